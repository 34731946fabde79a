// The product microkernels linear_rows.cpp and quant_rows.cpp share: output rows of y = x W^T + b for up to 8 rows
// of x, from row-major weights (the modules' own, or a quantized matrix's rows decoded into a scratch buffer). See
// linear_rows.cpp for why they are written this way and what they measured.
#pragma once

#include "simd.h"

namespace pc_rows {

constexpr int64_t BLOCK_ROWS = 64;      // output rows per pass over the x rows (their weights stay in L1/L2)
// How far ahead in the weights each row's loads prefetch: 4 KB along the row, or where a row is shorter than that,
// the same place in the next group of R rows (4 KB ahead fell on rows two ahead, half of them being read already).
// The bench model's weights at 4 rows (fp32, 2 KB rows): 19.0 against 16.6 GB/s; 1-15% elsewhere (2026-12-03).
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int64_t PARALLEL_WEIGHTS = 1 << 16;  // fewer weight elements than this: one thread

// The loops over a block's x rows and weight rows fully unrolled: otherwise GCC kept a copy of the accumulators on
// the stack and stored all M x R of them at every step of k (16-32 vector stores per step at 4 rows); with the
// pragma they stay in registers: 8 rows 10-12% faster in fp32, the same sums (2026-12-03).
#define PC_UNROLL _Pragma("GCC unroll 8")

// y[m, n..n+R) for the M <= 4 rows of x, from weight rows n..n+R (bf16).
template <int M, int R>
PC_AVX512_BF16 void rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* b,
                              uint16_t* y, int64_t ldy) {
  __m512 acc[M][R];
  PC_UNROLL for (int m = 0; m < M; ++m)
    PC_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t row = K * int64_t(sizeof(uint16_t)), ahead = row >= PREFETCH_BYTES ? PREFETCH_BYTES : R * row;
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1ull << (K - k)) - 1);
    __m512i wv[R];
    PC_UNROLL for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_maskz_loadu_epi16(mask, w + r * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + ahead, _MM_HINT_T0);
    }
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
      PC_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)wv[r], xv);
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m)
    PC_UNROLL for (int r = 0; r < R; ++r)
      y[m * ldy + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[m][r]) + (b ? bf16_to_f32(b[r]) : 0.f));
}

// The same in fp32.
template <int M, int R>
PC_AVX512 void rows_f32(const float* x, int64_t ldx, const float* w, int64_t K, const float* b, float* y,
                        int64_t ldy) {
  __m512 acc[M][R];
  PC_UNROLL for (int m = 0; m < M; ++m)
    PC_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t row = K * int64_t(sizeof(float)), ahead = row >= PREFETCH_BYTES ? PREFETCH_BYTES : R * row;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? ~__mmask16(0) : __mmask16((1u << (K - k)) - 1);
    __m512 wv[R];
    PC_UNROLL for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_maskz_loadu_ps(mask, w + r * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + ahead, _MM_HINT_T0);
    }
    PC_UNROLL for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      PC_UNROLL for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  PC_UNROLL for (int m = 0; m < M; ++m)
    PC_UNROLL for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]) + (b ? b[r] : 0.f);
}

template <int M, int R, typename T>
inline void rows(const T* x, int64_t ldx, const T* w, int64_t K, const T* b, T* y, int64_t ldy) {
  if constexpr (sizeof(T) == 2)
    rows_bf16<M, R>(x, ldx, w, K, b, y, ldy);
  else
    rows_f32<M, R>(x, ldx, w, K, b, y, ldy);
}

// Output rows [n0, n1) of one segment (w, b at its row 0; y at its column 0) for the M <= 8 rows of x, R weight
// rows at a time: the M x R accumulators, R weight registers and one of x fit the 32 vector registers. All M rows
// in one pass, so the weights stream from memory once: 5-8 rows had been two passes of up to 4, the second over
// weights already in L2, which did not overlap the memory reads (fp32, bench model's 8 layers, 8 rows: 6.3
// against 7.3 ms, 16.0 against 13.8 GB/s; bf16 5.3 against 5.9 ms; 1-4 rows unchanged, 2026-12-03). R 2 (fp32)
// and 3 (bf16) were the faster of 2 and 3 for each.
template <int M, typename T>
void span(const T* x, int64_t ldx, const T* w, int64_t K, const T* b, int64_t n0, int64_t n1, T* y, int64_t ldy) {
  constexpr int R = M <= 4 ? 4 : sizeof(T) == 2 ? 3 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows<M, R>(x, ldx, w + n * K, K, b ? b + n : nullptr, y + n, ldy);
  for (; n < n1; ++n) rows<M, 1>(x, ldx, w + n * K, K, b ? b + n : nullptr, y + n, ldy);
}

}  // namespace pc_rows
