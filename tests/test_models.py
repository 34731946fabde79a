"""Other checkpoints through the same code: bf16/fp16, Qwen2 and Mistral configs of the same shape."""

import pytest
import torch
import transformers

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import LlamaRunner
from pc_rag.store import MemoryStore


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_tracks_fp32(tiny_path, docs, dtype):
    engine = pc_rag.Engine.from_pretrained(tiny_path, dtype=dtype)
    ref = pc_rag.Engine.from_pretrained(tiny_path, dtype="float32")
    prompt = [Text("Sys. "), Chunk(docs[0]), Text("\n"), Chunk(docs[1]), Text("\nQ?")]
    engine.warm(docs[:2], progress=False)
    gen = engine.generate(prompt, mode="modular", max_new_tokens=8)
    assert len(gen.token_ids) == 8 and gen.cached_tokens > 0
    assert engine.runner.new_cache(1).keys.dtype == getattr(torch, dtype)
    # half precision full prefill stays close to fp32 (bf16 keeps 8 bits of mantissa)
    lh = engine.next_token_logits(prompt, "full")
    lf = ref.next_token_logits(prompt, "full")
    assert (lh - lf).abs().max().item() <= 0.1 * lf.abs().max().item()
    lm = engine.next_token_logits(prompt, "modular")
    assert torch.isfinite(lm).all()


def _save_variant(tmp_path, tiny_path, cls_name):
    base = transformers.AutoConfig.from_pretrained(tiny_path)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    common = dict(vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                  num_hidden_layers=base.num_hidden_layers, num_attention_heads=base.num_attention_heads,
                  num_key_value_heads=base.num_key_value_heads, max_position_embeddings=base.max_position_embeddings,
                  bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, initializer_range=0.05)
    if cls_name == "mistral":
        config = transformers.MistralConfig(sliding_window=None, **common)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_llama_family_architectures(tmp_path, tiny_path, docs, arch):
    torch.manual_seed(0)
    engine = pc_rag.Engine.from_pretrained(_save_variant(tmp_path, tiny_path, arch))
    prompt = [Chunk(docs[0]), Text("\nQ?")]
    ids = [t for s in engine.segmenter.segments(prompt) for t in s.token_ids]
    ref = engine.runner.reference_logits(ids)
    assert (engine.next_token_logits(prompt, "full") - ref).abs().max().item() <= 1e-5
    engine.warm([docs[0]], progress=False)
    assert (engine.next_token_logits(prompt, "modular") - ref).abs().max().item() <= 1e-4
    engine.warm([docs[1]], progress=False)
    gen = engine.generate([Text("Intro. "), Chunk(docs[1]), Chunk(docs[0]), Text("\nQ?")], max_new_tokens=4)
    assert gen.cached_tokens >= len(engine.segmenter.ids(docs[0])) + len(engine.segmenter.ids(docs[1]))


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_progressive_blend_at_ratio_one_equals_full_on_other_architectures(tmp_path, tiny_path, docs, arch):
    # blend's own layer-by-layer forward (`LlamaRunner.forward_layers`) against HF's forward of each family
    # (Qwen2 has biased q/k/v projections): every chunk token recomputed equals full (<= 1e-4, fp32).
    torch.manual_seed(0)
    engine = pc_rag.Engine.from_pretrained(_save_variant(tmp_path, tiny_path, arch))
    engine.blend_selection = "progressive"
    engine.warm(docs[:2], progress=False)
    prompt = [Text("Sys. "), Chunk(docs[1]), Text("\n"), Chunk(docs[0]), Text("\nQ?")]
    full = engine.next_token_logits(prompt, "full")
    assert (engine.next_token_logits(prompt, "blend", recompute_ratio=1.0) - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_progressive_blend_runs_in_half_precision(tiny_path, docs, dtype):
    engine = pc_rag.Engine.from_pretrained(tiny_path, dtype=dtype)
    engine.blend_selection = "progressive"
    engine.warm(docs[:2], progress=False)
    prompt = [Text("Sys. "), Chunk(docs[1]), Text("\n"), Chunk(docs[0]), Text("\nQ?")]
    full = engine.next_token_logits(prompt, "full")
    blend = engine.next_token_logits(prompt, "blend", recompute_ratio=1.0)
    assert torch.isfinite(blend).all()
    assert (blend - full).abs().max().item() <= 0.05 * full.abs().max().item()  # half-precision rounding only


# ---- the attention implementation a model was loaded with -----------------------------------------------------
@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "eager"])
def test_a_model_loaded_with_any_attention_runs_unchanged(tiny_path, loaded, docs, impl):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path)
    # What a user's `from_pretrained(..., attn_implementation=impl)` leaves in the config (flash-attn itself is
    # not installed here, so the setting is written directly).
    model.config._attn_implementation = impl
    engine = pc_rag.Engine(model, loaded[1], store=MemoryStore())
    assert model.config._attn_implementation == impl  # pc_rag never calls the model's attention: left as loaded
    # Blend recomputes tokens in the middle of the buffer, where only pc_rag's own masking keeps them from seeing
    # later slots. Reference: the same weights loaded with sdpa (the session's model), same mode, <= 1e-5.
    reference = pc_rag.Engine(*loaded, store=MemoryStore())
    prompt = [Text("Sys. "), Chunk(docs[0]), Text("\n"), Chunk(docs[1]), Text("\nQ?")]
    for e in (engine, reference):
        e.blend_selection = "chunk_start"
        e.warm(docs[:2], progress=False)
    got = engine.next_token_logits(prompt, "blend", recompute_ratio=0.5)
    assert (got - reference.next_token_logits(prompt, "blend", recompute_ratio=0.5)).abs().max().item() <= 1e-5


# ---- request buffers and their pool ---------------------------------------------------------------------------
def test_request_buffers_never_exceed_the_models_context(loaded):
    runner = LlamaRunner(*loaded)
    n = runner.shape.max_positions
    assert runner.acquire_cache(10**9).capacity == n
    assert runner.acquire_cache(n - 1).capacity == n  # rounding up to a multiple of 256 stops at the context too
    assert runner.acquire_cache(100).capacity == 256


def test_buffer_pool_stays_bounded_in_bytes(loaded):
    runner = LlamaRunner(*loaded)
    context_bytes = runner.shape.max_positions * runner.shape.kv_bytes_per_token(runner.dtype)
    bound = 2 * context_bytes  # stated bound: two context-size buffers at most (POOL_SIZE of them)
    for capacity in [100, 700, 2000, 10**5, 10**6, 300, 5000, 10**9, 1500]:
        runner.release_cache(runner.acquire_cache(capacity))
        assert sum(c.keys.nbytes + c.values.nbytes for c in runner._pool) <= bound, capacity
    assert sum(c.nbytes for c in runner._pool) <= runner.pool_max_bytes <= bound
    # and the pool still serves: a released buffer comes back for a request it fits
    small = runner.acquire_cache(200)
    runner.release_cache(small)
    assert runner.acquire_cache(150) is small
