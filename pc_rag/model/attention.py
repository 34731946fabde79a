"""Attention over a request's buffer: where one forward's tokens go (`Writes`) and the kernels that attend.

Which keys a query sees is decided here, by slot (a token's index in the prompt), never by HF's mask builders:
a token at slot s attends to every slot <= s, and in a sliding-window layer to the slots (s - window, s] only,
as HF's own sliding mask does over the prompt's token indices (`kv_idx > q_idx - sliding_window`). Positions
(RoPE) are independent of slots.

Layers that attend to everything before them, without soft-capping, take the fastest layout for the forward
(`Writes`). A windowed layer whose keys reach further back than its window, and every layer of a soft-capping
model (Gemma 2: sdpa has no soft-cap), attend in blocks of query rows over the keys each block can see, with an
explicit mask (`_attend_rows`): a long prefill costs O(tokens x window) there, not tokens squared.

Whether pc_rag's kernels (kernels.py) or sdpa attend is the runner's choice (`Backends`, backends.py), passed to
every call here; a call the chosen kernel cannot take (a layout it does not read) goes to sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .aligned import Aligned
from .aligned import attend as attend_aligned
from .backends import Backends

# From this many fresh tokens after a cached prefix, attention runs in two parts on CPU. Measured (bench model,
# forward of n tokens after 300 / 2000 cached, fp32 and bf16): 2048 tokens 18-22% faster in two parts, 512 up to
# 20% (fp32 after 2000) or even, below 256 even or the single masked call ahead by up to 15% (fewer ops).
SPLIT_MIN_TOKENS = 512

# After a cached prefix of at most 1/PADDED_PREFIX_SHARE of the fresh tokens, attention runs as one causal call with
# the prefix's rows padded (`_attend_padded`): the padding's extra scores (at most (1/4)^2 / 2 of the square's)
# cost less than `_attend_after`'s second call and merge.
PADDED_PREFIX_SHARE = 4

# Query rows per block in `_attend_rows`: bounds its scores ([heads, rows, keys] fp32) and masks.
ROWS_PER_BLOCK = 256

# sdpa's CPU kernel with its log-sum-exp, which two partial attentions need to be merged (`_attend_after`).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class Heads:
    """How a model's attention combines heads and scales logits (the attribute names are HF's attention modules')."""

    num_key_value_groups: int  # query heads per KV head
    scaling: float
    softcap: float | None = None  # logits -> tanh(logits / softcap) * softcap (Gemma 2)


@dataclass(frozen=True)
class Writes:
    """Where one forward's fresh tokens go and what they attend to, worked out once per forward for every layer.

    A token at slot s attends to every slot <= s, so no query sees past the last written slot: keys are read
    from [0, kv). Three layouts, cheapest first:
    - "causal": the tokens fill slots [0, n) (a cold prefill, a chunk encoded on its own): they attend only among
      themselves, with no mask: pc_rag's prefill kernel where the runner runs it, else sdpa with `is_causal`
      (its fused kernel skips the masked half);
    - "after": contiguous slots [start, start + n) after everything before them (a question after a cached
      prefix, a chat turn, a decode step). One token needs no mask (the decode kernel, or sdpa). Many: where the
      prefill kernel runs, one call over the cached keys and the fresh ones (its mask is the lower-right causal
      one by construction); after a prefix short next to them (a BOS seen before), one causal sdpa call with the
      prefix's rows padded (`_attend_padded`); else on CPU from SPLIT_MIN_TOKENS tokens, attention in two parts
      merged by their log-sum-exp (`_attend_after`), the cached keys with no mask and the fresh ones causally;
      otherwise sdpa with the lower-right causal mask. A 4K-token prompt that shared only its first token with
      an earlier one spent 2.2 s in masked attention against 1.2 s causal (bench model, fp32, sdpa);
    - "slots": any other slots (text between relocated chunks, blend's rows): the mask key slot <= query slot.
    """

    n: int
    kv: int  # keys [0, kv) are read
    layout: str  # "causal" | "after" | "slots"
    start: int | None  # the first slot ("causal", "after")
    index: torch.Tensor | None  # the slots, [n] long ("slots")
    mask: torch.Tensor | None  # additive [1, 1, n, kv] in the model's dtype, where attention takes one

    @classmethod
    def of(cls, slots: list[int], dtype: torch.dtype, device, backends: Backends) -> Writes:
        n, first, kv = len(slots), slots[0], max(slots) + 1
        if kv - first == n and slots == list(range(first, kv)):
            if first == 0:
                return cls(n, kv, "causal", 0, None, None)
            if (n == 1 or backends.prefill_kernel is not None or first * PADDED_PREFIX_SHARE <= n
                    or (n >= SPLIT_MIN_TOKENS and _splits(device))):
                return cls(n, kv, "after", first, None, None)
            return cls(n, kv, "after", first, None, _mask(torch.arange(first, kv, device=device), kv, dtype))
        return cls.scattered(torch.tensor(slots, device=device), kv, dtype, backends)

    @classmethod
    def scattered(cls, index: torch.Tensor, kv: int, dtype: torch.dtype, backends: Backends) -> Writes:
        """Writes at the slots `index` [n] in the "slots" layout. No mask where the prefill kernel runs (it takes
        each row's slot instead): at 3.9K rows the mask alone took 20 ms to build."""
        mask = None if backends.prefill_kernel is not None else _mask(index, kv, dtype)
        return cls(len(index), kv, "slots", None, index, mask)

    def rows(self, device) -> torch.Tensor:
        """The slots as a tensor [n]."""
        return self.index if self.index is not None else torch.arange(self.start, self.start + self.n, device=device)

    def keep(self, keep: torch.Tensor, rows: torch.Tensor) -> Writes:
        """These writes narrowed to the rows `keep` (indices into this forward's tokens); `rows` is `self.rows()`."""
        mask = None if self.mask is None else self.mask[:, :, keep]
        return Writes(len(keep), self.kv, "slots", None, rows[keep], mask)

    def blocks(self, size: int) -> list[tuple[int, int, int, int]]:
        """The rows in blocks of at most `size`: (first row, end row, lowest slot, highest slot) of each."""
        if self.index is None:  # contiguous: row r is at slot start + r
            return [(a, min(a + size, self.n), self.start + a, self.start + min(a + size, self.n) - 1)
                    for a in range(0, self.n, size)]
        slots = self.index.tolist()
        return [(a, min(a + size, self.n), min(slots[a: a + size]), max(slots[a: a + size]))
                for a in range(0, self.n, size)]


def attend(layer_keys: torch.Tensor, layer_values: torch.Tensor, heads: Heads, window: int | None, q, k, v,
           w: Writes, backends: Backends, written: bool = False,
           base: tuple[torch.Tensor, torch.Tensor] | None = None, aligned: Aligned | None = None,
           layer: int = 0) -> torch.Tensor:
    """Write the fresh keys and values `k`, `v` [1, H_kv, n, D] into one layer's buffers [1, H_kv, capacity, D]
    at `w`'s slots (unless `written`: they are views of the buffers there already), then attend (sliding `window`,
    if any) by the runner's `backends`: [1, H_q, n, D]. `base`: a shared prefix's keys and values [1, H_kv, P, D]
    before the buffer's slot 0 (model/cache.py), which every query sees; `w`'s slots count from the buffer's.
    `aligned` (a request with APE, never with a shared prefix): APE's attention over the reused chunks of this
    `layer` (aligned.py: plain torch ops, no kernel takes its per-key bias)."""
    if not written and w.layout == "slots":
        layer_keys.index_copy_(2, w.index, k)
        layer_values.index_copy_(2, w.index, v)
    elif not written:
        layer_keys[:, :, w.start: w.start + w.n] = k
        layer_values[:, :, w.start: w.start + w.n] = v
    if aligned is not None:
        return _attend_with_ape(layer_keys, layer_values, heads, window, q, w, backends, aligned, layer)
    if base is not None:
        return _attend_with_base(q, base, layer_keys, layer_values, w, heads, backends)
    if w.layout == "after" and w.n == 1:  # a decode step: the last `window` keys at most
        lo = 0 if window is None else max(0, w.kv - window)
        return attend_decode(q, [layer_keys[:, :, lo: w.kv]], [layer_values[:, :, lo: w.kv]], heads, backends)
    if heads.softcap is not None or (window is not None and w.kv > window):
        return _attend_rows(q, layer_keys, layer_values, w, heads, window)
    if w.layout == "causal":  # nothing before these tokens: the fresh tensors are all the keys there are
        if _prefill_kernel_takes(q, k, v, backends):
            return _attend_prefill(q, k, v, heads, backends)
        # Laid out [1, H, n, D] first: the kernel ran 8% faster in bf16 on them, copy included (fp32: even).
        return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True,
                                              scale=heads.scaling, **_gqa(heads))
    if w.layout == "after" and w.mask is None:
        keys, values = layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv]
        if _prefill_kernel_takes(q, keys, values, backends):  # one call over the cached keys and the fresh ones
            return _attend_prefill(q, keys, values, heads, backends)
        if w.start * PADDED_PREFIX_SHARE <= w.n:
            return _attend_padded(q, keys, values, w.start, heads)
        return _attend_after(q, layer_keys[:, :, : w.start], layer_values[:, :, : w.start], k, v, heads)
    mask = w.mask
    if w.layout == "slots":
        keys, values = layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv]
        if _prefill_kernel_takes(q, keys, values, backends):  # each row up to its own slot, no mask
            return _attend_prefill(q, keys, values, heads, backends, w.index)
        if w.n >= 2 * ROWS_PER_BLOCK:
            # sdpa's CPU kernel with a mask computes every key of every row: blend's first layers (nearly every
            # slot, scattered) paid for the whole square where a causal prefill pays for half (blend 0.2 at 3.9K
            # tokens on the bench model: 551 of its 778 ms). In blocks of rows, each reads the keys up to its last
            # slot.
            return _attend_rows(q, layer_keys, layer_values, w, heads, None)
        if mask is None:  # the runner has the kernel (Writes.scattered built none), but it refused these tensors
            mask = _mask(w.index, w.kv, q.dtype)
    return F.scaled_dot_product_attention(q, layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv],
                                          attn_mask=mask, scale=heads.scaling, **_gqa(heads))


def _attend_with_ape(layer_keys: torch.Tensor, layer_values: torch.Tensor, heads: Heads, window: int | None,
                     q: torch.Tensor, w: Writes, backends: Backends, aligned: Aligned, layer: int) -> torch.Tensor:
    """`attend` for a request with APE (its KV written already): the rows outside the reused chunks (the question,
    text between chunks, a decode step) through APE's attention (aligned.py); blend's recomputed chunk rows, which APE
    leaves as a full prefill would see them, through the runner's own kernels as scattered rows (they are most of
    blend's rows: all of them through APE's plain torch ops took 3.6x blend's time at 3.9K tokens)."""
    rows = w.rows(q.device)
    plain = aligned.reused[rows]  # [n] rows at reused chunk slots: recomputed by blend
    if not bool(plain.any()):
        return attend_aligned(q, layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv], rows, heads.scaling,
                              heads.num_key_value_groups, window, heads.softcap, aligned, layer)
    out = torch.empty_like(q)
    at = plain.nonzero().squeeze(1)
    out[:, :, at] = attend(layer_keys, layer_values, heads, window, q[:, :, at], None, None,
                           Writes.scattered(rows[at], w.kv, q.dtype, backends), backends, written=True)
    at = (~plain).nonzero().squeeze(1)
    if len(at):
        out[:, :, at] = attend_aligned(q[:, :, at], layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv], rows[at],
                                       heads.scaling, heads.num_key_value_groups, window, heads.softcap, aligned,
                                       layer)
    return out


def attend_at(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, heads: Heads,
              backends: Backends) -> torch.Tensor:
    """Query rows q [1, H_q, n, D] at `slots` [n] among keys / values [1, H_kv, T, D] (nothing written), each
    seeing the keys [0, its slot] (soft-capped if `heads.softcap`): [1, H_q, n, D]. pc_rag's prefill kernel where
    it takes them, else sdpa in blocks of rows. For probes that need some rows' attention only
    (runner.context_shift)."""
    if heads.softcap is None and _prefill_kernel_takes(q, keys, values, backends):
        return _attend_prefill(q, keys, values, heads, backends, slots)
    return _attend_rows(q, keys, values, Writes(len(slots), keys.shape[2], "slots", None, slots, None), heads, None)


def _prefill_kernel_takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, backends: Backends) -> bool:
    """Whether pc_rag's prefill kernel runs q [1, H_q, n, D] over keys [1, H_kv, T, D]: the runner's choice,
    CPU, fp32 or bf16, every row's D elements contiguous (heads and rows may be strided: the fused projection's
    views are)."""
    d = q.shape[-1]
    even = q.dtype != torch.bfloat16 or (keys.stride(1) % 2 == 0 and keys.stride(2) % 2 == 0)  # bf16 read in pairs
    return (backends.prefill_kernel is not None and q.device.type == "cpu" and q.dtype == keys.dtype == values.dtype
            and q.dtype in kernels.DTYPES and q.shape[0] == 1 and d % 16 == 0 and d <= 256
            and all(t.stride(-1) == 1 for t in (q, keys, values)) and even)


def _attend_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: Heads,
                    backends: Backends, slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, H_q, n, D] over keys [1, H_kv, T, D] through pc_rag's prefill kernel, lower-right causal (query row
    i sees keys [0, T - n + i]), or row i up to key `slots[i]`: [1, H_q, n, D]."""
    return kernels.prefill_attention(backends.prefill_kernel, q[0], keys[0], values[0], heads.scaling,
                                     seen=slots)[None]


def _splits(device) -> bool:
    return torch.device(device).type == "cpu" and _FLASH_CPU is not None


def _mask(q_slots: torch.Tensor, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, Q, kv]: 0 where key slot <= query slot, the dtype's lowest value elsewhere."""
    visible = torch.arange(kv, device=q_slots.device)[None, :] <= q_slots[:, None]  # [Q, kv]
    mask = torch.zeros(visible.shape, dtype=dtype, device=q_slots.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def _gqa(heads: Heads) -> dict:
    return {"enable_gqa": True} if heads.num_key_value_groups > 1 else {}  # sdpa repeats the kv heads itself


def attend_decode(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], heads: Heads,
                  backends: Backends,
                  bases: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
    """One decode step's attention for B requests: request b's query token q[b] [H_q, 1, D] over every key of its
    own keys[b] / values[b] [1, H_kv, T_b, D] (no mask), after its shared prefix bases[b] ([1, H_kv, P_b, D]
    each, or None). Returns [B, H_q, 1, D].

    Where the runner chose pc_rag's decode kernel (`backends`), it runs all B requests in one call (kernels.py),
    a shared prefix as one more segment of keys merged in the kernel: sdpa's CPU kernel read the KV at about half
    the machine's rate in fp32 and a third in bf16. Otherwise sdpa, request by request (`_attend_one`)."""
    b, h, _, d = q.shape
    group = heads.num_key_value_groups
    bases = bases or [None] * b
    fn = backends.decode_kernel
    segments = [(base, i) for i, base in enumerate(bases) if base is not None]
    if (fn is not None and heads.softcap is None
            and all(_kernel_takes(k, v) for k, v in zip(keys, values, strict=True))
            and all(_kernel_takes(*base) for base, _ in segments)):
        if not segments:
            o = kernels.decode_attention(fn, q.reshape(b, h // group, group, d),
                                         [k[0] for k in keys], [v[0] for v in values], heads.scaling)
        else:
            ks, vs, owner = [], [], []
            for i, (k, v) in enumerate(zip(keys, values, strict=True)):
                parts = ([bases[i]] if bases[i] is not None else []) + [(k, v)]
                ks += [p[0][0] for p in parts]
                vs += [p[1][0] for p in parts]
                owner += [i] * len(parts)
            o = kernels.decode_attention(fn, q.reshape(b, h // group, group, d), ks, vs, heads.scaling, owner)
        return o.reshape(b, h, 1, d)
    out = [_attend_one(q[i: i + 1], keys[i], values[i], heads) if bases[i] is None
           else merge([lse_attention(q[i: i + 1], *bases[i], None, heads),
                       lse_attention(q[i: i + 1], keys[i], values[i], None, heads)], q.dtype)
           for i in range(b)]
    return torch.cat(out) if b > 1 else out[0]


def _attend_with_base(q: torch.Tensor, base: tuple[torch.Tensor, torch.Tensor], layer_keys: torch.Tensor,
                      layer_values: torch.Tensor, w: Writes, heads: Heads, backends: Backends) -> torch.Tensor:
    """`attend` after a shared prefix `base` (keys, values [1, H_kv, P, D]), whose slots all precede the buffer's:
    every query sees all of it, and the buffer's slots up to its own. pc_rag's prefill kernel over the two laid
    end to end where it runs; else two attentions merged by their log-sum-exp, in blocks of ROWS_PER_BLOCK query
    rows (a decode step: attend_decode, the kernel where the runner chose it). Equal to one attention over the
    prefix and the buffer laid end to end, within float rounding."""
    if w.layout == "after" and w.n == 1:
        return attend_decode(q, [layer_keys[:, :, : w.kv]], [layer_values[:, :, : w.kv]], heads, backends, [base])
    rows = w.rows(q.device)
    if backends.prefill_kernel is not None and heads.softcap is None and q.device.type == "cpu":
        # One kernel call over the prefix and the buffer laid end to end: copying them together per layer costs
        # little next to the two sdpa attentions and their merge it replaces (an exact-mode server at 1.5 req/s
        # spent a third of its prefill in those).
        keys = torch.cat([base[0], layer_keys[:, :, : w.kv]], 2)
        values = torch.cat([base[1], layer_values[:, :, : w.kv]], 2)
        if _prefill_kernel_takes(q, keys, values, backends):  # contiguous rows: the lower-right causal layout
            slots = rows + base[0].shape[2] if w.layout == "slots" else None  # (which bf16 runs on AMX tiles)
            return _attend_prefill(q, keys, values, heads, backends, slots)
    out = []
    for a in range(0, w.n, ROWS_PER_BLOCK):
        block, at = q[:, :, a: a + ROWS_PER_BLOCK], rows[a: a + ROWS_PER_BLOCK]
        high = int(at.max()) + 1
        visible = torch.arange(high, device=q.device)[None, :] <= at[:, None]
        out.append(merge([lse_attention(block, *base, None, heads),
                          lse_attention(block, layer_keys[:, :, :high], layer_values[:, :, :high], visible, heads)],
                         q.dtype))
    return torch.cat(out, 2) if len(out) > 1 else out[0]


def lse_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                  heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, H_q, r, D] over keys / values [1, H_kv, T, D] where `visible` [r, T] (None: everywhere;
    every row must see a key), with its log-sum-exp: (output [1, H_q, r, D], lse [1, H_q, r] fp32), what `merge`
    takes. sdpa's flash kernel on CPU (it returns both); elsewhere the scores in fp32."""
    group = heads.num_key_value_groups
    b, h, r, d = q.shape
    if _FLASH_CPU is not None and q.device.type == "cpu":
        if visible is None and group > 1:  # each KV head read once: its query heads fold into its rows
            o, lse = _FLASH_CPU(q.reshape(b, h // group, group * r, d), keys, values, 0.0, False, scale=heads.scaling)
            return o.reshape(b, h, r, d), lse.reshape(b, h, r).float()
        if group > 1:
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
        o, lse = _FLASH_CPU(q, keys, values, 0.0, False, attn_mask=mask, scale=heads.scaling)
        return o, lse.float()
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), keys.float().transpose(2, 3)) * heads.scaling
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.matmul((scores - lse[..., None]).exp(), values.float()), lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Attentions of the same queries over disjoint sets of keys, (output, lse) each, as one attention over all
    of them (flash attention's merge rule): each output weighted by exp(its lse - the largest), normalised."""
    top = parts[0][1]
    for _, lse in parts[1:]:
        top = torch.maximum(top, lse)
    num = den = None
    for o, lse in parts:
        weight = (lse - top).exp().unsqueeze(-1)
        num = o.float() * weight if num is None else num + o.float() * weight
        den = weight if den is None else den + weight
    return (num / den).to(dtype)


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: Heads) -> torch.Tensor:
    """One query token [1, H_q, 1, D] over every key [1, H_kv, T, D] through sdpa (a decode step: no mask).

    With grouped-query attention, the query heads that share a KV head are passed to sdpa as that head's rows
    ([1, H_kv, group, D]; HF's repeat_kv gives query head h the KV head h // group), so each KV head is read
    once: sdpa's own GQA read it once per query head, and its CPU kernel ran a decode step 1.4x (fp32) to 4x
    (bf16) slower (8 layers, 4K keys, 2 query heads per KV head)."""
    if heads.softcap is not None:
        return _scores_attention(q, keys, values, None, heads)
    group = heads.num_key_value_groups
    if group == 1:
        return F.scaled_dot_product_attention(q, keys, values, scale=heads.scaling)
    b, h, _, d = q.shape
    o = F.scaled_dot_product_attention(q.reshape(b, h // group, group, d), keys, values, scale=heads.scaling)
    return o.reshape(b, h, 1, d)


def _kernel_takes(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether pc_rag's decode kernel runs these keys [1, H_kv, T, D]: CPU, fp32/bf16, rows contiguous."""
    d = keys.shape[-1]
    return (keys.device.type == "cpu" and keys.dtype in kernels.DTYPES and values.dtype == keys.dtype
            and keys.shape[0] == 1 and d % 16 == 0 and d <= 256 and keys.stride(-1) == 1 and keys.stride(-2) == d
            and values.stride(-1) == 1 and values.stride(-2) == d)


def _attend_padded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   heads: Heads) -> torch.Tensor:
    """n fresh queries [1, H_q, n, D] at slots [start, start + n) over keys / values [1, H_kv, start + n, D]: one
    causal sdpa call over all start + n rows, the cached prefix's own rows padded with zero queries and dropped.
    Where the prefix is short next to the fresh tokens (a prompt that shares only its first token with an earlier
    one), that is cheaper than `_attend_after`'s second call and merge: a cold 4K prompt in modular mode, whose BOS
    was seen before, took 1.32-1.39 s against full mode's 1.18-1.22 (bench model, bf16, sdpa on AMX)."""
    b, h, n, d = q.shape
    padded = torch.cat([q.new_zeros(b, h, start, d), q], 2)
    o = F.scaled_dot_product_attention(padded, keys.contiguous(), values.contiguous(), is_causal=True,
                                       scale=heads.scaling, **_gqa(heads))
    return o[:, :, start:]


def _attend_after(q: torch.Tensor, old_keys: torch.Tensor, old_values: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, heads: Heads) -> torch.Tensor:
    """n fresh queries [1, H_q, n, D] at the slots right after `old_keys`/`old_values` [1, H_kv, a, D], their own
    keys and values `keys`/`values` [1, H_kv, n, D]: attention over all a + n keys, as two attentions merged by
    their log-sum-exp (flash attention's own merge rule), each run by sdpa's CPU kernel at full speed: the old
    keys unmasked (every fresh token sees all of them; the query heads sharing a KV head fold into its rows, as
    in `_attend_one`), the fresh keys causally. Equal to the masked attention within float rounding."""
    group = heads.num_key_value_groups
    b, h, n, d = q.shape
    o1, lse1 = _FLASH_CPU(q.reshape(b, h // group, group * n, d), old_keys, old_values, 0.0, False,
                          scale=heads.scaling)
    o1, lse1 = o1.reshape(b, h, n, d), lse1.reshape(b, h, n)
    if group > 1:  # the kernel has no GQA of its own
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    o2, lse2 = _FLASH_CPU(q, keys, values, 0.0, True, scale=heads.scaling)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)  # [b, h, n, 1] fp32
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def _attend_rows(q: torch.Tensor, layer_keys: torch.Tensor, layer_values: torch.Tensor, w: Writes, heads: Heads,
                 window: int | None) -> torch.Tensor:
    """The queries q [1, H_q, n, D] at `w`'s slots over one layer's buffers [1, H_kv, capacity, D], each seeing the
    key slots (slot - window, slot] (window None: [0, slot]), soft-capped if `heads.softcap`: [1, H_q, n, D].

    In blocks of ROWS_PER_BLOCK query rows, each over only the key slots its rows can see, with a mask built for
    that block: the scores and masks stay [rows, window + rows] in a windowed layer however long the prompt."""
    out = []
    all_rows = w.rows(q.device)
    for a, b, low, high in w.blocks(ROWS_PER_BLOCK):
        lo = 0 if window is None else max(0, low - window + 1)
        rows = all_rows[a:b, None]  # [r, 1] query slots
        slots = torch.arange(lo, high + 1, device=q.device)[None, :]  # [1, T] key slots
        visible = slots <= rows
        if window is not None:
            visible &= slots > rows - window
        out.append(_scores_attention(q[:, :, a:b], layer_keys[:, :, lo: high + 1], layer_values[:, :, lo: high + 1],
                                     visible, heads))
    return torch.cat(out, 2) if len(out) > 1 else out[0]


def _scores_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                      heads: Heads) -> torch.Tensor:
    """Attention of q [1, H_q, r, D] over keys/values [1, H_kv, T, D] where `visible` [r, T] (None: everywhere).
    Soft-capping runs the ops of HF's eager attention (matmul in the model's dtype, cap, mask, softmax in fp32),
    which is what Gemma 2's own forward runs; otherwise sdpa with the boolean mask."""
    if heads.softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=heads.scaling, **_gqa(heads))
    group = heads.num_key_value_groups
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * heads.scaling
    scores = torch.tanh(scores / heads.softcap) * heads.softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)
