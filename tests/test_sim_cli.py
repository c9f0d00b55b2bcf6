"""`fmoe-sim` end to end on saved traces: the summary, the JSON result, one-line errors, `--help`."""

import json
import subprocess
import sys

import numpy as np
import pytest
from fmoe_jax.offload import cost_model, sim_cli

from fmoe_jax.trace import RoutingTrace


def _trace(tmp_path, experts: int = 8, layers: int = 4, requests: int = 3, steps: int = 6):
    rng = np.random.default_rng(0)
    data = [
        [{"ids": np.argsort(rng.random((1, layers, experts)), -1)[..., :2]} for _ in range(steps)]
        for _ in range(requests)
    ]
    trace = RoutingTrace.from_external(data, num_experts=experts)
    trace.save(tmp_path / "trace")
    return tmp_path / "trace.npz"


def test_replay_prints_a_summary_and_writes_json(tmp_path, capsys):
    path = _trace(tmp_path)
    out = tmp_path / "result.json"
    args = [str(path), "--model-preset", "mixtral", "--hardware", "h100_sxm", "--cache-experts", "8"]
    assert sim_cli.main([*args, "--policy", "on_demand_lru", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "simulated: policy on_demand_lru, 8 cache slots" in text
    assert "32 MoE layers replayed (the trace's 4 projected onto the model's; the model has 32)" in text
    record = json.loads(out.read_text())
    assert record["simulated"] and record["trace_layers"] == 4 and record["replayed_layers"] == 32
    assert record["result"]["capacity"] == 8
    assert sim_cli.main([*args, "--layers", "trace", "--no-progress"]) == 0
    assert "4 MoE layers replayed (the trace's; the model has 32)" in capsys.readouterr().out
    result = record["result"]
    assert result["hits"] + result["misses"] == sum(result["layer_needed"]) > 0
    assert f"hits   {result['hit_rate']:.3f}" in text
    # a policy option reaches the policy; fmoe runs inline without being told
    assert (
        sim_cli.main([*args, "--policy", "fmoe", "--policy-option", "semantic=false", "--no-progress"]) == 0
    )
    assert "policy fmoe" in capsys.readouterr().out
    # on routing without embeddings fmoe matches on the routing alone unless told otherwise, and says so
    assert sim_cli.main([*args, "--policy", "fmoe", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "policy fmoe" in out and "no semantic embeddings, so fmoe matches on the routing alone" in err
    assert sim_cli.main([*args, "--policy", "fmoe", "--policy-option", "semantic=true", "--no-progress"]) == 2
    assert "needs semantic embeddings" in capsys.readouterr().err


def test_mistakes_are_one_line_errors(tmp_path, capsys):
    path = _trace(tmp_path)
    base = ["--hardware", "h100_sxm", "--no-progress"]
    cases = [
        (
            [str(path), "--model-preset", "qwen3_moe", *base],
            "routes over 8 experts a layer, but model preset",
        ),
        ([str(tmp_path / "absent.npz"), "--model-preset", "mixtral", *base], "cannot read routing trace"),
        ([str(path), "--model-preset", "nothing", *base], "unknown model preset 'nothing'"),
        ([str(path), "--model-preset", "mixtral", "--policy-option", "bogus=1", *base], "takes no option"),
        ([str(path), "--model-preset", "mixtral", "--budget", "1.5", *base], "--budget must be a share"),
        ([str(path), "--model-preset", "mixtral", "--execution", "hybrid", *base], "give --host"),
        ([str(path), "--model-preset", "mixtral", "--layers", "refuse", *base], "layers='project'"),
        # an unwritable result file is refused before the replay, not after it
        (
            [str(path), "--model-preset", "mixtral", "--json", str(tmp_path / "no" / "r.json"), *base],
            f"--json {tmp_path / 'no' / 'r.json'}: its folder {tmp_path / 'no'} does not exist",
        ),
        ([str(path), "--model-preset", "mixtral", "--json", str(tmp_path), *base], "is a directory"),
    ]
    for argv, message in cases:
        assert sim_cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert message in err and err.strip().count("\n") == 0, err
        assert out == "", out  # nothing replayed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json", "trace.npz"]  # nothing written


def test_preset_names_ignore_case_and_separators(tmp_path, capsys):
    path = _trace(tmp_path)
    argv = [str(path), "--cache-experts", "8", "--no-progress", "--model-preset", "Mixtral"]
    assert sim_cli.main([*argv, "--hardware", "H100-SXM", "--host", "server 8ch"]) == 0
    hardware, host = cost_model.HARDWARE["h100_sxm"].name, cost_model.HOSTS["server_8ch"].name
    assert f"sizes on {hardware} + {host}" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # matches no preset: argparse's error, which lists them
        sim_cli.main([*argv, "--hardware", "h100"])
    assert "invalid choice: 'h100' (choose from" in capsys.readouterr().err


def test_help_and_presets_from_the_command_line():
    run = [sys.executable, "-m", "fmoe_jax.offload.simulator"]  # the module fmoe-sim documents
    help_text = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True).stdout
    assert "(default: on_demand_lru)" in help_text and "fmoe" in help_text and "rtx_3090" in help_text
    listed = subprocess.run([*run, "--list-presets"], capture_output=True, text=True, check=True)
    assert listed.stderr == ""  # no runpy warning: the package does not import the simulator eagerly
    assert "mixtral" in listed.stdout and "desktop_ddr5" in listed.stdout
    for preset in cost_model.PRESETS.values():  # every size, by its model's name, and accepted by that name
        assert f" {preset.name}: " in listed.stdout
        assert sim_cli.model_presets()[preset.name.lower()] is preset


def _jsonl(path, requests: int = 3, steps: int = 3, layers: int = 2):
    """Routing as a JSONL file, one record per request, step and layer (`RoutingTrace.from_external`)."""
    records = [
        {"request": f"r{r}", "step": s, "layer": layer, "experts": [layer, (r + s + layer + 1) % 8]}
        for r in range(requests)
        for s in range(steps)
        for layer in range(layers)
    ]
    path.write_text("\n".join(map(json.dumps, records)))
    return path


@pytest.mark.parametrize("limit", [1, 2])
def test_external_routing_replays_each_request_as_its_batch(tmp_path, limit):
    path = _jsonl(tmp_path / "routing.jsonl", requests=2)
    batches = sim_cli.read_traces([str(path)], cost_model.MODELS["mixtral"], limit=limit)
    assert len(batches) == limit and all(len(b.requests) == 1 for b in batches)


def test_every_trace_is_checked_against_the_preset(tmp_path, capsys):
    """The second TRACE too, behind one that replays as several batches (it used to reach the replay and
    end in a traceback)."""
    routing = _jsonl(tmp_path / "routing.jsonl")
    (tmp_path / "wide").mkdir()
    wide = _trace(tmp_path / "wide", experts=16)
    assert sim_cli.main([str(routing), str(wide), "--model-preset", "mixtral", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"routing trace {wide} routes over 16 experts a layer" in err and err.count("\n") == 0, err


def test_warmup_limit_and_a_warmup_that_is_also_measured(tmp_path, capsys, monkeypatch):
    routing = _jsonl(tmp_path / "routing.jsonl")
    replayed = []
    run = sim_cli.Replay.run
    monkeypatch.setattr(sim_cli.Replay, "run", lambda self, trace: replayed.append(trace) or run(self, trace))
    argv = [str(routing), "--model-preset", "mixtral", "--no-progress", "--cache-experts", "8"]
    assert sim_cli.main([*argv, "--warmup", str(routing), "--warmup-limit", "1"]) == 0
    assert len(replayed) == 1 + 3  # one warm-up request, then the three measured
    assert "both warm-up and measured" in capsys.readouterr().err
    assert sim_cli.main(argv) == 0
    assert "warm-up" not in capsys.readouterr().err


def test_a_sweep_replays_every_combination_as_alone_and_in_parallel(tmp_path, capsys):
    """Comma-separated policies, hardware and budgets replay every combination from the same traces: each
    point's result is the one its own run gives, in one process or in two (`--jobs 2`), and the JSON holds
    them all."""
    path = _trace(tmp_path, requests=4)
    base = [str(path), "--model-preset", "mixtral", "--no-progress"]
    sweep = [
        *base,
        "--policy",
        "on_demand_lru,fmoe",
        "--hardware",
        "h100_sxm,RTX-3090",
        "--budget",
        "0.25,0.5",
    ]
    for jobs in ("1", "2"):
        out = tmp_path / f"sweep{jobs}.json"
        assert sim_cli.main([*sweep, "--jobs", jobs, "--json", str(out)]) == 0
        text = capsys.readouterr().out
        assert text.startswith("simulated: 8 points, ") and text.count("\nh100_sxm ") == 4
        assert "fastest (median TPOT): h100_sxm 0.25: " in text
        points = json.loads(out.read_text())["points"]
        assert [(p["hardware"], p["budget"], p["policy"]) for p in points] == [
            (h, b, p)
            for h in ("h100_sxm", "rtx_3090")
            for b in (0.25, 0.5)
            for p in ("on_demand_lru", "fmoe")
        ]
        if jobs == "1":
            first = points
        else:
            assert points == first  # the same floats from the worker processes
    alone = tmp_path / "alone.json"
    argv = [*base, "--policy", "fmoe", "--hardware", "rtx_3090", "--budget", "0.5", "--json", str(alone)]
    assert sim_cli.main(argv) == 0
    record = json.loads(alone.read_text())
    assert record["result"] == first[7]["result"] and record["budget"] == 0.5
    assert "simulated: policy fmoe, 128 cache slots" in capsys.readouterr().out  # one point: the summary


def test_a_sweep_checks_every_point_before_replaying_any(tmp_path, capsys):
    path = _trace(tmp_path)
    base = [str(path), "--model-preset", "mixtral", "--no-progress"]
    for argv, message in [
        ([*base, "--budget", "0.25,1.5"], "--budget must be a share of the experts in (0, 1], got 1.5"),
        (
            [*base, "--policy", "fmoe,on_demand_lru", "--policy-option", "bogus=1"],
            "no policy of fmoe, on_demand_lru takes the option(s) bogus",
        ),
        ([*base, "--policy", "fmoe,on_demand_lru", "--jobs", "0"], "--jobs must be at least 1"),
        ([*base, "--jobs", "-1"], "--jobs must be at least 1, got -1"),  # one point too
    ]:
        assert sim_cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert message in err and err.strip().count("\n") == 0 and out == "", (err, out)
    # with several policies an option goes to those that take it
    assert sim_cli.main([*base, "--policy", "fmoe,on_demand_lru", "--policy-option", "sticky=true"]) == 0
    assert "on_demand_lru" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sim_cli.main([*base, "--policy", "fmoe,bogus"])
    assert "invalid choice: 'bogus' (choose from" in capsys.readouterr().err
