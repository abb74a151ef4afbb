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

namespace {

constexpr int64_t W = 16;  // lanes: one AVX-512 register of fp32, two of AVX2
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

// W elements widened to fp32 (bf16: the high half of an fp32, so a shift)
inline vf load16(const float* p) { vf v; std::memcpy(&v, p, sizeof(vf)); return v; }
inline vf load16(const c10::BFloat16* p) {
  vh h; std::memcpy(&h, p, sizeof(vh));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof(vf)); return v;
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

// y[i] = exp(x[i]) for x <= 0, W lanes at a time: 2^(x log2 e) = 2^n 2^f, n = round, |f| <= 1/2,
// 2^f by a degree-6 polynomial (relative error ~2e-7, below fp32 softmax rounding); x < -87 -> ~0
inline void exp_nonpos(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v; std::memcpy(&v, x + i, sizeof(vf));
    v = v < -87.f ? vf{} - 87.f : v;
    vf y = v * 1.44269504088896341f;
    vf r = (y + 12582912.f) - 12582912.f;  // round to nearest (|y| < 2^22)
    vf f = y - r;
    vf p = vf{} + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f; p = p * f + 9.6181291e-3f; p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f; p = p * f + 6.9314718e-1f; p = p * f + 1.f;
    vi e = (__builtin_convertvector(r, vi) + 127) << 23;
    vf scale; std::memcpy(&scale, &e, sizeof(vf));
    v = p * scale;
    std::memcpy(x + i, &v, sizeof(vf));
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

// attend() for head size 16 x HB: a query head's HB vectors stay in registers while the keys of a block
// pass (W keys' lane-wise products summed by hsum16, not one horizontal sum a key), and a head's value
// sums likewise (a key's row widened once a head, in L1 after the group's first head). Keys and values
// are read block by block in table order; heads of one kv head follow each other, so a block's rows of
// that kv head come from L1 for all but the first. Per head, the arithmetic does not depend on the
// other heads of the task (any split of the heads over tasks gives the same bits)
// rows [0, n) of one kv head's part of a block (rows `row` apart) as fp32, and the stride between
// them: in place for float, else widened once into buf (n x W * HB) for all the heads that share it. next: the
// same part of the next block (nullptr at the last), requested row by row as this one is read: a steady
// trickle of prefetches rather than a burst that overflows the core's miss queue
template <typename T, int HB>
inline const float* widen(const T* src, int64_t n, int64_t row, float* buf, int64_t& stride, const T* next) {
  constexpr int64_t lines = (W * HB * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  if (next)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(reinterpret_cast<const char*>(next + i * row) + 64 * l);
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

template <typename T, int HB>
void attend_tiles(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs,
                  int64_t row, int64_t nq, int64_t group, float scale, float* scores, float* acc, T* out,
                  int64_t lpad, int64_t t0, const float* pm, const float* pl, const float* pacc) {
  constexpr int64_t hd = W * HB;
  const int64_t m = len - t0, nkv = nq / group;
  thread_local std::vector<float> wide;  // a block's rows of one kv head, widened
  if (static_cast<int64_t>(wide.size()) < bs * hd) wide.resize(bs * hd);
  vf part[W];
  int64_t st = 0;
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    const bool more = t + bs < len;  // the next block's rows of these heads, while this one is scored
    for (int64_t g = 0; g < nkv; ++g) {
      const float* kf = widen<T, HB>(kc + table[b] * bs * row + g * hd, n, row, wide.data(), st,
                                     more ? kc + table[b + 1] * bs * row + g * hd : nullptr);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        vf qv[HB];
        for (int u = 0; u < HB; ++u) qv[u] = load16(q + h * hd + u * W) * scale;
        float* sc = scores + h * lpad + t - t0;
        for (int64_t i0 = 0; i0 < n; i0 += W) {
          const int64_t c = std::min<int64_t>(W, n - i0);
          for (int64_t i = 0; i < c; ++i) {
            const float* k = kf + (i0 + i) * st;
            vf p = qv[0] * load16(k);
            for (int u = 1; u < HB; ++u) p += qv[u] * load16(k + u * W);
            part[i] = p;
          }
          for (int64_t i = c; i < W; ++i) part[i] = vf{};
          const vf r = hsum16(part);
          std::memcpy(sc + i0, &r, c * sizeof(float));
        }
      }
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    float* sc = scores + h * lpad;
    auto [mx, sum] = exp_shifted(sc, m, pm ? pm[h] : -INFINITY);
    float alpha = 0.f;
    if (pm) {
      alpha = std::exp(pm[h] - mx);
      sum += alpha * pl[h];
    }
    sc[m] = 1.f / sum;
    if (pm) for (int64_t d = 0; d < hd; ++d) acc[h * hd + d] = alpha * pacc[h * hd + d];
    else std::fill(acc + h * hd, acc + (h + 1) * hd, 0.f);
  }
  for (int64_t b = t0 / bs, t = t0; t < len; ++b, t += bs) {
    const int64_t n = std::min(bs, len - t);
    const bool more = t + bs < len;
    for (int64_t g = 0; g < nkv; ++g) {
      const float* vf32 = widen<T, HB>(vc + table[b] * bs * row + g * hd, n, row, wide.data(), st,
                                       more ? vc + table[b + 1] * bs * row + g * hd : nullptr);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* p = scores + h * lpad + t - t0;
        vf a[HB];
        for (int u = 0; u < HB; ++u) a[u] = load16(acc + h * hd + u * W);
        for (int64_t i = 0; i < n; ++i)
          for (int u = 0; u < HB; ++u) a[u] += p[i] * load16(vf32 + i * st + u * W);
        std::memcpy(acc + h * hd, a, sizeof(a));
      }
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    const float inv = scores[h * lpad + m];
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d] * inv);
  }
}

// one sequence, nq consecutive query heads (whole kv-head groups of `group`): attention over the first
// len slots. Keys and values are read in place block by block (no division per key), each slot's
// row of these heads once, front to back (one sequential stream, not one per head); the query
// head h reads kv head h / group; scores, softmax and sums in fp32
template <typename T>
void attend(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs,
            int64_t row, int64_t hd, int64_t nq, int64_t group, float scale, float* qf, float* scores,
            float* acc, T* out, int64_t lpad, int64_t t0 = 0, const float* pm = nullptr, const float* pl = nullptr,
            const float* pacc = nullptr) {
  // slots [t0, len) only (t0 a multiple of bs); with a partial (pm, pl, pacc: per head max, sum of
  // exponentials, unnormalised sum of values of slots [0, t0), cascade_part) the two merge exactly
  const auto tiles = [&](auto hb) {  // hd = W * hb
    attend_tiles<T, decltype(hb)::value>(q, kc, vc, table, len, bs, row, nq, group, scale, scores, acc, out, lpad,
                                         t0, pm, pl, pacc);
  };
  switch (hd) {  // the head sizes of the families served (and of the tests' tiny models)
    case 16: return tiles(std::integral_constant<int, 1>{});
    case 32: return tiles(std::integral_constant<int, 2>{});
    case 64: return tiles(std::integral_constant<int, 4>{});
    case 128: return tiles(std::integral_constant<int, 8>{});
    default: break;
  }
  for (int64_t i = 0; i < nq * hd; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  const int64_t nbytes = nq / group * hd * static_cast<int64_t>(sizeof(T));  // this task's part of a slot's row
  const int64_t m = len - t0;  // scores index t - t0
  for (int64_t b = t0 / bs, t = t0; t < len; ++b) {
    const int64_t n = std::min(bs, len - t);
    const T* k = kc + table[b] * bs * row;
    for (int64_t i = 0; i < n; ++i, ++t, k += row) {
      if (i + AHEAD < n) ahead(k + AHEAD * row, nbytes);
      for (int64_t h = 0; h < nq; ++h) scores[h * lpad + t - t0] = dot(qf + h * hd, k + h / group * hd, hd);
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    float* sc = scores + h * lpad;
    float mx = pm ? pm[h] : -INFINITY;
    for (int64_t t = 0; t < m; ++t) mx = sc[t] > mx ? sc[t] : mx;
    for (int64_t t = 0; t < m; ++t) sc[t] -= mx;
    exp_nonpos(sc, m);
    float sum = 0.f;
    for (int64_t t = 0; t < m; ++t) sum += sc[t];
    float alpha = 0.f;  // the partial's weight after rescaling to the common max
    if (pm) {
      alpha = std::exp(pm[h] - mx);
      sum += alpha * pl[h];
    }
    sc[m] = 1.f / sum;  // lpad > m: the normaliser rides in the padding
    if (pm) for (int64_t d = 0; d < hd; ++d) acc[h * hd + d] = alpha * pacc[h * hd + d];
    else std::fill(acc + h * hd, acc + (h + 1) * hd, 0.f);
  }
  for (int64_t b = t0 / bs, t = t0; t < len; ++b) {
    const int64_t n = std::min(bs, len - t);
    const T* v = vc + table[b] * bs * row;
    for (int64_t i = 0; i < n; ++i, ++t, v += row) {
      if (i + AHEAD < n) ahead(v + AHEAD * row, nbytes);
      for (int64_t h = 0; h < nq; ++h) axpy(acc + h * hd, scores[h * lpad + t - t0], v + h / group * hd, hd);
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    const float inv = scores[h * lpad + m];
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d] * inv);
  }
}

// cascade (shared-prefix) decode: rows whose block tables begin with the same block ids read those slots'
// keys/values once for the whole group: widened once per group and kv head into fp32 (lp, hd) (cascade_gather),
// then each task (R rows of a group, one kv head) runs its R x group queries against them as two matrix products
// (at::mm, one thread inside the task), keeping per query the partial (max, sum of exponentials, unnormalised sum
// of values) that attend() merges with the row's own suffix (64 rows x 1,100 keys, bf16: 7.6 ms a layer on 2 Xeon
// cores with per-key loops, 1.8 with the products). pm / pl are (S, nh), pacc (S, nh, hd)
template <typename T>
void cascade_gather(const T* kc, const T* vc, const int64_t* table, int64_t lp, int64_t bs, int64_t row, int64_t hd,
                    int64_t g, float* kd, float* vd) {
  for (int64_t b = 0, t = 0; t < lp; ++b, t += bs) {
    const T* k = kc + table[b] * bs * row + g * hd;
    const T* v = vc + table[b] * bs * row + g * hd;
    for (int64_t i = 0; i < bs; ++i)
      for (int64_t d = 0; d < hd; ++d) {
        kd[(t + i) * hd + d] = static_cast<float>(k[i * row + d]);
        vd[(t + i) * hd + d] = static_cast<float>(v[i * row + d]);
      }
  }
}

// R rows of a group against its kv head g's shared keys / values (lp, hd) fp32 (cascade_gather, once per group and
// kv head for all its pieces): the scores as one matrix product, per query its max, exponentials (16 lanes at a
// time) and their sum, then the exponentials times the values as another: the partial pm / pl / pacc of each query
template <typename T>
void cascade_part(const T* qp, const torch::Tensor& keys, const torch::Tensor& vals, int64_t lp, int64_t hd,
                  int64_t nh, int64_t group, int64_t g, const int64_t* rows, int64_t R, float scale, float* pm,
                  float* pl, float* pacc) {
  const int64_t nq = R * group;
  auto qf = torch::empty({nq, hd}, torch::TensorOptions().dtype(torch::kFloat));
  float* qd = qf.data_ptr<float>();
  std::vector<int64_t> idx(nq);  // (row, head) -> index into pm / pl
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < group; ++j) {
      const int64_t i = r * group + j, h = g * group + j;
      idx[i] = rows[r] * nh + h;
      for (int64_t d = 0; d < hd; ++d) qd[i * hd + d] = static_cast<float>(qp[idx[i] * hd + d]) * scale;
    }
  auto scores = at::mm(qf, keys.t());  // (nq, lp)
  float* sd = scores.data_ptr<float>();
  for (int64_t q = 0; q < nq; ++q) {
    const auto [mx, sum] = exp_shifted(sd + q * lp, lp, -INFINITY);
    pm[idx[q]] = mx;
    pl[idx[q]] = sum;
  }
  const auto acc = at::mm(scores, vals);  // (nq, hd): the exponentials' sums of values
  for (int64_t q = 0; q < nq; ++q) std::memcpy(pacc + idx[q] * hd, acc.data_ptr<float>() + q * hd, hd * sizeof(float));
}

constexpr int64_t CASCADE_MIN_BLOCKS = 2;  // shorter shared runs are read per row
constexpr int64_t CASCADE_ROWS = 16;       // rows of a group per task (its share of the two products)

// groups of >= 2 rows that share >= CASCADE_MIN_BLOCKS leading block ids, and shared[s] the slots
// row s takes from its group's partial (whole blocks, and fewer than its length: its own token is
// always in the suffix); rows that share with nobody get 0. O(S^2 + S x shared blocks) on the host
std::vector<std::vector<int64_t>> cascade_groups(const int64_t* tab, const int64_t* ln, int64_t S, int64_t mb,
                                                 int64_t bs, std::vector<int64_t>& shared) {
  std::vector<std::vector<int64_t>> groups;
  std::vector<char> done(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (done[s]) continue;
    std::vector<int64_t> rows{s};
    int64_t nb = (ln[s] - 1) / bs;
    for (int64_t t = s + 1; t < S; ++t) {
      if (done[t] || tab[t * mb] != tab[s * mb] || ln[t] <= bs) continue;
      int64_t c = 0;
      const int64_t lim = std::min(nb, (ln[t] - 1) / bs);
      while (c < lim && tab[t * mb + c] == tab[s * mb + c]) ++c;
      if (c < CASCADE_MIN_BLOCKS) continue;
      rows.push_back(t);
      nb = c;
    }
    if (rows.size() < 2 || nb < CASCADE_MIN_BLOCKS) continue;
    for (int64_t r : rows) done[r] = 1, shared[r] = nb * bs;
    groups.push_back(std::move(rows));
  }
  return groups;
}

}  // namespace

// q (S, nh, hd); k_cache / v_cache (slots, nkv, hd), slots = num_blocks * block_size; table (S, max_blocks)
// int64 block ids; lens (S) int64 context lengths (>= 1) -> (S, nh, hd) in q's dtype
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                           torch::Tensor lens, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode: q, k_cache, v_cache are 3-D");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  TORCH_CHECK(table.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong, "paged_decode: int64 table/lens");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && table.is_contiguous() && lens.is_contiguous(),
              "paged_decode: cache, table and lens must be contiguous");
  const int64_t S = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  TORCH_CHECK(nh % nkv == 0 && k_cache.size(2) == hd, "paged_decode: head shapes");
  const int64_t group = nh / nkv, mb = table.size(1), row = nkv * hd;
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  int64_t lmax = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ln[s] >= 1 && ln[s] <= mb * block_size, "paged_decode: a length outside its block table");
    lmax = ln[s] > lmax ? ln[s] : lmax;
  }
  const int64_t lpad = lmax + 1;  // one more: each head's softmax normaliser
  // a task is one sequence's kv heads [c * per, (c + 1) * per): whole rows when there are enough
  // sequences for the threads (several tasks a thread, for balance), else each sequence's heads
  // split evenly over the threads (one long stream a thread rather than several short ones)
  const int64_t threads = at::get_num_threads();
  const int64_t want = S >= threads ? 4 * threads : threads;
  const int64_t chunks = std::min(nkv, std::max<int64_t>(1, (want + S - 1) / S));
  const int64_t per = (nkv + chunks - 1) / chunks;
  auto out = torch::empty_like(q);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<int64_t> shared(S, 0);
  const auto groups = cascade_groups(tab, ln, S, mb, block_size, shared);
  // partials of the shared parts: (S, nh) max and sum, (S, nh, hd) values; tasks (group, kv head, rows)
  std::vector<float> pm, pl, pacc;
  std::vector<std::array<int64_t, 4>> ctasks;  // group, kv head, first row in the group, rows
  std::vector<std::pair<torch::Tensor, torch::Tensor>> gkv;  // (group, kv head): shared keys, values (lp, hd) fp32
  if (!groups.empty()) {
    pm.resize(S * nh), pl.resize(S * nh), pacc.resize(S * nh * hd);
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
    for (const auto& rows : groups)
      for (int64_t g = 0; g < nkv; ++g)
        gkv.emplace_back(torch::empty({shared[rows[0]], hd}, f32), torch::empty({shared[rows[0]], hd}, f32));
    for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
      const int64_t R = groups[gi].size();
      const int64_t pieces = (R + CASCADE_ROWS - 1) / CASCADE_ROWS, per_piece = (R + pieces - 1) / pieces;
      for (int64_t g = 0; g < nkv; ++g)
        for (int64_t r0 = 0; r0 < R; r0 += per_piece) ctasks.push_back({gi, g, r0, std::min(per_piece, R - r0)});
    }
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    // each group's shared keys / values of each kv head widened once (not once a piece of rows), then the pieces
    at::parallel_for(0, static_cast<int64_t>(gkv.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t gi = i / nkv, g = i % nkv, r0 = groups[gi][0];
        cascade_gather<T>(kp, vp, tab + r0 * mb, shared[r0], block_size, row, hd, g, gkv[i].first.data_ptr<float>(),
                          gkv[i].second.data_ptr<float>());
      }
    });
    at::parallel_for(0, static_cast<int64_t>(ctasks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto& c = ctasks[i];
        const auto& rows = groups[c[0]];
        const auto& kv = gkv[c[0] * nkv + c[1]];
        cascade_part<T>(qp, kv.first, kv.second, shared[rows[0]], hd, nh, group, c[1], rows.data() + c[2], c[3],
                        scale, pm.data(), pl.data(), pacc.data());
      }
    });
    at::parallel_for(0, S * chunks, 1, [&](int64_t begin, int64_t end) {
      // scores (heads x lpad), scaled queries and accumulators (heads x hd each)
      const int64_t nq_max = per * group;
      std::vector<float> buf(nq_max * lpad + 2 * nq_max * hd);
      float* scores = buf.data();
      float* qf = scores + nq_max * lpad;
      float* acc = qf + nq_max * hd;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / chunks, g0 = i % chunks * per, g1 = std::min(nkv, g0 + per);
        if (g0 >= g1) continue;
        const int64_t h0 = g0 * group;
        const bool part = shared[s] > 0;
        attend<T>(qp + (s * nh + h0) * hd, kp + g0 * hd, vp + g0 * hd, tab + s * mb, ln[s], block_size, row, hd,
                  (g1 - g0) * group, group, scale, qf, scores, acc, op + (s * nh + h0) * hd, lpad, shared[s],
                  part ? pm.data() + s * nh + h0 : nullptr, part ? pl.data() + s * nh + h0 : nullptr,
                  part ? pacc.data() + (s * nh + h0) * hd : nullptr);
      }
    });
  };
  if (q.scalar_type() == torch::kFloat) run(float{});
  else if (q.scalar_type() == torch::kBFloat16) run(c10::BFloat16{});
  else if (q.scalar_type() == torch::kHalf) run(c10::Half{});
  else TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16, got ", q.scalar_type());
  return out;
}

// One sequence's kv heads [g0, g1) of paged_decode into out (1, nh, hd) contiguous, q's dtype: attend() over those
// heads, whose arithmetic a head does not depend on the others in its task, so any split of the heads gives
// paged_decode's bits (one sequence has no shared prefix to cascade). The fused step's team splits a sequence's
// heads this way (csrc/fused_team.cpp); the caller checked the shapes (paged_decode's checks, on the whole step)
void paged_decode_heads(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& table, const torch::Tensor& lens, int64_t block_size, int64_t g0,
                        int64_t g1, torch::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), group = nh / nkv, row = nkv * hd;
  const int64_t len = lens.data_ptr<int64_t>()[0], h0 = g0 * group, nq = (g1 - g0) * group, lpad = len + 1;
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
              q.scalar_type() == out.scalar_type() && table.scalar_type() == torch::kLong &&
              lens.scalar_type() == torch::kLong, "paged_decode_heads: q, the caches and out share a dtype; int64 "
              "table / lens");
  TORCH_CHECK(q.size(0) == 1 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes() &&
              0 <= g0 && g0 < g1 && g1 <= nkv && len >= 1 && len <= table.size(1) * block_size,
              "paged_decode_heads: one sequence, kv heads within [0, nkv), a length within its block table");
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<float> buf(nq * lpad + 2 * nq * hd);  // scores, scaled queries, accumulators (as paged_decode)
  auto run = [&](auto tag) {
    using T = decltype(tag);
    attend<T>(q.data_ptr<T>() + h0 * hd, k_cache.data_ptr<T>() + g0 * hd, v_cache.data_ptr<T>() + g0 * hd,
              table.data_ptr<int64_t>(), len, block_size, row, hd, nq, group, scale, buf.data() + nq * lpad,
              buf.data(), buf.data() + nq * lpad + nq * hd, out.data_ptr<T>() + h0 * hd, lpad);
  };
  if (q.scalar_type() == torch::kFloat) run(float{});
  else if (q.scalar_type() == torch::kBFloat16) run(c10::BFloat16{});
  else if (q.scalar_type() == torch::kHalf) run(c10::Half{});
  else TORCH_CHECK(false, "paged_decode_heads: float32, bfloat16 or float16, got ", q.scalar_type());
}
