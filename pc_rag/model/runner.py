"""The runner: an HF decoder's modules driven by pc_rag's own layer loop, into a request's SlotCache.

Not HF's `model(...)`: pc_rag runs the layers itself (`forward_layers`, `decode_batch`), reading the model's
Architecture (architecture.py) for what its family does differently, its linear layers as weights.py packs them,
its norms, embedding, rotary module and `apply_rotary_pos_emb` as the model's own code has them, and attention
as attention.py lays it out. Slots (where a token's KV goes), positions (RoPE) and the order blocks were fetched
in are independent. HF's forward runs only as the tests' reference (`reference_logits`).

Which code runs each operation (pc_rag's native kernels, oneDNN, sdpa) is chosen once, when the runner is built
(`choose_backends`), held in `self.backends` and passed to the operations; it is logged in one INFO line and
reported by `engine.stats()["backends"]`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from ..batch import TurnLock
from ..errors import Cancelled, OptionError, PCRagError, UnsupportedModelError
from . import checkpoint, heap, kernels, quant
from . import rope as rope_check
from .aligned import attend as attend_aligned
from .architecture import DEFAULT_ROPE
from .attention import Heads, Writes, attend, attend_at, attend_decode
from .backends import LINEAR_ROWS, MODULES, ONEDNN, QUANT, QUANT_ROWS_BACKEND, TORCH, Backends, Choice, choose, unfit
from .cache import HeldBlock, ModelShape, SharedPrefix, SlotCache, _to_device
from .families import SUPPORTED_MODEL_TYPES, describe
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .fused import FusedLayers
from .rope import RelocationCheck, relocate, rope_of
from .weights import QUANT_ROWS, Quantized, few_rows_limit, model_bytes, weights_of

# Free request buffers kept for reuse (each is layers x capacity x KV bytes per token): at most POOL_SIZE of
# them and at most `LlamaRunner.pool_max_bytes` together, by default POOL_SIZE context-size buffers capped at
# POOL_MAX_BYTES (a long-context buffer of a 1B model is 4 GiB; the allocation it saves is small next to
# the prefill of that many tokens).
POOL_SIZE = 2
POOL_MAX_BYTES = 1 << 30

# A prompt whose first this-many tokens or more are exact prefix blocks in memory reads them in place from one
# shared copy (cache.SharedPrefix) instead of copying them into its buffer: concurrent requests over one system text
# hold it once. Shorter prefixes are copied: their copy is cheap, and a shared one costs a second attention call
# per layer in a prefill. Unused shared prefixes are kept, most recent first, up to SHARED_KEPT of them and
# `pool_max_bytes` together, so the next request over the same prefix finds it built.
SHARED_PREFIX_MIN_TOKENS = 256
SHARED_KEPT = 4

# While other requests are decoding, a forward over more fresh tokens than this runs as several forwards of at
# most this many (a chunked prefill), each taking its own turn on the runner lock, so the decoding requests wait
# for one chunk, not for the whole prompt: 512 tokens of the 8-layer bench model take about 0.1-0.2 s on the
# 2-core CPU. With pc_rag's prefill kernel (CPU, kernels.py) a chunk costs what its share of one forward does
# (4K tokens, bench model: fp32 1.35-1.43 s in chunks of 512 against 1.43-1.59 s whole, bf16 0.76-0.80 against
# 0.76-0.84). Elsewhere a chunk attends through an explicit mask rather than the causal kernel of one forward,
# which made a 4K-token prefill ~20% slower (sdpa: 2.97 s in chunks of 512 against 2.44 s whole), a cost a
# request alone should not pay: there a request alone runs whole (SOLO_CHUNK_TOKENS below).
PREFILL_CHUNK_TOKENS = 512

# Alone, a longer forward still runs in chunks of this many tokens where pc_rag's prefill kernel runs: its
# products and activations then fit in memory the allocator reuses, instead of fresh pages per layer (bench
# model, 8K-token prefill, two runs each: fp32 3.7-4.2 s in chunks of 2048, 3.9-4.3 in 1024, 4.0-4.3 in 512,
# 4.7-4.9 whole; bf16 2.08-2.13 / 2.13-2.23 / 2.21-2.61 / 2.28-2.43 s; 4K: chunks even with whole or ahead).
SOLO_CHUNK_TOKENS = 2048

log = logging.getLogger("pc_rag.model")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PCRagError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class LlamaRunner:
    """Owns an HF decoder of a supported family (families/): forward passes into a SlotCache, RoPE relocation,
    fingerprints. (Named for the first family it ran; every family goes through the same code.)

    `native`: whether pc_rag's native CPU kernels may run (where they load and suit the model; False: torch's sdpa
    and oneDNN throughout, what the tests compare the kernels with), or the library to use (tests)."""

    def __init__(self, model, tokenizer, native: bool | kernels.Kernels = True):
        config = model.config
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise UnsupportedModelError(
                f"pc_rag runs decoder-only ...ForCausalLM models ({', '.join(SUPPORTED_MODEL_TYPES)}); "
                f"got {type(model).__name__} (model_type={getattr(config, 'model_type', None)!r})")
        # pc_rag's forwards never call the model's attention modules, so the attention implementation it was
        # loaded with (eager, sdpa, flash, flex) changes nothing here: the model is left as loaded.
        self.arch = describe(config)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        arch = self.arch
        windows = arch.windows
        self.shape = ModelShape(
            num_layers=len(arch.layers),
            kv_heads=arch.kv_heads,
            head_dim=arch.head_dim,
            max_positions=config.max_position_embeddings,
            sliding_window=windows[0] if windows else None,
        )
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.heads = Heads(arch.heads // arch.kv_heads, arch.attn_scale, arch.attn_softcap)
        _check_against_modules(model, arch)
        self.rope = rope_of(model, arch)
        # RoPE is applied as the model's own attention does: each family's modeling file has its copy (Phi-3's
        # passes the dims beyond the rotary ones through).
        modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
        if not hasattr(modeling, "apply_rotary_pos_emb"):
            raise UnsupportedModelError(f"{arch.model_type}: its modeling module {modeling.__name__} has no "
                                        "apply_rotary_pos_emb (a transformers version whose modeling code differs?)")
        self._apply_rope = modeling.apply_rotary_pos_emb
        if self.device.type == "cpu":
            heap.keep_temporaries()  # a forward's temporaries reused from the heap, not mapped afresh (heap.py)
        # One forward at a time: requests from several threads interleave step by step, each with its own
        # cache, so every thread gets exactly what a serial run gives. Turns are taken in arrival order (see
        # batch.TurnLock): a decode step waits for at most one prefill chunk.
        self._lock = TurnLock()
        self.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS
        self.solo_chunk_tokens = 0  # set by choose_backends
        # Whether other requests are in flight (set by the engine): long forwards are chunked then, so their
        # decode steps wait for one chunk at a time.
        self.others_decoding: Callable[[], bool] = lambda: False
        # Per thread: the Event that stops the forwards of the request this thread is prefilling (`cancellable`).
        self._cancel = threading.local()
        self._pool: list[SlotCache] = []
        self._pool_lock = threading.Lock()  # also guards the shared prefixes
        self._shared: dict[tuple[HeldBlock, ...], SharedPrefix] = {}  # insertion order: least recently used first
        self.shared_prefix_min_tokens = SHARED_PREFIX_MIN_TOKENS
        context_bytes = self.shape.max_positions * self.shape.kv_bytes_per_token(self.dtype)
        self.pool_max_bytes = min(POOL_MAX_BYTES, POOL_SIZE * context_bytes)
        self._fingerprint: str | None = None
        self._fingerprint_lock = threading.Lock()
        # Set by choose_backends: what runs each operation, the linear layers as the forwards multiply by them
        # (weights.py), and the fused layers where the model's layer is the standard one (fused.py).
        self.backends: Backends
        self.weights = weights_of(model, arch)
        self._fused: FusedLayers | None = None
        self.choose_backends(native)

    def choose_backends(self, native: bool | kernels.Kernels = True) -> Backends:
        """Choose what runs each operation of this runner's forwards (backends.py) and log it in one INFO line:
        pc_rag's native kernels where they load (compiled now if they must be, not mid-request) and suit this
        model, with `native=False` none of them, or the given library. Products of a few rows are timed against
        oneDNN once per model (weights.few_rows_limit), the fused layers probed against the module-by-module ones
        (fused.py). Called once when the runner is built; calling it again switches this runner (tests; not while
        it serves requests). Returns the choice, also kept as `self.backends`."""
        why = unfit(self.dtype, self.device, self.arch.head_dim)
        if why is None and native is True:
            library, why = kernels.loaded(), kernels.why_not()
        elif why is None and native is False:
            library, why = None, "this runner was built with native=False"
        else:
            library = native if why is None else None
        chosen = choose(self.dtype, self.heads.softcap is not None, library, why or "")
        shared = weights_of(self.model, self.arch)
        route, rows = None, 0  # the library the products go through, and up to how many rows for float weights
        if shared.quantized:
            products, few, route = self._quantized_products(library, why)
        elif not shared.packed:
            products = few = Choice(MODULES, "pc_rag's products do not run here (CUDA, fp16, or a torch whose oneDNN "
                                    "op failed its check): the model's own linear layers")
        else:
            products = Choice(ONEDNN, "oneDNN's linear op on the model's own row-major weights (one copy; q|k|v and "
                              "gate|up each one matrix the modules view)")
            if library is None:
                few = Choice(ONEDNN, f"no native kernels: {why}")
            elif self.dtype == torch.bfloat16 and not library.linear_bf16:
                few = Choice(ONEDNN, "bf16 and this CPU has no AVX512-BF16 for linear_rows")
            else:
                route = library
                rows, timed = few_rows_limit(shared, library)
                few = Choice(LINEAR_ROWS if rows else ONEDNN, timed)
        self.weights = shared.routed(route, rows)
        embed = self.model.model.embed_tokens
        if isinstance(embed, quant.QuantEmbedding):  # its lookups decoded by the kernel where it runs, else by torch
            embed.kernel = (None if library is None or self.device.type != "cpu"
                            else functools.partial(kernels.embedding_rows, library.dequant_rows))
        self.backends = replace(chosen, products=products, few_rows=few)
        self._fused = None
        self._fused, layers, batches = FusedLayers.of(self)
        if batches is not None:
            few = Choice(few.backend, f"{few.why}; {batches}")
        self.backends = replace(self.backends, few_rows=few, layers=layers)
        self.solo_chunk_tokens = SOLO_CHUNK_TOKENS if self.backends.prefill_kernel is not None else 0
        log.info("pc_rag: %s runs %s", self._model_name(), self.backends.summary())
        return self.backends

    def _quantized_products(self, library: kernels.Kernels | None, why: str) -> tuple[Choice, Choice, object]:
        """The backends of quantized weights' products (weights.Quantized), and the library they go through."""
        formats = sorted({f.name for p in self._quantized() for f in p.formats})
        torch_path = (f"{', '.join(formats)} decoded by torch (quant.dequantize) for each product, then F.linear "
                      "(no float copy kept)")
        because = (f"no native kernels ({why})" if library is None else
                   "bf16 and this CPU has no AVX512-BF16 for the quantized kernels"
                   if self.dtype == torch.bfloat16 and not library.linear_bf16 else None)
        if because is not None:
            if self.device.type == "cpu":  # CUDA's products are fast this way; a CPU's decode steps are not
                log.warning("pc_rag: %s: the quantized matrices are decoded by torch for every product, so decode "
                            "steps read them as floats (several times slower than the native kernels)%s", because,
                            "; float32 runs them" if self.dtype == torch.bfloat16 and library is not None else "")
            return Choice(TORCH, f"{torch_path}: {because}"), Choice(TORCH, because), None
        return (Choice(QUANT, f"{', '.join(formats)}: over {QUANT_ROWS} rows the matrices are decoded to "
                       f"{str(self.dtype).removeprefix('torch.')} a tile at a time by the native kernel, then "
                       "multiplied by oneDNN (the decoding paid once for a prefill's rows)"),
                Choice(QUANT_ROWS_BACKEND, f"up to {QUANT_ROWS} rows straight from the quantized bytes (quant_rows.cpp:"
                       " 8 layers' MLP of the 0.37B shape in Q4_0, 4.3 ms for 1 row and 28 for 16, against 18-23 ms "
                       "decoding them for oneDNN)"), library)

    def memory(self) -> dict:
        """What the loaded model holds (engine.stats()["model"]): its tensors' bytes (each storage once), the dtype of
        its activations and float tensors, and how many matrices each format holds ("float" for unquantized ones)."""
        formats: dict[str, int] = {}
        for module in self.model.modules():
            if isinstance(module, (quant.QuantLinear, quant.QuantEmbedding)):
                name = module.format.name
            elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                name = "float"
            else:
                continue
            formats[name] = formats.get(name, 0) + 1
        return {"bytes": model_bytes(self.model), "dtype": str(self.dtype).removeprefix("torch."),
                "matrices": dict(sorted(formats.items()))}

    def _quantized(self) -> list:
        w = weights_of(self.model, self.arch)
        return [p for lw in w.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down, w.lm_head)
                if isinstance(p, Quantized)]

    @property
    def fingerprint(self) -> str:
        """What the KV depends on besides the tokens: every weight byte, the forward-relevant config, the
        dtype and the tokenizer; never where the files live. Part of every store key.

        Computed on first use (an Engine reads it when it is built), so a runner that only loads a model for
        another one to wrap does not hash the weights twice.
        """
        with self._fingerprint_lock:
            if self._fingerprint is None:
                self._fingerprint = model_fingerprint(self.model, self.dtype) + "-" + tokenizer_fingerprint(
                    self.tokenizer)
            return self._fingerprint

    @classmethod
    def from_pretrained(cls, path_or_id: str, dtype="float32", device="cpu", quantize: str | None = None
                        ) -> LlamaRunner:
        """An HF checkpoint folder, a GGUF file (or a folder holding one), or a Hub id in the local cache
        (checkpoint.py); every bad path a CheckpointError naming it, before any weight loads where it can be. A GGUF
        keeps its quantized formats (gguf.py); `quantize` ("q8_0", "q4_0", "q4_k") quantizes a float checkpoint as it
        loads (quant.quantize_model). `dtype` is then the activations' and the float tensors' dtype."""
        from ..options import check_device

        check_device(device)  # before any weights load: "cuda" on a CPU build is one clear error
        dtype = parse_dtype(dtype)
        if quantize is not None and quantize not in quant.SCHEMES:
            raise OptionError(f"quantize={quantize!r}: choose one of {sorted(quant.SCHEMES)} (or None for the "
                              "checkpoint's own weights)")
        source = checkpoint.locate(path_or_id)
        if quantize is not None and source.gguf_file:
            raise OptionError(f"{path_or_id}: a GGUF file is already quantized and runs in its own formats; "
                              f"quantize={quantize!r} is for float checkpoints")
        config = source.config()
        try:
            describe(config)  # before any weights load: an unsupported family is one clear error
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{path_or_id}: {e}") from None
        tokenizer = source.tokenizer(getattr(config, "vocab_size", None))
        # The attention implementation is transformers' default for the family (sdpa, or eager for Gemma 2's
        # soft-capping): it only serves `reference_logits` and a user's own calls of the model.
        model = source.model(dtype, config)
        if quantize is not None:
            quant.quantize_model(model, quantize)
        return cls(quant.to_device(model, device), tokenizer)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The tokens that end a reply: the generation config's (one id or several) and the tokenizer's."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        return frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return getattr(self.config, "vocab_size", None) or len(self.tokenizer)

    @property
    def relocatable(self) -> bool:
        """Whether every RoPE table's frequencies are fixed (rope.RELOCATABLE_ROPE_TYPES)."""
        return self.rope.relocatable

    @property
    def rope_type(self) -> str:
        return self.rope.rope_type

    @property
    def relocation_check(self) -> RelocationCheck | None:
        """The relocation self-check's result for this model, if it ran in this process (`check_relocation`)."""
        return rope_check.checked(self.fingerprint, self.rope, self.backends)

    def check_relocation(self, probe: bool = True) -> RelocationCheck | None:
        """Refuse `modular`/`blend` (UnsupportedModelError) unless relocated keys equal keys encoded in place.

        First a RoPE whose frequencies change with the sequence length is refused outright; then, on first use
        per model and rotation, the self-check (rope.py) compares, in every layer, a probe's keys computed at
        positions 0.. and relocated by rope.PROBE_DELTA with its keys computed there. With `probe=False` no forward
        runs (Engine.explain): only what is already known is refused, and None is returned before the first check."""
        name = self._model_name()
        if not self.relocatable:
            raise UnsupportedModelError(
                f"{name}: rope_type {self.rope_type!r} rescales with sequence length (or, for M-RoPE, rotates by "
                f"positions of other modalities), so relocating cached keys by rotation is not exact; use "
                f"mode='exact' or mode='full' with this model")
        result = rope_check.checked(self.fingerprint, self.rope, self.backends)
        if result is None and not probe:
            return None
        if result is None:
            ids = self.tokenizer(rope_check.PROBE_TEXT, add_special_tokens=False)["input_ids"]
            bos = self.tokenizer.bos_token_id
            ids = ([bos] if bos is not None else []) + list(ids)
            result = rope_check.check(self.fingerprint, self.rope, name, lambda delta: self._probe_keys(ids, delta),
                                      len(ids), self.dtype, self.shape.max_positions, self.backends)
            log.info("relocation self-check of %s: %s, worst layer %d at %.2g (tolerance %.2g), %.1f ms", name,
                     "passed" if result.ok else "FAILED", result.layer, result.error, result.tolerance, result.ms)
        if not result.ok:
            raise UnsupportedModelError(
                f"{name}: relocating cached keys by RoPE rotation does not reproduce keys encoded at the new "
                f"position in layer {result.layer} (max relative error {result.error:.3g} > {result.tolerance:.3g}, "
                f"probe moved by {result.delta} positions); modes 'modular' and 'blend' are refused for this model, "
                f"'exact' and 'full' work. Please report it with the model's config.json")
        return result

    @torch.inference_mode()
    def _probe_keys(self, ids: list[int], delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys [L, H_kv, T, D] of `ids` at positions 0.. and at delta.., both computed from the layer
        inputs of one forward at 0.. (slots 0..): they differ by the rotation each layer applies and nothing else,
        so half-precision rounding does not compound through the layers (rope.check)."""
        n, dev = len(ids), self.device
        cache = self.new_cache(n)
        w = Writes.of(list(range(n)), self.dtype, dev, self.backends)
        far = []
        with self._lock:
            hidden = self._embed(torch.tensor([ids], device=dev))
            at_near = self._rope_at(hidden, torch.arange(n, device=dev)[None])
            at_far = self._rope_at(hidden, torch.arange(delta, delta + n, device=dev)[None])
            for i in range(self.shape.num_layers):
                q, k, v = self._qkv(i, hidden, at_near)
                far.append(self._qkv(i, hidden, at_far)[1][0])
                o = attend(cache.keys[i], cache.values[i], self.heads, self.arch.layers[i].window, q, k, v, w,
                           self.backends)
                hidden = self._after_attention(i, hidden, o)
        return cache.keys[:, 0].clone(), torch.stack(far)

    def _model_name(self) -> str:
        path = getattr(self.config, "_name_or_path", "") or type(self.model).__name__
        return f"{path} ({self.arch.model_type})"

    def new_cache(self, capacity: int) -> SlotCache:
        s = self.shape
        return SlotCache(s.num_layers, s.kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def acquire_cache(self, capacity: int, wanted: Sequence[HeldBlock] = ()) -> SlotCache:
        """A request buffer from the pool (or a new one), never larger than the model's context: no request
        writes a slot beyond it (a prompt's slots never outnumber its positions, and decoding stops at the
        context's end). Reusing buffers matters: allocating and first touching a fresh 64 MB buffer cost about
        as much as relocating every cached chunk (measured, CPU). Of the buffers that fit, the one that still
        holds the most of the `wanted` blocks in place (cache.py), then the smallest."""
        capacity = min(capacity, self.shape.max_positions)
        with self._pool_lock:
            fits = [c for c in self._pool if c.capacity >= capacity]
            if fits:
                def held(c: SlotCache) -> int:
                    return sum(b.n for b in wanted if c.holds(b.key, b.slot, b.n, b.position))

                cache = min(fits, key=lambda c: (-held(c), c.capacity))
                self._pool.remove(cache)
                cache.length = 0
                return cache
        # round up so nearby sizes share buffers
        return self.new_cache(min(-(-capacity // 256) * 256, self.shape.max_positions))

    def copy_cache(self, src: SlotCache, tokens: int) -> SlotCache:
        """A pooled buffer holding a copy of `src`'s first `tokens` slots, for one more reply to decode after the
        same prompt: n replies cost the prompt's KV copied n - 1 times (a small part of a prefill). A shared
        prefix `src` reads in place is read in place by the copy too."""
        cache = self.acquire_cache(src.own_capacity)
        cache.hold(())  # whatever it held from its last request is overwritten below
        if src.base is not None:  # one more reader of the very prefix `src` reads (its offset is the copy's too)
            with self._pool_lock:
                src.base.users += 1
            cache.attach(src.base)
        n = tokens - src.offset
        cache.keys[:, :, :, :n].copy_(src.keys[:, :, :, :n])
        cache.values[:, :, :, :n].copy_(src.values[:, :, :, :n])
        cache.length = tokens
        cache.align = src.align  # read only once the prompt's forward is done
        return cache

    @property
    def shares_prefixes(self) -> bool:
        """Whether requests can read a prefix in place from a shared copy: attention over it merges with the
        buffer's (attention.py), which the sliding-window and soft-capped layers' masked paths do not take."""
        return all(layer.window is None for layer in self.arch.layers) and self.heads.softcap is None

    def take_shared_prefix(self, blocks: tuple[HeldBlock, ...], whole: int,
                           build: Callable[[torch.Tensor, torch.Tensor], None]) -> SharedPrefix | None:
        """A shared prefix for a prompt that starts with `blocks` (slots [0, ...) as they hold), for one more
        request (`SlotCache.attach` it; `release_cache` lets go of it): the longest one held whose blocks begin
        `blocks`, else a new one of the first `whole` blocks (none if `whole` is 0), whose keys and values
        [L, 1, H_kv, n, D] `build` fills before anyone sees it."""
        with self._pool_lock:
            found = [b for k, b in self._shared.items() if blocks[: len(k)] == k]
            base = max(found, key=lambda b: b.n, default=None)
            if base is not None:
                del self._shared[base.blocks]
                self._shared[base.blocks] = base  # most recently used last
                base.users += 1
                return base
        if not whole:
            return None
        s, mine = self.shape, blocks[:whole]
        keys = torch.empty(s.num_layers, 1, s.kv_heads, sum(b.n for b in mine), s.head_dim, dtype=self.dtype,
                           device=self.device)
        values = torch.empty_like(keys)
        build(keys, values)
        base = SharedPrefix(mine, keys, values)
        with self._pool_lock:
            base = self._shared.pop(mine, None) or base  # built at once by another request: one copy
            self._shared[mine] = base
            base.users += 1
            self._trim_shared()
        return base

    def let_go(self, base: SharedPrefix) -> None:
        """One request less reads `base` (kept for the next ones while the budget allows)."""
        with self._pool_lock:
            base.users -= 1
            self._trim_shared()

    def _trim_shared(self) -> None:  # with self._pool_lock held
        unused = [(k, b) for k, b in self._shared.items() if b.users == 0]
        total = 0
        for i, (k, b) in enumerate(reversed(unused)):  # most recent first
            total += b.nbytes
            if i >= SHARED_KEPT or total > self.pool_max_bytes:
                del self._shared[k]

    def shared_stats(self) -> dict:
        """The shared prefixes held: how many, their bytes (`in_use`: of those requests read now), and the
        requests reading them."""
        with self._pool_lock:
            bases = list(self._shared.values())
        return {"prefixes": len(bases), "bytes": sum(b.nbytes for b in bases),
                "in_use_bytes": sum(b.nbytes for b in bases if b.users), "users": sum(b.users for b in bases)}

    def release_cache(self, cache: SlotCache) -> None:
        """Return a buffer to the pool (letting go of its shared prefix); the pool keeps the largest buffers that
        fit, at most POOL_SIZE of them and `pool_max_bytes` together (the others are freed)."""
        if cache.base is not None:
            self.let_go(cache.base)
            cache.attach(None)
        cache.align = None
        with self._pool_lock:
            kept, total = [], 0
            for c in sorted([*self._pool, cache], key=lambda c: c.capacity, reverse=True):
                if len(kept) < POOL_SIZE and total + c.nbytes <= self.pool_max_bytes:
                    kept.append(c)
                    total += c.nbytes
            self._pool = kept

    def forget_held(self) -> None:
        """The pooled buffers keep their memory but no longer offer the blocks they hold: the next requests copy
        or read every block, as in a new process (benchmarks of loads from disk and Redis)."""
        with self._pool_lock:
            for cache in self._pool:
                cache.hold(())
            for key in [k for k, b in self._shared.items() if b.users == 0]:
                del self._shared[key]

    def place(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys and values on the model's device (the same tensors when they are there already).

        Blocks read from disk or Redis are CPU tensors: move each once, here, rather than on every copy into a
        request buffer (`relocate` would otherwise move it again for each request)."""
        return _to_device(keys, self.device), _to_device(values, self.device)

    @contextlib.contextmanager
    def cancellable(self, stop: threading.Event) -> Iterator[None]:
        """While inside, every forward this thread runs raises `Cancelled` once `stop` is set (anything with an
        `is_set()`), at its next layer: a server request whose client left stops within a layer instead of running
        its whole prefill, and work a reply left behind stops for a request that arrives (request.py, "leftovers").
        A decode step is never stopped midway."""
        previous = getattr(self._cancel, "stop", None)
        self._cancel.stop = stop
        try:
            yield
        finally:
            self._cancel.stop = previous

    def _check_cancelled(self) -> None:
        stop = getattr(self._cancel, "stop", None)
        if stop is not None and stop.is_set():
            raise Cancelled("the request was cancelled before its first token (its client left or its deadline "
                            "passed)")

    @torch.inference_mode()
    def forward(self, cache: SlotCache, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Run `ids` (at `positions`, written to `slots`) over everything already in `cache`.

        Each token attends to every filled slot up to its own; returns the last token's logits [vocab] (fp32).
        While other requests decode, more than `prefill_chunk_tokens` tokens in increasing slot order run as a
        chunked prefill (equal to one forward within 1e-5, fp32); alone, more than `solo_chunk_tokens` do.
        """
        if len(ids) == 1 and self._fused is not None:  # a decode step: the fused one (fused.py)
            self._check_cancelled()
            return self.decode_batch([cache], ids, positions, slots)[0]
        n = self.prefill_chunk_tokens if self.others_decoding() else self.solo_chunk_tokens
        if n and len(ids) > n and all(a < b for a, b in zip(slots, slots[1:], strict=False)):
            return self._forward_chunked(cache, ids, positions, slots, n)
        return self.forward_layers(cache, ids, positions, slots)

    def encode_apart(self, ids: Sequence[Sequence[int]],
                     positions: Sequence[Sequence[int]]) -> tuple[list[SlotCache], int]:
        """Each sequence `ids[b]` (at `positions[b]`) on its own, in a new cache of its own from slot 0, seeing only
        itself: the standalone encodings of a prompt's chunks as one block-diagonal prefill. The products run once
        over every sequence's tokens (`forward_rows`) and attention runs per sequence in the causal layout (the
        prefill kernel, else sdpa), so k chunks cost about one prefill of their tokens instead of k passes through
        the weights (benchmarks/passages.py --encode). Equal to encoding each alone within float rounding: products
        over more rows may round differently in the last bits (tests/test_encode.py).

        Forwards hold at most what `forward` would run in one: the prefill chunk's tokens while other requests
        decode (their steps wait for one group at a time), the solo chunk's alone; a sequence longer than that runs
        alone, through `forward`'s chunks. Returns the caches, in order, and how many passes ran (a sequence in chunks
        counted once)."""
        caches = [self.new_cache(len(t)) for t in ids]
        b = forwards = 0
        while b < len(ids):
            limit = self.prefill_chunk_tokens if self.others_decoding() else self.solo_chunk_tokens
            group, tokens = [b], len(ids[b])
            while b + len(group) < len(ids) and (not limit or tokens + len(ids[b + len(group)]) <= limit):
                tokens += len(ids[b + len(group)])
                group.append(b + len(group))
            if limit and tokens > limit:  # one sequence longer than a forward's share
                self.forward(caches[b], list(ids[b]), list(positions[b]), list(range(len(ids[b]))))
            else:
                self.forward_rows([caches[i] for i in group], [list(ids[i]) for i in group],
                                  [list(positions[i]) for i in group], [list(range(len(ids[i]))) for i in group])
            b += len(group)
            forwards += 1
        return caches, forwards

    def _forward_chunked(self, cache: SlotCache, ids, positions, slots, n: int) -> torch.Tensor:
        """The same forward, `n` tokens at a time. A chunk's tokens attend to slots [0, its last slot]: every
        slot there is filled (cached blocks, earlier chunks, this chunk)."""
        for a in range(0, len(ids), n):
            logits = self.forward_layers(cache, ids[a: a + n], positions[a: a + n], slots[a: a + n])
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `ids` [B, T] (Gemma's scaling is inside its embedding module): [B, T, hidden]."""
        hidden = self.model.model.embed_tokens(ids)
        if self.arch.embed_multiplier is not None:
            hidden = hidden * self.arch.embed_multiplier
        return hidden

    def _rope_at(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [B, T, rotary dims] of every RoPE table at `positions` [B, T], from the model's rotary module
        (once per forward: a dynamic RoPE updates its frequencies there, as in HF's own forward)."""
        rotary = self.model.model.rotary_emb
        if self.arch.rope_by_layer_type:
            return {name: rotary(hidden, positions, name) for name in self.rope.tables}
        return {name: rotary(hidden, positions) for name in self.rope.tables}

    def _qkv(self, i: int, hidden: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
             x: torch.Tensor | None = None):
        """Layer `i`'s queries, keys and values for `hidden` [B, T, hidden], RoPE applied, [B, H, T, D] each: the
        ops of the model's own attention module (its projections fused, see weights.py). `x`: `hidden` already
        through the input norm (the fused layers')."""
        lw, arch = self.weights.layers[i], self.arch
        if x is None:
            x = lw.input_norm(hidden) if lw.input_norm is not None else hidden
        q, k, v = lw.qkv(x)
        if arch.qk_norm == "projection":  # OLMo 2: over all heads at once
            q, k = lw.q_norm(q), lw.k_norm(k)
        shape = (*x.shape[:2], -1, arch.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        if arch.qk_norm == "head":  # Qwen3, Gemma 3: each head's dims
            q, k = lw.q_norm(q), lw.k_norm(k)
        table = arch.layers[i].rope
        if table is None:  # a NoPE layer
            return q, k, v
        return (*self._apply_rope(q, k, *rope[table]), v)

    def _after_attention(self, i: int, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of layer `i`: the attention output `o` [B, H_q, T, D] through o_proj into the residual, then
        the MLP (down(act(gate(x)) * up(x)), as the model's own MLP module), each with the norms and multiplier
        the family has."""
        lw, scale = self.weights.layers[i], self.arch.residual_multiplier
        out = lw.o(o.transpose(1, 2).reshape(*hidden.shape[:2], -1))
        if lw.attn_out_norm is not None:
            out = lw.attn_out_norm(out)
        hidden = hidden + (out if scale is None else out * scale)
        gate, up = lw.gate_up(lw.mlp_norm(hidden) if lw.mlp_norm is not None else hidden)
        out = lw.down(lw.act(gate) * up)
        if lw.mlp_out_norm is not None:
            out = lw.mlp_out_norm(out)
        return hidden + (out if scale is None else out * scale)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output logits of the last hidden states [B, T, hidden], in the model's dtype: final norm, lm_head, then
        Granite's divisor and Gemma 2's soft-cap as the model's own head applies them."""
        arch = self.arch
        logits = self.weights.lm_head(self.model.model.norm(hidden))
        if arch.logits_divisor is not None:
            logits = logits / arch.logits_divisor
        if arch.final_softcap is not None:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits

    def forward_layers(self, cache: SlotCache, ids: list[int], positions: list[int], slots: list[int],
                       narrow: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
                       fused: bool = True) -> torch.Tensor:
        """The forward pass, layer by layer over the model's own modules: `ids` at `positions`, their KV written
        to `slots` of `cache`, each token attending to the slots up to its own (within its window, in a
        sliding-window layer). Returns the last token's logits [vocab] (fp32).

        Not HF's `model(...)`: that call builds a 4-D mask from the cache length, captures outputs and goes
        through the cache API per layer, and its sdpa could only skip the masked half of a prefill when the
        mask is plain causal. Here the attention layout is chosen once per forward (`Writes`); the ops of a
        layer are the model's own modules, so the logits equal HF's forward within float rounding
        (tests/test_model.py and tests/test_families.py compare them, 1e-4 in fp32).

        `narrow(layer, slots, keys)` (blend) is called in every layer once the rows' fresh keys ([H_kv, n, D],
        RoPE applied) exist, before any KV is written: it returns the indices of the rows to go on with (None:
        all). A dropped row keeps the KV already in its slot from this layer on (CacheBlend's selection: a row
        is dropped once its fresh KV shows it needs no recompute). The last row must stay.

        Where the model's layer is the standard one, its norms and SiLU run fused (fused.py; `fused=False`: module
        by module, what its probe compares with).
        """
        return self.forward_rows([cache], [ids], [positions], [slots], narrow, fused)[0]

    @torch.inference_mode()
    def forward_rows(self, caches: list[SlotCache], ids: list[list[int]], positions: list[list[int]],
                     slots: list[list[int]],
                     narrow: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
                     fused: bool = True) -> torch.Tensor:
        """`forward_layers` for B requests at once: request b's tokens `ids[b]` at `positions[b]`, written to
        `slots[b]` of `caches[b]`, attending to that cache only. Returns [B, vocab] fp32, each request's last
        token's logits.

        The products run once over every request's tokens together (a decode step's batching, for tokens still
        to prefill: the batched step's first tokens of newcomers, BatchDecoder); attention runs per request, in
        the layout its own writes take. `narrow` takes one request only."""
        if narrow is not None and len(caches) != 1:
            raise ValueError("forward_rows: narrow (blend) takes one request")
        self._check_cancelled()
        dev = self.device
        if narrow is not None and caches[0].base is not None:
            raise ValueError("forward_rows: narrow (blend) writes reused slots, a shared prefix's are read-only")
        # Each buffer's writes in its own slots (after its shared prefix, if any: cache.py)
        writes = [Writes.of([t - c.offset for t in s] if c.offset else s, self.dtype, dev, self.backends)
                  for c, s in zip(caches, slots, strict=True)]
        if narrow is not None and writes[0].layout != "slots":  # rows may drop out: attention by mask over the buffer
            w = writes[0]
            rows = w.rows(dev)
            writes = [Writes.scattered(rows, w.kv, self.dtype, self.backends)]
        for cache, w, at in zip(caches, writes, slots, strict=True):
            for a, b in _runs(at):
                cache.wrote(a, b)
            cache.length = max(cache.length, cache.offset + w.kv)
        spans, a = [], 0  # each request's tokens among the forward's rows
        for t in ids:
            spans.append((a, len(t)))
            a += len(t)
        layers = self.arch.layers
        fused = self._fused if fused else None
        with self._lock:
            hidden = self._embed(torch.tensor([[t for row in ids for t in row]], device=dev))  # [1, n, hidden]
            rope = self._rope_at(hidden, torch.tensor([[p for row in positions for p in row]], device=dev))
            x = fused.first_norm(hidden) if fused is not None else None  # the next layer's normed input
            # RoPE and the KV writes in one call where the slots are contiguous and every row stays
            written = fused is not None and narrow is None and all(w.layout != "slots" for w in writes)
            for i in range(self.shape.num_layers):
                if i:
                    self._check_cancelled()  # a request that must stop (cancellable) waits for one layer at most
                if written:
                    where = [(c, w.start, a, n) for c, w, (a, n) in zip(caches, writes, spans, strict=True)]
                    parts = fused.qkv_written(i, x, *rope[DEFAULT_ROPE], where)
                else:
                    q, k, v = self._qkv(i, hidden, rope, x)  # [1, H, n, D]
                    parts = [(q[:, :, a: a + n], k[:, :, a: a + n], v[:, :, a: a + n]) for a, n in spans]
                if narrow is not None:
                    (q, k, v), w = parts[0], writes[0]
                    keep = narrow(i, w.rows(dev), k[0])
                    if keep is not None:
                        hidden, q, k, v = hidden[:, keep], q[:, :, keep], k[:, :, keep], v[:, :, keep]
                        rope = {name: (cos[:, keep], sin[:, keep]) for name, (cos, sin) in rope.items()}
                        writes, parts = [w.keep(keep, w.rows(dev))], [(q, k, v)]
                for c, w in zip(caches, writes, strict=True):
                    if c.align is not None:  # these rows hold fresh KV in this layer from now on (aligned.py)
                        c.align.computed(i, w.rows(dev))
                outs = [attend(c.keys[i], c.values[i], self.heads, layers[i].window, q, k, v, w, self.backends,
                               written, c.base_views(i), c.align, i)
                        for c, w, (q, k, v) in zip(caches, writes, parts, strict=True)]
                o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
                if fused is not None:  # hidden updated in place
                    x = fused.after_attention(i, hidden, o)
                else:
                    hidden = self._after_attention(i, hidden, o)
            last = hidden[:, -1:] if len(spans) == 1 else hidden[:, [a + n - 1 for a, n in spans]]
            logits = self._logits(last)
        return logits[0].float()

    def step(self, caches: list[SlotCache], ids: list[list[int]], positions: list[list[int]],
             slots: list[int]) -> torch.Tensor:
        """The batched decode loop's step (BatchDecoder): request b's tokens `ids[b]` at `positions[b]`, written
        from slot `slots[b]` on. Returns [B, vocab] fp32, each request's last token's logits.

        The requests with one token (decoding) take `decode_batch`; those that bring the rest of their prompt
        (newcomers) take one `forward_rows` together. Not one forward over all rows: beside 7 decoding rows one
        newcomer of 10 tokens took as long that way as a step and its own forward (bench model, fp32 32.2 against
        31.1 ms; bf16 26.4 against 21.6), while newcomers together gain over forwards of their own (3 and 7 of 26
        tokens: fp32 62 and 106 ms against 83 and 177; docs/speed.md#batching-and-concurrent-streams)."""
        one = [b for b, t in enumerate(ids) if len(t) == 1]
        if len(one) == len(ids):
            return self.decode_batch(caches, [t[0] for t in ids], [p[0] for p in positions], slots)
        more = [b for b, t in enumerate(ids) if len(t) > 1]
        logits = self.forward_rows([caches[b] for b in more], [ids[b] for b in more], [positions[b] for b in more],
                                   [list(range(slots[b], slots[b] + len(ids[b]))) for b in more])
        out = torch.empty(len(ids), logits.shape[-1], dtype=logits.dtype, device=logits.device)
        out[more] = logits
        if one:
            out[one] = self.decode_batch([caches[b] for b in one], [ids[b][0] for b in one],
                                         [positions[b][0] for b in one], [slots[b] for b in one])
        return out

    @torch.inference_mode()
    def decode_batch(self, caches: list[SlotCache], ids: list[int], positions: list[int],
                     slots: list[int], fused: bool = True) -> torch.Tensor:
        """One decode step for B requests at once: token `ids[b]` at `positions[b]`, its KV written to
        `slots[b]` of `caches[b]`, attending to slots [0, slots[b]] of that cache only (its last `window` slots
        in a sliding-window layer). Returns [B, vocab] fp32.

        The layers' own modules run on the batch, so every weight is read once per step for all B requests
        (the step is memory-bound on CPU: B rows cost little more than one); attention runs per request over
        its own buffer, so nothing is padded or copied to line the requests up. With B = 1 the logits equal
        `forward`'s bit for bit (tests/test_batch.py); with B > 1 the matrix products over B rows may round
        differently in the last bits (measured: logits within 1e-5, fp32).

        Where the model's layer is the standard one, the step runs fused (fused.py; `fused=False`: module by
        module, what its probe compares with).
        """
        for cache, slot in zip(caches, slots, strict=True):
            cache.wrote(slot, slot + 1)
        aligned = [c.align for c in caches]
        if any(a is not None for a in aligned):
            fused = False  # the fused step's attention takes no per-key bias: module by module (aligned.py)
        if fused and self._fused is not None:
            with self._lock:
                return self._fused.step(caches, ids, positions, slots)
        n = len(ids)
        dev = self.device
        layers = self.arch.layers
        with self._lock:
            hidden = self._embed(torch.tensor(ids, device=dev)[:, None])  # [B, 1, hidden]
            rope = self._rope_at(hidden, torch.tensor(positions, device=dev)[:, None])  # table -> [B, 1, D] each
            # Each request's slots [0, slot] in every layer, and its new slot: views taken once per step.
            seen = [(c.keys[:, :, :, : s - c.offset + 1], c.values[:, :, :, : s - c.offset + 1])
                    for c, s in zip(caches, slots, strict=True)]
            shared = any(c.base is not None for c in caches)
            new = [(k[:, 0, :, -1], v[:, 0, :, -1]) for k, v in seen]  # [L, H_kv, D] each
            for i in range(self.shape.num_layers):
                q, k, v = self._qkv(i, hidden, rope)  # [B, H, 1, D]
                k_new, v_new = k[:, :, 0], v[:, :, 0]  # [B, H_kv, D]
                window = layers[i].window
                keys, values = [], []
                for b in range(n):
                    new[b][0][i] = k_new[b]
                    new[b][1][i] = v_new[b]
                    k_b, v_b = seen[b][0][i], seen[b][1][i]  # [1, H_kv, slot + 1, D]
                    if window is not None and slots[b] + 1 > window:  # the last `window` slots only
                        k_b, v_b = k_b[:, :, -window:], v_b[:, :, -window:]
                    keys.append(k_b)
                    values.append(v_b)
                bases = [c.base_views(i) for c in caches] if shared else None
                if any(a is not None for a in aligned):
                    o = torch.cat([
                        attend_aligned(q[b: b + 1], seen[b][0][i], seen[b][1][i],
                                     torch.tensor([slots[b]], device=dev), self.heads.scaling,
                                     self.heads.num_key_value_groups, window, self.heads.softcap, aligned[b], i)
                        if aligned[b] is not None else
                        attend_decode(q[b: b + 1], keys[b: b + 1], values[b: b + 1], self.heads, self.backends,
                                      bases[b: b + 1] if bases is not None else None)
                        for b in range(n)])
                else:
                    o = attend_decode(q, keys, values, self.heads, self.backends, bases)
                hidden = self._after_attention(i, hidden, o)
            logits = self._logits(hidden)[:, 0]  # [B, vocab]
        for cache, s in zip(caches, slots, strict=True):
            cache.length = max(cache.length, s + 1)
        return logits.float()

    @torch.inference_mode()
    def context_shift(self, ids: Sequence[int], positions: Sequence[int], rows: list[int],
                      blocks: list[tuple[int, int]], sink_ids: Sequence[int],
                      relative: bool = False) -> torch.Tensor:
        """How far layer 0 moves each reused token once it sees the whole prompt (`ids` at `positions`, by slot)
        instead of what its block was encoded with: the norm of o_proj(attention in context - attention as
        encoded), [len(rows)] fp32 (`relative`: divided by the norm of o_proj(attention in context), a scale that
        holds across prompts and models). Row r is slot `rows[r]`; its block is (first slot, how many positions its
        keys were moved) `blocks[r]`. Blend's cheap probe ("shift").

        Why it is cheap and exact: layer 0's queries, keys and values depend on the token and its position only,
        never on the context, so they are computed here from the ids alone, and both attentions come without
        running the layer's MLP: in context, one causal attention over the prompt; as encoded, one per block over
        the sink (`sink_ids`, at positions 0.. then, moved with the block now) and the block's own tokens. Layer 1's
        keys, which the full probe measures, differ from the cached ones by what this shift (and the MLP on it)
        adds. Sliding windows are left out: the result ranks tokens, it is no logit."""
        dev, n_sink = self.device, len(sink_ids)
        length = max(rows) + 1
        starts = sorted(set(blocks))
        new_ids = [*ids[:length], *(t for _ in starts for t in sink_ids)]
        new_pos = [*positions[:length], *(moved + j for _, moved in starts for j in range(n_sink))]
        with self._lock:
            hidden = self._embed(torch.tensor([new_ids], device=dev))
            rope = self._rope_at(hidden, torch.tensor([new_pos], device=dev))
            q, k, v = self._qkv(0, hidden, rope)  # [1, H, n, D]
        def among(idx: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
            """The rows `at` (indices into `idx`) of the tokens `idx` attending among themselves, in order."""
            return attend_at(q[:, :, idx[at]], k[:, :, idx], v[:, :, idx], at, self.heads, self.backends)[0]

        at = torch.tensor(rows, device=dev)
        in_context = among(torch.arange(length, device=dev), at)  # [H, n, D]
        encoded = torch.empty_like(in_context)
        by_block: dict[tuple[int, int], list[int]] = {}
        for r, block in enumerate(blocks):
            by_block.setdefault(block, []).append(r)
        for i, (first, moved) in enumerate(starts):
            mine = by_block[(first, moved)]
            sink = torch.arange(length + i * n_sink, length + (i + 1) * n_sink, device=dev)
            idx = torch.cat([sink, torch.arange(first, rows[mine[-1]] + 1, device=dev)])
            encoded[:, mine] = among(idx, n_sink + at[mine] - first)
        o = self.weights.layers[0].o
        delta = (in_context - encoded).transpose(0, 1).reshape(len(rows), -1)
        bias = o(torch.zeros_like(delta[:1]))  # o_proj's bias, if it has one: the difference of two outputs has none
        shift = (o(delta) - bias).float().norm(dim=-1)
        if not relative:
            return shift
        return shift / o(in_context.transpose(0, 1).reshape(len(rows), -1)).float().norm(dim=-1).clamp_min(1e-12)

    def shift_probe_share(self, context: int) -> float:
        """What `context_shift` costs per token as a share of one layer's work on that token (multiply-adds: the
        layer's four projections and up to two rows of attention over `context` keys, against the whole layer's
        projections, MLP and one row of attention)."""
        layer = self.model.model.layers[0]
        weights = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        hidden = self.model.model.embed_tokens.weight.shape[1]
        probe = hidden * (2 * self.arch.heads + 2 * self.arch.kv_heads) * self.arch.head_dim  # q, k, v and o
        attention = 2 * self.arch.heads * self.arch.head_dim * context  # scores and the weighted values
        return (probe + 1.5 * attention) / (weights + attention)

    @torch.inference_mode()
    def reference_logits(self, ids: list[int], positions: list[int] | None = None) -> torch.Tensor:
        """A plain HF forward over the whole sequence, no pc_rag cache: the reference tests compare to."""
        kwargs = {} if positions is None else {"position_ids": torch.tensor([positions], device=self.device)}
        # With use_cache=False, transformers 5.24 reads position ids that jump (PML layouts) as packed sequences
        # and masks across the jump: the default (a cache) keeps one causal sequence.
        out = self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)
        return out.logits[0, -1].float()

    def relocate(self, dst: torch.Tensor, src: torch.Tensor, delta: int) -> None:
        """Write keys `src` ([L, H, T, D], RoPE at p) into `dst` as if computed at p + delta, each layer rotated by
        its own RoPE table (NoPE layers copied): rope.relocate."""
        relocate(self.rope, dst, src, delta, self.backends)


def _check_against_modules(model, arch) -> None:
    """The description against the model's own attention modules, where they state the same thing: a family file
    or a transformers version that disagrees fails here, at load, not as wrong logits."""
    for i, layer in enumerate(model.model.layers[: len(arch.layers)]):
        scaling = getattr(layer.self_attn, "scaling", None)
        if scaling is not None and abs(scaling - arch.attn_scale) > 1e-6 * abs(arch.attn_scale):
            raise UnsupportedModelError(
                f"{arch.model_type}: layer {i}'s attention scales logits by {scaling}, pc_rag's description of the "
                f"family by {arch.attn_scale} (a transformers version whose modeling code differs?)")


def _runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """The (distinct) slots as [start, stop) runs of consecutive slots: one for a prefill's or a chunk's tail."""
    lo, hi = min(slots), max(slots)
    if hi - lo + 1 == len(slots):
        return [(lo, hi + 1)]
    ordered = sorted(slots)
    runs, start = [], ordered[0]
    for prev, s in zip(ordered, ordered[1:], strict=False):
        if s != prev + 1:
            runs.append((start, prev + 1))
            start = s
    return [*runs, (start, ordered[-1] + 1)]
