"""A KVBlock as safetensors bytes, for the disk and Redis tiers. Never pickle: a cache file is data only.

Layout: tensors `keys`, `values` ([L, H_kv, T, D]) and `token_ids` (int64 [T]); string metadata `format`,
`key`, `start`, `dtype`, `shape`, `meta` (JSON of KVBlock.meta) and `checksum`.

`decode_block` trusts nothing: the stored key must equal the requested key (a file copied or renamed from
another entry is never used), shapes and dtype must agree with the metadata, and the checksum must match.
The checksum is CRC-32 over the metadata and the raw tensor bytes. It guards against truncation and bit
rot, not against an attacker (whoever can write the cache directory can write any checksum); CRC-32 runs
at ~4-12 GB/s where blake2b runs at ~1-3 GB/s, so verification does not dominate a load.
"""

from __future__ import annotations

import json
import zlib

import safetensors.torch
import torch

from ..blocks import KVBlock
from ..errors import StoreError

FORMAT = "pc_rag.kvblock.v1"
# Our headers are under 1 KB (metadata strings and three tensor entries; check_block caps KVBlock.meta at
# 64 KiB). A larger declared length means the bytes are not ours, and refusing it up front means a bogus
# length never makes a reader allocate or read gigabytes.
MAX_HEADER_BYTES = 1 << 20


class CorruptBlockError(StoreError):
    """Stored bytes are not a valid block for the requested key; the tier removes them and reports a miss."""


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # zero-copy view of a contiguous tensor


def _checksum(meta: dict[str, str], tensors: list[torch.Tensor]) -> str:
    crc = zlib.crc32(json.dumps(meta, sort_keys=True).encode())
    for t in tensors:
        crc = zlib.crc32(_raw(t), crc)
    return f"{crc:08x}"


def _own_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage: safetensors refuses tensors that share storage
    (keys and values are often two views of one stacked tensor)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def encode_block(key: str, block: KVBlock) -> bytes:
    keys, values = _own_cpu(block.keys), _own_cpu(block.values)
    if keys.untyped_storage().data_ptr() == values.untyped_storage().data_ptr():
        values = values.clone()  # the same tensor passed twice
    token_ids = torch.tensor(block.token_ids, dtype=torch.int64)
    meta = {
        "format": FORMAT,
        "key": key,
        "start": str(block.start),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "shape": ",".join(str(n) for n in keys.shape),
        "meta": json.dumps(block.meta, sort_keys=True),
    }
    meta["checksum"] = _checksum(meta, [keys, values, token_ids])
    return safetensors.torch.save({"keys": keys, "values": values, "token_ids": token_ids}, metadata=meta)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def header_length(first8: bytes) -> int:
    """The header length a safetensors blob declares in its first 8 bytes, if plausible for a block."""
    if len(first8) < 8:
        raise CorruptBlockError(f"{len(first8)} bytes, shorter than a safetensors length prefix")
    n = int.from_bytes(first8[:8], "little")
    if not 2 <= n <= MAX_HEADER_BYTES:  # "{}" is the shortest JSON header
        raise CorruptBlockError(f"declared header length {n} is outside 2..{MAX_HEADER_BYTES}")
    return n


def declared_size(header: bytes) -> int:
    """Total size of the blob whose JSON header (without its 8-byte length prefix) is `header`: 8 + header +
    the end of its last tensor. A blob of any other size was cut short or padded; the disk tier checks this
    before reading a file, so a huge (sparse) file with a plausible header is refused without being read."""
    try:
        entries = json.loads(header)
        ends = [int(spec["data_offsets"][1]) for name, spec in entries.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CorruptBlockError(f"unreadable safetensors header: {type(e).__name__}: {e}") from e
    return 8 + len(header) + max(ends, default=0)


def _parse(buf: torch.Tensor) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The safetensors layout read in place from a uint8 tensor: the tensors are views of `buf` (no copy),
    after checking that every tensor's byte range lies inside the data section and fits its shape, and that
    the data section ends where the last tensor does."""
    header_len = header_length(buf[:8].numpy().tobytes())
    base = 8 + header_len
    if base > len(buf):
        raise ValueError(f"header of {header_len} bytes in a blob of {len(buf)}")
    header_bytes = buf[8:base].numpy().tobytes()
    if declared_size(header_bytes) != len(buf):
        raise ValueError(f"tensors end at byte {declared_size(header_bytes)} of a blob of {len(buf)}")
    header = json.loads(header_bytes)
    meta = header.pop("__metadata__")
    tensors = {}
    for name, spec in header.items():
        dtype = _DTYPES[spec["dtype"]]
        a, b = spec["data_offsets"]
        count = 1
        for n in spec["shape"]:
            count *= n
        if not 0 <= a <= b <= len(buf) - base or b - a != count * dtype.itemsize or count == 0:
            raise ValueError(f"tensor {name!r}: byte range {a}..{b} does not fit shape {spec['shape']}")
        tensors[name] = buf[base + a: base + b].view(dtype).view(spec["shape"])
    return meta, tensors


def decode_block(key: str, data: bytes | torch.Tensor) -> KVBlock:
    """Raises CorruptBlockError unless `data` is an intact block stored under exactly `key`.

    Given a uint8 tensor (the disk tier reads the file into one) the block's tensors are views of it: one
    copy from the page cache and one checksum pass per load; safetensors.torch.load would add a copy.
    """
    if not isinstance(data, torch.Tensor):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    try:
        meta, tensors = _parse(data)
        keys, values, ids = tensors["keys"], tensors["values"], tensors["token_ids"]
    except Exception as e:  # truncated, not safetensors, missing fields: all mean "not a block"
        raise CorruptBlockError(f"unreadable block for {key}: {type(e).__name__}: {e}") from e
    if meta.get("format") != FORMAT:
        raise CorruptBlockError(f"block for {key} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("key") != key:
        raise CorruptBlockError(f"block requested as {key} was stored under key {meta.get('key')!r}")
    shape = ",".join(str(n) for n in keys.shape)
    if (
        keys.dim() != 4 or values.shape != keys.shape or values.dtype != keys.dtype
        or meta.get("shape") != shape or meta.get("dtype") != str(keys.dtype).removeprefix("torch.")
        or ids.dim() != 1 or ids.numel() != keys.shape[2]
    ):
        raise CorruptBlockError(f"block for {key}: tensor shapes/dtypes disagree with its metadata")
    expected = meta.pop("checksum", None)
    if _checksum(meta, [keys, values, ids]) != expected:
        raise CorruptBlockError(f"block for {key}: checksum mismatch")
    try:
        start, block_meta = int(meta["start"]), json.loads(meta["meta"])
    except (KeyError, ValueError) as e:
        raise CorruptBlockError(f"block for {key}: bad metadata: {e}") from e
    return KVBlock(keys, values, tuple(ids.tolist()), start, block_meta)
