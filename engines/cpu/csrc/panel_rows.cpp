// The panel kernel's arithmetic (csrc/panel_kernel.cpp runs it; compiled just before it, in the same namespace): a
// row block of one panel (fp32, bf16), two fp32 panels at once, one row through several panels (AVX-512 or
// portable vector code, and AVX2 + FMA intrinsics), and where each asks for lines ahead of its reads.
#include <torch/types.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <utility>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#define PANEL_X86 1
#endif

namespace {

constexpr int64_t NR = 16;  // outputs per panel
constexpr int MR = 16;      // rows per block: MR vector accumulators

// fn(i0, i1) over the items [0, n) on torch's intra-op threads, in claims taken from a shared counter, each claim
// what is left / (2 x threads), at least `least` and a multiple of it: a thread the OS stops (another process on its
// core) holds the call up for the claim it is in, not for the rest of a static share as at::parallel_for's ranges do,
// and the claims shrink toward the end, so the threads still end together. 2-core Zen 4, 2 threads, beside a process
// taking 1 ms of every 10 on a core (old and new builds alternating in one process): SmolLM2's 2,048 x 576
// -> 3,072 fp32 through the panel kernel 1.044-1.055x its time alone, against 1.087-1.090x with static shares (alone:
// the same time, 39.3 / 39.6 ms AVX-512, 35.4 / 35.1 AVX2); a whole 2,048-token prefill step (half its multiply-adds
// in oneDNN's static shares) 1.067-1.082x against 1.077-1.098x.
template <typename F>
void claimed_for(int64_t n, int64_t least, const F& fn) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (n + least - 1) / least);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.load(std::memory_order_relaxed), g; i < n;) {
      g = (std::max(least, (n - i) / (2 * nt)) + least - 1) / least * least;
      if (next.compare_exchange_weak(i, std::min(n, i + g), std::memory_order_relaxed)) {
        fn(i, std::min(n, i + g));
        i = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// fn(q, p0, p1) over the (chunk q, panel p) items of nq chunks of rows x P panels, claimed (claimed_for) chunk by chunk:
// a claim's items cut at each chunk's end
template <typename F>
void claimed_chunks(int64_t nq, int64_t P, const F& fn) {
  claimed_for(nq * P, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0, q; i < i1; i = (q + 1) * P) {
      q = i / P;
      fn(q, i - q * P, std::min(i1 - q * P, P));
    }
  });
}
// whether variant `variant`'s M bf16 rows are laid out widened, each pair as two fp32 (K2, M, 2; widen_rows), not as
// 32-bit pairs (K2, M): the AVX2 several-row blocks read them so (block_avx2 on xw)
inline bool wide_rows(int64_t variant, int64_t M) { return variant == 2 && M > 1; }
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf as_f(vu u) { vf v; std::memcpy(&v, &u, sizeof(vf)); return v; }
inline vu load_u(const void* p) { vu u; std::memcpy(&u, p, sizeof(vu)); return u; }
inline vu as_u(vf v) { vu u; std::memcpy(&u, &v, sizeof(vu)); return u; }
// Lines asked for ahead of the reads go to L2 (prefetcht1: a deeper miss queue than L1's). Several rows: a panel's first
// row block reads it from memory, a line per 8-16 cycles of arithmetic, and asks for its lines 4 KB ahead; each later
// block asks for its share of the next panel's lines (Pf), so the weights stream in during all of a panel's blocks.
// SmolLM2's offline mix, Zen 4, decode at ~34 rows: bf16 729 (none) -> 751-806 (into L1) -> 826-843 tok/s (the shares:
// no change); fp32 the shares 469 -> 484. One row: 512 bytes ahead, bf16 +1.7 %, fp32 +2.1 % (into L1: -0.6 %)
inline void ahead(const void* p, int64_t by = 4096) { __builtin_prefetch(static_cast<const char*>(p) + by, 0, 2); }
struct Pf {  // where a row block asks: `share` null, 4 KB ahead of the line read; else a line of it every 65536 / inv steps
  const char* share = nullptr;
  int64_t inv = 0;
  void operator()(const void* line, int64_t k, int64_t plus = 0) const {
    if (share) __builtin_prefetch(share + plus + ((k * inv) >> 16) * 64, 0, 2);
    else ahead(static_cast<const char*>(line) + plus);
  }
};
struct NoPf {  // a block whose weights are already in L1 (run_blocked's later blocks): no asking
  void operator()(const void*, int64_t, int64_t = 0) const {}
};
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
inline void block(const float* xt, int64_t ldx, const float* w, int64_t K, float* acc, const Pf& f) {
#if defined(__AVX512F__)
  __m512 c[R];
  for (int m = 0; m < R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_loadu_ps(w + k * NR);
    f(w + k * NR, k);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < R; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), b, c[m]);
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(acc + m * NR, c[m]);
#else
  vf c[R];
  for (int m = 0; m < R; ++m) c[m] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const vf b = as_f(load_u(w + k * NR));
    f(w + k * NR, k);
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
inline void block2(const float* xt, int64_t ldx, const float* w, int64_t panel, int64_t K, float* acc, const Pf& f) {
  __m512 c[2 * R];
  for (int m = 0; m < 2 * R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(w + k * NR), b1 = _mm512_loadu_ps(w + panel + k * NR);
    f(w + k * NR, k), f(w + k * NR, k, panel * 4);
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
inline void rows_block2(int r, const float* xt, int64_t ldx, const float* w, int64_t panel, int64_t K, float* acc, const Pf& f) {
  switch (r) {
#define ROWS(i) case i: block2<i>(xt, ldx, w, panel, K, acc, f); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11)
#undef ROWS
    default: block2<MR2>(xt, ldx, w, panel, K, acc, f); break;
  }
}
#endif

// bf16: the weight panel is (K2, NR) pairs, a 32-bit lane holding inputs 2k (low half) and 2k + 1
// (high half) of one output; xp (K2, ldx) the rows' inputs paired the same way. With AVX512-BF16 one
// vdpbf16ps does both products of a lane (fp32 sums, flushing denormals); elsewhere both halves are
// widened (a bf16 is the high half of an fp32) and multiplied in fp32
template <int R>
inline void block(const uint32_t* xp, int64_t ldx, const c10::BFloat16* w, int64_t K2, float* acc, const Pf& f) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
#if defined(__AVX512BF16__)
  __m512 c[R];
  for (int m = 0; m < R; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh b = (__m512bh)_mm512_loadu_si512(wp + k * NR);
    f(wp + k * NR, k);
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
    f(wp + k * NR, k);
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
constexpr int ROW_G_AVX2_BF16 = 6;  // the same for variant 2 (ROW_AVX2_BF16, below)
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

// bf16, one row, AVX2: ROW_AVX2_BF16[g - 1] runs g panels at once, g <= ROW_G_AVX2_BF16 (12 sums, the pair's two
// halves, the mask and a weight vector: the 16 ymm registers, no spill). As ROW_G_BF16, more streams in flight: SmolLM2's
// 120 block Linears alone, 2 threads, 2-core AVX2 EPYC (Zen 3), six rounds interleaved: 4 panels a pass 16.6 GB/s
// (median), 5 17.9, 6 20.0
template <int... I>
constexpr std::array<RowBf16, sizeof...(I)> row_avx2_bf16_table(std::integer_sequence<int, I...>) {
  return {&row_avx2<I + 1>...};
}
const auto ROW_AVX2_BF16 = row_avx2_bf16_table(std::make_integer_sequence<int, ROW_G_AVX2_BF16>());

// Several rows with AVX2 + FMA (variant 2): block<R>'s sums, a panel's 16 outputs as two ymm registers a row. The
// portable code's 64-byte vectors on such a host kept its MR rows' sums on the stack (every k: a load and a store
// of each), and fast_linear timed it 5x slower than oneDNN at 32 rows (SmolLM2's 3072 x 576, Zen 3: 8.6 ms against
// 1.6), so decode batches never ran it there. Rows a block: fp32 6 (12 sums + 2 weight vectors + the broadcast: 15
// of the 16 registers), bf16 4 (8 sums + a pair's two halves of 16 lanes + the row's two halves + the mask). Each
// output is the same chain of fused multiply-adds in the same order as block<R> (bf16: the pair's low half, then its
// high half): the same bits.
constexpr int MR_AVX2 = 6, MR_AVX2_BF16 = 4;

// RM (row-major, prefill chunks: run_blocked): row m's k-th input at x[m * ldx + k], the rows as the model holds them
// (bf16: widened to fp32 in place, x[m * ldx + 2k], +1), no layout pass (a transpose of 2,048 x 576 fp32 took 2.2 ms,
// 15 % of that Linear); else x[k * ldx + m] (transposed, the decode layout). C: the sums go on from acc (rows_avx2).
// The loops over rows are unrolled first (GCC unroll): left to GCC, the sums' zeroing became a memset and all of them
// lived on the stack (a load and a store each, every k: half the speed) wherever a block was not inlined.
template <int R, bool RM, bool C, typename F>
__attribute__((target("avx2,fma"))) void block_avx2(const float* xt, int64_t ldx, const float* w, int64_t K,
                                                     float* acc, const F& f) {
  __m256 c[2 * R];
  _Pragma("GCC unroll 16") for (int i = 0; i < 2 * R; ++i) c[i] = C ? _mm256_loadu_ps(acc + (i / 2) * NR + (i % 2) * 8) : _mm256_setzero_ps();
  _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(w + k * NR), b1 = _mm256_loadu_ps(w + k * NR + 8);
    f(w + k * NR, k);
    _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
      const __m256 a = _mm256_broadcast_ss(RM ? xt + m * ldx + k : xt + k * ldx + m);
      c[2 * m] = _mm256_fmadd_ps(a, b0, c[2 * m]);
      c[2 * m + 1] = _mm256_fmadd_ps(a, b1, c[2 * m + 1]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(acc + m * NR, c[2 * m]);
    _mm256_storeu_ps(acc + m * NR + 8, c[2 * m + 1]);
  }
}

// a row's bf16 pair of inputs (at p) as two fp32 broadcasts: from its 32-bit pair (a shift and a mask), or already
// widened (wide_rows, RM: two broadcasts, no integer work; 45 -> ~100 GFLOP/s at 32 rows)
__attribute__((target("avx2,fma"))) inline void pair_halves(const uint32_t* p, __m256& xa, __m256& xz) {
  const __m256i xm = _mm256_set1_epi32(static_cast<int>(*p));
  xa = _mm256_castsi256_ps(_mm256_slli_epi32(xm, 16));
  xz = _mm256_castsi256_ps(_mm256_and_si256(xm, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
__attribute__((target("avx2,fma"))) inline void pair_halves(const float* p, __m256& xa, __m256& xz) {
  xa = _mm256_broadcast_ss(p), xz = _mm256_broadcast_ss(p + 1);
}

// bf16 weights: xp (K2, ldx) the rows' pairs, as 32-bit pairs (X uint32_t) or widened (X float, wide_rows); RM: rows
// of widened pairs
template <int R, bool RM, bool C, typename X, typename F>
__attribute__((target("avx2,fma"))) void block_avx2(const X* xp, int64_t ldx, const c10::BFloat16* w,
                                                     int64_t K2, float* acc, const F& f) {
  constexpr int64_t S = std::is_same_v<X, float> ? 2 : 1;  // X elements a pair
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 c[2 * R];
  _Pragma("GCC unroll 16") for (int i = 0; i < 2 * R; ++i) c[i] = C ? _mm256_loadu_ps(acc + (i / 2) * NR + (i % 2) * 8) : _mm256_setzero_ps();
  _Pragma("GCC unroll 4") for (int64_t k = 0; k < K2; ++k) {
    const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * NR));
    const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * NR + 8));
    f(wp + k * NR, k);
    const __m256 lo0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)), hi0 = _mm256_castsi256_ps(_mm256_and_si256(u0, high));
    const __m256 lo1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16)), hi1 = _mm256_castsi256_ps(_mm256_and_si256(u1, high));
    _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
      __m256 xa, xz;
      pair_halves(RM ? xp + m * ldx + S * k : xp + k * ldx + S * m, xa, xz);
      c[2 * m] = _mm256_fmadd_ps(xz, hi0, _mm256_fmadd_ps(xa, lo0, c[2 * m]));
      c[2 * m + 1] = _mm256_fmadd_ps(xz, hi1, _mm256_fmadd_ps(xa, lo1, c[2 * m + 1]));
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(acc + m * NR, c[2 * m]);
    _mm256_storeu_ps(acc + m * NR + 8, c[2 * m + 1]);
  }
}

// block_avx2 for r rows (1 .. the dtype's rows a block); carry: the sums go on from acc (a later slice of the inputs:
// the same chain of multiply-adds, so the same bits as one pass)
template <bool RM, bool C, typename X, typename T, typename F>
void rows_avx2_(int r, const X* xt, int64_t ldx, const T* w, int64_t K, float* acc, const F& f) {
  switch (std::is_same_v<T, float> ? r : std::min(r, MR_AVX2_BF16)) {
    case 1: block_avx2<1, RM, C>(xt, ldx, w, K, acc, f); break;
    case 2: block_avx2<2, RM, C>(xt, ldx, w, K, acc, f); break;
    case 3: block_avx2<3, RM, C>(xt, ldx, w, K, acc, f); break;
    case 4: block_avx2<4, RM, C>(xt, ldx, w, K, acc, f); break;
    case 5: if constexpr (std::is_same_v<T, float>) block_avx2<5, RM, C>(xt, ldx, w, K, acc, f); break;
    default: if constexpr (std::is_same_v<T, float>) block_avx2<MR_AVX2, RM, C>(xt, ldx, w, K, acc, f); break;
  }
}
template <bool RM = false, typename X, typename T, typename F>
void rows_avx2(int r, const X* xt, int64_t ldx, const T* w, int64_t K, float* acc, const F& f, bool carry = false) {
  if constexpr (RM) {
    if (carry) rows_avx2_<true, true>(r, xt, ldx, w, K, acc, f);
    else rows_avx2_<true, false>(r, xt, ldx, w, K, acc, f);
  } else {
    rows_avx2_<false, false>(r, xt, ldx, w, K, acc, f);
  }
}
#endif

// Several rows on AVX2 (variant 2): fp32 from 2 rows, bf16 from BLOCKED_ROWS (prefill chunks, the fused step's
// decode batches). The decode layout (K, M) puts a 6-row block's inputs M * 4 bytes apart (2,048 rows: a page a
// step, 6 values of each 64-byte line), and laying it out costs a pass over x; so these blocks read the rows as they
// are (RM, fp32; bf16 widened to fp32, an odd K's missing input zero). A thread takes a chunk of blocks whose rows
// fit in L2 (CHUNK_BYTES) through each of its panels, a slice of the panel at a time (16 KB of fp32 weights, kept in
// L1 for all the chunk's blocks, where the decode layout reads a panel of more than 512 inputs from L2 once a block);
// each output's sums go on from where they were (carry): the same chain of multiply-adds as one pass, the same bits
// as the portable code. 2-core Zen 2, 2 threads, the GPT-2 and SmolLM2 Linears (K 576-3,072), median of 7, both ways
// in one process: fp32 1.03-1.69x the decode layout at every row count from 2 to 47 (1.26-1.61x at 47), and the
// offline mixes' decode steps (the fused team's Linears) GPT-2 fp32 1.05x, SmolLM2 fp32 1.04x; bf16 (slice_sums:
// widened once a slice) 0.67-0.99x at 2-8 rows, 0.99-1.12x at 16, 1.13-1.31x at 24-47, the SmolLM2 bf16 mix 1.02x
// from 16 rows against 48.
constexpr int64_t BLOCKED_ROWS = 16, CHUNK_BYTES = 256 << 10, KC = 256, CHUNK_MAX = 64;
#if PANEL_X86
inline bool blocked_rows(int64_t variant, int64_t M, bool bf16) {
  return variant == 2 && M >= (bf16 ? BLOCKED_ROWS : 2);
}
#else
inline bool blocked_rows(int64_t, int64_t, bool) { return false; }
#endif

// row blocks a chunk of the blocked rows (ldx apart): their rows fit in L2
inline int64_t chunk_blocks(int64_t ldx) { return std::clamp<int64_t>(CHUNK_BYTES / (ldx * MR_AVX2 * 4), 1, CHUNK_MAX); }
inline int64_t chunks_of(int64_t M, int64_t ldx) {
  const int64_t nb = (M + MR_AVX2 - 1) / MR_AVX2;
  return (nb + chunk_blocks(ldx) - 1) / chunk_blocks(ldx);
}

#if defined(__AVX512F__)
// transpose_rows' full blocks (csrc/panel_kernel.cpp): 16 x 16 32-bit elements, rows ls apart, to dst's rows ld apart,
// transposed in registers: 32-bit then 64-bit interleaves within 128-bit lanes (after which r[4 i + s]'s lane j holds
// column 4 j + s of rows 4 i .. 4 i + 3), then the lanes gathered. The element-by-element loop took ~2 cycles an
// element: laying out each piece's queries and exponentials so (with the queries' copy) was 17 % of SmolLM2's bf16
// causal prefill attention on Zen 4
template <typename E>
inline void transpose16(const E* src, int64_t ls, E* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ls);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int s = 0; s < 4; ++s) {  // column 4 j + s: lane j of r[s], r[4 + s], r[8 + s], r[12 + s]
    const __m512i v0 = _mm512_shuffle_i32x4(r[s], r[4 + s], 0x44), v1 = _mm512_shuffle_i32x4(r[s], r[4 + s], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0xEE);
    _mm512_storeu_si512(dst + s * ld, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (4 + s) * ld, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (8 + s) * ld, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (12 + s) * ld, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}
#endif

}  // namespace
