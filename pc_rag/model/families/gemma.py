"""Gemma 2 and Gemma 3 (text): norms before and after each sublayer, queries scaled by query_pre_attn_scalar**-0.5,
sliding-window layers per `layer_types`, GeGLU (the MLP's own activation), the embedding scaled by sqrt(hidden)
in its own module. Gemma 2 soft-caps the attention and output logits; Gemma 3 normalises each query and key head
before RoPE and rotates local (sliding) and global layers with their own RoPE tables."""

from ...errors import UnsupportedModelError
from ..architecture import GEMMA_NORMS, Architecture, Layer, decoder, rope_type_of, sliding_windows

MODEL_TYPES = ("gemma2", "gemma3_text")


def describe(config) -> Architecture:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{config.model_type} with use_bidirectional_attention is an encoder "
                                    "(EmbeddingGemma), not a causal decoder")
    changes = dict(norms=GEMMA_NORMS, attn_scale=config.query_pre_attn_scalar ** -0.5,
                   attn_softcap=config.attn_logit_softcapping, final_softcap=config.final_logit_softcapping)
    if config.model_type == "gemma3_text":
        kinds = config.layer_types
        changes.update(
            qk_norm="head", rope_by_layer_type=True,
            layers=tuple(Layer(kind, w) for kind, w in zip(kinds, sliding_windows(config), strict=True)),
            rope_types=tuple((kind, rope_type_of(config.rope_parameters[kind])) for kind in sorted(set(kinds))))
    return decoder(config, **changes)
