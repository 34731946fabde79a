"""A KVBlock as safetensors bytes, for the disk and Redis tiers. Never pickle: a cache file is data only.

Layout (FORMAT v2): string metadata `format`, `key`, `start`, `dtype` (the block's), `shape` ([L, H_kv, T, D]),
`codec`, `meta` (JSON of KVBlock.meta) and `checksum`; tensors by codec:
- "none":  `keys`, `values` in the block's dtype, `token_ids` (int32 [T]); loads bit-identical.
- "int8z" (asked for as `compress="int8"`): keys and values quantized to int8 with scales, `key_scales`
           [L, H_kv, 1, D] (one per channel: keys have outlier channels) and `value_scales` [L, H_kv, T, 1]
           (one per token), as KIVI found best; scales are float16 (float32 when a scale falls outside
           float16's range). The int8 keys then values are stored as one zstd frame, `packed` (uint8): a
           lossless stage that takes the 8-bit payload below 8 bits per element (quantized KV is not uniform:
           0.91 of its size on the bench model), which is what brings a block under half of bfloat16's bytes
           with the scales and ids included. Decoded on load to the block's dtype. A block with non-finite
           values is stored with "none". Blocks tagged "int8" (the uncompressed int8 layout of an earlier
           build) are stale: misses, recomputed.
Tensors lie in the data section in one canonical order (larger elements first, then the order above), with
no gap, so every tensor view is aligned and a reader can check the header's offsets against the layout.

`decode_block` trusts nothing: the stored key must equal the requested key (a file copied or renamed from
another entry is never used), the tensors must be exactly those of the codec, laid out canonically, with the
shapes and dtype of the metadata, and the checksum must match. The checksum is xxh3-64 over the metadata (as
canonical JSON) and then the whole data section. It guards against truncation and bit rot, not against an
attacker (whoever can write the cache directory can write any checksum). xxh3 runs at ~24 GB/s on this
machine against ~4 GB/s for zlib's CRC-32 (v1), which had been a third of a disk load, and releases the GIL,
so a request's blocks are verified in parallel.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass

import torch
import xxhash
import zstandard

from ..blocks import KVBlock
from ..errors import StoreError
from .tier import StoreUsageError, add_time

# v2: xxh3-64 checksum over the data section, int32 token ids, canonical tensor order, optional int8 codec.
# Entries of another format are misses (never misread): the tiers drop them and the block is recomputed.
FORMAT = "pc_rag.kvblock.v2"
CODECS = ("none", "int8")  # what a tier may be asked for; "int8" is stored as "int8z"
_STORED = {"none": "none", "int8": "int8z"}
# Our headers are under 1 KB (metadata strings and a few tensor entries; check_block caps KVBlock.meta at
# 64 KiB). A larger declared length means the bytes are not ours, and refusing it up front means a bogus
# length never makes a reader allocate or read gigabytes.
MAX_HEADER_BYTES = 1 << 20

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_BLOCK_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TENSORS = {"none": ("keys", "values", "token_ids"),
            "int8z": ("packed", "key_scales", "value_scales", "token_ids")}
_ZSTD_LEVEL = 1  # levels 3-9 saved under 1% more on KV and compress several times slower
_F16_MIN, _F16_MAX = 2.0**-14, 65504.0  # float16's normal range, for scales
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def tier_codec(compress: str | None) -> str:
    """The codec a disk or Redis tier stores with, from its `compress` option (None or "none": exact)."""
    codec = "none" if compress in (None, "none") else compress
    if codec not in CODECS:
        raise StoreUsageError(f"unknown compress={compress!r}; choose one of {', '.join(CODECS)} (or None)")
    return codec


class CorruptBlockError(StoreError):
    """Stored bytes are not a valid block for the requested key; the tier removes them and reports a miss."""


class StaleBlockError(CorruptBlockError):
    """An intact entry of another FORMAT (another pc_rag version): a miss, removed, but not counted corrupt."""


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # zero-copy view of a contiguous tensor


def checksum(meta: dict[str, str], *section) -> str:
    """xxh3-64 over the metadata (canonical JSON, without the checksum) and then the data section, given whole or
    as its parts in order."""
    h = xxhash.xxh3_64(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for part in section:
        h.update(part)
    return h.hexdigest()


def _canonical(names_dtypes: list[tuple[str, torch.dtype]], codec: str) -> list[str]:
    """Names in their data-section order: larger elements first (so every offset is aligned), then the codec's
    own order."""
    order = _TENSORS[codec]
    return [n for n, _ in sorted(names_dtypes, key=lambda nd: (-nd[1].itemsize, order.index(nd[0])))]


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over `dim` (the reduced one): q in [-127, 127] and scale, x ~= q * scale."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True) / 127.0
    if float(scale.max()) <= _F16_MAX:
        scale = scale.clamp_min(_F16_MIN).half()  # quantize with the rounded scale, so decoding matches it
    else:
        scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x / scale.float()).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _tensors(block: KVBlock, codec: str) -> dict[str, torch.Tensor]:
    keys, values = block.keys.detach().cpu(), block.values.detach().cpu()
    token_ids = torch.tensor(block.token_ids, dtype=torch.int32)
    if codec == "int8z":
        qk, sk = _quantize(keys, dim=2)  # per channel: one scale per (layer, head, channel)
        qv, sv = _quantize(values, dim=3)  # per token: one scale per (layer, head, token)
        packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(bytes(_raw(qk)) + bytes(_raw(qv)))
        return {"packed": torch.frombuffer(bytearray(packed), dtype=torch.uint8), "key_scales": sk,
                "value_scales": sv, "token_ids": token_ids}
    return {"keys": keys.contiguous(), "values": values.contiguous(), "token_ids": token_ids}


def encode_block(key: str, block: KVBlock, codec: str = "none") -> bytes:
    """The block as safetensors bytes in FORMAT, with `codec` ("none" or "int8"). Blocks of the exact-prefix
    chain (meta kind "prefix") are always stored exact: `exact` mode promises a full prefill's KV, and keeps
    that promise from a compressed tier; chunks and scaffolds are relocated approximations anyway."""
    if codec not in CODECS:
        raise StoreError(f"unknown block codec {codec!r}; choose one of {', '.join(CODECS)}")
    codec = _STORED[codec]
    if block.meta.get("kind") == "prefix":
        codec = "none"
    if codec != "none" and not (torch.isfinite(block.keys).all() and torch.isfinite(block.values).all()):
        codec = "none"  # a scale cannot represent inf or nan: keep such a block exact
    tensors = _tensors(block, codec)
    order = _canonical([(n, t.dtype) for n, t in tensors.items()], codec)
    specs, offset = {}, 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        specs[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    data = b"".join(_raw(tensors[name]) for name in order)
    meta = {
        "format": FORMAT,
        "key": key,
        "start": str(block.start),
        "dtype": str(block.keys.dtype).removeprefix("torch."),
        "shape": ",".join(str(n) for n in block.keys.shape),
        "codec": codec,
        "meta": json.dumps(block.meta, sort_keys=True),
    }
    meta["checksum"] = checksum(meta, memoryview(data))
    header = json.dumps({"__metadata__": meta, **specs}).encode()
    header += b" " * (-(8 + len(header)) % 8)  # the data section starts 8-byte aligned, as safetensors pads it
    return len(header).to_bytes(8, "little") + header + data


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
    except ValueError as e:
        raise CorruptBlockError(f"unreadable safetensors header: {type(e).__name__}: {e}") from e
    return 8 + len(header) + _data_end(entries)


def _data_end(entries) -> int:
    try:
        ends = [int(spec["data_offsets"][1]) for name, spec in entries.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CorruptBlockError(f"unreadable safetensors header: {type(e).__name__}: {e}") from e
    return max(ends, default=0)


@dataclass(frozen=True)
class Layout:
    """A blob's safetensors header, checked against the codec's layout: its metadata, where the data section
    starts (`base`), and each tensor in data-section order as (name, dtype, shape, first byte, end byte), the
    bytes counted from `base`."""

    meta: dict[str, str]
    base: int
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        for n, dtype, shape, _, _ in self.tensors:
            if n == name:
                return dtype, shape
        raise KeyError(name)


def read_layout(key: str, header: bytes, total: int) -> Layout:
    """`_layout`, its errors as the block's: StaleBlockError for another format, CorruptBlockError for the rest."""
    try:
        return _layout(header, total)
    except StaleBlockError as e:
        raise StaleBlockError(f"block for {key} has {e}") from e
    except Exception as e:  # truncated, not safetensors, missing fields: all mean "not a block"
        raise CorruptBlockError(f"unreadable block for {key}: {type(e).__name__}: {e}") from e


def _layout(header: bytes, total: int) -> Layout:
    """The layout of a blob of `total` bytes whose JSON header (without its 8-byte length prefix) is `header`,
    after checking that the tensors are exactly the codec's, in canonical order, tiling the data section with no
    gap up to the blob's end, each byte range fitting its shape. Raises StaleBlockError for an intact entry of
    another format, ValueError (or any parsing error) for bytes that are not a block."""
    entries = json.loads(header)
    base = 8 + len(header)
    end = base + _data_end(entries)
    if end != total:
        raise ValueError(f"tensors end at byte {end} of a blob of {total}")
    meta = entries.pop("__metadata__")
    if meta.get("format") != FORMAT:
        raise StaleBlockError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    codec = meta.get("codec")
    if codec == "int8":
        raise StaleBlockError("the uncompressed int8 layout of an earlier build")
    if codec not in _TENSORS or set(entries) != set(_TENSORS[codec]):
        raise ValueError(f"codec {codec!r} with tensors {sorted(entries)}")
    order = _canonical([(n, _DTYPES[spec["dtype"]]) for n, spec in entries.items()], codec)
    tensors, offset = [], 0
    for name in order:
        spec = entries[name]
        dtype = _DTYPES[spec["dtype"]]
        a, b = spec["data_offsets"]
        shape = tuple(int(n) for n in spec["shape"])
        count = 1
        for n in shape:
            count *= n
        if a != offset or b - a != count * dtype.itemsize or count == 0:
            raise ValueError(f"tensor {name!r}: byte range {a}..{b} is not where the layout puts shape {list(shape)}")
        tensors.append((name, dtype, shape, a, b))
        offset = b
    return Layout(meta, base, tuple(tensors))


def _parse(key: str, buf: torch.Tensor) -> tuple[Layout, dict[str, torch.Tensor], memoryview]:
    """The layout read in place from a uint8 tensor: (layout, tensors as views of `buf` (no copy), the data
    section). Raises as `read_layout`."""
    raw = memoryview(buf.numpy())  # header slices through a memoryview: cheaper than tensor slicing per block
    header_len = header_length(raw[:8].tobytes())
    if 8 + header_len > len(buf):
        raise CorruptBlockError(f"unreadable block for {key}: header of {header_len} bytes in a blob of {len(buf)}")
    layout = read_layout(key, raw[8: 8 + header_len].tobytes(), len(buf))
    base = layout.base
    tensors = {name: buf[base + a: base + b].view(dtype).view(shape) for name, dtype, shape, a, b in layout.tensors}
    return layout, tensors, raw[base:]


@dataclass(frozen=True)
class Header:
    """What a checked layout says about the block it holds (`check_layout`)."""

    codec: str
    dtype: torch.dtype  # the block's (keys and values once decoded)
    shape: tuple[int, int, int, int]  # [L, H_kv, T, D]
    start: int
    meta: dict
    checksum: str | None


def check_layout(key: str, layout: Layout) -> Header:
    """Raises CorruptBlockError unless `layout`'s metadata and tensors agree with each other and name `key`."""
    meta = layout.meta
    try:
        if meta.get("key") != key:
            raise CorruptBlockError(f"block requested as {key} was stored under key {meta.get('key')!r}")
        codec, dtype = meta["codec"], _BLOCK_DTYPES.get(meta.get("dtype"))
        shape = tuple(int(n) for n in meta["shape"].split(","))
        stored = dtype if codec == "none" else torch.int8
        if codec == "none":
            (kd, ks), (vd, vs) = layout.spec("keys"), layout.spec("values")
        else:  # the payload's size is checked against the shape when it is unpacked
            (kd, ks), (vd, vs) = (stored, shape), (stored, shape)
        id_dtype, id_shape = layout.spec("token_ids")
        if (
            dtype is None or len(shape) != 4 or ks != shape or vs != shape or kd != stored or vd != stored
            or id_dtype != torch.int32 or id_shape != (shape[2],)
            or (codec == "int8z" and not _scales_fit(layout, shape))
        ):
            raise CorruptBlockError(f"block for {key}: tensor shapes/dtypes disagree with its metadata")
        return Header(codec, dtype, shape, int(meta["start"]), json.loads(meta["meta"]), meta.get("checksum"))
    except CorruptBlockError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CorruptBlockError(f"block for {key}: bad metadata: {type(e).__name__}: {e}") from e


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """q * scale in `dtype`, into `out` when given. Bit-identical either way: int8 is exact in every float dtype
    we store, and the in-place mul by the fp32 scale computes in fp32 before it rounds to out's dtype."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
        out.copy_(q).mul_(scale.float())  # int8 -> fp32, then the scale (an int8 * fp16 mul is 15x slower)
        return out if dtype == torch.float32 else out.to(dtype)
    return out.copy_(q).mul_(scale.float())


def decode_block(key: str, data: bytes | torch.Tensor, timings: dict[str, float] | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> KVBlock:
    """Raises CorruptBlockError unless `data` is an intact block stored under exactly `key`.

    Given a uint8 tensor (the disk tier reads the file into one) an uncompressed block's tensors are views of
    it: one copy from the page cache and one checksum pass per load. `timings`, when given, gets the seconds
    spent verifying (`verify_s`) and dequantizing (`decode_s`) added.

    `out` = (keys, values): CPU tensors of the block's dtype and [L, H_kv, T, D] shape (a request buffer's slots)
    that a compressed block is dequantized into, after its checksum matched, instead of into memory of its own;
    the returned block's keys and values are then these very tensors. (Its slots hold garbage if decoding fails
    after that: the caller must not use them unless a block is returned.) An uncompressed block, or one of another
    shape or dtype, ignores `out` (its tensors view `data`: nothing to save).
    """
    t0 = time.perf_counter()
    if not isinstance(data, torch.Tensor):
        # A view of the bytes, not a copy (the Redis tier's reply is a fresh bytes object that nothing else
        # holds): a copy of a 4K-token prompt's blocks cost more than verifying them. torch warns that the
        # buffer is read-only; blocks are never written (Store contract), so that warning is filtered above.
        data = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    layout, tensors, section = _parse(key, data)
    header = check_layout(key, layout)
    if checksum(layout.meta, section) != header.checksum:
        raise CorruptBlockError(f"block for {key}: checksum mismatch")
    codec, dtype, ids = header.codec, header.dtype, tensors["token_ids"]
    t1 = time.perf_counter()
    if codec == "int8z":
        shape = torch.Size(header.shape)
        n = shape.numel()
        packed = tensors["packed"].numpy()  # a view: zstd reads any buffer
        try:
            if zstandard.frame_content_size(packed) != 2 * n:  # before any allocation of that size
                raise zstandard.ZstdError(f"payload declares another size than the {2 * n} bytes of its shape")
            raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=2 * n)
        except zstandard.ZstdError as e:  # checksummed bytes that still do not unpack: written by something else
            raise CorruptBlockError(f"block for {key}: {e}") from e
        if len(raw) != 2 * n:
            raise CorruptBlockError(f"block for {key}: unpacked {len(raw)} bytes, expected {2 * n}")
        q = torch.frombuffer(raw, dtype=torch.int8)  # read only, by the dequantization
        ko, vo = out if out is not None and slots_fit(out, dtype, shape) else (None, None)
        keys = _dequantize(q[:n].view(shape), tensors["key_scales"], dtype, ko)
        values = _dequantize(q[n:].view(shape), tensors["value_scales"], dtype, vo)
    else:
        keys, values = tensors["keys"], tensors["values"]
    add_time(timings, "verify_s", t1 - t0)
    add_time(timings, "decode_s", time.perf_counter() - t1)
    return KVBlock(keys, values, tuple(ids.tolist()), header.start, header.meta)


def slots_fit(slots: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a block of `dtype` and `shape` can be decoded or read straight into `slots` (CPU tensors of both)."""
    return all(t.dtype == dtype and tuple(t.shape) == tuple(shape) and t.device.type == "cpu" for t in slots)


def _scales_fit(layout: Layout, shape: tuple[int, int, int, int]) -> bool:
    L, H, T, D = shape
    (kd, ks), (vd, vs) = layout.spec("key_scales"), layout.spec("value_scales")
    return ks == (L, H, 1, D) and vs == (L, H, T, 1) and kd in (torch.float16, torch.float32) and vd in (
        torch.float16, torch.float32)


def stored_bytes_per_token(block: KVBlock, codec: str = "none") -> float:
    """Bytes an encoded block takes per token (tensors and header), for reports against 2*L*H_kv*D*b."""
    return len(encode_block("chunk-bytes", block, codec)) / block.num_tokens
