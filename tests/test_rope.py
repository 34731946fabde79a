"""RoPE relocation: a chunk encoded at one position and rotated to p equals encoding it at p (<= 1e-4, fp32)."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.models.llama.modeling_llama import rotate_half

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import LlamaRunner
from pc_rag.store import MemoryStore

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def encode_at(engine, ids, start):
    """Reference: run BOS + chunk directly at positions start-1, start, ...; return the chunk's keys [L,H,T,D].

    The whole sequence moves, so every relative distance (the sink's included) is what it was at 1.
    """
    seq = [engine.segmenter.bos_id, *ids]
    cache = engine.runner.new_cache(len(seq))
    engine.runner.forward(cache, seq, list(range(start - 1, start - 1 + len(seq))), list(range(len(seq))))
    return cache.block_views(1, len(seq))[0].clone()


@pytest.fixture(scope="module", params=[None, LLAMA3, YARN], ids=["default", "llama3", "yarn"])
def rope_engine(request, tmp_path_factory, loaded):
    if request.param is None:
        model, tok = loaded
        return pc_rag.Engine(model, tok, store=MemoryStore())
    path = pc_rag.testing.build_tiny_llama(tmp_path_factory.mktemp("rope"), rope_scaling=request.param)
    return pc_rag.Engine.from_pretrained(path)


@pytest.mark.parametrize("target", [5, 300, 1500])
def test_rotated_keys_equal_direct_encoding(rope_engine, docs, target):
    ids = rope_engine.segmenter.ids(docs[1])
    at_one = encode_at(rope_engine, ids, 1)
    direct = encode_at(rope_engine, ids, target)
    moved = torch.empty_like(at_one)
    rope_engine.runner.relocate(moved, at_one, target - 1)
    assert (moved - direct).abs().max().item() <= 1e-4
    # and relocation is not a no-op: the positions really differ
    assert (at_one - direct).abs().max().item() > 1e-2


def test_modular_single_chunk_with_scaled_rope_equals_full(rope_engine, docs):
    prompt = [Chunk(docs[2]), Text("\nWhat?")]
    lm = rope_engine.next_token_logits(prompt, "modular")
    lf = rope_engine.next_token_logits(prompt, "full")
    assert (lm - lf).abs().max().item() <= 1e-4


def test_dynamic_ntk_refuses_modular_but_runs_exact(tmp_path, docs):
    engine = pc_rag.Engine.from_pretrained(pc_rag.testing.build_tiny_llama(tmp_path, rope_scaling=DYNAMIC))
    prompt = [Text("Intro. "), Chunk(docs[0]), Text("\nWhat?")]
    with pytest.raises(pc_rag.UnsupportedModelError, match="dynamic"):
        engine.generate(prompt, mode="modular")
    engine.generate(prompt, mode="exact", max_new_tokens=2)
    lf = engine.next_token_logits(prompt, "full")
    assert (engine.next_token_logits(prompt, "exact") - lf).abs().max().item() <= 1e-4


# ---- blocks on another device than the request buffer (a block read from disk or Redis is a CPU tensor) ------
class DeviceLog(TorchDispatchMode):
    """Records, for every aten op, the devices and sizes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        self.ops.append((func, [(t.device.type, t.numel()) for t in tensors]))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def meta_runner(loaded):
    """A runner whose model sits on another device than the CPU blocks (`meta` stands in for CUDA here)."""
    model, tok = loaded
    with torch.device("meta"):
        meta_model = type(model)(copy.deepcopy(model.config))  # the session's model keeps its own config
    return LlamaRunner(meta_model, tok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [0, 300])
def test_relocate_moves_a_cpu_block_once_and_rotates_on_the_buffers_device(loaded, dtype, delta):
    runner = LlamaRunner(*loaded)
    src = torch.randn(2, 2, 7, runner.shape.head_dim).to(dtype)  # [L, H, T, D] on the CPU
    dst = torch.empty(2, 2, 7, runner.shape.head_dim, dtype=dtype, device="meta")  # `meta` stands in for CUDA
    with DeviceLog() as log:
        runner.relocate(dst, src, delta)
    # Every op touching block-sized data (halves included) runs on meta, except the one copy from the host.
    big = [(f, args) for f, args in log.ops if any(n >= src.numel() // 2 for _, n in args)]
    on_host = [(f, args) for f, args in big if any(d == "cpu" for d, _ in args)]
    assert len(on_host) == 1 and ("cpu", src.numel()) in on_host[0][1], on_host
    assert len(big) > 1 if delta else len(big) == 1  # the rotation ran (on meta); delta 0 is the copy alone


def test_place_moves_a_block_to_the_models_device_once(meta_runner, loaded):
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mk, mv = meta_runner.place(k, v)
    assert (mk.device.type, mv.device.type) == ("meta", "meta") and mk.shape == k.shape and mv.dtype == v.dtype
    # already there: the same tensors, no copy
    pk, pv = meta_runner.place(mk, mv)
    assert pk is mk and pv is mv
    ck, cv = LlamaRunner(*loaded).place(k, v)
    assert ck is k and cv is v


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_relocate_equals_a_direct_rotation(loaded, dtype, tol):
    # Reference: HF's RoPE formula (k * cos + rotate_half(k) * sin) at angle delta * inv_freq, in fp32 on the CPU.
    # fp32: float rounding (<= 1e-5 absolute on unit-scale keys); bf16: one rounding to bf16 of the fp32 result
    # (relative 2**-7 covers it, plus 1e-6 absolute near zero).
    runner = LlamaRunner(*loaded)
    src = torch.randn(2, 2, 9, runner.shape.head_dim).to(dtype)
    delta = 1234
    angle = delta * runner.rope.tables["default"].inv_freq
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
    ref = src.float() * cos + rotate_half(src.float()) * sin
    dst = torch.empty_like(src)
    runner.relocate(dst, src, delta)
    torch.testing.assert_close(dst.float(), ref, rtol=tol, atol=1e-6 if dtype == torch.bfloat16 else tol)


def test_rope_types_that_depend_on_more_than_the_position_are_not_relocatable():
    # M-RoPE (Qwen2-VL style: sections rotated by positions of other modalities) is named by its sections, whatever
    # rope_type says; dynamic and longrope rescale with the sequence length.
    from pc_rag.model.architecture import rope_type_of
    from pc_rag.model.rope import RELOCATABLE_ROPE_TYPES

    assert rope_type_of({"rope_type": "default", "mrope_section": [16, 24, 24]}) == "mrope"
    assert rope_type_of({"type": "linear", "factor": 2.0}) == "linear" and rope_type_of(None) == "default"
    for name in ("mrope", "dynamic", "longrope"):
        assert name not in RELOCATABLE_ROPE_TYPES


def test_bf16_relocation_natively_equals_its_torch_ops():
    """rope._rotate's native call (bf16 on CPU, kernels.py) against its own torch ops, bit for bit: into a slice of
    a request buffer (strided layers and heads), and in place; nothing outside the slots written."""
    from pc_rag.model import kernels
    from pc_rag.model import rope as rope_module

    if kernels.loaded() is None:
        pytest.skip("the native kernels do not run here")
    g = torch.Generator().manual_seed(3)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    table = rope_module.RopeTable("default", "default", inv)
    src = torch.randn(3, 2, 40, 64, generator=g).mul(3).to(torch.bfloat16)
    buf = torch.zeros(3, 1, 2, 100, 64, dtype=torch.bfloat16)
    native = kernels.loaded().relocate_keys
    rope_module._rotate(buf[:, 0, :, 30:70], src, table, 1234, native)
    in_place = src.clone()
    rope_module._rotate(in_place, in_place, table, 1234, native)
    want = torch.empty_like(src)
    rope_module._rotate(want, src, table, 1234, None)  # torch's ops
    assert torch.equal(buf[:, 0, :, 30:70], want) and torch.equal(in_place, want)
    assert not buf[:, :, :, :30].any() and not buf[:, :, :, 70:].any()
