"""The learned-predictor baselines `promoe` and `duoserve`: predictor training, weight files, the policies'
prefetch requests and cache rules on hand-made events, and lossless serving in the live engine."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import RecordingCache, iteration_start, layer_routed
from fmoe_jax.models import model_identity
from fmoe_jax.offload.cache import DeviceExpertCache, Mover
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import HARDWARE, ModelPreset
from fmoe_jax.offload.driver import Driver, Functions, Routed
from fmoe_jax.offload.policies.base import PolicyContext
from fmoe_jax.offload.policies.duoserve import DuoServe
from fmoe_jax.offload.policies.promoe import ProMoE
from fmoe_jax.offload.predictors import Predictor
from fmoe_jax.offload.simulator import simulate
from fmoe_jax.research import predictor_training
from serving import served

import fmoe_jax as fj
from fmoe_jax.trace import Iteration, RequestTrace, RoutingTrace


# -- synthetic traces with structure ----------------------------------------------------------------------
def synthetic_trace(requests: int = 48, layers: int = 4, experts: int = 8, k: int = 2, dim: int = 16, seed=0):
    """Layer l + 1's experts are a fixed permutation of layer l's; each layer's router input (and the
    embedding, for layer 0) encodes that layer's experts plus noise. So every layer is a deterministic
    function of the previous layer's experts and of any earlier hidden state, while each layer's marginal
    is uniform (a popularity predictor gets about k / J)."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(experts) for _ in range(layers)]
    codes = rng.normal(size=(layers, experts, dim)).astype(np.float32)
    embed_codes = rng.normal(size=(experts, dim)).astype(np.float32)
    out = []
    for _ in range(requests):
        request = RequestTrace(prompt=[])
        for tokens in (6, 1, 1):
            ids = np.zeros((tokens, layers, k), np.int32)
            ids[:, 0] = [rng.choice(experts, k, replace=False) for _ in range(tokens)]
            for layer in range(1, layers):
                ids[:, layer] = perms[layer][ids[:, layer - 1]]
            hidden = codes[np.arange(layers)[None, :, None], ids].sum(2)
            embeds = embed_codes[ids[:, 0]].sum(1)
            request.iterations.append(
                Iteration(
                    ids=ids,
                    embeds=(embeds + 0.05 * rng.normal(size=embeds.shape)).astype(np.float32),
                    hidden=(hidden + 0.05 * rng.normal(size=hidden.shape)).astype(np.float32),
                )
            )
        out.append(request)
    meta = dict(num_layers=layers, num_experts=experts, top_k=k, embed_dim=dim, model_id="synthetic")
    return RoutingTrace(meta, out)


SETTINGS = dict(epochs=20, batch_size=32, learning_rate=3e-3, progress=False)


@pytest.fixture(scope="module")
def synthetic_predictors():
    train, held_out = predictor_training.split_requests([synthetic_trace()], eval_fraction=0.25, seed=0)
    promoe = predictor_training.train_promoe(train, stride=2, hidden=(32,), **SETTINGS)
    duoserve = predictor_training.train_duoserve(train, hidden=(32, 16), **SETTINGS)
    return promoe, duoserve, held_out


def test_training_learns_structure_and_beats_popularity(synthetic_predictors):
    promoe, duoserve, held_out = synthetic_predictors
    for predictor in (promoe, duoserve):
        losses = predictor.meta["train_loss"]
        assert losses[-1] < 0.5 * losses[0], f"{predictor.kind}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        scores = predictor_training.evaluate(predictor, held_out)
        assert scores["recall"] >= 0.95, (predictor.kind, scores)
        assert scores["popularity_recall"] < 0.5, (predictor.kind, scores)
        assert scores["any_hit"] >= scores["all_hit"] >= 0.9


def test_training_is_seeded(synthetic_predictors):
    promoe, _, _ = synthetic_predictors
    train, _ = predictor_training.split_requests([synthetic_trace()], eval_fraction=0.25, seed=0)
    again = predictor_training.train_promoe(train, stride=2, hidden=(32,), **SETTINGS)
    np.testing.assert_array_equal(again.layers[0]["w"], promoe.layers[0]["w"])


def test_save_load_round_trip(synthetic_predictors, tmp_path):
    promoe, duoserve, held_out = synthetic_predictors
    for predictor in (promoe, duoserve):
        stem = predictor.save(tmp_path / predictor.kind)
        loaded = Predictor.load(stem.with_suffix(".json"))
        assert loaded.kind == predictor.kind and loaded.meta == predictor.meta
        x = np.random.default_rng(0).normal(size=(5, predictor.mean.shape[-1])).astype(np.float32)
        group = predictor.mean.shape[0] - 1  # ProMoE: the last layer's predictor
        np.testing.assert_array_equal(loaded.probs(x, group), predictor.probs(x, group))
        assert predictor_training.evaluate(loaded, held_out) == predictor_training.evaluate(
            predictor, held_out
        )
    with pytest.raises(FileNotFoundError, match="train one with benchmarks/train_predictors.py"):
        Predictor.load(tmp_path / "missing")


def context(layers=4, experts=8, top_k=2, dim=16, distance=2, capacity=8, model_id="synthetic"):
    return PolicyContext(
        num_layers=layers,
        num_experts=experts,
        top_k=top_k,
        embed_dim=dim,
        prefetch_distance=distance,
        capacity=capacity,
        model_id=model_id,
    )


def test_mismatched_predictors_are_refused(synthetic_predictors):
    promoe, duoserve, _ = synthetic_predictors
    cases = [
        (ProMoE, promoe, context(layers=5), r"num_layers=4 \(model: 5\)"),
        (ProMoE, promoe, context(experts=6), r"num_experts=8 \(model: 6\)"),
        (ProMoE, promoe, context(dim=32), r"input_dim=16 \(model: 32\)"),
        (
            ProMoE,
            promoe,
            context(distance=3),
            r"prefetch_distance=3; set OffloadConfig\(prefetch_distance=2\)",
        ),
        (ProMoE, promoe, context(model_id="mixtral-0123"), "trained for model 'synthetic'"),
        (ProMoE, duoserve, context(), "holds 'duoserve' predictors"),
        (DuoServe, duoserve, context(top_k=1), r"top_k=2 \(model: 1\)"),
        (DuoServe, duoserve, context(model_id="other"), "retrain it on traces of this model"),
    ]
    for policy_cls, predictor, ctx, message in cases:
        with pytest.raises(ValueError, match=message):
            policy_cls(predictor=predictor).bind(ctx, RecordingCache())
    DuoServe(predictor=duoserve).bind(context(model_id=""), RecordingCache())  # unknown identity: shapes only


# -- hand-made events -------------------------------------------------------------------------------------


def linear_predictor(kind, w, *, layers, experts, k, dim=None, stride=None, popularity=None, affinity=None):
    """A predictor with one linear layer `w` `[G, F, J]` and no standardisation: probs = sigmoid(x @ w)."""
    groups, features, _ = w.shape
    meta = dict(model_id="", num_layers=layers, num_experts=experts, top_k=k)
    if kind == "promoe":
        meta |= dict(input_dim=dim, stride=stride)
    return Predictor(
        kind,
        meta,
        [{"w": np.asarray(w, np.float32), "b": np.zeros((groups, experts), np.float32)}],
        np.zeros((groups, features), np.float32),
        np.ones((groups, features), np.float32),
        np.full((layers, experts), 1.0 / experts, np.float32) if popularity is None else popularity,
        np.zeros((layers - 1, experts, experts), np.float32) if affinity is None else affinity,
    )


def one_hot(rows: list[int], n: int = 4) -> np.ndarray:
    return np.eye(n, dtype=np.float32)[rows]


def test_promoe_predicts_d_layers_ahead_from_hidden_states():
    """L=4, J=4, k=1, d=2: each layer's predictor is 10 * identity, so it picks the hidden state's argmax."""
    predictor = linear_predictor(
        "promoe", 10 * np.stack([np.eye(4)] * 4), layers=4, experts=4, k=1, dim=4, stride=2
    )
    policy, cache = ProMoE(predictor=predictor), RecordingCache()
    policy.bind(context(experts=4, top_k=1, dim=4, distance=2, model_id=""), cache)
    valid = np.array([[True], [False]])  # the second row has finished: ignored
    iteration_start(policy, one_hot([2, 0]), valid)
    ((items, kwargs),) = cache.requests
    p = 1 / (1 + np.exp(-10.0))
    assert items == [((0, 2), pytest.approx(p)), ((1, 2), pytest.approx(p / 2))]  # from the embedding
    assert kwargs == {"replace": True}
    layer_routed(policy, 0, None, np.array([[2], [0]]), valid, hidden=one_hot([3, 1]))
    items, kwargs = cache.requests[-1]
    assert items == [((2, 3), pytest.approx(p / 2))]  # layer 0 + d, priority p / d
    assert kwargs == {"replace": [2], "stale_before": 1}
    layer_routed(policy, 1, None, np.array([[2], [0]]), valid, hidden=one_hot([0, 1]))
    assert cache.requests[-1][0] == [((3, 0), pytest.approx(p / 2))]
    layer_routed(policy, 2, None, np.array([[3], [0]]), valid, hidden=one_hot([0, 1]))
    layer_routed(policy, 3, None, np.array([[1], [0]]), valid, hidden=one_hot([0, 1]))
    assert len(cache.requests) == 3  # layers 2 + d and 3 + d are past the last layer
    policy.on_iteration_end()
    stats = policy.stats()
    assert stats["predictor_recall"] == pytest.approx(3 / 4)  # layers 0, 1, 2 as predicted; layer 3 not


def test_duoserve_decode_predicts_next_layer_from_state_constructor():
    """The hand-made MLP reads only the affinity vector, which maps expert e of layer l to (e + 1 + l) % 4."""
    layers, experts = 3, 4
    affinity = np.stack([np.roll(np.eye(experts), 1 + layer, axis=1) for layer in range(layers - 1)])
    w = np.zeros((1, layers * experts + 2 * experts, experts))
    w[0, -experts:] = 10 * np.eye(experts)
    predictor = linear_predictor("duoserve", w, layers=layers, experts=experts, k=1, affinity=affinity)
    policy, cache = DuoServe(predictor=predictor), RecordingCache()
    policy.bind(context(layers=layers, experts=experts, top_k=1, model_id=""), cache)
    valid = np.ones((1, 1), bool)
    iteration_start(policy, None, valid)
    assert cache.requests == [([], {"replace": True})]  # decode: layer 0 loads on demand after its gate
    layer_routed(policy, 0, None, np.array([[1]]), valid)
    assert [key for key, _ in cache.requests[-1][0]] == [(1, 2)]
    assert cache.requests[-1][1] == {"replace": True}
    layer_routed(policy, 1, None, np.array([[3]]), valid)
    assert [key for key, _ in cache.requests[-1][0]] == [(2, 1)]  # (3 + 2) % 4
    layer_routed(policy, 2, None, np.array([[0]]), valid)
    assert len(cache.requests) == 3


def test_duoserve_prefill_streams_each_next_layer_in_popularity_order():
    popularity = np.array([[0.1, 0.4, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1]], np.float32)
    predictor = linear_predictor(
        "duoserve", np.zeros((1, 16, 4)), layers=2, experts=4, k=1, popularity=popularity
    )
    policy, cache = DuoServe(predictor=predictor), RecordingCache()
    policy.bind(context(layers=2, experts=4, top_k=1, model_id=""), cache)
    valid = np.ones((1, 5), bool)
    iteration_start(policy, None, valid)
    items, kwargs = cache.requests[-1]
    assert items == [((0, 1), 1.0), ((0, 2), 0.75), ((0, 3), 0.5), ((0, 0), 0.25)] and kwargs == {
        "replace": True
    }
    layer_routed(policy, 0, None, np.zeros((5, 1), np.int32), valid)
    assert [key for key, _ in cache.requests[-1][0]] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    layer_routed(policy, 1, None, np.zeros((5, 1), np.int32), valid)
    assert len(cache.requests) == 2


def test_eviction_keeps_needed_then_predicted_and_admission_leaves_room_for_misses():
    predictor = linear_predictor("duoserve", np.zeros((1, 16, 4)), layers=2, experts=4, k=1)
    policy, cache = DuoServe(predictor=predictor), RecordingCache(capacity=3)
    policy.bind(context(layers=2, experts=4, top_k=1, capacity=3, model_id=""), cache)
    book = cache.book
    valid = np.ones((1, 2), bool)
    iteration_start(policy, None, valid)  # prefill: layer 0 is streamed
    for key in [(0, 0), (0, 1), (1, 3)]:
        book.add(key, prefetched=True)
        book.mark_ready(key)
    layer_routed(policy, 0, None, np.array([[0], [2]]), valid)  # needs (0, 0) and (0, 2); (0, 2) is absent
    score = {key: policy.keep_score(key, entry) for key, entry in book.entries.items()}
    assert score[(0, 0)] == 3.0  # needed now, not used yet
    assert 1.0 < score[(1, 3)] <= 2.0  # streamed for the next layer
    assert score[(0, 1)] == 0.0  # not needed by its layer: first to go
    assert not policy.admit_prefetch((1, 1), 0.75, (0, 0))  # never evicts what the layer is about to use
    assert not policy.admit_prefetch((1, 0), 1.0, (0, 1))  # (0, 2) still has to load into that slot
    book.record_use((0, 0))  # the layer used (0, 0): it is now as evictable as any computed expert
    assert policy.keep_score((0, 0), book.entries[(0, 0)]) == 0.0
    assert policy.admit_prefetch((1, 0), 1.0, (0, 1))  # (0, 2) can still take (0, 0)'s slot
    policy.on_iteration_end()
    assert not policy.admit_prefetch((1, 0), 1.0, (0, 1))  # layer 1 has run: its prefetches are stale


class SyncMover(Mover):
    def start(self, key, *, urgent=False):
        return key

    def is_ready(self, handle):
        return True

    def wait(self, handles):
        pass


def test_duoserve_prefill_ring_through_the_real_cache_wastes_nothing():
    """Capacity 3, a layer needing all 4 experts runs in two chunks; layer 1's experts are streamed into the
    slots layer 0's first chunk frees, then hit; nothing prefetched is evicted unused."""
    predictor = linear_predictor("duoserve", np.zeros((1, 16, 4)), layers=2, experts=4, k=1)
    policy = DuoServe(predictor=predictor)
    cache = DeviceExpertCache(SyncMover(), capacity=3, expert_bytes=1, policy=policy, synchronous=True)
    policy.bind(context(layers=2, experts=4, top_k=1, capacity=3, model_id=""), cache)
    ids = np.arange(4, dtype=np.int32)[:, None]  # the 4 tokens route to experts 0..3
    loop = Functions(lambda m: Routed(ids), lambda *_: None)
    Driver(policy, cache).iteration(np.ones((1, 4), bool), None, loop)
    s = cache.book.stats
    assert s.wasted_prefetches == 0
    assert s.layer_hits == {0: 3, 1: 2}  # layer 0: the streamed three; layer 1: two streamed during layer 0
    assert s.hits + s.misses == 8 and len(cache.book) <= 3


# -- the live engine -------------------------------------------------------------------------------------
PROMPTS = {1: [[3, 14, 15, 92, 65, 35, 89, 79]], 3: [[3, 14, 15], list(range(20, 60)), [7, 7, 7, 7, 7, 7]]}
NEW_TOKENS = 4


@pytest.mark.parametrize("family", ["mixtral"])  # the other families: tests/test_lossless.py
def test_lossless_for_every_budget_and_batch(family, hf_dirs, tmp_path):
    resident = fj.load_model(hf_dirs[family])
    cfg = resident.config
    out = fj.generate(
        resident, [[5, 6, 7, 8], [9, 10, 11]], 4, stop_at_eos=False, record_trace=True, record_hidden=True
    )
    quick = dict(epochs=3, hidden=(16,), progress=False, model_id=model_identity(cfg))
    paths = {
        "promoe": predictor_training.train_promoe([out.trace], stride=1, **quick).save(tmp_path / "promoe"),
        "duoserve": predictor_training.train_duoserve([out.trace], **quick).save(tmp_path / "duoserve"),
    }
    reference = {
        b: fj.generate(resident, p, NEW_TOKENS, stop_at_eos=False).tokens for b, p in PROMPTS.items()
    }
    total = cfg.num_moe_layers * cfg.num_experts
    budgets = {"one_slot": 1, "quarter": max(1, total // 4), "all": total}
    base = fj.load_model(hf_dirs[family], offload=OffloadConfig(cache_experts=1))  # its programs are shared
    base.close()
    for policy_cls in (ProMoE, DuoServe):
        for budget, slots in budgets.items():
            policy = policy_cls(predictor=paths[policy_cls.name])
            offload = OffloadConfig(policy=policy, cache_experts=slots, prefetch_distance=1)
            model = served(base, offload)
            for batch, prompts in PROMPTS.items():
                got = fj.generate(model, prompts, NEW_TOKENS, stop_at_eos=False)
                assert got.tokens == reference[batch], f"{family} {policy_cls.name} {budget} batch {batch}"
                assert got.stats.peak_cache_bytes <= slots * got.stats.extra["expert_bytes"]
            model.close()
        counts = live_and_replayed(base, policy_cls, paths[policy_cls.name], budgets["quarter"])
        assert counts[0] == counts[1], f"{family} {policy_cls.name} live vs replayed: {counts}"
        assert counts[0][2] > 0, f"{family} {policy_cls.name} never prefetched"


def live_and_replayed(base, policy_cls, predictor, slots: int) -> list[tuple[int, int, int, int]]:
    """(hits, misses, prefetches, wasted prefetches) of live generation with synchronous transfers (`base`'s
    weights and programs behind a fresh engine), then of the trace-replay simulator driving a fresh policy
    through the same cache code over the recorded trace: the policies are deterministic, so the two must
    agree."""

    def config():
        policy = policy_cls(predictor=predictor)
        return OffloadConfig(policy=policy, cache_experts=slots, prefetch_distance=1, transfer="synchronous")

    with served(base, config()) as model:
        out = fj.generate(
            model, PROMPTS[3], NEW_TOKENS, stop_at_eos=False, record_trace=True, record_hidden=True
        )
        live = model.engine.cache.book.stats
        router = [
            np.asarray(model.module.layers[i].router.weight[...], np.float32).T
            for i in model.config.moe_layer_ids
        ]
        preset = ModelPreset.from_config(model.config)
    sim = simulate(out.trace, config(), model=preset, hardware=HARDWARE["h100_sxm"], router_weights=router)
    return [(c.hits, c.misses, c.prefetches, c.wasted_prefetches) for c in (live, sim)]
