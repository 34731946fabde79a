"""Llama 3.x, Mistral and Qwen2/2.5: the base decoder itself (Qwen2's biased q/k/v are in its modules). Mistral
windows every layer when its config has a `sliding_window`, Qwen2 the layers its `layer_types` marks."""

from ..architecture import Architecture, decoder

MODEL_TYPES = ("llama", "mistral", "qwen2")


def describe(config) -> Architecture:
    return decoder(config)
