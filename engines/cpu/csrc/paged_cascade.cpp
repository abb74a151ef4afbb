// The paged decode kernel's shared-prefix (cascade) part: compiled after csrc/paged_kernel.cpp, in its namespace.
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


// The cascade on AMX tiles (bf16 caches, kv groups of >= 2 query heads, head size a multiple of 32, a host with AMX:
// cascade_amx): a group's shared keys of a kv head are gathered once as the panel kernel's bf16 panels of lp
// outputs (keys) x hd inputs, its values as panels of hd outputs x lp inputs (zero-padded to a multiple of 32), and
// each task's queries run through panel_src::run_range's tiles: the scores as fp32 sums of exact bf16 products
// (scaled after), the exponentials rounded to bf16 for the product with the values (as torch's bf16 SDPA), sums
// fp32. 64 chats x 992 shared keys, SmolLM2, one layer: at::mm on the widened keys ~0.9 ms, here ~0.3.
inline bool cascade_amx(bool bf16, int64_t group, int64_t hd) {
  return bf16 && group >= 2 && hd % 32 == 0 && panel_src::amx_ready();
}

inline int64_t pad32(int64_t n) { return (n + 31) / 32 * 32; }

// W fp32 lanes rounded to bf16 (nearest even; finite values, as the exponentials are) at o
inline void store_bf16(c10::BFloat16* o, vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof(vu));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(u, vh);
  std::memcpy(o, &h, sizeof(vh));
}

// one row of raw attention scores (S) fp32 -> o[t] = exp(score * scale - m), m the largest scaled score, rounded to
// bf16, zeros from S to Sp; returns (m, the exponentials' sum, fp32). Two passes over the row, 16 lanes at a time:
// its maximum (scale > 0: the scaled row's maximum is the maximum's scaling), then the exponentials, their sum and
// the stores. The cascade's tiles take their probabilities from here, decode's and prefill's (cascade_prefill)
std::pair<float, float> softmax_row(const float* row, int64_t S, float scale, c10::BFloat16* o, int64_t Sp) {
#if defined(__AVX512F__)
  // The row's last S % 16 scores as one masked vector (the masked loads read nothing past S), the padding to Sp stored
  // 16 zeros at a time: a query row of a prompt holds ~L / 2 valid scores, and the scalar tail (up to 15 std::exp
  // calls and up to 31 stores a row) cost as much as the vector part
  if (Sp % W == 0 && S >= 1 && S <= Sp) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = ninf;
    int64_t t = 0;
    for (; t + W <= S; t += W) vmax = _mm512_max_ps(_mm512_loadu_ps(row + t), vmax);  // a NaN score keeps vmax
    const __mmask16 tail = static_cast<__mmask16>((1u << (S - t)) - 1u);
    if (S > t) vmax = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, tail, row + t), vmax);
    const float mx = _mm512_reduce_max_ps(vmax) * scale;
    vf vs = vf{};
    for (t = 0; t < S; t += W) {
      const __mmask16 k = S - t >= W ? static_cast<__mmask16>(0xFFFF) : tail;
      const vf x = reinterpret_cast<vf>(_mm512_maskz_loadu_ps(k, row + t));
      const vf e = reinterpret_cast<vf>(_mm512_maskz_mov_ps(k, reinterpret_cast<__m512>(exp16(x * scale - mx))));
      vs += e;
      store_bf16(o + t, e);
    }
    const vh zero = vh{};
    for (; t < Sp; t += W) std::memcpy(o + t, &zero, sizeof(vh));
    return {mx, hsum(vs)};
  }
#endif
  vf vm = vf{} - INFINITY;
  int64_t t = 0;
  for (; t + W <= S; t += W) {
    const vf x = load16(row + t);
    vm = x > vm ? x : vm;
  }
  float raw = -INFINITY;
  for (int j = 0; j < W; ++j) raw = vm[j] > raw ? vm[j] : raw;
  for (; t < S; ++t) raw = row[t] > raw ? row[t] : raw;
  const float mx = raw * scale;
  vf vs = vf{};
  for (t = 0; t + W <= S; t += W) {
    const vf e = exp16(load16(row + t) * scale - mx);
    vs += e;
    store_bf16(o + t, e);
  }
  float sum = hsum(vs);
  for (; t < S; ++t) {
    const float e = std::exp(row[t] * scale - mx);
    sum += e;
    o[t] = static_cast<c10::BFloat16>(e);
  }
  for (; t < Sp; ++t) o[t] = c10::BFloat16(0.f);
  return {mx, sum};
}

// kv head g's shared slots [0, lp) as key panels kd ((lp + 15) / 16, hd / 2, 16, 2) and value panels vd
// (hd / 16, pad32(lp) / 2, 16, 2), both zeroed beforehand. A slot's keys go to their panel as 32-bit pairs; two slots'
// values are interleaved 16 at a time (each widened, the second shifted into the high halves). Element by element it
// was ~15 % of the bf16 causal prefill's time (a 2,048-row SmolLM2 step of 16 prompts of 16-256 tokens, Zen 4)
void cascade_gather_amx(const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* table, int64_t lp, int64_t bs,
                        int64_t row, int64_t hd, int64_t g, c10::BFloat16* kd, c10::BFloat16* vd) {
  const int64_t lp2 = pad32(lp) / 2, h2 = hd / 2;
  const auto at = [&](const c10::BFloat16* c, int64_t t) { return c + (table[t / bs] * bs + t % bs) * row + g * hd; };
  auto* kw = reinterpret_cast<uint32_t*>(kd);
  for (int64_t t = 0; t < lp; ++t) {
    const c10::BFloat16* k = at(kc, t);
    uint32_t* dst = kw + (t / 16) * h2 * 16 + t % 16;  // panel t / 16, output t % 16: pair d2 at d2 * 16
    for (int64_t d2 = 0; d2 < h2; ++d2) {
      uint32_t pair;
      std::memcpy(&pair, k + 2 * d2, sizeof(pair));
      dst[d2 * 16] = pair;
    }
  }
  for (int64_t t = 0; t < lp; t += 2) {  // the callers' hd is a multiple of 32
    const c10::BFloat16* v0 = at(vc, t);
    const c10::BFloat16* v1 = t + 1 < lp ? at(vc, t + 1) : nullptr;  // past lp: zeros
    for (int64_t p = 0; p < hd / 16; ++p) {
      vh a, b = vh{};
      std::memcpy(&a, v0 + p * 16, sizeof(vh));
      if (v1) std::memcpy(&b, v1 + p * 16, sizeof(vh));
      const vu w = __builtin_convertvector(a, vu) | (__builtin_convertvector(b, vu) << 16);
      std::memcpy(vd + (p * lp2 + t / 2) * 32, &w, sizeof(vu));
    }
  }
}

// bf16 rows (M, K2 pairs) as run_range reads them for `variant`: as they are for AMX's tiles (3, 4); else (1, the
// several-row blocks: vdpbf16ps in a build for AVX512-BF16) transposed to (K2, M) pairs in t (panel_src::transpose_rows)
inline const uint32_t* rows_for(int64_t variant, const c10::BFloat16* x, int64_t M, int64_t K2, std::vector<uint32_t>& t) {
  const auto* s = reinterpret_cast<const uint32_t*>(x);
  if (variant >= 3) return s;
  if (static_cast<int64_t>(t.size()) < K2 * M) t.resize(K2 * M);
  panel_src::transpose_rows(s, M, K2, t.data());
  return t.data();
}

// cascade_part on the tiles: the R x group queries of kv head g (rows of a group) against its panels; variant 4: the
// tiles' arithmetic in scalar C++ (panel_kernel.cpp row_variant; tests on hosts without AMX)
void cascade_part_amx(const c10::BFloat16* qp, const torch::Tensor& kpan, const torch::Tensor& vpan, int64_t lp,
                      int64_t hd, int64_t nh, int64_t group, int64_t g, const int64_t* rows, int64_t R, float scale,
                      float* pm, float* pl, float* pacc, int64_t variant = 3) {
  using BF = c10::BFloat16;
  const int64_t nq = R * group, nq16 = (nq + 15) / 16 * 16, lpp = pad32(lp);
  // scratch a thread keeps (grown, never cleared): the queries' rows, then the exponentials' rows (the padding rows
  // nq .. nq16 hold stale values, which reach only their own outputs, never stored); scores; value sums
  thread_local std::vector<BF> x;
  thread_local std::vector<float> sc, acc;
  thread_local std::vector<int64_t> idx;
  thread_local std::vector<uint32_t> xt;
  if (static_cast<int64_t>(x.size()) < nq16 * std::max(hd, lpp)) x.resize(nq16 * std::max(hd, lpp));
  if (static_cast<int64_t>(sc.size()) < nq * lp) sc.resize(nq * lp);
  if (static_cast<int64_t>(acc.size()) < nq * hd) acc.resize(nq * hd);
  idx.resize(nq);  // (row, head) -> index into pm / pl
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < group; ++j) {
      const int64_t i = r * group + j;
      idx[i] = rows[r] * nh + g * group + j;
      std::memcpy(x.data() + i * hd, qp + idx[i] * hd, hd * sizeof(BF));
    }
  panel_src::run_range<uint32_t, BF, float>(rows_for(variant, x.data(), nq, hd / 2, xt), nq, hd / 2,
                                            kpan.data_ptr<BF>(), lp, nullptr, nullptr, sc.data(), variant, 0,
                                            (lp + 15) / 16);
  for (int64_t i = 0; i < nq; ++i) {
    const auto [mx, sum] = softmax_row(sc.data() + i * lp, lp, scale, x.data() + i * lpp, lpp);
    pm[idx[i]] = mx, pl[idx[i]] = sum;
  }
  panel_src::run_range<uint32_t, BF, float>(rows_for(variant, x.data(), nq, lpp / 2, xt), nq, lpp / 2,
                                            vpan.data_ptr<BF>(), hd, nullptr, nullptr, acc.data(), variant, 0, hd / 16);
  for (int64_t i = 0; i < nq; ++i) std::memcpy(pacc + idx[i] * hd, acc.data() + i * hd, hd * sizeof(float));
}

}  // namespace
