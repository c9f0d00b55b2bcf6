"""The simulator's iterations as the live engine lays them out (`Step`): the rows of a replayed batch's
requests, left padded, with what the replay charges and the driver asks worked out once an iteration
(valid tokens per layer and expert, each layer's needed experts); for a batch of one request, once for the
whole request (`Counted`). `offload/simulator.py` replays them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .policies import Policy
from .trace import RoutingTrace


@dataclasses.dataclass
class Step:
    """One iteration of a batch in the live engine's layout: N = B * T rows, invalid rows zero."""

    valid: np.ndarray  # [B, T] bool
    ids: np.ndarray  # [N, L, k] int32
    probs: np.ndarray | None  # [N, L, J] float32
    embeds: np.ndarray | None  # [N, H] float32
    hidden: np.ndarray | None  # [N, L, D] float32
    fed: np.ndarray | None  # [N] int64 token ids fed, where the policy `needs_tokens` and the trace has them
    new_tokens: np.ndarray  # [R] new tokens of each active row
    past_tokens: np.ndarray  # [R] tokens each active row had before this iteration
    routed: np.ndarray  # [L, J] valid tokens routed to each expert
    needed: list[tuple[int, ...]]  # [L] the experts the valid tokens chose, ascending (`Routed.needed`)
    # [L] the valid tokens routed to each of `needed`, in its order: what the cost model charges a chunk of
    # all of a layer's needed experts (`CostModel.experts_s`, a function of the chunk's size and token total).
    counts: list[tuple[int, ...]]

    def tokens(self, layer: int, keys: list[Any]) -> tuple[int, ...]:
        """The valid tokens routed to each expert of `keys` (`(layer, expert)`, some of `layer`'s needed
        experts), in their order."""
        row = self.routed[layer]
        return tuple([int(row[e]) for _, e in keys])


def layout(trace: RoutingTrace, i: int, policy: Policy, past: list[list[int]]) -> Step:
    """Iteration `i` of a batch as the engine lays it out: rows of the requests with an iteration `i`, left
    padded to the longest of them; only the arrays the policy reads. `past[b][i]`: the tokens request `b`
    has before its iteration `i`."""
    requests = trace.requests
    meta = trace.meta
    rows = len(requests)
    active = [b for b, r in enumerate(requests) if len(r.iterations) > i]
    width = max(requests[b].iterations[i].num_tokens for b in active)  # T
    layers, top_k, num_experts = meta["num_layers"], meta["top_k"], meta["num_experts"]
    valid = np.zeros((rows, width), bool)
    ids = np.zeros((rows, width, layers, top_k), np.int32)
    probs = np.zeros((rows, width, layers, num_experts), np.float32) if policy.needs_probs else None
    embeds = np.zeros((rows, width, meta["embed_dim"]), np.float32) if policy.needs_semantic else None
    hidden = None
    fed = np.zeros((rows, width), np.int64) if policy.needs_tokens else None
    new_tokens, past_tokens = [], []
    for b in active:
        it = requests[b].iterations[i]
        t = it.num_tokens
        valid[b, width - t :] = True
        ids[b, width - t :] = it.ids
        if probs is not None:
            probs[b, width - t :] = it.probs
        if embeds is not None:
            embeds[b, width - t :] = it.embeds
        if policy.needs_hidden:
            if hidden is None:
                hidden = np.zeros((rows, width, layers, it.hidden.shape[-1]), np.float32)
            hidden[b, width - t :] = it.hidden
        if fed is not None:
            if it.tokens is None:
                fed = None  # a request without them: the policy hears none this iteration
            else:
                fed[b, width - t :] = it.tokens
        new_tokens.append(t)
        past_tokens.append(past[b][i])
    n = rows * width
    ids = ids.reshape(n, layers, top_k)
    # Valid tokens per layer and expert: one count over every layer (offset by layer) for the iteration.
    chosen = ids[valid.reshape(-1)] + (np.arange(layers, dtype=np.int32) * num_experts)[:, None]  # [n, L, k]
    routed = np.bincount(chosen.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)
    return Step(
        valid=valid,
        ids=ids,
        probs=None if probs is None else probs.reshape(n, layers, num_experts),
        embeds=None if embeds is None else embeds.reshape(n, -1),
        hidden=None if hidden is None else hidden.reshape(n, layers, -1),
        fed=None if fed is None else fed.reshape(n),
        new_tokens=np.asarray(new_tokens),
        past_tokens=np.asarray(past_tokens),
        routed=routed,
        **_needed(routed),
    )


def _needed(routed: np.ndarray) -> dict[str, list[tuple[int, ...]]]:
    """Per row of `routed` (`[..., J]` valid tokens per expert, rows flattened in order), the experts with
    any, ascending (`needed`: `Routed.needed`), and their token counts in that order (`counts`)."""
    where = np.nonzero(routed)
    experts = where[-1].tolist()  # row by row, each row's ascending
    counts = routed[where].tolist()
    ends = np.cumsum(np.count_nonzero(routed, axis=-1).ravel()).tolist()
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    return dict(
        needed=[tuple(experts[a:b]) for a, b in bounds], counts=[tuple(counts[a:b]) for a, b in bounds]
    )


class Counted:
    """A batch of one request, laid out as `layout` would, with its routing counted for every iteration at
    once (one count over the request instead of one per iteration): no padding, every token valid."""

    def __init__(self, request: Any, meta: dict[str, Any]):
        self.request = request
        layers, num_experts = meta["num_layers"], meta["num_experts"]
        iterations = request.iterations
        tokens = [it.num_tokens for it in iterations]
        ids = np.concatenate([it.ids for it in iterations]).reshape(sum(tokens), layers, -1)  # [n, L, k]
        first = np.repeat(np.arange(len(iterations)) * layers, tokens)[:, None] + np.arange(layers)  # [n, L]
        chosen = first[:, :, None] * num_experts + ids
        shape = (len(iterations), layers, num_experts)
        routed = np.bincount(chosen.ravel(), minlength=np.prod(shape)).reshape(shape)
        self.routed = routed  # [I, L, J]
        found = _needed(routed)
        self.needed, self.counts = found["needed"], found["counts"]  # [I * L] each
        self.layers = layers

    def layout(self, i: int, policy: Policy, past: list[list[int]]) -> Step:
        it = self.request.iterations[i]
        t, layers = it.num_tokens, self.layers
        return Step(
            valid=np.ones((1, t), bool),
            ids=it.ids.astype(np.int32).reshape(t, layers, -1),
            probs=it.probs.astype(np.float32).reshape(t, layers, -1) if policy.needs_probs else None,
            embeds=it.embeds.astype(np.float32).reshape(t, -1) if policy.needs_semantic else None,
            hidden=it.hidden.astype(np.float32).reshape(t, layers, -1) if policy.needs_hidden else None,
            fed=it.tokens if policy.needs_tokens else None,
            new_tokens=np.asarray([t]),
            past_tokens=np.asarray([past[0][i]]),
            routed=self.routed[i],
            needed=self.needed[i * layers : (i + 1) * layers],
            counts=self.counts[i * layers : (i + 1) * layers],
        )
