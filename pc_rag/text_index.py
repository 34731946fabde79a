"""Indexes of texts to cut prompt strings at, so frameworks that flatten documents into one string still hit.

RAG frameworks hand the model one string (LangChain's stuff chain joins `page_content` with blank lines;
LlamaIndex puts metadata lines before each node's text). A `ChunkIndex` holds texts to treat as chunks and
finds them with one Aho-Corasick pass (pyahocorasick), linear in the prompt length whatever the number of
texts. `Engine.split` asks, for each prompt string: the texts registered with the engine (`register`, the
wrappers), the documents the framework hooks discovered (its `Discovery`, by default the process's `DISCOVERY`:
`discover`), the texts marked for this request (`marked`: content blocks with `cache_control`), and the replies
the engine generated (`ReplyIndex`); `resolve` keeps leftmost-longest, non-overlapping spans, and
`SegmentTokenizer.split` turns them into segments with the tokens of the joined string.

Matching rules, each chosen so that a hit never changes what the model is asked:
- Chunk keys are the text with surrounding whitespace stripped. Chat templates trim message content
  (Llama 3's `| trim`) and formatters add or drop newlines around documents; a stripped key matches in all
  those layouts. Whitespace inside a chunk is matched exactly.
- Leftmost-longest, non-overlapping: when texts overlap (one contains another), the match that starts first
  wins, then the longest one starting there.
- With `word_boundaries` (the default) a match glued to a letter or digit on either side ("cat" inside
  "concatenate") is not a hit.
- Everything else is text: a prompt with no known text is answered as usual (and still reuses the longest
  cached token prefix, prefix.py).
- Bounded: an index keeps at most `max_texts` texts and `max_chars` characters, least recently used first. Its
  automaton takes about 48 bytes per character of distinct text (pyahocorasick, measured), which is what the
  bounds in characters bound.
- Public texts (`add_many(texts, public=True)`, `Engine.register(..., public=True)`): documents their owner declared
  shared across cache namespaces; their spans are `public` chunks (KV keyed in no namespace, `Chunk.public`). Where
  a public text and a text marked for one request cover the same characters, the span is public (it is the same
  document); only texts registered as public are, so a request cannot make its own text public.
- Replies are kept per cache namespace (`ReplyIndex`): a reply is a cut only in prompts of the namespace whose
  request generated it.

Registering is cheap at any index size: new texts go to a small "recent" automaton, which is folded into the
main one (a full rebuild) only once it holds more than an eighth of the keys (or after an eviction), so a
retriever that registers a few documents per request does not pay for a rebuild of 100,000 keys each time.
Built automata are never modified, only replaced, so a split can run while another thread registers texts.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ahocorasick

from .errors import PCRagError
from .passages import MIN_PASSAGE_CHARS, answered_run, passage_spans
from .segments import Chunk, Text, check_text, cut_at, unicode_problem

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


@dataclass(frozen=True)
class Span:
    """Characters [start, end) of a prompt string: a "chunk", a "passage" (pc_rag.passages), or a "reply" this
    engine generated (`reply_ids`: the token ids it generated for exactly that text, when known); `public`: a chunk
    registered as public."""

    start: int
    end: int
    kind: str = "chunk"
    reply_ids: tuple[int, ...] | None = None
    public: bool = False


class ChunkIndex:
    """The chunk texts a prompt string is split at. Thread-safe; see the module docstring for the rules.

    Bounded: at most `max_texts` texts and `max_chars` characters, least recently used (registered or found
    in a prompt) dropped first, so a long-running server that sees new documents every request stays flat.
    Eviction drops an eighth of the bound at once: removing keys means rebuilding the automaton.
    """

    def __init__(self, texts: Iterable[str] = (), *, word_boundaries: bool = True, max_texts: int = 200_000,
                 max_chars: int = 512 << 20):
        if max_texts < 1 or max_chars < 1:
            raise PCRagError(f"ChunkIndex bounds must be >= 1, got max_texts={max_texts}, max_chars={max_chars}")
        self.word_boundaries = word_boundaries
        self.max_texts = max_texts
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._public: set[str] = set()  # keys registered as public
        self._chars = 0
        self._recent: set[str] = set()
        self._main: ahocorasick.Automaton | None = None
        self._recent_automaton: ahocorasick.Automaton | None = None
        self._dirty = False
        self._stale_main = False
        self.add_many(texts)

    @staticmethod
    def key(text: str) -> str:
        """The form a chunk text is registered and matched in (surrounding whitespace stripped)."""
        return check_text(text, "a chunk text").strip()

    def add(self, text: str) -> bool:
        """Register one chunk text; return False when it was already there or is only whitespace."""
        return self.add_many([text]) == 1

    def add_many(self, texts: Iterable[str], public: bool = False) -> int:
        """Register chunk texts (already registered ones count as used); return how many were new. `public`:
        declared shared across cache namespaces (a text once public stays so while it is registered)."""
        keys = [k for k in map(self.key, texts) if k and len(k) <= self.max_chars]
        with self._lock:
            new = 0
            for k in keys:
                if public:
                    self._public.add(k)
                if k in self._keys:
                    self._keys.move_to_end(k)
                    continue
                self._keys[k] = None
                self._chars += len(k)
                self._recent.add(k)
                new += 1
            if new:
                self._dirty = True
                self._evict()
        return new

    def _evict(self) -> None:
        if len(self._keys) <= self.max_texts and self._chars <= self.max_chars:
            return
        keep_texts, keep_chars = self.max_texts * 7 // 8, self.max_chars * 7 // 8
        while self._keys and (len(self._keys) > keep_texts or self._chars > keep_chars):
            k, _ = self._keys.popitem(last=False)
            self._chars -= len(k)
            self._public.discard(k)
            if k in self._recent:
                self._recent.discard(k)
            else:
                self._stale_main = True
        self._dirty = True

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and text.strip() in self._keys

    def is_public(self, text: str) -> bool:
        """Whether `text` (stripped) is registered as public."""
        return text.strip() in self._public

    def _automata(self) -> list[ahocorasick.Automaton]:
        """The built automata, rebuilding what registrations since the last call made stale."""
        with self._lock:
            if self._dirty:
                if self._stale_main or len(self._recent) > max(_RECENT_MIN, len(self._keys) // 8):
                    self._main = _build(self._keys)
                    self._recent = set()
                    self._stale_main = False
                self._recent_automaton = _build(self._recent)
                self._dirty = False
            return [a for a in (self._main, self._recent_automaton) if a is not None]

    def candidates(self, prompt_text: str) -> list[Span]:
        """Every occurrence of a registered text in `prompt_text` (overlapping ones included); marks them used."""
        found = []
        for automaton in self._automata():
            for end_index, length in automaton.iter(prompt_text):
                start = end_index + 1 - length
                if self.word_boundaries and _glued(prompt_text, start, end_index + 1):
                    continue
                found.append(Span(start, end_index + 1))
        if not found:
            return []
        with self._lock:
            for span in found:
                k = prompt_text[span.start: span.end]
                if k in self._keys:  # an automaton may still hold a key evicted since it was built
                    self._keys.move_to_end(k)
            public = self._public
            return [Span(s.start, s.end, public=True) if prompt_text[s.start: s.end] in public else s
                    for s in found if prompt_text[s.start: s.end] in self._keys]

    def spans(self, prompt_text: str) -> list[tuple[int, int]]:
        """The (start, end) character spans of registered chunks in `prompt_text`, leftmost-longest."""
        return [(s.start, s.end) for s in resolve(self.candidates(prompt_text))]

    def split(self, prompt_text: str) -> list[Text | Chunk]:
        """Cut `prompt_text` into segments: registered chunk texts become `Chunk`, the rest `Text`.

        Joining the segments' texts gives `prompt_text` back exactly. (Each piece is tokenized on its own;
        `Engine.split` instead keeps the tokens of the joined string.)
        """
        if not isinstance(prompt_text, str):
            raise PCRagError(f"split takes the prompt as a str, got {type(prompt_text).__name__}")
        spans = resolve(self.candidates(prompt_text))
        return cut_at(prompt_text, [(s.start, s.end) for s in spans], {s.start for s in spans if s.public})

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self._public.clear()
            self._chars = 0
            self._recent = set()
            self._main = self._recent_automaton = None
            self._dirty = self._stale_main = False


class ReplyIndex(ChunkIndex):
    """Replies an engine generated, as the next turn writes them back, with the token ids generated for them.

    A chat's next turn carries the previous reply as text after the previous prompt, and tokenizing the
    joined string can differ from what the model saw in two places: where the previous prompt ended (with
    a GPT-2 style pre-tokenizer, "\n\n" at the end of a string is one token, "\n\nHi" gives two), and inside
    the reply (a model may generate a non-canonical tokenization; a random test model does so all the
    time). So a reply is a hard cut: the text before it is tokenized as the string it was when the model
    answered, and the reply gets back its generated ids. The next turn's tokens then continue the earlier
    request's exactly, and the automatic prefix reuse covers the previous prompt and the reply.

    A reply is only a cut where the text before it is exactly the prompt it was generated after, in the same
    cache namespace (a hash of both is kept with it): the same words elsewhere ("Yes" quoted in another prompt)
    stay ordinary text, tokenized with their neighbours, and a request of another namespace sending the same
    prompt and reply is tokenized as if the reply had never been generated (its token count would otherwise
    tell it that one was). The generated ids are kept per prompt too, so no request is given another's.

    Keys are kept as written (not stripped): a reply is remembered both as generated and trimmed, the way
    chat templates write it back; `ids` is None for a trimmed form whose tokens cannot be told (a token that
    mixes the trimmed whitespace and text), which still cuts the prompt where the reply begins.
    """

    MAX_PROMPTS = 8  # prompts remembered per reply text (the same short reply may follow several prompts)

    # Bounded by characters for memory: pyahocorasick's automaton takes about 48 bytes per character of distinct
    # text (measured), so 2M characters is about 100 MB with the texts, reached by a server within its first
    # thousands of replies and flat from there (benchmarks/soak.py); at 16M it had been 0.8 GB. The next turn
    # writes back a recent reply: 2M characters are a thousand 2K-character replies.
    def __init__(self, max_texts: int = 4096, max_chars: int = 2 << 20):
        super().__init__(max_texts=max_texts, max_chars=max_chars)
        # reply text -> {hash of (namespace, the prompt it followed): the ids generated there}, oldest first. Per
        # prompt, not per text: the same text generated twice in one conversation (an agent repeating a tool call)
        # may have been generated as different tokens each time, and each occurrence must get back its own.
        self._after: dict[str, dict[int, tuple[int, ...] | None]] = {}

    @staticmethod
    def key(text: str) -> str:
        if not isinstance(text, str):
            raise PCRagError(f"a reply text must be a str, got {type(text).__name__}")
        return text if text.strip() else ""

    def remember(self, text: str, token_ids: Sequence[int] | None, after: str, namespace: str | None = None) -> None:
        """`text` was generated as `token_ids` right after the prompt string `after`, in cache `namespace`."""
        if not self.key(text):
            return
        with self._lock:
            prompts = self._after.setdefault(text, {})
            h = hash((namespace, after))
            prompts.pop(h, None)
            prompts[h] = None if token_ids is None else tuple(token_ids)
            while len(prompts) > self.MAX_PROMPTS:
                del prompts[next(iter(prompts))]
        self.add(text)
        with self._lock:
            if len(self._after) > len(self._keys):
                for k in [k for k in self._after if k not in self._keys]:
                    del self._after[k]

    def candidates(self, prompt_text: str, namespace: str | None = None) -> list[Span]:
        """The remembered replies in `prompt_text` that follow the very prompt they were generated after, in
        `namespace`, with the ids generated there."""
        spans = super().candidates(prompt_text)
        out = []
        with self._lock:
            for s in spans:
                prompts = self._after.get(prompt_text[s.start: s.end], {})
                h = hash((namespace, prompt_text[: s.start]))
                if h in prompts:
                    out.append(Span(s.start, s.end, "reply", prompts[h]))
        return out

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._after.clear()


def marked(prompt_text: str, texts: Iterable[str]) -> list[Span]:
    """Occurrences of texts marked as chunks for one request (e.g. content blocks with `cache_control`)."""
    found = []
    for text in texts:
        key = ChunkIndex.key(text)
        i = prompt_text.find(key) if key else -1
        while i >= 0:
            found.append(Span(i, i + len(key)))
            i = prompt_text.find(key, i + len(key))
    return found


def resolve(candidates: Iterable[Span]) -> list[Span]:
    """Leftmost-longest, non-overlapping: the span that starts first wins, then the longest starting there, then
    a public chunk (the same characters marked for one request are that public document)."""
    spans: list[Span] = []
    cursor = 0
    for span in sorted(candidates, key=lambda s: (s.start, s.start - s.end, not s.public)):
        if span.start >= cursor:
            spans.append(span)
            cursor = span.end
    return spans


def with_passages(prompt_text: str, spans: Sequence[Span], markers: re.Pattern | None = None) -> list[Span]:
    """`spans` (resolved: sorted, not overlapping) with the passages of the text between them (pc_rag.passages;
    `markers`: the tokenizer's special tokens) added, in order. A reply is a hard cut and a chunk is known already:
    passages are only looked for around them. The text the prompt's reply answers (`answered_span` of the text
    after the last of them) is never a passage, in any mode: it is computed in context."""
    out: list[Span] = []
    cursor = 0
    for span in [*spans, None]:
        end = len(prompt_text) if span is None else span.start
        if span is None:  # the last stretch: its runs of any length give both its passages and what is answered
            runs = passage_spans(prompt_text, cursor, end, markers, min_chars=1)
            answered = answered_run(prompt_text, runs)
            found = [r for r in runs if r[1] - r[0] >= MIN_PASSAGE_CHARS and r != answered]
        else:
            found = passage_spans(prompt_text, cursor, end, markers)
        out += [Span(a, b, "passage") for a, b in found]
        if span is not None:
            out.append(span)
            cursor = span.end
    return out


# ---- documents discovered by the framework hooks ----------------------------------------------------------
class Discovery:
    """Documents the framework hooks discovered, and the engines that split prompts with them.

    A retriever's documents are seen (LangChain callback, LlamaIndex event) before any LLM call, so a hook cannot
    know which engine will answer: it registers the texts here (`discover`), every engine watching this Discovery
    cuts prompt strings at them (unless turned off per call, or by PC_RAG_DISCOVERY=0), and each of those engines
    starts prefetching their KV (`Engine.prefetch`, unless its `prefetch_on_discover` is False). Engines are held
    weakly: one no longer used is never kept alive here. The hooks use the process's one `DISCOVERY`; an engine
    given another (`Engine(discovery=...)`) shares nothing with engines it never met."""

    def __init__(self, max_texts: int = 50_000, max_chars: int = 128 << 20):
        self.index = ChunkIndex(max_texts=max_texts, max_chars=max_chars)
        self._engines: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()

    def watch(self, engine) -> None:
        """Split `engine`'s prompts at the discovered documents and ask it to prefetch new ones."""
        with self._lock:
            self._engines.add(engine)

    def engines(self) -> list:
        with self._lock:
            return list(self._engines)

    def discover(self, texts: Iterable[str]) -> int:
        """Register retrieved document texts and start prefetching their KV into memory for every watching engine
        that wants it (never blocks); returns how many texts were new. A no-op when PC_RAG_DISCOVERY=0."""
        if not discovery_enabled():
            return 0
        # A hook never raises into the framework: a text no tokenizer takes (a lone surrogate) is not a chunk, and
        # the prompt holding it is refused where it enters the engine, naming it.
        texts = [t for t in texts if isinstance(t, str) and unicode_problem(t) is None]
        added = self.index.add_many(texts)
        if texts and prefetch_enabled():
            for engine in self.engines():
                if engine.prefetch_on_discover:
                    engine.prefetch(texts)
        return added

    def candidates(self, prompt_text: str) -> list[Span]:
        return self.index.candidates(prompt_text) if discovery_enabled() else []


def discovery_enabled() -> bool:
    return os.environ.get("PC_RAG_DISCOVERY", "1").strip().lower() not in ("0", "false", "no", "off")


def prefetch_enabled() -> bool:
    """PC_RAG_PREFETCH=0 turns prefetch on discovery off for the process."""
    return os.environ.get("PC_RAG_PREFETCH", "1").strip().lower() not in ("0", "false", "no", "off")


# The process's one entry point for the framework hooks: every Engine watches it unless given its own.
DISCOVERY = Discovery()


def discover(texts: Iterable[str]) -> int:
    """`DISCOVERY.discover(texts)`: what the framework hooks call."""
    return DISCOVERY.discover(texts)

