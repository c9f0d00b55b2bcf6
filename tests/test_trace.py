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
