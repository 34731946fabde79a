"""What a path given to `from_pretrained` holds, checked before any weight loads, and its loading through
transformers, every failure a CheckpointError (or UnsupportedModelError) naming the path and what is wrong.

A path is one of:
- a Hugging Face checkpoint folder: config.json and weights (*.safetensors, pytorch_model*.bin);
- a GGUF file (what llama.cpp and Ollama users have), or a folder holding exactly one .gguf and no config.json:
  transformers reads the config and the tokenizer from it (`gguf_file=`, the `gguf` package), for the families it
  reads from GGUF (Llama, Mistral, Qwen2/3, Gemma...); the weights are loaded by gguf.py, every matrix kept in the
  file's quantized format (Q8_0, Q4_0, Q4_K_M's Q4_K and Q6_K, ...; quant.py), the norms and any float tensor in the
  requested dtype. Its tokenizer is the one transformers builds from the file's vocabulary and merges (no
  tokenizer.json needed), less any token transformers adds past the model's vocabulary;
- a Hub id ("org/name") that is not a local path: passed to transformers as it is (found in the local Hugging Face
  cache; nothing is downloaded where the machine has no network).

Quantized HF checkpoints (`quantization_config` in config.json: bitsandbytes, GPTQ, AWQ, ...) are refused before
any weight loads: pc_rag multiplies by float weights and GGML's formats (weights.py), not by those. A float
checkpoint can be quantized as it loads instead (`quantize=`, quant.quantize_model).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, PCRagError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
# What transformers loads weights from in a checkpoint folder (5.x: safetensors, or PyTorch's pickles).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
GGUF_INSTALL = 'pip install "pc-rag[gguf]"'


@dataclass(frozen=True)
class Checkpoint:
    """Where transformers loads from: `source` (a folder, or a Hub id) and, for a GGUF, the file's name in it."""

    given: str  # the path or id as the user gave it, for messages
    source: str
    gguf_file: str | None = None

    @property
    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.source, **self.kwargs)
        except (PCRagError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise self._error("its config cannot be read", e) from None

    def tokenizer(self, vocab_size: int | None = None):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.source, **self.kwargs)
        except (PCRagError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise self._error("its tokenizer cannot be read", e) from None
        if self.gguf_file and vocab_size is not None:
            _drop_tokens_past(tokenizer, vocab_size)
        return tokenizer

    def model(self, dtype, config=None):
        from transformers import AutoModelForCausalLM

        try:
            if self.gguf_file:
                from . import gguf

                return gguf.load(Path(self.source) / self.gguf_file, config or self.config(), dtype, self.given)
            return AutoModelForCausalLM.from_pretrained(self.source, dtype=dtype, **self.kwargs)
        except (PCRagError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise self._error("its weights cannot be read", e) from None

    def _error(self, what: str, e: Exception) -> PCRagError:
        text = f"{self.given}: {what} ({type(e).__name__}: {e})"
        if self.gguf_file and "architecture" in str(e).lower():
            return UnsupportedModelError(f"{text}; transformers reads GGUF files of Llama, Mistral, Qwen2/3, Gemma "
                                         "and a few other families")
        return CheckpointError(text)


def locate(path_or_id: str | Path) -> Checkpoint:
    """The checkpoint `path_or_id` names, checked as far as it can be without loading it: a CheckpointError naming
    the path and what is wrong for a missing path, a file that is not a GGUF, a folder with no config.json (and no
    single .gguf), a config.json that is not JSON, no weight files, or a quantized checkpoint."""
    given = str(path_or_id)
    path = Path(given).expanduser()
    if not path.exists():
        if isinstance(path_or_id, str) and _HUB_ID.match(given):
            return Checkpoint(given, given)  # a Hub id: transformers looks in its cache
        raise CheckpointError(f"{given}: no such file or folder (pass a checkpoint folder holding config.json and "
                              "its weights, or a .gguf file)")
    if path.is_file():
        return _gguf(given, path)
    if not path.is_dir():
        raise CheckpointError(f"{given}: neither a file nor a folder")
    config = path / "config.json"
    if not config.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf(given, path / ggufs[0])
        if ggufs:
            raise CheckpointError(f"{given}: holds {len(ggufs)} GGUF files ({', '.join(ggufs)}) and no config.json; "
                                  "pass the path of the one to load")
        raise CheckpointError(f"{given}: no config.json, so not a Hugging Face checkpoint folder (config.json, "
                              "*.safetensors, tokenizer files), and no .gguf file in it")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{config}: cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config}: not a JSON object, so not a model config")
    refuse_quantized(given, raw)
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise CheckpointError(f"{given}: a config.json but no weights (expected {' or '.join(WEIGHT_PATTERNS)})")
    return Checkpoint(given, str(path))


def _drop_tokens_past(tokenizer, vocab_size: int) -> None:
    """Removes added tokens whose id is past the model's vocabulary from a tokenizer transformers built from a GGUF:
    it adds GPT-2's `<|endoftext|>` as the unknown token of a byte-level vocabulary that lacks it, and a prompt
    holding that text then gave an id the embedding does not have (an IndexError mid-request)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    spec = json.loads(backend.to_str())
    kept = [t for t in spec.get("added_tokens", []) if t["id"] < vocab_size]
    if len(kept) == len(spec.get("added_tokens", [])):
        return
    from tokenizers import Tokenizer

    spec["added_tokens"] = kept
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spec))  # the backend transformers' tokenizer wraps


def refuse_quantized(given: str, config: dict) -> None:
    """A CheckpointError for a checkpoint whose config.json has a `quantization_config`, saying what to load
    instead."""
    quantization = config.get("quantization_config")
    if not quantization:
        return
    method = quantization.get("quant_method", "unknown method") if isinstance(quantization, dict) else "unknown"
    raise CheckpointError(
        f"{given}: a quantized checkpoint ({method}, config.json's quantization_config); pc_rag runs float weights "
        f"and GGUF's quantized formats, not this one. Load a GGUF file of the model (llama.cpp's Q4_K_M, Q8_0, ...: "
        f"pc_rag keeps them quantized; {GGUF_INSTALL}), or the unquantized checkpoint it was made from, quantized as "
        f"it loads (quantize='q4_k', 'q4_0' or 'q8_0')")


def _gguf(given: str, path: Path) -> Checkpoint:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{given}: cannot be read ({type(e).__name__}: {e})") from None
    if magic != GGUF_MAGIC:
        what = "a safetensors file" if path.suffix == ".safetensors" else f"a file starting {magic!r}"
        raise CheckpointError(f"{given}: not a checkpoint: {what}, not a GGUF file (whose first bytes are "
                              f"{GGUF_MAGIC!r}); pass a checkpoint folder holding config.json and its weights, or "
                              "a .gguf file")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(f"{given}: loading a GGUF file needs the {' and '.join(missing)} package"
                              f"{'s' if len(missing) > 1 else ''} (transformers reads GGUF with them): {GGUF_INSTALL}")
    return Checkpoint(given, str(path.parent), path.name)
