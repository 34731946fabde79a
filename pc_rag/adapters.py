"""What the LangChain and LlamaIndex adapters share; imports neither framework.

The one path every adapter request takes:
    framework messages -> role/content dicts -> the model's own chat template (`render_chat`) -> one string
    -> `Engine.split` (registered, discovered and marked documents become `Chunk`s; earlier replies keep their
    generated tokens) -> `stream_generation` -> text pieces, then the engine's `Generation` (token counts,
    `cached_tokens`, `stored_tokens`) -> `usage`.
With tools (`chat_request`): the tools go through the template too (pc_rag.tools), a forced `tool_choice` or a
`response_format` becomes the request's grammar, and `CallFilter` turns the reply into text and tool calls.
Reasoning models (pc_rag.reasoning): what the model writes between the thinking markers (`<think>...</think>`) is
given out apart (`Reasoning` pieces, `ChatReply.reasoning`), and only the answer is read for tool calls.
Completion-style calls skip the chat template and split the prompt string as it is. Nothing needs wiring: the
automatic prefix reuse works on any prompt, and the framework hooks (`discover`) register retrieved documents.
`GenerationOptions.cache_salt` (the classes' `cache_salt` field, or a per-call keyword) keeps one user's cache
apart from another's in a multi-user app: it goes to the split (replies) and to the engine call (every key).
Documents registered with `register(engine, texts, public=True)` are shared by every namespace.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .errors import OptionError, OptionTypeError, PCRagError
from .grammar import Grammar
from .options import GenerationOptions
from .reasoning import CONTENT, ThinkingFilter, ThinkingMarkers
from .segments import Chunk, Text
from .text_index import discover, discovery_enabled, index_for
from .tools import CallFilter, ToolCall, ToolFormat, call_grammar, check_tool_choice, render_messages, tool_specs

__all__ = ["ChatReply", "ChatRequest", "GenerationOptions", "Reasoning", "ToolCall", "chat_prompt",
           "chat_request", "completion_prompt", "discover", "discovery_enabled", "register", "render_chat",
           "response_grammar", "shared_engine", "stream_chat", "stream_generation", "usage"]

_ENGINES: dict[tuple[str, str, str], Any] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(path: str, dtype: str = "float32", device: str = "cpu"):
    """The Engine for a checkpoint, loaded on first use and shared by every adapter instance in the process.

    Adapters are cheap to construct (LangChain builds them per chain, its tests ten times in a row); the
    weights and the KV store they would otherwise each hold are loaded once per (path, dtype, device).
    """
    key = (str(path), dtype, device)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            from . import Engine  # the model code loads only when a request needs it

            engine = _ENGINES[key] = Engine.from_pretrained(str(path), dtype=dtype, device=device)
        return engine


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """Messages (with tool calls and tool results, pc_rag.tools) and `tools` (OpenAI function dicts) as the model's
    chat template writes them, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise PCRagError(
            "the model's tokenizer has no chat template; use the completion-style class (PromptCacheLLM) "
            "or set tokenizer.chat_template"
        )
    rendered, kwargs = render_messages(messages, tool_specs(tools), ToolFormat.detect(tokenizer))
    return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kwargs)


def chat_prompt(engine, messages: Sequence[Mapping[str, Any]], chunk_texts: Sequence[str] = (),
                discovered: bool = True, cache_salt: str | None = None,
                tools: Sequence[Mapping[str, Any]] = ()) -> list[Text | Chunk]:
    """Chat messages (and `tools`, through the chat template) as prompt segments: registered and discovered
    documents (unless `discovered=False`) and `chunk_texts` (content marked with `cache_control`) inside any
    message become `Chunk`s; earlier replies of the namespace `cache_salt` keep their generated tokens."""
    return completion_prompt(engine, render_chat(engine.tokenizer, messages, tools), chunk_texts, discovered,
                             cache_salt)


def response_grammar(response_format: Mapping[str, Any] | None) -> Grammar | None:
    """OpenAI's `response_format` as a grammar: `{"type": "json_schema", "json_schema": {"schema": ...}}`, `{"type":
    "json_object"}`, or `{"type": "text"}`/None (free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise OptionTypeError(f"response_format must be a dict, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is None:
            raise OptionError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return Grammar.json_schema(schema)
    raise OptionError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One chat request with tools: the prompt, the options (the grammar of a forced call or a response format
    included), and what reading the reply needs."""

    prompt: list[Text | Chunk]
    options: GenerationOptions
    tool_format: ToolFormat
    tools: list[dict[str, Any]]  # OpenAI function dicts
    tool_choice: str  # auto, none, required or a tool's name
    thinking: ThinkingMarkers = ThinkingMarkers()
    starts_thinking: bool = False  # the template's generation prompt opened the thinking block

    @property
    def forced(self) -> bool:
        return self.tool_choice not in ("auto", "none")

    def call_filter(self, tokenizer=None) -> CallFilter | None:
        """What reads the reply's pieces into text and calls; None when no call can come (no tools, "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return CallFilter(self.tool_format, self.tools, forced=self.forced, tokenizer=tokenizer)

    def thinking_filter(self) -> ThinkingFilter:
        """What splits the reply's pieces into reasoning and answer (pc_rag.reasoning)."""
        return ThinkingFilter(self.thinking, inside=self.starts_thinking)


def chat_request(engine, messages: Sequence[Mapping[str, Any]], options: GenerationOptions,
                 tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                 response_format: Mapping[str, Any] | None = None, parallel_tool_calls: bool = False,
                 chunk_texts: Sequence[str] = (), discovered: bool = True) -> ChatRequest:
    """A chat request as the engine runs it. `tool_choice` "required" (LangChain's "any") or a tool's name
    constrains the reply to a valid call (`parallel_tool_calls`: one or more); a `response_format` constrains it
    to JSON; both at once is refused (a forced call is already JSON). A reply after a generation prompt that opened
    the thinking block starts inside it, unless a forced call or a response format makes the whole reply that."""
    specs = tool_specs(tools)
    choice = check_tool_choice(tool_choice, specs)
    fmt = ToolFormat.detect(engine.tokenizer)
    grammar = call_grammar(fmt, specs, choice, parallel=parallel_tool_calls)
    wanted = response_grammar(response_format)
    if wanted is not None:
        if grammar is not None:
            raise OptionError("response_format and a forced tool_choice cannot both constrain one reply")
        grammar = wanted
    if grammar is not None:
        options = dataclasses.replace(options, grammar=grammar)
    text = render_chat(engine.tokenizer, messages, specs)
    prompt = completion_prompt(engine, text, chunk_texts, discovered, options.cache_salt)
    markers = ThinkingMarkers.detect(engine.tokenizer)
    inside = grammar is None and markers.starts_inside(text)
    return ChatRequest(prompt, options, fmt, specs, choice, markers, inside)


def completion_prompt(engine, prompt_text: str, chunk_texts: Sequence[str] = (),
                      discovered: bool = True, cache_salt: str | None = None) -> list[Text | Chunk]:
    """A plain prompt string as segments (no chat template)."""
    split = getattr(engine, "split", None)
    if split is not None:
        return split(prompt_text, chunk_texts=chunk_texts, discovered=discovered, cache_salt=cache_salt)
    index_for(engine).add_many(chunk_texts)  # an engine stand-in without Engine.split (tests)
    return index_for(engine).split(prompt_text)


def register(engine, texts, public: bool = False) -> int:
    """Register document texts as chunks of `engine`'s prompts; return how many were new. `public=True`: shared
    by every cache namespace (`Engine.register`): only for documents any user may know are in use."""
    return index_for(engine).add_many(texts, public=bool(public))


def stream_generation(engine, prompt: Sequence[Text | Chunk], options: GenerationOptions) -> Iterator[Any]:
    """The text pieces of one request (`str`), then the engine's `Generation` as the last item."""
    return engine.stream_generation(
        prompt, mode=options.mode, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
        top_p=options.top_p, stop=list(options.stop) or None, seed=options.seed,
        recompute_ratio=options.recompute_ratio, cache_salt=options.cache_salt, grammar=options.grammar,
    )


def usage(generation) -> dict[str, int]:
    """Token counts of a finished request: `cached_tokens`, prompt tokens whose KV came from the store (reused);
    `cache_creation_tokens`, prompt tokens whose KV this request newly stored (chunks it encoded, new prefix
    blocks). `prompt_tokens` counts all prompt tokens, reused ones included (as ChatAnthropic's input_tokens)."""
    return {
        "prompt_tokens": int(generation.prompt_tokens),
        "completion_tokens": len(generation.token_ids),
        "cached_tokens": int(generation.cached_tokens),
        "cache_creation_tokens": int(getattr(generation, "stored_tokens", 0)),
    }


class Reasoning(str):
    """A piece of a chat reply's reasoning (the text between the thinking markers); the answer's pieces are `str`."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """A finished chat reply: its text (calls and thinking taken out), its tool calls, the engine's `Generation`,
    and its reasoning (the text between the thinking markers; "" when there was none)."""

    content: str
    tool_calls: list[ToolCall]
    generation: Any
    reasoning: str = ""

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.generation.finish_reason


def stream_chat(engine, request: ChatRequest, heartbeat: bool = False) -> Iterator[Any]:
    """The pieces of one chat request: the answer's text (`str`; what may be a tool call is held back) and its
    reasoning (`Reasoning`, a `str` too: test for it first), then its `ChatReply`. `heartbeat`: an empty piece
    for each token held back, so that a caller which stops or times out a request between pieces (the server)
    still can while a call is decoded."""
    calls = request.call_filter(engine.tokenizer)
    thinking = request.thinking_filter()
    text: list[str] = []
    thought: list[str] = []

    def pieces(parts):
        for kind, part in parts:
            if kind != CONTENT:
                thought.append(part)
                yield Reasoning(part)
                continue
            piece = calls.feed(part) if calls is not None else part
            if piece:
                text.append(piece)
                yield piece

    for item in stream_generation(engine, request.prompt, request.options):
        if isinstance(item, str):
            out = list(pieces(thinking.feed(item)))
            yield from out
            if not out and heartbeat:
                yield ""
            continue
        yield from pieces(thinking.finish())
        found: list[ToolCall] = []
        if calls is not None:
            rest, found = calls.finish()
            if rest:
                text.append(rest)
                yield rest
        yield ChatReply("".join(text), found, item, "".join(thought))
