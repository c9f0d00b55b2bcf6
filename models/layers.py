"""Shared transformer layers: norms, rotary embeddings, grouped-query attention with a KV cache, and the
per-layer cache every layer kind keeps (`LayerKV`, `LinearState`).

Used by every family through `models/base.py`; nothing here knows a model family, only `MoEConfig` features.

Dimension letters: B batch, T new tokens, S cache length, D hidden, H query heads, K key/value heads,
G = H / K query heads per KV head, E head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import MoEConfig, RopeConfig


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x in float32, divided by its root mean square over the last axis (every RMSNorm's first step)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back, as the Mixtral/Qwen reference implementations do."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight[...] * rms_normalized(x, self.eps).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (Phi-3.5-MoE); statistics in float32."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class ZeroCenteredRMSNorm(nnx.Module):
    """RMSNorm whose stored weight is centred on zero: `x / rms(x) * (1 + w)`, all in float32 before the cast
    back (Qwen3-Next and Qwen3.5 store and train `w`, initialised to zeros)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


NORMS = {"rms": RMSNorm, "layer": LayerNorm, "rms_zero_centered": ZeroCenteredRMSNorm}


def make_norm(cfg: MoEConfig, *, dtype: jnp.dtype, dim: int | None = None) -> nnx.Module:
    """The config's norm over `dim` features (default: the hidden size)."""
    return NORMS[cfg.norm](dim or cfg.hidden_size, cfg.norm_eps, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------
# Linear layers. Weights are stored `[out, in]`, the Hugging Face / PyTorch layout, because XLA:CPU
# multiplies by them much faster than by `[in, out]` (measured on this 2-core CPU, float32, 8 distinct
# 1024 x 3584 expert matrices per program):
#   one token (decode):    x `[1, in]` contracted with W `[out, in]` on both minor dims reads the weights at
#                          ~20 GB/s, `x @ W[in, out]` at ~13 GB/s;
#   M >= 2 tokens:         `W[out, in] @ X^T[in, M]` with X^T materialised runs a SwiGLU expert 1.8x
#                          (M = 8), 2.2x (M = 32) and 1.3x (M = 128) faster than any form XLA picks when
#                          the transpose is left for it to fold into the dot.
# `linear` therefore materialises the transposed activations on CPU (optimization barriers stop XLA from
# folding the transposes back into the dot) and leaves other backends to XLA's own layout choice.


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T`: x `[..., in]`, w `[out, in]` -> `[..., out]` in the promoted dtype."""
    lead, fan_in = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    x2 = x.reshape(rows, fan_in)
    if rows > 1 and jax.default_backend() == "cpu":
        x_t = jax.lax.optimization_barrier(x2.T)  # [in, M], laid out as such
        y = jax.lax.optimization_barrier(w @ x_t).T  # [out, M] -> [M, out]
    else:
        y = jax.lax.dot_general(x2, w, (((1,), (1,)), ((), ())))
    return y.reshape(*lead, w.shape[0])


class Linear(nnx.Module):
    """`y = x W^T + b` with `weight` `[out, in]` (the HF tensor as it is) and an optional `bias` `[out]`."""

    def __init__(
        self,
        fan_in: int,
        fan_out: int,
        *,
        use_bias: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None = None,
        key: jax.Array | None = None,
    ):
        """Initialised LeCun-normal over `fan_in` (as `nnx.Linear`) from `key`, else from one `rngs` draw."""
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        key = rngs.params() if key is None else key
        self.weight = nnx.Param(init(key, (fan_out, fan_in), dtype))
        self.bias = nnx.Param(jnp.zeros((fan_out,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = linear(x.astype(self.weight.dtype), self.weight[...])
        return y if self.bias is None else y + self.bias[...]


# ----------------------------------------------------------------------------------------------------------
# Positions, masks and rotary embeddings for one call (prefill or decode step).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the new tokens of one call sit in the (left-padded) KV cache.

    `generate` left pads its rows so that every row writes its new tokens at the same cache index
    `write_index` (a scalar); continuous batching (`fmoe_jax/batching.py`) gives each row its own (`[B]`).
    Row b's real tokens start at cache index `key_start[b]`, and its token at cache index i has position
    `i - key_start[b]`.
    """

    write_index: jax.Array  # [] or [B] int32, cache index of the first new token (of every row, or per row)
    key_start: jax.Array  # [B] int32, first valid cache index per row
    row_active: jax.Array  # [B] bool, False for rows that finished (their tokens count as padding)
    num_new: int = dataclasses.field(metadata=dict(static=True))  # T

    @property
    def query_index(self) -> jax.Array:  # [1, T] or [B, T]: cache index of each new token
        w = jnp.asarray(self.write_index)
        if w.ndim == 0:
            return (w + jnp.arange(self.num_new, dtype=jnp.int32))[None, :]
        return w[:, None] + jnp.arange(self.num_new, dtype=jnp.int32)[None, :]

    @property
    def positions(self) -> jax.Array:  # [B, T]
        return jnp.maximum(self.query_index - self.key_start[:, None], 0)

    @property
    def token_valid(self) -> jax.Array:  # [B, T] False on left padding and in finished rows
        return (self.query_index >= self.key_start[:, None]) & self.row_active[:, None]

    @property
    def continues(self) -> jax.Array:  # [B] bool
        """Row b already holds tokens of its sequence before this call (its first new token is not its
        first): a recurrent state carries on. Otherwise the call starts the row afresh, whatever an earlier
        request left in its state (a reused continuous-batching slot, a reused prefill cache)."""
        return jnp.asarray(self.write_index) > self.key_start


def write_new(cache: jax.Array, new: jax.Array, layout: Layout) -> jax.Array:
    """`new` `[B, T, ...]` written into `cache` `[B, S, ...]` at the layout's write index (one for every
    row: a slice update; one per row: a scatter)."""
    new = new.astype(cache.dtype)
    w = jnp.asarray(layout.write_index)
    tail = (0,) * (cache.ndim - 2)
    if w.ndim == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, w, *tail))
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, *tail)))(cache, new, w)


def rope_tables(
    rope: RopeConfig, head_dim: int, positions: jax.Array, valid: jax.Array, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[B, T, E]` for `positions` `[B, T]`.

    LongRoPE follows the original Phi-3.5-MoE code: the factor set (short or long) and the mscale are
    chosen per call from the largest position in the batch, so keys cached before the sequence crossed
    `original_max_position_embeddings` keep their earlier rotation.
    """
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)  # [E/2]
    scale = jnp.float32(1.0)
    if rope.kind == "yarn":
        inv_freq = _yarn_inv_freq(rope, head_dim)
        scale = jnp.float32(rope.attention_factor)
    if rope.kind == "longrope":
        seq_len = jnp.max(jnp.where(valid, positions, 0)) + 1
        is_long = seq_len > rope.original_max_position_embeddings
        factors = jnp.where(
            is_long, jnp.asarray(rope.long_factor, jnp.float32), jnp.asarray(rope.short_factor, jnp.float32)
        )
        inv_freq = 1.0 / (factors * rope.theta**exponent)
        scale = jnp.where(is_long, jnp.float32(rope.long_mscale), jnp.float32(rope.short_mscale))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> jax.Array:
    """YaRN frequencies `[E/2]`: the original ones for dimensions that turn more than `beta_fast` times over
    the original context, interpolated (`/ factor`) below `beta_slow` turns, a linear blend between."""

    def dim_of(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the context
        context = rope.original_max_position_embeddings
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: avoids dividing by zero
    pos_freqs = rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[B, T, N, E]`, cos/sin `[B, T, E]` (rotate-half convention of the HF reference)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`apply_rope` on the first E' dimensions of each head (E': the tables' width); the rest pass as is."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)


# ----------------------------------------------------------------------------------------------------------
# KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """One layer's cache, axis 1 the cache position. Grouped-query attention caches keys `k` and values
    `v` `[B, S, K, E]`; multi-head latent attention (`models/mla.py`) caches what it needs instead: the
    normalised latent `k` `[B, S, 1, kv_lora_rank]` and the rotated shared key `v` `[B, S, 1, rope_dim]`."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearState:
    """A linear-attention (Gated DeltaNet, `models/gated_deltanet.py`) layer's cache: a fixed size per row,
    however long the sequence. Axis 0 is the row, as in `LayerKV`, so batches move rows alike."""

    conv: jax.Array  # [B, K-1, C] the convolution's last K-1 inputs (queries, keys, values), model dtype
    recurrent: jax.Array  # [B, HV, Dk, Dv] float32, the delta rule's state per value head


LayerCache = LayerKV | LinearState


def init_kv_cache(cfg: MoEConfig, batch: int, length: int, dtype: jnp.dtype) -> list[LayerCache]:
    """The per-request cache: one entry per layer, zero filled, a `LayerKV` of `length` positions for an
    attention layer and a `LinearState` for a linear-attention one; a list so the engine can donate one
    layer's cache at a time."""
    if cfg.is_mla:
        k_shape, v_shape = (batch, length, 1, cfg.kv_lora_rank), (batch, length, 1, cfg.qk_rope_head_dim)
    else:
        k_shape = v_shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    cache: list[LayerCache] = []
    for i in range(cfg.num_layers):
        if cfg.is_linear(i):
            la = cfg.linear_attention
            cache.append(
                LinearState(
                    jnp.zeros((batch, la.conv_kernel - 1, la.conv_dim), dtype),
                    jnp.zeros((batch, la.num_value_heads, la.key_head_dim, la.value_head_dim), jnp.float32),
                )
            )
        else:
            cache.append(LayerKV(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)))
    return cache


def cache_shape(cache: list[LayerCache]) -> tuple[int, int]:
    """(rows, positions) of a per-request cache; positions 0 when no layer keeps keys."""
    rows = jax.tree.leaves(cache[0])[0].shape[0]
    return rows, next((c.k.shape[1] for c in cache if isinstance(c, LayerKV)), 0)


def attention_mask(layout: Layout, length: int, window: int | None) -> jax.Array:
    """`[B, T, S]` bool: causal over the cache, no left padding, within the sliding window if any."""
    q_idx = layout.query_index[:, :, None]  # [1 or B, T, 1]
    k_idx = jnp.arange(length, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    allowed = (k_idx <= q_idx) & (k_idx >= layout.key_start[:, None, None])
    if window is not None:
        allowed &= (q_idx - k_idx) < window
    return allowed


class Attention(nnx.Module):
    """Grouped-query attention that appends the new keys/values to the cache and attends over it.

    Optional per config: RMSNorm of queries and keys before RoPE, per head (`qk_norm="head"`, Qwen3) or
    over the whole projection (`"full"`, OLMoE), OLMoE's clamp of q, k and v (`clip_qkv`), RoPE on the first
    `rope_dim` dimensions of each head only (`partial_rotary_factor`: GLM-4.5, Qwen3-Next), gpt-oss's sinks
    (a learned logit per head that joins the softmax over the keys and takes its share of the probability
    without adding a value), and an output gate (`attention_output_gate`, Qwen3-Next: q_proj yields per head
    the query and a gate, and the output is scaled by the gate's sigmoid).
    """

    def __init__(self, cfg: MoEConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, rngs=rngs)
        self.output_gate = cfg.attention_output_gate
        self.q_proj = Linear(d, h * e * (2 if self.output_gate else 1), use_bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(d, k * e, use_bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(d, k * e, use_bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(h * e, d, use_bias=cfg.o_bias, **kw)
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, e
        self.qk_norm, self.clip = cfg.qk_norm, cfg.clip_qkv
        self.rope_dim = cfg.rope_dim
        self.sinks = nnx.Param(jnp.zeros((h,), dtype)) if cfg.attention_sinks else None
        if cfg.qk_norm != "none":
            q_dim, k_dim = (e, e) if cfg.qk_norm == "head" else (h * e, k * e)
            norm = ZeroCenteredRMSNorm if cfg.norm == "rms_zero_centered" else RMSNorm
            self.q_norm = norm(q_dim, cfg.norm_eps, dtype=dtype)
            self.k_norm = norm(k_dim, cfg.norm_eps, dtype=dtype)

    def __call__(
        self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: LayerKV, layout: Layout, window: int | None
    ) -> tuple[jax.Array, LayerKV]:
        b, t, _ = x.shape
        h, k, e = self.num_heads, self.num_kv_heads, self.head_dim
        q, k_new, v_new = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*E], [B, T, K*E] x 2
        if self.output_gate:  # per head: E query dimensions, then E gate dimensions
            q, gate = jnp.split(q.reshape(b, t, h, 2 * e), 2, axis=-1)
            q, gate = q.reshape(b, t, h * e), gate.reshape(b, t, h * e)
        if self.qk_norm == "full":
            q, k_new = self.q_norm(q), self.k_norm(k_new)
        if self.clip is not None:
            q, k_new, v_new = (jnp.clip(a, -self.clip, self.clip) for a in (q, k_new, v_new))
        q, k_new, v_new = q.reshape(b, t, h, e), k_new.reshape(b, t, k, e), v_new.reshape(b, t, k, e)
        if self.qk_norm == "head":
            q, k_new = self.q_norm(q), self.k_norm(k_new)
        q, k_new = apply_partial_rope(q, *rope), apply_partial_rope(k_new, *rope)

        keys, values = write_new(kv.k, k_new, layout), write_new(kv.v, v_new, layout)
        allowed = attention_mask(layout, keys.shape[1], window)  # [B, T, S]

        qg = q.reshape(b, t, k, h // k, e)
        scores = jnp.einsum("btkge,bske->bkgts", qg, keys.astype(q.dtype)) * (1.0 / math.sqrt(e))
        scores = jnp.where(allowed[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = self._softmax(scores).astype(q.dtype)
        out = jnp.einsum("bkgts,bske->btkge", probs, values.astype(q.dtype)).reshape(b, t, h * e)
        if self.output_gate:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), LayerKV(keys, values)

    def _softmax(self, scores: jax.Array) -> jax.Array:
        """Softmax over the keys of `[B, K, G, T, S]` float32 scores, each head's sink one more key."""
        if self.sinks is None:
            return jax.nn.softmax(scores, axis=-1)
        b, k, g, t, _ = scores.shape
        sink = jnp.broadcast_to(self.sinks[...].astype(jnp.float32).reshape(1, k, g, 1, 1), (b, k, g, t, 1))
        return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
