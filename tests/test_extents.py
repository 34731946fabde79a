"""Extents: the persistent tiers hold an exact prefix's blocks in groups of EXTENT_BLOCKS (one file or Redis value
per group), memory keeps single blocks. References: `full` (logits within 1e-4, same greedy tokens) and the stored
entries themselves (bit for bit)."""

from __future__ import annotations

import pytest
import torch

import pc_rag
from pc_rag.prefix import BLOCK_TOKENS, EXTENT_BLOCKS, BlockRef, extent_key, extents
from pc_rag.store import DiskStore, MemoryStore, RedisStore, TieredStore

TOL = 1e-4
GROUP = EXTENT_BLOCKS * BLOCK_TOKENS


def long_text(n_topics: int = 3) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t][:1500] for t in ("for", "while", "if", "try")[:n_topics])


# ---- grouping, without a model --------------------------------------------------------------------------
def refs_of(sizes):
    out, a = [], 0
    for i, n in enumerate(sizes):
        out.append(BlockRef(a, a + n, f"prefix-{i:040x}", "root"))
        a += n
    return out


def test_whole_groups_only_aligned_to_the_run_and_named_by_their_last_block():
    refs = refs_of([BLOCK_TOKENS] * (2 * EXTENT_BLOCKS + 3))
    assert extents(refs) == [(0, extent_key(refs[EXTENT_BLOCKS - 1].key)),
                             (EXTENT_BLOCKS, extent_key(refs[2 * EXTENT_BLOCKS - 1].key))]
    assert extent_key("prefix-" + "ab" * 20) == "extent-" + "ab" * 20
    short_last = refs_of([BLOCK_TOKENS] * (EXTENT_BLOCKS - 1) + [BLOCK_TOKENS - 5])
    assert extents(short_last) == []  # a closed run's short last block never makes a group whole
    assert extents(refs_of([BLOCK_TOKENS] * (EXTENT_BLOCKS - 1))) == []


# ---- the engine --------------------------------------------------------------------------------------------
def tiered(folder):
    memory, disk = MemoryStore(), DiskStore(folder)
    return TieredStore([memory, disk]), memory, disk


def full_reference(loaded, prompt, max_new_tokens=4):
    model, tok = loaded
    ref = pc_rag.Engine(model, tok, store=MemoryStore())
    return ref.generate(prompt, mode="full", max_new_tokens=max_new_tokens), ref.next_token_logits(prompt, "full")


def written(loaded, folder, prompt, max_new_tokens=1):
    """An engine over memory and `folder` that answered `prompt` once: (engine, memory, disk)."""
    model, tok = loaded
    store, memory, disk = tiered(folder)
    engine = pc_rag.Engine(model, tok, store=store)
    engine.generate(prompt, mode="exact", max_new_tokens=max_new_tokens)
    return engine, memory, disk


def entries(disk: DiskStore) -> list[str]:
    return sorted(p.name.removeprefix("kv-").removesuffix(".safetensors") for p in disk.blocks_dir.iterdir())


def test_groups_go_to_disk_as_extents_and_come_back_whole(loaded, tmp_path):
    model, tok = loaded
    prompt = long_text(4)
    ref, ref_logits = full_reference(loaded, prompt)
    first, memory, disk = written(loaded, tmp_path, prompt, max_new_tokens=4)
    n_prompt = len(first.tokenizer(prompt)["input_ids"])
    groups = (n_prompt - GROUP) // GROUP  # whole groups ending at least a group before the prompt's end
    assert groups >= 2
    on_disk = entries(disk)
    assert sum(k.startswith("extent-") for k in on_disk) == groups
    # on disk: the extents, then single blocks for the last 256-511 tokens and the reply; memory: single blocks
    assert sum(k.startswith("prefix-") for k in on_disk) <= (n_prompt + 4) // BLOCK_TOKENS - groups * EXTENT_BLOCKS
    assert not any(memory.contains(k) for k in on_disk if k.startswith("extent-"))
    assert memory.tier_stats()[0].entries >= n_prompt // BLOCK_TOKENS
    # a new process: the groups are read from their extents, straight into the request buffer
    store2, memory2, disk2 = tiered(tmp_path)
    engine = pc_rag.Engine(model, tok, store=store2)
    plan = engine.explain(prompt, "exact").plan
    spans = [p for p in plan.pieces if p.members]
    assert len(spans) == groups and all(p.n == GROUP and p.load == "read" for p in spans)
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens >= groups * GROUP
    s = disk2.tier_stats()[0]
    assert (s.hits, s.misses, s.corrupt) == (len(on_disk), 0, 0)  # one read per entry, nothing asked in vain
    # memory now holds every block of the extents, bit for bit what the extent holds for its slots
    for p in spans:
        stored = disk2.get(p.key)
        for j, key in enumerate(p.members):
            held = memory2.get(key)
            span = slice(j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
            assert torch.equal(held.keys, stored.keys[:, :, span]) and torch.equal(held.values,
                                                                                   stored.values[:, :, span])
    assert entries(disk2) == on_disk  # nothing written again
    # and the next request is served from memory alone, asking the disk nothing
    before = disk2.tier_stats()[0]
    assert (engine.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= TOL
    after = disk2.tier_stats()[0]
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_a_prompt_leaving_a_group_midway_reuses_the_groups_before_it(loaded, tmp_path):
    """From another process, a group stored as an extent is found only whole (the documented cost of extents): the
    prompt that differs inside group 2 reuses group 1, and its output still equals full."""
    model, tok = loaded
    prompt = long_text(4)
    assert len(tok(prompt)["input_ids"]) > 3 * GROUP  # so that group 2 ends far from the prompt's end
    store, _, _ = tiered(tmp_path)
    pc_rag.Engine(model, tok, store=store).generate(prompt, mode="exact", max_new_tokens=1)
    ids = tok(prompt)["input_ids"]
    cut = GROUP + 3 * BLOCK_TOKENS + 5  # inside the second group
    other = tok.decode(ids[:cut]) + " something else entirely, and more words after it."
    ref, ref_logits = full_reference(loaded, other)
    engine = pc_rag.Engine(model, tok, store=tiered(tmp_path)[0])
    got = engine.generate(other, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens == GROUP
    assert (engine.next_token_logits(other, "exact") - ref_logits).abs().max().item() <= TOL


def test_a_growing_chat_turns_its_single_blocks_into_an_extent(loaded, tmp_path):
    """Request 1 ends less than a group after its first group: its blocks go to disk singly. Request 2 continues it
    well past: the group is written as an extent. A new process then reads it as one entry."""
    model, tok = loaded
    text = long_text(3)
    ids = tok(text)["input_ids"]
    assert len(ids) > 2 * GROUP + BLOCK_TOKENS
    short = tok.decode(ids[: GROUP + GROUP // 2])
    store, _, disk = tiered(tmp_path)
    engine = pc_rag.Engine(model, tok, store=store)
    engine.generate(short, mode="exact", max_new_tokens=1)
    assert not any(k.startswith("extent-") for k in entries(disk))
    engine.generate(text, mode="exact", max_new_tokens=1)
    assert any(k.startswith("extent-") for k in entries(disk))
    ref, ref_logits = full_reference(loaded, text)
    fresh = pc_rag.Engine(model, tok, store=tiered(tmp_path)[0])
    plan = fresh.explain(text, "exact").plan
    assert plan.pieces[0].members and plan.pieces[0].load == "read"
    assert (fresh.next_token_logits(text, "exact") - ref_logits).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["disk alone", "redis"])
def test_extents_in_a_persistent_store_alone_and_in_redis(loaded, tmp_path, kind):
    model, tok = loaded
    prompt = long_text(3)
    ref, ref_logits = full_reference(loaded, prompt)
    if kind == "redis":
        fakeredis = pytest.importorskip("fakeredis")
        server = fakeredis.FakeServer()

        def store():
            return TieredStore([MemoryStore(), RedisStore(client=fakeredis.FakeRedis(server=server))])
    else:
        def store():
            return DiskStore(tmp_path)
    pc_rag.Engine(model, tok, store=store()).generate(prompt, mode="exact", max_new_tokens=1)
    engine = pc_rag.Engine(model, tok, store=store())
    plan = engine.explain(prompt, "exact").plan
    assert any(p.members for p in plan.pieces)
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids and got.cached_tokens >= GROUP
    assert (engine.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= TOL


def test_a_damaged_extent_is_recomputed_and_written_again(loaded, tmp_path):
    """The process that wrote the extent, its memory emptied: the damaged extent fails its checksum when read, its
    256 slots are computed in the request's forward (equals full), and it is stored again after the reply,
    although this process remembers writing it."""
    prompt = long_text(4)
    ref, ref_logits = full_reference(loaded, prompt)
    engine, memory, disk = written(loaded, tmp_path, prompt)
    victim = next(k for k in entries(disk) if k.startswith("extent-"))
    path = disk.file_for(victim)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    memory.clear()
    engine.planner.prefixes.clear()
    got = engine.generate(prompt, mode="exact", max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert disk.tier_stats()[0].corrupt == 1
    assert disk.get(victim) is not None  # whole again
    assert (engine.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= TOL
