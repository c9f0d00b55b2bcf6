"""`Gate`: the ASGI middleware in front of fmoe-serve's routes: the API key and the request body's size.

`create_app` wraps its app in it. A request without the key (when one is set) gets a 401 and one whose body
is over `max_request_bytes` a 413, both as OpenAI's error JSON, before any of the body is parsed. A refused
body is read and dropped rather than left unread, so that a client still sending it gets the answer instead
of a reset connection (unless it asked `Expect: 100-continue`: then it is answered at once and sends
nothing). Everything here runs on the event loop without blocking it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from . import protocol as p

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)
DRAIN_LIMIT_BYTES = 64 << 20  # past this much of a refused body, the connection is dropped instead


def error_body(error: p.APIError) -> bytes:
    """OpenAI's error JSON, ASCII-escaped: a message may quote the client's text, lone surrogates included."""
    return json.dumps(error.body()).encode()


class Gate:
    """Checks each HTTP request's API key and body size, then hands the app the body it read.

    Args:
      app: the ASGI app behind the gate.
      max_request_bytes: the largest body accepted; larger ones get a 413.
      api_key: None (no key), or the key every route but `OPEN_PATHS` requires as `Authorization: Bearer`.
      refused: called with (path, status) for each request the gate answers itself (the server counts them).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_request_bytes: int,
        api_key: str | None,
        refused: Callable[[str, int], None] = lambda path, status: None,
    ):
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be None (no key) or a non-empty string, got ''")
        self.app, self.max_request_bytes, self.refused = app, max_request_bytes, refused
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._authorization_error(scope) or self._declared_size_error(scope)
        body = b""
        if error is None:
            body, complete = await self._read(receive, self.max_request_bytes)
            if not complete:
                error = self._too_large()
        if error is not None:
            await self._refuse(scope, receive, send, error)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorization_error(self, scope: Scope) -> p.APIError | None:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.api_key):
            return None
        return p.APIError(
            401,
            "Incorrect or missing API key: send it as the header 'Authorization: Bearer <key>' (fmoe-serve "
            "was started with --api-key or FMOE_SERVE_API_KEY)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _declared_size_error(self, scope: Scope) -> p.APIError | None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            return p.APIError(400, f"Content-Length must be a number of bytes, got {declared.decode()!r:.40}")
        return self._too_large() if int(declared) > self.max_request_bytes else None

    def _too_large(self) -> p.APIError:
        return p.APIError(
            413,
            f"The request body is over {self.max_request_bytes} bytes, this server's limit "
            "(fmoe-serve --max-request-bytes)",
            code="request_too_large",
        )

    @staticmethod
    async def _read(receive: Receive, limit: int, keep: bool = True) -> tuple[bytes, bool]:
        """The body (b"" unless `keep`), read up to `limit` bytes; and whether it ended there (False: it is
        longer, or the client went away before its end)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", False
            if keep:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: p.APIError) -> None:
        if dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue":
            await self._read(receive, DRAIN_LIMIT_BYTES, keep=False)  # then the client reads the answer
        self.refused(scope["path"], error.status)
        body = error_body(error)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then passes on what the client sends next
    (its disconnection)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
