"""A CPU paged-attention kernel for decode: one C++ op per layer for every decode sequence.

Decode attention reads each sequence's keys and values once (the step is memory-bound: a context of
L keys is 2 x L x nkv x hd elements for ~4 x L x nh x hd FLOPs). In torch ops that is either one
small SDPA call per sequence from a Python loop (single-threaded, ~0.16 ms a call at ~270 keys
on the 2-core EPYC of BENCHMARKS.md) or a gather of every context into a padded batch, which
copies the contexts once more than it reads them and measured 15-30x slower than the loop. This
kernel walks the block table in C++: one task per (sequence, query head) over torch's intra-op
thread pool (so the engine's adaptive thread count applies), keys and values read in place from
the cache, scores, softmax and the weighted sum of values in fp32 whatever the cache dtype
(bf16 / fp16 are widened on load, as the eager path's fp32 scratch does).

It is built once per machine (engines/cpp_ext.py: gcc, -O3 -march=native, keyed by the CPU's model
and flags, so a cache shared between machines never loads a binary built for another CPU). `load()`
returns None with the reason when no compiler is present or the build fails; the engine then
uses the per-sequence loop and says why (EngineConfig.decode_attention).
"""

from __future__ import annotations

import functools

import torch

from engines.cpp_ext import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t W = 16;  // lanes of the partial sums: one AVX-512 register of fp32, two of AVX2

// widen one row of hd elements to fp32 (bf16: the high half of an fp32, so a shift)
inline void widen(const float* x, float* y, int64_t n) { for (int64_t i = 0; i < n; ++i) y[i] = x[i]; }
inline void widen(const c10::BFloat16* x, float* y, int64_t n) {
  const uint16_t* r = reinterpret_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < n; ++i) { uint32_t b = uint32_t(r[i]) << 16; float f; std::memcpy(&f, &b, 4); y[i] = f; }
}
inline void widen(const double* x, float* y, int64_t n) { for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]); }
inline void widen(const c10::Half* x, float* y, int64_t n) { for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]); }

// W-lane partial sums so the compiler vectorizes the reduction without reassociation flags
inline float dot(const float* a, const float* b, int64_t n) {
  float part[W] = {0.f};
  int64_t i = 0;
  for (; i + W <= n; i += W)
    for (int64_t j = 0; j < W; ++j) part[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int64_t j = 0; j < W; ++j) s += part[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// one (sequence, head) pair: out[hd] = softmax(scale * K q) V over the sequence's first len slots;
// kc / vc point at this head's first element, row = elements between slots
template <typename T>
void attend_one(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t bs,
                int64_t row, int64_t hd, float scale, float* qf, float* scores, float* acc, float* tmp, T* out) {
  widen(q, qf, hd);
  for (int64_t d = 0; d < hd; ++d) qf[d] *= scale;
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + (table[t / bs] * bs + t % bs) * row;
    float s;
    if constexpr (std::is_same_v<T, float>) s = dot(qf, k, hd);  // fp32 read in place
    else { widen(k, tmp, hd); s = dot(qf, tmp, hd); }
    scores[t] = s;
    mx = s > mx ? s : mx;
  }
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) { scores[t] = std::exp(scores[t] - mx); sum += scores[t]; }
  for (int64_t d = 0; d < hd; ++d) acc[d] = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    const T* v = vc + (table[t / bs] * bs + t % bs) * row;
    const float p = scores[t];
    if constexpr (std::is_same_v<T, float>) { for (int64_t d = 0; d < hd; ++d) acc[d] += p * v[d]; }
    else { widen(v, tmp, hd); for (int64_t d = 0; d < hd; ++d) acc[d] += p * tmp[d]; }
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < hd; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

}  // namespace

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
  auto out = torch::empty_like(q);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, S * nh, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(lmax + 3 * hd);  // scores (lmax), scaled q, accumulator, a widened row (hd each)
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / nh, h = i % nh, kvh = h / group;
        attend_one<scalar_t>(qp + i * hd, kp + kvh * hd, vp + kvh * hd, tab + s * mb, ln[s], block_size, row, hd,
                             scale, buf.data() + lmax, buf.data(), buf.data() + lmax + hd, buf.data() + lmax + 2 * hd,
                             op + i * hd);
      }
    });
  });
  return out;
}
"""


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable). Builds on first use (~20 s on 2
    cores), then loads from torch's extension cache."""
    return build("shardserve_paged_", _SOURCE, ["paged_decode"], "CPU paged-attention kernel")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q (S, nh, hd), caches (slots, nkv, hd), table (S, max_blocks) int64, lens (S) int64 -> (S, nh, hd)."""
    mod, why = load()
    if mod is None:
        raise RuntimeError(why)
    return mod.paged_decode(q, k_cache, v_cache, table, lens, block_size)
