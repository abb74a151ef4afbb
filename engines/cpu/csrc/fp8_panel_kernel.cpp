// FP8 (e4m3) weight-only Linear for CPU decode, its kernels: built after csrc/panel_kernel.cpp into one module;
// csrc/fp8_range.cpp, after it, drives them and binds them (engines/cpu/panel_kernel.py fp8_*; the fused decode
// step, csrc/fused_decode.cpp, calls fp8_linear_res).
//
// The weight stays one byte a weight in memory, stored as panels (ceil(N / 16), ceil(K / 2), 32): for each pair
// of inputs, a 32-byte chunk with each of 16 outputs' two bytes side by side, so a panel is one sequential
// read. The vector variants widen 32 bytes in registers with 8 integer ops into 4 fp32 vectors of the weights
// times 2^-120, exactly (decode32_avx2: the byte becomes a bf16 whose exponent has the wrong bias, widened
// as the bf16 panel kernel widens bf16); the input rows are scaled by 2^90 instead, so every product is x w
// 2^-30, a normal fp32 (exact scalings: rows with |x| >= 2^38 would overflow; activations are far below). The
// first version of this kernel widened 8 bytes to 32-bit lanes and shifted the bits into an fp32 (7 ops per
// 8 weights), the second to fp16 and F16C (12 uops per 16): both compute-bound on the 2-core AVX2 EPYC (SmolLM2's
// decode Linears on one thread: 6.6 and 7.1 GB/s of FP8 bytes; this one 8.5-9.1, the bf16 panel kernel 11.6-12.7). The e4m3 NaN
// pattern (0x7f / 0xff) reads as +-480: weights hold no NaN. Sums over the inputs in fp32, in order, one
// fused multiply-add an input (std::fma in the portable variant, on unscaled rows: the same bits); the
// per-output (channel) scale, the scale-back and the bias applied once at the end: y[m, n] = scale[n] *
// sum_k x[m, k] w[n, k] + bias[n], rounded to x's dtype (+ a residual, rounded again, as torch's `res + y`).
//
// Variants, chosen at run time (variant 0) or forced: 1 portable (scalar C++, the reference), 2 AVX2 + FMA
// (8 lanes, two registers a panel), 3 AVX-512F/DQ (16 lanes, GCC vector code), 4 variant 3's source built for
// AVX2 + FMA (never chosen: it exists so variant 3's body is tested on hosts without AVX-512), 5 AVX512-BF16 for
// bf16 rows (one vdpbf16ps a chunk, below), 6 variant 5's arithmetic in scalar C++ (never chosen: it checks
// variant 5's order and flushes on any host, and equals it bit for bit where both run). Each is compiled
// for its own target whatever the build host (function target attributes), and runs only where the CPU has it
// (checked per call). One row (batch-1 decode) runs G panels at once: G streams of weights in flight.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define F8_X86 1
#endif
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t F8_NR = 16;  // outputs per panel
constexpr int F8_MR = 4;       // rows per block: 2 x 4 accumulators + 4 weights + 2 broadcasts of 16 ymm
constexpr int F8_G = 4;        // panels a pass for one row
constexpr int64_t F8_BLOCK = 4;  // passes a block, at most, for one row on AVX2 (fp8_range)
constexpr int F8_GW = 16;      // ... at most, in the one-row AVX512-BF16 loop (row_bf16)
constexpr int64_t F8_AHEAD_W = 1024;  // bytes ahead that loop requests on each panel (into L2, see row_bf16)
constexpr float X_UP = 0x1p90f, W_DOWN = 0x1p-120f;  // rows scaled up, the decoded weights' scale (see the top)
// position of output j's pair in a 32-byte chunk (an involution: output ORDER[p] sits at position p)
constexpr int ORDER[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// a row's inputs 2 k2, 2 k2 + 1 (fp32 holding bf16 values) as one 32-bit pair, input 2 k2 + 1 in the high half,
// as the chunk's bytes lie (the bf16 variants 5 and 6)
inline uint32_t x_pair(const float* x) {
  uint32_t a, b;
  std::memcpy(&a, x, 4);
  std::memcpy(&b, x + 1, 4);
  return (b & 0xFFFF0000u) | (a >> 16);
}

// e4m3 byte -> its value times 2^-8 (fp32, exact), the portable reference's decoding
inline float e4m3_scaled(uint8_t b) {
  const float mag = std::ldexp(static_cast<float>(b & 7), -3);  // mantissa / 8
  const int e = (b >> 3) & 15;
  const float v = e ? std::ldexp(1.f + mag, e - 7 - 8) : std::ldexp(mag, -6 - 8);
  return (b & 0x80) ? -v : v;
}

// acc (r, F8_NR) = x (r rows, ldx apart; fp32, unscaled) @ the panel (K2 chunks of 32 bytes) decoded; the
// sums times 2^-8 (the store multiplies by scale * 2^8)
void block_portable(const float* x, int64_t ldx, int r, const uint8_t* w, int64_t K2, float* acc) {
  std::fill(acc, acc + r * F8_NR, 0.f);
  for (int64_t k2 = 0; k2 < K2; ++k2)
    for (int t = 0; t < 2; ++t)  // inputs 2 k2, 2 k2 + 1 in order
      for (int64_t j = 0; j < F8_NR; ++j) {
        const float wk = e4m3_scaled(w[k2 * 32 + 2 * ORDER[j] + t]);
        for (int m = 0; m < r; ++m)
          acc[m * F8_NR + j] = std::fma(x[m * ldx + 2 * k2 + t], wk, acc[m * F8_NR + j]);
      }
}

#if F8_X86
// 32 bytes (inputs 2 k2 and 2 k2 + 1 of 16 outputs) -> 4 fp32 vectors of the weights times 2^-120, exactly:
// a byte in the high half of a 16-bit lane (s eeee mmm 0^8), shifted right by 4 arithmetically and masked
// (s 0000 eeee mmm 0000), is a bf16 with the e4m3 exponent under bias 127 instead of 7 (subnormals
// included, as bf16 denormals); a 32-bit lane holds one output's two inputs, widened as the bf16 kernel
// does (a 16-bit shift, a mask). a0 / b0: outputs 0-7, inputs 2 k2 / 2 k2 + 1; a1 / b1: outputs 8-15
__attribute__((target("avx2,fma"))) inline void decode32_avx2(const uint8_t* p, __m256& a0, __m256& b0, __m256& a1,
                                                              __m256& b1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16(static_cast<short>(0x87F0));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, v), 4), keep);  // outputs 0-7
  const __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, v), 4), keep);  // 8-15
  a0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
  b0 = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
  a1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
}

// x: R rows scaled by X_UP, ldx apart (padded to 2 K2). Every loop over the sums unrolled: with the row count a
// run-time bound they lived on the stack (a load and a store each, every chunk). SmolLM2's 120 block Linears, 2
// threads, 2-core Zen 3, both builds alternating in one process, median of 15: 4 rows 1.25x, 16 rows 1.30x; same bits
template <int R>
__attribute__((target("avx2,fma"))) void block_rows_avx2(const float* x, int64_t ldx, const uint8_t* w, int64_t K2,
                                                          float* acc) {
  __m256 c[2 * R];
  _Pragma("GCC unroll 16") for (int i = 0; i < 2 * R; ++i) c[i] = _mm256_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m256 a0, b0, a1, b1;
    decode32_avx2(w + k2 * 32, a0, b0, a1, b1);
    _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
      const __m256 xa = _mm256_broadcast_ss(x + m * ldx + 2 * k2), xb = _mm256_broadcast_ss(x + m * ldx + 2 * k2 + 1);
      c[2 * m] = _mm256_fmadd_ps(xb, b0, _mm256_fmadd_ps(xa, a0, c[2 * m]));
      c[2 * m + 1] = _mm256_fmadd_ps(xb, b1, _mm256_fmadd_ps(xa, a1, c[2 * m + 1]));
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(acc + m * F8_NR, c[2 * m]);
    _mm256_storeu_ps(acc + m * F8_NR + 8, c[2 * m + 1]);
  }
}

// chunks [0, kc) of one panel decoded to fp32 (2 kc, F8_NR) times 2^-120: input 2 k's 16 weights in output order, then
// input 2 k + 1's, as the fp32 row blocks read a panel (fp8_range.cpp wide_rows_avx2)
__attribute__((target("avx2,fma"))) inline void decode_panel_avx2(const uint8_t* w, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    __m256 a0, b0, a1, b1;
    decode32_avx2(w + k * 32, a0, b0, a1, b1);
    _mm256_storeu_ps(dst + 2 * k * F8_NR, a0);
    _mm256_storeu_ps(dst + 2 * k * F8_NR + 8, a1);
    _mm256_storeu_ps(dst + (2 * k + 1) * F8_NR, b0);
    _mm256_storeu_ps(dst + (2 * k + 1) * F8_NR + 8, b1);
  }
}

// r (1 .. F8_MR) rows
void block_avx2(const float* x, int64_t ldx, int r, const uint8_t* w, int64_t K2, float* acc) {
  static_assert(F8_MR == 4, "block_avx2 dispatches 1 to 4 rows");
  switch (r) {
    case 1: return block_rows_avx2<1>(x, ldx, w, K2, acc);
    case 2: return block_rows_avx2<2>(x, ldx, w, K2, acc);
    case 3: return block_rows_avx2<3>(x, ldx, w, K2, acc);
    default: return block_rows_avx2<4>(x, ldx, w, K2, acc);
  }
}

// The one-row loop's decoding of a chunk, with no byte unpacking: a 16-bit lane of the chunk is one position's pair
// (the input 2 k2 + 1 byte high, 2 k2 low). The odd byte is decoded in place (an arithmetic shift right by 4); the
// even one is multiplied by 16 into its lane, sign-extended (vpmaddubsw with 16 for the low byte and 0 for the high:
// what a 16-bit shift left by 8 and arithmetic right by 4 give, in one op on the multiply pipe instead of two on
// the shift pipe); a 32-bit lane then holds two positions: its high half masked (s 0000 eeee mmm 0000 0^16), its low
// half shifted up by 16 and masked. a0 / b0: positions 0, 2, .., 14, inputs 2 k2 / 2 k2 + 1; a1 / b1: positions 1, 3,
// .., 15 (row_avx2 puts the sums back in output order). 8 vector ops a chunk, 2 constants (so row_avx2<4>'s 8 sums
// stay in registers). History on the 2-core Zen 2, same bits at every step: the first pairs decoding (9 ops, 5 shifts,
// against decode32_avx2's 10) 16.7 -> 18.7 GB/s of FP8 bytes on SmolLM2's 120 block Linears, one row, 2 threads; the
// low halves moved up by vpshufb instead of 32-bit shifts (3 shifts, 2 shuffles) 14.4-15.3 -> 18.0-18.9 GB/s in L2 on
// one thread, SmolLM2 FP8 + head batch 1 142.2 -> 149.0 tok/s; one mask after the shuffle for all four (no spilled
// sums) 0.99-1.07x. Now (2026-12-05, alternating builds): one thread over 1.2 MB in L3 1.04-1.08x in 6 of 8 pairs
// (0.97-0.98x in 2); the model, FP8 + FP8 head, batch 1, 2 threads, median of 7 a process: 1.00-1.08x in 4 of 4
// pairs. Not kept: the even byte by vpmaddubsw with the low halves still moved by vpshufb (a third constant:
// GCC spills a sum) 0.95-1.00x in L3; both bytes by vpmaddubsw (a third constant, both on the multiply pipe) 0.94x
__attribute__((target("avx2,fma"))) inline void decode32_pairs_avx2(const uint8_t* p, __m256& a0, __m256& b0, __m256& a1,
                                                                    __m256& b1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x87F00000u));  // a high half's sign, exponent, mantissa
  // the even byte times 16, sign-extended: the 16-bit shift left by 8 and arithmetic right by 4 in one multiply-add
  const __m256i even = _mm256_maddubs_epi16(_mm256_set1_epi16(16), v), odd = _mm256_srai_epi16(v, 4);
  a0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(even, 16), keep));
  b0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(odd, 16), keep));
  a1 = _mm256_castsi256_ps(_mm256_and_si256(even, keep));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(odd, keep));
}

// bytes ahead of the chunk being read that the one-row AVX2 loop asks for: each of its G panels is a stream of
// only K2 * 32 bytes (9 KB on SmolLM2's width), too short for the hardware prefetchers to ramp up on before it
// ends, so the loop requests its lines itself, running on into the next group's panel of the same slot (G
// panels on) near a panel's end (a request past the share or the tensor is dropped: prefetches never fault).
// The requests are non-temporal (prefetchnta: into L1, kept out of the outer levels as the line is used once a
// step), so the weights' stream no longer evicts what the step reads again (its activations, scales, KV cache,
// the interpreter's objects). SmolLM2 FP8 + FP8 head, batch 1, 2 threads, 2-core AVX2 EPYC (Zen 2), both ways
// switched in one process, medians of 10: 7.25 -> 6.27 ms a token (the team's Linears 3.94 -> 3.71 ms, the rest of
// the step 1.01 -> 0.78, the head and the interpreter outside it 2.21 -> 1.78); 512, 1024 and 2048 bytes ahead
// 6.31, 6.27 and 6.42 ms; none ahead (each request at the line being read) 8.08. The same requests in the bf16
// one-row kernel (which leaves its stream to the hardware prefetchers) cost 1-4 %; the AVX-512 variants keep
// prefetcht0 (not measured on such a host)
constexpr int64_t F8_AHEAD = 1024;
constexpr int64_t F8_AHEAD_WIDE = 2048;  // the wide (AVX-512) loop's, prefetcht0: as measured on Zen 4 before

// one chunk k2 of each of G panels (slot bytes apart) for one row (scaled) into c (2 G sums); ASK: the even chunks,
// which request a line F8_AHEAD bytes on in each panel (non-temporal, above), running on near a panel's end into that
// slot's next panel, `next` bytes from this one's start
template <int G, bool ASK>
__attribute__((target("avx2,fma"), always_inline)) inline void row_chunk_avx2(const float* x, const uint8_t* w,
                                                                              int64_t panel, int64_t slot, int64_t next,
                                                                              int64_t k2, __m256* c) {
  const __m256 xa = _mm256_broadcast_ss(x + 2 * k2), xb = _mm256_broadcast_ss(x + 2 * k2 + 1);
  const int64_t ahead = k2 * 32 + F8_AHEAD;
  const int64_t line = ahead < panel ? ahead : ahead - panel + next;
  _Pragma("GCC unroll 16") for (int g = 0; g < G; ++g) {
    if constexpr (ASK)  // a line every 2 chunks
      _mm_prefetch(reinterpret_cast<const char*>(w + g * slot + line), _MM_HINT_NTA);
    __m256 a0, b0, a1, b1;
    decode32_pairs_avx2(w + g * slot + k2 * 32, a0, b0, a1, b1);
    c[2 * g] = _mm256_fmadd_ps(xb, b0, _mm256_fmadd_ps(xa, a0, c[2 * g]));
    c[2 * g + 1] = _mm256_fmadd_ps(xb, b1, _mm256_fmadd_ps(xa, a1, c[2 * g + 1]));
  }
}

// one row (scaled) through G panels of panel bytes, slot bytes apart (a pass of consecutive panels: slot = panel; of
// a block's, fp8_range: slot = G panels): acc (G, F8_NR); near a panel's end the requests go to the slot's next
// panel, `next` bytes from this one's start (the next pass's: G panels on; a thread claiming from the back, its passes
// run from the last: G panels back). Every loop
// over the sums unrolled (GCC unroll) and two chunks a pass with one test: left to GCC, the sums lived on the stack
// (a store each, every chunk) and a pass ran ~99 instructions for 128 weights, ~76 now (a Zen 3 core issues 6 a
// cycle). SmolLM2's 120 block Linears from memory, one row, as block_rows_avx2: 2 threads 1.08x (20.6 -> 22.2 GB/s of
// FP8 bytes), one thread 1.12x (13.0 -> 14.5); same bits. Tried and not kept: each 32-bit lane's four bytes brought
// to its top by reading the chunk 0-3 bytes early (a shift and a mask a vector, 8 ops a chunk against 9): 1.00x
template <int G>
__attribute__((target("avx2,fma"))) void row_avx2(const float* x, const uint8_t* w, int64_t panel, int64_t K2,
                                                   float* acc, int64_t slot, int64_t next) {
  __m256 c[2 * G];
  _Pragma("GCC unroll 16") for (int i = 0; i < 2 * G; ++i) c[i] = _mm256_setzero_ps();
  int64_t k2 = 0;
  for (; k2 + 1 < K2; k2 += 2) {
    row_chunk_avx2<G, true>(x, w, panel, slot, next, k2, c);
    row_chunk_avx2<G, false>(x, w, panel, slot, next, k2 + 1, c);
  }
  if (k2 < K2) row_chunk_avx2<G, true>(x, w, panel, slot, next, k2, c);
  alignas(32) float s[2 * G][8];
  _Pragma("GCC unroll 16") for (int i = 0; i < 2 * G; ++i) _mm256_store_ps(s[i], c[i]);
  for (int g = 0; g < G; ++g)  // lane j of c[2 g] is position 2 j, of c[2 g + 1] position 2 j + 1
    for (int j = 0; j < 8; ++j) {
      acc[g * F8_NR + ORDER[2 * j]] = s[2 * g][j];
      acc[g * F8_NR + ORDER[2 * j + 1]] = s[2 * g + 1][j];
    }
}

// The wide (16-lane) variant, written once with GCC vector extensions (no intrinsics) so the same body builds
// for any x86 target: variant 3 compiles it for AVX-512F (one zmm a 16-lane vector) and runs where the CPU has
// it; variant 4 compiles it for AVX2 + FMA (GCC splits each 16-lane vector into two ymm), so the body the
// AVX-512 build runs is checked on every AVX2 host too (tests/test_cpu_fp8_kernel.py forces both). The
// multiply-adds are written `x * w + c` and contracted to one fused multiply-add each (GCC's default
// -ffp-contract=fast with FMA in the target; the tests compare the bits with the portable std::fma)
typedef uint16_t f8_u16x16 __attribute__((vector_size(32)));  // one 32-byte chunk: lane p = position p's pair
typedef uint32_t f8_u32x16 __attribute__((vector_size(64)));
typedef int32_t f8_i32x16 __attribute__((vector_size(64)));
typedef float f8_f32x16 __attribute__((vector_size(64)));

// 32 bytes -> the weights of inputs 2 k2 (a) and 2 k2 + 1 (b) for the 16 outputs, times 2^-120, exactly; lane
// p holds output ORDER[p]. Each byte moved to the top of a 32-bit lane, shifted right by 4 arithmetically and
// masked (s 0000 eeee mmm 0^20): an fp32 with the e4m3 exponent under bias 127 (subnormals as fp32 denormals)
__attribute__((always_inline)) inline void decode32_wide(const uint8_t* p, f8_f32x16& a, f8_f32x16& b) {
  f8_u16x16 z;
  std::memcpy(&z, p, 32);
  const f8_u32x16 u = __builtin_convertvector(z, f8_u32x16);  // byte 2p in bits 0-7, byte 2p + 1 in 8-15
  const f8_i32x16 keep = f8_i32x16{} + static_cast<int32_t>(0x87F00000u);
  a = reinterpret_cast<f8_f32x16>((reinterpret_cast<f8_i32x16>(u << 24) >> 4) & keep);
  b = reinterpret_cast<f8_f32x16>((reinterpret_cast<f8_i32x16>(u << 16) >> 4) & keep);
}

// the 16 sums of lane order into acc (F8_NR) in output order
__attribute__((always_inline)) inline void store_wide(const f8_f32x16& c, float* acc) {
  for (int q = 0; q < F8_NR; ++q) acc[ORDER[q]] = c[q];
}

// block_avx2's loop on 16-lane vectors (x: rows scaled by X_UP)
__attribute__((always_inline)) inline void block_wide(const float* x, int64_t ldx, int r, const uint8_t* w, int64_t K2,
                                                      float* acc) {
  f8_f32x16 c[F8_MR] = {};
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    f8_f32x16 a, b;
    decode32_wide(w + k2 * 32, a, b);
    for (int m = 0; m < r; ++m) c[m] = x[m * ldx + 2 * k2 + 1] * b + (x[m * ldx + 2 * k2] * a + c[m]);
  }
  for (int m = 0; m < r; ++m) store_wide(c[m], acc + m * F8_NR);
}

// row_avx2's loop (prefetch included) on 16-lane vectors: one row through G panels
template <int G, bool BACK = false>
__attribute__((always_inline)) inline void row_wide(const float* x, const uint8_t* w, int64_t panel, int64_t K2,
                                                    float* acc) {
  f8_f32x16 c[G] = {};
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const float xa = x[2 * k2], xb = x[2 * k2 + 1];
    const int64_t ahead = k2 * 32 + F8_AHEAD_WIDE;
    const int64_t line = ahead < panel ? ahead : BACK ? ahead - (G + 1) * panel : ahead + (G - 1) * panel;
    for (int g = 0; g < G; ++g) {
      if ((k2 & 1) == 0) __builtin_prefetch(w + g * panel + line, 0, 3);
      f8_f32x16 a, b;
      decode32_wide(w + g * panel + k2 * 32, a, b);
      c[g] = xb * b + (xa * a + c[g]);
    }
  }
  for (int g = 0; g < G; ++g) store_wide(c[g], acc + g * F8_NR);
}

// variant 3: the wide body on AVX-512 (zmm)
__attribute__((target("avx512f,avx512dq,avx2,fma"))) void block_avx512(const float* x, int64_t ldx, int r,
                                                                        const uint8_t* w, int64_t K2, float* acc) {
  block_wide(x, ldx, r, w, K2, acc);
}
__attribute__((target("avx512f,avx512dq,avx2,fma"))) void row4_avx512(const float* x, const uint8_t* w, int64_t panel,
                                                                       int64_t K2, float* acc) {
  row_wide<F8_G>(x, w, panel, K2, acc);
}
__attribute__((target("avx512f,avx512dq,avx2,fma"))) void row4_avx512_back(const float* x, const uint8_t* w,
                                                                            int64_t panel, int64_t K2, float* acc) {
  row_wide<F8_G, true>(x, w, panel, K2, acc);
}
// variant 4: the same body on AVX2 + FMA (each 16-lane vector in two ymm); on a host whose -march=native has
// AVX-512 the build may still use zmm here (the target only adds to the native one), and variant 3 runs there
__attribute__((target("avx2,fma"))) void block_wide_avx2(const float* x, int64_t ldx, int r, const uint8_t* w,
                                                         int64_t K2, float* acc) {
  block_wide(x, ldx, r, w, K2, acc);
}
__attribute__((target("avx2,fma"))) void row4_wide_avx2(const float* x, const uint8_t* w, int64_t panel, int64_t K2,
                                                        float* acc) {
  row_wide<F8_G>(x, w, panel, K2, acc);
}
__attribute__((target("avx2,fma"))) void row4_wide_avx2_back(const float* x, const uint8_t* w, int64_t panel,
                                                             int64_t K2, float* acc) {
  row_wide<F8_G, true>(x, w, panel, K2, acc);
}

// Variant 5, AVX512-BF16, for bf16 rows (their values, scaled by X_UP, are exact bf16 numbers): the 16-bit
// decoding above already gives bf16 weights (times 2^-120), so a 32-byte chunk is a zero-extension and 3 integer
// ops, then ONE vdpbf16ps adds both inputs' products for the 16 outputs (variant 3: 6 integer ops
// and 2 fused multiply-adds on fp32 widenings, compute-bound at ~15 GB/s of FP8 bytes a core on a 2-core Xeon,
// where the bf16 panel kernel reads ~17 from memory). vdpbf16ps adds the odd bf16 of a pair's product first, then
// the even one, each rounded once (a product of two bf16 is exact in fp32: a fused multiply-add): with the bytes as
// they lie, input 2 k2 + 1 is the odd half, so it is added first (x_pair matches; variant 6 keeps that order; a
// rotation that put input 2 k2 first cost a fourth port-0 operation a chunk: 1 row of 1536 x 576, one thread,
// L2-resident, 58.3 -> 44.6 us). It also flushes denormal inputs and results: an e4m3 subnormal weight
// (|w| < 2^-6 of its scale unit; 0.009 % of SmolLM2's GPTQ codes) counts as zero, which is the only difference
// from the portable bits (tests)
// The byte is sign-extended into its 16-bit lane (s^9 eeee mmm), then shifted left by 4 and masked (s 0000 eeee mmm
// 0000): the bits of the zero-extension shifted left by 8, right by 4 arithmetically and masked, one shift fewer on
// the port the dot product also needs (1 row of 1536 x 576, one thread, L2-resident: 52.3 / 55.1 -> 49.8 / 50.0 us
// in alternating builds; 120 such Linears of SmolLM2 from memory, 2 threads: 5.28 / 6.04 -> 4.96 / 5.34 ms)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512bh decode32_bf16(const uint8_t* p) {
  const __m512i z = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // byte j: lane j
  return reinterpret_cast<__m512bh>(_mm512_and_si512(_mm512_slli_epi16(z, 4),
                                                     _mm512_set1_epi16(static_cast<short>(0x87F0))));
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void store_lanes(__m512 c, float* acc) {
  alignas(64) float t[F8_NR];
  _mm512_store_ps(t, c);
  for (int q = 0; q < F8_NR; ++q) acc[ORDER[q]] = t[q];
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void block_bf16(const float* x, int64_t ldx, int r,
                                                                        const uint8_t* w, int64_t K2, float* acc) {
  __m512 c[F8_MR];
  for (int m = 0; m < F8_MR; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const __m512bh wk = decode32_bf16(w + k2 * 32);
    for (int m = 0; m < r; ++m)
      c[m] = _mm512_dpbf16_ps(c[m], wk, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(
                                            x_pair(x + m * ldx + 2 * k2)))));
  }
  for (int m = 0; m < r; ++m) store_lanes(c[m], acc + m * F8_NR);
}

// One row through G panels (panel bytes apart) at once: G streams of weights in flight. The pairs of inputs are laid
// out once a pass, so each chunk's vdpbf16ps broadcasts its pair straight from memory. One row is bound by how many
// lines a core has in flight, not by its integer ops: on the 2-core Zen 4 EPYC, 1 row of 1536 x 576 from memory on
// one thread read 18-20 GB/s at 4 panels a pass, 28-30 at 12 or 16 (a plain streaming read: 20), 18-22 at 24; and
// SmolLM2's batch-1 FP8 decode (2 threads, passes interleaved in one process, median of 5) ran 137 tok/s at 4
// panels 2048 bytes ahead, 163-167 at 8 or 12 (512 or 256 ahead), 171-174 at 16 (256 ahead, or none), into L1; into L2
// (prefetcht1, a deeper miss queue) 1024 ahead: +7.6 % (512: +2.5 %; L1 1024: -19 %). Near a panel's end the requests
// go on into the next pass's panel: the group after (a thread claiming from the front, fused_team.cpp), or with BACK
// the group before, where a thread claiming from the back reads next (SmolLM2 FP8 + FP8 head, batch 1, 2-core Zen 4
// EPYC, one process, rounds alternating: the step 1.012x at a read >= 45 GB/s, 1.010x below 35; 124 and 96 rounds).
// A panel's sums do not depend on G
template <int G, bool BACK = false>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void row_bf16(const float* x, const uint8_t* w, int64_t panel,
                                                                      int64_t K2, float* acc) {
  thread_local std::vector<uint32_t> pairs;
  if (static_cast<int64_t>(pairs.size()) < K2) pairs.resize(K2);
  for (int64_t k2 = 0; k2 < K2; ++k2) pairs[k2] = x_pair(x + 2 * k2);
  const uint32_t* xp = pairs.data();
  __m512 c[G];
  for (int g = 0; g < G; ++g) c[g] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const __m512bh xk = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp[k2])));
    const int64_t ahead = k2 * 32 + F8_AHEAD_W,
                  line = ahead < panel ? ahead : BACK ? ahead - (G + 1) * panel : ahead + (G - 1) * panel;
    for (int g = 0; g < G; ++g) {
      if ((k2 & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + g * panel + line), _MM_HINT_T1);
      c[g] = _mm512_dpbf16_ps(c[g], decode32_bf16(w + g * panel + k2 * 32), xk);
    }
  }
  for (int g = 0; g < G; ++g) store_lanes(c[g], acc + g * F8_NR);
}

using RowFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, float*);
template <bool BACK, int... I>
constexpr std::array<RowFn, sizeof...(I)> row_bf16_table(std::integer_sequence<int, I...>) {
  return {&row_bf16<I + 1, BACK>...};
}
const auto ROW_BF16 = row_bf16_table<false>(std::make_integer_sequence<int, F8_GW>());  // [g - 1]: g panels
const auto ROW_BF16_BACK = row_bf16_table<true>(std::make_integer_sequence<int, F8_GW>());  // ... BACK

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }
bool has_avx512bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
}
#else  // not x86: the portable variant only
bool has_avx2() { return false; }
bool has_avx512() { return false; }
bool has_avx512bf16() { return false; }
#endif

// variant 6: variant 5's arithmetic one lane at a time, on any CPU: the same bf16 weights (the byte's bits as
// the 16-bit decoding leaves them), a denormal flushed to zero, the pair's odd product (input 2 k2 + 1) added
// first then the even one, each with one rounding, a denormal sum flushed to zero
inline float bf16_daz(uint16_t h) {
  if ((h & 0x7F80u) == 0) return 0.f;
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ftz(float v) { return std::fabs(v) < 0x1p-126f ? 0.f * v : v; }

void block_bf16_emulated(const float* x, int64_t ldx, int r, const uint8_t* w, int64_t K2, float* acc) {
  std::fill(acc, acc + r * F8_NR, 0.f);
  for (int64_t k2 = 0; k2 < K2; ++k2)
    for (int q = 0; q < F8_NR; ++q) {  // lane q: output ORDER[q]
      const auto bits = [](uint8_t b) { return static_cast<uint16_t>(static_cast<int16_t>(b << 8) >> 4) & 0x87F0u; };
      const float w0 = bf16_daz(bits(w[k2 * 32 + 2 * q])), w1 = bf16_daz(bits(w[k2 * 32 + 2 * q + 1]));
      for (int m = 0; m < r; ++m) {
        const uint32_t xp = x_pair(x + m * ldx + 2 * k2);
        float& a = acc[m * F8_NR + ORDER[q]];
        a = ftz(std::fma(bf16_daz(static_cast<uint16_t>(xp >> 16)), w1, a));
        a = ftz(std::fma(bf16_daz(static_cast<uint16_t>(xp & 0xFFFFu)), w0, a));
      }
    }
}

}  // namespace
