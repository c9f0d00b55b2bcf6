"""fmoe's learned reuse predictor: its samples, its training, and how the fmoe policy uses it (the reuse
forecast's hint, refreshed after each layer from the router input)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import RecordingCache, iteration_start, layer_routed
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import HARDWARE, MODELS
from fmoe_jax.offload.policies.base import PolicyContext
from fmoe_jax.offload.policies.fmoe import FMoE
from fmoe_jax.offload.predictors import Predictor
from fmoe_jax.offload.simulator import simulate
from fmoe_jax.research import predictor_training

from fmoe_jax.trace import Iteration, RequestTrace, RoutingTrace

LAYERS, EXPERTS, DIM = 2, 4, 8


def next_token_trace(requests: int, seed: int, *, tokens: int = 10) -> RoutingTrace:
    """Top-1 routing, the same expert at both layers, drawn at random each token; each layer's router input
    carries a code of the expert the *next* token will use, plus noise (the last token's, of a random one).
    So the next token's experts can be read from the router input, and from nothing else."""
    rng = np.random.default_rng(seed)
    codes = np.random.default_rng(99).normal(size=(EXPERTS, DIM)).astype(np.float32)
    out = []
    for _ in range(requests):
        route = rng.integers(0, EXPERTS, tokens + 1)  # the last entry: the token after the request ends
        request = RequestTrace(prompt=[1])
        for t in range(tokens):
            ids = np.full((1, LAYERS, 1), route[t], np.int32)
            hidden = codes[route[t + 1]] + 0.3 * rng.normal(size=(1, LAYERS, DIM))
            probs = np.full((1, LAYERS, EXPERTS), 0.1, np.float32)
            probs[..., route[t]] = 0.7
            embeds = rng.normal(size=(1, DIM)).astype(np.float32)
            request.iterations.append(Iteration(ids, probs, embeds, hidden=hidden.astype(np.float32)))
        out.append(request)
    meta = dict(num_layers=LAYERS, num_experts=EXPERTS, top_k=1, embed_dim=DIM, model_id="next-token")
    return RoutingTrace(meta, out)


def test_reuse_dataset_lines_up_router_inputs_with_the_iterations_after_them():
    trace = next_token_trace(2, seed=0, tokens=5)
    x, y = predictor_training.reuse_dataset([trace], horizon=2)
    assert x.shape == (LAYERS, 2 * 3, DIM) and y.shape == (2 * 3, LAYERS * EXPERTS)  # 3 tokens with 2 after
    n = 0
    for request in trace.requests:
        its = request.iterations
        for i in range(len(its) - 2):
            np.testing.assert_array_equal(x[:, n], its[i].hidden[-1])
            later = {int(its[j].ids[0, 0, 0]) for j in (i + 1, i + 2)}
            expected = np.zeros((LAYERS, EXPERTS))
            expected[:, sorted(later)] = 1.0
            np.testing.assert_array_equal(y[n].reshape(LAYERS, EXPERTS), expected)
            n += 1
    with pytest.raises(ValueError, match="nothing to learn from"):
        predictor_training.reuse_dataset([trace], horizon=5)
    bare = RoutingTrace(trace.meta, [RequestTrace([1], [Iteration(ids=its[0].ids)] * 3)])
    with pytest.raises(ValueError, match="record_hidden=True"):
        predictor_training.reuse_dataset([bare], horizon=1)


@pytest.fixture(scope="module")
def trained() -> Predictor:
    return predictor_training.train_reuse(
        [next_token_trace(60, seed=1)], horizon=1, l2=(1e-4, 1e-2), epochs=40, progress=False
    )


def test_reuse_predictor_reads_the_next_tokens_experts_from_the_router_input(trained):
    assert trained.kind == "reuse" and trained.meta["horizon"] == 1
    assert trained.meta["l2"] in (1e-4, 1e-2) and set(trained.meta["held_out_loss"]) == {"0.0001", "0.01"}
    by_layer = trained.meta["held_out_loss_by_layer"]  # the chosen strength's, per layer's router input
    assert len(by_layer) == LAYERS and np.isclose(
        np.mean(by_layer), trained.meta["held_out_loss"][str(trained.meta["l2"])]
    )
    x, y = predictor_training.reuse_dataset([next_token_trace(20, seed=2)], horizon=1)  # unseen requests
    for layer in range(LAYERS):
        p = trained.probs(x[layer], layer)  # [N, L * J]
        assert p[y > 0].mean() > 0.8 and p[y == 0].mean() < 1 / EXPERTS, layer  # 1 / J: knowing nothing
        # Each token's most likely expert is the one the next token uses (top 1, the same at both layers).
        np.testing.assert_array_equal(p[:, :EXPERTS].argmax(1), y[:, :EXPERTS].argmax(1))


def context(**overrides) -> PolicyContext:
    settings = dict(
        num_layers=LAYERS, num_experts=EXPERTS, top_k=1, embed_dim=DIM, prefetch_distance=1, capacity=4
    )
    return PolicyContext(**(settings | overrides), model_id="next-token")


def test_fmoe_refreshes_its_reuse_hint_after_each_layer(trained):
    policy = FMoE(reuse_predictor=trained, asynchronous=False, trajectory=False, semantic=False)
    assert policy.needs_hidden
    policy.bind(context(), RecordingCache())
    trace = next_token_trace(1, seed=3)
    valid = np.ones((1, 1), bool)
    for it in trace.requests[0].iterations[:3]:
        iteration_start(policy, None, valid)
        logits = []
        for layer in range(LAYERS):
            probs, hidden = it.probs[:, layer], it.hidden[:, layer]
            layer_routed(policy, layer, probs, it.ids[:, layer], valid, hidden=hidden)
            p = trained.probs(hidden, layer)[0].astype(np.float64)
            logits.append(np.log(p) - np.log1p(-p))
            # The hint: the mean log-odds of the iteration's layers so far (one row: no union over rows).
            hint = 1.0 / (1.0 + np.exp(-np.mean(logits, axis=0)))
            np.testing.assert_allclose(policy._hint, hint.reshape(LAYERS, EXPERTS), rtol=1e-5)
            # The iteration's forecast snapshot is rebinned with the newest hint (what the table learns from).
            np.testing.assert_array_equal(policy.forecast.pending[-1][0], policy.forecast.bins(policy._hint))
            used = policy.guides.used
            assert np.all(policy.forecast.scores[used] == policy.forecast._if_used[used])
        policy.on_iteration_end()


def test_fmoe_refuses_a_reuse_predictor_of_another_model(trained):
    with pytest.raises(ValueError, match=r"fmoe's reuse predictor does not fit this model: num_experts=4"):
        FMoE(reuse_predictor=trained, asynchronous=False).bind(context(num_experts=6), RecordingCache())
    with pytest.raises(ValueError, match="serves eviction 'reuse' only, not 'lru'"):
        FMoE(reuse_predictor=trained, eviction="lru")
    with pytest.raises(ValueError, match="trained for model 'next-token'"):
        FMoE(reuse_predictor=trained, asynchronous=False).bind(
            PolicyContext(LAYERS, EXPERTS, 1, DIM, 1, 4, model_id="other"), RecordingCache()
        )


def test_reuse_predictor_round_trips_and_from_traces_trains_one(trained, tmp_path):
    stem = trained.save(tmp_path / "reuse")
    loaded = FMoE(reuse_predictor=stem).reuse_predictor
    x = np.random.default_rng(0).normal(size=(3, DIM)).astype(np.float32)
    np.testing.assert_array_equal(loaded.probs(x, 1), trained.probs(x, 1))
    traces = [next_token_trace(30, seed=4)]
    policy = FMoE.from_traces(
        traces, prefetch_distance=1, store_capacity=64, reuse_predictor="train", asynchronous=False
    )
    assert policy.reuse_predictor is None and policy.needs_hidden  # trained at `bind`, for its horizon
    empty = FMoE.from_traces([], prefetch_distance=1, store_capacity=64, reuse_predictor="train")
    assert empty.reuse_predictor is None and not empty.needs_hidden
    # The simulator drives it from the traces' router inputs.
    result = simulate(
        [next_token_trace(3, seed=5)],
        OffloadConfig(policy=policy, cache_experts=3, prefetch_distance=1),
        model=MODELS["mixtral"],
        hardware=HARDWARE["rtx_3090"],
        router_weights=[np.zeros((DIM, EXPERTS), np.float32)] * LAYERS,
    )
    assert result.hit_rate > 0
    # Trained for the horizon the forecast looks at: 3 slots of 2 layers x top 1 resolve "auto" to 3; bound
    # again beside one slot, the policy looks 2 iterations ahead and trains a predictor for that.
    assert policy.reuse_horizon == 3 and policy.reuse_predictor.meta["horizon"] == 3
    policy.bind(PolicyContext(LAYERS, EXPERTS, 1, DIM, 1, 1, model_id="next-token"), RecordingCache())
    assert policy.reuse_horizon == 2 and policy.reuse_predictor.meta["horizon"] == 2
    policy.close()
    unrecorded = next_token_trace(1, seed=6)
    for it in unrecorded.requests[0].iterations:
        it.hidden = None
    with pytest.raises(ValueError, match="the traces lack 'hidden'"):
        FMoE.from_traces([unrecorded], prefetch_distance=1, store_capacity=64, reuse_predictor="train")
    with pytest.raises(ValueError, match="serves eviction 'reuse' only"):
        FMoE.from_traces(
            traces, prefetch_distance=1, store_capacity=64, reuse_predictor="train", eviction="lfu"
        )


@pytest.mark.parametrize(("copy_s", "rests"), [(1e-9, True), (1.0, False)])
def test_fmoe_reuse_predictor_pays_for_itself_like_the_matcher(trained, copy_s, rests):
    """Live (no simulated `matcher_s`), the predictor's measured host time per layer is paid from
    `pay_for_matching`'s credit: where a copy costs next to nothing it rests, and the engine stops copying
    router inputs out (`needs_hidden`); where copies are dear it runs at every layer."""
    policy = FMoE(reuse_predictor=trained, asynchronous=False, trajectory=False, semantic=False)
    policy.bind(context(copy_s=copy_s, layer_s=1e-3), RecordingCache())
    valid = np.ones((1, 1), bool)
    its = next_token_trace(1, seed=4, tokens=10).requests[0].iterations
    for it in its:
        iteration_start(policy, None, valid)
        for layer in range(LAYERS):
            hidden = it.hidden[:, layer] if policy.needs_hidden else None  # as the engine gives it
            layer_routed(policy, layer, it.probs[:, layer], it.ids[:, layer], valid, hidden=hidden)
        policy.on_iteration_end()
    stats = policy.stats()
    assert stats["reuse_predictor_ms"] > 0  # priced once warm
    if rests:
        assert stats["unpaid_reuse"] > 0 and not policy.needs_hidden
    else:
        assert "unpaid_reuse" not in stats and policy.needs_hidden
