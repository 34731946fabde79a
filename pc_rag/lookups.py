"""The store as planning asks it (`plan.Lookups`), two ways.

`StoreLookups`, for a request: lookups as the engine runs them (hits counted, lower-tier hits promoted, blocks on
disk or in Redis left unread for a read straight into the request buffer); it keeps the blocks its answers name,
which the build then copies or reads into the request's cache.
`WhereLookups`, for `Engine.explain`: only asks which tier holds each key (`Store.where`), so explaining a request
reads, counts, promotes and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .blocks import KVBlock
from .plan import Found
from .store import PendingBlock, Store


class StoreLookups:
    """`plan.Lookups` over `store` for one request. `blocks`: what the answers named, by key: blocks in hand
    (placed by `place`, e.g. on the model's device) and PendingBlocks (read later by `Store.read_pending`).
    `direct`: blocks a tier can read in place are left unread (else every block is read at lookup)."""

    def __init__(self, store: Store, place: Callable[[KVBlock], KVBlock], direct: bool = True):
        self.store = store
        self.place = place
        self.direct = direct
        self.has_persistent = store.has_persistent
        self.blocks: dict[str, KVBlock | PendingBlock] = {}

    def find(self, keys: Sequence[str], tiers: str = "all") -> list[Found | None]:
        keys = list(keys)
        ask = self.store.find_many_with_source if self.direct else self.store.get_many_with_source
        return [self._keep(key, block, origin) for key, (block, origin) in zip(keys, ask(keys, tiers), strict=True)]

    def get(self, key: str) -> Found | None:
        return self._keep(key, *self.store.get_with_source(key))

    def _keep(self, key: str, block: KVBlock | PendingBlock | None, origin: str | None) -> Found | None:
        if block is None:
            return None
        if isinstance(block, PendingBlock):
            self.blocks[key] = block
            return Found(origin, None, direct=True)
        block = self.place(block)
        self.blocks[key] = block
        return Found(origin, block.token_ids)


class WhereLookups:
    """`plan.Lookups` that only asks where each key is held (`Store.where`). Blocks are not read, so their tokens
    are not checked: a foreign entry under a colliding key (never seen in practice: keys are 160-bit hashes of
    the tokens) would show as a hit here and be recomputed by the request."""

    def __init__(self, store: Store, direct: bool = True):
        self.store = store
        self.direct = direct
        self.has_persistent = store.has_persistent

    def find(self, keys: Sequence[str], tiers: str = "all") -> list[Found | None]:
        return [None if held is None else Found(held.tier, None, self.direct and held.in_place)
                for held in self.store.where(list(keys), tiers)]

    def get(self, key: str) -> Found | None:
        held = self.store.where([key])[0]
        return None if held is None else Found(held.tier)
