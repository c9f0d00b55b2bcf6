"""fmoe-serve's HTTP layer: `OpenAIServer`, one model behind OpenAI's routes, and `create_app`, its app.

`create_app` is called by `fmoe_jax.serve.cli` (and by tests); its route functions are thin, each one call
of the server object. For a generation request the server reads the body (the `Gate` in front of the app
has checked its size and the API key), parses, validates and tokenizes it on a worker thread, so that a
large body never holds the event loop (`/health`, other clients), submits it to the `Scheduler`, and writes
the job's `StreamPiece`s through its endpoint's `Bodies`: whole, or as server-sent events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import fmoe_jax as fj
from fmoe_jax.errors import ArgumentError
from fmoe_jax.generation import resolve_request
from fmoe_jax.prompts import encode_prompt
from fmoe_jax.request import Request as GenerateRequest

from . import protocol as p
from .bodies import Bodies, ChatBodies, CompletionBodies
from .gate import Gate, error_body
from .metrics import Metrics
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("fmoe_jax.serve")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 128k-token prompt is ~0.5 MB of text, ~1 MB as token ids
PREPARE_THREADS = 4  # requests parsed and tokenized at once, off the event loop
RETRY_AFTER_S = 1  # what a 503 for a full queue asks clients to wait
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
CLIENT_GONE = 499  # the status of a response nobody reads (nginx's "client closed request")
SCHEDULER_JOIN_S = 30  # how long closing waits for the scheduler's thread to end its step
SHOWN_PROBLEMS = 3  # validation problems a 400's message lists (a hostile body can have millions)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class StopCut:
    """One request's text with its stop string cut off, given piece by piece: OpenAI's text ends *before* a
    stop string, generate's row keeps the token that completed one. While a stop string could still
    complete, the characters that could start it are held back, so the streamed deltas concatenate to the
    non-streamed text."""

    def __init__(self, stops: str | list[str] | None):
        self.stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.sent = "", 0

    def add(self, text: str, finish: str | None) -> str:
        """The text to send now, after a piece of `text` (its row's last when `finish` is not None)."""
        self.text += text
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            end = min(found)
        else:
            end = len(self.text) - (0 if finish is not None else self.hold)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A generation request checked and tokenized, ready to submit."""

    body: p.GenerationRequest
    prompt_ids: list[int]
    options: dict[str, Any]  # generate's keyword arguments
    request: GenerateRequest  # the same, resolved (and so checked) by generate's own code


class OpenAIServer:
    """One model served over OpenAI's API: what every route does, with the `Scheduler` that runs the model.

    Args:
      model: the loaded model (its caller owns it: `close` does not close it).
      model_name: the model's id in the API.
      max_batch, max_queue, context, chunk: the `Scheduler`'s.
    """

    def __init__(
        self,
        model: fj.Model,
        *,
        model_name: str,
        max_batch: int = 1,
        max_queue: int = 64,
        context: int | None = None,
        chunk: int = 16,
    ):
        self.model, self.model_name = model, model_name
        compilations = model.engine.programs.compilations
        self.metrics = Metrics(  # read when scraped
            lambda: self.scheduler.depth, lambda: self.scheduler.running, lambda: sum(compilations.values())
        )
        self.scheduler = Scheduler(
            model,
            max_batch=max_batch,
            max_queue=max_queue,
            on_batch=self.metrics.batch_done,
            context=context,
            chunk=chunk,
        )
        self.limit = model.config.max_position_embeddings
        self.created = int(time.time())
        self.prepare_pool = concurrent.futures.ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="fmoe-serve-prepare"
        )

    # -- routes -------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.generate(request, p.CompletionRequest, CompletionBodies)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, p.ChatCompletionRequest, ChatBodies)

    def models(self) -> p.ModelList:
        return p.ModelList(data=[self.model_card(self.model_name)])

    def model_card(self, name: str) -> p.ModelCard:
        self._check_model(name)
        return p.ModelCard(id=self.model_name, created=self.created, max_model_len=self.limit)

    def health(self) -> Response:
        ok = self.scheduler.accepting
        return JSONResponse({"status": "ok" if ok else "shutting down"}, status_code=200 if ok else 503)

    def exposition(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- errors -------------------------------------------------------------------------------------------
    def error_response(self, path: str, error: p.APIError) -> Response:
        """OpenAI's error JSON for `error`, counted in the metrics."""
        self.refused(path, error.status)
        return Response(error_body(error), error.status, error.headers, media_type="application/json")

    def refused(self, path: str, status: int | str) -> None:
        """Counts an answer other than a generation's 200 (unknown paths counted together)."""
        self.metrics.request_done(route_label(path), status)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise p.APIError(
                404,
                f"The model {name!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # -- generation ---------------------------------------------------------------------------------------
    async def generate(
        self, request: Request, kind: type[p.GenerationRequest], bodies_type: type[Bodies]
    ) -> Response:
        """One generation request, either endpoint: prepared off the event loop, submitted, answered."""
        loop = asyncio.get_running_loop()
        raw = await request.body()
        prepared = await loop.run_in_executor(self.prepare_pool, self.prepare, raw, kind)
        job = self._submit(prepared)
        body = prepared.body
        bodies = bodies_type(
            body, model_name=self.model_name, created=self.created, token_text=self.token_text
        )
        cut = StopCut(body.stop)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return self._events(request, job, self._chunks(job, bodies, cut, usage))
        pieces = await self._collect(job, request)
        if pieces is None:
            return Response(status_code=CLIENT_GONE)
        text = "".join(cut.add(piece.text, piece.finish_reason) for piece in pieces)
        self._observe(job)
        self.metrics.request_done(request.url.path, 200)
        return json_response(bodies.whole(text, pieces, usage_of(job)))

    def prepare(self, raw: bytes, kind: type[p.GenerationRequest]) -> Prepared:
        """Parses, validates and tokenizes a request body, and checks it against the model (on a worker
        thread). Every client mistake is an `APIError` naming the parameter."""
        body = parse_body(raw, kind)
        self._check_model(body.model)
        body.refuse_unsupported()
        param = kind.prompt_param
        try:
            ids = encode_prompt(self.model, body.prompt_input(), 0)
        except ValueError as err:
            raise p.APIError(400, str(err), param=param) from None
        max_new = body.requested_max_tokens() or kind.default_max_tokens or self.limit - len(ids)
        if len(ids) + max(max_new, 1) > self.limit:
            raise p.APIError(
                400,
                f"This model's maximum context length is {self.limit} tokens. However, you requested "
                f"{len(ids) + max_new} tokens ({len(ids)} in the {param}, {max_new} in the completion). "
                f"Shorten the {param} or ask for fewer tokens (max_tokens).",
                param=param,
                code="context_length_exceeded",
            )
        options = body.generate_options(max_new)
        try:
            checked = resolve_request(self.model, ids, **options)
        except ArgumentError as err:
            raise p.APIError(400, str(err), param=body.param_of(err.argument)) from None
        except ValueError as err:
            raise p.APIError(400, str(err)) from None
        return Prepared(body, ids, options, checked)

    def _submit(self, prepared: Prepared) -> Job:
        try:
            return self.scheduler.submit(prepared.prompt_ids, prepared.options, prepared.request)
        except QueueFull as err:
            raise p.APIError(
                503,
                f"The server is busy: {err}. Retry after {RETRY_AFTER_S} s.",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ShuttingDown as err:
            raise shutting_down(err) from None

    def token_text(self, token: int) -> str:
        return self.model.tokenizer.decode([token]) if self.model.tokenizer is not None else str(token)

    def _observe(self, job: Job) -> None:
        if job.first_token_s is not None:
            self.metrics.ttft.observe(job.first_token_s - job.submitted_s)
        if job.tokens > 1:
            self.metrics.tpot.observe((job.last_token_s - job.first_token_s) / (job.tokens - 1))
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.generated_tokens.inc(job.tokens)

    async def _collect(self, job: Job, request: Request) -> list[fj.StreamPiece] | None:
        """Every piece of a non-streamed request; None when its client went away (which cancels it)."""
        reading = asyncio.ensure_future(_all(job))
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=DISCONNECT_POLL_S)
                if done:
                    return reading.result()
                if await request.is_disconnected():
                    self.metrics.request_done(request.url.path, "cancelled")
                    return None
        except ShuttingDown as err:
            raise shutting_down(err) from None
        finally:
            reading.cancel()
            self.scheduler.cancel(job)

    async def _chunks(self, job: Job, bodies: Bodies, cut: StopCut, usage: bool) -> AsyncIterator[str]:
        for chunk in bodies.opening():
            yield chunk.model_dump_json()
        async for piece in job:
            yield bodies.chunk(cut.add(piece.text, piece.finish_reason), piece).model_dump_json()
        if usage:
            yield bodies.usage_chunk(usage_of(job)).model_dump_json()

    def _events(self, request: Request, job: Job, chunks: AsyncIterator[str]) -> StreamingResponse:
        """Server-sent events: each chunk as `data: {json}`, then `data: [DONE]`. An error after the start is
        an event with OpenAI's error body, then `[DONE]`. A client that goes away cancels the job."""
        route = request.url.path

        async def stream() -> AsyncIterator[str]:
            status: int | str = "cancelled"
            try:
                async for chunk in chunks:
                    yield f"data: {chunk}\n\n"
                status = 200
                self._observe(job)
            except Exception as err:  # noqa: BLE001 - the response has started: the error goes in the stream
                error = shutting_down(err) if isinstance(err, ShuttingDown) else None
                if error is None:
                    log.exception("stream of %s failed", route)
                    error = p.APIError(500, f"internal error: {err}", type="server_error")
                status = error.status
                yield f"data: {error_body(error).decode()}\n\n"
            finally:
                self.scheduler.cancel(job)
                self.metrics.request_done(route, status)
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # -- the end ------------------------------------------------------------------------------------------
    async def cut_off(self, grace: float) -> None:
        """Ends every request still waiting or running, `grace` seconds into shutdown: each gets a 503 (a
        stream: an error event, then `[DONE]`). One log line says how many."""
        left = self.scheduler.depth + self.scheduler.running
        if left:
            log.warning(
                "shutdown: %d request(s) not finished after --shutdown-timeout %g s are answered 503",
                left,
                grace,
            )
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.close, SCHEDULER_JOIN_S)

    def close(self) -> None:
        """Closes the scheduler (cancelling what is left) and the preparing threads; not the model."""
        self.scheduler.close(timeout=SCHEDULER_JOIN_S)
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)


def create_app(
    model: fj.Model,
    *,
    model_name: str,
    max_batch: int = 1,
    max_queue: int = 64,
    context: int | None = None,
    chunk: int = 16,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The server's app (`app.state.server` is its `OpenAIServer`); its lifespan's end closes the server.
    `max_batch`, `max_queue`, `context` and `chunk` are the `Scheduler`'s; `max_request_bytes` and `api_key`
    the `Gate`'s."""
    server = OpenAIServer(
        model, model_name=model_name, max_batch=max_batch, max_queue=max_queue, context=context, chunk=chunk
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="fmoe-serve", lifespan=lifespan)
    app.state.server, app.state.scheduler, app.state.metrics = server, server.scheduler, server.metrics
    app.state.model = model
    app.add_middleware(Gate, max_request_bytes=max_request_bytes, api_key=api_key, refused=server.refused)

    @app.exception_handler(p.APIError)
    async def api_error(request: Request, error: p.APIError) -> Response:
        return server.error_response(request.url.path, error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return server.error_response(request.url.path, p.APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> Response:
        log.exception("request %s failed", request.url.path)
        error = p.APIError(500, f"internal error: {error}", type="server_error")
        return server.error_response(request.url.path, error)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return server.models()

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> p.ModelCard:
        return server.model_card(name)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        return server.health()

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return server.exposition()

    return app


def parse_body(raw: bytes, kind: type[p.GenerationRequest]) -> p.GenerationRequest:
    """A request body as `kind`. Python's JSON parser reads what OpenAI's clients send (escaped lone
    surrogates included: the prompt's own check then names them); problems are a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        raise p.APIError(400, f"The request body is not valid JSON: {err}") from None
    try:
        return kind.model_validate(data)
    except pydantic.ValidationError as err:
        problems = err.errors(include_url=False, include_input=False)
        where = [".".join(str(x) for x in e["loc"]) for e in problems]
        shown = [f"{w}: {e['msg']}" if w else e["msg"] for w, e in zip(where, problems, strict=True)]
        more = len(shown) - SHOWN_PROBLEMS
        message = "; ".join(shown[:SHOWN_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
        loc = problems[0]["loc"] if problems else ()
        raise p.APIError(400, message, param=str(loc[0]) if loc else None) from None


def route_label(path: str) -> str:
    """A path as the metrics label it: the route, so that clients cannot grow the label set."""
    if path in ROUTES:
        return path
    return "/v1/models/{name}" if path.startswith("/v1/models/") else "other"


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def usage_of(job: Job) -> p.Usage:
    n = len(job.prompt_ids)
    return p.Usage(prompt_tokens=n, completion_tokens=job.tokens, total_tokens=n + job.tokens)


def shutting_down(err: Exception) -> p.APIError:
    return p.APIError(503, str(err), type="server_error", code="shutting_down")


async def _all(job: Job) -> list[fj.StreamPiece]:
    return [piece async for piece in job]
