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
#include <vector>

#include "simd.h"

namespace {

// The G query rows q [G, D] (fp32, already scaled) over n key/value rows k, v [n, D] of one KV head: the chunk's
// score max m [G], exp-sum l [G] and unnormalised output acc [G, D]. s: room for G * n scores.
template <typename T>
PC_AVX512 void attend_chunk(const float* q, const T* k, const T* v, int64_t n, int64_t G, int64_t D, float* s,
                            float* m, float* l, float* acc) {
  const int64_t V = D / 16;
  for (int64_t t = 0; t < n; ++t) {
    __m512 kt[16];
    for (int64_t j = 0; j < V; ++j) kt[j] = load16<T>(k + t * D + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), kt[0]);
      for (int64_t j = 1; j < V; ++j) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), kt[j], a);
      s[g * n + t] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
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
  for (int64_t g = 0; g < G; ++g) {  // values chunk stays in L2 across the group's rows
    const float* sg = s + g * n;
    __m512 a[16];
    for (int64_t j = 0; j < V; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m512 p = _mm512_set1_ps(sg[t]);
      for (int64_t j = 0; j < V; ++j) a[j] = _mm512_fmadd_ps(p, load16<T>(v + t * D + 16 * j), a[j]);
    }
    for (int64_t j = 0; j < V; ++j) _mm512_storeu_ps(acc + g * D + 16 * j, a[j]);
  }
}

// Every request's keys in chunks of `rows`: work item i belongs to request r where first[r] <= i < first[r + 1],
// head and chunk in request order; each item's max, exp-sum and partial output go to ml, acc at index i.
template <typename T>
void attend_all(int64_t B, const float* q, const void* const* keys, const void* const* values, const int64_t* n,
                const int64_t* k_head, const int64_t* v_head, int64_t H, int64_t G, int64_t D, int64_t rows,
                int threads, const int64_t* first, float* ml, float* acc) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(G * rows), m(G), l(G);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < first[B]; ++i) {
      const int64_t r = std::upper_bound(first, first + B + 1, i) - first - 1;
      const int64_t C = (n[r] + rows - 1) / rows, j = i - first[r];
      const int64_t h = j / C, t0 = (j % C) * rows, len = std::min(rows, n[r] - t0);
      attend_chunk<T>(q + (r * H + h) * G * D, static_cast<const T*>(keys[r]) + h * k_head[r] + t0 * D,
                      static_cast<const T*>(values[r]) + h * v_head[r] + t0 * D, len, G, D, s.data(), m.data(),
                      l.data(), acc + i * G * D);
      for (int64_t g = 0; g < G; ++g) {
        ml[(i * G + g) * 2] = m[g];
        ml[(i * G + g) * 2 + 1] = l[g];
      }
    }
  }
}

}  // namespace

extern "C" {

int pc_rag_supported() { return avx512_supported(); }

// B requests of one decode step at once (one request: B = 1). q [B, H, G, D] contiguous, in the keys' dtype: query
// head h * G + g uses KV head h (HF's repeat_kv); scores are scaled by `scale`. Request r's keys and values: H heads
// of n[r] rows of D elements (fp32, or bf16 when bf16 != 0) at keys[r], values[r], rows contiguous, heads k_head[r]
// / v_head[r] elements apart. rows: keys per work item. out [B, H, G, D] in the keys' dtype. Returns 0, or -1 for
// shapes it does not take.
int pc_rag_decode_attention(int64_t B, const void* q, const void* const* keys, const void* const* values,
                            const int64_t* n, const int64_t* k_head, const int64_t* v_head, int64_t H, int64_t G,
                            int64_t D, int bf16, float scale, int64_t rows, int threads, void* out) {
  if (!pc_rag_supported() || D % 16 != 0 || D > 256 || rows <= 0 || B <= 0 || H <= 0 || G <= 0) return -1;
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t r = 0; r < B; ++r) {
    if (n[r] <= 0) return -1;
    first[r + 1] = first[r] + H * ((n[r] + rows - 1) / rows);
  }
  const int64_t Q = B * H * G * D;
  std::vector<float> qs(Q), ml(first[B] * G * 2), acc(first[B] * G * D), o(D);
  for (int64_t i = 0; i < Q; ++i)
    qs[i] = scale * (bf16 ? bf16_to_f32(static_cast<const uint16_t*>(q)[i]) : static_cast<const float*>(q)[i]);
  if (bf16)
    attend_all<uint16_t>(B, qs.data(), keys, values, n, k_head, v_head, H, G, D, rows, threads, first.data(),
                         ml.data(), acc.data());
  else
    attend_all<float>(B, qs.data(), keys, values, n, k_head, v_head, H, G, D, rows, threads, first.data(), ml.data(),
                      acc.data());
  // Merge each query row's chunks: weights exp(m_c - max m), normalised by the weighted exp-sums.
  for (int64_t r = 0; r < B; ++r) {
    const int64_t C = (n[r] + rows - 1) / rows;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < C; ++c) M = std::max(M, ml[((first[r] + h * C + c) * G + g) * 2]);
        float L = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t j = (first[r] + h * C + c) * G + g;
          const float w = std::exp(ml[j * 2] - M);
          L += w * ml[j * 2 + 1];
          for (int64_t d = 0; d < D; ++d) o[d] += w * acc[j * D + d];
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
  return 0;
}

}  // extern "C"
