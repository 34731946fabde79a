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
// which is a cold prefill when nq == nk and a question after a cached prefix otherwise. Or, given `seen`, row i
// sees keys [0, seen[i]]: rows at any slots (text between relocated chunks, blend's recomputed rows), which sdpa
// could only take with a mask, computing every key of every row.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <omp.h>
#include <sys/syscall.h>
#include <type_traits>
#include <unistd.h>

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

// Minimax polynomials for 2^f on [-1/2, 1/2], highest power first: degree 5 (relative error 8e-8, as Cephes' exp:
// fp32's precision) and degree 4 (2.7e-6, well under the bf16 rounding, 2^-9, of the weights the AMX path makes).
constexpr float EXP2_FP32[] = {1.327744403e-3f, 9.6758837914e-3f, 5.5507131e-2f, 2.402211243e-1f, 6.9314696468e-1f,
                               1.0000000734f};
constexpr float EXP2_BF16[] = {9.5711205838e-3f, 5.5920936473e-2f, 2.4024745354e-1f, 6.9312135868e-1f,
                               9.9999924829e-1f};

// 2^t: 2^round(t) by scalef (0 far below the smallest float), times one of the polynomials above for the rest. In
// base 2 the softmax's scale and log2(e) fold into the FMA that subtracts the row max, and the range reduction is
// one subtraction. The exp was where the AMX softmax spent most of its time (Cephes' exp16: 6.3 of 27 ms for a
// bench-model layer of 4K tokens).
template <int N>
PC_AVX512 inline __m512 exp2_16(__m512 t, const float (&c)[N]) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// Online softmax of one row's block of scores s [BN] (unscaled), `live` of them visible, in base 2 (scale2 is the
// scale times log2(e); m is in those units): updates the row's max m and sum l, rescales its output o [D], and
// leaves the weights in s (fp32, or bf16 in pb), 0 past `live`.
template <bool BF16>
PC_AVX512 inline void softmax_row(float* s, int64_t live, float scale2, float& m, float& l, float* o, int64_t D,
                                  uint16_t* pb) {
  const __m512 sc = _mm512_set1_ps(scale2);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < live; j += 16) {
    const __mmask16 k = live - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (live - j)) - 1);
    top = _mm512_mask_max_ps(top, k, top, _mm512_mul_ps(_mm512_loadu_ps(s + j), sc));
  }
  const float mx = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m == mx ? 1.f : m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(m - mx);
  const __m512 M = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < live; j += 16) {
    const __mmask16 k = live - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (live - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, M), EXP2_FP32));
    sum = _mm512_add_ps(sum, e);
    if constexpr (BF16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), to_bf16(e));
    else
      _mm512_storeu_ps(s + j, e);
  }
  for (; j < BN; j += 16) {  // past the visible keys: weights 0
    if constexpr (BF16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), _mm256_setzero_si256());
    else
      _mm512_storeu_ps(s + j, _mm512_setzero_ps());
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


// ---- AMX (Intel since Sapphire Rapids): bf16 products on 16x16 tiles -------------------------------------------
// sdpa's CPU kernel runs its bf16 block products on these tiles too (through oneDNN), and ran a bench-model layer of
// 4K tokens in 42 ms against 142 for the AVX512-BF16 dot products above. The packed keys ([D/2][16][2] panels)
// and values ([pairs][D][2]) are already the tiles' pair layout, so the packing is shared.
#define PC_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")))

// Linux hands out AMX's tile state only to a process that asks for it (oneDNN asks too; asking again is harmless).
bool amx_usable() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// All 8 tiles 16 rows of 64 bytes: an fp32 accumulator [16][16] or a bf16 operand [16][32]. A constant in memory:
// GCC 12 drops the stores to a local config before ldtilecfg, as if it read none of it.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig TILES = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

constexpr int64_t AM = 16;  // query rows per work item: one tile's rows

// Scores S [16, 16 panels] = Q [16, D] . K^T for `panels` (1-4) 16-key panels: accumulators in tiles 0-3, the query
// rows' 32 dims in tile 4, the panels' in tiles 5 and 6 (alternating, so a load overlaps the product before it).
PC_AMX inline void scores_amx(const uint16_t* q, const uint16_t* kp, int64_t D, int panels, float* s) {
  _tile_zero(0);
  if (panels > 1) _tile_zero(1);
  if (panels > 2) _tile_zero(2);
  if (panels > 3) _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, q + c * 32, D * 2);
    const uint16_t* k = kp + c * 512;  // 16 pairs of dims x 16 keys, panels 16 D apart
    _tile_loadd(5, k, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (panels > 1) { _tile_loadd(6, k + 16 * D, 64); _tile_dpbf16ps(1, 4, 6); }
    if (panels > 2) { _tile_loadd(5, k + 32 * D, 64); _tile_dpbf16ps(2, 4, 5); }
    if (panels > 3) { _tile_loadd(6, k + 48 * D, 64); _tile_dpbf16ps(3, 4, 6); }
  }
  _tile_stored(0, s, BN * 4);
  if (panels > 1) _tile_stored(1, s + 16, BN * 4);
  if (panels > 2) _tile_stored(2, s + 32, BN * 4);
  if (panels > 3) _tile_stored(3, s + 48, BN * 4);
}

// The same for D == 64 over `panels` (any count) 16-key panels: the query rows' two 32-dim halves stay in tiles 4
// and 5 for the whole block, two panels at a time accumulate in tiles 0 and 1, their four key tiles in 2, 3, 6, 7
// (no tile loaded again before the product reading it is done).
PC_AMX inline void scores_amx64(const uint16_t* q, const uint16_t* kp, int64_t panels, float* s) {
  _tile_loadd(4, q, 128);
  _tile_loadd(5, q + 32, 128);
  int64_t p = 0;
  for (; p + 2 <= panels; p += 2, kp += 2 * 16 * 64, s += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, kp, 64);
    _tile_loadd(3, kp + 512, 64);
    _tile_loadd(6, kp + 1024, 64);
    _tile_loadd(7, kp + 1536, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(0, 5, 3);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, s, BN * 4);
    _tile_stored(1, s + 16, BN * 4);
  }
  if (p < panels) {
    _tile_zero(0);
    _tile_loadd(2, kp, 64);
    _tile_loadd(3, kp + 512, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(0, 5, 3);
    _tile_stored(0, s, BN * 4);
  }
}

// O [16, D] += P [16, n] . V [n, D]: P's rows bf16 weights (BN apart), V packed [n / 2][D][2], n a multiple of 32.
// 64 dims at a time: their accumulators in tiles 0-3 (O's rows in memory between blocks, where the softmax rescales
// them), 32 keys' weights in tile 4, the values' in tiles 5-7 by turns (weights in two tiles by turns: no faster).
PC_AMX inline void values_amx(const uint16_t* p, const uint16_t* vp, int64_t n, float* o, int64_t D) {
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t tiles = std::min<int64_t>(4, (D - c) / 16);
    _tile_loadd(0, o + c, D * 4);
    if (tiles > 1) _tile_loadd(1, o + c + 16, D * 4);
    if (tiles > 2) _tile_loadd(2, o + c + 32, D * 4);
    if (tiles > 3) _tile_loadd(3, o + c + 48, D * 4);
    for (int64_t j = 0; j < n; j += 32) {
      const uint16_t* v = vp + j * D + 2 * c;  // 16 pairs of keys x 16 dims, pairs 2 D apart
      _tile_loadd(4, p + j, BN * 2);
      _tile_loadd(5, v, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (tiles > 1) { _tile_loadd(6, v + 32, D * 4); _tile_dpbf16ps(1, 4, 6); }
      if (tiles > 2) { _tile_loadd(7, v + 64, D * 4); _tile_dpbf16ps(2, 4, 7); }
      if (tiles > 3) { _tile_loadd(5, v + 96, D * 4); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, o + c, D * 4);
    if (tiles > 1) _tile_stored(1, o + c + 16, D * 4);
    if (tiles > 2) _tile_stored(2, o + c + 32, D * 4);
    if (tiles > 3) _tile_stored(3, o + c + 48, D * 4);
  }
}

// How far above a row's running max a block's scores may be (base-2 units) and still be weighted against it.
constexpr float SLACK = 8.f;

// Online softmax of one row's block of scores s (unscaled), `live` of them visible, in base 2 as softmax_row, the
// weights written as bf16 to pb up to `width` (a multiple of 32; zeros past live); the row's sum kept as 16 lanes
// (l), added up once at the end. A row's max m is set by its first block and raised only when a later block
// has a score more than SLACK above it (weights up to 2^8: fp32 has the room, bf16 the same relative precision),
// so most blocks take one pass over their scores (the weights and their max together) instead of two (the max,
// then the weights) and rescale nothing. scale2 > 0, so the block's largest score is its largest weight's.
PC_AMX inline void softmax_row_amx(const float* s, int64_t live, int64_t width, float scale2, float& m, float* l,
                                   float* o, int64_t D, uint16_t* pb) {
  const __m512 sc = _mm512_set1_ps(scale2);
  if (m == -std::numeric_limits<float>::infinity()) {  // the row's first block: its max first
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 16 <= live; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    if (j < live) top = _mm512_mask_max_ps(top, __mmask16((1u << (live - j)) - 1), top, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(top) * scale2;
  }
  for (;;) {
    const __m512 M = _mm512_set1_ps(m);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    __m512 top0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), top1 = top0;
    int64_t j = 0;
    for (; j + 32 <= live; j += 32) {  // every score visible
      const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, M);
      const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), sc, M);
      top0 = _mm512_max_ps(top0, x0);
      top1 = _mm512_max_ps(top1, x1);
      const __m512 e0 = exp2_16(x0, EXP2_BF16), e1 = exp2_16(x1, EXP2_BF16);
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      _mm512_storeu_si512(pb + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (; j < width; j += 32) {  // the row's last visible scores, then zeros
      const int64_t n = live - j;
      const __mmask16 k0 = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
      const __mmask16 k1 = n >= 32 ? __mmask16(0xFFFF) : n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
      const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, M);
      const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), sc, M);
      top0 = _mm512_mask_max_ps(top0, k0, top0, x0);
      top1 = _mm512_mask_max_ps(top1, k1, top1, x1);
      const __m512 e0 = _mm512_maskz_mov_ps(k0, exp2_16(x0, EXP2_BF16));
      const __m512 e1 = _mm512_maskz_mov_ps(k1, exp2_16(x1, EXP2_BF16));
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      _mm512_storeu_si512(pb + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    const __m512 top = _mm512_max_ps(top0, top1);
    if (!_mm512_cmp_ps_mask(top, _mm512_set1_ps(SLACK), _CMP_GT_OQ)) {
      _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), _mm512_add_ps(sum0, sum1)));
      return;
    }
    // A score far above the running max: raise it to this block's, rescale the sum and output, weigh again.
    const float up = _mm512_reduce_max_ps(top);
    const __m512 a = _mm512_set1_ps(std::exp2(-up));
    _mm512_storeu_ps(l, _mm512_mul_ps(_mm512_loadu_ps(l), a));
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
    m += up;
  }
}

// attend_causal's bf16 path on AMX tiles: work items of 16 query rows of one head, every item of a KV head before
// the next head's (they read the same packed keys and values, which then stay in the core's L2 cache), the rows
// that see the most keys first.
PC_AMX int attend_causal_amx(const uint16_t* q, Rows qr, const uint16_t* k, Rows kr, const uint16_t* v, Rows vr,
                             uint16_t* out, Rows orows, int64_t nq, int64_t nk, int64_t H, int64_t G, int64_t D,
                             float scale, int threads) {
  const int64_t HK = H / G, padded = (nk + BN - 1) / BN * BN, before = nk - nq, blocks = (nq + AM - 1) / AM;
  const float scale2 = scale * 1.44269504088896341f;  // the softmax in base 2
  struct Scratch {
    alignas(64) uint16_t q[AM * MAX_D];
    alignas(64) float s[AM * BN];
    alignas(64) float o[AM * MAX_D];
    alignas(64) uint16_t pb[AM * BN];
    alignas(64) float l[AM * 16];  // each row's sum as 16 lanes
    float m[AM];
  };
  std::unique_ptr<uint16_t[]> kp(new (std::nothrow) uint16_t[HK * padded * D]);
  std::unique_ptr<uint16_t[]> vp(new (std::nothrow) uint16_t[HK * padded * D]);
  std::unique_ptr<Scratch[]> scratch(new (std::nothrow) Scratch[threads]);
  if (!kp || !vp || !scratch) return -2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < HK; ++h) {
      pack_keys<uint16_t>(k + kr.at(h, 0), kr.token, nk, padded, D, kp.get() + h * padded * D);
      pack_values(v + vr.at(h, 0), vr.token, nk, padded, D, vp.get() + h * padded * D);
    }
    _tile_loadconfig(&TILES);
    Scratch& mine = scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < H * blocks; ++item) {
      const int64_t hk = item / (G * blocks), rest = item % (G * blocks);
      const int64_t h = hk * G + rest % G, i0 = (blocks - 1 - rest / G) * AM, rows = std::min(AM, nq - i0);
      for (int64_t r = 0; r < AM; ++r) {
        if (r < rows)
          std::memcpy(mine.q + r * D, q + qr.at(h, i0 + r), D * 2);
        else
          std::memset(mine.q + r * D, 0, D * 2);
      }
      std::fill(mine.o, mine.o + AM * D, 0.f);
      std::fill(mine.m, mine.m + AM, -std::numeric_limits<float>::infinity());
      std::fill(mine.l, mine.l + AM * 16, 0.f);
      std::memset(mine.pb + rows * BN, 0, (AM - rows) * BN * 2);  // rows past the end: weights 0
      const uint16_t* keys = kp.get() + hk * padded * D;
      const uint16_t* values = vp.get() + hk * padded * D;
      const int64_t last = before + i0 + rows - 1;  // the last key any row sees
      for (int64_t j0 = 0; j0 <= last; j0 += BN) {
        const int64_t panels = std::min<int64_t>(BN, last - j0 + 1 + 15) / 16;  // 16-key panels any row sees
        if (D == 64)
          scores_amx64(mine.q, keys + j0 * D, panels, mine.s);
        else
          for (int64_t p = 0; p < panels; p += 4)
            scores_amx(mine.q, keys + (j0 + p * 16) * D, D, int(std::min<int64_t>(4, panels - p)), mine.s + p * 16);
        int64_t widest = 0;
        for (int64_t r = 0; r < rows; ++r) widest = std::max(widest, std::min({BN, nk - j0, before + i0 + r - j0 + 1}));
        const int64_t width = (widest + 31) / 32 * 32;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t live = std::min({BN, nk - j0, before + i0 + r - j0 + 1});
          if (live <= 0)  // this row sees none of the block: weights 0, nothing else changes
            std::memset(mine.pb + r * BN, 0, width * 2);
          else
            softmax_row_amx(mine.s + r * BN, live, width, scale2, mine.m[r], mine.l + r * 16, mine.o + r * D, D,
                            mine.pb + r * BN);
        }
        values_amx(mine.pb, values + j0 * D, width, mine.o, D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(mine.l + r * 16)));
        for (int64_t d = 0; d < D; d += 16)
          store16<uint16_t>(out + orows.at(h, i0 + r) + d, _mm512_mul_ps(_mm512_loadu_ps(mine.o + r * D + d), inv));
      }
    }
    _tile_release();
  }
  return 0;
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
                  int64_t nq, int64_t nk, const int64_t* seen, int64_t H, int64_t G, int64_t D, float scale,
                  int threads) {
  using T = std::conditional_t<MODE == FP32, float, uint16_t>;      // the tensors' elements
  using C = std::conditional_t<MODE == BF16_DOT, uint16_t, float>;  // the packed keys' and query rows'
  constexpr bool DOT = MODE == BF16_DOT;
  const int64_t HK = H / G, padded = (nk + BN - 1) / BN * BN, before = nk - nq, blocks = (nq + BM - 1) / BM;
  const float scale2 = scale * 1.44269504088896341f;  // the softmax in base 2
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
      const auto sees = [&](int64_t i) { return seen ? seen[i] : before + i; };  // row i's last key
      int64_t last = 0;                                                // the last key any row sees
      for (int64_t r = 0; r < rows; ++r) last = std::max(last, sees(i0 + r));
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
          const int64_t live = std::min({BN, nk - j0, sees(i0 + r) - j0 + 1});
          if (live <= 0) {  // this row sees none of the block: weights 0, nothing else changes
            if constexpr (DOT)
              std::memset(pb + r * BN, 0, BN * sizeof(uint16_t));
            else
              std::fill(s + r * BN, s + (r + 1) * BN, 0.f);
            continue;
          }
          widest = std::max(widest, live);
          softmax_row<DOT>(s + r * BN, live, scale2, m[r], l[r], o + r * D, D, pb + r * BN);
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

// Whether bf16 runs on AMX tiles here (Intel since Sapphire Rapids, where Linux grants this process the tiles).
int pc_rag_prefill_amx_supported() {
  static const bool amx = amx_usable();
  return amx;
}

// Causal attention of nq query rows over nk >= nq keys (row i sees keys [0, nk - nq + i], or [0, seen[i]] where
// `seen` is not null: nq values in [0, nk); AMX is not used then, dot products are). q, out: H heads of nq
// rows; k, v: H / G heads of nk rows (query head h uses KV head h / G, HF's repeat_kv); every row D contiguous
// elements, heads and rows at the given element strides. Scores are scaled by `scale`. bf16: 0 for fp32 tensors;
// for bf16 tensors 1 (the fastest this CPU has: AMX tiles where it has them, D % 32 == 0 and scale > 0, else
// AVX512-BF16 dot products, else widened to fp32), 2 (always widened) or 3 (dot products, never AMX): 2 and 3 for
// tests. Returns 0, -1 for shapes or a CPU it does not take, -2 when its scratch memory cannot be allocated.
int pc_rag_prefill_attention(const void* q, int64_t q_head, int64_t q_token, const void* k, int64_t k_head,
                             int64_t k_token, const void* v, int64_t v_head, int64_t v_token, void* out,
                             int64_t o_head, int64_t o_token, int64_t nq, int64_t nk, const int64_t* seen,
                             int64_t H, int64_t G, int64_t D, int bf16, float scale, int threads) {
  if (!avx512_supported() || bf16 < 0 || bf16 > 3) return -1;
  if (D % 16 != 0 || D > MAX_D || nq <= 0 || nk < nq || H <= 0 || G <= 0 || H % G != 0 || threads <= 0) return -1;
  if (seen && std::any_of(seen, seen + nq, [nk](int64_t s) { return s < 0 || s >= nk; })) return -1;
  if (bf16 && (k_head % 2 || k_token % 2)) return -1;  // key rows are read as 32-bit words (pairs of dims)
  const Rows qr{q_head, q_token}, kr{k_head, k_token}, vr{v_head, v_token}, orows{o_head, o_token};
  // The AMX path takes the causal layout only (rows at any slots were never run on AMX hardware: not guessed at).
  if (bf16 == 1 && !seen && pc_rag_prefill_amx_supported() && D % 32 == 0 && scale > 0)
    return attend_causal_amx(static_cast<const uint16_t*>(q), qr, static_cast<const uint16_t*>(k), kr,
                             static_cast<const uint16_t*>(v), vr, static_cast<uint16_t*>(out), orows, nq, nk, H, G, D,
                             scale, threads);
  if ((bf16 == 1 || bf16 == 3) && pc_rag_prefill_bf16_supported())
    return attend_causal<BF16_DOT>(q, qr, k, kr, v, vr, out, orows, nq, nk, seen, H, G, D, scale, threads);
  if (bf16)
    return attend_causal<BF16_WIDENED>(q, qr, k, kr, v, vr, out, orows, nq, nk, seen, H, G, D, scale, threads);
  return attend_causal<FP32>(q, qr, k, kr, v, vr, out, orows, nq, nk, seen, H, G, D, scale, threads);
}

}  // extern "C"
