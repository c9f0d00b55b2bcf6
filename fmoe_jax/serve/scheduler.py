"""`Scheduler`: the queue between fmoe-serve's HTTP handlers and the model, and the thread that serves it.

The HTTP layer submits a request's token ids and `generate` options and reads the `Job` it gets back (an
async iterator of `StreamPiece`s); this module is the only part of the server that calls the model.

How requests are served. One thread takes queued jobs in order of arrival. With `max_batch=1` (the default)
each job runs alone as one `generate_stream` call, exactly as `fmoe_jax.generate` would run it. With
`max_batch` > 1 greedy jobs go through continuous batching (`fmoe_jax.batching.ContinuousBatch`, `max_batch`
slots): a job joins the running batch at the next iteration boundary when a slot is free, its prompt is
prefilled a chunk per iteration while the other rows keep decoding, and it leaves its slot when it
finishes. A job's greedy tokens then do not depend on which other jobs share its iterations (the batch's
programs have one shape whoever is in it), but they may differ from `generate`'s where bfloat16 rounding
of a near-tie differs between a chunked prefill and a whole one. Jobs the batch does not take (sampled ones,
so that a `seed` reproduces `generate`'s tokens; a repetition penalty; a prompt longer than the batch's
context) run alone once the batch has drained: the queue stays first come, first served. The model is held
(`Model.serving`) from a busy period's first job to its last.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import fmoe_jax as fj
from fmoe_jax.batching import ContinuousBatch
from fmoe_jax.generation import resolve_request
from fmoe_jax.request import Request


class QueueFull(Exception):
    """`submit` refused a job: `max_queue` jobs are waiting already."""


class ShuttingDown(Exception):
    """`submit` refused a job: the scheduler is closing."""


_DONE = object()  # the end of a job's pieces


@dataclasses.dataclass
class _Failed:
    error: BaseException


class Job:
    """One submitted request: iterate it (`async for piece in job`) for its `StreamPiece`s as they are made.

    Iteration ends after the piece with a `finish_reason`; it raises what the generation raised, or
    `ShuttingDown` when the scheduler cancelled the job while closing. Timestamps are `time.perf_counter()`.
    """

    def __init__(self, prompt_ids: list[int], options: dict[str, Any], request: Request):
        self.prompt_ids, self.options, self.request = prompt_ids, options, request
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.finished = False  # its last piece (or its error) has been handed over
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.tokens = 0

    def _put(self, item: Any) -> None:
        """Hands a piece (or the end) to the job's event loop; called on the scheduler thread."""
        if self.finished:
            return
        now = time.perf_counter()
        if isinstance(item, fj.StreamPiece):
            self.first_token_s = self.first_token_s or now
            self.last_token_s, self.tokens = now, self.tokens + 1
        else:
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[fj.StreamPiece]:
        while True:
            item = await self.queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if item is _DONE:
                return
            yield item


class Scheduler:
    """Serves submitted jobs on one thread, in order of arrival (batched as the module docstring says).

    Args:
      model: a loaded `fmoe_jax.Model`.
      max_batch: sequences decoding at once (1: every job alone, as `generate` runs it).
      max_queue: most jobs waiting (not yet running); `submit` raises `QueueFull` beyond it.
      on_batch: called with each busy period's `GenerationStats` (for the server's metrics): one
        `generate` call's, or a continuous batch's from its first job to its idle end.
      context: with `max_batch` > 1, cache positions per slot (default: the model's context, at most 2048).
      chunk: with `max_batch` > 1, prompt tokens prefilled per iteration.
    """

    def __init__(
        self,
        model: fj.Model,
        *,
        max_batch: int = 1,
        max_queue: int = 64,
        on_batch: Callable[[fj.GenerationStats], None] | None = None,
        context: int | None = None,
        chunk: int = 16,
    ):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.model, self.max_batch, self.max_queue, self.on_batch = model, max_batch, max_queue, on_batch
        self.batch: ContinuousBatch | None = None
        if max_batch > 1:
            limit = model.config.max_position_embeddings
            self.batch = ContinuousBatch(
                model, slots=max_batch, context=context or min(limit, 2048), chunk=chunk
            )
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._active = False  # from taking a job until its busy period's statistics are reported
        self._cv = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="fmoe-serve-scheduler", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting to run."""
        return len(self._waiting)

    @property
    def accepting(self) -> bool:
        """Whether `submit` takes jobs (False once `close` began)."""
        return self._accepting

    @property
    def running(self) -> int:
        """Jobs now running (in the continuous batch's slots, or the one running alone)."""
        return len(self._running)

    @property
    def idle(self) -> bool:
        """Nothing waits or runs, and the last busy period's statistics have gone to `on_batch`."""
        with self._cv:
            return not self._waiting and not self._active

    def warmup(self) -> float:
        """Compiles the continuous batch's programs (`ContinuousBatch.warmup`) before serving; returns the
        seconds spent compiling. Without batching (`max_batch=1`), `generate`'s shapes depend on each
        prompt's length and nothing is compiled here (0.0)."""
        if self.batch is None:
            return 0.0
        with self.model.serving():
            return self.batch.warmup()

    def submit(self, prompt_ids: list[int], options: dict[str, Any], request: Request | None = None) -> Job:
        """Queues a job: `prompt_ids` generated from with `generate`'s keyword `options`. Call it from the
        event loop that will read the job. `request` is the two resolved by `resolve_request` (the server
        does it off the event loop), resolved here when None. Raises `ValueError` (generate's, for invalid
        options), `QueueFull` or `ShuttingDown`."""
        if request is None:
            request = resolve_request(self.model, prompt_ids, **options)  # checks them
        job = Job(prompt_ids, options, request)
        with self._cv:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue)")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drops a job (its client went away): out of the queue, or out of its slot at the next iteration
        (a job running alone stops at its next token). No-op for a finished job."""
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)

    def close(self, timeout: float | None = None) -> None:
        """Stops taking jobs, cancels those waiting and the running ones (each gets `ShuttingDown`), and
        waits up to `timeout` seconds for the thread. To finish in-flight requests first, wait until `depth`
        and `running` are 0 (fmoe-serve lets uvicorn's graceful shutdown do that)."""
        with self._cv:
            self._accepting = False
            self._stop = True
            for job in self._waiting:
                job._put(_Failed(ShuttingDown("the server shut down before serving this request")))
            self._waiting.clear()
            self._cv.notify()
        self._thread.join(timeout)

    # -- the scheduler thread ------------------------------------------------------------------------------
    def _batched(self, job: Job) -> bool:
        return self.batch is not None and self.batch.accepts(job.request) is None

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._waiting.popleft()
                self._running, self._active = [job], True
            try:
                if self._batched(job):
                    self._serve_batch(job)
                else:
                    self._serve_alone(job)
            finally:
                with self._cv:
                    self._running, self._active = [], False

    def _serve_alone(self, job: Job) -> None:
        stream = fj.generate_stream(self.model, job.prompt_ids, **job.options)
        try:
            with stream:
                for piece in stream:
                    self._hand(job, piece)
                    if self._stop or job.cancelled:
                        break
            if job.finished and not job.cancelled and self.on_batch is not None:
                self.on_batch(stream.output.stats)
        except Exception as error:  # noqa: BLE001 - handed to the job's client, the thread goes on
            job._put(_Failed(error))
        job._put(_Failed(ShuttingDown("the server shut down while serving this request")))

    def _serve_batch(self, first: Job) -> None:
        """One busy period of the continuous batch: from `first` until no job is in it and the next waiting
        job (if any) is not one it takes."""
        batch = self.batch
        served = False  # whether a job got all its tokens (a period of cancelled jobs reports nothing)
        with self.model.serving():
            batch.begin()
            try:
                batch.join(first.request, first)
                while True:
                    with self._cv:
                        if self._stop:
                            break
                        for job in [j for j in self._running if j.cancelled]:
                            batch.leave(job)
                            self._running.remove(job)
                        while self._waiting and batch.free and self._batched(self._waiting[0]):
                            job = self._waiting.popleft()
                            batch.join(job.request, job)
                            self._running.append(job)
                    if not batch.busy:
                        break
                    for job, piece in batch.prefill() + batch.decode():
                        if self._hand(job, piece):
                            served = True
                            with self._cv:
                                self._running.remove(job)
            except Exception as error:  # noqa: BLE001 - handed to every client in the batch, the thread goes on
                for job in self._running:
                    job._put(_Failed(error))
            finally:
                with self._cv:
                    for job in self._running:
                        batch.leave(job)
                        job._put(_Failed(ShuttingDown("the server shut down while serving this request")))
                stats = batch.end()
        if served and self.on_batch is not None:
            self.on_batch(stats)

    @staticmethod
    def _hand(job: Job, piece: fj.StreamPiece) -> bool:
        """Gives `piece` to its job (unless cancelled); True when it was the job's last."""
        if job.cancelled:
            return False
        job._put(dataclasses.replace(piece, row=0))
        if piece.finish_reason is None:
            return False
        job._put(_DONE)
        return True
