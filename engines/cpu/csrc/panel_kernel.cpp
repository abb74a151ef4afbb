// The CPU panel Linear kernel: built and bound by engines/cpu/panel_kernel.py (see its docstring).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <array>
#include <utility>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#define PANEL_X86 1
#endif

namespace {

constexpr int64_t NR = 16;  // outputs per panel
constexpr int MR = 16;      // rows per block: MR vector accumulators
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf as_f(vu u) { vf v; std::memcpy(&v, &u, sizeof(vf)); return v; }
inline vu load_u(const void* p) { vu u; std::memcpy(&u, p, sizeof(vu)); return u; }
inline vu as_u(vf v) { vu u; std::memcpy(&u, &v, sizeof(vu)); return u; }
// several rows: a panel's first row block reads it from memory a line per 8-16 cycles of arithmetic, and the hardware
// prefetchers alone left that waiting; each line is asked for 4 KB ahead into L2 (prefetcht1: a deeper miss queue than
// L1's). SmolLM2's bf16 offline mix, Zen 4, decode at ~34 rows: 729 (none) -> 751-806 (into L1, 2-4 KB) -> 826-843 tok/s
// (fp32: no change). One row: 512 bytes ahead, into L2: bf16 +1.7 %, fp32 +2.1 % (into L1 256: -0.6 %; batch 1)
inline void ahead(const void* p, int64_t by = 4096) { __builtin_prefetch(static_cast<const char*>(p) + by, 0, 2); }
typedef uint16_t vh __attribute__((vector_size(32)));

// 16 fp32 rounded to bf16 as c10::BFloat16(float) rounds them (to nearest even; a NaN to 0x7FC0), as fp32
inline vf round_bf16(vf v) {
  const vu u = as_u(v), nan = (vu)(v != v);
  const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return as_f((r & ~nan) | (0x7FC00000u & nan));
}

// 16 outputs of a row: y = acc + bias rounded to T, then res + y rounded (the scalar store's arithmetic)
inline void store16(const float* acc, const float* bias, const float* res, float* out) {
  vf y = as_f(load_u(acc)) + (bias ? as_f(load_u(bias)) : vf{});
  if (res) y = as_f(load_u(res)) + y;
  std::memcpy(out, &y, sizeof(vf));
}
inline void store16(const float* acc, const float* bias, const c10::BFloat16* res, c10::BFloat16* out) {
  vf y = round_bf16(as_f(load_u(acc)) + (bias ? as_f(load_u(bias)) : vf{}));
  if (res) {
    vh h;
    std::memcpy(&h, res, sizeof(vh));
    y = round_bf16(as_f(__builtin_convertvector(h, vu) << 16) + y);
  }
  const vh o = __builtin_convertvector(as_u(y) >> 16, vh);
  std::memcpy(out, &o, sizeof(vh));
}

// fp32: acc (R, NR) = xt[:, :R]^T (R, K) @ w (K, NR); xt holds the rows transposed, ldx apart per k. With
// AVX-512 written with intrinsics: GCC kept the vector-extension array's 16 sums in registers but also stored
// each to the stack every k (its assembly: 16 stores a step), which halved the rate (65 GFLOP/s a core against
// 124 without the stores); the same fused multiply-adds in the same order, the same bits
template <int R>
inline void block(const float* xt, int64_t ldx, const float* w, int64_t K, float* acc) {
#if defined(__AVX512F__)
  __m512 c[R];
  for (int m = 0; m < R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_loadu_ps(w + k * NR);
    ahead(w + k * NR);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < R; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), b, c[m]);
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(acc + m * NR, c[m]);
#else
  vf c[R];
  for (int m = 0; m < R; ++m) c[m] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const vf b = as_f(load_u(w + k * NR));
    ahead(w + k * NR);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < R; ++m) c[m] += xk[m] * b;
  }
  for (int m = 0; m < R; ++m) std::memcpy(acc + m * NR, &c[m], sizeof(vf));
#endif
}

#if defined(__AVX512F__)
constexpr int MR2 = 12;  // rows per block of the two-panel fp32 pass: 24 sums in registers

// fp32, two adjacent panels at once (w, and w + panel): each row's input is broadcast once for both, so a step
// is 2 weight loads and R broadcasts for 2 R multiply-adds (one panel: 1 + R for R): 124 -> ~150 GFLOP/s a core.
// Each output's sum is the same chain in the same order as block<R>'s: the same bits
template <int R>
inline void block2(const float* xt, int64_t ldx, const float* w, int64_t panel, int64_t K, float* acc) {
  __m512 c[2 * R];
  for (int m = 0; m < 2 * R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(w + k * NR), b1 = _mm512_loadu_ps(w + panel + k * NR);
    ahead(w + k * NR), ahead(w + panel + k * NR);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < R; ++m) {
      const __m512 a = _mm512_set1_ps(xk[m]);
      c[2 * m] = _mm512_fmadd_ps(a, b0, c[2 * m]);
      c[2 * m + 1] = _mm512_fmadd_ps(a, b1, c[2 * m + 1]);
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_storeu_ps(acc + m * NR, c[2 * m]);
    _mm512_storeu_ps(acc + (R + m) * NR, c[2 * m + 1]);
  }
}

// block2 for r rows (1..MR2): acc holds the first panel's r x NR sums, then the second's
inline void rows_block2(int r, const float* xt, int64_t ldx, const float* w, int64_t panel, int64_t K, float* acc) {
  switch (r) {
#define ROWS(i) case i: block2<i>(xt, ldx, w, panel, K, acc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11)
#undef ROWS
    default: block2<MR2>(xt, ldx, w, panel, K, acc); break;
  }
}
#endif

// bf16: the weight panel is (K2, NR) pairs, a 32-bit lane holding inputs 2k (low half) and 2k + 1
// (high half) of one output; xp (K2, ldx) the rows' inputs paired the same way. With AVX512-BF16 one
// vdpbf16ps does both products of a lane (fp32 sums, flushing denormals); elsewhere both halves are
// widened (a bf16 is the high half of an fp32) and multiplied in fp32
template <int R>
inline void block(const uint32_t* xp, int64_t ldx, const c10::BFloat16* w, int64_t K2, float* acc) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
#if defined(__AVX512BF16__)
  __m512 c[R];
  for (int m = 0; m < R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh b = (__m512bh)_mm512_loadu_si512(wp + k * NR);
    ahead(wp + k * NR);
    const uint32_t* xk = xp + k * ldx;
    for (int m = 0; m < R; ++m) c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)_mm512_set1_epi32((int)xk[m]), b);
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(acc + m * NR, c[m]);
#else
  vf c[R];
  for (int m = 0; m < R; ++m) c[m] = vf{};
  for (int64_t k = 0; k < K2; ++k) {
    const vu u = load_u(wp + k * NR);
    const vf lo = as_f(u << 16), hi = as_f(u & 0xFFFF0000u);
    ahead(wp + k * NR);
    const uint32_t* xk = xp + k * ldx;
    for (int m = 0; m < R; ++m) {
      uint32_t a = xk[m] << 16, z = xk[m] & 0xFFFF0000u;
      float xa, xz;
      std::memcpy(&xa, &a, 4);
      std::memcpy(&xz, &z, 4);
      c[m] += xa * lo;
      c[m] += xz * hi;
    }
  }
  for (int m = 0; m < R; ++m) std::memcpy(acc + m * NR, &c[m], sizeof(vf));
#endif
}

// one row through G panels at once (fp32): one output's sum is still in order over k, but G
// independent FMA chains keep the loads streaming where a single panel's chain would wait on each
// FMA's latency (one 64-byte line per ~4 cycles, below a fast host's memory rate; BENCHMARKS.md issue 12)
template <int G>
inline void row_panels(const float* x, const float* w, int64_t panel, int64_t K, float* acc) {
  vf c[G];
  for (int g = 0; g < G; ++g) c[g] = vf{};
  for (int64_t k = 0; k < K; ++k)
    for (int g = 0; g < G; ++g) ahead(w + g * panel + k * NR, 512), c[g] += x[k] * as_f(load_u(w + g * panel + k * NR));
  for (int g = 0; g < G; ++g) std::memcpy(acc + g * NR, &c[g], sizeof(vf));
}

// bf16, as block<R> above for one row
template <int G>
inline void row_panels(const uint32_t* xp, const c10::BFloat16* w, int64_t panel, int64_t K2, float* acc) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const int64_t lanes = panel / 2;  // 32-bit lanes per panel
#if defined(__AVX512BF16__)
  __m512 c[G];
  for (int g = 0; g < G; ++g) c[g] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[k]);
    for (int g = 0; g < G; ++g)
      ahead(wp + g * lanes + k * NR, 512), c[g] = _mm512_dpbf16_ps(c[g], a, (__m512bh)_mm512_loadu_si512(wp + g * lanes + k * NR));
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * NR, c[g]);
#else
  vf c[G];
  for (int g = 0; g < G; ++g) c[g] = vf{};
  for (int64_t k = 0; k < K2; ++k) {
    uint32_t a = xp[k] << 16, z = xp[k] & 0xFFFF0000u;
    float xa, xz;
    std::memcpy(&xa, &a, 4);
    std::memcpy(&xz, &z, 4);
    for (int g = 0; g < G; ++g) {
      const vu u = load_u(wp + g * lanes + k * NR);
      c[g] += xa * as_f(u << 16);
      c[g] += xz * as_f(u & 0xFFFF0000u);
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(acc + g * NR, &c[g], sizeof(vf));
#endif
}

// bf16 rows, one row: ROW_BF16[g - 1] runs g panels at once, g <= ROW_G_BF16. One row is bound by the lines a core
// has in flight: SmolLM2's batch-1 bf16 decode on the 2-core Zen 4 EPYC (2 threads, passes interleaved in one
// process, median of 7) ran 107.5 tok/s at 4 panels a pass, 112-114 at 6 to 10 (fp32 rows: no change, 58 at 4, 6, 8)
constexpr int ROW_G_BF16 = 8;
using RowBf16 = void (*)(const uint32_t*, const c10::BFloat16*, int64_t, int64_t, float*);
template <int... I>
constexpr std::array<RowBf16, sizeof...(I)> row_bf16_table(std::integer_sequence<int, I...>) { return {&row_panels<I + 1>...}; }
const auto ROW_BF16 = row_bf16_table(std::make_integer_sequence<int, ROW_G_BF16>());

#if PANEL_X86
// The one-row paths above written with AVX2 + FMA intrinsics, chosen at run time (variant 2): on an AVX2 host GCC
// lowers the 64-byte vector types of the portable code poorly (the broadcast of each input and the accumulators go
// through the stack, seen in its assembly; bf16 read ~3 GB/s a core against ~6 for FP8). The same fused
// multiply-adds in the same order as the portable code (which GCC contracts to FMAs on such a host): the same bits.
template <int G>
__attribute__((target("avx2,fma"))) void row_avx2(const float* x, const float* w, int64_t panel, int64_t K,
                                                   float* acc) {
  __m256 c[2 * G];
  for (int i = 0; i < 2 * G; ++i) c[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int g = 0; g < G; ++g) {
      const float* p = w + g * panel + k * NR;
      c[2 * g] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p), c[2 * g]);
      c[2 * g + 1] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 8), c[2 * g + 1]);
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(acc + g * NR, c[2 * g]);
    _mm256_storeu_ps(acc + g * NR + 8, c[2 * g + 1]);
  }
}

// bf16: a 32-bit lane's low half (input 2k) widened by a 16-bit shift, its high half by a mask
template <int G>
__attribute__((target("avx2,fma"))) void row_avx2(const uint32_t* xp, const c10::BFloat16* w, int64_t panel,
                                                   int64_t K2, float* acc) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const int64_t lanes = panel / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 c[2 * G];
  for (int i = 0; i < 2 * G; ++i) c[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m256i xk = _mm256_set1_epi32(static_cast<int>(xp[k]));
    const __m256 xa = _mm256_castsi256_ps(_mm256_slli_epi32(xk, 16)), xz = _mm256_castsi256_ps(_mm256_and_si256(xk, high));
    for (int g = 0; g < G; ++g) {
      const uint32_t* p = wp + g * lanes + k * NR;
      for (int h = 0; h < 2; ++h) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * h));
        c[2 * g + h] = _mm256_fmadd_ps(xa, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), c[2 * g + h]);
        c[2 * g + h] = _mm256_fmadd_ps(xz, _mm256_castsi256_ps(_mm256_and_si256(u, high)), c[2 * g + h]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(acc + g * NR, c[2 * g]);
    _mm256_storeu_ps(acc + g * NR + 8, c[2 * g + 1]);
  }
}
#endif

// the variant `variant` resolves to here: 1 portable (the vector code above, AVX-512 or AVX512-BF16 where the
// build has them), 2 AVX2 + FMA for one row, 3 AMX for several bf16 rows (one row: portable), 4 AMX's layout
// with its arithmetic in scalar C++ (tests; never auto's pick); 0: amx where the host runs it, else AVX2 where the
// CPU has it and the build has no AVX-512F (whose portable code is already fast), else portable. An error names
// what a forced one lacks.
int64_t row_variant(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 4,
              "panel kernel: variant 0 (auto), 1 (portable), 2 (avx2), 3 (amx), 4 (amx_emulated), got ", variant);
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
void rows_block(int r, const X* xt, int64_t ldx, const T* w, int64_t K, float* acc) {
  switch (r) {
#define ROWS(i) case i: block<i>(xt, ldx, w, K, acc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15)
#undef ROWS
    default: block<MR>(xt, ldx, w, K, acc); break;
  }
}

// panels [p0, p1) of xt (Kp, M) the rows' inputs transposed (fp32, or bf16 pairs), w (P, Kp, NR) -> out (M, N); with
// res (M, N), out = res + (the Linear's output rounded to T), rounded to T: what `res + linear(x)` gives (res may be
// out: each element is read, then written, by the thread that owns its panel). Each panel's sums do not depend on how
// the panels or rows are split (one row: groups of G panels, the rest one at a time; rows: blocks of any size; the
// same sums in the same order), so any split over threads gives the same bits (the fused step's team splits them)
template <typename X, typename T, typename O = T>
void run_range(const X* xt, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res, O* out,
               int64_t variant, int64_t p0, int64_t p1) {
  const int64_t panel = Kp * NR * (std::is_same_v<T, float> ? 1 : 2);  // elements of T per panel
  // the sums of panel p for rows m0 .. m0 + r - 1 (acc: r x NR) plus the bias, rounded into out
  auto store = [&](int64_t p, int64_t m0, int r, const float* acc) {
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
  };
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
  float acc[2 * MR * NR];  // block2: two panels of up to MR2 rows
  int64_t p = p0;
  if (M == 1) {  // G panels a pass (the same sums, in the same order, as one panel at a time)
    constexpr int G = 4;
    if constexpr (std::is_same_v<T, c10::BFloat16>)  // bf16 rows: up to ROW_G_BF16 panels a pass (see there)
      for (int64_t g; variant != 2 && (g = std::min<int64_t>(ROW_G_BF16, p1 - p)) > G; p += g) {
        ROW_BF16[g - 1](xt, w + p * panel, panel, Kp, acc);
        for (int64_t i = 0; i < g; ++i) store(p + i, 0, 1, acc + i * NR);
      }
    for (; p + G <= p1; p += G) {
#if PANEL_X86
      if (variant == 2) row_avx2<G>(xt, w + p * panel, panel, Kp, acc);
      else
#endif
        row_panels<G>(xt, w + p * panel, panel, Kp, acc);
      for (int g = 0; g < G; ++g) store(p + g, 0, 1, acc + g * NR);
    }
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (M > 1)
      for (; p + 2 <= p1; p += 2)
        for (int64_t nb = (M + MR2 - 1) / MR2, m0 = 0, b = 0, r; m0 < M; m0 += r, ++b) {
          r = M / nb + (b < M % nb);  // blocks of near-equal rows (below)
          rows_block2(static_cast<int>(r), xt + m0, M, w + p * panel, panel, Kp, acc);
          store(p, m0, r, acc);
          store(p + 1, m0, r, acc + r * NR);
        }
  }
#endif
  for (; p < p1; ++p)  // blocks of near-equal rows (34: 12 + 11 + 11, not 16 + 16 + 2, whose 2 sums wait on latency)
    for (int64_t nb = (M + MR - 1) / MR, m0 = 0, b = 0, r; m0 < M; m0 += r, ++b) {
      r = M / nb + (b < M % nb);
      rows_block(static_cast<int>(r), xt + m0, M, w + p * panel, Kp, acc);
      store(p, m0, static_cast<int>(r), acc);
    }
}

// all panels of the Linear (run_range) over torch's intra-op threads
template <typename X, typename T, typename O = T>
void run(const X* xt, int64_t M, int64_t Kp, const T* w, int64_t N, const float* bias, const O* res, O* out,
         int64_t variant) {
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t p0, int64_t p1) {
    run_range(xt, M, Kp, w, N, bias, res, out, variant, p0, p1);
  });
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
    auto xt = x.t().contiguous();  // (K, M): one input's row values adjacent
    run(xt.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, bp, with_res ? residual->data_ptr<float>() : nullptr,
        out.data_ptr<float>(), v);
  } else if (x.scalar_type() == torch::kBFloat16) {
    const int64_t K2 = (K + 1) / 2;
    TORCH_CHECK(panels.dim() == 4 && panels.size(1) == K2 && panels.size(3) == 2,
                "panel_linear: bf16 panels (P, ceil(K / 2), 16, 2)");
    auto xt = bf16_rows(x, v);
    run(reinterpret_cast<const uint32_t*>(xt.data_ptr<c10::BFloat16>()), M, K2, panels.data_ptr<c10::BFloat16>(),
        N, bp, with_res ? residual->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(), v);
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
  auto xt = bf16_rows(x, v);
  run(reinterpret_cast<const uint32_t*>(xt.data_ptr<c10::BFloat16>()), M, K2, panels.data_ptr<c10::BFloat16>(), N,
      static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), out.data_ptr<float>(), v);
  return out;
}

// the one-row variant `variant` resolves to on this CPU (see row_variant)
int64_t panel_variant(int64_t variant) { return row_variant(variant); }
