"""How each of fmoe-serve's generation endpoints writes a request's `StreamPiece`s as OpenAI's bodies: the
whole answer, or a stream's chunks. `OpenAIServer` (app.py) makes one object per request and owns the rest
(submitting, waiting, stop strings, errors), the same for both endpoints.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from pydantic import BaseModel

import fmoe_jax as fj

from . import protocol as p

TokenText = Callable[[int], str]  # a token id as the text logprobs show


class Bodies:
    """One request's bodies. Subclasses say how pieces read for their endpoint; `text` is always the piece's
    text after the stop-string cut."""

    id_prefix = ""

    def __init__(self, body: p.GenerationRequest, *, model_name: str, created: int, token_text: TokenText):
        self.body, self.model_name, self.created, self.token_text = body, model_name, created, token_text
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"

    def opening(self) -> list[BaseModel]:
        """Chunks a stream starts with, before its first piece."""
        return []

    def chunk(self, text: str, piece: fj.StreamPiece) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        raise NotImplementedError

    def whole(self, text: str, pieces: list[fj.StreamPiece], usage: p.Usage) -> BaseModel:
        raise NotImplementedError


class CompletionBodies(Bodies):
    """/v1/completions: `text_completion` objects, logprobs as tokens, their log-probabilities and offsets."""

    id_prefix = "cmpl"
    body: p.CompletionRequest

    def __init__(self, body: p.CompletionRequest, **kw):
        super().__init__(body, **kw)
        self.offset = 0  # characters streamed so far (logprobs' text_offset)

    def _response(self, choices: list[p.CompletionChoice], usage: p.Usage | None = None) -> BaseModel:
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    def _choice(self, text: str, pieces: list[fj.StreamPiece], offset: int) -> p.CompletionChoice:
        reason = p.finish_reason(pieces[-1].finish_reason) if pieces else None
        lp = self._logprobs(pieces, offset) if self.body.logprobs is not None else None
        return p.CompletionChoice(text=text, finish_reason=reason, logprobs=lp)

    def _logprobs(self, pieces: list[fj.StreamPiece], offset: int) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs(top_logprobs=[] if pieces and pieces[0].top_logprobs else None)
        for piece in pieces:
            out.tokens.append(self.token_text(piece.token))
            out.token_logprobs.append(piece.logprob)
            out.text_offset.append(offset)
            offset += len(piece.text)
            if out.top_logprobs is not None:
                out.top_logprobs.append({self.token_text(t): lp for t, lp in piece.top_logprobs})
        return out

    def chunk(self, text: str, piece: fj.StreamPiece) -> BaseModel:
        choice = self._choice(text, [piece], self.offset)
        self.offset += len(piece.text)
        return self._response([choice])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return self._response([], usage)

    def whole(self, text: str, pieces: list[fj.StreamPiece], usage: p.Usage) -> BaseModel:
        return self._response([self._choice(text, pieces, 0)], usage)


class ChatBodies(Bodies):
    """/v1/chat/completions: `chat.completion` objects (chunks: deltas after one naming the role)."""

    id_prefix = "chatcmpl"
    body: p.ChatCompletionRequest

    def _logprobs(self, pieces: list[fj.StreamPiece]) -> p.ChoiceLogprobs | None:
        if not self.body.logprobs or not pieces:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
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

    def _chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> BaseModel:
        return p.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    def opening(self) -> list[BaseModel]:
        return [self._chunk([p.ChatChunkChoice(delta=p.Delta(role="assistant", content=""))])]

    def chunk(self, text: str, piece: fj.StreamPiece) -> BaseModel:
        reason = p.finish_reason(piece.finish_reason)
        logprobs = self._logprobs([piece])
        return self._chunk(
            [p.ChatChunkChoice(delta=p.Delta(content=text), finish_reason=reason, logprobs=logprobs)]
        )

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return self._chunk([], usage)

    def whole(self, text: str, pieces: list[fj.StreamPiece], usage: p.Usage) -> BaseModel:
        choice = p.ChatChoice(
            message=p.AssistantMessage(content=text),
            finish_reason=p.finish_reason(pieces[-1].finish_reason),
            logprobs=self._logprobs(pieces),
        )
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model_name, choices=[choice], usage=usage
        )
