// Decode attention on a build for AVX2 without AVX-512: attend_avx2, which attend_tiles (csrc/paged_kernel.cpp, before
// this file in the paged kernel's namespace) calls there.
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

#if PANEL_X86
// exp(v) for v <= 0, 8 lanes: exp16's steps (csrc/paged_kernel.cpp) as GCC contracts them in an AVX2 build (v log2 e
// never rounded: the rounding constant and f = y - r are fused multiply-adds, the polynomial too), on v clamped at
// -87: a lane below that is the caller's (the softmaxes zero it, SwiGLU in csrc/mlp_rows.cpp takes std::exp). Here
// for the decode softmax below and causal prefill's (csrc/paged_causal.cpp)
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 v) {
  const __m256 c = _mm256_max_ps(v, _mm256_set1_ps(-87.f)), l2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 r = _mm256_sub_ps(_mm256_fmadd_ps(c, l2e, _mm256_set1_ps(12582912.f)), _mm256_set1_ps(12582912.f));
  const __m256 f = _mm256_fmsub_ps(c, l2e, r);
  __m256 p = _mm256_set1_ps(1.5403530e-4f);
  for (const float k : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(k));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(r),
                                                                                  _mm256_set1_epi32(127)), 23)));
}

// lanes of v below -87
__attribute__((target("avx2,fma"))) inline __m256 below_87(__m256 v) {
  return _mm256_cmp_ps(v, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
}

// lanes j .. j + 7 below `valid`, as a mask
__attribute__((target("avx2,fma"))) inline __m256 below(int64_t j, int64_t valid) {
  const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(j)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane));
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// A build for AVX2 without AVX-512 (-march=native on such a host): attend_tiles' 16-lane vectors are two ymm registers
// each there, and GCC kept their arrays (a key's partial sums, the shuffle tree's operands) on the stack: 64 SmolLM2
// rows x 200 positions took 4.4 ms a layer on 2 threads of a Zen 3 EPYC (4.5 GB/s of fp32 cache), against 1.2 ms on one
// thread of an AVX-512 Xeon. Here with 8-lane intrinsics: a query head's scaled query in registers (hd <= 64), 8 keys'
// partial sums reduced by one hadd tree, a head's value sums in registers (64 lanes a pass); bf16 rows widened in
// registers, once for two or three query heads of their kv head (scores_group_avx2, values_group_avx2). The same walk
// (block by block in table order, each kv head's rows for its query heads, the next block's rows requested as these are
// read) and the same softmax; sums in a different order than the AVX-512 build's, so the bits are this build's own (any
// split of heads or sequences over threads gives the same)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// lane i = the sum of r[i]'s 8 lanes
inline __m256 hsum8(const __m256* r) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// softmax_heads' work (same arguments) on 8 lanes: a head's maximum in one pass, then exp(score - max) stored and
// summed in another, the tail of a head's scores through a padded copy. softmax_heads' 16-lane vectors are two ymm
// registers each here, kept on the stack, with four passes and std::exp for a tail: 64 rows x 145-290 positions,
// 30 layers' tables, 2-core EPYC Zen 3, alternating in one process, median of 21: fp32 1.258 -> 1.100 ms a layer,
// bf16 0.904 -> 0.742 (one thread, caches warm: 110 -> 87 ns a row's position)
inline void decode_softmax_avx2(float* scores, int64_t m, int64_t lpad, int64_t nq, int64_t hd, float* acc,
                                const float* pm, const float* pl, const float* pacc) {
  const int64_t m8 = m / 8 * 8, c = m - m8;
  for (int64_t h = 0; h < nq; ++h) {
    float* sc = scores + h * lpad;
    alignas(32) float tail[8];
    for (int64_t j = 0; j < 8; ++j) tail[j] = j < c ? sc[m8 + j] : -INFINITY;
    __m256 vm = _mm256_load_ps(tail);
    for (int64_t t = 0; t < m8; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sc + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    float mx = pm ? pm[h] : -INFINITY;
    for (int j = 0; j < 8; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (int64_t t = 0; t < m8; t += 8) {
      const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx);
      const __m256 x = _mm256_andnot_ps(below_87(v), exp8(v));
      _mm256_storeu_ps(sc + t, x);
      vs = _mm256_add_ps(vs, x);
    }
    if (c) {
      const __m256 v = _mm256_sub_ps(_mm256_load_ps(tail), vmx);
      const __m256 x = _mm256_and_ps(_mm256_andnot_ps(below_87(v), exp8(v)), below(0, c));
      _mm256_store_ps(tail, x);
      for (int64_t j = 0; j < c; ++j) sc[m8 + j] = tail[j];
      vs = _mm256_add_ps(vs, x);
    }
    _mm256_store_ps(lanes, vs);
    float sum = 0.f;
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    finish_head(sc, m, mx, sum, h, hd, acc, pm, pl, pacc);
  }
}

// a head's key dot before its lanes are summed: q(u) (the scaled query's 8 lanes u) times the key row k's, in two
// chains of multiply-adds (even and odd u) added at the end; scores_avx2 and scores_rows_avx2 both sum through it
template <typename T, int H8, typename QF>
inline __m256 key_chains(const QF& q, const T* k) {
  __m256 p0 = _mm256_mul_ps(q(0), load8(k)), p1 = _mm256_mul_ps(q(1), load8(k + 8));
  for (int u = 2; u < H8; u += 2) {
    p0 = _mm256_fmadd_ps(q(u), load8(k + 8 * u), p0);
    p1 = _mm256_fmadd_ps(q(u + 1), load8(k + 8 * u + 8), p1);
  }
  return _mm256_add_ps(p0, p1);
}

// dst[i] = qs . k[i] for the n key rows at k (`row` apart), qs the head's scaled fp32 query of 8 * H8 lanes; row i of
// ka (the next block's keys) requested, and a part of vs (this task's values) asked for, as key row i is read: a
// trickle, not both blocks' 128 lines at once before the scores, which overflowed the core's miss queue as on AVX-512
// (attend_tiles).
// With values_avx2's trickle of the next block's values: 64 rows x 145-290 positions, 30 layers' tables, 2-core EPYC
// Zen 3, both builds alternating in one process, median of 21, two runs: fp32 2.34 -> 2.09, 2.49 -> 2.26 ms a layer;
// bf16 1.67 -> 1.44, 1.79 -> 1.48 (the key trickle alone: fp32 1.07-1.08x, bf16 1.08-1.11x)
template <typename T, int H8>
inline void scores_avx2(const float* qs, const T* k, int64_t n, int64_t row, float* dst, const T* ka = nullptr,
                        PartCursor<T, H8 / 2>* vs = nullptr) {
  constexpr int QR = H8 <= 8 ? H8 : 1;  // query vectors kept in registers (hd 128: read from L1)
  __m256 qv[QR];
  if constexpr (H8 <= 8)
    for (int u = 0; u < H8; ++u) qv[u] = _mm256_loadu_ps(qs + 8 * u);
  const auto Q = [&](int u) { if constexpr (H8 <= 8) return qv[u]; else return _mm256_loadu_ps(qs + 8 * u); };
  __m256 part[8];
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t c = std::min<int64_t>(8, n - i0);
    for (int64_t i = 0; i < c; ++i) {
      const T* kr = k + (i0 + i) * row;
      if (ka) prefetch_rows<T, H8 / 2>(ka + (i0 + i) * row, 1, row);
      if (vs) vs->next();
      part[i] = key_chains<T, H8>(Q, kr);
    }
    for (int64_t i = c; i < 8; ++i) part[i] = _mm256_setzero_ps();
    const __m256 r = hsum8(part);
    if (c == 8) {
      _mm256_storeu_ps(dst + i0, r);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, r);
      std::memcpy(dst + i0, t, c * sizeof(float));
    }
  }
}

// scores_avx2 for NG (2 or 3) query heads of one kv head at once, bf16 rows: each key row is widened once for all of
// them, the heads' scaled queries (hd apart) read from L1 as the multiply-adds' operands; dst: the heads' scores,
// lpad apart. Each head's sums are scores_avx2's chains in its order: the same bits
template <typename T, int H8, int NG>
inline void scores_group_avx2(const float* qs, const T* k, int64_t n, int64_t row, float* dst, int64_t lpad,
                              const T* ka, PartCursor<T, H8 / 2>* vs) {
  constexpr int64_t hd = 8 * H8;
  static_assert(H8 % 2 == 0 && NG >= 2 && NG <= 3, "scores_group_avx2: two chains a head");
  alignas(32) float part[NG][8][8];
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t c = std::min<int64_t>(8, n - i0);
    for (int64_t i = 0; i < c; ++i) {
      const T* kr = k + (i0 + i) * row;
      if (ka) prefetch_rows<T, H8 / 2>(ka + (i0 + i) * row, 1, row);
      if (vs) vs->next();
      __m256 p[NG][2];
      const __m256 k0 = load8(kr), k1 = load8(kr + 8);
      for (int h = 0; h < NG; ++h) {
        p[h][0] = _mm256_mul_ps(_mm256_loadu_ps(qs + h * hd), k0);
        p[h][1] = _mm256_mul_ps(_mm256_loadu_ps(qs + h * hd + 8), k1);
      }
      for (int u = 2; u < H8; u += 2) {
        const __m256 ku0 = load8(kr + 8 * u), ku1 = load8(kr + 8 * u + 8);
        for (int h = 0; h < NG; ++h) {
          p[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * hd + 8 * u), ku0, p[h][0]);
          p[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * hd + 8 * u + 8), ku1, p[h][1]);
        }
      }
      for (int h = 0; h < NG; ++h) _mm256_store_ps(part[h][i], _mm256_add_ps(p[h][0], p[h][1]));
    }
    for (int h = 0; h < NG; ++h) {
      __m256 r8[8];
      for (int64_t i = 0; i < 8; ++i) r8[i] = i < c ? _mm256_load_ps(part[h][i]) : _mm256_setzero_ps();
      const __m256 r = hsum8(r8);
      float* d = dst + h * lpad + i0;
      if (c == 8) {
        _mm256_storeu_ps(d, r);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, r);
        std::memcpy(d, t, c * sizeof(float));
      }
    }
  }
}

// a kv head's `group` query heads as the grouped passes take them (GROUPED): three at a time, two where two or four
// are left, a last one alone; f(first head, std::integral_constant<int, heads>). Not GROUPED: one at a time
template <bool GROUPED, typename F>
inline void head_groups(int64_t group, F&& f) {
  for (int64_t h = 0; h < group;) {
    if constexpr (GROUPED) {
      const int64_t left = group - h;
      if (left == 2 || left == 4) {
        f(h, std::integral_constant<int, 2>{}), h += 2;
        continue;
      }
      if (left >= 3) {
        f(h, std::integral_constant<int, 3>{}), h += 3;
        continue;
      }
    }
    f(h, std::integral_constant<int, 1>{}), ++h;
  }
}

// one kv head's scores over a block for its `group` query heads: bf16 rows by head_groups (scores_group_avx2), fp32
// rows one head at a time (scores_avx2); the first pass asks for the next block's keys (ka) and this task's values
// (vs), a row at a time
template <typename T, int H8>
inline void scores_heads_avx2(const float* qs, const T* k, int64_t n, int64_t row, float* dst, int64_t lpad,
                              int64_t group, const T* ka, PartCursor<T, H8 / 2>* vs) {
  constexpr int64_t hd = 8 * H8;
  head_groups<!std::is_same_v<T, float> && H8 % 2 == 0>(group, [&](int64_t h, auto heads) {
    constexpr int NG = decltype(heads)::value;
    const T* ask = h == 0 ? ka : nullptr;
    PartCursor<T, H8 / 2>* cursor = h == 0 ? vs : nullptr;
    if constexpr (NG == 1) scores_avx2<T, H8>(qs + h * hd, k, n, row, dst + h * lpad, ask, cursor);
    else scores_group_avx2<T, H8, NG>(qs + h * hd, k, n, row, dst + h * lpad, lpad, ask, cursor);
  });
}

// acc (8 * H8 lanes) += p[i] * v[i] over the n value rows at v (`row` apart), 64 lanes of sums in registers a pass;
// row i of va (the next block's values) requested and a part of nk (the thread's next task's keys, NextKeys) asked
// for as value row i is read (first pass)
template <typename T, int H8>
inline void values_avx2(const float* p, const T* v, int64_t n, int64_t row, float* acc, const T* va = nullptr,
                        PartCursor<T, H8 / 2>* nk = nullptr) {
  constexpr int C = H8 < 8 ? H8 : 8;
  for (int u0 = 0; u0 < H8; u0 += C) {
    __m256 a[C];
    for (int u = 0; u < C; ++u) a[u] = _mm256_loadu_ps(acc + 8 * (u0 + u));
    for (int64_t i = 0; i < n; ++i) {
      if (u0 == 0) {
        if (va) prefetch_rows<T, H8 / 2>(va + i * row, 1, row);
        if (nk) nk->next();
      }
      const __m256 pi = _mm256_broadcast_ss(p + i);
      const T* vr = v + i * row + 8 * u0;
      for (int u = 0; u < C; ++u) a[u] = _mm256_fmadd_ps(pi, load8(vr + 8 * u), a[u]);
    }
    for (int u = 0; u < C; ++u) _mm256_storeu_ps(acc + 8 * (u0 + u), a[u]);
  }
}

// values_avx2 for NG (2 or 3) query heads of one kv head at once, bf16 rows: each value row is widened once for all of
// them (values_avx2 widens it once a head), 32 lanes a pass, NG x 4 sums in registers. acc: the heads' sums (hd apart),
// p: their weights (lpad apart). The same fused multiply-adds in the same order as values_avx2's: the same bits.
// With scores_group_avx2, 2-core Zen 3 EPYC, 64 rows x 112-224 positions, 1 and 8 layers' tables, both builds
// alternating in one process, median of 9: bf16 SmolLM2 (9 query / 3 kv heads of 64) 1.22-1.34x, 32 / 8 heads
// 1.15-1.24x, 14 / 2 1.22-1.39x (1 and 2 threads); this pass alone 1.07-1.13x. fp32 rows need no widening: the
// same grouping there (both passes) gave 0.95-1.07x at 9 / 3 heads, so fp32 keeps the one-head loops
template <typename T, int H8, int NG>
inline void values_group_avx2(const float* p, int64_t lpad, const T* v, int64_t n, int64_t row, float* acc,
                              const T* va, PartCursor<T, H8 / 2>* nk) {
  constexpr int C = 4;
  constexpr int64_t hd = 8 * H8;
  static_assert(H8 % C == 0 && NG >= 2 && NG <= 3, "values_group_avx2: 32-lane passes, NG x 4 + NG + 1 registers");
  for (int u0 = 0; u0 < H8; u0 += C) {
    __m256 a[NG][C];
    for (int h = 0; h < NG; ++h)
      for (int u = 0; u < C; ++u) a[h][u] = _mm256_loadu_ps(acc + h * hd + 8 * (u0 + u));
    for (int64_t i = 0; i < n; ++i) {
      if (u0 == 0) {
        if (va) prefetch_rows<T, H8 / 2>(va + i * row, 1, row);
        if (nk) nk->next();
      }
      const T* vr = v + i * row + 8 * u0;
      __m256 pi[NG];
      for (int h = 0; h < NG; ++h) pi[h] = _mm256_broadcast_ss(p + h * lpad + i);
      for (int u = 0; u < C; ++u) {
        const __m256 x = load8(vr + 8 * u);
        for (int h = 0; h < NG; ++h) a[h][u] = _mm256_fmadd_ps(pi[h], x, a[h][u]);
      }
    }
    for (int h = 0; h < NG; ++h)
      for (int u = 0; u < C; ++u) _mm256_storeu_ps(acc + h * hd + 8 * (u0 + u), a[h][u]);
  }
}

// one kv head's value pass over a block for its `group` query heads: bf16 rows by head_groups (values_group_avx2),
// fp32 rows one head at a time (values_avx2); the first pass asks for the next block's values (va) and the next
// task's keys (nk)
template <typename T, int H8>
inline void values_heads_avx2(const float* p, int64_t lpad, const T* v, int64_t n, int64_t row, float* acc,
                              int64_t group, const T* va, PartCursor<T, H8 / 2>* nk) {
  constexpr int64_t hd = 8 * H8;
  head_groups<!std::is_same_v<T, float> && H8 % 4 == 0>(group, [&](int64_t h, auto heads) {
    constexpr int NG = decltype(heads)::value;
    const T* ask = h == 0 ? va : nullptr;
    PartCursor<T, H8 / 2>* cursor = h == 0 ? nk : nullptr;
    if constexpr (NG == 1) values_avx2<T, H8>(p + h * lpad, v, n, row, acc + h * hd, ask, cursor);
    else values_group_avx2<T, H8, NG>(p + h * lpad, lpad, v, n, row, acc + h * hd, ask, cursor);
  });
}

// Without grouped-query heads (group 1: GPT-2's 12 heads, each its own keys and values), the walk in memory order: a
// position's row of every kv head of the task (contiguous), 8 query heads' scores at a time, before the next
// position's, where the walk above reads a block a kv head at a time (a 256-byte strip of each 3 KB row) and trickles
// requests for what comes next. The hardware's own stream detection then keeps up, and one line of the next block a
// position is asked for across the gap between blocks. GPT-2's shape, 64 rows x 145-290 positions, 12 layers' tables,
// fp32, 2-core EPYC Zen 2, both walks alternating in one process, median of 9: sequential blocks 3.80 -> 2.94 ms a
// layer (23.2 -> 30.0 GB/s against a streaming read of ~30), scattered 4.03 -> 3.15 (a standalone build of the walk).
// Each head's sums are the strip walk's in its order (a head's key dot through key_chains, the shuffle tree over a
// lane's own vector; values a multiply-add a position), so the bits are the same. With grouped heads each query head
// reads its kv head's row from L1 (scores 8 query heads at a time): fp32 rows take it up to 4 query heads a kv head,
// bf16 rows never, each widened once a query head there (both walks alternating in one process, 64 rows x 145-290
// positions, median of 9, sequential / scattered blocks: fp32 SmolLM2's 9 / 3 x 64 heads 1.07x / 1.09x, 32 / 8 x 128
// 1.14x / 1.16x, 14 / 2 x 64 0.92x / 1.01x; bf16 0.59-0.91x at all three, where the strip walk widens a key row once
// for its group's heads: scores_group_avx2)
template <typename T, int H8>
inline void scores_rows_avx2(const float* qs, const T* k, int64_t n, int64_t row, int64_t nq, int64_t group,
                             float* dst, int64_t lpad, const T* ka) {
  constexpr int64_t hd = 8 * H8;
  for (int64_t i = 0; i < n; ++i) {
    const T* kr = k + i * row;
    if (ka) __builtin_prefetch(reinterpret_cast<const char*>(ka) + 64 * i, 0, 3);
    for (int64_t h0 = 0; h0 < nq; h0 += 8) {
      const int64_t hc = std::min<int64_t>(8, nq - h0);
      __m256 part[8];
      for (int64_t j = 0; j < 8; ++j) {
        if (j >= hc) {
          part[j] = _mm256_setzero_ps();
          continue;
        }
        const float* qq = qs + (h0 + j) * hd;
        part[j] = key_chains<T, H8>([qq](int u) { return _mm256_loadu_ps(qq + 8 * u); }, kr + (h0 + j) / group * hd);
      }
      alignas(32) float r[8];
      _mm256_store_ps(r, hsum8(part));  // lane j: head h0 + j's score at this position
      for (int64_t j = 0; j < hc; ++j) dst[(h0 + j) * lpad + i] = r[j];
    }
  }
}

// acc (nq query heads, hd apart) += p[h][i] * v[i][h / group] over the block's n value rows, a position's heads at a
// time (the sums in L1: 3 KB for 12 heads of 64); one line of the next block (va) asked for a position
template <typename T, int H8>
inline void values_rows_avx2(const float* p, int64_t lpad, const T* v, int64_t n, int64_t row, int64_t nq,
                             int64_t group, float* acc, const T* va) {
  constexpr int64_t hd = 8 * H8;
  for (int64_t i = 0; i < n; ++i) {
    const T* vr = v + i * row;
    if (va) __builtin_prefetch(reinterpret_cast<const char*>(va) + 64 * i, 0, 3);
    for (int64_t h = 0; h < nq; ++h) {
      const __m256 pi = _mm256_broadcast_ss(p + h * lpad + i);
      float* a = acc + h * hd;
      const T* x = vr + h / group * hd;
      for (int u = 0; u < H8; ++u)
        _mm256_storeu_ps(a + 8 * u, _mm256_fmadd_ps(pi, load8(x + 8 * u), _mm256_loadu_ps(a + 8 * u)));
    }
  }
}

// attend_tiles' work (same arguments) with the loops above; hd = 8 * H8 (H8 = 2 HB)
template <typename T, int H8>
void attend_avx2(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs, int64_t row,
                 int64_t nq, int64_t group, float scale, float* scores, float* acc, T* out, int64_t lpad, int64_t t0,
                 const float* pm, const float* pl, const float* pacc, const NextKeys& nx) {
  constexpr int64_t hd = 8 * H8;
  const int64_t m = len - t0, nkv = nq / group;
  // the first block's keys (the task before on this thread asked for them already, unless there was none); then as
  // the keys are scored, this task's values in memory order, and as the values are summed, the next task's keys:
  // 64 rows x 145-290 positions, 30 layers' tables, 2-core EPYC Zen 3, alternating in one process, median of 21-25,
  // against the values' parts asked for a kv head at a time and no next task's keys: fp32 1.07x, 1.07x, 1.11x; bf16
  // 1.13x, 1.11x (the next keys alone: fp32 1.02-1.14x, bf16 1.06-1.09x; all parts spread evenly over both passes as
  // one stream: fp32 0.89x, bf16 0.81x)
  for (int64_t g = 0; g < nkv; ++g)
    prefetch_rows<T, H8 / 2>(kc + table[t0 / bs] * bs * row + g * hd, std::min(bs, len - t0), row);
  thread_local std::vector<float> qs;
  if (static_cast<int64_t>(qs.size()) < nq * hd) qs.resize(nq * hd);
  for (int64_t i = 0; i < nq * hd; ++i) qs[i] = static_cast<float>(q[i]) * scale;
  if (group == 1 || (std::is_same_v<T, float> && group <= 4)) {  // memory order (scores_rows_avx2)
    for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
      const bool more = t + bs < len;
      scores_rows_avx2<T, H8>(qs.data(), kc + table[b] * bs * row, std::min(bs, len - t), row, nq, group,
                              scores + t - t0, lpad, more ? kc + table[b + 1] * bs * row : nullptr);
    }
    decode_softmax_avx2(scores, m, lpad, nq, hd, acc, pm, pl, pacc);
    for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
      const bool more = t + bs < len;
      values_rows_avx2<T, H8>(scores + t - t0, lpad, vc + table[b] * bs * row, std::min(bs, len - t), row, nq, group,
                              acc, more ? vc + table[b + 1] * bs * row : nullptr);
    }
    write_heads(scores, m, lpad, nq, hd, acc, out);
    return;
  }
  PartCursor<T, H8 / 2> vs(vc, table, t0, len, bs, row, nkv);  // the strip walk's requests (above)
  PartCursor<T, H8 / 2> nk(nx);
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    const bool more = t + bs < len;
    for (int64_t g = 0; g < nkv; ++g) {
      const T* k = kc + table[b] * bs * row + g * hd;
      const T* kn = more ? kc + table[b + 1] * bs * row + g * hd : nullptr;
      scores_heads_avx2<T, H8>(qs.data() + g * group * hd, k, n, row, scores + g * group * lpad + t - t0, lpad, group,
                               kn, &vs);
    }
  }
  decode_softmax_avx2(scores, m, lpad, nq, hd, acc, pm, pl, pacc);
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    for (int64_t g = 0; g < nkv; ++g) {
      const T* v = vc + table[b] * bs * row + g * hd;
      const T* vn = t + bs < len ? vc + table[b + 1] * bs * row + g * hd : nullptr;
      values_heads_avx2<T, H8>(scores + g * group * lpad + t - t0, lpad, v, n, row, acc + g * group * hd, group, vn,
                               &nk);
    }
  }
  write_heads(scores, m, lpad, nq, hd, acc, out);
}
#endif

}  // namespace
