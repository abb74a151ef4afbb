"""A CPU decode step's transformer blocks in one C++ call: no Python between the ops.

At batch 1 a GPT-2-124M decode token is ~10 ms of weight streaming (the Linears) and, in the
module path, ~1.7 ms of ~300 small ops each entered from Python (norms, the QKV split, KV writes,
attention, GELU, residual adds, FastLinear's dispatch; BENCHMARKS.md issue 12 run 12): the host
waits on the interpreter while no weight is read. Here the blocks of a decode-only step run as one
C++ function calling the same kernels in the same order as engines/model.py with FastLinear "panel"
Linears and engines/paged_kernel attention: at::layer_norm, the panel Linear (engines/panel_kernel.py)
with its bias, the KV writes (one memcpy a row: what index_copy_ does), paged decode attention, the
output projection plus the residual (added in the Linear's store loop, after its result is rounded,
as torch's add), layer_norm, the up projection, GELU, the down projection plus the residual. The same
arithmetic on the same inputs: the hidden states are bitwise those of the module path (tests). The
blocks' ~170 weight and cache tensors are handed to C++ once (`bind`); a step passes a handle.

It applies where the module path would run exactly those kernels: a GPT-2-style model (LayerNorm,
GELU, learned positions, no gated MLP) on CPU, every block Linear a FastLinear whose timed choice for
this row count and thread count is "panel", decode attention through the paged kernel, a decode-only
step. Anything else (prefill chunks, TP / PP shards, FP8 layers, Llama, another kernel chosen, more
than BULK_FROM - 1 rows) runs the module path. The source is the panel and paged kernels' own
source, each in a namespace of its own, plus the loop below: one build (~40 s on 2 cores, once per
machine, engines/cpp_ext.py); EngineConfig.fused_decode "off" never builds or uses it.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from engines import paged_kernel, panel_kernel
from engines.cpp_ext import build

_LOOP = r"""
namespace {
c10::optional<torch::Tensor> given(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// cache[slots[m]] = qkv[m, off:off + n] for each of the step's M rows (what index_copy_ does), one
// memcpy a row where the cache is a contiguous (slots, n) table of qkv's dtype; index_copy_ otherwise
void write_rows(const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& qkv, int64_t off,
                int64_t nkv, int64_t hd) {
  const int64_t M = qkv.size(0), n = nkv * hd;
  if (!cache.is_contiguous() || cache.scalar_type() != qkv.scalar_type() || !qkv.is_contiguous() ||
      slots.scalar_type() != at::kLong || !slots.is_contiguous() || cache.numel() != cache.size(0) * n) {
    cache.index_copy_(0, slots, qkv.narrow(1, off, n).view({M, nkv, hd}));
    return;
  }
  const int64_t S = cache.size(0), ld = qkv.size(1), es = qkv.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(qkv.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sp[m] >= 0 && sp[m] < S, "decode_blocks: cache slot ", sp[m], " out of range [0, ", S, ")");
    std::memcpy(dst + sp[m] * n * es, src + (m * ld + off) * es, n * es);
  }
}

// the tensors of one model's blocks, bound once (bind): a step passes a handle, not ~170 tensors
struct Bound {
  std::vector<torch::Tensor> w, k_caches, v_caches;
};
std::mutex bound_mu;
std::vector<std::shared_ptr<Bound>> bound;
}  // namespace

// x (M, C): the step's M decode tokens after the embeddings; w: 12 tensors a layer (norm1 weight,
// bias; qkv panels, bias; proj panels, bias; norm2 weight, bias; up panels, bias; down panels, bias;
// an empty tensor for no bias); k_caches / v_caches (slots, nkv, hd) a layer; slots (M) int64 cache
// slots of this step's keys; table (M, max_blocks), lens (M) as paged_decode -> (M, C) after the blocks
torch::Tensor decode_blocks(torch::Tensor x, const std::vector<torch::Tensor>& w,
                            const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                            torch::Tensor slots, torch::Tensor table, torch::Tensor lens, int64_t block_size,
                            int64_t n_head, int64_t ffn, double eps, bool gelu_tanh) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && static_cast<int64_t>(w.size()) == 12 * L &&
              static_cast<int64_t>(v_caches.size()) == L, "decode_blocks: x (M, C), 12 tensors and 2 caches a layer");
  const int64_t M = x.size(0), C = x.size(1);
  const int64_t nkv = k_caches[0].size(1), hd = k_caches[0].size(2);
  const int64_t qn = n_head * hd, kn = nkv * hd;
  const c10::string_view approximate = gelu_tanh ? "tanh" : "none";
  x = x.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = w.data() + 12 * l;
    auto h = at::layer_norm(x, {C}, p[0], p[1], eps);
    auto qkv = panel_src::panel_linear(h, p[2], qn + 2 * kn, given(p[3]));  // (M, qn + 2 kn)
    write_rows(k_caches[l], slots, qkv, qn, nkv, hd);
    write_rows(v_caches[l], slots, qkv, qn + kn, nkv, hd);
    auto y = paged_src::paged_decode(qkv.narrow(1, 0, qn).view({M, n_head, hd}), k_caches[l], v_caches[l],
                                     table, lens, block_size);  // (M, nh, hd)
    x = panel_src::panel_linear_res(y.view({M, qn}), p[4], C, given(p[5]), x);  // x + proj(y)
    h = at::layer_norm(x, {C}, p[6], p[7], eps);
    auto u = at::gelu(panel_src::panel_linear(h, p[8], ffn, given(p[9])), approximate);
    x = panel_src::panel_linear_res(u, p[10], C, given(p[11]), x);  // x + down(u)
  }
  return x;
}

int64_t bind(std::vector<torch::Tensor> w, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
  TORCH_CHECK(!k_caches.empty() && w.size() == 12 * k_caches.size() && v_caches.size() == k_caches.size(),
              "bind: 12 tensors and 2 caches a layer");
  std::lock_guard<std::mutex> g(bound_mu);
  bound.push_back(std::make_shared<Bound>(Bound{std::move(w), std::move(k_caches), std::move(v_caches)}));
  return static_cast<int64_t>(bound.size()) - 1;
}

void unbind(int64_t handle) {
  std::lock_guard<std::mutex> g(bound_mu);
  if (handle >= 0 && handle < static_cast<int64_t>(bound.size())) bound[handle].reset();
}

// decode_blocks on the tensors bound under `handle`
torch::Tensor decode_bound(int64_t handle, torch::Tensor x, torch::Tensor slots, torch::Tensor table, torch::Tensor lens,
                           int64_t block_size, int64_t n_head, int64_t ffn, double eps, bool gelu_tanh) {
  std::shared_ptr<Bound> b;
  {
    std::lock_guard<std::mutex> g(bound_mu);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound.size()) && bound[handle], "decode_bound: no tensors bound as ", handle);
    b = bound[handle];
  }
  return decode_blocks(x, b->w, b->k_caches, b->v_caches, slots, table, lens, block_size, n_head, ffn, eps, gelu_tanh);
}
"""


def _split(source: str) -> tuple[list[str], str]:
    """(its #include lines, the rest): the includes go to the top of the combined source, the rest
    into a namespace (an #include inside a namespace would put the library in it)."""
    includes = re.findall(r"^#include [<\"].*[>\"]$", source, flags=re.MULTILINE)
    return includes, re.sub(r"^#include [<\"].*[>\"]$", "", source, flags=re.MULTILINE)


def combined_source() -> str:
    """The panel kernel's and the paged kernel's sources, each in a namespace, then the loop."""
    parts, includes = [], []
    for name, src in (("panel_src", panel_kernel._SOURCE), ("paged_src", paged_kernel._SOURCE)):
        inc, body = _split(src)
        includes += [i for i in inc if i not in includes and "immintrin" not in i]
        parts.append(f"namespace {name} {{\n{body}\n}}  // namespace {name}\n")
    # immintrin.h only where the panel kernel uses it (its own guard, kept in its body, is now empty)
    head = "\n".join(includes) + "\n#include <memory>\n#include <mutex>\n#include <vector>\n#if defined(__AVX512BF16__)\n#include <immintrin.h>\n#endif\n"
    return head + "".join(parts) + _LOOP


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable); built on first use."""
    return build("shardserve_fused_", combined_source(), ["decode_blocks", "bind", "unbind", "decode_bound"],
                 "CPU fused decode step")


def why_not(model: nn.Module, device: torch.device) -> str | None:
    """Why the fused step cannot run this model here (None: it can, for some row and thread counts)."""
    from engines.fast_linear import FastLinear

    cfg = getattr(model, "cfg", None)
    if device.type != "cpu":
        return "not a CPU engine"
    if cfg is None or cfg.model_type != "gpt2" or cfg.activation not in ("gelu", "gelu_tanh") or cfg.uses_rope:
        return "only GPT-2-style models (LayerNorm, GELU, learned positions)"
    blocks = list(getattr(model, "blocks", []))
    if not blocks:
        return "no transformer blocks"
    for block in blocks:
        if not isinstance(block.norm1, nn.LayerNorm) or not isinstance(block.norm2, nn.LayerNorm):
            return "a block's norm is not a LayerNorm"
        for lin in (block.attn.qkv, block.attn.proj, block.mlp.up, block.mlp.down):
            if not isinstance(lin, FastLinear) or lin.panels is None:
                return "a block Linear has no panel-kernel copy (another kernel was chosen, or FP8 / TP layers)"
    return None


class FusedDecode:
    """The blocks of a GPT-2-style model as one C++ call for decode-only steps (see the module doc)."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        mod, why = load()
        if mod is None:
            raise RuntimeError(why)
        self.mod, self.model, cfg = mod, model, model.cfg
        self.k_caches, self.v_caches = k_caches, v_caches
        empty = torch.empty(0)
        self.linears = [lin for b in model.blocks for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down)]
        self.weights: list[torch.Tensor] = []
        for b in model.blocks:
            a, m = b.attn, b.mlp
            self.weights += [b.norm1.weight, b.norm1.bias, a.qkv.panels, _bias(a.qkv, empty), a.proj.panels,
                             _bias(a.proj, empty), b.norm2.weight, b.norm2.bias, m.up.panels, _bias(m.up, empty),
                             m.down.panels, _bias(m.down, empty)]
        self.handle = mod.bind(self.weights, k_caches, v_caches)  # held in C++: a step passes only the handle
        self.n_head, self.ffn, self.eps = cfg.n_head, cfg.ffn_dim, cfg.norm_eps
        self.gelu_tanh = cfg.activation == "gelu_tanh"
        self._ok: dict[tuple[bool, bool], bool] = {}

    def usable(self, rows: int) -> bool:
        """Whether every block Linear runs the panel kernel at `rows` rows on this thread count (the
        module path's choice, FastLinear.forward): only then are the two paths the same ops."""
        from engines.fast_linear import BULK_FROM

        if rows >= BULK_FROM:
            return False
        one_thread = torch.get_num_threads() == 1
        key = (one_thread, rows == 1)
        ok = self._ok.get(key)
        if ok is None:
            ok = True
            for lin in self.linears:
                kinds = lin.single if one_thread and lin.single is not None else (lin.one, lin.many, lin.bulk)
                ok = ok and kinds[0 if rows == 1 else 1] == "panel"
            self._ok[key] = ok
        return ok

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """input_ids, positions (1, M) of M decode tokens -> hidden states (1, M, C) after the final norm."""
        model = self.model
        x = model.wte(input_ids) + model.wpe(positions)  # (1, M, C), as GPT.forward
        x = self.mod.decode_bound(self.handle, x[0], slots, table, lens, block_size, self.n_head, self.ffn,
                                  self.eps, self.gelu_tanh)
        return model.norm_f(x[None])

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            self.mod.unbind(handle)  # the engine is gone: its weights and caches may be freed


def _bias(lin: nn.Module, empty: torch.Tensor) -> torch.Tensor:
    return lin.bias if lin.bias is not None else empty
