"""What the LangChain and LlamaIndex adapters share; imports neither framework.

The one path every adapter request takes:
    framework messages -> role/content dicts -> the model's own chat template (`render_chat`) -> one string
    -> `Engine.split` (registered, discovered and marked documents become `Chunk`s; earlier replies keep their
    generated tokens) -> `stream_generation` -> text pieces, then the engine's `Generation` (token counts,
    `cached_tokens`, `stored_tokens`) -> `usage`.
Completion-style calls skip the chat template and split the prompt string as it is. Nothing needs wiring: the
automatic prefix reuse works on any prompt, and the framework hooks (`discover`) register retrieved documents.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .errors import PCRagError
from .options import GenerationOptions
from .segments import Chunk, Text
from .text_index import discover, discovery_enabled, index_for

__all__ = ["GenerationOptions", "SamplingOptions", "chat_prompt", "completion_prompt", "discover",
           "discovery_enabled", "register", "render_chat", "shared_engine", "stream_generation", "usage"]

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


def render_chat(tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """Messages as the model's chat template writes them, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise PCRagError(
            "the model's tokenizer has no chat template; use the completion-style class (PromptCacheLLM) "
            "or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def chat_prompt(engine, messages: Sequence[Mapping[str, str]], chunk_texts: Sequence[str] = (),
                discovered: bool = True) -> list[Text | Chunk]:
    """Chat messages as prompt segments: registered and discovered documents (unless `discovered=False`) and
    `chunk_texts` (content marked with `cache_control`) inside any message become `Chunk`s."""
    return completion_prompt(engine, render_chat(engine.tokenizer, messages), chunk_texts, discovered)


def completion_prompt(engine, prompt_text: str, chunk_texts: Sequence[str] = (),
                      discovered: bool = True) -> list[Text | Chunk]:
    """A plain prompt string as segments (no chat template)."""
    split = getattr(engine, "split", None)
    if split is not None:
        return split(prompt_text, chunk_texts=chunk_texts, discovered=discovered)
    index_for(engine).add_many(chunk_texts)  # an engine stand-in without Engine.split (tests)
    return index_for(engine).split(prompt_text)


def register(engine, texts) -> int:
    """Register document texts as chunks of `engine`'s prompts; return how many were new."""
    return index_for(engine).add_many(texts)


# The earlier name of the options the adapters build: the engine's own checked GenerationOptions (one definition;
# the adapters use that name now).
SamplingOptions = GenerationOptions


def stream_generation(engine, prompt: Sequence[Text | Chunk], options: GenerationOptions) -> Iterator[Any]:
    """The text pieces of one request (`str`), then the engine's `Generation` as the last item."""
    return engine.stream_generation(
        prompt, mode=options.mode, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
        top_p=options.top_p, stop=list(options.stop) or None, seed=options.seed,
        recompute_ratio=options.recompute_ratio,
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
