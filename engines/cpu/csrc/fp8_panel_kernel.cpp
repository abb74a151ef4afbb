// FP8 (e4m3) weight-only Linear for CPU decode: built after csrc/panel_kernel.cpp into one module and bound
// by engines/cpu/panel_kernel.py (fp8_*); the fused decode step (csrc/fused_decode.cpp) calls fp8_linear_res.
//
// The weight stays one byte a weight in memory, stored as panels (ceil(N / 16), K, 16) of e4m3 bytes: 16
// outputs side by side for each input, so a panel is one sequential read. Each byte is widened in registers
// to the fp16 whose value is the weight times 2^-8, exactly (subnormals included): a byte b placed in the
// high half of a 16-bit lane, shifted right by one arithmetically and bit 14 cleared, is
// s 0 eeee mmm 0000000, an fp16 with the e4m3 exponent under a bias of 15 instead of 7. F16C's vcvtph2ps then
// gives the fp32 (the e4m3 NaN pattern, 0x7f / 0xff, reads as +-480: weights hold no NaN). That is 3 integer
// ops and a conversion per 8-16 weights, against 7 for widening to 32-bit lanes and shifting the bits into
// an fp32 (the kernel this replaced; measured in benchmarks/bench_panel_kernel.py --fp8). Sums over the
// inputs in fp32, in order, one fused multiply-add an input (std::fma in the portable variant, so every
// variant gives the same bits); the per-output (channel) scale times 2^8 and the bias applied once at the
// end: y[m, n] = scale[n] * sum_k x[m, k] w[n, k] + bias[n], rounded to x's dtype (+ a residual, rounded
// again, as torch's `res + y`).
//
// Variants, chosen at run time (variant 0) or forced: 1 portable (scalar C++, the reference), 2 AVX2 + FMA +
// F16C (8 lanes, two registers a panel), 3 AVX-512F/BW (16 lanes). Each is compiled for its own target
// whatever the build host (function target attributes), and runs only where the CPU has it (checked per
// call). One row (batch-1 decode) runs G panels at once: 2G independent FMA chains keep the loads streaming.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define F8_X86 1
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t F8_NR = 16;  // outputs per panel
constexpr int F8_MR = 6;       // rows per block: 2 x 6 accumulators + 2 weights + 1 broadcast of 16 ymm
constexpr int F8_G = 4;        // panels a pass for one row

// e4m3 byte -> its value times 2^-8 (fp32, exact), as the vector variants decode it
inline float e4m3_scaled(uint8_t b) {
  const float mag = std::ldexp(static_cast<float>(b & 7), -3);  // mantissa / 8
  const int e = (b >> 3) & 15;
  const float v = e ? std::ldexp(1.f + mag, e - 7 - 8) : std::ldexp(mag, -6 - 8);
  return (b & 0x80) ? -v : v;
}

// acc (r, F8_NR) = x[m0 : m0 + r] (r, K; rows ldx apart) @ w (K, F8_NR) decoded; x fp32
void block_portable(const float* x, int64_t ldx, int r, const uint8_t* w, int64_t K, float* acc) {
  std::fill(acc, acc + r * F8_NR, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < F8_NR; ++j) {
      const float wk = e4m3_scaled(w[k * F8_NR + j]);
      for (int m = 0; m < r; ++m) acc[m * F8_NR + j] = std::fma(x[m * ldx + k], wk, acc[m * F8_NR + j]);
    }
}

#if F8_X86
// 16 e4m3 bytes -> two fp32 vectors (outputs 0-7, 8-15) of the weights times 2^-8
__attribute__((target("avx2,fma,f16c"))) inline void decode16_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i keep = _mm_set1_epi16(static_cast<short>(0xBFFF)), zero = _mm_setzero_si128();
  const __m128i h0 = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, b), 1), keep);  // 8 fp16
  const __m128i h1 = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, b), 1), keep);
  lo = _mm256_cvtph_ps(h0);
  hi = _mm256_cvtph_ps(h1);
}

__attribute__((target("avx2,fma,f16c"))) void block_avx2(const float* x, int64_t ldx, int r, const uint8_t* w,
                                                          int64_t K, float* acc) {
  __m256 c[2 * F8_MR];
  for (int i = 0; i < 2 * F8_MR; ++i) c[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    decode16_avx2(w + k * F8_NR, w0, w1);
    for (int m = 0; m < r; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
      c[2 * m] = _mm256_fmadd_ps(xv, w0, c[2 * m]);
      c[2 * m + 1] = _mm256_fmadd_ps(xv, w1, c[2 * m + 1]);
    }
  }
  for (int m = 0; m < r; ++m) {
    _mm256_storeu_ps(acc + m * F8_NR, c[2 * m]);
    _mm256_storeu_ps(acc + m * F8_NR + 8, c[2 * m + 1]);
  }
}

// one row through G panels (panel bytes apart): acc (G, F8_NR)
template <int G>
__attribute__((target("avx2,fma,f16c"))) void row_avx2(const float* x, const uint8_t* w, int64_t panel, int64_t K,
                                                        float* acc) {
  __m256 c[2 * G];
  for (int i = 0; i < 2 * G; ++i) c[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int g = 0; g < G; ++g) {
      __m256 w0, w1;
      decode16_avx2(w + g * panel + k * F8_NR, w0, w1);
      c[2 * g] = _mm256_fmadd_ps(xv, w0, c[2 * g]);
      c[2 * g + 1] = _mm256_fmadd_ps(xv, w1, c[2 * g + 1]);
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(acc + g * F8_NR, c[2 * g]);
    _mm256_storeu_ps(acc + g * F8_NR + 8, c[2 * g + 1]);
  }
}

// 16 e4m3 bytes -> one fp32 vector of the weights times 2^-8
__attribute__((target("avx512f,avx512bw,avx2,f16c"))) inline __m512 decode16_avx512(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // 16 x u16
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_cvtph_ps(h);
}

__attribute__((target("avx512f,avx512bw,avx2,f16c"))) void block_avx512(const float* x, int64_t ldx, int r,
                                                                         const uint8_t* w, int64_t K, float* acc) {
  __m512 c[F8_MR];
  for (int i = 0; i < F8_MR; ++i) c[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wv = decode16_avx512(w + k * F8_NR);
    for (int m = 0; m < r; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), wv, c[m]);
  }
  for (int m = 0; m < r; ++m) _mm512_storeu_ps(acc + m * F8_NR, c[m]);
}

template <int G>
__attribute__((target("avx512f,avx512bw,avx2,f16c"))) void row_avx512(const float* x, const uint8_t* w,
                                                                       int64_t panel, int64_t K, float* acc) {
  __m512 c[G];
  for (int g = 0; g < G; ++g) c[g] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 xv = _mm512_set1_ps(x[k]);
    for (int g = 0; g < G; ++g) c[g] = _mm512_fmadd_ps(xv, decode16_avx512(w + g * panel + k * F8_NR), c[g]);
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * F8_NR, c[g]);
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
#else  // not x86: the portable variant only
bool has_avx2() { return false; }
bool has_avx512() { return false; }
#endif

// the sums of panels [p, p + g) for rows [m0, m0 + r) of x (M, K fp32) -> acc (g or r, F8_NR)
void sums(int64_t v, const float* x, int64_t K, int64_t m0, int r, int g, const uint8_t* wp, float* acc) {
  const int64_t panel = K * F8_NR;
#if F8_X86
  if (r == 1 && g == F8_G && v == 3) return row_avx512<F8_G>(x + m0 * K, wp, panel, K, acc);
  if (r == 1 && g == F8_G && v == 2) return row_avx2<F8_G>(x + m0 * K, wp, panel, K, acc);
#endif
  for (int i = 0; i < g; ++i) {  // (g == 1 unless one row)
    float* a = acc + i * F8_NR;
    const uint8_t* w = wp + i * panel;
#if F8_X86
    if (v == 3) { block_avx512(x + m0 * K, K, r, w, K, a); continue; }
    if (v == 2) { block_avx2(x + m0 * K, K, r, w, K, a); continue; }
#endif
    block_portable(x + m0 * K, K, r, w, K, a);
  }
}

template <typename T>
void run_fp8(int64_t v, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* s,
             const float* bias, const T* res, T* out) {
  const int64_t P = (N + F8_NR - 1) / F8_NR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float acc[F8_MR * F8_NR > F8_G * F8_NR ? F8_MR * F8_NR : F8_G * F8_NR];
    // rows [m0, m0 + r) of panel p from acc (r, F8_NR)
    auto store = [&](int64_t p, int64_t m0, int r, const float* a) {
      const int64_t n0 = p * F8_NR, nn = std::min(F8_NR, N - n0);
      for (int m = 0; m < r; ++m)
        for (int64_t j = 0; j < nn; ++j) {
          const int64_t i = (m0 + m) * N + n0 + j;
          const T y = static_cast<T>(a[m * F8_NR + j] * (s[n0 + j] * 256.f) + (bias ? bias[n0 + j] : 0.f));
          out[i] = res ? static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(y)) : y;
        }
    };
    for (int64_t p = p0; p < p1;) {
      if (M == 1) {
        const int g = p + F8_G <= p1 ? F8_G : 1;
        sums(v, x, K, 0, 1, g, w + p * K * F8_NR, acc);
        for (int i = 0; i < g; ++i) store(p + i, 0, 1, acc + i * F8_NR);
        p += g;
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += F8_MR) {
        const int r = static_cast<int>(std::min<int64_t>(F8_MR, M - m0));
        sums(v, x, K, m0, r, 1, w + p * K * F8_NR, acc);
        store(p, m0, r, acc);
      }
      ++p;
    }
  });
}

}  // namespace

// the variant `variant` resolves to on this CPU (0: the best it has), or an error naming what it lacks
int64_t fp8_variant(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 3, "fp8 kernel: variant 0 (auto), 1 (portable), 2 (avx2), 3 (avx512), got ",
              variant);
  if (variant == 0) return has_avx512() ? 3 : has_avx2() ? 2 : 1;
  TORCH_CHECK(variant != 2 || has_avx2(), "fp8 kernel: the avx2 variant needs AVX2, FMA and F16C, which this CPU lacks");
  TORCH_CHECK(variant != 3 || has_avx512(), "fp8 kernel: the avx512 variant needs AVX-512F and AVX-512BW, which this "
              "CPU lacks");
  return variant;
}

// weight (N, K) uint8 (e4m3 bytes) -> panels (ceil(N / 16), K, 16) uint8, padded outputs zero
torch::Tensor fp8_pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kByte, "fp8_pack_panels: (N, K) uint8 e4m3 bytes");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + F8_NR - 1) / F8_NR;
  auto padded = torch::zeros({P * F8_NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, F8_NR, K}).transpose(1, 2).contiguous();
}

// x (M, K) float32 / bfloat16; panels (P, K, 16) uint8; scales (N) fp32 per-output; bias (N) or none; residual
// (M, N) of x's dtype or none -> (M, N) in x's dtype: scale[n] * (x @ fp8(W)^T)[:, n] + bias[n], rounded, plus
// the residual (rounded again, as torch's `res + y`)
torch::Tensor fp8_linear_res(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                             c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "fp8_linear: x (M, K) float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), P = (N + F8_NR - 1) / F8_NR;
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.is_contiguous() && panels.dim() == 3 &&
              panels.size(0) == P && panels.size(1) == K && panels.size(2) == F8_NR, "fp8_linear: panels (ceil(N / 16), K, 16) uint8");
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
  const int64_t v = fp8_variant(variant);
  // x as contiguous fp32 rows (M, K): a bf16 x widened here, not through a torch op (~us a call)
  std::vector<float> xf;
  const float* xp;
  auto xc = x.contiguous();
  if (x.scalar_type() == torch::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xf.resize(M * K);
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    xp = xf.data();
  }
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* w = panels.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (x.scalar_type() == torch::kFloat)
    run_fp8<float>(v, xp, M, K, w, N, s, bp, with_res ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>());
  else
    run_fp8<c10::BFloat16>(v, xp, M, K, w, N, s, bp, with_res ? residual->data_ptr<c10::BFloat16>() : nullptr,
                           out.data_ptr<c10::BFloat16>());
  return out;
}

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                         c10::optional<torch::Tensor> bias, int64_t variant) {
  return fp8_linear_res(x, panels, scales, N, bias, c10::nullopt, variant);
}
