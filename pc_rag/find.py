"""Finding registered chunk texts inside a flat prompt string, so frameworks that flatten documents still hit.

RAG frameworks hand the model one string (LangChain's stuff chain joins `page_content` with blank lines;
LlamaIndex puts metadata lines before each node's text). `ChunkIndex` holds the texts registered as chunks
and `split` cuts a prompt string back into `Text` / `Chunk` segments with one Aho-Corasick pass
(pyahocorasick), so the cost is linear in the prompt length whatever the number of registered chunks.

Matching rules, each chosen so that a hit never changes what the model is asked:
- Keys are the registered text with surrounding whitespace stripped. Chat templates trim message content
  (Llama 3's `| trim`) and formatters add or drop newlines around documents; a stripped key matches in all
  those layouts, and the `Chunk` always holds the same text, so its KV is found whatever the layout. The
  whitespace around a hit stays in the neighbouring `Text`. Whitespace inside a chunk is matched exactly.
- Leftmost-longest, non-overlapping: when registered texts overlap (one contains another), the match that
  starts first wins, then the longest one starting there.
- With `word_boundaries` (the default) a match glued to a letter or digit on either side ("cat" inside
  "concatenate") is not a hit: cutting a word in two would change its tokenization.
- Everything else is `Text`: a prompt with no registered chunk becomes one `Text` and is answered as usual.

Registering is cheap at any index size: new texts go to a small "recent" automaton, which is folded into the
main one (a full rebuild) only once it holds more than an eighth of the keys, so a retriever that registers
a few documents per request does not pay for a rebuild of 100,000 keys each time. Built automata are never
modified, only replaced, so `split` can run while another thread registers texts.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import ahocorasick

from .errors import PCRagError
from .segments import Chunk, Text

_RECENT_MIN = 256  # the recent automaton is folded into the main one past max(_RECENT_MIN, keys // 8)


def _build(keys: Iterable[str]) -> ahocorasick.Automaton | None:
    automaton = ahocorasick.Automaton(ahocorasick.STORE_INTS)
    for key in keys:
        automaton.add_word(key, len(key))
    if len(automaton) == 0:
        return None
    automaton.make_automaton()
    return automaton


def _glued(text: str, start: int, end: int) -> bool:
    """True when the span [start, end) starts or ends inside a word of `text`."""
    if start > 0 and text[start - 1].isalnum() and text[start].isalnum():
        return True
    return end < len(text) and text[end].isalnum() and text[end - 1].isalnum()


class ChunkIndex:
    """The chunk texts a prompt string is split at. Thread-safe; see the module docstring for the rules."""

    def __init__(self, texts: Iterable[str] = (), *, word_boundaries: bool = True):
        self.word_boundaries = word_boundaries
        self._lock = threading.Lock()
        self._keys: set[str] = set()
        self._recent: set[str] = set()
        self._main: ahocorasick.Automaton | None = None
        self._recent_automaton: ahocorasick.Automaton | None = None
        self._dirty = False
        self.add_many(texts)

    @staticmethod
    def key(text: str) -> str:
        """The form a chunk text is registered and matched in (surrounding whitespace stripped)."""
        if not isinstance(text, str):
            raise PCRagError(f"a chunk text must be a str, got {type(text).__name__}")
        return text.strip()

    def add(self, text: str) -> bool:
        """Register one chunk text; return False when it was already there or is only whitespace."""
        return self.add_many([text]) == 1

    def add_many(self, texts: Iterable[str]) -> int:
        """Register chunk texts; return how many were new."""
        new = {k for k in map(self.key, texts) if k}
        with self._lock:
            new -= self._keys
            if not new:
                return 0
            self._keys |= new
            self._recent |= new
            self._dirty = True
        return len(new)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and text.strip() in self._keys

    def _automata(self) -> list[ahocorasick.Automaton]:
        """The built automata, rebuilding what registrations since the last call made stale."""
        with self._lock:
            if self._dirty:
                if len(self._recent) > max(_RECENT_MIN, len(self._keys) // 8):
                    self._main = _build(self._keys)
                    self._recent = set()
                self._recent_automaton = _build(self._recent)
                self._dirty = False
            return [a for a in (self._main, self._recent_automaton) if a is not None]

    def spans(self, prompt_text: str) -> list[tuple[int, int]]:
        """The (start, end) character spans of registered chunks in `prompt_text`, leftmost-longest."""
        found: list[tuple[int, int]] = []  # (start, -length) so that sorting puts the longest first
        for automaton in self._automata():
            for end_index, length in automaton.iter(prompt_text):
                start = end_index + 1 - length
                if self.word_boundaries and _glued(prompt_text, start, end_index + 1):
                    continue
                found.append((start, -length))
        found.sort()
        spans: list[tuple[int, int]] = []
        cursor = 0
        for start, neg_length in found:
            if start >= cursor:
                spans.append((start, start - neg_length))
                cursor = start - neg_length
        return spans

    def split(self, prompt_text: str) -> list[Text | Chunk]:
        """Cut `prompt_text` into segments: registered chunk texts become `Chunk`, the rest `Text`.

        Joining the segments' texts gives `prompt_text` back exactly.
        """
        if not isinstance(prompt_text, str):
            raise PCRagError(f"split takes the prompt as a str, got {type(prompt_text).__name__}")
        segments: list[Text | Chunk] = []
        cursor = 0
        for start, end in self.spans(prompt_text):
            if start > cursor:
                segments.append(Text(prompt_text[cursor:start]))
            segments.append(Chunk(prompt_text[start:end]))
            cursor = end
        if cursor < len(prompt_text) or not segments:
            segments.append(Text(prompt_text[cursor:]))
        return segments


# One index per engine, so every adapter instance built on the same Engine (the LangChain chat model, its
# retriever wrapper, the LlamaIndex LLM and postprocessor) registers into and splits with the same texts.
_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INDEXES_LOCK = threading.Lock()


def index_for(engine: object) -> ChunkIndex:
    """The ChunkIndex shared by all adapters on `engine` (created on first use, dropped with the engine)."""
    with _INDEXES_LOCK:
        index = _INDEXES.get(engine)
        if index is None:
            index = _INDEXES[engine] = ChunkIndex()
        return index
