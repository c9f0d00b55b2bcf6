"""`generate` and `forward`: the user-facing entry points that drive an engine.

Prompts are tokenized, left padded to a bucketed length (a bounded set of compiled shapes), prefilled,
then decoded one token per step until `max_new_tokens` or EOS. Works the same for the resident and the
offload engine; statistics come from the loop here plus whatever the engine measures.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Generator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmoe_jax.models import Layout

from .loading import Model
from .prompts import check_token_ids
from .request import Request, make_request
from .sampling import Sampling, sampler_key
from .streaming import GenerationStream, Rows, StreamPiece, log_softmax, make_streamer
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
    host_computed: int = 0  # hybrid execution: experts the host computed (misses, and hits it balanced)
    host_compute_s: float = 0.0  # hybrid execution: seconds of the host's calls, dispatch to result
    link_busy_share: float = 0.0  # fraction of the call's time the host-to-device link was copying experts
    bytes_to_device: int = 0
    prefetches: int = 0
    wasted_prefetches: int = 0
    peak_cache_bytes: int = 0
    overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_hit_rate: list[float] = dataclasses.field(default_factory=list)
    # The engine's host path, per step (prefill first, then each decode step): device programs it launched,
    # host waits for device results (a read of routing or of the sampled tokens, the generation loop's
    # included), and host seconds of the step outside those waits and outside waits for expert copies.
    step_launches: list[int] = dataclasses.field(default_factory=list)
    step_syncs: list[int] = dataclasses.field(default_factory=list)
    step_host_s: list[float] = dataclasses.field(default_factory=list)
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
    logprobs: list[list[float]] | None = None  # per prompt and token: its log-probability (return_logprobs)
    # per prompt and token: the `top_logprobs` likeliest (token id, log-probability), best first
    top_logprobs: list[list[tuple[tuple[int, float], ...]]] | None = None
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # per prompt: "eos", "stop", "length"


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
    prompts: Any,
    max_new_tokens: int = 32,
    sampling: Sampling | None = None,
    seed: int = 0,
    *,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    return_logprobs: bool = False,
    top_logprobs: int = 0,
    streamer: Any = None,
    stop_at_eos: bool = True,
    record_trace: bool = False,
    record_hidden: bool = False,
    forced_routing: RoutingTrace | None = None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens for each prompt (a batch, left padded).

    Args:
      model: from `load_model`.
      prompts: one prompt or a list of them. A prompt is a string (tokenized with the model's tokenizer), a
        list of token ids, or a chat conversation `[{"role": "user", "content": "..."}, ...]` (rendered by
        the tokenizer's chat template, with the assistant's turn opened).
      max_new_tokens: tokens to generate per prompt, a positive int.
      sampling: `Greedy()` or `Sample(temperature, top_k, top_p, repetition_penalty)`; default greedy. Or
        leave it out and use the Hugging Face names below (not both).
      seed: PRNG seed for sampling.
      do_sample, temperature, top_k, top_p, repetition_penalty: as in transformers' `generate`, mapped onto
        `Greedy`/`Sample` by `fmoe_jax.sampling.from_hf_arguments` (`temperature=0` alone means greedy; an
        unset `top_k` does not restrict sampling; conflicting settings are a `ValueError`).
      eos_token_id: a token id or a list of them that ends a row, instead of the model's EOS token(s).
      stop: a string or a list of them that ends a row once its text contains one; the row keeps the token
        that completed it (as transformers' `stop_strings`). Needs a tokenizer.
      return_logprobs: also return `out.logprobs`, each generated token's log-probability under the model
        (log-softmax of the logits `forward` computes, before any sampling transformation).
      top_logprobs: with `return_logprobs`, also the likeliest `top_logprobs` tokens per step.
      streamer: a callable given each `StreamPiece` as it is made, or a transformers streamer (`put`/`end`,
        e.g. `transformers.TextStreamer(model.tokenizer)`). `generate_stream` is the iterator form.
      stop_at_eos: stop a row at the model's EOS token(s).
      record_trace: also return `out.trace`, the routing trace (semantic embeddings, router
        probabilities of every MoE layer and chosen experts, per request and iteration).
      record_hidden: the trace also keeps every MoE layer's router input (for learned predictors).
      forced_routing: a `RoutingTrace` (one request per prompt, its first iteration the prompt's tokens, then
        one token per step, at least `max_new_tokens` iterations) whose experts and weights every MoE layer
        uses instead of its router's choice; the routers still run. An offload policy hears the trace's
        routing, probabilities and semantic context, as the simulator replays them (`fmoe_jax/forced.py`).
    """
    arguments = dict(locals())  # the first statement: generate's arguments by name, and nothing else
    streamer = arguments.pop("streamer")
    request = make_request(**arguments)
    stream = make_streamer(streamer, model.pad_token_id)
    steps = _generation(model, request, text_pieces=stream is not None)
    if stream is not None:
        stream.start(request.prompt_ids)
    while True:
        try:
            pieces = next(steps)
        except StopIteration as done:
            if stream is not None:
                stream.end()
            return done.value
        if stream is not None:
            stream.step(pieces, len(request.prompt_ids))


def generate_stream(model: Model, prompts: Any, *args: Any, **options: Any) -> GenerationStream:
    """`generate` as an iterator: yields a `StreamPiece` (row, token id, text piece, log-probability, finish
    reason) for each token as soon as it is sampled, a step's rows in order; afterwards `stream.output` is
    the `GenerateOutput` (the same tokens as `generate` with the same arguments).

    Takes `generate`'s arguments except `streamer`; they are checked here, before the first token. The
    stream holds the model from its first piece until it is exhausted or closed (`stream.close()`, or
    garbage collection): other calls on the model wait meanwhile.

        stream = fj.generate_stream(model, "Once upon a time", max_new_tokens=40, temperature=0.8)
        for piece in stream:
            print(piece.text, end="", flush=True)
        stream.output.stats.tpot_s
    """
    if "streamer" in options:
        raise ValueError("generate_stream yields the pieces itself; pass streamer= to generate instead")
    request = resolve_request(model, prompts, *args, **options)
    return GenerationStream(_holding(model, _generation(model, request, text_pieces=True)))


def resolve_request(model: Model, prompts: Any, *args: Any, **options: Any) -> Request:
    """`generate`'s arguments (less `streamer`) checked and resolved into a `Request`, as `generate` does:
    its defaults, its `ValueError` for a bad value and its `TypeError` for a name it does not take."""
    arguments = inspect.signature(generate).bind(model, prompts, *args, **options)
    arguments.apply_defaults()
    arguments.arguments.pop("streamer", None)
    return make_request(**arguments.arguments)


# help() and editors show the options `generate_stream` binds: generate's, less `streamer`.
generate_stream.__signature__ = inspect.signature(generate).replace(  # type: ignore[attr-defined]
    parameters=[p for p in inspect.signature(generate).parameters.values() if p.name != "streamer"],
    return_annotation="GenerationStream",
)


def _holding(model: Model, steps: Generator) -> Generator:
    """`steps` run while holding the model (`Model.serving`), from the first piece to the last: a stream
    is one call, and other calls on the model wait until it is exhausted or closed."""
    with model.serving():
        return (yield from steps)


def _generation(
    model: Model, request: Request, *, text_pieces: bool
) -> Generator[list[StreamPiece], None, GenerateOutput]:
    """The generation loop: prefill, then one decode step per token. Yields each step's new pieces (one per
    row still generating; their text only with `text_pieces` or stop strings, which need it) and returns the
    `GenerateOutput`."""
    ids = request.prompt_ids
    max_new_tokens, sampling = request.max_new_tokens, request.sampling
    record_trace, record_hidden = request.record_trace, request.record_hidden
    cfg = model.config
    batch = len(ids)
    tokens, key_start = _left_padded(ids, model.pad_token_id)
    t_pad = tokens.shape[1]
    cache_len = bucket_length(t_pad + max_new_tokens)
    active = np.ones((batch,), bool)
    rows = _rows(model, request, text_pieces)
    seen = _seen_tokens(ids, cfg.vocab_size) if sampling.repetition_penalty != 1.0 else None
    engine = model.engine
    # Every call's key, fold_in(key(seed), i), made at once as raw key data: host-side JAX calls in the
    # decode loop cost ~0.5 ms each on CPU, a step's layout and key are therefore plain NumPy.
    step_keys = _StepKeys(jax.random.key(request.seed))
    trace = RoutingTrace.empty(cfg, [list(p) for p in ids]) if record_trace else None
    engine.begin(batch)
    compiled = engine.programs.compile_s

    stats = GenerationStats(prompt_tokens=sum(len(p) for p in ids))
    cache = engine.init_cache(batch, cache_len)
    first_key = sampler_key(step_keys[0], seen)  # before the clock: its program compiles on the first call
    start = time.perf_counter()
    layout = Layout(np.int32(0), key_start, active.copy(), t_pad)
    forced = _no_forcing if request.forced is None else request.forced.step
    prefill = (tokens, cache, layout, first_key, sampling, record_trace, record_hidden)
    out, cache = engine.step(*prefill, forced=forced(0, t_pad, active))
    next_tokens = np.asarray(out.tokens)
    compile_s = engine.programs.compile_s - compiled
    stats.ttft_s = time.perf_counter() - start - compile_s
    if trace is not None:
        trace.add_iteration(
            out.recorded,
            valid=np.arange(t_pad)[None, :] >= (t_pad - np.array([len(p) for p in ids]))[:, None],
            tokens=tokens,
        )

    for step in range(max_new_tokens):
        log_probs = log_softmax(np.asarray(out.logits)) if request.return_logprobs else None
        pieces = []
        for b in range(batch):
            if active[b]:
                piece = rows.add(b, int(next_tokens[b]), None if log_probs is None else log_probs[b])
                pieces.append(piece)
                if piece.finish_reason is not None:
                    active[b] = False
        yield pieces
        if step == max_new_tokens - 1 or not active.any():
            break
        if seen is not None:
            seen[np.flatnonzero(active), next_tokens[active]] = True
        t0, compiled = time.perf_counter(), engine.programs.compile_s
        layout = Layout(np.int32(t_pad + step), key_start, active.copy(), 1)
        row_valid = active.copy()
        key = sampler_key(step_keys[step + 1], seen)
        forcing = forced(step + 1, 1, active)
        fed = next_tokens[:, None]
        out, cache = engine.step(
            fed, cache, layout, key, sampling, record_trace, record_hidden, forced=forcing
        )
        next_tokens = np.asarray(out.tokens)
        step_compile_s = engine.programs.compile_s - compiled
        compile_s += step_compile_s
        stats.decode_step_s.append(time.perf_counter() - t0 - step_compile_s)
        if trace is not None:
            trace.add_iteration(out.recorded, valid=row_valid[:, None], tokens=fed)

    stats.compile_s = compile_s
    return _output(model, rows, stats, trace)


def _rows(model: Model, request: Request, text_pieces: bool) -> Rows:
    """The rows' generated tokens and stop rules; text pieces are decoded when streamed or stop strings
    need them."""
    tokenizer = model.tokenizer if text_pieces or request.stop else None
    limits = dict(logprobs=request.return_logprobs, top_logprobs=request.top_logprobs)
    return Rows(
        len(request.prompt_ids), tokenizer, request.eos, request.stop, request.max_new_tokens, **limits
    )


def _no_forcing(step: int, width: int, active: np.ndarray) -> None:
    """A step's forced routing when `generate` was given none (`ForcedSteps.step`'s signature)."""
    return None


def _left_padded(ids: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as one [batch, bucketed length] array, padded on the left, and where each row starts."""
    t_pad = bucket_length(max(len(p) for p in ids))
    tokens = np.full((len(ids), t_pad), pad_token_id, np.int32)
    for b, p in enumerate(ids):
        tokens[b, t_pad - len(p) :] = p
    return tokens, np.asarray([t_pad - len(p) for p in ids], np.int32)


def _seen_tokens(ids: list[list[int]], vocab_size: int) -> np.ndarray:
    """Each row's tokens, for the repetition penalty (a bit mask the sampler reads, see `sampler_key`)."""
    seen = np.zeros((len(ids), vocab_size), bool)
    for b, p in enumerate(ids):
        seen[b, p] = True
    return seen


def _output(model: Model, rows: Rows, stats: GenerationStats, trace: RoutingTrace | None) -> GenerateOutput:
    """The finished generation: statistics completed (and the engine's added), texts decoded."""
    generated = rows.tokens
    stats.new_tokens = sum(len(g) for g in generated)
    stats.tpot_s = float(np.mean(stats.decode_step_s)) if stats.decode_step_s else 0.0
    model.engine.finish(stats)
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(g, skip_special_tokens=True) for g in generated]
    return GenerateOutput(
        generated, texts, stats, trace, rows.logprobs, rows.top, [str(r) for r in rows.finish_reasons]
    )


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
    tokens = jnp.asarray(check_token_ids(token_ids, model.config.vocab_size, "token_ids"))
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
