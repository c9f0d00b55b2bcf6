"""The movers: how an expert's host arrays are copied to a device for a `DeviceExpertCache`
(`offload/cache/device.py`), as `OffloadConfig.transfer` chooses.

- "direct": `JaxMover` issues each expert's `jax.device_put` at once (the runtime orders the copies);
- "thread": `ThreadedJaxMover` issues whole copies from a transfer thread of its own, on-demand loads first;
- "chunked": `ChunkedJaxMover` sends them from that thread one matrix at a time, on-demand loads first, and
  can stop a prefetch between matrices;
- "synchronous": direct copies, each waited for as it is issued (the cache's `synchronous`).
`TimedMover` wraps any of them and times its copies, for the hybrid planner and the link's busy share; the
simulator plugs in a simulated link (`offload/resources.py`).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from fmoe_jax.models.moe import ExpertWeights

from .cache import Key, Mover

# Platforms whose copies go through a compiled program by default (`copier`): measured by
# `benchmarks/link_compute.py` ("copy call"); a platform not listed uses `jax.device_put` until measured.
PROGRAM_COPIES = frozenset({"cpu"})


def copier(device: jax.sharding.Sharding, by_program: bool | None = None) -> Callable[[Any], Any]:
    """A function that copies a pytree of arrays to `device`, returning without waiting: `jax.device_put`, or
    (`by_program`; None: as `PROGRAM_COPIES` says for the device's platform) a compiled program that does
    the same copy, whose launch costs the host less than `device_put`'s dispatch on the CPU backend."""
    if by_program is None:
        by_program = next(iter(device.device_set)).platform in PROGRAM_COPIES
    if not by_program:
        return functools.partial(jax.device_put, device=device)
    return jax.jit(functools.partial(jax.device_put, device=device))


class JaxMover(Mover):
    """Asynchronous copies of an expert's host arrays to a device sharding, issued at once (`copier`)."""

    def __init__(
        self,
        host: Callable[[Key], ExpertWeights],
        device: jax.sharding.Sharding,
        *,
        by_program: bool | None = None,
    ):
        self.host = host
        self.device = device
        self._copy = copier(device, by_program)

    def start(self, key: Key, *, urgent: bool = False) -> ExpertWeights:
        return self._copy(self.host(key))

    def is_ready(self, handle: ExpertWeights) -> bool:
        return all(a.is_ready() for a in jax.tree.leaves(handle))  # quantized matrices hold two arrays

    def wait(self, handles: Sequence[ExpertWeights]) -> None:
        jax.block_until_ready(list(handles))


class _Transfer:
    """One expert's copy by `ChunkedJaxMover`: its host arrays (the chunks), sent in order."""

    def __init__(self, key: Key, leaves: list[Any], treedef: Any):  # treedef None: one chunk, the whole
        self.key, self.leaves, self.treedef = key, leaves, treedef
        self.sent: list[jax.Array] = []  # the device arrays of the chunks that have landed
        self.sending = False  # a chunk is on the link
        self.cancelled = False
        self.done = threading.Event()  # landed, failed or cancelled
        self.error: BaseException | None = None
        self.arrays: Any = None  # the expert's device arrays, once landed

    def unsent_share(self) -> float:
        """The share of the expert's bytes not sent and not under way."""

        def nbytes(chunk: Any) -> int:
            return sum(leaf.nbytes for leaf in jax.tree.leaves(chunk))

        total = sum(nbytes(leaf) for leaf in self.leaves)
        later = self.leaves[len(self.sent) + self.sending :]
        return sum(nbytes(leaf) for leaf in later) / max(total, 1)

    def landed(self) -> Any:
        """The expert's device arrays from its landed chunks."""
        if self.treedef is None:  # sent whole
            return self.sent[0]
        return jax.tree.unflatten(self.treedef, self.sent)


class _Link:
    """`ChunkedJaxMover`'s queues and its transfer thread's loop. The thread holds only this (not the mover,
    whose host-array source keeps the model alive), and stops once the mover is closed or collected."""

    def __init__(self, device: jax.sharding.Sharding):
        self.device = device
        self._copy = copier(device)
        self.cv = threading.Condition()
        self.urgent: collections.deque[_Transfer] = collections.deque()  # on-demand loads, in order
        self.queued: collections.deque[_Transfer] = collections.deque()  # prefetches, in the order started
        self.closed = False

    def send(self, leaf: Any) -> jax.Array:
        """One chunk to the device, waiting until it has landed."""
        return jax.block_until_ready(self._copy(leaf))

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def run(self) -> None:
        while True:
            with self.cv:
                while not (self.urgent or self.queued or self.closed):
                    self.cv.wait()
                if self.closed:
                    for transfer in (*self.urgent, *self.queued):
                        transfer.error = RuntimeError("the expert transfer thread was closed")
                        transfer.done.set()
                    return
                line = self.urgent if self.urgent else self.queued
                transfer = line[0]
                leaf = transfer.leaves[len(transfer.sent)]
                transfer.sending = True
            try:  # one chunk on the link at a time: what comes next is decided between chunks
                chunk, error = self.send(leaf), None
            except Exception as err:  # noqa: BLE001 - handed to whoever waits for this copy
                chunk, error = None, err
            with self.cv:
                transfer.sending = False
                if transfer.cancelled:  # it left its line when cancelled
                    continue
                if error is None:
                    transfer.sent.append(chunk)
                if error is not None or len(transfer.sent) == len(transfer.leaves):
                    line.remove(transfer)
                    transfer.error = error
                    if error is None:
                        transfer.arrays = transfer.landed()
                    transfer.done.set()


class ThreadedJaxMover(Mover):
    """Copies whole experts (one `device_put` of all an expert's arrays) from a transfer thread of its own:
    on-demand loads (`urgent`) before every prefetch, prefetches in the order they were started; `cancel`
    stops a prefetch that is no longer wanted before it starts. Issuing a copy leaves the caller's thread,
    but a miss may wait behind a whole prefetch. `OffloadConfig(transfer="thread")`; decision "transfer
    thread".

    The cost: a copy waits for the previous one to land before it is issued (the link is never given two at
    once, so that the order stays ours), and each is a thread hand-off.
    """

    def __init__(
        self,
        host: Callable[[Key], ExpertWeights],
        device: jax.sharding.Sharding,
        *,
        finish_started: bool = True,
    ):
        self.host = host
        self.finish_started = finish_started
        self._link = _Link(device)
        thread = threading.Thread(target=self._link.run, name="fmoe-expert-transfers", daemon=True)
        thread.start()
        self._closer = weakref.finalize(self, self._link.close)

    def _transfer(self, key: Key, expert: ExpertWeights) -> _Transfer:
        return _Transfer(key, [expert], None)  # one chunk: the whole pytree in one device_put

    def start(self, key: Key, *, urgent: bool = False) -> _Transfer:
        transfer = self._transfer(key, self.host(key))
        with self._link.cv:
            if self._link.closed:
                raise RuntimeError("the expert transfer thread was closed")
            (self._link.urgent if urgent else self._link.queued).append(transfer)
            self._link.cv.notify()
        return transfer

    def is_ready(self, handle: _Transfer) -> bool:
        return handle.done.is_set()

    def wait(self, handles: Sequence[_Transfer]) -> None:
        for handle in handles:
            handle.done.wait()
            if handle.error is not None:
                raise handle.error

    def result(self, handle: _Transfer) -> ExpertWeights:
        if handle.error is not None:
            raise handle.error
        return handle.arrays

    def cancel(self, handle: _Transfer) -> float | None:
        with self._link.cv:
            if handle.done.is_set() or handle.cancelled:
                return None
            unsent = handle.unsent_share()
            if handle.sending and unsent == 0.0:  # its last chunk is under way
                return None
            if self.finish_started and (handle.sent or handle.sending):
                return None
            for line in (self._link.urgent, self._link.queued):
                if handle in line:
                    line.remove(handle)
            handle.cancelled = True
            handle.error = RuntimeError(f"the copy of expert {handle.key} was cancelled")
            handle.done.set()
            return unsent

    def close(self) -> None:
        """Stops the transfer thread; copies not landed fail."""
        self._closer()


class ChunkedJaxMover(ThreadedJaxMover):
    """`ThreadedJaxMover`, one chunk (one of the expert's arrays: a matrix, or a quantized matrix's values or
    scales) at a time. So an on-demand load waits behind at most one chunk of a prefetch, and `cancel` stops
    a prefetch that is no longer wanted before its first chunk, or between chunks with
    `finish_started=False`, freeing the link (the simulator's `SimulatedLink` models the same).
    `OffloadConfig(transfer="chunked")`.

    A started copy finishes by default (decision "finish started copies"): a cancelled copy's sent chunks are
    wasted link time, and the prediction it served was often right after all. On a GPU each chunk pays the
    copy's fixed cost (`benchmarks/link_compute.py`).
    """

    def _transfer(self, key: Key, expert: ExpertWeights) -> _Transfer:
        return _Transfer(key, *jax.tree.flatten(expert))


def jax_mover(transfer: str, host: Callable[[Key], ExpertWeights], device: jax.sharding.Sharding) -> Mover:
    """The mover of `OffloadConfig.transfer` (`offload/config.py`'s `TRANSFERS`) for experts from `host` to
    `device`; "synchronous" copies directly, the cache waiting for each (`DeviceExpertCache.synchronous`)."""
    if transfer == "chunked":
        return ChunkedJaxMover(host, device)
    if transfer == "thread":
        return ThreadedJaxMover(host, device)
    if transfer in ("direct", "synchronous"):
        return JaxMover(host, device)
    raise ValueError(f"transfer must be 'direct', 'thread', 'chunked' or 'synchronous', got {transfer!r}")


class TimedMover(Mover):
    """A `Mover` around another (`JaxMover`, `ThreadedJaxMover`, `ChunkedJaxMover`) that times its copies,
    for the hybrid planner (`landing_in`, `load_in`) and the link's busy share; every engine's cache copies
    through one. A copy's time runs from its start to when the cache first sees it done (polled or waited
    for): an upper bound, averaged exponentially into `copy_s`."""

    def __init__(self, inner: Mover, decay: float = 0.8):
        self.inner = inner
        self.decay = decay
        self.copy_s: float | None = None
        self.started: dict[int, tuple[float, Any]] = {}  # id(handle) -> (start, handle: keeps the id unique)
        self.busy_s = 0.0
        self._busy_until = 0.0

    def calibrate(self, key: Key) -> None:
        """Times one copy of `key` (discarded), so that the planner has a copy time before the first miss."""
        self.wait([self.start(key)])

    def start(self, key: Key, *, urgent: bool = False) -> Any:
        handle = self.inner.start(key, urgent=urgent)
        self.started[id(handle)] = (time.perf_counter(), handle)
        return handle

    def result(self, handle: Any) -> Any:
        return self.inner.result(handle)

    def close(self) -> None:
        self.inner.close()

    def cancel(self, handle: Any) -> float | None:
        unsent = self.inner.cancel(handle)
        if unsent is not None:
            self.started.pop(id(handle), None)
        return unsent

    def is_ready(self, handle: Any) -> bool:
        ready = self.inner.is_ready(handle)
        if ready:
            self._landed([handle])
        return ready

    def wait(self, handles: Sequence[Any]) -> None:
        self.inner.wait(handles)
        self._landed(handles)

    def _landed(self, handles: Sequence[Any]) -> None:
        now = time.perf_counter()
        for handle in handles:
            record = self.started.pop(id(handle), None)
            if record is None:
                continue
            begin = record[0]
            seconds = now - begin
            old = self.copy_s
            self.copy_s = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
            self.busy_s += max(0.0, now - max(begin, self._busy_until))
            self._busy_until = max(self._busy_until, now)

    def landing_in(self, handle: Any, ahead: int = 0) -> float:
        """The rest of the average copy time (`ahead` is ignored: `jax.device_put` has no priorities)."""
        record = self.started.get(id(handle))
        if record is None or self.copy_s is None:
            return 0.0
        return max(0.0, record[0] + self.copy_s - time.perf_counter())

    def load_in(self, ahead: int = 0) -> float:
        return (ahead + 1) * (self.copy_s or 0.0)
