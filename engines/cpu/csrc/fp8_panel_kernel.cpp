// FP8 (e4m3) weight-only Linear for CPU decode: built after csrc/panel_kernel.cpp into one module and bound
// by engines/cpu/panel_kernel.py (fp8_*).
//
// The weight stays one byte a weight in memory, stored as panels (ceil(N / 16), K, 16) of e4m3 bytes: 16
// outputs side by side for each input, so a panel is one sequential read. Each byte is widened to fp32 in
// registers: the 7 bits below the sign, shifted into an fp32's exponent and mantissa fields, are the
// value times 2^-120 (subnormals included, as fp32 denormals), so one multiply by 2^120 and the sign bit
// give the exact value (the e4m3 NaN pattern, 0x7f / 0xff, reads as +-480: weights hold no NaN). Sums
// over the inputs in fp32, in order; the per-output (channel) scale and the bias applied once at the end:
// y[m, n] = scale[n] * sum_k x[m, k] w[n, k] + bias[n], rounded to x's dtype.
//
// Variants, chosen at run time (variant 0) or forced: 1 portable (scalar C++, the reference), 2 AVX2 + FMA
// (8 lanes, two registers a panel), 3 AVX-512 (16 lanes). Each is compiled for its own target whatever the
// build host (function target attributes), and runs only where the CPU has it (checked per call).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t F8_NR = 16;  // outputs per panel
constexpr int F8_MR = 8;       // rows per block

inline float e4m3(uint8_t b) {
  uint32_t u = static_cast<uint32_t>(b & 0x7f) << 20;
  float f;
  std::memcpy(&f, &u, 4);
  f *= 0x1p120f;
  return (b & 0x80) ? -f : f;
}

// acc (r, F8_NR) = xt[:, m0 : m0 + r]^T (r, K) @ w (K, F8_NR) decoded; xt (K, M) fp32
void block_portable(const float* xt, int64_t M, int64_t m0, int r, const uint8_t* w, int64_t K, float* acc) {
  std::fill(acc, acc + r * F8_NR, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    float wk[F8_NR];
    for (int64_t j = 0; j < F8_NR; ++j) wk[j] = e4m3(w[k * F8_NR + j]);
    for (int m = 0; m < r; ++m) {
      const float xv = xt[k * M + m0 + m];
      for (int64_t j = 0; j < F8_NR; ++j) acc[m * F8_NR + j] += xv * wk[j];
    }
  }
}

__attribute__((target("avx2,fma"))) void block_avx2(const float* xt, int64_t M, int64_t m0, int r, const uint8_t* w,
                                                     int64_t K, float* acc) {
  __m256 c[2 * F8_MR];
  for (int i = 0; i < 2 * r; ++i) c[i] = _mm256_setzero_ps();
  const __m256i low7 = _mm256_set1_epi32(0x7f), sign = _mm256_set1_epi32(0x80);
  const __m256 big = _mm256_set1_ps(0x1p120f);
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2];
    for (int h = 0; h < 2; ++h) {
      __m128i b;
      std::memcpy(&b, w + k * F8_NR + 8 * h, 8);  // 8 bytes into the low half
      const __m256i u = _mm256_cvtepu8_epi32(b);
      const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, low7), 20);
      const __m256i sg = _mm256_slli_epi32(_mm256_and_si256(u, sign), 24);
      wv[h] = _mm256_or_ps(_mm256_mul_ps(_mm256_castsi256_ps(mag), big), _mm256_castsi256_ps(sg));
    }
    const float* xk = xt + k * M + m0;
    for (int m = 0; m < r; ++m) {
      const __m256 xv = _mm256_set1_ps(xk[m]);
      c[2 * m] = _mm256_fmadd_ps(xv, wv[0], c[2 * m]);
      c[2 * m + 1] = _mm256_fmadd_ps(xv, wv[1], c[2 * m + 1]);
    }
  }
  for (int m = 0; m < r; ++m) {
    _mm256_storeu_ps(acc + m * F8_NR, c[2 * m]);
    _mm256_storeu_ps(acc + m * F8_NR + 8, c[2 * m + 1]);
  }
}

__attribute__((target("avx512f"))) void block_avx512(const float* xt, int64_t M, int64_t m0, int r, const uint8_t* w,
                                                      int64_t K, float* acc) {
  __m512 c[F8_MR];
  for (int i = 0; i < r; ++i) c[i] = _mm512_setzero_ps();
  const __m512i low7 = _mm512_set1_epi32(0x7f), sign = _mm512_set1_epi32(0x80);
  const __m512 big = _mm512_set1_ps(0x1p120f);
  for (int64_t k = 0; k < K; ++k) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * F8_NR)));
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(u, low7), 20);
    const __m512i sg = _mm512_slli_epi32(_mm512_and_si512(u, sign), 24);
    const __m512 wv = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(mag), big)), sg));
    const float* xk = xt + k * M + m0;
    for (int m = 0; m < r; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), wv, c[m]);
  }
  for (int m = 0; m < r; ++m) _mm512_storeu_ps(acc + m * F8_NR, c[m]);
}

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f"); }

}  // namespace

// the variant `variant` resolves to on this CPU (0: the best it has), or an error naming what it lacks
int64_t fp8_variant(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 3, "fp8 kernel: variant 0 (auto), 1 (portable), 2 (avx2), 3 (avx512), got ",
              variant);
  if (variant == 0) return has_avx512() ? 3 : has_avx2() ? 2 : 1;
  TORCH_CHECK(variant != 2 || has_avx2(), "fp8 kernel: the avx2 variant needs AVX2 and FMA, which this CPU lacks");
  TORCH_CHECK(variant != 3 || has_avx512(), "fp8 kernel: the avx512 variant needs AVX-512F, which this CPU lacks");
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

// x (M, K) float32 / bfloat16; panels (P, K, 16) uint8; scales (N) per-output; bias (N) or none -> (M, N)
// in x's dtype: scale[n] * (x @ fp8(W)^T)[:, n] + bias[n]
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t N,
                         c10::optional<torch::Tensor> bias, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "fp8_linear: x (M, K) float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), P = (N + F8_NR - 1) / F8_NR;
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.is_contiguous() && panels.dim() == 3 &&
              panels.size(0) == P && panels.size(1) == K && panels.size(2) == F8_NR, "fp8_linear: panels (ceil(N / 16), K, 16) uint8");
  auto sc = scales.to(torch::kFloat).contiguous();
  TORCH_CHECK(sc.numel() == N, "fp8_linear: one scale an output (", N, "), got ", sc.numel());
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "fp8_linear: bias of N outputs");
    bp = bf.data_ptr<float>();
  }
  const int64_t v = fp8_variant(variant);
  auto xt = x.to(torch::kFloat).t().contiguous();  // (K, M)
  auto out32 = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const float* xp = xt.data_ptr<float>();
  const float* s = sc.data_ptr<float>();
  const uint8_t* w = panels.data_ptr<uint8_t>();
  float* o = out32.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float acc[F8_MR * F8_NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * F8_NR, nn = std::min(F8_NR, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += F8_MR) {
        const int r = static_cast<int>(std::min<int64_t>(F8_MR, M - m0));
        const uint8_t* wp = w + p * K * F8_NR;
        if (v == 3) block_avx512(xp, M, m0, r, wp, K, acc);
        else if (v == 2) block_avx2(xp, M, m0, r, wp, K, acc);
        else block_portable(xp, M, m0, r, wp, K, acc);
        for (int m = 0; m < r; ++m)
          for (int64_t j = 0; j < nn; ++j)
            o[(m0 + m) * N + n0 + j] = acc[m * F8_NR + j] * s[n0 + j] + (bp ? bp[n0 + j] : 0.f);
      }
    }
  });
  return x.scalar_type() == torch::kFloat ? out32 : out32.to(x.scalar_type());
}
