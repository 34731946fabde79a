"""The Redis tier over a Redis Cluster (or Valkey cluster): a request's keys split by hash slot, one pipeline per node.

`redis+cluster://host:port[,host:port...]` names seed nodes; the options are those of `redis://` (`ttl_s`, `prefix`,
`compress`). Each master node is a `RedisStore` of its own (redis_tier.py), so everything that tier does per batch
holds per node: one pipelined round trip, the batch deadline (timeout plus bytes at `min_transfer_bytes_per_s`),
damaged and wrong-type entries as corrupt misses, reads straight into the request's buffer. What this module adds:

- **The slot map**: `CLUSTER SLOTS` asked of a seed (or of any node known so far), once at the first call and again
  after a MOVED or ASK reply (a resharding, a failover) or a node that stops answering (at most once every
  `retry_after_s`). A key's slot is CRC16 of its Redis name modulo 16384, as the server computes it.
- **Fan-out**: a batch's keys are grouped by the node that owns their slot and the groups are read at the same time,
  one thread per node, each under its own deadline: a request waits for its slowest node, not for the sum.
- **A node down is misses for its slots, the rest served.** A node that fails is paused for `retry_after_s` (reads
  and writes apart, as a tier in a TieredStore: `Pauses`); its keys are misses meanwhile, and nothing is raised, so
  the TieredStore above keeps the cluster's other nodes in use; when every node is down, each is paused in turn
  and a batch costs at most one timeout every `retry_after_s`, as a single Redis does. Only a slot map that no
  node answers is raised (a TierUnavailableError: the TieredStore pauses the whole tier).
  Keys of a slot no node serves (a cluster missing a master) are misses. A redirected reply (MOVED, ASK) is a miss
  for that node's keys in that batch, and the map is refreshed; the client never follows redirects, so a batch
  costs one round trip per node whatever the cluster is doing.

Run the cluster with `cluster-require-full-coverage no`: with the default (yes) the surviving masters refuse every
command once a master has been down for `cluster-node-timeout`, and the whole tier is then a miss (docs/store.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any
from urllib.parse import quote, urlencode

from ..blocks import KVBlock
from ..errors import StoreError
from .redis_tier import MIN_TRANSFER_BYTES_PER_S, ClusterRedirectError, RedisStore, _connect, _Exchange, _within
from .tier import (
    READ,
    WRITE,
    Held,
    Pauses,
    ReadTarget,
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    check_key,
)

SLOTS = 16384


def key_slot(name: str) -> int:
    """The cluster slot of a Redis key name (CRC16/XMODEM of the name, or of its {hash tag}, modulo 16384)."""
    from redis.crc import key_slot as crc_slot  # redis-py's implementation of the cluster spec

    return crc_slot(name.encode())


class RedisClusterStore(Store):
    """`seeds`: "host:port" of one or more cluster nodes (any role); the masters are found from them. The other
    arguments are RedisStore's, applied to every node; `username`/`password` authenticate to each node;
    `retry_after_s` is how long a failing node is skipped; `query`: other options of the spec's URL, passed to
    each node's connection as a `redis://` URL's are."""

    name = "redis"
    persistent = True
    reads_in_place = True

    def __init__(
        self,
        seeds: Sequence[str],
        ttl_s: float | None = 7 * 24 * 3600,
        prefix: str = "pc_rag:",
        timeout_s: float = 0.5,
        compress: str | None = None,
        min_transfer_bytes_per_s: float = MIN_TRANSFER_BYTES_PER_S,
        username: str | None = None,
        password: str | None = None,
        retry_after_s: float = 5.0,
        query: dict[str, str] | None = None,
    ):
        seeds = [s.strip() for s in seeds if s.strip()]
        if not seeds:
            raise StoreUsageError("RedisClusterStore needs at least one seed node 'host:port'")
        for seed in seeds:
            _split_address(seed)
        self.seeds = seeds
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.min_transfer_bytes_per_s = min_transfer_bytes_per_s
        self._auth = "" if username is None and password is None else (
            f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@")
        self._query = f"?{urlencode(query)}" if query else ""
        self.url = "redis+cluster://" + ",".join(seeds)  # for messages: never the password
        self._node_options = dict(ttl_s=ttl_s, prefix=prefix, timeout_s=timeout_s, compress=compress,
                                  min_transfer_bytes_per_s=min_transfer_bytes_per_s)
        RedisStore(client=object(), **self._node_options)  # checks the options now, as a single node would
        self._nodes: dict[str, RedisStore] = {}  # address -> its tier; kept after a node leaves (its counters)
        self._slots: list[str | None] | None = None  # slot -> address of its master; None until first asked
        self._mapped_at = -float("inf")
        self._map_lock = threading.Lock()
        self._failed_seeds: list[str] = []  # nodes that did not answer CLUSTER SLOTS, last failed last (asked last)
        self._pauses = Pauses(retry_after_s, what="redis cluster node")
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)  # what no node counted: keys of a down node or of an unserved slot

    # ---- topology ---------------------------------------------------------------------------------------------
    def _node(self, address: str) -> RedisStore:
        with self._lock:
            if address not in self._nodes:
                url = f"redis://{self._auth}{address}/0{self._query}"
                self._nodes[address] = RedisStore(url, **self._node_options)
                self._nodes[address].url = f"redis://{address}"  # messages name the node, never the password
            return self._nodes[address]

    def _slot_map(self, refresh: bool = False) -> list[str | None]:
        with self._map_lock:
            stale = refresh and time.monotonic() - self._mapped_at >= self._pauses.retry_after_s
            if self._slots is None or stale:
                self._slots = self._ask_slots()
                self._mapped_at = time.monotonic()
            return self._slots

    def _ask_slots(self) -> list[str | None]:
        """CLUSTER SLOTS from the first node that answers: the seeds, then every node known so far, those that
        failed last time at the end. One deadline for all of them (each connection and handshake included), as
        for any exchange (redis_tier.py): a node that drips its answer costs the call that deadline, not one per
        node, and is asked last next time."""
        errors = []
        exchange = _Exchange(self.timeout_s, self.min_transfer_bytes_per_s)
        known = list(dict.fromkeys([*self.seeds, *self._nodes]))
        order = [a for a in known if a not in self._failed_seeds] + [a for a in self._failed_seeds if a in known]
        for address in order:
            host, port = _split_address(address)
            try:
                with _within(exchange):
                    client = _connect(f"redis://{self._auth}{address}/0{self._query}", self.timeout_s)
                    try:
                        reply = client.execute_command("CLUSTER SLOTS")
                    finally:
                        client.close()
            except Exception as e:  # any failure: the next node
                errors.append(f"{address}: {type(e).__name__}: {e}")
                self._failed_seeds = [a for a in self._failed_seeds if a != address] + [address]
                if exchange.left_s() <= 0:
                    break
                continue
            self._failed_seeds = [a for a in self._failed_seeds if a != address]
            return _parse_slots(reply, host)
        with self._lock:
            self.stats.errors += 1
        raise TierUnavailableError(f"redis cluster {self.url}: no node answered CLUSTER SLOTS ({'; '.join(errors)})")

    def _groups(self, keys: Sequence[str]) -> dict[str | None, list[int]]:
        """Indices of `keys` by the address of the master that owns their slot (None: no node serves it)."""
        slots = self._slot_map()
        groups: dict[str | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(slots[key_slot(self.prefix + check_key(key))], []).append(i)
        return groups

    # ---- fan-out ----------------------------------------------------------------------------------------------
    def _fan_out(self, op: str, keys: Sequence[str], call: Callable[[RedisStore, list[int]], list], empty: Any,
                 count_misses: bool = True, pause: bool = True) -> list:
        """`call(node, indices)` for each node's share of `keys`, the nodes at once; its answers in `keys`' order.
        A node that is paused, fails, or redirects answers `empty` for its keys (a miss), and so do keys of a slot
        no node serves. Raised: what a call raises that is not a store failure (a sink's own error), and the slot
        map's failure (no node answers it: the tier as a whole is down, and the TieredStore pauses it)."""
        direction = READ if op == "get" else WRITE
        out = [empty] * len(keys)
        groups = self._groups(keys)
        lost = len(groups.pop(None, []))
        asked = {a: idx for a, idx in groups.items() if not pause or self._pauses.usable(a, direction)}
        lost += sum(len(idx) for a, idx in groups.items() if a not in asked)

        def one(address: str, idx: list[int]) -> tuple[list | None, StoreError | None]:
            try:
                return call(self._node(address), idx), None
            except StoreError as e:
                return None, e

        items = list(asked.items())
        if len(items) > 1:
            results = list(self._executor().map(lambda item: one(*item), items))
        else:
            results = [one(*item) for item in items]
        for (address, idx), (answers, error) in zip(items, results, strict=True):
            if error is None:
                if pause:
                    self._pauses.succeeded(address, address, direction)
                for i, answer in zip(idx, answers, strict=True):
                    out[i] = answer
                continue
            lost += len(idx)
            if isinstance(error, ClusterRedirectError):  # the map moved: not the node's fault
                self._refresh_later()
            elif pause:
                self._pauses.failed(address, address, op, error)
                if isinstance(error, TierUnavailableError):  # a failover may have moved its slots
                    self._refresh_later()
        if count_misses and lost:
            with self._lock:
                self.stats.misses += lost
        return out

    def _refresh_later(self) -> None:
        """Asks for the slot map again now (rate-limited); a failure here leaves the old map in place."""
        try:
            self._slot_map(refresh=True)
        except StoreError:
            pass

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pc_rag-redis-node")
            return self._pool

    # ---- the Store interface ------------------------------------------------------------------------------------
    def get(self, key: str) -> KVBlock | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str], count: bool = True) -> list[KVBlock | None]:
        return self._fan_out("get", keys, lambda node, idx: node.get_many([keys[i] for i in idx], count), None,
                             count_misses=count)

    def reread(self, keys: list[str]) -> list[KVBlock | None]:
        return self.get_many(keys, count=False)

    def locate(self, keys: list[str]) -> list[bool]:
        return self._fan_out("get", keys, lambda node, idx: node.locate([keys[i] for i in idx]), False)

    def where(self, keys: Sequence[str], tiers: str = "all") -> list[Held | None]:
        keys = list(keys)
        if not self._of_kind(tiers):
            return [None] * len(keys)
        return self._fan_out("get", keys, lambda node, idx: node.where([keys[i] for i in idx]), None,
                             count_misses=False, pause=False)

    def read_into(self, keys: list[str], sinks: list[ReadTarget | Callable[[KVBlock], bool]]) -> list[bool]:
        return self._fan_out("get", keys, lambda node, idx: node.read_into([keys[i] for i in idx],
                                                                           [sinks[i] for i in idx]), False)

    def put(self, key: str, block: KVBlock) -> None:
        self._fan_out("put", [key], lambda node, idx: [node.put(key, block)], None, count_misses=False)

    def clear(self) -> None:
        """Deletes every key under this store's prefix on every master (all processes)."""
        for address in sorted({a for a in self._slot_map() if a is not None}):
            self._node(address).clear()

    def server_usage(self) -> tuple[int, int]:
        """(used_memory bytes, number of keys) summed over the masters."""
        usage = [self._node(a).server_usage() for a in sorted({a for a in self._slot_map() if a is not None})]
        return sum(u[0] for u in usage), sum(u[1] for u in usage)

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            parts = [self.stats, *(s for node in self._nodes.values() for s in node.tier_stats())]
            total = TierStats(self.name)
            for f in fields(TierStats):
                if f.name != "name":
                    setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
            return [total]


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise StoreUsageError(f"bad redis cluster node {address!r}: write host:port, e.g. 10.0.0.3:6379")
    return host.strip("[]"), int(port)


def _parse_slots(reply, asked_host: str) -> list[str | None]:
    """CLUSTER SLOTS (`[[first, last, [host, port, id, ...], replicas...], ...]`) as slot -> master address. A node
    that announces no host (an empty string) is at the address it was asked at, as the cluster spec says."""
    slots: list[str | None] = [None] * SLOTS
    for entry in reply:
        first, last, master = int(entry[0]), int(entry[1]), entry[2]
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        address = f"{host or asked_host}:{int(master[1])}"
        slots[first:last + 1] = [address] * (last - first + 1)
    return slots
