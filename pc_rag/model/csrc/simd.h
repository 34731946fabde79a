// What the kernel files share: the AVX-512 target attributes, 16-lane loads of fp32 or bf16, a vectorised exp,
// scalar bf16 conversions and HF's RMSNorm of one row. Header-only, functions inline, so each kernel file
// compiles on its own.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define PC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

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

inline bool avx512_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}
