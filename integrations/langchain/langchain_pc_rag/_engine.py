"""The fields and the request path that the chat model and the completion model share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, ConfigDict, Field

from pc_rag.adapters import GenerationOptions, shared_engine


class EngineFields(BaseModel):
    """Which engine answers, and the sampling defaults; per-call keyword arguments override the defaults."""

    _ls_model_type = "llm"  # what LangSmith records: "chat" for the chat model

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str | None = Field(
        default=None, description="Path of a local checkpoint: an HF folder or a GGUF file (kept quantized as in "
        "the file); loaded on the first request."
    )
    engine: Any = Field(
        default=None, exclude=True, description="An existing pc_rag.Engine (instead of `model`)."
    )
    dtype: str = Field(default="float32", description="Weights dtype when loading `model`.")
    device: str = Field(default="cpu", description="Device when loading `model`.")
    quantize: str | None = Field(
        default=None, description="'q4_k', 'q4_0' or 'q8_0': quantize a float checkpoint's matrices as `model` "
        "loads (a quarter to half of its memory; a GGUF file is already quantized). None: as the checkpoint is.")
    mode: str = Field(
        default="modular", description="pc_rag mode: 'modular' reuses chunk KV, 'full' computes every token."
    )
    max_tokens: int = Field(default=256, alias="max_new_tokens", description="Most tokens to generate.")
    temperature: float = Field(default=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass.")
    stop: list[str] | None = Field(default=None, description="Strings that end generation (not returned).")
    seed: int | None = Field(default=None, description="Sampling seed.")
    logprobs: bool | None = Field(
        default=None, description="Report each generated token's log-probability (ChatOpenAI's field): "
        "response_metadata['logprobs'] (the completion class: generation_info['logprobs']).")
    top_logprobs: int | None = Field(
        default=None, description="With logprobs: also the this many most likely tokens of each step (0 to 20).")
    presence_penalty: float | None = Field(default=None, description="OpenAI's presence penalty, -2 to 2.")
    frequency_penalty: float | None = Field(default=None, description="OpenAI's frequency penalty, -2 to 2.")
    logit_bias: dict[int, float] | None = Field(
        default=None, description="{token id: bias in -100..100} added to the logits at every step (OpenAI's).")
    cache_salt: str | None = Field(
        default=None,
        description="Cache namespace (1 to 256 characters; also a per-call keyword): requests reuse only the KV "
        "that requests with the same salt stored, and public documents. In a multi-user app, one per user keeps "
        "a user from learning another's prompts through cache hits. None: the shared namespace.",
    )
    auto_chunks: bool = Field(
        default=True,
        description="Reuse the KV of documents that any LangChain retriever in this process returned (found "
        "wherever they appear in the prompt). False: only text blocks marked with `cache_control` and "
        "documents registered with this model's engine (PromptCacheRetriever, register_documents) are chunks. "
        "PC_RAG_DISCOVERY=0 in the environment turns discovery off for the whole process.",
    )

    def _engine(self):
        if self.engine is not None:
            return self.engine
        if not self.model:
            raise ValueError("pass model=<path of a local HF Llama checkpoint> or engine=<pc_rag.Engine>")
        return shared_engine(self.model, self.dtype, self.device, self.quantize)

    @property
    def model_name(self) -> str:
        if self.model:
            return self.model
        path = getattr(getattr(self.engine, "model", None), "name_or_path", None)
        return str(path or "pc-rag")

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_name, "mode": self.mode, "temperature": self.temperature}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        options = self._options(stop, kwargs)
        return LangSmithParams(
            ls_provider="pc_rag",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type=self._ls_model_type,
            ls_temperature=options.temperature,
            ls_max_tokens=options.max_new_tokens,
            ls_stop=list(options.stop) if options.stop else None,
        )

    def _options(self, stop: Sequence[str] | None, kwargs: dict[str, Any]) -> GenerationOptions:
        """Defaults from the fields, overridden by the call's `stop` and keyword arguments."""
        stop = stop if stop is not None else kwargs.get("stop", self.stop)
        return GenerationOptions(
            mode=kwargs.get("mode", self.mode),
            max_new_tokens=int(kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens))),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            stop=tuple(stop) if stop else None,
            seed=kwargs.get("seed", self.seed),
            cache_salt=kwargs.get("cache_salt", self.cache_salt),
            logprobs=(kwargs.get("top_logprobs", self.top_logprobs) or 0)
            if kwargs.get("logprobs", self.logprobs) else None,
            presence_penalty=kwargs.get("presence_penalty", self.presence_penalty) or 0.0,
            frequency_penalty=kwargs.get("frequency_penalty", self.frequency_penalty) or 0.0,
            logit_bias=kwargs.get("logit_bias", self.logit_bias),
        )
