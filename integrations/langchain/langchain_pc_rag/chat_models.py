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

Reasoning models: the text between the thinking markers (`<think>...</think>`, pc_rag.reasoning) is
`AIMessage.additional_kwargs["reasoning_content"]` (streamed chunks carry their part of it there), not content;
written back to templates that read it (an AIMessage's `reasoning_content`), dropped by those that do not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
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
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from pc_rag.adapters import ChatReply, Reasoning, chat_request, stream_chat, usage

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
        request = chat_request(
            engine, [d for d, _ in parts], self._options(stop, kwargs), tools=kwargs.get("tools"),
            tool_choice=kwargs.get("tool_choice"), response_format=kwargs.get("response_format"),
            parallel_tool_calls=bool(kwargs.get("parallel_tool_calls", False)), chunk_texts=marked,
            discovered=self.auto_chunks,
        )
        for item in stream_chat(engine, request):
            if isinstance(item, Reasoning):
                yield ChatGenerationChunk(
                    message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": str(item)}))
                continue
            if isinstance(item, str):
                yield ChatGenerationChunk(message=AIMessageChunk(content=item))
                continue
            reply: ChatReply = item
            generation = reply.generation
            calls = [
                tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id, index=i)
                for i, c in enumerate(reply.tool_calls)
            ]
            yield ChatGenerationChunk(
                message=AIMessageChunk(
                    content="",
                    tool_call_chunks=calls,
                    usage_metadata=usage_metadata(usage(generation)),
                    response_metadata={
                        "model_name": self.model_name,
                        "finish_reason": reply.finish_reason,
                        "mode": generation.mode,
                        "ttft_s": generation.ttft_s,
                        "model_provider": "pc_rag",
                    },
                    chunk_position="last",
                ),
                generation_info={"finish_reason": reply.finish_reason},
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
                        invalid_tool_calls=message.invalid_tool_calls,
                        usage_metadata=message.usage_metadata,
                        response_metadata=message.response_metadata,
                    ),
                    generation_info=full.generation_info,
                )
            ]
        )
