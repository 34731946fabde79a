"""Spec strings -> stores: how a user or a config file says where KV blocks are cached."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from .disk import DiskStore
from .memory import MemoryStore
from .redis_cluster import RedisClusterStore
from .redis_tier import RedisStore
from .tier import Store, StoreUsageError, as_store, looks_like_store
from .tiered import TieredStore

SPEC_HELP = (
    "a store spec is 'memory', 'memory:<size>' (option ?policy=lru|gdsf), 'disk', 'disk:<path>', "
    "'disk:<path>?max_bytes=<size>&compress=int8', "
    "'redis://host:port/db' (options ?ttl_s=<s>&prefix=<p>&compress=int8), 'redis+cluster://host:port,host:port' "
    "(the same options), a list of those (top tier first), or a "
    "store object; sizes are bytes or use KB/MB/GB/TB or KiB/MiB/GiB/TiB"
)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def default_cache_dir() -> Path:
    """$PC_RAG_CACHE_DIR, else $XDG_CACHE_HOME/pc_rag, else ~/.cache/pc_rag."""
    if os.environ.get("PC_RAG_CACHE_DIR"):
        return Path(os.environ["PC_RAG_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pc_rag"


def disk_folder(store: Store) -> Path | None:
    """The folder of the store's first disk tier (a DiskStore, alone or in a TieredStore), else None: where files
    that belong beside the cached blocks are kept (the engine's APE calibrations)."""
    for tier in getattr(store, "tiers", [store]):
        if isinstance(tier, DiskStore):
            return tier.path
    return None


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise StoreUsageError(f"bad size {text!r}: use bytes (e.g. 500000000) or a unit like 4GiB, 500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def open_store(spec: str | Store | Sequence[str | Store] | None = None) -> Store:
    """The store the engine should use.

    - None: memory (4 GiB) over disk (20 GiB) under `default_cache_dir()` ($PC_RAG_CACHE_DIR,
      $XDG_CACHE_HOME/pc_rag or ~/.cache/pc_rag).
    - a store object: a `Store` subclass is used as is; any other object with get/put/clear/tier_stats (a
      duck-typed store of one's own) is seen through the Store interface (`as_store`: its own methods, the
      defaults for the rest).
    - "memory" (4 GiB), "memory:2GiB", "memory?max_bytes=2GiB&ttl_s=600", "memory:2GiB?policy=gdsf" (which block
      leaves first: pc_rag.store.memory).
    - "disk" (default directory), "disk:/path/to/dir", "disk:/path?max_bytes=50GiB"; `compress=int8` stores
      8-bit keys and values with scales (lossy, about a quarter of float32's bytes; see docs/store.md).
    - "redis://host:6379/0", "redis://host:6379/0?ttl_s=86400&prefix=pc_rag:&compress=int8" (also rediss://); the size
      bound is the server's maxmemory with maxmemory-policy allkeys-lru.
    - "redis+cluster://host:7000,host:7001" (seed nodes of a Redis Cluster or Valkey cluster; the options of
      redis://): a request's keys are split by hash slot over the masters, one pipeline per node (redis_cluster.py).
    - a list of the above: tiers, top first, e.g. ["memory:8GiB", "disk:/data/kv", "redis://cache:6379/0"].

    Strings and lists give a TieredStore (even for one tier), so a failing tier degrades to a miss.
    """
    if spec is None:
        return TieredStore([MemoryStore(), DiskStore(default_cache_dir())])
    if isinstance(spec, str):
        return TieredStore([_open_tier(spec)])
    if isinstance(spec, Sequence):
        return TieredStore([_open_tier(s) for s in spec])
    if looks_like_store(spec):
        return as_store(spec)
    raise StoreUsageError(f"cannot make a store from {type(spec).__name__}: {SPEC_HELP}")


def _open_tier(spec: str | Store) -> Store:
    if looks_like_store(spec):
        return as_store(spec)
    if not isinstance(spec, str):
        raise StoreUsageError(f"cannot make a store tier from {type(spec).__name__}: {SPEC_HELP}")
    if spec.startswith(("redis://", "rediss://", "redis+cluster://")):
        parts = urlsplit(spec)
        query = dict(parse_qsl(parts.query))
        ttl = query.pop("ttl_s", None)
        kwargs = {"prefix": query.pop("prefix")} if "prefix" in query else {}
        if "compress" in query:
            kwargs["compress"] = query.pop("compress")
        kwargs["ttl_s"] = _number(ttl, spec) if ttl not in (None, "none") else None
        if parts.scheme == "redis+cluster":
            return _cluster(spec, parts, query, kwargs)
        url = urlunsplit(parts._replace(query=urlencode(query)))
        return RedisStore(url, **kwargs)
    kind, _, rest = spec.partition(":")
    location, _, query_text = rest.partition("?")
    if "?" in kind:
        kind, _, query_text = kind.partition("?")
    options = dict(parse_qsl(query_text))
    max_bytes = parse_bytes(options.pop("max_bytes")) if "max_bytes" in options else None
    if kind == "memory":
        ttl = options.pop("ttl_s", None)
        policy = options.pop("policy", "gdsf")
        _no_extra(options, spec)
        if location:
            max_bytes = parse_bytes(location)
        return MemoryStore(
            **({"max_bytes": max_bytes} if max_bytes is not None else {}),
            ttl_s=_number(ttl, spec) if ttl is not None else None, policy=policy,
        )
    if kind == "disk":
        compress = options.pop("compress", None)
        _no_extra(options, spec)
        path = Path(location).expanduser() if location else default_cache_dir()
        return DiskStore(path, **({"max_bytes": max_bytes} if max_bytes is not None else {}), compress=compress)
    raise StoreUsageError(f"unknown store spec {spec!r}: {SPEC_HELP}")


def _cluster(spec: str, parts, query: dict[str, str], kwargs: dict) -> RedisClusterStore:
    """redis+cluster://[user:password@]host:port[,host:port...][/0][?options]: a cluster has database 0 only."""
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if parts.path.strip("/") not in ("", "0"):
        raise StoreUsageError(f"a Redis Cluster has database 0 only, not {parts.path.strip('/')!r}, in store spec "
                              f"{spec!r}")
    if userinfo:
        user, _, password = userinfo.partition(":")
        kwargs.update(username=unquote(user) or None, password=unquote(password) or None)
    return RedisClusterStore(hosts.split(","), query=query, **kwargs)


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise StoreUsageError(f"bad number {text!r} in store spec {spec!r}: {SPEC_HELP}") from None


def _no_extra(options: dict[str, str], spec: str) -> None:
    if options:
        raise StoreUsageError(f"unknown option(s) {sorted(options)} in store spec {spec!r}: {SPEC_HELP}")
