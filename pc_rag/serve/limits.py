"""What bounds one client's hold on the server before its request reaches the engine: the time to send a
request's head and its body, the body's size, the Host it names, the prompt's size.

    connection -> head within `read_timeout_s` (head_deadline_h11; else the connection is closed)
    -> RequestGuard: Host (a key-less loopback server, auth.py) -> 421; Content-Length over `max_body_bytes`
       -> 413 at once, nothing read; a body without a length counted while it is read -> 413 at the limit;
       a body not in within `read_timeout_s` -> 408
    -> the app: pydantic (4 MiB of JSON is tens of MB of objects, bounded) -> parts and characters bounded
       (`check_prompt_size`) before anything is tokenized.

Measured before these bounds (issue 24): a 50 MB chat message took the server from 1.1 GB to past 6 GB with no
answer in 30 s (about 100 bytes of memory per body byte); 500 half-open connections stayed open for good. The
numbers after them are in docs/serve.md, "Security".

uvicorn has no timeout for a request's head: its keep-alive timer runs only between requests, and any byte
received cancels it, so a client that connects and sends nothing, or a header byte every few seconds, holds
its connection forever. `head_deadline_h11` is uvicorn's h11 protocol with one timer more.
"""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException

from .auth import host_name
from .schema import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128K-token context is about 0.5 MB of text
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_PROMPT_PARTS = 1024  # messages, content parts, chunks and stop strings of one request
# Characters per token of the context the prompt may hold: natural text is 3 to 5 per token, code and
# whitespace runs more; beyond this many the prompt cannot fit the context whatever it says.
CHARS_PER_CONTEXT_TOKEN = 16


class RequestGuard:
    """ASGI middleware: Host check, body size and body read time (see the module docstring)."""

    def __init__(self, app, max_body_bytes: int, read_timeout_s: float, allowed_hosts: frozenset[str] | None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and host_name(headers.get("host", "")) not in self.allowed_hosts:
            return await _answer(send, 421, f"Host {headers.get('host', '')!r} is not served here: this server "
                                            f"listens on loopback without an API key and answers only Host "
                                            f"values naming loopback (DNS rebinding); use http://127.0.0.1, "
                                            f"or start it with --allowed-host NAME or an API key")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _answer(send, 400, f"Content-Length {length!r} is not a number")
            if int(length) > self.max_body_bytes:
                return await _answer(send, 413, _too_large(self.max_body_bytes, int(length)))
        return await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive):
        """`receive`, raising an HTTPException (FastAPI re-raises those from its body read, and the app answers
        them) once the body passes `max_body_bytes` or takes longer than `read_timeout_s`. Once the body is in,
        messages pass as they are: the app waits on `receive` for the client's disconnect for the whole request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        state = {"bytes": 0, "done": False}

        async def bounded():
            if state["done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.read_timeout_s:g} s "
                                         f"(--read-timeout)", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                state["bytes"] += len(message.get("body", b""))
                if state["bytes"] > self.max_body_bytes:
                    raise HTTPException(413, _too_large(self.max_body_bytes, None),
                                        headers={"Connection": "close"})
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        return bounded


def _too_large(limit: int, length: int | None) -> str:
    size = "longer" if length is None else f"{length} bytes, more"
    return f"the request body is {size} than this server's limit of {limit} bytes (--max-body-bytes)"


async def _answer(send, status: int, message: str) -> None:
    """An error answered before the app runs, in OpenAI's shape; the connection is closed after it (the
    client may still be sending a body nobody will read)."""
    body = json.dumps(error_body(message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def check_prompt_size(texts: list[str], max_parts: int, max_chars: int) -> str | None:
    """Why a request's texts are too many or too long (None: they fit), before any is tokenized: tokenizing
    and finding 10^5 marked parts held a running place for 67 s (issue 24)."""
    if len(texts) > max_parts:
        return (f"the request has {len(texts)} prompt parts (messages, content parts, chunks, stop strings), more "
                f"than this server's limit of {max_parts} (--max-prompt-parts)")
    chars = sum(len(t) for t in texts)
    if chars > max_chars:
        return (f"the prompt is {chars} characters, more than this server's limit of {max_chars} "
                f"(--max-prompt-chars; a prompt that long cannot fit the model's context)")
    return None


def head_deadline_h11(head_timeout_s: float) -> type:
    """uvicorn's h11 protocol class, closing a connection whose next request head (request line and headers) has
    not arrived `head_timeout_s` after the connection was made or the previous response was sent. A head in
    progress does not count as activity: a header byte every few seconds is cut off like silence. (A class, as
    uvicorn's `http=` takes one and builds the protocol itself; uvicorn is imported here, not with the app.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadlineH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # nothing is owed to a client that never finished asking

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._head_timer is not None:  # the head is in
                self._head_timer.cancel()
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()  # the next request on this connection gets the same time

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return HeadDeadlineH11
