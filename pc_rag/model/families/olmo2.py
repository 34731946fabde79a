"""OLMo 2: no norm before attention or the MLP; RMSNorm on each sublayer's output before the residual add, and over
the whole query and key projections (not per head) before RoPE."""

from ..architecture import Architecture, Norms, decoder

MODEL_TYPES = ("olmo2",)


def describe(config) -> Architecture:
    norms = Norms(before_attention=None, after_attention="post_attention_layernorm", before_mlp=None,
                  after_mlp="post_feedforward_layernorm")
    return decoder(config, norms=norms, qk_norm="projection")
