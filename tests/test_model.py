"""pc_rag's own layer loop (LlamaRunner.forward_layers), its attention layouts (model/attention.py) and the decoder
weights it multiplies by (model/weights.py).

References: HF's own forward over the whole sequence (`reference_logits`, independent of our loop, our attention
layouts and our packed weights) within 1e-4 (fp32); each attention layout against sdpa with the explicit mask
(key slot <= query slot) within 1e-5 (fp32) or 2e-2 (bf16, one more rounding); packed products against
`F.linear` within 1e-4 relative (fp32: oneDNN sums in another order than MKL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pc_rag
from pc_rag.model import backends, kernels
from pc_rag.model.attention import SPLIT_MIN_TOKENS, Heads, Writes, _attend_after, _attend_one, _mask
from pc_rag.model.weights import Packed, Plain, _packs, weights_of


def masked(q, keys, values, slots, groups):
    """The reference: sdpa over every key with the mask key slot <= query slot."""
    mask = _mask(torch.tensor(slots), keys.shape[2], q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=q.shape[-1] ** -0.5,
                                          enable_gqa=groups > 1)


def test_writes_pick_the_layout_from_the_slots():
    dt = torch.float32
    if kernels.loaded() is not None:  # the prefill kernel takes few rows after a prefix: no mask
        chosen = backends.choose(dt, False, kernels.loaded())
        assert chosen.prefill_kernel is not None and Writes.of([5, 6, 7], dt, "cpu", chosen).mask is None
    off = backends.without_kernels("the layouts sdpa takes")  # what follows is without pc_rag's kernels
    cold = Writes.of([0, 1, 2, 3], dt, "cpu", off)
    assert (cold.layout, cold.kv, cold.start, cold.mask) == ("causal", 4, 0, None)
    step = Writes.of([9], dt, "cpu", off)
    assert (step.layout, step.kv, step.start, step.mask) == ("after", 10, 9, None)
    few = Writes.of([5, 6, 7], dt, "cpu", off)  # the lower-right causal mask
    assert (few.layout, few.kv, few.start) == ("after", 8, 5) and few.mask.shape == (1, 1, 3, 8)
    assert (few.mask[0, 0] == 0).tolist() == [[k <= s for k in range(8)] for s in (5, 6, 7)]
    many = list(range(5, 5 + SPLIT_MIN_TOKENS))
    after = Writes.of(many, dt, "cpu", off)  # on CPU, attention in two parts: no mask
    assert (after.layout, after.kv, after.start, after.mask) == ("after", many[-1] + 1, 5, None)
    assert Writes.of(many, dt, "meta", off).mask is None  # after a short prefix, anywhere: padded rows
    long_prefix = list(range(SPLIT_MIN_TOKENS, 2 * SPLIT_MIN_TOKENS))
    assert Writes.of(long_prefix, dt, "cpu", off).mask is None  # on CPU, in two parts
    assert Writes.of(long_prefix, dt, "meta", off).mask is not None  # elsewhere the mask
    gaps = Writes.of([2, 3, 7], dt, "cpu", off)
    assert gaps.layout == "slots" and gaps.index.tolist() == [2, 3, 7] and gaps.kv == 8
    visible = (gaps.mask[0, 0] == 0).tolist()
    assert visible == [[k <= s for k in range(8)] for s in (2, 3, 7)]
    narrowed = gaps.keep(torch.tensor([0, 2]), gaps.rows("cpu"))
    assert narrowed.index.tolist() == [2, 7] and torch.equal(narrowed.mask, gaps.mask[:, :, [0, 2]])
    if kernels.loaded() is not None:  # the kernel takes each row's slot: no mask, narrowed or not
        chosen = backends.choose(dt, False, kernels.loaded())
        gaps = Writes.of([2, 3, 7], dt, "cpu", chosen)
        assert gaps.layout == "slots" and gaps.mask is None
        assert gaps.keep(torch.tensor([0, 2]), gaps.rows("cpu")).mask is None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("before,n", [(1, 40), (37, 5), (64, 64)])
def test_attention_after_a_prefix_equals_the_masked_attention(dtype, tol, groups, before, n):
    g = torch.Generator().manual_seed(before * 100 + n)
    h_kv, d = 2, 16
    q = torch.randn(1, h_kv * groups, n, d, generator=g).to(dtype)
    keys = torch.randn(1, h_kv, before + n, d, generator=g).to(dtype)
    values = torch.randn(1, h_kv, before + n, d, generator=g).to(dtype)
    want = masked(q, keys, values, list(range(before, before + n)), groups)
    got = _attend_after(q, keys[:, :, :before], values[:, :, :before], keys[:, :, before:], values[:, :, before:],
                        Heads(groups, d ** -0.5))
    assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_one_query_folds_its_group_onto_the_kv_head(groups):
    g = torch.Generator().manual_seed(groups)
    q = torch.randn(3, 2 * groups, 1, 16, generator=g)
    keys, values = torch.randn(3, 2, 50, 16, generator=g), torch.randn(3, 2, 50, 16, generator=g)
    want = F.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=groups > 1)
    assert (_attend_one(q, keys, values, Heads(groups, 0.25)) - want).abs().max().item() <= 1e-6


def test_every_layout_equals_hf_forward(engine, docs):
    """A prompt run as: one cold forward (causal); its first token cached then the rest (after, the two-part
    attention); a cached prefix then one token (after, one query); the rest in non-contiguous pieces (slots)."""
    runner = engine.runner
    ids = [t for s in engine.segmenter.segments([pc_rag.Text("\n".join(docs * 2))]) for t in s.token_ids]
    n = len(ids)
    assert n > SPLIT_MIN_TOKENS + 10
    want = runner.reference_logits(ids)
    cuts = {"causal": [list(range(n))], "after, two parts": [[0], list(range(1, n))],
            "after, masked": [list(range(n - 9)), list(range(n - 9, n))], "after one": [list(range(n - 1)), [n - 1]],
            "slots": [list(range(0, n, 2)), list(range(1, n, 2))]}
    for name, parts in cuts.items():
        cache = runner.new_cache(n)
        for slots in parts:
            if name == "slots" and slots[0] == 0:  # the even slots are rewritten over a buffer a causal pass
                # filled, so each of them still sees every earlier slot, odd ones included
                runner.forward(cache, ids, list(range(n)), list(range(n)))
            logits = runner.forward(cache, [ids[s] for s in slots], slots, slots)
        assert (logits - want).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_equal_f_linear(dtype):
    if not _packs(dtype, torch.device("cpu")):
        pytest.skip("oneDNN's packed linear does not run on this torch/CPU (the model's own layers are used)")
    g = torch.Generator().manual_seed(1)
    mods = [torch.nn.Linear(48, out, bias=bias, dtype=dtype) for out, bias in ((32, True), (16, False), (16, True))]
    for m in mods:
        m.weight.data = torch.randn(m.weight.shape, generator=g).to(dtype)
    x = torch.randn(2, 5, 48, generator=g).to(dtype)
    got, want = Packed(mods)(x), Plain(mods)(x)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= tol


def test_weights_are_packed_once_per_model_and_not_for_fp16(loaded, tiny_path):
    model, _ = loaded
    arch = pc_rag.model.describe(model.config)
    a = weights_of(model, arch)
    assert weights_of(model, arch) is a  # engines over one model share the copy
    assert a.packed == _packs(torch.float32, torch.device("cpu"))
    half = pc_rag.Engine.from_pretrained(tiny_path, dtype="float16", store="memory")
    assert not half.runner.weights.packed  # no fast oneDNN fp16 path on CPU: the modules themselves
