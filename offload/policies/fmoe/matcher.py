"""How fMoE's matcher runs the contexts the engine publishes, behind one interface (`Matcher`): on a thread
of its own (the paper's publisher/subscriber: the engine never waits for matching), inline (deterministic:
tests, and the simulator with a free matcher), or inline on the simulator's clock (each context takes the
matcher's modelled host time, behind the earlier ones). The work on a context is the policy's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal


@dataclasses.dataclass
class Context:
    """One piece of the matcher's work: a search (semantic, trajectory) or a store update."""

    kind: Literal["semantic", "trajectory", "update"]
    layer: int = -1
    data: Any = None
    extra: Any = None
    iteration: int = 0  # the policy's iteration count when published (a late match updates no guide)
    request: int = 0  # the policy's request count when published
    rows: Any = None  # update: each token's batch row
    requests: Any = None  # update: each row's request id (`IterationStart.requests`), or None
    token_hint: Any = None  # update: `[L, J]` what the rows' token contexts forecast (`TokenContexts`)
    published: float = 0.0  # on the simulated clock (`PolicyContext.clock`), when the simulator times it


Work = Callable[[Context], None]
# Whether a newer context waiting behind one makes it moot: the matcher may then skip it.
Superseded = Callable[[Context, Iterable[Context]], bool]


def superseded_rule(band: bool) -> Superseded:
    """Band targets: a newer prediction waiting behind a prediction replaces its prefetches anyway (each one
    covers every later layer), so the older may be skipped; an update is never skipped."""

    def superseded(context: Context, newer: Iterable[Context]) -> bool:
        return band and context.kind != "update" and any(c.kind != "update" for c in newer)

    return superseded


class Matcher:
    """Runs published contexts through `work`. A context the work fails on (say, routing with NaNs from a
    broken input) costs only its own prediction: it is dropped, counted in `counts["failed_contexts"]` and
    warned about once, and the matcher goes on with the next."""

    def __init__(self, work: Work, counts: collections.Counter):
        self.work = work
        self.counts = counts
        self.last_error: str | None = None  # the latest context the work failed on, and why

    def publish(self, context: Context) -> None:
        """Hands over a context (engine thread; never waits for matching)."""
        raise NotImplementedError

    def catch_up(self) -> None:
        """Finishes what is due by now: the simulator's clocked matcher at each event; others do nothing."""

    def wait_idle(self) -> None:
        """Blocks until every published context is done (tests, benchmarks)."""

    def close(self) -> None:
        """Finishes or drops what is left, and stops any thread."""

    def run(self, context: Context) -> None:
        try:
            self.work(context)
        except Exception as err:  # noqa: BLE001 - any failure of one context is reported, not fatal
            self.counts["failed_contexts"] += 1
            if self.last_error is None:
                warnings.warn(
                    f"fmoe matcher dropped a {context.kind} context: {err!r} (counted in "
                    "stats.extra['failed_contexts']; the model keeps serving)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.last_error = f"{context.kind}: {err!r}"


class InlineMatcher(Matcher):
    """Each context is done as it is published, on the engine's thread."""

    def publish(self, context: Context) -> None:
        self.run(context)


class ThreadedMatcher(Matcher):
    """A thread of its own drains the contexts, dropping the oldest beyond `queue_size` and skipping those a
    newer one supersedes."""

    def __init__(self, work: Work, counts: collections.Counter, *, queue_size: int, superseded: Superseded):
        super().__init__(work, counts)
        self.queue_size, self.superseded = queue_size, superseded
        # The engine thread only puts contexts here (a C-level queue: no Python lock for the engine thread to
        # take while the matcher holds the interpreter); the matcher drains it, drops and skips on its side.
        self._inbox: queue.SimpleQueue[Context | None] = queue.SimpleQueue()
        self._published = 0  # contexts put in the inbox (engine thread)
        self._done = 0  # contexts the matcher has finished with: processed, skipped or dropped
        self._thread: threading.Thread | None = threading.Thread(
            target=self._loop, name="fmoe-matcher", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def publish(self, context: Context) -> None:
        self._published += 1
        self._inbox.put(context)

    def wait_idle(self) -> None:
        while self._thread is not None and self._done < self._published:
            time.sleep(0.001)

    def close(self) -> None:
        """Stops the thread after the contexts it has."""
        if self._thread is not None:
            self._inbox.put(None)  # after the contexts already published
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        backlog: collections.deque[Context | None] = collections.deque()
        while True:
            if not backlog:
                backlog.append(self._inbox.get())  # waits, without holding the interpreter
            while True:  # everything published meanwhile
                try:
                    backlog.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            # The oldest go first when the matcher falls behind (never close()'s mark, which comes last).
            while len(backlog) > self.queue_size and backlog[0] is not None:
                backlog.popleft()
                self.counts["dropped_contexts"] += 1
                self._done += 1
            context = backlog.popleft()
            if context is None:  # close(): every context published before it is done
                return
            try:
                if self.superseded(context, (c for c in backlog if c is not None)):
                    self.counts["skipped_contexts"] += 1
                else:
                    self.run(context)
            finally:
                self._done += 1


class ClockedMatcher(Matcher):
    """The simulator's model of `ThreadedMatcher` (`PolicyContext.clock` and `.matcher_s`): finishes the
    contexts whose host time has run by now on the simulated clock, one at a time, the oldest first,
    dropping the oldest beyond `queue_size` and skipping one a newer one supersedes. Each takes `cost(kind)`
    seconds; its prefetches are requested at the first event after it finished."""

    def __init__(
        self,
        work: Work,
        counts: collections.Counter,
        *,
        queue_size: int,
        superseded: Superseded,
        clock: Callable[[], float],
        cost: Callable[[str], float],
    ):
        super().__init__(work, counts)
        self.queue_size, self.superseded, self.clock, self.cost = queue_size, superseded, clock, cost
        self._backlog: collections.deque[Context] = collections.deque()
        self._free_at = 0.0  # when the modelled thread is next free

    def publish(self, context: Context) -> None:
        context.published = self.clock()
        self._backlog.append(context)
        self.catch_up()

    def catch_up(self) -> None:
        now, backlog = self.clock(), self._backlog
        while backlog:
            start = max(self._free_at, backlog[0].published)
            if start > now:
                return
            waiting = sum(1 for c in backlog if c.published <= start)  # what the thread has seen by then
            if waiting > self.queue_size:
                backlog.popleft()
                self.counts["dropped_contexts"] += 1
                continue
            context = backlog[0]
            if self.superseded(context, itertools.islice(backlog, 1, waiting)):
                backlog.popleft()
                self.counts["skipped_contexts"] += 1
                continue
            finish = start + self.cost(context.kind)
            if finish > now:
                return
            backlog.popleft()
            self._free_at = finish
            self.run(context)

    def close(self) -> None:
        """The unfinished work: what it learns is kept, predictions made after the replay would prefetch
        for nothing."""
        for context in self._backlog:
            if context.kind == "update":
                self.run(context)
        self._backlog.clear()


def make_matcher(
    work: Work,
    counts: collections.Counter,
    *,
    asynchronous: bool,
    queue_size: int,
    band: bool,
    clock: Callable[[], float] | None,
    cost: Callable[[str], float],
    clocked: bool,
) -> Matcher:
    """The matcher a policy runs: threaded when `asynchronous`, else clocked when the simulator models the
    matcher's host time (`clocked`), else inline."""
    superseded = superseded_rule(band)
    if asynchronous:
        return ThreadedMatcher(work, counts, queue_size=queue_size, superseded=superseded)
    if clocked:
        return ClockedMatcher(
            work, counts, queue_size=queue_size, superseded=superseded, clock=clock, cost=cost
        )
    return InlineMatcher(work, counts)
