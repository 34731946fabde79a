"""PromptCacheLLM: the completion-style (legacy `LLM`) face of the same engine; no chat template."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from pc_rag.adapters import completion_prompt, stream_generation, usage

from ._engine import EngineFields


def token_usage(usages: list[dict[str, int]]) -> dict:
    """Usage summed over a call's prompts, in the shape OpenAI-style consumers read from
    `LLMResult.llm_output["token_usage"]` (langchain-community's OpenAI callback, LangSmith), plus
    pc_rag's `cache_creation_tokens` (prompt tokens whose KV the requests stored)."""
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                    "cache_creation_tokens")}
    return {
        "prompt_tokens": total["prompt_tokens"],
        "completion_tokens": total["completion_tokens"],
        "total_tokens": total["prompt_tokens"] + total["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": total["cached_tokens"]},
        "cache_creation_tokens": total["cache_creation_tokens"],
    }


def legacy_logprobs(entries) -> dict[str, Any]:
    """TokenLogprob entries in OpenAI's completions shape (what langchain-openai's OpenAI class puts in
    `generation_info["logprobs"]`): tokens, token_logprobs, top_logprobs (the chosen token among them) and
    text_offset."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in (*e.top, e)} for e in entries], "text_offset": offsets}


class PromptCacheLLM(EngineFields, LLM):
    """Completion model: the prompt string is split at documents (discovered or registered) and continued as
    it is. `generation_info["usage"]` holds each prompt's counts; `llm_output["token_usage"]` their sum;
    `generation_info["logprobs"]` (with `logprobs=True`) OpenAI's completions logprobs."""

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

    def with_structured_output(self, schema: Any, **kwargs: Any):
        raise NotImplementedError(
            "PromptCacheLLM does not support structured output (with_structured_output): it is a completion model. "
            "Use ChatPromptCache.with_structured_output, which constrains the reply to the schema's JSON."
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine = self._engine()
        options = self._options(stop, kwargs)
        segments = completion_prompt(engine, prompt, discovered=self.auto_chunks, cache_salt=options.cache_salt)
        for item in stream_generation(engine, segments, options):
            if isinstance(item, str):
                # BaseLLM.stream does not report tokens for us (unlike BaseChatModel).
                if run_manager:
                    run_manager.on_llm_new_token(item)
                yield GenerationChunk(text=item)
            else:
                generation = item
                info = {"finish_reason": generation.finish_reason, "usage": usage(generation),
                        "model_name": self.model_name}
                if generation.logprobs is not None:
                    info["logprobs"] = legacy_logprobs(generation.logprobs)
                yield GenerationChunk(text="", generation_info=info)

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
        usages = [g[0].generation_info["usage"] for g in generations]
        return LLMResult(
            generations=generations, llm_output={"token_usage": token_usage(usages), "model_name": self.model_name}
        )

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text
