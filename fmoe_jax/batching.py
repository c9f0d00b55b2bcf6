"""Continuous batching: sequence slots over one model's engine that requests join and leave between
iterations, with a fixed, small set of compiled programs.

A `ContinuousBatch` keeps `slots` sequences in one KV cache `[slots, context]`. A request joins at an
iteration boundary. Its prompt, left padded to a multiple of `chunk` tokens, is prefilled one chunk per
iteration into a one-row cache of its own, so that the rows already decoding keep decoding meanwhile; after
its last chunk (which also gives its first token) the row is moved into a free slot (`insert_row`). Every
iteration then decodes one token of every decoding row, each at its own cache index (`Layout.write_index`
per row), and a row leaves its slot when it finishes. An iteration's expert demand is the union over its
valid rows, as in a `generate` batch, and the expert policy hears the same events: `RequestStart` at
`begin`, then one iteration per prefill chunk (`[1, chunk]` tokens) and per decode step (`[slots, 1]`,
the rows not decoding marked invalid).

The programs are one prefill chunk `[1, chunk]`, the move into a slot, and one decode step `[slots, 1]`
(for the offload engine: their per-layer steps, each at one expert width, see `OffloadEngine._layers`).
`warmup` compiles them before serving; `Programs.compilations` then shows whether anything compiled since.

Exactness. A row's numbers do not depend on the other rows: every decode step has the same shape whoever
is in it, and a prefill runs alone. So a request gets the same greedy tokens whether it is served alone or
alongside others (`tests/test_batching.py` checks the logits bit for bit). They are not always `generate`'s
tokens for the same prompt: a chunked prefill and a `[slots, 1]` decode step round bfloat16 differently from
`generate`'s whole-prompt prefill and `[1, 1]` steps, so a near-tie can go the other way.

Scope: greedy decoding without a repetition penalty (every row shares one compiled sampler) and without
routing traces; `accepts` says why a request cannot join, and such requests go through `generate`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from fmoe_jax.models import Layout

from .engines.programs import insert_row
from .generation import GenerationStats, resolve_request
from .request import Request
from .sampling import Greedy
from .streaming import Rows, StreamPiece, log_softmax

GREEDY = Greedy()


@dataclasses.dataclass(eq=False)
class _Row:
    """One request in the batch: joining (prefilling chunk by chunk), then decoding in a slot."""

    owner: Any  # whatever the caller names the request by; pieces come back with it
    request: Request
    rows: Rows  # its tokens, text and finish reason (a one-row `Rows`, as `generate` keeps them)
    tokens: np.ndarray  # [P] its prompt, left padded to a multiple of `chunk`
    key_start: int  # cache index of its first prompt token
    number: int  # the batch's count of requests joined so far: its id for the expert policy
    next_chunk: int = 0


class ContinuousBatch:
    """`slots` sequences decoding together; requests join and leave between iterations (module docstring).

    Not thread-safe: one thread drives it (`join`, `leave`, `prefill`, `decode`), holding the model
    (`Model.serving`) meanwhile.

    Args:
      model: a loaded `fmoe_jax.Model` (resident or offloaded).
      slots: sequences decoding at once.
      context: cache positions per slot: a request's padded prompt plus its new tokens must fit.
      chunk: prompt tokens prefilled per iteration.
    """

    def __init__(self, model: Any, *, slots: int = 4, context: int = 512, chunk: int = 16):
        limit = model.config.max_position_embeddings
        for name, value in (("slots", slots), ("context", context), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not chunk < context <= limit:
            raise ValueError(
                f"context must be more than chunk={chunk} and at most the model's max_position_embeddings="
                f"{limit}, got {context}"
            )
        self.model, self.engine = model, model.engine
        self.slots, self.context, self.chunk = slots, context, chunk
        self._insert = insert_row(self.engine.programs)
        self._cache = self.engine.init_cache(slots, context)
        self._side = self.engine.init_cache(1, context)  # the joining request's prefill
        self._joining: collections.deque[_Row] = collections.deque()
        self._joined = 0  # requests joined so far
        self._in_slot: list[_Row | None] = [None] * slots
        self._write = np.zeros((slots,), np.int32)  # each slot's cache index of its next token
        self._key_start = np.zeros((slots,), np.int32)
        self._last = np.full((slots,), model.pad_token_id, np.int32)  # each slot's last token
        self._key = np.asarray(jax.random.key_data(jax.random.key(0)))  # greedy: never read
        self._period: GenerationStats | None = None
        self._period_compile_s = 0.0

    # -- what the caller asks -------------------------------------------------------------------------
    @property
    def decoding(self) -> int:
        """Rows in slots, decoding."""
        return sum(r is not None for r in self._in_slot)

    @property
    def free(self) -> int:
        """Requests that can join now (a joining request holds a slot from the start)."""
        return self.slots - self.decoding - len(self._joining)

    @property
    def busy(self) -> bool:
        return bool(self._joining) or self.decoding > 0

    def accepts(self, request: Request) -> str | None:
        """Why `request` cannot join any batch of this shape (None: it can)."""
        if request.sampling != GREEDY:
            return (
                f"continuous batching decodes greedily without a repetition penalty, not {request.sampling}"
            )
        if request.record_trace or request.record_hidden:
            return "continuous batching records no routing trace"
        if len(request.prompt_ids) != 1:
            return "a continuous batch takes one prompt per request"
        n = len(request.prompt_ids[0])
        if self._padded(n) + request.max_new_tokens > self.context:
            return (
                f"a prompt of {n} tokens (padded to {self._padded(n)}) + {request.max_new_tokens} new tokens "
                f"exceed the batch's context of {self.context}"
            )
        return None

    def _padded(self, n: int) -> int:
        return -(-n // self.chunk) * self.chunk

    # -- joining and leaving --------------------------------------------------------------------------
    def join(self, request: Request, owner: Any) -> None:
        """Queues `request` (from `make_request`) for prefill; its pieces come back under `owner`."""
        reason = self.accepts(request)
        if reason is not None:
            raise ValueError(reason)
        if not self.free:
            raise RuntimeError(f"all {self.slots} slots are taken; join when `free` > 0")
        prompt = request.prompt_ids[0]
        padded = self._padded(len(prompt))
        tokens = np.full((padded,), self.model.pad_token_id, np.int32)
        tokens[padded - len(prompt) :] = prompt
        rows = Rows(
            1,
            self.model.tokenizer,
            request.eos,
            request.stop,
            request.max_new_tokens,
            logprobs=request.return_logprobs,
            top_logprobs=request.top_logprobs,
        )
        self._joined += 1
        self._joining.append(_Row(owner, request, rows, tokens, padded - len(prompt), self._joined))
        if self._period is not None:
            self._period.prompt_tokens += len(prompt)

    def leave(self, owner: Any) -> None:
        """Drops `owner`'s request (its client went away): its slot is free from the next iteration."""
        for row in list(self._joining):
            if row.owner is owner:
                self._joining.remove(row)
        for slot, row in enumerate(self._in_slot):
            if row is not None and row.owner is owner:
                self._in_slot[slot] = None

    # -- iterations -----------------------------------------------------------------------------------
    def prefill(self) -> list[tuple[Any, StreamPiece]]:
        """One prefill chunk of the oldest joining request; after its last chunk, its first token (and the
        row moves into a slot, decoding from the next `decode`)."""
        if not self._joining:
            return []
        row, c = self._joining[0], self.chunk
        start = row.next_chunk * c
        layout = Layout(np.int32(start), np.asarray([row.key_start], np.int32), np.ones((1,), bool), c)
        out, self._side = self.engine.step(
            row.tokens[None, start : start + c], self._side, layout, self._key, GREEDY, requests=(row.number,)
        )
        row.next_chunk += 1
        if start + c < len(row.tokens):
            return []
        self._joining.popleft()
        token = int(np.asarray(out.tokens)[0])
        piece = self._add(row, token, out.logits, 0)
        if piece.finish_reason is None:  # into a slot, to decode
            slot = self._in_slot.index(None)
            self._cache = self._insert(self._cache, self._side, np.int32(slot))
            self._in_slot[slot] = row
            self._write[slot], self._key_start[slot], self._last[slot] = len(row.tokens), row.key_start, token
        return [(row.owner, piece)]

    def decode(self) -> list[tuple[Any, StreamPiece]]:
        """One decode step of every row in a slot: each row's next token."""
        active = np.asarray([r is not None for r in self._in_slot])
        if not active.any():
            return []
        start = time.perf_counter()
        compiled = self.engine.programs.compile_s
        layout = Layout(self._write.copy(), self._key_start.copy(), active, 1)
        requests = tuple(-1 if r is None else r.number for r in self._in_slot)
        out, self._cache = self.engine.step(
            self._last[:, None].copy(), self._cache, layout, self._key, GREEDY, requests=requests
        )
        tokens = np.asarray(out.tokens)
        pieces = []
        for slot in np.flatnonzero(active):
            row = self._in_slot[slot]
            piece = self._add(row, int(tokens[slot]), out.logits, slot)
            pieces.append((row.owner, piece))
            if piece.finish_reason is not None:
                self._in_slot[slot] = None
            else:
                self._write[slot] += 1
                self._last[slot] = tokens[slot]
        if self._period is not None:
            compile_s = self.engine.programs.compile_s - compiled
            self._period.decode_step_s.append(time.perf_counter() - start - compile_s)
            self._period.extra.setdefault("decode_rows", []).append(int(active.sum()))
        return pieces

    def _add(self, row: _Row, token: int, logits: Any, index: int) -> StreamPiece:
        log_probs = (
            log_softmax(np.asarray(logits)[index : index + 1])[0] if row.request.return_logprobs else None
        )
        if self._period is not None:
            self._period.new_tokens += 1
        return row.rows.add(0, token, log_probs)

    # -- statistics and warm-up -----------------------------------------------------------------------
    def begin(self) -> None:
        """A busy period starts: the engine counts its statistics from here (`end` returns them)."""
        self.engine.begin(self.slots)
        self._period = GenerationStats()
        self._period_compile_s = self.engine.programs.compile_s

    def end(self) -> GenerationStats:
        """The busy period's statistics: expert cache and policy as `generate` reports them, `tpot_s` the
        median decode step (every row's token), `compile_s` what compiled meanwhile (0 after `warmup`)."""
        stats, self._period = self._period, None
        if stats is None:
            raise RuntimeError("end() without begin()")
        stats.tpot_s = float(np.median(stats.decode_step_s)) if stats.decode_step_s else 0.0
        stats.compile_s = self.engine.programs.compile_s - self._period_compile_s
        self.engine.finish(stats)
        return stats

    def warmup(self, passes: int = 2) -> float:
        """Compiles every program serving will run: `passes` busy periods in which `slots` requests of one
        chunk of random tokens join and decode 3 tokens each (an offloaded model's steps stop at no layer only
        once its cache has filled, hence two). The expert policy learns nothing from them
        (`Engine.paused_learning`). Returns the seconds spent compiling."""
        if self.busy:
            raise RuntimeError("warm up before serving: requests are in the batch")
        compiled = self.engine.programs.compile_s
        rng = np.random.default_rng(0)
        vocab = self.model.config.vocab_size
        with self.engine.paused_learning():
            for _ in range(passes):
                self.begin()
                for i in range(self.slots):
                    ids = rng.integers(0, vocab, self.chunk).tolist()
                    request = resolve_request(self.model, [ids], max_new_tokens=3, stop_at_eos=False)
                    self.join(request, i)
                while self.busy:
                    self.prefill()
                    self.decode()
                self.end()
        return self.engine.programs.compile_s - compiled
