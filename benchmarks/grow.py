"""A deeper, wider Llama that starts out computing what a trained smaller one computes (model growth).

    grow(small, config) -> LlamaForCausalLM with config's shape

Why: a 5-20M-parameter model cannot be trained on the retrieval tasks from scratch within two hours on this 2-core
CPU (a step costs ~9 CPU-seconds; the 0.6M-parameter 4-layer model took 25,100 steps); grown from that model,
it starts where the small one ended and its training goes to the new layers, the new width and the new task.
Function-preserving growth (Net2Net, Chen et al. 2016; bert2BERT, Chen et al. 2022), here with zeros, not copies:
- depth: the small model's layer i becomes layer round(i * L / l); every other layer is new, with its output
  projections (attention `o_proj`, MLP `down_proj`) zero, so that at the start it adds nothing to the residual
  stream, and random inputs, so that gradients reach it (zero-initialised residual branches, as in ReZero);
- width: the small model's weights fill the top-left corner of each larger matrix; new heads and new MLP units
  have random inputs and zero outputs, and the new hidden dimensions start at zero in the embeddings, so a new
  dimension holds 0 until training writes to it. RMSNorm divides by the root mean square over all dimensions:
  with the new ones at zero that is sqrt(l_hidden / hidden) times smaller, so every norm weight is scaled by the
  same factor (exact but for the norm's epsilon);
- heads: the head size and RoPE stay; new query heads share key/value heads in the same ratio, so the small
  model's query head h still reads its key/value head h // ratio;
- vocabulary: new tokens (the alias task's word) get random rows; the old tokens keep their ids.
`tests/test_benchmarks.py` checks that the grown model's logits equal the small model's.
"""

from __future__ import annotations

import math

import torch


def grow(small, config, seed: int = 0):
    """A LlamaForCausalLM of `config`'s shape whose logits on the small model's vocabulary equal `small`'s."""
    from transformers import LlamaForCausalLM

    s = small.config
    d = s.hidden_size // s.num_attention_heads
    if config.hidden_size // config.num_attention_heads != d or getattr(config, "head_dim", d) != d:
        raise ValueError(f"the head size must stay {d}")
    if (s.num_attention_heads // s.num_key_value_heads != config.num_attention_heads // config.num_key_value_heads
            or config.num_attention_heads < s.num_attention_heads):
        raise ValueError("query heads per key/value head must stay the same, and heads may only be added")
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        if getattr(config, name) < getattr(s, name):
            raise ValueError(f"{name} may only grow ({getattr(s, name)} -> {getattr(config, name)})")
    if config.rope_parameters != s.rope_parameters or not config.tie_word_embeddings:
        raise ValueError("RoPE must stay the same and the embeddings tied, as in the small model")
    torch.manual_seed(seed)
    big = LlamaForCausalLM(config)
    src, dst = small.state_dict(), big.state_dict()
    h, hq, hkv, i = s.hidden_size, s.num_attention_heads * d, s.num_key_value_heads * d, s.intermediate_size
    norm = math.sqrt(h / config.hidden_size)
    L, l_small = config.num_hidden_layers, s.num_hidden_layers
    placed = {round(j * L / l_small): j for j in range(l_small)}
    with torch.no_grad():
        for n in range(L):
            new = f"model.layers.{n}."
            for out in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                dst[new + out].zero_()
            if n not in placed:
                continue
            old = f"model.layers.{placed[n]}."
            for name, rows in (("self_attn.q_proj", hq), ("self_attn.k_proj", hkv), ("self_attn.v_proj", hkv),
                               ("mlp.gate_proj", i), ("mlp.up_proj", i)):
                dst[f"{new}{name}.weight"][:rows, :h] = src[f"{old}{name}.weight"]
            dst[new + "self_attn.o_proj.weight"][:h, :hq] = src[old + "self_attn.o_proj.weight"]
            dst[new + "mlp.down_proj.weight"][:h, :i] = src[old + "mlp.down_proj.weight"]
            for name in ("input_layernorm", "post_attention_layernorm"):
                _norm(dst[f"{new}{name}.weight"], src[f"{old}{name}.weight"], norm)
        _norm(dst["model.norm.weight"], src["model.norm.weight"], norm)
        emb = dst["model.embed_tokens.weight"]
        emb[: s.vocab_size] = 0
        emb[: s.vocab_size, :h] = src["model.embed_tokens.weight"]
    big.load_state_dict(dst)
    big.tie_weights()
    return big


def _norm(new: torch.Tensor, old: torch.Tensor, scale: float) -> None:
    new.fill_(scale)
    new[: old.numel()] = old * scale
