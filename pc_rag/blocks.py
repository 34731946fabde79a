"""KV blocks: the cached unit, and the keys that say what a block's KV depends on.

A block holds the keys and values of one segment for every layer, stacked so that copying or relocating it
is one tensor op over all layers:  keys, values: [layers, kv_heads, tokens, head_dim].
Keys are stored after RoPE, at positions `start .. start+tokens-1` (HF applies RoPE before the cache).
Storage treats blocks as plain tensors plus metadata and never needs the model.

Namespaces: a request may carry one (`cache_salt=`; `pc-rag serve` gives each tenant its own). It is mixed into
the key of every chunk and scaffold block and into the root of the prefix chain (`root_key`), so every prefix
block, link and extent key after it differs too: a request finds only what requests of its own namespace stored,
in every tier, whatever process wrote it. No namespace (None) gives the keys of earlier versions exactly; it is
also the namespace of public chunks (documents an operator declared shared across namespaces).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import torch

# Bump when the way blocks are encoded changes (sink prefix, position layout): old entries then never match.
# 2: prefix blocks are fixed-size token blocks keyed with their position ids (was: one node per segment).
SCHEME_VERSION = 2


@dataclass(frozen=True)
class KVBlock:
    keys: torch.Tensor  # [L, H_kv, T, D], RoPE applied at positions start..start+T-1
    values: torch.Tensor  # [L, H_kv, T, D]
    token_ids: tuple[int, ...]
    start: int
    meta: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=20)
    for p in parts:
        h.update(struct.pack("<Q", len(p)))  # length-prefixed, so ("ab","c") != ("a","bc")
        h.update(p)
    return h.hexdigest()


def _ids_bytes(ids: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def _in_namespace(namespace: str | None) -> tuple[bytes, ...]:
    # Appended parts: with none, a key's digest is exactly what it was before namespaces.
    return () if namespace is None else (b"namespace", namespace.encode())


def chunk_key(fingerprint: str, token_ids: tuple[int, ...], context_ids: tuple[int, ...], start: int,
              namespace: str | None = None) -> str:
    """Key of a chunk encoded on its own: after `context_ids` (the sink prefix), first token at `start`."""
    return "chunk-" + _digest(
        b"chunk", str(SCHEME_VERSION).encode(), fingerprint.encode(),
        _ids_bytes(context_ids), str(start).encode(), _ids_bytes(token_ids), *_in_namespace(namespace),
    )


def tenant_namespace(tenant: str | None, salt: str | None = None) -> str | None:
    """The cache namespace `pc-rag serve` gives a request: its tenant's (the tenant of its API key), narrowed by the
    request's `cache_salt`, never widened: every (tenant, salt) pair is a namespace of its own, and no salt reaches
    another tenant's. Without a tenant (a server without keys, or `--shared-cache`): None without a salt (the
    namespace of `pc-rag warm` and of engine calls without one), else the salt's own. Digests, so that no salt a
    client sends equals a tenant's namespace, and every namespace is 45 or 47 characters whatever the names' lengths."""
    if tenant is None:
        return None if salt is None else "salt-" + _digest(b"salt", salt.encode())
    return "tenant-" + _digest(b"tenant", tenant.encode(), *(() if salt is None else (b"salt", salt.encode())))


def root_key(fingerprint: str, namespace: str | None = None) -> str:
    """The parent of a prompt's first prefix block: every prefix, link and extent key chains from it, so a
    namespace here keeps the whole chain apart. Never a store key itself."""
    if namespace is None:
        return "root-" + fingerprint
    return "root-" + _digest(b"root", str(SCHEME_VERSION).encode(), fingerprint.encode(), *_in_namespace(namespace))


def prefix_key(fingerprint: str, parent: str, token_ids: tuple[int, ...], positions: tuple[int, ...]) -> str:
    """Key of one block of the exact-prefix chain: chained to its parent's key, as vLLM chains block hashes,
    so a block's KV (computed after the whole prefix) is only ever found after that same prefix."""
    return "prefix-" + _digest(
        b"prefix", str(SCHEME_VERSION).encode(), fingerprint.encode(),
        parent.encode(), _ids_bytes(positions), _ids_bytes(token_ids),
    )


def link_key(parent: str, block_key: str, start: int) -> str:
    """Chain key after a relocated block (a chunk, scaffold or separator at position `start`): what follows it
    was computed over that block's relocated KV, so it may only be reused after the same block at the same place."""
    return "link-" + _digest(b"link", str(SCHEME_VERSION).encode(), parent.encode(), block_key.encode(),
                             str(start).encode())


def scaffold_key(fingerprint: str, segment_ids: list[tuple[int, ...]], context_ids: tuple[int, ...], start: int,
                 namespace: str | None = None) -> str:
    """Key of a scaffold group encoded jointly: its segments (chunks and the text between them) in order."""
    return "scaffold-" + _digest(
        b"scaffold", str(SCHEME_VERSION).encode(), fingerprint.encode(),
        _ids_bytes(context_ids), str(start).encode(), *(_ids_bytes(ids) for ids in segment_ids),
        *_in_namespace(namespace),
    )
