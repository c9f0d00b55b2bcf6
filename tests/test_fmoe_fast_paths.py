"""fMoE's eviction shortcuts give what scoring every victim afresh gives: the keep-score table kept between
the policy's events (`Eviction.stale`; past the end of a layer's event that ended on a call to the cache)
and the cache's memo of a refused prefetch (`Policy.refusal_stamp`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
from fmoe_jax.offload.policies import FMoE
from fmoe_jax.offload.simulator import simulate

from fmoe_jax.trace import Iteration, RequestTrace, RoutingTrace

LAYERS, EXPERTS, TOP_K = 8, 8, 2


def sticky_request(rng: np.random.Generator, steps: int) -> RequestTrace:
    """A prefill of 4 tokens, then `steps` decode steps whose routing mostly repeats the last token's (so
    that matches guide prefetches, and some are refused against what the cache holds)."""
    logits = rng.normal(size=(LAYERS, EXPERTS))
    iterations = []
    for tokens in [4] + [1] * steps:
        logits = 0.7 * logits + 0.3 * rng.normal(size=(LAYERS, EXPERTS)) * 3
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        probs = np.repeat(probs[None], tokens, 0).astype(np.float32)
        ids = np.argsort(-probs, axis=-1)[..., :TOP_K].astype(np.int32)
        iterations.append(Iteration(ids=ids, probs=probs, embeds=None))
    return RequestTrace(prompt=[], iterations=iterations)


def traces(seed: int, requests: int, steps: int) -> list[RoutingTrace]:
    rng = np.random.default_rng(seed)
    meta = dict(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, embed_dim=0)
    return [RoutingTrace(meta, [sticky_request(rng, steps)]) for _ in range(requests)]


class Counting(FMoE):
    """fMoE counting the victim searches the cache makes; `shortcuts=False`: every one scored afresh."""

    def __init__(self, *args, shortcuts: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.shortcuts, self.searches = shortcuts, 0

    def bind(self, ctx, cache) -> None:
        super().bind(ctx, cache)
        self.evictor.keeps_table = self.shortcuts

    def keep_scores(self, layers, experts):
        self.searches += 1
        return super().keep_scores(layers, experts)

    def refusal_stamp(self, key, priority):
        return super().refusal_stamp(key, priority) if self.shortcuts else None


def test_the_kept_table_and_the_refusal_memo_change_no_outcome():
    store, replayed = traces(0, 4, 40), traces(1, 3, 60)
    results, policies = [], []
    for shortcuts in (False, True):
        policy = Counting.from_traces(
            store, prefetch_distance=1, store_capacity=64, semantic=False, asynchronous=False, admission=0.1
        )
        policy.shortcuts = shortcuts
        offload = OffloadConfig(policy=policy, cache_experts=LAYERS * EXPERTS // 4)
        results.append(simulate(replayed, offload, model=MIXTRAL_8X7B, hardware=RTX_3090))
        policies.append(policy)
    general, fast = results
    assert general.prefetches > 0 and general.misses > 0
    np.testing.assert_equal(dataclasses.asdict(fast), dataclasses.asdict(general))  # every field, exactly
    assert policies[1].searches < policies[0].searches  # refusals stood without a victim search


class ScoredOneByOne(FMoE):
    """fMoE whose victims the cache scores one `keep_score` at a time, in recency order."""

    keep_scores = None


@pytest.mark.parametrize("eviction", ["fmoe", "lfu", "lru"])
def test_array_scores_of_the_other_eviction_rules_change_no_outcome(eviction):
    """`Eviction.keep_scores` of the paper's p * freq (one `keep_priority` over the candidates), LFU and LRU
    choose every victim as scoring each candidate alone does."""
    store, replayed = traces(2, 4, 40), traces(3, 3, 60)
    results = []
    for cls in (ScoredOneByOne, FMoE):
        policy = cls.from_traces(
            store,
            prefetch_distance=1,
            store_capacity=64,
            semantic=False,
            asynchronous=False,
            eviction=eviction,
        )
        offload = OffloadConfig(policy=policy, cache_experts=LAYERS * EXPERTS // 4)
        results.append(simulate(replayed, offload, model=MIXTRAL_8X7B, hardware=RTX_3090))
    one_by_one, arrays = results
    assert one_by_one.prefetches > 0 and one_by_one.misses > 0
    # every field, exactly
    np.testing.assert_equal(dataclasses.asdict(arrays), dataclasses.asdict(one_by_one))
