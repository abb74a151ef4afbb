// The greedy screen's candidates (engines/cpu/greedy_head.py): compiled last, at namespace scope, after
// csrc/fused_decode.cpp (whose `using` declarations bring paged_src's 16-lane vectors here).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

typedef int32_t vi32 __attribute__((vector_size(64)));

// a (S, V) float32 (approximate logits), k (S) and wn (V) float32 (each entry's error is at most k[s] * wn[j]) -> (N, 2)
// int64: the (row, column) pairs that may hold the row's largest exact value, a[s, j] + k[s] wn[j] >= max over i of
// (a[s, i] - k[s] wn[i]); rows in order, columns ascending. A row with a NaN, or no finite bound, gives the one pair
// (s, -1) (its caller takes the full logits). The greedy screen's candidates (engines/cpu/greedy_head.py): two
// vectorized passes a row
torch::Tensor near_max_rows(torch::Tensor a, torch::Tensor k, torch::Tensor wn) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == torch::kFloat && a.size(1) > 0, "near_max_rows: a (S, V) float32, V > 0");
  TORCH_CHECK(k.dim() == 1 && k.scalar_type() == torch::kFloat && k.size(0) == a.size(0), "near_max_rows: k (S) float32");
  TORCH_CHECK(wn.dim() == 1 && wn.scalar_type() == torch::kFloat && wn.size(0) == a.size(1),
              "near_max_rows: wn (V) float32");
  auto x = a.contiguous();
  auto kk = k.contiguous();
  auto ww = wn.contiguous();
  const int64_t S = x.size(0), V = x.size(1);
  const float* p = x.data_ptr<float>();
  const float* kp = kk.data_ptr<float>();
  const float* wp = ww.data_ptr<float>();
  std::vector<std::vector<int64_t>> hits(S);
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const float* r = p + s * V;
      const float ks = kp[s];
      vf m = vf{} - INFINITY, bad = vf{};
      int64_t j = 0;
      for (; j + W <= V; j += W) {
        const vf v = load16(r + j);
        const vf lo = v - ks * load16(wp + j);
        m = lo > m ? lo : m;
        bad = (vf)((vi32)bad | (vi32)(v != v));
      }
      float best = -INFINITY;
      bool nan = false;
      for (int l = 0; l < W; ++l) {
        best = m[l] > best ? m[l] : best;
        nan = nan || ((vi32)bad)[l] != 0;
      }
      for (; j < V; ++j) {
        nan = nan || r[j] != r[j];
        const float lo = r[j] - ks * wp[j];
        best = lo > best ? lo : best;
      }
      if (nan || !std::isfinite(best)) {
        hits[s] = {-1};
        continue;
      }
      for (j = 0; j + W <= V; j += W) {
        const vi32 ge = load16(r + j) + ks * load16(wp + j) >= best;
        bool any = false;
        for (int l = 0; l < W; ++l) any = any || ge[l] != 0;
        if (any)
          for (int l = 0; l < W; ++l)
            if (ge[l]) hits[s].push_back(j + l);
      }
      for (; j < V; ++j)
        if (r[j] + ks * wp[j] >= best) hits[s].push_back(j);
    }
  });
  int64_t n = 0;
  for (const auto& h : hits) n += static_cast<int64_t>(h.size());
  auto out = torch::empty({n, 2}, x.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    for (const int64_t c : hits[s]) *o++ = s, *o++ = c;
  return out;
}
