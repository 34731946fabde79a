"""One file per decoder family: the model types it covers and `describe(config) -> Architecture`.

A family's file states only what its decoder changes from the base one (architecture.decoder). Adding a family:
a file here, its entry in FAMILIES, a tiny checkpoint in pc_rag.testing.TINY_FAMILIES, and the guarantees of
tests/test_families.py run on it.
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ..architecture import Architecture
from . import gemma, granite, llama, olmo2, phi3, qwen3, smollm3

FAMILIES = {model_type: family.describe
            for family in (llama, qwen3, gemma, phi3, smollm3, granite, olmo2)
            for model_type in family.MODEL_TYPES}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def describe(config) -> Architecture:
    """The Architecture of an HF decoder config, or UnsupportedModelError naming the model type."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not a decoder pc_rag supports ({', '.join(SUPPORTED_MODEL_TYPES)})")
    return FAMILIES[model_type](config)
