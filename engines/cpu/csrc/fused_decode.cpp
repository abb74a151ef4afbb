// The fused CPU decode step's loop (engines/cpu/fused_decode.py): a decode-only step's transformer blocks in
// one call. engines/cpu/fused_decode.py compiles it after the panel kernel's and the paged kernel's sources,
// each in a namespace of its own (panel_src::, paged_src::); the includes below go to the top.
#include <torch/types.h>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace {
c10::optional<torch::Tensor> given(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// cache[slots[m], g0:g0 + H] = src[m] for each of the step's M rows (what index_copy_ does): src (M, H * hd) or (M, H,
// hd), H heads (all nkv unless g0 and src say fewer), rows any stride apart, a row's elements adjacent; one memcpy a
// row where the cache is a contiguous (slots, nkv, hd) table of src's dtype, index_copy_ otherwise
void write_rows(const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& src, int64_t nkv,
                int64_t hd, int64_t g0 = 0) {
  const int64_t M = src.size(0), H = src.dim() == 2 ? src.size(1) / hd : src.size(1), n = H * hd, row = nkv * hd;
  const bool packed = src.dim() == 2 ? src.stride(1) == 1 : src.dim() == 3 && src.stride(2) == 1 && src.stride(1) == hd;
  TORCH_CHECK(g0 >= 0 && g0 + H <= nkv, "decode_blocks: kv heads [", g0, ", ", g0 + H, ") past the cache's ", nkv);
  if (!cache.is_contiguous() || cache.scalar_type() != src.scalar_type() || !packed ||
      slots.scalar_type() != at::kLong || !slots.is_contiguous() || cache.numel() != cache.size(0) * row) {
    cache.narrow(1, g0, H).index_copy_(0, slots, src.reshape({M, H, hd}));
    return;
  }
  const int64_t S = cache.size(0), ld = src.stride(0), es = src.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(cache.data_ptr()) + g0 * hd * es;
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sp[m] >= 0 && sp[m] < S, "decode_blocks: cache slot ", sp[m], " out of range [0, ", S, ")");
    std::memcpy(dst + sp[m] * row * es, from + m * ld * es, n * es);
  }
}

// rotary embedding in place, rotate-half form, as engines/model/transformer.py apply_rope: x (M, H, hd), its last dim
// adjacent; cos / sin (M, hd / 2) fp32. In fp32 each product rounded on its own, then the difference / sum
// (torch's x1 * cos - x2 * sin as three ops), then rounded to T: no fused multiply-add here, or the
// result would differ from the module path's in the last bit
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(T* x, int64_t M, int64_t H, int64_t hd, int64_t s0,
                                                             int64_t s1, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cos + m * half;
    const float* s = sin + m * half;
    for (int64_t h = 0; h < H; ++h) {
      T* p = x + m * s0 + h * s1;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(p[i]), b = static_cast<float>(p[i + half]);
        const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
        p[i] = static_cast<T>(ac - bs);
        p[i + half] = static_cast<T>(bc + as);
      }
    }
  }
}

void rope_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t M = x.size(0), H = x.size(1), hd = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && hd % 2 == 0, "decode_blocks: rope on (M, heads, even hd) rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              sin.scalar_type() == at::kFloat && cos.numel() == M * hd / 2 && sin.numel() == M * hd / 2,
              "decode_blocks: cos / sin (M, hd / 2) contiguous float32");
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) rope_rows(x.data_ptr<float>(), M, H, hd, x.stride(0), x.stride(1), c, s);
  else if (x.scalar_type() == at::kBFloat16)
    rope_rows(x.data_ptr<c10::BFloat16>(), M, H, hd, x.stride(0), x.stride(1), c, s);
  else if (x.scalar_type() == at::kHalf) rope_rows(x.data_ptr<c10::Half>(), M, H, hd, x.stride(0), x.stride(1), c, s);
  else TORCH_CHECK(false, "decode_blocks: rope on float32, bfloat16 or float16, got ", x.scalar_type());
}

// engines/model/transformer.py RMSNorm's steps in one pass a row: x (M, C) rows ldx apart, normalised in fp32
// (the mean of the squares, 1 / sqrt(mean + eps)), the product rounded to T, then times the weight (torch's T * T:
// the fp32 product rounded once). A row's arithmetic does not depend on the others (any split gives the same bits),
// nor on the call: the squares summed in 16 lanes (input c into lane c % 16), the lanes added in a fixed tree. (An
// `omp simd` reduction left the order to the compiler, which vectorized two calls differently: the rows
// fused_team.cpp own_rows computes differed from norm_range's in fp32's last bits)
template <typename T>
void rms_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t M, int64_t C, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* r = x + m * ldx;
    T* o = out + m * C;
    float lane[16] = {};
    int64_t c = 0;
    for (; c + 16 <= C; c += 16)
      for (int j = 0; j < 16; ++j) lane[j] += static_cast<float>(r[c + j]) * static_cast<float>(r[c + j]);
    for (; c < C; ++c) lane[c % 16] += static_cast<float>(r[c]) * static_cast<float>(r[c]);
    for (int s = 8; s >= 1; s /= 2)
      for (int j = 0; j < s; ++j) lane[j] += lane[j + s];
    const float ss = lane[0];
    const float rstd = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
    for (int64_t c = 0; c < C; ++c)
      o[c] = static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(static_cast<T>(static_cast<float>(r[c]) * rstd)));
  }
}

// RMSNorm of x (..., C), its last dim adjacent, into a new contiguous tensor: rms_rows over torch's threads
// (inline inside the fused team's region); a weight of another dtype or shape: the torch ops
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t C = x.size(-1);
  const auto st = x.scalar_type();
  if (weight.scalar_type() != st || !weight.is_contiguous() || weight.numel() != C || x.stride(-1) != 1 ||
      (st != at::kFloat && st != at::kBFloat16 && st != at::kHalf))
    return weight * at::rms_norm(x.to(at::kFloat), {C}, c10::nullopt, eps).to(st);
  const auto x2 = x.dim() == 2 ? x : x.reshape({-1, C});
  auto out = torch::empty(x2.sizes(), x2.options());
  const int64_t M = x2.size(0), ld = x2.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "rms_norm", [&] {
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      rms_rows(x2.data_ptr<scalar_t>() + b * ld, ld, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>() + b * C, e - b,
               C, eps);
    });
  });
  return out.view(x.sizes());
}

// one of the block's norms: RMSNorm (bias empty) or LayerNorm
torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, bool rms,
                   double eps) {
  if (rms) return rms_norm(x, weight, eps);
  return at::layer_norm(x, {x.size(-1)}, weight, given(bias), eps);
}

// one block Linear through the kernel its FastLinear chose for this step's row count, as FastLinear.run
// calls it (engines/cpu/fast_linear.py): t = (weight, bias or empty, panels, packed, weight_t; empty where not
// built); kind 0 panel, 1 packed (oneDNN on the prepacked weight), 2 linear, 3 pretransposed, 4 gemv (one
// row: mv / addmv on the weight), 5 + v the FP8 weight-only kernel's variant v (engines/cpu/fast_linear.py
// Fp8PanelLinear: t = (scales, bias or empty, e4m3 panels, empty, empty)), PANEL_AVX2 the panel kernel's avx2
// variant on the same panels (fast_linear.PANEL_KINDS: offered where auto is another). With a residual: residual + the
// Linear's output (the panel and FP8 kernels add it in their store loops; the others by torch's add, as the
// module path's `x + ...`)
constexpr int64_t PANEL_AVX2 = 12;  // block_linear's code of the panel kernel's avx2 variant (after FP8's 5 .. 11)

// the panel kernel's variant of block_linear's code `kind` (0 or PANEL_AVX2), auto_variant being what auto resolves to
inline int64_t panel_kind_variant(int64_t kind, int64_t auto_variant) {
  return kind == PANEL_AVX2 ? panel_src::row_variant(2) : auto_variant;
}

torch::Tensor block_linear(int64_t kind, const torch::Tensor& x, const torch::Tensor* t, int64_t N,
                           const c10::optional<torch::Tensor>& residual) {
  const auto bias = given(t[1]);
  if (kind == 0 || kind == PANEL_AVX2) return panel_src::panel_linear_res(x, t[2], N, bias, residual, kind ? 2 : 0);
  if (kind >= 5 && kind < PANEL_AVX2) return fp8_src::fp8_linear_res(x, t[2], t[0], N, bias, residual, kind - 5);
  torch::Tensor y;
  if (kind == 1) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, t[3], bias.has_value() ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                            c10::List<c10::optional<at::Scalar>>(), c10::IValue(std::string(""))};
    op.callBoxed(&stack);
    y = stack[0].toTensor();
  } else if (kind == 2) {
    y = at::linear(x, t[0], bias);
  } else if (kind == 3) {
    y = bias.has_value() ? at::addmm(*bias, x, t[4]) : at::mm(x, t[4]);
  } else if (kind == 4) {
    TORCH_CHECK(x.size(0) == 1, "decode_blocks: gemv takes one row, got ", x.size(0));
    y = (bias.has_value() ? at::addmv(*bias, t[0], x[0]) : at::mv(t[0], x[0])).unsqueeze(0);
  } else {
    TORCH_CHECK(false, "decode_blocks: unknown Linear kernel ", kind);
  }
  return residual.has_value() ? *residual + y : y;
}

struct TeamPlan;  // the fused team's description of a bound model's Linears (csrc/fused_team.cpp)

// the tensors of one model's blocks, bound once (bind): a step passes a handle, not ~250 tensors. Their storage does
// not change once bound (the engine sets the weights before it binds them), so the team's plan of them (the Linears'
// pointers and shapes) holds from step to step
struct Bound {
  std::vector<torch::Tensor> w, k_caches, v_caches;
  std::mutex plan_mu;
  std::shared_ptr<TeamPlan> plan;  // the last step's (rebuilt where a step's kernels or dtype differ)
};
std::mutex bound_mu;
std::vector<std::shared_ptr<Bound>> bound;

// norm1 weight, bias, norm2 weight, bias, q-norm weight, k-norm weight (empty where the model has none),
// then 5 tensors a Linear
constexpr int64_t PER_LAYER = 6 + 4 * 5;

// The step's constants, as passed to decode_blocks (see there)
struct StepArgs {
  const torch::Tensor &slots, &table, &lens, &cos, &sin;
  int64_t block_size, n_head, ffn;
  double eps;
  int64_t act;
  bool rms;
  double qk_eps;
};

// the step as one parallel region (csrc/fused_team.cpp, compiled after this file) and where it applies
bool team_applies(const torch::Tensor& x, const std::vector<int64_t>& kinds, const StepArgs& a);
torch::Tensor decode_team(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                          const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                          const StepArgs& a, Bound* b);

// Half 0 of layer l (norm1, the QKV Linear, q / k norms, rotary, KV writes, paged attention, the output
// projection) or half 1 (norm2, the up Linear, the activation, the down projection) on x (M, C): with a
// residual, residual + the closing Linear's output (the next x); without, the closing Linear's output alone
// (a tensor-parallel shard's partial product, see decode_half_bound)
torch::Tensor run_half(const torch::Tensor& x, const torch::Tensor* p, const int64_t* kind, int64_t half,
                       const torch::Tensor& k_cache, const torch::Tensor& v_cache, const StepArgs& a,
                       const c10::optional<torch::Tensor>& residual) {
  const int64_t M = x.size(0), C = x.size(1);
  const int64_t nkv = k_cache.size(1), hd = k_cache.size(2);
  const int64_t qn = a.n_head * hd, kn = nkv * hd;
  if (half == 1) {
    const torch::Tensor *up_w = p + 16, *down_w = p + 21;
    auto h = norm(x, p[2], p[3], a.rms, a.eps);
    auto u = block_linear(kind[2], h, up_w, a.act == 2 ? 2 * a.ffn : a.ffn, c10::nullopt);
    u = a.act == 2 ? swiglu(u, a.ffn) : a.act == 1 ? gelu_tanh_(u) : at::gelu(u, "none");  // (csrc/mlp_rows.cpp)
    return block_linear(kind[3], u, down_w, C, residual);  // x + down(u)
  }
  const torch::Tensor *qkv_w = p + 6, *proj_w = p + 11;
  auto h = norm(x, p[0], p[1], a.rms, a.eps);
  auto qkv = block_linear(kind[0], h, qkv_w, qn + 2 * kn, c10::nullopt);  // (M, qn + 2 kn)
  auto q = qkv.narrow(1, 0, qn).view({M, a.n_head, hd});                  // (M, nh, hd)
  auto k = qkv.narrow(1, qn, kn).view({M, nkv, hd});                      // (M, nkv, hd)
  if (p[4].numel()) q = rms_norm(q, p[4], a.qk_eps);  // per head, before the rotation (Qwen3)
  if (p[5].numel()) k = rms_norm(k, p[5], a.qk_eps);
  if (a.cos.numel() > 0) {
    rope_(q, a.cos, a.sin);  // in place: qkv (or the normed copy) is this step's own
    rope_(k, a.cos, a.sin);
  }
  write_rows(k_cache, a.slots, k.view({M, kn}), nkv, hd);
  write_rows(v_cache, a.slots, qkv.narrow(1, qn + kn, kn), nkv, hd);
  auto y = paged_src::paged_decode(q, k_cache, v_cache, a.table, a.lens, a.block_size);  // (M, nh, hd)
  return block_linear(kind[1], y.view({M, qn}), proj_w, C, residual);  // x + proj(y)
}
}  // namespace

// The module path's cache write and rotary embedding on CPU (engines/cpu/module_ops.py), with the fused step's
// arithmetic (so the same bits as index_copy_ and transformer.py apply_rope), split by rows over torch's threads.
// cache (slots, nkv, hd) contiguous; src (M, nkv, hd) in the cache's dtype, hd adjacent; slots (M) int64
void write_slots(torch::Tensor cache, torch::Tensor slots, torch::Tensor src) {
  TORCH_CHECK(cache.dim() == 3 && src.dim() == 3 && slots.dim() == 1 && slots.size(0) == src.size(0) &&
              src.size(1) == cache.size(1) && src.size(2) == cache.size(2), "write_slots: cache (slots, nkv, hd), "
              "src (M, nkv, hd), slots (M)");
  const int64_t M = src.size(0), nkv = src.size(1), hd = src.size(2);
  if (src.stride(2) != 1 || src.stride(1) != hd || !cache.is_contiguous() || !slots.is_contiguous() ||
      slots.scalar_type() != at::kLong || cache.scalar_type() != src.scalar_type()) {
    cache.index_copy_(0, slots, src);
    return;
  }
  const auto flat = src.view({M, nkv * hd});
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    write_rows(cache, slots.narrow(0, b, e - b), flat.narrow(0, b, e - b), nkv, hd);
  });
}

// engines/model/transformer.py RMSNorm on CPU at inference: rms_norm above
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) { return rms_norm(x, weight, eps); }

// engines/model/transformer.py MLP's silu(gate) * up on CPU at inference: swiglu (csrc/mlp_rows.cpp), u (M, 2 ffn)
torch::Tensor swiglu_rows_(torch::Tensor u, int64_t ffn) { return swiglu(u, ffn); }

// x (M, H, hd) rotated in place, cos / sin (M, hd / 2) float32 contiguous (rope_ above, over torch's threads)
void rope_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3, "rope_inplace: x (M, heads, hd)");
  const int64_t M = x.size(0), half = x.size(2) / 2;
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    rope_(x.narrow(0, b, e - b), cos.view({M, half}).narrow(0, b, e - b), sin.view({M, half}).narrow(0, b, e - b));
  });
}

// The family's choices (engines/cpu/fused_decode.py Family): act 0 GELU, 1 GELU (tanh), 2 SwiGLU (the up
// Linear's rows [0, ffn) the gate, [ffn, 2 ffn) the up projection, silu(gate) * up); rms: RMSNorm for the
// block norms instead of LayerNorm; qk_eps: the per-head q / k RMSNorms' epsilon (where bound).
//
// x (M, C): the step's M decode tokens after the embeddings (or the previous pipeline stage's output);
// w: PER_LAYER tensors a layer (see above; for qkv, proj, up and down: weight, bias, panels, packed,
// weight_t, an empty tensor for one not built); kinds: 4 a layer, the kernel of each Linear (block_linear);
// k_caches / v_caches (slots, nkv, hd) a layer; slots (M) int64 cache slots of this step's keys; table
// (M, max_blocks), lens (M) as paged_decode; cos / sin (M, hd / 2) float32 of the tokens' positions (empty:
// no rotary embedding); n_head and ffn are this shard's (its query heads, its MLP width) -> (M, C) after the
// blocks
// (b: the Bound holding w and the caches, whose team plan the step reuses, or none)
torch::Tensor decode_blocks_of(Bound* b, torch::Tensor x, const std::vector<torch::Tensor>& w,
                               const std::vector<int64_t>& kinds, const std::vector<torch::Tensor>& k_caches,
                               const std::vector<torch::Tensor>& v_caches, torch::Tensor slots, torch::Tensor table,
                               torch::Tensor lens, int64_t block_size, int64_t n_head, int64_t ffn, double eps, int64_t act,
                               bool rms, double qk_eps, torch::Tensor cos, torch::Tensor sin) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && static_cast<int64_t>(w.size()) == PER_LAYER * L &&
              static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L,
              "decode_blocks: x (M, C), ", PER_LAYER, " tensors, 4 kernels and 2 caches a layer");
  TORCH_CHECK(act >= 0 && act <= 2, "decode_blocks: act 0 (gelu), 1 (gelu tanh) or 2 (swiglu), got ", act);
  const StepArgs a{slots, table, lens, cos, sin, block_size, n_head, ffn, eps, act, rms, qk_eps};
  x = x.contiguous();
  if (team_applies(x, kinds, a)) return decode_team(x, w, kinds, k_caches, v_caches, a, b);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = w.data() + PER_LAYER * l;
    const int64_t* kind = kinds.data() + 4 * l;
    x = run_half(x, p, kind, 0, k_caches[l], v_caches[l], a, x);
    x = run_half(x, p, kind, 1, k_caches[l], v_caches[l], a, x);
  }
  return x;
}

torch::Tensor decode_blocks(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                            const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                            torch::Tensor slots, torch::Tensor table, torch::Tensor lens, int64_t block_size,
                            int64_t n_head, int64_t ffn, double eps, int64_t act, bool rms, double qk_eps,
                            torch::Tensor cos, torch::Tensor sin) {
  return decode_blocks_of(nullptr, x, w, kinds, k_caches, v_caches, slots, table, lens, block_size, n_head, ffn, eps,
                          act, rms, qk_eps, cos, sin);
}

int64_t bind(std::vector<torch::Tensor> w, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
  TORCH_CHECK(!k_caches.empty() && static_cast<int64_t>(w.size()) == PER_LAYER * static_cast<int64_t>(k_caches.size()) &&
              v_caches.size() == k_caches.size(), "bind: ", PER_LAYER, " tensors and 2 caches a layer");
  std::lock_guard<std::mutex> g(bound_mu);
  auto b = std::make_shared<Bound>();
  b->w = std::move(w), b->k_caches = std::move(k_caches), b->v_caches = std::move(v_caches);
  bound.push_back(std::move(b));
  return static_cast<int64_t>(bound.size()) - 1;
}

void unbind(int64_t handle) {
  std::lock_guard<std::mutex> g(bound_mu);
  if (handle >= 0 && handle < static_cast<int64_t>(bound.size())) bound[handle].reset();
}

// the tensors bound under `handle` (an error naming the caller where none are)
std::shared_ptr<Bound> bound_at(int64_t handle, const char* who) {
  std::lock_guard<std::mutex> g(bound_mu);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound.size()) && bound[handle], who,
              ": no tensors bound as ", handle);
  return bound[handle];
}

// decode_blocks on the tensors bound under `handle`
torch::Tensor decode_bound(int64_t handle, torch::Tensor x, std::vector<int64_t> kinds, torch::Tensor slots,
                           torch::Tensor table, torch::Tensor lens, int64_t block_size, int64_t n_head, int64_t ffn,
                           double eps, int64_t act, bool rms, double qk_eps, torch::Tensor cos, torch::Tensor sin) {
  const auto b = bound_at(handle, "decode_bound");
  return decode_blocks_of(b.get(), x, b->w, kinds, b->k_caches, b->v_caches, slots, table, lens, block_size, n_head,
                          ffn, eps, act, rms, qk_eps, cos, sin);
}

// One half of layer `layer` of the blocks bound under `handle` for a tensor-parallel shard (half 0: norm1 ..
// the attention's output projection; 1: norm2 .. the MLP's down projection), kinds its 4 kernels: returns
// that closing Linear's partial product (M, C), without bias or residual (bound without bias). The caller
// all-reduces it over the TP group and adds the bias and the residual, as engines/parallel/tp.py
// RowParallelLinear and the block's `x + ...` do, then calls the next half
torch::Tensor decode_half_bound(int64_t handle, torch::Tensor x, int64_t layer, int64_t half,
                                std::vector<int64_t> kinds, torch::Tensor slots, torch::Tensor table,
                                torch::Tensor lens, int64_t block_size, int64_t n_head, int64_t ffn, double eps,
                                int64_t act, bool rms, double qk_eps, torch::Tensor cos, torch::Tensor sin) {
  const auto b = bound_at(handle, "decode_half_bound");
  const int64_t L = static_cast<int64_t>(b->k_caches.size());
  TORCH_CHECK(x.dim() == 2 && layer >= 0 && layer < L && (half == 0 || half == 1) && kinds.size() == 4,
              "decode_half_bound: x (M, C), layer in [0, ", L, "), half 0 or 1, 4 kernels");
  TORCH_CHECK(act >= 0 && act <= 2, "decode_half_bound: act 0 (gelu), 1 (gelu tanh) or 2 (swiglu), got ", act);
  const StepArgs a{slots, table, lens, cos, sin, block_size, n_head, ffn, eps, act, rms, qk_eps};
  return run_half(x.contiguous(), b->w.data() + PER_LAYER * layer, kinds.data(), half, b->k_caches[layer],
                  b->v_caches[layer], a, c10::nullopt);
}

// (the paged kernel's 16-lane types)
namespace {
using paged_src::vf;
using paged_src::W;
using paged_src::load16;
// the first index of the row's maximum, a NaN counting as larger than any number (torch.argmax):
// 16 lanes, each keeping its first maximum (strict >), then the lowest index among the lanes' ties
int64_t argmax_row(const float* r, int64_t V) {
  typedef int32_t vi32 __attribute__((vector_size(64)));
  int64_t k = 0, best = 0;
  float bv = r[0];
  bool nan = false;
  if (V >= 2 * W) {
    vf m = load16(r), any_nan = vf{};
    vi32 cur, bi;
    for (int j = 0; j < W; ++j) cur[j] = j;
    bi = cur;
    any_nan = (vf)((vi32)any_nan | (vi32)(m != m));
    for (k = W; k + W <= V; k += W) {
      const vf v = load16(r + k);
      cur += static_cast<int32_t>(W);
      const vi32 gt = v > m;
      m = gt ? v : m;
      bi = gt ? cur : bi;
      any_nan = (vf)((vi32)any_nan | (vi32)(v != v));
    }
    for (int j = 0; j < W; ++j) nan = nan || ((vi32)any_nan)[j] != 0;
    bv = m[0], best = bi[0];
    for (int j = 1; j < W; ++j)
      if (m[j] > bv || (m[j] == bv && bi[j] < best)) bv = m[j], best = bi[j];
  } else {
    k = 1;
    nan = r[0] != r[0];
  }
  for (; k < V; ++k) {
    nan = nan || r[k] != r[k];
    if (r[k] > bv) bv = r[k], best = k;
  }
  if (nan)
    for (int64_t i = 0; i < V; ++i)
      if (r[i] != r[i]) return i;
  return best;
}
}  // namespace

#if defined(__x86_64__)
namespace {
// argmax_row on AVX2 in two passes: the maximum (4 registers of 8 lanes, NaNs noted on the side), then the first
// index equal to it (a compare and a mask a register; the row is still in L2). GCC lowers argmax_row's 16-lane
// selects poorly for AVX2: 267 us a 49,152-entry row on the 2-core AVX2 EPYC against torch's 54 us; this 11 us
__attribute__((target("avx2"))) int64_t argmax_row_avx2(const float* r, int64_t V) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, un = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= V; k += 32) {
    const __m256 a = _mm256_loadu_ps(r + k), b = _mm256_loadu_ps(r + k + 8), c = _mm256_loadu_ps(r + k + 16),
                 d = _mm256_loadu_ps(r + k + 24);
    un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b), m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float mx = -INFINITY;
  for (float v : lanes) mx = v > mx ? v : mx;
  bool nan = _mm256_movemask_ps(un) != 0;
  for (; k < V; ++k) {
    nan = nan || r[k] != r[k];
    mx = r[k] > mx ? r[k] : mx;
  }
  if (nan)
    for (int64_t i = 0; i < V; ++i)
      if (r[i] != r[i]) return i;
  const __m256 t = _mm256_set1_ps(mx);
  for (k = 0; k + 8 <= V; k += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + k), t, _CMP_EQ_OQ))) return k + __builtin_ctz(hit);
  for (; k < V; ++k)
    if (r[k] == mx) return k;
  return 0;  // not reached: mx is one of the row's entries
}
}  // namespace
#endif

// logits (S, V) float32 -> (S) int64: torch.argmax(logits, dim=-1), vectorized (torch's CPU argmax scans one
// element at a time: ~44 us for a 50,257-entry row on a Zen 4, ~2.7 ms for 64 rows). variant: 0 the best this CPU
// runs, 1 the 16-lane portable code, 2 AVX2 (two passes; an error where the CPU lacks AVX2)
torch::Tensor argmax_rows_variant(torch::Tensor logits, int64_t variant) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.size(1) > 0,
              "argmax_rows: (S, V) float32 with V > 0");
  TORCH_CHECK(variant >= 0 && variant <= 2, "argmax_rows: variant 0 (auto), 1 (portable) or 2 (AVX2), got ", variant);
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2");
#else
  const bool avx2 = false;
#endif
  TORCH_CHECK(variant != 2 || avx2, "argmax_rows: variant 2 needs AVX2, which this CPU lacks");
  const bool use_avx2 = variant == 2 || (variant == 0 && avx2);
  auto x = logits.contiguous();
  const int64_t S = x.size(0), V = x.size(1);
  auto out = torch::empty({S}, x.options().dtype(torch::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
#if defined(__x86_64__)
      if (use_avx2) {
        o[s] = argmax_row_avx2(p + s * V, V);
        continue;
      }
#endif
      o[s] = argmax_row(p + s * V, V);
    }
  });
  (void)use_avx2;
  return out;
}

torch::Tensor argmax_rows(torch::Tensor logits) { return argmax_rows_variant(logits, 0); }
