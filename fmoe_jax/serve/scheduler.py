"""`Scheduler`: the queue between fmoe-serve's HTTP handlers and the model, and the thread that serves it.

The HTTP layer submits a request's token ids and `generate` options and reads the `Job` it gets back (an
async iterator of `StreamPiece`s); this module is the only part of the server that calls the model.

How requests are served today: the model runs one `generate_stream` call at a time (`Model.serving`), so one
thread takes queued jobs and runs them, by default one job per call (`max_batch=1`). Batching is opt-in
because it is not exact: bfloat16 rounding in the model depends on the batch size, so a near-tie can flip a
greedy token. On fmoe-tiny-qwen-moe, 8 copies of one prompt in a batch moved its log-probabilities by up to
0.026 (0.004 at 4) and flipped its 7th greedy token (top-2 margin 0.03); on fmoe-tiny-mixtral the change was
1e-7 and 16 prompts gave equal tokens at batch 2, 4 and 8. With `max_batch` > 1, waiting greedy jobs with
equal options run together as one left-padded batch of up to `max_batch` rows, in powers of two (a bounded
set of compiled shapes: 3 waiting jobs run as 2, then 1); sampled jobs always run alone, so that a `seed`
reproduces its tokens. A batch runs from prefill to its last row's end: rows do not join or leave mid-batch
(no continuous batching), and a cancelled row's tokens are dropped while its batchmates run on; a batch whose
every row is cancelled stops at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import fmoe_jax as fj
from fmoe_jax.sampling import Greedy, from_hf_arguments

SAMPLING_NAMES = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


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

    def __init__(self, prompt_ids: list[int], options: dict[str, Any], stream: Any, batch_key: Any):
        self.prompt_ids, self.options, self.batch_key = prompt_ids, options, batch_key
        self.stream = stream  # the job's own validated generate_stream, used when it runs alone
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
      max_batch: most rows in one `generate` call (1: every job alone, the exact default; see above).
      max_queue: most jobs waiting (not yet running); `submit` raises `QueueFull` beyond it.
      on_batch: called with each finished batch's `GenerationStats` (for the server's metrics).
    """

    def __init__(
        self,
        model: fj.Model,
        *,
        max_batch: int = 1,
        max_queue: int = 64,
        on_batch: Callable[[fj.GenerationStats], None] | None = None,
    ):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.model, self.max_batch, self.max_queue, self.on_batch = model, max_batch, max_queue, on_batch
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
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
        """Jobs in the batch now running."""
        return len(self._running)

    def submit(self, prompt_ids: list[int], options: dict[str, Any]) -> Job:
        """Queues a job: `prompt_ids` generated from with `generate`'s keyword `options`. Call it from the
        event loop that will read the job. Raises `ValueError` (generate's, for invalid options), `QueueFull`
        or `ShuttingDown`."""
        stream = fj.generate_stream(self.model, prompt_ids, **options)  # checks every option, starts nothing
        job = Job(prompt_ids, options, stream, _batch_key(options))
        with self._cv:
            if not self._accepting:
                stream.close()
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                stream.close()
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue)")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drops a job (its client went away): out of the queue, or its rows ignored while its batch runs; a
        batch whose every job is cancelled stops, freeing the model. No-op for a finished job."""
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.stream.close()

    def close(self, timeout: float | None = None) -> None:
        """Stops taking jobs, cancels those waiting and the running batch (each gets `ShuttingDown`), and
        waits up to `timeout` seconds for the thread. To finish in-flight requests first, wait until `depth`
        and `running` are 0 (fmoe-serve lets uvicorn's graceful shutdown do that)."""
        with self._cv:
            self._accepting = False
            self._stop = True
            for job in self._waiting:
                job.stream.close()
                job._put(_Failed(ShuttingDown("the server shut down before serving this request")))
            self._waiting.clear()
            self._cv.notify()
        self._thread.join(timeout)

    # -- the scheduler thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                self._running = self._take()
            try:
                self._run(self._running)
            finally:
                with self._cv:
                    self._running = []

    def _take(self) -> list[Job]:
        """The next batch (caller holds the lock): the oldest job, and younger ones with its batch key."""
        first = self._waiting.popleft()
        batch = [first]
        if first.batch_key is not None:
            batch += [j for j in self._waiting if j.batch_key == first.batch_key][: self.max_batch - 1]
        size = 1 << (len(batch).bit_length() - 1)  # a power of two: bounded compiled shapes
        batch = batch[:size]
        for job in batch[1:]:
            self._waiting.remove(job)
        return batch

    def _run(self, batch: Sequence[Job]) -> None:
        if len(batch) == 1:
            stream = batch[0].stream
        else:
            for job in batch:
                job.stream.close()
            stream = fj.generate_stream(self.model, [j.prompt_ids for j in batch], **batch[0].options)
        try:
            with stream:
                for piece in stream:
                    job = batch[piece.row]
                    if not job.cancelled:
                        job._put(dataclasses.replace(piece, row=0))
                        if piece.finish_reason is not None:
                            job._put(_DONE)
                    pending = [j for j in batch if not j.finished]
                    if self._stop or (pending and all(j.cancelled for j in pending)):
                        break
                if all(j.finished for j in batch) and self.on_batch is not None:
                    self.on_batch(stream.output.stats)
        except Exception as error:  # noqa: BLE001 - handed to every client of the batch, the thread goes on
            for job in batch:
                job._put(_Failed(error))
        stopped = ShuttingDown("the server shut down while serving this request")
        for job in batch:
            job._put(_Failed(stopped))


def _batch_key(options: dict[str, Any]) -> Any:
    """Jobs with equal keys may share a batch: greedy ones with the same options. None: the job runs alone."""
    sampling = from_hf_arguments(None, **{k: options[k] for k in SAMPLING_NAMES if k in options})
    if not isinstance(sampling, Greedy) or options.get("record_trace"):
        return None
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if k != "seed"}
    return tuple(sorted(frozen.items()))
