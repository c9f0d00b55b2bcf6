"""Routing traces: what generate records, saving and loading, and traces built from external routing data."""

from __future__ import annotations

import numpy as np
import pytest

import fmoe_jax as fj
from fmoe_jax.trace import RoutingTrace


def test_recorded_trace_matches_generation_and_round_trips(hf_dirs, tmp_path):
    model = fj.load_model(hf_dirs["qwen2_moe"])
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = fj.generate(
        model, prompts, max_new_tokens=4, stop_at_eos=False, record_trace=True, record_hidden=True
    )
    cfg = model.config
    trace = out.trace
    assert trace.meta["num_layers"] == cfg.num_moe_layers and trace.meta["num_experts"] == cfg.num_experts
    for request, prompt, generated in zip(trace.requests, prompts, out.tokens, strict=True):
        assert request.prompt == prompt
        assert [it.num_tokens for it in request.iterations] == [len(prompt)] + [1] * (len(generated) - 1)
        first = request.iterations[0]
        assert first.probs.shape == (len(prompt), cfg.num_moe_layers, cfg.num_experts)
        assert first.ids.shape == (len(prompt), cfg.num_moe_layers, cfg.top_k)
        assert first.embeds.shape == (len(prompt), cfg.hidden_size)
        assert first.hidden.shape == (len(prompt), cfg.num_moe_layers, cfg.hidden_size)
        np.testing.assert_allclose(first.probs.sum(-1), 1.0, rtol=0, atol=1e-5)
        top = np.argsort(-first.probs, axis=-1)[..., : cfg.top_k]
        np.testing.assert_array_equal(np.sort(top, -1), np.sort(first.ids, -1))  # ids are the top-k
    # the router probabilities equal those of a plain forward over the prompt
    logits, probs = fj.forward(model, [prompts[1]], return_router_probs=True)
    np.testing.assert_allclose(trace.requests[1].iterations[0].probs, np.asarray(probs)[0], rtol=0, atol=1e-5)

    trace.save(tmp_path / "t")
    loaded = RoutingTrace.load(tmp_path / "t.npz")
    assert loaded.meta == trace.meta
    for a, b in zip(loaded.requests, trace.requests, strict=True):
        assert a.prompt == b.prompt and len(a.iterations) == len(b.iterations)
        for x, y in zip(a.iterations, b.iterations, strict=True):
            for name in ("ids", "probs", "embeds", "hidden"):
                np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_offloaded_engine_records_the_same_trace(hf_dirs):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    resident = fj.generate(
        fj.load_model(hf_dirs["mixtral"]), prompts, 3, stop_at_eos=False, record_trace=True
    )
    offloaded = fj.generate(
        fj.load_model(hf_dirs["mixtral"], offload=fj.OffloadConfig(cache_experts=2)),
        prompts,
        3,
        stop_at_eos=False,
        record_trace=True,
    )
    for a, b in zip(resident.trace.requests, offloaded.trace.requests, strict=True):
        for x, y in zip(a.iterations, b.iterations, strict=True):
            np.testing.assert_array_equal(x.ids, y.ids)
            np.testing.assert_allclose(x.probs, y.probs, rtol=0, atol=1e-6)


def test_external_routing_data():
    ids = np.array([[[0, 3], [1, 2]], [[2, 3], [0, 1]]])  # [t=2, L=2, k=2]
    weights = np.array([[[0.7, 0.3], [0.6, 0.4]], [[0.5, 0.5], [0.9, 0.1]]], np.float32)
    trace = RoutingTrace.from_external(
        [[{"ids": ids, "weights": weights}, {"ids": ids[:1]}]], num_experts=4, meta={"source": "published"}
    )
    first, second = trace.requests[0].iterations
    assert trace.meta["num_layers"] == 2 and trace.meta["top_k"] == 2 and trace.meta["source"] == "published"
    np.testing.assert_allclose(first.probs[0, 0], [0.7, 0, 0, 0.3], rtol=0, atol=1e-7)  # weights: chosen
    np.testing.assert_allclose(second.probs[0, 1], [0, 0.5, 0.5, 0], rtol=0, atol=1e-7)  # no weights: 1/k
    with pytest.raises(ValueError, match="expert ids outside"):
        RoutingTrace.from_external([[{"ids": ids + 4}]], num_experts=4)
    with pytest.raises(ValueError, match="required"):
        RoutingTrace.from_external([[{"probs": np.zeros((1, 2, 4))}]], num_experts=4)
    with pytest.raises(ValueError, match="does not match"):
        RoutingTrace.from_external([[{"ids": ids}, {"ids": ids[:, :1]}]], num_experts=4)


def test_missing_trace_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="routing trace"):
        RoutingTrace.load(tmp_path / "nothing")


def test_concurrent_saves_of_one_trace_do_not_collide(tmp_path):
    """Two benchmark processes recording the same workload save its traces to one path: each save writes a
    temporary file of its own, so none renames another's half-written file away (a FileNotFoundError
    before), and what is left loads whole."""
    import threading

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 8, size=(64, 4, 2))
    trace = RoutingTrace.from_external([[{"ids": ids}] * 40], num_experts=8)
    errors = []

    def save():
        try:
            for _ in range(10):
                trace.save(tmp_path / "t")
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=save) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.npz"]  # no temporary file left
    loaded = RoutingTrace.load(tmp_path / "t")
    np.testing.assert_array_equal(loaded.requests[0].iterations[39].ids, trace.requests[0].iterations[39].ids)


def _routing_set(directory, ids: dict, weights: dict | None = None, num_experts: int = 8):
    """A routing-set directory as the shared gpt-oss-20b routing is stored (`offload/trace_formats.py`)."""
    import json

    arrays = {f"{name}__ids": a for name, a in ids.items()}
    arrays.update({f"{name}__w": w for name, w in (weights or {}).items()})
    np.savez(directory / "decode_routing.npz", **arrays)
    records = [{"request": name, "dataset": f"set{i % 2}", "tokens": ["x"]} for i, name in enumerate(ids)]
    (directory / "requests.json").write_text(json.dumps({"num_experts": num_experts, "requests": records}))


def test_routing_set_directory_reads_one_iteration_per_decode_step(tmp_path):
    rng = np.random.default_rng(0)
    ids = {  # distinct experts per token and layer, [T, 3, 2]
        name: np.argsort(rng.random((t, 3, 8)), -1)[..., :2].astype(np.int16)
        for name, t in (("r0", 5), ("r1", 2))
    }
    weights = {"r0": np.full((5, 3, 2), 0.5, np.float16), "r1": np.full((2, 3, 2), 0.5, np.float16)}
    _routing_set(tmp_path, ids, weights)
    trace = RoutingTrace.from_external(tmp_path)
    assert trace.meta["num_layers"] == 3 and trace.meta["top_k"] == 2 and trace.meta["num_experts"] == 8
    assert [r["request"] for r in trace.meta["requests"]] == ["r0", "r1"]
    assert "tokens" not in trace.meta["requests"][0]  # token strings stay in the file
    assert [len(r.iterations) for r in trace.requests] == [5, 2]
    for t, it in enumerate(trace.requests[0].iterations):
        np.testing.assert_array_equal(it.ids, ids["r0"][t : t + 1])
        np.testing.assert_allclose(it.probs.sum(-1), 1.0, rtol=0, atol=1e-6)
    only = RoutingTrace.from_external(tmp_path, select=lambda r: r["dataset"] == "set1")
    assert [r["request"] for r in only.meta["requests"]] == ["r1"]
    assert len(RoutingTrace.from_external(tmp_path, select=["r0"]).requests) == 1


def test_routing_set_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        RoutingTrace.from_external(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="missing decode_routing.npz"):
        RoutingTrace.from_external(tmp_path)
    _routing_set(tmp_path, {"r0": np.zeros((2, 3, 2), np.int16)}, {"r0": np.zeros((2, 3, 1), np.float16)})
    with pytest.raises(ValueError, match="r0__w has shape"):
        RoutingTrace.from_external(tmp_path)
    _routing_set(tmp_path, {"r0": np.full((2, 3, 2), 9, np.int16)})
    with pytest.raises(ValueError, match="expert ids outside"):
        RoutingTrace.from_external(tmp_path)


def test_routing_jsonl_records(tmp_path):
    import json

    lines = []
    for request, steps in (("a", 3), ("b", 1)):
        for step in range(steps):
            for layer in range(2):
                lines.append(
                    {
                        "request": request,
                        "step": step,
                        "layer": layer,
                        "experts": [layer, step + 1],
                        "weights": [0.75, 0.25],
                    }
                )
    path = tmp_path / "routing.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in reversed(lines)) + "\n")  # any order
    trace = RoutingTrace.from_external(path, num_experts=4)
    assert sorted(len(r.iterations) for r in trace.requests) == [1, 3]
    by_name = dict(zip([r["request"] for r in trace.meta["requests"]], trace.requests, strict=True))
    np.testing.assert_array_equal(by_name["a"].iterations[2].ids, [[[0, 3], [1, 3]]])
    np.testing.assert_allclose(
        by_name["a"].iterations[2].weights, [[[0.75, 0.25], [0.75, 0.25]]], rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="needs num_experts"):
        RoutingTrace.from_external(path)
    path.write_text(json.dumps({"request": "a", "step": 0, "layer": 1, "experts": [0]}) + "\n")
    with pytest.raises(ValueError, match=r"has layers \[1\], expected 0..1"):
        RoutingTrace.from_external(path, num_experts=4)
    path.write_text('{"request": "a", "step": 0}\n')
    with pytest.raises(ValueError, match="line 1: expected a JSON object"):
        RoutingTrace.from_external(path, num_experts=4)


def test_routing_sets_and_jsonl_give_each_step_its_fed_token(tmp_path):
    """A routing set's token strings at `__pos` become token ids (equal strings, equal ids), kept by
    save/load; a JSONL record's `token` is the step's id; positions that do not index the strings give
    none."""
    import json

    from fmoe_jax.offload.trace_formats import token_id

    ids = np.zeros((4, 3, 2), np.int16)
    ids[..., 1] = 1
    np.savez(tmp_path / "decode_routing.npz", r0__ids=ids, r0__pos=np.array([2, 3, 4, 5]), r1__ids=ids[:2])
    strings = ["<s>", "Q", " the", " cat", " the", " cat"]
    records = [{"request": "r0", "tokens": strings}, {"request": "r1", "tokens": strings}]
    (tmp_path / "requests.json").write_text(json.dumps({"num_experts": 4, "requests": records}))
    trace = RoutingTrace.from_external(tmp_path)
    fed = [int(it.tokens[0]) for it in trace.requests[0].iterations]
    assert fed == [token_id(s) for s in strings[2:]] and fed[0] == fed[2] != fed[1]
    assert all(it.tokens is None for it in trace.requests[1].iterations)  # r1 has no positions
    trace.save(tmp_path / "saved")
    loaded = RoutingTrace.load(tmp_path / "saved")
    assert [int(it.tokens[0]) for it in loaded.requests[0].iterations] == fed
    np.savez(tmp_path / "decode_routing.npz", r0__ids=ids, r0__pos=np.array([2, 3, 4, 6]), r1__ids=ids[:2])
    assert all(it.tokens is None for it in RoutingTrace.from_external(tmp_path).requests[0].iterations)

    lines = [
        {"request": "a", "step": s, "layer": layer, "experts": [0, 1], "token": 100 + s}
        for s in range(2)
        for layer in range(3)
    ]
    path = tmp_path / "routing.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = RoutingTrace.from_external(path, num_experts=4)
    assert [it.tokens.tolist() for it in trace.requests[0].iterations] == [[100], [101]]
    path.write_text("\n".join(json.dumps({**x, "token": "x"}) for x in lines) + "\n")
    with pytest.raises(ValueError, match="optionally weights, token"):
        RoutingTrace.from_external(path, num_experts=4)
