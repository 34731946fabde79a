"""PromptCacheLLM: the completion-style (legacy `LLM`) face of the same engine; no chat template."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from pc_rag.adapters import completion_prompt, stream_generation, usage

from ._engine import EngineFields


class PromptCacheLLM(EngineFields, LLM):
    """Completion model: the prompt string is split at registered documents and continued as it is."""

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

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
