"""`python -m benchmarks.gpu_check --cpu-smoke`: every section of the GPU check runs at tiny sizes on CPU."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_gpu_check_cpu_smoke_writes_every_section(tmp_path):
    payload = gpu_check.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert payload["errors"] == {}, payload["errors"]
    saved = json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())
    assert saved["link"]["latency"]["fit"]["rate_gbs"] > 0
    rows = saved["offload_overhead"]["rows"]
    assert set(rows) == {"resident", "warm (cache = all)", "on_demand_lru 25%", "fmoe 25%"}
    assert rows["warm (cache = all)"]["launches_per_token"] == 1.0  # every expert resident: one launch
    replay = saved["live_replay"]["rows"]
    assert {(r["policy"], r["mode"]) for r in replay} == {
        (p, m) for p in ("on_demand_lru", "fmoe", "oracle") for m in ("copy", "hybrid")
    }
    assert all(r["live_tpot_ms"] > 0 and r["sim_tpot_ms"] > 0 for r in replay)
    assert "| live_replay |" in (tmp_path / "gpu_check_cpu_smoke.md").read_text()
