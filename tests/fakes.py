"""Stand-ins shared by the policy tests: a cache that records prefetch requests, and event helpers that
drive a policy's hooks as the iteration driver does (`offload/driver.py`)."""

from __future__ import annotations

import numpy as np
from fmoe_jax.offload.cache import BookView, CacheBook
from fmoe_jax.offload.events import IterationStart, LayerRouted, RequestStart, needed_experts


class RecordingCache(BookView):
    """A `CacheView` over a real `CacheBook` (for the eviction rules) whose prefetch requests are recorded,
    not carried out."""

    def __init__(self, capacity: int = 8):
        self.book = CacheBook(capacity, expert_bytes=1)
        self.requests: list[tuple[list, dict]] = []
        self.timers = {"on_demand_wait": 0.0}

    def request_prefetch(self, items, **kwargs):
        self.requests.append((list(items), kwargs))

    def drop_prefetches(self, *, before):
        self.requests.append(([], {"drop_before": before}))


def request_start(policy, batch: int) -> None:
    policy.on_request_start(RequestStart(batch))


def iteration_start(policy, embeds, valid, requests=None) -> None:
    policy.on_iteration_start(IterationStart(np.asarray(valid), embeds, requests))


def layer_routed(policy, layer: int, probs, ids, valid, *, hidden=None) -> None:
    """`LayerRouted` for ids `[N, k]` and valid `[B, T]` (its needed experts computed as the driver does)."""
    ids, valid = np.asarray(ids), np.asarray(valid)
    needed = needed_experts(ids, valid.reshape(-1))
    policy.on_layer_routed(LayerRouted(layer, ids, valid, needed, probs, hidden))


def skewed_routing(rng: np.random.Generator, requests: int, steps: int = 20):
    """A `RoutingTrace` of `requests` one-row requests, `steps` decode steps over 4 layers of 8 experts,
    top-2, each layer favouring its low-numbered experts (so that reuse can be learned from it)."""
    from fmoe_jax.trace import RoutingTrace

    routed = [
        [{"ids": np.argsort(rng.random((1, 4, 8)) + np.arange(8) * 0.1, -1)[..., :2]} for _ in range(steps)]
        for _ in range(requests)
    ]
    return RoutingTrace.from_external(routed, num_experts=8)
