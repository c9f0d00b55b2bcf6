"""The events a policy receives, one small frozen dataclass each, made by the iteration driver
(`offload/driver.py`) for the live engine and the simulator alike.

Order within a `generate` call (or a replayed batch): `RequestStart`, then per iteration `IterationStart`,
one `LayerRouted` per MoE layer in layer order, and `Policy.on_iteration_end()`. Arrays are host NumPy
arrays the policy may keep; N = B * T tokens of the iteration, rows of invalid tokens are not meaningful.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class RequestStart:
    """A batch of requests begins (one `generate` call, or one replayed trace)."""

    batch: int  # B, rows of the batch


@dataclasses.dataclass(frozen=True, slots=True)
class IterationStart:
    """An iteration over N = B * T new tokens starts (prefill: T > 1; decode: T = 1)."""

    valid: np.ndarray  # [B, T] bool: False for padding and finished rows
    embeds: np.ndarray | None = None  # [N, H] float32, the semantic context (policies that `needs_semantic`)
    # Each row's request, an id stable across iterations (continuous batching, where a row's request
    # changes between `RequestStart`s); None: the rows are the requests of the last `RequestStart`.
    requests: tuple[int, ...] | None = None
    tokens: np.ndarray | None = None  # [N] int64 token ids fed (policies that `needs_tokens`; None: unknown)

    @property
    def decoding(self) -> bool:
        return self.valid.shape[1] == 1


@dataclasses.dataclass(frozen=True, slots=True)
class LayerRouted:
    """MoE layer `layer` has routed its tokens (the trajectory context); its experts have not run yet."""

    layer: int  # MoE-layer index
    ids: np.ndarray  # [N, k] int32, each token's chosen experts
    valid: np.ndarray  # [B, T] bool, as in `IterationStart`
    needed: tuple[int, ...]  # the distinct experts the valid tokens chose, ascending
    probs: np.ndarray | None = None  # [N, J] float32 router probabilities (policies that `needs_probs`)
    hidden: np.ndarray | None = None  # [N, D] float32 router input (policies that `needs_hidden`)

    @property
    def token_valid(self) -> np.ndarray:
        """`valid` flattened to the N tokens: `[N]` bool."""
        return self.valid.reshape(-1)


def needed_experts(ids: np.ndarray, valid: np.ndarray | None) -> tuple[int, ...]:
    """Distinct experts chosen by the valid tokens: ids `[N, k]`, valid `[N]` (None: every token) ->
    ascending expert ids."""
    chosen = ids if valid is None else ids[valid]
    return tuple(sorted(set(chosen.ravel().tolist())))
