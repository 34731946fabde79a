"""A prefix read in place by every request over it (model/cache.py SharedPrefix), not copied into each buffer.

Reference: `full` mode (one forward over the whole prompt, nothing reused) and plain attention over the prefix and
the buffer laid end to end. Tolerances: logits 1e-4 (fp32), attention outputs 1e-5; greedy token ids equal."""

from __future__ import annotations

import threading

import pytest
import torch

import pc_rag
from pc_rag.model import attention, kernels
from pc_rag.model.attention import Heads, Writes, lse_attention, merge
from pc_rag.model.backends import choose
from pc_rag.store import MemoryStore

SYSTEM = "System: " + " ".join(f"rule {i}: answer with care and cite the documents." for i in range(45))


def questions(n: int) -> list[str]:
    return [SYSTEM + f"\n\nQuestion {i}: what does item {i * 7} say?" for i in range(n)]


@pytest.fixture(params=["native", "sdpa"])
def shared(loaded, request):
    """An engine whose first request stored the system text's blocks, and which shares prefixes as it does while
    other requests run (a request alone copies); native: the fused step and kernels."""
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    if request.param == "sdpa":
        engine.runner.choose_backends(native=False)
    engine.generate(SYSTEM + "\n\nA first question.", mode="exact", max_new_tokens=2)
    engine.runner.others_decoding = lambda: True
    yield engine
    engine.runner.choose_backends()


def test_a_prompt_over_a_stored_prefix_reads_it_in_place_and_equals_full(shared):
    engine, prompt = shared, questions(1)[0]
    want = engine.next_token_logits(prompt, mode="full")
    got = engine.next_token_logits(prompt, mode="exact")
    assert (got - want).abs().max() <= 1e-4
    stats = engine.runner.shared_stats()
    assert stats["prefixes"] == 1 and stats["users"] == 0 and stats["bytes"] > 0
    full = engine.generate(prompt, mode="full", max_new_tokens=16)
    gen = engine.generate(prompt, mode="exact", max_new_tokens=16, n=2)
    assert gen.cached_tokens >= engine.runner.shared_prefix_min_tokens
    assert [c.token_ids for c in gen.choices] == [full.token_ids, full.token_ids]  # n replies share it too
    assert engine.runner.shared_stats()["users"] == 0


def test_concurrent_requests_over_one_prefix_hold_it_once_and_answer_as_one_at_a_time(shared):
    engine = shared
    prompts = questions(6)
    want = [engine.generate(p, mode="full", max_new_tokens=12).token_ids for p in prompts]
    runner, seen = engine.runner, []
    release = runner.release_cache

    def watched(cache):  # what is held while the requests run: every buffer but the last still out
        seen.append((cache.base is not None, runner.shared_stats()))
        release(cache)

    runner.release_cache = watched
    try:
        got = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(
            i, engine.generate(prompts[i], mode="exact", max_new_tokens=12))) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        runner.release_cache = release
    assert [g.token_ids for g in got] == want
    assert all(based for based, _ in seen)
    assert max(s["users"] for _, s in seen) >= 2 and all(s["prefixes"] == 1 for _, s in seen)
    assert runner.shared_stats()["users"] == 0


def test_a_conversation_continues_after_a_shared_prefix_and_stays_exact(shared):
    """The reply is saved as prefix blocks straddling the shared prefix's end; the next turn reuses them."""
    engine = shared
    first = questions(1)[0]
    reply = engine.generate(first, mode="exact", max_new_tokens=10)
    turn = first + reply.text + "\n\nAnd then?"
    want = engine.next_token_logits(turn, mode="full")
    got = engine.generate(turn, mode="exact", max_new_tokens=1)
    assert got.cached_tokens > len(reply.prompt_ids)
    assert (engine.next_token_logits(turn, mode="exact") - want).abs().max() <= 1e-4


def test_a_request_alone_copies_as_before(loaded):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    for prompt in questions(3):
        engine.generate(prompt, mode="exact", max_new_tokens=2)
    assert engine.runner.shared_stats()["prefixes"] == 0


def test_blend_and_short_prefixes_copy_as_before(loaded):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    engine.runner.others_decoding = lambda: True
    short = "Short system text.\n\nQuestion?"
    engine.generate(short, mode="exact", max_new_tokens=2)
    engine.generate(short, mode="exact", max_new_tokens=2)
    assert engine.runner.shared_stats()["prefixes"] == 0  # under shared_prefix_min_tokens
    engine.generate(SYSTEM + "\n\nQ?", mode="exact", max_new_tokens=2)
    want = engine.next_token_logits(SYSTEM + "\n\nQ2?", mode="full")
    got = engine.next_token_logits(SYSTEM + "\n\nQ2?", mode="blend", recompute_ratio=0.5)
    assert engine.runner.shared_stats()["prefixes"] == 0  # blend recomputes in place: never a shared prefix
    assert (got - want).abs().max() <= 1e-4  # an exact prefix is exact in blend too


def test_windowed_models_do_not_share(tmp_path):
    path = pc_rag.testing.build_tiny(tmp_path / "mistral", "mistral")
    engine = pc_rag.Engine.from_pretrained(path, store="memory")
    assert not engine.runner.shares_prefixes


# ---- the attention pieces against plain attention over the prefix and the buffer end to end ------------------
def _heads(h: int, hk: int) -> Heads:
    return Heads(num_key_value_groups=h // hk, scaling=0.25)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("hk", [4, 2])
@pytest.mark.parametrize("layout", ["causal", "after", "slots", "decode"])
def test_attention_after_a_shared_prefix_equals_one_attention_over_both(hk, layout, native):
    """attend() with a shared prefix against sdpa over the prefix and the buffer laid end to end, each query
    seeing all of the prefix and the buffer's slots up to its own (what slots the layout writes is its own)."""
    if native and kernels.loaded() is None:
        pytest.skip("pc_rag's CPU kernels did not build here")
    g = torch.Generator().manual_seed(hk * 10 + len(layout))
    h, d, p = 4, 16, 40
    old, n = {"causal": (0, 7), "after": (9, 7), "slots": (9, 6), "decode": (12, 1)}[layout]
    heads = _heads(h, hk)
    backends = choose(torch.float32, False, kernels.loaded() if native else None)
    base = (torch.randn(1, hk, p, d, generator=g), torch.randn(1, hk, p, d, generator=g))
    buf_k, buf_v = torch.randn(1, hk, 32, d, generator=g), torch.randn(1, hk, 32, d, generator=g)
    q, k, v = (torch.randn(1, x, n, d, generator=g) for x in (h, hk, hk))
    slots = [old + i for i in (0, 2, 3, 5, 6, 8)] if layout == "slots" else list(range(old, old + n))
    w = Writes.of(slots, torch.float32, "cpu", backends)
    assert w.layout == {"causal": "causal", "slots": "slots"}.get(layout, "after")
    out = attention.attend(buf_k, buf_v, heads, None, q, k, v, w, backends, base=base)
    keys = torch.cat([base[0], buf_k[:, :, : max(slots) + 1]], 2).repeat_interleave(h // hk, 1)
    values = torch.cat([base[1], buf_v[:, :, : max(slots) + 1]], 2).repeat_interleave(h // hk, 1)
    visible = torch.arange(keys.shape[2])[None, :] <= (torch.tensor(slots) + p)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=0.25)
    assert (out - want).abs().max() <= 1e-5


@pytest.mark.parametrize("group", [1, 2])
def test_lse_attention_and_merge_equal_one_attention(group):
    g = torch.Generator().manual_seed(group)
    hk, d = 2, 16
    heads = _heads(hk * group, hk)
    q = torch.randn(1, hk * group, 5, d, generator=g)
    k1, v1, k2, v2 = (torch.randn(1, hk, t, d, generator=g) for t in (11, 11, 6, 6))
    visible = torch.ones(5, 6, dtype=torch.bool).tril(1)
    keys = torch.cat([k1, k2], 2).repeat_interleave(group, 1)
    values = torch.cat([v1, v2], 2).repeat_interleave(group, 1)
    mask = torch.cat([torch.ones(5, 11, dtype=torch.bool), visible], 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25)
    flash = merge([lse_attention(q, k1, v1, None, heads), lse_attention(q, k2, v2, visible, heads)], q.dtype)
    assert (flash - want).abs().max() <= 1e-5
    saved = attention._FLASH_CPU
    attention._FLASH_CPU = None  # the path other devices take: scores in fp32
    try:
        plain = merge([lse_attention(q, k1, v1, None, heads), lse_attention(q, k2, v2, visible, heads)], q.dtype)
    finally:
        attention._FLASH_CPU = saved
    assert (plain - want).abs().max() <= 1e-5


@pytest.mark.skipif(kernels.loaded() is None, reason="pc_rag's CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_merges_a_shared_prefix_as_one_sequence(dtype):
    fn, g = kernels.loaded().decode, torch.Generator().manual_seed(5)
    hk, group, d = 2, 3, 32
    q = torch.randn(3, hk, group, d, generator=g).to(dtype)
    bases = [torch.randn(hk, t, d, generator=g).to(dtype) for t in (100, 0, 70)]
    owns = [torch.randn(hk, t, d, generator=g).to(dtype) for t in (5, 9, 1)]
    vb = [torch.randn_like(b) for b in bases]
    vo = [torch.randn_like(o) for o in owns]
    whole = kernels.decode_attention(fn, q, [torch.cat([b, o], 1) for b, o in zip(bases, owns, strict=True)],
                                     [torch.cat([b, o], 1) for b, o in zip(vb, vo, strict=True)], 0.125)
    ks, vs, owner = [], [], []
    for r in range(3):
        if bases[r].shape[1]:
            ks.append(bases[r])
            vs.append(vb[r])
            owner.append(r)
        ks.append(owns[r])
        vs.append(vo[r])
        owner.append(r)
    parts = kernels.decode_attention(fn, q, ks, vs, 0.125, owner)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (parts.float() - whole.float()).abs().max() <= tol
