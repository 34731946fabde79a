"""An engine double: records the prompt segments it is given and answers with fixed pieces, no model."""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag import Engine
from pc_rag.segments import Chunk, Text
from pc_rag.text_index import DISCOVERY, ChunkIndex, ReplyIndex


class FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class CharSegmenter:
    """Cuts a prompt string at the spans `Engine.split` found, by characters (there are no tokens here)."""

    @staticmethod
    def split(text, spans):
        out, cursor = [], 0
        for span in spans:
            if span.start > cursor:
                out.append(Text(text[cursor: span.start]))
            out.append(Chunk(text[span.start: span.end]))
            cursor = span.end
        return out + [Text(text[cursor:])] if cursor < len(text) or not out else out


@dataclass(frozen=True)
class FakeGeneration:
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    stored_tokens: int
    ttft_s: float
    mode: str
    finish_reason: str
    logprobs: tuple | None = None
    error: str | None = None  # as Generation.error: why a grammar could not finish (finish_reason "error")

    @property
    def choices(self) -> tuple:
        """As Generation.choices: one reply, this one."""
        return (self,)


class FakeEngine:
    """`stream_generation` as pc_rag.Engine's: text pieces, then a Generation.

    `cached_tokens` counts the characters of Chunk segments, so tests can see what was found. Prompt strings are
    split by the engine's own rules (`Engine.split`: registered, discovered and marked documents).
    """

    split = Engine.split
    register = Engine.register

    def __init__(self, pieces=("Hello", " there")):
        self.tokenizer = FakeTokenizer()
        self.segmenter = CharSegmenter()
        self.chunks, self.replies = ChunkIndex(), ReplyIndex()
        self.discovery = DISCOVERY  # what the hooks register into, as a real engine's default
        self.pieces = pieces
        self.calls: list[tuple[list, dict]] = []

    def stream_generation(self, prompt, **kwargs):
        self.calls.append((list(prompt), kwargs))
        yield from self.pieces
        cached = sum(len(s.text) for s in prompt if type(s).__name__ == "Chunk")
        total = sum(len(s.text) for s in prompt)
        yield FakeGeneration(
            text="".join(self.pieces),
            token_ids=tuple(range(len(self.pieces))),
            prompt_tokens=total,
            cached_tokens=cached,
            computed_tokens=total - cached,
            stored_tokens=0,
            ttft_s=0.001,
            mode=kwargs["mode"],
            finish_reason="length",
        )
