"""The simulator's physical resources on its clock: the host-to-device link (`SimulatedLink`, copies in
chunks, on-demand loads ahead of prefetch chunks not yet started, cancellation between chunks) and the host
CPU that computes missed experts under hybrid execution (`SimulatedHost`). `offload/simulator.py` drives them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

from .cache import Key, Mover
from .hybrid import ModelledHostCost


@dataclasses.dataclass(eq=False, slots=True)
class Copy:
    """A simulated host-to-device copy (the `SimulatedLink`'s handle)."""

    key: Key
    urgent: bool  # an on-demand load: served before every prefetch chunk not yet started
    submitted_s: float  # when the host asked for it
    chunks_left: int  # chunks the link has not started
    done_s: float = math.inf  # when its last chunk lands (known once that chunk has started)


class SimulatedLink(Mover):
    """A `Mover` over one host-to-device link with a simulated clock, copying in chunks.

    An expert goes over in `chunks` equal pieces (one per weight matrix by default), one piece at a time,
    each taking `chunk_latency_s` (the copy's fixed cost, `HardwarePreset.copy_latency_s`) beside its bytes.
    The link serves urgent copies (on-demand loads) before any prefetch piece it has not started, so a
    miss waits behind at most the one piece already under way; prefetches are served in the order asked,
    back to back while any wait; a prefetch can be cancelled before its first piece (or between pieces,
    with `finish_started=False`; see `transfer.ChunkedJaxMover` for why started copies finish). `wait`
    advances the clock to the last completion and counts the advance as stall time (compute waiting for
    experts); `compute` advances it by compute time. The link's schedule is worked out lazily: a piece is
    committed when the clock passes its start, so a later urgent copy can still go ahead of the pieces not
    yet started.
    """

    def __init__(
        self,
        expert_bytes: int,
        bytes_per_s: float,
        *,
        chunks: int = 3,
        finish_started: bool = True,
        chunk_latency_s: float = 0.0,
    ):
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bytes_per_s} bytes/s")
        if chunks < 1:
            raise ValueError(f"an expert goes over in at least one chunk, got chunks={chunks}")
        if chunk_latency_s < 0:
            raise ValueError(f"a chunk's fixed cost must be >= 0, got {chunk_latency_s} s")
        self.chunks = chunks
        self.finish_started = finish_started
        self.chunk_s = chunk_latency_s + expert_bytes / bytes_per_s / chunks  # each piece pays the fixed cost
        self.copy_s = chunks * self.chunk_s
        self.clock = 0.0
        self.free_at = 0.0  # when the last piece the link has started completes
        self.urgent: collections.deque[Copy] = collections.deque()
        self.background: collections.deque[Copy] = collections.deque()
        self.stall_s = 0.0
        self.compute_s = 0.0
        self.busy_s = 0.0

    def _commit_one(self) -> bool:
        """Starts the next piece (the caller checked its start time). False when there is none."""
        queue = self.urgent or self.background
        if not queue:
            return False
        copy = queue[0]
        free_at, submitted = self.free_at, copy.submitted_s
        self.free_at = (submitted if submitted > free_at else free_at) + self.chunk_s  # its start: the max
        self.busy_s += self.chunk_s
        copy.chunks_left -= 1
        if copy.chunks_left == 0:
            copy.done_s = self.free_at
            queue.popleft()
        return True

    def _commit_copy(self) -> bool:
        """Starts every piece left of the next copy, one after another (as `_commit_one` would: nothing
        else is asked of the link meanwhile, so no other piece goes between them). False when there is
        none."""
        queue = self.urgent or self.background
        if not queue:
            return False
        copy = queue.popleft()
        free_at, submitted, chunk_s = self.free_at, copy.submitted_s, self.chunk_s
        start = submitted if submitted > free_at else free_at  # the max: later pieces start at `free_at`
        busy = self.busy_s
        for _ in range(copy.chunks_left):
            start += chunk_s
            busy += chunk_s
        self.free_at = copy.done_s = start
        self.busy_s = busy
        copy.chunks_left = 0
        return True

    def _advance(self, until: float) -> None:
        """Commits every piece that starts before `until`."""
        while queue := self.urgent or self.background:
            free_at, submitted = self.free_at, queue[0].submitted_s
            if (submitted if submitted > free_at else free_at) >= until:  # its start: the max
                return
            self._commit_one()

    def start(self, key: Key, *, urgent: bool = False) -> Copy:
        if self.urgent or self.background:
            self._advance(self.clock)
        copy = Copy(key, urgent, self.clock, self.chunks)
        (self.urgent if urgent else self.background).append(copy)
        return copy

    def is_ready(self, handle: Copy) -> bool:
        if handle.done_s == math.inf:  # else its last piece is committed: when it lands is known
            self._advance(self.clock)
        return handle.done_s <= self.clock

    def landing_in(self, handle: Copy, ahead: int = 0) -> float:
        """Seconds from now until `handle`'s copy lands (0 once it has), if `ahead` more on-demand copies are
        issued now (they go before a prefetch's pieces not yet started): the hybrid planner's question."""
        self._advance(self.clock)
        if handle.done_s != math.inf:
            return max(0.0, handle.done_s - self.clock)
        queue = self.urgent if handle.urgent else self.background
        pieces = sum(c.chunks_left for c in itertools.takewhile(lambda c: c is not handle, queue))
        pieces += handle.chunks_left
        if not handle.urgent:
            pieces += sum(c.chunks_left for c in self.urgent) + ahead * self.chunks
        return max(self.free_at, self.clock) - self.clock + pieces * self.chunk_s

    def load_in(self, ahead: int = 0) -> float:
        """Seconds from now until an on-demand copy issued now, behind `ahead` others, would land: after the
        piece under way and the urgent copies waiting, before the prefetches' pieces not yet started."""
        self._advance(self.clock)
        pieces = sum(c.chunks_left for c in self.urgent) + (ahead + 1) * self.chunks
        return max(self.free_at, self.clock) - self.clock + pieces * self.chunk_s

    loads_now = True  # copies land on the simulated clock: nothing to block on

    def load_now(self, keys: Sequence[Key]) -> list[Copy]:
        """`start(key, urgent=True)` of each of `keys` and one `wait`, worked out at once when the link holds
        no other copy (the same floats: each piece starts at the max of its copy's submission and the
        link's last piece, and the clock moves to the last landing); else by those calls."""
        if self.urgent or self.background:
            return super().load_now(keys)
        now, free_at, busy, chunk_s, chunks = self.clock, self.free_at, self.busy_s, self.chunk_s, self.chunks
        handles = []
        for key in keys:
            start = now if now > free_at else free_at
            for _ in range(chunks):
                start += chunk_s
                busy += chunk_s
            free_at = start
            handles.append(Copy(key, True, now, 0, start))
        self.free_at, self.busy_s = free_at, busy
        if handles and free_at > now:  # the landings only grow: the last is the latest
            self.stall_s += free_at - now
            self.clock = free_at
        return handles

    def wait(self, handles: Sequence[Copy]) -> None:
        if self.urgent or self.background:
            self._advance(self.clock)
        for handle in handles:  # the link's pieces in its order, until every handle's last has started
            while handle.done_s == math.inf:
                if not self._commit_copy():
                    raise RuntimeError("waiting for a copy the link does not hold (cancelled?)")
        until = self.clock
        for handle in handles:
            if handle.done_s > until:
                until = handle.done_s
        if until > self.clock:
            self.stall_s += until - self.clock
            self.clock = until

    def cancel(self, handle: Copy) -> float | None:
        self._advance(self.clock)
        if handle.done_s != math.inf:
            return None  # its last piece is under way or done
        if self.finish_started and handle.chunks_left < self.chunks:
            return None  # started: it lands
        queue = self.urgent if handle.urgent else self.background
        queue.remove(handle)
        return handle.chunks_left / self.chunks

    def compute(self, seconds: float) -> None:
        self.compute_s += seconds
        self.clock += seconds


class SimulatedHost:
    """The host CPU on the simulated clock: a layer's host call starts when the layer has routed, runs
    concurrently with the device and the link, and takes `ModelledHostCost.call_s`; the device waits for its
    result before finishing the layer."""

    def __init__(self, cost: ModelledHostCost | None):
        self.cost = cost
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.done_at: float | None = None  # the pending call's result, simulated time

    def start(self, now: float, tokens: int, expert_tokens: list[int]) -> None:
        seconds = self.cost.call_s(tokens, expert_tokens)
        self.busy_s += seconds
        self.done_at = now + seconds

    def join(self, link: SimulatedLink) -> None:
        """The device takes the pending call's result: the clock moves on to it if it is not there yet."""
        if self.done_at is not None and self.done_at > link.clock:
            self.wait_s += self.done_at - link.clock
            link.clock = self.done_at
        self.done_at = None
