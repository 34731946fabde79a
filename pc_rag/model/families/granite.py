"""Granite (3.x dense): the base decoder with multipliers on the embeddings, the attention logits (in place of
head_dim**-0.5) and each sublayer's output, and the output logits divided by `logits_scaling`."""

from ..architecture import Architecture, decoder

MODEL_TYPES = ("granite",)


def describe(config) -> Architecture:
    return decoder(config, attn_scale=config.attention_multiplier, embed_multiplier=config.embedding_multiplier,
                   residual_multiplier=config.residual_multiplier, logits_divisor=config.logits_scaling)
