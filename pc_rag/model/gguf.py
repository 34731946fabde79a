"""A GGUF file loaded as llama.cpp runs it: each matrix kept in the file's quantized format (quant.py), never a float
copy of the model.

transformers' own GGUF loading (`from_pretrained(gguf_file=...)`) dequantizes every tensor to fp32 numpy and then to
the dtype asked for: an 8B Q4_K_M file of 4.9 GB became a 16-32 GB float model. Here transformers still reads what
the file says of the model (its config and tokenizer, checkpoint.py) and names the tensors (the `gguf` package's
name map, as transformers' loader uses it), but the model is built on the meta device and filled tensor by tensor:

- a quantized matrix of a linear layer becomes a quant.QuantLinear holding the file's bytes, the embedding a
  quant.QuantEmbedding (its rows dequantized as they are looked up); where the output layer is tied to the embedding
  (no `output.weight`, as in Qwen2.5 0.5B) they share those bytes;
- float tensors (norms, biases, an F16/F32 matrix) become parameters in the model's dtype, through transformers'
  processor for the architecture, as its loader does (Gemma's norms, llama.cpp's q/k row order for Llama);
- the one transformation a processor makes of a quantized matrix, llama.cpp's order of a Llama's q and k rows, is a
  permutation of whole rows, and rows are whole blocks: it is applied to the bytes (found by running the processor
  over the row numbers). A processor that does anything else to a quantized matrix is refused, by name;
- buffers computed at construction (the rotary frequencies) are built again on the CPU, from the config.

A tensor of a type pc_rag cannot multiply by (Q2_K, Q3_K, the IQ and TQ types, ...) is an error naming the type, its
tensors and what to do, before anything is built; nothing is dequantized behind the user's back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, UnsupportedModelError
from . import quant

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # GGML ids of the float types a file may hold


def load(path: Path, config, dtype: torch.dtype, given: str):
    """The model in the GGUF file `path` (whose config transformers read: `config`), its matrices quantized as in the
    file, the rest in `dtype`, on the CPU. `given`: the path as the user gave it, for messages."""
    import numpy as np
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(path)
    _check_types(reader, given)
    arch = _field(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = get_gguf_hf_weights_map(model, processor)

    quantized: dict[str, tuple[quant.Format, torch.Tensor, int]] = {}  # HF name -> (format, bytes, columns)
    floats: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        fmt = quant.FORMATS.get(int(t.tensor_type))
        if fmt is None:
            weights = _float(t)
            done = processor.process(weights=weights, name=t.name, tensor_key_mapping=names, parsed_parameters={})
            if done.name in names:
                floats[names[done.name]] = torch.from_numpy(np.array(done.weights)).to(dtype)
            continue
        if t.name not in names:
            continue
        rows = int(t.data.shape[0])
        order = processor.process(weights=np.arange(rows)[:, None], name=t.name, tensor_key_mapping=names,
                                  parsed_parameters={})
        perm = np.asarray(order.weights).reshape(-1)
        if order.name != t.name or perm.shape != (rows,) or not np.array_equal(np.sort(perm), np.arange(rows)):
            raise UnsupportedModelError(f"{given}: transformers' reading of {arch} rewrites the quantized tensor "
                                        f"{t.name} in a way pc_rag cannot apply to its {fmt.name} bytes")
        data = torch.from_numpy(np.array(t.data))  # a copy: the file is not kept mapped
        if not np.array_equal(perm, np.arange(rows)):
            data = data[torch.from_numpy(perm)].contiguous()
        quantized[names[t.name]] = (fmt, data, int(t.shape[0]))

    _fill(model, quantized, floats, config, dtype, given)
    return model.eval().requires_grad_(False)


def context_length(path: Path) -> int | None:
    """The model's context in tokens as the GGUF file at `path` states it (`<arch>.context_length`), read from its
    header without loading a tensor; None where the file does not say."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    found = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    return int(found) if found is not None else None


def _field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field

    found = read_field(reader, key)
    return found[0] if found else None


def _check_types(reader, given: str) -> None:
    """A CheckpointError naming every type in the file that pc_rag does not multiply by, and its tensors."""
    unsupported: dict[str, list[str]] = {}
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind not in quant.FORMATS and kind not in FLOAT_TYPES:
            unsupported.setdefault(t.tensor_type.name, []).append(t.name)
    if unsupported:
        what = "; ".join(f"{kind} ({len(ts)} tensors, e.g. {ts[0]})" for kind, ts in unsupported.items())
        runs = ", ".join(sorted(f.name for f in quant.FORMATS.values()))
        raise CheckpointError(
            f"{given}: holds tensors of a quantization pc_rag does not run: {what}. pc_rag keeps a GGUF's weights in "
            f"their format and multiplies by them directly; it runs {runs}, F16, BF16 and F32. Use a file of one of "
            "those (Q4_K_M, Q5_K_M or Q8_0 are published for most models), or make one from the original checkpoint "
            "with llama.cpp's llama-quantize, or load the float checkpoint with quantize='q4_k'")


def _float(t):
    """A float tensor of the file as fp32 numpy (F16 and BF16 widened)."""
    import numpy as np
    from gguf import dequantize

    data = np.asarray(t.data)
    return dequantize(data, t.tensor_type) if int(t.tensor_type) != 0 else data


def _fill(model, quantized: dict, floats: dict, config, dtype: torch.dtype, given: str) -> None:
    """Puts the file's tensors into the meta-device model: QuantLinear / QuantEmbedding modules for the quantized
    matrices, parameters for the float tensors; ties the output layer to the embedding where the file has no output
    matrix; rebuilds the buffers computed at construction. Anything left on the meta device is an error."""
    inner = model.model
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if key not in quantized:
            continue
        fmt, data, cols = quantized.pop(key)
        parent, attr = _parent(model, name)
        if isinstance(module, torch.nn.Embedding):
            scale = quant.embedding_scale(module, config)
            setattr(parent, attr, quant.QuantEmbedding(data, fmt, cols, dtype, scale))
        elif isinstance(module, torch.nn.Linear):
            bias = floats.pop(f"{name}.bias", None) if module.bias is not None else None
            setattr(parent, attr, quant.QuantLinear(data, fmt, cols, bias))
        else:
            raise UnsupportedModelError(f"{given}: {key} is quantized ({fmt.name}) but {type(module).__name__} is not "
                                        "a linear layer or an embedding pc_rag can keep quantized")
    if quantized:
        raise UnsupportedModelError(f"{given}: quantized tensors pc_rag found no module for: {sorted(quantized)}")
    for key, value in floats.items():
        parent, attr = _parent(model, key)
        current = getattr(parent, attr, None)
        if not isinstance(current, torch.Tensor) or tuple(current.shape) != tuple(value.shape):
            raise CheckpointError(f"{given}: tensor {key} of shape {tuple(value.shape)} does not fit the model "
                                  f"({None if current is None else tuple(current.shape)})")
        setattr(parent, attr, torch.nn.Parameter(value, requires_grad=False))
    if getattr(config, "tie_word_embeddings", False) and _on_meta(model.lm_head):
        embed = inner.embed_tokens
        if isinstance(embed, quant.QuantEmbedding):
            model.lm_head = quant.QuantLinear(embed.qweight, embed.format, embed.embedding_dim)
        else:
            model.lm_head.weight = embed.weight
    _rebuild_buffers(model, config, given)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{given}: the file has no tensor for {', '.join(left[:8])}"
                              f"{' and more' if len(left) > 8 else ''}")


def _parent(model, name: str):
    *path, attr = name.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part)
    return parent, attr


def _on_meta(module: torch.nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def _rebuild_buffers(model, config, given: str) -> None:
    """Modules whose buffers are computed at construction (RoPE's frequencies) built again on the CPU: they hold no
    weights, so a new one from its config is the same module."""
    for name, module in list(model.named_modules()):
        meta = [b for b, t in module.named_buffers(recurse=False) if t.device.type == "meta"]
        if not meta:
            continue
        if any(True for _ in module.parameters(recurse=False)) or not hasattr(module, "config"):
            raise UnsupportedModelError(f"{given}: {name}'s buffers {meta} are computed when it is built, and pc_rag "
                                        f"cannot build a {type(module).__name__} again")
        parent, attr = _parent(model, name)
        with torch.device("cpu"):
            setattr(parent, attr, type(module)(config=module.config))
