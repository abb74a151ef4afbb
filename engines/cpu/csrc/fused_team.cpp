// The fused decode step as ONE parallel region a step (engines/cpu/fused_decode.py; compiled after
// csrc/fused_decode.cpp, whose helpers it calls): a team of torch's intra-op thread count enters once and
// walks the layers together, phase by phase, with a spin barrier after each shared phase. Thread 0 runs the small
// ops (the norms, the activation; for several sequences also the q / k norms: the per-op loop's ATen calls, or loops
// that round as they do, so the same bits) and lays out the next Linear's input rows, while the others pull the back
// of that Linear's panels into their caches (one sequence of RMSNorm and SwiGLU: every thread runs them on its own
// copy of the row instead, `own` below); then every thread claims groups of its panels (the panel and FP8
// kernels' run_range / blocked_range / fp8_range: a panel's sums do not depend on the split, so the bits are the
// per-op loop's; csrc/team_linear.cpp). The attention is shared: each thread its sequences, or for one sequence its
// kv heads (their q / k norms, rotation, cache writes and attention). The per-op loop entered ~150 OpenMP regions a
// token on SmolLM2 (4 Linears and the attention a layer, 30 layers), each a fork and a join of the thread pool, with
// the weights' stream stopped in between.
#include <torch/types.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// one probe of a spin wait: a pause, or after a while the core yielded (a preempted teammate on a shared host gets it back)
inline void spin_pause(int spins) {
  if (spins < 20000) {
#if defined(__x86_64__)
    _mm_pause();
#endif
  } else {
    std::this_thread::yield();
  }
}

// A sense-reversing spin barrier for one step's team: the last of n arrivals resets the count and flips the
// shared sense; the others spin on it (a pause a probe), yielding the core after a while so a preempted
// teammate on a shared host gets it back. An early arrival given a Warmer (csrc/team_linear.cpp) requests its lines
// meanwhile, a few a probe: the next Linear's panels, from the end it claims from (SmolLM2 FP8 + FP8 head, batch 1,
// 2-core Zen 4 EPYC: thread 0, done with its kv head of three, warms the projection; its share of that Linear
// 260 -> 194 us a token, rdtsc in the phases)
class SpinBarrier {
 public:
  void wait(int n, bool& local, Warmer* warmer = nullptr) {
    if (n == 1) return;
    local = !local;
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count_.store(0, std::memory_order_relaxed);
      sense_.store(local, std::memory_order_release);
      return;
    }
    bool more = warmer != nullptr;
    for (int spins = 0; sense_.load(std::memory_order_acquire) != local; ++spins)
      if (more) more = warmer->step();
      else spin_pause(spins);
  }

 private:
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<bool> sense_{false};
};

// Rows a step needs for the team to split thread 0's row-wise small ops (the norms, the activation) and the next
// Linear's layout over its threads, each its rows (a row's ops do not depend on the others: the same bits). Below
// it the others warm the next Linear's panels meanwhile instead (batch 1 and a few rows read the weights from memory).
// SmolLM2, 2-core EPYC Zen 4 (thread 0's serial phases ~8 % of a bf16 step of 64 rows, the other's spin waits 7.9 % of
// the perf samples): decode steps, both ways switched in one process, median of 3: bf16 64 rows 63.3 -> 59.6 ms, 34
// rows 35.2 -> 34.5, 16 rows 17.7 -> 17.4; fp32 64 rows 110.3 -> 107.5
constexpr int64_t SPLIT_ROWS = 16;

// Whether the team runs this step: every block Linear on the panel (either kind) or FP8 kernel, fp32 or bf16 rows. The
// attention is shared too: several sequences split by sequence, one sequence by query heads, at any
// context length
bool team_applies(const torch::Tensor& x, const std::vector<int64_t>& kinds, const StepArgs& a) {
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return false;
  for (const int64_t k : kinds)
    if ((k != 0 && k < 5) || k > PANEL_AVX2) return false;
  TORCH_CHECK(a.lens.numel() == x.size(0) && a.lens.scalar_type() == at::kLong, "decode_blocks: lens (M) int64");
  return true;
}

// A bound model's Linears as the team runs them (LinearDesc), for the step's kernels and dtype: built by the first step
// of a kind, then reused (csrc/fused_decode.cpp Bound). Built each step, they cost thread 0 ~60 us of a 3.3 ms SmolLM2
// FP8 token (120 Linears' tensors, their metadata out of every cache)
struct TeamPlan {
  std::vector<int64_t> kinds;
  at::ScalarType dt;
  int64_t panel_variant = 0, C = 0, qn = 0, kn = 0, up_n = 0, ffn = 0;
  std::vector<LinearDesc> lin;  // 4 a layer: qkv, proj, up, down
  // the caches' storage where every one is a contiguous (slots, nkv, hd) table of the step's dtype (plain): a layer's
  // attention of one sequence then writes and reads them through these (own_heads below), else through the tensors
  bool plain = false;
  std::vector<void*> kc, vc;
  bool qk_norms = false;  // whether a layer has q / k norms (Qwen3)
  std::vector<const void*> norm_w;  // the layers' norms' weights, 2 a layer (requested ahead: decode_team's linear)
  int64_t norm_bytes = 0;           // each one's
};

// the step's plan: b's where it matches the step, else a new one (kept in b where given)
std::shared_ptr<const TeamPlan> plan_for(Bound* b, const std::vector<torch::Tensor>& w,
                                         const std::vector<int64_t>& kinds,
                                         const std::vector<torch::Tensor>& k_caches,
                                         const std::vector<torch::Tensor>& v_caches, at::ScalarType dt,
                                         int64_t panel_variant, int64_t C, int64_t qn, int64_t kn, int64_t up_n,
                                         int64_t ffn) {
  std::unique_lock<std::mutex> hold;
  if (b) {
    hold = std::unique_lock<std::mutex>(b->plan_mu);
    const auto& p = b->plan;
    if (p && p->kinds == kinds && p->dt == dt && p->panel_variant == panel_variant && p->C == C && p->qn == qn &&
        p->kn == kn && p->up_n == up_n && p->ffn == ffn)
      return p;
  }
  auto p = std::make_shared<TeamPlan>();
  p->kinds = kinds, p->dt = dt, p->panel_variant = panel_variant, p->C = C, p->qn = qn, p->kn = kn, p->up_n = up_n;
  p->ffn = ffn;
  const int64_t L = static_cast<int64_t>(kinds.size()) / 4, n_out[4] = {qn + 2 * kn, C, up_n, C};
  const int64_t n_in[4] = {C, qn, C, ffn};
  p->lin.resize(4 * L);
  for (int64_t l = 0; l < L; ++l)
    for (int i = 0; i < 4; ++i)
      p->lin[4 * l + i] = describe(kinds[4 * l + i], w.data() + PER_LAYER * l + 6 + 5 * i, n_out[i], n_in[i], dt,
                                   panel_variant);
  const int64_t nkv = k_caches[0].size(1), hd = k_caches[0].size(2);
  for (int64_t l = 0; l < L; ++l)
    p->qk_norms = p->qk_norms || w[PER_LAYER * l + 4].numel() || w[PER_LAYER * l + 5].numel();
  p->plain = true;
  for (const auto* caches : {&k_caches, &v_caches})
    for (const auto& c : *caches)
      p->plain = p->plain && c.dim() == 3 && c.is_contiguous() && c.scalar_type() == dt && c.size(1) == nkv &&
                 c.size(2) == hd && c.size(0) == k_caches[0].size(0);
  for (int64_t l = 0; p->plain && l < L; ++l)
    p->kc.push_back(k_caches[l].data_ptr()), p->vc.push_back(v_caches[l].data_ptr());
  p->norm_bytes = w[0].nbytes();
  for (int64_t l = 0; l < L; ++l)
    for (int i = 0; i < 2; ++i) {
      const auto& n = w[PER_LAYER * l + 2 * i];
      p->norm_bytes = std::min<int64_t>(p->norm_bytes, n.nbytes());
      p->norm_w.push_back(n.data_ptr());
    }
  if (b) b->plan = p;
  return p;
}

// decode_blocks (csrc/fused_decode.cpp) as one parallel region: the same ops as run_half, in the same order
torch::Tensor decode_team(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                          const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                          const StepArgs& a, Bound* b) {
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
  const auto plan = plan_for(b, w, kinds, k_caches, v_caches, x.scalar_type(), panel_variant, C, qn, kn, up_n, a.ffn);
  const std::vector<LinearDesc>& lin = plan->lin;
  TeamLinear job, proj_job, job2;  // proj_job: the attention's projection; job2: the down Linear's (own below)
  std::vector<float> buf_proj;
  torch::Tensor h, q, kr, att, act;  // thread 0's tensors between phases
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
  // the attention over the team: several sequences split by sequence, one by query heads claimed one at a time (below);
  // a team of one: inline
  const bool split_attention = M > 1, split_heads = M == 1 && threads > 1;
  // one sequence through plain caches, no q / k norms (own_heads' lean path): the step's pointers, read once here
  const bool lean = split_heads && plan->plain && !plan->qk_norms && a.slots.is_contiguous() &&
                    a.slots.scalar_type() == at::kLong && a.table.scalar_type() == at::kLong && a.table.is_contiguous() &&
                    a.lens.scalar_type() == at::kLong && hd % 2 == 0 &&
                    (a.cos.numel() == 0 || (a.cos.scalar_type() == at::kFloat && a.sin.scalar_type() == at::kFloat &&
                                            a.cos.is_contiguous() && a.sin.is_contiguous() &&
                                            a.cos.numel() == hd / 2 && a.sin.numel() == hd / 2));
  void *qkv_p = qkv.data_ptr(), *y_p = y.data_ptr();
  const int64_t es = x.element_size();
  const float* cos_p = lean && a.cos.numel() ? a.cos.data_ptr<float>() : nullptr;
  const float* sin_p = cos_p ? a.sin.data_ptr<float>() : nullptr;
  const int64_t slot0 = lean ? a.slots.data_ptr<int64_t>()[0] : 0;
  const int64_t len0 = lean ? a.lens.data_ptr<int64_t>()[0] : 0;
  const int64_t* tab_p = lean ? a.table.data_ptr<int64_t>() : nullptr;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  // One sequence (lean), RMSNorm and SwiGLU, every Linear an FP8 one or a panel one reading its row as it is (own):
  // each thread computes the small ops' row itself into its own buffer (own_rows below), no serial phase,
  // and thread 0 readies each Linear's claims while the one before runs (QKV and up in job, the projection in
  // proj_job, down in job2: each readied once the claims of its last use have ended). The small ops read a few KB,
  // but each hand-off of thread 0's output cost the others a miss a line and a flag's round trip, the more so when
  // the two vCPUs are far apart. SmolLM2 FP8 + FP8 head, batch 1, 2-core Zen 4 EPYC, one process, rounds alternating
  // with the build before (runs/s97/abcont.py; medians, by the read of 256 MB before each round): the step 1.03-1.05x
  // where the read was >= 45 GB/s (86 and 124 rounds in two runs), 1.00-1.02x below 35 (its memory the bound)
  bool own = lean && a.act == 2 && a.rms;
  for (int64_t l = 0; own && l < L; ++l)
    for (int i = 0; own && i < 4; ++i) {
      const int64_t k_in[4] = {C, qn, C, a.ffn}, kind = lin[4 * l + i].kind;
      own = (i % 2 || rms_direct(x, w[PER_LAYER * l + i], true)) &&
            (kind >= 5 || (kind == 0 && (x.scalar_type() == at::kFloat || k_in[i] % 2 == 0)));
    }
  // own: the Linears' input shapes for prepare (the threads' rows are their own): x's, and the down Linear's (u's gate)
  const torch::Tensor gate = own ? u.narrow(1, 0, a.ffn) : torch::Tensor();
  if (own) prepare(job, lin[0], x, nullptr, qkv, buf, false);
  void* const x_p = x.data_ptr();
  const void* const u_p = u.data_ptr();
  if (lean)
    TORCH_CHECK(slot0 >= 0 && slot0 < k_caches[0].size(0) && len0 >= 1 && len0 <= a.table.size(1) * a.block_size,
                "decode_blocks: cache slot ", slot0, " or length ", len0, " out of range");
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
    std::vector<float> att_buf;  // own_heads' scores, scaled queries and sums (lean)
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
    // next: the Linear after the phase, whose panels a thread done early requests while it waits (Warmer)
    auto phase = [&](bool who, auto&& f, const LinearDesc* next = nullptr) {
      guarded(who, f);
      Warmer warmer;
      if (next) warmer = Warmer(*next, tid, nt);
      bar.wait(nt, sense, next ? &warmer : nullptr);
    };
    int64_t serials = 0;  // thread 0's phases this thread has passed
    // thread 0 runs f (the small ops, then lays out the next Linear's input) and goes on into the next phase; the others
    // warm their caches with the last bytes of that Linear's panels `next` meanwhile, then wait for f's end (not a
    // barrier: thread 0 never waits for them here). Their requests fill the core's miss queue, so a warming thread
    // notices f's end only once the queue has drained (~1.5 us at batch 1 on the 2-core Zen 4 EPYC: the warm took
    // ~2.6 us a phase against thread 0's ~1.3); the next phase's claims absorb that lateness. SmolLM2 FP8 + FP8 head,
    // batch 1: thread 0's waits after its serial phases ~150 us of a 3.1 ms token (rdtsc in the phases)
    auto serial = [&](const LinearDesc& next, auto&& f) {
      if (tid == 0) {
        guarded(true, f);
        done.fetch_add(1, std::memory_order_release);
      } else {
        warm(next, tid - 1, nt - 1, done, serials);
        for (int spins = 0; done.load(std::memory_order_acquire) <= serials; ++spins) spin_pause(spins);
      }
      ++serials;
    };
    // thread 0 requests the norm weights `norm` (a plan->norm_w index) after its claims: the next serial phase reads
    // them, by then evicted by the weights' stream (SmolLM2 FP8 + FP8 head, batch 1, 2-core Zen 4 EPYC: thread 0's
    // norm-and-up phases 40-42 -> 25-26 us a token, rdtsc in the phases)
    // (own: every thread its own input row xo, and every thread requests the norm weights; thread 0 then readies the
    // next Linear's claims: `then`)
    auto own_linear = [&](TeamLinear& j, const LinearDesc* next, int64_t norm, const void* xo, auto&& then) {
      phase(true, [&] {
        j.run(tid, xo);
        if ((tid == 0 || own) && norm >= 0) request_bytes(plan->norm_w[norm], plan->norm_bytes);
        if (tid == 0) then();
      }, next);
    };
    auto linear = [&](TeamLinear& j, const LinearDesc* next, int64_t norm = -1) {
      own_linear(j, next, norm, nullptr, [] {});
    };
    // own: this thread's norm n (a plan->norm_w index) of x, or with n < 0 SwiGLU of u, into its own row (64-byte
    // aligned, as a tensor's), laid out for the Linear j (lay_row): norm_range's / swiglu_range's ops, the same bits
    std::vector<float> row_buf, mine;
    if (own) row_buf.resize(widest + 16), mine.resize(widest + 2);
    float* const row = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(row_buf.data()) + 63) & ~uintptr_t{63});
    auto own_row = [&](auto tag, int64_t n, const TeamLinear& j) -> const void* {
      using T = decltype(tag);
      T* r = reinterpret_cast<T*>(row);
      if (n < 0) {
        swiglu_rows(static_cast<const T*>(u_p), up_n, a.ffn, r, 1);
        return lay_row(j, r, a.ffn, mine.data());
      }
      rms_rows(static_cast<const T*>(x_p), C, static_cast<const T*>(plan->norm_w[n]), r, 1, C, a.eps);
      return lay_row(j, r, C, mine.data());
    };
    auto own_rows = [&](int64_t n, const TeamLinear& j) {
      return x.scalar_type() == at::kFloat ? own_row(float{}, n, j) : own_row(c10::BFloat16{}, n, j);
    };
    const void* xo = nullptr;  // own: the row the next Linear reads
    const int64_t r0 = tid * M / nt, r1 = (tid + 1) * M / nt;  // this thread's rows in a split phase
    // split_heads: this thread's kv heads [g0, g1), thread 0 the last share (the smaller where they are uneven)
    const int64_t per = (nkv + nt - 1) / nt, g0 = std::min(nkv, (nt - 1 - tid) * per), g1 = std::min(nkv, g0 + per);
    // the norm before the Linear d (weights n) and its layout: over the team's rows where split allows, else on thread 0
    // (then `also` too)
    auto norm_then = [&](const torch::Tensor* n, const LinearDesc& d, torch::Tensor& o, auto&& also) {
      if (split && rms_direct(x, n[0], a.rms) && deferrable(d, h)) {
        phase(tid == 0, [&] { prepare(job, d, h, nullptr, o, buf, false); });
        phase(true, [&] {
          norm_range(x, n[0], a.eps, h, r0, r1);
          lay_out(job, h, r0, r1);
        });
        return;
      }
      serial(d, [&] {
        norm_into(x, n[0], n[1], a.rms, a.eps, h);
        prepare(job, d, h, nullptr, o, buf);
        also();
      });
    };
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* p = w.data() + PER_LAYER * l;
      const LinearDesc* d = lin.data() + 4 * l;
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
      // one sequence, an FP8 projection: each thread lays out its heads' columns of y after attending them (own_heads),
      // into the projection's own job, readied with the QKV Linear's (SmolLM2 FP8 + FP8 head on the 2-core Zen 4 EPYC:
      // a phase of thread 0 reading the other thread's heads took 1-2 us a layer)
      const bool lay_heads = split_heads && d[1].kind >= 5;
      if (own) guarded(true, [&] {
        xo = own_rows(2 * l, job);
        if (tid == 0) prepare(proj_job, d[1], y, &x, x, buf_proj, false);  // (a panel's one row: y itself)
      });
      else norm_then(p, d[0], qkv, [&] {
        if (lay_heads) prepare(proj_job, d[1], y, &x, x, buf_proj, false);
      });
      if (lean && g0 < g1)  // the keys and values this thread attends next (the new position's come from the Linear)
        request_kv(plan->kc[l], plan->vc[l], tab_p, len0 - 1, a.block_size, kn * es, g0 * hd * es, (g1 - g0) * hd * es);
      own_linear(job, d + 1, -1, xo, [] {});  // qkv (M, qn + 2 kn)
      // the attention's rows laid out by the threads that computed them (split_attention, below)
      const bool lay_y = split && split_attention && deferrable(d[1], y);
      if (!split_heads) serial(d[1], [&] {
        q = q_all;  // (M, nh, hd)
        auto k = k_all;  // (M, nkv, hd)
        if (p[4].numel()) q = rms_norm(q, p[4], a.qk_eps);
        if (p[5].numel()) k = rms_norm(k, p[5], a.qk_eps);
        kr = k;
        if (lay_y) prepare(job, d[1], y, &x, x, buf, false);
        if (split_attention) return;  // each thread rotates and caches its own rows, then attends them (below)
        rotate_and_cache(0, M);
        att = paged_src::paged_decode(q, k_cache, v_cache, a.table, a.lens, a.block_size).view({M, qn});
        prepare(job, d[1], att, &x, x, buf);
      });
      // One sequence: thread t its share of the kv heads, start to end: its heads' q / k norms (Qwen3), their rotation,
      // its keys and values into the caches, its attention, its columns of the projection's input (lay_heads); thread
      // 0 the last share (g0, g1 above). A head's ops do not depend on the others: the bits of the whole. (Was: thread
      // 0 alone ran the norms, rotation and cache writes in a phase of their own, 2-3 us a layer of SmolLM2, the others
      // warming the projection meanwhile)
      if (split_heads) {
        phase(true, [&] {
          if (g0 >= g1) return;
          const int64_t group = a.n_head / nkv, h0 = g0 * group, nq = (g1 - g0) * group;
          if (lean) {  // the same ops on raw pointers (no tensor views: each ~1 us of ATen)
            const auto run = [&](auto tag) {
              using T = decltype(tag);
              T* qh = static_cast<T*>(qkv_p) + h0 * hd;
              T* kh = static_cast<T*>(qkv_p) + qn + g0 * hd;
              const T* vh = static_cast<T*>(qkv_p) + qn + kn + g0 * hd;
              if (cos_p) {
                rope_rows<T>(qh, 1, nq, hd, 0, hd, cos_p, sin_p);
                rope_rows<T>(kh, 1, g1 - g0, hd, 0, hd, cos_p, sin_p);
              }
              T* kc = static_cast<T*>(plan->kc[l]);
              T* vc = static_cast<T*>(plan->vc[l]);
              std::memcpy(kc + slot0 * kn + g0 * hd, kh, (g1 - g0) * hd * sizeof(T));
              std::memcpy(vc + slot0 * kn + g0 * hd, vh, (g1 - g0) * hd * sizeof(T));
              const int64_t lpad = len0 + 1;
              if (static_cast<int64_t>(att_buf.size()) < nq * (lpad + 2 * hd)) att_buf.resize(nq * (lpad + 2 * hd));
              float* sc = att_buf.data();
              paged_src::attend<T>(qh, kc + g0 * hd, vc + g0 * hd, tab_p, len0, a.block_size, kn, hd, nq, group,
                                   scale, sc + nq * lpad, sc, sc + nq * lpad + nq * hd, static_cast<T*>(y_p) + h0 * hd,
                                   lpad);
            };
            if (x.scalar_type() == at::kFloat) run(float{});
            else run(c10::BFloat16{});
            if (lay_heads) fp8_lay_cols(proj_job, y, h0 * hd, (h0 + nq) * hd);
            return;
          }
          auto qs = q_all.narrow(1, h0, nq), ks = k_all.narrow(1, g0, g1 - g0);
          if (p[4].numel()) qs.copy_(rms_norm(qs, p[4], a.qk_eps));
          if (p[5].numel()) ks.copy_(rms_norm(ks, p[5], a.qk_eps));
          if (a.cos.numel() > 0) {
            rope_(qs, a.cos, a.sin);
            rope_(ks, a.cos, a.sin);
          }
          write_rows(k_cache, a.slots, ks, nkv, hd, g0);
          write_rows(v_cache, a.slots, v_all.narrow(1, g0 * hd, (g1 - g0) * hd), nkv, hd, g0);
          paged_src::paged_decode_heads(q_all, k_cache, v_cache, a.table, a.lens, a.block_size, g0, g1, y3);
          if (lay_heads) fp8_lay_cols(proj_job, y, h0 * hd, (h0 + nq) * hd);
        }, d + 1);
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
        }, d + 1);
      }
      // the team's attention in y: thread 0 lays out the projection's input
      if (own) {  // x + proj(y); u (M, up_n) of this thread's norm; act's rows, each thread its own; x + down(act)
        own_linear(proj_job, d + 2, 2 * l + 1, nullptr, [&] { prepare(job, d[2], x, nullptr, u, buf, false); });
        guarded(true, [&] { xo = own_rows(2 * l + 1, job); });
        own_linear(job, d + 3, -1, xo, [&] { prepare(job2, d[3], gate, &x, x, buf, false); });
        guarded(true, [&] { xo = own_rows(-1, job2); });
        own_linear(job2, l + 1 < L ? d + 4 : nullptr, l + 1 < L ? 2 * l + 2 : -1, xo, [&] {
          if (l + 1 < L) prepare(job, d[4], x, nullptr, qkv, buf, false);
        });
        continue;
      }
      if ((split_heads || split_attention) && !lay_y && !lay_heads)
        serial(d[1], [&] { prepare(job, d[1], y, &x, x, buf); });
      linear(lay_heads ? proj_job : job, d + 2, 2 * l + 1);  // x + proj(y)
      norm_then(p + 2, d[2], u, [] {});
      linear(job, d + 3);  // u (M, up_n)
      if (split && a.act != 0 && deferrable(d[3], act)) {  // the activation's rows, each thread its own
        phase(tid == 0, [&] { prepare(job, d[3], act, &x, x, buf, false); });
        phase(true, [&] {
          if (a.act == 2) swiglu_range(u, a.ffn, act, r0, r1);
          else gelu_range(u, act, r0, r1);
          lay_out(job, act, r0, r1);
        });
      } else serial(d[3], [&] {
        if (a.act == 0) act = at::gelu(u, "none").contiguous();
        else if (a.act == 1) gelu_into(u, act);
        else swiglu_into(u, a.ffn, act);
        prepare(job, d[3], act, &x, x, buf);
      });
      linear(job, l + 1 < L ? d + 4 : nullptr, l + 1 < L ? 2 * l + 2 : -1);  // x + down(act)
    }
  }
  if (error) std::rethrow_exception(error);
  return x;
}

}  // namespace
