"""Offline checkpoints for tests, benchmarks and the demo: nothing is downloaded.

`build_tiny_llama` trains a byte-level BPE tokenizer on Python's own `pydoc_data.topics` text (so merges
at segment boundaries behave like a real tokenizer's), builds a `LlamaForCausalLM` with random weights from
a fixed seed, and saves both with `save_pretrained`, so callers load it through the real
`from_pretrained` path. `build_tiny` does the same for every supported family (`TINY_FAMILIES`: each one's
real HF config class, with what makes the family differ switched on at a tiny size). The weights are random:
the text they generate means nothing.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import PCRagError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Llama-3 style chat template, so that chat code paths run through `apply_chat_template` as with a real model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int


SIZES = {
    # GQA (2 KV heads for 4 query heads) so the grouped-query paths are always exercised.
    "tiny": TinyShape(2048, 64, 2, 4, 2, 128, 2048),
    # The shape the field notes measured (33M parameters with an 8K vocabulary): 8 layers, hidden 512, 8/4 heads.
    "bench": TinyShape(8192, 512, 8, 8, 4, 1536, 16384),
    # The layer shapes of Qwen2.5-0.5B (24 layers, hidden 896, 14/2 heads of 64, MLP 4864) with the bench vocabulary,
    # as a Llama: 0.37B parameters, for benchmarks at the size of a small model people run (benchmarks/peers.py).
    "large": TinyShape(8192, 896, 24, 14, 2, 4864, 32768),
    # Rows of 256 weights and more, so that the K-quants (blocks of 256) are exercised (the tiny one's 64 take none).
    "quant": TinyShape(2048, 256, 2, 4, 2, 512, 2048),
    # Llama 3.2 1B's layers (16 of hidden 2048, 32/8 heads of 64, MLP 8192) with the bench vocabulary: 1.0B
    # parameters, for the GPU check (benchmarks/gpu_check.py), built in memory on the device.
    "1b": TinyShape(8192, 2048, 16, 32, 8, 8192, 16384),
}


def pydoc_corpus() -> list[str]:
    """Python's own documentation topics: real English and code text that ships with every CPython."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on `pydoc_corpus` (trained once per process and size)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer(vocab_size))


@functools.cache
def _trained_tokenizer(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pydoc_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok.to_str()


def build_tiny_llama(
    directory: str | Path,
    size: str = "tiny",
    seed: int = 0,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.05,
) -> Path:
    """Write an HF checkpoint directory (config.json, model.safetensors, tokenizer files); return its path.

    `rope_scaling`: extra RoPE parameters such as
    `{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256}`.
    `initializer_range` is above HF's 0.02 so that random logits are peaked enough for greedy decoding
    not to hinge on float noise.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise PCRagError(f"unknown test model size {size!r}; choose one of {sorted(SIZES)}")
    shape = SIZES[size]
    out = Path(directory)
    tok = save_tokenizer(out, shape)

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_parameters=rope_parameters,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    (out / "pc_rag_test_model.json").write_text(json.dumps({"size": size, "seed": seed}))
    return out


def write_gguf(checkpoint: str | Path, path: str | Path, qtype: str = "F32") -> Path:
    """Write the Llama HF checkpoint folder `checkpoint` (a `build_tiny_llama` one: byte-level BPE tokenizer,
    untied output) as one GGUF file at `path`, as llama.cpp's convert_hf_to_gguf.py does for a Llama (its
    metadata keys, tensor names, the q/k rows permuted for llama.cpp's RoPE, the tokenizer as a "gpt2" vocabulary
    with merges), offline with the `gguf` package's writer. `qtype`: "F32", "F16", "Q8_0", "Q4_0" or "Q4_K_M" for
    the matrices, each as llama.cpp's llama-quantize lays that type out (`gguf_types`); norms stay F32, as llama.cpp
    keeps them. Returns `path`."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    checkpoint, path = Path(checkpoint), Path(path)
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise PCRagError(f"write_gguf writes Llama checkpoints; {checkpoint} is {config.get('model_type')!r}")
    if qtype not in GGUF_TYPES:
        raise PCRagError(f"write_gguf: qtype {qtype!r}; choose one of {sorted(GGUF_TYPES)}")
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(checkpoint.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [None] * config["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    template = checkpoint / "chat_template.jinja"  # where transformers 5 saves it; older files in tokenizer_config
    template = template.read_text() if template.exists() else tok_config.get("chat_template")
    if template:
        writer.add_chat_template(template)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's rotary layout of q and k rows
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise PCRagError(f"write_gguf: no GGUF name for tensor {name}")
        kind = "F32" if data.ndim == 1 else gguf_type(qtype, target, data.shape[1], config["num_hidden_layers"])
        if kind == "F32":
            writer.add_tensor(target, np.ascontiguousarray(data, dtype=np.float32))
        elif kind == "F16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, _quantized(data, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K_M")


def gguf_type(qtype: str, name: str, cols: int, layers: int) -> str:
    """The type llama.cpp's llama-quantize gives the matrix `name` (of rows of `cols`) in a file of type `qtype`
    (llama_tensor_get_type, llama.cpp 2025): Q4_0 and Q4_K_M keep the output matrix at Q6_K; Q4_K_M gives attn_v and
    ffn_down Q6_K in the first and last eighth of the layers and every third between, Q4_K elsewhere; a row whose
    length the type's blocks do not divide falls back (Q4_K to Q5_0, Q6_K to Q8_0)."""
    if qtype in ("F32", "F16", "Q8_0"):
        return qtype
    if name == "output.weight":
        kind = "Q6_K"
    elif qtype == "Q4_0":
        kind = "Q4_0"
    else:
        kind = "Q4_K"
        if name.endswith(("attn_v.weight", "ffn_down.weight")):
            i = int(name.split(".")[1])
            if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
                kind = "Q6_K"
    if kind in ("Q4_K", "Q6_K") and cols % 256:
        kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]
    return kind


def _quantized(data, kind: str):
    """A float matrix's rows in GGML type `kind`: pc_rag's quantizers, or the gguf package's for Q5_0."""
    import gguf
    import torch

    from .model import quant

    if kind in quant.BY_NAME and kind != "Q5_0":
        return quant.quantize(torch.from_numpy(data), quant.BY_NAME[kind]).numpy()
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind])


def save_tokenizer(out: Path, shape: TinyShape):
    """Write the tiny tokenizer (Llama 3's special tokens and chat template) into `out`; return it."""
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(shape.vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=CHAT_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=shape.max_positions,
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(out)
    return tok


# Every supported family at the "tiny" size: (config class, model class, what makes the family differ). Windows are
# 32 tokens (test prompts are longer), layer patterns mix the layer kinds, soft-caps are small enough to bend
# random-weight logits, and multipliers are far from 1, so that a forward ignoring any of them fails its tests.
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 32,
                                                  "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 32, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.0,
        "final_logit_softcapping": 2.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 32, "query_pre_attn_scalar": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "sliding_window": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75}}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 6.0, "attention_multiplier": 0.15, "residual_multiplier": 0.5,
        "logits_scaling": 4.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}


def build_tiny(directory: str | Path, family: str, seed: int = 0, **config_changes) -> Path:
    """Write a tiny random-weight checkpoint of `family` (a key of TINY_FAMILIES) with the tiny tokenizer, from the
    family's real HF config class, and `config_changes` over TINY_FAMILIES' settings; return its path."""
    out = Path(directory)
    tok = save_tokenizer(out, SIZES["tiny"])
    tiny_model(family, tok, "tiny", seed, **config_changes).save_pretrained(out)
    (out / "pc_rag_test_model.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out


def tiny_model(family: str, tokenizer, size: str = "tiny", seed: int = 0, **config_changes):
    """A random-weight `...ForCausalLM` of `family` at `size` (SIZES) in memory, on torch's default device and
    dtype, for `tokenizer`: the family's real HF config class with TINY_FAMILIES' settings and `config_changes`."""
    import torch
    import transformers

    if family not in TINY_FAMILIES:
        raise PCRagError(f"unknown test model family {family!r}; choose one of {sorted(TINY_FAMILIES)}")
    if size not in SIZES:
        raise PCRagError(f"unknown test model size {size!r}; choose one of {sorted(SIZES)}")
    config_name, model_name, changes = TINY_FAMILIES[family]
    shape = SIZES[size]
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, initializer_range=0.05)
    settings.update(changes)
    settings.update(config_changes)
    if family == "phi3":  # Phi-3's config derives head_dim from hidden_size and num_attention_heads
        settings.pop("head_dim")
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config)


@functools.cache
def loaded(path: str):
    """(model, tokenizer) of a checkpoint, loaded once per process: test suites share one copy of the weights."""
    from .engine import Engine

    base = Engine.from_pretrained(path, store="memory")
    return base.model, base.tokenizer


def one_at_a_time(engine):
    """`engine` as it was before decoding was batched, for tests and benchmarks to compare with: each request decodes
    on its own thread (concurrent ones take turns at every forward) and prefills are not kept in arrival order."""
    import contextlib

    engine.traffic.shares_steps = lambda: False
    engine.traffic.prefill_turn = contextlib.nullcontext()
    return engine


def fresh_engine(path: str):
    """An Engine over `path`'s (shared) weights with an empty memory-only store: nothing cached yet."""
    from .engine import Engine
    from .store import MemoryStore

    model, tokenizer = loaded(str(path))
    return Engine(model, tokenizer, store=MemoryStore())


class LocalRedisCluster:
    """A Redis Cluster (or Valkey cluster) of `masters` nodes on free loopback ports, without replicas or
    persistence, for tests and benchmarks: `start()` launches the servers with `--cluster-enabled yes` and joins
    them with `<cli> --cluster create ... --cluster-yes`; `stop_node(i)` / `start_node(i)` kill and restart one
    (it keeps its slots: its nodes.conf stays in `folder`); `spec` is the store spec. `server`: "redis-server" or
    "valkey-server" (the matching cli is used). `cluster-require-full-coverage no`: the other masters keep
    serving their slots while one is down (the setting docs/store.md asks for)."""

    def __init__(self, folder, masters: int = 3, server: str = "redis-server", node_timeout_ms: int = 1000):
        import shutil

        self.folder = Path(folder)
        self.server = shutil.which(server)
        self.cli = shutil.which(server.replace("-server", "-cli"))
        if self.server is None or self.cli is None:
            raise PCRagError(f"{server} or its cli is not installed (apt-get install {server.split('-')[0]})")
        self.ports = [_free_cluster_port() for _ in range(masters)]
        self.node_timeout_ms = node_timeout_ms
        self.procs: list = [None] * masters

    @property
    def spec(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> LocalRedisCluster:
        import subprocess

        for i in range(len(self.ports)):
            self.start_node(i)
        subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def start_node(self, i: int) -> None:
        import subprocess

        port = self.ports[i]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.procs[i] = subprocess.Popen(
            [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(port)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports cluster_state:ok."""
        import subprocess
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [subprocess.run([self.cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True,
                                     timeout=10).stdout for p, proc in zip(self.ports, self.procs, strict=True) if proc]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise PCRagError(f"the redis cluster on ports {self.ports} did not reach cluster_state:ok")

    def stop_node(self, i: int) -> None:
        if self.procs[i] is not None:
            self.procs[i].kill()
            self.procs[i].wait(timeout=10)
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.stop_node(i)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_cluster_port() -> int:
    """A loopback port that is free with its cluster bus port (port + 10000, which must stay under 65536)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 50000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise PCRagError("no free pair of loopback ports for a redis cluster node")


def _wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise PCRagError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:g} s")
