// The fused decode step's Linears (csrc/fused_team.cpp, compiled just after this file): one block Linear readied by
// thread 0 for the team (its input rows laid out as its kernel reads them), the panels handed out in claims, and the
// warming of the next Linear's panels while thread 0 runs the small ops before it; and those small ops' rows (the
// norms, SwiGLU) over a range of rows.
#include <torch/types.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

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

// One block Linear prepared by thread 0 for the team: its input rows laid out as its kernel reads them, its
// panels, bias, scales, residual and output (raw pointers into tensors the step keeps alive). Its panels are
// handed out in claims of `group` from both ends: thread 0 takes them from the front, the others from the back,
// where they warmed their caches while thread 0 ran the phase before (warm); a group's sums do not depend on
// which thread computes them, so the bits do not either
struct TeamLinear {
  int64_t group = 4;    // panels a claim: the one-row kernels' G (see prepare)
  int64_t kind = 0;     // block_linear's code: 0 panel (either kind: variant says which), 5 + v FP8
  int64_t variant = 0;  // the kernel's variant, resolved
  bool bf16 = false;
  bool blocked = false;  // panel kernel, many rows on AVX2: the rows as they are (bf16 widened), run_blocked's blocks
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

  // claims that taper: counted in units of `u` panels (a whole pass), a claim `group` panels while more than one such
  // claim is left, then one unit: the Linear's last claims are short, so the threads end it closer together (each
  // Linear ends at its slowest thread's barrier). (While more than the team's size in claims was left: a 36-panel
  // Linear gave the thread claiming from the back no whole claim; SmolLM2 FP8 batch 1, 2 threads, AVX2 blocks of
  // passes, switched step by step: the fused step 0.985-0.995x)
  void taper(int64_t u) {
    unit = u;
    const int64_t units = (P + u - 1) / u;
    left.store(units), front.store(0), back.store(units);
  }
  int64_t unit = 0;  // > 0: taper's claims

  // claim groups until none is left: a claim first takes one of `left`, so the two ends never meet twice; xo: this
  // thread's own copy of the laid-out input rows (fused_team.cpp own_rows), else x
  void run(int tid, const void* xo = nullptr) {
    if (unit > 0) {  // taper: a claim first takes its units from `left`, as above
      const int64_t big = std::max<int64_t>(1, group / unit), nt = omp_get_num_threads();
      for (int64_t have = left.load(std::memory_order_relaxed), take;;) {
        do {
          if (have <= 0) return;
          take = std::min(have, have > big ? big : 1);
        } while (!left.compare_exchange_weak(have, have - take, std::memory_order_relaxed));
        const int64_t u0 = tid == 0 ? front.fetch_add(take, std::memory_order_relaxed)
                                    : back.fetch_sub(take, std::memory_order_relaxed) - take;
        range(u0 * unit, std::min(P, (u0 + take) * unit), back_passes && tid != 0, xo);
        have = left.load(std::memory_order_relaxed);
      }
    }
    while (left.fetch_sub(1, std::memory_order_relaxed) > 0) {
      const int64_t g = tid == 0 ? front.fetch_add(1, std::memory_order_relaxed)
                                 : back.fetch_sub(1, std::memory_order_relaxed) - 1;
      range(g * group, std::min(P, (g + 1) * group), back_passes && tid != 0, xo);
    }
  }

  // whether the threads claiming from the back run their claims' passes backwards (variants 2-4) or request the group
  // before theirs (5: one pass a claim) (prepare)
  bool back_passes = false;

  // panels [p0, p1); backward: a one-row FP8 claim's passes from the last (fp8_range); xo: the input rows, else x
  void range(int64_t p0, int64_t p1, bool backward = false, const void* xo = nullptr) const {
    using BF = c10::BFloat16;
    const void* x = xo ? xo : this->x;
    if (blocked && bf16)
      panel_src::blocked_range(static_cast<const float*>(x), M, Kp, static_cast<const BF*>(w), N, bias,
                               static_cast<const BF*>(res), static_cast<BF*>(out), p0, p1);
    else if (blocked)
      panel_src::blocked_range(static_cast<const float*>(x), M, Kp, static_cast<const float*>(w), N, bias,
                               static_cast<const float*>(res), static_cast<float*>(out), p0, p1);
    else if (kind == 0 && bf16 && panel_src::wide_rows(variant, M))  // rows widened to fp32 pairs (widen_rows)
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

// rows [r0, r1) of x (M, K) laid out for the Linear j that prepare(..., lay = false) readied (see deferrable)
void lay_out(const TeamLinear& j, const torch::Tensor& x, int64_t r0, int64_t r1) {
  const int64_t M = x.size(0), K = x.size(1);
  if (j.blocked && x.scalar_type() == at::kBFloat16) {  // (M, 2 K2) fp32 rows, an odd K's last input zero
    const int64_t K2 = (K + 1) / 2;
    const c10::BFloat16* src = x.data_ptr<c10::BFloat16>();
    float* dst = static_cast<float*>(const_cast<void*>(j.x));
    for (int64_t m = r0; m < r1; ++m) {
      for (int64_t k = 0; k < K; ++k) dst[m * 2 * K2 + k] = static_cast<float>(src[m * K + k]);
      if (K % 2) dst[m * 2 * K2 + K] = 0.f;
    }
  } else if (j.blocked) {  // fp32: the rows themselves (prepare)
  } else if (x.scalar_type() == at::kBFloat16 && panel_src::wide_rows(j.variant, M))
    panel_src::widen_rows(x.data_ptr<c10::BFloat16>(), M, K, static_cast<float*>(const_cast<void*>(j.x)), r0, r1);
  else if (x.scalar_type() == at::kBFloat16)
    panel_src::transpose_rows(reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>()), M, K / 2,
                   static_cast<uint32_t*>(const_cast<void*>(j.x)), r0, r1);
  else
    panel_src::transpose_rows(x.data_ptr<float>(), M, K, static_cast<float*>(const_cast<void*>(j.x)), r0, r1);
}

// The factor an FP8 Linear's input rows are laid out with: X_UP for the vector variants, 1 for the portable one
inline float fp8_row_up(const TeamLinear& j) { return j.variant == 1 ? 1.f : fp8_src::X_UP; }

// Columns [k0, k1) of an FP8 Linear's input rows x (M, K) into its prepared rows (M, 2 K2) at j.x, scaled by X_UP
// for the vector variants: prepare lays out every column; with prepare's lay false the threads that computed a row's
// columns lay them out (fused_team.cpp lay_heads), so no phase waits for thread 0 to read them. The pointers are taken
// once (not a data_ptr call an element: 3 % of SmolLM2's batch-1 FP8 decode)
void fp8_lay_cols(const TeamLinear& j, const torch::Tensor& x, int64_t k0, int64_t k1) {
  const float up = fp8_row_up(j);
  const int64_t M = x.size(0), K = x.size(1), ld = 2 * ((K + 1) / 2);
  float* dst = static_cast<float*>(const_cast<void*>(j.x));
  const c10::BFloat16* x16 = x.scalar_type() == at::kBFloat16 ? x.data_ptr<c10::BFloat16>() : nullptr;
  const float* x32 = x16 ? nullptr : x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = k0; k < k1; ++k) dst[m * ld + k] = up * (x16 ? static_cast<float>(x16[m * K + k]) : x32[m * K + k]);
}

// One row h of K inputs laid out for the Linear j as prepare lays out one row into buf: an FP8 Linear's fp32 row
// (scaled by X_UP for the vector variants; fp8_lay_cols' arithmetic, an odd K's pad input zero), else the row itself
// (the one-row panel kernels read it as it is: prepare). A thread's own copy where every thread computes the row
// (fused_team.cpp own_rows); -> the pointer the Linear's kernels then read
template <typename T>
const void* lay_row(const TeamLinear& j, const T* h, int64_t K, float* dst) {
  if (j.kind == 0) return h;
  const float up = fp8_row_up(j);
  for (int64_t k = 0; k < K; ++k) dst[k] = up * static_cast<float>(h[k]);
  if (K % 2) dst[K] = 0.f;
  return dst;
}

// One block Linear as the team runs it, resolved once a step before the team's region (describe): its kernel and
// variant, its shape, the pointers to its weights, scales and bias. The serial phases then read one struct a Linear,
// not its tensors' metadata: by then the weights' stream has evicted those from every cache, and each tensor was a
// chain of misses (its TensorImpl, then its storage) on thread 0's path while the others waited
struct LinearDesc {
  int64_t kind = 0;     // block_linear's code, PANEL_AVX2 folded into 0 (variant says which)
  int64_t variant = 0;  // the kernel's variant, resolved
  int64_t N = 0, Kp = 0, P = 0;  // Kp: the panel's inputs (fp32 panel: K; bf16 panel and FP8: K2)
  int64_t bytes = 0;              // the panels' (warm)
  const void* w = nullptr;
  const float *bias = nullptr, *scales = nullptr;
  torch::Tensor bias_keep;  // a bias of another dtype, converted to fp32
};

// The Linear t (as block_linear: weight or scales, bias, panels, ...) of N outputs on K inputs of dtype dt, kernel
// `kind`; panel_variant: what the panel kernel's auto resolves to (kind PANEL_AVX2 runs its avx2 variant)
LinearDesc describe(int64_t kind, const torch::Tensor* t, int64_t N, int64_t K, at::ScalarType dt,
                    int64_t panel_variant) {
  if (kind == PANEL_AVX2) panel_variant = panel_kind_variant(kind, panel_variant), kind = 0;  // the panel kernel's avx2
  const bool bf16 = dt == at::kBFloat16;
  const int64_t K2 = (K + 1) / 2;
  LinearDesc d;
  d.kind = kind, d.N = N, d.P = (N + 15) / 16;
  if (t[1].numel()) {
    d.bias_keep = t[1].scalar_type() == at::kFloat ? t[1].contiguous() : t[1].to(at::kFloat).contiguous();
    TORCH_CHECK(d.bias_keep.numel() == N, "decode_blocks: a bias of N outputs");
    d.bias = d.bias_keep.data_ptr<float>();
  }
  const torch::Tensor& panels = t[2];
  if (kind == 0) {
    d.variant = panel_variant, d.Kp = bf16 ? K2 : K;
    TORCH_CHECK(panels.scalar_type() == dt && panels.is_contiguous() && panels.dim() >= 2 && panels.size(0) == d.P &&
                panels.size(1) == d.Kp, "decode_blocks: panels of the Linear's shape and the step's dtype");
  } else {
    d.variant = fp8_src::fp8_variant(kind - 5, bf16), d.Kp = K2;
    TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 3 &&
                panels.size(0) == d.P && panels.size(1) == K2 && t[0].scalar_type() == at::kFloat &&
                t[0].is_contiguous() && t[0].numel() == N,
                "decode_blocks: FP8 panels and float32 scales of the Linear's shape");
    d.scales = t[0].data_ptr<float>();
  }
  d.w = panels.data_ptr(), d.bytes = static_cast<int64_t>(panels.nbytes());
  return d;
}

// bytes of a Linear's panels (from its end) the threads other than 0 pull into their caches while thread 0 runs
// the small ops before it: at batch 1 the weights are read from memory once a token, and those threads would
// otherwise only wait
constexpr int64_t WARM_BYTES = 256 << 10;
// bytes of a Linear's panels (from its front) thread 0 requests while it waits for the team at the phase before
constexpr int64_t FRONT_BYTES = 128 << 10;

// The lines of a Linear's panels one thread requests while it would otherwise wait, a few at a time (step): thread 0
// the front of the panels (its first claims), thread t > 0 of nt its slice of the last WARM_BYTES (the back end's
// first claims), from the top down
struct Warmer {
  const char* base = nullptr;
  int64_t at = 0, lo = 0, hi = 0, stride = 64;  // the next line's offset, the range [lo, hi), the direction

  Warmer() = default;
  Warmer(const LinearDesc& d, int tid, int nt) : base(static_cast<const char*>(d.w)) {
    const int64_t bytes = d.bytes, region = std::min(bytes, WARM_BYTES);
    if (nt < 2) return;
    if (tid == 0) {
      lo = at = 0, hi = std::min(bytes, FRONT_BYTES);
      return;
    }
    const int64_t slice = (region / (nt - 1) + 63) / 64 * 64;
    hi = bytes - (tid - 1) * slice, lo = std::max(bytes - region, hi - slice), at = hi - 64, stride = -64;
  }

  // requests the next 4 lines; false when none is left
  bool step() {
    for (int i = 0; i < 4 && at >= lo && at < hi; ++i, at += stride) {
#if defined(__x86_64__)
      _mm_prefetch(base + at, _MM_HINT_T1);
#endif
    }
    return at >= lo && at < hi;
  }
};

// thread w + 1 of the nw + 1: request its slice of the Linear d's panels' back end (Warmer) until thread 0 ends the
// phase (done moves past k)
void warm(const LinearDesc& d, int w, int nw, const std::atomic<int64_t>& done, int64_t k) {
  Warmer r(d, w + 1, nw + 1);
  while (r.step() && done.load(std::memory_order_relaxed) == k) {
  }
}

// Requests the lines of [p, p + n) bytes into the caches
void request_bytes(const void* p, int64_t n) {
#if defined(__x86_64__)
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
#endif
}

// Requests the cached keys and values of positions [0, n) of one sequence (block table `table`, blocks of bs slots) in
// the plain caches kc, vc: `bytes` of each slot's row from byte `off`, rows `ld` bytes apart. A layer's attention of
// one sequence reads them right after its QKV Linear, by then evicted by the weights' stream: requested as that
// Linear starts, they arrive among its panels. SmolLM2 FP8 + FP8 head, batch 1, contexts 60-108, 2-core Zen 4 EPYC:
// the attention phase's slower thread 160-186 -> 131-140 us a token (rdtsc in the phases)
void request_kv(const void* kc, const void* vc, const int64_t* table, int64_t n, int64_t bs, int64_t ld, int64_t off,
                int64_t bytes) {
  const char *k = static_cast<const char*>(kc) + off, *v = static_cast<const char*>(vc) + off;
  for (int64_t pos = 0; pos < n; ++pos) {
    const int64_t row = (table[pos / bs] * bs + pos % bs) * ld;
    request_bytes(k + row, bytes);
    request_bytes(v + row, bytes);
  }
}

// Whether prepare may leave the layout of x's rows to the team (lay_out below): a panel Linear's several rows, laid
// out transposed (not AMX's row tiles, not an odd bf16 width's zero-padded pairs)
bool deferrable(const LinearDesc& d, const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  if (d.kind != 0 || M < 2) return false;
  if (x.scalar_type() != at::kBFloat16) return true;
  return K % 2 == 0 && !panel_src::amx_rows(d.variant, M, K / 2);
}

// Thread 0: x (M, K) contiguous through the Linear d into out (M, N), plus res (M, N) where given (res may be out).
// The rows are laid out in buf as the per-op kernels lay them out (panel: transposed, bf16 in pairs; FP8: fp32 rows
// of 2 K2, scaled by X_UP for the vector variants)
void prepare(TeamLinear& j, const LinearDesc& d, const torch::Tensor& x, const torch::Tensor* res,
             const torch::Tensor& out, std::vector<float>& buf, bool lay = true) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == out.scalar_type(),
              "decode_blocks: a Linear's input rows (M, K) contiguous, of the step's dtype");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  j.kind = d.kind, j.variant = d.variant, j.group = 4, j.unit = 0, j.bf16 = bf16, j.M = M, j.N = d.N;
  j.Kp = d.Kp, j.P = d.P, j.w = d.w, j.bias = d.bias, j.scales = d.scales, j.back_passes = false;
  j.out = out.data_ptr(), j.blocked = false;
  j.res = res ? res->data_ptr() : nullptr;
  j.reset();
  if (d.kind == 0) {
    const int64_t v = d.variant;
    if (M == 1 && bf16) j.claim_up_to(v == 2 ? panel_src::ROW_G_AVX2_BF16 : panel_src::ROW_G_BF16);
    if (M == 1 && (!bf16 || K % 2 == 0)) {  // one row: already laid out (a bf16 pair is 32 bits)
      j.x = x.data_ptr();
      return;
    }
    if (bf16 && panel_src::amx_rows(v, M, K2)) {  // (M rounded up to 16, K) rows, the rest zero
      buf.assign((M + 15) / 16 * 16 * K2, 0.f);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(reinterpret_cast<uint32_t*>(buf.data()) + m * K2, x.data_ptr<c10::BFloat16>() + m * K, 2 * K);
      j.x = buf.data();
      return;
    }
    if (panel_src::blocked_rows(v, M, bf16)) {  // the module path's blocks (run_blocked), its bits
      j.blocked = true;
      if (!bf16) {  // the rows as they are (x lives until the Linear has run: the step holds it)
        j.x = x.data_ptr();
        return;
      }
    }
    if (static_cast<int64_t>(buf.size()) < M * 2 * K2) buf.resize(M * 2 * K2);
    j.x = buf.data();
    if (j.blocked) {
      if (!lay && deferrable(d, x)) return;
      lay_out(j, x, 0, M);
      return;
    }
    if (!lay && deferrable(d, x)) return;  // the team lays the rows out (lay_out)
    if (bf16 && panel_src::wide_rows(v, M)) {  // (K2, M, 2) fp32, an odd K's missing input zero
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
  if (M == 1 && j.variant == 5) {  // one pass a claim; the threads claiming from the back request the group before
    j.claim_up_to(fp8_src::F8_GW);
    j.back_passes = true;
  }
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
    j.claim_passes((j.variant == 2 ? fp8_src::F8_BLOCK : 2) * fp8_src::F8_G, fp8_src::F8_G);
    // the last claims one pass each (taper): SmolLM2 FP8 + FP8 head, batch 1, 2 threads, Zen 2, the fused step timed
    // inside (three processes of each build alternating, 64 steps each): thread 0's waits at the Linears' ends 0.29-0.60
    // -> 0.17-0.24 ms a step (the step 4.5-5.1 -> 4.2-5.4 ms, the host's spread); the same bits. AVX2 (variant 2):
    // claims of F8_BLOCK passes, each one block of passes (fp8_range: longer streams)
    j.taper(fp8_src::F8_G);
  }
  if (static_cast<int64_t>(buf.size()) < M * 2 * K2) buf.resize(M * 2 * K2);
  if (K % 2)
    for (int64_t m = 0; m < M; ++m) buf[m * 2 * K2 + K] = 0.f;  // an odd K's pad input (the columns are all laid out)
  j.x = buf.data();
  if (lay) fp8_lay_cols(j, x, 0, K);  // else the team lays the row out, each thread its columns
}

}  // namespace
