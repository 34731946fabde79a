"""The OpenAI-compatible HTTP app over one Engine (FastAPI): routes, the request path, errors.

    POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or not), GET /v1/models,
    GET /metrics (Prometheus' text format, metrics.py; the same keys as /v1),
    GET /health (no auth, for load balancers: liveness only, unless the request carries a key),
    GET /ready (no auth: 200 while a request would be taken, 503 + Retry-After while the line is full or the
    server is shutting down: readiness for a load balancer or a router)

One path per request, as in the drop-in classes (pc_rag/adapters.py):
    connection, Host, body size and read time (limits.py) -> API key -> tenant (auth.py; 401)
    -> request JSON -> pydantic schema (schema.py; refused and unknown fields -> 400) -> GenerationOptions (checked,
       and against the engine: `Engine.checked_options` -> 400),
       their `cache_salt` the request's cache namespace: its tenant's, narrowed by its `cache_salt`
       (`blocks.tenant_namespace`; with `--shared-cache` the salt's alone)
    -> prompt parts and characters bounded (limits.check_prompt_size; 400), nothing tokenized yet
    -> a place in the bounded line (admission.py; full -> 429, waited too long -> 503, both with Retry-After)
    -> a worker thread: messages and tools through the model's chat template (`chat_request`, `cache_control`
       parts as chunks; a forced tool_choice or a response_format is the request's grammar) or the prompt string
       (`completion_prompt`) -> `Engine.stream_generation` -> text pieces (a tool call held back: `stream_chat`)
    -> the event loop: SSE chunks (tool calls as one delta at the end; a reasoning model's thinking as
       `delta.reasoning_content`, pc_rag.reasoning; each choice's pieces under its index, n > 1; logprobs with the
       pieces they complete), or one JSON body once the reply is in (`message.reasoning_content` beside `content`)
    -> usage with cached_tokens; the request counted in /metrics (`ServerMetrics.finished`).

The engine call is blocking, so it runs in a worker thread per request; concurrent requests meet in the
engine's batched decode loop (pc_rag/batch.py), one forward pass per step for all of them. The response
starts once the first piece (or an error) is out: an unusable prompt (longer than the context, no chat
template) is a 400 even when streaming was asked for. A client that disconnects (while waiting in line,
during the prefill, or mid-stream) stops its request: during the prefill at its next forward (a chunk encode,
a prefill chunk: `LlamaRunner.cancellable`), later at its next token; the request leaves the batch and its
buffer goes back to the pool. A request without its first token `prefill_timeout_s` after it started is
answered 503 and stopped the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..adapters import (
    ChatReply,
    Reasoning,
    chat_request,
    check_reasoning_effort,
    completion_prompt,
    openai_logprobs,
    response_grammar,
    stream_chat,
    stream_generation,
)
from ..blocks import tenant_namespace
from ..decode import choice_of, joined
from ..errors import OptionError, PCRagError, PMLError, PromptError, UnsupportedModelError
from ..model import heap
from ..options import GenerationOptions
from ..tools import ToolFormat, call_grammar, check_tool_choice, tool_specs
from .admission import Admission, QueueFull, QueueTimeout, TooLate
from .auth import LOOPBACK_NAMES, APIKey, KeyRing, bearer_token
from .limits import (
    CHARS_PER_CONTEXT_TOKEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_PARTS,
    DEFAULT_READ_TIMEOUT_S,
    RequestGuard,
    check_prompt_size,
)
from .metrics import ServerMetrics, StatusCounter
from .schema import ChatCompletionRequest, CompletionRequest, chat_messages, error_body, usage

log = logging.getLogger("pc_rag.serve")

# What an unusable request raises inside the engine: a 400 naming the problem. Anything else is a 500.
CLIENT_ERRORS = (PromptError, OptionError, PMLError, UnsupportedModelError)

# OpenAI's default when a request gives no temperature (clients such as ChatOpenAI send none unless set).
# How often the server gives its heap's free pages back (model.heap.release, in a thread). Without it a soak of
# 100,000 mixed requests grew the server by 30 MiB after its caches were full (20,000 to 100,000 requests), in steps,
# all of it in malloc's arenas (/proc/PID/smaps), where the churn of the bounded caches leaves freed blocks resident;
# a trim costs milliseconds (benchmarks/soak.py, docs/serve.md "A long run").
TRIM_EVERY_S = 30.0

DEFAULT_TEMPERATURE = 1.0


class APIError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


@dataclass
class ServerSettings:
    """What `pc-rag serve` was started with (beyond the engine).

    api_keys: the keys accepted, each with its tenant (auth.py); none: no auth. allowed_hosts: the `Host` names
    served (None: any; `pc-rag serve` on loopback without keys: loopback names, against DNS rebinding).
    max_prompt_chars: None: CHARS_PER_CONTEXT_TOKEN per token of the model's context.
    shared_cache: every tenant in one cache namespace (a request's `cache_salt` still narrows it), for a server
    whose users may read each other's prompts; by default each tenant's is its own (docs/serve.md, "Security").
    """

    model_id: str
    api_keys: tuple[APIKey, ...] = ()
    max_running: int = 16
    max_waiting: int = 64
    queue_timeout_s: float = 60.0
    default_max_tokens: int = 1024
    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_prompt_parts: int = DEFAULT_MAX_PROMPT_PARTS
    max_prompt_chars: int | None = None
    prefill_timeout_s: float = 300.0
    shared_cache: bool = False
    ttft_limit_s: float | None = None  # admission.Admission's first-token rule; None: off

    @staticmethod
    def loopback_hosts(extra: tuple[str, ...] = ()) -> frozenset[str]:
        return frozenset((*LOOPBACK_NAMES, *(h.lower() for h in extra)))


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `engine` (run it with uvicorn, as `pc-rag serve` does)."""
    admission = Admission(settings.max_running, settings.max_waiting, settings.ttft_limit_s)
    keys = KeyRing(settings.api_keys)
    max_chars = settings.max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * engine.runner.shape.max_positions
    # One thread per running request (admission bounds them): the engine call blocks until its next token.
    # A request whose reply is whole gives its place back while its thread runs its leftovers (request.py): twice
    # as many threads, so that a request admitted then never waits for one.
    executor = ThreadPoolExecutor(max_workers=2 * settings.max_running, thread_name_prefix="pc_rag-request")

    releases = {"count": 0, "last_ms": 0.0, "max_ms": 0.0}  # /health's "heap": what the trims cost

    async def release_heap():
        while True:
            await asyncio.sleep(TRIM_EVERY_S)
            start = time.perf_counter()
            await asyncio.to_thread(heap.release)
            ms = (time.perf_counter() - start) * 1e3
            releases.update(count=releases["count"] + 1, last_ms=ms, max_ms=max(ms, releases["max_ms"]))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        _app.state.stopping = False
        trimmer = asyncio.create_task(release_heap())
        yield
        _app.state.stopping = True  # /ready answers 503 from here on
        trimmer.cancel()
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pc_rag", summary="OpenAI-compatible completions over a pc_rag Engine", lifespan=lifespan)
    created = int(time.time())
    app.state.engine, app.state.admission, app.state.settings = engine, admission, settings
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes, read_timeout_s=settings.read_timeout_s,
                       allowed_hosts=settings.allowed_hosts)
    metrics = app.state.metrics = ServerMetrics(engine, admission)
    app.add_middleware(StatusCounter, metrics=metrics)  # outermost: it sees RequestGuard's answers too

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        # The deepest error: for a field of several types (`content`: a string or parts) it is the one of the
        # type the client sent (a bad part), not that the list is not a string.
        first = max(e.errors(), key=lambda err: len(err.get("loc", ())), default={"loc": (), "msg": "invalid request"})
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON ({why})"), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _type_tag(p))
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers)

    def tenant_of(request: Request) -> str | None:
        """The tenant of the request's bearer token; None for a missing or wrong one, or when no key is set."""
        token = bearer_token(request.headers.get("authorization", ""))
        return keys.tenant(token) if keys and token is not None else None

    def authorized(request: Request) -> None:
        """Every /v1 route: the tenant goes on the request (`request.state.tenant`, None without keys): it names
        the request's cache namespace (`_checked`)."""
        request.state.tenant = None
        if not keys:
            return
        request.state.tenant = tenant_of(request)
        log.debug("%s %s: tenant %s", request.method, request.url.path, request.state.tenant)
        if request.state.tenant is None:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (a key given to "
                                "pc-rag serve with --api-key, --api-keys or $PC_RAG_API_KEYS)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health(request: Request):
        if keys and tenant_of(request) is None:  # load balancers need liveness only; the rest is for operators
            return {"status": "ok"}
        stats = engine.stats()
        caches = {"store_bytes": sum(t["bytes_held"] for t in stats["tiers"]),
                  "prefix_blocks": stats["prefix"]["blocks_indexed"], "replies": stats["registered"]["replies"],
                  "chunks": stats["registered"]["chunks"], "passages": stats["passages"]["indexed"],
                  "tokenizer_memo": stats["tokenizer_memo"]["entries"], "grammars": stats["grammars"]["compiled"]}
        return {"status": "ok", "model": settings.model_id, "running": admission.running,
                "waiting": admission.waiting, "served": admission.served, "rejected": admission.rejected,
                "decode": stats["decode"], "encodes": stats["encodes"], "relocation_check": stats["relocation_check"],
                "caches": caches,  # what the bounded indexes hold: a long run's memory, told apart (soak.py)
                "heap_releases": dict(releases)}

    @app.get("/ready")
    async def ready():
        """Readiness, distinct from liveness (/health): the model is loaded by the time the app serves, so what can
        make a live server unready is a full line (the next request would be a 429) or a shutdown under way. No key
        is needed and nothing beyond the state is told."""
        if getattr(app.state, "stopping", False):
            return JSONResponse({"status": "stopping"}, status_code=503, headers={"Retry-After": "5"})
        if not admission.has_room:
            return JSONResponse({"status": "busy"}, status_code=503,
                                headers={"Retry-After": str(admission.retry_after_s())})
        return {"status": "ready"}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics_text():
        """Prometheus' text format (metrics.py). Read off the event loop: the store's counters take their locks."""
        running, waiting = admission.running, admission.waiting  # the line is the event loop's to read
        body = await asyncio.to_thread(metrics.exposition, running, waiting)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [_model_card(settings.model_id, created, engine)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str):
        if model_id != settings.model_id:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                                f"{settings.model_id!r}", "not_found_error", "model", "model_not_found")
        return _model_card(settings.model_id, created, engine)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if not getattr(engine.tokenizer, "chat_template", None):
            raise APIError(400, f"{settings.model_id} has no chat template (its tokenizer defines none): send the "
                                f"prompt as a string to /v1/completions")
        options = _checked(body, settings, max_chars, request, engine)
        messages, marked = chat_messages(body)
        chunks = marked + body.chunks
        await asyncio.to_thread(_check_tools, engine, body)  # a bad tool, choice or schema: a 400 before the line

        def make():
            return stream_chat(engine, chat_request(
                engine, messages, options, tools=body.tools, tool_choice=body.tool_choice,
                response_format=body.response_format, parallel_tool_calls=bool(body.parallel_tool_calls),
                chunk_texts=chunks, reasoning_effort=body.reasoning_effort), heartbeat=True)

        return await _respond(request, body, make, _ChatFormat(settings.model_id, body))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        options = _checked(body, settings, max_chars, request, engine)
        text, chunks = body.prompt_text, body.chunks

        def make():
            prompt = completion_prompt(engine, text, chunk_texts=chunks, cache_salt=options.cache_salt)
            return stream_generation(engine, prompt, options)

        return await _respond(request, body, make, _CompletionFormat(settings.model_id, body))

    async def _respond(request: Request, body, make: Callable[[], Iterator], fmt):
        arrived = time.perf_counter()
        disconnect = asyncio.create_task(_disconnected(request))
        try:
            await _admitted(admission, settings.queue_timeout_s, disconnect)
        except _Disconnected:  # left the line (the wait was cancelled) before any work was done
            return JSONResponse(error_body("client disconnected"), status_code=499)
        except TooLate as late:
            disconnect.cancel()
            raise APIError(429, f"the first token would come in about {late.expected_s:.1f} s, beyond the "
                                f"server's limit of {admission.ttft_limit_s:g} s (--ttft-limit); retry later",
                           "rate_limit_error", code="ttft_limit",
                           headers={"Retry-After": str(admission.retry_after_s())}) from None
        except QueueFull:
            disconnect.cancel()
            raise APIError(429, f"the server is at capacity ({admission.max_running} running, "
                                f"{admission.max_waiting} waiting); retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(admission.retry_after_s())}) from None
        except QueueTimeout:
            disconnect.cancel()
            raise APIError(503, f"waited {settings.queue_timeout_s:g} s in line without starting; retry later",
                           "server_overloaded", code="queue_timeout",
                           headers={"Retry-After": str(admission.retry_after_s())}) from None
        started = time.perf_counter()
        metrics.queue_time.observe(started - arrived)

        def finished(final) -> None:  # the reply is out: counted in /metrics
            reason = final.finish_reason if isinstance(final, ChatReply) else _generation(final).finish_reason
            metrics.finished(_generation(final), reason, arrived, started)

        worker = _Worker(make, engine.runner.cancellable)
        streaming, first = False, False
        try:
            worker.start(executor, admission)
            kind, value = await worker.next_or(disconnect, settings.prefill_timeout_s)
            first = kind in ("piece", "done")
            if first:
                admission.first_token(started, time.perf_counter())
            if kind == "timeout":  # the worker is stopped at its next forward; its place is freed once it is
                raise APIError(503, f"no first token within {settings.prefill_timeout_s:g} s (--prefill-timeout); "
                                    f"the request was stopped", "server_overloaded", code="prefill_timeout")
            if kind == "piece" and body.stream:
                streaming = True  # from here Starlette's StreamingResponse watches for the disconnect
                return StreamingResponse(_sse(fmt, body, worker, (kind, value), finished),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            pieces = []
            while kind == "piece":
                pieces.append(value)
                kind, value = await worker.next_or(disconnect)
            if kind == "disconnected":  # nobody reads this answer; the worker is stopped
                return JSONResponse(error_body("client disconnected"), status_code=499)
            if kind == "error":
                raise _as_api_error(value)
            if body.stream:  # the whole reply held back (a stop string's prefix) or empty: one stream at once
                streaming = True
                return StreamingResponse(_sse(fmt, body, worker, (kind, value), finished),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            finished(value)
            return JSONResponse(fmt.whole(value, usage(_generation(value))))
        finally:
            if not first:
                admission.no_first_token()
            disconnect.cancel()
            if not streaming:
                worker.stop.set()

    return app


def _type_tag(part) -> bool:
    """Whether a pydantic error location part names a branch of a union type ("str", "list[ContentPart]",
    "function-after[...]") rather than a field or an index."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def _model_card(model_id: str, created: int, engine) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pc_rag",
            "max_model_len": engine.runner.shape.max_positions}


def _checked(body, settings: ServerSettings, max_chars: int, request: Request, engine) -> GenerationOptions:
    """The request's options, once its fields are known to be usable and its prompt small enough to tokenize.
    Their `cache_salt` is the request's cache namespace, never the client's salt as sent: the tenant's namespace
    narrowed by it (`tenant_namespace`), so no value a client sends reaches another tenant's blocks."""
    too_large = check_prompt_size(body.prompt_texts(), settings.max_prompt_parts, max_chars)
    if too_large:
        raise APIError(400, too_large, code="prompt_too_large")
    tenant = None if settings.shared_cache else request.state.tenant
    return _options(body, settings, engine, tenant_namespace(tenant, body.cache_salt))


def _options(body, settings: ServerSettings, engine, namespace: str | None = None) -> GenerationOptions:
    refused = body.refused()
    if refused:
        raise APIError(400, "not supported by pc-rag serve: " + "; ".join(refused),
                       param=refused[0].split(":")[0].split("=")[0].split(" ")[0])
    try:
        return engine.checked_options(GenerationOptions(
            mode=body.mode,
            max_new_tokens=body.limit or settings.default_max_tokens,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_list,
            seed=body.seed,
            recompute_ratio=body.recompute_ratio,
            align=body.align,
            cache_salt=namespace,
            n=body.choices_decoded,
            logprobs=body.logprobs_asked,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=body.logit_bias,
        ))
    except PCRagError as e:
        raise APIError(400, str(e)) from None


def _check_tools(engine, body: ChatCompletionRequest) -> None:
    """The request's tools, tool_choice and response_format as the engine will use them, with the grammar they
    ask for compiled (kept: the request uses it), and its reasoning_effort against the chat template, so that
    anything unusable is a 400 naming it."""
    try:
        check_reasoning_effort(engine.tokenizer, body.reasoning_effort)
    except PCRagError as e:
        raise APIError(400, str(e), param="reasoning_effort") from None
    try:
        specs = tool_specs(body.tools)
        choice = check_tool_choice(body.tool_choice, specs)
        grammar = call_grammar(ToolFormat.detect(engine.tokenizer), specs, choice, bool(body.parallel_tool_calls))
        wanted = response_grammar(body.response_format)
        if grammar is not None and wanted is not None:
            raise OptionError("response_format and a forced tool_choice cannot both constrain one reply")
        if (grammar or wanted) is not None:
            engine.grammars.compiled(grammar or wanted)
    except PCRagError as e:
        raise APIError(400, str(e), param="tools" if body.tools else "response_format") from None
    except Exception as e:  # anything the grammar library refuses in a client's schema
        raise APIError(400, f"tools/response_format: {type(e).__name__}: {e}") from None


def _generation(final):
    """The engine's Generation of a finished request (a chat request ends with a ChatReply holding it)."""
    return final.generation if isinstance(final, ChatReply) else final


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, CLIENT_ERRORS):
        return APIError(400, str(error))
    log.error("pc_rag serve: request failed", exc_info=(type(error), error, error.__traceback__))
    return APIError(500, f"internal error: {type(error).__name__}: {error}", "server_error")


class _Disconnected(Exception):
    pass


async def _admitted(admission: Admission, timeout_s: float, disconnect: asyncio.Task) -> None:
    """A running place, or _Disconnected (out of the line, no place held) if the client goes away first."""
    wait = asyncio.ensure_future(admission.acquire(timeout_s))
    done, _ = await asyncio.wait({wait, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if wait in done:
        return wait.result()  # QueueFull / QueueTimeout raise here
    wait.cancel()
    try:
        await wait
    except (asyncio.CancelledError, QueueFull, QueueTimeout):
        pass
    else:
        admission.no_first_token()
        admission.release()  # it got a place just as the client left
    raise _Disconnected


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the request body is already read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Worker:
    """One request's engine stream, run in a worker thread; what it yields reaches the event loop in order:
    ("piece", str)..., then ("done", Generation) or ("error", exception)."""

    def __init__(self, make: Callable[[], Iterator], cancellable: Callable[[threading.Event], Any]):
        self._make = make
        self._cancellable = cancellable  # LlamaRunner.cancellable: the prefill's forwards check `stop`
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.stop = threading.Event()  # set by the event loop: the client is gone or the response is sent
        self._held: tuple[str, Any] | None = None  # an entry `pieces` took from the queue after a run of pieces

    def start(self, executor: ThreadPoolExecutor, admission: Admission) -> None:
        t0 = time.perf_counter()
        released = False

        def release(*_) -> None:  # on the event loop, once
            nonlocal released
            if not released:
                released = True
                admission.release(time.perf_counter() - t0)

        self._release = release
        future = self._loop.run_in_executor(executor, self._produce)
        # The place in line is given back once the reply is whole (its buffers are back in the pool), or else once
        # the thread is done, i.e. the engine's stream is closed.
        future.add_done_callback(release)

    def _post(self, entry) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, entry)
        except RuntimeError:  # the loop is closed (server shutting down): nobody reads the rest
            self.stop.set()

    def _produce(self) -> None:
        try:
            if self.stop.is_set():  # the client left, or the deadline passed, while the thread was starting
                return
            items = self._make()
            try:
                # The first item is the prefill's: its forwards stop once `stop` is set (Cancelled). Later ones
                # are decode steps, stopped between tokens below.
                with self._cancellable(self.stop):
                    first = next(items, None)
                for item in itertools.chain([first] if first is not None else [], items):
                    if not isinstance(item, str):
                        # The reply is whole: its place is given back now, and the engine's stream runs its
                        # leftovers (request.py), which stop for any request that starts.
                        self._post(("done", item))
                        self._loop.call_soon_threadsafe(self._release)
                        continue
                    self._post(("piece", item))
                    if self.stop.is_set():
                        break
            finally:
                items.close()  # the engine leaves the batch, stores the prefix blocks, releases the buffer
        except BaseException as error:  # handed to the event loop, answered there
            self._post(("error", error))

    async def next(self) -> tuple[str, Any]:
        if self._held is not None:
            entry, self._held = self._held, None
            return entry
        return await self._queue.get()

    async def pieces(self) -> tuple[str, Any]:
        """The next entry, with the pieces already waiting behind a piece joined into it: one event per
        wake-up rather than per token. Alone, a stream gets each token as it comes; 8 streams through HTTP on
        the 2-core machine spent their time in per-event work (the server's and the client's) instead."""
        kind, value = await self.next()
        while kind == "piece" and not self._queue.empty():
            entry = self._queue.get_nowait()
            if entry[0] == "piece" and not entry[1]:
                continue  # a heartbeat (stream_chat): it has done its work in the worker
            if entry[0] != "piece" or choice_of(entry[1]) != choice_of(value) or (
                    isinstance(entry[1], Reasoning) != isinstance(value, Reasoning) and value):
                # an answer's piece is not joined to the reasoning's, nor the other way round, nor two choices'
                self._held = entry
                break
            value = joined(value, entry[1])
        return kind, value

    async def next_or(self, disconnect: asyncio.Task, timeout_s: float | None = None) -> tuple[str, Any]:
        """The next entry, or ("disconnected", None) if the client goes away first, or ("timeout", None) after
        `timeout_s` (in both the worker is stopped)."""
        if self._held is not None:
            return await self.next()
        get = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({get, disconnect}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        self.stop.set()
        return ("disconnected" if disconnect in done else "timeout"), None


class _ChatFormat:
    """chat.completion and chat.completion.chunk objects: a choice per reply (n), logprobs when asked."""

    def __init__(self, model_id: str, body: ChatCompletionRequest):
        self.model_id, self.id, self.created = model_id, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.logprobs = bool(body.logprobs)
        self.n = body.n or 1
        self._sent = [0] * self.n  # per choice, tokens whose logprobs a chunk carried

    def _chunk(self, delta: dict, finish: str | None, choice: int = 0, logprobs=None, error: str | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "choices": [{"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             **_choice_error(error)}]}

    def _logprobs(self, entries) -> dict | None:
        return {"content": openai_logprobs(entries), "refusal": None} if self.logprobs else None

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, i) for i in range(self.n)]

    def piece(self, text: str) -> dict:
        choice, entries = choice_of(text), getattr(text, "logprobs", ())
        self._sent[choice] += len(entries)
        if isinstance(text, Reasoning):  # the thinking of a reasoning model, as vLLM and Ollama send it
            return self._chunk({"reasoning_content": str(text)}, None, choice, self._logprobs(entries))
        return self._chunk({"content": str(text)}, None, choice, self._logprobs(entries))

    def closing(self, reply: ChatReply) -> list[dict]:
        """Per choice: its calls as one delta (a call the budget cut included), then its finish, with the logprobs
        of its tokens no piece carried (a held-back call's, the end-of-turn token's)."""
        out = []
        for r in reply.choices:
            rest = tuple(r.logprobs or ())[self._sent[r.choice]:]
            if r.tool_calls:
                calls = [{"index": i, **c.openai()} for i, c in enumerate(r.tool_calls)]
                out.append(self._chunk({"tool_calls": calls}, None, r.choice, self._logprobs(rest) if rest else None))
                rest = ()
            out.append(self._chunk({}, r.finish_reason, r.choice, self._logprobs(rest) if rest else None, r.error))
        return out

    def usage_chunk(self, counts: dict) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "choices": [], "usage": counts}

    def whole(self, reply: ChatReply, counts: dict) -> dict:
        choices = []
        for r in reply.choices:
            message: dict[str, Any] = {"role": "assistant", "content": r.content}
            if r.reasoning:
                message["reasoning_content"] = r.reasoning
            if r.tool_calls:
                message["content"] = r.content or None  # as OpenAI: no text beside the calls is null
                message["tool_calls"] = [c.openai() for c in r.tool_calls]
            choices.append({"index": r.choice, "message": message, "logprobs": self._logprobs(r.logprobs),
                            "finish_reason": r.finish_reason, **_choice_error(r.error)})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": counts}


class _CompletionFormat:
    """text_completion objects (streamed chunks have the same object name, as OpenAI's): a choice per reply (n; the
    n best of best_of by mean token log-probability), the prompt before each with echo, the legacy logprobs object
    (tokens, token_logprobs, top_logprobs with the chosen token among them, text_offset) when asked."""

    def __init__(self, model_id: str, body: CompletionRequest):
        self.model_id, self.id, self.created = model_id, f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.logprobs = body.logprobs is not None
        self.n = body.n or 1
        self.echo = body.prompt_text if body.echo else ""
        self._sent = [0] * self.n
        self._offset = [len(self.echo)] * self.n  # per choice, the characters of text before its next token

    def _chunk(self, text: str, finish: str | None, choice: int = 0, logprobs=None, error: str | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [{"index": choice, "text": text, "logprobs": logprobs, "finish_reason": finish,
                             **_choice_error(error)}]}

    def _logprobs(self, choice: int, entries) -> dict | None:
        if not self.logprobs:
            return None
        offsets = []
        for e in entries:
            offsets.append(self._offset[choice])
            self._offset[choice] += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [max(e.logprob, -9999.0) for e in entries],
                "top_logprobs": [{t.token: max(t.logprob, -9999.0) for t in (*e.top, e)} for e in entries],
                "text_offset": offsets}

    def opening(self) -> list[dict]:
        return [self._chunk(self.echo, None, i) for i in range(self.n)] if self.echo else []

    def piece(self, text: str) -> dict:
        choice, entries = choice_of(text), getattr(text, "logprobs", ())
        self._sent[choice] += len(entries)
        return self._chunk(str(text), None, choice, self._logprobs(choice, entries))

    def closing(self, generation) -> list[dict]:
        return [self._chunk("", c.finish_reason, c.index,
                            self._logprobs(c.index, tuple(c.logprobs or ())[self._sent[c.index]:]), c.error)
                for c in generation.choices]

    def usage_chunk(self, counts: dict) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [], "usage": counts}

    def whole(self, generation, counts: dict) -> dict:
        choices = list(generation.choices)
        if len(choices) > self.n:  # best_of: the n whose tokens are likeliest on average, best first
            choices = sorted(choices, key=lambda c: -sum(e.logprob for e in c.logprobs) / max(1, len(c.logprobs)))
            choices = choices[: self.n]
        out = []
        for i, c in enumerate(choices):
            self._offset[i] = len(self.echo)
            out.append({"index": i, "text": self.echo + c.text, "logprobs": self._logprobs(i, c.logprobs or ()),
                        "finish_reason": c.finish_reason, **_choice_error(c.error)})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": out, "usage": counts}


def _choice_error(error: str | None) -> dict:
    """A choice's `error` field, beside finish_reason "error": why its grammar (a response_format, a forced tool call)
    could not be completed. OpenAI's choices have no such field, nor that reason: a reply under a grammar is complete
    and valid, or cut by max_tokens, or refused with a 400; what llguidance finds only while decoding (a branch of
    the grammar no text completes, one of its limits) is said here rather than passed off as "stop"."""
    return {} if error is None else {"error": {"message": error, "type": "grammar_error", "code": "grammar_incomplete"}}


def _event(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def _sse(fmt, body, worker: _Worker, first: tuple[str, Any], finished: Callable[[Any], None]
               ) -> AsyncIterator[bytes]:
    """The stream's events; when the client disconnects Starlette cancels this generator and the worker stops.
    `finished` is called with the final reply once its last events are out."""
    try:
        for opening in fmt.opening():
            yield _event(opening)
        kind, value = first
        while kind == "piece":
            if value:  # "" is a held-back token of a tool call (stream_chat's heartbeat)
                yield _event(fmt.piece(value))
            kind, value = await worker.pieces()
        if kind == "error":  # after the first piece the status line is sent: the error goes in the stream
            error = _as_api_error(value)
            yield _event(error.body)
            return
        for closing in fmt.closing(value):
            yield _event(closing)
        if body.include_usage:
            yield _event(fmt.usage_chunk(usage(_generation(value))))
        yield _event("[DONE]")
        finished(value)
    finally:
        worker.stop.set()
