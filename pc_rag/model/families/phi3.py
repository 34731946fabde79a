"""Phi-3 and Phi-4-mini: fused q|k|v and gate|up projections, RoPE over the first `partial_rotary_factor` of each
head (the rotary module's inv_freq has that many dims; the family's own apply_rotary_pos_emb passes the rest
through), a sliding window on every layer when the config has one. Phi-4-mini and the 128K Phi-3 models use
longrope, whose frequencies change with the sequence length: exact and full only (rope.py)."""

from ..architecture import Architecture, decoder

MODEL_TYPES = ("phi3",)


def describe(config) -> Architecture:
    return decoder(config, qkv=("qkv_proj",), gate_up=("gate_up_proj",), act="activation_fn")
