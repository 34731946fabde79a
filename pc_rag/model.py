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

import hashlib
import threading
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.llama.modeling_llama import rotate_half  # Mistral and Qwen2 copy the same function

from .errors import PCRagError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose inverse frequencies do not depend on the sequence length: rotating a cached key by
# delta positions is then exactly the key computed at the new position (up to float rounding).
# "dynamic" and "longrope" rescale with the sequence length, so a relocated key would be wrong.
RELOCATABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# transformers 5.24 renamed the forward keyword; older 5.x only know the old one.
# Free request buffers kept for reuse (each is layers x capacity x KV bytes per token).
POOL_SIZE = 2

_CACHE_KW = "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PCRagError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class _SlotLayer(CacheLayerMixin):
    """One layer's view of the request buffer; HF calls `update` with the fresh tokens' K/V."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: SlotCache):
        super().__init__()
        self.keys, self.values = keys, values  # [1, H_kv, capacity, D] views into the owner's buffers
        self.is_initialized = True
        self._owner = owner

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        o = self._owner
        if o.write_range is not None:  # contiguous slots (decode, a trailing question): a plain slice write
            a, b = o.write_range
            self.keys[:, :, a:b] = key_states
            self.values[:, :, a:b] = value_states
        else:
            self.keys.index_copy_(2, o.write_slots, key_states)
            self.values.index_copy_(2, o.write_slots, value_states)
        # Views, not copies: HF's DynamicCache concatenates (a full copy of the cache per layer per step).
        return self.keys[:, :, : o.length], self.values[:, :, : o.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.length, 0

    def get_seq_length(self) -> int:  # HF reads it before `update`: the length before this forward's tokens
        return self._owner.length - self._owner.pending

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """A request's preallocated KV buffer, written by slot."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.empty(num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0  # slots [0, length) are valid
        self.pending = 0  # tokens the current forward writes
        self.write_range: tuple[int, int] | None = None
        self.write_slots: torch.Tensor | None = None
        super().__init__(layers=[_SlotLayer(self.keys[i], self.values[i], self) for i in range(num_layers)])

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def prepare_write(self, slots: list[int]) -> None:
        if slots == list(range(slots[0], slots[0] + len(slots))):
            self.write_range, self.write_slots = (slots[0], slots[0] + len(slots)), None
        else:
            self.write_range = None
            self.write_slots = torch.tensor(slots, device=self.keys.device)
        self.length = max(self.length, max(slots) + 1)
        self.pending = len(slots)

    def appends_causally(self, slots: list[int]) -> bool:
        """True when this forward just appends after everything in the cache (a plain prefill from slot 0,
        or one decode step): HF's own causal masking is then exact, and sdpa can use its fast causal kernels."""
        return self.write_range is not None and self.write_range == (self.length - len(slots), self.length) and (
            len(slots) == 1 or self.write_range[0] == 0
        )

    def block_views(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [a, b) of every layer: ([L, H_kv, b-a, D], same) views."""
        return self.keys[:, 0, :, a:b], self.values[:, 0, :, a:b]


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
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().to(torch.float32)  # [D/2]
        self.fingerprint = _model_fingerprint(model, self.dtype) + "-" + _tokenizer_fingerprint(tokenizer)
        # One forward at a time: requests from several threads interleave step by step, each with its own
        # cache, so every thread gets exactly what a serial run gives.
        self._lock = threading.Lock()
        self._pool: list[SlotCache] = []
        self._pool_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path_or_id: str, dtype="float32", device="cpu") -> LlamaRunner:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
        """A request buffer from the pool (or a new one). Reusing buffers matters: allocating and first
        touching a fresh 64 MB buffer cost about as much as relocating every cached chunk (measured, CPU)."""
        with self._pool_lock:
            fits = [c for c in self._pool if c.capacity >= capacity]
            if fits:
                cache = min(fits, key=lambda c: c.capacity)
                self._pool.remove(cache)
                cache.length = 0
                return cache
        return self.new_cache(-(-capacity // 256) * 256)  # round up so nearby sizes share buffers

    def release_cache(self, cache: SlotCache) -> None:
        """Return a buffer to the pool; the pool keeps the POOL_SIZE largest."""
        with self._pool_lock:
            self._pool.append(cache)
            self._pool.sort(key=lambda c: c.capacity, reverse=True)
            del self._pool[POOL_SIZE:]

    @torch.inference_mode()
    def forward(self, cache: SlotCache, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Run `ids` (at `positions`, written to `slots`) over everything already in `cache`.

        Each token attends to every filled slot up to its own; returns the last token's logits [vocab] (fp32).
        """
        cache.prepare_write(slots)
        dev = self.device
        mask = None
        if not cache.appends_causally(slots):
            q_slots = torch.tensor(slots, device=dev)
            k_slots = torch.arange(cache.length, device=dev)
            visible = k_slots[None, :] <= q_slots[:, None]  # [Q, K]
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            mask = mask[None, None]
        kwargs = {_CACHE_KW: cache}
        with self._lock:
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.tensor([positions], device=dev),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def probe_keys(self, ids: list[int], positions: list[int], layer: int) -> torch.Tensor:
        """Keys of layer `layer` for a plain causal prefill of `ids`: [H_kv, T, D].

        The selection probe of `blend`: layers before `layer` run in full over every token; of `layer` itself
        only the key projection runs (its attention and MLP would not change its keys), so the probe costs
        `layer` layers plus a projection, a fraction of a full prefill.
        """
        inner = self.model.model
        dev = self.device
        pos = torch.tensor([positions], device=dev)
        hidden = inner.embed_tokens(torch.tensor([ids], device=dev))
        cos, sin = inner.rotary_emb(hidden, pos)
        with self._lock:
            if layer:
                mask = None  # sdpa applies its own causal mask when none is given; eager needs one spelled out
                if self.model.config._attn_implementation != "sdpa":
                    mask = torch.full((len(ids), len(ids)), torch.finfo(self.dtype).min, dtype=self.dtype,
                                      device=dev).triu(1)[None, None]
                cache = self.new_cache(len(ids))  # the layers' own attention path, as in a prefill
                cache.prepare_write(list(range(len(ids))))
                for block in inner.layers[:layer]:
                    hidden = block(hidden, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin),
                                   use_cache=True, **{_CACHE_KW: cache})
            block = inner.layers[layer]
            attn = block.self_attn
            k = attn.k_proj(block.input_layernorm(hidden)).view(len(ids), -1, attn.head_dim).transpose(0, 1)
            return k * cos[0] + rotate_half(k) * sin[0]  # HF's apply_rotary_pos_emb, for the keys alone

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
        """
        if delta == 0:
            dst.copy_(src)
            return
        h = src.shape[-1] // 2
        angle = delta * self.inv_freq.to(src.device)
        if src.dtype == torch.float32:
            cos, sin = angle.cos(), angle.sin()
            k1, k2 = src[..., :h], src[..., h:]
            o1, o2 = dst[..., :h], dst[..., h:]
            torch.mul(k1, cos, out=o1)
            o1.addcmul_(k2, sin, value=-1.0)
            torch.mul(k2, cos, out=o2)
            o2.addcmul_(k1, sin)
        else:  # half precision: rotate in fp32 so the relocation adds one rounding, not four
            k = src.float()
            k1, k2 = k[..., :h], k[..., h:]
            cos, sin = angle.cos(), angle.sin()
            dst[..., :h] = k1 * cos - k2 * sin
            dst[..., h:] = k2 * cos + k1 * sin


def _model_fingerprint(model, dtype: torch.dtype) -> str:
    """Architecture config + dtype + a strided sample of every weight tensor.

    Hashing every weight of a 1B model costs seconds at load; a fixed sample of each tensor (with its
    shape and name) tells apart any two real checkpoints, fine-tunes included, in milliseconds.
    """
    h = hashlib.blake2b(digest_size=12)
    h.update(model.config.to_json_string(use_diff=False).encode())
    h.update(str(dtype).encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 1024)
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(flat[::step][:1024].float().cpu().numpy().tobytes())
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.blake2b(digest_size=8)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()
