"""ChatPromptCache: a LangChain chat model answered by a local pc_rag Engine that reuses document KV.

Messages are written with the model's own chat template into one string; documents found in it become
chunks whose KV is reused wherever the chain's prompt template put them: documents any retriever returned
(discovered automatically, see `discovery`), text blocks marked with `cache_control`, and documents
registered with the engine (`PromptCacheRetriever`, `register_documents`). `_generate` is `_stream`
collected, so both take the same path.

Agents: `bind_tools(tools, tool_choice=...)` renders the tools through the model's chat template (pc_rag.tools);
"any"/"required" or a tool's name constrain the reply to a valid call (a grammar), "auto" lets the model choose
and parses its calls out of the reply. `with_structured_output(schema)` constrains the reply to the schema's JSON
(method "json_schema", the default, or "json_mode"), or to a forced call ("function_calling"). A tool call in the
history (`AIMessage.tool_calls`, `ToolMessage`) is written back as the model wrote it, so the next agent step
reuses the previous step's prompt and reply.

A forced call or a JSON reply that the token budget (`max_tokens`) cut is reported as such, never as markup in
the content: `response_metadata["finish_reason"]` is "length" and the cut call is in `invalid_tool_calls` with the
reason (streamed, its `args` are a JSON string of the partial arguments: LangChain's chunk merging would otherwise
complete the partial JSON into a call); `with_structured_output` raises an OutputParserException naming
max_tokens. A reply whose grammar could not be completed (llguidance found, while decoding, a dead end or one of
its limits: `Generation.error`) has finish_reason "error" and `response_metadata["error"]` saying why; its partial
call is in `invalid_tool_calls` with that reason, and `with_structured_output` raises an OutputParserException
quoting it.

Reasoning models: the text between the thinking markers (`<think>...</think>`, pc_rag.reasoning) is
`AIMessage.additional_kwargs["reasoning_content"]` (streamed chunks carry their part of it there), not content;
written back to templates that read it (an AIMessage's `reasoning_content`), dropped by those that do not.
`reasoning_effort` goes to a chat template that reads it (else a ValueError).

Logprobs (`logprobs=True`, `top_logprobs=k`, as ChatOpenAI's): `response_metadata["logprobs"]["content"]`, OpenAI's
entries (token, logprob, bytes, top_logprobs); each streamed chunk carries those of its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from pc_rag.adapters import ChatReply, CutCall, Reasoning, chat_request, openai_logprobs, stream_chat, usage

from ._engine import EngineFields

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system", ToolMessage: "tool"}


def _message_dict(message: BaseMessage) -> tuple[dict[str, Any], list[str]]:
    """A LangChain message as the role/content dict a chat template takes (text content, tool calls, a tool
    result's call id), and the texts of its content blocks marked with `cache_control` (Anthropic's convention),
    which are chunks."""
    if isinstance(message, ChatMessage):
        role = message.role
    else:
        role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), None)
    if role is None:
        kind = type(message).__name__
        raise ValueError(f"ChatPromptCache cannot send a {kind}; use system, human and ai messages")
    marked: list[str] = []
    if isinstance(message.content, list):
        # tool_use blocks (Anthropic's shape of an AIMessage's calls) repeat message.tool_calls, written below
        blocks = [b for b in message.content if isinstance(b, dict) and b.get("type") != "tool_use"]
        other = [b.get("type") for b in blocks if b.get("type") != "text"]
        if other:
            raise ValueError(f"ChatPromptCache takes text only; the message has {other} content blocks")
        marked = [b["text"] for b in blocks if b.get("cache_control") and isinstance(b.get("text"), str)]
    out: dict[str, Any] = {"role": role, "content": message.text}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for c in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.additional_kwargs.get("reasoning_content") if isinstance(message, AIMessage) else None
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    return out, marked


def usage_metadata(counts: dict[str, int]) -> UsageMetadata:
    """pc_rag's token counts as LangChain reports them (as ChatAnthropic: `input_tokens` includes cached)."""
    return UsageMetadata(
        input_tokens=counts["prompt_tokens"],
        output_tokens=counts["completion_tokens"],
        total_tokens=counts["prompt_tokens"] + counts["completion_tokens"],
        input_token_details={
            "cache_read": counts["cached_tokens"],  # prompt tokens whose KV was reused
            "cache_creation": counts["cache_creation_tokens"],  # prompt tokens whose KV this request stored
        },
    )


class ChatPromptCache(EngineFields, BaseChatModel):
    """Chat model on a local Llama through pc_rag, reusing the KV of registered documents.

    ```python
    llm = ChatPromptCache(model="/models/llama-3.2-1b-instruct", max_tokens=128)
    retriever = PromptCacheRetriever(retriever=vectorstore.as_retriever(), llm=llm)
    ```
    Documents returned by any retriever in the process are found in the prompt with no wrapper
    (`auto_chunks=False` to ignore them). Usage: `usage_metadata["input_token_details"]` has `cache_read`
    (prompt tokens whose KV was reused) and `cache_creation` (prompt tokens whose KV this request stored).
    Tools: `bind_tools`; structured output: `with_structured_output` (constrained decoding: llguidance, a
    dependency of pc-rag).
    """

    reasoning_effort: str | None = None
    """OpenAI's `reasoning_effort`, for a chat template that reads it (gpt-oss's); refused by one that does not."""

    @property
    def _llm_type(self) -> str:
        return "pc-rag-chat"

    _ls_model_type = "chat"

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """Tools for every call of the returned runnable. `tool_choice`: "auto" (the default: the model decides;
        its calls are parsed from the reply), "none", "any"/"required" (one call of any tool, always valid), or a
        tool's name; `parallel_tool_calls=True` lets a forced reply hold several calls."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """A runnable whose output is `schema`'s value (a pydantic instance for a pydantic class, else a dict).
        method "json_schema" (default): the reply is constrained to the schema's JSON; "json_mode": to any JSON
        object (ask for the fields in the prompt); "function_calling": to one call of a tool made of the schema."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **traced)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = convert_to_json_schema(schema)
                name = json_schema.get("title", "output")
                response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema}}
            else:
                response_format = {"type": "json_object"}
            llm = self.bind(response_format=response_format, **traced)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be json_schema, json_mode or function_calling, got {method!r}")
        parser = RunnableLambda(_not_cut) | parser  # a reply cut by max_tokens: an error that says so
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([none], exception_key="parsing_error")

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel.stream reports each chunk to run_manager itself; reporting here would double it.
        engine = self._engine()
        parts = [_message_dict(m) for m in messages]
        marked = [text for _, texts in parts for text in texts]
        options = self._options(stop, kwargs)
        request = chat_request(
            engine, [d for d, _ in parts], options, tools=kwargs.get("tools"),
            tool_choice=kwargs.get("tool_choice"), response_format=kwargs.get("response_format"),
            parallel_tool_calls=bool(kwargs.get("parallel_tool_calls", False)), chunk_texts=marked,
            discovered=self.auto_chunks, reasoning_effort=kwargs.get("reasoning_effort", self.reasoning_effort),
        )
        logprobs = options.logprobs is not None
        sent = 0  # tokens whose logprobs a chunk carried
        for item in stream_chat(engine, request):
            if isinstance(item, str):
                entries = getattr(item, "logprobs", ())
                sent += len(entries)
                meta = {"logprobs": {"content": openai_logprobs(entries)}} if logprobs and entries else {}
                if isinstance(item, Reasoning):
                    message = AIMessageChunk(content="", additional_kwargs={"reasoning_content": str(item)},
                                             response_metadata=meta)
                else:
                    message = AIMessageChunk(content=str(item), response_metadata=meta)
                yield ChatGenerationChunk(message=message)
                continue
            reply: ChatReply = item
            generation = reply.generation
            calls, invalid = [], []
            for i, c in enumerate(reply.tool_calls):
                # A cut call's arguments are partial JSON text, sent as a JSON string: LangChain's merging of
                # streamed chunks completes partial JSON into a call, a string it keeps as an invalid one.
                # `_generate` gives them as written, with why the call is invalid.
                calls.append(tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id,
                                             index=i))
                if isinstance(c, CutCall):
                    invalid.append(invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=reply.error or (
                        f"cut by the token budget (max_tokens={options.max_new_tokens}) before the call was "
                        f"complete: raise max_tokens")))
            metadata = {
                "model_name": self.model_name,
                "finish_reason": reply.finish_reason,
                "mode": generation.mode,
                "ttft_s": generation.ttft_s,
                "model_provider": "pc_rag",
            }
            if reply.error is not None:
                metadata["error"] = reply.error
            rest = tuple(reply.logprobs or ())[sent:]
            if logprobs:
                metadata["logprobs"] = {"content": openai_logprobs(rest)}
            info: dict[str, Any] = {"finish_reason": reply.finish_reason}
            if invalid:
                info["invalid_tool_calls"] = invalid
            yield ChatGenerationChunk(
                message=AIMessageChunk(
                    content="",
                    tool_call_chunks=calls,
                    usage_metadata=usage_metadata(usage(generation)),
                    response_metadata=metadata,
                    chunk_position="last",
                ),
                generation_info=info,
            )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        full: ChatGenerationChunk | None = None
        for chunk in self._stream(messages, stop, run_manager, **kwargs):
            full = chunk if full is None else full + chunk
        message = full.message
        return ChatResult(
            generations=[
                ChatGeneration(
                    message=AIMessage(
                        content=message.content,
                        additional_kwargs=message.additional_kwargs,
                        tool_calls=message.tool_calls,
                        # a cut call as written, with why it is invalid (the merged chunks hold it as a string)
                        invalid_tool_calls=(full.generation_info or {}).get("invalid_tool_calls",
                                                                            message.invalid_tool_calls),
                        usage_metadata=message.usage_metadata,
                        response_metadata=message.response_metadata,
                    ),
                    generation_info={k: v for k, v in (full.generation_info or {}).items()
                                     if k != "invalid_tool_calls"},
                )
            ]
        )


def _not_cut(message: BaseMessage) -> BaseMessage:
    """with_structured_output's reply, unless the token budget cut it (a forced call in invalid_tool_calls, or
    JSON that does not parse, with finish_reason "length"): then an OutputParserException naming max_tokens, as
    ChatOpenAI's structured output raises LengthFinishReasonError; or its grammar could not be completed
    (finish_reason "error"): then one quoting why."""
    metadata = getattr(message, "response_metadata", {}) or {}
    if metadata.get("finish_reason") == "error":
        raise OutputParserException(f"the structured output is incomplete: {metadata.get('error')}",
                                    llm_output=message.text)
    if metadata.get("finish_reason") != "length":
        return message
    cut = bool(getattr(message, "invalid_tool_calls", None))
    if not cut and not getattr(message, "tool_calls", None):
        try:
            json.loads(message.text)
        except ValueError:
            cut = True
    if cut:
        raise OutputParserException(
            "the reply was cut by the token budget (max_tokens) before its structured output was complete: raise "
            "max_tokens", llm_output=message.text)
    return message
