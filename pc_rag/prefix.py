"""Automatic exact prefix reuse: a request reuses the KV that any earlier request computed for the same
leading tokens, whatever the segmentation, with no registration, the earlier request's reply included.

A request's tokens (the prompt, then the reply as it is decoded) are laid out as *runs*: slots whose KV is
computed in context. In `modular`/`blend`, runs are separated by *links*: blocks relocated from the chunk
store (chunks, scaffolds, separators). A run is cut into blocks of `BLOCK_TOKENS` tokens from its first slot;
each block's key chains its parent's key with the block's token ids and position ids (vLLM's scheme), and a
link chains the relocated block's key and its place. So a key names everything its KV depends on, and a
block is only ever found after the very same tokens, laid out the same way.

Lookup (plain Python over keys, so it is tested without a model): the keys of a run's blocks are computed up
front and fetched in one batch; the longest run of hits is reused. Where the chain breaks inside a block,
`PrefixIndex` (memory only) lists the blocks stored under the last parent; the longest common token prefix
with one of them is reused too, because the KV of token i depends only on tokens <= i: the first n tokens
of any stored block are exact for a prompt that shares them. So reuse is token-exact while the blocks are in
this process's index, and loses at most BLOCK_TOKENS - 1 tokens per request when they come from a disk or
Redis tier filled by another process (only whole blocks can be found by hash there).

Why BLOCK_TOKENS = 32: see docs/results.md ("Automatic prefix reuse"); smaller blocks lose fewer tokens to
rounding in the persistent tiers but cost one store entry and one copy per block.

Extents: the persistent tiers (disk, Redis) hold a run's blocks in groups of EXTENT_BLOCKS whole blocks, aligned
to the run's first slot, one entry per group, named by `extent_key` of the group's last block key (so, like
that key, found only after exactly the same tokens); the memory tier keeps single blocks. A run's blocks
outside a whole group (its last blocks) are stored singly everywhere, as before. Why: each entry costs a
file open, a header and checks, ~150 us of Python on the read path; an 8K-token prefix was 250 files and its
reads were bound by that, not by the bytes (docs/store.md, "Extents"). The cost: a new process finds a
group only whole, so where a prompt leaves an earlier one inside a stored group it recomputes up to
EXTENT_BLOCKS * BLOCK_TOKENS - 1 tokens that the single blocks would have given it (from memory nothing changes).
To keep the common case whole, a request stores the groups near its prompt's end singly (`far_groups`): a
later, longer prompt (the chat's next turn) finds them so, and stores them as an extent in turn.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import link_key, prefix_key

BLOCK_TOKENS = 32
EXTENT_BLOCKS = 8  # 256 tokens an entry in the persistent tiers, LMCache's chunk size


@dataclass(frozen=True)
class Run:
    """Slots [start, end) computed in context. `closed`: a link follows, so the run's length is part of the
    layout and its last, shorter block is found by hash like the others; an open run (the last one, which
    the reply extends) ends where the request ended, so its short tail is only found through the index."""

    start: int
    end: int
    closed: bool


@dataclass(frozen=True)
class Link:
    """A relocated block at slots [start, end): its store key and the position id of its first token."""

    start: int
    end: int
    key: str
    position: int


@dataclass(frozen=True)
class BlockRef:
    """One prefix block of a request: slots [start, end), its key and its parent's key."""

    start: int
    end: int
    key: str
    parent: str


def run_blocks(fingerprint: str, parent: str, ids: Sequence[int], positions: Sequence[int], start: int,
               end: int, with_tail: bool, block_tokens: int = BLOCK_TOKENS) -> list[BlockRef]:
    """The chained blocks of slots [start, end): full blocks, and the shorter last one if `with_tail`."""
    out = []
    for a in range(start, end, block_tokens):
        b = min(a + block_tokens, end)
        if b - a < block_tokens and not with_tail:
            break
        key = prefix_key(fingerprint, parent, tuple(ids[a:b]), tuple(positions[a:b]))
        out.append(BlockRef(a, b, key, parent))
        parent = key
    return out


def extent_key(last: str) -> str:
    """Key of the extent (group of whole blocks) that ends with the block keyed `last`."""
    return "extent-" + last.removeprefix("prefix-")


def extents(refs: Sequence[BlockRef], block_tokens: int = BLOCK_TOKENS,
            extent_blocks: int = EXTENT_BLOCKS) -> list[tuple[int, str]]:
    """The whole groups of a run's blocks `refs` (from its first slot): (index of the group's first block in
    refs, extent key), for groups of `extent_blocks` blocks of `block_tokens` tokens each."""
    out = []
    for i in range(0, len(refs) - extent_blocks + 1, extent_blocks):
        group = refs[i: i + extent_blocks]
        if all(r.end - r.start == block_tokens for r in group):
            out.append((i, extent_key(group[-1].key)))
    return out


def in_groups(groups: list[tuple[int, str]], extent_blocks: int = EXTENT_BLOCKS) -> set[int]:
    """Indexes of the blocks that `groups` (first block index, extent key) hold."""
    return {j for i, _ in groups for j in range(i, i + extent_blocks)}


def far_groups(refs: Sequence[BlockRef], groups: list[tuple[int, str]], total: int,
               block_tokens: int = BLOCK_TOKENS, extent_blocks: int = EXTENT_BLOCKS) -> list[tuple[int, str]]:
    """The whole groups that a request stores as extents: those ending at least one extent's length before slot
    `total` (the prompt's end). The blocks after them (the prompt's last 256-511 tokens and the reply) are stored
    singly, since that is where the next prompt most often leaves this one (a new question after the same
    system prompt), and short prompts are not worth grouping."""
    return [(i, key) for i, key in groups
            if refs[i + extent_blocks - 1].end <= total - extent_blocks * block_tokens]


def after_link(parent: str, link: Link) -> str:
    return link_key(parent, link.key, link.position)


def _packed(ids: Sequence[int], positions: Sequence[int]) -> bytes:
    # Token and position ids interleaved, so one bytes comparison checks both.
    if len(ids) != len(positions):
        raise ValueError(f"{len(ids)} token ids for {len(positions)} positions")
    out = array("q", bytes(16 * len(ids)))
    out[0::2], out[1::2] = array("q", ids), array("q", positions)
    return out.tobytes()


def _common_prefix(a: bytes, b: bytes, unit: int) -> int:
    """Length, in units of `unit` bytes, of the common prefix of a and b (binary search over C slice compares)."""
    lo, hi = 0, min(len(a), len(b)) // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * unit] == b[: mid * unit]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """In memory: which blocks were stored under each parent key, with their token and position ids.

    Bounded: at most `max_blocks` blocks in all (least recently used forgotten first) and `max_children` per
    parent (a fixed system prompt followed by thousands of questions gives its last block thousands of
    children; the most recent ones are the likely matches). An entry takes about 1 KB (a 32-token block's packed
    ids, its key and the dicts' own: 980 bytes, tracemalloc), so the default holds 16 MiB and half a million
    tokens of prefixes; at 65,536 it had grown a server's memory by 64 MiB over its first 60,000 requests
    (benchmarks/soak.py). Forgetting an entry loses reuse, never
    correctness: a block's KV is always fetched from the store and its tokens checked before use.
    """

    def __init__(self, max_blocks: int = 16384, max_children: int = 64):
        self.max_blocks = max_blocks
        self.max_children = max_children
        self._children: dict[str, OrderedDict[str, bytes]] = {}
        self._lru: OrderedDict[str, str] = OrderedDict()  # block key -> parent key
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, parent: str, key: str, ids: Sequence[int], positions: Sequence[int]) -> None:
        packed = _packed(ids, positions)
        with self._lock:
            children = self._children.setdefault(parent, OrderedDict())
            children[key] = packed
            children.move_to_end(key)
            self._lru[key] = parent
            self._lru.move_to_end(key)
            while len(children) > self.max_children:
                self._forget(next(iter(children)))
            while len(self._lru) > self.max_blocks:
                self._forget(next(iter(self._lru)))

    def _forget(self, key: str) -> None:
        parent = self._lru.pop(key, None)
        children = self._children.get(parent)
        if children is not None:
            children.pop(key, None)
            if not children:
                del self._children[parent]

    def longest(self, parent: str, ids: Sequence[int], positions: Sequence[int],
                touch: bool = True) -> tuple[str, int] | None:
        """The stored child of `parent` sharing the longest token prefix with (ids, positions): (key, n), n >= 1;
        `touch`: mark it recently used (planning does not: the engine touches what a plan used, `touch(key)`)."""
        want = _packed(ids, positions)
        with self._lock:
            children = list(self._children.get(parent, {}).items())
        best = None
        for key, packed in children:
            n = _common_prefix(want, packed, 16)
            if n and (best is None or n > best[1]):
                best = (key, n)
        if best is not None and touch:
            self.touch(best[0])
        return best

    def tokens(self, key: str) -> int | None:
        """How many tokens the block `key` holds (None for a block the index does not hold)."""
        with self._lock:
            parent = self._lru.get(key)
            packed = None if parent is None else self._children[parent].get(key)
        return None if packed is None else len(packed) // 16

    def touch(self, key: str) -> None:
        """Mark a block recently used (a no-op for a block the index does not hold)."""
        with self._lock:
            parent = self._lru.get(key)
            if parent is not None:
                self._lru.move_to_end(key)
                self._children[parent].move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            self._children.clear()
            self._lru.clear()
