// Weights kept in GGML's block-quantized formats (what GGUF files hold: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
// K-quants Q4_K, Q5_K, Q6_K that Q4_K_M and Q5_K_M mix), multiplied without a float copy of the matrix
// (quant.py, weights.Quantized):
//
// - pc_rag_dequant_rows: rows of such a matrix decoded to fp32 or bf16, each weight exactly as GGML's reference
//   dequantization computes it in fp32 (then rounded to nearest even for bf16, as torch's conversion): an
//   embedding's rows, and a prefill's products, which multiply a layer's decoded weights by many rows at a time
//   through oneDNN (there the decoding is paid once for all the rows).
// - pc_rag_quant_rows: the product of a few rows (a decode step's) by such matrices, the weights read from memory
//   once, in their quantized bytes. bf16 x: straight into AVX512-BF16 dot products (below). fp32 x: each thread
//   decodes a block of its output rows into a scratch buffer that stays in L2, then runs linear_rows' microkernels
//   (rows.h) over it for every x row. Either way each output is the product by the weights exactly as decoded,
//   summed in fp32 in one fixed order whatever M is: a row's result does not depend on its batch.
//
// Every format's block is decoded 16 weights at a time: the quantized values widened to 32-bit lanes, converted,
// times the block's scale (and minus its offset where it has one), the products exact in fp32 (a scale of 11 to 19
// significant bits times a value of at most 8).

#include <omp.h>

#include <algorithm>
#include <vector>

#include "rows.h"

namespace {

using namespace pc_rows;

// GGML's type ids (ggml.h) and their blocks: weights and bytes per block.
enum : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t weights, bytes;
};

inline Format format_of(int type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}


// The AVX-512 subsets every kernel here uses, with F16C for the blocks' fp16 scales (every AVX-512 CPU has it);
// PC_QUANT adds AVX512-BF16 for the direct kernels, which callers check for first.
#define PC_DECODE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define PC_QUANT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))

// A block's fp16 scale as fp32 (exactly).
PC_DECODE inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes widened to 16 int32 lanes.
PC_DECODE inline __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

PC_DECODE inline __m512 scaled(__m512i q, float a) { return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(a)); }

// out[16] = a * q + c (a * q exact, one rounding for the add, as GGML's reference: (d * q) + m).
PC_DECODE inline void put(float* out, __m512i q, float a, float c) {
  _mm512_storeu_ps(out, _mm512_add_ps(scaled(q, a), _mm512_set1_ps(c)));
}

// One block of `type` decoded into out[weights] (fp32).
PC_DECODE void block_f32(int type, const uint8_t* b, float* out) {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  switch (type) {
    case Q8_0: {
      const float d = f16(b);
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_ps(out + 16 * h, scaled(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                                   reinterpret_cast<const __m128i*>(b + 2 + 16 * h))), d));
      return;
    }
    case Q4_0:
    case Q4_1: {
      const float d = f16(b), m = type == Q4_1 ? f16(b + 2) : 0.f;
      const __m512i q = bytes16(b + (type == Q4_1 ? 4 : 2));
      __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi32(q, 4);
      if (type == Q4_0) {  // (q - 8) * d
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
        _mm512_storeu_ps(out, scaled(lo, d));
        _mm512_storeu_ps(out + 16, scaled(hi, d));
      } else {
        put(out, lo, d, m);
        put(out + 16, hi, d, m);
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const bool offset = type == Q5_1;
      const float d = f16(b), m = offset ? f16(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (offset ? 4 : 2), 4);
      const __m512i q = bytes16(b + (offset ? 8 : 6)), sixteen = _mm512_set1_epi32(16);
      // weight j's fifth bit is bit j of qh
      __m512i lo = _mm512_mask_add_epi32(_mm512_and_si512(q, low4), __mmask16(qh & 0xFFFF), _mm512_and_si512(q, low4),
                                         sixteen);
      __m512i hi = _mm512_mask_add_epi32(_mm512_srli_epi32(q, 4), __mmask16(qh >> 16), _mm512_srli_epi32(q, 4), sixteen);
      if (!offset) {  // (q - 16) * d
        _mm512_storeu_ps(out, scaled(_mm512_sub_epi32(lo, sixteen), d));
        _mm512_storeu_ps(out + 16, scaled(_mm512_sub_epi32(hi, sixteen), d));
      } else {
        put(out, lo, d, m);
        put(out + 16, hi, d, m);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      // d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, [Q5_K: 32 bytes of fifth bits], 128 bytes
      // of nibbles: sub-block 2i in the low nibbles of bytes 32i.., 2i+1 in their high nibbles.
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* s = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (type == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        const float a = d * float(sc), c = dmin * float(mn);
        for (int h = 0; h < 2; ++h) {
          const __m512i q = bytes16(qs + 32 * (j / 2) + 16 * h);
          __m512i v = (j & 1) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, low4);
          if (type == Q5_K) {
            const __m512i bit = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh + 16 * h), j), _mm512_set1_epi32(1));
            v = _mm512_or_si512(v, _mm512_slli_epi32(bit, 4));
          }
          _mm512_storeu_ps(out + 32 * j + 16 * h, _mm512_sub_ps(scaled(v, a), _mm512_set1_ps(c)));
        }
      }
      return;
    }
    case Q6_K: {
      // 128 bytes of low nibbles, 64 of high pairs of bits, 16 int8 scales (one per 16 weights), d; in two halves
      // of 128 weights: weights l, l+32, l+64, l+96 (l < 32) take the low nibble of ql[l], of ql[l+32], the high
      // nibble of ql[l], of ql[l+32], and bits 0-1, 2-3, 4-5, 6-7 of qh[l].
      const float d = f16(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int half_ = 0; half_ < 2; ++half_) {
        const uint8_t* ql = b + 64 * half_;
        const uint8_t* qh = b + 128 + 32 * half_;
        for (int part = 0; part < 4; ++part)
          for (int h = 0; h < 2; ++h) {
            const int l = 16 * h, w = 128 * half_ + 32 * part + l;
            const __m512i lowq = bytes16(ql + l + (part & 1) * 32);
            const __m512i nib = part < 2 ? _mm512_and_si512(lowq, low4) : _mm512_srli_epi32(lowq, 4);
            const __m512i two = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh + l), 2 * part), _mm512_set1_epi32(3));
            const __m512i q = _mm512_sub_epi32(_mm512_or_si512(nib, _mm512_slli_epi32(two, 4)), _mm512_set1_epi32(32));
            _mm512_storeu_ps(out + w, scaled(q, d * float(sc[w / 16])));
          }
      }
      return;
    }
  }
}

// Row `row` [K / weights blocks of `type`] decoded into out [K] (fp32, or bf16 rounded to nearest even).
template <typename T>
PC_DECODE void decode_row(int type, Format f, const uint8_t* row, int64_t K, T* out) {
  alignas(64) float tmp[256];
  for (int64_t k = 0; k < K; k += f.weights, row += f.bytes) {
    float* dst = sizeof(T) == 4 ? reinterpret_cast<float*>(out + k) : tmp;
    block_f32(type, row, dst);
    if constexpr (sizeof(T) == 2)
      for (int64_t i = 0; i < f.weights; i += 16) store16(out + k + i, _mm512_load_ps(tmp + i));
  }
}


// ---- A decode step's products: the quantized values straight into AVX512-BF16 dot products -------------------
//
// Decoding into the scratch buffer costs ~35 vector ops per 32 weights (widen, convert, scale, round to bf16, store,
// load again): one core decoded 2 GB/s of Q4_0 where the machine reads 20 (2026-12-07, Xeon with AMX, 2 threads:
// 8 layers of the 0.37B shape's MLP, 1 row: 14.7 ms through the scratch buffer against 9.7 for bf16 linear_rows over
// four times the bytes). So for bf16 x the formats people run are read in registers: each block's integers become
// bf16 exactly (a table lookup of 32 entries, vpermw, for 4- and 5-bit values; widened through fp32 for 8- and
// 6-bit ones), a dot product with x sums them per block in fp32, and the block's scale multiplies that sum (plus, for
// the K-quants' offsets, offset times the sum of x over the sub-block). So these products use the file's weights
// exactly (scale times value); a prefill's products, through oneDNN on decoded weights, round them to bf16 first.
// Q4_0 and Q5_0 store a block's weights j and j + 16 in one byte, so their x is read in pairs of blocks laid out as
// their nibbles come (Xs.pairs below); Q4_1 and Q5_1 add their offset times the sum of x over the block.

constexpr int64_t PREFETCH_AHEAD = 8192;
constexpr int64_t MAX_BLOCKS = 4096;  // blocks of 32 in a row the direct kernels take (K <= 131072)

// The weights PREFETCH_AHEAD bytes past p asked for: the hardware prefetcher stops at every 4 KB page, and without
// this the kernels waited on memory at each (Q4_0 at 5 against 16 GB/s, 2026-12-07). One line per call: callers
// call it for every 64 bytes or less they read (a loop over lines here was a third of the Q4_0 loop's instructions).
PC_QUANT inline void ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_AHEAD, _MM_HINT_T0);
}


// The fp16 scale of each of a row's `nb` blocks (`bytes` apart, the scale at byte `at`) as fp32, into d[nb]: once
// per row, so the block loop broadcasts them from memory (a load) rather than converting each (two shuffle-port
// ops per block, which bounded Q4_0 there).
PC_QUANT inline void block_scales(const uint8_t* row, int64_t nb, int64_t bytes, int at, float* d) {
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(int(bytes)));
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 live = nb - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - b)) - 1);
    // 4 bytes at each block's scale (its first 2), the scale in the low half of each lane
    const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, row + b * bytes + at, 1);
    _mm512_mask_storeu_ps(d + b, live, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
  }
}

// *p in every lane, as a load (vbroadcastss from memory) rather than a shuffle of a register holding it.
PC_QUANT inline __m512 bcast(const float* p) {
  __m512 v;
  asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// The bf16 of value j - bias for j = 0..31 (the tables vpermw reads), for the biases the formats use; built once, as
// building one per row (32 conversions) cost as much as a short row's products.
struct Tables {
  alignas(64) uint16_t at[4][32];  // bias 0, 8, 16, 32
  Tables() {
    const int biases[4] = {0, 8, 16, 32};
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 32; ++j) at[t][j] = f32_to_bf16(float(j - biases[t]));
  }
};
const Tables TABLES;

PC_QUANT inline __m512i table(int bias) {
  return _mm512_load_si512(TABLES.at[bias == 0 ? 0 : bias == 8 ? 1 : bias == 16 ? 2 : 3]);
}

// x as the kernels read it: bf16 rows in their order (`x`), the same rows with each pair of 32-blocks laid out
// [0..15 of both, 16..31 of both] (`pairs`, Q4_0 / Q5_0), and the sum of every 32 of x in fp32 (`sums`, the
// K-quants' offsets).
struct Xs {
  const uint16_t* x;
  const uint16_t* pairs;
  const float* sums;
  int64_t ld, ld_pairs, ld_sums;
};

// y[m] += sum over the row's weights for M rows of x; `row` is one weight row of K weights in `type`.
template <int M, int type>
PC_QUANT void dot_legacy(const uint8_t* row, int64_t K, const Xs& xs, __m512* out) {
  // Q4_0, Q4_1, Q5_0, Q5_1: d [, m] [, 32 fifth bits], 16 bytes of nibbles (weights j and j + 16 in byte j)
  constexpr bool five = type == Q5_0 || type == Q5_1, offset = type == Q4_1 || type == Q5_1;
  const int64_t bytes = format_of(type).bytes, nb = K / 32;
  const int qh_at = offset ? 4 : 2, at = qh_at + (five ? 4 : 0);
  __m512 acc[M];
  PC_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lut = table(offset ? 0 : five ? 16 : 8), low4 = _mm512_set1_epi16(0x0F);
  const __m512i sixteen = _mm512_set1_epi16(16);
  alignas(64) float ds[MAX_BLOCKS];
  block_scales(row, nb, bytes, 0, ds);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* p = row + b * bytes;
    ahead(p);  // a pair is 36-48 bytes
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + bytes + at)), 1);
    const __m512i q = _mm512_cvtepu8_epi16(raw);  // [block b bytes, block b + 1 bytes]
    __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi16(q, 4);
    if constexpr (five) {  // fifth bits: weight j of a block is bit j of its qh
      uint32_t h0, h1;
      std::memcpy(&h0, p + qh_at, 4);
      std::memcpy(&h1, p + bytes + qh_at, 4);
      lo = _mm512_mask_add_epi16(lo, __mmask32((h0 & 0xFFFF) | (h1 << 16)), lo, sixteen);
      hi = _mm512_mask_add_epi16(hi, __mmask32((h0 >> 16) | (h1 & 0xFFFF0000u)), hi, sixteen);
    }
    const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(lo, lut), wh = (__m512bh)_mm512_permutexvar_epi16(hi, lut);
    const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(ds[b]), _mm512_set1_ps(ds[b + 1]));
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const uint16_t* xp = xs.pairs + m * xs.ld_pairs + 32 * b;
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, (__m512bh)_mm512_loadu_si512(xp));
      s = _mm512_dpbf16_ps(s, wh, (__m512bh)_mm512_loadu_si512(xp + 32));
      acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
    }
  }
  if (b < nb) {  // an odd last block: its x is in order in `pairs` too
    const uint8_t* p = row + b * bytes;
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)));
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(0x0F))),
                                   _mm256_srli_epi16(q, 4), 1);
    if constexpr (five) {
      uint32_t h;
      std::memcpy(&h, p + qh_at, 4);
      v = _mm512_mask_add_epi16(v, __mmask32(h), v, sixteen);
    }
    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(v, lut);
    const __m512 d = _mm512_set1_ps(ds[b]);
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), w,
                                        (__m512bh)_mm512_loadu_si512(xs.pairs + m * xs.ld_pairs + 32 * b));
      acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
    }
  }
  if constexpr (offset) {  // + m times the sum of x over the block
    alignas(64) float ms[MAX_BLOCKS];
    block_scales(row, nb, bytes, 2, ms);
    PC_UNROLL for (int m = 0; m < M; ++m) {
      __m512 o = _mm512_setzero_ps();
      for (int64_t i = 0; i < nb; i += 16) {
        const __mmask16 live = nb - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - i)) - 1);
        o = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, ms + i), _mm512_maskz_loadu_ps(live, xs.sums + m * xs.ld_sums + i), o);
      }
      acc[m] = _mm512_add_ps(acc[m], o);
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(out[m], acc[m]);
}

template <int M>
PC_QUANT void dot_q8_0(const uint8_t* row, int64_t K, const Xs& xs, __m512* out) {
  __m512 acc[M];
  PC_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  alignas(64) float ds[MAX_BLOCKS];
  block_scales(row, K / 32, 34, 0, ds);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = row + b * 34;
    ahead(p);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
    const __m512bh w = _mm512_cvtne2ps_pbh(q1, q0);  // the integers, exactly
    const __m512 d = _mm512_set1_ps(ds[b]);
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(xs.x + m * xs.ld + 32 * b));
      acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(out[m], acc[m]);
}

// A K-quant super-block's 8 six-bit scales and mins (Q4_K, Q5_K) times d and dmin: a[0..8), c[0..8).
PC_QUANT inline void scales_k4(const uint8_t* p, float* a, float* c) {
  const float d = f16(p), dmin = f16(p + 2);
  uint32_t u[3];
  std::memcpy(u, p + 4, 12);
  const uint32_t sc_lo = u[0] & 0x3F3F3F3F, mn_lo = u[1] & 0x3F3F3F3F;
  const uint32_t sc_hi = (u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030);
  const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030);
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi32(int(mn_hi), int(mn_lo), int(sc_hi),
                                                                          int(sc_lo))));
  const __m512 f = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
  alignas(64) float ac[16];
  _mm512_store_ps(ac, _mm512_mul_ps(v, f));
  std::memcpy(a, ac, 32);
  std::memcpy(c, ac + 8, 32);
}

template <int M, bool five>
PC_QUANT void dot_q4_k(const uint8_t* row, int64_t K, const Xs& xs, __m512* out, __m256* out_off) {
  __m512 acc[M];
  PC_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  __m256 off[M];
  PC_UNROLL for (int m = 0; m < M; ++m) off[m] = _mm256_setzero_ps();
  const __m512i lut = table(0), low4 = _mm512_set1_epi16(0x0F), one = _mm512_set1_epi16(1);
  const int64_t bytes = five ? 176 : 144;
  alignas(32) float a[8], c[8];
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* p = row + sb * bytes;
    ahead(p);
    scales_k4(p, a, c);
    const __m256 cv = _mm256_load_ps(c);
    PC_UNROLL for (int m = 0; m < M; ++m)
      off[m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xs.sums + m * xs.ld_sums + 8 * sb), off[m]);
    const uint8_t* qs = p + (five ? 48 : 16);
    const __m512i qh = five ? _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)))
                            : _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      ahead(qs + 32 * i + 16);  // with the one above, every 64 bytes of a 144- or 176-byte super-block
      const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i)));
      __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi16(q, 4);
      if constexpr (five) {  // sub-block j's fifth bits: bit j of qh[0..32)
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * i), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * i + 1), one), 4));
      }
      const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(lo, lut);
      const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(hi, lut);
      const __m512 al = bcast(a + 2 * i), ah = bcast(a + 2 * i + 1);
      PC_UNROLL for (int m = 0; m < M; ++m) {
        const uint16_t* xp = xs.x + m * xs.ld + 256 * sb + 64 * i;
        const __m512 sl = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, (__m512bh)_mm512_loadu_si512(xp));
        const __m512 sh = _mm512_dpbf16_ps(_mm512_setzero_ps(), wh, (__m512bh)_mm512_loadu_si512(xp + 32));
        acc[m] = _mm512_fmadd_ps(sl, al, acc[m]);
        acc[m] = _mm512_fmadd_ps(sh, ah, acc[m]);
      }
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(out[m], acc[m]);
  PC_UNROLL for (int m = 0; m < M; ++m) out_off[m] = _mm256_add_ps(out_off[m], off[m]);
}

template <int M>
PC_QUANT void dot_q6_k(const uint8_t* row, int64_t K, const Xs& xs, __m512* out) {
  __m512 acc[M];
  PC_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  // The 64 bf16 of j - 32 (j = 0..63): two tables for vpermi2w.
  const __m512i lut_lo = table(32), lut_hi = table(0);
  const __m512i low4 = _mm512_set1_epi16(0x0F), three = _mm512_set1_epi16(3);
  const __m512i blend_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* p = row + sb * 210;
    for (int line = 0; line < 210; line += 64) ahead(p + line);
    const float d = f16(p + 208);
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)))),
                                    _mm512_set1_ps(d));  // the 16 sub-blocks' scales
    for (int h = 0; h < 2; ++h) {
      const __m512i qa = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h)));
      const __m512i qb = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32)));
      const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h)));
      for (int part = 0; part < 4; ++part) {
        const __m512i src = (part & 1) ? qb : qa;
        const __m512i nib = part < 2 ? _mm512_and_si512(src, low4) : _mm512_srli_epi16(src, 4);
        const __m512i q = _mm512_or_si512(
            nib, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * part), three), 4));
        const __m512bh w = (__m512bh)_mm512_permutex2var_epi16(lut_lo, q, lut_hi);  // bf16(q - 32), q in 0..63
        const int s = 8 * h + 2 * part;  // the first of its two sub-blocks of 16
        const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(blend_idx, _mm512_set1_epi32(s)), sc);
        PC_UNROLL for (int m = 0; m < M; ++m) {
          const __m512 v = _mm512_dpbf16_ps(_mm512_setzero_ps(), w,
                                            (__m512bh)_mm512_loadu_si512(xs.x + m * xs.ld + 256 * sb + 128 * h + 32 * part));
          acc[m] = _mm512_fmadd_ps(v, scale, acc[m]);  // lanes 0-7: sub-block s, 8-15: s + 1
        }
      }
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(out[m], acc[m]);
}

// Whether `type` has a kernel above (bf16 x); the others go through the scratch buffer.
inline bool direct(int type, int64_t K) {
  return K / 32 <= MAX_BLOCKS && format_of(type).weights > 0;
}

// y[m, n] for output rows [n0, n1) of one weight matrix of `type` (rows row_bytes apart), M <= 8 rows of x.
template <int M>
PC_QUANT void direct_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t K, const Xs& xs, const uint16_t* b,
                          int64_t n0, int64_t n1, uint16_t* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    // The next rows' bytes on their way while this one is read (the hardware prefetcher stops at each 4 KB page).

    __m512 acc[M];
    __m256 off[M];
    PC_UNROLL for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_setzero_ps();
      off[m] = _mm256_setzero_ps();
    }
    switch (type) {
      case Q4_0: dot_legacy<M, Q4_0>(row, K, xs, acc); break;
      case Q4_1: dot_legacy<M, Q4_1>(row, K, xs, acc); break;
      case Q5_0: dot_legacy<M, Q5_0>(row, K, xs, acc); break;
      case Q5_1: dot_legacy<M, Q5_1>(row, K, xs, acc); break;
      case Q8_0: dot_q8_0<M>(row, K, xs, acc); break;
      case Q4_K: dot_q4_k<M, false>(row, K, xs, acc, off); break;
      case Q5_K: dot_q4_k<M, true>(row, K, xs, acc, off); break;
      case Q6_K: dot_q6_k<M>(row, K, xs, acc); break;
    }
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const __m256 o = off[m];
      const float offset = _mm512_reduce_add_ps(_mm512_insertf32x8(_mm512_setzero_ps(), o, 0));
      y[m * ldy + n] = f32_to_bf16(_mm512_reduce_add_ps(acc[m]) - offset + (b ? bf16_to_f32(b[n]) : 0.f));
    }
  }
}

// ---- A prefill's decoding: rows to bf16 by table lookups ------------------------------------------------------
//
// A prefill's products decode each matrix to bf16 for oneDNN; decode_row's way (fp32 through memory, then rounded
// with integer ops) cost ~25 ops per 32 weights. Here each block's (or sub-block's) 16 or 32 possible values are
// computed once, scale times value exactly in fp32 and rounded to bf16 by VCVTNE(2)PS2BF16 (to nearest even, as
// torch's conversion and store16 do), and vpermw looks each weight up: ~7 ops per 32. 8- and 6-bit values have too
// many possible values for one table; they are widened through fp32 and rounded the same way. Same values as
// decode_row's, tested alike.

// The table of 32 bf16 entries a * (j - bias) + c for j = 0..31 (16 distinct where the values are 4-bit).
PC_QUANT inline __m512i values(float a, float c, int bias) {
  const __m512 j = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 sixteen = _mm512_set1_ps(16.f), off = _mm512_set1_ps(float(bias));
  const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(j, off), _mm512_set1_ps(a)), _mm512_set1_ps(c));
  const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_add_ps(j, sixteen), off), _mm512_set1_ps(a)),
                                  _mm512_set1_ps(c));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// 16 bytes of nibbles (weights j and j + 16 in byte j) as 32 word indices in weight order.
PC_QUANT inline __m512i nibbles32(const uint8_t* p) {
  const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(0x0F))),
                            _mm256_srli_epi16(q, 4), 1);
}

PC_QUANT inline void put32(uint16_t* out, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Row `row` of `type` decoded into out [K] (bf16), by tables.
PC_QUANT void decode_row_bf16(int type, Format f, const uint8_t* row, int64_t K, uint16_t* out) {
  const int64_t nb = K / f.weights;
  switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      const bool five = type == Q5_0 || type == Q5_1, offset = type == Q4_1 || type == Q5_1;
      const int qh_at = offset ? 4 : 2, at = qh_at + (five ? 4 : 0), bias = offset ? 0 : five ? 16 : 8;
      for (int64_t b = 0; b < nb; ++b, row += f.bytes, out += 32) {
        __m512i idx = nibbles32(row + at);
        if (five) {
          uint32_t h;
          std::memcpy(&h, row + qh_at, 4);
          idx = _mm512_mask_add_epi16(idx, __mmask32(h), idx, _mm512_set1_epi16(16));
        }
        const __m512i t = values(f16(row), offset ? f16(row + 2) : 0.f, bias);
        _mm512_storeu_si512(out, _mm512_permutexvar_epi16(idx, t));
      }
      return;
    }
    case Q8_0:
      for (int64_t b = 0; b < nb; ++b, row += f.bytes, out += 32) {
        const __m512 d = _mm512_set1_ps(f16(row));
        put32(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(row + 2)))), d),
              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(row + 18)))), d));
      }
      return;
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      alignas(32) float a[8], c[8];
      for (int64_t b = 0; b < nb; ++b, row += f.bytes) {
        scales_k4(row, a, c);
        const uint8_t* qs = row + (five ? 48 : 16);
        const __m512i qh = five ? _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)))
                                : _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j, out += 32) {
          const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2))));
          __m512i idx = (j & 1) ? _mm512_srli_epi16(q, 4) : _mm512_and_si512(q, _mm512_set1_epi16(0x0F));
          if (five)
            idx = _mm512_or_si512(idx, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, j),
                                                                          _mm512_set1_epi16(1)), 4));
          _mm512_storeu_si512(out, _mm512_permutexvar_epi16(idx, values(a[j], -c[j], 0)));
        }
      }
      return;
    }
    case Q6_K:
      for (int64_t b = 0; b < nb; ++b, row += f.bytes, out += 256) {
        alignas(64) float w[256];
        block_f32(Q6_K, row, w);  // exact: d * scale * (q - 32) needs no rounding in fp32
        for (int i = 0; i < 256; i += 32) put32(out + i, _mm512_load_ps(w + i), _mm512_load_ps(w + i + 16));
      }
      return;
  }
}

// Xs for M rows of bf16 x: the pairs layout where `pairs`, the sums where `sums`, kept in pbuf and sbuf.
PC_QUANT Xs prepare(int64_t M, int64_t K, const uint16_t* x, int64_t ldx, bool pairs, bool sums,
                    std::vector<uint16_t>& pbuf, std::vector<float>& sbuf) {
  Xs xs{x, nullptr, nullptr, ldx, K, K / 32};
  if (pairs) {
    pbuf.resize(M * K);
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* src = x + m * ldx;
      uint16_t* dst = pbuf.data() + m * K;
      int64_t k = 0;
      for (; k + 64 <= K; k += 64) {  // [0..16), [32..48), [16..32), [48..64)
        std::memcpy(dst + k, src + k, 32);
        std::memcpy(dst + k + 16, src + k + 32, 32);
        std::memcpy(dst + k + 32, src + k + 16, 32);
        std::memcpy(dst + k + 48, src + k + 48, 32);
      }
      std::memcpy(dst + k, src + k, (K - k) * 2);
    }
    xs.pairs = pbuf.data();
  }
  if (sums) {
    sbuf.resize(M * (K / 32));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < K / 32; ++g) {
        __m512 v = _mm512_add_ps(load16(x + m * ldx + 32 * g), load16(x + m * ldx + 32 * g + 16));
        sbuf[m * (K / 32) + g] = _mm512_reduce_add_ps(v);
      }
    xs.sums = sbuf.data();
  }
  return xs;
}

// Output rows per scratch block: as many as fit SCRATCH_BYTES (in L2 while the x rows run over them), a multiple
// of 4 (the microkernels' rows per pass), at least 4.
constexpr int64_t SCRATCH_BYTES = 192 << 10;

template <typename T>
void quant_rows(int64_t M, int64_t K, const T* x, int64_t ldx, int64_t S, const uint8_t* const* w,
                const int64_t* rows_of, const int* types, const T* bias, int threads, T* y, int64_t ldy) {
  int64_t N = 0;
  bool pairs = false, sums = false, direct_any = false;
  for (int64_t s = 0; s < S; ++s) {
    N += rows_of[s];
    pairs |= format_of(types[s]).weights == 32 && types[s] != Q8_0;
    sums |= types[s] == Q4_K || types[s] == Q5_K || types[s] == Q4_1 || types[s] == Q5_1;
    direct_any |= direct(types[s], K);
  }
  // bf16 x in the layouts the direct kernels read, once for every thread
  std::vector<uint16_t> pbuf;
  std::vector<float> sbuf;
  Xs xs{};
  if constexpr (sizeof(T) == 2)
    if (direct_any) xs = prepare(M, K, x, ldx, pairs, sums, pbuf, sbuf);
  const int64_t block = std::max<int64_t>(4, SCRATCH_BYTES / (K * int64_t(sizeof(T))) / 4 * 4);
#pragma omp parallel num_threads(threads) if (N * K >= PARALLEL_WEIGHTS)
  {
    std::vector<T> scratch;
    const int64_t nt = omp_get_num_threads(), per = ((N + nt - 1) / nt + 3) / 4 * 4;
    const int64_t lo = std::min(N, omp_get_thread_num() * per), hi = std::min(N, lo + per);
    int64_t base = 0;
    for (int64_t s = 0; s < S; base += rows_of[s++]) {
      const Format f = format_of(types[s]);
      const int64_t row_bytes = K / f.weights * f.bytes;
      const int64_t a = std::max(lo, base) - base, e = std::min(hi, base + rows_of[s]) - base;
      const T* b = bias ? bias + base : nullptr;
      if (a >= e) continue;
      if constexpr (sizeof(T) == 2) {
        if (direct(types[s], K)) {
          for (int64_t m = 0; m < M; m += 8) {
            Xs xm = xs;
            xm.x += m * xs.ld;
            if (xm.pairs) xm.pairs += m * xs.ld_pairs;
            if (xm.sums) xm.sums += m * xs.ld_sums;
            T* ym = y + m * ldy + base;
            switch (std::min<int64_t>(8, M - m)) {
              case 8: direct_rows<8>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 7: direct_rows<7>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 6: direct_rows<6>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 5: direct_rows<5>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 4: direct_rows<4>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 3: direct_rows<3>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              case 2: direct_rows<2>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy); break;
              default: direct_rows<1>(types[s], w[s], row_bytes, K, xm, b, a, e, ym, ldy);
            }
          }
          continue;
        }
      }
      scratch.resize(block * K);
      for (int64_t c = a; c < e; c += block) {
        const int64_t n = std::min(e, c + block) - c;
        for (int64_t r = 0; r < n; ++r) decode_row(types[s], f, w[s] + (c + r) * row_bytes, K, scratch.data() + r * K);
        for (int64_t m = 0; m < M; m += 8) {
          const T* xm = x + m * ldx;
          T* ym = y + m * ldy + base + c;
          const T* bc = b ? b + c : nullptr;
          switch (std::min<int64_t>(8, M - m)) {
            case 8: span<8>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 7: span<7>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 6: span<6>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 5: span<5>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 4: span<4>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 3: span<3>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            case 2: span<2>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy); break;
            default: span<1>(xm, ldx, scratch.data(), K, bc, 0, n, ym, ldy);
          }
        }
      }
    }
  }
}

bool fits(int type, int64_t K) {
  const Format f = format_of(type);
  return f.weights > 0 && K > 0 && K % f.weights == 0;
}

}  // namespace

extern "C" {

// Weights per block of GGML type `type` (0 where the kernels do not read it), and bytes per block.
int64_t pc_rag_quant_block_weights(int type) { return format_of(type).weights; }
int64_t pc_rag_quant_block_bytes(int type) { return format_of(type).bytes; }

// out [n, K] (rows ldo apart; fp32, or bf16 where bf16) = rows index[0..n) (or 0..n where index is null) of the
// matrix `w` of GGML type `type` (rows row_bytes apart), decoded. Returns 0, or -1 for a type or K it does not take.
int pc_rag_dequant_rows(int type, int64_t K, const void* w, int64_t row_bytes, int64_t n, const int64_t* index,
                        int bf16, int threads, void* out, int64_t ldo) {
  if (!avx512_supported() || !fits(type, K) || row_bytes != K / format_of(type).weights * format_of(type).bytes)
    return -1;
  const Format f = format_of(type);
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const bool tables = avx512_bf16_supported();
#pragma omp parallel for num_threads(threads) if (n * K >= PARALLEL_WEIGHTS) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = base + (index ? index[i] : i) * row_bytes;
    if (bf16 && tables)
      decode_row_bf16(type, f, row, K, static_cast<uint16_t*>(out) + i * ldo);
    else if (bf16)
      decode_row(type, f, row, K, static_cast<uint16_t*>(out) + i * ldo);
    else
      decode_row(type, f, row, K, static_cast<float*>(out) + i * ldo);
  }
  return 0;
}

// y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart, fp32 or bf16) times the S quantized matrices w[s]
// [rows[s], K] of GGML types types[s] (rows contiguous), concatenated, plus bias [N] where not null, in x's dtype.
// Returns 0, or -1 for bf16 on a CPU without AVX512-BF16 or a type or K it does not take.
int pc_rag_quant_rows(int64_t M, int64_t K, const void* x, int64_t ldx, int64_t S, const void* const* w,
                      const int64_t* rows, const int* types, const void* bias, int bf16, int threads, void* y,
                      int64_t ldy) {
  if (!avx512_supported() || (bf16 && !avx512_bf16_supported())) return -1;
  for (int64_t s = 0; s < S; ++s)
    if (!fits(types[s], K)) return -1;
  const auto* ws = reinterpret_cast<const uint8_t* const*>(w);
  if (bf16)
    quant_rows(M, K, static_cast<const uint16_t*>(x), ldx, S, ws, rows, types, static_cast<const uint16_t*>(bias),
               threads, static_cast<uint16_t*>(y), ldy);
  else
    quant_rows(M, K, static_cast<const float*>(x), ldx, S, ws, rows, types, static_cast<const float*>(bias), threads,
               static_cast<float*>(y), ldy);
  return 0;
}

}  // extern "C"
