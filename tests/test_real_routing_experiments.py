"""Experiments on routing recorded elsewhere (`benchmarks/real_routing.py`): a tiny routing set in the shared
gpt-oss-20b layout (24 layers x 32 experts, top-4) with a few short requests in each part of the split."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks import exp2_overall, exp4_cache_budget, exp5_ablation, exp8_hybrid, foresight, real_routing
from benchmarks import harness as h

DATASETS = {"store": "mmlu_test", "validation": "mmlu_dev", "evaluation": "mmlu_validation"}


@pytest.fixture(scope="module")
def routing(tmp_path_factory) -> Path:
    """Three requests of 6 decode steps per part, each request's routing skewed to its own experts."""
    path = tmp_path_factory.mktemp("routing")
    rng = np.random.default_rng(0)
    arrays, records = {}, []
    for part, dataset in DATASETS.items():
        for i in range(3):
            name = f"{part[0]}{i}"
            logits = rng.normal(size=(6, 24, 32)) + 2.0 * rng.normal(size=(1, 24, 32))
            ids = np.argsort(-logits, -1)[..., :4]
            weights = np.take_along_axis(np.exp(logits), ids, -1)
            arrays[f"{name}__ids"] = ids.astype(np.int32)
            arrays[f"{name}__w"] = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
            records.append({"request": name, "dataset": dataset})
    np.savez(path / "decode_routing.npz", **arrays)
    header = {"model": "openai/gpt-oss-20b", "num_moe_layers": 24, "num_experts": 32, "top_k": 4}
    (path / "requests.json").write_text(json.dumps({**header, "requests": records}))
    return path


def common(routing: Path, tmp_path: Path, model: str = real_routing.NAME) -> list[str]:
    return [
        "--model",
        model,
        "--routing-data",
        str(routing),
        "--out",
        str(tmp_path),
        "--routing-requests",
        "2",
    ]


def workload(argv: list[str]) -> h.Workload:
    parser = argparse.ArgumentParser()
    h.add_arguments(parser)
    args = parser.parse_args(argv)
    return h.load_workload(args.model[0], args)


def test_routing_workload_parts_and_sizes(routing, tmp_path):
    w = workload([*common(routing, tmp_path, f"{real_routing.NAME}@int4"), "--split", "validation"])
    assert not w.recorded and w.simulated_only and w.total_experts == 24 * 32
    assert [r.trace.meta["requests"][0]["request"] for r in w.store] == ["s0", "s1", "s2"]
    assert [r.trace.meta["requests"][0]["request"] for r in w.eval] == ["v0", "v2"]  # 2 of 3, evenly spaced
    assert w.name.endswith("(validation)") and w.preset.expert_quantization == "int4"
    assert "2 of the 3 validation requests" in h.settings_note(w)
    labels = [v.label for v in h.runnable(w, h.variants(h.POLICIES))]
    assert (
        "promoe" not in labels and "duoserve" not in labels and "mixtral_offload (no speculation)" in labels
    )
    with pytest.raises(SystemExit, match="fp8"):
        h.load_workload(f"{real_routing.NAME}@fp8", w.args)


def test_gap_closed_is_the_share_of_best_baseline_to_oracle():
    gap = h.gap_closed({"resident": 1.0, "on_demand_lru": 10.0, "fiddler": 8.0, "fmoe": 6.0, "oracle": 4.0})
    assert gap["best_baseline"] == "fiddler" and gap["gap_closed"] == pytest.approx(0.5)
    assert h.gap_closed({"fmoe": 6.0, "oracle": 4.0}) == {}
    assert math.isnan(h.gap_closed({"a": 4.0, "fmoe": 6.0, "oracle": 4.0})["gap_closed"])


def test_exp2_and_exp4_replay_the_routing_against_every_runnable_baseline(routing, tmp_path):
    payload = exp2_overall.main([*common(routing, tmp_path), "--hardware", "rtx_3090"])
    sim = payload["models"][f"{real_routing.NAME}@bf16"]["sim"]["rtx_3090"]
    assert {"fmoe", "oracle", "on_demand_lru", "mixtral_offload (no speculation)"} <= set(sim)
    assert "promoe" not in sim and all(len(r["async"]["tpot_s"]) == 2 for r in sim.values())
    md = (tmp_path / "exp2_overall.md").read_text()
    assert "gap to the oracle fmoe closes" in md and "gpt-oss-20b's real decode routing" in md

    budgets = ["--budgets", "0.125", "0.25"]
    payload = exp4_cache_budget.main([*common(routing, tmp_path), "--hardware", "h100_sxm", *budgets])
    rows = payload["models"][f"{real_routing.NAME}@bf16"]["sim"]["h100_sxm"]
    assert {r["budget"] for r in rows} == {0.125, 0.25} and {r["slots"] for r in rows} == {96, 192}
    md = (tmp_path / "exp4_cache_budget.md").read_text()
    assert "share of the best baseline's gap to the oracle fmoe closes" in md


def test_exp5_and_exp8_run_on_routing_alone(routing, tmp_path):
    """exp5's rows that need no router inputs or embeddings (its tracking rows replayed here; the others
    are fmoe options the exp2 test covers), and exp8 whole."""
    w = workload([*common(routing, tmp_path), "--hardware", "rtx_3090"])
    tracking, caching, parts = exp5_ablation.groups(w)
    assert [v.label for v in tracking] == ["hit count", "map(T)", "map(T+delta)", "+ cost admission"]
    assert caching == exp5_ablation.CACHING and "no reuse predictor" not in [v.label for v in parts]
    assert "no token contexts" in [v.label for v in parts]  # the routing's fmoe reads the fed tokens
    rows = exp5_ablation.rows_for(w, tracking, w.args)
    assert all(0 < r["rtx_3090_hit_rate"] < 1 and r["rtx_3090_tpot_s"] > 0 for r in rows)
    payload = exp8_hybrid.main(
        [*common(routing, tmp_path), "--budgets", "0.25", "--systems", "rtx_3090+desktop_ddr4"]
    )
    rows = payload["models"][f"{real_routing.NAME}@bf16 at gpt-oss-20b (bf16 experts)"][
        "rtx_3090+desktop_ddr4"
    ]
    assert {r["policy"] for r in rows} >= {"fmoe+hybrid", "fiddler", "static_split"}


def test_foresight_on_the_routing_merges_beside_the_saved_models(routing, tmp_path):
    """`foresight --merge` on the routing keeps the saved rows of other models (and their split), replaces
    its own, compares against the baselines the routing can drive, and the README reports it apart."""
    from benchmarks.make_readme import _foresight_sentence

    shipped = dict(model="fmoe-tiny-mixtral", hardware="h100_sxm", budget=0.25, fmoe_closure=0.5)
    shipped |= dict(fmoe_matches=1, closure_0_tokens=0.1, closure_1_tokens=0.6, closure_2_tokens=0.9)
    saved = {"command": "the whole run", "args": {"split": "eval"}, "rows": [shipped]}
    saved |= {"notes": ["fmoe-tiny-mixtral: its settings", "closure: the old run's"], "tables": {}}
    (tmp_path / "foresight.json").write_text(json.dumps(saved))
    argv = [*common(routing, tmp_path), "--hardware", "rtx_3090", "--budgets", "0.25", "0.5"]
    for _ in range(2):  # the second run replaces the first's rows
        payload = foresight.main([*argv, "--horizons", "1", "--merge"])
    rows = payload["rows"]
    assert [(r["model"], r["budget"]) for r in rows] == [
        ("fmoe-tiny-mixtral", 0.25),
        (f"{real_routing.NAME}@bf16", 0.25),
        (f"{real_routing.NAME}@bf16", 0.5),
    ]
    assert all(r["split"] == "eval" for r in rows) and payload["command"] == "the whole run"
    assert "Command: `the whole run`" in (tmp_path / "foresight.md").read_text()  # as the JSON's
    for r in rows[1:]:
        assert set(r["tpot_s"]) == {
            "on_demand_lru",
            "on_demand_lfu",
            "mixtral_offload (no speculation)",
            "moe_infinity",
            "fmoe",
            "oracle, 1 token(s)",
            "oracle",
        }
        assert r["best_tpot_s"] == min(v for k, v in r["tpot_s"].items() if k != "fmoe" and "oracle" not in k)
    notes = json.loads((tmp_path / "foresight.json").read_text())["notes"]
    assert notes[0] == "fmoe-tiny-mixtral: its settings" and sum(n.startswith("closure:") for n in notes) == 1
    assert sum(n.startswith(f"{real_routing.NAME}@bf16:") for n in notes) == 1
    text = _foresight_sentence(json.loads((tmp_path / "foresight.json").read_text()))
    assert text.startswith("At 25% cached (simulated, eval split, `foresight`), fMoE closes 50 % of the gap")
    short = sum(r["closure_1_tokens"] < 0.5 for r in rows[1:])
    assert f"On gpt-oss-20b's real routing ({real_routing.NAME}@bf16, eval split, `foresight`" in text
    assert f"closes less than half of it at {short} of 2 (preset, budget) points." in text


def test_gpt_oss_routing_takes_the_shared_split(routing, tmp_path):
    from benchmarks import gpt_oss_routing

    argv = ["--data", str(routing), "--eval", "2", "--store", "2", "--warmup", "1", "--max-steps", "4"]
    payload = gpt_oss_routing.main([*argv, "--budgets", "0.25", "--out", str(tmp_path)])
    assert payload["eval_requests"] == ["e0", "e2"] and payload["store_requests"] == ["s0", "s2"]
    assert len(payload["rows"]) == len(gpt_oss_routing.VARIANTS)


def test_readme_reports_the_routing_gap_and_leaves_validation_out_of_the_counts():
    from benchmarks.make_readme import _routing_sentence, reported

    def rows(fmoe):
        tpot = {"on_demand_lru": 10.0, "fiddler": 8.0, "fmoe": fmoe, "oracle": 4.0}
        return [{"budget": 0.25, "policy": p, "median_tpot_s": t} for p, t in tpot.items()]

    name = f"{real_routing.NAME}@bf16"
    models = {name: {"sim": {"rtx_3090": rows(6.0)}}}
    models[f"{name} (validation)"] = {"sim": {"h100_sxm": rows(7.0), "rtx_3090": rows(9.0)}}
    text = _routing_sentence({"models": models})
    assert f"below every baseline's at 1 of 1 on {name}, 1 of 2 on {name} (validation)" in text
    assert f"{name}: 50 % on the rtx_3090 preset (best baseline fiddler)" in text
    assert f"{name} (validation): 25 % on the h100_sxm preset" in text
    assert list(reported({"models": models})) == [name]
