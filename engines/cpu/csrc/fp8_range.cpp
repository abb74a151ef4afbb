// The FP8 weight-only Linear's driver and bindings (compiled after csrc/fp8_panel_kernel.cpp, whose kernels and
// constants it uses, in the same namespace): the sums of a group of panels by variant, a range of panels for one
// thread (the fused team's claims call it), all panels over torch's intra-op threads, and the bound functions
// (engines/cpu/panel_kernel.py fp8_*).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>

namespace {

// the sums of panels [p, p + g) for rows [m0, m0 + r) of x (M, ldx) -> acc (g or r, F8_NR)
void sums(int64_t v, const float* x, int64_t ldx, int64_t K2, int64_t m0, int r, int g, const uint8_t* wp,
          float* acc, bool back = false) {
  const int64_t panel = K2 * 32;
#if F8_X86
  if (r == 1 && v == 5) return (back ? ROW_BF16_BACK : ROW_BF16)[g - 1](x + m0 * ldx, wp, panel, K2, acc);
  if (back && r == 1 && g == F8_G && v == 3) return row4_avx512_back(x + m0 * ldx, wp, panel, K2, acc);
  if (back && r == 1 && g == F8_G && v == 4) return row4_wide_avx2_back(x + m0 * ldx, wp, panel, K2, acc);
  if (r == 1 && g == F8_G && v == 3) return row4_avx512(x + m0 * ldx, wp, panel, K2, acc);
  if (r == 1 && g == F8_G && v == 4) return row4_wide_avx2(x + m0 * ldx, wp, panel, K2, acc);
  if (r == 1 && g == F8_G && v == 2)
    return row_avx2<F8_G>(x + m0 * ldx, wp, panel, K2, acc, panel, (back ? -F8_G : F8_G) * panel);
#endif
  for (int i = 0; i < g; ++i) {  // (g == 1 unless one row)
    float* a = acc + i * F8_NR;
    const uint8_t* w = wp + i * panel;
    if (v == 6) { block_bf16_emulated(x + m0 * ldx, ldx, r, w, K2, a); continue; }
#if F8_X86
    if (v == 5) { block_bf16(x + m0 * ldx, ldx, r, w, K2, a); continue; }
    if (v == 3) { block_avx512(x + m0 * ldx, ldx, r, w, K2, a); continue; }
    if (v == 4) { block_wide_avx2(x + m0 * ldx, ldx, r, w, K2, a); continue; }
    if (v == 2) { block_avx2(x + m0 * ldx, ldx, r, w, K2, a); continue; }
#endif
    block_portable(x + m0 * ldx, ldx, r, w, K2, a);
  }
}

// Several rows on AVX2 (variant 2), F8_WIDE_ROWS or more: 4-row blocks (block_rows_avx2) decode every chunk of a panel
// once a block (16 times a panel at 64 rows). Here each slice of a panel (KC inputs) is decoded once, to fp32 in L1
// (decode_panel_avx2), and the panel kernel's fp32 row blocks (6 rows, 12 sums) run over it, a chunk of blocks whose
// rows fit in L2 at a time, each output's sums going on from slice to slice: the bf16 panel kernel's walk of its
// blocked rows (panel_kernel.cpp blocked_walk, wide_sums) with each slice decoded instead of widened. The rows are
// scaled as every vector variant's, each output the same chain of fused multiply-adds in the same order, so the same
// bits as the 4-row blocks. SmolLM2's four Linear shapes through
// fp8_linear, 2 threads, 2-core AVX2 EPYC (Zen 2), three processes of each build alternating: 64 rows 2.28-2.54 ->
// 1.94-2.21 ms, 24-48 rows 1.05-1.2x, 16 rows either way (0.57-0.87 against 0.66-0.84 ms), 8-12 rows slower; a
// 64-row decode step of SmolLM2 FP8 + FP8 head 173-174 -> 152-164 ms (bf16's: 158).
constexpr int64_t F8_WIDE_ROWS = 24;

#if F8_X86
template <typename Store>
void wide_rows_avx2(const float* x, int64_t M, int64_t ldx, int64_t K2, const uint8_t* w, int64_t p0, int64_t p1,
                    const Store& store, int64_t q) {
  alignas(64) float wide[panel_src::KC * F8_NR];
  panel_src::blocked_walk(
      M, ldx, K2, panel_src::KC / 2, p0, p1,
      [&](int64_t p, int64_t k0, int64_t kc, int64_t nb, int64_t c0, int64_t c1, float* acc) {
        decode_panel_avx2(w + (p * K2 + k0) * 32, kc, wide);
        panel_src::wide_sums(x, M, nb, ldx, c0, c1, k0, kc, acc, wide);
      },
      store, q);
}
#endif

// panels [p0, p1) of the Linear: x (M, ldx) fp32, scaled by X_UP for the vector variants; the sums' scale back:
// 2^8 (portable), 2^30 (vector). Each panel's sums do not depend on the split (one row: groups of F8_G panels,
// the rest one at a time, in the same order), so any split over threads gives the same bits; res may be out
template <typename T>
void fp8_range(int64_t v, const float* x, int64_t M, int64_t ldx, int64_t K2, const uint8_t* w, int64_t N,
               const float* s, const float* bias, const T* res, T* out, int64_t p0, int64_t p1, bool backward = false,
               int64_t q = -1) {
  const float back = v == 1 ? 0x1p8f : 1.f / (X_UP * W_DOWN);
  float acc[F8_GW * F8_NR];
  // rows [m0, m0 + r) of panel p from acc (r, F8_NR)
  auto store = [&](int64_t p, int64_t m0, int r, const float* a) {
    const int64_t n0 = p * F8_NR, nn = std::min(F8_NR, N - n0);
    if (nn == F8_NR) {  // a full panel: the panel kernel's vector store of the scaled sums (its rounding is torch's)
      float t[F8_NR];
      for (int m = 0; m < r; ++m) {
        for (int j = 0; j < F8_NR; ++j) t[j] = a[m * F8_NR + j] * (s[n0 + j] * back);
        const int64_t i = (m0 + m) * N + n0;
        panel_src::store16(t, bias ? bias + n0 : nullptr, res ? res + i : nullptr, out + i);
      }
      return;
    }
    for (int m = 0; m < r; ++m)
      for (int64_t j = 0; j < nn; ++j) {
        const int64_t i = (m0 + m) * N + n0 + j;
        const T y = static_cast<T>(a[m * F8_NR + j] * (s[n0 + j] * back) + (bias ? bias[n0 + j] : 0.f));
        out[i] = res ? static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(y)) : y;
      }
  };
#if F8_X86
  // One row on AVX2: blocks of n passes (2 <= n <= F8_BLOCK), pass j of a block its panels j, n + j, 2 n + j, 3 n + j:
  // each of a pass's F8_G streams runs on, contiguous, into its next pass's panel, so a stream is n panels long, not
  // one. A core reads memory faster in longer streams: one row from memory on the 2-core AVX2 EPYC (Zen 2), the
  // same kernel, 4 streams at once, each n panels of 9 KB (SmolLM2's width) long: one thread 13.3 GB/s at n = 1,
  // 17.0 at 4, 18.6 at 16; two 25.0 -> 30.6 at 4 (a standalone loop over 256 MB). In the model (FP8 + FP8 head, batch
  // 1, 2 threads, both ways switched every 16 or 64 steps in one process, medians of ~380 steps a way, 4 runs): the
  // fused step 0.945-0.966x, the FP8 head (fp8_linear_f32, 3,072 panels) 0.88-0.92x; 8 or 16 passes a block with
  // claims of 32 or more: within 1.5 % of 4. A thread claiming from the back (fused_team.cpp) takes its blocks from the
  // last, each block's passes in order. A panel's sums do not depend on which panels share its pass: the same bits
  if (M == 1 && v == 2) {
    const int64_t panel = K2 * 32;
    // n passes from panel b: pass j its panels b + j, b + n + j, b + 2 n + j, ..; after: the block read next
    auto block = [&](int64_t b, int64_t n, int64_t after) {
      for (int64_t j = 0; j < n; ++j) {
        row_avx2<F8_G>(x, w + (b + j) * panel, panel, K2, acc, n * panel, j + 1 < n ? panel : (after - b - j) * panel);
        for (int s = 0; s < F8_G; ++s) store(b + j + s * n, 0, 1, acc + s * F8_NR);
      }
    };
    const auto passes = [&] { return std::min(F8_BLOCK, (p1 - p0) / F8_G); };  // the next block's, in [p0, p1)
    for (int64_t n = passes(); n >= 2; n = passes()) {
      const int64_t b = backward ? p1 - n * F8_G : p0;
      (backward ? p1 : p0) = backward ? b : b + n * F8_G;
      block(b, n, backward ? b - passes() * F8_G : p0);
    }
  }
#endif
  // backward (one row, variants 2-4: a team thread claiming from the back, fused_team.cpp): the same passes from the
  // last to the first, the single panels past the last whole pass first, each pass requesting the one before it
  if (M == 1 && backward && v >= 2 && v <= 4) {
    const int64_t whole = p0 + (p1 - p0) / F8_G * F8_G;
    for (int64_t p = p1 - 1; p >= whole; --p) {
      sums(v, x, ldx, K2, 0, 1, 1, w + p * K2 * 32, acc);
      store(p, 0, 1, acc);
    }
    for (int64_t p = whole - F8_G; p >= p0; p -= F8_G) {
      sums(v, x, ldx, K2, 0, 1, F8_G, w + p * K2 * 32, acc, true);
      for (int i = 0; i < F8_G; ++i) store(p + i, 0, 1, acc + i * F8_NR);
    }
    return;
  }
#if F8_X86
  if (v == 2 && M >= F8_WIDE_ROWS) return wide_rows_avx2(x, M, ldx, K2, w, p0, p1, store, q);
#endif
  for (int64_t p = p0; p < p1;) {
    if (M == 1) {
      const int g = v == 5 ? static_cast<int>(std::min<int64_t>(F8_GW, p1 - p)) : p + F8_G <= p1 ? F8_G : 1;
      sums(v, x, ldx, K2, 0, 1, g, w + p * K2 * 32, acc, backward && v == 5);  // (5: requests the group before)
      for (int i = 0; i < g; ++i) store(p + i, 0, 1, acc + i * F8_NR);
      p += g;
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += F8_MR) {
      const int r = static_cast<int>(std::min<int64_t>(F8_MR, M - m0));
      sums(v, x, ldx, K2, m0, r, 1, w + p * K2 * 32, acc);
      store(p, m0, r, acc);
    }
    ++p;
  }
}

// all panels (fp8_range) over torch's intra-op threads: one row, a static share each (its passes); more rows, claims
// of panels (panel_src::claimed_for), chunk by chunk where the rows are blocked (as the panel kernel's run_blocked)
template <typename T>
void run_fp8(int64_t v, const float* x, int64_t M, int64_t ldx, int64_t K2, const uint8_t* w, int64_t N,
             const float* s, const float* bias, const T* res, T* out) {
  const int64_t P = (N + F8_NR - 1) / F8_NR;
  auto range = [&](int64_t p0, int64_t p1, int64_t q) {
    fp8_range<T>(v, x, M, ldx, K2, w, N, s, bias, res, out, p0, p1, false, q);
  };
  if (M == 1) return at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { range(p0, p1, -1); });
  int64_t chunks = 1;
#if F8_X86
  if (v == 2 && M >= F8_WIDE_ROWS) chunks = panel_src::chunks_of(M, ldx);
#endif
  panel_src::claimed_chunks(chunks, P, [&](int64_t q, int64_t p0, int64_t p1) { range(p0, p1, chunks > 1 ? q : -1); });
}

}  // namespace

// the variant `variant` resolves to on this CPU for fp32 or bf16 rows (0: the best it has for them), or an error
// naming what it lacks
int64_t fp8_variant(int64_t variant, bool bf16) {
  TORCH_CHECK(variant >= 0 && variant <= 6, "fp8 kernel: variant 0 (auto), 1 (portable), 2 (avx2), 3 (avx512), "
              "4 (avx512_on_avx2: variant 3's body built for AVX2), 5 (avx512bf16), 6 (avx512bf16_emulated), got ",
              variant);
  if (variant == 0) return bf16 && has_avx512bf16() ? 5 : has_avx512() ? 3 : has_avx2() ? 2 : 1;
  TORCH_CHECK((variant != 2 && variant != 4) || has_avx2(), "fp8 kernel: the avx2 and avx512_on_avx2 variants need "
              "AVX2 and FMA, which this CPU lacks");
  TORCH_CHECK(variant != 3 || has_avx512(), "fp8 kernel: the avx512 variant needs AVX-512F and AVX-512DQ, which this "
              "CPU lacks");
  TORCH_CHECK(variant < 5 || bf16, "fp8 kernel: the avx512bf16 variants take bfloat16 rows (a product of two bf16 "
              "numbers), got float32 rows");
  TORCH_CHECK(variant != 5 || has_avx512bf16(), "fp8 kernel: the avx512bf16 variant needs AVX-512F, AVX-512BW and "
              "AVX512-BF16, which this CPU lacks");
  return variant;
}

// weight (N, K) uint8 (e4m3 bytes) -> panels (ceil(N / 16), ceil(K / 2), 32) uint8: for each pair of inputs a
// 32-byte chunk holding each output's two bytes side by side, outputs in ORDER (the vector decoding's lane
// order); padded outputs and a padded odd input zero
torch::Tensor fp8_pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kByte, "fp8_pack_panels: (N, K) uint8 e4m3 bytes");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + F8_NR - 1) / F8_NR, K2 = (K + 1) / 2;
  auto padded = torch::zeros({P * F8_NR, 2 * K2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  auto order = torch::tensor(std::vector<int64_t>(ORDER, ORDER + F8_NR), torch::kLong);
  return padded.view({P, F8_NR, K2, 2}).permute({0, 2, 1, 3}).index_select(2, order).contiguous().view({P, K2, 32});
}

// x (M, K) float32 / bfloat16; panels (P, K, 16) uint8; scales (N) fp32 per-output; bias (N) or none; residual
// (M, N) of x's dtype or none -> (M, N) in x's dtype: scale[n] * (x @ fp8(W)^T)[:, n] + bias[n], rounded, plus
// the residual (rounded again, as torch's `res + y`); out_float: (M, N) fp32, unrounded (no residual), the row
// variant still the one x's dtype picks
torch::Tensor fp8_linear_impl(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                              c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, int64_t variant,
                              bool out_float) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "fp8_linear: x (M, K) float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), P = (N + F8_NR - 1) / F8_NR, K2 = (K + 1) / 2;
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.is_contiguous() && panels.dim() == 3 &&
              panels.size(0) == P && panels.size(1) == K2 && panels.size(2) == 32,
              "fp8_linear: panels (ceil(N / 16), ceil(K / 2), 32) uint8 (fp8_pack_panels)");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              "fp8_linear: one float32 scale an output (", N, "), got ", scales.numel(), " ", scales.scalar_type());
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->scalar_type() == torch::kFloat ? bias->contiguous() : bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "fp8_linear: bias of N outputs");
    bp = bf.data_ptr<float>();
  }
  const bool with_res = residual.has_value() && residual->defined();
  if (with_res)
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == M && residual->size(1) == N, "fp8_linear: a contiguous (M, N) residual of x's dtype");
  const int64_t v = fp8_variant(variant, x.scalar_type() == torch::kBFloat16);
  // x as fp32 rows (M, 2 K2), the odd input's pad zero; scaled by X_UP for the vector variants (exact: a
  // power of two)
  std::vector<float> xf(M * 2 * K2, 0.f);
  const float up = v == 1 ? 1.f : X_UP;
  auto xc = x.contiguous();
  const float* x32 = x.scalar_type() == torch::kFloat ? xc.data_ptr<float>() : nullptr;
  const c10::BFloat16* x16 = x32 ? nullptr : xc.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      xf[m * 2 * K2 + k] = up * (x32 ? x32[m * K + k] : static_cast<float>(x16[m * K + k]));
  TORCH_CHECK(!(out_float && with_res), "fp8_linear: an fp32 output takes no residual");
  auto out = torch::empty({M, N}, x.options().dtype(out_float ? torch::kFloat : x.scalar_type()));
  const uint8_t* w = panels.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (out.scalar_type() == torch::kFloat)
    run_fp8<float>(v, xf.data(), M, 2 * K2, K2, w, N, s, bp, with_res ? residual->data_ptr<float>() : nullptr,
                   out.data_ptr<float>());
  else
    run_fp8<c10::BFloat16>(v, xf.data(), M, 2 * K2, K2, w, N, s, bp,
                           with_res ? residual->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>());
  return out;
}

torch::Tensor fp8_linear_res(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                             c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, int64_t variant) {
  return fp8_linear_impl(x, panels, scales, N, bias, residual, variant, false);
}

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                         c10::optional<torch::Tensor> bias, int64_t variant) {
  return fp8_linear_impl(x, panels, scales, N, bias, c10::nullopt, variant, false);
}

// fp8_linear's sums in fp32, not rounded to x's dtype (a vocabulary head's logits: engines/cpu/fp8_linear.py
// Fp8PanelLinear.forward_float)
torch::Tensor fp8_linear_f32(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                             c10::optional<torch::Tensor> bias, int64_t variant) {
  return fp8_linear_impl(x, panels, scales, N, bias, c10::nullopt, variant, true);
}
