"""PromptCacheLLM: a LlamaIndex LLM answered by a local pc_rag Engine that reuses the KV of retrieved nodes.

One path: prompt string (completions) or chat messages rendered with the model's own chat template ->
`ChunkIndex.split` (registered node texts become `Chunk`s) -> `Engine.stream_generation`. The non-streaming
calls collect the stream. `raw["usage"]` holds `prompt_tokens`, `completion_tokens`, `cached_tokens`;
`raw["ttft_s"]` is the time to first token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from pc_rag.adapters import (
    SamplingOptions,
    chat_prompt,
    completion_prompt,
    shared_engine,
    stream_generation,
    usage,
)


def _message_dict(message: ChatMessage) -> dict[str, str]:
    other = [type(b).__name__ for b in message.blocks if not isinstance(b, TextBlock)]
    if other:
        raise ValueError(f"PromptCacheLLM takes text only; the message has {other} blocks")
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    return {"role": role, "content": message.content or ""}


class PromptCacheLLM(CustomLLM):
    """Local Llama through pc_rag; documents registered with its engine are reused wherever they appear.

    Register retrieved nodes with `PromptCacheNodeRegistrar(llm=...)` and answer with
    `PromptCacheSynthesizer(llm=...)` (or `prompt_cache_query_engine(index, llm)`, which sets up both).
    """

    model: str | None = Field(default=None, description="Path of a local HF Llama checkpoint; loaded lazily.")
    engine: Any = Field(default=None, exclude=True, description="An existing pc_rag.Engine.")
    dtype: str = Field(default="float32", description="Weights dtype when loading `model`.")
    device: str = Field(default="cpu", description="Device when loading `model`.")
    mode: str = Field(default="modular", description="'modular' reuses chunk KV, 'exact' prefixes.")
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[str] | None = Field(default=None, description="Strings that end generation (not returned).")
    seed: int | None = Field(default=None, description="Sampling seed.")
    context_window: int = Field(
        default=DEFAULT_CONTEXT_WINDOW,
        description="The model's context in tokens, for LlamaIndex's prompt sizing (not read from the model, "
        "so that building this object loads nothing).",
    )

    _loaded: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,  # query engines then go through chat(), i.e. the model's chat template
            model_name=self.model or "pc-rag",
        )

    def get_engine(self):
        """The pc_rag Engine answering this LLM (loaded on first use and shared per checkpoint)."""
        if self.engine is not None:
            return self.engine
        if self._loaded is None:
            if not self.model:
                raise ValueError("pass model=<path of a local HF Llama checkpoint> or engine=<pc_rag.Engine>")
            self._loaded = shared_engine(self.model, self.dtype, self.device)
        return self._loaded

    def _options(self, kwargs: dict[str, Any]) -> SamplingOptions:
        stop = kwargs.get("stop", self.stop)
        return SamplingOptions(
            mode=kwargs.get("mode", self.mode),
            max_new_tokens=int(kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            stop=tuple(stop) if stop else None,
            seed=kwargs.get("seed", self.seed),
        )

    def _pieces(self, segments, kwargs) -> Iterator[tuple[str, str, dict | None]]:
        """(delta, text so far, None) per piece, then ("", full text, raw) with usage once done."""
        text = ""
        for item in stream_generation(self.get_engine(), segments, self._options(kwargs)):
            if isinstance(item, str):
                text += item
                yield item, text, None
            else:
                raw = {"usage": usage(item), "finish_reason": item.finish_reason, "mode": item.mode,
                       "ttft_s": item.ttft_s}
                yield "", text, raw

    # ---- completions: the prompt string as it is -------------------------------------------------------
    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        segments = completion_prompt(self.get_engine(), prompt)

        def gen() -> CompletionResponseGen:
            for delta, text, raw in self._pieces(segments, kwargs):
                yield CompletionResponse(text=text, delta=delta, raw=raw or {})

        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        segments = completion_prompt(self.get_engine(), prompt)
        *_, (_, text, raw) = self._pieces(segments, kwargs)
        return CompletionResponse(text=text, raw=raw)

    # ---- chat: the model's chat template -----------------------------------------------------------------
    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        segments = chat_prompt(self.get_engine(), [_message_dict(m) for m in messages])

        def gen() -> ChatResponseGen:
            for delta, text, raw in self._pieces(segments, kwargs):
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                yield ChatResponse(message=message, delta=delta, raw=raw or {})

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        segments = chat_prompt(self.get_engine(), [_message_dict(m) for m in messages])
        *_, (_, text, raw) = self._pieces(segments, kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), raw=raw)
