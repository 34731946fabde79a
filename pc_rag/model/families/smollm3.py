"""SmolLM3: the base decoder without RoPE on the layers `no_rope_layers` marks 0 (every 4th by default: NoPE)."""

from dataclasses import replace

from ..architecture import Architecture, decoder

MODEL_TYPES = ("smollm3",)


def describe(config) -> Architecture:
    base = decoder(config)
    layers = tuple(replace(layer, rope=layer.rope if uses else None)
                   for layer, uses in zip(base.layers, config.no_rope_layers, strict=True))
    return replace(base, layers=layers)
