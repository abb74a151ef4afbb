// The paged decode kernel's entry points: compiled after csrc/paged_kernel.cpp and csrc/paged_cascade.cpp, in
// their namespace.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

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
  std::vector<std::pair<torch::Tensor, torch::Tensor>> gkv;  // (group, kv head): shared keys, values
  const bool amx = cascade_amx(q.scalar_type() == torch::kBFloat16, group, hd);
  if (!groups.empty()) {
    pm.resize(S * nh), pl.resize(S * nh), pacc.resize(S * nh * hd);
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat), bf = f32.dtype(torch::kBFloat16);
    for (const auto& rows : groups)
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t lp = shared[rows[0]];
        if (amx)  // panels (cascade_gather_amx)
          gkv.emplace_back(torch::zeros({(lp + 15) / 16 * 16 * hd}, bf), torch::zeros({hd * pad32(lp)}, bf));
        else  // (lp, hd) fp32 rows
          gkv.emplace_back(torch::empty({lp, hd}, f32), torch::empty({lp, hd}, f32));
      }
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
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (amx) {
            cascade_gather_amx(kp, vp, tab + r0 * mb, shared[r0], block_size, row, hd, g, gkv[i].first.data_ptr<T>(),
                               gkv[i].second.data_ptr<T>());
            continue;
          }
        cascade_gather<T>(kp, vp, tab + r0 * mb, shared[r0], block_size, row, hd, g, gkv[i].first.data_ptr<float>(),
                          gkv[i].second.data_ptr<float>());
      }
    });
    at::parallel_for(0, static_cast<int64_t>(ctasks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto& c = ctasks[i];
        const auto& rows = groups[c[0]];
        const auto& kv = gkv[c[0] * nkv + c[1]];
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (amx) {
            cascade_part_amx(qp, kv.first, kv.second, shared[rows[0]], hd, nh, group, c[1], rows.data() + c[2], c[3],
                             scale, pm.data(), pl.data(), pacc.data());
            continue;
          }
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
        if (i + 1 < end) {  // the keys of this thread's next task, for attend's value pass to request (NextKeys)
          const int64_t s1 = (i + 1) / chunks, n0 = (i + 1) % chunks * per, n1 = std::min(nkv, n0 + per);
          set_next_keys(n0 < n1 ? kp + n0 * hd : nullptr, tab + s1 * mb, ln[s1], shared[s1], n1 - n0, block_size, row);
        }
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

// The products' variants of cascade_prefill and causal_prefill (engines/model/prefill_cascade.py prefill_variant);
// causal_prefill also runs 2 (csrc/paged_causal.cpp)
void check_prefill_variant(const char* op, int64_t variant, bool bf16, int64_t hd, bool causal = false) {
#if PANEL_X86
  const bool avx2 = causal && hd % 16 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool avx2 = false;
#endif
  TORCH_CHECK(variant == 0 || (variant == 2 && avx2) ||
                  ((variant == 1 || variant == 4 || (variant == 3 && panel_src::amx_ready())) && bf16 && hd % 32 == 0),
              op, ": variant 0 (fp32 products), 1 (bf16 rows: bf16, hd a multiple of 32), ",
              causal ? "2 (avx2 row blocks: hd a multiple of 16, a CPU with AVX2 and FMA), " : "",
              "3 (amx: bf16, hd a multiple of 32, a host with AMX tiles) or 4 (amx_emulated: bf16, hd a multiple of 32), "
              "got ", variant);
}

// Prefill chunks that continue one cached prefix (engines/model/prefill_cascade.py): each query row of a chunk is
// a decode row of the cascade above whose context ends at its own position. chunks (G, 3) int64: a chunk's first
// row in q (N, nh, hd), its query count n and start position (>= shared_len); tables (G, >= blocks) their block
// tables, which all begin with the same shared_len / block_size block ids. Returns (R, nh, hd) in q's dtype, the
// attention of the chunks' rows in order (R = the sum of n), each query i of a chunk over positions [0, start + i].
// Three phases, each over the intra-op threads: the shared keys and values of each kv head gathered once (into
// panels, cascade_gather_amx, or fp32 rows, cascade_gather); every query's partial over them (tasks of
// PREFILL_QUERIES queries: rows x the kv head's query heads, cascade_part_amx or cascade_part, each its scores,
// softmax and product with the values in the core's cache); then each row's own slots after the prefix, merged with
// its partial (attend, as a decode row). variant: 0 the fp32 products (any dtype), 1 the panel kernel's bf16 row
// blocks (vdpbf16ps where built for AVX512-BF16), 3 AMX tiles (bf16, a host with AMX), 4 their arithmetic in scalar
// C++ (bf16; tests on any host). Before (SmolLM2, 43 chats' questions, 2,047 rows,
// after 1,041 shared keys, 2 Xeon cores): panel_linear_f32 and a softmax over slices of up to 8 MB of scores through
// memory, the own part and the merge in torch ops, ~26 ms a layer.
constexpr int64_t PREFILL_QUERIES = 96;
torch::Tensor cascade_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                              torch::Tensor chunks, int64_t shared_len, int64_t block_size, int64_t variant) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(),
              "cascade_prefill: q (N, nh, hd), caches (slots, nkv, hd)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "cascade_prefill: q and the cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cascade_prefill: contiguous caches");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && chunks.scalar_type() == torch::kLong && tables.dim() == 2 &&
              chunks.dim() == 2 && chunks.size(1) == 3 && tables.size(0) == chunks.size(0) && chunks.size(0) >= 1,
              "cascade_prefill: int64 tables (G, blocks) and chunks (G, 3: first row, queries, start)");
  q = q.contiguous(), tables = tables.contiguous(), chunks = chunks.contiguous();
  const int64_t N = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), row = nkv * hd;
  const int64_t G = chunks.size(0), mb = tables.size(1), blocks = k_cache.size(0) / std::max<int64_t>(block_size, 1);
  TORCH_CHECK(nh % nkv == 0 && k_cache.size(2) == hd, "cascade_prefill: head shapes (nh a multiple of nkv)");
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  check_prefill_variant("cascade_prefill", variant, bf16, hd);
  TORCH_CHECK(block_size >= 1 && shared_len >= block_size && shared_len % block_size == 0 && shared_len <= mb * block_size,
              "cascade_prefill: shared length ", shared_len, " must be whole blocks of ", block_size, " within the tables");
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* ch = chunks.data_ptr<int64_t>();
  std::vector<int64_t> rows, chunk_of;  // the chunks' query rows in order, and each one's chunk
  int64_t lmax = shared_len + 1;
  for (int64_t c = 0; c < G; ++c) {
    const int64_t r0 = ch[3 * c], n = ch[3 * c + 1], start = ch[3 * c + 2];
    TORCH_CHECK(r0 >= 0 && n >= 1 && r0 + n <= N && start >= shared_len && start + n <= mb * block_size,
                "cascade_prefill: chunk ", c, " (rows ", r0, " + ", n, ", start ", start, ") outside q or its table");
    for (int64_t b = 0; b < (start + n + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tab[c * mb + b] >= 0 && tab[c * mb + b] < blocks, "cascade_prefill: block id ", tab[c * mb + b],
                  " outside [0, ", blocks, ")");
    for (int64_t b = 0; b < shared_len / block_size; ++b)
      TORCH_CHECK(tab[c * mb + b] == tab[b], "cascade_prefill: chunk ", c, " does not begin with the shared blocks");
    for (int64_t i = 0; i < n; ++i) rows.push_back(r0 + i), chunk_of.push_back(c);
    lmax = std::max(lmax, start + n);
  }
  const int64_t R = rows.size(), group = nh / nkv, lp = shared_len, lpad = lmax - shared_len + 1;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<float> pm(N * nh), pl(N * nh), pacc(N * nh * hd);
  const auto f32 = q.options().dtype(torch::kFloat), bf = f32.dtype(torch::kBFloat16);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> kv;  // each kv head's shared keys, values
  for (int64_t g = 0; g < nkv; ++g)
    if (variant) kv.emplace_back(torch::zeros({(lp + 15) / 16 * 16 * hd}, bf), torch::zeros({hd * pad32(lp)}, bf));
    else kv.emplace_back(torch::empty({lp, hd}, f32), torch::empty({lp, hd}, f32));
  auto out = torch::empty({R, nh, hd}, q.options());
  const int64_t per = std::max<int64_t>(1, PREFILL_QUERIES / group), pieces = (R + per - 1) / per;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    at::parallel_for(0, nkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (variant) {
            cascade_gather_amx(kp, vp, tab, lp, block_size, row, hd, g, kv[g].first.data_ptr<T>(),
                               kv[g].second.data_ptr<T>());
            continue;
          }
        cascade_gather<T>(kp, vp, tab, lp, block_size, row, hd, g, kv[g].first.data_ptr<float>(),
                          kv[g].second.data_ptr<float>());
      }
    });
    at::parallel_for(0, nkv * pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = i / pieces, r0 = i % pieces * per, n = std::min(per, R - r0);
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (variant) {
            cascade_part_amx(qp, kv[g].first, kv[g].second, lp, hd, nh, group, g, rows.data() + r0, n, scale,
                             pm.data(), pl.data(), pacc.data(), variant);
            continue;
          }
        cascade_part<T>(qp, kv[g].first, kv[g].second, lp, hd, nh, group, g, rows.data() + r0, n, scale, pm.data(),
                        pl.data(), pacc.data());
      }
    });
    T* op = out.data_ptr<T>();
    at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(nh * lpad + 2 * nh * hd);  // scores, scaled queries, accumulators (as paged_decode)
      for (int64_t i = begin; i < end; ++i) {
        const int64_t c = chunk_of[i], s = rows[i], len = ch[3 * c + 2] + (s - ch[3 * c]) + 1;
        attend<T>(qp + s * nh * hd, kp, vp, tab + c * mb, len, block_size, row, hd, nh, group, scale,
                  buf.data() + nh * lpad, buf.data(), buf.data() + nh * lpad + nh * hd, op + i * nh * hd, lpad,
                  shared_len, pm.data() + s * nh, pl.data() + s * nh, pacc.data() + s * nh * hd);
      }
    });
  };
  if (q.scalar_type() == torch::kFloat) run(float{});
  else if (bf16) run(c10::BFloat16{});
  else if (q.scalar_type() == torch::kHalf) run(c10::Half{});
  else TORCH_CHECK(false, "cascade_prefill: float32, bfloat16 or float16, got ", q.scalar_type());
  return out;
}

// One prefill chunk (n query rows from row r0, at positions start .. start + n - 1) and kv head g, causal: its keys /
// values [0, start + n) gathered once (fp32 rows, or bf16 panels for variant 1, 3, 4), then per piece of `piece` rows the
// scores of its rows x group queries against the piece's context [0, lp) as one product, each query's softmax over
// its own slots [0, its position] only (the later slots' exponentials are zeros), the exponentials times the
// values as another product, each output row the sums over the exponentials' sum, rounded once into out
template <typename T>
void causal_chunk(const T* qp, const T* kc, const T* vc, const int64_t* table, int64_t bs, int64_t row, int64_t hd,
                  int64_t nh, int64_t qs, int64_t group, int64_t g, int64_t r0, int64_t n, int64_t start, int64_t piece,
                  float scale, T* out, int64_t variant) {
  const int64_t L = start + n;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  std::vector<float> sums(piece * group);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (variant) {
      using BF = c10::BFloat16;
      // key panels ((L + 15) / 16, hd / 2, 16, 2): a piece's keys are the first of them; value panels (hd / 16,
      // pad32(L) / 2, 16, 2): a piece runs each 16-output panel on its own, over its first pad32(lp) / 2 key pairs
      const int64_t L16 = (L + 15) / 16 * 16, L2 = pad32(L) / 2;
      thread_local std::vector<BF> x, kd, vd;
      thread_local std::vector<float> sc, acc;
      thread_local std::vector<uint32_t> xt;
      kd.assign(L16 * hd, BF(0.f));
      vd.assign(hd * 2 * L2, BF(0.f));
      cascade_gather_amx(kc, vc, table, L, bs, row, hd, g, kd.data(), vd.data());
      for (int64_t i0 = 0; i0 < n; i0 += piece) {
        const int64_t R = std::min(piece, n - i0), nq = R * group, nq16 = (nq + 15) / 16 * 16;
        const int64_t lp = start + i0 + R, lp16 = (lp + 15) / 16 * 16, lpp = pad32(lp);
        if (static_cast<int64_t>(x.size()) < nq16 * std::max(hd, lpp)) x.resize(nq16 * std::max(hd, lpp));
        if (static_cast<int64_t>(sc.size()) < nq16 * lp16) sc.resize(nq16 * lp16);
        if (static_cast<int64_t>(acc.size()) < nq16 * hd) acc.resize(nq16 * hd);
        const auto head = [&](int64_t i) { return (r0 + i0 + i / group) * nh + g * group + i % group; };
        const auto query = [&](int64_t i) { return qp + (r0 + i0 + i / group) * qs + (g * group + i % group) * hd; };
        for (int64_t r = 0; r < R; ++r)  // a token's group of query heads lies together: one copy a token
          std::memcpy(x.data() + r * group * hd, query(r * group), group * hd * sizeof(BF));
        panel_src::run_range<uint32_t, BF, float>(rows_for(variant, x.data(), nq, hd / 2, xt), nq, hd / 2, kd.data(),
                                                  lp16, nullptr, nullptr, sc.data(), variant, 0, lp16 / 16);
        for (int64_t i = 0; i < nq; ++i)
          sums[i] = softmax_row(sc.data() + i * lp16, start + i0 + i / group + 1, scale, x.data() + i * lpp, lpp).second;
        const uint32_t* e = rows_for(variant, x.data(), nq, lpp / 2, xt);  // the exponentials
        for (int64_t p = 0; p < hd / 16; ++p)  // panel p of the values at its place in vd, read as a run of lpp / 2
          panel_src::run_range<uint32_t, BF, float>(e, nq, lpp / 2,
                                                    vd.data() + p * (L2 - lpp / 2) * 32, hd, nullptr, nullptr,
                                                    acc.data(), variant, p, p + 1);
        for (int64_t i = 0; i < nq; ++i) {  // 16 at a time (hd a multiple of 32), rounded as c10 rounds
          T* o = out + head(i) * hd;
          const float inv = 1.f / sums[i];
          for (int64_t d = 0; d < hd; d += W) {
            const vf y = panel_src::round_bf16(load16(acc.data() + i * hd + d) * inv);
            const vh h = __builtin_convertvector(panel_src::as_u(y) >> 16, vh);
            std::memcpy(o + d, &h, sizeof(vh));
          }
        }
      }
      return;
    }
  }
  // cascade_gather copies whole blocks: room for the last one; a piece uses the first lp rows
  const int64_t Lb = (L + bs - 1) / bs * bs;
  auto keys = torch::empty({Lb, hd}, f32), vals = torch::empty({Lb, hd}, f32);
  cascade_gather<T>(kc, vc, table, L, bs, row, hd, g, keys.data_ptr<float>(), vals.data_ptr<float>());
  for (int64_t i0 = 0; i0 < n; i0 += piece) {
    const int64_t R = std::min(piece, n - i0), nq = R * group, lp = start + i0 + R;
    const auto head = [&](int64_t i) { return (r0 + i0 + i / group) * nh + g * group + i % group; };
    const auto query = [&](int64_t i) { return qp + (r0 + i0 + i / group) * qs + (g * group + i % group) * hd; };
    auto qf = torch::empty({nq, hd}, f32);
    float* qd = qf.data_ptr<float>();
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t d = 0; d < hd; ++d) qd[i * hd + d] = static_cast<float>(query(i)[d]) * scale;
    auto scores = at::mm(qf, keys.narrow(0, 0, lp).t());  // (nq, lp)
    float* sd = scores.data_ptr<float>();
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t valid = start + i0 + i / group + 1;
      sums[i] = exp_shifted(sd + i * lp, valid, -INFINITY).second;
      std::fill(sd + i * lp + valid, sd + (i + 1) * lp, 0.f);
    }
    const auto a = at::mm(scores, vals.narrow(0, 0, lp));  // (nq, hd)
    const float* ad = a.data_ptr<float>();
    for (int64_t i = 0; i < nq; ++i) {
      T* o = out + head(i) * hd;
      const float inv = 1.f / sums[i];
      for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(ad[i * hd + d] * inv);
    }
  }
}

// Every prefill chunk of a step, causal (fresh prompts and continuations; their keys and values already in the
// cache): one task a chunk and kv head (causal_chunk: its context gathered once, then per piece of `piece` query
// rows two products over the piece's context, each query's softmax masked to its own slots; variant 2: blocks of 6
// query rows through AVX2 row blocks, csrc/paged_causal.cpp causal_chunk_avx2). Rows are written to
// `out` (N, nh, hd) in place, at their rows of q. One parallel region a layer, tasks claimed costliest first:
// per-sequence SDPA took 68 calls a layer on a SmolLM2 step of 14 fresh prompts (2,048 rows), each a fork and join,
// and a strided copy of its output.
void causal_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                    torch::Tensor chunks, int64_t block_size, int64_t variant, int64_t piece, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
              out.sizes() == q.sizes(), "causal_prefill: q and out (N, nh, hd), caches (slots, nkv, hd)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "causal_prefill: q, out and the cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "causal_prefill: contiguous caches and out");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && chunks.scalar_type() == torch::kLong && tables.dim() == 2 &&
              chunks.dim() == 2 && chunks.size(1) == 3 && tables.size(0) == chunks.size(0),
              "causal_prefill: int64 tables (G, blocks) and chunks (G, 3: first row, queries, start)");
  // q's rows may lie apart (a view of the step's fused q, k, v output: no copy), each row's heads together
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  tables = tables.contiguous(), chunks = chunks.contiguous();
  const int64_t N = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), row = nkv * hd, qs = q.stride(0);
  const int64_t G = chunks.size(0), mb = tables.size(1), bs = block_size;
  TORCH_CHECK(nh % nkv == 0 && k_cache.size(2) == hd, "causal_prefill: head shapes (nh a multiple of nkv)");
  TORCH_CHECK(bs >= 1 && piece >= 1, "causal_prefill: block size and piece rows must be >= 1");
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  check_prefill_variant("causal_prefill", variant, bf16, hd, true);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* ch = chunks.data_ptr<int64_t>();
  const int64_t blocks = k_cache.size(0) / bs;
  std::vector<char> seen(N, 0);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (cost, chunk x nkv + kv head), costliest first
  for (int64_t c = 0; c < G; ++c) {
    const int64_t r0 = ch[3 * c], n = ch[3 * c + 1], start = ch[3 * c + 2];
    TORCH_CHECK(r0 >= 0 && n >= 1 && r0 + n <= N && start >= 0 && start + n <= mb * bs,
                "causal_prefill: chunk ", c, " (rows ", r0, " + ", n, ", start ", start, ") outside q or its table");
    for (int64_t b = 0; b < (start + n + bs - 1) / bs; ++b)
      TORCH_CHECK(tab[c * mb + b] >= 0 && tab[c * mb + b] < blocks, "causal_prefill: block id ", tab[c * mb + b],
                  " outside [0, ", blocks, ")");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(!seen[r0 + i], "causal_prefill: row ", r0 + i, " in two chunks");
      seen[r0 + i] = 1;
    }
    for (int64_t g = 0; g < nkv; ++g) tasks.emplace_back(n * (2 * start + n), c * nkv + g);
  }
  std::sort(tasks.begin(), tasks.end(), std::greater<>());
  const int64_t group = nh / nkv, nt = static_cast<int64_t>(tasks.size());
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    std::atomic<int64_t> next{0};  // each thread claims the next costliest task (their costs differ by 100x)
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < nt;) {
        const int64_t c = tasks[i].second / nkv, g = tasks[i].second % nkv;
#if PANEL_X86
        if (variant == 2) {
          causal_chunk_avx2<T>(qp, kp, vp, tab + c * mb, bs, row, hd, nh, qs, group, g, ch[3 * c], ch[3 * c + 1],
                               ch[3 * c + 2], scale, op);
          continue;
        }
#endif
        causal_chunk<T>(qp, kp, vp, tab + c * mb, bs, row, hd, nh, qs, group, g, ch[3 * c], ch[3 * c + 1], ch[3 * c + 2],
                        piece, scale, op, variant);
      }
    });
  };
  if (q.scalar_type() == torch::kFloat) run(float{});
  else if (bf16) run(c10::BFloat16{});
  else if (q.scalar_type() == torch::kHalf) run(c10::Half{});
  else TORCH_CHECK(false, "causal_prefill: float32, bfloat16 or float16, got ", q.scalar_type());
}
