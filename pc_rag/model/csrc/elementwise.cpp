// The small ops between a decode step's matrix products, one call each instead of 5-9 torch ops (fused.py's
// FusedDecode): the residual add with the RMSNorm after it, and the MLP's SiLU(gate) * up. Each rounds to the
// tensors' dtype where the model's own ops do, so fp32 results match them to float rounding and bf16 ones to the
// last bit but for the sum of squares' order.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

// SiLU as torch computes it in fp32, x / (1 + exp(-x)), then rounded to T; times up, rounded again.
template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t N, T* out) {
  for (int64_t i = 0; i < N; ++i) {
    const float g = to_f32(gate[i]);
    const T a = from_f32<T>(g / (1.f + std::exp(-g)));
    out[i] = from_f32<T>(to_f32(a) * to_f32(up[i]));
  }
}

template <typename T>
void add_rms_norm(int64_t B, int64_t N, T* x, const T* delta, const T* w, float eps, T* out) {
  for (int64_t r = 0; r < B; ++r) {
    T* xr = x + r * N;
    if (delta)
      for (int64_t i = 0; i < N; ++i) xr[i] = from_f32<T>(to_f32(xr[i]) + to_f32(delta[r * N + i]));
    if (w) rms_norm_row(xr, w, N, eps, out + r * N);
  }
}

}  // namespace

extern "C" {

// B rows x [B, N]: x += delta where delta is not null (the residual add, in place), then out = RMSNorm(x) * w where
// w is not null. Returns 0.
int pc_rag_add_rms_norm(int64_t B, int64_t N, void* x, const void* delta, const void* w, float eps, int bf16,
                        void* out) {
  if (bf16)
    add_rms_norm(B, N, static_cast<uint16_t*>(x), static_cast<const uint16_t*>(delta),
                 static_cast<const uint16_t*>(w), eps, static_cast<uint16_t*>(out));
  else
    add_rms_norm(B, N, static_cast<float*>(x), static_cast<const float*>(delta), static_cast<const float*>(w), eps,
                 static_cast<float*>(out));
  return 0;
}

// B rows of gate and up [B, N] (rows `row` elements apart: the halves of one fused product, or two products):
// out [B, N] = SiLU(gate) * up. Returns 0.
int pc_rag_silu_mul(int64_t B, int64_t N, const void* gate, const void* up, int64_t row, int bf16, void* out) {
  for (int64_t r = 0; r < B; ++r) {
    if (bf16)
      silu_mul_row(static_cast<const uint16_t*>(gate) + r * row, static_cast<const uint16_t*>(up) + r * row, N,
                   static_cast<uint16_t*>(out) + r * N);
    else
      silu_mul_row(static_cast<const float*>(gate) + r * row, static_cast<const float*>(up) + r * row, N,
                   static_cast<float*>(out) + r * N);
  }
  return 0;
}

}  // extern "C"
