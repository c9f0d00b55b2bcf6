"""`generate`'s arguments checked and resolved into one `Request`: prompt ids, the sampling method, the stop
rules and what to record. Every mistake is a `ValueError` naming the value, raised before any work starts.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from .errors import ArgumentError
from .forced import ForcedSteps
from .prompts import encode_prompts
from .sampling import Sampling, from_hf_arguments


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: list[list[int]]  # per prompt, without padding
    max_new_tokens: int
    sampling: Sampling
    seed: int
    eos: frozenset[int]  # token ids that end a row
    stop: tuple[str, ...]  # strings that end a row
    return_logprobs: bool
    top_logprobs: int
    record_trace: bool
    record_hidden: bool
    forced: ForcedSteps | None = None  # the routing every step takes instead of its routers' (`forced.py`)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ArgumentError(name, f"{name} must be a positive int, got {value!r}")
    return int(value)


def _eos_ids(model: Any, eos_token_id: Any, stop_at_eos: bool) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset(model.eos_token_ids) if stop_at_eos else frozenset()
    if not stop_at_eos:
        raise ArgumentError(
            "eos_token_id",
            f"eos_token_id={eos_token_id!r} has no effect with stop_at_eos=False; drop one of them",
        )
    ids = [eos_token_id] if isinstance(eos_token_id, numbers.Number) else eos_token_id
    vocab = model.config.vocab_size
    if not isinstance(ids, Sequence) or not ids:
        raise ArgumentError(
            "eos_token_id",
            f"eos_token_id must be a token id or a non-empty list of them, got {eos_token_id!r}",
        )
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
            raise ArgumentError(
                "eos_token_id",
                f"eos_token_id must hold ints in [0, {vocab}) (the vocabulary), got {eos_token_id!r}",
            )
    return frozenset(int(t) for t in ids)


def stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` (None, a string or a list of strings) as a tuple; an empty string is refused: it would match
    before the first character and end every row with no text."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, Sequence) or not all(isinstance(s, str) and s for s in strings):
        raise ArgumentError("stop", f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(strings)


def _stop_strings(model: Any, stop: Any) -> tuple[str, ...]:
    strings = stop_strings(stop)
    if strings and model.tokenizer is None:
        raise ArgumentError(
            "stop",
            f"stop={stop!r} needs a tokenizer to read the text, and the model at {model.source} has none; "
            "use eos_token_id with token ids instead",
        )
    return strings


def make_request(
    model: Any,
    prompts: Any,
    max_new_tokens: Any,
    sampling: Sampling | None,
    seed: Any,
    *,
    eos_token_id: int | Sequence[int] | None,
    stop: str | Sequence[str] | None,
    return_logprobs: bool,
    top_logprobs: int,
    stop_at_eos: bool,
    record_trace: bool,
    record_hidden: bool,
    forced_routing: Any = None,
    **hf_sampling: Any,
) -> Request:
    """Checks and resolves `generate`'s arguments, every one passed (their defaults and documentation are
    `generate`'s); `hf_sampling` are the Hugging Face sampling names, for `from_hf_arguments`."""
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ArgumentError("seed", f"seed must be an int, got {seed!r}")
    if not -(2**63) <= seed < 2**63:
        raise ArgumentError("seed", f"seed must be an int in [-2**63, 2**63), got {seed!r}")
    sampling = from_hf_arguments(sampling, **hf_sampling)
    if not isinstance(return_logprobs, bool):
        raise ArgumentError(
            "return_logprobs", f"return_logprobs must be True or False, got {return_logprobs!r}"
        )
    vocab = model.config.vocab_size
    if (
        isinstance(top_logprobs, bool)
        or not isinstance(top_logprobs, numbers.Integral)
        or not 0 <= top_logprobs <= vocab
    ):
        raise ArgumentError(
            "top_logprobs", f"top_logprobs must be an int in [0, {vocab}], got {top_logprobs!r}"
        )
    if top_logprobs and not return_logprobs:
        raise ArgumentError("top_logprobs", f"top_logprobs={top_logprobs} needs return_logprobs=True")
    ids = encode_prompts(model, prompts)
    longest = max(len(p) for p in ids)
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_position_embeddings={limit}; shorten the prompt or generate fewer tokens"
        )
    return Request(
        prompt_ids=ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=int(seed),
        eos=_eos_ids(model, eos_token_id, stop_at_eos),
        stop=_stop_strings(model, stop),
        return_logprobs=return_logprobs,
        top_logprobs=int(top_logprobs),
        record_trace=record_trace,
        record_hidden=record_hidden,
        forced=None
        if forced_routing is None
        else ForcedSteps(forced_routing, model.config, ids, max_new_tokens),
    )
