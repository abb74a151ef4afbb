// The fused decode step as ONE parallel region a step (engines/cpu/fused_decode.py; compiled after
// csrc/fused_decode.cpp, whose helpers it calls): a team of torch's intra-op thread count enters once and
// walks the layers together, phase by phase, with a spin barrier between phases. Thread 0 runs the small ops
// (the norms, q / k norms, rotary, KV writes, the attention of one sequence, the activation: the per-op loop's
// ATen calls, or loops that round as they do, so the same bits) and lays out the next Linear's input rows,
// while the others pull the back of that Linear's panels into their caches; then every thread claims groups
// of its panels (the panel and FP8 kernels' run_range / fp8_range: a panel's sums do not depend on the split,
// so the bits are the per-op loop's). The per-op loop entered ~150 OpenMP regions a token on SmolLM2 (4
// Linears and the attention a layer, 30 layers), each a fork and a join of the thread pool, with the weights'
// stream stopped in between.
#include <torch/types.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

namespace {

// A sense-reversing spin barrier for one step's team: the last of n arrivals resets the count and flips the
// shared sense; the others spin on it (a pause a probe), yielding the core after a while so a preempted
// teammate on a shared host gets it back
class SpinBarrier {
 public:
  void wait(int n, bool& local) {
    if (n == 1) return;
    local = !local;
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count_.store(0, std::memory_order_relaxed);
      sense_.store(local, std::memory_order_release);
      return;
    }
    for (int spins = 0; sense_.load(std::memory_order_acquire) != local; ++spins) {
      if (spins < 20000) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<bool> sense_{false};
};

// One block Linear prepared by thread 0 for the team: its input rows laid out as its kernel reads them, its
// panels, bias, scales, residual and output (raw pointers into tensors the step keeps alive). Its panels are
// handed out in claims of `group` from both ends: thread 0 takes them from the front, the others from the back,
// where they warmed their caches while thread 0 ran the phase before (warm); a group's sums do not depend on
// which thread computes them, so the bits do not either
struct TeamLinear {
  int64_t group = 4;    // panels a claim: the one-row kernels' G (see prepare)
  int64_t kind = 0;     // block_linear's code: 0 panel, 5 + v FP8
  int64_t variant = 0;  // the kernel's variant, resolved
  bool bf16 = false;
  int64_t M = 0, N = 0, Kp = 0, P = 0;  // Kp: the panel's inputs (fp32 panel: K; bf16 panel and FP8: K2)
  const void* x = nullptr;
  const void* w = nullptr;
  const float *bias = nullptr, *scales = nullptr;
  const void* res = nullptr;
  void* out = nullptr;
  std::atomic<int64_t> left{0}, front{0}, back{0};  // groups not yet claimed; the next from each end

  // claims of up to g panels (the one-row kernel's most a pass), as many claims as a multiple of the team's size
  void claim_up_to(int64_t g) {
    const int64_t nt = omp_get_num_threads(), claims = nt * ((P + nt * g - 1) / (nt * g));
    group = (P + claims - 1) / claims;
    reset();
  }

  // claims of about g panels in whole passes of `pass` panels (a one-row kernel's G), as claim_up_to, the group
  // rounded up to whole passes: every pass starts at a multiple of `pass`, as in the kernel run alone
  void claim_passes(int64_t g, int64_t pass) {
    claim_up_to(g);
    group = (group + pass - 1) / pass * pass;
    reset();
  }

  void reset() {
    const int64_t groups = (P + group - 1) / group;
    left.store(groups), front.store(0), back.store(groups);
  }

  // claim groups until none is left: a claim first takes one of `left`, so the two ends never meet twice
  void run(int tid) {
    while (left.fetch_sub(1, std::memory_order_relaxed) > 0) {
      const int64_t g = tid == 0 ? front.fetch_add(1, std::memory_order_relaxed)
                                 : back.fetch_sub(1, std::memory_order_relaxed) - 1;
      range(g * group, std::min(P, (g + 1) * group), back_passes && tid != 0);
    }
  }

  bool back_passes = false;  // whether the threads claiming from the back run their claims' passes backwards (prepare)

  // panels [p0, p1); backward: a one-row FP8 claim's passes from the last (fp8_range)
  void range(int64_t p0, int64_t p1, bool backward = false) const {
    using BF = c10::BFloat16;
    if (kind == 0 && bf16 && panel_src::wide_rows(variant, M))  // rows widened to fp32 pairs (widen_rows)
      panel_src::run_range(static_cast<const float*>(x), M, Kp, static_cast<const BF*>(w), N, bias,
                           static_cast<const BF*>(res), static_cast<BF*>(out), variant, p0, p1);
    else if (kind == 0 && bf16)
      panel_src::run_range(static_cast<const uint32_t*>(x), M, Kp, static_cast<const BF*>(w), N, bias,
                           static_cast<const BF*>(res), static_cast<BF*>(out), variant, p0, p1);
    else if (kind == 0)
      panel_src::run_range(static_cast<const float*>(x), M, Kp, static_cast<const float*>(w), N, bias,
                           static_cast<const float*>(res), static_cast<float*>(out), variant, p0, p1);
    else if (bf16)
      fp8_src::fp8_range<BF>(variant, static_cast<const float*>(x), M, 2 * Kp, Kp, static_cast<const uint8_t*>(w), N,
                             scales, bias, static_cast<const BF*>(res), static_cast<BF*>(out), p0, p1, backward);
    else
      fp8_src::fp8_range<float>(variant, static_cast<const float*>(x), M, 2 * Kp, Kp, static_cast<const uint8_t*>(w),
                                N, scales, bias, static_cast<const float*>(res), static_cast<float*>(out), p0, p1, backward);
  }
};

// bytes of a Linear's panels (from its end) the threads other than 0 pull into their caches while thread 0 runs
// the small ops before it: at batch 1 the weights are read from memory once a token, and those threads would
// otherwise only wait
constexpr int64_t WARM_BYTES = 256 << 10;

// thread w of the nw others than 0: request its slice of the last WARM_BYTES of `panels` (the back end's first
// claims), from the top down, until thread 0 ends the phase (done moves past k)
void warm(const torch::Tensor& panels, int w, int nw, const std::atomic<int64_t>& done, int64_t k) {
#if defined(__x86_64__)
  const char* base = static_cast<const char*>(panels.data_ptr());
  const int64_t bytes = static_cast<int64_t>(panels.nbytes()), region = std::min(bytes, WARM_BYTES);
  const int64_t slice = (region / nw + 63) / 64 * 64, hi = bytes - w * slice, lo = std::max(bytes - region, hi - slice);
  int64_t lines = 0;
  for (int64_t o = hi - 64; o >= lo; o -= 64) {
    if (++lines % 32 == 0 && done.load(std::memory_order_relaxed) != k) return;
    _mm_prefetch(base + o, _MM_HINT_T1);
  }
#endif
}

// Whether prepare may leave the layout of x's rows to the team (lay_out below): a panel Linear's several rows, laid
// out transposed (not AMX's row tiles, not an odd bf16 width's zero-padded pairs)
bool deferrable(int64_t kind, const torch::Tensor& x, int64_t panel_variant) {
  const int64_t M = x.size(0), K = x.size(1);
  if (kind != 0 || M < 2) return false;
  if (x.scalar_type() != at::kBFloat16) return true;
  return K % 2 == 0 && !panel_src::amx_rows(panel_variant, M, K / 2);
}

// rows [r0, r1) of x (M, K) laid out for the Linear j that prepare(..., lay = false) readied (see deferrable)
void lay_out(const TeamLinear& j, const torch::Tensor& x, int64_t r0, int64_t r1) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16 && panel_src::wide_rows(j.variant, M))
    panel_src::widen_rows(x.data_ptr<c10::BFloat16>(), M, K, static_cast<float*>(const_cast<void*>(j.x)), r0, r1);
  else if (x.scalar_type() == at::kBFloat16)
    panel_src::transpose_rows(reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>()), M, K / 2,
                   static_cast<uint32_t*>(const_cast<void*>(j.x)), r0, r1);
  else
    panel_src::transpose_rows(x.data_ptr<float>(), M, K, static_cast<float*>(const_cast<void*>(j.x)), r0, r1);
}

// Thread 0: x (M, K) contiguous through the Linear t (as block_linear: weight or scales, bias, panels, ...) of
// N outputs into out (M, N), plus res (M, N) where given (res may be out). The rows are laid out in buf as the
// per-op kernels lay them out (panel: transposed, bf16 in pairs; FP8: fp32 rows of 2 K2, scaled by X_UP for the
// vector variants); bias_keep holds a converted bias alive
void prepare(TeamLinear& j, int64_t kind, const torch::Tensor& x, const torch::Tensor* t, int64_t N,
             const torch::Tensor* res, const torch::Tensor& out, std::vector<float>& buf, torch::Tensor& bias_keep,
             int64_t panel_variant, bool lay = true) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == out.scalar_type(),
              "decode_blocks: a Linear's input rows (M, K) contiguous, of the step's dtype");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  j.kind = kind, j.group = 4, j.bf16 = bf16, j.M = M, j.N = N, j.out = out.data_ptr();
  j.res = res ? res->data_ptr() : nullptr;
  j.bias = nullptr, j.scales = nullptr;
  j.P = (N + 15) / 16;
  j.reset();
  if (t[1].numel()) {
    bias_keep = t[1].scalar_type() == at::kFloat ? t[1].contiguous() : t[1].to(at::kFloat).contiguous();
    TORCH_CHECK(bias_keep.numel() == N, "decode_blocks: a bias of N outputs");
    j.bias = bias_keep.data_ptr<float>();
  }
  const torch::Tensor& panels = t[2];
  if (kind == 0) {
    j.variant = panel_variant, j.Kp = bf16 ? K2 : K, j.P = panels.size(0);
    if (M == 1 && bf16) j.claim_up_to(panel_variant == 2 ? panel_src::ROW_G_AVX2_BF16 : panel_src::ROW_G_BF16);
    TORCH_CHECK(panels.scalar_type() == x.scalar_type() && panels.is_contiguous() && panels.size(0) == (N + 15) / 16 &&
                panels.size(1) == j.Kp, "decode_blocks: panels of the Linear's shape and the step's dtype");
    j.w = panels.data_ptr();
    if (M == 1 && (!bf16 || K % 2 == 0)) {  // one row: already laid out (a bf16 pair is 32 bits)
      j.x = x.data_ptr();
      return;
    }
    if (bf16 && panel_src::amx_rows(panel_variant, M, K2)) {  // (M rounded up to 16, K) rows, the rest zero
      buf.assign((M + 15) / 16 * 16 * K2, 0.f);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(reinterpret_cast<uint32_t*>(buf.data()) + m * K2, x.data_ptr<c10::BFloat16>() + m * K, 2 * K);
      j.x = buf.data();
      return;
    }
    if (static_cast<int64_t>(buf.size()) < M * 2 * K2) buf.resize(M * 2 * K2);
    j.x = buf.data();
    if (!lay && deferrable(kind, x, panel_variant)) return;  // the team lays the rows out (lay_out)
    if (bf16 && panel_src::wide_rows(panel_variant, M)) {  // (K2, M, 2) fp32, an odd K's missing input zero
      panel_src::widen_rows(x.data_ptr<c10::BFloat16>(), M, K, buf.data());
    } else if (bf16 && K % 2) {  // (K2, M) pairs: input 2 k2 in the low half, the last pair's high half zero
      std::fill(buf.begin(), buf.begin() + M * K2, 0.f);
      auto* xp = reinterpret_cast<uint32_t*>(buf.data());
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xp[(k / 2) * M + m] |= static_cast<uint32_t>(src[m * K + k]) << (16 * (k % 2));
    } else {  // bf16: the same pairs, the rows' 32-bit words (M, K2) transposed; fp32: (K, M)
      lay_out(j, x, 0, M);
    }
    return;
  }
  j.variant = fp8_src::fp8_variant(kind - 5, bf16), j.Kp = K2, j.P = panels.size(0);
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.size(0) == (N + 15) / 16 &&
              panels.size(1) == K2 && t[0].scalar_type() == at::kFloat && t[0].is_contiguous() && t[0].numel() == N,
              "decode_blocks: FP8 panels and float32 scales of the Linear's shape");
  j.w = panels.data_ptr(), j.scales = t[0].data_ptr<float>();
  if (M == 1 && j.variant == 5) j.claim_up_to(fp8_src::F8_GW);
  // the 4-panel passes of variants 2-4 request the next pass's panels near their end (row_avx2 / row_wide: the group
  // after, F8_G panels on); for a thread taking its claims from the back, the group after is one it has already read,
  // so those threads run each claim's passes from its last to its first and request the group before (BACK), which
  // is where their next claim ends: every claim but the first starts on panels already on their way. SmolLM2 FP8,
  // batch 1, 2 threads, 2-core AVX2 EPYC, both ways switched in one process (median of 10-16, three processes): claims
  // of one pass 14.92 / 15.21 ms a token -> two passes 14.37 / 14.81 (0ae9006) -> two passes run from the back 13.93 /
  // 14.15 / 13.46 -> 13.66 / 13.82 / 12.80 (claims of 1 or 4 passes so: 13.88, 14.03; thread 0 requesting its first
  // claim's first 1-2 KB a panel as it lays out the input: no gain). Bits unchanged: a panel's sums do not depend on the
  // order the panels run in
  else if (M == 1 && j.variant >= 2 && j.variant <= 4) {
    j.back_passes = true;
    j.claim_passes(2 * fp8_src::F8_G, fp8_src::F8_G);
  }
  const float up = j.variant == 1 ? 1.f : fp8_src::X_UP;
  buf.assign(M * 2 * K2, 0.f);
  const c10::BFloat16* x16 = bf16 ? x.data_ptr<c10::BFloat16>() : nullptr;  // (not a data_ptr call an element: 3 %
  const float* x32 = bf16 ? nullptr : x.data_ptr<float>();                   // of SmolLM2's batch-1 FP8 decode)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) buf[m * 2 * K2 + k] = up * (x16 ? static_cast<float>(x16[m * K + k]) : x32[m * K + k]);
  j.x = buf.data();
}

}  // namespace

namespace {

// Whether norm_into runs rms_rows on x (so that rows of it may run apart: norm_range)
bool rms_direct(const torch::Tensor& x, const torch::Tensor& weight, bool rms) {
  return rms && weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1) &&
         x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// rows [r0, r1) of norm_into's RMSNorm (rms_direct), into out (M, C) allocated
void norm_range(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out, int64_t r0,
                int64_t r1) {
  const int64_t C = x.size(1), ld = x.stride(0);
  if (r0 >= r1) return;
  if (x.scalar_type() == at::kFloat)
    rms_rows(x.data_ptr<float>() + r0 * ld, ld, weight.data_ptr<float>(), out.data_ptr<float>() + r0 * C, r1 - r0, C, eps);
  else
    rms_rows(x.data_ptr<c10::BFloat16>() + r0 * ld, ld, weight.data_ptr<c10::BFloat16>(),
             out.data_ptr<c10::BFloat16>() + r0 * C, r1 - r0, C, eps);
}

// rows [r0, r1) of swiglu_into, into out (M, ffn) allocated
void swiglu_range(const torch::Tensor& u, int64_t ffn, torch::Tensor& out, int64_t r0, int64_t r1) {
  if (r0 >= r1) return;
  const int64_t ld = u.stride(0);
  if (u.scalar_type() == at::kFloat)
    swiglu_rows(u.data_ptr<float>() + r0 * ld, ld, ffn, out.data_ptr<float>() + r0 * ffn, r1 - r0);
  else
    swiglu_rows(u.data_ptr<c10::BFloat16>() + r0 * ld, ld, ffn, out.data_ptr<c10::BFloat16>() + r0 * ffn, r1 - r0);
}

// The block's norm of x (M, C) into out (M, C), as norm() computes it, without an allocation for RMSNorm (rms_rows
// of csrc/fused_decode.cpp, one pass a row); LayerNorm, or a weight of another dtype: norm()
void norm_into(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, bool rms, double eps,
               torch::Tensor& out) {
  if (!rms_direct(x, weight, rms)) {
    out = norm(x, weight, bias, rms, eps).contiguous();
    return;
  }
  if (!out.defined() || !out.is_contiguous() || out.sizes() != x.sizes()) out = torch::empty_like(x);
  norm_range(x, weight, eps, out, 0, x.size(0));
}

// SwiGLU's silu(gate) * up into out (M, ffn) without an allocation: swiglu_rows (csrc/fused_decode.cpp), as the
// per-op loop; u (M, 2 ffn) the up Linear's rows, gate first
void swiglu_into(const torch::Tensor& u, int64_t ffn, torch::Tensor& out) {
  const int64_t M = u.size(0);
  if (!out.defined() || out.size(0) != M || out.size(1) != ffn) out = torch::empty({M, ffn}, u.options());
  swiglu_range(u, ffn, out, 0, M);
}

// Rows a step needs for the team to split thread 0's row-wise small ops (the norms, the activation) and the next
// Linear's layout over its threads, each its rows (a row's ops do not depend on the others: the same bits). Below
// it the others warm the next Linear's panels meanwhile instead (batch 1 and a few rows read the weights from memory).
// SmolLM2, 2-core EPYC Zen 4 (thread 0's serial phases ~8 % of a bf16 step of 64 rows, the other's spin waits 7.9 % of
// the perf samples): decode steps, both ways switched in one process, median of 3: bf16 64 rows 63.3 -> 59.6 ms, 34
// rows 35.2 -> 34.5, 16 rows 17.7 -> 17.4; fp32 64 rows 110.3 -> 107.5
constexpr int64_t SPLIT_ROWS = 16;

// Whether the team runs this step: every block Linear on the panel or FP8 kernel, fp32 or bf16 rows. The
// attention is shared too: several sequences split by sequence, one sequence by kv heads (as paged_decode
// splits them entered outside a parallel region), at any context length
bool team_applies(const torch::Tensor& x, const std::vector<int64_t>& kinds, const StepArgs& a) {
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return false;
  for (const int64_t k : kinds)
    if (k != 0 && k < 5) return false;
  TORCH_CHECK(a.lens.numel() == x.size(0) && a.lens.scalar_type() == at::kLong, "decode_blocks: lens (M) int64");
  return true;
}

// decode_blocks (csrc/fused_decode.cpp) as one parallel region: the same ops as run_half, in the same order
torch::Tensor decode_team(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                          const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                          const StepArgs& a) {
  const int64_t L = static_cast<int64_t>(k_caches.size()), M = x.size(0), C = x.size(1);
  const int64_t nkv = k_caches[0].size(1), hd = k_caches[0].size(2), qn = a.n_head * hd, kn = nkv * hd;
  const int64_t up_n = a.act == 2 ? 2 * a.ffn : a.ffn;
  x = x.clone(at::MemoryFormat::Contiguous);  // the residual stream, updated in place by the closing Linears
  auto qkv = torch::empty({M, qn + 2 * kn}, x.options());
  auto y = torch::empty({M, qn}, x.options());  // the attention's output
  auto u = torch::empty({M, up_n}, x.options());
  // the views of qkv and y the layers take, once a step (were ~400 calls on thread 0's path a batch-1 SmolLM2 token)
  const auto q_all = qkv.narrow(1, 0, qn).view({M, a.n_head, hd}), k_all = qkv.narrow(1, qn, kn).view({M, nkv, hd});
  const auto v_all = qkv.narrow(1, qn + kn, kn);
  auto y3 = y.view({M, a.n_head, hd});
  const int64_t widest = std::max({C, qn, a.ffn});
  std::vector<float> buf(M * (widest + 1));
  const int64_t panel_variant = panel_src::row_variant(0);
  TeamLinear job;
  torch::Tensor h, q, kr, att, act, bias_keep;  // thread 0's tensors between phases
  const bool split = at::get_num_threads() > 1 && M >= SPLIT_ROWS;  // (SPLIT_ROWS)
  if (split) {  // the split phases' outputs, before the threads write their rows
    h = torch::empty_like(x);
    if (a.act != 0) act = torch::empty({M, a.ffn}, x.options());
  }
  const at::ThreadLocalState tls;       // the caller's (grad / inference mode): the team's ATen calls run under it
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::atomic<int64_t> done{0};  // thread 0's phases ended (the others warm the next Linear until it moves)
  SpinBarrier bar;
  const int threads = at::get_num_threads();
  // the attention over the team: several sequences split by sequence, one by kv heads (thread 0 the last
  // share, the smaller where they are uneven: it also lays out the next Linear's input); a team of one: inline
  const bool split_attention = M > 1, split_heads = M == 1 && threads > 1;
  // split_attention: of nt threads, thread t takes the sequences [cut(t), cut(t + 1)), contiguous runs of about equal
  // work (each row's context length plus ROW_COST: pre holds the running sums), not of equal counts: a decode batch's
  // contexts differ several-fold (the peer mix: 20-500 positions) and the phase ends at its slowest thread's barrier
  constexpr int64_t ROW_COST = 32;  // positions' worth of a row's fixed work (its queries, its softmax, its stores)
  std::vector<int64_t> pre(M + 1, 0);
  if (split_attention) {
    const auto lens = a.lens.contiguous();
    const int64_t* ln = lens.data_ptr<int64_t>();
    for (int64_t s = 0; s < M; ++s) pre[s + 1] = pre[s] + ln[s] + ROW_COST;
  }
  const auto cut = [&](int64_t t, int64_t nt) -> int64_t {  // the first row with t / nt of the work before it
    if (t >= nt) return M;
    return std::lower_bound(pre.begin(), pre.end(), (t * pre[M] + nt - 1) / nt) - pre.begin();
  };
#pragma omp parallel num_threads(threads)
  {
    at::ThreadLocalStateGuard guard(tls);
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    bool sense = false;
    // f on the thread(s) `who` says; an error stops the work (every thread still meets every barrier) and is
    // raised after the region
    auto guarded = [&](bool who, auto&& f) {
      if (who && !failed.load(std::memory_order_relaxed)) {
        try {
          f();
        } catch (...) {
#pragma omp critical(shardserve_team_error)
          if (!error) error = std::current_exception();
          failed.store(true);
        }
      }
    };
    // f on the thread(s) `who` says, then every thread waits for the phase to end
    auto phase = [&](bool who, auto&& f) {
      guarded(who, f);
      bar.wait(nt, sense);
    };
    int64_t serials = 0;  // thread 0's phases this thread has passed
    // thread 0 runs f (the small ops, then lays out the next Linear's input); the others warm their caches with
    // the last bytes of that Linear's panels `next` meanwhile
    auto serial = [&](const torch::Tensor& next, auto&& f) {
      if (tid == 0) {
        guarded(true, f);
        done.fetch_add(1, std::memory_order_relaxed);
      } else {
        warm(next, tid - 1, nt - 1, done, serials);
      }
      bar.wait(nt, sense);
      ++serials;
    };
    auto linear = [&] { phase(true, [&] { job.run(tid); }); };
    const int64_t r0 = tid * M / nt, r1 = (tid + 1) * M / nt;  // this thread's rows in a split phase
    // the norm before a Linear (weights n) and its layout: over the team's rows where split allows, else on thread 0
    auto norm_then = [&](const torch::Tensor* n, int64_t kind, const torch::Tensor* t, int64_t N, torch::Tensor& o,
                         const torch::Tensor& next) {
      if (split && rms_direct(x, n[0], a.rms) && deferrable(kind, h, panel_variant)) {
        phase(tid == 0, [&] { prepare(job, kind, h, t, N, nullptr, o, buf, bias_keep, panel_variant, false); });
        phase(true, [&] {
          norm_range(x, n[0], a.eps, h, r0, r1);
          lay_out(job, h, r0, r1);
        });
        return;
      }
      serial(next, [&] {
        norm_into(x, n[0], n[1], a.rms, a.eps, h);
        prepare(job, kind, h, t, N, nullptr, o, buf, bias_keep, panel_variant);
      });
    };
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* p = w.data() + PER_LAYER * l;
      const int64_t* kind = kinds.data() + 4 * l;
      const torch::Tensor &k_cache = k_caches[l], &v_cache = v_caches[l];
      // rows [s0, s0 + n): RoPE on their queries and keys (in place), their keys and values into the caches (all rows:
      // no views); a row depends on itself only, so any split of the rows over threads gives the same bits
      auto rotate_and_cache = [&](int64_t s0, int64_t n) {
        const bool all = s0 == 0 && n == M;
        const auto qs = all ? q : q.narrow(0, s0, n), ks = all ? kr : kr.narrow(0, s0, n);
        if (a.cos.numel() > 0) {
          const int64_t half = hd / 2;
          const auto cs = all ? a.cos : a.cos.view({M, half}).narrow(0, s0, n);
          const auto sn = all ? a.sin : a.sin.view({M, half}).narrow(0, s0, n);
          rope_(qs, cs, sn);
          rope_(ks, cs, sn);
        }
        const auto slots = all ? a.slots : a.slots.narrow(0, s0, n);
        write_rows(k_cache, slots, ks, nkv, hd);
        write_rows(v_cache, slots, all ? v_all : v_all.narrow(0, s0, n), nkv, hd);
      };
      norm_then(p, kind[0], p + 6, qn + 2 * kn, qkv, p[8]);
      linear();  // qkv (M, qn + 2 kn)
      // the attention's rows laid out by the threads that computed them (split_attention, below)
      const bool lay_y = split && split_attention && deferrable(kind[1], y, panel_variant);
      serial(p[13], [&] {
        q = q_all;  // (M, nh, hd)
        auto k = k_all;  // (M, nkv, hd)
        if (p[4].numel()) q = rms_norm(q, p[4], a.qk_eps);
        if (p[5].numel()) k = rms_norm(k, p[5], a.qk_eps);
        kr = k;
        if (lay_y) prepare(job, kind[1], y, p + 11, C, &x, x, buf, bias_keep, panel_variant, false);
        if (split_attention) return;  // each thread rotates and caches its own rows, then attends them (below)
        rotate_and_cache(0, M);
        if (split_heads) return;
        att = paged_src::paged_decode(q, k_cache, v_cache, a.table, a.lens, a.block_size).view({M, qn});
        prepare(job, kind[1], att, p + 11, C, &x, x, buf, bias_keep, panel_variant);
      });
      if (split_heads) {  // one sequence: thread t its share of the kv heads (none past the last)
        phase(true, [&] {
          const int64_t per = (nkv + nt - 1) / nt, g0 = std::min(nkv, (nt - 1 - tid) * per), g1 = std::min(nkv, g0 + per);
          if (g0 >= g1) return;
          paged_src::paged_decode_heads(q.contiguous(), k_cache, v_cache, a.table, a.lens, a.block_size, g0, g1, y3);
        });
      }
      if (split_attention) {  // each thread its sequences (none for a thread past the last)
        phase(true, [&] {
          const int64_t s0 = cut(tid, nt), n = cut(tid + 1, nt) - s0;
          if (n <= 0) return;
          rotate_and_cache(s0, n);
          auto part = paged_src::paged_decode(q.narrow(0, s0, n), k_cache, v_cache, a.table.narrow(0, s0, n),
                                              a.lens.narrow(0, s0, n), a.block_size);  // (n, nh, hd) contiguous
          std::memcpy(static_cast<char*>(y.data_ptr()) + s0 * qn * y.element_size(), part.data_ptr(),
                      n * qn * y.element_size());
          if (lay_y) lay_out(job, y, s0, s0 + n);
        });
      }
      if ((split_heads || split_attention) && !lay_y)  // the team's attention in y: thread 0 lays out the projection's input
        serial(p[13], [&] { prepare(job, kind[1], y, p + 11, C, &x, x, buf, bias_keep, panel_variant); });
      linear();  // x + proj(y)
      norm_then(p + 2, kind[2], p + 16, up_n, u, p[18]);
      linear();  // u (M, up_n)
      if (split && a.act != 0 && deferrable(kind[3], act, panel_variant)) {  // the activation's rows, each thread its own
        phase(tid == 0, [&] { prepare(job, kind[3], act, p + 21, C, &x, x, buf, bias_keep, panel_variant, false); });
        phase(true, [&] {
          if (a.act == 2) swiglu_range(u, a.ffn, act, r0, r1);
          else gelu_range(u, act, r0, r1);
          lay_out(job, act, r0, r1);
        });
      } else serial(p[23], [&] {
        if (a.act == 0) act = at::gelu(u, "none").contiguous();
        else if (a.act == 1) gelu_into(u, act);
        else swiglu_into(u, a.ffn, act);
        prepare(job, kind[3], act, p + 21, C, &x, x, buf, bias_keep, panel_variant);
      });
      linear();  // x + down(act)
    }
  }
  if (error) std::rethrow_exception(error);
  return x;
}

}  // namespace
