"""Names in transformers' own API that changed between the releases pc_rag supports (pyproject.toml), for code
that calls an HF model directly: the benchmarks' HF baselines. pc_rag's own forwards pass no cache to HF."""

from __future__ import annotations

import transformers

_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])

# transformers 5.24 renamed the keyword of a model's forward and `generate` that takes the KV cache from
# `past_key_values` to `cache` (the old name still works there, with a deprecation warning, until 5.40).
CACHE_KEYWORD = "cache" if _VERSION >= (5, 24) else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments that pass `cache` to an HF model's forward or `generate` in this transformers release."""
    return {CACHE_KEYWORD: cache}
