"""Weights kept in GGML's block-quantized formats, what GGUF files hold, as pc_rag multiplies by them.

A quantized matrix [out, in] is its file's bytes, one row after another ([out, in / weights_per_block *
bytes_per_block] uint8), in one of the formats below; nothing else is kept (no float copy). Each block of 32 or 256
weights stores small integers and one or a few scales (and offsets): weight = scale * q (+ offset). The formats
people run: Q8_0 (8-bit), Q4_0 (4-bit, llama.cpp's oldest), and the K-quants: Q4_K_M, Ollama's and LM Studio's
default, mixes Q4_K with Q6_K (and Q5_0 / Q8_0 where a row is not a multiple of 256), Q5_K_M mixes Q5_K with Q6_K.

- `dequantize(data, fmt, cols)`: the weights in fp32, as GGML's reference dequantization computes them (the `gguf`
  package's numpy version is the tests' independent reference); torch ops, on any device: the path where the native
  kernels do not run (CUDA, no AVX-512) and the modules' own forwards.
- `quantize(weight, fmt)`: a float matrix to Q8_0, Q4_0 (as llama.cpp's reference quantizers, byte for byte), Q4_K
  or Q6_K (a plain min/max search per sub-block, not llama.cpp's iterative one: valid blocks of those formats, a
  little more error): `Engine.from_pretrained(..., quantize=...)` for a float checkpoint.
- `QuantLinear`, `QuantEmbedding`: the modules that hold a quantized matrix in a model (gguf.py builds them from a
  file, `quantize_model` from a float model). Their forwards dequantize (a reference, and CUDA's path); pc_rag's
  own forward multiplies through weights.Quantized instead (kernels.QuantRows on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PCRagError


@dataclass(frozen=True)
class Format:
    name: str
    ggml_type: int  # GGML's id (ggml.h's ggml_type), as GGUF files record it
    weights: int  # per block
    bytes: int  # per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.weights * self.bytes


Q4_0 = Format("Q4_0", 2, 32, 18)
Q4_1 = Format("Q4_1", 3, 32, 20)
Q5_0 = Format("Q5_0", 6, 32, 22)
Q5_1 = Format("Q5_1", 7, 32, 24)
Q8_0 = Format("Q8_0", 8, 32, 34)
Q4_K = Format("Q4_K", 12, 256, 144)
Q5_K = Format("Q5_K", 13, 256, 176)
Q6_K = Format("Q6_K", 14, 256, 210)
FORMATS = {f.ggml_type: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)}
BY_NAME = {f.name: f for f in FORMATS.values()}

# `quantize=` schemes for a float checkpoint: the format of the decoder's matrices and of the output matrix (kept
# at 6 bits or more, as llama.cpp's quantizer does for every scheme below 8 bits; a tied embedding is the output
# matrix), the embedding as the decoder's. A row length a format cannot take (not a multiple of its block) takes
# the next one in FALLBACK (llama.cpp falls back likewise), and a matrix no format takes stays float.
SCHEMES = {"q8_0": (Q8_0, Q8_0), "q4_0": (Q4_0, Q6_K), "q4_k": (Q4_K, Q6_K)}
FALLBACK = {Q4_K: Q4_0, Q6_K: Q8_0, Q4_0: Q8_0}


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian IEEE halves) -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (qs & 0x0F).to(torch.int32), (qs >> 4).to(torch.int32)


def _bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n / 8] uint8 -> [..., n] int32: bit j of the little-endian bit string."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.int32)
    return ((qh.to(torch.int32)[..., None] >> shifts) & 1).flatten(-2)[..., :n]


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (int32 [..., 8])."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


@torch.no_grad()
def dequantize(data: torch.Tensor, fmt: Format, cols: int) -> torch.Tensor:
    """Rows of a quantized matrix (uint8 [rows, row_bytes]) -> fp32 [rows, cols], as GGML's reference computes each
    weight in fp32 (scale times value exact, one rounding where an offset is added)."""
    rows = data.shape[0]
    b = data.reshape(rows, cols // fmt.weights, fmt.bytes)
    if fmt is Q8_0:
        return (_half(b[..., 0:2])[..., None] * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, cols)
    if fmt in (Q4_0, Q4_1, Q5_0, Q5_1):
        offset = fmt in (Q4_1, Q5_1)
        d = _half(b[..., 0:2])[..., None]
        at = 4 if offset else 2
        lo, hi = _nibbles(b[..., at + (4 if fmt.name.startswith("Q5") else 0):])
        q = torch.cat([lo, hi], -1)
        if fmt.name.startswith("Q5"):
            q = q | (_bits(b[..., at: at + 4], 32) << 4)
        if offset:
            return (d * q.float() + _half(b[..., 2:4])[..., None]).reshape(rows, cols)
        return (d * (q - (16 if fmt is Q5_0 else 8)).float()).reshape(rows, cols)
    if fmt in (Q4_K, Q5_K):
        d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(b[..., 4:16])
        a, c = (d * sc.float())[..., None], (dmin * mn.float())[..., None]  # [rows, blocks, 8, 1]
        qs = b[..., 48:] if fmt is Q5_K else b[..., 16:]
        lo, hi = _nibbles(qs.reshape(rows, -1, 4, 32))
        q = torch.stack([lo, hi], -2).reshape(rows, -1, 8, 32)  # sub-block 2i: low nibbles, 2i + 1: high
        if fmt is Q5_K:
            shifts = torch.arange(8, device=data.device, dtype=torch.int32)[:, None]
            q = q | (((b[..., 16:48].to(torch.int32)[..., None, :] >> shifts) & 1) << 4)
        return (a * q.float() - c).reshape(rows, cols)
    if fmt is Q6_K:
        ql, qh = b[..., 0:128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        lo, hi = _nibbles(ql)  # [rows, blocks, 2 halves, 64]
        low = torch.cat([lo, hi], -1).reshape(rows, -1, 2, 4, 32)  # per half: ql[0:32], ql[32:64] low, then high
        shifts = torch.tensor([0, 2, 4, 6], device=data.device, dtype=torch.int32)[:, None]
        two = (qh.to(torch.int32) >> shifts) & 3
        q = ((low | (two << 4)) - 32).reshape(rows, -1, 16, 16)
        scales = b[..., 192:208].contiguous().view(torch.int8).float()  # [rows, blocks, 16]
        a = (_half(b[..., 208:210])[..., None] * scales)[..., None]
        return (a * q.float()).reshape(rows, cols)
    raise PCRagError(f"no dequantization for {fmt.name}")


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf, what GGML's quantizers use)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _as_half_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


@torch.no_grad()
def quantize(weight: torch.Tensor, fmt: Format) -> torch.Tensor:
    """A float matrix [rows, cols] (cols a multiple of the format's block) -> its rows in `fmt` (uint8 [rows,
    row_bytes]). Q8_0 and Q4_0 as GGML's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref);
    Q4_K and Q6_K by a min/max search per sub-block (module docstring)."""
    rows, cols = weight.shape
    if cols % fmt.weights:
        raise PCRagError(f"{fmt.name} takes rows of a multiple of {fmt.weights} weights, not {cols}")
    x = weight.detach().float().reshape(rows, cols // fmt.weights, fmt.weights)
    if fmt is Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127
        q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_as_half_bytes(d[..., 0]), q], -1).reshape(rows, -1)
    if fmt is Q4_0:
        at = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, at) / -8
        q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)
        return torch.cat([_as_half_bytes(d[..., 0]), qs], -1).reshape(rows, -1)
    if fmt is Q4_K:
        return _quantize_q4_k(x).reshape(rows, -1)
    if fmt is Q6_K:
        return _quantize_q6_k(x).reshape(rows, -1)
    raise PCRagError(f"pc_rag quantizes to Q8_0, Q4_0, Q4_K and Q6_K, not {fmt.name}")


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 256] -> [rows, blocks, 144]: per sub-block of 32, scale (max - min) / 15 and offset -min
    (min <= 0), both as 6-bit multiples of the block's two fp16 factors."""
    sub = x.reshape(*x.shape[:2], 8, 32)
    lo, hi = sub.amin(-1).clamp(max=0), sub.amax(-1)
    scale, mins = (hi - lo) / 15, -lo
    d = scale.amax(-1, keepdim=True) / 63
    dmin = mins.amax(-1, keepdim=True) / 63
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)
    sc = _round_away(scale * _inverse(d16.float())).clamp(0, 63)
    mn = _round_away(mins * _inverse(dmin16.float())).clamp(0, 63)
    a, c = d16.float() * sc, dmin16.float() * mn
    q = _round_away((sub + c[..., None]) * _inverse(a)[..., None]).clamp(0, 15).to(torch.uint8)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], -1)
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).flatten(-2)
    return torch.cat([_as_half_bytes(d16[..., 0]), _as_half_bytes(dmin16[..., 0]), packed, qs], -1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 256] -> [rows, blocks, 210]: per sub-block of 16, a signed scale (its largest magnitude maps
    to -32) as an int8 multiple of the block's fp16 factor."""
    sub = x.reshape(*x.shape[:2], 16, 16)
    at = sub.abs().argmax(-1, keepdim=True)
    scale = torch.gather(sub, -1, at)[..., 0] / -32
    d = scale.abs().amax(-1, keepdim=True) / 127
    d16 = d.to(torch.float16)
    sc = _round_away(scale * _inverse(d16.float())).clamp(-128, 127)
    a = d16.float() * sc
    q = (_round_away(sub * _inverse(a)[..., None]).clamp(-32, 31) + 32).to(torch.uint8)
    q = q.reshape(*q.shape[:2], 2, 4, 32)  # per half of 128: weights l, l+32, l+64, l+96
    low = q & 0x0F
    ql = torch.cat([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], -1)
    top = q >> 4
    qh = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return torch.cat([ql.flatten(-2), qh.flatten(-2), sc.to(torch.int8).view(torch.uint8),
                      _as_half_bytes(d16[..., 0])], -1)


class QuantLinear(torch.nn.Module):
    """A linear layer whose weight [out_features, in_features] is kept quantized (`qweight`, its file bytes, and
    `qformat`, the GGML type, both in the state dict, so the model fingerprint covers them). Its forward dequantizes
    the whole matrix (the reference and CUDA's path); pc_rag's CPU forward multiplies through weights.Quantized."""

    def __init__(self, qweight: torch.Tensor, fmt: Format, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != fmt.row_bytes(in_features) \
                or in_features % fmt.weights:
            raise PCRagError(f"{fmt.name} weight of {tuple(qweight.shape)} bytes for {in_features} inputs")
        self.format = fmt
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("qformat", torch.tensor([fmt.ggml_type], dtype=torch.int32))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.format, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name}"


class QuantEmbedding(torch.nn.Module):
    """An embedding table kept quantized: a lookup dequantizes only the rows it reads, in `dtype`, times `scale`
    (Gemma's scaled embeddings; 1 elsewhere)."""

    def __init__(self, qweight: torch.Tensor, fmt: Format, embedding_dim: int, dtype: torch.dtype,
                 scale: float | None = None, kernel=None):
        super().__init__()
        self.format, self.dtype, self.scale = fmt, dtype, scale
        self.num_embeddings, self.embedding_dim = qweight.shape[0], embedding_dim
        self.register_buffer("qweight", qweight)
        self.register_buffer("qformat", torch.tensor([fmt.ggml_type], dtype=torch.int32))
        self.kernel = kernel  # kernels.dequant_rows where the native kernels run (set by weights.py)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.kernel is not None and self.qweight.device.type == "cpu":
            rows = self.kernel(self.qweight, self.format, self.embedding_dim, flat, self.dtype)
        else:
            rows = dequantize(self.qweight[flat], self.format, self.embedding_dim).to(self.dtype)
        if self.scale is not None:
            rows = rows * torch.tensor(self.scale, dtype=self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}"


def embedding_scale(module: torch.nn.Module, config) -> float | None:
    """The factor an embedding module multiplies its rows by (Gemma's scaled embeddings: sqrt(hidden size)), or
    None; a module of another kind that is not a plain nn.Embedding is refused."""
    if type(module) is torch.nn.Embedding:
        return None
    if hasattr(module, "embed_scale"):
        return float(config.hidden_size) ** 0.5
    raise PCRagError(f"{type(module).__name__}: an embedding pc_rag cannot keep quantized")


def quantize_model(model, scheme: str) -> None:
    """Replaces the decoder's linear layers, the output layer and the embedding of a float HF model by quantized
    ones (`SCHEMES[scheme]`), one at a time, so each float weight goes once its quantized copy is made."""
    if scheme not in SCHEMES:
        raise PCRagError(f"quantize={scheme!r}: choose one of {sorted(SCHEMES)}")
    body, head = SCHEMES[scheme]
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight

    def fit(fmt: Format | None, cols: int) -> Format | None:
        while fmt is not None and cols % fmt.weights:
            fmt = FALLBACK.get(fmt)
        return fmt

    def swap(parent, name: str, fmt: Format) -> None:
        linear = getattr(parent, name)
        f = fit(fmt, linear.in_features)
        if f is None:
            return
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(parent, name, QuantLinear(quantize(linear.weight, f), f, linear.in_features, bias))

    for layer in inner.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    swap(parent, name, body)
    embed = inner.embed_tokens
    dim = embed.weight.shape[1]
    scale = embedding_scale(embed, model.config)
    efmt = fit(head if tied else body, dim)
    if efmt is not None:
        q = quantize(embed.weight, efmt)
        inner.embed_tokens = QuantEmbedding(q, efmt, dim, embed.weight.dtype, scale)
        if tied:
            model.lm_head = QuantLinear(q, efmt, dim)
    if not tied:
        swap(model, "lm_head", head)


def to_device(model, device) -> torch.nn.Module:
    """`model.to(device)`, with an output layer that shares its quantized bytes with the embedding still sharing
    them there (`to` copies each module's buffers on its own)."""
    head, embed = model.lm_head, model.model.embed_tokens
    shared = isinstance(head, QuantLinear) and isinstance(embed, QuantEmbedding) and head.qweight is embed.qweight
    model = model.to(device)
    if shared:
        head.qweight = embed.qweight
    return model
