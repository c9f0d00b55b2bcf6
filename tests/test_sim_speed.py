"""The simulator's speed benchmarks at their smallest: `sim_speed` and its paired form against a commit."""

import json
import subprocess

import pytest

from benchmarks import sim_speed, sim_speed_paired


def test_sim_speed_reports_every_policy(tmp_path):
    payload = sim_speed.main(["--requests", "1", "--store", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = {r["policy"]: r for r in payload["rows"]}
    assert set(rows) == set(sim_speed.POLICIES)
    assert all(r["events_per_cpu_s"] > 0 and 0 < r["sim_hit_rate"] <= 1 for r in rows.values())
    assert (tmp_path / "sim_speed.md").exists()


def _in_git() -> bool:
    done = subprocess.run(["git", "-C", str(sim_speed_paired.ROOT), "rev-parse", "HEAD"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _in_git(), reason="a checkout without git history has no commit to compare with")
def test_paired_against_a_commit_replays_its_library_and_the_same_outcome(tmp_path):
    """Against HEAD (the library `git archive` takes from the commit, loaded first on the child's path: the
    child checks which `fmoe_jax` it imported) both sides replay the same outcome, each side once a pair."""
    argv = ["--against", "HEAD", "--pairs", "2", "--requests", "1", "--store", "2"]
    payload = sim_speed_paired.main([*argv, "--policies", "on_demand_lru", "--out", str(tmp_path)])
    (summary,) = payload["summary"]
    assert summary["policy"] == "on_demand_lru" and summary["same_outcome"]
    assert len(summary["speedups"]) == 2 and summary["median_speedup"] > 0
    sides = [(r["pair"], r["side"], r["first"]) for r in payload["rows"]]
    assert sides == [(0, "before", True), (0, "now", False), (1, "now", True), (1, "before", False)]
    saved = json.loads((tmp_path / "sim_speed_paired.json").read_text())
    assert saved["against"] == payload["against"]
    assert not any("different outcomes" in note for note in saved["notes"])  # said only where they differ


def test_paired_refuses_what_is_not_a_commit(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sim_speed_paired.main(["--against", "no-such-commit", "--out", str(tmp_path)])
    assert "--against no-such-commit: not a commit of this repository" in capsys.readouterr().err
