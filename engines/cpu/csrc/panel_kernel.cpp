// The CPU panel Linear kernel: built and bound by engines/cpu/panel_kernel.py (see its docstring); the blocks' and
// rows' arithmetic is csrc/panel_rows.cpp, compiled just before this file in the same namespace.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>

namespace {

// what auto (variant 0) resolves to where pinned (panel_auto_variant; tests), 0 where not: the CPU's pick below
std::atomic<int64_t> auto_pin{0};

// the variant `variant` resolves to here: 1 portable (panel_rows.cpp's vector code, AVX-512 or AVX512-BF16 where the
// build has them), 2 AVX2 + FMA (one row, and several: rows_avx2), 3 AMX for several bf16 rows (one row: portable), 4 AMX's layout
// with its arithmetic in scalar C++ (tests; never auto's pick); 0: amx where the host runs it, else AVX2 where the
// CPU has it and the build has no AVX-512F (whose portable code is already fast), else portable. An error names
// what a forced one lacks.
int64_t row_variant(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 4,
              "panel kernel: variant 0 (auto), 1 (portable), 2 (avx2), 3 (amx), 4 (amx_emulated), got ", variant);
  if (variant == 0 && auto_pin.load(std::memory_order_relaxed)) variant = auto_pin.load(std::memory_order_relaxed);
  TORCH_CHECK(variant != 3 || amx_ready(),
              "panel kernel: the amx variant needs AMX-TILE and AMX-BF16 in the build and the kernel's leave to use "
              "them, which this host lacks");
#if PANEL_X86
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool avx2 = false;
#endif
  TORCH_CHECK(variant != 2 || avx2, "panel kernel: the avx2 variant needs AVX2 and FMA, which this CPU lacks");
  if (variant) return variant;
  if (amx_ready()) return 3;
#if defined(__AVX512F__)
  return 1;
#else
  return avx2 ? 2 : 1;
#endif
}

template <typename X, typename T>
void rows_block(int r, const X* xt, int64_t ldx, const T* w, int64_t K, float* acc, const Pf& f) {
  switch (r) {
#define ROWS(i) case i: block<i>(xt, ldx, w, K, acc, f); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15)
#undef ROWS
    default: block<MR>(xt, ldx, w, K, acc, f); break;
  }
}

// the sums of panel p for rows m0 .. m0 + r - 1 (acc: r x NR) plus the bias, rounded into out (M, N) (plus res)
template <typename O>
void store_sums(int64_t p, int64_t m0, int r, const float* acc, int64_t N, const float* bias, const O* res, O* out) {
  const int64_t n0 = p * NR, nn = std::min(NR, N - n0);
  if (nn == NR) {  // a full panel: 16 outputs a vector, the same arithmetic
    for (int m = 0; m < r; ++m) {
      const int64_t i = (m0 + m) * N + n0;
      store16(acc + m * NR, bias ? bias + n0 : nullptr, res ? res + i : nullptr, out + i);
    }
    return;
  }
  for (int m = 0; m < r; ++m)
    for (int64_t j = 0; j < nn; ++j) {
      const int64_t i = (m0 + m) * N + n0 + j;
      const O y = static_cast<O>(acc[m * NR + j] + (bias ? bias[n0 + j] : 0.f));
      out[i] = res ? static_cast<O>(static_cast<float>(res[i]) + static_cast<float>(y)) : y;
    }
}

// rows [m0, m0 + r) of block b: M rows in nb blocks of near-equal rows (34 in 3: 12 + 11 + 11)
inline void row_block(int64_t b, int64_t M, int64_t nb, int64_t& m0, int64_t& r) {
  m0 = b * (M / nb) + std::min(b, M % nb), r = M / nb + (b < M % nb);
}

// panels [p0, p1) of xt (Kp, M) the rows' inputs transposed (fp32, or bf16 pairs), w (P, Kp, NR) -> out (M, N); with
// res (M, N), out = res + (the Linear's output rounded to T), rounded to T: what `res + linear(x)` gives (res may be
// out: each element is read, then written, by the thread that owns its panel). Each panel's sums do not depend on how
// the panels or rows are split (one row: groups of G panels, the rest one at a time; rows: blocks of any size; the
// same sums in the same order), so any split over threads gives the same bits (the fused step's team splits them)
template <typename X, typename T, typename O = T>
void run_range(const X* xt, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res, O* out,
               int64_t variant, int64_t p0, int64_t p1) {
  constexpr bool wide = std::is_same_v<X, float> && !std::is_same_v<T, float>;  // bf16 rows widened (wide_rows)
  const int64_t panel = Kp * NR * (std::is_same_v<T, float> ? 1 : 2);  // elements of T per panel
  auto store = [&](int64_t p, int64_t m0, int r, const float* acc) { store_sums(p, m0, r, acc, N, bias, res, out); };
  if constexpr (std::is_same_v<T, c10::BFloat16> && !wide) {
    if (amx_rows(variant, M, Kp)) {  // xt: (ceil(M / 16) * 16, Kp) rows, see amx_rows
      alignas(64) float tiles[4 * 256];
      const int64_t lanes = Kp * NR, M16 = (M + 15) / 16 * 16;
#if PANEL_AMX
      if (variant == 3) amx_config();
#endif
      for (int64_t p = p0; p < p1; p += 2) {
        const bool two = p + 1 < p1;
        for (int64_t m0 = 0; m0 < M16; m0 += 32) {
          const bool tall = m0 + 16 < M16;
          const uint32_t* xm = xt + m0 * Kp;
          const auto* wp = reinterpret_cast<const uint32_t*>(w + p * panel);
#if PANEL_AMX
#define AMX_BLOCK(PB, MB) variant == 3 ? amx_block<PB, MB>(xm, Kp, wp, lanes, tiles) \
                                       : amx_block_emulated<PB, MB>(xm, Kp, wp, lanes, tiles)
#else
#define AMX_BLOCK(PB, MB) amx_block_emulated<PB, MB>(xm, Kp, wp, lanes, tiles)
#endif
          if (two && tall) AMX_BLOCK(2, 2);
          else if (two) AMX_BLOCK(2, 1);
          else if (tall) AMX_BLOCK(1, 2);
          else AMX_BLOCK(1, 1);
#undef AMX_BLOCK
          const int PB = two ? 2 : 1;
          for (int mb = 0; mb < (tall ? 2 : 1); ++mb)
            for (int pb = 0; pb < PB; ++pb) {
              const int64_t r0 = m0 + 16 * mb;
              if (r0 < M) store(p + pb, r0, static_cast<int>(std::min<int64_t>(16, M - r0)), tiles + (mb * PB + pb) * 256);
            }
        }
      }
      return;
    }
  }
  // row block b > 0 of nb: its share of the panel (or pair) `next` panels on, a line every nb - 1 steps
  auto pf = [&](int64_t next, int64_t b, int64_t nb) {
    return b == 0 ? Pf{} : Pf{reinterpret_cast<const char*>(w + next * panel) + (b - 1) * (Kp / (nb - 1)) * 64, 65536 / (nb - 1)};
  };
  float acc[2 * MR * NR];  // block2: two panels of up to MR2 rows
  int64_t p = p0;
  if constexpr (!wide)
  if (M == 1) {  // G panels a pass (the same sums, in the same order, as one panel at a time)
    constexpr int G = 4;
    if constexpr (std::is_same_v<T, c10::BFloat16>)  // bf16 rows: up to ROW_G_BF16 panels a pass (see there)
      for (int64_t g; variant != 2 && (g = std::min<int64_t>(ROW_G_BF16, p1 - p)) > G; p += g) {
        ROW_BF16[g - 1](xt, w + p * panel, panel, Kp, acc);
        for (int64_t i = 0; i < g; ++i) store(p + i, 0, 1, acc + i * NR);
      }
#if PANEL_X86
    if constexpr (std::is_same_v<T, c10::BFloat16>)  // AVX2: up to ROW_G_AVX2_BF16 panels a pass, to the last
      for (int64_t g; variant == 2 && (g = std::min<int64_t>(ROW_G_AVX2_BF16, p1 - p)) > 0; p += g) {
        ROW_AVX2_BF16[g - 1](xt, w + p * panel, panel, Kp, acc);
        for (int64_t i = 0; i < g; ++i) store(p + i, 0, 1, acc + i * NR);
      }
#endif
    for (; p + G <= p1; p += G) {
#if PANEL_X86
      if (variant == 2) row_avx2<G>(xt, w + p * panel, panel, Kp, acc);
      else
#endif
        row_panels<G>(xt, w + p * panel, panel, Kp, acc);
      for (int g = 0; g < G; ++g) store(p + g, 0, 1, acc + g * NR);
    }
  }
#if PANEL_X86
  // AVX2 + FMA blocks of near-equal bf16 rows (rows_avx2) in the decode layout, fewer than BLOCKED_ROWS (more, and
  // fp32 rows from 2, run the row-major blocks: blocked_range); before the AVX-512 pairs below
  if constexpr (!std::is_same_v<T, float>)
  if (variant == 2 && M > 1) {
    constexpr int64_t MRV = MR_AVX2_BF16, XW = wide ? 2 : 1;
    for (; p < p1; ++p)
      for (int64_t nb = (M + MRV - 1) / MRV, b = 0, m0, r; b < nb; ++b) {
        row_block(b, M, nb, m0, r);
        rows_avx2(static_cast<int>(r), xt + XW * m0, XW * M, w + p * panel, Kp, acc, pf(p + 1, b, nb));
        store(p, m0, static_cast<int>(r), acc);
      }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (M > 1)
      for (; p + 2 <= p1; p += 2)
        for (int64_t nb = (M + MR2 - 1) / MR2, b = 0, m0, r; b < nb; ++b) {
          row_block(b, M, nb, m0, r);  // blocks of near-equal rows (below)
          rows_block2(static_cast<int>(r), xt + m0, M, w + p * panel, panel, Kp, acc, pf(p + 2, b, nb));
          store(p, m0, r, acc);
          store(p + 1, m0, r, acc + r * NR);
        }
  }
#endif
  if constexpr (!wide)
  for (; p < p1; ++p)  // blocks of near-equal rows (34: 12 + 11 + 11, not 16 + 16 + 2, whose 2 sums wait on latency)
    for (int64_t nb = (M + MR - 1) / MR, b = 0, m0, r; b < nb; ++b) {
      row_block(b, M, nb, m0, r);
      rows_block(static_cast<int>(r), xt + m0, M, w + p * panel, Kp, acc, pf(p + 1, b, nb));
      store(p, m0, static_cast<int>(r), acc);
    }
}

// src (M, K) -> dst (K, M): 16 rows at a time, so their 16 source lines stay in L1 while each destination line is
// written whole (the element-wise scatter of bf16 pairs into a zeroed buffer: prepare 2.4 % of the perf samples of a
// SmolLM2 bf16 mix's decode steps (34 rows on average, 2-core EPYC Zen 4), and the others' spin waits 9.0 %; now 1.2 and 6.3)
// (rows [r0, r1) only: the fused step's team lays out its rows each; xt of the several-row blocks, run_range,
// is this of the rows' 32-bit pairs or fp32 values)
template <typename E>
inline void transpose_rows(const E* src, int64_t M, int64_t K, E* dst, int64_t r0 = 0, int64_t r1 = -1) {
  for (int64_t m0 = r0, end = r1 < 0 ? M : r1; m0 < end; m0 += 16) {
    const int64_t m1 = std::min(end, m0 + 16);
    int64_t k = 0;
#if defined(__AVX512F__)
    if constexpr (sizeof(E) == 4)
      if (m1 - m0 == 16)
        for (; k + 16 <= K; k += 16) transpose16(src + m0 * K + k, K, dst + k * M + m0, M);
#endif
    for (; k < K; ++k)
      for (int64_t m = m0; m < m1; ++m) dst[k * M + m] = src[m * K + k];
  }
}

// bf16 rows src (M, K) -> dst (K2, M, 2) fp32, each pair's two inputs widened (wide_rows' layout; an odd K's missing
// input zero), rows [r0, r1) only, 16 at a time as transpose_rows
inline void widen_rows(const c10::BFloat16* src, int64_t M, int64_t K, float* dst, int64_t r0 = 0, int64_t r1 = -1) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m0 = r0, end = r1 < 0 ? M : r1; m0 < end; m0 += 16) {
    const int64_t m1 = std::min(end, m0 + 16);
    for (int64_t k2 = 0; k2 < K2; ++k2)
      for (int64_t m = m0; m < m1; ++m) {
        float* d = dst + (k2 * M + m) * 2;
        d[0] = static_cast<float>(src[m * K + 2 * k2]);
        d[1] = 2 * k2 + 1 < K ? static_cast<float>(src[m * K + 2 * k2 + 1]) : 0.f;
      }
  }
}

// x (M, K) fp32 or bf16 -> the rows run_blocked reads: fp32 (M, K), or bf16 widened to fp32 (M, 2 * ceil(K / 2))
torch::Tensor blocked_inputs(const torch::Tensor& x) {
  if (x.scalar_type() == torch::kFloat) return x.contiguous();
  return (x.size(1) % 2 ? torch::constant_pad_nd(x, {0, 1}) : x).to(torch::kFloat).contiguous();
}

struct Stored {  // run_blocked's `then` where nothing follows the store
  void operator()(int64_t, int64_t, int64_t) const {}
};

#if PANEL_X86
// bf16 panel pairs [0, kc) of one panel (w: (kc, NR, 2)) widened to fp32 (2 kc, NR): input 2 k's 16 weights, then input
// 2 k + 1's, as the fp32 blocks read a panel; each line's weights asked for 4 KB ahead (a slice's first reading)
__attribute__((target("avx2,fma"))) inline void widen_panel(const c10::BFloat16* w, int64_t kc, float* dst) {
  const auto* u = reinterpret_cast<const uint32_t*>(w);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < kc; ++k) {
    ahead(u + k * NR);
    const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + k * NR));
    const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + k * NR + 8));
    _mm256_storeu_ps(dst + 2 * k * NR, _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)));
    _mm256_storeu_ps(dst + 2 * k * NR + 8, _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16)));
    _mm256_storeu_ps(dst + (2 * k + 1) * NR, _mm256_castsi256_ps(_mm256_and_si256(u0, high)));
    _mm256_storeu_ps(dst + (2 * k + 1) * NR + 8, _mm256_castsi256_ps(_mm256_and_si256(u1, high)));
  }
}

// slice_sums (below) over a slice already widened to fp32 in wide (2 kc x NR floats: bf16 here, FP8 in fp8_range.cpp)
inline void wide_sums(const float* xb, int64_t M, int64_t nb, int64_t ldx, int64_t c0, int64_t c1, int64_t k0,
                      int64_t kc, float* acc, const float* wide) {
  for (int64_t b = c0, m0, r; b < c1; ++b) {
    row_block(b, M, nb, m0, r);
    rows_avx2<true>(static_cast<int>(r), xb + m0 * ldx + 2 * k0, ldx, wide, 2 * kc, acc + (b - c0) * MR_AVX2 * NR,
                    NoPf{}, k0 > 0);
  }
}
#endif

// Panel inputs a slice of the blocked rows: fp32 KC (16 KB of weights); bf16 KC / 2 pairs, widened once a slice to
// 16 KB of fp32 (widen_panel) that every block of the chunk reads through the fp32 blocks (6 rows, 12 sums): the
// same chain of multiply-adds as the bf16 blocks' (a pair's low input, then its high one), so the same bits, without
// their 4-row blocks' two dependent multiply-adds a pair and each block's widening of every weight. A GPT-2 decode
// step's Linears and head in bf16 (benchmarks/bench_panel_kernel.py --rows 48,64,512 --dtypes bfloat16, 2-core Zen 2,
// 2 threads, both builds twice): 48 rows 89.7 -> 82.3 ms, 64 rows 120.5 -> 103.4, 512 rows 960 -> 831 (132 -> 145-154
// GFLOP/s)
template <typename T>
constexpr int64_t slice_of() { return std::is_same_v<T, float> ? KC : KC / 2; }

// The sums of the chunk's row blocks [c0, c1) (of nb, rows xb (M, ldx) fp32) over a panel's inputs [k0, k0 + kc) (bf16:
// pairs), wk their weights, into acc (MR_AVX2 x NR a block, carried on where k0 > 0); wide: bf16's widened slice
template <typename T>
void slice_sums(const float* xb, int64_t M, int64_t nb, int64_t ldx, int64_t c0, int64_t c1, const T* wk, int64_t k0,
                int64_t kc, float* acc, float* wide) {
#if PANEL_X86
  if constexpr (!std::is_same_v<T, float>) {
    widen_panel(wk, kc, wide);
    wide_sums(xb, M, nb, ldx, c0, c1, k0, kc, acc, wide);
  } else {
    for (int64_t b = c0, m0, r; b < c1; ++b) {
      row_block(b, M, nb, m0, r);
      float* am = acc + (b - c0) * MR_AVX2 * NR;
      if (b == c0)  // the chunk's first block reads the slice's weights, asking ahead
        rows_avx2<true>(static_cast<int>(r), xb + m0 * ldx + k0, ldx, wk, kc, am, Pf{}, k0 > 0);
      else
        rows_avx2<true>(static_cast<int>(r), xb + m0 * ldx + k0, ldx, wk, kc, am, NoPf{}, k0 > 0);
    }
  }
#endif
}

// The blocked rows (M, ldx apart) through panels [p0, p1) of Kp inputs (pairs), KS a slice, a chunk of row blocks at a
// time (only chunk q where q >= 0): slice(p, k0, kc, nb, c0, c1, acc) sums the chunk over a slice, store(p, m0, r, sums)
// a block's outputs of p
template <typename Slice, typename Store>
void blocked_walk(int64_t M, int64_t ldx, int64_t Kp, int64_t KS, int64_t p0, int64_t p1, const Slice& slice,
                  const Store& store, int64_t q = -1) {
  const int64_t nb = (M + MR_AVX2 - 1) / MR_AVX2, chunk = chunk_blocks(ldx);
  alignas(64) float acc[CHUNK_MAX * MR_AVX2 * NR];
  for (int64_t c0 = q < 0 ? 0 : q * chunk; c0 < (q < 0 ? nb : std::min(nb, (q + 1) * chunk)); c0 += chunk) {
    const int64_t c1 = std::min(nb, c0 + chunk);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k0 = 0; k0 < Kp; k0 += KS) slice(p, k0, std::min(KS, Kp - k0), nb, c0, c1, acc);
      for (int64_t b = c0, m0, r; b < c1; ++b) {
        row_block(b, M, nb, m0, r);
        store(p, m0, static_cast<int>(r), acc + (b - c0) * MR_AVX2 * NR);
      }
    }
  }
}

// panels [p0, p1) of run_blocked below over every chunk of rows, or chunk q (the fused step's team claims groups of
// panels; run_blocked, panels of a chunk)
template <typename T, typename O, typename Then = Stored>
void blocked_range(const float* xb, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res,
                   O* out, int64_t p0, int64_t p1, const Then& then = Then{}, int64_t q = -1) {
#if PANEL_X86
  constexpr int64_t XW = std::is_same_v<T, float> ? 1 : 2;
  const int64_t panel = Kp * NR * XW, ldx = Kp * XW;
  alignas(64) float wide[KC * NR];
  blocked_walk(
      M, ldx, Kp, slice_of<T>(), p0, p1,
      [&](int64_t p, int64_t k0, int64_t kc, int64_t nb, int64_t c0, int64_t c1, float* acc) {
        slice_sums(xb, M, nb, ldx, c0, c1, w + p * panel + k0 * NR * XW, k0, kc, acc, wide);
      },
      [&](int64_t p, int64_t m0, int r, const float* acc) {
        store_sums(p, m0, r, acc, N, bias, res, out);
        then(p, m0, r);
      },
      q);
#else
  TORCH_CHECK(false, "panel kernel: the blocked rows need the avx2 variant");
#endif
}

// xb (blocked_inputs) through the panels of w (fp32 (P, Kp, NR), or bf16 pairs (P, Kp, NR, 2)) -> out (M, N); then(p,
// m0, r) after a block's outputs of panel p are stored (rows m0 .. m0 + r - 1, still in L1: panel_gelu's activation).
// The threads claim (chunk, panel) items, chunk by chunk (claimed_for): the same bits as any split.
template <typename T, typename O, typename Then = Stored>
void run_blocked(const float* xb, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res, O* out,
                 const Then& then = Then{}) {
  claimed_chunks(chunks_of(M, Kp * (std::is_same_v<T, float> ? 1 : 2)), (N + NR - 1) / NR,
                 [&](int64_t q, int64_t p0, int64_t p1) {
                   blocked_range(xb, M, Kp, w, N, bias, res, out, p0, p1, then, q);
                 });
}

// all panels of the Linear (run_range) over torch's intra-op threads: one row, a static share each (its passes of
// several panels); more rows, claims of panel pairs (claimed_for; AMX's blocks take two at a time)
template <typename X, typename T, typename O = T>
void run(const X* xt, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res, O* out,
         int64_t variant) {
  auto range = [&](int64_t p0, int64_t p1) { run_range(xt, M, Kp, w, N, bias, res, out, variant, p0, p1); };
  if (M == 1) at::parallel_for(0, (N + NR - 1) / NR, 1, range);
  else claimed_for((N + NR - 1) / NR, 2, range);
}

}  // namespace

// weight (N, K) -> fp32 panels (ceil(N / 16), K, 16), or bf16 panels (ceil(N / 16), ceil(K / 2), 16, 2):
// the padded outputs' (and a padded odd input's) weights zero
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: a 2-D weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  if (weight.scalar_type() == torch::kBFloat16) {
    const int64_t K2 = (K + 1) / 2;
    auto padded = torch::zeros({P * NR, 2 * K2}, weight.options());
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
    return padded.view({P, NR, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  TORCH_CHECK(weight.scalar_type() == torch::kFloat, "pack_panels: float32 or bfloat16, got ", weight.scalar_type());
  auto padded = torch::zeros({P * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

// bf16 rows x (M, K) laid out as run_range reads them for variant v: padded to (ceil(M / 16) * 16, K2 pairs) for
// AMX's tiles (amx_rows), else transposed to (K2, M) pairs (a pair is 32 bits); an odd K gets a zero input
torch::Tensor bf16_rows(const torch::Tensor& x, int64_t v) {
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  auto xs = K % 2 ? torch::constant_pad_nd(x, {0, 1}) : x.contiguous();
  return amx_rows(v, M, K2) ? torch::constant_pad_nd(xs, {0, 0, 0, (16 - M % 16) % 16})
                            : xs.view({M, K2, 2}).transpose(0, 1).contiguous();
}

// bf16 rows x (M, K) widened as wide_rows' blocks read them: (ceil(K / 2), M, 2) fp32 (widen_rows)
torch::Tensor widened_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous();
  auto xw = torch::empty({(K + 1) / 2, M, 2}, x.options().dtype(torch::kFloat));
  widen_rows(xc.data_ptr<c10::BFloat16>(), M, K, xw.data_ptr<float>());
  return xw;
}

// x (M, K), panels of a weight with N outputs, optional bias (N), optional residual (M, N) -> (M, N) in
// x's dtype: x @ W^T + bias, plus the residual (added after the Linear's result is rounded, as torch's add)
torch::Tensor panel_linear_res(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias,
                               c10::optional<torch::Tensor> residual, int64_t variant = 0) {
  const int64_t v = row_variant(variant);
  TORCH_CHECK(x.dim() == 2, "panel_linear: x (M, K)");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "panel_linear: x and the weight must share a dtype");
  TORCH_CHECK(panels.is_contiguous() && panels.size(0) == (N + NR - 1) / NR && panels.size(2) == NR,
              "panel_linear: panels of N outputs");
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  const bool with_res = residual.has_value() && residual->defined();
  if (with_res)
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == M && residual->size(1) == N, "panel_linear: a contiguous (M, N) residual of x's dtype");
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(torch::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  if (x.scalar_type() == torch::kFloat) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(1) == K, "panel_linear: fp32 panels (P, K, 16)");
    const float* res = with_res ? residual->data_ptr<float>() : nullptr;
    if (blocked_rows(v, M, false)) {
      run_blocked(blocked_inputs(x).data_ptr<float>(), M, K, panels.data_ptr<float>(), N, bp, res, out.data_ptr<float>());
      return out;
    }
    auto xt = x.t().contiguous();  // (K, M): one input's row values adjacent
    run(xt.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, bp, res, out.data_ptr<float>(), v);
  } else if (x.scalar_type() == torch::kBFloat16) {
    const int64_t K2 = (K + 1) / 2;
    TORCH_CHECK(panels.dim() == 4 && panels.size(1) == K2 && panels.size(3) == 2,
                "panel_linear: bf16 panels (P, ceil(K / 2), 16, 2)");
    const auto* res = with_res ? residual->data_ptr<c10::BFloat16>() : nullptr;
    if (blocked_rows(v, M, true)) {
      run_blocked(blocked_inputs(x).data_ptr<float>(), M, K2, panels.data_ptr<c10::BFloat16>(), N, bp, res,
                  out.data_ptr<c10::BFloat16>());
    } else if (wide_rows(v, M)) {
      auto xw = widened_rows(x);
      run(xw.data_ptr<float>(), M, K2, panels.data_ptr<c10::BFloat16>(), N, bp, res, out.data_ptr<c10::BFloat16>(), v);
    } else {
      auto xt = bf16_rows(x, v);
      run(reinterpret_cast<const uint32_t*>(xt.data_ptr<c10::BFloat16>()), M, K2, panels.data_ptr<c10::BFloat16>(),
          N, bp, res, out.data_ptr<c10::BFloat16>(), v);
    }
  } else {
    TORCH_CHECK(false, "panel_linear: float32 or bfloat16, got ", x.scalar_type());
  }
  return out;
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias,
                           int64_t variant) {
  return panel_linear_res(x, panels, N, bias, c10::nullopt, variant);
}

// bf16 x (M, K) through bf16 panels of N outputs -> (M, N) fp32: the kernel's fp32 sums, not rounded (attention
// scores: engines/model/prefill_cascade.py)
torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor panels, int64_t N, int64_t variant) {
  const int64_t v = row_variant(variant);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && panels.scalar_type() == torch::kBFloat16,
              "panel_linear_f32: bf16 x (M, K) and bf16 panels");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 4 && panels.size(0) == (N + NR - 1) / NR &&
              panels.size(1) == K2 && panels.size(2) == NR, "panel_linear_f32: bf16 panels (P, ceil(K / 2), 16, 2)");
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (blocked_rows(v, M, true)) {
    run_blocked(blocked_inputs(x).data_ptr<float>(), M, K2, panels.data_ptr<c10::BFloat16>(), N,
                static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), out.data_ptr<float>());
    return out;
  }
  if (wide_rows(v, M)) {
    auto xw = widened_rows(x);
    run(xw.data_ptr<float>(), M, K2, panels.data_ptr<c10::BFloat16>(), N, static_cast<const float*>(nullptr),
        static_cast<const float*>(nullptr), out.data_ptr<float>(), v);
    return out;
  }
  auto xt = bf16_rows(x, v);
  run(reinterpret_cast<const uint32_t*>(xt.data_ptr<c10::BFloat16>()), M, K2, panels.data_ptr<c10::BFloat16>(), N,
      static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), out.data_ptr<float>(), v);
  return out;
}

// the one-row variant `variant` resolves to on this CPU (see row_variant)
int64_t panel_variant(int64_t variant) { return row_variant(variant); }

// pin what auto (variant 0) resolves to in this process, 0 to unpin; returns the pin before. Tests: auto portable on
// an AVX2 host, so that a decode step's Linears on auto and on the avx2 kind (engines/cpu/fast_linear.PANEL_KINDS)
// run different code side by side there; a variant this host lacks is refused as forcing it is
int64_t panel_auto_variant(int64_t variant) {
  if (variant) row_variant(variant);
  return auto_pin.exchange(variant);
}
