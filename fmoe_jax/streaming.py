"""What `generate` returns, built token by token: per-row ids, text pieces, log-probabilities, stop reasons.

The generation loop (`generation.py`) hands every new token to `Rows`; `generate_stream` yields the
resulting `StreamPiece`s as they are made, and `generate(..., streamer=...)` passes them to a callback or to a
Hugging Face streamer (`transformers.TextStreamer` and the like).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


@dataclasses.dataclass(frozen=True)
class StreamPiece:
    """One generated token of one row, as soon as it is sampled."""

    row: int  # which prompt of the batch
    token: int  # the token id
    text: str  # the text it completes ("" while it ends inside a multi-byte character; "" without tokenizer)
    logprob: float | None = None  # log-probability of `token` under the model, with `return_logprobs`
    top_logprobs: tuple[
        tuple[int, float], ...
    ] = ()  # the `top_logprobs` likeliest (id, log-prob), best first
    finish_reason: str | None = None  # on the row's last token: "eos", "stop" (a stop string) or "length"


class TextPieces:
    """Incremental detokenization of one row: the text each new token adds, so that the pieces concatenate to
    `tokenizer.decode(all tokens)`.

    Decoding a lone token can be wrong for two reasons: a byte-level token may end inside a multi-byte
    character, and SentencePiece-style tokenizers drop the leading space of a sequence's first word. So each
    step decodes the tokens since the previous emitted piece *with one piece of context before them*, and
    emits only what grew past that context, and nothing while the text ends with an incomplete character.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.context = 0  # tokens[context:emitted] decode to the context text
        self.emitted = 0  # tokens before this index are in emitted pieces

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.context : self.emitted])
        after = self._decode(self.tokens[self.context :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        self.context, self.emitted = self.emitted, len(self.tokens)
        return after[len(before) :]


class Rows:
    """Per-row results of one `generate` call, grown one token at a time.

    Args:
      batch: number of rows.
      tokenizer: makes the text pieces; None: `text` stays "" (stop strings need a tokenizer).
      eos: token ids that end a row (empty: none).
      stop: strings that end a row once its text contains one (the row keeps the token that completed it).
      max_new_tokens: the length limit.
      top_logprobs: how many of the likeliest tokens to report per step (0: none).
      logprobs: whether to record the chosen tokens' log-probabilities.
    """

    def __init__(
        self,
        batch: int,
        tokenizer: Any,
        eos: frozenset[int],
        stop: Sequence[str],
        max_new_tokens: int,
        *,
        logprobs: bool,
        top_logprobs: int,
    ):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.text = [""] * batch
        self.pieces = [TextPieces(tokenizer) for _ in range(batch)] if tokenizer is not None else None
        self.eos, self.stop, self.max_new_tokens = eos, tuple(stop), max_new_tokens
        self.logprobs: list[list[float]] | None = [[] for _ in range(batch)] if logprobs else None
        self.n_top = top_logprobs
        self.top: list[list[tuple[tuple[int, float], ...]]] | None = (
            [[] for _ in range(batch)] if top_logprobs else None
        )
        self.finish_reasons: list[str | None] = [None] * batch

    def add(self, row: int, token: int, log_probs: np.ndarray | None) -> StreamPiece:
        """Records the row's next token; `log_probs` `[V]` are the step's log-probabilities of that row (with
        `logprobs`). Returns the piece, whose `finish_reason` says whether the row is done."""
        self.tokens[row].append(token)
        text = self.pieces[row].add(token) if self.pieces is not None else ""
        self.text[row] += text
        logprob, top = None, ()
        if self.logprobs is not None:
            logprob = float(log_probs[token])
            self.logprobs[row].append(logprob)
        if self.top is not None:
            best = np.argpartition(-log_probs, self.n_top - 1)[: self.n_top]
            best = best[np.argsort(-log_probs[best], kind="stable")]
            top = tuple((int(t), float(log_probs[t])) for t in best)
            self.top[row].append(top)
        reason = None
        if token in self.eos:
            reason = "eos"
        elif text and any(s in self.text[row][-(len(s) + len(text) - 1) :] for s in self.stop):
            reason = "stop"
        elif len(self.tokens[row]) == self.max_new_tokens:
            reason = "length"
        self.finish_reasons[row] = reason
        return StreamPiece(row, token, text, logprob, top, reason)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits `[B, V]`, in float64 (then the float32 logits are the only rounding)."""
    logits = np.asarray(logits, np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.sum(np.exp(logits - peak), axis=-1, keepdims=True))


class Streamer:
    """`generate`'s `streamer=`: a callable given each `StreamPiece`, or an object with Hugging Face's
    streamer interface (`put(ids)`, `end()`, e.g. `transformers.TextStreamer(tokenizer)`), given the prompt
    ids `[B, T]` first and then each step's new ids `[B]` (finished rows repeat `pad_token_id`), as
    transformers' `generate` does."""

    def __init__(self, target: Any, pad_token_id: int):
        if callable(getattr(target, "put", None)) and callable(getattr(target, "end", None)):
            self.hf, self.callback = target, None
        elif callable(target):
            self.hf, self.callback = None, target
        else:
            raise ValueError(
                "streamer must be a callable taking a fmoe_jax.StreamPiece or an object with put() and end() "
                f"(a transformers streamer), got {type(target).__name__}"
            )
        self.pad = pad_token_id

    def start(self, prompt_ids: list[list[int]]) -> None:
        if self.hf is not None:
            longest = max(len(p) for p in prompt_ids)
            padded = np.full((len(prompt_ids), longest), self.pad, np.int64)
            for b, p in enumerate(prompt_ids):
                padded[b, longest - len(p) :] = p
            self.hf.put(padded)

    def step(self, pieces: Sequence[StreamPiece], batch: int) -> None:
        if self.callback is not None:
            for piece in pieces:
                self.callback(piece)
            return
        ids = np.full((batch,), self.pad, np.int64)
        for piece in pieces:
            ids[piece.row] = piece.token
        self.hf.put(ids)

    def end(self) -> None:
        if self.hf is not None:
            self.hf.end()


class GenerationStream:
    """`generate_stream`'s result: iterate it for `StreamPiece`s as they are made; afterwards `output` is the
    `GenerateOutput` that `generate` would have returned (statistics included)."""

    def __init__(self, steps: Iterator[list[StreamPiece]]):
        self._steps = steps
        self._output = None

    def __iter__(self) -> Iterator[StreamPiece]:
        while True:
            try:
                pieces = next(self._steps)
            except StopIteration as done:
                self._output = done.value
                return
            yield from pieces

    @property
    def output(self) -> Any:
        if self._output is None:
            raise RuntimeError(
                "the stream has not finished: iterate over it to the end before reading .output"
            )
        return self._output

    def close(self) -> None:
        """Stops a stream early: the generation ends and the model is free for other calls."""
        self._steps.close()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_streamer(target: Callable[[StreamPiece], Any] | Any | None, pad_token_id: int) -> Streamer | None:
    return None if target is None else Streamer(target, pad_token_id)
