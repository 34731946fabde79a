"""Passages: the pieces of a plain-string prompt that can be reused as chunks once an earlier request carried them.

Apps that join retrieved documents into their prompt themselves (a LangChain 1.x middleware or tool calling
`similarity_search`, any OpenAI-API client) hand us one string. `passage_spans` cuts it into passages at
content-defined seams, so a document is the same passage wherever it lands; the planner (plan.py) reuses a passage
from its own cached encoding, as a registered chunk, where that is known to pay and the exact cached prefix has
ended; `PassageIndex` remembers which passages each cache namespace has sent.

The rule (docs/design.md, "Passages"), line by line over the text between known chunks and replies:
- Seams: the tokenizer's special tokens (`<|eot_id|>`, `<start_of_turn>`: chat templates' message bounds), and
  `<|...|>` anywhere; a blank line; a line of separator marks only (`---`, `***`, `===`, `___`, `###`, `~~~`, `+++`);
  a line of tags only (`<doc id=3>`, `</doc>`, `<|eot_id|>`, `<document_content>`).
- Labels that number or wrap a document are not part of it: at a line's start, an opening tag, `[3]`, `(3)`,
  `3:` or `Document 3:` (Doc, Source, Passage, Context, Chunk, Excerpt, Result, Reference, Snippet) are cut
  off and begin a new passage; at a line's end a closing tag (`</doc>`, `<|eot_id|>`) is cut off and ends it.
- A passage is a run of the remaining lines (single newlines stay inside: a hard-wrapped paragraph, a list),
  surrounding whitespace stripped. Shorter than MIN_PASSAGE_CHARS (here) or MIN_PASSAGE_TOKENS (once tokenized,
  segments.py) it stays plain text: a title or a metadata line costs less to compute than to look up.
- The text a reply answers is never a passage (`answered_span`): the last run of content of the prompt (after its
  last seam; a chat's last message, or its question when documents precede it there), skipping lone words after it
  (a chat template's `assistant`, `model`, an `Answer:` line). It depends on everything before it (the documents
  it asks about), it is new in nearly every request (stored, it never comes back), and it is what the answer
  depends on most: computed in context, it sees the documents as a full prefill's would.
So a passage's bounds depend on its own characters and its seams, never on its place in the prompt: documents
joined by blank lines (LangChain's stuff chain, LlamaIndex's metadata lines before a blank line), by `---`,
numbered `[1]`, or wrapped in tags all give the document's text as a passage. What the rule cannot see: documents
joined by a single newline with no label form one passage (reused only as that same run), and a document with
blank lines inside is several passages (each reused on its own, an approximation: a later paragraph no longer
sees the earlier ones, as any chunk; `blend` repairs part of it).

Passages are cut in characters; segments.py widens them to the tokens of the joined string, so the model always
sees the tokens it would have seen, and a passage is reused only where its tokens are the same as where it was
encoded (its key is its token ids).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .errors import PCRagError

MIN_PASSAGE_CHARS = 48  # a cheap first filter, before tokenizing
MIN_PASSAGE_TOKENS = 16  # shorter passages stay text (segments.py)

_TAG = r"<[^<>\n]{1,200}>"
_SEPARATOR_LINE = re.compile(r"[ \t]*(?:[-=*_#~+][ \t]*){3,}\r?")
_TAG_LINE = re.compile(rf"[ \t]*(?:{_TAG}[ \t]*)+\r?")
# A label at a line's start (repeated: "[2] <doc>"): an opening tag, a bracketed or parenthesized number, "3:",
# or a word that names a document followed by its number.
_LABEL = re.compile(
    rf"[ \t]*(?:{_TAG}|\[[ \t]*\d{{1,5}}[ \t]*\][ \t]*:?|\([ \t]*\d{{1,5}}[ \t]*\)[ \t]*:?|\d{{1,5}}[ \t]*:(?=[ \t])"
    r"|(?:document|doc|source|passage|context|chunk|excerpt|result|reference|snippet)[ \t]*#?[ \t]*\d{1,5}"
    r"[ \t]*[:.)\]-])[ \t]*",
    re.IGNORECASE,
)
_SPECIAL = re.compile(r"<\|[^<>|\n]{1,100}\|>")  # `<|eot_id|>`-like markers: seams wherever they are
_CLOSING = re.compile(r"</[^<>\n]{1,200}>|<\|[^<>\n]{1,200}\|>")


def _closing(line: str, a: int, b: int) -> int:
    """Where the closing tags at the end of line[a:b] begin (b when there are none): read from the right, so
    a long line costs only its last tags."""
    cut = b
    while True:
        end = len(line[a:cut].rstrip(" \t\r")) + a
        if end <= a or line[end - 1] != ">":
            return cut
        lt = line.rfind("<", max(a, end - 204), end)
        if lt < 0 or not _CLOSING.fullmatch(line, lt, end):
            return cut
        cut = lt


def marker_pattern(markers: Iterable[str]) -> re.Pattern | None:
    """A pattern matching any of `markers`: the texts of a tokenizer's special tokens (`<|eot_id|>`,
    `<start_of_turn>`, `[INST]`), which chat templates put between messages, in the middle of a line too."""
    texts = sorted({m for m in markers if isinstance(m, str) and m.strip()}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def tokenizer_markers(tokenizer) -> re.Pattern | None:
    """`marker_pattern` of a tokenizer's special tokens (those of its chat template among them)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return marker_pattern([*getattr(tokenizer, "all_special_tokens", ()),
                           *(t.content for t in added.values() if getattr(t, "special", False))])


def passage_spans(text: str, start: int = 0, end: int | None = None, markers: re.Pattern | None = None,
                  min_chars: int = MIN_PASSAGE_CHARS) -> list[tuple[int, int]]:
    """The passages of text[start:end] as (start, end) character spans of `text`, in order, not overlapping, each
    at least `min_chars` long and stripped of surrounding whitespace. `markers` (`marker_pattern`): texts that are
    seams wherever they occur, as `<|...|>` always is. Linear in the length of the text."""
    end = len(text) if end is None else end
    spans: list[tuple[int, int]] = []
    for a, b in _between(text, start, end, markers):
        for c, d in _between(text, a, b, _SPECIAL):
            spans += _passages(text, c, d, min_chars)
    return spans


def _between(text: str, start: int, end: int, markers: re.Pattern | None) -> list[tuple[int, int]]:
    """The stretches of text[start:end] between occurrences of `markers`."""
    if markers is None:
        return [(start, end)]
    out, cursor = [], start
    for m in markers.finditer(text, start, end):
        out.append((cursor, m.start()))
        cursor = m.end()
    return [*out, (cursor, end)]


def answered_span(text: str, start: int = 0, end: int | None = None,
                  markers: re.Pattern | None = None) -> tuple[int, int] | None:
    """The text a reply to the prompt text[start:end] answers, as a (start, end) span of `text`, or None when the
    stretch holds none: `answered_run` of its runs of content under the line rule (`passage_spans` of any length).
    A caller passes the stretch after the prompt's last chunk or reply (text_index.with_passages): where nothing but
    lone words follows those, the reply answers no text of this stretch."""
    return answered_run(text, passage_spans(text, start, end, markers, min_chars=1))


def answered_run(text: str, runs: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The last of `runs` (spans of `text`, in order) that is not a lone word (`_LONE_WORD`: a chat template's role
    name before the generation, an `Answer:` line), None if there is none."""
    return next((r for r in reversed(runs) if not _LONE_WORD.fullmatch(text, *r)), None)


# A run of content that is one word of letters, digits, `_` or `-`, a colon after it at most: a chat template's role
# name ("assistant", "model"), or a completion prompt's "Answer:". What a reply answers comes before it ("Why?" is a
# question: its "?" is not a word's).
_LONE_WORD = re.compile(r"[\w-]{1,40}:?")


def _passages(text: str, start: int, end: int, min_chars: int = MIN_PASSAGE_CHARS) -> list[tuple[int, int]]:
    """`passage_spans` within one stretch with no marker: the line rule of the module docstring (runs of content of
    at least `min_chars` characters)."""
    spans: list[tuple[int, int]] = []
    first = last = -1  # the open passage's first and last content characters (last exclusive)

    def close() -> None:
        nonlocal first, last
        if first >= 0 and last - first >= min_chars:
            spans.append((first, last))
        first = last = -1

    pos = start
    while pos < end:
        nl = text.find("\n", pos, end)
        line_end = end if nl < 0 else nl
        line = text[pos:line_end]
        if not line.strip() or _SEPARATOR_LINE.fullmatch(line) or _TAG_LINE.fullmatch(line):
            close()
        else:
            a, b = 0, len(line)
            while True:  # labels, repeated ("[2] <doc>")
                m = _LABEL.match(line, a, b)
                if m is None or m.end() == a:
                    break
                a = m.end()
            if a:
                close()  # a labelled line begins a new passage
            cut = _closing(line, a, b)
            closing = cut < b
            b = cut
            content = line[a:b]
            if content.strip():
                lead = len(content) - len(content.lstrip())
                if first < 0:
                    first = pos + a + lead
                last = pos + a + len(content.rstrip())
            if closing:
                close()  # a closing tag ends the passage
        pos = line_end + 1
    close()
    return spans


@dataclass
class PassageCounts:
    """What passages did for one engine since it started (`Engine.stats()["passages"]`)."""

    requests: int = 0  # requests whose prompt held passages
    reused: int = 0  # passages reused from the store (memory, disk or Redis)
    reused_tokens: int = 0
    encoded: int = 0  # passages encoded on the request path (seen before, their KV not stored)
    encoded_after_reply: int = 0  # new passages encoded once the reply was out, while no other request ran
    stopped_after_reply: int = 0  # those encodes stopped by a request that arrived (left to the passages' next sight)


class PassageIndex:
    """Which passages each cache namespace has sent, by the store key of their own encoding (plan.Planner's
    `chunk_wanted`: the key carries the model, the passage's tokens and the namespace).

    Bounded per namespace by count (`max_passages`) and by the KV bytes its passages' own encodings take
    (`max_kv_bytes`, from the tokens and `kv_bytes_per_token`), least recently sent forgotten first; at most
    `max_namespaces` namespaces, the least recently active forgotten whole; and at most `max_total` entries in all,
    the least recently active namespace's oldest forgotten first (without it, a server with many tenants could hold
    max_passages for each: 4096 x 100,000 entries). Forgetting loses reuse, never correctness: a passage whose block
    is still stored is found by its key anyway. Memory: an entry is the key's 16-byte digest and its token count
    (about 150 bytes with the dict's own), so the default bound is about 60 MB.

    A namespace's entries never answer another's (a tenant learns nothing of what another sent)."""

    def __init__(self, max_passages: int = 100_000, max_kv_bytes: int = 64 << 30, max_namespaces: int = 4096,
                 kv_bytes_per_token: int = 0, max_total: int = 400_000):
        if min(max_passages, max_kv_bytes, max_namespaces, max_total) < 1:
            raise PCRagError(f"PassageIndex bounds must be >= 1, got max_passages={max_passages}, "
                             f"max_kv_bytes={max_kv_bytes}, max_namespaces={max_namespaces}, max_total={max_total}")
        self.max_passages = max_passages
        self.max_kv_bytes = max_kv_bytes
        self.max_namespaces = max_namespaces
        self.max_total = max_total
        self._total = 0  # entries over every namespace
        self.kv_bytes_per_token = kv_bytes_per_token
        self.counts = PassageCounts()
        self._spaces: OrderedDict[str | None, _Space] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(key: str) -> bytes:
        # Keys are "chunk-" + 40 hex digits (blocks.chunk_key); 16 bytes of it keep collisions out of reach.
        return bytes.fromhex(key.rpartition("-")[2][-32:])

    def seen(self, namespace: str | None, key: str) -> bool:
        """Whether `namespace` sent the passage keyed `key` before (and it is still remembered)."""
        with self._lock:
            space = self._spaces.get(namespace)
            return space is not None and self._digest(key) in space.entries

    def add(self, namespace: str | None, passages: Iterable[tuple[str, int]]) -> None:
        """Remember passages `namespace` sent: (key, tokens) each; sending one again marks it recently used."""
        with self._lock:
            space = self._spaces.get(namespace)
            if space is None:
                space = self._spaces[namespace] = _Space()
                while len(self._spaces) > self.max_namespaces:
                    self._total -= len(self._spaces.popitem(last=False)[1].entries)
            self._spaces.move_to_end(namespace)
            for key, tokens in passages:
                digest = self._digest(key)
                if digest in space.entries:
                    space.entries.move_to_end(digest)
                    continue
                space.entries[digest] = tokens
                space.tokens += tokens
                self._total += 1
            while space.entries and (len(space.entries) > self.max_passages
                                     or space.tokens * self.kv_bytes_per_token > self.max_kv_bytes):
                space.forget_oldest()
                self._total -= 1
            while self._total > self.max_total:  # the least recently active namespace gives first
                oldest = next(iter(self._spaces.values()))
                oldest.forget_oldest()
                self._total -= 1
                if not oldest.entries:
                    self._spaces.popitem(last=False)

    def count(self, **changes: int) -> None:
        """Add to the counters (`PassageCounts` fields)."""
        with self._lock:
            for name, n in changes.items():
                setattr(self.counts, name, getattr(self.counts, name) + n)

    def stats(self) -> dict:
        with self._lock:
            return {"namespaces": len(self._spaces), "indexed": sum(len(s.entries) for s in self._spaces.values()),
                    **vars(self.counts)}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s.entries) for s in self._spaces.values())

    def clear(self) -> None:
        with self._lock:
            self._spaces.clear()
            self._total = 0


@dataclass
class _Space:
    """One namespace's passages: digest -> tokens, least recently sent first."""

    entries: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    tokens: int = 0

    def forget_oldest(self) -> None:
        _, tokens = self.entries.popitem(last=False)
        self.tokens -= tokens
