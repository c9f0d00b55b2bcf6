"""Multi-head latent attention (DeepSeek-V2): keys and values decompressed from a small cached latent.

`DecoderLayer` (`models/base.py`) uses it instead of `Attention` when `MoEConfig.kv_lora_rank > 0`. The cache
(`LayerKV`, `models/layers.py`) holds per token the normalised latent `c` `[kv_lora_rank]` and the rotated
rotary key `k_pe` `[qk_rope_head_dim]` shared by every head: 512 + 64 = 576 numbers per token and layer in
DeepSeek-V2-Lite instead of 16 heads x (192 + 128) = 5,120 for full keys and values.

Dimension letters: B batch, T new tokens, S cache length, D hidden, H heads, N qk_nope_head_dim,
P qk_rope_head_dim, V v_head_dim, R kv_lora_rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import MoEConfig, yarn_mscale
from .layers import LayerKV, Layout, Linear, RMSNorm, apply_rope, attention_mask, write_new

# The latent norms' epsilon is fixed in DeepSeek-V2's code (and transformers'), not `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: MoEConfig) -> float:
    """`1 / sqrt(N + P)`, times YaRN's `mscale(factor, mscale_all_dim)^2` when the config sets it."""
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if cfg.rope.kind == "yarn" and cfg.rope.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
    return scale


def deinterleave(x: jax.Array) -> jax.Array:
    """`[..., P]` rotated in pairs (0, 1), (2, 3), ... -> pairs (i, i + P/2), the layout `apply_rope` rotates.

    DeepSeek rotates adjacent pairs (its reference code views them as complex numbers); queries and keys are
    permuted alike, so their dot products, all that attention reads, are those of the reference.
    """
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nnx.Module):
    """MLA with its latent cache. Prefill decompresses the cached latents into per-head keys and values;
    a decode step (T = 1) instead folds the decompression into the query and the output (`absorbed`), which
    reads the small latents once instead of building `[S, H, N + V]` keys and values from them per token."""

    def __init__(self, cfg: MoEConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_heads
        n, p, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, **kw)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * (n + p), **kw)
        else:
            self.q_proj = Linear(d, h * (n + p), **kw)
        self.kv_a_proj = Linear(d, r + p, **kw)
        self.kv_a_norm = RMSNorm(r, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(r, h * (n + v), **kw)
        self.o_proj = Linear(h * v, d, **kw)
        self.num_heads, self.dims = h, (n, p, v, r)
        self.low_rank_q = bool(cfg.q_lora_rank)
        self.scale = softmax_scale(cfg)
        self.interleaved = cfg.rope_interleave

    def __call__(
        self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: LayerKV, layout: Layout, window: int | None
    ) -> tuple[jax.Array, LayerKV]:
        """x `[B, T, D]`, rope cos/sin `[B, T, P]` -> output `[B, T, D]` and the cache with the new tokens."""
        b, t, _ = x.shape
        h, (n, p, v, r) = self.num_heads, self.dims
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q = q.reshape(b, t, h, n + p)
        q_nope, q_pe = q[..., :n], q[..., n:]  # [B, T, H, N], [B, T, H, P]
        compressed = self.kv_a_proj(x)  # [B, T, R + P]
        latent = self.kv_a_norm(compressed[..., :r])[:, :, None, :]  # [B, T, 1, R]
        k_pe = compressed[..., None, r:]  # [B, T, 1, P]
        cos, sin = rope
        if self.interleaved:  # DeepSeek's checkpoints; a config may say `rope_interleave: false`
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)

        latents, rope_keys = write_new(kv.k, latent, layout), write_new(kv.v, k_pe, layout)
        allowed = attention_mask(layout, latents.shape[1], window)  # [B, T, S]

        c = latents[:, :, 0].astype(q.dtype)  # [B, S, R]
        w_b = self.kv_b_proj.weight[...].reshape(h, n + v, r)
        w_k, w_v = w_b[:, :n], w_b[:, n:]  # [H, N, R], [H, V, R]
        scores = jnp.einsum("bthp,bsp->bhts", q_pe, rope_keys[:, :, 0].astype(q.dtype))
        if t == 1:
            q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, w_k)
            scores = scores + jnp.einsum("bthr,bsr->bhts", q_latent, c)
        else:
            k_nope = jnp.einsum("bsr,hnr->bshn", c, w_k)
            scores = scores + jnp.einsum("bthn,bshn->bhts", q_nope, k_nope)
        scores = (scores * self.scale).astype(jnp.float32)
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        if t == 1:
            out = jnp.einsum("bthr,hvr->bthv", jnp.einsum("bhts,bsr->bthr", probs, c), w_v)
        else:
            out = jnp.einsum("bhts,bshv->bthv", probs, jnp.einsum("bsr,hvr->bshv", c, w_v))
        return self.o_proj(out.reshape(b, t, h * v)), LayerKV(latents, rope_keys)
