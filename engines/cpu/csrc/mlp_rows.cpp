// The MLP's activation on CPU (compiled before csrc/fused_decode.cpp, at namespace scope): SwiGLU and the tanh GELU a
// row at a time (swiglu_rows, gelu_span: the module path's and the fused step's), and for a prefill chunk on AVX2 the
// up Linear with the activation in its store (panel_swiglu, panel_gelu: the Linear's output is never written whole).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

// SwiGLU of u's rows (M, 2 ffn; gate first, rows ldu apart) into out (M, ffn), T: silu in fp32 (g * sigmoid(g),
// the exponential of -|g| 16 lanes at a time, paged_src::exp_nonpos, relative error ~2e-7), rounded to T, then
// times up (torch's T * T: the fp32 product rounded once): MLP.forward's silu(gate) * up in one pass a row
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// 8 fp32 rounded to bf16 as c10 rounds them (to nearest even, a NaN to 0x7FC0), as fp32 (panel_src::round_bf16)
inline __m256 round8_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                      _mm256_and_si256(_mm256_srli_epi32(u, 16), one)),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline void store8(float* o, __m256 y) { _mm256_storeu_ps(o, y); }
inline void store8(c10::BFloat16* o, __m256 y) {  // y already bf16 values
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(y), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// A build for AVX2 without AVX-512: swiglu_rows' 16-lane vector code kept its lanes on the stack there (the clamp at
// -87 a scalar max a lane; 2,048 rows of SmolLM2's MLP ~7 ms on 2 Zen 3 cores, torch's silu * up ~4). The same
// steps 8 lanes at a time in intrinsics, as GCC contracted exp16 in that build (y = v log2 e never rounded: the
// rounding constant and f = y - r are fused multiply-adds; the polynomial in fused multiply-adds; paged_src::exp8,
// csrc/paged_causal.cpp): the same bits.
// silu(g) * up for 8 lanes (swiglu_rows' vector loop)
template <typename T>
inline void swiglu8(const T* g, const T* up, T* o) {
  const __m256 x = load8f(g), v = _mm256_or_ps(x, _mm256_set1_ps(-0.f));  // -|g|
  __m256 e = paged_src::exp8(v);
  if (const int low = _mm256_movemask_ps(paged_src::below_87(v))) {  // rare
    alignas(32) float ev[8], vv[8];
    _mm256_store_ps(ev, e), _mm256_store_ps(vv, v);
    for (int j = 0; j < 8; ++j)
      if (low >> j & 1) ev[j] = std::exp(vv[j]);
    e = _mm256_load_ps(ev);
  }
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, _mm256_set1_ps(1.f), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)), d);
  if constexpr (std::is_same_v<T, float>)
    store8(o, _mm256_mul_ps(_mm256_mul_ps(x, sig), load8f(up)));
  else
    store8(o, round8_bf16(_mm256_mul_ps(round8_bf16(_mm256_mul_ps(x, sig)), load8f(up))));
}
#endif

template <typename T>
void swiglu_rows(const T* u, int64_t ldu, int64_t ffn, T* out, int64_t M) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
    for (int64_t m = 0; m < M; ++m) {
      const T* g = u + m * ldu;
      T* o = out + m * ffn;
      int64_t i = 0;
      for (; i + 8 <= ffn; i += 8) swiglu8(g + i, g + ffn + i, o + i);
      for (; i < ffn; ++i) {
        float e = -std::fabs(static_cast<float>(g[i]));
        paged_src::exp_nonpos(&e, 1);
        const float x = static_cast<float>(g[i]), sig = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(x * sig)) * static_cast<float>(g[ffn + i]));
      }
    }
    return;
  }
#endif
  constexpr int64_t CH = 256;
  float e[CH];
  for (int64_t m = 0; m < M; ++m) {
    const T* g = u + m * ldu;
    const T* up = g + ffn;
    T* o = out + m * ffn;
    for (int64_t i0 = 0; i0 < ffn; i0 += CH) {
      const int64_t c = std::min(CH, ffn - i0);
      for (int64_t i = 0; i < c; ++i) e[i] = -std::fabs(static_cast<float>(g[i0 + i]));
      paged_src::exp_nonpos(e, c);
      int64_t i = 0;
      if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
        // 16 lanes at a time, the same arithmetic: the division and products are IEEE fp32 whether scalar or
        // vector, and the two roundings to bf16 are c10's (panel_src::round_bf16), where the scalar loop rounded
        // through c10::BFloat16 a value at a time (1,740 rows of SmolLM2's MLP, one thread: 2.58 -> 2.24 ms;
        // fp32 ran the scalar loop: 12.5 ms on two AVX2 cores, torch's silu and product 3.8)
        using paged_src::vf;
        for (; i + paged_src::W <= c; i += paged_src::W) {
          const vf x = paged_src::load16(g + i0 + i), ev = paged_src::load16(e + i), d = 1.f + ev;
          const vf sig = (x >= 0.f ? vf{} + 1.f : ev) / d;  // one division: 1 / d or e / d, as the scalar branch
          if constexpr (std::is_same_v<T, float>) {
            const vf y = x * sig * paged_src::load16(up + i0 + i);
            std::memcpy(o + i0 + i, &y, sizeof(y));
          } else {
            const vf y = panel_src::round_bf16(panel_src::round_bf16(x * sig) * paged_src::load16(up + i0 + i));
            const paged_src::vh h = __builtin_convertvector(panel_src::as_u(y) >> 16, paged_src::vh);
            std::memcpy(o + i0 + i, &h, sizeof(h));
          }
        }
      }
      for (; i < c; ++i) {
        const float x = static_cast<float>(g[i0 + i]);
        const float sig = x >= 0.f ? 1.f / (1.f + e[i]) : e[i] / (1.f + e[i]);
        o[i0 + i] = static_cast<T>(static_cast<float>(static_cast<T>(x * sig)) * static_cast<float>(up[i0 + i]));
      }
    }
  }
}

// silu(u[:, :ffn]) * u[:, ffn:] of u (M, 2 ffn) as a new (M, ffn) tensor: swiglu_rows over torch's threads
// (inline inside the fused team's region); rows of another dtype or layout: the torch ops
torch::Tensor swiglu(const torch::Tensor& u, int64_t ffn) {
  const auto st = u.scalar_type();
  if (u.dim() != 2 || u.size(1) != 2 * ffn || u.stride(1) != 1 ||
      (st != at::kFloat && st != at::kBFloat16 && st != at::kHalf))
    return at::silu(u.narrow(-1, 0, ffn)) * u.narrow(-1, ffn, ffn);
  const int64_t M = u.size(0), ld = u.stride(0);
  auto out = torch::empty({M, ffn}, u.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "swiglu", [&] {
    at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
      swiglu_rows(u.data_ptr<scalar_t>() + b * ld, ld, ffn, out.data_ptr<scalar_t>() + b * ffn, e - b);
    });
  });
  return out;
}

// GELU in its tanh form (GPT-2's gelu_new): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), computed as
// x sigmoid(2u) (the same function: 1 + tanh(u) = 2 / (1 + e^-2u)) from e = exp(-|2u|) (paged_src::exp8, relative
// error ~2e-7): x / (1 + e) where 2u >= 0, x e / (1 + e) below. torch's vectorized kernel takes tanh from Sleef, ~10
// cycles an element: a GPT-2 decode step of 60 rows spent 0.69 ms a layer in it on one Zen 2 thread (~8 % of a ~100 ms
// step), a 2,048-row prefill chunk 10.7 ms a layer on two; this one ~3 cycles (0.18 ms at 60 rows). Within 1.4e-7 |x|
// of the exact function over -12 .. 12 and 100k N(0, 9) values (torch's: 1.0e-7), 4.8e-7 from torch's at most. -0,
// +-inf and NaN as torch's; e^-|2u| below e^-87 counts as 0 (torch's 1 + tanh is 0 there too).
constexpr float GELU_A = 1.5957691216057308f, GELU_B = 0.0713548162726f;  // 2 sqrt(2 / pi), times 0.044715
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(GELU_B), _mm256_set1_ps(GELU_A)));
  const __m256 v = _mm256_or_ps(t, _mm256_set1_ps(-0.f));  // -|2u|
  const __m256 e = _mm256_andnot_ps(paged_src::below_87(v), paged_src::exp8(v));
  const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.f), _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
}
#endif

// o[i] = gelu_tanh(u[i]) for n values (o may be u), T fp32 or bf16 (computed in fp32, rounded once): 8 lanes at a time,
// a tail through the same lanes (so a value's bits do not depend on where it sits in the row)
template <typename T>
void gelu_span(const T* u, T* o, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  auto put = [](T* dst, __m256 y) {
    if constexpr (std::is_same_v<T, float>) store8(dst, y);
    else store8(dst, round8_bf16(y));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) put(o + i, gelu_tanh8(load8f(u + i)));
  if (i < n) {
    alignas(32) T t[8] = {};
    std::copy(u + i, u + n, t);
    put(t, gelu_tanh8(load8f(t)));
    std::copy(t, t + (n - i), o + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(u[i]), t = x * (x * x * GELU_B + GELU_A);
    const float e = std::fabs(t) > 87.f ? 0.f : std::exp(-std::fabs(t));
    o[i] = static_cast<T>(x * ((t >= 0.f ? 1.f : e) / (1.f + e)));
  }
#endif
}

// rows [r0, r1) of the tanh GELU of u (M, N; rows u.stride(0) apart) into out (M, N) contiguous, fp32 / bf16
void gelu_range(const torch::Tensor& u, torch::Tensor& out, int64_t r0, int64_t r1) {
  const int64_t ld = u.stride(0), N = u.size(1);
  for (int64_t m = r0; m < r1; ++m) {
    if (u.scalar_type() == at::kFloat) gelu_span(u.data_ptr<float>() + m * ld, out.data_ptr<float>() + m * N, N);
    else gelu_span(u.data_ptr<c10::BFloat16>() + m * ld, out.data_ptr<c10::BFloat16>() + m * N, N);
  }
}

bool gelu_direct(const torch::Tensor& u) {  // rows gelu_span takes; other dtypes or layouts: at::gelu
  return u.dim() == 2 && u.stride(1) == 1 && (u.scalar_type() == at::kFloat || u.scalar_type() == at::kBFloat16);
}

// The tanh GELU of u (M, N) into out (allocated unless it is (M, N) already; may be u itself), over torch's threads
// (inline inside the fused team's region): the module path's, the fused step's and panel_gelu's arithmetic
void gelu_into(const torch::Tensor& u, torch::Tensor& out) {
  if (!gelu_direct(u)) {
    out = at::gelu(u, "tanh").contiguous();
    return;
  }
  const int64_t M = u.size(0);
  if (!out.defined() || !out.is_contiguous() || out.sizes() != u.sizes() || out.scalar_type() != u.scalar_type())
    out = torch::empty({M, u.size(1)}, u.options());
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) { gelu_range(u, out, b, e); });
}

// the tanh GELU of u in place (the kernels' own fresh outputs: run_half's, panel_gelu's): u itself (another dtype or
// layout: a new tensor, at::gelu's)
torch::Tensor gelu_tanh_(torch::Tensor u) {
  torch::Tensor out = gelu_direct(u) && u.is_contiguous() ? u : torch::Tensor();
  gelu_into(u, out);
  return out;
}

// the module path's tanh GELU (engines/cpu/module_ops.py gelu_tanh) as a new tensor: u may be what a forward hook on
// the Linear kept, so it is not written
torch::Tensor gelu_tanh_rows(torch::Tensor u) {
  torch::Tensor out;
  gelu_into(u, out);
  return out;
}

// x rows (blocked_inputs) through the gate panels [0, ffn / 16) and up panels [ffn / 16, ffn / 8) of a SwiGLU
// MLP's fused weight (no bias) -> silu(gate) * up into out (M, ffn): run_blocked's chunks of row blocks, 16 KB slices
// and carried sums, a gate panel and its up panel over the same chunk, their sums rounded to T as panel_linear's
// store rounds them, then swiglu_rows on those 16 + 16 values: swiglu(panel_linear(x))'s bits
template <typename T>
void blocked_swiglu(const float* xb, int64_t M, int64_t Kp, const T* w, int64_t ffn, T* out) {
#if PANEL_X86
  using panel_src::NR, panel_src::MR_AVX2;  // (local constexpr copies of these in the lambda's array bound: a GCC 12 ICE)
  constexpr int64_t XW = std::is_same_v<T, float> ? 1 : 2, KS = panel_src::slice_of<T>();
  const int64_t panel = Kp * NR * XW, ldx = Kp * XW, nb = (M + MR_AVX2 - 1) / MR_AVX2, half = ffn / NR;
  const int64_t chunk = panel_src::chunk_blocks(ldx);
  // (chunk, pair) items claimed chunk by chunk, as run_blocked's
  panel_src::claimed_chunks(panel_src::chunks_of(M, ldx), half, [&](int64_t q, int64_t p0, int64_t p1) {
    alignas(64) float acc[2][panel_src::CHUNK_MAX * MR_AVX2 * NR], wide[panel_src::KC * NR];
    const int64_t c0 = q * chunk, c1 = std::min(nb, c0 + chunk);
    for (int64_t p = p0; p < p1; ++p) {
      for (int h = 0; h < 2; ++h) {  // gate panel p, then up panel p + half
        const T* wp = w + (p + h * half) * panel;
        for (int64_t k0 = 0; k0 < Kp; k0 += KS)
          panel_src::slice_sums(xb, M, nb, ldx, c0, c1, wp + k0 * NR * XW, k0, std::min(KS, Kp - k0), acc[h], wide);
      }
      for (int64_t b = c0, m0, r; b < c1; ++b) {
        panel_src::row_block(b, M, nb, m0, r);
        for (int64_t m = 0; m < r; ++m) {
          T t[2 * NR];  // the gate's and the up's 16 outputs, rounded as panel_linear stores them (+ 0.f: -0 -> 0)
          for (int64_t c = 0; c < NR; ++c) {
            t[c] = static_cast<T>(acc[0][((b - c0) * MR_AVX2 + m) * NR + c] + 0.f);
            t[NR + c] = static_cast<T>(acc[1][((b - c0) * MR_AVX2 + m) * NR + c] + 0.f);
          }
          swiglu_rows(t, 2 * NR, NR, out + (m0 + m) * ffn + p * NR, 1);
        }
      }
    }
  });
#endif
}

// silu(gate) * up of a SwiGLU MLP's fused gate / up Linear (panels of 2 ffn outputs, gate first, no bias) on x (M,
// K) fp32 or bf16 -> (M, ffn) in x's dtype: for a prefill chunk on AVX2 (the blocked rows) in the kernel's store
// (blocked_swiglu: the (M, 2 ffn) product is never written nor read back, 25 MB a layer for SmolLM2's 2,048 fp32
// rows; the same bits); elsewhere swiglu(panel_linear(x)).
torch::Tensor panel_swiglu(torch::Tensor x, torch::Tensor panels, int64_t ffn, int64_t variant) {
  const int64_t v = panel_src::row_variant(variant);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == panels.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "panel_swiglu: x (M, K) float32 or bfloat16 and panels of its dtype");
  TORCH_CHECK(ffn >= 1 && panels.dim() >= 3 && panels.size(0) == (2 * ffn + 15) / 16,
              "panel_swiglu: panels of 2 ffn = ", 2 * ffn, " outputs");
  const int64_t M = x.size(0);
  if (!panel_src::blocked_rows(v, M, x.scalar_type() == torch::kBFloat16) || ffn % 16)
    return swiglu(panel_src::panel_linear_res(x, panels, 2 * ffn, c10::nullopt, c10::nullopt, variant), ffn);
  const bool bf = x.scalar_type() == torch::kBFloat16;
  const int64_t Kp = bf ? (x.size(1) + 1) / 2 : x.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.size(1) == Kp, "panel_swiglu: panels of x's ", x.size(1), " inputs");
  auto xb = panel_src::blocked_inputs(x);
  auto out = torch::empty({M, ffn}, x.options());
  if (bf) blocked_swiglu(xb.data_ptr<float>(), M, Kp, panels.data_ptr<c10::BFloat16>(), ffn, out.data_ptr<c10::BFloat16>());
  else blocked_swiglu(xb.data_ptr<float>(), M, Kp, panels.data_ptr<float>(), ffn, out.data_ptr<float>());
  return out;
}

// x (M, K) fp32 or bf16 through the panels of an MLP's up Linear (N outputs, optional bias) -> gelu_tanh(x W^T + b)
// (M, N) in x's dtype: for a prefill chunk on AVX2 (the blocked rows) in the kernel's store, each block's 16 outputs
// a row while they are in L1 (the (M, N) product is written once, not written, read and written again: 2,048 fp32
// rows of GPT-2's 3,072 outputs are 25 MB); elsewhere the Linear, then gelu_span in place. The same bits either way.
torch::Tensor panel_gelu(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias,
                         int64_t variant) {
  const int64_t v = panel_src::row_variant(variant);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == panels.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "panel_gelu: x (M, K) float32 or bfloat16 and panels of its dtype");
  TORCH_CHECK(N >= 1 && panels.dim() >= 3 && panels.size(0) == (N + 15) / 16, "panel_gelu: panels of N = ", N,
              " outputs");
  const int64_t M = x.size(0);
  if (!panel_src::blocked_rows(v, M, x.scalar_type() == torch::kBFloat16))
    return gelu_tanh_(panel_src::panel_linear_res(x, panels, N, bias, c10::nullopt, variant));
  const bool bf = x.scalar_type() == torch::kBFloat16;
  const int64_t Kp = bf ? (x.size(1) + 1) / 2 : x.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.size(1) == Kp, "panel_gelu: panels of x's ", x.size(1), " inputs");
  torch::Tensor bf32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "panel_gelu: a bias of N = ", N, " values");
    bf32 = bias->to(torch::kFloat).contiguous();
  }
  const float* bp = bf32.defined() ? bf32.data_ptr<float>() : nullptr;
  auto xb = panel_src::blocked_inputs(x);
  auto out = torch::empty({M, N}, x.options());
  auto go = [&](auto* o, const auto* w) {
    using O = std::remove_pointer_t<decltype(o)>;
    panel_src::run_blocked(xb.data_ptr<float>(), M, Kp, w, N, bp, static_cast<const O*>(nullptr), o,
                           [&](int64_t p, int64_t m0, int64_t r) {
                             const int64_t n0 = p * panel_src::NR, nn = std::min(panel_src::NR, N - n0);
                             for (int64_t m = m0; m < m0 + r; ++m) gelu_span(o + m * N + n0, o + m * N + n0, nn);
                           });
  };
  if (bf) go(out.data_ptr<c10::BFloat16>(), panels.data_ptr<c10::BFloat16>());
  else go(out.data_ptr<float>(), panels.data_ptr<float>());
  return out;
}

}  // namespace
