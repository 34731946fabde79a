"""Weights kept quantized (model/quant.py, model/gguf.py, weights.Quantized, csrc/quant_rows.cpp).

References, each independent of the code under test:
- the `gguf` package's numpy dequantization and quantizers (llama.cpp's reference formats): our torch decoding equals
  it exactly, our Q8_0 / Q4_0 quantizers byte for byte;
- float64 products of the exactly decoded weights: the kernels within fp32 accumulation (1e-5 relative) in fp32, and
  one bf16 rounding of the output (2^-8 relative) in bf16;
- transformers' own GGUF loading, which dequantizes the whole file to a float model: pc_rag's forward on the file's
  quantized bytes gives its logits within 1e-4 (fp32);
- `full` on the same quantized model for `exact`, as everywhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pc_rag
from pc_rag.errors import CheckpointError, OptionError
from pc_rag.model import kernels, quant
from pc_rag.model.runner import LlamaRunner
from pc_rag.model.weights import Quantized
from pc_rag.testing import build_tiny_llama, gguf_type, write_gguf

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'pc-rag[gguf]')")
pytest.importorskip("accelerate", reason="transformers reads GGUF with accelerate (pip install 'pc-rag[gguf]')")

QUANTIZED = (quant.Q8_0, quant.Q4_0, quant.Q4_K, quant.Q6_K)  # formats pc_rag quantizes to
ALL = tuple(quant.FORMATS.values())


def _valid_bytes(fmt: quant.Format, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of `fmt` with every byte random but the fp16 scales (finite, of the size real weights have): any bit
    pattern of the integer fields is a valid block."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, fmt.row_bytes(cols)), dtype=torch.uint8, generator=g)
    blocks = raw.view(rows, -1, fmt.bytes)
    scales = {quant.Q6_K: (208,), quant.Q4_K: (0, 2), quant.Q5_K: (0, 2), quant.Q4_1: (0, 2), quant.Q5_1: (0, 2)}
    for at in scales.get(fmt, (0,)):
        values = (torch.rand(blocks.shape[:2], generator=g) * 0.02 + 0.001).to(torch.float16)
        blocks[..., at: at + 2] = values.view(torch.uint8).view(*values.shape, 2)
    return raw


def _reference(data: torch.Tensor, fmt: quant.Format) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(data.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type)).copy())


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_dequantize_equals_ggml_reference(fmt):
    cols = 512
    data = _valid_bytes(fmt, 24, cols)
    assert torch.equal(quant.dequantize(data, fmt, cols), _reference(data, fmt))
    if fmt in QUANTIZED:
        made = quant.quantize(torch.randn(24, cols) * 0.05, fmt)
        assert torch.equal(quant.dequantize(made, fmt, cols), _reference(made, fmt))


@pytest.mark.parametrize("fmt", (quant.Q8_0, quant.Q4_0), ids=lambda f: f.name)
def test_q8_0_and_q4_0_quantize_as_ggml_byte_for_byte(fmt):
    w = torch.randn(16, 256) * 0.03
    w[0, :32] = 0  # an all-zero block: scale 0, no division by it
    theirs = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(quant.quantize(w, fmt).numpy(), theirs)


def test_quantizers_errors_are_those_of_their_bits():
    """Relative RMS error of each format over Gaussian weights, from 8 bits down to 4 (measured: Q8_0 0.004,
    Q6_K 0.015, Q4_K 0.05, Q4_0 0.07; bounds with a margin), and every weight within one step of its value."""
    w = torch.randn(64, 1024) * 0.02
    bounds = {quant.Q8_0: 0.01, quant.Q6_K: 0.03, quant.Q4_K: 0.09, quant.Q4_0: 0.11}
    for fmt, bound in bounds.items():
        back = quant.dequantize(quant.quantize(w, fmt), fmt, 1024)
        assert ((back - w).norm() / w.norm()).item() < bound, fmt.name
    with pytest.raises(pc_rag.PCRagError, match="multiple of 256"):
        quant.quantize(torch.randn(4, 96), quant.Q4_K)


needs_kernels = pytest.mark.skipif(kernels.loaded() is None, reason="pc_rag's native kernels do not run here")


def _bf16_ok() -> bool:
    return kernels.loaded() is not None and kernels.loaded().linear_bf16


@needs_kernels
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_decoded_rows_equal_torch_decoding(fmt):
    k = kernels.loaded()
    cols = 1024 if fmt.weights == 256 else 544  # 17 blocks of 32: an odd one last
    data = _valid_bytes(fmt, 40, cols, seed=1)
    want = quant.dequantize(data, fmt, cols)
    for dtype in (torch.float32, torch.bfloat16):
        out = kernels.dequant_rows(k.dequant_rows, data, fmt, cols, None, torch.empty(40, cols, dtype=dtype))
        assert torch.equal(out, want.to(dtype)), dtype  # bf16: the exact value rounded to nearest even, as torch's
    index = torch.tensor([39, 0, 7, 7])
    picked = kernels.dequant_rows(k.dequant_rows, data, fmt, cols, index, torch.empty(4, cols))
    assert torch.equal(picked, want[index])


@needs_kernels
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_products_of_a_few_rows_equal_float64_products_of_the_decoded_weights(fmt, dtype):
    """In segments (q | k | v), odd block counts, and 1 to 19 rows (the kernel runs 8 rows at a time)."""
    if dtype == torch.bfloat16 and not _bf16_ok():
        pytest.skip("no AVX512-BF16 here")
    k = kernels.loaded()
    g = torch.Generator().manual_seed(2)
    for cols in ((256, 1024) if fmt.weights == 256 else (96, 544)):
        parts = [_valid_bytes(fmt, n, cols, seed=n) for n in (24, 8, 13)]
        bias = torch.randn(45, generator=g).to(dtype)
        rows = kernels.QuantRows(k.quant_rows, k.dequant_rows, parts, [fmt] * 3, cols, bias, dtype)
        exact = torch.cat([quant.dequantize(p, fmt, cols) for p in parts]).double()
        for m in (1, 3, 8, 9, 19):
            x = torch.randn(m, cols, generator=g).to(dtype)
            want = x.double() @ exact.T + bias.double()
            got = rows(x).double()
            if dtype == torch.float32:
                assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (cols, m)
            else:  # one rounding of each output to bf16, the sums in fp32
                assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * want.abs().max()).all(), (cols, m)
            one_by_one = torch.cat([rows(x[i: i + 1]) for i in range(m)])
            assert torch.equal(got.to(dtype), one_by_one)  # a row's result does not depend on its batch


@needs_kernels
def test_a_product_mixing_formats_as_q4_k_m_does():
    """Q4_K_M's q | k | v: Q4_K, Q4_K and Q6_K in one product, with Q5_0 and Q8_0 beside them elsewhere."""
    k = kernels.loaded()
    dtype = torch.bfloat16 if _bf16_ok() else torch.float32
    fmts = [quant.Q4_K, quant.Q6_K, quant.Q5_0, quant.Q8_0]
    parts = [_valid_bytes(f, 20, 512, seed=i) for i, f in enumerate(fmts)]
    rows = kernels.QuantRows(k.quant_rows, k.dequant_rows, parts, fmts, 512, None, dtype)
    exact = torch.cat([quant.dequantize(p, f, 512) for p, f in zip(parts, fmts, strict=True)]).double()
    x = torch.randn(5, 512).to(dtype)
    want = x.double() @ exact.T
    assert ((rows(x).double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * want.abs().max()).all()
    assert torch.equal(rows.dequantize(15, 45), torch.cat([quant.dequantize(p, f, 512) for p, f in
                                                            zip(parts, fmts, strict=True)])[15:45].to(dtype))


def test_quantized_modules_forward_through_their_decoded_weights():
    w = torch.randn(48, 256) * 0.05
    q = quant.quantize(w, quant.Q4_K)
    bias = torch.randn(48)
    linear = quant.QuantLinear(q, quant.Q4_K, 256, bias)
    x = torch.randn(3, 256)
    want = torch.nn.functional.linear(x, quant.dequantize(q, quant.Q4_K, 256), bias)
    assert torch.allclose(linear(x), want, atol=1e-6)
    embed = quant.QuantEmbedding(q, quant.Q4_K, 256, torch.float32)
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(embed(ids), quant.dequantize(q, quant.Q4_K, 256)[ids])
    if kernels.loaded() is not None:
        import functools

        embed.kernel = functools.partial(kernels.embedding_rows, kernels.loaded().dequant_rows)
        assert torch.equal(embed(ids), quant.dequantize(q, quant.Q4_K, 256)[ids])
        with pytest.raises(IndexError):
            embed(torch.tensor([48]))  # never a read past the table
    with pytest.raises(pc_rag.PCRagError):
        quant.QuantLinear(q[:, :100].contiguous(), quant.Q4_K, 256)


# ---- GGUF files -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_path(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("quant"), size="quant", seed=0)


@pytest.fixture(scope="module")
def files(quant_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant-gguf")
    return {q: write_gguf(quant_path, out / f"{q.lower()}.gguf", q) for q in ("Q8_0", "Q4_0", "Q4_K_M")}


def _transformers_float_model(path):
    """transformers' own GGUF loading: every tensor dequantized (by the gguf package) to an fp32 model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _ids(n=40):
    return [(7 * i + 3) % 1900 + 5 for i in range(n)]


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_0", "Q4_K_M"))
def test_a_gguf_keeps_its_formats_and_answers_as_its_dequantized_float_model(files, qtype):
    path = files[qtype]
    runner = LlamaRunner.from_pretrained(str(path))
    reader = gguf.GGUFReader(path)
    want_formats = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            want_formats[t.tensor_type.name] = want_formats.get(t.tensor_type.name, 0) + 1
            assert t.tensor_type.name == gguf_type(qtype, t.name, int(t.shape[0]), 2)
    assert runner.memory()["matrices"] == dict(sorted(want_formats.items()))
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert runner.memory()["bytes"] <= 1.15 * tensor_bytes  # the file's bytes, not a float copy of them
    layer = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, quant.QuantLinear) and isinstance(runner.weights.layers[0].down, Quantized)

    reference = _transformers_float_model(path)
    ids = _ids()
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([ids])).logits[0].float()
    cache = runner.new_cache(64)
    for n in (len(ids) - 1, 1):  # a prefill (decoded tiles and oneDNN), then a step (the kernel, fused)
        at = list(range(len(ids) - n - 1 if n == 1 else 0, len(ids) - 1 if n != 1 else len(ids)))
        got = runner.forward(cache, [ids[i] for i in at], at, at)
        assert (got - want[at[-1]]).abs().max().item() < 1e-4, (qtype, n)


def test_q4_k_m_matrices_take_the_types_llama_cpp_gives_them(files):
    reader = gguf.GGUFReader(files["Q4_K_M"])
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["output.weight"] == "Q6_K" and kinds["blk.1.ffn_down.weight"] == "Q6_K"  # the last eighth
    assert kinds["blk.0.ffn_down.weight"] == "Q4_K" and kinds["blk.0.attn_q.weight"] == "Q4_K"
    assert kinds["token_embd.weight"] == "Q4_K"


def test_quantized_engine_modes_equal_full_where_they_promise(files, docs):
    engine = pc_rag.Engine.from_pretrained(files["Q4_K_M"], store="memory", dtype="float32")
    assert engine.runner.backends.products.backend in ("dequantized+oneDNN", "torch")
    prompt = [pc_rag.Text("Answer from the documents.\n\n"), pc_rag.Chunk(docs[0][:300]), pc_rag.Text("\n\n"),
              pc_rag.Chunk(docs[1][:300]), pc_rag.Text("\n\nQuestion: what is this about?\nAnswer:")]
    full = engine.generate(prompt, mode="full", max_new_tokens=8, logprobs=1)
    engine.generate(prompt, mode="exact", max_new_tokens=1)  # computes and stores the prefix
    exact = engine.generate(prompt, mode="exact", max_new_tokens=8, logprobs=1)
    assert exact.cached_tokens > 0 and exact.text == full.text
    for a, b in zip(exact.logprobs, full.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-3
    assert engine.runner.check_relocation() is not None  # relocated keys equal keys encoded in place
    modular = engine.generate(prompt[::-1][1:] + prompt[-1:], mode="modular", max_new_tokens=4)
    assert modular.computed_tokens > 0 and engine.stats()["model"]["matrices"]["Q4_K"] > 0


@needs_kernels
def test_a_quantized_decode_step_runs_fused_and_equals_the_module_by_module_step(files):
    runner = LlamaRunner.from_pretrained(str(files["Q4_K_M"]),
                                         dtype="bfloat16" if _bf16_ok() else "float32")
    assert runner.backends.layers.backend == "fused" and runner.backends.few_rows.backend == "quant_rows"
    ids = _ids(12)
    caches = [runner.new_cache(16), runner.new_cache(16)]
    at = list(range(11))
    for c in caches:
        runner.forward_layers(c, ids[:11], at, at)
    fused = runner.decode_batch(caches[:1], ids[11:], [11], [11])[0]
    plain = runner.decode_batch(caches[1:], ids[11:], [11], [11], fused=False)[0]
    tol = 1e-4 if runner.dtype == torch.float32 else 5e-2
    assert ((fused - plain).abs().max() / plain.abs().max()).item() <= tol


def test_quantize_a_float_checkpoint_as_it_loads(quant_path):
    float_runner = LlamaRunner.from_pretrained(str(quant_path))
    runner = LlamaRunner.from_pretrained(str(quant_path), quantize="q4_k")
    matrices = runner.memory()["matrices"]
    assert matrices.get("Q4_K", 0) >= 14 and matrices.get("Q6_K", 0) == 1 and "float" not in matrices
    assert runner.memory()["bytes"] < 0.25 * float_runner.memory()["bytes"]
    # the reference: the float model with each matrix replaced by its quantized value, decoded
    reference = float_runner.model
    with torch.no_grad():
        for name, module in runner.model.named_modules():
            if isinstance(module, quant.QuantLinear):
                target = reference.get_submodule(name)
                target.weight.copy_(quant.dequantize(module.qweight, module.format, module.in_features))
            elif isinstance(module, quant.QuantEmbedding):
                reference.get_submodule(name).weight.copy_(quant.dequantize(module.qweight, module.format,
                                                                            module.embedding_dim))
    ids = _ids()
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([ids])).logits[0, -1].float()
    got = runner.forward(runner.new_cache(64), ids, list(range(len(ids))), list(range(len(ids))))
    assert (got - want).abs().max().item() < 1e-4
    assert runner.fingerprint != float_runner.fingerprint
    assert LlamaRunner.from_pretrained(str(quant_path), quantize="q8_0").fingerprint != runner.fingerprint


def test_fingerprints_tell_quantizations_apart(files):
    prints = {q: LlamaRunner.from_pretrained(str(p)).fingerprint for q, p in files.items()}
    assert len(set(prints.values())) == len(prints)
    assert LlamaRunner.from_pretrained(str(files["Q4_0"])).fingerprint == prints["Q4_0"]


def test_bad_quantization_requests_are_named(files, quant_path):
    with pytest.raises(OptionError, match="q3_k"):
        LlamaRunner.from_pretrained(str(quant_path), quantize="q3_k")
    with pytest.raises(OptionError, match="already quantized"):
        LlamaRunner.from_pretrained(str(files["Q4_0"]), quantize="q4_k")


def test_a_gguf_of_a_type_pc_rag_does_not_run_is_refused_by_name(files, tmp_path):
    """An IQ2_XXS tensor (made by rewriting a Q4_0 file's tensor type): a CheckpointError naming the type, a tensor
    and what to do; nothing dequantized behind the user's back."""
    src = gguf.GGUFReader(files["Q4_0"])
    writer = gguf.GGUFWriter(tmp_path / "iq.gguf", "llama")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        writer.add_key_value(field.name, value, field.types[0],
                             sub_type=field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        kind = t.tensor_type
        data = np.array(t.data)
        if t.name == "blk.1.ffn_up.weight":  # 66 bytes per 256 weights
            kind = gguf.GGMLQuantizationType.IQ2_XXS
            data = np.zeros((data.shape[0], int(t.shape[0]) // 256 * 66), dtype=np.uint8)
        writer.add_tensor(t.name, data, raw_dtype=kind if kind not in (0, 1) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"IQ2_XXS \(1 tensors, e.g. blk.1.ffn_up.weight\).*llama-quantize"):
        LlamaRunner.from_pretrained(str(tmp_path / "iq.gguf"))


def test_float_weights_are_one_copy_the_modules_view(quant_path):
    runner = LlamaRunner.from_pretrained(str(quant_path))
    if not runner.weights.packed:
        pytest.skip("the model's own layers run here (no oneDNN linear op)")
    attn = runner.model.model.layers[0].self_attn
    qkv = runner.weights.layers[0].qkv.weight
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert runner.memory()["bytes"] <= 1.01 * params + (1 << 16)  # no second copy beside them
    fresh = LlamaRunner.from_pretrained(str(quant_path))
    ids = _ids()
    assert torch.allclose(runner.reference_logits(ids), fresh.reference_logits(ids), atol=1e-5)


def test_without_native_kernels_each_product_decodes_with_torch(files):
    """The path of CUDA and of CPUs without AVX-512: quant.dequantize per product, then F.linear (and the embedding
    through torch): the same logits as transformers' dequantized model, prefill and decode step."""
    loaded = LlamaRunner.from_pretrained(str(files["Q4_K_M"]))
    runner = LlamaRunner(loaded.model, loaded.tokenizer, native=False)
    assert runner.backends.products.backend == "torch" and runner.backends.few_rows.backend == "torch"
    assert all(p.kernel is None for lw in runner.weights.layers for p in (lw.qkv, lw.down))
    reference = _transformers_float_model(files["Q4_K_M"])
    ids = _ids()
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([ids])).logits[0].float()
    cache = runner.new_cache(64)
    at = list(range(len(ids) - 1))
    assert (runner.forward(cache, ids[:-1], at, at) - want[-2]).abs().max().item() < 1e-4
    n = len(ids) - 1
    assert (runner.forward(cache, ids[-1:], [n], [n]) - want[-1]).abs().max().item() < 1e-4


def test_a_prefill_in_row_blocks_decodes_each_matrix_once_and_equals_the_float_model(files, monkeypatch):
    """fused.after_attention runs the MLP in blocks of rows; quantized matrices are decoded once for all of them
    (Quantized.decoded), with the same logits as transformers' dequantized model."""
    from pc_rag.model import fused

    monkeypatch.setattr(fused, "MLP_BYTES", 1 << 16)  # blocks of 256 rows: a 300-token prompt takes two
    runner = LlamaRunner.from_pretrained(str(files["Q4_0"]))
    if runner._fused is None:
        pytest.skip("the fused layers do not run here")
    calls = []
    real = Quantized.decoded
    monkeypatch.setattr(Quantized, "decoded", lambda self: calls.append(self) or real(self))
    ids = _ids(300)
    got = runner.forward(runner.new_cache(320), ids, list(range(300)), list(range(300)))
    assert len(calls) == 2 * 2  # gate|up and down of each of the two layers, once each
    with torch.inference_mode():
        want = _transformers_float_model(files["Q4_0"])(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert (got - want).abs().max().item() < 1e-4
