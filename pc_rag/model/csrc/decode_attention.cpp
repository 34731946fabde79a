// Decode attention on x86-64 CPUs with AVX-512: one query token per KV head group over a request's cached keys and
// values, read once at the machine's memory rate (kernels.py compiles this file with g++ and calls it through
// ctypes; attention.attend_decode uses it).
//
// Why not sdpa: its CPU kernel runs a decode step as tiny matrix products (2 query rows against blocks of 512
// keys) and read the KV at ~9-16 GB/s in fp32 and ~7 GB/s in bf16 on the bench machine, against 23 GB/s for a
// plain read of the same slices. Here each key row is loaded once for every query row of its group, scores and
// softmax stay in fp32, and the keys are split into chunks merged by their log-sum-exp (flash attention's rule)
// so that both a short prompt and a model with few KV heads keep every thread busy.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

// A request's prefix shared read-only with other requests (model/cache.py's SharedPrefix): n rows of every layer's
// keys and values, H heads each, as pc_rag_decode_step's caches are strided (elements). decode_layers.cpp repeats it.
struct PcBase {
  const void* keys;
  const void* values;
  int64_t k_layer, v_layer, k_head, v_head, n;
};

namespace {

constexpr int64_t KB = 16;  // keys per block of scores
constexpr int PV_ROWS = 6;  // output tile: up to 6 query rows x 4 vectors (64 dims) = 24 accumulators
constexpr int64_t PF_BYTES = 8192;  // how far ahead to prefetch the KV rows (from memory in a real step, not cache)

// Ask for the cache lines of `bytes` bytes at p (no fault past the buffer's end: prefetches never fault).
inline void prefetch_rows(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
}

// 16 vectors' lane sums as one vector, lane t = sum of a[t]: pairs, quads and 128-bit blocks added in a tree
// (45 shuffles and adds for 16 sums, where 16 separate reductions cost ~8 each).
PC_AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512* x = a + 4 * i;
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
    // each 128-bit block b: the sums of keys 4i..4i+3 over that block's 4 lanes
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// out rows [GB, 16 * VB] += the scores' rows s (ld apart) times the values' dims [d0, d0 + 16 * VB) over n keys:
// each value vector loaded (and widened) once for GB query rows.
template <typename T, int GB, int VB>
PC_AVX512 void weigh_values(const float* s, int64_t ld, const T* v, int64_t n, int64_t D, int64_t d0, float* acc) {
  __m512 a[GB][VB];
  for (auto& r : a)
    for (auto& x : r) x = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    if (d0 == 0) prefetch_rows(reinterpret_cast<const char*>(v + (t + 1) * D) + PF_BYTES, D * int64_t(sizeof(T)));
    __m512 vt[VB];
    for (int j = 0; j < VB; ++j) vt[j] = load16<T>(v + t * D + d0 + 16 * j);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * ld + t]);
      for (int j = 0; j < VB; ++j) a[g][j] = _mm512_fmadd_ps(p, vt[j], a[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < VB; ++j) _mm512_storeu_ps(acc + g * D + d0 + 16 * j, a[g][j]);
}

template <typename T, int GB>
PC_AVX512 void weigh_values_rows(const float* s, int64_t ld, const T* v, int64_t n, int64_t D, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weigh_values<T, GB, 4>(s, ld, v, n, D, d0, acc);
  switch ((D - d0) / 16) {
    case 3: weigh_values<T, GB, 3>(s, ld, v, n, D, d0, acc); break;
    case 2: weigh_values<T, GB, 2>(s, ld, v, n, D, d0, acc); break;
    case 1: weigh_values<T, GB, 1>(s, ld, v, n, D, d0, acc); break;
    default: break;
  }
}

// Whether bf16 scores are taken by AVX512-BF16 dot products (`block_scores_bf16`): checked once.
bool dot_bf16() {
  static const bool yes = avx512_bf16_supported();
  return yes;
}

// The scores of the G query rows q [G, D] (bf16, unscaled; D % 32 == 0) against a block of KB bf16 key rows k
// [KB, D] (zeros past the chunk's end), times scale, into s[g * ld] for each row g: two keys' dims per lane
// (VDPBF16PS: exact products, fp32 sums), so the keys are read as they are stored, not widened to fp32 first.
// Measured alone (2026-12-03, Xeon with AMX, bf16, keys in cache), against the widening and fp32 FMAs: 352 against
// 405 us for 7 query heads per KV head over 4K keys, 376 against 424 for 8 requests of 600 keys, 2 heads each.
PC_AVX512_BF16 void block_scores_bf16(const uint16_t* q, const uint16_t* k, int64_t G, int64_t D, float scale,
                                      float* s, int64_t ld) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512 a[KB];
    for (int64_t t = 0; t < KB; ++t) a[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 32) {
      const __m512bh qj = (__m512bh)_mm512_loadu_si512(q + g * D + j);
      for (int64_t t = 0; t < KB; ++t) a[t] = _mm512_dpbf16_ps(a[t], qj, (__m512bh)_mm512_loadu_si512(k + t * D + j));
    }
    _mm512_storeu_ps(s + g * ld, _mm512_mul_ps(reduce16(a), sc));
  }
}

// The G query rows q [G, D] (fp32, already scaled) over n key/value rows k, v [n, D] of one KV head: the chunk's
// score max m [G], exp-sum l [G] and unnormalised output acc [G, D]. s: room for G * ld scores, ld = n rounded up
// to 16; kb: room for 16 * D floats. qr: the same query rows unscaled in bf16 (null for fp32), which the scores are
// taken from where `block_scores_bf16` runs.
template <typename T>
PC_AVX512 void attend_chunk(const float* q, const T* qr, float scale, const T* k, const T* v, int64_t n, int64_t G,
                            int64_t D, float* s, float* kb, float* m, float* l, float* acc) {
  const int64_t V = D / 16, ld = (n + KB - 1) / KB * KB;
  const bool dot = std::is_same<T, uint16_t>::value && qr != nullptr && D % 32 == 0 && dot_bf16();
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t nb = std::min(KB, n - t0);
    if (dot) {
      const uint16_t* keys = reinterpret_cast<const uint16_t*>(k + t0 * D);
      if (nb < KB) {  // the chunk's last keys, padded with zeros
        uint16_t* pad = reinterpret_cast<uint16_t*>(kb);
        std::memset(pad, 0, KB * D * sizeof(uint16_t));
        std::memcpy(pad, keys, nb * D * sizeof(uint16_t));
        keys = pad;
      }
      prefetch_rows(reinterpret_cast<const char*>(k + (t0 + KB) * D) + PF_BYTES, KB * D * int64_t(sizeof(T)));
      block_scores_bf16(reinterpret_cast<const uint16_t*>(qr), keys, G, D, scale, s + t0, ld);
      continue;
    }
    // The block's keys in fp32 (zeros past the chunk's end), read from L1 by every query row of the group.
    const float* keys = kb;
    if (std::is_same<T, float>::value && nb == KB) {
      keys = reinterpret_cast<const float*>(k + t0 * D);
    } else {
      for (int64_t t = 0; t < KB; ++t)
        for (int64_t j = 0; j < V; ++j)
          _mm512_storeu_ps(kb + t * D + 16 * j, t < nb ? load16<T>(k + (t0 + t) * D + 16 * j) : _mm512_setzero_ps());
    }
    prefetch_rows(reinterpret_cast<const char*>(k + (t0 + KB) * D) + PF_BYTES, KB * D * int64_t(sizeof(T)));
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 a[KB];
      for (int64_t t = 0; t < KB; ++t) a[t] = _mm512_setzero_ps();
      for (int64_t j = 0; j < V; ++j) {
        const __m512 qj = _mm512_loadu_ps(qg + 16 * j);
        for (int64_t t = 0; t < KB; ++t) a[t] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(keys + t * D + 16 * j), a[t]);
      }
      _mm512_storeu_ps(s + g * ld + t0, reduce16(a));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ld;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sg + t));
    float M = _mm512_reduce_max_ps(top);
    for (; t < n; ++t) M = std::max(M, sg[t]);
    const __m512 Mv = _mm512_set1_ps(M);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), Mv)));
      _mm512_mask_storeu_ps(sg + t, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    m[g] = M;
    l[g] = _mm512_reduce_add_ps(sum);
  }
  // The rows in blocks of at most PV_ROWS, as even as they split (7 rows: 4 + 3), so each value row is read
  // ceil(G / PV_ROWS) times.
  const int64_t blocks = (G + PV_ROWS - 1) / PV_ROWS;
  for (int64_t b = 0, g0 = 0; b < blocks; ++b) {
    const int64_t rows = (G - g0) / (blocks - b);
    const float* sb = s + g0 * ld;
    float* ab = acc + g0 * D;
    switch (rows) {
      case 1: weigh_values_rows<T, 1>(sb, ld, v, n, D, ab); break;
      case 2: weigh_values_rows<T, 2>(sb, ld, v, n, D, ab); break;
      case 3: weigh_values_rows<T, 3>(sb, ld, v, n, D, ab); break;
      case 4: weigh_values_rows<T, 4>(sb, ld, v, n, D, ab); break;
      case 5: weigh_values_rows<T, 5>(sb, ld, v, n, D, ab); break;
      default: weigh_values_rows<T, 6>(sb, ld, v, n, D, ab); break;
    }
    g0 += rows;
  }
}

// Every segment's keys in chunks of `rows`: work item i belongs to segment s where first[s] <= i < first[s + 1],
// head and chunk in segment order; each item's max, exp-sum and partial output go to ml, acc at index i. Segment s
// is read by the query rows of request owner[s] (owner null: request s).
template <typename T>
void attend_all(int64_t S, const int64_t* owner, const float* q, const T* qr, float scale, const void* const* keys,
                const void* const* values, const int64_t* n, const int64_t* k_head, const int64_t* v_head, int64_t H,
                int64_t G, int64_t D, int64_t rows, int threads, const int64_t* first, float* ml, float* acc) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(G * ((rows + KB - 1) / KB * KB)), kb(KB * D), m(G), l(G);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < first[S]; ++i) {
      const int64_t g_ = std::upper_bound(first, first + S + 1, i) - first - 1;
      const int64_t r = owner ? owner[g_] : g_;
      const int64_t C = (n[g_] + rows - 1) / rows, j = i - first[g_];
      const int64_t h = j / C, t0 = (j % C) * rows, len = std::min(rows, n[g_] - t0);
      attend_chunk<T>(q + (r * H + h) * G * D, qr ? qr + (r * H + h) * G * D : nullptr, scale,
                      static_cast<const T*>(keys[g_]) + h * k_head[g_] + t0 * D,
                      static_cast<const T*>(values[g_]) + h * v_head[g_] + t0 * D, len, G, D, s.data(), kb.data(),
                      m.data(), l.data(), acc + i * G * D);
      for (int64_t g = 0; g < G; ++g) {
        ml[(i * G + g) * 2] = m[g];
        ml[(i * G + g) * 2 + 1] = l[g];
      }
    }
  }
}

// Attention for B requests from their scaled fp32 queries qs [B, H, G, D] (and in bf16 the same unscaled, qr, which
// the scores are taken from where AVX512-BF16 runs) over S segments of keys: segment s's keys[s] / values[s] (H
// heads of n[s] rows, heads k_head[s] / v_head[s] elements apart) are read by request owner[s] (owner null: S == B,
// segment r is request r's). A request's segments (a prefix shared read-only with other requests, then its own
// slots) are merged as its chunks are. Into out [B, H, G, D] in the keys' dtype.
void attend(int64_t B, int64_t S, const int64_t* owner, const float* qs, const uint16_t* qr, float scale,
            const void* const* keys, const void* const* values, const int64_t* n, const int64_t* k_head,
            const int64_t* v_head, int64_t H, int64_t G, int64_t D, int bf16, int64_t rows, int threads, void* out) {
  std::vector<int64_t> first(S + 1, 0);
  for (int64_t g = 0; g < S; ++g) first[g + 1] = first[g] + H * ((n[g] + rows - 1) / rows);
  std::vector<float> ml(first[S] * G * 2), acc(first[S] * G * D), o(D);
  if (bf16)
    attend_all<uint16_t>(S, owner, qs, qr, scale, keys, values, n, k_head, v_head, H, G, D, rows, threads,
                         first.data(), ml.data(), acc.data());
  else
    attend_all<float>(S, owner, qs, nullptr, scale, keys, values, n, k_head, v_head, H, G, D, rows, threads,
                      first.data(), ml.data(), acc.data());
  // Merge each query row's chunks over its segments: weights exp(m_c - max m), normalised by the weighted exp-sums.
  std::vector<std::vector<int64_t>> mine(B);
  for (int64_t g = 0; g < S; ++g) mine[owner ? owner[g] : g].push_back(g);
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        float M = -std::numeric_limits<float>::infinity();
        for (const int64_t sg : mine[r]) {
          const int64_t C = (n[sg] + rows - 1) / rows;
          for (int64_t c = 0; c < C; ++c) M = std::max(M, ml[((first[sg] + h * C + c) * G + g) * 2]);
        }
        float L = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (const int64_t sg : mine[r]) {
          const int64_t C = (n[sg] + rows - 1) / rows;
          for (int64_t c = 0; c < C; ++c) {
            const int64_t j = (first[sg] + h * C + c) * G + g;
            const float w = std::exp(ml[j * 2] - M);
            L += w * ml[j * 2 + 1];
            for (int64_t d = 0; d < D; ++d) o[d] += w * acc[j * D + d];
          }
        }
        const int64_t at = ((r * H + h) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          if (bf16)
            static_cast<uint16_t*>(out)[at + d] = f32_to_bf16(o[d] / L);
          else
            static_cast<float*>(out)[at + d] = o[d] / L;
        }
      }
    }
  }
}

// Keys per work item: small enough that every thread gets about four items, 64-512 rows.
int64_t rows_per_item(int64_t B, const int64_t* n, int64_t H, int threads) {
  int64_t total = 0;
  for (int64_t r = 0; r < B; ++r) total += n[r];
  return std::min<int64_t>(512, std::max<int64_t>(64, (total * H + 4 * threads - 1) / (4 * threads)));
}

// One layer of a decode step, for B requests, from the projections: q [B, H * G * D], k and v [B, H * D] (rows
// q_row, k_row, v_row elements apart; the three column ranges of one fused product, or three products). Each
// head's RMSNorm where q_norm / k_norm [D] are given (Qwen3), RoPE on the queries and the new keys (cos, sin [B, D],
// rows cs_row apart), the new key and value written to slot[r] of request r's cache (H heads of rows at k_cache[r]
// + layer * k_layer[r] for the keys, heads k_head[r] elements apart; the values alike), then attention over the
// slots [lo, slot[r]] (lo: 0, or the last `window` slots when window > 0), after the request's shared prefix where
// bases (null: none) gives it one (bases[r].n > 0 rows, read in place; not with a window).
template <typename T>
int decode_step(int64_t B, const T* q, int64_t q_row, const T* k, int64_t k_row, const T* v, int64_t v_row,
                const T* cos, const T* sin, int64_t cs_row, const T* q_norm, const T* k_norm, float eps,
                void* const* k_cache, void* const* v_cache, const int64_t* k_layer, const int64_t* v_layer,
                int64_t layer, const int64_t* k_head, const int64_t* v_head, const int64_t* slot, int64_t window,
                const PcBase* bases, int64_t H, int64_t G, int64_t D, float scale, int threads, void* out) {
  const int64_t HQ = H * G;
  std::vector<float> qs(B * HQ * D);
  std::vector<T> qr(B * HQ * D), normed(D);
  std::vector<const void*> keys, values;
  std::vector<int64_t> n, kh, vh, owner;
  for (int64_t r = 0; r < B; ++r) {
    const T *c = cos + r * cs_row, *s = sin + r * cs_row;
    for (int64_t h = 0; h < HQ; ++h) {
      const T* x = q + r * q_row + h * D;
      if (q_norm) x = rms_norm_row(x, q_norm, D, eps, normed.data());
      rotate(x, c, s, D, qr.data() + (r * HQ + h) * D, qs.data() + (r * HQ + h) * D, scale);
    }
    T* kc = static_cast<T*>(k_cache[r]) + layer * k_layer[r];
    T* vc = static_cast<T*>(v_cache[r]) + layer * v_layer[r];
    for (int64_t h = 0; h < H; ++h) {
      const T* x = k + r * k_row + h * D;
      if (k_norm) x = rms_norm_row(x, k_norm, D, eps, normed.data());
      rotate<T>(x, c, s, D, kc + h * k_head[r] + slot[r] * D, nullptr, 0.f);
      std::memcpy(vc + h * v_head[r] + slot[r] * D, v + r * v_row + h * D, D * sizeof(T));
    }
    if (bases && bases[r].n > 0) {
      const PcBase& b = bases[r];
      keys.push_back(static_cast<const T*>(b.keys) + layer * b.k_layer);
      values.push_back(static_cast<const T*>(b.values) + layer * b.v_layer);
      n.push_back(b.n);
      kh.push_back(b.k_head);
      vh.push_back(b.v_head);
      owner.push_back(r);
    }
    const int64_t lo = window > 0 && slot[r] + 1 > window ? slot[r] + 1 - window : 0;
    keys.push_back(kc + lo * D);
    values.push_back(vc + lo * D);
    n.push_back(slot[r] + 1 - lo);
    kh.push_back(k_head[r]);
    vh.push_back(v_head[r]);
    owner.push_back(r);
  }
  const bool bf16 = std::is_same<T, uint16_t>::value;
  const int64_t S = static_cast<int64_t>(n.size());
  attend(B, S, owner.data(), qs.data(), bf16 ? reinterpret_cast<const uint16_t*>(qr.data()) : nullptr, scale,
         keys.data(), values.data(), n.data(), kh.data(), vh.data(), H, G, D, bf16,
         rows_per_item(S, n.data(), H, threads), threads, out);
  return 0;
}

}  // namespace

extern "C" {

int pc_rag_decode_attention_segments(int64_t B, const void* q, int64_t S, const int64_t* owner,
                                     const void* const* keys, const void* const* values, const int64_t* n,
                                     const int64_t* k_head, const int64_t* v_head, int64_t H, int64_t G, int64_t D,
                                     int bf16, float scale, int64_t rows, int threads, void* out);

int pc_rag_supported() { return avx512_supported(); }

// B requests of one decode step at once (one request: B = 1). q [B, H, G, D] contiguous, in the keys' dtype: query
// head h * G + g uses KV head h (HF's repeat_kv); scores are scaled by `scale`. Request r's keys and values: H heads
// of n[r] rows of D elements (fp32, or bf16 when bf16 != 0) at keys[r], values[r], rows contiguous, heads k_head[r]
// / v_head[r] elements apart. rows: keys per work item. out [B, H, G, D] in the keys' dtype. Returns 0, or -1 for
// shapes it does not take.
int pc_rag_decode_attention(int64_t B, const void* q, const void* const* keys, const void* const* values,
                            const int64_t* n, const int64_t* k_head, const int64_t* v_head, int64_t H, int64_t G,
                            int64_t D, int bf16, float scale, int64_t rows, int threads, void* out) {
  return pc_rag_decode_attention_segments(B, q, B, nullptr, keys, values, n, k_head, v_head, H, G, D, bf16, scale,
                                          rows, threads, out);
}

// The same over S segments of keys, segment s read by request owner[s] (a shared prefix and the request's own
// slots: two segments of one request, merged by their log-sum-exp). Every request needs at least one key.
int pc_rag_decode_attention_segments(int64_t B, const void* q, int64_t S, const int64_t* owner,
                                     const void* const* keys, const void* const* values, const int64_t* n,
                                     const int64_t* k_head, const int64_t* v_head, int64_t H, int64_t G, int64_t D,
                                     int bf16, float scale, int64_t rows, int threads, void* out) {
  if (!pc_rag_supported() || D % 16 != 0 || D > 256 || rows <= 0 || B <= 0 || S <= 0 || H <= 0 || G <= 0) return -1;
  std::vector<int64_t> keyed(B, 0);
  for (int64_t g = 0; g < S; ++g) {
    const int64_t r = owner ? owner[g] : g;
    if (n[g] < 0 || r < 0 || r >= B) return -1;
    keyed[r] += n[g];
  }
  for (int64_t r = 0; r < B; ++r)
    if (keyed[r] <= 0) return -1;
  const int64_t Q = B * H * G * D;
  std::vector<float> qs(Q);
  for (int64_t i = 0; i < Q; ++i)
    qs[i] = scale * (bf16 ? bf16_to_f32(static_cast<const uint16_t*>(q)[i]) : static_cast<const float*>(q)[i]);
  attend(B, S, owner, qs.data(), bf16 ? static_cast<const uint16_t*>(q) : nullptr, scale, keys, values, n, k_head,
         v_head, H, G, D, bf16, rows, threads, out);
  return 0;
}

// One layer's attention in a decode step for B requests, straight from the q, k, v projections: see decode_step
// above (strides in elements). Returns 0, or -1 for shapes it does not take.
int pc_rag_decode_step(int64_t B, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                       int64_t v_row, const void* cos, const void* sin, int64_t cs_row, const void* q_norm,
                       const void* k_norm, float eps, void* const* k_cache, void* const* v_cache,
                       const int64_t* k_layer, const int64_t* v_layer, int64_t layer, const int64_t* k_head,
                       const int64_t* v_head, const int64_t* slot, int64_t window, const PcBase* bases, int64_t H,
                       int64_t G, int64_t D, int bf16, float scale, int threads, void* out) {
  if (!pc_rag_supported() || D % 16 != 0 || D > 256 || B <= 0 || H <= 0 || G <= 0) return -1;
  for (int64_t r = 0; r < B; ++r)
    if (slot[r] < 0 || (bases && (bases[r].n < 0 || (bases[r].n > 0 && window > 0)))) return -1;
  if (bf16)
    return decode_step(B, static_cast<const uint16_t*>(q), q_row, static_cast<const uint16_t*>(k), k_row,
                       static_cast<const uint16_t*>(v), v_row, static_cast<const uint16_t*>(cos),
                       static_cast<const uint16_t*>(sin), cs_row, static_cast<const uint16_t*>(q_norm),
                       static_cast<const uint16_t*>(k_norm), eps, k_cache, v_cache, k_layer, v_layer, layer, k_head,
                       v_head, slot, window, bases, H, G, D, scale, threads, out);
  return decode_step(B, static_cast<const float*>(q), q_row, static_cast<const float*>(k), k_row,
                     static_cast<const float*>(v), v_row, static_cast<const float*>(cos),
                     static_cast<const float*>(sin), cs_row, static_cast<const float*>(q_norm),
                     static_cast<const float*>(k_norm), eps, k_cache, v_cache, k_layer, v_layer, layer, k_head, v_head,
                     slot, window, bases, H, G, D, scale, threads, out);
}

}  // extern "C"
