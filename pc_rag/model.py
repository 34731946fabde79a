"""Everything that touches transformers: loading, the forward call, the cache object HF writes into, RoPE.

The rest of pc_rag passes plain tensors and dataclasses; when transformers changes (5.24 renamed the
forward keyword `past_key_values` to `cache`), this is the one file to edit.

The cache is one preallocated buffer per request for all layers,
    keys, values: [layers, 1, kv_heads, capacity, head_dim],
indexed by *slot* (a token's index in the prompt). Cached blocks are copied (keys relocated by RoPE
rotation) straight into their slots; fresh tokens are written by HF's own `cache.update` into theirs.
Attention order comes from the explicit 4-D mask we pass (key slot <= query slot), and positions from
explicit `position_ids`, so slots, positions and the order blocks were fetched in are independent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
import xxhash
from transformers.models.llama.modeling_llama import (  # Mistral and Qwen2 copy the same functions
    apply_rotary_pos_emb,
)

from .batch import TurnLock
from .errors import Cancelled, PCRagError, UnsupportedModelError
from .weights import weights_of

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose inverse frequencies do not depend on the sequence length: rotating a cached key by
# delta positions is then exactly the key computed at the new position (up to float rounding).
# "dynamic" and "longrope" rescale with the sequence length, so a relocated key would be wrong.
RELOCATABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Attention implementations that apply the explicit 4-D mask pc_rag passes (None: HF falls back to eager).
# Flash-attention and flex kernels build their own (causal or packed) masks and would ignore ours.
MASK_HONOURING_ATTENTION = (None, "eager", "sdpa")

# Free request buffers kept for reuse (each is layers x capacity x KV bytes per token): at most POOL_SIZE of
# them and at most `LlamaRunner.pool_max_bytes` together, by default POOL_SIZE context-size buffers capped at
# POOL_MAX_BYTES (a long-context buffer of a 1B model is 4 GiB; the allocation it saves is small next to
# the prefill of that many tokens).
POOL_SIZE = 2
POOL_MAX_BYTES = 1 << 30

# While other requests are decoding, a forward over more fresh tokens than this runs as several forwards of at
# most this many (a chunked prefill), each taking its own turn on the runner lock, so the decoding requests wait
# for one chunk, not for the whole prompt: 512 tokens of the 8-layer bench model take about 0.3 s on the 2-core
# CPU. Only then: a chunk attends through an explicit mask rather than the causal kernel of one forward, which
# made a 4K-token prefill ~20% slower (bench model, medians of 3: 2.97 s in chunks of 512, 3.21 s in chunks of
# 256, 2.44 s whole), a cost a request alone should not pay.
PREFILL_CHUNK_TOKENS = 512

log = logging.getLogger("pc_rag.model")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PCRagError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class SlotCache:
    """A request's preallocated KV buffer, written by slot: keys, values [layers, 1, kv_heads, capacity, head_dim].

    Slots [0, length) are valid. Only pc_rag's own layer loop (LlamaRunner) writes it; it is not an HF cache
    object, so no transformers cache API is involved in a request."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.empty(num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def block_views(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [a, b) of every layer: ([L, H_kv, b-a, D], same) views."""
        return self.keys[:, 0, :, a:b], self.values[:, 0, :, a:b]


@dataclass(frozen=True)
class Writes:
    """Where one forward's fresh tokens go and what they attend to, worked out once per forward for every layer.

    A token at slot s attends to every slot <= s, so no query sees past the last written slot: keys are read
    from [0, kv). Three layouts, cheapest first:
    - "causal": the tokens fill slots [0, n) (a cold prefill, a chunk encoded on its own): they attend only among
      themselves, so sdpa runs on the fresh keys with `is_causal` (its fused kernel skips the masked half);
    - "after": contiguous slots [start, start + n) after everything before them (a question after a cached
      prefix, a chat turn, a decode step). One token needs no mask. Many (SPLIT_MIN_TOKENS) on CPU: attention
      in two parts merged by their log-sum-exp (`_attend_after`), the cached keys with no mask and the fresh ones
      with the causal kernel; otherwise with the lower-right causal mask. A 4K-token prompt that shared only its
      first token with an earlier one spent 2.2 s in masked attention against 1.2 s causal (bench model, fp32);
    - "slots": any other slots (text between relocated chunks, blend's rows): the mask key slot <= query slot.
    """

    n: int
    kv: int  # keys [0, kv) are read
    layout: str  # "causal" | "after" | "slots"
    start: int | None  # the first slot ("causal", "after")
    index: torch.Tensor | None  # the slots, [n] long ("slots")
    mask: torch.Tensor | None  # additive [1, 1, n, kv] in the model's dtype, where attention takes one

    @classmethod
    def of(cls, slots: list[int], dtype: torch.dtype, device) -> Writes:
        n, first, kv = len(slots), slots[0], max(slots) + 1
        if kv - first == n and slots == list(range(first, kv)):
            if first == 0:
                return cls(n, kv, "causal", 0, None, None)
            if n == 1 or (n >= SPLIT_MIN_TOKENS and _splits(device)):
                return cls(n, kv, "after", first, None, None)
            return cls(n, kv, "after", first, None, _mask(torch.arange(first, kv, device=device), kv, dtype))
        index = torch.tensor(slots, device=device)
        return cls(n, kv, "slots", None, index, _mask(index, kv, dtype))

    def rows(self, device) -> torch.Tensor:
        """The slots as a tensor [n]."""
        return self.index if self.index is not None else torch.arange(self.start, self.start + self.n, device=device)

    def keep(self, keep: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> Writes:
        """These writes narrowed to the rows `keep` (indices into this forward's tokens); `rows` is `self.rows()`."""
        mask = self.mask if self.mask is not None else _mask(rows, self.kv, dtype)
        return Writes(len(keep), self.kv, "slots", None, rows[keep], mask[:, :, keep])


# From this many fresh tokens after a cached prefix, attention runs in two parts on CPU. Measured (bench model,
# forward of n tokens after 300 / 2000 cached, fp32 and bf16): 2048 tokens 18-22% faster in two parts, 512 up to
# 20% (fp32 after 2000) or even, below 256 even or the single masked call ahead by up to 15% (fewer ops).
SPLIT_MIN_TOKENS = 512

# sdpa's CPU kernel with its log-sum-exp, which two partial attentions need to be merged (`_attend_after`).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splits(device) -> bool:
    return torch.device(device).type == "cpu" and _FLASH_CPU is not None


def _mask(q_slots: torch.Tensor, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, Q, kv]: 0 where key slot <= query slot, the dtype's lowest value elsewhere."""
    visible = torch.arange(kv, device=q_slots.device)[None, :] <= q_slots[:, None]  # [Q, kv]
    mask = torch.zeros(visible.shape, dtype=dtype, device=q_slots.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    sliding_window: int | None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


class LlamaRunner:
    """Owns an HF Llama-family model: forward passes into a SlotCache, RoPE relocation, fingerprints."""

    def __init__(self, model, tokenizer):
        config = model.config
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES or not hasattr(model, "model"):
            raise UnsupportedModelError(
                f"pc_rag supports Llama-family decoders ({', '.join(SUPPORTED_MODEL_TYPES)}); "
                f"got model_type={getattr(config, 'model_type', None)!r} ({type(model).__name__})"
            )
        _use_mask_honouring_attention(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_positions=config.max_position_embeddings,
            sliding_window=getattr(config, "sliding_window", None),
        )
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_type = rope.get("rope_type", "default")
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().to(torch.float32)  # [D/2], on the model's device
        # decode_batch applies RoPE as the model's own attention does: each family's modeling file has its copy.
        self._apply_rope = getattr(sys.modules[type(model.model.layers[0].self_attn).__module__],
                                   "apply_rotary_pos_emb", apply_rotary_pos_emb)
        # The linear layers as the forward passes multiply by them (fused, oneDNN-packed on CPU: weights.py).
        self.weights = weights_of(model, self.shape.num_layers)
        # One forward at a time: requests from several threads interleave step by step, each with its own
        # cache, so every thread gets exactly what a serial run gives. Turns are taken in arrival order (see
        # batch.TurnLock): a decode step waits for at most one prefill chunk.
        self._lock = TurnLock()
        self.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS
        # Whether other requests are in flight (set by the engine): long forwards are chunked then, so their
        # decode steps wait for one chunk at a time.
        self.others_decoding: Callable[[], bool] = lambda: False
        # Per thread: the Event that stops the forwards of the request this thread is prefilling (`cancellable`).
        self._cancel = threading.local()
        self._pool: list[SlotCache] = []
        self._pool_lock = threading.Lock()
        context_bytes = self.shape.max_positions * self.shape.kv_bytes_per_token(self.dtype)
        self.pool_max_bytes = min(POOL_MAX_BYTES, POOL_SIZE * context_bytes)
        self._fingerprint: str | None = None
        self._fingerprint_lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        """What the KV depends on besides the tokens: every weight byte, the forward-relevant config, the
        dtype and the tokenizer; never where the files live. Part of every store key.

        Computed on first use (an Engine reads it when it is built), so a runner that only loads a model for
        another one to wrap does not hash the weights twice.
        """
        with self._fingerprint_lock:
            if self._fingerprint is None:
                self._fingerprint = _model_fingerprint(self.model, self.dtype) + "-" + _tokenizer_fingerprint(
                    self.tokenizer)
            return self._fingerprint

    @classmethod
    def from_pretrained(cls, path_or_id: str, dtype="float32", device="cpu") -> LlamaRunner:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from .options import check_device

        check_device(device)  # before any weights load: "cuda" on a CPU build is one clear error

        config = AutoConfig.from_pretrained(path_or_id)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{path_or_id}: model_type {config.model_type!r} is not a supported Llama-family decoder "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
        # sdpa takes our additive 4-D mask as is, on CPU and CUDA alike.
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=parse_dtype(dtype), attn_implementation="sdpa")
        return cls(model.to(device), tokenizer)

    @property
    def relocatable(self) -> bool:
        return self.rope_type in RELOCATABLE_ROPE_TYPES

    def new_cache(self, capacity: int) -> SlotCache:
        s = self.shape
        return SlotCache(s.num_layers, s.kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def acquire_cache(self, capacity: int) -> SlotCache:
        """A request buffer from the pool (or a new one), never larger than the model's context: no request
        writes a slot beyond it (a prompt's slots never outnumber its positions, and decoding stops at the
        context's end). Reusing buffers matters: allocating and first touching a fresh 64 MB buffer cost about
        as much as relocating every cached chunk (measured, CPU)."""
        capacity = min(capacity, self.shape.max_positions)
        with self._pool_lock:
            fits = [c for c in self._pool if c.capacity >= capacity]
            if fits:
                cache = min(fits, key=lambda c: c.capacity)
                self._pool.remove(cache)
                cache.length = 0
                return cache
        # round up so nearby sizes share buffers
        return self.new_cache(min(-(-capacity // 256) * 256, self.shape.max_positions))

    def release_cache(self, cache: SlotCache) -> None:
        """Return a buffer to the pool; the pool keeps the largest buffers that fit, at most POOL_SIZE of them
        and `pool_max_bytes` together (the others are freed)."""
        with self._pool_lock:
            kept, total = [], 0
            for c in sorted([*self._pool, cache], key=lambda c: c.capacity, reverse=True):
                if len(kept) < POOL_SIZE and total + c.nbytes <= self.pool_max_bytes:
                    kept.append(c)
                    total += c.nbytes
            self._pool = kept

    def place(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys and values on the model's device (the same tensors when they are there already).

        Blocks read from disk or Redis are CPU tensors: move each once, here, rather than on every copy into a
        request buffer (`relocate` would otherwise move it again for each request)."""
        return _to_device(keys, self.device), _to_device(values, self.device)

    @contextlib.contextmanager
    def cancellable(self, stop: threading.Event) -> Iterator[None]:
        """While inside, every forward this thread starts raises `Cancelled` once `stop` is set: a server request
        whose client left stops at its next chunk encode or prefill chunk instead of running its whole prefill.
        A forward already running finishes (a prefill alone is one forward: it is not split for this)."""
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
        chunked prefill (equal to one forward within 1e-5, fp32).
        """
        n = self.prefill_chunk_tokens
        if n and len(ids) > n and self.others_decoding() and all(a < b for a, b in zip(slots, slots[1:], strict=False)):
            return self._forward_chunked(cache, ids, positions, slots, n)
        return self.forward_layers(cache, ids, positions, slots)

    def _forward_chunked(self, cache: SlotCache, ids, positions, slots, n: int) -> torch.Tensor:
        """The same forward, `n` tokens at a time. A chunk's tokens attend to slots [0, its last slot]: every
        slot there is filled (cached blocks, earlier chunks, this chunk)."""
        for a in range(0, len(ids), n):
            logits = self.forward_layers(cache, ids[a: a + n], positions[a: a + n], slots[a: a + n])
        return logits

    def _qkv(self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer `i`'s queries, keys and values for `hidden` [B, T, hidden], RoPE applied, [B, H, T, D] each: the
        ops of the model's own attention module (its projections fused, see weights.py)."""
        lw = self.weights.layers[i]
        x = lw.input_norm(hidden)
        shape = (*x.shape[:2], -1, self.shape.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in lw.qkv(x))
        return (*self._apply_rope(q, k, cos, sin), v)

    def _after_attention(self, i: int, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of layer `i`: the attention output `o` [B, H_q, T, D] through o_proj into the residual, then
        the MLP (down(act(gate(x)) * up(x)), as the model's own MLP module)."""
        lw = self.weights.layers[i]
        hidden = hidden + lw.o(o.transpose(1, 2).reshape(*hidden.shape[:2], -1))
        gate, up = lw.gate_up(lw.post_norm(hidden))
        return hidden + lw.down(lw.act(gate) * up)

    @staticmethod
    def _attend(layer_keys: torch.Tensor, layer_values: torch.Tensor, attn, q, k, v, w: Writes) -> torch.Tensor:
        """Write the fresh keys and values `k`, `v` [1, H_kv, n, D] into one layer's buffers [1, H_kv, capacity, D]
        at `w`'s slots, then attend: [1, H_q, n, D]."""
        if w.layout == "slots":
            layer_keys.index_copy_(2, w.index, k)
            layer_values.index_copy_(2, w.index, v)
        else:
            layer_keys[:, :, w.start: w.start + w.n] = k
            layer_values[:, :, w.start: w.start + w.n] = v
        if w.layout == "causal":  # nothing before these tokens: the fresh tensors are all the keys there are
            # Laid out [1, H, n, D] first: the kernel ran 8% faster in bf16 on them, copy included (fp32: even).
            return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True,
                                                  scale=attn.scaling, **_gqa(attn))
        if w.layout == "after" and w.n == 1:
            return _attend_one(q, layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv], attn)
        if w.layout == "after" and w.mask is None:
            return _attend_after(q, layer_keys[:, :, : w.start], layer_values[:, :, : w.start], k, v, attn)
        return F.scaled_dot_product_attention(q, layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv],
                                              attn_mask=w.mask, scale=attn.scaling, **_gqa(attn))

    @torch.inference_mode()
    def forward_layers(self, cache: SlotCache, ids: list[int], positions: list[int], slots: list[int],
                       narrow: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
                       ) -> torch.Tensor:
        """The forward pass, layer by layer over the model's own modules: `ids` at `positions`, their KV written
        to `slots` of `cache`, each token attending to the slots up to its own. Returns the last token's logits
        [vocab] (fp32).

        Not HF's `model(...)`: that call builds a 4-D mask from the cache length, captures outputs and goes
        through the cache API per layer, and its sdpa could only skip the masked half of a prefill when the
        mask is plain causal. Here the attention layout is chosen once per forward (`Writes`); the ops of a
        layer are the model's own modules, so the logits equal HF's forward within float rounding
        (tests/test_model.py compares them, 1e-4 in fp32).

        `narrow(layer, slots, keys)` (blend) is called in every layer once the rows' fresh keys ([H_kv, n, D],
        RoPE applied) exist, before any KV is written: it returns the indices of the rows to go on with (None:
        all). A dropped row keeps the KV already in its slot from this layer on (CacheBlend's selection: a row
        is dropped once its fresh KV shows it needs no recompute). The last row must stay.
        """
        self._check_cancelled()
        inner = self.model.model
        dev = self.device
        w = Writes.of(slots, self.dtype, dev)
        if narrow is not None and w.layout != "slots":  # rows may drop out: attention by mask over the buffer
            rows = w.rows(dev)
            w = Writes(w.n, w.kv, "slots", None, rows, _mask(rows, w.kv, self.dtype))
        cache.length = max(cache.length, w.kv)
        with self._lock:
            hidden = inner.embed_tokens(torch.tensor([ids], device=dev))  # [1, n, hidden]
            cos, sin = inner.rotary_emb(hidden, torch.tensor([positions], device=dev))  # [1, n, D]
            for i, layer in enumerate(inner.layers[: self.shape.num_layers]):
                q, k, v = self._qkv(i, hidden, cos, sin)  # [1, H, n, D]
                keep = narrow(i, w.rows(dev), k[0]) if narrow is not None else None
                if keep is not None:
                    hidden, q, k, v, cos, sin = (hidden[:, keep], q[:, :, keep], k[:, :, keep], v[:, :, keep],
                                                 cos[:, keep], sin[:, keep])
                    w = w.keep(keep, w.rows(dev), self.dtype)
                o = self._attend(cache.keys[i], cache.values[i], layer.self_attn, q, k, v, w)
                hidden = self._after_attention(i, hidden, o)
            logits = self.weights.lm_head(inner.norm(hidden[:, -1:]))
        return logits[0, -1].float()

    @torch.inference_mode()
    def decode_batch(self, caches: list[SlotCache], ids: list[int], positions: list[int],
                     slots: list[int]) -> torch.Tensor:
        """One decode step for B requests at once: token `ids[b]` at `positions[b]`, its KV written to
        `slots[b]` of `caches[b]`, attending to slots [0, slots[b]] of that cache only. Returns [B, vocab] fp32.

        The layers' own modules run on the batch, so every weight is read once per step for all B requests
        (the step is memory-bound on CPU: B rows cost little more than one); attention runs per request over
        its own buffer, so nothing is padded or copied to line the requests up. With B = 1 the logits equal
        `forward`'s bit for bit (tests/test_batch.py); with B > 1 the matrix products over B rows may round
        differently in the last bits (measured: logits within 1e-5, fp32).
        """
        inner = self.model.model
        n = len(ids)
        dev = self.device
        with self._lock:
            hidden = inner.embed_tokens(torch.tensor(ids, device=dev)[:, None])  # [B, 1, hidden]
            cos, sin = inner.rotary_emb(hidden, torch.tensor(positions, device=dev)[:, None])  # [B, 1, D]
            # Each request's slots [0, slot] in every layer, and its new slot: views taken once per step.
            seen = [(c.keys[:, :, :, : s + 1], c.values[:, :, :, : s + 1]) for c, s in zip(caches, slots, strict=True)]
            new = [(k[:, 0, :, -1], v[:, 0, :, -1]) for k, v in seen]  # [L, H_kv, D] each
            for i, layer in enumerate(inner.layers[: self.shape.num_layers]):
                attn = layer.self_attn
                q, k, v = self._qkv(i, hidden, cos, sin)  # [B, H, 1, D]
                k_new, v_new = k[:, :, 0], v[:, :, 0]  # [B, H_kv, D]
                out = []
                for b in range(n):
                    new[b][0][i] = k_new[b]
                    new[b][1][i] = v_new[b]
                    out.append(_attend_one(q[b: b + 1], seen[b][0][i], seen[b][1][i], attn))
                hidden = self._after_attention(i, hidden, torch.cat(out) if n > 1 else out[0])
            logits = self.weights.lm_head(inner.norm(hidden))[:, 0]  # [B, vocab]
        for cache, s in zip(caches, slots, strict=True):
            cache.length = max(cache.length, s + 1)
        return logits.float()

    @torch.inference_mode()
    def reference_logits(self, ids: list[int], positions: list[int] | None = None) -> torch.Tensor:
        """A plain HF forward over the whole sequence, no pc_rag cache: the reference tests compare to."""
        kwargs = {} if positions is None else {"position_ids": torch.tensor([positions], device=self.device)}
        out = self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def relocate(self, dst: torch.Tensor, src: torch.Tensor, delta: int) -> None:
        """Write keys `src` ([L, H, T, D], RoPE at p) into `dst` as if computed at p + delta.

        HF's RoPE rotates the halves (x1, x2) of each head by angle p*inv_freq: rotating again by
        delta*inv_freq gives angle (p+delta)*inv_freq exactly (attention scaling, as in yarn, is a
        constant factor that commutes with the rotation).

        `src` may live on another device than `dst` (a block read from disk or Redis is on the CPU): it is
        copied to `dst`'s device once, in its own dtype, and rotated there.
        """
        if delta == 0:
            dst.copy_(src, non_blocking=_may_copy_async(src.device, dst.device))  # across devices if need be
            return
        src = _to_device(src, dst.device)
        h = src.shape[-1] // 2
        angle = delta * self.inv_freq.to(dst.device)
        if src.dtype == dst.dtype == torch.float32:
            cos, sin = angle.cos(), angle.sin()
            k1, k2 = src[..., :h], src[..., h:]
            o1, o2 = dst[..., :h], dst[..., h:]
            torch.mul(k1, cos, out=o1)
            o1.addcmul_(k2, sin, value=-1.0)
            torch.mul(k2, cos, out=o2)
            o2.addcmul_(k1, sin)
        else:  # half precision: rotate in fp32 so the relocation adds one rounding, not four
            k = src.float()  # [L, H, T, D]
            k1, k2 = k[..., :h], k[..., h:]
            cos, sin = angle.cos(), angle.sin()
            dst[..., :h] = k1 * cos - k2 * sin
            dst[..., h:] = k2 * cos + k1 * sin


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn) -> torch.Tensor:
    """One query token [1, H_q, 1, D] over every key [1, H_kv, T, D] (a decode step: no mask).

    With grouped-query attention, the query heads that share a KV head are passed to sdpa as that head's rows
    ([1, H_kv, group, D]; HF's repeat_kv gives query head h the KV head h // group), so each KV head is read
    once: sdpa's own GQA read it once per query head, and its CPU kernel ran a decode step 1.4x (fp32) to 4x
    (bf16) slower (8 layers, 4K keys, 2 query heads per KV head)."""
    group = attn.num_key_value_groups
    if group == 1:
        return F.scaled_dot_product_attention(q, keys, values, scale=attn.scaling)
    b, h, _, d = q.shape
    o = F.scaled_dot_product_attention(q.reshape(b, h // group, group, d), keys, values, scale=attn.scaling)
    return o.reshape(b, h, 1, d)


def _attend_after(q: torch.Tensor, old_keys: torch.Tensor, old_values: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, attn) -> torch.Tensor:
    """n fresh queries [1, H_q, n, D] at the slots right after `old_keys`/`old_values` [1, H_kv, a, D], their own
    keys and values `keys`/`values` [1, H_kv, n, D]: attention over all a + n keys, as two attentions merged by
    their log-sum-exp (flash attention's own merge rule), each run by sdpa's CPU kernel at full speed: the old
    keys unmasked (every fresh token sees all of them; the query heads sharing a KV head fold into its rows, as
    in `_attend_one`), the fresh keys causally. Equal to the masked attention within float rounding."""
    group = attn.num_key_value_groups
    b, h, n, d = q.shape
    o1, lse1 = _FLASH_CPU(q.reshape(b, h // group, group * n, d), old_keys, old_values, 0.0, False, scale=attn.scaling)
    o1, lse1 = o1.reshape(b, h, n, d), lse1.reshape(b, h, n)
    if group > 1:  # the kernel has no GQA of its own
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    o2, lse2 = _FLASH_CPU(q, keys, values, 0.0, True, scale=attn.scaling)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)  # [b, h, n, 1] fp32
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def _gqa(attn) -> dict:
    return {"enable_gqa": True} if attn.num_key_value_groups > 1 else {}  # sdpa repeats the kv heads itself


def _may_copy_async(src: torch.device, dst: torch.device) -> bool:
    # Host to accelerator may be asynchronous: the copy is queued on the stream before any kernel that reads
    # the result (and overlaps with the host when the source is pinned). The other way round the host could
    # read the result before the copy lands, so it stays synchronous.
    return src.type == "cpu" and dst.type not in ("cpu", "meta")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    return t.to(device, non_blocking=_may_copy_async(t.device, device))


def _use_mask_honouring_attention(model) -> None:
    """Switch a model loaded with flash-attention or flex attention to sdpa (in place), or refuse it.

    pc_rag's attention order comes from the explicit 4-D mask it passes (key slot <= query slot); those
    kernels ignore it and would attend by their own causal rule over the buffer's slots."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl in MASK_HONOURING_ATTENTION:
        return
    error = None
    try:
        # 5.24 warns and changes nothing for a model class outside HF's attention interface: checked below.
        model.set_attn_implementation("sdpa")
    except Exception as e:  # any failure to switch leaves a model pc_rag cannot run: refused below
        error = e
    if getattr(config, "_attn_implementation", None) != "sdpa":
        raise UnsupportedModelError(
            f"{type(model).__name__} uses attn_implementation={impl!r}, whose kernels ignore the explicit attention "
            f"mask pc_rag relies on, and switching it to 'sdpa' failed ({error or 'the setting did not change'}); "
            f"load the model with attn_implementation='sdpa' or 'eager'"
        ) from error
    log.warning("%s was loaded with attn_implementation=%r, whose kernels ignore pc_rag's explicit attention mask; "
                "switched it to 'sdpa' (the model object is changed in place)", type(model).__name__, impl)


# Config fields that change no forward pass: where the checkpoint came from and what wrote it, the storage
# dtype (the dtype in use is hashed instead), the attention kernel (eager and sdpa agree to rounding), output
# switches, the label maps of classification heads, special token ids (the ids themselves are in every store
# key), initialisation, and every generation setting (older configs still carry them at the top level).
_CONFIG_FIELDS_OUTSIDE_FORWARD = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype", "torch_dtype",
    "_attn_implementation", "_attn_implementation_internal", "attn_implementation", "_experts_implementation",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache", "id2label", "label2id",
    "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range",
}) | frozenset(transformers.GenerationConfig().to_dict())

# Bytes copied at a time from an accelerator to the host for hashing.
_HASH_CHUNK_BYTES = 64 << 20


def _forward_config(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in _CONFIG_FIELDS_OUTSIDE_FORWARD}


def _hash_tensor(h, t: torch.Tensor, chunk_bytes: int = _HASH_CHUNK_BYTES, stage: bool | None = None) -> None:
    """Feed every byte of `t` to the hash `h`. A CPU tensor is read in place; a tensor on an accelerator
    (or any, with stage=True) is copied to the host `chunk_bytes` at a time, into one reused buffer (pinned
    for CUDA), so hashing a model never holds a second copy of it. Both ways give the same digest."""
    flat = t.detach().reshape(-1)
    raw = (flat if flat.is_contiguous() else flat.contiguous()).view(torch.uint8)  # [bytes]
    if raw.device.type == "meta":
        raise UnsupportedModelError("the model's weights are on the meta device (not loaded): nothing to fingerprint")
    if stage is None:
        stage = raw.device.type != "cpu"
    if not stage:
        h.update(raw.numpy())
        return
    n = raw.numel()
    buf = torch.empty(min(n, chunk_bytes), dtype=torch.uint8, pin_memory=raw.device.type == "cuda")
    for a in range(0, n, chunk_bytes):
        part = buf[: min(chunk_bytes, n - a)]
        part.copy_(raw[a: a + part.numel()])
        h.update(part.numpy())


def _model_fingerprint(model, dtype: torch.dtype) -> str:
    """Forward-relevant config + dtype + every byte of every weight, with its name, dtype and shape.

    xxh3-128 runs near memory speed (9 to 16 GB/s over a 1B bf16 model on this 2-core machine: 0.16 to 0.27 s,
    README "Model fingerprint"); a sample of each tensor would miss a fine-tune that changed a few embedding
    rows. The in-memory tensors are hashed, not the files: a model may never have been saved, or
    may have been changed after loading.
    """
    h = xxhash.xxh3_128()
    h.update(json.dumps(_forward_config(model.config), sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    seen: dict[tuple, str] = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            h.update(f"\n{name}|{p.dtype}|{tuple(p.shape)}|".encode())
            ident = (p.device, p.data_ptr(), p.dtype, tuple(p.shape), p.stride())
            if ident in seen:  # tied weights (lm_head = embed_tokens): hashed once, recorded as the same tensor
                h.update(f"={seen[ident]}".encode())
                continue
            seen[ident] = name
            _hash_tensor(h, p)
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's definition (vocabulary, merges, normalizer, special tokens, post-processor), without
    its truncation and padding state, which a call with `truncation=True` or `padding=...` leaves behind."""
    h = hashlib.blake2b(digest_size=8)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()
