"""Prefix blocks read from disk straight into the request buffer (DiskStore.read_into, TieredStore.read_pending,
Assembler._read: the plan's "read" pieces).

References: `full` mode on the same prompt (exact reuse must give the same greedy tokens and next-token logits
within 1e-4, fp32: the reused blocks were computed in other forward passes, so only float rounding may
differ), and, for the store calls, the blocks as `get` returns them (bit-identical)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import pc_rag
from pc_rag.blocks import KVBlock
from pc_rag.lookups import StoreLookups
from pc_rag.prefix import BLOCK_TOKENS
from pc_rag.store import (
    DiskStore,
    MemoryStore,
    PendingBlock,
    ReadTarget,
    RedisStore,
    TieredStore,
    as_store,
)
from pc_rag.store import disk as disk_module
from pc_rag.store import tier as tier_module
from pc_rag.store.codec import encode_block

from .conftest import PlainStore

TOL = 1e-4


def read_into_own_memory(engine) -> None:
    """The engine reads every block from disk or Redis into memory of its own at planning, then copies it in: the
    path before blocks were read straight into the request buffer, kept here as a reference."""
    engine.assembler.lookups = lambda: StoreLookups(engine.store, engine.assembler.place, direct=False)


def block(seed: int, tokens: int = 4) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, tokens, 8, generator=g)
    return KVBlock(k, torch.randn(2, 2, tokens, 8, generator=g), tuple(range(seed, seed + tokens)), 3,
                   {"kind": "prefix"})


def copier(out: dict, key: str):
    """A sink that keeps a copy of the block it is handed (the block itself views a staging buffer)."""
    def take(b: KVBlock) -> bool:
        out[key] = KVBlock(b.keys.clone(), b.values.clone(), b.token_ids, b.start, b.meta)
        return True
    return take


# ---- the store calls, without a model ---------------------------------------------------------------------
def test_read_into_hands_over_the_blocks_get_returns(tmp_path):
    disk = DiskStore(tmp_path)
    blocks = {f"prefix-{i}": block(i) for i in range(5)}
    for key, b in blocks.items():
        disk.put(key, b)
    keys = [*blocks, "prefix-absent"]
    assert disk.locate(keys) == [True] * 5 + [False]
    got: dict[str, KVBlock] = {}
    taken = disk.read_into(keys, [copier(got, k) for k in keys])
    assert taken == [True] * 5 + [False]
    for key, b in blocks.items():
        ref = disk.get(key)
        assert torch.equal(got[key].keys, ref.keys) and torch.equal(got[key].values, ref.values)
        assert got[key].token_ids == b.token_ids and got[key].start == b.start
    s = disk.tier_stats()[0]
    assert s.copy_s > 0 and s.read_s > 0 and s.verify_s > 0
    assert s.misses == 2  # the absent key: once when located, once when read


def test_read_into_reuses_one_staging_buffer_per_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_module, "READER_THREADS", 1)  # every read in the calling thread
    disk = DiskStore(tmp_path)
    for i in range(3):
        disk.put(f"prefix-{i}", block(i))
    addresses = []

    def note(b: KVBlock) -> bool:
        addresses.append(b.keys.untyped_storage().data_ptr())
        return True

    disk.read_into([f"prefix-{i}" for i in range(3)], [note] * 3)
    disk.read_into(["prefix-0"], [note])
    assert len(set(addresses)) == 1  # no fresh memory per block
    fresh = [disk.get(f"prefix-{i}").keys.untyped_storage().data_ptr() for i in range(2)]
    assert addresses[0] not in fresh  # get() still returns blocks of their own, never the staging buffer


def stored(folder, n: int) -> tuple[DiskStore, list[str]]:
    """A disk tier holding blocks `prefix-0` .. `prefix-{n-1}` (block(i) each)."""
    disk = DiskStore(folder)
    keys = [f"prefix-{i}" for i in range(n)]
    for i, key in enumerate(keys):
        disk.put(key, block(i))
    return disk, keys


def flip(path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_read_into_refuses_damaged_files_and_counts_them(tmp_path):
    disk, keys = stored(tmp_path, 4)
    flip(disk.file_for(keys[1]), -5, 0xFF)
    os.unlink(disk.file_for(keys[2]))
    os.unlink(disk.file_for(keys[3]))
    os.mkfifo(disk.file_for(keys[3]))
    got: dict[str, KVBlock] = {}
    assert disk.read_into(keys, [copier(got, k) for k in keys]) == [True, False, False, False]
    s = disk.tier_stats()[0]
    assert (s.corrupt, s.misses, s.hits) == (2, 3, 1)
    assert not disk.file_for(keys[1]).exists() and not disk.file_for(keys[3]).exists()  # removed, as get does


def test_a_sink_refusing_or_raising(tmp_path):
    disk = DiskStore(tmp_path)
    disk.put("prefix-a", block(1))
    disk.put("prefix-b", block(2))
    assert disk.read_into(["prefix-a", "prefix-b"], [lambda b: False, lambda b: True]) == [False, True]

    def boom(b):
        raise RuntimeError("the caller's bug")

    store = TieredStore([MemoryStore(), disk])
    pending = [b for b, _ in store.find_many_with_source(["prefix-a"])]
    with pytest.raises(RuntimeError, match="the caller's bug"):
        store.read_pending(pending, [boom])
    assert store._usable(1, "reads")  # a sink's error is not the tier's: no pause


def test_tiered_find_leaves_disk_blocks_unread_and_unpromoted(tmp_path):
    disk, memory = DiskStore(tmp_path), MemoryStore()
    disk.put("prefix-disk", block(1))
    memory.put("prefix-mem", block(2))
    store = TieredStore([memory, disk])
    found = store.find_many_with_source(["prefix-mem", "prefix-disk", "prefix-none"])
    assert isinstance(found[0][0], KVBlock) and found[0][1] == "memory"
    assert found[1] == (PendingBlock("prefix-disk", "disk", 1), "disk")
    assert found[2] == (None, None)
    assert disk.tier_stats()[0].bytes_read == 0 and not memory.contains("prefix-disk")
    got: dict[str, KVBlock] = {}
    assert store.read_pending([found[1][0]], [copier(got, "prefix-disk")]) == [True]
    assert torch.equal(got["prefix-disk"].keys, block(1).keys)
    assert not memory.contains("prefix-disk")  # the caller decides what memory keeps


def test_a_failing_read_is_a_miss_and_pauses_the_tier(tmp_path, monkeypatch):
    disk, keys = stored(tmp_path, 3)
    store = TieredStore([MemoryStore(), disk])
    pending = [b for b, _ in store.find_many_with_source(keys)]
    real = disk_module.read_block_file
    bad = disk.file_for(keys[1])

    def flaky(path, *args, **kwargs):
        if path == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_module, "read_block_file", flaky)
    got: dict[str, KVBlock] = {}
    assert store.read_pending(pending, [copier(got, k) for k in keys]) == [True, False, True]
    assert disk.tier_stats()[0].errors == 1 and not store._usable(1, "reads")
    assert store.find_many_with_source(keys) == [(None, None)] * 3  # paused: not even located


def slots(n_blocks: int, tokens: int = 4, dtype=torch.float32):
    """A request-buffer-like pair [L, 1, H, S, D] (keys, values) and each block's slot views ([L, H, T, D])."""
    keys = torch.full((2, 1, 2, n_blocks * tokens + 3, 8), float("nan"), dtype=dtype)
    values = torch.full_like(keys, float("nan"))
    return keys, values, [(keys[:, 0, :, i * tokens: (i + 1) * tokens], values[:, 0, :, i * tokens: (i + 1) * tokens])
                          for i in range(n_blocks)]


def test_a_sink_naming_slots_gets_the_block_read_into_them(tmp_path, monkeypatch):
    """Reference: the blocks as `get` returns them (bit-identical); the block handed to the sink views the slots,
    and no staging buffer was used."""
    disk, keys = stored(tmp_path, 5)
    monkeypatch.setattr(disk_module, "_staging_buffer", None)  # any staged read would fail
    _, _, views = slots(len(keys))
    handed = []

    def taker(dk):
        def take(b: KVBlock) -> bool:
            handed.append((b.keys is dk, b.token_ids, b.start))
            return True
        return take

    assert disk.read_into(keys, [ReadTarget(taker(dk), dk, dv) for dk, dv in views]) == [True] * 5
    assert sorted(handed, key=lambda h: h[1]) == [(True, block(i).token_ids, 3) for i in range(5)]
    for key, (dk, dv) in zip(keys, views, strict=True):
        ref = disk.get(key)
        assert torch.equal(dk, ref.keys) and torch.equal(dv, ref.values)
    s = disk.tier_stats()[0]
    assert s.hits == 5 + 5 and s.read_s > 0 and s.verify_s > 0


def test_a_block_of_more_planes_than_one_preadv_takes(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "_IOV_MAX", 3)  # 2 layers x 2 heads x 2 tensors + ids: 9 buffers, 3 calls
    disk = DiskStore(tmp_path)
    disk.put("prefix-a", block(7))
    _, _, [(dk, dv)] = slots(1)
    assert disk.read_into(["prefix-a"], [ReadTarget(lambda b: True, dk, dv)]) == [True]
    assert torch.equal(dk, block(7).keys) and torch.equal(dv, block(7).values)


def test_a_damaged_file_read_in_place_is_refused_removed_and_counted(tmp_path):
    disk, keys = stored(tmp_path, 3)
    flip(disk.file_for(keys[1]), -200, 0x10)  # in the values
    with open(disk.file_for(keys[2]), "r+b") as f:  # cut short: its header now disagrees with its size
        f.truncate(300)
    taken = []
    _, _, views = slots(3)
    sinks = [ReadTarget(lambda b, k=k: taken.append(k) or True, dk, dv)
             for k, (dk, dv) in zip(keys, views, strict=True)]
    assert disk.read_into(keys, sinks) == [True, False, False]
    assert taken == [keys[0]]  # never handed a block that failed its checks
    s = disk.tier_stats()[0]
    assert (s.corrupt, s.hits) == (2, 1)
    assert not disk.file_for(keys[1]).exists() and not disk.file_for(keys[2]).exists()


def test_a_file_shrinking_while_read_in_place_is_read_again_staged(tmp_path, monkeypatch):
    """A short preadv (the file cut after its header was checked) is not trusted: the block is read again the
    usual way, which finds it whole (here) or corrupt."""
    disk = DiskStore(tmp_path)
    disk.put("prefix-a", block(3))
    real, calls = os.preadv, []

    def short(fd, buffers, offset):
        calls.append(offset)
        return 0 if len(calls) == 1 else real(fd, buffers, offset)

    monkeypatch.setattr(disk_module.os, "preadv", short)
    _, _, [(dk, dv)] = slots(1)
    got: dict[str, KVBlock] = {}
    assert disk.read_into(["prefix-a"], [ReadTarget(copier(got, "prefix-a"), dk, dv)]) == [True]
    assert torch.equal(got["prefix-a"].keys, block(3).keys) and got["prefix-a"].keys is not dk


@pytest.mark.parametrize("case", ["another dtype", "planes not contiguous"])
def test_blocks_that_cannot_be_read_in_place_are_staged(tmp_path, case):
    """Reference: the block as `get` returns it, handed to the sink from staging (not viewing the slots)."""
    disk = DiskStore(tmp_path)
    b = KVBlock(block(5).keys, block(5).values, block(5).token_ids, 3, {"kind": "chunk"})
    disk.put("chunk-a", b)
    dk, dv = slots(1, dtype=torch.float64 if case == "another dtype" else torch.float32)[2][0]
    if case == "planes not contiguous":
        dk, dv = dk.transpose(2, 3).contiguous().transpose(2, 3), dv  # [T, D] planes with stride 1 along T
    got: dict[str, KVBlock] = {}
    assert disk.read_into(["chunk-a"], [ReadTarget(copier(got, "chunk-a"), dk, dv)]) == [True]
    ref = disk.get("chunk-a")
    assert torch.equal(got["chunk-a"].keys, ref.keys) and torch.equal(got["chunk-a"].values, ref.values)
    assert torch.isnan(dk).all()  # nothing was written into the slots by the tier


def _int8_tier(kind: str, path):
    if kind == "disk":
        return DiskStore(path, compress="int8")
    fakeredis = pytest.importorskip("fakeredis")
    return RedisStore(client=fakeredis.FakeRedis(), compress="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_compressed_blocks_are_dequantized_into_the_slots(tmp_path, kind, dtype):
    """Reference: the block as `get` decodes it into memory of its own, bit for bit (same dtype); the block handed
    to the sink is the slots themselves, and a slot pair of another shape gets a block of its own."""
    tier = _int8_tier(kind, tmp_path)
    b = block(5)
    b = KVBlock(b.keys.to(dtype), b.values.to(dtype), b.token_ids, 3, {"kind": "chunk"})
    tier.put("chunk-a", b)
    tier.put("chunk-b", b)
    ref = tier.get("chunk-a")
    _, _, [(dk, dv), (ek, ev)] = slots(2, dtype=dtype)
    small_k, small_v = ek[:, :, :2], ev[:, :, :2]  # not the block's shape: left alone
    got: dict[str, KVBlock] = {}
    handed: dict[str, KVBlock] = {}

    def keep(key):
        def take(blk):
            handed[key] = blk
            return copier(got, key)(blk)
        return take

    assert tier.locate(["chunk-a", "chunk-b", "chunk-c"]) == [True, True, False]
    assert tier.read_into(["chunk-a", "chunk-b"], [ReadTarget(keep("chunk-a"), dk, dv),
                                                  ReadTarget(keep("chunk-b"), small_k, small_v)]) == [True, True]
    assert handed["chunk-a"].keys is dk and handed["chunk-a"].values is dv
    assert torch.equal(dk, ref.keys) and torch.equal(dv, ref.values)
    assert handed["chunk-b"].keys is not small_k and torch.isnan(ek.float()).all()
    assert torch.equal(got["chunk-b"].keys, ref.keys) and torch.equal(got["chunk-b"].values, ref.values)
    assert 0 < (ref.keys.float() - b.keys.float()).abs().max() < 0.1  # lossy, as int8 is
    s = tier.tier_stats()[0]
    assert (s.hits, s.misses) == (3, 1)  # get, then the two reads; locate's miss
    assert tier.reread(["chunk-a"])[0] is not None and tier.tier_stats()[0].hits == 3  # not counted again


def test_other_stores_answer_as_get_many_with_source(tmp_path):
    plain = PlainStore()
    plain.put("prefix-a", block(1))
    assert as_store(plain).find_many_with_source(["prefix-a", "prefix-b"]) == [(plain.blocks["prefix-a"], "plain"),
                                                                                (None, None)]
    disk = DiskStore(tmp_path)  # a disk tier used on its own (not in a TieredStore) is read as before
    disk.put("prefix-a", block(1))
    b, origin = disk.find_many_with_source(["prefix-a"])[0]
    assert isinstance(b, KVBlock) and origin == "disk"


def test_staging_is_not_kept_for_files_larger_than_its_bound(monkeypatch):
    monkeypatch.setattr(disk_module, "STAGING_MAX_BYTES", 1000)
    monkeypatch.setattr(disk_module, "_staging", disk_module.threading.local())
    small = disk_module._staging_buffer(100)
    assert disk_module._staging_buffer(50).data_ptr() == small.data_ptr()
    big = disk_module._staging_buffer(5000)
    assert big.numel() == 5000 and disk_module._staging_buffer(10).data_ptr() == small.data_ptr()


# ---- the engine: exact mode from disk in a new engine -------------------------------------------------------
def system_text():
    from pydoc_data.topics import topics

    return topics["for"][:1500]


PROMPT_QUESTION = "\n\nQuestion: what does the loop do?"


@pytest.fixture
def on_disk(loaded, tmp_path):
    """A disk folder holding the prefix blocks of one exact request, and that request's prompt."""
    model, tok = loaded
    prompt = system_text() + PROMPT_QUESTION
    first = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.generate(prompt, mode="exact", max_new_tokens=4)
    return tmp_path, prompt


def new_engine(loaded, folder):
    """A new process's engine, as far as the cache goes: empty memory tier, empty prefix index."""
    model, tok = loaded
    memory, disk = MemoryStore(), DiskStore(folder)
    return pc_rag.Engine(model, tok, store=TieredStore([memory, disk])), memory, disk


def full_reference(loaded, prompt, max_new_tokens=4):
    model, tok = loaded
    ref = pc_rag.Engine(model, tok, store=MemoryStore())
    return ref.generate(prompt, mode="full", max_new_tokens=max_new_tokens), ref.next_token_logits(prompt, "full")


def prefix_files(folder) -> list:
    return sorted(p for p in (folder / "pc_rag-kv-v1").iterdir() if p.name.startswith(("kv-prefix-", "kv-extent-")))


def test_exact_from_disk_in_a_new_engine_equals_full_and_lands_in_memory(loaded, on_disk):
    folder, prompt = on_disk
    ref, ref_logits = full_reference(loaded, prompt)
    engine, memory, disk = new_engine(loaded, folder)
    files = {p.name: p.stat().st_mtime_ns for p in prefix_files(folder)}
    logits = engine.next_token_logits(prompt, "exact")
    assert (logits - ref_logits).abs().max().item() <= TOL
    s = disk.tier_stats()[0]
    assert s.hits == len(files) and s.copy_s > 0 and s.corrupt == 0
    assert memory.tier_stats()[0].entries >= len(files)  # promoted after the reply
    assert {p.name for p in prefix_files(folder)} == set(files)  # and not written back to disk
    again = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert {s.origin for s in again.sources if s.source == "prefix"} == {"memory"}
    assert again.token_ids == ref.token_ids
    assert disk.tier_stats()[0].hits == len(files)  # the second request read nothing from disk


def test_generate_from_disk_reports_the_disk_blocks(loaded, on_disk):
    folder, prompt = on_disk
    ref, _ = full_reference(loaded, prompt)
    engine, _, _ = new_engine(loaded, folder)
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert {s.origin for s in got.sources if s.source == "prefix"} == {"disk"}
    assert got.cached_tokens == (got.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS


@pytest.mark.parametrize("damage", ["corrupt", "foreign tokens"])
def test_a_damaged_block_is_recomputed_and_still_equals_full(loaded, on_disk, damage):
    folder, prompt = on_disk
    ref, ref_logits = full_reference(loaded, prompt)
    engine, _, disk = new_engine(loaded, folder)
    files = prefix_files(folder)
    victim = files[len(files) // 2]
    if damage == "corrupt":
        flip(victim, victim.stat().st_size // 2, 0x01)
    else:  # intact and checksummed, under the right key, but the KV of other tokens
        key = victim.name.removeprefix("kv-").removesuffix(".safetensors")
        b = disk.get(key)
        victim.write_bytes(encode_block(key, KVBlock(b.keys, b.values, tuple(t + 1 for t in b.token_ids), b.start,
                                                     b.meta)))
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    fresh = [s for s in got.sources if s.source == "fresh" and s.kind == "prefix"]
    assert [s.tokens for s in fresh] == [BLOCK_TOKENS]  # only the damaged block's slots were recomputed
    assert got.cached_tokens == (got.prompt_tokens // BLOCK_TOKENS - 1) * BLOCK_TOKENS
    s = disk.tier_stats()[0]
    assert s.corrupt == (damage == "corrupt")
    assert s.misses == (damage == "corrupt")
    assert victim.exists()  # the recomputed block is stored again, on disk too
    logits = new_engine(loaded, folder)[0].next_token_logits(prompt, "exact")
    assert (logits - ref_logits).abs().max().item() <= TOL


def test_a_file_removed_before_the_request_ends_the_chain_there(loaded, on_disk):
    """Planning sees that the file is gone (no entry under its name): the blocks after it are not used, as
    before direct loads, since the chain is only walked as far as its blocks are found."""
    folder, prompt = on_disk
    ref, ref_logits = full_reference(loaded, prompt)
    engine, _, disk = new_engine(loaded, folder)
    files = prefix_files(folder)
    keys = [p.name.removeprefix("kv-").removesuffix(".safetensors") for p in files]
    pending = to_read(engine, prompt, "exact")
    order = [p.key for p in pending]
    assert sorted(order) == sorted(keys)
    disk.file_for(order[2]).unlink()
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens == pending[0].n + pending[1].n
    assert disk.tier_stats()[0].misses >= 1
    assert (engine.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= TOL


def test_a_file_removed_between_planning_and_loading(loaded, on_disk):
    folder, prompt = on_disk
    _, ref_logits = full_reference(loaded, prompt)
    engine, _, disk = new_engine(loaded, folder)
    plan, blocks = planned(engine, prompt, "exact")
    pending = [p for p in plan.pieces if p.load == "read"]
    assert len(pending) == len(prefix_files(folder))
    for p in pending[:2]:
        disk.file_for(p.key).unlink()
    asm = engine.assembler.assemble(plan, blocks, extra_capacity=0)
    try:
        assert (asm.logits - ref_logits).abs().max().item() <= TOL
        lost = pending[0].n + pending[1].n
        assert asm.cached_tokens == sum(p.n for p in pending) - lost
        assert not {k for p in pending[:2] for k in (p.key, *p.members)} & asm.plan.as_built().hits
        # recorded on the plan, not written over it: the plan still says what was planned
        assert [(e.slot, e.what) for e in asm.plan.events] == [(p.slot, "lost") for p in pending[:2]]
        assert asm.plan.pieces == plan.pieces
        assert sum(p.n for p in asm.pieces if p.source == "fresh" and p.kind == "prefix") == lost
    finally:
        engine.runner.release_cache(asm.cache)
    assert disk.tier_stats()[0].misses == 2


def test_an_unreadable_block_is_recomputed(loaded, on_disk, monkeypatch):
    folder, prompt = on_disk
    ref, ref_logits = full_reference(loaded, prompt)
    engine, _, disk = new_engine(loaded, folder)
    bad = prefix_files(folder)[0]  # the extent (kv-extent- sorts first): its blocks are recomputed
    pending = to_read(engine, prompt, "exact")
    lost = next(p.n for p in pending if disk.file_for(p.key) == bad)
    real = disk_module._open_block  # both reads (in place and staged) open the file through it

    def flaky(path, *args, **kwargs):
        if path == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_module, "_open_block", flaky)
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens == sum(p.n for p in pending) - lost
    assert disk.tier_stats()[0].errors == 1
    assert (engine.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= TOL


def chunk_prompt(docs):
    return [pc_rag.Text(system_text()), pc_rag.Chunk(docs[0]), pc_rag.Text("\n\n"), pc_rag.Chunk(docs[1]),
            pc_rag.Text(PROMPT_QUESTION)]


@pytest.mark.parametrize("mode", ["modular", "blend"])
def test_relocated_blocks_from_disk_equal_those_from_memory(loaded, tmp_path, docs, mode):
    """Reference: the same request with every block in memory (the engine that encoded them). From disk, the
    prefix and the chunks are read straight into the request buffer (chunk keys rotated there), then promoted to
    memory after the reply, bit for bit what disk holds."""
    model, tok = loaded
    prompt = chunk_prompt(docs)
    first = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.generate(prompt, mode=mode, max_new_tokens=2)
    ref, ref_origins = served(first, prompt, mode)
    assert ref_origins["chunk"] == {"memory"}
    engine, memory, disk = new_engine(loaded, tmp_path)
    chunks = [p for p in engine.explain(prompt, mode).plan.pieces if p.source == "chunk"]
    assert chunks and all(p.load == "read" and p.position != p.encode_start for p in chunks)
    logits, origins = served(engine, prompt, mode)
    assert origins["chunk"] == {"disk"} and (mode == "blend" or "disk" in origins["prefix"])
    assert (logits - ref).abs().max().item() <= 1e-5
    for p in chunks:
        held, stored = memory.get(p.key), disk.get(p.key)
        assert torch.equal(held.keys, stored.keys) and torch.equal(held.values, stored.values)
    again = engine.generate(prompt, mode=mode, max_new_tokens=2)
    assert {s.origin for s in again.sources if s.source == "chunk"} == {"memory"}


def test_a_chunk_damaged_after_planning_is_encoded_again(loaded, tmp_path, docs):
    """Reference: modular with every block in memory. A chunk file corrupted between planning and loading is
    encoded again on its own (as a miss would be), so the answer is still modular's, and stored again."""
    model, tok = loaded
    prompt = chunk_prompt(docs)
    first = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.generate(prompt, mode="modular", max_new_tokens=2)
    ref = first.next_token_logits(prompt, "modular")
    engine, memory, disk = new_engine(loaded, tmp_path)
    plan, blocks = planned(engine, prompt, "modular")
    victim = next(p for p in plan.pieces if p.source == "chunk")
    path = disk.file_for(victim.key)
    flip(path, path.stat().st_size // 2, 0x04)
    asm = engine.assembler.assemble(plan, blocks, extra_capacity=4)
    try:
        assert (asm.logits - ref).abs().max().item() <= 1e-5
        redone = next(p for p in asm.pieces if p.slot == victim.slot)
        assert redone.origin == "computed" and redone.load == "encode"
        assert asm.cached_tokens == plan_cached(plan) - victim.n
    finally:
        engine.runner.release_cache(asm.cache)
    assert disk.tier_stats()[0].corrupt == 1 and disk.get(victim.key) is not None  # stored again


def test_a_repeated_chunk_damaged_after_planning_is_encoded_once(loaded, tmp_path, docs):
    model, tok = loaded
    prompt = [pc_rag.Text(system_text()), pc_rag.Chunk(docs[0]), pc_rag.Text("\n\n"), pc_rag.Chunk(docs[0]),
              pc_rag.Text(PROMPT_QUESTION)]
    first = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.generate(prompt, mode="modular", max_new_tokens=1)
    ref, _ = served(first, prompt, "modular")
    engine, _, disk = new_engine(loaded, tmp_path)
    plan, blocks = planned(engine, prompt, "modular")
    twice = [p for p in plan.pieces if p.source == "chunk" and p.kind == "chunk"]
    assert len(twice) == 2 and twice[0].key == twice[1].key
    path = disk.file_for(twice[0].key)
    flip(path, path.stat().st_size // 2, 0x04)
    asm = engine.assembler.assemble(plan, blocks, extra_capacity=4)
    try:
        assert (asm.logits - ref).abs().max().item() <= 1e-5
        assert engine.stats()["encodes"]["request"]["chunks"] == 1
    finally:
        engine.runner.release_cache(asm.cache)


def served(engine, prompt, mode):
    """One request through the assembler as `generate` runs it: (next-token logits, {source: origins}); the blocks
    read from disk are promoted to memory after it, as after a reply."""
    plan, blocks = planned(engine, prompt, mode)
    recompute = pc_rag.assemble.Recompute(0.3, engine.blend_selection) if mode == "blend" else None
    asm = engine.assembler.assemble(plan, blocks, extra_capacity=4, recompute=recompute)
    try:
        engine.assembler.save_prefix(asm)
    finally:
        engine.runner.release_cache(asm.cache)
    origins: dict[str, set] = {}
    for p in asm.pieces:
        origins.setdefault(p.source, set()).add(p.origin)
    return asm.logits, origins


def planned(engine, prompt, mode):
    """A request's plan as `generate` makes it (lookups counted, blocks kept for the build), and the blocks its
    lookups found: what `Assembler.assemble` carries out."""
    lookups = engine.assembler.lookups()
    return engine.planner.plan(engine.segmenter.segments(engine.split(prompt) if isinstance(prompt, str) else prompt),
                               mode, lookups), lookups.blocks


def to_read(engine, prompt, mode):
    """The pieces a request would read straight into its buffer, as `Engine.explain` plans them (it reads and counts
    nothing, so the tier counters the tests check are the request's own)."""
    return [p for p in engine.explain(prompt, mode).plan.pieces if p.load == "read"]


def plan_cached(plan) -> int:
    """Tokens a plan reuses, should every pending block load (the last token is always computed)."""
    n = sum(p.n for p in plan.pieces if p.source != "fresh" and p.origin != "computed")
    return n - (plan.pieces[-1].source != "fresh")


@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_block_used_twice_is_read_once_and_counted_once(loaded, tmp_path, docs, compress):
    """Three chunks, so the separator block is used twice, and a chunk repeated. Reference: the same disk read
    the way it was before reads in place (`read_into_own_memory`: every block into memory of its own, then
    relocated). int8 blocks are read staged (dequantized) and copied relocated: their duplicates are rotated from
    where the first copy's keys are."""
    model, tok = loaded
    prompt = [pc_rag.Text(system_text()), pc_rag.Chunk(docs[0]), pc_rag.Text("\n\n"), pc_rag.Chunk(docs[1]),
              pc_rag.Text("\n\n"), pc_rag.Chunk(docs[0]), pc_rag.Text(PROMPT_QUESTION)]
    spec = TieredStore([MemoryStore(), DiskStore(tmp_path, compress=compress)])
    pc_rag.Engine(model, tok, store=spec).generate(prompt, mode="modular", max_new_tokens=1)
    before = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path, compress=compress)]))
    read_into_own_memory(before)
    ref, _ = served(before, prompt, "modular")
    memory, disk = MemoryStore(), DiskStore(tmp_path, compress=compress)
    engine = pc_rag.Engine(model, tok, store=TieredStore([memory, disk]))
    plan = engine.explain(prompt, "modular").plan
    relocated = [p for p in plan.pieces if p.load == "read" and p.relocated]
    keys = {p.key for p in relocated}
    assert len(keys) < len(relocated)  # some blocks are used twice
    logits, origins = served(engine, prompt, "modular")
    assert origins["chunk"] == {"disk"}
    assert (logits - ref).abs().max().item() <= 1e-5
    reads = len(keys) + sum(1 for p in plan.pieces if p.load == "read" and not p.relocated)
    assert disk.tier_stats()[0].hits == reads  # each block read once, and its promotion not counted again
    assert all(memory.contains(k) for k in keys)


@pytest.mark.parametrize("compress", [None, "int8"])
@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_blocks_from_redis_are_read_into_the_buffer(loaded, docs, compress, mode):
    """Redis reads into the request buffer too (one EXISTS round trip at planning, one GET round trip for the
    blocks). Reference: the same Redis read the way it was before (`read_into_own_memory`: every block decoded into
    memory of its own, then copied or relocated), within 1e-5; each block fetched once and counted once, and the
    blocks promoted to memory are those Redis holds."""
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.FakeServer()

    def redis():
        return RedisStore(client=fakeredis.FakeRedis(server=server), compress=compress)

    model, tok = loaded
    prompt = chunk_prompt(docs)
    pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), redis()])).generate(prompt, mode=mode, max_new_tokens=1)
    before = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), redis()]))
    read_into_own_memory(before)
    ref, _ = served(before, prompt, mode)
    memory, tier = MemoryStore(), redis()
    engine = pc_rag.Engine(model, tok, store=TieredStore([memory, tier]))
    pending = to_read(engine, prompt, mode)
    assert pending and {p.origin for p in pending} == {"redis"}
    logits, origins = served(engine, prompt, mode)
    assert "redis" in origins["prefix" if mode == "exact" else "chunk"]
    assert (logits - ref).abs().max().item() <= 1e-5
    assert tier.tier_stats()[0].hits == len({p.key for p in pending})
    for p in pending:
        if p.relocated:  # relocated blocks are promoted as Redis holds them
            held, stored = memory.get(p.key), tier.get(p.key)
            assert torch.equal(held.keys, stored.keys) and torch.equal(held.values, stored.values)


def test_bfloat16_chunks_from_disk_equal_those_from_memory(tiny_path, tmp_path, docs):
    """bfloat16 keys read in place are rotated by `relocate` after the reads, as blocks from memory are: the same
    computation on the same bytes."""
    prompt = chunk_prompt(docs)
    memory = MemoryStore()
    first = pc_rag.Engine.from_pretrained(tiny_path, dtype="bfloat16", store=TieredStore([memory, DiskStore(tmp_path)]))
    first.generate(prompt, mode="modular", max_new_tokens=1)
    # Both from engines that have seen nothing (the first one's prefix index would let it run only the last token,
    # as a decode step: another kernel, which rounds bf16 differently).
    ref, ref_origins = served(pc_rag.Engine(first.model, first.tokenizer, store=TieredStore([memory])), prompt,
                              "modular")
    engine = pc_rag.Engine(first.model, first.tokenizer, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    logits, origins = served(engine, prompt, "modular")
    assert ref_origins["chunk"] != {"disk"} and origins["chunk"] == {"disk"}
    assert (logits - ref).abs().max().item() <= 1e-5


def test_a_store_of_ones_own_keeps_working(loaded):
    model, tok = loaded
    prompt = system_text() + PROMPT_QUESTION
    ref, _ = full_reference(loaded, prompt)
    engine = pc_rag.Engine(model, tok, store=PlainStore())
    engine.generate(prompt, mode="exact", max_new_tokens=4)
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert {s.origin for s in got.sources if s.source == "prefix"} == {"plain"}
    assert got.token_ids == ref.token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_in_the_buffer_bit_for_bit(tiny_path, tmp_path, dtype):
    """Reference: the blocks as the disk tier's `get` returns them. What the request buffer held is what memory
    gets after the reply (cloned from the buffer), so the promoted blocks must equal them exactly."""
    prompt = system_text() + PROMPT_QUESTION
    first = pc_rag.Engine.from_pretrained(tiny_path, dtype=dtype, store=TieredStore([MemoryStore(),
                                                                                      DiskStore(tmp_path)]))
    first.generate(prompt, mode="exact", max_new_tokens=1)
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    engine = pc_rag.Engine(first.model, first.tokenizer, store=TieredStore([memory, disk]))
    pending = to_read(engine, prompt, "exact")
    assert pending  # (an extent's blocks are compared one by one: tests/test_extents.py has prompts with extents)
    engine.next_token_logits(prompt, "exact")
    pairs = []  # (block key, the stored entry's keys and values for its slots)
    for p in pending:
        stored = disk.get(p.key)
        for j, key in enumerate(p.block_keys):
            span = slice(j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
            pairs.append((key, stored.keys[:, :, span], stored.values[:, :, span]))
    for key, ref_k, ref_v in pairs[:-1]:  # the last block may end with the prompt's last token, recomputed
        got = memory.get(key)
        assert got.keys.dtype == getattr(torch, dtype)
        assert torch.equal(got.keys, ref_k) and torch.equal(got.values, ref_v)


def test_the_read_target_falls_back_to_relocate_off_the_numpy_path(engine):
    """Buffers on an accelerator (no machine with one here) take `runner.relocate`, as does a block of another
    dtype: exercised on the CPU with a float64 block. Reference: the block cast to the buffer's dtype."""
    from pc_rag.plan import Piece

    shape = engine.runner.shape
    cache = engine.runner.new_cache(64)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(shape.num_layers, shape.kv_heads, 32, shape.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(k.shape, generator=g, dtype=torch.float64)
    ids = tuple(range(64))
    take = engine.assembler._read_target(Piece(32, 32, "prefix", "prefix", 32), ids, cache, [], {}).take
    assert take(KVBlock(k, v, ids[32:], 32)) is True
    dk, dv = cache.block_views(32, 64)
    assert torch.equal(dk, k.float()) and torch.equal(dv, v.float())
    assert take(KVBlock(k, v, ids[:32], 32)) is False  # other tokens: refused
