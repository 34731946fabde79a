"""PromptCacheLLM: the completion-style (legacy `LLM`) face of the same engine; no chat template."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import LLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from pc_rag.adapters import completion_prompt, stream_generation, usage

from ._engine import EngineFields


class PromptCacheLLM(EngineFields, LLM):
    """Completion model: the prompt string is split at registered documents and continued as it is."""

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_name, "mode": self.mode, "temperature": self.temperature}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        options = self._options(stop, kwargs)
        return LangSmithParams(
            ls_provider="pc_rag",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type="llm",
            ls_temperature=options.temperature,
            ls_max_tokens=options.max_new_tokens,
            ls_stop=list(options.stop) if options.stop else None,
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine = self._engine()
        segments = completion_prompt(engine, prompt)
        for item in stream_generation(engine, segments, self._options(stop, kwargs)):
            if isinstance(item, str):
                # BaseLLM.stream does not report tokens for us (unlike BaseChatModel).
                if run_manager:
                    run_manager.on_llm_new_token(item)
                yield GenerationChunk(text=item)
            else:
                generation = item
                yield GenerationChunk(
                    text="",
                    generation_info={
                        "finish_reason": generation.finish_reason,
                        "usage": usage(generation),
                        "model_name": self.model_name,
                    },
                )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            full = GenerationChunk(text="")
            for chunk in self._stream(prompt, stop, run_manager, **kwargs):
                full += chunk
            generations.append([Generation(text=full.text, generation_info=full.generation_info)])
        return LLMResult(generations=generations)

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text
