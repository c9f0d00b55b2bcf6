"""What followed each recent context of fed tokens (`TokenContexts`): a forecast of the experts the next
iterations use, from the tokens a request has fed so far, as an n-gram model with back-off. The reuse hint
(`FMoE._update`) joins it to the store's. The token ids are what an engine feeds and knows before a step
runs; routing recorded elsewhere may carry them too (`Iteration.tokens`). Decision "token contexts".
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

# Context lengths in tokens, the longest tried first: the last three tokens fed, else two, else one.
ORDERS = (3, 2, 1)
# Contexts kept per order, the least recently seen dropped first: 3 orders x 4,096 x L x J uint16 counts
# (19 MB at gpt-oss-20b's 24 x 32).
CAPACITY = 4096
_HALVE_AT = 60_000  # a context's counts halve here, within uint16


class TokenContexts:
    """For each context (the last n tokens a row fed, n in `ORDERS`), how often each expert was used within
    the `horizon` iterations that followed it: `hint` reads P(used within the horizon | the longest context
    seen before) for each row, and the rows' chances combine as independent.

    A row's state (its recent tokens, the contexts still inside their horizon) is kept per request key;
    `start_request` forgets every row's, not what was learned.
    """

    def __init__(self, num_layers: int, num_experts: int, horizon: int, capacity: int = CAPACITY):
        self.shape, self.horizon, self.capacity = (num_layers, num_experts), horizon, capacity
        self._counts = {n: collections.OrderedDict() for n in ORDERS}  # context -> (times, [L * J] uses)
        self._rows: dict[Hashable, _Row] = {}
        self._fed: np.ndarray | None = None  # the current iteration's (`begin_iteration`)
        self._valid: np.ndarray | None = None
        self._ids: np.ndarray | None = None

    def __len__(self) -> int:
        return sum(len(table) for table in self._counts.values())

    def start_request(self) -> None:
        self._rows.clear()

    def keep_rows(self, rows: Sequence[Hashable]) -> None:
        """Forgets the state of every row but `rows` (requests that have left a continuous batch), once
        there are twice as many."""
        if len(self._rows) > 2 * len(rows):
            keep = set(rows)
            self._rows = {key: state for key, state in self._rows.items() if key in keep}

    def learn_traces(self, traces: Sequence[Any]) -> None:
        """Learns recorded requests (`RoutingTrace`s) from the tokens they fed (`Iteration.tokens`), each
        from its start up to its first iteration without them; the rows are then forgotten."""
        for trace in traces:
            for request in trace.requests:
                self.start_request()
                for it in request.iterations:
                    if it.tokens is None:
                        break
                    valid = np.ones((1, it.num_tokens), bool)
                    self.observe(
                        0, it.tokens.tolist(), used_by_row(np.asarray(it.ids), valid, self.shape[1])[0]
                    )
        self.start_request()

    def begin_iteration(self, tokens: np.ndarray | None, valid: np.ndarray, top_k: int) -> None:
        """An iteration of a batch starts: `tokens` `[N]` the ids it feeds (None: unknown, it is not
        learned), `valid` `[B, T]`. Several rows' experts are then kept as each layer routes (`route`)."""
        self._fed, self._valid = tokens, valid
        rows, width = valid.shape
        self._ids = None
        if tokens is not None and rows > 1:
            self._ids = np.zeros((rows * width, self.shape[0], top_k), np.int64)

    def route(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer`'s choices `[N, k]`, kept where the iteration has several rows."""
        if self._ids is not None:
            self._ids[:, layer] = ids

    def end_iteration(self, requests: Sequence[Hashable] | None, used: np.ndarray) -> list[Hashable] | None:
        """The iteration has ended: each row's tokens and experts are observed (`used` `[L, J]`: the whole
        iteration's, which are one row's own; `requests`: each row's request, None: the rows are the
        requests). Returns the keys of the rows that fed any (for `hint`), or None without tokens."""
        fed, valid = self._fed, self._valid
        if fed is None:
            return None
        rows, tokens = valid.shape
        if rows == 1 and tokens == 1 and requests is None:  # decode at batch 1
            if not valid[0, 0]:
                return []
            self.observe(0, [int(fed[0])], used)
            return [0]
        keys = requests if requests is not None else range(rows)
        if requests is not None:  # continuous batching: a row's request changes as requests leave
            self.keep_rows(keys)
        by_row = [used] if rows == 1 else used_by_row(self._ids, valid, self.shape[1])
        fed = fed.reshape(rows, tokens)
        active = []
        for b, key in enumerate(keys):
            if valid[b].any():
                self.observe(key, fed[b][valid[b]].tolist(), by_row[b])
                active.append(key)
        return active

    def observe(self, row: Hashable, tokens: Sequence[int], used: np.ndarray | None) -> None:
        """One iteration of `row`: it fed `tokens` (a prefill's, or decode's one) and used `used` (`[L, J]`
        bool; None: not known, nothing learned). The contexts inside their horizon count `used`; a decode
        iteration's contexts (ending with its token) start theirs."""
        state = self._rows.get(row)
        if state is None:
            state = self._rows[row] = _Row()
        if used is not None:
            flat = used.reshape(-1)
            done = 0
            for pending in state.pending:
                if pending.used is None:  # its first iteration: a copy
                    pending.used = flat.copy()
                else:
                    pending.used |= flat
                pending.left -= 1
                done += pending.left == 0
            for _ in range(done):  # the oldest first: those whose horizon has passed
                self._learn(state.pending.popleft())
        else:
            state.pending.clear()  # an iteration not seen: the horizons it falls in are incomplete
        state.recent.extend(tokens)
        recent = tuple(state.recent)
        state.contexts = [(n, recent[-n:]) for n in ORDERS if len(recent) >= n]
        if len(tokens) == 1 and used is not None:
            state.pending.append(_Pending(state.contexts, self.horizon))

    def hint(self, rows: Sequence[Hashable]) -> np.ndarray | None:
        """`[L, J]` the chance each expert is used within the horizon by any of `rows` (None: no row's
        context was seen before)."""
        stays = None
        for row in rows:
            state = self._rows.get(row)
            p = None if state is None else self._predict(state.contexts)
            if p is not None:
                stays = 1.0 - p if stays is None else stays * (1.0 - p)
        return None if stays is None else (1.0 - stays).reshape(self.shape)

    def _predict(self, contexts: list[tuple[int, tuple[int, ...]]]) -> np.ndarray | None:
        for n, context in contexts:
            found = self._counts[n].get(context)
            if found is not None:
                times, uses = found
                return uses / float(times)
        return None

    def _learn(self, pending: _Pending) -> None:
        for n, context in pending.contexts:
            table = self._counts[n]
            found = table.get(context)
            if found is None:
                found = [0, np.zeros(pending.used.size, np.uint16)]
                table[context] = found
                if len(table) > self.capacity:
                    table.popitem(last=False)
            else:
                table.move_to_end(context)
            found[0] += 1
            found[1] += pending.used
            if found[0] >= _HALVE_AT:
                found[0] //= 2
                found[1] //= 2


class _Row:
    __slots__ = ("contexts", "pending", "recent")

    def __init__(self) -> None:
        self.recent: collections.deque = collections.deque(maxlen=max(ORDERS))  # the last tokens fed
        self.contexts: list[tuple[int, tuple[int, ...]]] = []  # (n, the last n of them), the longest first
        self.pending: collections.deque = collections.deque()  # contexts still inside their horizon


class _Pending:
    __slots__ = ("contexts", "left", "used")

    def __init__(self, contexts: list, left: int):
        self.contexts, self.left = contexts, left
        self.used: np.ndarray | None = None  # [L * J] bool, the experts of the iterations since


def used_by_row(ids: np.ndarray, valid: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """Each row's experts `[L, J]` bool from an iteration's routing `ids` `[B * T, L, k]` and `valid`
    `[B, T]`: those its valid tokens chose."""
    rows, tokens = valid.shape
    layers = ids.shape[1]
    if tokens == 1 and valid.all():  # decode, every row active: each row's one token
        masks = np.zeros((rows, layers, num_experts), bool)
        masks[np.arange(rows)[:, None, None], np.arange(layers)[None, :, None], ids] = True
        return list(masks)
    out = []
    for b in range(rows):
        chosen = ids[b * tokens : (b + 1) * tokens][valid[b]]  # [t, L, k]
        mask = np.zeros((layers, num_experts), bool)
        if len(chosen):
            np.put_along_axis(
                mask, chosen.transpose(1, 0, 2).reshape(layers, -1).astype(np.int64), True, axis=1
            )
        out.append(mask)
    return out
