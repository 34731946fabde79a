"""Blocks a pooled request buffer still holds from its last request (model/cache.py: `HeldBlock`, `SlotCache.holds`,
`wrote`; `LlamaRunner.acquire_cache(wanted=)`; `Assembler.assemble`): found in place, they are not copied again.
Each test runs the same requests on two fresh engines, one with every block copied in (`holds` always False), and
the logits must be equal bit for bit: the same plans, the same bytes in the buffer. Any write below a held block
(a forward at its slots, blend's recomputed tokens) must make the next request copy it again."""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import HeldBlock
from pc_rag.model import cache as cache_module
from pc_rag.store import MemoryStore

from .test_engine import rag_prompt


def _engine(loaded):
    return pc_rag.Engine(*loaded, store=MemoryStore())


def _copies(engine, monkeypatch) -> list[int]:
    """Tokens of every block the assembler copies into a request buffer from here on (each goes through
    runner.relocate)."""
    copied = []
    real = engine.runner.relocate

    def relocate(dst, src, delta):
        copied.append(src.shape[2])
        return real(dst, src, delta)

    monkeypatch.setattr(engine.runner, "relocate", relocate)
    return copied


def _both(loaded, monkeypatch, requests):
    """`requests(engine)` on a fresh engine, then on another with no block ever found in place: both results."""
    held = requests(_engine(loaded))
    with monkeypatch.context() as m:
        m.setattr(cache_module.SlotCache, "holds", lambda self, *a: False)
        copied = requests(_engine(loaded))
    return held, copied


@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_blocks_held_in_the_pooled_buffer_are_not_copied_again(loaded, docs, monkeypatch, mode):
    copies = {}

    def requests(engine):
        engine.next_token_logits(rag_prompt(docs, question="First question?"), mode)
        engine.next_token_logits(rag_prompt(docs, question="Second question?"), mode)  # its blocks stay in place
        copies[engine] = _copies(engine, monkeypatch)
        return engine.next_token_logits(rag_prompt(docs, question="Third question, another one?"), mode)

    held, copied = _both(loaded, monkeypatch, requests)
    on, off = copies.values()
    assert on == [] and sum(off) > 0, f"{mode}: copied {on} tokens that the pooled buffer held ({off} without)"
    assert torch.equal(held, copied)


@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_blocks_a_request_stored_from_its_buffer_are_held_too(loaded, docs, monkeypatch, mode):
    """A prompt computed once, then continued (a chat's next turn): its prefix blocks were stored from the buffer,
    which holds them; the next turn copies none of them."""
    first = [Text("System text about Python.\n\n"), Text(docs[0]), Text("\n\nUser: what is this?")]
    copies = {}

    def requests(engine):
        engine.next_token_logits(first, mode)
        copies[engine] = _copies(engine, monkeypatch)
        return engine.next_token_logits([*first, Text("\nAssistant: a topic.\nUser: and then?")], mode)

    held, copied = _both(loaded, monkeypatch, requests)
    on, off = copies.values()
    assert on == [] and sum(off) > 0, f"{mode}: copied {on} ({off} without holding)"
    assert torch.equal(held, copied)


def test_chunks_in_other_slots_are_copied(loaded, docs, monkeypatch):
    copies = {}

    def requests(engine):
        engine.next_token_logits(rag_prompt(docs, (0, 1), question="First?"), "modular")
        copies[engine] = _copies(engine, monkeypatch)
        return engine.next_token_logits(rag_prompt(docs, (1, 0), question="First?"), "modular")  # chunks swapped

    held, copied = _both(loaded, monkeypatch, requests)
    on, off = copies.values()
    assert len(on) >= 2 and len(off) >= len(on)
    assert torch.equal(held, copied)


@pytest.mark.parametrize("write", ["forward", "decode step"])
def test_a_write_over_held_slots_makes_the_next_request_copy_them(loaded, docs, monkeypatch, write):
    prompt = rag_prompt(docs, question="What is this?")
    copies = {}

    def requests(engine):
        engine.next_token_logits(prompt, "modular")
        # Another use of the pooled buffer writes other tokens' KV into slots its first chunk occupies.
        runner = engine.runner
        (buffer,) = runner._pool
        cache = runner.acquire_cache(buffer.capacity)
        assert cache is buffer
        chunk = max(cache.held, key=lambda h: h.n)
        slot = chunk.slot + 2
        cache.length = slot
        if write == "forward":
            runner.forward(cache, [5, 6, 7], [slot, slot + 1, slot + 2], [slot, slot + 1, slot + 2])
        else:
            runner.decode_batch([cache], [5], [slot], [slot])
        runner.release_cache(cache)
        copies[engine] = _copies(engine, monkeypatch)
        return engine.next_token_logits(prompt, "modular"), chunk.n

    (held, n), (copied, _) = _both(loaded, monkeypatch, requests)
    on, _ = copies.values()
    assert n in on, "the block over the written slots was trusted"
    assert torch.equal(held, copied)


def test_blend_recomputed_tokens_are_not_taken_for_the_chunks(loaded, docs, monkeypatch):
    prompt = rag_prompt(docs, question="Which one?")

    def requests(engine):
        engine.next_token_logits(prompt, "modular")
        engine.next_token_logits(prompt, "blend", recompute_ratio=0.5)  # rewrites some of the chunks' slots
        return engine.next_token_logits(prompt, "modular")

    held, copied = _both(loaded, monkeypatch, requests)
    assert torch.equal(held, copied)


def test_another_namespace_never_finds_a_held_block(engine, docs, monkeypatch):
    prompt = rag_prompt(docs, question="Whose prompt?")
    engine.next_token_logits(prompt, "exact", cache_salt="tenant-b")  # b's blocks stored
    engine.next_token_logits(prompt, "exact", cache_salt="tenant-a")
    engine.next_token_logits(prompt, "exact", cache_salt="tenant-a")  # the pooled buffer holds a's blocks
    (buffer,) = engine.runner._pool
    held = sum(b.n for b in buffer.held)
    assert held > 0
    copied = _copies(engine, monkeypatch)
    engine.next_token_logits(prompt, "exact", cache_salt="tenant-b")  # the same tokens, its own blocks
    assert sum(copied) >= held, "tenant b's request took blocks tenant a's left in the buffer"


def test_replies_over_held_blocks_equal_copied(loaded, docs, monkeypatch):
    """Decoding writes after the prompt: the held blocks stay intact; whole replies, greedy and seeded, are the same."""
    prompts = [[Text("System text that stays the same.\n\n"), Chunk(docs[2]), Text(f"\n\nQuestion {i}?")]
               for i in range(3)]

    def requests(engine):
        return [engine.generate(p, mode=mode, max_new_tokens=8, temperature=t, seed=1).token_ids
                for mode in ("exact", "modular") for t in (0.0, 0.8) for p in prompts]

    held, copied = _both(loaded, monkeypatch, requests)
    assert held == copied


def test_acquire_prefers_the_buffer_holding_the_wanted_blocks(engine):
    runner = engine.runner
    small, large = runner.acquire_cache(300), runner.acquire_cache(600)
    block = HeldBlock("key", 0, 100, 0)
    large.hold((block,))
    runner.release_cache(small)
    runner.release_cache(large)
    assert runner.acquire_cache(200, [block]) is large
    assert runner.acquire_cache(200, [block]) is small
    large.wrote(50, 51)
    assert not large.holds("key", 0, 100, 0) and large.holds("key", 0, 50, 0)
    assert not large.holds("key", 0, 50, 1) and not large.holds("other", 0, 50, 0)
    large.hold((block, HeldBlock("next", 100, 20, 100)))
    large.wrote(0, 1)  # before both: the first is gone, the second intact
    assert not large.holds("key", 0, 1, 0) and large.holds("next", 100, 20, 100)
    large.wrote(120, 130)  # after both
    assert large.holds("next", 100, 20, 100)
