"""The disk tier: one safetensors file per block, `<dir>/<key>.safetensors`, persistent across restarts.

Writes go to a temporary file in the same directory and are renamed over the target (`os.replace`), so a
reader sees either no file or a whole one; a crash mid-write leaves at most a `.tmp` file, removed by the
next start. There is no fsync: after a power loss a file can be short or zeroed, which the checksum
catches (counted as corrupt, removed, a miss).

The byte bound is LRU over an in-memory index (key -> file size) rebuilt from the directory on start and
ordered by file mtime; a hit touches the file's mtime so the order survives restarts. Several processes
may share a directory: a get always looks at the file itself, so entries written by another process are
found. Each process enforces the bound over the files it knows (those present at its start, plus those it
wrote or read since), so with several writers the directory can exceed the bound by what the others wrote
since this process started, until they evict too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from ..blocks import KVBlock
from ..errors import StoreError
from .codec import CorruptBlockError, decode_block, encode_block
from .tier import KEY_PATTERN, StoreUsageError, TierStats, check_key

log = logging.getLogger("pc_rag.store")

SUFFIX = ".safetensors"
STALE_TMP_S = 3600.0  # a temp file this old belongs to a writer that died


class DiskStore:
    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int = 20 << 30):
        if max_bytes < 0:
            raise StoreUsageError(f"DiskStore needs max_bytes >= 0, got {max_bytes}")
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        # An unwritable or missing directory is not an error here: the store is built at engine start and
        # must not fail it; get/put then raise StoreError, which the tiered store treats as a miss.
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            found = []
            now = time.time()
            with os.scandir(self.path) as it:
                for entry in it:
                    if entry.name.endswith(".tmp") and now - entry.stat().st_mtime > STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    key = entry.name.removesuffix(SUFFIX)
                    if entry.name.endswith(SUFFIX) and KEY_PATTERN.fullmatch(key) and entry.is_file():
                        st = entry.stat()
                        found.append((st.st_mtime_ns, key, st.st_size))
        except OSError as e:
            log.debug("disk store %s: cannot scan (%s)", self.path, e)
            return
        with self._lock:
            for _, key, size in sorted(found):
                self._index[key] = size
            self.stats.bytes_held = sum(self._index.values())
            self.stats.entries = len(self._index)
            self._unlink(self._evict_over_bound())  # a previous run may have used a larger bound

    def file_for(self, key: str) -> Path:
        return self.path / (check_key(key) + SUFFIX)

    def get(self, key: str) -> KVBlock | None:
        path = self.file_for(key)
        t0 = time.perf_counter()
        try:
            # One readinto() an uninitialised uint8 tensor that the block's tensors then view (decode_block;
            # a bytearray would be zero-filled first: one more pass over the data). Not an mmap
            # (safetensors' load_file): it pins the file, would change under the tensor if the file were
            # rewritten in place, and (measured) faulting the pages in was slower than one read.
            with open(path, "rb") as f:
                data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
                data = data[: f.readinto(data.numpy())]  # short read: a truncated file, caught by the checks
        except FileNotFoundError:
            with self._lock:
                self._forget(key)  # evicted by another process, or never written
                self.stats.misses += 1
            return None
        except OSError as e:
            self._count_error()
            raise StoreError(f"disk store cannot read {path}: {e}") from e
        try:
            block = decode_block(key, data)
        except CorruptBlockError as e:
            log.warning("disk store: removing %s: %s", path, e)
            with self._lock:
                self._unlink([path])
                self._forget(key)
                self.stats.corrupt += 1
                self.stats.misses += 1
            return None
        with self._lock:
            # The file may have been evicted by another thread since it was read: the bytes read are still a
            # whole, checked block (served), but the index must only list files that exist.
            try:
                os.utime(path)  # LRU order for the next start
                present = True
            except FileNotFoundError:
                present = False
            except OSError:
                present = True  # a read-only cache still serves hits
            if present:
                self._account(key, len(data))
            self.stats.hits += 1
            self.stats.load_s += time.perf_counter() - t0
        return block

    def put(self, key: str, block: KVBlock) -> None:
        path = self.file_for(key)
        data = encode_block(key, block)
        if len(data) > self.max_bytes:
            return  # larger than the whole budget
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            try:
                self._write(tmp, data)
            except FileNotFoundError:  # the directory was removed while running: recreate it once
                self.path.mkdir(parents=True, exist_ok=True)
                self._write(tmp, data)
            # The slow write above is outside the lock; the rename, the index update and the eviction's
            # unlinks are inside it, so no thread can unlink a file that another just renamed into place
            # (which would leave the index listing a file that is gone).
            with self._lock:
                os.replace(tmp, path)
                self._account(key, len(data))
                self._unlink(self._evict_over_bound())
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._count_error()
            raise StoreError(f"disk store cannot write {path}: {e}") from e

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)

    def _account(self, key: str, size: int) -> None:
        self._forget(key)
        self._index[key] = size
        self.stats.bytes_held += size
        self.stats.entries = len(self._index)

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.stats.bytes_held -= size
            self.stats.entries = len(self._index)

    def _evict_over_bound(self) -> list[Path]:
        victims = []
        while self.stats.bytes_held > self.max_bytes and self._index:
            key = next(iter(self._index))
            self._forget(key)
            self.stats.evictions += 1
            victims.append(self.path / (key + SUFFIX))
        return victims

    def _unlink(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                log.debug("disk store: cannot remove %s (%s)", p, e)

    def _count_error(self) -> None:
        with self._lock:
            self.stats.errors += 1

    def clear(self) -> None:
        """Removes this store's block files (only `<key>.safetensors` names; other files are left alone)."""
        with self._lock:  # as put: no rename can land between the listing and the unlinks
            keys = list(self._index)
            self._index.clear()
            self.stats.bytes_held = 0
            self.stats.entries = 0
            try:
                with os.scandir(self.path) as it:
                    keys += [e.name.removesuffix(SUFFIX) for e in it if e.name.endswith(SUFFIX)]
            except OSError as e:
                raise StoreError(f"disk store cannot list {self.path}: {e}") from e
            self._unlink([self.path / (k + SUFFIX) for k in set(keys) if KEY_PATTERN.fullmatch(k)])

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]
