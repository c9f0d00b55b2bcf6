"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5-MoE (three of every four layers).

`DecoderLayer` (`models/base.py`) uses `GatedDeltaNet` instead of softmax attention where
`MoEConfig.is_linear(layer)`. Per token: a short causal convolution over the projected queries, keys and
values, then the gated delta rule, a recurrent state `S` `[Dk, Dv]` per value head that decays by `exp(g)`
and is corrected towards each new key-value pair at the rate `beta`:

    S = exp(g) S;  S = S + beta k (v - k^T S)^T;  out = q^T S

then an RMSNorm of the output gated by `silu(z)`. The layer's cache is `LinearState` (`models/layers.py`): the
state and the convolution's last inputs, a fixed size per row. A decode step applies the rule once
(`delta_rule_step`); a prefill runs the chunked form (`chunked_delta_rule`): within a chunk of C tokens the
updates are solved at once as a triangular system, and a `lax.scan` carries the state from chunk to chunk, so
no Python loop runs per token. The rule runs in float32, as transformers' reference does.

Padding is a no-op: a left-padding token, or a token of a finished row, neither decays nor writes the state
(g = 0, beta = 0) nor enters the convolution (its input is zero); a row whose call starts its sequence
(`Layout.continues` False) starts from a zero state, whatever the cache held before.

Dimension letters: B batch, T new tokens, D hidden, Hk key heads, H value heads, Dk / Dv key / value head
dims, C channels of the convolution (2 Hk Dk + H Dv), K taps, N chunks, L tokens per chunk.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import MoEConfig
from .layers import Layout, Linear, LinearState, rms_normalized

CHUNK = 64  # tokens per chunk of the prefill (transformers' reference uses the same)
L2_EPS = 1e-6  # queries and keys are L2-normalised with this epsilon, as in the reference


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def delta_rule_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token: q, k `[B, H, Dk]`, v `[B, H, Dv]`, g, beta `[B, H]`, state `[B, H, Dk, Dv]` (float32) ->
    output `[B, H, Dv]` and the new state."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, state), state


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """The delta rule over T tokens at once (what `delta_rule_step` T times gives, up to rounding).

    Args:
      q, k: `[B, T, H, Dk]` float32 (normalised; q scaled), v: `[B, T, H, Dv]`, g, beta: `[B, T, H]`,
        state: `[B, H, Dk, Dv]` before the first token.
    Returns:
      outputs `[B, T, H, Dv]` and the state after the last token.

    Within a chunk, with G the cumulative log decay from the chunk's start, the token i's corrected value is
    `u_i = beta_i (v_i - e^{G_i} k_i^T S) - sum_{j<i} beta_i e^{G_i - G_j} (k_i . k_j) u_j`: a unit lower
    triangular system `(I + A) U = beta (V - e^G K S)`, solved once per chunk for the state-free part and the
    part linear in S. Then `out_i = e^{G_i} q_i^T S + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j` and the chunk
    leaves `S' = e^{G_L} S + sum_j e^{G_L - G_j} k_j u_j^T`. The system's inverse is a product of a few
    matmuls (`unit_lower_inverse`).
    """
    b, t, h, dk = k.shape
    size = min(chunk, t)
    pad = -t % size
    if pad:  # no-op tokens at the end: no decay, no write
        q, k, v, g, beta = (
            jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta)
        )
    n = (t + pad) // size

    def chunks(a: jax.Array) -> jax.Array:  # [B, T, H, ...] -> [N, B, H, L, ...]
        a = a.reshape(b, n, size, h, *a.shape[3:])
        return jnp.moveaxis(a, (1, 3), (0, 2))

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, L]
    lower = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [.., L, L], i >= j
    k_beta = k * beta[..., None]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay * ~jnp.eye(size, dtype=bool)
    inverse = unit_lower_inverse(system)
    u0 = inverse @ (v * beta[..., None])  # u = u0 - w S
    w = inverse @ (k_beta * jnp.exp(cum)[..., None])
    scores = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, xs):
        u0_c, w_c, scores_c, q_c, k_c, decay_c = xs
        u = u0_c - jnp.einsum("bhlk,bhkv->bhlv", w_c, s)
        out = jnp.einsum("bhlk,bhkv->bhlv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", scores_c, u)
        s = s * decay_c + jnp.einsum("bhlk,bhlv->bhkv", k_c, u)
        return s, out

    state, out = jax.lax.scan(step, state, (u0, w, scores, q_decayed, k_decayed, chunk_decay))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, t + pad, h, -1)  # [N, B, H, L, Dv] -> [B, T, H, Dv]
    return out[:, :t], state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """`(I + a)^-1` of a strictly lower triangular `a` `[..., L, L]`: the sum of `(-a)^n` for n < L (`a` is
    nilpotent), as the product `(I - a)(I + a^2)(I + a^4)...` of log2(L) factors: a few batched matmuls,
    which XLA runs well on every backend (on CPU, `solve_triangular` calls LAPACK one small system at a time,
    an order of magnitude slower at L = 64)."""
    size = a.shape[-1]
    power = -a
    inverse = jnp.eye(size, dtype=a.dtype) + power
    for _ in range(max(0, math.ceil(math.log2(size)) - 1)):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution with SiLU: x `[B, T, C]` after the K-1 earlier inputs `window`
    `[B, K-1, C]`, weight `[C, 1, K]` (as transformers stores it). Returns `[B, T, C]` in x's dtype and the
    last K-1 inputs (the next window)."""
    taps = weight.shape[-1]
    t = x.shape[1]
    full = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    out = sum(full[:, j : j + t].astype(jnp.float32) * w[:, j] for j in range(taps))
    out = jax.nn.silu(out.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
    return out, full[:, t:]


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each head's output (float32 statistics), times `silu(z)`, as the reference computes it."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        y = self.weight[...] * rms_normalized(x, self.eps).astype(x.dtype)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """The token mixer of a linear-attention layer; called as `Attention` is, its cache a `LinearState`."""

    def __init__(self, cfg: MoEConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        la = cfg.linear_attention
        d, hk, h = cfg.hidden_size, la.num_key_heads, la.num_value_heads
        self.dims = (hk, h, la.key_head_dim, la.value_head_dim)
        self.fused = la.fused_projections
        key_dim, value_dim = hk * la.key_head_dim, h * la.value_head_dim
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        if self.fused:
            self.in_proj_qkvz = Linear(d, 2 * key_dim + 2 * value_dim, **kw)
            self.in_proj_ba = Linear(d, 2 * h, **kw)
        else:
            self.in_proj_qkv = Linear(d, 2 * key_dim + value_dim, **kw)
            self.in_proj_z = Linear(d, value_dim, **kw)
            self.in_proj_b = Linear(d, h, **kw)
            self.in_proj_a = Linear(d, h, **kw)
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=0)
        self.conv_weight = nnx.Param(init(rngs.params(), (la.conv_dim, 1, la.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.ones((h,), dtype))
        # Decay rates A in [0.01, 16], as transformers initialises them (checkpoints overwrite both).
        a = jax.random.uniform(rngs.params(), (h,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(dtype))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.norm_eps, dtype=dtype)
        self.out_proj = Linear(value_dim, d, **kw)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x `[B, T, D]` -> the convolution's input `[B, T, C]` (all queries, keys, values), z
        `[B, T, H, Dv]`, b and a `[B, T, H]`, whichever projections the checkpoint has."""
        b, t, _ = x.shape
        hk, h, dk, dv = self.dims
        if not self.fused:
            z = self.in_proj_z(x).reshape(b, t, h, dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = h // hk  # value heads per key head; Qwen3-Next interleaves q, k, v, z (and b, a) per key head
        qkvz = self.in_proj_qkvz(x).reshape(b, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(b, t, hk, 2 * r)
        mixed = jnp.concatenate([a.reshape(b, t, -1) for a in (q, k, v)], axis=-1)
        return mixed, z.reshape(b, t, h, dv), ba[..., :r].reshape(b, t, h), ba[..., r:].reshape(b, t, h)

    def __call__(
        self, x: jax.Array, rope: object, cache: LinearState, layout: Layout, window: int | None
    ) -> tuple[jax.Array, LinearState]:
        """x `[B, T, D]` (normed) -> output `[B, T, D]` and the state after the call (`rope`, `window`:
        unused, the softmax attention's arguments)."""
        b, t, _ = x.shape
        hk, h, dk, dv = self.dims
        valid = layout.token_valid  # [B, T]
        x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
        mixed, z, beta_in, a = self._project(x)
        continues = layout.continues  # [B]
        window_in = jnp.where(continues[:, None, None], cache.conv, jnp.zeros((), cache.conv.dtype))
        mixed, window_out = causal_conv(mixed, window_in, self.conv_weight[...])
        window_out = jnp.where(jnp.any(valid, axis=1)[:, None, None], window_out, window_in)

        q, k, v = jnp.split(mixed.astype(jnp.float32), [hk * dk, 2 * hk * dk], axis=-1)
        q = jnp.repeat(l2_normalize(q.reshape(b, t, hk, dk)), h // hk, axis=2) * dk**-0.5
        k = jnp.repeat(l2_normalize(k.reshape(b, t, hk, dk)), h // hk, axis=2)
        v = v.reshape(b, t, h, dv)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(beta_in.astype(jnp.float32)), 0.0)  # [B, T, H]
        rate = jnp.exp(self.A_log[...].astype(jnp.float32))
        g = -rate * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        g = jnp.where(valid[..., None], g, 0.0)
        state = jnp.where(continues[:, None, None, None], cache.recurrent, 0.0)
        if t == 1:
            out, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            out = out[:, None]
        else:
            out, state = chunked_delta_rule(q, k, v, g, beta, state)
        out = self.norm(out.astype(x.dtype), z).reshape(b, t, h * dv)
        return self.out_proj(out), LinearState(window_out, state)
