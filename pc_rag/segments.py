"""Prompts as segments, and segments as token ids with position ids.

A prompt is a list of `Text` (computed fresh each request) and `Chunk` (a document whose KV is cached and
reused). Each segment is tokenized on its own and the token lists are concatenated: the joined string would
tokenize differently at the boundaries, and keeping the boundaries fixed is what lets a chunk's tokens (and
so its KV) be identical in every prompt it appears in. `full` mode uses the same segment tokenization, so
every mode sees exactly the same token ids. Put separators ("\\n\\n") inside the segments you pass.
"""

from __future__ import annotations

import numbers
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .errors import PromptError


@dataclass(frozen=True)
class Text:
    """Free text computed fresh every request (system text, separators, the question).

    `position`: the position id of its first token; None places it right after the previous segment.
    """

    text: str
    position: int | None = None

    def __post_init__(self):
        _check_segment(self, self.text, position=self.position)


@dataclass(frozen=True)
class Chunk:
    """A reusable document chunk: encoded once on its own, then reused at any position in any prompt.

    `position`: as for `Text`; `encode_position` (PML schemas) fixes the position the chunk is encoded at,
    so a chunk used where its schema placed it needs no RoPE relocation.
    """

    text: str
    position: int | None = None
    encode_position: int | None = None

    def __post_init__(self):
        _check_segment(self, self.text, position=self.position, encode_position=self.encode_position)


Prompt = Sequence[Text | Chunk]


def _check_segment(seg, text, **positions) -> None:
    kind = type(seg).__name__
    if not isinstance(text, str):
        raise PromptError(f"{kind}(text=...) must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # The tokenizer would fail with "TextEncodeInput must be Union[...]"; a lone surrogate usually
            # comes from bytes decoded with errors="surrogateescape", or JSON holding half of an escaped pair.
            raise PromptError(
                f"{kind}({_preview(text)}) holds a lone surrogate {text[e.start]!r} at character {e.start}, "
                f"which is not valid Unicode text; decode the source with errors='replace' or drop it"
            ) from None
    for name, value in positions.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PromptError(f"{kind}({_preview(text)}): {name} must be an int or None, got {type(value).__name__}")
        if value < 0:
            raise PromptError(f"{kind}({_preview(text)}): {name} must be >= 0, got {value}")
        object.__setattr__(seg, name, int(value))  # numpy ints from a retriever become plain ints


def _preview(text: str, n: int = 30) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


@dataclass(frozen=True)
class TokenSegment:
    """One segment after tokenization: its ids and the position id of each token."""

    kind: str  # "bos" | "text" | "sep" (whitespace-only text) | "chunk"
    token_ids: tuple[int, ...]
    start: int  # position id of the first token; a segment's tokens have consecutive position ids
    encode_start: int | None = None  # chunks only: position the chunk's KV is encoded at

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


class SegmentTokenizer:
    """Tokenizes segments on their own, with a bounded memo (chunk texts recur across requests)."""

    def __init__(self, tokenizer, max_entries: int = 65536):
        self.tokenizer = tokenizer
        self.bos_id: int | None = tokenizer.bos_token_id
        self._memo: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()  # engines serve several threads; the memo's LRU order is shared state

    def ids(self, text: str) -> tuple[int, ...]:
        with self._lock:
            hit = self._memo.get(text)
            if hit is not None:
                self._memo.move_to_end(text)
                return hit
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        with self._lock:
            self._memo[text] = ids
            if len(self._memo) > self._max_entries:
                self._memo.popitem(last=False)
        return ids

    def segments(self, prompt: Prompt) -> list[TokenSegment]:
        """Tokenize a prompt and lay out position ids; a BOS sink segment comes first when the model has one."""
        if isinstance(prompt, (str, Text, Chunk)):
            raise PromptError("a prompt is a list of pc_rag.Text / pc_rag.Chunk segments, not a single value")
        if not isinstance(prompt, Sequence):
            # A generator would be consumed by one look and then be empty: ask for a list instead.
            raise PromptError(f"prompt must be a string or a list of pc_rag.Text / pc_rag.Chunk segments, got "
                              f"{type(prompt).__name__}" + ("; pass list(...) of it" if isinstance(prompt, Iterator)
                                                            else ""))
        if len(prompt) == 0:
            raise PromptError("the prompt is empty: pass at least one pc_rag.Text or pc_rag.Chunk")
        out: list[TokenSegment] = []
        pos = 0
        for i, seg in enumerate(prompt):
            if not isinstance(seg, (Text, Chunk)):
                raise PromptError(f"prompt segment {i} is a {type(seg).__name__}; expected pc_rag.Text or pc_rag.Chunk")
            ids = self.ids(seg.text)
            # BOS (the attention sink) at position 0 unless the prompt brings its own or claims position 0.
            if i == 0 and self.bos_id is not None and ids[:1] != (self.bos_id,) and seg.position != 0:
                out.append(TokenSegment("bos", (self.bos_id,), 0))
                pos = 1
            if not ids:
                continue  # an empty segment contributes nothing; dropping it keeps positions honest
            start = pos if seg.position is None else seg.position
            if start < 0:
                raise PromptError(f"prompt segment {i} has a negative position ({start})")
            if isinstance(seg, Chunk):
                enc = seg.encode_position
                out.append(TokenSegment("chunk", ids, start, encode_start=enc))
            else:
                out.append(TokenSegment("text" if seg.text.strip() else "sep", ids, start))
            pos = start + len(ids)
        if not any(s.kind != "bos" for s in out):
            raise PromptError("the prompt has no tokens: every segment's text is empty")
        return out
