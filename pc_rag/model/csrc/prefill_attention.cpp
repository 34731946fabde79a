// Causal attention of many query rows (a prefill, or the fresh tokens after a cached prefix) on x86-64 CPUs with
// AVX-512: flash attention (blocks of keys, an online softmax in fp32) over register-blocked products.
// kernels.py compiles it with decode_attention.cpp into one library; attention.attend calls it.
//
// Why not sdpa: its CPU kernel hands every block product to MKL, whose fp32 products ran at 97-114 GFLOP/s on the
// bench machine (AMD, AVX-512) against ~190 for oneDNN's, and it does bf16 at the same rate as fp32. Here the
// products are small fixed tiles held in registers: fp32 with FMAs, bf16 with AVX512-BF16's dot products (two
// products per lane per instruction; the softmax weights are rounded to bf16 for the second product, as sdpa's
// bf16 kernel does). On AVX-512 CPUs without AVX512-BF16, bf16 tensors are widened to fp32 as they are packed.
//
// Query row i (of nq) sits after nk - nq earlier keys and sees keys [0, nk - nq + i]: the lower-right causal mask,
// which is a cold prefill when nq == nk and a question after a cached prefix otherwise.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <omp.h>
#include <type_traits>

#include "simd.h"

namespace {

// Measured (bench model's heads, 4K tokens, fp32 / bf16 ms per layer): 64-key blocks 76 / 46, 128 64 / 40,
// 256 62.5 / 37.5; 24-96 rows per item within 3% of each other at 128 keys.
constexpr int64_t BM = 48;   // query rows per work item (a multiple of both tiles' rows)
constexpr int64_t BN = 256;  // keys per block
constexpr int64_t MAX_D = 256;  // head_dim at most
constexpr int QK_ROWS = 12;  // scores tile: 12 rows x 32 keys = 24 accumulators
constexpr int PV_ROWS = 6;   // output tile: 6 rows x 64 dims = 24 accumulators

// Where row t of head h of a [heads, tokens, D] tensor starts: elements apart, D contiguous.
struct Rows {
  int64_t head, token;
  int64_t at(int64_t h, int64_t t) const { return h * head + t * token; }
};

// Scores S [QK_ROWS, span] = Q [QK_ROWS, D] . K^T over the packed key panels (fp32: [D][16] each), two panels
// (32 keys) at a time; span is a multiple of 32 (the panels are padded with zeros to the block's end).
PC_AVX512 inline void scores_f32(const float* q, const float* kp, int64_t D, float* s, int64_t span) {
  for (int64_t p = 0; p < span; p += 32, kp += 2 * D * 16, s += 32) {
    __m512 acc[QK_ROWS][2];
    for (auto& r : acc) r[0] = r[1] = _mm512_setzero_ps();
    const float* kp1 = kp + D * 16;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 b0 = _mm512_loadu_ps(kp + d * 16), b1 = _mm512_loadu_ps(kp1 + d * 16);
      for (int r = 0; r < QK_ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(q[r * D + d]);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < QK_ROWS; ++r) {
      _mm512_storeu_ps(s + r * BN, acc[r][0]);
      _mm512_storeu_ps(s + r * BN + 16, acc[r][1]);
    }
  }
}

// The same in bf16: Q rows as bf16 pairs, key panels [D/2][16][2] (dims d, d+1 of a key side by side).
PC_AVX512_BF16 inline void scores_bf16(const uint16_t* q, const uint16_t* kp, int64_t D, float* s, int64_t span) {
  for (int64_t p = 0; p < span; p += 32, kp += 2 * D * 16, s += 32) {
    __m512 acc[QK_ROWS][2];
    for (auto& r : acc) r[0] = r[1] = _mm512_setzero_ps();
    const uint16_t* kp1 = kp + D * 16;
    for (int64_t d = 0; d < D; d += 2) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kp + d * 16);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(kp1 + d * 16);
      for (int r = 0; r < QK_ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, q + r * D + d, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
    for (int r = 0; r < QK_ROWS; ++r) {
      _mm512_storeu_ps(s + r * BN, acc[r][0]);
      _mm512_storeu_ps(s + r * BN + 16, acc[r][1]);
    }
  }
}

// O [PV_ROWS, 16 VN] += P [PV_ROWS, n] . V [n, 16 VN] (fp32; V rows `vt` elements apart, O rows D apart).
template <int VN>
PC_AVX512 inline void values_f32(const float* p, const float* v, int64_t vt, int64_t n, float* o, int64_t D) {
  __m512 acc[PV_ROWS][VN];
  for (int r = 0; r < PV_ROWS; ++r)
    for (int c = 0; c < VN; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 b[VN];
    for (int c = 0; c < VN; ++c) b[c] = _mm512_loadu_ps(v + j * vt + 16 * c);
    for (int r = 0; r < PV_ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(p[r * BN + j]);
      for (int c = 0; c < VN; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < PV_ROWS; ++r)
    for (int c = 0; c < VN; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// The same in bf16: P rows as bf16 pairs of keys, V packed [n / 2][D][2] (keys j, j + 1 side by side per dim).
template <int VN>
PC_AVX512_BF16 inline void values_bf16(const uint16_t* p, const uint16_t* vp, int64_t pairs, float* o, int64_t D) {
  __m512 acc[PV_ROWS][VN];
  for (int r = 0; r < PV_ROWS; ++r)
    for (int c = 0; c < VN; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh b[VN];
    for (int c = 0; c < VN; ++c) b[c] = (__m512bh)_mm512_loadu_si512(vp + j * 2 * D + 32 * c);
    for (int r = 0; r < PV_ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * BN + 2 * j, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < VN; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < PV_ROWS; ++r)
    for (int c = 0; c < VN; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// One tile row of O over all of D, 64 dims at a time (D is a multiple of 16).
template <bool BF16>
inline void values_tile(const void* p, const void* v, int64_t vt, int64_t n, float* o, int64_t D) {
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t left = std::min<int64_t>(64, D - c) / 16;
    if constexpr (BF16) {
      const uint16_t* pb = static_cast<const uint16_t*>(p);
      const uint16_t* vb = static_cast<const uint16_t*>(v) + 2 * c;
      const int64_t pairs = (n + 1) / 2;
      switch (left) {
        case 4: values_bf16<4>(pb, vb, pairs, o + c, D); break;
        case 3: values_bf16<3>(pb, vb, pairs, o + c, D); break;
        case 2: values_bf16<2>(pb, vb, pairs, o + c, D); break;
        default: values_bf16<1>(pb, vb, pairs, o + c, D);
      }
    } else {
      const float* pf = static_cast<const float*>(p);
      const float* vf = static_cast<const float*>(v) + c;
      switch (left) {
        case 4: values_f32<4>(pf, vf, vt, n, o + c, D); break;
        case 3: values_f32<3>(pf, vf, vt, n, o + c, D); break;
        case 2: values_f32<2>(pf, vf, vt, n, o + c, D); break;
        default: values_f32<1>(pf, vf, vt, n, o + c, D);
      }
    }
  }
}

// 16 fp32 to bf16, rounded to nearest even (as torch rounds; the weights are finite), with AVX-512F only, so the
// softmax runs on CPUs without AVX512-BF16 too.
PC_AVX512 inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Online softmax of one row's block of scores s [BN] (unscaled), `live` of them visible: updates the row's max m
// and exp-sum l, rescales its output o [D], and leaves the weights in s (fp32, or bf16 in pb), 0 past `live`.
template <bool BF16>
PC_AVX512 inline void softmax_row(float* s, int64_t live, float scale, float& m, float& l, float* o, int64_t D,
                                  uint16_t* pb) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < live; j += 16) {
    const __mmask16 k = live - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (live - j)) - 1);
    top = _mm512_mask_max_ps(top, k, top, _mm512_mul_ps(_mm512_loadu_ps(s + j), sc));
  }
  const float mx = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - mx);
  const __m512 M = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < BN; j += 16) {
    const int64_t n = live - j;
    const __mmask16 k = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, M)));
    sum = _mm512_add_ps(sum, e);
    if constexpr (BF16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), to_bf16(e));
    else
      _mm512_storeu_ps(s + j, e);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mx;
  if (alpha != 1.f) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
  }
}

// 16 rows of 16 32-bit words (rows `stride` words apart) transposed into dst [16][16].
PC_AVX512 inline void transpose16(const uint32_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved: words 2 apart
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then pairs of pairs: 4 rows per 128-bit lane
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + j] holds word (4 lane + j) of rows 4b..4b+3 in lane `lane`; gather the lanes across the 4 groups.
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(a, c, 0x88);       // lane 0
    t[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);   // lane 2
    t[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);   // lane 1
    t[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);  // lane 3
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, t[i]);
}

// Keys of one KV head packed for the score tiles, padded with zeros to `padded` keys: panels of 16 keys, each
// [D][16] fp32 or [D/2][16] pairs of bf16 (32-bit words either way: `words` per key row).
template <typename T>
PC_AVX512 void pack_keys(const T* k, int64_t kt, int64_t nk, int64_t padded, int64_t D, T* out) {
  const int64_t words = D * sizeof(T) / 4, stride = kt * sizeof(T) / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(k);
  for (int64_t p = 0; p < padded / 16; ++p) {
    uint32_t* panel = reinterpret_cast<uint32_t*>(out) + p * words * 16;
    int64_t w = 0;
    if (p * 16 + 16 <= nk)  // a full panel: 16x16 transposes
      for (; w + 16 <= words; w += 16) transpose16(src + p * 16 * stride + w, stride, panel + w * 16);
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t key = p * 16 + t;
      for (int64_t x = w; x < words; ++x) panel[x * 16 + t] = key < nk ? src[key * stride + x] : 0;
    }
  }
}

// bf16 values of one KV head as pairs of keys [padded / 2][D][2], zeros past nk.
PC_AVX512 void pack_values(const uint16_t* v, int64_t vt, int64_t nk, int64_t padded, int64_t D, uint16_t* out) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t t = 0; t < padded; t += 2) {
    uint16_t* dst = out + t * D;
    int64_t d = 0;
    if (t + 2 <= nk) {  // both keys there: interleave 32 dims at a time
      const uint16_t *a = v + t * vt, *b = a + vt;
      for (; d + 32 <= D; d += 32) {
        const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
    for (; d < D; ++d) {
      dst[2 * d] = t < nk ? v[t * vt + d] : 0;
      dst[2 * d + 1] = t + 1 < nk ? v[(t + 1) * vt + d] : 0;
    }
  }
}

// What a call computes in: fp32 throughout; bf16 tensors with AVX512-BF16 dot products; or bf16 tensors widened
// to fp32 as they are packed (AVX-512 CPUs without AVX512-BF16: Skylake-SP to Ice Lake).
enum Mode { FP32 = 0, BF16_DOT = 1, BF16_WIDENED = 2 };

// bf16 rows widened into fp32: keys as [D][16] panels (through a 16-row scratch, then 16x16 transposes), padded
// with zeros to `padded` keys.
PC_AVX512 void pack_keys_widened(const uint16_t* k, int64_t kt, int64_t nk, int64_t padded, int64_t D, float* out) {
  alignas(64) float rows[16 * MAX_D];
  for (int64_t p = 0; p < padded / 16; ++p) {
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t key = p * 16 + t;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(rows + t * D + d, key < nk ? load16<uint16_t>(k + key * kt + d) : _mm512_setzero_ps());
    }
    for (int64_t w = 0; w < D; w += 16)
      transpose16(reinterpret_cast<const uint32_t*>(rows) + w, D, reinterpret_cast<uint32_t*>(out) + (p * D + w) * 16);
  }
}

// bf16 value rows widened into fp32 rows [padded][D], zeros past nk.
PC_AVX512 void widen_values(const uint16_t* v, int64_t vt, int64_t nk, int64_t padded, int64_t D, float* out) {
  for (int64_t t = 0; t < padded; ++t)
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + t * D + d, t < nk ? load16<uint16_t>(v + t * vt + d) : _mm512_setzero_ps());
}

template <int MODE>
int attend_causal(const void* q, Rows qr, const void* k, Rows kr, const void* v, Rows vr, void* out, Rows orows,
                  int64_t nq, int64_t nk, int64_t H, int64_t G, int64_t D, float scale, int threads) {
  using T = std::conditional_t<MODE == FP32, float, uint16_t>;      // the tensors' elements
  using C = std::conditional_t<MODE == BF16_DOT, uint16_t, float>;  // the packed keys' and query rows'
  constexpr bool DOT = MODE == BF16_DOT;
  const int64_t HK = H / G, padded = (nk + BN - 1) / BN * BN, before = nk - nq, blocks = (nq + BM - 1) / BM;
  // Every allocation up front and without exceptions (one thrown inside an OpenMP region ends the process): the
  // packed keys (and bf16 values), then each thread's tiles. Out of memory returns -2.
  struct Scratch {  // one thread's: its query rows, scores, output rows, row maxima and sums, bf16 weights
    C q[BM * MAX_D];
    float s[BM * BN], o[BM * MAX_D], m[BM], l[BM];
    uint16_t pb[BM * BN];
  };
  using VP = std::conditional_t<DOT, uint16_t, float>;  // packed values: bf16 pairs, or widened rows
  std::unique_ptr<C[]> kp(new (std::nothrow) C[HK * padded * D]);
  std::unique_ptr<VP[]> vp(MODE != FP32 ? new (std::nothrow) VP[HK * padded * D] : nullptr);
  std::unique_ptr<Scratch[]> scratch(new (std::nothrow) Scratch[threads]);
  if (!kp || (MODE != FP32 && !vp) || !scratch) return -2;
  const T* qt = static_cast<const T*>(q);
  const T* ktens = static_cast<const T*>(k);
  const T* vtens = static_cast<const T*>(v);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < HK; ++h) {
      C* keys = kp.get() + h * padded * D;
      if constexpr (MODE == BF16_WIDENED) {
        pack_keys_widened(ktens + kr.at(h, 0), kr.token, nk, padded, D, keys);
        widen_values(vtens + vr.at(h, 0), vr.token, nk, padded, D, vp.get() + h * padded * D);
      } else {
        pack_keys<T>(ktens + kr.at(h, 0), kr.token, nk, padded, D, keys);
        if constexpr (DOT) pack_values(vtens + vr.at(h, 0), vr.token, nk, padded, D, vp.get() + h * padded * D);
      }
    }
    Scratch& mine = scratch[omp_get_thread_num()];
    C* const qbuf = mine.q;
    float *const s = mine.s, *const o = mine.o, *const m = mine.m, *const l = mine.l;
    uint16_t* const pb = mine.pb;
    // The longest rows first (the last query blocks see the most keys), so the threads finish together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < H * blocks; ++item) {
      const int64_t h = item % H, i0 = (blocks - 1 - item / H) * BM, rows = std::min(BM, nq - i0), hk = h / G;
      for (int64_t r = 0; r < BM; ++r) {
        if (r >= rows)
          std::memset(qbuf + r * D, 0, D * sizeof(C));
        else if constexpr (MODE == BF16_WIDENED)
          for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = bf16_to_f32(qt[qr.at(h, i0 + r) + d]);
        else
          std::memcpy(qbuf + r * D, qt + qr.at(h, i0 + r), D * sizeof(C));
      }
      std::fill(o, o + BM * D, 0.f);
      std::fill(m, m + BM, -std::numeric_limits<float>::infinity());
      std::fill(l, l + BM, 0.f);
      std::memset(pb, 0, BM * BN * sizeof(uint16_t));
      std::fill(s, s + BM * BN, 0.f);
      const int64_t tiles = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;  // rows computed, padding included
      const int64_t last = before + i0 + rows - 1;                     // the last key any row sees
      for (int64_t j0 = 0; j0 <= last; j0 += BN) {
        const C* kblock = kp.get() + hk * padded * D + j0 * D;
        const int64_t span = std::min(BN, (last - j0 + 32) / 32 * 32);  // the keys any row sees, in 32s
        for (int64_t r = 0; r < tiles; r += QK_ROWS) {
          if constexpr (DOT)
            scores_bf16(qbuf + r * D, kblock, D, s + r * BN, span);
          else
            scores_f32(qbuf + r * D, kblock, D, s + r * BN, span);
        }
        int64_t widest = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t live = std::min({BN, nk - j0, before + i0 + r - j0 + 1});
          if (live <= 0) {  // this row sees none of the block: weights 0, nothing else changes
            if constexpr (DOT)
              std::memset(pb + r * BN, 0, BN * sizeof(uint16_t));
            else
              std::fill(s + r * BN, s + (r + 1) * BN, 0.f);
            continue;
          }
          widest = std::max(widest, live);
          softmax_row<DOT>(s + r * BN, live, scale, m[r], l[r], o + r * D, D, pb + r * BN);
        }
        for (int64_t r = 0; r < rows; r += PV_ROWS) {
          if constexpr (DOT)
            values_tile<true>(pb + r * BN, vp.get() + hk * padded * D + j0 * D, 0, widest, o + r * D, D);
          else if constexpr (MODE == BF16_WIDENED)
            values_tile<false>(s + r * BN, vp.get() + hk * padded * D + j0 * D, D, widest, o + r * D, D);
          else
            values_tile<false>(s + r * BN, vtens + vr.at(hk, j0), vr.token, widest, o + r * D, D);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        T* dst = static_cast<T*>(out) + orows.at(h, i0 + r);
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (MODE == FP32)
            dst[d] = o[r * D + d] * inv;
          else
            dst[d] = f32_to_bf16(o[r * D + d] * inv);
        }
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Whether this CPU has AVX512-BF16's dot products (the bf16 path's fast mode; without them bf16 is widened).
int pc_rag_prefill_bf16_supported() { return avx512_bf16_supported(); }

// Causal attention of nq query rows over nk >= nq keys (row i sees keys [0, nk - nq + i]). q, out: H heads of nq
// rows; k, v: H / G heads of nk rows (query head h uses KV head h / G, HF's repeat_kv); every row D contiguous
// elements, heads and rows at the given element strides. Scores are scaled by `scale`. bf16: 0 for fp32 tensors;
// 1 for bf16 (AVX512-BF16 dot products where the CPU has them, else widened to fp32); 2 for bf16 always widened
// (tests). Returns 0, -1 for shapes or a CPU it does not take, -2 when its scratch memory cannot be allocated.
int pc_rag_prefill_attention(const void* q, int64_t q_head, int64_t q_token, const void* k, int64_t k_head,
                             int64_t k_token, const void* v, int64_t v_head, int64_t v_token, void* out,
                             int64_t o_head, int64_t o_token, int64_t nq, int64_t nk, int64_t H, int64_t G, int64_t D,
                             int bf16, float scale, int threads) {
  if (!avx512_supported() || bf16 < 0 || bf16 > 2) return -1;
  if (D % 16 != 0 || D > MAX_D || nq <= 0 || nk < nq || H <= 0 || G <= 0 || H % G != 0 || threads <= 0) return -1;
  if (bf16 && (k_head % 2 || k_token % 2)) return -1;  // key rows are read as 32-bit words (pairs of dims)
  const Rows qr{q_head, q_token}, kr{k_head, k_token}, vr{v_head, v_token}, orows{o_head, o_token};
  if (bf16 == 1 && pc_rag_prefill_bf16_supported())
    return attend_causal<BF16_DOT>(q, qr, k, kr, v, vr, out, orows, nq, nk, H, G, D, scale, threads);
  if (bf16)
    return attend_causal<BF16_WIDENED>(q, qr, k, kr, v, vr, out, orows, nq, nk, H, G, D, scale, threads);
  return attend_causal<FP32>(q, qr, k, kr, v, vr, out, orows, nq, nk, H, G, D, scale, threads);
}

}  // extern "C"
