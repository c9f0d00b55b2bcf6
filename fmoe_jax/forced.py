"""Forced routing: a recorded `RoutingTrace` replayed live (`generate(..., forced_routing=trace)`).

Every MoE layer of every step uses the trace's experts and weights instead of its router's choice (the router
still runs, so its cost is paid), and an offload policy hears the trace's routing, probabilities and
semantic context where the trace has them: the events the simulator gives it for the same trace. So a live
run on a model with random weights measures what serving a real model's routing costs (`random_model`,
`benchmarks/live_replay.py`). `ForcedSteps` checks a trace against a model and a batch of prompts, and lays
out each step's arrays as the engines take them.
"""

from __future__ import annotations

import numpy as np

from fmoe_jax.models import ForcedRouting, MoEConfig

from .engines import ForcedStep
from .errors import ArgumentError
from .trace import Iteration, RoutingTrace


class ForcedSteps:
    """A trace checked against a model's config and a batch's prompts; `step(i, ...)` is step i's routing.

    The trace holds one request per prompt, in order; each request's first iteration has one token per
    prompt token (the prefill), each later one a single token (a decode step), and at least
    `max_new_tokens` iterations in all. Missing mixing weights are 1/k. Probabilities (and the semantic
    context) are forced only where every iteration has them (and its width is the model's); otherwise the
    router's probabilities (the step's own embedding) stand.
    """

    def __init__(self, trace: RoutingTrace, cfg: MoEConfig, prompts: list[list[int]], max_new_tokens: int):
        if not isinstance(trace, RoutingTrace):
            raise ArgumentError(
                "forced_routing", f"forced_routing must be a RoutingTrace, got {type(trace).__name__}"
            )
        want = {"num_layers": cfg.num_moe_layers, "num_experts": cfg.num_experts, "top_k": cfg.top_k}
        for key, value in want.items():
            if trace.meta.get(key) != value:
                raise ArgumentError(
                    "forced_routing",
                    f"forced_routing has {key}={trace.meta.get(key)} but the model has {value}; force a "
                    "trace of the model's MoE layers, experts and top-k (random_model builds one of its "
                    "sizes)",
                )
        if len(trace.requests) != len(prompts):
            raise ArgumentError(
                "forced_routing",
                f"forced_routing has {len(trace.requests)} requests for {len(prompts)} prompts; pass one "
                "request per prompt, in order",
            )
        for r, (request, prompt) in enumerate(zip(trace.requests, prompts, strict=True)):
            _check_request(r, request.iterations, len(prompt), max_new_tokens, cfg.num_experts)
        its = [it for request in trace.requests for it in request.iterations]
        self.requests = [request.iterations for request in trace.requests]
        self.top_k, self.num_layers, self.num_experts = cfg.top_k, cfg.num_moe_layers, cfg.num_experts
        self.with_probs = all(it.probs is not None for it in its)
        self.with_embeds = all(it.embeds is not None and it.embeds.shape[-1] == cfg.hidden_size for it in its)
        self.hidden = cfg.hidden_size

    def step(self, i: int, width: int, active: np.ndarray) -> ForcedStep:
        """Step i's routing (0: the prefill) for rows `active` `[B]`, left padded to `width` tokens: arrays
        `[B * width, ...]`, zeros in padding and in inactive rows."""
        rows = len(self.requests)
        ids = np.zeros((rows, width, self.num_layers, self.top_k), np.int32)
        weights = np.zeros(ids.shape, np.float32)
        probs = (
            np.zeros((rows, width, self.num_layers, self.num_experts), np.float32)
            if self.with_probs
            else None
        )
        embeds = np.zeros((rows, width, self.hidden), np.float32) if self.with_embeds else None
        for b, iterations in enumerate(self.requests):
            if not active[b] or i >= len(iterations):
                continue
            it = iterations[i]
            t = it.num_tokens
            ids[b, width - t :] = it.ids
            weights[b, width - t :] = 1.0 / self.top_k if it.weights is None else it.weights
            if probs is not None:
                probs[b, width - t :] = it.probs
            if embeds is not None:
                embeds[b, width - t :] = it.embeds
        n = rows * width
        routing = ForcedRouting(
            ids.reshape(n, self.num_layers, -1),
            weights.reshape(n, self.num_layers, -1),
            None if probs is None else probs.reshape(n, self.num_layers, -1),
        )
        return ForcedStep(routing, None if embeds is None else embeds.reshape(n, -1))


def _check_request(r: int, iterations: list[Iteration], prompt: int, steps: int, num_experts: int) -> None:
    """ArgumentError naming request r's first disagreement with its prompt and the steps generate runs."""

    def refuse(why: str) -> None:
        raise ArgumentError("forced_routing", f"forced_routing request {r}: {why}")

    if len(iterations) < steps:
        refuse(f"has {len(iterations)} iterations, but generate runs up to max_new_tokens={steps} steps")
    if iterations[0].num_tokens != prompt:
        refuse(f"its first iteration routes {iterations[0].num_tokens} tokens, its prompt has {prompt}")
    for i, it in enumerate(iterations[:steps]):
        if i and it.num_tokens != 1:
            refuse(f"iteration {i} routes {it.num_tokens} tokens; a decode step routes one")
        if it.ids.size and (it.ids.min() < 0 or it.ids.max() >= num_experts):
            refuse(f"iteration {i} names experts outside [0, {num_experts})")
