// A whole decode step's decoder layers in one call (fused.py's FusedLayers.step, where every product of the step
// goes through linear_rows, or quant_rows for quantized weights): the same native ops as the Python loop, in the same order, so the same sums.
//
// Why one call: the Python loop made ~10 native calls and ~10 torch ops per layer, each dispatched from Python and
// each letting go of the GIL and taking it back. Before and after, in one session (bench model, fp32, 600 keys a
// request, 2026-12-03): a step of 1 request 8.5 against 6.5 ms, of 8 requests 16.6 against 13.4. A server's request
// threads and event loop get the GIL for the whole step, not between its ops.

#include <algorithm>
#include <cstdint>
#include <vector>

// decode_attention.cpp's: a request's prefix shared read-only with other requests.
struct PcBase {
  const void* keys;
  const void* values;
  int64_t k_layer, v_layer, k_head, v_head, n;
};

extern "C" {
int pc_rag_linear_rows(int64_t M, int64_t K, const void* x, int64_t ldx, int64_t S, const void* const* w,
                       const int64_t* rows, const void* bias, int bf16, int threads, void* y, int64_t ldy);
int pc_rag_quant_rows(int64_t M, int64_t K, const void* x, int64_t ldx, int64_t S, const void* const* w,
                      const int64_t* rows, const int* types, const void* bias, int bf16, int threads, void* y,
                      int64_t ldy);
int pc_rag_add_rms_norm(int64_t B, int64_t N, void* x, const void* delta, const void* w, float eps, int bf16,
                        int threads, void* out);
int pc_rag_silu_mul(int64_t B, int64_t N, const void* gate, const void* up, int64_t row, int bf16, int threads,
                    void* out);
int pc_rag_decode_step(int64_t B, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                       int64_t v_row, const void* cos, const void* sin, int64_t cs_row, const void* q_norm,
                       const void* k_norm, float eps, void* const* k_cache, void* const* v_cache,
                       const int64_t* k_layer, const int64_t* v_layer, int64_t layer, const int64_t* k_head,
                       const int64_t* v_head, const int64_t* slot, int64_t window, const PcBase* bases, int64_t H,
                       int64_t G, int64_t D, int bf16, float scale, int threads, void* out);

// One product's weights as kernels.LinearRows holds them: S row-major segments [rows[s], K], concatenated outputs.
struct PcProduct {
  int64_t segments;
  const void* const* weights;
  const int64_t* rows;
  const int* types;  // GGML types of quantized segments (quant_rows.cpp), or null for weights in x's dtype
  const void* bias;  // [sum of rows] or null
  int64_t outputs;   // sum of rows
};

// One decoder layer (fixed once the model is loaded).
struct PcLayer {
  const void* input_norm;
  const void* mlp_norm;
  const void* q_norm;  // per-head q/k RMSNorm weights (Qwen3), or null
  const void* k_norm;
  PcProduct qkv, o, gate_up, down;
  int64_t window;  // sliding window, 0 for none
};

// hidden [B, N] (in place): the embeddings in, every layer's residual stream out (before the final norm). The caches
// and slots (and shared prefixes, `bases`, null for none) as pc_rag_decode_step takes them; cos, sin [B, D].
// Returns 0, or the first op's nonzero status.
int pc_rag_decode_layers(int64_t B, int64_t N, void* hidden, int64_t L, const PcLayer* layers, const void* cos,
                         const void* sin, void* const* k_cache, void* const* v_cache, const int64_t* k_layer,
                         const int64_t* v_layer, const int64_t* k_head, const int64_t* v_head, const int64_t* slot,
                         const PcBase* bases, int64_t H, int64_t G, int64_t D, float eps, float qk_eps, float scale, int bf16,
                         int threads) {
  if (B <= 0 || L <= 0) return -1;
  const int64_t e = bf16 ? 2 : 4;
  int64_t widest = N;
  for (int64_t i = 0; i < L; ++i)
    for (const PcProduct* p : {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down})
      widest = std::max(widest, p->outputs);
  // x: a norm's output; y: a product's; a: attention's output, then the MLP's activation.
  std::vector<char> x(B * N * e), y(B * widest * e), a(B * widest * e);
  int status = pc_rag_add_rms_norm(B, N, hidden, nullptr, layers[0].input_norm, eps, bf16, threads, x.data());
  for (int64_t i = 0; i < L && status == 0; ++i) {
    const PcLayer& l = layers[i];
    const int64_t q = H * G * D, n = l.qkv.outputs;
    auto product = [&](const PcProduct& p, const void* in, int64_t k, void* out) {
      if (p.types)
        return pc_rag_quant_rows(B, k, in, k, p.segments, p.weights, p.rows, p.types, p.bias, bf16, threads, out,
                                 p.outputs);
      return pc_rag_linear_rows(B, k, in, k, p.segments, p.weights, p.rows, p.bias, bf16, threads, out, p.outputs);
    };
    if ((status = product(l.qkv, x.data(), N, y.data())) != 0) break;
    const char* qkv = y.data();
    if ((status = pc_rag_decode_step(B, qkv, n, qkv + q * e, n, qkv + (q + H * D) * e, n, cos, sin, D, l.q_norm,
                                     l.k_norm, qk_eps, k_cache, v_cache, k_layer, v_layer, i, k_head, v_head, slot,
                                     l.window, bases, H, G, D, bf16, scale, threads, a.data())) != 0)
      break;
    if ((status = product(l.o, a.data(), q, y.data())) != 0) break;
    pc_rag_add_rms_norm(B, N, hidden, y.data(), l.mlp_norm, eps, bf16, threads, x.data());
    if ((status = product(l.gate_up, x.data(), N, y.data())) != 0) break;
    const int64_t m = l.gate_up.outputs / 2;
    pc_rag_silu_mul(B, m, y.data(), y.data() + m * e, l.gate_up.outputs, bf16, threads, a.data());
    if ((status = product(l.down, a.data(), m, y.data())) != 0) break;
    pc_rag_add_rms_norm(B, N, hidden, y.data(), i + 1 < L ? layers[i + 1].input_norm : nullptr, eps, bf16, threads,
                        x.data());
  }
  return status;
}

}  // extern "C"
