// Several greedy decode steps in one call (engines/cpu/fused_decode.py FusedDecode.run_steps; compiled after
// csrc/fused_decode.cpp and csrc/fused_team.cpp, whose helpers it calls). A batch-1 SmolLM2 token on a 2-core host
// spends ~0.6 ms of its ~5.5 ms in the interpreter between the blocks' call, the vocabulary head and the sampler,
// and most of that is cold: the weights' stream has just evicted the interpreter's code and data from every cache.
// Here each step's embedding lookup, blocks, final norm, head and argmax run back to back in C++, the argmax
// feeding the next step, with the same ops on the same inputs as the one-step path (so the same tokens: tests).
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {
// head_kind codes of decode_steps_bound beyond block_linear's (0 .. PANEL_AVX2, whose output is widened to fp32)
constexpr int64_t HEAD_FP8_F32 = 100;  // + the FP8 kernel's variant: its fp32 sums (Fp8PanelLinear.forward_float)
constexpr int64_t HEAD_PANEL_F32 = 200;  // bf16 rows through bf16 panels, fp32 sums (FastLinear.forward_float)

// the head's logits (M, N) fp32 of the final hidden rows h (M, C), as engines/model/transformer.head_logits
torch::Tensor head_logits(int64_t kind, const torch::Tensor& h, const torch::Tensor* t, int64_t N) {
  if (kind >= HEAD_FP8_F32 && kind < HEAD_PANEL_F32)
    return fp8_src::fp8_linear_f32(h, t[2], t[0], N, given(t[1]), kind - HEAD_FP8_F32);
  if (kind == HEAD_PANEL_F32) return panel_src::panel_linear_f32(h, t[2], N, 0);
  auto y = block_linear(kind, h, t, N, c10::nullopt);
  return y.scalar_type() == torch::kFloat ? y : y.to(torch::kFloat);
}

// The greedy screen's tokens of fp32 rows h (M, C) (engines/cpu/greedy_head.py GreedyScreen.tokens, the same ops):
// s = (the head's bf16 panels, its fp32 weight (out, C), its rows' norms (vocab)), c the bound's constant, variant the
// panel kernel's; an undefined tensor where a row is NaN / infinite or too flat (the full head then, as the step head)
torch::Tensor screen_tokens(const torch::Tensor& h, const std::vector<torch::Tensor>& s, double c, int64_t variant,
                            int64_t out, int64_t vocab) {
  constexpr int64_t MAX_CANDIDATES_PER_ROW = 256;  // (greedy_head.py)
  const int64_t M = h.size(0);
  auto a = panel_src::panel_linear_f32(h.to(at::kBFloat16), s[0], out, variant);  // (M, out)
  if (a.size(1) != vocab) a = a.narrow(1, 0, vocab).contiguous();
  const auto k = at::linalg_vector_norm(h, 2, at::IntArrayRef{1}) * c;
  const auto pairs = near_max_rows(a, k, s[2]);  // (N, 2) (row, column)
  if (pairs.size(0) == 0 || pairs.size(0) > MAX_CANDIDATES_PER_ROW * M || (pairs.select(1, 1) < 0).any().item<bool>())
    return {};
  const auto rows = pairs.select(1, 0), cols = pairs.select(1, 1);
  const auto exact = (h.index_select(0, rows) * s[1].index_select(0, cols)).sum(-1);  // the candidates' fp32 logits
  const auto best = at::full({M}, -INFINITY, h.options()).scatter_reduce(0, rows, exact, "amax");
  if (!at::isfinite(best).all().item<bool>()) return {};
  const auto hit = at::where(exact == best.index_select(0, rows), cols, at::full_like(cols, vocab));
  return at::full({M}, vocab, cols.options()).scatter_reduce(0, rows, hit, "amin");
}
}  // namespace

// Up to `steps` greedy decode tokens of M sequences on the blocks bound under `handle` (one device: its first
// and last stage). ids (M) int64 the tokens to feed; pos (M) their positions; table (M, blocks) int64 covering
// positions up to pos + steps - 1; cos_table / sin_table (P, hd / 2) fp32 of positions [0, P), P > pos + steps - 1
// (empty: no rotary embedding); around = (wte weight, wpe weight or empty, the final norm's weight, its bias or
// empty); head_kind (HEAD_FP8_F32 + variant, HEAD_PANEL_F32, or a block_linear code) and head = its 5 tensors as a
// block Linear's (scales, bias, FP8 panels for the FP8 head; weight, bias, panels, packed, weight_t otherwise),
// head_out its rows; vocab: the argmax's columns; stops (M, S) int64 each row's stop tokens (-1 padding); screen:
// empty, or the greedy screen's 3 tensors (screen_tokens), its constant and panel variant, which then draws the
// tokens (the full head where it cannot). The other arguments as decode_bound. Step j embeds the ids (+ the learned
// positions), runs the blocks, the final norm (RMSNorm where rms, else LayerNorm; eps), the head and the argmax of
// its first `vocab` logits (or the screen's tokens), which are step j + 1's ids. -> tokens (n, M) int64: n = steps,
// or fewer where a row drew one of its stop tokens at step n - 1 (every row's tokens up to there computed)
torch::Tensor decode_steps_bound(int64_t handle, torch::Tensor ids, torch::Tensor pos, int64_t steps,
                                 std::vector<int64_t> kinds, torch::Tensor table, int64_t block_size, int64_t n_head,
                                 int64_t ffn, double eps, int64_t act, bool rms, double qk_eps, torch::Tensor cos_table,
                                 torch::Tensor sin_table, std::vector<torch::Tensor> around, int64_t head_kind,
                                 std::vector<torch::Tensor> head, int64_t head_out, int64_t vocab, torch::Tensor stops,
                                 std::vector<torch::Tensor> screen, double screen_c, int64_t screen_variant) {
  const auto b = bound_at(handle, "decode_steps_bound");
  const int64_t M = ids.numel();
  TORCH_CHECK(steps >= 1 && M >= 1 && pos.numel() == M && ids.scalar_type() == at::kLong &&
              pos.scalar_type() == at::kLong, "decode_steps_bound: steps >= 1, ids and pos (M) int64");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == M && table.scalar_type() == at::kLong && table.is_contiguous(),
              "decode_steps_bound: table (M, blocks) int64 contiguous");
  TORCH_CHECK(around.size() == 4 && head.size() == 5 && head_out >= vocab && vocab > 0,
              "decode_steps_bound: 4 tensors around the blocks, 5 of the head, head_out >= vocab > 0");
  TORCH_CHECK(stops.dim() == 2 && stops.size(0) == M && stops.scalar_type() == at::kLong,
              "decode_steps_bound: stops (M, S) int64");
  TORCH_CHECK(screen.empty() || (screen.size() == 3 && screen[1].scalar_type() == at::kFloat),
              "decode_steps_bound: no screen, or its bf16 panels, fp32 weight and row norms");
  const auto stop = stops.contiguous();
  const int64_t S = stop.size(1), W = table.size(1);
  const int64_t* sp = stop.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const bool rope = cos_table.numel() > 0;
  auto x_ids = ids.contiguous().clone(), p = pos.contiguous().clone();
  auto slots = torch::empty({M}, p.options()), lens = torch::empty({M}, p.options());
  auto out = torch::empty({steps, M}, p.options());
  const auto empty = torch::empty({0});
  // the step's small ops on raw pointers where they apply (each ATen call ~2-5 us on a batch-1 SmolLM2 token's path,
  // its code and data evicted by the weights' stream): the embedding's rows copied (no learned positions: nn.Embedding's
  // lookup is a copy of the rows), one row's rotary angles a view of the table's row (index_select copies it)
  const auto& wte = around[0];
  const bool rows = around[1].numel() == 0 && wte.dim() == 2 && wte.is_contiguous();
  const int64_t V = wte.size(0), C = wte.size(1), row_bytes = C * wte.element_size();
  const auto x = rows ? torch::empty({M, C}, wte.options()) : empty;
  int64_t* ids_p = x_ids.data_ptr<int64_t>();
  int64_t* pp = p.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t j = 0; j < steps; ++j) {
    int64_t* s = slots.data_ptr<int64_t>();
    int64_t* l = lens.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(pp[m] >= 0 && pp[m] / block_size < W && (!rope || pp[m] < cos_table.size(0)),
                  "decode_steps_bound: position ", pp[m], " past the block table or the rotary table");
      s[m] = tp[m * W + pp[m] / block_size] * block_size + pp[m] % block_size;
      l[m] = pp[m] + 1;
    }
    torch::Tensor e = x;  // (M, C): nn.Embedding's lookup (+ the learned positions')
    if (rows)
      for (int64_t m = 0; m < M; ++m) {
        TORCH_CHECK(ids_p[m] >= 0 && ids_p[m] < V, "decode_steps_bound: token id ", ids_p[m], " outside [0, ", V, ")");
        std::memcpy(static_cast<char*>(x.data_ptr()) + m * row_bytes,
                    static_cast<const char*>(wte.data_ptr()) + ids_p[m] * row_bytes, row_bytes);
      }
    else e = at::embedding(wte, x_ids) + at::embedding(around[1], p);
    torch::Tensor cos = empty, sin = empty;
    if (rope && M == 1) cos = cos_table.narrow(0, pp[0], 1), sin = sin_table.narrow(0, pp[0], 1);
    else if (rope) cos = cos_table.index_select(0, p), sin = sin_table.index_select(0, p);
    auto h = decode_blocks_of(b.get(), e, b->w, kinds, b->k_caches, b->v_caches, slots, table, lens, block_size, n_head,
                              ffn, eps, act, rms, qk_eps, cos, sin);
    h = norm(h, around[2], around[3], rms, eps);
    torch::Tensor tok;  // (M)
    if (!screen.empty()) tok = screen_tokens(h, screen, screen_c, screen_variant, head_out, vocab);
    if (!tok.defined()) {
      auto logits = head_logits(head_kind, h, head.data(), head_out);
      if (vocab < head_out) logits = logits.narrow(1, 0, vocab);
      tok = argmax_rows(logits);
    }
    const int64_t* t = tok.data_ptr<int64_t>();
    std::copy(t, t + M, op + j * M);
    bool stopped = false;
    for (int64_t m = 0; m < M && !stopped; ++m)
      for (int64_t k = 0; k < S; ++k) stopped = stopped || (sp[m * S + k] >= 0 && sp[m * S + k] == t[m]);
    if (stopped) return out.narrow(0, 0, j + 1);
    for (int64_t m = 0; m < M; ++m) ids_p[m] = t[m], ++pp[m];
  }
  return out;
}
