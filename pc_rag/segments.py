"""Prompts as segments, and segments as token ids with position ids.

A prompt is a list of `Text` (computed fresh each request) and `Chunk` (a document whose KV is cached and
reused). Each segment is tokenized on its own and the token lists are concatenated: the joined string would
tokenize differently at the boundaries, and keeping the boundaries fixed is what lets a chunk's tokens (and
so its KV) be identical in every prompt it appears in. `full` mode uses the same segment tokenization, so
every mode sees exactly the same token ids. Put separators ("\\n\\n") inside the segments you pass.
"""

from __future__ import annotations

import bisect
import numbers
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .errors import PromptError
from .passages import MIN_PASSAGE_TOKENS


@dataclass(frozen=True)
class Text:
    """Free text computed fresh every request (system text, separators, the question), unless an earlier
    request computed the same leading tokens (automatic prefix reuse).

    `position`: the position id of its first token; None places it right after the previous segment.
    `token_ids`: its tokens, when they are already known (`Engine.split` keeps the tokens of the joined
    prompt string); None tokenizes `text` on its own.
    `passage`: a passage of a plain-string prompt (pc_rag.passages, `Engine.split`): in `modular` and `blend`,
    after the exact cached prefix ends, it is reused like a chunk where its own encoding is stored or an
    earlier request of the namespace sent it (plan.py); otherwise it is text like any other.
    """

    text: str
    position: int | None = None
    token_ids: tuple[int, ...] | None = None
    passage: bool = False

    def __post_init__(self):
        _check_segment(self, self.text, position=self.position)
        if not isinstance(self.passage, bool):
            raise PromptError(f"Text({_preview(self.text)}): passage must be True or False, got "
                              f"{type(self.passage).__name__}")


@dataclass(frozen=True)
class Chunk:
    """A reusable document chunk: encoded once on its own, then reused at any position in any prompt.

    `position`: as for `Text`; `encode_position` (PML schemas) fixes the position the chunk is encoded at,
    so a chunk used where its schema placed it needs no RoPE relocation.
    `public`: a document its owner declared shared (`Engine.register(texts, public=True)`): its KV is keyed in no
    namespace, so requests of every namespace (`cache_salt`) share it; the prompt around it stays in the
    request's namespace. Off by default: a chunk is keyed in the namespace of the request it is in.
    """

    text: str
    position: int | None = None
    encode_position: int | None = None
    token_ids: tuple[int, ...] | None = None  # as for Text
    public: bool = False

    def __post_init__(self):
        _check_segment(self, self.text, position=self.position, encode_position=self.encode_position)
        if not isinstance(self.public, bool):
            raise PromptError(f"Chunk({_preview(self.text)}): public must be True or False, got "
                              f"{type(self.public).__name__}")


Prompt = Sequence[Text | Chunk]


# ---- text where it enters -----------------------------------------------------------------------------------------
# Every string bound for a tokenizer is checked once, where it enters pc_rag (a Text or Chunk, `Engine.split`'s prompt
# string, registered and marked texts, PML, chat messages and tools, the server's fields), so that the error names
# what the caller passed; nothing after that point checks again. What a tokenizer cannot take is a lone surrogate:
# today's fast tokenizers raise "TextEncodeInput must be Union[...]" (a TypeError naming nothing) for it. It comes
# from bytes decoded with errors="surrogateescape", or JSON holding half of an escaped pair.
INVALID_TEXT_HINT = "which is not valid Unicode text; decode the source with errors='replace' or drop it"


def lone_surrogate(text: str) -> int | None:
    """Where `text` first holds a lone surrogate, None if nowhere."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def unicode_problem(text: str) -> str | None:
    """What makes `text` unusable by a tokenizer ("a lone surrogate '\\ud800' at character 3"), None if nothing."""
    at = lone_surrogate(text)
    return None if at is None else f"a lone surrogate {text[at]!r} at character {at}"


def check_text(text, where: str) -> str:
    """`text`, once it is a str a tokenizer can take; otherwise a PromptError naming `where` (the caller's name for
    it: "the prompt string", "messages[2].content")."""
    if not isinstance(text, str):
        raise PromptError(f"{where} must be a str, got {type(text).__name__}")
    problem = unicode_problem(text)
    if problem is not None:
        raise PromptError(f"{where} holds {problem}, {INVALID_TEXT_HINT}")
    return text


def check_texts(value, where: str) -> None:
    """Every string inside `value` (dicts' keys and values, lists, nested), as `check_text` checks one: chat messages
    and tools, whose every string the chat template may write into the prompt. Other leaves are left alone."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(key, f"a key of {where}")
            check_texts(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_texts(item, f"{where}[{i}]")


def _check_segment(seg, text, **positions) -> None:
    kind = type(seg).__name__
    if not isinstance(text, str):
        raise PromptError(f"{kind}(text=...) must be a str, got {type(text).__name__}")
    problem = unicode_problem(text)
    if problem is not None:
        raise PromptError(f"{kind}({_preview(text)}) holds {problem}, {INVALID_TEXT_HINT}")
    for name, value in positions.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PromptError(f"{kind}({_preview(text)}): {name} must be an int or None, got {type(value).__name__}")
        if value < 0:
            raise PromptError(f"{kind}({_preview(text)}): {name} must be >= 0, got {value}")
        object.__setattr__(seg, name, int(value))  # numpy ints from a retriever become plain ints


def chunk_list(chunks, caller: str) -> list[Chunk]:
    """`chunks` (str or Chunk each) as Chunks, every item checked before any slow work starts."""
    if isinstance(chunks, (str, Chunk)):  # a lone string would be taken character by character
        raise PromptError(f"{caller} takes a list of chunks (str or pc_rag.Chunk), not a single one: {caller}([chunk])")
    chunks = list(chunks)
    for i, c in enumerate(chunks):
        if not isinstance(c, (str, Chunk)):
            raise PromptError(f"{caller}: chunks[{i}] is a {type(c).__name__}; pass str or pc_rag.Chunk")
    return [Chunk(c) if isinstance(c, str) else c for c in chunks]


def _preview(text: str, n: int = 30) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


@dataclass(frozen=True)
class TokenSegment:
    """One segment after tokenization: its ids and the position id of each token."""

    # "bos" | "text" | "sep" (whitespace-only text) | "chunk" | "passage" (a passage text that planning chose to
    # reuse as a chunk: plan.py; `Text(passage=True)` arrives as "text" with `passage` set)
    kind: str
    token_ids: tuple[int, ...]
    start: int  # position id of the first token; a segment's tokens have consecutive position ids
    encode_start: int | None = None  # chunks only: position the chunk's KV is encoded at
    public: bool = False  # chunks only: keyed in no namespace (`Chunk.public`)
    passage: bool = False  # text that may be reused as a chunk (`Text.passage`)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


def cut_at(text: str, spans: Sequence[tuple[int, int]], public: Collection[int] = ()) -> list[Text | Chunk]:
    """`text` cut at character spans (sorted, not overlapping): each span a `Chunk` (public when its start is in
    `public`), the rest `Text`, every piece tokenized on its own. Joining the pieces' texts gives `text` back."""
    out: list[Text | Chunk] = []
    cursor = 0
    for start, end in spans:
        if start > cursor:
            out.append(Text(text[cursor:start]))
        out.append(Chunk(text[start:end], public=start in public))
        cursor = end
    if cursor < len(text) or not out:
        out.append(Text(text[cursor:]))
    return out


class SegmentTokenizer:
    """Tokenizes segments on their own, with a bounded memo (chunk texts recur across requests).

    Bounded by entries and by characters, least recently used forgotten first: an entry takes about 10 bytes per
    character (the text, and its ids as a tuple of ints: 9.6 bytes per character of pydoc text, tracemalloc), so the
    default bound is about 80 MB, which a server with varied traffic reaches and stays at (at 64M characters it
    would have been 0.6 GB)."""

    def __init__(self, tokenizer, max_entries: int = 65536, max_chars: int = 8 << 20):
        self.tokenizer = tokenizer
        self.bos_id: int | None = tokenizer.bos_token_id
        self._memo: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()  # (namespace, text)
        self._max_entries = max_entries
        # Bounded by characters too: whole prompt strings pass through here, and a server sees many long ones.
        self._max_chars = max_chars
        self._chars = 0
        self._lock = threading.Lock()  # engines serve several threads; the memo's LRU order is shared state

    def memo_size(self) -> tuple[int, int]:
        """The memo's entries and the characters of their texts (`Engine.stats`)."""
        with self._lock:
            return len(self._memo), self._chars

    def ids(self, text: str, namespace: str | None = None) -> tuple[int, ...]:
        """`text`'s token ids. The memo is kept per cache namespace: a hit is faster than tokenizing, so a memo
        shared between namespaces would tell one whether another had sent the very same text."""
        key = (namespace, text)
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(text) > self._max_chars // 16:
            return ids  # too large to be worth a slot
        with self._lock:
            if key not in self._memo:
                self._memo[key] = ids
                self._chars += len(text)
            while self._memo and (len(self._memo) > self._max_entries or self._chars > self._max_chars):
                (_, old), _ = self._memo.popitem(last=False)
                self._chars -= len(old)
        return ids

    def split(self, text: str, spans: Sequence) -> list[Text | Chunk]:
        """A prompt string as segments, cut at `spans` (text_index.Span, leftmost first, not overlapping): chunks,
        passages (`Text(passage=True)`; those under MIN_PASSAGE_TOKENS tokens stay plain text) and replies this
        engine generated.

        Tokenizing pieces on their own can give tokens the joined text would not have ("Context: The" cut
        before "The" gives ':', ' ', 'The' instead of ':', ' The'), so the text is tokenized whole and each
        chunk is widened to the tokens that cover it (here the chunk takes ' The', its leading space
        included). The model sees the joined string's tokens, in every mode, and a chunk's tokens are the same
        in every prompt where the same characters surround it.

        A reply is a hard cut (see text_index.ReplyIndex): the text before it is tokenized as the string the model
        answered after, and the reply gets the ids it was generated as (or is tokenized on its own when they
        are not known). Tokenizers without offsets (slow, Python ones) tokenize each piece on its own.
        """
        out: list[Text | Chunk] = []
        cursor, chunks = 0, []
        for span in [*spans, None]:
            if span is not None and span.kind in ("chunk", "passage"):
                chunks.append(span)
                continue
            end = span.start if span is not None else len(text)
            if end > cursor or span is None:
                out += self._split_joined(text, cursor, end, chunks)
            chunks = []
            if span is not None:
                out.append(Text(text[span.start: span.end], token_ids=span.reply_ids))
                cursor = span.end
        return [s for s in out if s.text or s.token_ids]

    def _split_joined(self, full: str, a: int, b: int, chunks: list) -> list[Text | Chunk]:
        """full[a:b] tokenized whole, cut into Text and Chunk at `chunks` (widened to token boundaries)."""
        text = full[a:b]
        if not chunks:
            return [Text(text)]
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer: no offsets
            enc = None
        if enc is None or "offset_mapping" not in enc:
            # Each piece tokenized on its own (the tokens differ from the joined string's): passages, which must
            # never change what the model sees, stay in the text.
            chunks = [s for s in chunks if s.kind == "chunk"]
            if not chunks:
                return [Text(text)]
            return cut_at(text, [(s.start - a, s.end - a) for s in chunks], {s.start - a for s in chunks if s.public})
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        starts, ends = [o[0] for o in offsets], [o[1] for o in offsets]
        out: list[Text | Chunk] = []
        cut = 0  # next token not yet placed in a segment

        def char(t: int) -> int:
            return starts[t] if t < len(ids) else len(text)

        for span in chunks:
            first = bisect.bisect_right(ends, span.start - a)  # first token ending after the chunk's start
            last = bisect.bisect_left(starts, span.end - a)  # one past the last token starting before its end
            if first < cut or first >= last:
                continue  # shares a token with the previous chunk, or covers none: stays text
            if span.kind == "passage" and last - first < MIN_PASSAGE_TOKENS:
                continue  # too short to be worth a lookup: stays in the text around it
            if first > cut:
                out.append(Text(text[char(cut): char(first)], token_ids=tuple(ids[cut:first])))
            piece = text[char(first): char(last)]
            if span.kind == "passage":
                out.append(Text(piece, token_ids=tuple(ids[first:last]), passage=True))
            else:
                out.append(Chunk(piece, token_ids=tuple(ids[first:last]), public=span.public))
            cut = last
        if cut < len(ids):
            out.append(Text(text[char(cut):], token_ids=tuple(ids[cut:])))
        return out

    def segments(self, prompt: Prompt, namespace: str | None = None) -> list[TokenSegment]:
        """Tokenize a prompt and lay out position ids; a BOS sink segment comes first when the model has one.
        `namespace`: the request's cache namespace (the memo of `ids` is kept per namespace)."""
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
            ids = tuple(seg.token_ids) if seg.token_ids is not None else self.ids(seg.text, namespace)
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
                out.append(TokenSegment("chunk", ids, start, encode_start=enc, public=seg.public))
            else:
                out.append(TokenSegment("text" if seg.text.strip() else "sep", ids, start, passage=seg.passage))
            pos = start + len(ids)
        if not any(s.kind != "bos" for s in out):
            raise PromptError("the prompt has no tokens: every segment's text is empty")
        return out
