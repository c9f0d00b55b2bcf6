"""The experiment harness (benchmarks/harness.py) end to end on a tiny random model, live and simulated, and
the simulator's warm-up, so the experiment scripts cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import HARDWARE, MIXTRAL_8X7B
from fmoe_jax.offload.simulator import Replay, simulate

from benchmarks.validation_grid import compare
from fmoe_jax.trace import RoutingTrace

ROOT = Path(__file__).resolve().parents[1]


def random_trace(seed: int, requests: int = 2, iterations: int = 4) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    return RoutingTrace.from_external(
        [
            [{"ids": np.stack([rng.permutation(6)[:2] for _ in range(3)])[None]} for _ in range(iterations)]
            for _ in range(requests)
        ],
        num_experts=6,
    )


@pytest.mark.parametrize("policy", ["on_demand_lfu", "on_demand_lru"])
def test_simulate_warmup_carries_state_and_is_left_out(policy):
    first, second = random_trace(0), random_trace(1)
    offload = OffloadConfig(policy=policy, cache_experts=12)
    kw = dict(model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"])
    both = simulate([first, second], offload, **kw)
    alone = simulate([first], offload, **kw)
    warmed = simulate([second], offload, warmup=[first], **kw)
    assert warmed.hits == both.hits - alone.hits
    assert warmed.misses == both.misses - alone.misses
    assert warmed.bytes_to_device == both.bytes_to_device - alone.bytes_to_device
    np.testing.assert_allclose(warmed.ttft_s, both.ttft_s[2:], rtol=1e-12, atol=0)
    np.testing.assert_allclose(warmed.total_s, both.total_s - alone.total_s, rtol=1e-9, atol=1e-12)
    assert warmed.hits + warmed.misses == sum(warmed.layer_needed)
    cold = simulate([second], offload, **kw)
    assert warmed.hits > cold.hits  # the warm-up's cache state carried over

    replay = Replay(offload, meta=first.meta, **kw)
    replay.run(first)
    replay.reset_statistics()
    replay.run(second)
    stepped = replay.close()
    assert (stepped.hits, stepped.misses, stepped.ttft_s) == (warmed.hits, warmed.misses, warmed.ttft_s)


def tiny_sharegpt(tmp_path: Path) -> Path:
    """Six short prompts as a ShareGPT file."""
    prompts = tmp_path / "sharegpt_tiny.json"
    texts = ["hello there", "what is a mixture of experts", "tell me a story", "two plus two", "why", "ok"]
    prompts.write_text(
        json.dumps(
            [{"id": str(i), "conversations": [{"from": "human", "value": t}]} for i, t in enumerate(texts)]
        )
    )
    return prompts


def test_exp2_runs_live_and_simulated(hf_dirs, tmp_path):
    prompts = tiny_sharegpt(tmp_path)
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.exp2_overall"]
    command += [
        *("--model", str(hf_dirs["mixtral"]), "--prompts", str(prompts), "--n-prompts", "6"),
        *("--prompt-tokens", "8", "--new-tokens", "3", "--warmup", "1", "--live-requests", "2"),
        *("--hardware", "h100_sxm", "--policies", "on_demand_lru", "fmoe", "--max-inflight", "2"),
        *("--out", str(out), "--cache-dir", str(tmp_path / "cache")),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=300)
    payload = json.loads((out / "exp2_overall.json").read_text())
    for suffix in ("json", "md", "png"):
        assert (out / f"exp2_overall.{suffix}").stat().st_size > 0
    assert payload["args"]["max_inflight"] == "2"
    (result,) = payload["models"].values()
    for policy in ("on_demand_lru", "fmoe"):
        live = result["live"][policy]
        assert live["requests"] == 2 and len(live["tpot_s"]) == 2
        assert live["hits"] + live["misses"] > 0
        assert live["compilations"] == 0, "a recompilation while measuring is a bug"
        sim = result["sim"]["h100_sxm"][policy]
        assert len(sim["async"]["ttft_s"]) == 2
        assert sim["async"]["median_tpot_s"] > 0
    # Without prediction, hits do not depend on timing: live and replayed counts agree exactly.
    live, sync = result["live"]["on_demand_lru"], result["sim"]["h100_sxm"]["on_demand_lru"]["sync"]
    assert (live["hits"], live["misses"]) == (sync["hits"], sync["misses"])
    assert "fmoe against each" in (out / "exp2_overall.md").read_text()

    # A model's traces replayed at another preset's sizes (simulated only), merged into the saved results.
    replay = [arg if arg != str(hf_dirs["mixtral"]) else f"{arg}@qwen3_next" for arg in command]
    replay += ["--merge", "--policies", "on_demand_lru"]
    subprocess.run(replay, cwd=ROOT, check=True, timeout=300)
    merged = json.loads((out / "exp2_overall.json").read_text())
    assert merged["command"] == payload["command"] and len(merged["merged"]) == 1
    assert merged["models"]["mixtral"] == payload["models"]["mixtral"]
    added = merged["models"]["mixtral@qwen3_next"]
    assert added["live"] == {} and list(added["sim"]["h100_sxm"]) == ["on_demand_lru"]
    # Two traced layers replayed at a 48-layer preset: the caption says so, not "at Qwen3-Next sizes".
    caption = "mixtral@qwen3_next, simulated at Qwen3-Next-80B-A3B's per-layer sizes (2 of its 48 MoE layers)"
    assert f"{caption} on h100_sxm" in merged["tables"]
    assert any("traces of 2 MoE layers" in n and "which has 48" in n for n in merged["notes"])
    assert sum(n.startswith("mixtral:") for n in merged["notes"]) == 1


def test_figures_redraw_from_saved_results(tmp_path):
    """`make_readme --replot` draws every experiment's figure from its JSON alone, and scrubs what must not be
    committed: a machine's absolute paths and the dropped `fmoe_wins` column."""
    import shutil

    from benchmarks import make_readme

    results = ROOT / "benchmarks" / "results"
    for name, _, _ in make_readme.EXPERIMENTS:
        shutil.copy(results / f"{name}.json", tmp_path)
        shutil.copy(results / f"{name}.md", tmp_path)
    payload = json.loads((tmp_path / "exp2_overall.json").read_text())
    payload["args"]["out"] = "/home/someone/clone/benchmarks/results"
    next(iter(payload["tables"].values()))[0]["fmoe_wins"] = True
    (tmp_path / "exp2_overall.json").write_text(json.dumps(payload, indent=1))
    md = tmp_path / "exp2_overall.md"
    md.write_text(md.read_text() + "\n| policy | fmoe_wins |\n|---|---|\n| fmoe | True |\n")
    make_readme.replot(tmp_path)
    for name, _, _ in make_readme.EXPERIMENTS:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
    text = (tmp_path / "exp2_overall.json").read_text() + md.read_text()
    assert "/home/someone" not in text and "fmoe_wins" not in text
    assert '"out": "benchmarks/results"' in text and "| fmoe |\n" in text


def test_conclusion_is_computed_from_the_results(tmp_path):
    """The README's opening paragraph follows the numbers: make fMoE slower than LRU in the saved results and
    the sentence changes with them."""
    from benchmarks.make_readme import conclusion

    def row(hit, tpot):
        return {"hit_rate": hit, "median_tpot_s": tpot}

    def sim(fmoe_tpot):
        rows = {"on_demand_lru": row(0.5, 0.10), "promoe": row(0.7, 0.20), "fmoe": row(0.6, fmoe_tpot)}
        return {p: {"async": r} for p, r in rows.items()}

    def write(fmoe_tpot):
        payload = {
            "machine": {"backend": "cpu"},
            "args": {"budget": "0.25"},
            "tables": {"m, simulated at Mixtral-8x7B sizes on rtx_3090": []},
            "models": {"m": {"live": {}, "sim": {"rtx_3090": sim(fmoe_tpot)}}},
        }
        (tmp_path / "exp2_overall.json").write_text(json.dumps(payload))
        return conclusion(tmp_path)

    faster = write(0.08)
    assert "lowest median TPOT of every policy but the oracle in 1 of 1 settings" in faster
    assert "20 % below on-demand LRU (ratio 0.80x)" in faster
    assert "60 % below the fastest other predictive policy, promoe (ratio 0.40x)" in faster
    assert "not the highest (promoe 0.70)" in faster and "Mixtral-8x7B" in faster and "RTX 3090" in faster
    slower = write(0.11)
    assert "in 0 of 1 settings" in slower and "10 % above on-demand LRU (ratio 1.10x)" in slower
    assert "matcher as free" not in slower  # no experiment 7 yet

    def overhead(charged_ms, share=None):  # experiment 7's simulated rows (fmoe's matcher free and charged,
        tpot = {  # and LRU) and its real-size row at Qwen1.5-MoE / H100
            "fmoe, matcher free": 8.0,
            "fmoe, matcher at this CPU's speed": charged_ms,
            "on_demand_lru": 10.0,
        }
        rows = [{"policy": p, "hardware": "h100_sxm", "median_tpot_ms": t} for p, t in tpot.items()]
        payload = {"machine": {"backend": "cpu", "cpus": 2}, "args": {"budget": "0.25"}, "models": {}}
        payload["models"]["m"] = {"live": [], "sim": rows}
        if share is not None:
            real = dict(model="Qwen1.5-MoE-A2.7B", hardware="h100_sxm", fmoe_host_ms=share * 6.8)
            payload["real_size"] = [
                dict(real, hardware="rtx_3090", matcher_share=9.9),
                real | {"matcher_share": share},
            ]
        (tmp_path / "exp7_overhead.json").write_text(json.dumps(payload))
        return conclusion(tmp_path)

    cheap = overhead(9.0)
    assert "charged the host time it takes on a 2-core CPU at real sizes (experiment 7, 25% cached)" in cheap
    assert "rises by 12 % and stays 10 % below on-demand LRU (ratio 0.90x)" in cheap
    assert "rises by 50 % and stays 20 % above on-demand LRU (ratio 1.20x)" in overhead(12.0)
    assert "rises by 0 % and stays" in overhead(7.98)  # -0.25 % rounds to 0, not "-0"
    assert "moves by -2 % and stays" in overhead(7.84)  # charged, it can end a little faster
    assert "Qwen1.5-MoE" not in cheap  # no real-size rows
    assert (
        "3.8 ms a decode iteration at Qwen1.5-MoE's shapes, 0.56 of an H100's compute for the iteration "
        "(above issue 16's target of 0.30)" in overhead(9.0, share=0.56)
    )
    assert "0.25 of an H100's compute for the iteration (within issue 16's target" in overhead(
        9.0, share=0.25
    )
    assert "matcher thread" not in overhead(9.0, share=0.56)  # a run from before the split
    (tmp_path / "exp7_overhead.json").write_text(
        (tmp_path / "exp7_overhead.json")
        .read_text()
        .replace(
            '"matcher_share": 0.56',
            '"matcher_share": 0.56, "matcher_thread_ms": 2.4, "matcher_thread_share": 0.35',
        )
    )
    assert (
        "target of 0.30); the matcher thread's part of it (searches, selection, the map update and the "
        "hint) is 2.4 ms, 0.35." in conclusion(tmp_path)
    )
    assert "gpt-oss-20b's shapes" not in conclusion(tmp_path)  # no gpt-oss-20b rows
    payload = json.loads((tmp_path / "exp7_overhead.json").read_text())
    gpt_oss = dict(model="gpt-oss-20b", hardware="h100_sxm", fmoe_host_ms=2.3, matcher_share=0.41)
    bf16 = gpt_oss | {"model": "gpt-oss-20b (bf16 experts)", "matcher_share": 0.29}
    payload["real_size"] += [gpt_oss, bf16]
    (tmp_path / "exp7_overhead.json").write_text(json.dumps(payload))
    assert (
        "At gpt-oss-20b's shapes it is 2.3 ms an iteration: of an H100's compute for the iteration, 0.41 "
        "with MXFP4 experts (above 0.30) and 0.29 with bf16 experts (within 0.30)." in conclusion(tmp_path)
    )
    payload["real_size"][-1]["matcher_share"] = 0.3042  # two decimals would show it on the target
    (tmp_path / "exp7_overhead.json").write_text(json.dumps(payload))
    assert "and 0.304 with bf16 experts (above 0.30)." in conclusion(tmp_path)

    def foresight(fmoe_closure, matches):  # benchmarks/foresight.py's rows; only 25 % is reported
        row = dict(budget=0.25, fmoe_closure=fmoe_closure, fmoe_matches=matches)
        row |= {"closure_0_tokens": -0.2, "closure_1_tokens": 0.5, "closure_2_tokens": 0.75}
        other = row | {"budget": 0.5, "fmoe_closure": 0.9}
        payload = {"args": {"split": "eval"}, "rows": [row, row | {"fmoe_closure": 0.4}, other]}
        (tmp_path / "foresight.json").write_text(json.dumps(payload))
        return conclusion(tmp_path)

    text = foresight(0.45, 0)
    assert "At 25% cached (simulated, eval split, `foresight`), fMoE closes 40–45 % of the gap" in text
    assert "closes -20 % when it sees only the current token, 50 % when it sees 1 more token, 75 %" in text
    assert "at least as fast as the oracle seeing the current token alone at 2 of 2 points, and as" in text
    assert "the current token alone at 0 of 2 points, and as the one seeing one more token at 0." in (
        foresight(0.1, -1)
    )


def test_main_readme_hybrid_table_is_written_from_the_results(tmp_path):
    """The main README's hybrid-execution block is rewritten from exp8's JSON (and only that block): the
    numbers and whether each target is met follow the saved results."""
    from benchmarks import make_readme

    def row(policy, budget, tpot):
        shares = dict(host_share=0.5, host_busy_share=0.75, link_busy_share=0.25)
        return dict(policy=policy, budget=budget, tpot_ms=tpot, ttft_ms=900.0, **shares)

    rows = [
        row(p, b, t * b) for p, t in (("on_demand_lru", 400.0), ("fmoe+hybrid", 100.0)) for b in (0.25, 0.5)
    ]
    goal = dict(
        system="rtx_3090+desktop_ddr5", ratio="fmoe+hybrid / fiddler TPOT", value=0.9, target="<= 0.85"
    )
    payload = {
        "command": "python -m benchmarks.exp8_hybrid --quick",
        "models": {"m at Mixtral-8x7B": {"rtx_3090+desktop_ddr5": rows}, "m at Phi": {"rtx_3090+x": rows}},
        "tables": {
            "Targets (issue 17)": [dict(goal, met=False)],
            "m, simulated at Mixtral-8x7B's per-layer sizes (8 of its 32 MoE layers) on rtx_3090+x": rows,
        },
    }
    (tmp_path / "exp8_hybrid.json").write_text(json.dumps(payload))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{make_readme.HYBRID_BEGIN}\nstale\n{make_readme.HYBRID_END}\nrest\n")
    make_readme.write_hybrid_summary(readme, tmp_path)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{make_readme.HYBRID_END}\nrest\n")
    assert "stale" not in text and text.count("| variant |") == 1  # Mixtral sizes only
    assert "m's routing at Mixtral-8x7B's per-layer sizes (8 of its 32 MoE layers)" in text
    assert "| variant | TPOT ms, 25 % | TPOT ms, 50 % | TTFT ms, 25 % |" in text
    assert "| fmoe+hybrid | 25.0 | 50.0 | 900 | 0.50 | 0.75 | 0.25 |" in text
    assert "fmoe+hybrid / fiddler TPOT = 0.900 (target <= 0.85): **not met**" in text


def test_exp3_serves_live_over_http_at_arrival_times_and_simulates(hf_dirs, tmp_path):
    """Experiment 3 end to end on a tiny model: live, requests stream from fmoe-serve (continuous batching)
    at scaled arrival times, nothing compiles while they run; simulated, static batches on the replay."""
    prompts = tiny_sharegpt(tmp_path)
    arrivals = tmp_path / "arrivals.csv"
    arrivals.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(
            f"2023-11-16 18:15:{10 + s:02d}.5000000,300,{n}\n" for s, n in [(0, 3), (1, 2), (1, 3), (4, 1)]
        )
    )
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.exp3_online"]
    command += [
        *("--model", str(hf_dirs["mixtral"]), "--prompts", str(prompts), "--n-prompts", "6"),
        *("--prompt-tokens", "8", "--new-tokens", "3", "--arrivals", str(arrivals), "--requests", "4"),
        *("--max-batch", "2", "--calibration", "1", "--hardware", "h100_sxm"),
        *("--policies", "on_demand_lru", "fmoe", "--out", str(out), "--cache-dir", str(tmp_path / "cache")),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=600)
    payload = json.loads((out / "exp3_online.json").read_text())
    (result,) = payload["models"].values()
    live = result["live"]["live"]
    for row in live["rows"]:
        assert row["requests"] == 4 and row["compilations"] == 0 and row["p99_s"] >= row["p50_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["p50_s"]
    assert set(live["ttft"]) == {"on_demand_lru", "fmoe"}
    sim = result["sim"]["h100_sxm"]
    assert all(r["requests"] == 4 and r["batches"] >= 1 for r in sim["rows"])
    assert (out / "exp3_online.png").stat().st_size > 10_000


def test_merging_a_rerun_replaces_its_models_notes_and_keeps_the_experiments_notes_once():
    """A model entry naming the preset it was simulated at ("r@int4 at P") owns the notes and captions that
    name the model alone ("r@int4: ..."); the experiment's own notes, written by every run, stay single."""
    from benchmarks import harness as h

    general = "TPOT: medians over the requests."
    old = {
        "command": "exp --all",
        "models": {"tiny": {"x": 1}, "r@int4 at P": {"x": 2}},
        "tables": {"tiny, simulated at P on h": [{"x": 1}], "r@int4, simulated at P on h": [{"x": 2}]},
        "notes": ["tiny: its settings", general, "r@int4: the old settings", general],
    }
    payload = {"models": {"r@int4 at P": {"x": 3}}}
    tables = {"r@int4, simulated at P on h": [{"x": 3}]}
    merged, tables, notes, command = h.merged_results(
        old, payload, tables, ["r@int4: the new settings", general], "exp --model r@int4 --merge"
    )
    assert command == "exp --all" and merged["merged"][-1]["command"] == "exp --model r@int4 --merge"
    assert merged["models"] == {"tiny": {"x": 1}, "r@int4 at P": {"x": 3}}
    assert tables == {"tiny, simulated at P on h": [{"x": 1}], "r@int4, simulated at P on h": [{"x": 3}]}
    assert notes == ["tiny: its settings", "r@int4: the new settings", general]


def test_fmoe_store_and_moe_infinity_eams_are_sized_apart():
    """`--store-capacity` sizes fmoe's store (a run's `store_capacity` overrides it) and `--eam-capacity`
    MoE-Infinity's EAM collection: changing fmoe's store leaves the baseline as it was."""
    import argparse
    import types

    from benchmarks import harness as h

    parser = argparse.ArgumentParser()
    h.add_arguments(parser)
    args = parser.parse_args(["--store-capacity", "7", "--eam-capacity", "9", "--max-inflight", "1"])
    workload = types.SimpleNamespace(args=args, store=[], slots=lambda budget: 4, recorded=True)

    def policy(variant, **kwargs):
        return h.offload_config(workload, variant, calls=[], simulated=True, **kwargs).policy

    fmoe = h.Variant("fmoe", "fmoe", (("eviction", "lru"),))  # no reuse predictor to train
    assert policy(fmoe).options.store_capacity == 7
    assert policy(fmoe, store_capacity=5).options.store_capacity == 5
    assert policy(h.Variant("moe_infinity", "moe_infinity")).capacity == 9
    assert policy(h.Variant("moe_infinity", "moe_infinity"), store_capacity=5).capacity == 9


def test_validation_split_holds_out_the_store_prompts_only():
    from fmoe_jax.research.workloads import Prompt

    from benchmarks.harness import split_prompts

    prompts = [Prompt(text=f"prompt {i}", source="t", category=f"c{i % 3}", uid=f"p{i}") for i in range(60)]
    store, evaluation = split_prompts(prompts, "eval", seed=0)
    v_store, v_replayed = split_prompts(prompts, "validation", seed=0)
    uids = lambda ps: {p.uid for p in ps}  # noqa: E731
    assert uids(v_store) | uids(v_replayed) == uids(store)  # only store prompts
    assert not uids(v_store) & uids(v_replayed)
    assert not uids(v_replayed) & uids(evaluation)
    assert len(v_replayed) == round(0.3 * len(store))
    with pytest.raises(ValueError, match="split must be"):
        split_prompts(prompts, "test", seed=0)


def test_exp5_ablates_the_default_fmoe_and_belady_foresight(hf_dirs, tmp_path):
    prompts = tiny_sharegpt(tmp_path)
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.exp5_ablation", "--no-live"]
    command += [
        *("--model", str(hf_dirs["mixtral"]), "--prompts", str(prompts), "--n-prompts", "6"),
        *("--prompt-tokens", "8", "--new-tokens", "4", "--warmup", "1", "--hardware", "h100_sxm"),
        *("--out", str(out), "--cache-dir", str(tmp_path / "cache")),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=600)
    payload = json.loads((out / "exp5_ablation.json").read_text())
    (result,) = payload["models"].values()
    parts = {row["variant"]: row for row in result["parts"]}
    assert set(parts) >= {"fmoe (default: reuse eviction)", "whole copies", "calibration off", "oracle"}
    assert set(parts) >= {"no prefetch", "cancel between chunks", "no next-token guess"}
    assert set(parts) >= {"admission: lands in time, pays for its stalls", "admission after the link's queue"}
    assert "no token contexts" not in parts  # the default's reuse predictor leaves them off
    assert "reuse" in {row["variant"] for row in result["caching"]}
    # Belady's miss count is the optimum of on-demand loading: no foresight limit does better.
    best = parts["Belady, whole future"]["sim_hit_rate_sync"]
    assert all(parts[f"Belady, {n} token(s)"]["sim_hit_rate_sync"] <= best for n in (1, 2, 4))
    # On the H100 preset the default copies whole (`HardwarePreset.copy_chunks`); per matrix, each of the
    # three chunks pays the copy's fixed cost.
    default, whole = parts["fmoe (default: reuse eviction)"], parts["whole copies"]
    assert whole["h100_sxm_tpot_s"] == default["h100_sxm_tpot_s"]
    assert parts["one chunk per matrix"]["h100_sxm_tpot_s"] > whole["h100_sxm_tpot_s"]
    assert "(c) the default fmoe's parts" in (out / "exp5_ablation.md").read_text()
    assert (out / "exp5_ablation.png").stat().st_size > 10_000


def test_foresight_compares_fmoe_with_oracles_of_limited_foresight(hf_dirs, tmp_path):
    prompts = tiny_sharegpt(tmp_path)
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.foresight", "--budgets", "0.25", "0.5"]
    command += [
        *("--model", str(hf_dirs["mixtral"]), "--prompts", str(prompts), "--n-prompts", "6"),
        *("--prompt-tokens", "8", "--new-tokens", "4", "--warmup", "1", "--hardware", "h100_sxm"),
        *("--horizons", "0", "8", "--out", str(out), "--cache-dir", str(tmp_path / "cache")),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=600)
    rows = json.loads((out / "foresight.json").read_text())["rows"]
    # Mixtral-family routing replays at its own sizes and at Phi-3.5-MoE's.
    name = hf_dirs["mixtral"].name
    expected = [(name, 0.25), (name, 0.5), (f"{name} @ Phi-3.5-MoE", 0.25), (f"{name} @ Phi-3.5-MoE", 0.5)]
    assert [(r["model"], r["budget"]) for r in rows] == expected
    for r in rows:
        tpot = r["tpot_s"]
        baselines = {p: t for p, t in tpot.items() if p != "fmoe" and not p.startswith("oracle")}
        assert len(baselines) == 6 and r["best_tpot_s"] == min(baselines.values())
        assert tpot[r["best_baseline"]] == r["best_tpot_s"]
        # Eight tokens of foresight see every remaining token of a 4-token request: the whole oracle.
        assert tpot["oracle, 8 token(s)"] == tpot["oracle"]
        if r["best_tpot_s"] != r["oracle_tpot_s"]:
            assert r["closure_8_tokens"] == 1.0
    assert "fmoe_matches" in (out / "foresight.md").read_text()
    assert (out / "foresight.png").stat().st_size > 10_000


def test_foresight_summary_of_one_point():
    from benchmarks import foresight

    tpot = dict.fromkeys(foresight.BASELINES, 10.0) | {"promoe": 8.0, "oracle": 4.0, "fmoe": 6.0}
    tpot |= {"oracle, 0 token(s)": 7.0, "oracle, 1 token(s)": 6.0, "oracle, 2 token(s)": 5.0}
    row = foresight.summarise(tpot, [0, 1, 2])
    assert (row["best_baseline"], row["best_tpot_s"], row["oracle_tpot_s"]) == ("promoe", 8.0, 4.0)
    assert row["fmoe_closure"] == 0.5 and row["closure_0_tokens"] == 0.25 and row["closure_2_tokens"] == 0.75
    assert row["fmoe_matches"] == 1  # as fast as the oracle seeing one token ahead, slower than two
    assert foresight.summarise(tpot | {"fmoe": 7.5}, [0, 1, 2])["fmoe_matches"] == -1


def test_conclusion_counts_where_fmoe_hybrid_wins_and_loses():
    from benchmarks.make_readme import _hybrid_sentence

    def rows(budget, **tpot):
        return [
            {"policy": p.replace("_h", "+hybrid"), "budget": budget, "tpot_ms": t} for p, t in tpot.items()
        ]

    payload = {
        "models": {
            "m": {
                "sys": rows(0.25, fmoe_h=30.0, fiddler=40.0, on_demand_lru_h=35.0, oracle_h=20.0)
                + rows(0.5, fmoe_h=20.0, fiddler=25.0, on_demand_lru_h=18.0, oracle_h=22.0)
            }
        }
    }
    text = _hybrid_sentence(payload)
    assert "at 1 of 2 (model, system, budget) points" in text
    assert "at budget 0.5 to on_demand_lru+hybrid, by up to 11 %" in text
    assert "0.75–0.80x Fiddler's" in text
    assert "real routing" not in text
    # gpt-oss-20b's real routing is counted apart from the shipped models' traces
    payload["models"]["gpt-oss-20b-routing@bf16 at gpt-oss-20b"] = {
        "sys": rows(0.25, fmoe_h=10.0, fiddler=20.0, on_demand_lru_h=15.0)
    }
    shipped, routing = _hybrid_sentence(payload).split(" On gpt-oss-20b's real routing")
    assert "at 1 of 2 (model, system, budget) points" in shipped
    assert "at 1 of 1 (model, system, budget) points" in routing and "0.50x Fiddler's" in routing


def test_exp7_times_the_whole_fmoe_policy_per_iteration():
    """Experiment 7's host cost at real sizes is the policy's whole decode iteration (`policy_iteration`):
    every layer before L - d is either searched after, confirmed (`skip_confirmed`) or rested (after repeated
    matches), as the engine would run it, not the store's searches alone."""
    from benchmarks import matcher_overhead as mo

    dims = dict(num_layers=6, num_experts=16, embed_dim=8)
    contexts = mo.Contexts(seed=0, **dims)
    rng = np.random.default_rng(0)
    store = mo._filled_store(contexts, 64, dims, None)
    queries = [contexts.draw(rng, 1) for _ in range(5)]
    row = mo.policy_iteration(store, queries, top_k=4, prefetch_distance=2)
    assert row["policy_iteration"]["p50_ms"] > 0
    assert row["searches_per_iteration"] >= 1  # the first layer's search always runs
    # The matcher thread's part: every timed iteration searched, so it took some, and less than the whole.
    assert len(row["matcher_thread_times_ms"]) == len(row["policy_iteration_times_ms"])
    assert np.all(row["matcher_thread_times_ms"] > 0)
    assert np.all(row["matcher_thread_times_ms"] < row["policy_iteration_times_ms"])
    done = row["searches_per_iteration"] + row["skipped_per_iteration"] + row["rested_per_iteration"]
    assert done == pytest.approx(6 - 2)
    # Its floor: the same iteration with the searches off (exp7's no_search_ms) searches nothing.
    bare = mo.policy_iteration(store, queries, top_k=4, prefetch_distance=2, semantic=False, trajectory=False)
    assert bare["policy_iteration"]["p50_ms"] > 0
    assert bare["searches_per_iteration"] == 0 and bare["skipped_per_iteration"] == 0
    # `measure` (exp7's source) times both in rounds taking turns, pooling each one's iterations.
    flush = np.ones(16, np.float32)
    m = mo.measure("tiny", dims, 64, repeats=5, flush=flush, prefetch_distance=2, top_k=4)
    rounds = m["policy_iteration_rounds_ms"]
    assert len(rounds) == mo.POLICY_ROUNDS and min(rounds) <= m["policy_iteration"]["p50_ms"] <= max(rounds)
    assert m["policy_iteration_no_search"]["p50_ms"] > 0 and "policy_iteration_times_ms" not in m
    # Each round starts from the store as it was, with tokens it has not learned: replaying the tokens of
    # the round before on the store that added their maps, the searches would find themselves.
    version, maps = store.version, store.maps.copy()
    row = mo.policy_rounds(store, contexts, repeats=20, top_k=4, prefetch_distance=2, rounds=3)
    assert store.version == version and np.array_equal(store.maps, maps)
    assert len(row["searches_by_round"]) == 3 and min(row["searches_by_round"]) >= 1
    assert 0 < row["matcher_thread"]["p50_ms"] < row["policy_iteration"]["p50_ms"]


def test_link_compute_runs_on_the_cpu_and_the_readme_reports_an_accelerators_run(tmp_path):
    """`benchmarks.link_compute` runs end to end on any backend (the CPU's "link" is a memcpy and its numbers
    say nothing of PCIe, so the README's sentence is written from an accelerator's run only)."""
    import subprocess
    import sys

    from benchmarks.make_readme import _device_sentence

    cmd = [sys.executable, "-m", "benchmarks.link_compute", "--small", "--models", "qwen3_moe"]
    subprocess.run([*cmd, "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=900)
    payload = json.loads((tmp_path / "link_compute.json").read_text())
    assert not payload["errors"], payload["errors"]
    assert [r["expert"] for r in payload["copies"]] == ["bench-s", "Qwen3-30B-A3B"]
    assert {r["issue"] for r in payload["overlap"]} >= {"pinned, after compute", "pinned, other thread"}
    assert payload["layers"][0]["experts_kernel_ms"] > 0 and (tmp_path / "link_compute.png").exists()
    assert _device_sentence(payload, []) == ""  # measured on the CPU
    gpu = dict(payload, machine=dict(payload["machine"], backend="gpu"), device_kind="NVIDIA H200")
    gpu["latency"] = dict(gpu["latency"], fit=dict(latency_ms=0.3, rate_gbs=50.0))
    gpu["overlap"] = [
        dict(issue="pinned, after compute", overlap=0.1),
        dict(issue="pinned, before compute", overlap=0.95),
        dict(issue="pinned, other thread", overlap=0.9),
    ]
    row = dict(tpot_ms=30.0, hit_rate=0.75, critical_path_policy_ms=9.0)
    live = dict(rows={"on_demand_lru, 25%": dict(row, tpot_ms=24.0, hit_rate=0.6), "fmoe, 25%": row})
    text = _device_sentence(gpu, [live])
    assert "0.30 ms plus its bytes at 50.0 GB/s" in text and "hid only 10 %" in text and "90–95 %" in text
    assert "1 run(s)), fMoE decodes at 1.25x on-demand LRU's TPOT" in text and "costs more" in text
    faster = dict(rows={"on_demand_lru, 25%": dict(row, tpot_ms=33.0), "fmoe, 25%": row})
    text = _device_sentence(gpu, [live, faster])
    assert "2 run(s)), fMoE decodes at 0.91–1.25x" in text and "about what its hits save" in text


def test_validation_grid_compares_variants_on_the_validation_split_only(hf_dirs, tmp_path):
    """Variants with policy options and settings (copies per matrix, store capacity) against on-demand LRU at
    each point; the baseline's ratio is 1, copies per matrix change the simulated H100 TPOT (each chunk pays
    the copy's fixed cost; the default there is whole copies), and the evaluation split is refused."""
    prompts = tiny_sharegpt(tmp_path)
    saved = tmp_path / "grid.json"
    command = [sys.executable, "-m", "benchmarks.validation_grid"]
    common = [
        *("--model", str(hf_dirs["mixtral"]), "--prompts", str(prompts), "--n-prompts", "6"),
        *("--prompt-tokens", "8", "--new-tokens", "4", "--warmup", "1", "--hardware", "h100_sxm"),
        *("--budgets", "0.25", "--cache-dir", str(tmp_path / "cache")),
    ]
    variants = ["--variant", 'lru_chunked=on_demand_lru:{"chunks": 3}', 'small=fmoe:{"store_capacity": 8}']
    variants.append('again=fmoe:{"store_capacity": 8}')  # the same replay: the same fingerprint
    subprocess.run([*command, *common, *variants, "--save", str(saved)], cwd=ROOT, check=True, timeout=600)
    payload = json.loads(saved.read_text())
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == {"on_demand_lru", "lru_chunked", "small", "again"}
    assert rows["on_demand_lru"]["vs_baseline"] == 1.0
    assert rows["lru_chunked"]["tpot_ms"] > rows["on_demand_lru"]["tpot_ms"]  # 3 fixed costs a copy, not 1
    assert payload["summary"]["small"]["worst_vs_baseline"] == rows["small"]["vs_baseline"]
    fingerprints = {label: row["fingerprint"] for label, row in rows.items()}
    assert fingerprints["again"] == fingerprints["small"] != fingerprints["on_demand_lru"]
    # `--compare`'s report: a point whose replay came out otherwise, or that the earlier save lacks, is named.
    earlier = [dict(r, fingerprint="0" * 16) if r["variant"] == "small" else r for r in payload["rows"][1:]]
    same, lines = compare(payload["rows"], earlier)
    assert same == 2 and len(lines) == 2
    assert "on_demand_lru: not in the earlier save" in lines[0] and "small: differs" in lines[1]
    evaluation = [*command, *common, *variants, "--split", "eval"]
    refused = subprocess.run(evaluation, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "validation split only" in refused.stderr


def test_rerun_runs_each_experiment_with_its_recorded_command_and_stops_at_a_failure(tmp_path, monkeypatch):
    """`benchmarks.rerun`: the command comes from the experiment's results (run with this interpreter); the
    simulated experiments run two at a time, the timed ones one after another, none after a failure."""
    import sys

    from benchmarks import rerun

    (tmp_path / "exp7_overhead.json").write_text(
        json.dumps({"command": ".venv/bin/python -m benchmarks.exp7_overhead --data '../shared/my data'"})
    )
    assert rerun.recorded_command("exp7_overhead", tmp_path) == [
        sys.executable,
        "-m",
        "benchmarks.exp7_overhead",
        "--data",
        "../shared/my data",
    ]
    with pytest.raises(FileNotFoundError, match="exp2_overall.json is missing"):
        rerun.recorded_command("exp2_overall", tmp_path)
    (tmp_path / "exp2_overall.json").write_text(
        json.dumps({"command": "python -m benchmarks.exp4_cache_budget"})
    )
    with pytest.raises(ValueError, match="not a run of benchmarks.exp2_overall"):
        rerun.recorded_command("exp2_overall", tmp_path)

    def fake(failing):  # records each run, and fails the one named
        def run(name, argv):
            calls.append(name)
            return int(name == failing)

        return run

    calls = []
    monkeypatch.setattr(rerun, "run", fake("t2"))
    with pytest.raises(SystemExit, match="t2 failed"):
        rerun.run_all([("s1", []), ("s2", []), ("s3", [])], [("t1", []), ("t2", [])])
    assert sorted(calls[:3]) == ["s1", "s2", "s3"] and calls[3:] == ["t1", "t2"]
    calls.clear()
    monkeypatch.setattr(rerun, "run", fake("t1"))
    with pytest.raises(SystemExit, match="t1 failed"):
        rerun.run_all([("s1", [])], [("t1", []), ("t2", [])])
    assert calls == ["s1", "t1"]  # t2 never ran


def test_captions_say_how_many_of_the_presets_layers_a_replay_covers():
    """A trace of fewer MoE layers than the preset it is charged at is not "at Mixtral-8x7B sizes": the
    caption names the layers replayed; a trace with all of them keeps the short form."""
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, MODELS

    from benchmarks.harness import simulated_sizes, sizes_phrase

    mixtral = MODELS["mixtral"]
    assert sizes_phrase(mixtral, 8) == "Mixtral-8x7B's per-layer sizes (8 of its 32 MoE layers)"
    assert sizes_phrase(GPT_OSS_20B, 24) == "gpt-oss-20b sizes"
    payload = {"tables": {f"m, simulated at {sizes_phrase(mixtral, 8)} on rtx_3090": []}}
    assert simulated_sizes(payload, "m") == sizes_phrase(mixtral, 8)


def test_readme_reports_live_replay_beside_the_simulator():
    """The live-against-simulated sentence follows `live_replay`'s saved rows: change a ratio, it changes."""
    from benchmarks.make_readme import _live_replay_sentence

    def payload(ratio):
        row = dict(policy="on_demand_lru", budget=0.25, mode="copy", live_hit_rate=0.5, sim_hit_rate=0.5)
        return {
            "model": dict(layers=24, hidden=704, experts="bf16"),
            "rows": [dict(row, sim_vs_live=ratio), dict(row, policy="fmoe", mode="hybrid", sim_vs_live=1.2)],
            "machine": {"backend": "cpu"},
            "hardware": "2-core VM",
            "requests": ["a", "b"],
            "steps": 32,
        }

    text = _live_replay_sentence(payload(0.95))
    assert "over live TPOT: 0.95 (on_demand_lru), 1.20 (fmoe, hybrid)" in text
    assert "2 evaluation requests" in text and "24 MoE layers" in text and "GPU presets" in text
    assert "0.80 (on_demand_lru)" in _live_replay_sentence(payload(0.8))
    assert "against on_demand_lru" not in text  # no copy-mode row beside it
    both = payload(0.95)
    lru = dict(both["rows"][0], live_tpot_ms=100.0)
    both["rows"] = [lru, dict(lru, policy="fmoe+stops", live_tpot_ms=84.0)]
    assert "on_demand_lru's at the same budget: fmoe+stops 0.84x" in _live_replay_sentence(both)
    both["args"] = {"split": "validation"}
    assert "2 validation requests" in _live_replay_sentence(both)
    assert "also the warm-up" not in _live_replay_sentence(both)  # (no warm-up named: measured apart)
    both["warmup_request"] = "b"  # a run from before the warm-up was left out of the measured
    assert "real routing (one of them, b, also the warm-up: measured warm)" in _live_replay_sentence(both)


def test_live_replay_splits_a_priced_policys_host_time_for_the_simulator():
    """`live_replay.bookkeeping`: a policy that prices its bookkeeping live gives the simulator that price
    per layer, and the rest of its host time (the paid iterations' price taken out) for every layer; its
    measured iterations' paid share counts from the warm-up's end. Another policy gives none."""
    from benchmarks.live_replay import bookkeeping

    warm = {"unpaid_bookkeeping": 10, "bookkeeping_ms": 3.0}
    last = {"unpaid_bookkeeping": 28, "bookkeeping_ms": 2.4, "copy_ms": 0.04}
    out = bookkeeping(warm, last, tokens=20, policy_s=0.5e-3, layers=24)  # 18 of 20 rested: 2 paid
    assert out["bookkeeping_s"] == pytest.approx(2.4e-3 / 24)
    assert out["floor_s"] == pytest.approx((20 * 0.5e-3 - 2 * 2.4e-3) / 20 / 24)
    assert (out["paid_share"], out["unpaid"], out["copy_ms"]) == (0.1, 28, 0.04)
    assert bookkeeping({}, {"unpaid_bookkeeping": 0, "bookkeeping_ms": 9.0}, 2, 1e-3, 2)["floor_s"] == 0.0
    assert set(bookkeeping({}, {}, 20, 0.5e-3, 24).values()) == {None}


def test_readme_reports_the_latest_gpu_check_against_its_targets():
    """The gpu_check sentence follows the saved ratios and names the device and date; a smoke run (CPU) or a
    check whose bench-s section failed says nothing."""
    from benchmarks.make_readme import _gpu_check_sentence

    def payload(fmoe_vs_lru: float) -> dict:
        ratios = dict(warm_vs_resident=1.71, lru_vs_link_bound=3.31, fmoe_vs_lru=fmoe_vs_lru)
        return dict(
            device_kind="NVIDIA H200",
            machine=dict(date="2026-11-30T14:52:39"),
            offload_overhead=dict(ratios=ratios),
            link=dict(control_flow=dict(branches=33, us_each=dict(cond=41.0, switch=55.0, loop=3.0))),
        )

    text = _gpu_check_sentence(payload(0.897))
    assert "NVIDIA H200 (2026-11-30)" in text and "fMoE at 0.90x LRU's TPOT (target 1.0)" in text
    assert "1.71x the resident engine's TPOT (target 1.15)" in text and "`lax.cond` costs 41 us" in text
    assert "fMoE at 1.12x" in _gpu_check_sentence(payload(1.12))
    assert _gpu_check_sentence({**payload(1.0), "offload_overhead": None}) == ""
