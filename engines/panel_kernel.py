"""A CPU Linear kernel for the few rows of a decode step: y = x @ W^T + b on a weight stored in panels.

At 1-32 rows a Linear is neither one matrix-vector product nor a big GEMM, and the kernels torch
ships are tuned for the two ends: on the 2-core EPYC of BENCHMARKS.md (issue 12) oneDNN's
prepacked fp32 kernel ran GPT-2-124M's decode Linears at 14 GB/s for one row (the machine streams
35) and at ~100 GFLOP/s for 16 rows (the fp32 peak is ~190). Here the weight (N, K) is stored once
as panels (ceil(N / 16), K, 16): 16 output features side by side for each input feature, so a
panel is one sequential read. One task per panel on torch's intra-op threads keeps up to 16 rows x
16 outputs of fp32 sums in vector registers, and for each input feature loads 16 weights once and
multiplies them by each row's value (the rows are transposed first, so those values are adjacent).
More rows run in blocks of 16 over the same panel while it is in cache.

The weight may be bf16 (widened on load: a bf16 is the high half of an fp32); sums are fp32; the
result is rounded to the input's dtype. Every output element is one sequential sum over K in
order, computed by one thread: the result does not depend on the thread count. Vectors are GCC
vector extensions, so -march=native makes them AVX-512 or two AVX2 registers. Built once per
machine (engines/cpp_ext.py); engines/fast_linear.py times it against torch's kernels for each
shape and row count and uses it only where it measured faster.
"""

from __future__ import annotations

import functools

import torch

from engines.cpp_ext import build

PANEL = 16
"""Output features per panel (one AVX-512 register of fp32)."""

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t NR = 16;  // outputs per panel
constexpr int MR = 16;      // rows per block: MR vector accumulators
typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load16(const float* p) { vf v; std::memcpy(&v, p, sizeof(vf)); return v; }
inline vf load16(const c10::BFloat16* p) {  // widen: a bf16 is the high 16 bits of an fp32
  vh h; std::memcpy(&h, p, sizeof(vh));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof(vf)); return v;
}

// acc (R, NR) = xt[:, :R]^T (R, K) @ w (K, NR); xt holds the rows transposed, ldx apart per k
template <int R, typename T>
inline void block(const float* xt, int64_t ldx, const T* w, int64_t K, float* acc) {
  vf c[R];
  for (int m = 0; m < R; ++m) c[m] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const vf b = load16(w + k * NR);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < R; ++m) c[m] += xk[m] * b;
  }
  for (int m = 0; m < R; ++m) std::memcpy(acc + m * NR, &c[m], sizeof(vf));
}

template <typename T>
void rows_block(int r, const float* xt, int64_t ldx, const T* w, int64_t K, float* acc) {
  switch (r) {
#define ROWS(i) case i: block<i>(xt, ldx, w, K, acc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15)
#undef ROWS
    default: block<MR>(xt, ldx, w, K, acc); break;
  }
}

template <typename T>
void run(const float* xt, int64_t M, int64_t K, const T* w, int64_t N, const float* bias, T* out) {
  const int64_t P = (N + NR - 1) / NR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float acc[MR * NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, nn = std::min(NR, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int r = static_cast<int>(std::min<int64_t>(MR, M - m0));
        rows_block<T>(r, xt + m0, M, w + p * K * NR, K, acc);
        for (int m = 0; m < r; ++m)
          for (int64_t j = 0; j < nn; ++j)
            out[(m0 + m) * N + n0 + j] = static_cast<T>(acc[m * NR + j] + (bias ? bias[n0 + j] : 0.f));
      }
    }
  });
}

}  // namespace

// weight (N, K) -> panels (ceil(N / 16), K, 16), the padded outputs' weights zero
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: a 2-D weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  auto padded = torch::zeros({P * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

// x (M, K), panels (P, K, 16) of a weight with N outputs, optional bias (N) -> (M, N) in x's dtype
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR && panels.size(1) == x.size(1),
              "panel_linear: x (M, K) and panels (P, K, 16)");
  TORCH_CHECK(panels.is_contiguous() && panels.size(0) == (N + NR - 1) / NR, "panel_linear: panels of N outputs");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "panel_linear: x and the weight must share a dtype");
  const int64_t M = x.size(0), K = x.size(1);
  auto xt = x.to(torch::kFloat).t().contiguous();  // (K, M): one input feature's row values adjacent
  auto out = torch::empty({M, N}, x.options());
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(torch::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  if (x.scalar_type() == torch::kFloat)
    run<float>(xt.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, bp, out.data_ptr<float>());
  else if (x.scalar_type() == torch::kBFloat16)
    run<c10::BFloat16>(xt.data_ptr<float>(), M, K, panels.data_ptr<c10::BFloat16>(), N, bp,
                       out.data_ptr<c10::BFloat16>());
  else
    TORCH_CHECK(false, "panel_linear: float32 or bfloat16, got ", x.scalar_type());
  return out;
}
"""

DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable); built on first use (~25 s on 2 cores)."""
    return build("shardserve_panel_", _SOURCE, ["pack_panels", "panel_linear"], "CPU panel Linear kernel")


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load()[0] is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> (ceil(N / 16), K, 16) panels, a copy."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    return mod.pack_panels(weight.detach())


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) through the panels of an (out_features, K) weight (+ bias) -> (M, out_features)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    return mod.panel_linear(x, panels, out_features, bias)
