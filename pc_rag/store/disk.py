"""The disk tier: one safetensors file per block, persistent across restarts.

The store owns one subfolder of the folder it is given, and only the names of one pattern in it:

    <dir>/pc_rag-kv-v1/kv-<key>.safetensors              a block
    <dir>/pc_rag-kv-v1/.kv-<key>.<pid>.<thread>.tmp      a write in progress

Nothing else is ever indexed, counted, evicted or removed, whatever `<dir>` or the subfolder hold: a
`--cache-dir` pointed at a checkpoint folder by mistake costs one new subfolder, never a file. Blocks of the
layout before this one (`<dir>/<key>.safetensors`) are ignored: delete them by hand if they are yours.

Reading trusts no entry: only a regular file is opened (never followed through a symlink, never blocking on
a FIFO), and its size must be what its safetensors header declares before any data is read. A directory, a
FIFO, a symlink, a truncated, padded or sparse file under a block's name is a corrupt entry: counted,
removed where that is safe (a directory only if empty), a miss; the tier stays up.

Writes go to a temporary file in the same folder and are renamed over the target (`os.replace`), so a
reader sees either no file or a whole one; a crash mid-write leaves at most a `.tmp` file, removed by the
next start. There is no fsync: after a power loss a file can be short or zeroed, which the size and
checksum checks catch (counted as corrupt, removed, a miss).

`get_many` returns blocks of their own (each file read into a fresh buffer that the block's tensors view).
`locate` and `read_into` serve the engine's exact-prefix blocks instead: `locate` only says which entries
exist, and `read_into` later reads each file into a staging buffer reused by its reader thread, checks it
there exactly as `get_many` does, and hands the block to the caller's sink, which copies it into the request's
KV buffer; so a request from disk faults in no fresh memory (which cost more than the reads themselves).

The byte bound is LRU over an in-memory index (key -> file size) rebuilt from the folder on start and
ordered by file mtime (a file whose blocks on disk hold far less than its size, a sparse file, is a corrupt
entry there, removed, never counted: a 64 GiB sparse file under a block's name evicted every valid block); a
hit touches the file's mtime so the order survives restarts. Several processes may share a folder: a get
always looks at the file itself, so entries written by another process are found. Each process enforces the
bound over the files it knows (those present at its start, plus those it wrote or read since), so with several
writers the folder can exceed the bound by what the others wrote since this process started, until they evict
too.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..blocks import KVBlock
from ..errors import StoreError
from .codec import (
    CorruptBlockError,
    StaleBlockError,
    check_layout,
    checksum,
    declared_size,
    decode_block,
    encode_block,
    header_length,
    read_layout,
    slots_fit,
    tier_codec,
)
from .tier import (
    KEY_PATTERN,
    ReadTarget,
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    add_time,
    check_key,
    in_parallel,
)

log = logging.getLogger("pc_rag.store")

BLOCKS_DIR = "pc_rag-kv-v1"  # bump with the file name scheme: an old layout is then ignored, never misread
_BLOCK_NAME = re.compile(rf"kv-({KEY_PATTERN.pattern})\.safetensors")
_TMP_NAME = re.compile(rf"\.kv-({KEY_PATTERN.pattern})\.\d+\.\d+\.tmp")
STALE_TMP_S = 3600.0  # a temp file this old belongs to a writer that died
# A block file is written whole, so the disk holds all its bytes; one holding less than an eighth of its size
# (and over 1 MiB short) has holes. Compressing filesystems (ZFS, btrfs) store KV at close to its size: float
# and int8 KV is noise to lz4 and zstd, far from 8x.
SPARSE_RATIO = 8
SPARSE_SLACK_BYTES = 1 << 20

# O_NOFOLLOW: a symlink under a block's name is refused, not followed out of the cache. O_NONBLOCK: opening
# a FIFO returns at once instead of waiting for a writer (no effect on regular files). Both are POSIX only.
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
# O_EXCL: never write through anything already at the temp name (a symlink or FIFO left there).
_WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def block_file_name(key: str) -> str:
    return f"kv-{check_key(key)}.safetensors"


def block_files(path: str | os.PathLike) -> list[tuple[Path, int]]:
    """The block files a DiskStore opened on `path` owns, with their sizes: regular files named
    `kv-<key>.safetensors` in `path/pc_rag-kv-v1`. Creates nothing; [] when that folder is missing or
    cannot be listed."""
    folder = Path(path).expanduser() / BLOCKS_DIR
    try:
        return [(folder / name, st.st_size) for name, st in _scan(folder, _BLOCK_NAME) if stat.S_ISREG(st.st_mode)]
    except OSError:
        return []


def _sparse(st: os.stat_result) -> bool:
    """Whether a file's blocks on disk hold far less than its size (st_blocks counts 512-byte units on Linux and
    macOS; a platform without it is not checked)."""
    blocks = getattr(st, "st_blocks", None)
    if blocks is None:
        return False
    on_disk = blocks * 512
    return st.st_size - on_disk > SPARSE_SLACK_BYTES and on_disk * SPARSE_RATIO < st.st_size


def _scan(folder: Path, pattern: re.Pattern) -> Iterator[tuple[str, os.stat_result]]:
    """(name, lstat) of the entries of `folder` whose name matches `pattern`; other names are not even
    stat'ed. An entry that cannot be stat'ed (removed meanwhile by another process, an I/O error) is skipped,
    not fatal: the rest of the folder is still listed. Raises OSError only if the folder cannot be opened."""
    with os.scandir(folder) as it:
        while True:
            try:
                entry = next(it)
            except StopIteration:
                return
            except OSError as e:  # reading the folder failed midway: keep what was listed
                log.debug("disk store: listing %s stopped early (%s)", folder, e)
                return
            if not pattern.fullmatch(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                log.debug("disk store: skipping %s (%s)", entry.path, e)
                continue
            yield entry.name, st


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "non-regular file"


# Reads straight into a caller's buffer (`DiskStore.read_into`) land first in one staging buffer per thread,
# reused from block to block. A fresh buffer per block is memory the kernel must fault in and zero on first
# touch (~0.4 us per 4 KiB page): measured, reading the 250 files of an 8K-token exact prefix took ~93 ms into
# fresh buffers and ~12 ms into a reused one. A file above STAGING_MAX_BYTES is read into fresh memory instead,
# so no thread keeps a large buffer alive (exact-prefix blocks are 32 tokens: 4 MiB for an 8B model in bf16).
STAGING_MAX_BYTES = 32 << 20
_staging = threading.local()


def _staging_buffer(size: int) -> torch.Tensor:
    """`size` bytes of this thread's staging buffer (grown when a file is larger): valid until this thread's
    next read."""
    buf = getattr(_staging, "buffer", None)
    if buf is None or buf.numel() < size:
        if size > STAGING_MAX_BYTES:
            return torch.empty(size, dtype=torch.uint8)
        buf = _staging.buffer = torch.empty(-(-size // 65536) * 65536, dtype=torch.uint8)
    return buf[:size]


def _open_block(path: Path) -> tuple[int, int]:
    """(fd, size) of a block file, opened once it is known to be a regular file. Raises CorruptBlockError for any
    other entry (FIFO, directory, symlink, device), FileNotFoundError when there is none, OSError when opening
    fails. The caller closes the fd."""
    st = os.lstat(path)  # before open(): a FIFO or a device is never opened at all
    if not stat.S_ISREG(st.st_mode):
        raise CorruptBlockError(f"{path.name} is a {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise CorruptBlockError(f"{path.name} is a symlink, not a regular file") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
        os.close(fd)
        raise CorruptBlockError(f"{path.name} is a {_kind(st.st_mode)}, not a regular file")
    return fd, st.st_size


def read_block_file(path: Path, timings: dict[str, float] | None = None, staging: bool = False) -> torch.Tensor:
    """The bytes of a block file, as a uint8 tensor, read once the entry is known to be a regular file whose
    size is what its safetensors header declares. Raises CorruptBlockError for any other entry (FIFO,
    directory, symlink, device; a header that is implausible or disagrees with the file size),
    FileNotFoundError when there is none, OSError when reading fails. `timings`, when given, gets the seconds
    spent opening and checking the entry (`open_s`) and reading its bytes (`read_s`) added. `staging`: read
    into this thread's reused staging buffer (the result is then only valid until the thread's next read)."""
    t0 = time.perf_counter()
    fd, size = _open_block(path)
    # One readinto() an uninitialised uint8 tensor that the block's tensors then view (decode_block; a
    # bytearray would be zero-filled first: one more pass over the data). Not an mmap (safetensors'
    # load_file): it pins the file, would change under the tensor if the file were rewritten in place, and
    # (measured) faulting the pages in was slower than one read. Nor a buffer with transparent huge pages:
    # measured slower too (4.5 against 8 GB/s), since malloc reuses the pages of freed blocks anyway.
    with open(fd, "rb", buffering=0) as f:
        n = header_length(f.read(8))
        if 8 + n > size:
            raise CorruptBlockError(f"header of {n} bytes in a file of {size}")
        expected = declared_size(f.read(n))
        if expected != size:
            raise CorruptBlockError(f"file is {size} bytes, its header declares {expected}")
        f.seek(0)
        t1 = time.perf_counter()
        data = _staging_buffer(size) if staging else torch.empty(size, dtype=torch.uint8)
        view, got = memoryview(data.numpy()), 0
        while got < size:  # one read() returns at most ~2 GiB on Linux
            chunk = f.readinto(view[got:])
            if not chunk:
                break
            got += chunk
    add_time(timings, "open_s", t1 - t0)
    add_time(timings, "read_s", time.perf_counter() - t1)
    return data[:got]  # short: the file shrank while read, caught by decode_block's checks


# In-place reads (`read_into` with a ReadTarget that names its slots) scatter a file's data section over the slots'
# [T, D] planes with preadv: one copy from the page cache and one checksum pass over the slots, where the staged
# path adds a copy from the staging buffer into the slots. Where preadv is missing (Windows, older macOS) every
# read is staged.
_IOV_MAX = 1024  # POSIX's IOV_MAX on Linux; a block of more planes is read in several calls
_IN_PLACE = hasattr(os, "preadv")
_HEAD_BYTES = 4096  # our headers are under 1 KB: one pread gets the length prefix and the header


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of `t`'s whole storage, writable."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(storage.numpy())


@functools.lru_cache(maxsize=64)
def _plane_offsets(item: int, s0: int, s1: int, L: int, H: int) -> tuple[int, ...]:
    """Byte offsets of the (l, h) planes from a block's first byte; the same for every block of a request buffer."""
    return tuple((i * s0 + j * s1) * item for i in range(L) for j in range(H))


def _planes(t: torch.Tensor, raw: memoryview) -> list[memoryview] | None:
    """The [T, D] planes of a [L, H, T, D] tensor as slices of `raw` (its storage's bytes), in (l, h) order; None
    when they are not each contiguous."""
    L, H, T, D = t.shape
    if t.stride(3) != 1 or (T > 1 and t.stride(2) != D):
        return None
    item = t.element_size()
    base, n = t.storage_offset() * item, T * D * item
    return [raw[base + o: base + o + n] for o in _plane_offsets(item, t.stride(0), t.stride(1), L, H)]


def read_block_in_place(path: Path, key: str, sink: ReadTarget, raws: dict[int, memoryview],
                        timings: dict[str, float] | None = None) -> tuple[KVBlock, int] | None:
    """Reads the block file at `path` straight into `sink.keys` / `sink.values` and checks it there as
    `decode_block` would: (the block, which views them; the file's size). None, the caller then reading it
    staged: when the block is not stored bit-exact in their shape and dtype (no data read), when the file was cut
    short while read, or when the sink names no slots or slots outside `raws` (the bytes of the CPU storages it
    may read into, by storage address). Raises as `read_block_file`, and CorruptBlockError / StaleBlockError as
    `decode_block`."""
    if sink.slots is None:
        return None
    keys, values = sink.slots
    key_raw, value_raw = raws.get(keys.untyped_storage().data_ptr()), raws.get(values.untyped_storage().data_ptr())
    if key_raw is None or value_raw is None:
        return None
    t0 = time.perf_counter()
    fd, size = _open_block(path)
    try:
        head = os.pread(fd, min(size, _HEAD_BYTES), 0)
        n = header_length(head)
        if 8 + n > size:
            raise CorruptBlockError(f"header of {n} bytes in a file of {size}")
        if 8 + n > len(head):
            head += os.pread(fd, 8 + n - len(head), len(head))
        layout = read_layout(key, head[8: 8 + n], size)
        header = check_layout(key, layout)
        if header.codec != "none" or not slots_fit(sink.slots, header.dtype, header.shape):
            return None
        ids = bytearray(4 * header.shape[2])  # int32, in the machine's byte order as torch reads it
        parts = {"keys": _planes(keys, key_raw), "values": _planes(values, value_raw), "token_ids": [memoryview(ids)]}
        if parts["keys"] is None or parts["values"] is None:
            return None
        section = [b for name, *_ in layout.tensors for b in parts[name]]
        t1 = time.perf_counter()
        got = 0
        for i in range(0, len(section), _IOV_MAX):
            got += os.preadv(fd, section[i: i + _IOV_MAX], layout.base + got)
        if got != size - layout.base:
            return None  # cut short while read (a short preadv is only ever the end of the file)
        t2 = time.perf_counter()
        if checksum(layout.meta, *section) != header.checksum:
            raise CorruptBlockError(f"block for {key}: checksum mismatch")
    finally:
        os.close(fd)
    t3 = time.perf_counter()
    add_time(timings, "open_s", t1 - t0)
    add_time(timings, "read_s", t2 - t1)
    add_time(timings, "verify_s", t3 - t2)
    return KVBlock(keys, values, tuple(memoryview(ids).cast("i")), header.start, header.meta), size


@dataclass
class _Load:
    """What reading one block file gave, before the index and the counters are updated under the lock."""

    block: KVBlock | None = None  # the block read; None for a miss, and after a sink took it (see read_into)
    found: bool = False  # a whole, verified block was read
    taken: bool = False  # read_into: the sink took the block
    sink_error: Exception | None = None  # read_into: what the sink raised (the caller's, re-raised)
    size: int = 0
    missing: bool = False
    corrupt: CorruptBlockError | None = None
    error: OSError | None = None
    timings: dict[str, float] = field(default_factory=dict)


class DiskStore(Store):
    name = "disk"
    persistent = True
    reads_in_place = True

    def __init__(self, path: str | os.PathLike, max_bytes: int = 20 << 30, compress: str | None = None):
        """`compress`: None (blocks stored bit-exact) or "int8" (8-bit keys and values with scales, about a
        quarter of float32's bytes; lossy: see docs/store.md for its measured fidelity cost)."""
        if max_bytes < 0:
            raise StoreUsageError(f"DiskStore needs max_bytes >= 0, got {max_bytes}")
        self.codec = tier_codec(compress)
        self.path = Path(path).expanduser()  # the folder given; blocks live in its subfolder blocks_dir
        self.blocks_dir = self.path / BLOCKS_DIR
        self.max_bytes = max_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        # An unwritable or missing folder is not an error here: the store is built at engine start and must
        # not fail it; get/put then raise StoreError, which the tiered store treats as a miss.
        found = []
        sparse = 0
        now = time.time()
        try:
            self.blocks_dir.mkdir(parents=True, exist_ok=True)
            for name, st in _scan(self.blocks_dir, _TMP_NAME):
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TMP_S:
                    self._remove_entry(self.blocks_dir / name)
            for name, st in _scan(self.blocks_dir, _BLOCK_NAME):
                if not stat.S_ISREG(st.st_mode):  # anything else under a block name is dealt with when read
                    continue
                if _sparse(st):
                    log.warning("disk store: removing %s: %d bytes long but %d on disk (a sparse file, not a block "
                                "this store wrote)", self.blocks_dir / name, st.st_size, st.st_blocks * 512)
                    self._remove_entry(self.blocks_dir / name)
                    sparse += 1
                    continue
                found.append((st.st_mtime_ns, _BLOCK_NAME.fullmatch(name).group(1), st.st_size))
        except OSError as e:
            log.debug("disk store %s: cannot scan (%s)", self.blocks_dir, e)
            return
        with self._lock:
            self.stats.corrupt += sparse
            for _, key, size in sorted(found):
                self._index[key] = size
            self.stats.bytes_held = sum(self._index.values())
            self.stats.entries = len(self._index)
            self._unlink(self._evict_over_bound())  # a previous run may have used a larger bound

    def file_for(self, key: str) -> Path:
        return self.blocks_dir / block_file_name(key)

    def get(self, key: str) -> KVBlock | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str], count: bool = True) -> list[KVBlock | None]:
        """The blocks of `keys` (None for a miss), read and verified in parallel. A file that cannot be read
        (an I/O error, not a missing or corrupt entry) fails the whole call with a StoreError, as a failing
        tier does. `count=False` (`reread`): not counted as hits, misses, bytes or load time."""
        paths = [self.file_for(key) for key in keys]  # checks every key before any file is touched
        t0 = time.perf_counter()
        loads = in_parallel(self._load, list(zip(keys, paths, strict=True)))
        blocks, failed = self._settle_all(keys, paths, loads, t0, count)
        if failed is not None:
            path, e = failed
            raise self._error(f"cannot read {path}", e) from e
        return blocks

    def locate(self, keys: list[str]) -> list[bool]:
        """Whether an entry exists under each key's name, reading nothing (one lstat each): the keys `read_into`
        may then load. Anything under a block's name counts (a FIFO or a folder too: `read_into` finds it
        corrupt). A key with no entry is a miss."""
        paths = [self.file_for(key) for key in keys]
        held = []
        for path in paths:
            try:
                os.lstat(path)
                held.append(True)
            except FileNotFoundError:
                held.append(False)
            except OSError as e:
                raise self._error(f"cannot stat {path}", e) from e
        with self._lock:
            for key, h in zip(keys, held, strict=True):
                if not h:
                    self.stats.misses += 1
                    self._forget(key)
        return held

    def contains(self, key: str) -> bool:
        """Whether an entry exists under the key's name (one lstat), counted as nothing (`locate` counts misses)."""
        try:
            os.lstat(self.file_for(key))
        except OSError:
            return False
        return True

    def read_into(self, keys: list[str], sinks: list[ReadTarget | Callable[[KVBlock], bool]]) -> list[bool]:
        """Reads the blocks of `keys` and hands each one to its sink (a ReadTarget, or a plain `take(block) -> bool`:
        True, taken) in the reader threads, without allocating memory for it: the file is read straight into the
        sink's slots where it names them and the block allows (see ReadTarget), else into the thread's staging buffer,
        and checked as `get_many` checks it (size, header, key, layout, checksum). The block's tensors view the
        slots or that buffer, so they are valid only during the call: the sink copies a staged block where it
        belongs (e.g. into a request buffer). Returns, per key, whether its sink took a block; a missing, corrupt
        or unreadable file is a miss, counted as by `get_many`. A file that cannot be read (an I/O error) raises
        a StoreError, after the other blocks were handed over, whose `loaded` attribute is that list. What a sink
        raises is re-raised as it is. Blocks read this way are never kept by this tier or put into any other."""
        sinks = [ReadTarget.of(s) for s in sinks]
        raws: dict[int, memoryview] = {}  # one view per storage (a request buffer's two), not one per sink
        for t in (t for s in sinks if _IN_PLACE and s.slots is not None for t in s.slots):
            ptr = t.untyped_storage().data_ptr()
            if t.device.type == "cpu" and ptr not in raws:
                raws[ptr] = _raw(t)
        paths = [self.file_for(key) for key in keys]
        t0 = time.perf_counter()
        loads = in_parallel(self._load, [(key, path, sink, raws) for key, path, sink in zip(keys, paths, sinks,
                                                                                           strict=True)])
        _, failed = self._settle_all(keys, paths, loads, t0)
        for load in loads:
            if load.sink_error is not None:
                raise load.sink_error
        loaded = [load.taken for load in loads]
        if failed is not None:
            path, e = failed
            error = self._error(f"cannot read {path}", e)
            error.loaded = loaded
            raise error from e
        return loaded

    def reread(self, keys: list[str]) -> list[KVBlock | None]:
        """`get_many` for blocks this tier already served into a caller's buffer (`read_into`) and now wanted in
        memory of their own, e.g. to promote them: not counted again (hits, misses, bytes, load time); a damaged
        file is still counted corrupt and removed."""
        return self.get_many(keys, count=False)

    def _settle_all(self, keys: list[str], paths: list[Path], loads: list[_Load], t0: float, count: bool = True):
        """Index, counters and timings for a batch read since `t0` (`count=False`: the index and corrupt entries
        only): the blocks (None for a miss) and the first I/O error as (path, error), or None."""
        blocks: list[KVBlock | None] = []
        failed = None
        with self._lock:
            for key, path, load in zip(keys, paths, loads, strict=True):
                blocks.append(self._settle(key, path, load, count))
                if load.error is not None and failed is None:
                    failed = (path, load.error)
                if not count:
                    continue
                for step, seconds in load.timings.items():
                    setattr(self.stats, step, getattr(self.stats, step) + seconds)
                if load.found:
                    self.stats.bytes_read += load.size
            if count and any(load.found for load in loads):
                self.stats.load_s += time.perf_counter() - t0
        return blocks, failed

    def _load(self, key: str, path: Path, sink: ReadTarget | None = None,
              raws: dict[int, memoryview] | None = None) -> _Load:
        """Reads and checks one block file, and hands it to `sink` if given (read_into); no shared state is
        touched (runs in the reader threads)."""
        load = _Load()
        try:
            in_place = read_block_in_place(path, key, sink, raws, load.timings) if sink is not None else None
            if in_place is not None:
                load.block, load.size = in_place
            else:
                data = read_block_file(path, load.timings, staging=sink is not None)
                load.size = len(data)
                load.block = decode_block(key, data, load.timings, sink.slots if sink is not None else None)
            load.found = True
        except FileNotFoundError:
            load.missing = True
        except CorruptBlockError as e:
            load.corrupt = e
        except OSError as e:
            load.error = e
        if sink is not None and load.found:
            t0 = time.perf_counter()
            try:
                load.taken = bool(sink.take(load.block))
            except Exception as e:  # the caller's: re-raised once the counters are settled
                load.sink_error = e
            load.timings["copy_s"] = time.perf_counter() - t0
            load.block = None  # it viewed the staging buffer, which this thread's next read overwrites
        return load

    def _settle(self, key: str, path: Path, load: _Load, count: bool = True) -> KVBlock | None:
        """Index and counters for one load (under the lock); the block, or None for a miss."""
        if not load.found:
            if load.error is None and count:
                self.stats.misses += 1
            if load.missing:
                self._forget(key)  # evicted by another process, or never written
            elif isinstance(load.corrupt, StaleBlockError):
                log.debug("disk store: removing %s: %s", path, load.corrupt)  # written by another version
                self._remove_entry(path)
                self._forget(key)
            elif load.corrupt is not None:
                log.warning("disk store: removing %s: %s", path, load.corrupt)
                self._remove_entry(path)
                self._forget(key)
                self.stats.corrupt += 1
            return None
        # The file may have been evicted by another thread since it was read: the bytes read are still a
        # whole, checked block (served), but the index must only list files that exist.
        try:
            os.utime(path, follow_symlinks=False)  # LRU order for the next start
            present = True
        except FileNotFoundError:
            present = False
        except OSError:
            present = True  # a read-only cache still serves hits
        if present:
            self._account(key, load.size)
        if count:
            self.stats.hits += 1
        return load.block

    def put(self, key: str, block: KVBlock) -> None:
        path = self.file_for(key)
        data = encode_block(key, block, self.codec)
        if len(data) > self.max_bytes:
            return  # larger than the whole budget
        tmp = self.blocks_dir / f".kv-{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            try:
                self._write(tmp, data)
            except FileNotFoundError:  # the folder was removed while running: recreate it once
                self.blocks_dir.mkdir(parents=True, exist_ok=True)
                self._write(tmp, data)
            # The slow write above is outside the lock; the rename, the index update and the eviction's
            # unlinks are inside it, so no thread can unlink a file that another just renamed into place
            # (which would leave the index listing a file that is gone).
            with self._lock:
                try:
                    os.replace(tmp, path)
                except IsADirectoryError:
                    # A folder sits under the block's name: removed if empty, else this block is not stored.
                    # Either way one bad entry, not a failing tier.
                    self.stats.corrupt += 1
                    self._remove_entry(path)
                    os.replace(tmp, path)
                self._account(key, len(data))
                self._unlink(self._evict_over_bound())
        except OSError as e:
            self._remove_entry(tmp)  # only ever our own temp name
            if isinstance(e, IsADirectoryError):
                log.warning("disk store: not storing %s: a folder that is not empty holds its name", path)
                return
            raise self._error(f"cannot write {path}", e) from e

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        try:
            fd = os.open(path, _WRITE_FLAGS, 0o644)
        except FileExistsError:  # left by a dead process whose pid and thread id we now have
            os.unlink(path)
            fd = os.open(path, _WRITE_FLAGS, 0o644)
        with open(fd, "wb") as f:
            f.write(data)

    def _error(self, what: str, e: OSError) -> StoreError:
        with self._lock:
            self.stats.errors += 1
        if e.errno == errno.ENOTDIR:  # the cache folder (or its subfolder name) is a file: nothing works
            return TierUnavailableError(
                f"disk store {self.path}: {what}: {e}; --cache-dir / disk:<path> must name a folder"
            )
        return StoreError(f"disk store: {what}: {e}")

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
            victims.append(self.file_for(key))
        return victims

    def _unlink(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                log.debug("disk store: cannot remove %s (%s)", p, e)

    @staticmethod
    def _remove_entry(path: Path) -> None:
        """Removes whatever is at `path`, one of our names: a file, FIFO or symlink (the link, never its
        target) is unlinked; a directory only if it is empty, since what it holds is not ours to judge."""
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("disk store: cannot remove %s (%s)", path, e)

    def clear(self) -> None:
        """Removes this store's block files (`pc_rag-kv-v1/kv-<key>.safetensors`); nothing else is touched."""
        error = None
        with self._lock:  # as put: no rename can land between the listing and the unlinks
            self._index.clear()
            self.stats.bytes_held = 0
            self.stats.entries = 0
            try:
                for name, _ in list(_scan(self.blocks_dir, _BLOCK_NAME)):
                    self._remove_entry(self.blocks_dir / name)
            except FileNotFoundError:
                pass  # no subfolder: nothing of ours to clear
            except OSError as e:
                error = e
        if error is not None:
            raise self._error(f"cannot list {self.blocks_dir}", error) from error

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]
