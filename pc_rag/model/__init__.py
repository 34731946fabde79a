"""Everything that touches transformers: loading, pc_rag's own forward passes over a model's modules, RoPE.

The rest of pc_rag passes plain tensors and dataclasses; when transformers changes (5.24 renamed the forward
keyword `past_key_values` to `cache`), this package is the one place to edit. What each file holds:

- architecture.py: what differs between decoder families, as data (`Architecture`, one `Layer` per layer);
- families/: one small file per family (Llama/Mistral/Qwen2, Qwen3, Gemma 2/3, Phi-3/4, SmolLM3, Granite,
  OLMo 2) reading its HF config into an Architecture;
- weights.py: each layer's modules as the forwards call them (projections fused, oneDNN-packed on CPU);
- attention.py: where one forward's tokens go (`Writes`), sliding windows and soft-capping, the kernels;
- kernels.py: pc_rag's native CPU kernels (csrc/: attention, a decode step's small ops, few-row products),
  compiled once per machine where they run;
- backends.py: which code runs each operation (the kernels, oneDNN, sdpa), chosen once per runner, with why;
- cache.py: a request's KV buffer (`SlotCache`) and the KV shape (`ModelShape`);
- rope.py: RoPE tables per layer, relocation of cached keys, the relocation self-check;
- checkpoint.py: what a path given to `from_pretrained` holds (an HF folder, a GGUF file), checked, and its loading;
- fingerprint.py: the model fingerprint in every store key;
- hf.py: names in transformers' API that differ between supported releases (for direct HF calls: benchmarks);
- runner.py: `LlamaRunner`, the layer loop over all of the above;
- heap.py: glibc's malloc thresholds, so that a forward's large temporaries are reused;
- threads.py: `release_team`, a thread that stops computing to wait gives back its OpenMP team.
"""

from .architecture import Architecture, Layer, Norms
from .attention import SPLIT_MIN_TOKENS, Heads, Writes
from .cache import HeldBlock, ModelShape, SlotCache
from .families import FAMILIES, SUPPORTED_MODEL_TYPES, describe
from .fingerprint import hash_tensor
from .rope import RELOCATABLE_ROPE_TYPES, RelocationCheck
from .runner import DTYPES, POOL_MAX_BYTES, POOL_SIZE, PREFILL_CHUNK_TOKENS, SOLO_CHUNK_TOKENS, LlamaRunner, parse_dtype
from .threads import release_team, releasing_team

__all__ = [
    "DTYPES", "FAMILIES", "POOL_MAX_BYTES", "POOL_SIZE", "PREFILL_CHUNK_TOKENS", "RELOCATABLE_ROPE_TYPES",
    "SOLO_CHUNK_TOKENS", "SPLIT_MIN_TOKENS", "SUPPORTED_MODEL_TYPES", "Architecture", "Heads", "HeldBlock", "Layer",
    "LlamaRunner", "ModelShape", "Norms", "RelocationCheck", "SlotCache", "Writes", "describe", "hash_tensor",
    "parse_dtype", "release_team", "releasing_team",
]
