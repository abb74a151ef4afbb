// Causal prefill attention on AVX2 + FMA (causal_prefill's variant 2, csrc/paged_decode.cpp): compiled after
// csrc/paged_cascade.cpp in the paged kernel's namespace; its products are the panel kernel's AVX2 row blocks
// (panel_src::rows_avx2, csrc/panel_rows.cpp).
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

#if PANEL_X86
// One prefill chunk (n query rows from row r0, positions start .. start + n - 1) and kv head g, fp32 arithmetic on any
// dtype. Variant 0 runs pieces of 32 queries as two at::mm calls each (a piece's scores over its whole context, then
// the values): ~40 GFLOP/s of causal work on SmolLM2's 2,048-row steps (2-core Zen 3), under the call overhead and
// the masked half of each piece. Here the chunk's keys are laid out as the panel kernel's weights (16 keys a panel,
// (hd, 16) each) and its values as 16-wide strips ((L, 16) each). Each block of up to 6 tokens of one query head
// takes the key panels up to its last token only (fp32 queries read where they lie, nh * hd apart: a copy of them
// was a tenth of the time, this host's memory being slow), its rows' scaled softmax masked to their own positions
// (the later slots' weights zero), then the value strips over those slots; each output divided by its row's sum
// and rounded once into out. A block's keys and values stay in L2 (256 keys: 64 KB each), its scores in L1.
// A query row's softmax weights over slots [0, pb * 16): its scores at s (pb panels of 16, `ld` apart), scaled;
// exp(scale (s - max)) over [0, valid), zero after; returns their sum. One pass for the max, one for the rest (the
// 16-lane vector code of exp_shifted kept its sums and maxima on the stack in an AVX2 build: a third of the time)
__attribute__((target("avx2,fma"))) inline float softmax_avx2(const float* s, int64_t ld, int64_t pb, int64_t valid,
                                                              float scale, float* w) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < valid; j += 8)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + (j / 16) * ld + j % 16), below(j, valid)));
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
  const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_mul_ps(mx, sc);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < pb * 16; j += 8) {
    const __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(s + (j / 16) * ld + j % 16), sc, shift);
    const __m256 v = _mm256_min_ps(x, _mm256_setzero_ps());
    const __m256 y = _mm256_and_ps(_mm256_andnot_ps(below_87(v), exp8(v)), below(j, valid));
    sum = _mm256_add_ps(sum, y);
    _mm256_storeu_ps(w + j, y);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, sum);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// o[0, 16) = a[0, 16) * inv, rounded to T
template <typename T>
inline void store_scaled(const float* a, float inv, T* o) {
  for (int c = 0; c < 16; ++c) o[c] = static_cast<T>(a[c] * inv);
}
template <>
__attribute__((target("avx2,fma"))) inline void store_scaled(const float* a, float inv, float* o) {
  const __m256 s = _mm256_set1_ps(inv);
  _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(a), s));
  _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_loadu_ps(a + 8), s));
}

template <typename T>
void causal_chunk_avx2(const T* qp, const T* kc, const T* vc, const int64_t* table, int64_t bs, int64_t row,
                       int64_t hd, int64_t nh, int64_t qs, int64_t group, int64_t g, int64_t r0, int64_t n, int64_t start,
                       float scale, T* out) {
  constexpr int64_t NR = panel_src::NR, MB = panel_src::MR_AVX2;
  const int64_t L = start + n, P = (L + NR - 1) / NR, H = hd / NR;
  thread_local std::vector<float> kp, vs, xq, sc, e;
  alignas(32) float acc[MB * NR];
  kp.resize(P * hd * NR), vs.resize(H * L * NR), sc.resize(P * MB * NR), e.resize(MB * P * NR);
  int64_t at[2][NR];  // the offsets of this panel's 16 keys (and the next one's, asked for ahead) in the cache
  const auto offsets = [&](int64_t p, int64_t* o) {
    for (int64_t jj = 0, j = p * NR; jj < NR && j < L; ++jj, ++j) {
      o[jj] = (table[j / bs] * bs + j % bs) * row + g * hd;
      for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kc + o[jj]) + b, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(vc + o[jj]) + b, 0, 3);
      }
    }
  };
  offsets(0, at[0]);
  for (int64_t p = 0; p < P; ++p) {  // panel p: keys 16p .. as (hd, 16); their values, row j of each strip
    const int64_t c = std::min(NR, L - p * NR);
    const int64_t* o = at[p % 2];
    if (p + 1 < P) offsets(p + 1, at[(p + 1) % 2]);
    float* kd = kp.data() + p * hd * NR;
    for (int64_t d = 0; d < hd; ++d)
      for (int64_t jj = 0; jj < c; ++jj) kd[d * NR + jj] = static_cast<float>(kc[o[jj] + d]);
    for (int64_t jj = 0; jj < c; ++jj)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < NR; ++i) vs[(h * L + p * NR + jj) * NR + i] = static_cast<float>(vc[o[jj] + h * NR + i]);
  }
  const float* xb;  // head h's query of token t at xb + h * hs + t * ldq (q's tokens qs apart)
  int64_t ldq, hs;
  if constexpr (std::is_same_v<T, float>) {
    xb = qp + r0 * qs + g * group * hd, ldq = qs, hs = hd;
  } else {  // widened once, (group, n, hd)
    xq.resize(group * n * hd);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < hd; ++d)
          xq[(h * n + t) * hd + d] = static_cast<float>(qp[(r0 + t) * qs + (g * group + h) * hd + d]);
    xb = xq.data(), ldq = hd, hs = n * hd;
  }
  float sums[MB];
  for (int64_t h = 0; h < group; ++h)
    for (int64_t t0 = 0; t0 < n; t0 += MB) {
      const int r = static_cast<int>(std::min(MB, n - t0));
      const int64_t lim = start + t0 + r, pb = (lim + NR - 1) / NR, lde = pb * NR;
      const float* x = xb + h * hs + t0 * ldq;
      for (int64_t p = 0; p < pb; ++p)  // scores (pb, r, 16): panel p's 16 keys for each row
        panel_src::rows_avx2<true>(r, x, ldq, kp.data() + p * hd * NR, hd, sc.data() + p * MB * NR, panel_src::NoPf{});
      for (int m = 0; m < r; ++m)
        sums[m] = softmax_avx2(sc.data() + m * NR, MB * NR, pb, start + t0 + m + 1, scale, e.data() + m * lde);
      for (int64_t p = 0; p < H; ++p) {  // the values' 16 dims p: the rows' weights over slots [0, lim)
        panel_src::rows_avx2<true>(r, e.data(), lde, vs.data() + p * L * NR, lim, acc, panel_src::NoPf{});
        for (int m = 0; m < r; ++m)
          store_scaled(acc + m * NR, 1.f / sums[m], out + ((r0 + t0 + m) * nh + g * group + h) * hd + p * NR);
      }
    }
}
#endif

}  // namespace
