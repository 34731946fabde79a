"""Other checkpoints through the same code: bf16/fp16, Qwen2 and Mistral configs of the same shape."""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text


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
    import transformers

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
