"""`generate` and `forward`: the user-facing entry points that drive an engine.

Prompts are tokenized, left padded to a bucketed length (a bounded set of compiled shapes), prefilled,
then decoded one token per step until `max_new_tokens` or EOS. Works the same for the resident and the
offload engine; statistics come from the loop here plus whatever the engine measures.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmoe_jax.models import Layout

from .loading import Model
from .sampling import Greedy, Sampling
from .trace import RoutingTrace

MIN_BUCKET = 16


def bucket_length(n: int) -> int:
    """Smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x powers of two) that holds n."""
    size = MIN_BUCKET
    while True:
        if n <= size:
            return size
        if n <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


@dataclasses.dataclass
class GenerationStats:
    """Timings and expert-cache statistics of one `generate` call (see README, "Statistics").

    `ttft_s`: from the start of prefill to the first token on the host. `tpot_s`: mean time per later
    token. Neither includes compilation: the calls that compiled a program had its compile time taken out,
    and `compile_s` reports it. The offload fields stay zero for a resident model.
    """

    ttft_s: float = 0.0
    tpot_s: float = 0.0
    compile_s: float = 0.0
    decode_step_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    new_tokens: int = 0
    hit_rate: float = 1.0
    hits: int = 0
    misses: int = 0
    late_prefetches: int = 0
    bytes_to_device: int = 0
    prefetches: int = 0
    wasted_prefetches: int = 0
    peak_cache_bytes: int = 0
    overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_hit_rate: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated ids per prompt (EOS included when it stopped a row)
    texts: list[str] | None  # decoded `tokens`, when the model has a tokenizer
    stats: GenerationStats
    trace: RoutingTrace | None = None


def encode_prompts(model: Model, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise ValueError(
                    f"prompt {i} is a string but the model at {model.source} has no tokenizer; "
                    "pass token-id lists instead"
                )
            ids = list(model.tokenizer(prompt)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def _serialized(fn):
    """Runs a public entry point while holding its model (`Model.serving`): one call at a time per model."""

    @functools.wraps(fn)
    def call(model: Model, *args, **kwargs):
        with model.serving():
            return fn(model, *args, **kwargs)

    return call


@_serialized
def generate(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    sampling: Sampling = Greedy(),
    seed: int = 0,
    *,
    stop_at_eos: bool = True,
    record_trace: bool = False,
    record_hidden: bool = False,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens for each prompt (a batch, left padded).

    Args:
      model: from `load_model`.
      prompts: strings (tokenized with the model's tokenizer) or lists of token ids.
      max_new_tokens: tokens to generate per prompt, at least 1.
      sampling: `Greedy()` or `Sample(temperature, top_k, top_p)`.
      seed: PRNG seed for sampling.
      stop_at_eos: stop a row at the model's EOS token(s).
      record_trace: also return `out.trace`, the routing trace (semantic embeddings, router
        probabilities of every MoE layer and chosen experts, per request and iteration).
      record_hidden: the trace also keeps every MoE layer's router input (for learned predictors).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = encode_prompts(model, prompts)
    cfg = model.config
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt or generate fewer "
            "tokens"
        )
    batch = len(ids)
    t_pad = bucket_length(longest)
    cache_len = bucket_length(t_pad + max_new_tokens)
    tokens = np.full((batch, t_pad), model.pad_token_id, np.int32)
    for b, p in enumerate(ids):
        tokens[b, t_pad - len(p) :] = p
    key_start = np.asarray([t_pad - len(p) for p in ids], np.int32)
    active = np.ones((batch,), bool)
    eos = set(model.eos_token_ids) if stop_at_eos else set()
    engine = model.engine
    # Every call's key, fold_in(key(seed), i), made at once as raw key data: host-side JAX calls in the
    # decode loop cost ~0.5 ms each on CPU, a step's layout and key are therefore plain NumPy.
    step_keys = _StepKeys(jax.random.key(seed))
    trace = RoutingTrace.empty(cfg, [list(p) for p in ids]) if record_trace else None
    engine.begin(batch)
    compiled = engine.programs.compile_s

    stats = GenerationStats(prompt_tokens=sum(len(p) for p in ids))
    cache = engine.init_cache(batch, cache_len)
    start = time.perf_counter()
    layout = Layout(np.int32(0), key_start, active.copy(), t_pad)
    out, cache = engine.step(
        tokens,
        cache,
        layout,
        step_keys[0],
        sampling,
        record_trace,
        record_hidden,
    )
    next_tokens = np.asarray(out.tokens)
    compile_s = engine.programs.compile_s - compiled
    stats.ttft_s = time.perf_counter() - start - compile_s
    if trace is not None:
        trace.add_iteration(
            out.recorded,
            valid=np.arange(t_pad)[None, :] >= (t_pad - np.array([len(p) for p in ids]))[:, None],
        )

    generated: list[list[int]] = [[] for _ in range(batch)]
    for step in range(max_new_tokens):
        for b in range(batch):
            if active[b]:
                generated[b].append(int(next_tokens[b]))
                if int(next_tokens[b]) in eos:
                    active[b] = False
        if step == max_new_tokens - 1 or not active.any():
            break
        t0, compiled = time.perf_counter(), engine.programs.compile_s
        layout = Layout(np.int32(t_pad + step), key_start, active.copy(), 1)
        row_valid = active.copy()
        out, cache = engine.step(
            next_tokens[:, None],
            cache,
            layout,
            step_keys[step + 1],
            sampling,
            record_trace,
            record_hidden,
        )
        next_tokens = np.asarray(out.tokens)
        step_compile_s = engine.programs.compile_s - compiled
        compile_s += step_compile_s
        stats.decode_step_s.append(time.perf_counter() - t0 - step_compile_s)
        if trace is not None:
            trace.add_iteration(out.recorded, valid=row_valid[:, None])

    stats.new_tokens = sum(len(g) for g in generated)
    stats.tpot_s = float(np.mean(stats.decode_step_s)) if stats.decode_step_s else 0.0
    stats.compile_s = compile_s
    engine.finish(stats)
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(g, skip_special_tokens=True) for g in generated]
    return GenerateOutput(generated, texts, stats, trace)


class _StepKeys:
    """`fold_in(key, i)` as raw key data for call i (0: prefill), made 64 at a time by one compiled program
    (the same for every `max_new_tokens`)."""

    BLOCK = 64

    def __init__(self, key: jax.Array):
        self.key = key
        self.blocks: dict[int, np.ndarray] = {}

    def __getitem__(self, i: int) -> np.ndarray:
        block = i // self.BLOCK
        if block not in self.blocks:
            self.blocks[block] = np.asarray(jax.random.key_data(_key_block(self.key, np.uint32(block))))
        return self.blocks[block][i % self.BLOCK]


@jax.jit
def _key_block(key: jax.Array, block: jax.Array) -> jax.Array:
    index = block * _StepKeys.BLOCK + jnp.arange(_StepKeys.BLOCK, dtype=jnp.uint32)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


@_serialized
def forward(model: Model, token_ids: Any, *, return_router_probs: bool = False):
    """Logits `[B, T, V]` float32 of unpadded, equal-length token ids `[B, T]` (no sampling, no cache kept).

    With `return_router_probs`, also the router probabilities `[B, T, L_moe, J]` of every MoE layer.
    """
    tokens = jnp.asarray(token_ids, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"token_ids must be [B, T] with T >= 1, got shape {tuple(tokens.shape)}")
    if tokens.shape[1] > model.config.max_position_embeddings:
        raise ValueError(
            f"{tokens.shape[1]} tokens exceed max_position_embeddings={model.config.max_position_embeddings}"
        )
    logits, routings = model.engine.forward(tokens)
    if not return_router_probs:
        return logits
    b, t = tokens.shape
    probs = jnp.stack([r.probs for r in routings], axis=1).reshape(b, t, len(routings), -1)
    return logits, probs
