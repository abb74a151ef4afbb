// The CPU paged decode-attention kernel: built and bound by engines/cpu/paged_kernel.py (see its docstring).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t W = 16;  // lanes: one AVX-512 register of fp32, two of AVX2
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

// W elements widened to fp32 (bf16: the high half of an fp32, so a shift)
inline vf load16(const float* p) { vf v; std::memcpy(&v, p, sizeof(vf)); return v; }
inline vf load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // one widening load (GCC splits the generic conversion into two halves and an insert)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh h; std::memcpy(&h, p, sizeof(vh));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof(vf)); return v;
#endif
}

inline vf load16(const c10::Half* p) { vf v; for (int64_t j = 0; j < W; ++j) v[j] = static_cast<float>(p[j]); return v; }

inline float hsum(vf v) { float s = 0.f; for (int64_t j = 0; j < W; ++j) s += v[j]; return s; }

// a (fp32) . b (n elements of T), W lanes of partial sums then the tail
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  vf part = vf{};
  int64_t i = 0;
  for (; i + W <= n; i += W) part += load16(a + i) * load16(b + i);
  float s = hsum(part);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// acc (fp32) += p * v (n elements of T)
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf a = load16(acc + i) + p * load16(v + i);
    std::memcpy(acc + i, &a, sizeof(vf));
  }
  for (; i < n; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// exp(v) for v <= 0, W lanes: 2^(v log2 e) = 2^n 2^f, n = round, |f| <= 1/2, 2^f by a degree-6 polynomial
// (relative error ~2e-7, below fp32 softmax rounding); v < -87 -> ~0
inline vf exp16(vf v) {
  v = v < -87.f ? vf{} - 87.f : v;
  vf y = v * 1.44269504088896341f;
  vf r = (y + 12582912.f) - 12582912.f;  // round to nearest (|y| < 2^22)
  vf f = y - r;
  vf p = vf{} + 1.5403530e-4f;
  p = p * f + 1.3333558e-3f; p = p * f + 9.6181291e-3f; p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f; p = p * f + 6.9314718e-1f; p = p * f + 1.f;
  vi e = (__builtin_convertvector(r, vi) + 127) << 23;
  vf scale; std::memcpy(&scale, &e, sizeof(vf));
  return p * scale;
}

// y[i] = exp(x[i]) for x <= 0 in place, W lanes at a time (exp16), the tail by std::exp. exp16 clamps its input at
// -87 (its scale is a normal float), so a lane below that takes std::exp (a denormal or 0): SwiGLU's silu(-3e38) was
// -4.9 and silu(-inf) -inf with the clamp (torch: -0, NaN); a softmax's weight there was 1.6e-38 for ~0
inline void exp_nonpos(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v; std::memcpy(&v, x + i, sizeof(vf));
    vf y = exp16(v);
#if defined(__AVX512F__)  // one compare into a mask register, not a lane-by-lane test
    const bool low = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), _mm512_set1_ps(-87.f), _CMP_LT_OQ) != 0;
#elif defined(__AVX2__)  // two compares and their sign masks (the lane-by-lane test: half of SmolLM2's SwiGLU)
    __m256 h[2];
    std::memcpy(h, &v, sizeof(vf));
    const __m256 t = _mm256_set1_ps(-87.f);
    const bool low = (_mm256_movemask_ps(_mm256_cmp_ps(h[0], t, _CMP_LT_OQ)) |
                      _mm256_movemask_ps(_mm256_cmp_ps(h[1], t, _CMP_LT_OQ))) != 0;
#else
    bool low = false;
    for (int j = 0; j < W; ++j) low |= v[j] < -87.f;
#endif
    if (low)  // rare: the lanes below
      for (int j = 0; j < W; ++j)
        if (v[j] < -87.f) y[j] = std::exp(v[j]);
    std::memcpy(x + i, &y, sizeof(vf));
  }
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// sc[0, m) -> exp(sc - mx) in place, mx the larger of `start` and sc's maximum (both reductions 16 lanes at a
// time); returns (mx, the exponentials' sum)
inline std::pair<float, float> exp_shifted(float* sc, int64_t m, float start) {
  vf vm = vf{} - INFINITY;
  int64_t t = 0;
  for (; t + W <= m; t += W) {
    const vf x = load16(sc + t);
    vm = x > vm ? x : vm;
  }
  float mx = start;
  for (int j = 0; j < W; ++j) mx = vm[j] > mx ? vm[j] : mx;
  for (; t < m; ++t) mx = sc[t] > mx ? sc[t] : mx;
  for (t = 0; t < m; ++t) sc[t] -= mx;
  exp_nonpos(sc, m);
  vf vs = vf{};
  for (t = 0; t + W <= m; t += W) vs += load16(sc + t);
  float sum = hsum(vs);
  for (; t < m; ++t) sum += sc[t];
  return {mx, sum};
}

// a task's piece of a slot's row is a few hundred bytes every row's length apart, and the cache
// holds no context between steps (every Linear's weights stream through it): the hardware
// prefetchers do not follow such a walk, so each piece would wait for memory. Rows AHEAD slots on
// are requested while this one is used (in situ on GPT-2 batch-1 decode: -0.25 ms a token, of
// ~1.5 ms of attention and small ops; BENCHMARKS.md issue 12)
constexpr int64_t AHEAD = 4;
inline void ahead(const void* p, int64_t nbytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < nbytes; o += 64) __builtin_prefetch(c + o);
}

// 16 vectors -> one whose lane i is the sum of v[i]'s lanes: four levels of lane shuffles and adds
// (15 of each), each level halving the lanes a vector keeps per source, sources in order
inline vf hsum16(vf* v) {
  static const vi lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                           {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                           {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                           {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  static const vi off = {8, 4, 2, 1};  // hi = lo + the level's half block
  for (int level = 0, n = W; level < 4; ++level, n /= 2) {
    const vi l = lo[level], h = lo[level] + off[level];
    for (int i = 0; i < n / 2; ++i)
      v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], l) + __builtin_shuffle(v[2 * i], v[2 * i + 1], h);
  }
  return v[0];
}

// the scores of c (<= W) keys from their lane-wise partial sums (part[i]: key i's 16 lanes), times scale, to dst:
// the lanes past c zeroed, one shuffle tree, and a whole vector's store where c == W (a copy of c * 4 bytes, with c
// known only at run time, became a loop of 4-byte moves)
inline void store_scores(vf* part, int64_t c, float scale, float* dst) {
  for (int64_t i = c; i < W; ++i) part[i] = vf{};
  const vf r = hsum16(part) * scale;
  if (c == W) std::memcpy(dst, &r, sizeof(vf));
  else std::memcpy(dst, &r, c * sizeof(float));
}

// attend() for head size 16 x HB: a query head's HB vectors stay in registers while the keys of a block
// pass (W keys' lane-wise products summed by hsum16, not one horizontal sum a key), and a head's value
// sums likewise (a key's row widened once a head, in L1 after the group's first head). Keys and values
// are read block by block in table order; heads of one kv head follow each other, so a block's rows of
// that kv head come from L1 for all but the first. Per head, the arithmetic does not depend on the
// other heads of the task (any split of the heads over tasks gives the same bits)
// rows [0, n) of one kv head's part of a block (rows `row` apart) as fp32, and the stride between
// them: in place for float, else widened once into buf (n x W * HB) for all the heads that share it. next: the
// same part of the next block (nullptr at the last), requested before this one is read (where the rows are read in
// place, fp32 or bf16 scores by vdpbf16ps, the caller trickles them instead: see attend_tiles), into L2 (prefetcht1), whose
// queue holds more misses than L1's (34 SmolLM2 rows x 250 positions, bf16, 30 layers, 2-core EPYC Zen 4:
// 16.8-17.1 -> 11.8 ms into L2; the offline mix's decode steps 600-612 -> 665-675 tok/s; into L1 on the Xeon
// made no difference). Widening a block's whole row span at once (one stream, not a kv head at a time): 13.6 ms
// the rows [0, n) of a block's part of one kv head (rows `row` apart) requested into L2
template <typename T, int HB>
inline void prefetch_rows(const T* p, int64_t n, int64_t row) {
  constexpr int64_t lines = (W * HB * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(reinterpret_cast<const char*>(p + i * row) + 64 * l, 0, 2);
}

template <typename T, int HB>
inline const float* widen(const T* src, int64_t n, int64_t row, float* buf, int64_t& stride, const T* next) {
  if (next) prefetch_rows<T, HB>(next, n, row);
  if constexpr (std::is_same_v<T, float>) {
    stride = row;
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int u = 0; u < HB; ++u) {
        const vf x = load16(src + i * row + u * W);
        std::memcpy(buf + (i * HB + u) * W, &x, sizeof(vf));
      }
    stride = W * HB;
    return buf;
  }
}

// query heads of one kv head a pass over a block's rows (the values, and the keys scored by vdpbf16ps; fp32 keys go a
// head at a time, tile_scores): each key or value row is loaded (bf16 values: widened in
// registers, not copied into a buffer first) once for HC heads, whose query vectors (scores) or value sums (the
// weighted sum) stay in registers, HC x HB vectors of 16 lanes (<= 16); a head at a time loaded each row group
// times. Same bits. SmolLM2 decode steps of 64 rows at 200-248 positions (3 query heads a kv head), 2-core EPYC
// Zen 4, both ways switched in one process, median of 3: bf16 74.3 -> 66.8 ms, fp32 124.9 -> 121.1 ms
// (bf16 attention alone, one thread, 32 rows x ~225 positions, with load16's one widening load and store_scores'
// whole-vector stores: 0.48 -> 0.42 ms a layer, three alternating runs of each build). HC fits AVX-512's 32
// registers; a build without AVX-512 holds a 16-lane vector in two of its 16 (one head a pass at hd 64, as before)
template <int HB>
constexpr int heads_a_pass() {
#if defined(__AVX512F__)
  return HB >= 16 ? 1 : 16 / HB;
#else
  return HB >= 4 ? 1 : 8 / HB - 1;
#endif
}

#if defined(__AVX512BF16__)
// bf16 scores of query heads [h0, h1) against the n keys at k (one kv head's part of a block): a key's products
// with a query as vdpbf16ps of its pairs (exact bf16 products, fp32 sums: hd / 32 instructions a key, where the
// fp32 path widened each key row once and ran hd / 16 multiply-adds), 16 keys' lanes summed by hsum16, then scaled;
// next: the next block's keys, requested as these are read (as widen). SmolLM2 bf16 decode steps (hd 64, 3 query
// heads a kv head), 2-core EPYC Zen 4, both ways switched in one process, median of 3: 64 rows at 16-316 positions
// 69.2 -> 64.7 ms, at 200-400 81.9 -> 77.1; 34 rows at 100-300 38.0 -> 37.0. A host without AVX512-BF16 builds the
// widening path (the panel kernel's bf16 row blocks are chosen the same way, at build time)
template <int HB>
inline void scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t n, int64_t row, const c10::BFloat16* next,
                        int64_t h0, int64_t h1, float scale, float* sc0, int64_t lpad, vf (*part)[W],
                        const c10::BFloat16* also = nullptr) {
  // also: the values of these rows, requested with the next block's keys a row at a time as each key row is read
  // (the trickle of attend_tiles' fp32 rows) rather than the next block's keys in a burst here
  constexpr int64_t hd = W * HB;
  constexpr int HC = heads_a_pass<HB>();
  const bool trickle = also != nullptr;
  if (next && !trickle) prefetch_rows<c10::BFloat16, HB>(next, n, row);
  for (int64_t g0 = h0; g0 < h1; g0 += HC) {
    const int64_t hc = std::min<int64_t>(HC, h1 - g0);
    __m512bh qb[HC][HB / 2];
#pragma GCC unroll 16
    for (int j = 0; j < HC; ++j)
      if (j < hc)
        for (int u = 0; u < HB / 2; ++u) qb[j][u] = (__m512bh)_mm512_loadu_si512(q + (g0 + j) * hd + 32 * u);
    for (int64_t i0 = 0; i0 < n; i0 += W) {
      const int64_t c = std::min<int64_t>(W, n - i0);
      for (int64_t i = 0; i < c; ++i) {
        const c10::BFloat16* kr = k + (i0 + i) * row;
        if (trickle && g0 == h0) {
          if (next) prefetch_rows<c10::BFloat16, HB>(next + (i0 + i) * row, 1, row);
          prefetch_rows<c10::BFloat16, HB>(also + (i0 + i) * row, 1, row);
        }
        __m512bh kv[HB / 2];
        for (int u = 0; u < HB / 2; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(kr + 32 * u);
#pragma GCC unroll 16
        for (int j = 0; j < HC; ++j)
          if (j < hc) {
            __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[j][0], kv[0]);
            for (int u = 1; u < HB / 2; ++u) p = _mm512_dpbf16_ps(p, qb[j][u], kv[u]);
            part[j][i] = (vf)p;
          }
      }
      for (int64_t j = 0; j < hc; ++j) store_scores(part[j], c, scale, sc0 + (g0 + j) * lpad + i0);
    }
  }
}
#endif

// the scores of one query head (qv: its HB vectors, scaled) against c (<= W) fp32 key rows at k (`st` apart): each row's
// lane-wise products in a register of its own, the 16 reduced by hsum16, the rows past c zero; a whole tile unrolled
// with no test a row. pv (not null): the first head of a kv head, which requests this block's values and (pk) the next
// block's keys a row at a time as it reads (the trickle, attend_tiles)
// Same bits as the group's heads a pass (heads_a_pass), whose 16 rows' sums per head and query vectors GCC kept on
// the stack (a multiply-add with a memory operand a lane group, a store a row): 64 SmolLM2 rows x 145-290 positions,
// fp32, 30 layers' tables, caches cold, 2-core EPYC Zen 4, both ways alternating in one process, median of 21 pair
// ratios: 1.12x and 1.07x (1.28 -> 1.17, 1.22 -> 1.14 ms a layer); 16 rows in L3: 1.12x. bf16 keys by vdpbf16ps a
// head at a time were 0.94x (a key row's two loads then feed one head, not three): scores_bf16 keeps the group pass
template <typename T, int HB>
inline vf tile_scores(const vf* qv, const float* k, int64_t c, int64_t st, const T* pk, const T* pv, int64_t row) {
  vf p[W];
  const auto one = [&](int64_t i) {
    if (pv) {
      if (pk) prefetch_rows<T, HB>(pk + i * row, 1, row);
      prefetch_rows<T, HB>(pv + i * row, 1, row);
    }
    const float* kr = k + i * st;
    vf s = qv[0] * load16(kr);
    for (int u = 1; u < HB; ++u) s += qv[u] * load16(kr + u * W);
    return s;
  };
  if (c == W) {
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) p[i] = one(i);
  } else {
    for (int i = 0; i < W; ++i) p[i] = i < c ? one(i) : vf{};
  }
  return hsum16(p);
}

// head h's softmax finished from its exponentials' max mx and sum: 1 / the sum (with the partial's, pm, pl: see
// attend, rescaled to the common max) at sc[m], and its value sums started: 0, or the partial's pacc rescaled
inline void finish_head(float* sc, int64_t m, float mx, float sum, int64_t h, int64_t hd, float* acc, const float* pm,
                        const float* pl, const float* pacc) {
  float alpha = 0.f;
  if (pm) {
    alpha = std::exp(pm[h] - mx);
    sum += alpha * pl[h];
  }
  sc[m] = 1.f / sum;
  if (pm) for (int64_t d = 0; d < hd; ++d) acc[h * hd + d] = alpha * pacc[h * hd + d];
  else std::fill(acc + h * hd, acc + (h + 1) * hd, 0.f);
}

// each head's scores [0, m) -> exponentials of (score - max) in place, 1 / their sum at m (lpad > m: it rides in the
// padding), and its value sums started (finish_head)
inline void softmax_heads(float* scores, int64_t m, int64_t lpad, int64_t nq, int64_t hd, float* acc, const float* pm,
                          const float* pl, const float* pacc) {
  for (int64_t h = 0; h < nq; ++h) {
    float* sc = scores + h * lpad;
    const auto [mx, sum] = exp_shifted(sc, m, pm ? pm[h] : -INFINITY);
    finish_head(sc, m, mx, sum, h, hd, acc, pm, pl, pacc);
  }
}

// out (nq, hd) = each head's value sums times its 1 / sum (softmax_heads), rounded to T
template <typename T>
inline void write_heads(const float* scores, int64_t m, int64_t lpad, int64_t nq, int64_t hd, const float* acc, T* out) {
  for (int64_t h = 0; h < nq; ++h) {
    const float inv = scores[h * lpad + m];
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d] * inv);
  }
}


// The keys the thread's next decode task will read (paged_decode names them before each task; none: kc null, and
// attend forgets them after one call). The value pass, which reads values the key pass already requested, asks for
// them toward L2, one kv head's part of a slot a value row, so that memory streams while the values are summed and the
// next key pass finds its rows near (fp32 only). SmolLM2's heads, 64 rows at 145-290 positions, 30 layers' tables,
// caches cold, 2-core EPYC Zen 4, both builds alternating in one process, median of 21, three runs: fp32 1.016 ->
// 0.964, 1.005 -> 0.948, 1.011 -> 0.968 ms a layer (two parts a value row: 0.971); bf16 (its keys scored by
// vdpbf16ps) went both ways in four runs (0.514 -> 0.490, 0.608 -> 0.627, 0.583 -> 0.634, 0.549 -> 0.523): it does not ask
struct NextKeys {
  const void* kc = nullptr;  // the next task's first kv head's part of slot 0
  const int64_t* table = nullptr;
  int64_t len = 0, t0 = 0, nkv = 0, bs = 0, row = 0;
};
thread_local NextKeys next_keys;

inline void set_next_keys(const void* kc, const int64_t* table, int64_t len, int64_t t0, int64_t nkv, int64_t bs,
                          int64_t row) {
  next_keys = NextKeys{kc, table, len, t0, nkv, bs, row};
}

// A task's slots [t, len) a kv head's part at a time in memory order (slot t's heads, then slot t + 1), a part's lines
// requested toward L2 at each next(): called once a row read, the parts stream in step with the pass. NextKeys'
// slots (the value passes) and, on AVX2, a task's own values (csrc/paged_avx2.cpp)
template <typename T, int HB>
struct PartCursor {
  const T* base;  // slot 0's first kv head's part (nullptr: nothing to ask for)
  const int64_t* table;
  int64_t t, len, bs, row, nkv, g = 0, b, o;  // g, b, o: slot t's kv head, table entry, offset (no division a part)
  PartCursor(const T* base_, const int64_t* table_, int64_t t_, int64_t len_, int64_t bs_, int64_t row_, int64_t nkv_)
      : base(base_), table(table_), t(t_), len(len_), bs(bs_), row(row_), nkv(nkv_), b(bs_ > 0 ? t_ / bs_ : 0),
        o(bs_ > 0 ? t_ % bs_ : 0) {}
  explicit PartCursor(const NextKeys& nx)
      : PartCursor(static_cast<const T*>(nx.kc), nx.table, nx.t0, nx.len, nx.bs, nx.row, nx.nkv) {}
  inline void next() {
    if (!base || t >= len) return;
    prefetch_rows<T, HB>(base + (table[b] * bs + o) * row + g * W * HB, 1, row);
    if (++g < nkv) return;
    g = 0, ++t;
    if (++o == bs) o = 0, ++b;
  }
};

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// attend_tiles' work on a build for AVX2 without AVX-512 (csrc/paged_avx2.cpp, later in this namespace)
template <typename T, int H8>
void attend_avx2(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs, int64_t row,
                 int64_t nq, int64_t group, float scale, float* scores, float* acc, T* out, int64_t lpad, int64_t t0,
                 const float* pm, const float* pl, const float* pacc, const NextKeys& nx);
#endif

template <typename T, int HB>
void attend_tiles(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs,
                  int64_t row, int64_t nq, int64_t group, float scale, float* scores, float* acc, T* out,
                  int64_t lpad, int64_t t0, const float* pm, const float* pl, const float* pacc, const NextKeys& nx) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same_v<T, c10::Half>) {  // fp16 rows: the widening path below (F16C conversions)
    attend_avx2<T, 2 * HB>(q, kc, vc, table, len, bs, row, nq, group, scale, scores, acc, out, lpad, t0, pm, pl, pacc, nx);
    return;
  }
#endif
  constexpr int64_t hd = W * HB;
  constexpr int HC = heads_a_pass<HB>();
  // values read in place (widened in registers) where load16 is a conversion of a few instructions (fp32, bf16)
  constexpr bool direct = !std::is_same_v<T, c10::Half>;
  const int64_t m = len - t0, nkv = nq / group;
  thread_local std::vector<float> wide;  // a block's rows of one kv head, widened
  if (static_cast<int64_t>(wide.size()) < bs * hd) wide.resize(bs * hd);
#if defined(__AVX512BF16__)
  vf part[HC][W];  // scores_bf16's rows' sums
#endif
  int64_t st = 0;
  // the walk's first block's keys (nothing asked for them while the block before was read: there is none)
  for (int64_t g = 0; g < nkv; ++g) prefetch_rows<T, HB>(kc + table[t0 / bs] * bs * row + g * hd, std::min(bs, len - t0), row);
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    const bool more = t + bs < len;  // the next block's rows of these heads, while this one is scored
    for (int64_t g = 0; g < nkv; ++g) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && HB % 2 == 0) {  // scores_bf16: no widened rows
        scores_bf16<HB>(q, kc + table[b] * bs * row + g * hd, n, row, more ? kc + table[b + 1] * bs * row + g * hd : nullptr,
                        g * group, (g + 1) * group, scale, scores + t - t0, lpad, part, vc + table[b] * bs * row + g * hd);
        continue;
      }
#endif
      // rows read in place (fp32): the next block's keys and this block's values requested a row's lines as each
      // key row is read (first pass of the group's heads), not both blocks' whole parts before the scores: ~130 lines
      // at once overflowed the core's miss queue and the values came back to the value pass from memory, not L2
      // (64 rows x 145-290 positions, 30 layers' tables, caches cold, 2-core EPYC Zen 4, both builds alternating
      // in one process, median of 15: fp32 1.63 -> 1.29 ms a layer; bf16 by vdpbf16ps, scores_bf16's `also`,
      // 0.83 -> 0.75 ms). Keys and values in one pass with a running softmax instead
      // was slower: fp32 1.36 against this 1.29 ms in the same run, bf16 1.14 against the two-pass 0.98
      constexpr bool trickle = std::is_same_v<T, float>;
      const T* knext = more ? kc + table[b + 1] * bs * row + g * hd : nullptr;
      const T* vnow = vc + table[b] * bs * row + g * hd;
      const float* kf = widen<T, HB>(kc + table[b] * bs * row + g * hd, n, row, wide.data(), st,
                                     trickle ? nullptr : knext);
      // the same rows' values, toward L2 for the pass after the softmax: two streams in flight instead of the
      // values' own stream starting cold (64 SmolLM2 rows x 158-230 positions, bf16, 2-core Xeon: a step's 30
      // layers 18.0 vs 19.3 ms, 25.1 vs 26.5, alternating builds 20.1-22.0 vs 22.5-22.6)
      if constexpr (!trickle) prefetch_rows<T, HB>(vnow, n, row);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {  // a head at a time: tile_scores
        vf qv[HB];
        for (int u = 0; u < HB; ++u) qv[u] = load16(q + h * hd + u * W) * scale;
        const bool first = trickle && h == g * group;
        for (int64_t i0 = 0; i0 < n; i0 += W) {
          const int64_t c = std::min<int64_t>(W, n - i0);
          const vf r = tile_scores<T, HB>(qv, kf + i0 * st, c, st, first && knext ? knext + i0 * row : nullptr,
                                          first ? vnow + i0 * row : nullptr, row);
          float* dst = scores + h * lpad + t - t0 + i0;
          if (c == W) std::memcpy(dst, &r, sizeof(vf));
          else std::memcpy(dst, &r, c * sizeof(float));
        }
      }
    }
  }
  softmax_heads(scores, m, lpad, nq, hd, acc, pm, pl, pacc);
  PartCursor<T, HB> nk(nx);  // the next task's keys, the next part to request (NextKeys)
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    const bool more = t + bs < len;
    for (int64_t g = 0; g < nkv; ++g) {
      const T* src = vc + table[b] * bs * row + g * hd;
      const T* next = more ? vc + table[b + 1] * bs * row + g * hd : nullptr;
      const T* v0 = src;  // rows `rs` apart: in place (direct), else widened into `wide`
      const float* w0 = nullptr;
      int64_t rs = row;
      if constexpr (!direct) {
        w0 = widen<T, HB>(src, n, row, wide.data(), rs, next);
      }
      // a value row loaded (and widened) once for HC heads of the group, whose sums stay in registers; each head's
      // sum takes the rows in the same order as a head at a time did, so the bits do not change
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HC) {
        const int64_t hc = std::min<int64_t>(HC, (g + 1) * group - h0);
        vf a[HC][HB];
        const float* p[HC];
#pragma GCC unroll 16
        for (int j = 0; j < HC; ++j)
          if (j < hc) {
            p[j] = scores + (h0 + j) * lpad + t - t0;
            for (int u = 0; u < HB; ++u) a[j][u] = load16(acc + (h0 + j) * hd + u * W);
          }
        for (int64_t i = 0; i < n; ++i) {
          if constexpr (direct)  // the next block's values, a row at a time as these are read (a trickle, as the
            // keys': the same quiet host, alternating, median of 25, with the first block's keys above: fp32 1.11 ->
            // 1.06 ms a layer, bf16 0.61 -> 0.59)
            if (next && h0 == g * group) prefetch_rows<T, HB>(next + i * row, 1, row);
          if constexpr (std::is_same_v<T, float>)
            if (h0 == g * group) nk.next();
          vf v[HB];
          for (int u = 0; u < HB; ++u) {
            if constexpr (direct) v[u] = load16(v0 + i * rs + u * W);
            else v[u] = load16(w0 + i * rs + u * W);
          }
#pragma GCC unroll 16
          for (int j = 0; j < HC; ++j)
            if (j < hc) {
              const float pi = p[j][i];
              for (int u = 0; u < HB; ++u) a[j][u] += pi * v[u];
            }
        }
        for (int64_t j = 0; j < hc; ++j) std::memcpy(acc + (h0 + j) * hd, a[j], sizeof(a[j]));
      }
    }
  }
  write_heads(scores, m, lpad, nq, hd, acc, out);
}

}  // namespace
