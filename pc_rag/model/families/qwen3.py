"""Qwen3: the base decoder with an RMSNorm over each head of the queries and keys, before RoPE."""

from ..architecture import Architecture, decoder

MODEL_TYPES = ("qwen3",)


def describe(config) -> Architecture:
    return decoder(config, qk_norm="head")
