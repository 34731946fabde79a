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
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jinja2 import TemplateError  # what chat templates raise; jinja2 comes with torch

from .decode import Piece, choice_of
from .errors import GrammarError, OptionError, OptionTypeError, PCRagError, PromptError, ReplyCutError
from .grammar import Grammar
from .options import GenerationOptions
from .reasoning import CONTENT, ThinkingFilter, ThinkingMarkers
from .segments import Chunk, Text, check_texts
from .text_index import discover, discovery_enabled
from .tools import (
    CallFilter,
    CutCall,
    ToolCall,
    ToolFormat,
    call_grammar,
    check_tool_choice,
    render_messages,
    tool_specs,
)

__all__ = ["ChatReply", "ChatRequest", "CutCall", "GenerationOptions", "GrammarError", "Piece", "Reasoning",
           "ReplyCutError", "ToolCall", "chat_prompt", "chat_request", "check_reasoning_effort", "choice_of",
           "completion_prompt", "discover", "discovery_enabled", "model_context", "openai_logprobs", "register",
           "render_chat", "response_grammar", "shared_engine", "stream_chat", "stream_generation", "usage"]

# OpenAI's values of `reasoning_effort`; a chat template that reads the variable gets it as sent.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_ENGINES: dict[tuple[str, str, str, str | None], Any] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(path: str, dtype: str = "float32", device: str = "cpu", quantize: str | None = None):
    """The Engine for a checkpoint, loaded on first use and shared by every adapter instance in the process.

    Adapters are cheap to construct (LangChain builds them per chain, its tests ten times in a row); the
    weights and the KV store they would otherwise each hold are loaded once per (path, dtype, device, quantize).
    `quantize`: "q8_0", "q4_0" or "q4_k" quantizes a float checkpoint's matrices as it loads (Engine.from_pretrained).
    """
    key = (str(path), dtype, device, quantize)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            from . import Engine  # the model code loads only when a request needs it

            engine = _ENGINES[key] = Engine.from_pretrained(str(path), dtype=dtype, device=device, quantize=quantize)
        return engine


def model_context(path: str) -> int | None:
    """The context in tokens of the local checkpoint at `path` (a folder's config.json `max_position_embeddings`, or a
    GGUF file's `context_length`, also a folder holding one GGUF: `checkpoint.locate`), read without loading the
    model; None where it cannot be read (a Hub id, a missing or broken file: loading the model reports those)."""
    from pathlib import Path

    from .model.checkpoint import locate

    try:
        config = Path(path).expanduser() / "config.json"
        if config.is_file():
            return int(json.loads(config.read_text())["max_position_embeddings"])
        found = locate(path)
        if found.gguf_file:
            from .model.gguf import context_length

            return context_length(Path(found.source) / found.gguf_file)
    except Exception:  # a header that cannot be read: loading the model names what is wrong with it
        pass
    return None


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                reasoning_effort: str | None = None) -> str:
    """Messages (with tool calls and tool results, pc_rag.tools) and `tools` (OpenAI function dicts) as the model's
    chat template writes them, ending with the assistant header. `reasoning_effort` goes to a template that reads
    it (`check_reasoning_effort`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PCRagError(
            "the model's tokenizer has no chat template; use the completion-style class (PromptCacheLLM) "
            "or set tokenizer.chat_template"
        )
    rendered, kwargs = render_messages(checked_messages(messages), tool_specs(tools), ToolFormat.detect(tokenizer))
    if check_reasoning_effort(tokenizer, reasoning_effort) is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    try:
        return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kwargs)
    except TemplateError as e:  # a template's own refusal (`raise_exception("roles must alternate")`) or failure
        raise PromptError(f"the model's chat template refused the messages: {e}") from None


def checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`messages` as chat templates and `tools.render_messages` take them: a non-empty list of dicts, each with a
    role (a non-empty str), text content (a str or None), OpenAI's or LangChain's tool calls (each naming its
    function), and only valid Unicode text in any field; else a PromptError naming the message and the field (a
    template would fail on it with an error naming neither, or write `5` or `None` into the prompt)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise PromptError(f"messages must be a list of role/content dicts, got {type(messages).__name__}")
    if not messages:
        raise PromptError("messages is empty: a chat request needs at least one message")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise PromptError(f"{where} must be a role/content dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise PromptError(f"{where}.role must be a non-empty str, got {m.get('role')!r:.40}")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise PromptError(f"{where}.content must be a str or None, got {type(m['content']).__name__}")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, (list, tuple)):
            raise PromptError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise PromptError(f"{where}.tool_calls[{j}] must be a dict naming its function "
                                  f'({{"function": {{"name": ..., "arguments": ...}}}}), got {call!r:.60}')
            arguments = function.get("arguments", function.get("args", {}))
            if not isinstance(arguments, (Mapping, str)):
                raise PromptError(f"{where}.tool_calls[{j}]'s arguments must be a dict or JSON text, got "
                                  f"{type(arguments).__name__}")
        check_texts(m, where)
    return list(messages)


def check_reasoning_effort(tokenizer, effort: str | None) -> str | None:
    """`effort` (OpenAI's `reasoning_effort`) when the model's chat template reads a `reasoning_effort` variable
    (gpt-oss's, and templates written for it); an OptionError otherwise: nothing else would act on it."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise OptionError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(t for t in template.values() if isinstance(t, str))
    if "reasoning_effort" not in template:
        raise OptionError("reasoning_effort: this model's chat template does not read it, so it would change "
                          "nothing; leave it out (a template that reads `reasoning_effort` gets it as sent)")
    return effort


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
    json_reply: bool = False  # a response_format constrains the reply to JSON

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
                 chunk_texts: Sequence[str] = (), discovered: bool = True,
                 reasoning_effort: str | None = None) -> ChatRequest:
    """A chat request as the engine runs it. `tool_choice` "required" (LangChain's "any") or a tool's name
    constrains the reply to a valid call (`parallel_tool_calls`: one or more); a `response_format` constrains it
    to JSON; both at once is refused (a forced call is already JSON). A reply after a generation prompt that opened
    the thinking block starts inside it, unless a forced call or a response format makes the whole reply that.
    `reasoning_effort` goes to a chat template that reads it (else an OptionError)."""
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
    text = render_chat(engine.tokenizer, messages, specs, reasoning_effort)
    prompt = completion_prompt(engine, text, chunk_texts, discovered, options.cache_salt)
    markers = ThinkingMarkers.detect(engine.tokenizer)
    inside = grammar is None and markers.starts_inside(text)
    return ChatRequest(prompt, options, fmt, specs, choice, markers, inside, json_reply=wanted is not None)


def completion_prompt(engine, prompt_text: str, chunk_texts: Sequence[str] = (),
                      discovered: bool = True, cache_salt: str | None = None) -> list[Text | Chunk]:
    """A plain prompt string as segments (no chat template): `Engine.split`."""
    return engine.split(prompt_text, chunk_texts=chunk_texts, discovered=discovered, cache_salt=cache_salt)


def register(engine, texts, public: bool = False) -> int:
    """Register document texts as chunks of `engine`'s prompts; return how many were new. `public=True`: shared
    by every cache namespace (`Engine.register`): only for documents any user may know are in use."""
    return engine.register(texts, public=public)


def stream_generation(engine, prompt: Sequence[Text | Chunk], options: GenerationOptions) -> Iterator[Any]:
    """The text pieces of one request (`str`; a `decode.Piece` with logprobs or for a choice but the first), then the
    engine's `Generation` as the last item."""
    return engine.stream_generation(
        prompt, mode=options.mode, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
        top_p=options.top_p, stop=list(options.stop) or None, seed=options.seed,
        recompute_ratio=options.recompute_ratio, cache_salt=options.cache_salt, grammar=options.grammar,
        n=options.n, logprobs=options.logprobs, presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty, logit_bias=dict(options.logit_bias) or None,
        align=options.align,
    )


def usage(generation) -> dict[str, int]:
    """Token counts of a finished request: `cached_tokens`, prompt tokens whose KV came from the store (reused);
    `cache_creation_tokens`, prompt tokens whose KV this request newly stored (chunks it encoded, new prefix
    blocks). `prompt_tokens` counts all prompt tokens, reused ones included (as ChatAnthropic's input_tokens);
    `completion_tokens` every choice's tokens."""
    return {
        "prompt_tokens": int(generation.prompt_tokens),
        "completion_tokens": sum(len(c.token_ids) for c in generation.choices),
        "cached_tokens": int(generation.cached_tokens),
        "cache_creation_tokens": int(getattr(generation, "stored_tokens", 0)),
    }


def openai_logprobs(logprobs) -> list[dict[str, Any]]:
    """TokenLogprob entries (pc_rag.decode) as OpenAI's chat `logprobs.content` writes them: token, logprob, bytes,
    top_logprobs. A log-probability of -inf (a token no step allowed) is written -9999.0, as OpenAI does."""

    def one(e) -> dict[str, Any]:
        return {"token": e.token, "logprob": max(e.logprob, -9999.0), "bytes": list(e.token_bytes)}

    return [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in logprobs or ()]


class Reasoning(Piece):
    """A piece of a chat reply's reasoning (the text between the thinking markers); the answer's pieces are `str`
    (or `Piece`). Test for it first: it is a `str` too."""


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """A finished chat reply: its text (calls and thinking taken out), its tool calls (a `CutCall` for one the token
    budget ended before it was complete), the engine's `Generation`, and its reasoning (the text between the
    thinking markers; "" when there was none). `choice`: which of the request's replies this is; the first holds
    the others in `others` (n > 1). `cut`: the token budget ended the reply inside the structure the request asked
    for (a tool call, or a response_format's JSON). `error`: why its grammar could not be completed (finish reason
    "error"; a call it ended inside is a `CutCall`, as a cut one)."""

    content: str
    tool_calls: list[ToolCall | CutCall]
    generation: Any
    reasoning: str = ""
    choice: int = 0
    cut: bool = False
    others: tuple[ChatReply, ...] = ()

    @property
    def error(self) -> str | None:
        """Why the reply's grammar could not be completed (`Generation.error`); None when it was, or there was none."""
        return self.generation.choices[self.choice].error

    @property
    def finish_reason(self) -> str:
        """"error" when the reply's grammar could not be completed, "length" when the budget cut a call (OpenAI's,
        with the partial call in tool_calls), "tool_calls" when the reply made calls, else the engine's ("stop" or
        "length")."""
        if self.error is not None:
            return "error"
        if any(isinstance(c, CutCall) for c in self.tool_calls):
            return "length"
        return "tool_calls" if self.tool_calls else self.generation.choices[self.choice].finish_reason

    @property
    def choices(self) -> tuple[ChatReply, ...]:
        return (self, *self.others)

    @property
    def logprobs(self):
        """This reply's TokenLogprob entries (None when not asked)."""
        return self.generation.choices[self.choice].logprobs

    def check_complete(self, budget: int | None = None) -> None:
        """Raise `ReplyCutError` when the token budget cut the reply's call or JSON, `GrammarError` when its grammar
        could not be completed (the adapters whose frameworks have no place for a partial call raise them)."""
        if self.error is not None:
            raise GrammarError(f"the reply is incomplete: {self.error}")
        if not self.cut:
            return
        what = "tool call" if any(isinstance(c, CutCall) for c in self.tool_calls) else "JSON reply"
        limit = f"max_new_tokens={budget}" if budget is not None else "max_new_tokens"
        raise ReplyCutError(f"the reply was cut by the token budget ({limit}; OpenAI's max_tokens) before its {what} "
                            f"was complete: raise max_tokens / max_new_tokens")


class _ChoiceReader:
    """One choice's pieces as stream_chat reads them: thinking apart, calls held back, logprobs carried along."""

    def __init__(self, engine, request: ChatRequest, choice: int):
        self.choice = choice
        self.calls = request.call_filter(engine.tokenizer)
        self.thinking = request.thinking_filter()
        self.text: list[str] = []
        self.thought: list[str] = []
        self.pending: tuple = ()  # logprobs of tokens whose text is not out yet
        self.keep = request.options.logprobs is not None or choice > 0  # pieces as Piece, not plain text

    def feed(self, item: str) -> list[str]:
        self.pending += getattr(item, "logprobs", ())
        return list(self.pieces(self.thinking.feed(str(item))))

    def pieces(self, parts):
        for kind, part in parts:
            if kind != CONTENT:
                self.thought.append(part)
                yield self._out(Reasoning, part)
                continue
            piece = self.calls.feed(part) if self.calls is not None else part
            if piece:
                self.text.append(piece)
                yield self._out(Piece, piece)

    def _out(self, cls, text: str) -> str:
        if not self.keep:
            return cls(text) if cls is Reasoning else text
        out, self.pending = cls(text, self.pending, self.choice), ()
        return out


def stream_chat(engine, request: ChatRequest, heartbeat: bool = False) -> Iterator[Any]:
    """The pieces of one chat request: the answer's text (`str`; what may be a tool call is held back) and its
    reasoning (`Reasoning`, a `str` too: test for it first), then its `ChatReply`. With logprobs asked or n > 1,
    pieces are `decode.Piece`s carrying their tokens' logprobs and their `choice`. `heartbeat`: an empty piece for
    each token held back, so that a caller which stops or times out a request between pieces (the server) still can
    while a call is decoded.

    A reply the token budget cut inside its call or its JSON (`ChatReply.cut`): the calls complete before the cut,
    then the cut one as a `CutCall` (its name and arguments as far as written), and never the call's markup as
    text."""
    readers = [_ChoiceReader(engine, request, i) for i in range(request.options.n)]
    for item in stream_generation(engine, request.prompt, request.options):
        if isinstance(item, str):
            out = readers[choice_of(item)].feed(item)
            yield from out
            if not out and heartbeat:
                yield ""
            continue
        replies = []
        for reader in readers:
            yield from reader.pieces(reader.thinking.finish())
            finish = item.choices[reader.choice].finish_reason
            budget_ended = finish == "length"
            found: list[ToolCall | CutCall] = []
            if reader.calls is not None:  # a call a failed grammar ended inside is cut too: never markup as text
                rest, found = reader.calls.finish(cut=finish in ("length", "error"))
                if rest:
                    reader.text.append(rest)
                    yield reader._out(Piece, rest)
            content = "".join(reader.text)
            cut = budget_ended and (any(isinstance(c, CutCall) for c in found) or (
                request.json_reply and not _is_json(content)))
            replies.append(ChatReply(content, found, item, "".join(reader.thought), reader.choice, cut))
        yield dataclasses.replace(replies[0], others=tuple(replies[1:]))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
