"""PromptCacheLLM: a LlamaIndex LLM answered by a local pc_rag Engine that reuses the KV of retrieved nodes.

One path: prompt string (completions) or chat messages rendered with the model's own chat template ->
the prompt split into segments (nodes any retriever returned, TextBlocks marked by a CachePoint and nodes
registered with the engine become `Chunk`s) -> `Engine.stream_generation`. The non-streaming calls collect
the stream; the async ones run it in a worker thread so the event loop keeps running.

Agents: a `FunctionCallingLLM`. Tools are rendered through the model's chat template (pc_rag.tools);
`tool_required=True` (or `tool_choice="required"`/a tool's name) constrains the reply to a valid call, so
`FunctionAgent` steps and `structured_predict` (a forced call of the output class) always get one; the calls are
in `message.additional_kwargs["tool_calls"]` in OpenAI's shape, and tool messages answer them. `chat(...,
response_format={"type": "json_schema", ...})` constrains the reply to JSON.

Reasoning models: the text between the thinking markers (`<think>...</think>`, pc_rag.reasoning) is
`message.additional_kwargs["reasoning_content"]`, not content (streamed: the reasoning so far, and each response's
`additional_kwargs["reasoning_delta"]`); a message's `reasoning_content` goes back to templates that read it.

A forced call or a `response_format` reply that the token budget (`max_new_tokens`) cut raises
`pc_rag.errors.ReplyCutError` naming it: LlamaIndex has no place for a partial call, and the call's markup never
comes back as text; one whose grammar could not be completed (finish reason "error") raises
`pc_rag.errors.GrammarError` saying why. Logprobs (`logprobs=True`, `top_logprobs=k`): `CompletionResponse.logprobs` and
`ChatResponse.logprobs`, one list per generated token, the token itself first, then the k most likely (streamed:
each response those of the tokens it completes, the last one those no delta carried).
`reasoning_effort` goes to a chat template that reads it.

Usage of every request: `raw["usage"]` in OpenAI's shape (`prompt_tokens`, `completion_tokens`,
`total_tokens`, `prompt_tokens_details.cached_tokens`: what LlamaIndex's TokenCountingHandler reads) plus
`cached_tokens` and `cache_creation_tokens`; `llm.last_usage`; and `track_usage()` around any query or chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from pc_rag.adapters import (
    ChatReply,
    GenerationOptions,
    Reasoning,
    chat_request,
    completion_prompt,
    model_context,
    shared_engine,
    stream_chat,
    stream_generation,
    usage,
)

T = TypeVar("T")

def openai_usage(generation) -> dict[str, Any]:
    """A request's token counts in OpenAI's shape, plus pc_rag's flat `cached_tokens`/`cache_creation_tokens`."""
    counts = usage(generation)
    cached, created = counts["cached_tokens"], counts["cache_creation_tokens"]
    return {
        "prompt_tokens": counts["prompt_tokens"],  # includes the cached ones
        "completion_tokens": counts["completion_tokens"],
        "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": cached},
        "cached_tokens": cached,  # prompt tokens whose KV was reused
        "cache_creation_tokens": created,  # prompt tokens whose KV this request stored
    }


@dataclass
class UsageTotals:
    """Token counts summed over the requests finished inside a `track_usage()` block."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, usage: dict[str, Any]) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += usage["prompt_tokens"]
            self.completion_tokens += usage["completion_tokens"]
            self.cached_tokens += usage["cached_tokens"]
            self.cache_creation_tokens += usage["cache_creation_tokens"]


# The totals objects of the enclosing track_usage() blocks. LlamaIndex runs parts of a query in threads and
# tasks that copy the context (streaming chat engines write the reply in a thread): the copies hold the same
# objects, so requests finished there are counted too.
_TRACKERS: contextvars.ContextVar[tuple[UsageTotals, ...]] = contextvars.ContextVar("pc_rag_usage", default=())


@contextlib.contextmanager
def track_usage() -> Iterator[UsageTotals]:
    """Sum the usage of every PromptCacheLLM request that finishes inside the block (in this context and the
    threads and tasks started from it), e.g. around `query_engine.query(...)` or `chat_engine.chat(...)`."""
    totals = UsageTotals()
    token = _TRACKERS.set((*_TRACKERS.get(), totals))
    try:
        yield totals
    finally:
        _TRACKERS.reset(token)


def _message_parts(message: ChatMessage) -> tuple[dict[str, Any], list[str]]:
    """A message as the role/content dict a chat template takes (with its tool calls, or the id of the call a
    tool message answers), and the texts it marks as chunks: the TextBlock right before a `CachePoint`, or the
    whole text when `additional_kwargs` has `cache_control` (the two ways LlamaIndex marks cacheable content for
    Anthropic)."""
    blocks = message.blocks
    other = [type(b).__name__ for b in blocks if not isinstance(b, (TextBlock, CachePoint))]
    if other:
        raise ValueError(f"PromptCacheLLM takes text only; the message has {other} blocks")
    content = message.content or ""
    marked = [b.text for b, after in zip(blocks, blocks[1:], strict=False)
              if isinstance(b, TextBlock) and isinstance(after, CachePoint)]
    if message.additional_kwargs.get("cache_control"):
        marked.append(content)
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.additional_kwargs.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_dict(c) for c in calls]
    if message.additional_kwargs.get("tool_call_id"):
        out["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    reasoning = message.additional_kwargs.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    return out, marked


def _call_dict(call: Any) -> dict[str, Any]:
    """A tool call as OpenAI's dict: ours are dicts already; OpenAI client objects and ToolSelections are read."""
    if isinstance(call, ToolSelection):
        return {"id": call.tool_id, "type": "function",
                "function": {"name": call.tool_name, "arguments": call.tool_kwargs}}
    if hasattr(call, "model_dump"):
        call = call.model_dump()
    if not isinstance(call, dict) or not isinstance(call.get("function", call).get("name"), str):
        raise ValueError(f"a tool call needs a function name, got {call!r}")
    return call


async def _iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """The items of a blocking iterator, produced in a worker thread so that the event loop keeps running.

    `make` runs in the thread too (loading the model, splitting the prompt). When the consumer stops early
    the thread stops at the next item and closes the iterator, so the engine frees the request's buffers.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def post(entry) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, entry)
        except RuntimeError:  # the loop is closed: nobody waits for the rest
            stop.set()

    def produce() -> None:
        try:
            items = make()
            try:
                for item in items:
                    post(("item", item))
                    if stop.is_set():
                        break
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
        except BaseException as error:  # handed to the consumer, raised there
            post(("error", error))
        else:
            post(("done", None))

    context = contextvars.copy_context()  # instrumentation spans and track_usage() live in context variables
    threading.Thread(target=context.run, args=(produce,), name="pc_rag-stream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "error":
                raise value
            if kind == "done":
                return
            yield value
    finally:
        stop.set()


def _logprobs(entries) -> list[list[LogProb]] | None:
    """pc_rag's TokenLogprob entries as LlamaIndex's: per token, the token itself, then the most likely of its step
    (the token not repeated among them). None when there are none (not asked)."""
    if not entries:
        return None

    def one(e) -> LogProb:
        return LogProb(token=e.token, logprob=e.logprob, bytes=list(e.token_bytes))

    return [[one(e), *(one(t) for t in e.top if t.token_id != e.token_id)] for e in entries]


def _all(responses) -> list[list[LogProb]] | None:
    """The logprobs of a stream's responses, together (each carries those of the tokens it completes)."""
    return [per_token for r in responses for per_token in r.logprobs or ()] or None


class PromptCacheLLM(FunctionCallingLLM):
    """Local Llama through pc_rag; documents in the prompt are reused wherever they appear.

    Nodes any LlamaIndex retriever returns are discovered automatically (see `discovery`): a stock
    `index.as_query_engine(llm=llm)` or `index.as_chat_engine(chat_mode="context", llm=llm)` reuses them.
    `PromptCacheNodeRegistrar` / `PromptCacheSynthesizer` / `prompt_cache_query_engine` are optional.
    A `FunctionCallingLLM`: `FunctionAgent`, `predict_and_call`, `structured_predict` (a forced call).
    """

    model: str | None = Field(default=None, description="Path of a local checkpoint: an HF folder or a GGUF file "
                              "(kept quantized as in the file); loaded lazily.")
    engine: Any = Field(default=None, exclude=True, description="An existing pc_rag.Engine.")
    dtype: str = Field(default="float32", description="Weights dtype when loading `model`.")
    device: str = Field(default="cpu", description="Device when loading `model`.")
    quantize: str | None = Field(
        default=None, description="'q4_k', 'q4_0' or 'q8_0': quantize a float checkpoint's matrices as `model` "
        "loads (a quarter to half of its memory; a GGUF file is already quantized). None: as the checkpoint is.")
    mode: str = Field(default="modular", description="'modular' reuses chunk KV, 'exact' prefixes.")
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[str] | None = Field(default=None, description="Strings that end generation (not returned).")
    seed: int | None = Field(default=None, description="Sampling seed.")
    logprobs: bool | None = Field(default=None, description="Report each generated token's log-probability.")
    top_logprobs: int = Field(default=0, ge=0, le=20, description="With logprobs: the most likely tokens per step.")
    presence_penalty: float | None = Field(default=None, description="OpenAI's presence penalty, -2 to 2.")
    frequency_penalty: float | None = Field(default=None, description="OpenAI's frequency penalty, -2 to 2.")
    logit_bias: dict[int, float] | None = Field(
        default=None, description="{token id: bias in -100..100} added to the logits at every step (OpenAI's).")
    reasoning_effort: str | None = Field(
        default=None, description="OpenAI's reasoning_effort, for a chat template that reads it (refused else).")
    cache_salt: str | None = Field(
        default=None,
        description="Cache namespace (1 to 256 characters; also a per-call keyword): requests reuse only the KV "
        "that requests with the same salt stored, and public documents. In a multi-user app, one per user keeps "
        "a user from learning another's prompts through cache hits. None: the shared namespace.",
    )
    context_window: int | None = Field(
        default=None,
        gt=0,
        description="The model's context in tokens, for LlamaIndex's prompt sizing. None: the model's own "
        "(max_position_embeddings from the checkpoint's config.json, or a GGUF file's context_length, read "
        "without loading the weights).",
    )
    is_chat_model: bool | None = Field(
        default=None,
        description="Whether LlamaIndex sends chat messages (chat(): the model's chat template) rather than "
        "prompt strings (complete()). None: from the tokenizer, chat when it has a chat template; the model "
        "is loaded by the first predict/stream call (query engines), before LlamaIndex reads this.",
    )
    auto_chunks: bool = Field(
        default=True,
        description="Reuse the KV of nodes that any LlamaIndex retriever in this process returned, found "
        "wherever they appear in the prompt. False: only TextBlocks marked by a CachePoint and nodes registered "
        "with this LLM's engine are chunks. PC_RAG_DISCOVERY=0 turns discovery off for the whole process.",
    )

    _loaded: Any = PrivateAttr(default=None)
    _config_context: int | None = PrivateAttr(default=None)
    _last_usage: dict | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    # ---- what LlamaIndex reads to size and shape prompts ------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._context_window(),
            num_output=self.max_new_tokens,
            is_chat_model=self._chat_model(),
            is_function_calling_model=True,
            model_name=self.model or "pc-rag",
        )

    def _loaded_engine(self):
        return self.engine if self.engine is not None else self._loaded

    def _context_window(self) -> int:
        # LlamaIndex's default (3900) on a 2K model made compact mode answer "Empty Response": its refine step
        # swallows the engine's too-long-prompt error. Synthesizers read this when they are built, before any
        # request, so it comes from config.json (or the GGUF's header) rather than from loading the model.
        if self.context_window is not None:
            return self.context_window
        engine = self._loaded_engine()
        if engine is not None:
            return engine.runner.shape.max_positions
        if self.model and self._config_context is None:
            self._config_context = model_context(self.model)
        return self._config_context or DEFAULT_CONTEXT_WINDOW

    def _chat_model(self) -> bool:
        if self.is_chat_model is not None:
            return self.is_chat_model
        engine = self._loaded_engine()
        # Not loaded yet: chat, the usual case; predict/stream load the model before LlamaIndex branches on it.
        return True if engine is None else bool(getattr(engine.tokenizer, "chat_template", None))

    def get_engine(self):
        """The pc_rag Engine answering this LLM (loaded on first use and shared per checkpoint)."""
        if self.engine is not None:
            return self.engine
        if self._loaded is None:
            if not self.model:
                raise ValueError("pass model=<path of a local HF Llama checkpoint> or engine=<pc_rag.Engine>")
            self._loaded = shared_engine(self.model, self.dtype, self.device, self.quantize)
        return self._loaded

    # LLM.predict/stream/apredict/astream choose chat() or complete() from metadata.is_chat_model: with the
    # field unset, load the model first so that the choice comes from its tokenizer.
    def predict(self, prompt, **prompt_args: Any) -> str:
        self._load_if_undecided()
        return super().predict(prompt, **prompt_args)

    def stream(self, prompt, **prompt_args: Any):
        self._load_if_undecided()
        return super().stream(prompt, **prompt_args)

    async def apredict(self, prompt, **prompt_args: Any) -> str:
        await asyncio.to_thread(self._load_if_undecided)
        return await super().apredict(prompt, **prompt_args)

    async def astream(self, prompt, **prompt_args: Any):
        await asyncio.to_thread(self._load_if_undecided)
        return await super().astream(prompt, **prompt_args)

    def _load_if_undecided(self) -> None:
        if self.is_chat_model is None:
            self.get_engine()

    # ---- usage --------------------------------------------------------------------------------------------
    @property
    def last_usage(self) -> dict | None:
        """`raw["usage"]` of the request this LLM finished last (in any thread; None before the first).

        With concurrent requests on one LLM, use `track_usage()` around each query instead."""
        return self._last_usage

    def _record(self, usage: dict[str, Any]) -> None:
        self._last_usage = usage
        for totals in _TRACKERS.get():
            totals.add(usage)

    # ---- the request path ---------------------------------------------------------------------------------
    def _options(self, kwargs: dict[str, Any]) -> GenerationOptions:
        stop = kwargs.get("stop", self.stop)
        return GenerationOptions(
            mode=kwargs.get("mode", self.mode),
            max_new_tokens=int(kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            stop=tuple(stop) if stop else None,
            seed=kwargs.get("seed", self.seed),
            cache_salt=kwargs.get("cache_salt", self.cache_salt),
            logprobs=kwargs.get("top_logprobs", self.top_logprobs) if kwargs.get("logprobs", self.logprobs) else None,
            presence_penalty=kwargs.get("presence_penalty", self.presence_penalty) or 0.0,
            frequency_penalty=kwargs.get("frequency_penalty", self.frequency_penalty) or 0.0,
            logit_bias=kwargs.get("logit_bias", self.logit_bias),
        )

    def _chat_request(self, messages: Sequence[ChatMessage], parts: Iterable[tuple[dict, list[str]]], kwargs):
        engine = self.get_engine()
        parts = list(parts)
        marked = [text for _, texts in parts for text in texts]
        salt = self._options(kwargs).cache_salt
        if getattr(engine.tokenizer, "chat_template", None):
            return chat_request(
                engine, [d for d, _ in parts], self._options(kwargs), tools=kwargs.get("tools"),
                tool_choice=kwargs.get("tool_choice"), response_format=kwargs.get("response_format"),
                parallel_tool_calls=bool(kwargs.get("parallel_tool_calls", False)), chunk_texts=marked,
                discovered=self.auto_chunks, reasoning_effort=kwargs.get("reasoning_effort", self.reasoning_effort),
            )
        if kwargs.get("tools") or kwargs.get("response_format"):
            raise ValueError("tools and response_format need a model with a chat template")
        # No chat template (a base model): LlamaIndex's own rendering, as for any completion model.
        prompt = self.messages_to_prompt(messages)
        return completion_prompt(engine, prompt, chunk_texts=marked, discovered=self.auto_chunks, cache_salt=salt)

    def _completion_segments(self, prompt: str, kwargs):
        return completion_prompt(self.get_engine(), prompt, discovered=self.auto_chunks,
                                 cache_salt=self._options(kwargs).cache_salt)

    def _raw(self, generation, finish_reason: str) -> dict[str, Any]:
        raw = {"usage": openai_usage(generation), "finish_reason": finish_reason, "mode": generation.mode,
               "ttft_s": generation.ttft_s}
        self._record(raw["usage"])
        return raw

    def _sent(self, segments) -> None:
        """Called with each request's prompt segments before it runs (a hook for tests that record them)."""

    def _completions(self, segments, kwargs) -> Iterator[CompletionResponse]:
        self._sent(segments)
        text, sent = "", 0
        for item in stream_generation(self.get_engine(), segments, self._options(kwargs)):
            if isinstance(item, str):
                text += item
                sent += len(getattr(item, "logprobs", ()))
                yield CompletionResponse(text=text, delta=str(item), logprobs=_logprobs(getattr(item, "logprobs", ())))
            else:
                yield CompletionResponse(text=text, delta="", raw=self._raw(item, item.finish_reason),
                                         logprobs=_logprobs(tuple(item.logprobs or ())[sent:]))

    def _chats(self, request, kwargs) -> Iterator[ChatResponse]:
        """The chat's responses as they stream; the last holds the tool calls and the usage."""
        if isinstance(request, list):  # no chat template: segments from messages_to_prompt
            for response in self._completions(request, kwargs):
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
                                   delta=response.delta, raw=response.raw or {}, logprobs=response.logprobs)
            return
        self._sent(request.prompt)
        text = thought = ""
        sent = 0
        for item in stream_chat(self.get_engine(), request):
            logprobs = _logprobs(getattr(item, "logprobs", ())) if isinstance(item, str) else None
            sent += len(getattr(item, "logprobs", ())) if isinstance(item, str) else 0
            if isinstance(item, Reasoning):
                thought += item
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text,
                                      additional_kwargs={"reasoning_content": thought})
                yield ChatResponse(message=message, delta="", additional_kwargs={"reasoning_delta": str(item)},
                                   logprobs=logprobs)
                continue
            if isinstance(item, str):
                extra = {"reasoning_content": thought} if thought else {}
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text + item, additional_kwargs=extra)
                text += item
                yield ChatResponse(message=message, delta=str(item), logprobs=logprobs)
                continue
            reply: ChatReply = item
            reply.check_complete(request.options.max_new_tokens)  # a cut call or JSON, a failed grammar: raised
            extra = {"tool_calls": [c.openai() for c in reply.tool_calls]} if reply.tool_calls else {}
            if reply.reasoning:
                extra["reasoning_content"] = reply.reasoning
            message = ChatMessage(role=MessageRole.ASSISTANT, content=reply.content, additional_kwargs=extra)
            yield ChatResponse(message=message, delta="", raw=self._raw(reply.generation, reply.finish_reason),
                               logprobs=_logprobs(tuple(reply.logprobs or ())[sent:]))

    def _complete(self, prompt: str, kwargs) -> CompletionResponse:
        responses = list(self._completions(self._completion_segments(prompt, kwargs), kwargs))
        return CompletionResponse(text=responses[-1].text, raw=responses[-1].raw, logprobs=_all(responses))

    def _chat(self, messages: Sequence[ChatMessage], parts, kwargs) -> ChatResponse:
        responses = list(self._chats(self._chat_request(messages, parts, kwargs), kwargs))
        return ChatResponse(message=responses[-1].message, raw=responses[-1].raw, logprobs=_all(responses))

    # ---- function calling ----------------------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 **kwargs: Any) -> dict[str, Any]:
        """The `chat` arguments of a request with `tools`: their OpenAI schemas, and `tool_choice` "required"
        when `tool_required` (the reply is then constrained to a valid call)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        specs = [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
        choice = kwargs.pop("tool_choice", None) or ("required" if tool_required else "auto")
        return {"messages": messages, "tools": specs or None, "tool_choice": choice if specs else None,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got the text {response.message.content!r}")
        selections = []
        for call in calls:
            function = _call_dict(call)["function"]
            args = function.get("arguments") or {}
            selections.append(ToolSelection(tool_id=call.get("id") or "", tool_name=function["name"],
                                            tool_kwargs=json.loads(args) if isinstance(args, str) else args))
        return selections

    # ---- completions: the prompt string as it is -------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completions(self._completion_segments(prompt, kwargs), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return _iterate_in_thread(lambda: self._completions(self._completion_segments(prompt, kwargs), kwargs))

    # ---- chat: the model's chat template -----------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, [_message_parts(m) for m in messages], kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        parts = [_message_parts(m) for m in messages]
        return self._chats(self._chat_request(messages, parts, kwargs), kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        parts = [_message_parts(m) for m in messages]  # bad input fails here, before a thread is used
        return await asyncio.to_thread(self._chat, messages, parts, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        parts = [_message_parts(m) for m in messages]
        return _iterate_in_thread(lambda: self._chats(self._chat_request(messages, parts, kwargs), kwargs))
