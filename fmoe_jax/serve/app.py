"""fmoe-serve's HTTP layer: a FastAPI app with OpenAI's routes over one model and its `Scheduler`.

`create_app` is called by `fmoe_jax.serve.cli` (and by tests); route functions are thin: check the request,
tokenize it, submit it, and turn the job's `StreamPiece`s into OpenAI's bodies or server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import fmoe_jax as fj
from fmoe_jax.prompts import encode_prompt

from . import protocol as p
from .metrics import Metrics
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("fmoe_jax.serve")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
RETRY_AFTER_S = 1  # what a 503 for a full queue asks clients to wait
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
CLIENT_GONE = 499  # the status of a response nobody reads (nginx's "client closed request")


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


def create_app(
    model: fj.Model,
    *,
    model_name: str,
    max_batch: int = 1,
    max_queue: int = 64,
    context: int | None = None,
    chunk: int = 16,
) -> FastAPI:
    """The server's app; its lifespan's end closes the scheduler (not the model, which its caller owns).
    `max_batch`, `max_queue`, `context` and `chunk` are the `Scheduler`'s."""
    compilations = model.engine.programs.compilations
    metrics = Metrics(  # read when scraped
        lambda: scheduler.depth, lambda: scheduler.running, lambda: sum(compilations.values())
    )
    scheduler = Scheduler(
        model,
        max_batch=max_batch,
        max_queue=max_queue,
        on_batch=metrics.batch_done,
        context=context,
        chunk=chunk,
    )
    limit = model.config.max_position_embeddings
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close(timeout=30)

    app = FastAPI(title="fmoe-serve", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.model = scheduler, metrics, model

    def error_response(request: Request, error: p.APIError) -> JSONResponse:
        metrics.request_done(request.url.path, error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(p.APIError)
    async def api_error(request: Request, error: p.APIError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(e.get("type") == "json_invalid" for e in problems):
            return error_response(request, p.APIError(400, "the request body is not valid JSON"))
        where = [".".join(str(x) for x in e.get("loc", ())[1:]) for e in problems]
        message = "; ".join(
            f"{w}: {e['msg']}" if w else e["msg"] for w, e in zip(where, problems, strict=True)
        )
        param = where[0] if where and where[0] else None
        return error_response(request, p.APIError(400, message or "invalid request body", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_response(request, p.APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("request %s failed", request.url.path)
        return error_response(request, p.APIError(500, f"internal error: {error}", type="server_error"))

    def check_model(name: str) -> None:
        if name != model_name:
            raise p.APIError(
                404,
                f"The model `{name}` does not exist: this server serves `{model_name}`",
                param="model",
                code="model_not_found",
            )

    def submit(body: p.GenerationRequest, prompt, param: str, default_max: int | None) -> Job:
        """Tokenizes, checks the context, maps the options and queues the request."""
        check_model(body.model)
        body.refuse_unsupported()
        try:
            ids = encode_prompt(model, prompt, 0)
        except ValueError as err:
            raise p.APIError(400, str(err), param=param) from None
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_new = requested or default_max or limit - len(ids)
        if len(ids) + max(max_new, 1) > limit:
            raise p.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_new} tokens ({len(ids)} in the {param}, {max_new} in the completion). "
                f"Shorten the {param} or ask for fewer tokens (max_tokens).",
                param=param,
                code="context_length_exceeded",
            )
        try:
            return scheduler.submit(ids, body.generate_options(max_new))
        except ValueError as err:
            raise p.APIError(400, str(err)) from None
        except QueueFull as err:
            raise p.APIError(
                503,
                f"The server is busy: {err}. Retry after {RETRY_AFTER_S} s.",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ShuttingDown as err:
            raise p.APIError(503, str(err), type="server_error", code="shutting_down") from None

    def token_text(token: int) -> str:
        return model.tokenizer.decode([token]) if model.tokenizer is not None else str(token)

    def observe(job: Job, prompt_tokens: int) -> None:
        if job.first_token_s is not None:
            metrics.ttft.observe(job.first_token_s - job.submitted_s)
        if job.tokens > 1:
            metrics.tpot.observe((job.last_token_s - job.first_token_s) / (job.tokens - 1))
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.generated_tokens.inc(job.tokens)

    async def whole(job: Job, request: Request, cut: StopCut) -> tuple[list[fj.StreamPiece], str] | None:
        """A non-streamed answer: its pieces and its text (cut at a stop string), counted as served; None
        when its client went away."""
        pieces = await collect(job, request)
        if pieces is None:
            return None
        text = "".join(cut.add(piece.text, piece.finish_reason) for piece in pieces)
        observe(job, len(job.prompt_ids))
        metrics.request_done(request.url.path, 200)
        return pieces, text

    async def collect(job: Job, request: Request) -> list[fj.StreamPiece] | None:
        """Every piece of a non-streamed request; None when its client went away (which cancels it)."""
        reading = asyncio.ensure_future(_all(job))
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=DISCONNECT_POLL_S)
                if done:
                    return reading.result()
                if await request.is_disconnected():
                    metrics.request_done(request.url.path, "cancelled")
                    return None
        except ShuttingDown as err:
            raise p.APIError(503, str(err), type="server_error", code="shutting_down") from None
        finally:
            reading.cancel()
            scheduler.cancel(job)

    def events(request: Request, job: Job, chunks: AsyncIterator[str]) -> StreamingResponse:
        """Server-sent events: each chunk as `data: {json}`, then `data: [DONE]`; an error after the start
        is one last event with OpenAI's error body. A client that goes away cancels the job."""
        route = request.url.path

        async def stream() -> AsyncIterator[str]:
            status: int | str = "cancelled"
            try:
                async for chunk in chunks:
                    yield f"data: {chunk}\n\n"
                yield "data: [DONE]\n\n"
                status = 200
                observe(job, len(job.prompt_ids))
            except Exception as err:  # noqa: BLE001 - the response has started: the error goes in the stream
                shutting = isinstance(err, ShuttingDown)
                status = 503 if shutting else 500
                if not shutting:
                    log.exception("stream of %s failed", route)
                error = p.APIError(status, str(err), type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
            finally:
                scheduler.cancel(job)
                metrics.request_done(route, status)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def usage(job: Job) -> p.Usage:
        n = len(job.prompt_ids)
        return p.Usage(prompt_tokens=n, completion_tokens=job.tokens, total_tokens=n + job.tokens)

    # -- completions --------------------------------------------------------------------------------------
    def completion_logprobs(pieces: list[fj.StreamPiece], offset: int) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs(top_logprobs=[] if pieces and pieces[0].top_logprobs else None)
        for piece in pieces:
            out.tokens.append(token_text(piece.token))
            out.token_logprobs.append(piece.logprob)
            out.text_offset.append(offset)
            offset += len(piece.text)
            if out.top_logprobs is not None:
                out.top_logprobs.append({token_text(t): lp for t, lp in piece.top_logprobs})
        return out

    @app.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> p.CompletionResponse | Response:
        job = submit(body, body.single_prompt(), "prompt", COMPLETION_DEFAULT_MAX_TOKENS)
        rid, logprobs = f"cmpl-{uuid.uuid4().hex}", body.logprobs is not None
        cut = StopCut(body.stop)

        def choice(text: str, pieces: list[fj.StreamPiece], offset: int) -> p.CompletionChoice:
            reason = p.finish_reason(pieces[-1].finish_reason) if pieces else None
            lp = completion_logprobs(pieces, offset) if logprobs else None
            return p.CompletionChoice(text=text, finish_reason=reason, logprobs=lp)

        if body.stream:

            async def chunks() -> AsyncIterator[str]:
                offset = 0
                async for piece in job:
                    text = cut.add(piece.text, piece.finish_reason)
                    c = choice(text, [piece], offset)
                    offset += len(piece.text)
                    yield p.CompletionResponse(
                        id=rid, created=created, model=model_name, choices=[c]
                    ).model_dump_json()
                if body.stream_options and body.stream_options.include_usage:
                    yield p.CompletionResponse(
                        id=rid, created=created, model=model_name, choices=[], usage=usage(job)
                    ).model_dump_json()

            return events(request, job, chunks())
        answer = await whole(job, request, cut)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        pieces, text = answer
        return p.CompletionResponse(
            id=rid, created=created, model=model_name, choices=[choice(text, pieces, 0)], usage=usage(job)
        )

    # -- chat completions ---------------------------------------------------------------------------------
    def chat_logprobs(pieces: list[fj.StreamPiece]) -> p.ChoiceLogprobs:
        def entry(token: int, logprob: float) -> dict:
            text = token_text(token)
            return dict(token=text, logprob=logprob, bytes=list(text.encode()))

        return p.ChoiceLogprobs(
            content=[
                p.TokenLogprob(
                    **entry(piece.token, piece.logprob),
                    top_logprobs=[p.TopLogprob(**entry(t, lp)) for t, lp in piece.top_logprobs],
                )
                for piece in pieces
            ]
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: p.ChatCompletionRequest, request: Request
    ) -> p.ChatCompletionResponse | Response:
        job = submit(body, [m.as_dict() for m in body.messages], "messages", None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        cut = StopCut(body.stop)
        if body.stream:

            def chunk(delta: p.Delta, reason: str | None = None, pieces=(), **extra) -> str:
                lp = chat_logprobs(list(pieces)) if body.logprobs and pieces else None
                c = p.ChatChunkChoice(delta=delta, finish_reason=p.finish_reason(reason), logprobs=lp)
                return p.ChatCompletionChunk(
                    id=rid, created=created, model=model_name, choices=[c], **extra
                ).model_dump_json()

            async def chunks() -> AsyncIterator[str]:
                yield chunk(p.Delta(role="assistant", content=""))
                async for piece in job:
                    text = cut.add(piece.text, piece.finish_reason)
                    yield chunk(p.Delta(content=text), piece.finish_reason, [piece])
                if body.stream_options and body.stream_options.include_usage:
                    yield p.ChatCompletionChunk(
                        id=rid, created=created, model=model_name, choices=[], usage=usage(job)
                    ).model_dump_json()

            return events(request, job, chunks())
        answer = await whole(job, request, cut)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        pieces, text = answer
        choice = p.ChatChoice(
            message=p.AssistantMessage(content=text),
            finish_reason=p.finish_reason(pieces[-1].finish_reason),
            logprobs=chat_logprobs(pieces) if body.logprobs else None,
        )
        return p.ChatCompletionResponse(
            id=rid, created=created, model=model_name, choices=[choice], usage=usage(job)
        )

    # -- the rest -----------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, created=created, max_model_len=limit)])

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> p.ModelCard:
        check_model(name)
        return p.ModelCard(id=model_name, created=created, max_model_len=limit)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = scheduler.accepting
        return JSONResponse({"status": "ok" if ok else "shutting down"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _all(job: Job) -> list[fj.StreamPiece]:
    return [piece async for piece in job]
