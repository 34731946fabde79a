// What the kernel files share: the AVX-512 target attributes, 16-lane loads of fp32 or bf16, a vectorised exp,
// scalar bf16 conversions and HF's RMSNorm of one row. Header-only, functions inline, so each kernel file
// compiles on its own.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define PC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
// The same with AVX512-BF16 dot products (VDPBF16PS); callers check `avx512_bf16_supported()` first.
#define PC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

template <typename T> PC_AVX512 inline __m512 load16(const T* p);
template <> PC_AVX512 inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> PC_AVX512 inline __m512 load16<uint16_t>(const uint16_t* p) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift.
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0: Cephes expf's range reduction and polynomial (~1 ulp); 2^n by scalef, which goes to 0 below
// the smallest float instead of wrapping.
PC_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// exp(x) for any x: above 100 it is +inf as it should be (2^n overflows in scalef); the clamp keeps the range
// reduction's r small there.
PC_AVX512 inline __m512 exp16_any(__m512 x) { return exp16(_mm512_min_ps(x, _mm512_set1_ps(100.f))); }

// v rounded to T and widened back (bf16: to nearest even, as torch's conversion; fp32: v).
template <typename T> PC_AVX512 inline __m512 round16(__m512 v);
template <> PC_AVX512 inline __m512 round16<float>(__m512 v) { return v; }
template <> PC_AVX512 inline __m512 round16<uint16_t>(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// 16 lanes stored as T (bf16 rounded to nearest even).
template <typename T> PC_AVX512 inline void store16(T* p, __m512 v);
template <> PC_AVX512 inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <> PC_AVX512 inline void store16<uint16_t>(uint16_t* p, __m512 v) {
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16<uint16_t>(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's conversion does (the outputs are finite: a softmax average of finite values).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Scalars of either dtype through fp32 (bf16 rounded to nearest even).
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline uint16_t from_f32<uint16_t>(float x) { return f32_to_bf16(x); }

// HF's LlamaRMSNorm (and Qwen3's per-head q/k norms) on one row x [N]: w * T(x * rsqrt(mean(x^2) + eps)),
// statistics in fp32; into out, which it returns.
template <typename T>
inline const T* rms_norm_row(const T* x, const T* w, int64_t N, float eps, T* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < N; ++i) ss += to_f32(x[i]) * to_f32(x[i]);
  const float inv = 1.f / std::sqrt(ss / float(N) + eps);
  for (int64_t i = 0; i < N; ++i) out[i] = from_f32<T>(to_f32(w[i]) * to_f32(from_f32<T>(to_f32(x[i]) * inv)));
  return out;
}

// x [D] rotated as HF's apply_rotary_pos_emb does, x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1]),
// each product and the sum rounded to T as its three tensor ops are; into y [D] (in T) and, if ys, ys [D] (fp32,
// times scale).
template <typename T>
void rotate(const T* x, const T* cos, const T* sin, int64_t D, T* y, float* ys, float scale) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float xd = to_f32(x[d]), rd = d < half ? -to_f32(x[d + half]) : to_f32(x[d - half]);
    const T a = from_f32<T>(xd * to_f32(cos[d])), b = from_f32<T>(rd * to_f32(sin[d]));
    y[d] = from_f32<T>(to_f32(a) + to_f32(b));
    if (ys) ys[d] = scale * to_f32(y[d]);
  }
}

// rotate's result into y only, 16 lanes at a time where each half of the head is a whole number of vectors
// (D % 32 == 0), with the same roundings.
template <typename T>
PC_AVX512 inline void rotate_row(const T* x, const T* cos, const T* sin, int64_t D, T* y) {
  const int64_t half = D / 2;
  if (half % 16) {
    rotate<T>(x, cos, sin, D, y, nullptr, 0.f);
    return;
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 x1 = load16(x + d), x2 = load16(x + d + half);
    const __m512 a1 = round16<T>(_mm512_mul_ps(x1, load16(cos + d)));
    const __m512 b1 = round16<T>(_mm512_mul_ps(_mm512_sub_ps(zero, x2), load16(sin + d)));
    const __m512 a2 = round16<T>(_mm512_mul_ps(x2, load16(cos + d + half)));
    const __m512 b2 = round16<T>(_mm512_mul_ps(x1, load16(sin + d + half)));
    store16(y + d, _mm512_add_ps(a1, b1));
    store16(y + d + half, _mm512_add_ps(a2, b2));
  }
}

inline bool avx512_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}

inline bool avx512_bf16_supported() { return avx512_supported() && __builtin_cpu_supports("avx512bf16"); }
