// Decode attention's entry for one task (csrc/paged_kernel.cpp's attend_tiles for the head sizes served, a plain
// walk for the rest): compiled after paged_kernel.cpp and paged_avx2.cpp in the paged kernel's namespace;
// paged_decode.cpp calls it.
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

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
  const NextKeys nx = next_keys;  // named for this call only
  next_keys = NextKeys{};
  const auto tiles = [&](auto hb) {  // hd = W * hb
    attend_tiles<T, decltype(hb)::value>(q, kc, vc, table, len, bs, row, nq, group, scale, scores, acc, out, lpad,
                                         t0, pm, pl, pacc, nx);
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

}  // namespace
