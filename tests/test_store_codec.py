"""The block format (codec.py) and batched disk loads. References: the tensors put in, bit for bit for
uncompressed blocks; for int8 blocks, the quantization bound stated in each test (half a quantization step
of the block's scale, plus the block dtype's own rounding)."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch

from pc_rag.blocks import KVBlock
from pc_rag.store import DiskStore, StoreUsageError, open_store
from pc_rag.store.codec import FORMAT, CorruptBlockError, StaleBlockError, decode_block, encode_block

from .test_store import assert_same, block_path, key_of, make_block


def kv_block(seed: int, tokens: int = 40, dtype=torch.float32, layers: int = 2, heads: int = 2, dim: int = 64):
    g = torch.Generator().manual_seed(seed)
    shape = (layers, heads, tokens, dim)
    keys = torch.randn(shape, generator=g) * torch.linspace(0.1, 8.0, dim)  # outlier channels, as real keys have
    values = torch.randn(shape, generator=g) * torch.linspace(0.5, 3.0, tokens)[:, None]
    return KVBlock(keys.to(dtype), values.to(dtype), tuple(range(100, 100 + tokens)), 5, {"kind": "chunk"})


def assert_within_quantization(got: KVBlock, want: KVBlock) -> None:
    """Symmetric int8: |x - x'| <= scale / 2 with scale = amax / 127 over the channel (keys: over tokens) or
    the token (values: over the head dim); the scale is stored in float16 (relative rounding 2**-11) and the
    result rounded to the block's dtype."""
    assert got.keys.dtype == want.keys.dtype and got.keys.shape == want.keys.shape
    assert got.token_ids == want.token_ids and got.start == want.start and got.meta == want.meta
    eps = torch.finfo(want.keys.dtype).eps
    for x, y, dim in ((want.keys.float(), got.keys.float(), 2), (want.values.float(), got.values.float(), 3)):
        step = x.abs().amax(dim=dim, keepdim=True) / 127 * (1 + 2**-10)
        bound = step / 2 + x.abs() * eps + 1e-7
        assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() - bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_is_within_half_a_step(tmp_path, dtype):
    store = DiskStore(tmp_path, compress="int8")
    block = kv_block(1, dtype=dtype)
    store.put(key_of(1), block)
    assert_within_quantization(store.get(key_of(1)), block)


def test_int8_in_redis_is_within_half_a_step():
    fakeredis = pytest.importorskip("fakeredis")
    from pc_rag.store import RedisStore

    store = RedisStore("redis://fake", client=fakeredis.FakeRedis(), compress="int8")
    block = kv_block(2)
    store.put(key_of(2), block)
    assert_within_quantization(store.get(key_of(2)), block)


def test_int8_takes_at_most_a_quarter_of_float32():
    block = kv_block(3, tokens=256)
    exact, int8 = len(encode_block(key_of(3), block)), len(encode_block(key_of(3), block, "int8"))
    # The int8 payload is a quarter of float32 and zstd packs it below 8 bits per element (Gaussian data quantized
    # to 8 bits carries ~7 bits); scales, int32 token ids and the header add ~3% at this shape.
    assert 0.2 < int8 / exact <= 0.25


def test_blocks_of_the_uncompressed_int8_layout_are_stale(tmp_path):
    # An int8 block as an earlier build wrote it (keys and values as int8 tensors): a miss, not misread.
    block = kv_block(4)
    data = encode_block(key_of(4), block, "int8")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["codec"] = "int8"
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with pytest.raises(StaleBlockError):
        decode_block(key_of(4), len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def test_a_packed_payload_of_another_size_is_corrupt():
    # A payload whose checksum matches (rewritten consistently) but that unpacks to another size than the shape.
    import zstandard

    from pc_rag.store import codec
    block = kv_block(5, tokens=8)
    data = encode_block(key_of(5), block, "int8")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    tensors = {name: data[8 + n + a: 8 + n + b] for name, spec in header.items()
               for a, b in [spec["data_offsets"]]}
    tensors["packed"] = zstandard.ZstdCompressor().compress(b"\0" * 10)
    order = codec._canonical([(k, codec._DTYPES[header[k]["dtype"]]) for k in header], "int8z")
    offset, section = 0, b""
    for name in order:
        header[name]["data_offsets"] = [offset, offset + len(tensors[name])]
        offset += len(tensors[name])
        section += tensors[name]
    header["packed"]["shape"] = [len(tensors["packed"])]
    meta.pop("checksum")
    meta["checksum"] = codec.checksum(meta, memoryview(section))
    raw = json.dumps({"__metadata__": meta, **header}).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with pytest.raises(CorruptBlockError, match="another size"):
        decode_block(key_of(5), len(raw).to_bytes(8, "little") + raw + section)


def test_prefix_blocks_stay_exact_in_a_compressed_tier(tmp_path):
    # exact mode promises a full prefill's KV: its blocks are never quantized
    store = DiskStore(tmp_path, compress="int8")
    block = kv_block(8)
    prefix = KVBlock(block.keys, block.values, block.token_ids, block.start, {"kind": "prefix"})
    store.put(key_of(8), prefix)
    assert_same(store.get(key_of(8)), prefix)


def test_exact_mode_from_a_compressed_disk_equals_full(loaded, docs, tmp_path):
    import pc_rag
    from pc_rag import Chunk, Text

    model, tok = loaded
    prompt = [Text("Answer from the documents.\n\n"), Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQ?")]
    spec = f"disk:{tmp_path}?compress=int8"
    pc_rag.Engine(model, tok, store=spec).generate(prompt, mode="exact", max_new_tokens=4)
    other = pc_rag.Engine(model, tok, store=spec)  # another process: only the disk tier holds the prefix
    got = other.next_token_logits(prompt, mode="exact")
    assert other.store.tier_stats()[0].hits > 0  # the prefix came from the compressed disk tier
    ref = other.next_token_logits(prompt, mode="full")
    assert torch.allclose(got, ref, atol=1e-4)


def test_non_finite_block_is_stored_exact(tmp_path):
    block = kv_block(4)
    block.keys[0, 0, 0, 0] = math.inf
    block.values[1, 1, 1, 1] = math.nan
    store = DiskStore(tmp_path, compress="int8")
    store.put(key_of(4), block)
    got = store.get(key_of(4))
    assert torch.equal(got.keys, block.keys) and got.values.isnan().sum() == 1
    assert torch.equal(got.values.nan_to_num(), block.values.nan_to_num())


def test_files_are_safetensors_that_other_readers_load():
    block = kv_block(5)
    tensors = safetensors.torch.load(encode_block(key_of(5), block))
    assert torch.equal(tensors["keys"], block.keys) and torch.equal(tensors["values"], block.values)
    assert tensors["token_ids"].tolist() == list(block.token_ids)


def _rewrite_header(data: bytes, change) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw))  # same length: the data section stays where it was
    assert len(raw) == n
    return data[:8] + raw + data[8 + n:]


def test_swapped_tensor_offsets_are_corrupt_not_swapped_tensors():
    # The checksum covers the data section, not the header's offsets: the canonical layout check must catch a
    # header that points `keys` at the values' bytes (same size, same dtype).
    data = encode_block(key_of(6), kv_block(6))

    def swap(header):
        header["keys"]["data_offsets"], header["values"]["data_offsets"] = (
            header["values"]["data_offsets"], header["keys"]["data_offsets"])

    from pc_rag.store import CorruptBlockError

    with pytest.raises(CorruptBlockError):
        decode_block(key_of(6), _rewrite_header(data, swap))


def test_block_of_an_older_format_is_a_miss_removed_but_not_corrupt(tmp_path):
    store = DiskStore(tmp_path)
    block = make_block(7)
    meta = {"format": "pc_rag.kvblock.v1", "key": key_of(7), "start": "1", "dtype": "float32",
            "shape": "2,2,6,4", "meta": "{}", "checksum": "00000000"}
    path = block_path(tmp_path, key_of(7))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(safetensors.torch.save({"keys": block.keys, "values": block.values,
                                             "token_ids": torch.tensor(block.token_ids)}, metadata=meta))
    assert store.get(key_of(7)) is None
    s = store.tier_stats()[0]
    assert (s.misses, s.corrupt) == (1, 0)
    assert not path.exists()
    assert FORMAT != meta["format"]


def test_batched_disk_read_is_bit_identical_and_isolates_a_corrupt_file(tmp_path):
    store = DiskStore(tmp_path)
    blocks = {key_of(i): make_block(i, tokens=3 + i) for i in range(12)}
    for key, block in blocks.items():
        store.put(key, block)
    bad = block_path(tmp_path, key_of(5))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    keys = [*blocks, key_of(99)]
    got = store.get_many(keys)
    for key, block in zip(keys, got, strict=True):
        if key in (key_of(5), key_of(99)):
            assert block is None
        else:
            assert_same(block, blocks[key])
    s = store.tier_stats()[0]
    assert (s.hits, s.misses, s.corrupt) == (11, 2, 1)
    assert s.read_s > 0 and s.verify_s > 0 and s.bytes_read == sum(
        len(encode_block(k, b)) for k, b in blocks.items() if k != key_of(5))


def test_compress_option_in_specs(tmp_path):
    tier = open_store(f"disk:{tmp_path}?compress=int8&max_bytes=1GiB").tiers[0]
    assert (tier.codec, tier.max_bytes) == ("int8", 1 << 30)
    assert open_store(f"disk:{tmp_path}").tiers[0].codec == "none"
    with pytest.raises(StoreUsageError, match="compress"):
        open_store(f"disk:{tmp_path}?compress=zip")
    pytest.importorskip("redis")
    assert open_store("redis://127.0.0.1:1/0?compress=int8&prefix=x:").tiers[0].codec == "int8"
