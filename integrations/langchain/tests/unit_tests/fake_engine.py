"""An engine double: records the prompt segments it is given and answers with fixed pieces, no model."""

from __future__ import annotations

from dataclasses import dataclass


class FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass(frozen=True)
class FakeGeneration:
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float
    mode: str
    finish_reason: str


class FakeEngine:
    """`stream_generation` as pc_rag.Engine's: text pieces, then a Generation.

    `cached_tokens` counts the characters of Chunk segments, so tests can see what was found.
    """

    def __init__(self, pieces=("Hello", " there")):
        self.tokenizer = FakeTokenizer()
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
            ttft_s=0.001,
            mode=kwargs["mode"],
            finish_reason="length",
        )
