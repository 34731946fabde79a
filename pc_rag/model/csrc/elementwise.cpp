// The small ops between a layer's matrix products, one call each instead of 5-9 torch ops (fused.py): the residual
// add with the RMSNorm after it, the MLP's SiLU(gate) * up, and a prefill's RoPE with its KV writes. A decode step passes one row per request, a
// prefill thousands: rows go to the threads, 16 lanes at a time. Each op rounds to the tensors' dtype where the
// model's own ops do, so fp32 results match them to float rounding and bf16 ones to the last bit but for the sum of
// squares' order and exp's last ulp.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

// Below this many elements a call runs on one thread: a decode step's rows are done before threads would start.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;

// SiLU as torch computes it in fp32, x / (1 + exp(-x)), then rounded to T; times up, rounded again.
template <typename T>
PC_AVX512 void silu_mul_row(const T* gate, const T* up, int64_t N, T* out) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= N; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp16_any(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 a = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    store16(out + i, _mm512_mul_ps(a, load16(up + i)));
  }
  for (; i < N; ++i) {
    const float g = to_f32(gate[i]);
    const T a = from_f32<T>(g / (1.f + std::exp(-g)));
    out[i] = from_f32<T>(to_f32(a) * to_f32(up[i]));
  }
}

// One row: x += delta (rounded to T) where delta is given, then out = w * T(x * rsqrt(mean(x^2) + eps)) where w is
// given (HF's LlamaRMSNorm: statistics in fp32).
template <typename T>
PC_AVX512 void add_rms_norm_row(T* x, const T* delta, const T* w, int64_t N, float eps, T* out) {
  __m512 acc = _mm512_setzero_ps();
  float tail = 0.f;
  int64_t i = 0;
  for (; i + 16 <= N; i += 16) {
    __m512 v = load16(x + i);
    if (delta) {
      v = round16<T>(_mm512_add_ps(v, load16(delta + i)));
      store16(x + i, v);
    }
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  for (int64_t j = i; j < N; ++j) {
    if (delta) x[j] = from_f32<T>(to_f32(x[j]) + to_f32(delta[j]));
    tail += to_f32(x[j]) * to_f32(x[j]);
  }
  if (!w) return;
  const float inv = 1.f / std::sqrt((_mm512_reduce_add_ps(acc) + tail) / float(N) + eps);
  const __m512 s = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= N; i += 16)
    store16(out + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(x + i), s))));
  for (; i < N; ++i) out[i] = from_f32<T>(to_f32(w[i]) * to_f32(from_f32<T>(to_f32(x[i]) * inv)));
}

template <typename T>
void add_rms_norm(int64_t B, int64_t N, T* x, const T* delta, const T* w, float eps, int threads, T* out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (B > 1 && B * N >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < B; ++r)
    add_rms_norm_row(x + r * N, delta ? delta + r * N : nullptr, w, N, eps, out + r * N);
}

template <typename T>
void silu_mul(int64_t B, int64_t N, const T* gate, const T* up, int64_t row, int threads, T* out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (B > 1 && B * N >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < B; ++r) silu_mul_row(gate + r * row, up + r * row, N, out + r * N);
}

// n rows of one prefill from the projections q [n, H * G * D], k and v [n, H * D] (rows q_row, k_row, v_row elements
// apart): each head's RMSNorm where q_norm / k_norm [D] are given (Qwen3), RoPE (cos, sin [n, D], rows cs_row
// apart) on the queries into q_out [H * G, n, D] and on the keys into k_out (head h's row r at h * k_head + r * D:
// a layer's cache at the prefill's first slot), the values copied into v_out alike.
template <typename T>
void prefill_rope(int64_t n, const T* q, int64_t q_row, const T* k, int64_t k_row, const T* v, int64_t v_row,
                  const T* cos, const T* sin, int64_t cs_row, const T* q_norm, const T* k_norm, float eps, T* q_out,
                  T* k_out, int64_t k_head, T* v_out, int64_t v_head, int64_t H, int64_t G, int64_t D, int threads) {
  const int64_t HQ = H * G;
#pragma omp parallel num_threads(threads) if (n * HQ * D >= PARALLEL_ELEMENTS)
  {
    std::vector<T> normed(D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      const T *c = cos + r * cs_row, *s = sin + r * cs_row;
      for (int64_t h = 0; h < HQ; ++h) {
        const T* x = q + r * q_row + h * D;
        if (q_norm) x = rms_norm_row(x, q_norm, D, eps, normed.data());
        rotate_row(x, c, s, D, q_out + (h * n + r) * D);
      }
      for (int64_t h = 0; h < H; ++h) {
        const T* x = k + r * k_row + h * D;
        if (k_norm) x = rms_norm_row(x, k_norm, D, eps, normed.data());
        rotate_row(x, c, s, D, k_out + h * k_head + r * D);
        std::memcpy(v_out + h * v_head + r * D, v + r * v_row + h * D, D * sizeof(T));
      }
    }
  }
}

// Cached keys moved by a RoPE rotation (rope.py's relocate): each row [D] of L x H x T, at src + l * s_layer + h *
// s_head + t * s_row (dst alike), rotated by the angles whose cos and sin [D / 2] (fp32) are given, in fp32 with
// one rounding to T per op as rope._rotate's torch ops: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin. src may be
// dst (each row is read before it is written).
template <typename T>
PC_AVX512 void relocate_keys(int64_t L, int64_t H, int64_t T_, int64_t D, const T* src, int64_t s_layer,
                             int64_t s_head, int64_t s_row, T* dst, int64_t d_layer, int64_t d_head, int64_t d_row,
                             const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T_; ++t) {
        const T* x = src + l * s_layer + h * s_head + t * s_row;
        T* y = dst + l * d_layer + h * d_head + t * d_row;
        int64_t d = 0;
        for (; d + 16 <= half; d += 16) {
          const __m512 x1 = load16(x + d), x2 = load16(x + half + d);
          const __m512 c = _mm512_loadu_ps(cos + d), s = _mm512_loadu_ps(sin + d);
          store16(y + d, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
          store16(y + half + d, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
        }
        for (; d < half; ++d) {
          const float x1 = to_f32(x[d]), x2 = to_f32(x[half + d]);
          y[d] = from_f32<T>(x1 * cos[d] - x2 * sin[d]);
          y[half + d] = from_f32<T>(x2 * cos[d] + x1 * sin[d]);
        }
      }
}

}  // namespace

extern "C" {

// B rows x [B, N]: x += delta where delta is not null (the residual add, in place), then out = RMSNorm(x) * w where
// w is not null. Returns 0.
int pc_rag_add_rms_norm(int64_t B, int64_t N, void* x, const void* delta, const void* w, float eps, int bf16,
                        int threads, void* out) {
  if (bf16)
    add_rms_norm(B, N, static_cast<uint16_t*>(x), static_cast<const uint16_t*>(delta),
                 static_cast<const uint16_t*>(w), eps, threads, static_cast<uint16_t*>(out));
  else
    add_rms_norm(B, N, static_cast<float*>(x), static_cast<const float*>(delta), static_cast<const float*>(w), eps,
                 threads, static_cast<float*>(out));
  return 0;
}

// B rows of gate and up [B, N] (rows `row` elements apart: the halves of one fused product, or two products):
// out [B, N] = SiLU(gate) * up. Returns 0.
int pc_rag_silu_mul(int64_t B, int64_t N, const void* gate, const void* up, int64_t row, int bf16, int threads,
                    void* out) {
  if (bf16)
    silu_mul(B, N, static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up), row, threads,
             static_cast<uint16_t*>(out));
  else
    silu_mul(B, N, static_cast<const float*>(gate), static_cast<const float*>(up), row, threads,
             static_cast<float*>(out));
  return 0;
}

// A prefill's RoPE and KV writes for one layer: see prefill_rope above (strides in elements). Returns 0.
int pc_rag_prefill_rope(int64_t n, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                        int64_t v_row, const void* cos, const void* sin, int64_t cs_row, const void* q_norm,
                        const void* k_norm, float eps, void* q_out, void* k_out, int64_t k_head, void* v_out,
                        int64_t v_head, int64_t H, int64_t G, int64_t D, int bf16, int threads) {
  if (bf16)
    prefill_rope(n, static_cast<const uint16_t*>(q), q_row, static_cast<const uint16_t*>(k), k_row,
                 static_cast<const uint16_t*>(v), v_row, static_cast<const uint16_t*>(cos),
                 static_cast<const uint16_t*>(sin), cs_row, static_cast<const uint16_t*>(q_norm),
                 static_cast<const uint16_t*>(k_norm), eps, static_cast<uint16_t*>(q_out), static_cast<uint16_t*>(k_out),
                 k_head, static_cast<uint16_t*>(v_out), v_head, H, G, D, threads);
  else
    prefill_rope(n, static_cast<const float*>(q), q_row, static_cast<const float*>(k), k_row,
                 static_cast<const float*>(v), v_row, static_cast<const float*>(cos), static_cast<const float*>(sin),
                 cs_row, static_cast<const float*>(q_norm), static_cast<const float*>(k_norm), eps,
                 static_cast<float*>(q_out), static_cast<float*>(k_out), k_head, static_cast<float*>(v_out), v_head, H,
                 G, D, threads);
  return 0;
}

// bf16 keys relocated by a rotation: see relocate_keys above (strides in elements; one thread: block reads call it
// from reader threads, where an OpenMP team each would oversubscribe the cores). fp32 keys stay with torch's ops,
// as fast there. Returns 0, or -1 for an odd D.
int pc_rag_relocate_keys(int64_t L, int64_t H, int64_t T, int64_t D, const void* src, int64_t s_layer, int64_t s_head,
                         int64_t s_row, void* dst, int64_t d_layer, int64_t d_head, int64_t d_row, const float* cos,
                         const float* sin) {
  if (D % 2) return -1;
  relocate_keys(L, H, T, D, static_cast<const uint16_t*>(src), s_layer, s_head, s_row, static_cast<uint16_t*>(dst),
                d_layer, d_head, d_row, cos, sin);
  return 0;
}

}  // extern "C"
