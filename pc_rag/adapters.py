"""What the LangChain and LlamaIndex adapters share; imports neither framework.

The one path every adapter request takes:
    framework messages -> role/content dicts -> the model's own chat template (`render_chat`) -> one string
    -> `ChunkIndex.split` (registered documents become `Chunk`s) -> `stream_generation` -> text pieces, then
    the engine's `Generation` (token counts, `cached_tokens`) -> `usage`.
Completion-style calls skip the chat template and split the prompt string as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import PCRagError
from .find import index_for
from .segments import Chunk, Text

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


def chat_prompt(engine, messages: Sequence[Mapping[str, str]]) -> list[Text | Chunk]:
    """Chat messages as prompt segments: registered documents inside any message become `Chunk`s."""
    return index_for(engine).split(render_chat(engine.tokenizer, messages))


def completion_prompt(engine, prompt_text: str) -> list[Text | Chunk]:
    """A plain prompt string as segments (no chat template)."""
    return index_for(engine).split(prompt_text)


def register(engine, texts) -> int:
    """Register document texts as chunks of `engine`'s prompts; return how many were new."""
    return index_for(engine).add_many(texts)


@dataclass(frozen=True)
class SamplingOptions:
    """The generation options every adapter exposes, in the engine's terms."""

    mode: str = "modular"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] | None = None
    seed: int | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": list(self.stop) if self.stop else None,
            "seed": self.seed,
        }


def stream_generation(engine, prompt: Sequence[Text | Chunk], options: SamplingOptions) -> Iterator[Any]:
    """The text pieces of one request (`str`), then the engine's `Generation` as the last item."""
    return engine.stream_generation(prompt, **options.engine_kwargs())


def usage(generation) -> dict[str, int]:
    """Token counts of a finished request (`cached_tokens`: prompt tokens whose KV came from the store)."""
    return {
        "prompt_tokens": int(generation.prompt_tokens),
        "completion_tokens": len(generation.token_ids),
        "cached_tokens": int(generation.cached_tokens),
    }
