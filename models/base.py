"""The decoder-only MoE model every family instantiates, split into the steps the engine calls.

A family supplies its config parser and routing function (`models/mixtral.py` etc.); this module wires
norms, attention (grouped-query, multi-head latent from `models/mla.py`, or in hybrid models' linear layers
Gated DeltaNet from `models/gated_deltanet.py`), router, routed experts, an optional shared expert and dense
MLP layers. Routed experts
live in `MoECausalLM.experts`, outside the layers, so the offload engine can run a layer's dense part on
the device while the experts come from its cache.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .config import MoEConfig
from .gated_deltanet import GatedDeltaNet
from .layers import Attention, LayerCache, Layout, Linear, linear, make_norm, rope_tables
from .mla import LatentAttention
from .moe import (
    AnyExpertWeights,
    ClampedSwiGLU,
    Expert,
    ForcedRouting,
    Kernel,
    Routing,
    expert_parts,
    sum_parts,
)
from .quant import ExpertQuantization

# Router logits [N, J] (any dtype) -> Routing; families with a score-correction bias (DeepSeek-V3) take it
# as a third argument, [J] float32.
RouteFn = Callable[..., Routing]


class DecoderLayer(nnx.Module):
    """Attention block plus either a routed MoE block (router, optional shared expert) or a dense MLP."""

    def __init__(self, cfg: MoEConfig, layer: int, route_fn: RouteFn, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.is_moe = cfg.moe_layers[layer]
        self.window = cfg.sliding_windows[layer]
        self.route_fn = route_fn
        self.input_norm = make_norm(cfg, dtype=dtype)
        self.attn = _token_mixer(cfg, layer)(cfg, dtype=dtype, rngs=rngs)
        self.post_norm = make_norm(cfg, dtype=dtype)
        kw = dict(dtype=dtype, rngs=rngs)
        if self.is_moe:
            self.router = Linear(cfg.hidden_size, cfg.num_experts, use_bias=cfg.router_bias, **kw)
            if cfg.score_correction_bias:  # float32 whatever the model's dtype, as DeepSeek-V3 keeps it
                self.score_correction = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))
            if cfg.shared_expert_intermediate_size:
                self.shared_expert = Expert(cfg.hidden_size, cfg.shared_expert_intermediate_size, **kw)
            if cfg.shared_expert_gate:
                self.shared_gate = Linear(cfg.hidden_size, 1, use_bias=False, **kw)
        else:
            self.mlp = Expert(cfg.hidden_size, cfg.dense_intermediate_size, **kw)

    def attention_block(
        self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: LayerCache, layout: Layout
    ) -> tuple[jax.Array, jax.Array, LayerCache]:
        """x `[B, T, D]` -> residual stream after attention `h`, the MLP input `z = norm(h)`, new cache (the
        layer's own kind: `LayerKV`, or `LinearState` for a linear-attention layer)."""
        attn_out, kv = self.attn(self.input_norm(x), rope, kv, layout, self.window)
        h = x + attn_out
        return h, self.post_norm(h), kv

    def route(self, z: jax.Array) -> Routing:
        """z `[N, D]` -> routing of N tokens (probabilities in float32)."""
        if self.config.router_matmul_float32:
            logits = linear(z.astype(jnp.float32), self.router.weight[...].astype(jnp.float32))
        else:
            logits = self.router(z)
        if self.config.score_correction_bias:
            return self.route_fn(logits, self.config, self.score_correction[...])
        return self.route_fn(logits, self.config)

    def mix(self, z: jax.Array, parts: jax.Array) -> jax.Array:
        """The layer's MLP output from every routed assignment's output `parts` `[N, k, D]` float32 (see
        `models/moe.py`): summed and rounded once, plus the shared expert. `[N, D]` in z's dtype."""
        return sum_parts(parts).astype(z.dtype) + self.shared_output(z).astype(z.dtype)

    def shared_output(self, z: jax.Array) -> jax.Array:
        """The always-on shared expert: scaled by its sigmoid gate (Qwen1.5-MoE) or not (DeepSeek-V2's
        shared experts, one MLP of their summed width); zeros for families without one."""
        if not hasattr(self, "shared_expert"):
            return jnp.zeros(z.shape, z.dtype)
        if hasattr(self, "shared_gate"):
            return jax.nn.sigmoid(self.shared_gate(z)) * self.shared_expert(z)
        return self.shared_expert(z)

    def dense_output(self, z: jax.Array) -> jax.Array:
        return self.mlp(z)


def _token_mixer(cfg: MoEConfig, layer: int) -> type:
    """The layer's attention: Gated DeltaNet in a hybrid model's linear layers, else latent (MLA) or
    grouped-query softmax attention."""
    if cfg.is_linear(layer):
        return GatedDeltaNet
    return LatentAttention if cfg.is_mla else Attention


def output_logits(final_norm: nnx.Module, projection: Linear | nnx.Embed, x: jax.Array) -> jax.Array:
    """Final norm then the LM head (or the tied embedding): `[..., D]` -> `[..., V]` float32."""
    x = final_norm(x)
    if isinstance(projection, nnx.Embed):  # tied: the embedding table `[V, D]` is already `[out, in]`
        logits = linear(x.astype(projection.embedding.dtype), projection.embedding[...])
    else:
        logits = projection(x)
    return logits.astype(jnp.float32)


class MoECausalLM(nnx.Module):
    """Embedding, decoder layers, routed experts `experts[layer][expert]`, final norm and LM head.

    With `expert_quantization` the routed experts are stored quantized (`models/quant.py`, zeros until a
    checkpoint fills them); every other weight, the shared expert included, keeps `dtype`.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        route_fn: RouteFn,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
        expert_quantization: ExpertQuantization | None = None,
    ):
        if expert_quantization is not None:
            expert_quantization.check_model(cfg.hidden_size, cfg.expert_intermediate_size)
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.expert_quantization = expert_quantization
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, route_fn, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.experts = nnx.List(
            [
                nnx.List(
                    [
                        Expert(
                            cfg.hidden_size,
                            cfg.expert_intermediate_size,
                            dtype=dtype,
                            key=key,
                            quantization=expert_quantization,
                            activation=None if cfg.swiglu_clamp is None else ClampedSwiGLU(*cfg.swiglu_clamp),
                        )
                        for key in _expert_keys(rngs, cfg.num_experts)
                    ]
                )
                if cfg.moe_layers[i]
                else nnx.List([])
                for i in range(cfg.num_layers)
            ]
        )
        self.final_norm = make_norm(cfg, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, use_bias=cfg.lm_head_bias, dtype=dtype, rngs=rngs
            )

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens `[B, T]` -> `[B, T, D]`; this is also the semantic context fMoE matches on."""
        return self.embed(tokens)

    def rope(self, layout: Layout) -> tuple[jax.Array, jax.Array]:
        return self.rope_for(self.config, layout, self.dtype)

    @staticmethod
    def rope_for(cfg: MoEConfig, layout: Layout, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """cos/sin tables `[B, T, E]` (E: rotated dimensions per head) of one call, shared by every layer."""
        return rope_tables(cfg.rope, cfg.rope_dim, layout.positions, layout.token_valid, dtype)

    @property
    def output_projection(self) -> Linear | nnx.Embed:
        return self.embed if self.config.tie_word_embeddings else self.lm_head

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: `[B, T, D]` -> logits `[B, T, V]` float32."""
        return output_logits(self.final_norm, self.output_projection, x)

    def layer_experts(self, layer: int) -> list[AnyExpertWeights]:
        return [e.weights() for e in self.experts[layer]]

    def __call__(
        self,
        tokens: jax.Array,
        cache: list[LayerCache],
        layout: Layout,
        *,
        kernel: Kernel = "auto",
        last_only: bool = False,
        moe_inputs: list | None = None,
        forced: ForcedRouting | None = None,
    ) -> tuple[jax.Array, list[LayerCache], list[Routing]]:
        """Resident forward over all layers.

        Args:
          tokens: `[B, T]` new tokens (left padded).
          cache: the per-layer caches (`init_kv_cache`: `LayerKV` `[B, S, ...]`, `LinearState` `[B, ...]`).
          layout: where the tokens go in the cache.
          last_only: return only the last position's logits `[B, V]` (prefill never needs `[B, T, V]`).
          moe_inputs: if a list, each MoE layer's router input `[B*T, D]` is appended to it (traces for
            policies that predict from hidden states).
          forced: routing every MoE layer takes instead of its router's choice (the router still runs).
        Returns:
          logits `[B, T, V]` (or `[B, V]`) float32, the updated cache, and each MoE layer's routing over the
          B*T tokens.
        """
        b, t = tokens.shape
        x = self.embed_tokens(tokens)
        rope = self.rope(layout)
        valid = layout.token_valid.reshape(b * t)
        new_cache, routings = [], []
        slots = jnp.arange(self.config.num_experts, dtype=jnp.int32)
        for i, layer in enumerate(self.layers):
            h, z, kv = layer.attention_block(x, rope, cache[i], layout)
            new_cache.append(kv)
            z = z.reshape(b * t, -1)
            if layer.is_moe:
                routing = layer.route(z)
                if forced is not None:
                    routing = forced.apply(len(routings), routing)
                routings.append(routing)
                if moe_inputs is not None:
                    moe_inputs.append(z)
                parts = expert_parts(z, routing, self.layer_experts(i), slots, valid, kernel=kernel)
                y = layer.mix(z, parts)
            else:
                y = layer.dense_output(z)
            x = h + y.reshape(b, t, -1).astype(h.dtype)
        if last_only:
            return self.head(x[:, -1:, :])[:, 0], new_cache, routings
        return self.head(x), new_cache, routings


def _expert_keys(rngs: nnx.Rngs, n: int) -> list[jax.Array]:
    """One key per expert of a layer, from a single draw of `rngs`. Under `nnx.eval_shape` (the abstract
    model every load builds) each `rngs` draw costs time growing with the draws before it: drawing three per
    expert made the abstract 8 x 32-expert Qwen model take 40 s to build."""
    layer_key = rngs.params()
    return [jax.random.fold_in(layer_key, e) for e in range(n)]
