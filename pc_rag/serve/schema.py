"""The OpenAI request and response shapes `pc-rag serve` speaks (pydantic), and what it adds to them.

Requests: every field of OpenAI's chat completions and completions requests is declared here, and each either
works, or is refused with a 400 naming it (`refused()`) when pc_rag does not do what it asks; the few that by
their definition change nothing in the reply (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`, ...)
are taken as they are. A field that is neither OpenAI's nor one of the extensions below is refused too: ignoring
it would give the client something it did not ask for (docs/serve.md, "Every request field"). An assistant
message's `reasoning_content` goes to the chat template, which may write it back or drop it; tools, tool_choice,
parallel_tool_calls, response_format, tool messages and assistant tool_calls: pc_rag.tools.

Extensions (the `openai` client sends them with `extra_body={...}`):
- `mode`: "modular" (default), "exact", "blend" or "full" (see the README's "Modes").
- `recompute_ratio`: blend's share of reused chunk tokens recomputed.
- `align`: null, or "ape" (modular and blend): APE's temperature and scale on the attention over reused chunks
  (pc_rag/align.py; the engine's pair).
- `chunks`: texts to treat as chunks wherever they appear in this request's prompt (the completions
  counterpart of chat content parts marked with `cache_control`).
- `cache_salt` (vLLM's name): narrows the request's cache namespace within its tenant's (a string of 1 to 256
  characters): requests reuse only KV that requests of the same tenant with the same salt stored, and public
  documents. It never widens it: the namespace is derived from the tenant and the salt together.
Every text that reaches the tokenizer (prompt, message content, parts, chunks, stop strings) must be valid
Unicode: a lone surrogate (`"\\ud800"` in the JSON) is a 400 naming the field, not a tokenizer error.
Responses: a reasoning model's thinking as `message.reasoning_content` (streamed: `delta.reasoning_content`), as
vLLM and Ollama send it (pc_rag.reasoning); `usage.prompt_tokens_details.cached_tokens` as OpenAI reports prompt
caching (ChatOpenAI maps it to `cache_read`) and `cache_write_tokens` (ChatOpenAI: `cache_creation`), plus
`usage.pc_rag` with the engine's own counts and the time to first token.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..options import DEFAULT_RECOMPUTE_RATIO, MODES
from ..segments import unicode_problem

MAX_CACHE_SALT_CHARS = 256
EXTENSIONS = ("mode", "recompute_ratio", "align", "chunks", "cache_salt")
# vLLM's and SGLang's own request fields, at the values that ask for what pc_rag does anyway (SGLang's router adds
# the first seven to every request it forwards, at these values): taken at them, refused at any other.
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (False,), "ignore_eos": (False,), "no_stop_trim": (False,),
    "return_hidden_states": (False,), "separate_reasoning": (True,), "stream_reasoning": (True,),
    "skip_special_tokens": (True,), "echo": (False,), "add_generation_prompt": (True,),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,), "top_k": (-1, 0),
    "min_p": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "use_beam_search": (False,),
}


def _unicode_text(text: str) -> str:
    """`text` if a tokenizer can take it (segments.check_text); JSON's escapes can carry a lone surrogate, which the
    tokenizer refuses with a TypeError (a 500) deep inside a request. A ValueError: pydantic names the field."""
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"holds {problem}, which is not valid Unicode text")
    return text


# Every text that reaches the chat template or the tokenizer.
PromptText = Annotated[str, AfterValidator(_unicode_text)]


class _Request(BaseModel):
    # Fields beyond the declared ones are kept (model_extra) to be refused by name, not dropped unseen.
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, description="Echoed; the server answers with the one model it serves.")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, description="0 = greedy (default 1, as OpenAI's).")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: PromptText | list[PromptText] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: nothing to do with the reply
    # pc_rag extensions
    mode: str = "modular"
    recompute_ratio: float = Field(default=DEFAULT_RECOMPUTE_RATIO, ge=0.0, le=1.0)
    align: Literal["ape"] | None = None
    chunks: list[PromptText] = Field(default_factory=list)
    cache_salt: PromptText | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                          description="Narrows the cache namespace within the tenant's.")

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        return mode

    def refused(self) -> list[str]:
        """Fields set to something pc_rag does not do (each: the field, what was asked and why it is refused)."""
        out = []
        for name, value in sorted((self.model_extra or {}).items()):
            if name in NEUTRAL_FIELDS:
                if value is not None and value not in NEUTRAL_FIELDS[name]:
                    taken = " or ".join(repr(v) for v in NEUTRAL_FIELDS[name])
                    out.append(f"{name}={value!r}: not done by pc_rag (taken only as {taken}, what it does anyway)")
                continue
            out.append(f"{name}: not a field of OpenAI's API that pc-rag serve knows, nor one of its extensions "
                       f"({', '.join(EXTENSIONS)})")
        for key in sorted(set(self.stream_options or {}) - {"include_usage", "include_obfuscation"}):
            out.append(f"stream_options.{key}: not an option pc-rag serve knows (include_usage)")
        if (self.stream_options or {}).get("include_obfuscation"):
            out.append("stream_options.include_obfuscation: pc-rag serve does not pad streamed events; send false "
                       "or leave it out")
        return out

    @property
    def choices_decoded(self) -> int:
        """How many replies the engine decodes (n, or completions' best_of)."""
        return self.n or 1

    @property
    def logprobs_asked(self) -> int | None:
        """The engine's `logprobs` (k most likely per token; None: none)."""
        return None

    def prompt_texts(self) -> list[str]:
        """Every text of the request that is tokenized or searched (for the bounds on parts and characters,
        checked before any of it is)."""
        return [*self.chunks, *(self.stop_list or [])]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: PromptText | None = None
    cache_control: dict[str, Any] | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: PromptText
    arguments: PromptText | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history, as the client got it from us (or from another model)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: PromptText | list[ContentPart] | None = None
    name: PromptText | None = None  # given to the chat template (templates that read it write it)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: PromptText | None = None  # an assistant's thinking, for templates that write it back
    audio: dict[str, Any] | None = None  # an earlier audio reply's id: refused
    function_call: Any = None  # the legacy function calling: refused


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # what newer clients send for max_tokens
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: str | None = None  # given to chat templates that read it (adapters.check_reasoning_effort)
    # Refused when set to what pc_rag does not do (see `refused`).
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    verbosity: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Taken and left as they are: by OpenAI's definition they do not change the reply.
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def refused(self) -> list[str]:
        out = super().refused()
        if self.functions or self.function_call not in (None, "none"):
            out.append("functions/function_call: the legacy function calling (send tools and tool_choice)")
        if self.top_logprobs and not self.logprobs:
            out.append("top_logprobs: needs logprobs: true")
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            field = "audio" if self.audio is not None else "modalities"
            out.append(f"{field}: pc_rag replies in text only (modalities [\"text\"])")
        if self.prediction is not None:
            out.append("prediction: no predicted outputs (leave it out; the reply is the same without it)")
        if self.web_search_options is not None:
            out.append("web_search_options: pc_rag does not search the web")
        if self.moderation is not None:
            out.append("moderation: pc_rag runs no moderation model on the request or the reply")
        if self.verbosity not in (None, "medium"):
            out.append(f"verbosity={self.verbosity!r}: not done (only the model's own, medium)")
        if self.store:
            out.append("store: pc-rag serve keeps no completions to list or retrieve later (send false)")
        if self.service_tier not in (None, "auto", "default"):
            out.append(f"service_tier={self.service_tier!r}: one tier here (auto or default)")
        for i, m in enumerate(self.messages):
            if m.role == "function" or m.function_call is not None:
                out.append(f"messages[{i}]: the legacy function calling (send role tool and tool_calls)")
            if m.audio is not None:
                out.append(f"messages[{i}].audio: no audio")
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text" or part.text is None:
                    out.append(f"messages[{i}].content[{j}]: type {part.type!r} (text parts only)")
        return out

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_texts(self) -> list[str]:
        texts = super().prompt_texts()
        for m in self.messages:
            if isinstance(m.content, list):
                texts += [p.text or "" for p in m.content]
            else:
                texts.append(m.content or "")
            if m.reasoning_content:
                texts.append(m.reasoning_content)
        return texts

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: PromptText | list[PromptText]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def refused(self) -> list[str]:
        out = super().refused()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            out.append(f"prompt: one prompt string per request (got a list of {len(self.prompt)})")
        if self.echo and self.logprobs is not None:
            out.append("echo with logprobs: the prompt's tokens have no logprobs here (their KV comes from the "
                       "cache, not from a forward that scores them)")
        if self.suffix:
            out.append("suffix: no fill-in-the-middle")
        if self.best_of is not None and self.best_of < (self.n or 1):
            out.append(f"best_of={self.best_of}: must be at least n ({self.n})")
        if self.best_of not in (None, self.n or 1) and self.stream:
            out.append("best_of: not with stream (the best replies are known only once all are done)")
        return out

    @property
    def choices_decoded(self) -> int:
        return max(self.best_of or 1, self.n or 1)

    @property
    def logprobs_asked(self) -> int | None:
        # best_of ranks the replies by their tokens' log-probabilities: recorded even when not asked for.
        if self.logprobs is None and self.choices_decoded > (self.n or 1):
            return 0
        return self.logprobs

    def prompt_texts(self) -> list[str]:
        return [*super().prompt_texts(), *([self.prompt] if isinstance(self.prompt, str) else self.prompt)]

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def limit(self) -> int | None:
        return self.max_tokens


def chat_messages(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as role/content dicts for the chat template (with their tool calls and the call a tool
    message answers), and the text parts marked with `cache_control` (chunks, as in the drop-in classes). Text
    parts are joined with nothing between them, as the LangChain and LlamaIndex classes join a message's text
    blocks."""
    messages, marked = [], []
    for m in request.messages:
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system role
        if isinstance(m.content, list):
            texts = [p.text or "" for p in m.content]
            marked += [p.text for p in m.content if p.cache_control and p.text]
            content = "".join(texts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        messages.append(message)
    return messages, marked


def usage(generation) -> dict[str, Any]:
    """OpenAI's usage object for a finished request, with pc_rag's counts under `pc_rag`."""
    completion = generation.completion_tokens  # every choice's (n, best_of), as OpenAI counts them
    return {
        "prompt_tokens": generation.prompt_tokens,  # cached ones included, as OpenAI counts them
        "completion_tokens": completion,
        "total_tokens": generation.prompt_tokens + completion,
        # cached_tokens as OpenAI reports prompt caching (ChatOpenAI: cache_read); cache_write_tokens, OpenAI's
        # newer field for tokens written to the cache (ChatOpenAI: cache_creation), the prompt tokens whose KV
        # this request stored.
        "prompt_tokens_details": {"cached_tokens": generation.cached_tokens,
                                  "cache_write_tokens": generation.stored_tokens},
        "pc_rag": {
            "mode": generation.mode,
            "cached_tokens": generation.cached_tokens,  # prompt tokens whose KV came from the store
            "computed_tokens": generation.computed_tokens,
            "cache_creation_tokens": generation.stored_tokens,  # prompt tokens whose KV this request stored
            "recomputed_tokens": generation.recomputed_tokens,  # blend only
            "ttft_s": round(generation.ttft_s, 6),
        },
    }


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: what the openai client turns into BadRequestError & co with this message."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
