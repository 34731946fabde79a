// A product of a few rows by a weight matrix, y = x W^T + b: a decode step's linear layers (weights.Packed calls
// it for up to weights.FEW_ROWS rows).
//
// Such a product is a read of the weights, and oneDNN's packed one-row products read them at 9-12 GB/s on the
// Intel Xeon with AMX we measure on (bf16 and fp32 alike, 24 layers of the large shape, the machine reading 18-24),
// MKL's at 7-17. Here each thread streams its own range of output rows straight from the modules' row-major
// weights (no copy), 4 rows at a time, 4 KB prefetched ahead; fp32 by FMAs, bf16 by AVX512-BF16 dot products
// (two products per lane per instruction, accumulated in fp32), each output rounded once after the bias as
// oneDNN does. 2026-12-03, 1 row: bf16 47-65 against oneDNN's 79-104 ms per 24 layers, fp32 80-148 against 108-255
// (MKL 86-165); up to 4 rows it stays ahead (bf16 82 against 117 ms at 4), from 6 rows AMX's tiles catch up.
//
// The weights are given as S row-major [rows_s, K] segments whose outputs are concatenated (a layer's q, k and v
// modules, or gate and up): the modules keep their own tensors, and the packed copy stays for longer products.
// Each output row's sum runs in one fixed order whatever M is, so a row's result does not depend on its batch.

#include <omp.h>

#include <algorithm>

#include "rows.h"


namespace {

using namespace pc_rows;

template <typename T>
void linear_rows(int64_t M, int64_t K, const T* x, int64_t ldx, int64_t S, const T* const* w, const int64_t* rows_of,
                 const T* bias, int threads, T* y, int64_t ldy) {
  int64_t N = 0;
  for (int64_t s = 0; s < S; ++s) N += rows_of[s];
#pragma omp parallel num_threads(threads) if (N * K >= PARALLEL_WEIGHTS)
  {
    // Each thread its own range of output rows (a multiple of 4), across segments.
    const int64_t nt = omp_get_num_threads(), per = ((N + nt - 1) / nt + 3) / 4 * 4;
    const int64_t lo = std::min(N, omp_get_thread_num() * per), hi = std::min(N, lo + per);
    int64_t base = 0;
    for (int64_t s = 0; s < S; base += rows_of[s++]) {
      const int64_t a = std::max(lo, base) - base, e = std::min(hi, base + rows_of[s]) - base;
      const T* b = bias ? bias + base : nullptr;
      for (int64_t c = a; c < e; c += BLOCK_ROWS) {
        const int64_t c1 = std::min(e, c + BLOCK_ROWS);
        for (int64_t m = 0; m < M; m += 8) {
          const T* xm = x + m * ldx;
          T* ym = y + m * ldy + base;
          switch (std::min<int64_t>(8, M - m)) {
            case 8: span<8>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 7: span<7>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 6: span<6>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 5: span<5>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 4: span<4>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 3: span<3>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            case 2: span<2>(xm, ldx, w[s], K, b, c, c1, ym, ldy); break;
            default: span<1>(xm, ldx, w[s], K, b, c, c1, ym, ldy);
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int pc_rag_linear_bf16_supported() { return avx512_bf16_supported(); }

// y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) times the S weight segments w[s] [rows[s], K] (row-major,
// contiguous), concatenated, plus bias [N] where not null. Returns 0, or -1 for bf16 on a CPU without AVX512-BF16.
int pc_rag_linear_rows(int64_t M, int64_t K, const void* x, int64_t ldx, int64_t S, const void* const* w,
                       const int64_t* rows, const void* bias, int bf16, int threads, void* y, int64_t ldy) {
  if (!avx512_supported() || (bf16 && !pc_rag_linear_bf16_supported())) return -1;
  if (bf16)
    linear_rows(M, K, static_cast<const uint16_t*>(x), ldx, S, reinterpret_cast<const uint16_t* const*>(w), rows,
                static_cast<const uint16_t*>(bias), threads, static_cast<uint16_t*>(y), ldy);
  else
    linear_rows(M, K, static_cast<const float*>(x), ldx, S, reinterpret_cast<const float* const*>(w), rows,
                static_cast<const float*>(bias), threads, static_cast<float*>(y), ldy);
  return 0;
}

}  // extern "C"
