"""Token sampling methods as small frozen dataclasses, applied inside the jitted decode step.

`fmoe_jax.generate(..., sampling=Greedy() | Sample(temperature, top_k, top_p))`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Always the most likely token (ties: lowest id)."""

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sample:
    """Temperature sampling, optionally restricted to the `top_k` most likely tokens and/or the smallest
    set whose probability reaches `top_p` (nucleus). `top_k=0` and `top_p=1.0` disable the restriction."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use Greedy() for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits `[B, V]` float32, a PRNG key (typed, or its raw `key_data`) -> token ids `[B]`."""
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        logits = logits.astype(jnp.float32) / self.temperature
        neg = jnp.finfo(jnp.float32).min
        if self.top_k:
            kth = jax.lax.top_k(logits, min(self.top_k, logits.shape[-1]))[0][:, -1:]
            logits = jnp.where(logits < kth, neg, logits)
        if self.top_p < 1.0:
            order = jnp.argsort(-logits, axis=-1)
            sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
            cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
            # keep a token if the mass before it is below top_p (so the first token is always kept)
            keep_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < self.top_p
            keep = (
                jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
            )
            logits = jnp.where(keep, logits, neg)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


Sampling = Greedy | Sample
