"""Token sampling methods as small frozen dataclasses, applied inside the jitted decode step.

`fmoe_jax.generate(..., sampling=Greedy() | Sample(temperature, top_k, top_p, repetition_penalty))`;
`from_hf_arguments` maps the Hugging Face names (`do_sample`, `temperature`, ...) onto them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ArgumentError

_WORD = 32  # the seen-token mask travels as bits of uint32 words


def _check_real(name: str, value: Any, ok, expected: str) -> None:
    """ValueError unless `value` is a finite real number (not a bool) for which `ok(value)` holds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ArgumentError(name, f"{name} must be {expected}, got {value!r}")


def _check_penalty(value: Any) -> None:
    _check_real("repetition_penalty", value, lambda v: v > 0, "a finite number > 0 (1.0: no penalty)")


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Always the most likely token (ties: lowest id), after the repetition penalty if one is set.

    `repetition_penalty` (1.0: off) is that of Hugging Face and of CTRL (Keskar et al., 2019): the logit
    of every token already in the row (prompt or generated) is divided by it when positive and multiplied
    by it when negative, so a penalty above 1 makes repeats less likely.
    """

    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_penalty(self.repetition_penalty)

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits `[B, V]` float32, the step's `sampler_key` -> token ids `[B]`."""
        logits, _ = _penalised(logits, key, self.repetition_penalty)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sample:
    """Temperature sampling, optionally restricted to the `top_k` most likely tokens and/or the smallest
    set whose probability reaches `top_p` (nucleus). `top_k=0` and `top_p=1.0` disable the restriction.
    `repetition_penalty` as in `Greedy`, applied first (as Hugging Face orders its logits processors)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_real(
            "temperature", self.temperature, lambda v: v > 0, "a finite number > 0 (use Greedy() for argmax)"
        )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ArgumentError(
                "top_k", f"top_k must be an int >= 0 (0: no top-k restriction), got {self.top_k!r}"
            )
        _check_real("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1] (1.0: no nucleus restriction)")
        _check_penalty(self.repetition_penalty)

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits `[B, V]` float32, the step's `sampler_key` (or a typed PRNG key) -> token ids `[B]`."""
        logits, key = _penalised(logits, key, self.repetition_penalty)
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        logits = logits.astype(jnp.float32) / self.temperature
        neg = jnp.finfo(jnp.float32).min
        if self.top_k:
            kth = jax.lax.top_k(logits, min(int(self.top_k), logits.shape[-1]))[0][:, -1:]
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


def sampler_key(key_data: np.ndarray, seen: np.ndarray | None) -> np.ndarray:
    """The `key` the engine passes to the sampler for one step: the raw PRNG key data, followed, when the
    method penalises repetition, by each row's seen tokens as a bit mask.

    One flat uint32 array `[K + B * ceil(V / 32)]` whatever the prompt and generation lengths, so the
    penalty adds no compiled shape beyond the batch size, and every engine (one device or a mesh) carries it
    exactly as it carries a key.

    Args:
      key_data: `[K]` uint32, `jax.random.key_data` of the step's key.
      seen: `[B, V]` bool, the tokens already in each row (prompt and generated), or None.
    """
    if seen is None:
        return key_data
    b, v = seen.shape
    bits = np.zeros((b, -(-v // _WORD) * _WORD), np.uint32)
    bits[:, :v] = seen
    words = np.bitwise_or.reduce(bits.reshape(b, -1, _WORD) << np.arange(_WORD, dtype=np.uint32), axis=-1)
    return np.concatenate([np.asarray(key_data, np.uint32), words.reshape(-1)])


def _penalised(logits: jax.Array, key: jax.Array, penalty: float) -> tuple[jax.Array, jax.Array]:
    """Splits a `sampler_key` into the PRNG key data and the seen-token mask, and applies the repetition
    penalty to the logits `[B, V]` (unchanged when `penalty` is 1)."""
    if penalty == 1.0:
        return logits, key
    b, v = logits.shape
    n_words = -(-v // _WORD)
    key, words = key[: -b * n_words], key[-b * n_words :].reshape(b, n_words)
    seen = ((words[:, :, None] >> jnp.arange(_WORD, dtype=jnp.uint32)) & 1).reshape(b, -1)[:, :v] > 0
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits), key


def _no_restriction(name: str, value: Any) -> bool:
    """Whether `value` of `top_k` / `top_p` is the one that restricts nothing (0 / 1.0)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return False
    return value == (0 if name == "top_k" else 1.0)


def from_hf_arguments(
    sampling: Sampling | None,
    *,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
) -> Sampling:
    """The sampling method for `generate`'s arguments: `sampling` itself, or one built from the Hugging Face
    names (None: not given).

    `do_sample=None` samples when `temperature`, `top_k` or `top_p` is given, except that `temperature=0`
    means greedy decoding (as in OpenAI's API). Unlike transformers, an unset `top_k` does not restrict
    sampling (transformers' `GenerationConfig` defaults to 50). Conflicts are refused, not ignored.
    """
    hf = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    given = {
        name: value
        for name, value in {**hf, "repetition_penalty": repetition_penalty}.items()
        if value is not None
    }
    if sampling is not None:
        if not isinstance(sampling, (Greedy, Sample)):
            raise ArgumentError(
                "sampling", f"sampling must be fmoe_jax.Greedy(...) or fmoe_jax.Sample(...), got {sampling!r}"
            )
        if given:
            listed = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ArgumentError(
                next(iter(given)),
                f"pass either sampling={sampling!r} or the Hugging Face arguments ({listed}), not both",
            )
        return sampling
    if do_sample is not None and not isinstance(do_sample, (bool, np.bool_)):
        raise ArgumentError("do_sample", f"do_sample must be True or False, got {do_sample!r}")
    penalty = 1.0 if repetition_penalty is None else repetition_penalty
    given_restrictions = {k: v for k, v in dict(top_k=top_k, top_p=top_p).items() if v is not None}
    # what greedy decoding would ignore: top_k=0 and top_p=1 restrict nothing
    restrictions = {k: v for k, v in given_restrictions.items() if not _no_restriction(k, v)}
    if do_sample is None:
        do_sample = temperature != 0 if temperature is not None else bool(given_restrictions)
        if temperature == 0 and restrictions:
            listed = ", ".join(f"{k}={v!r}" for k, v in restrictions.items())
            raise ArgumentError(
                next(iter(restrictions)),
                f"temperature=0 means greedy decoding, which would ignore {listed}; drop them or give a "
                "temperature > 0",
            )
    if not do_sample:
        ignored = dict(restrictions)
        if temperature is not None and temperature not in (0, 1):  # 0 and 1 leave greedy decoding as it is
            ignored = {"temperature": temperature, **ignored}
        if ignored:
            listed = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
            raise ArgumentError(
                next(iter(ignored)),
                f"do_sample=False decodes greedily and would ignore {listed}; drop them or pass "
                "do_sample=True",
            )
        return Greedy(repetition_penalty=penalty)
    temperature = 1.0 if temperature is None else temperature
    _check_real(
        "temperature",
        temperature,
        lambda v: v > 0,
        "a finite number > 0 with do_sample=True (temperature 0 is greedy decoding: pass do_sample=False)",
    )
    return Sample(
        temperature=temperature,
        top_k=0 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
        repetition_penalty=penalty,
    )
