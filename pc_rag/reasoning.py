"""Reasoning models: the text between the chat template's thinking markers, reported apart from the answer.

Qwen3, SmolLM3 and the DeepSeek-R1 distills write `<think>...</think>` before their answer (`ThinkingMarkers.detect`
reads the markers from the tokenizer's vocabulary and chat template; `<think>`/`</think>` by default). A template
whose generation prompt already opened `<think>` (DeepSeek-R1's) makes the reply start inside the thinking
(`starts_inside`). `ThinkingFilter` splits a reply's streamed pieces into reasoning and answer:

- a thinking block is only read at the start of the reply (after whitespace), as these models write it; `<think>`
  anywhere else is the answer's text;
- the answer's leading whitespace after `</think>` is dropped (Qwen3 writes `</think>\\n\\n`); the reasoning is
  kept as written;
- a reply without markers is unchanged: while its start could still be `<think>` (whitespace, `<`, `<th`...) it is
  held back, then given out as it is;
- a reply that ends inside the thinking (cut by max_tokens) is all reasoning.

What reads tool calls out of a reply (pc_rag.tools.CallFilter) sees only the answer: a call written inside the
thinking is not a call. Chat templates drop earlier turns' thinking (Qwen3's keeps only the answer), so the next
turn's prompt holds the answer right after the previous prompt: the engine remembers the answer as that prompt's
reply (`after_reply.remember_reply`), so the next turn still reuses the previous prompt.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

# (open, close) pairs, the usual first: Qwen3, SmolLM3, DeepSeek-R1 and its distills, QwQ, Phi-4-reasoning, ...
KNOWN_MARKERS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"),
                 ("<|START_THINKING|>", "<|END_THINKING|>"))


@dataclass(frozen=True)
class ThinkingMarkers:
    open: str = "<think>"
    close: str = "</think>"

    @classmethod
    def detect(cls, tokenizer) -> ThinkingMarkers:
        """The first known pair whose opening marker is a token of the vocabulary or in the chat template;
        `<think>`/`</think>` when none is. Read once per tokenizer and template."""
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):
            template = "\n".join(str(t) for t in template.values())
        try:
            seen = _DETECTED.get(tokenizer)
        except TypeError:  # not weakly referenceable: read it each time
            return cls._read(tokenizer, template)
        if seen is None or seen[0] != template:
            seen = _DETECTED[tokenizer] = (template, cls._read(tokenizer, template))
        return seen[1]

    @classmethod
    def _read(cls, tokenizer, template: str) -> ThinkingMarkers:
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # a tokenizer stand-in (tests) or one without a vocabulary to read
            vocab = {}
        for open_, close in KNOWN_MARKERS:
            if open_ in vocab or open_ in template:
                return cls(open_, close)
        return cls()

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether a reply to `prompt_text` starts inside the thinking: the generation prompt opened it."""
        return prompt_text.rstrip().endswith(self.open)

    def answer(self, text: str) -> str | None:
        """The answer of a whole reply that holds a thinking block (what a chat template writes back); None when
        it holds none."""
        at = text.find(self.close)
        return text[at + len(self.close):].lstrip() if at >= 0 else None


_DETECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its template, its markers)

REASONING, CONTENT = "reasoning", "content"


class ThinkingFilter:
    """A reply's text pieces as (kind, text) pairs, kind REASONING or CONTENT, in order (see the module)."""

    def __init__(self, markers: ThinkingMarkers, inside: bool = False):
        self.markers = markers
        self.state = "inside" if inside else "start"  # start -> inside -> after -> answer, or start -> answer
        self.held = ""

    def feed(self, piece: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.held += piece
        open_, close = self.markers.open, self.markers.close
        while True:
            if self.state == "start":
                head = self.held.lstrip()
                if head.startswith(open_):
                    self.held, self.state = head[len(open_):], "inside"
                    continue
                if open_.startswith(head):  # still possibly the opening marker (or only whitespace so far)
                    return out
                self.state = "answer"
                continue
            if self.state == "inside":
                at = self.held.find(close)
                if at >= 0:
                    if at:
                        out.append((REASONING, self.held[:at]))
                    self.held, self.state = self.held[at + len(close):], "after"
                    continue
                keep = _partial_suffix(self.held, close)
                if len(self.held) > keep:
                    out.append((REASONING, self.held[: len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                return out
            if self.state == "after":
                self.held = self.held.lstrip()
                if not self.held:
                    return out
                self.state = "answer"
                continue
            if self.held:
                out.append((CONTENT, self.held))
                self.held = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held back once the reply has ended."""
        held, self.held = self.held, ""
        if not held or self.state == "after":
            return []
        return [(REASONING if self.state == "inside" else CONTENT, held)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
