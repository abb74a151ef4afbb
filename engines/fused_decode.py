"""A CPU decode step's transformer blocks in one C++ call: no Python between the ops.

At batch 1 a GPT-2-124M decode token is ~10 ms of weight streaming (the Linears) and, in the
module path, ~1.7 ms of ~300 small ops each entered from Python (norms, the QKV split, KV writes,
attention, GELU, residual adds, FastLinear's dispatch; BENCHMARKS.md issue 12 run 12): the host
waits on the interpreter while no weight is read; on a small model at a decode batch of 2-16 those ops
are most of the step. Here the blocks of a decode-only step run as one C++ function calling the same
kernels in the same order as engines/model.py with the kernel each FastLinear chose for the step's row
count and engines/paged_kernel attention: at::layer_norm, the QKV Linear with its bias, the KV writes
(one memcpy a row: what index_copy_ does), paged decode attention, the output projection plus the
residual (the panel kernel adds it in its store loop, after its result is rounded, as torch's add;
the other kernels through torch's add), layer_norm, the up projection, GELU, the down projection
plus the residual. The same arithmetic on the same inputs: the hidden states are bitwise those of the
module path (tests). The blocks' weight, kernel-copy and cache tensors are handed to C++ once
(`bind`); a step passes a handle and the Linears' kernel codes.

It applies where the module path would run exactly those kernels: a GPT-2-style model (LayerNorm,
GELU, learned positions, no gated MLP) on CPU, every block Linear a FastLinear whose timed choice for
this row count and thread count is one the loop calls (KERNELS: panel, packed (oneDNN's prepacked
linear), linear, pretransposed), decode attention through the paged kernel, a decode-only step.
Anything else (prefill chunks, TP / PP shards, FP8 layers, Llama, a "halves" / "gemv" / "sliced"
kernel chosen, more than BULK_FROM - 1 rows) runs the module path. The source is the panel and
paged kernels' own source, each in a namespace of its own, plus the loop below: one build (~40 s on
2 cores, once per machine, engines/cpp_ext.py); EngineConfig.fused_decode "off" never builds or uses it.
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

// one block Linear through the kernel its FastLinear chose for this step's row count, as FastLinear.run
// calls it (engines/fast_linear.py): t = (weight, bias or empty, panels, packed, weight_t; empty where not
// built); kind 0 panel, 1 packed (oneDNN on the prepacked weight), 2 linear, 3 pretransposed. With a
// residual: residual + the Linear's output (the panel kernel adds it in its store loop; the others by
// torch's add, as the module path's `x + ...`)
torch::Tensor block_linear(int64_t kind, const torch::Tensor& x, const torch::Tensor* t, int64_t N,
                           const c10::optional<torch::Tensor>& residual) {
  const auto bias = given(t[1]);
  if (kind == 0) return panel_src::panel_linear_res(x, t[2], N, bias, residual);
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
  } else {
    TORCH_CHECK(false, "decode_blocks: unknown Linear kernel ", kind);
  }
  return residual.has_value() ? *residual + y : y;
}

// the tensors of one model's blocks, bound once (bind): a step passes a handle, not ~250 tensors
struct Bound {
  std::vector<torch::Tensor> w, k_caches, v_caches;
};
std::mutex bound_mu;
std::vector<std::shared_ptr<Bound>> bound;
}  // namespace

constexpr int64_t PER_LAYER = 4 + 4 * 5;  // norm1 weight, bias, norm2 weight, bias; 5 tensors a Linear

// x (M, C): the step's M decode tokens after the embeddings; w: PER_LAYER tensors a layer (norm1 weight,
// bias, norm2 weight, bias, then for qkv, proj, up and down: weight, bias, panels, packed, weight_t, an
// empty tensor for one not built); kinds: 4 a layer, the kernel of each Linear (block_linear);
// k_caches / v_caches (slots, nkv, hd) a layer; slots (M) int64 cache slots of this step's keys;
// table (M, max_blocks), lens (M) as paged_decode -> (M, C) after the blocks
torch::Tensor decode_blocks(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                            const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                            torch::Tensor slots, torch::Tensor table, torch::Tensor lens, int64_t block_size,
                            int64_t n_head, int64_t ffn, double eps, bool gelu_tanh) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && static_cast<int64_t>(w.size()) == PER_LAYER * L &&
              static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L,
              "decode_blocks: x (M, C), ", PER_LAYER, " tensors, 4 kernels and 2 caches a layer");
  const int64_t M = x.size(0), C = x.size(1);
  const int64_t nkv = k_caches[0].size(1), hd = k_caches[0].size(2);
  const int64_t qn = n_head * hd, kn = nkv * hd;
  const c10::string_view approximate = gelu_tanh ? "tanh" : "none";
  x = x.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = w.data() + PER_LAYER * l;
    const torch::Tensor *qkv_w = p + 4, *proj_w = p + 9, *up_w = p + 14, *down_w = p + 19;
    const int64_t* kind = kinds.data() + 4 * l;
    auto h = at::layer_norm(x, {C}, p[0], p[1], eps);
    auto qkv = block_linear(kind[0], h, qkv_w, qn + 2 * kn, c10::nullopt);  // (M, qn + 2 kn)
    write_rows(k_caches[l], slots, qkv, qn, nkv, hd);
    write_rows(v_caches[l], slots, qkv, qn + kn, nkv, hd);
    auto y = paged_src::paged_decode(qkv.narrow(1, 0, qn).view({M, n_head, hd}), k_caches[l], v_caches[l],
                                     table, lens, block_size);  // (M, nh, hd)
    x = block_linear(kind[1], y.view({M, qn}), proj_w, C, x);  // x + proj(y)
    h = at::layer_norm(x, {C}, p[2], p[3], eps);
    auto u = at::gelu(block_linear(kind[2], h, up_w, ffn, c10::nullopt), approximate);
    x = block_linear(kind[3], u, down_w, C, x);  // x + down(u)
  }
  return x;
}

int64_t bind(std::vector<torch::Tensor> w, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
  TORCH_CHECK(!k_caches.empty() && static_cast<int64_t>(w.size()) == PER_LAYER * static_cast<int64_t>(k_caches.size()) &&
              v_caches.size() == k_caches.size(), "bind: ", PER_LAYER, " tensors and 2 caches a layer");
  std::lock_guard<std::mutex> g(bound_mu);
  bound.push_back(std::make_shared<Bound>(Bound{std::move(w), std::move(k_caches), std::move(v_caches)}));
  return static_cast<int64_t>(bound.size()) - 1;
}

void unbind(int64_t handle) {
  std::lock_guard<std::mutex> g(bound_mu);
  if (handle >= 0 && handle < static_cast<int64_t>(bound.size())) bound[handle].reset();
}

// decode_blocks on the tensors bound under `handle`
torch::Tensor decode_bound(int64_t handle, torch::Tensor x, std::vector<int64_t> kinds, torch::Tensor slots,
                           torch::Tensor table, torch::Tensor lens, int64_t block_size, int64_t n_head, int64_t ffn,
                           double eps, bool gelu_tanh) {
  std::shared_ptr<Bound> b;
  {
    std::lock_guard<std::mutex> g(bound_mu);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound.size()) && bound[handle], "decode_bound: no tensors bound as ", handle);
    b = bound[handle];
  }
  return decode_blocks(x, b->w, kinds, b->k_caches, b->v_caches, slots, table, lens, block_size, n_head, ffn, eps,
                       gelu_tanh);
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


KERNELS = {"panel": 0, "packed": 1, "linear": 2, "pretransposed": 3}
"""FastLinear kernels the C++ loop calls (block_linear's codes); a step whose Linears chose another runs
the module path."""


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
            if not isinstance(lin, FastLinear):
                return ("a block Linear is not a FastLinear (CPU Linear autotuning off, FP8 or TP layers): no panel "
                        "or packed kernel copies to call")
    return None


class FusedDecode:
    """The blocks of a GPT-2-style model as one C++ call for decode-only steps (see the module doc)."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        mod, why = load()
        if mod is None:
            raise RuntimeError(why)
        self.mod, self.model, cfg = mod, model, model.cfg
        empty = torch.empty(0)
        self.linears = [lin for b in model.blocks for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down)]
        weights: list[torch.Tensor] = []
        for b in model.blocks:
            weights += [b.norm1.weight, b.norm1.bias, b.norm2.weight, b.norm2.bias]
            for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down):
                weights += [lin.weight, *(t if t is not None else empty
                                          for t in (lin.bias, lin.panels, lin.packed, lin.weight_t))]
        self.handle = mod.bind(weights, k_caches, v_caches)  # held in C++ (kept alive there): a step passes the handle
        self.n_head, self.ffn, self.eps = cfg.n_head, cfg.ffn_dim, cfg.norm_eps
        self.gelu_tanh = cfg.activation == "gelu_tanh"
        self._kinds: dict[tuple[bool, bool], list[int] | None] = {}

    def kinds(self, rows: int) -> list[int] | None:
        """The kernel code (KERNELS) of every block Linear at `rows` rows on this thread count, as
        FastLinear.forward picks it; None when one of them is a kernel the C++ loop does not call
        ("halves", "gemv", "sliced") or the rows are a prefill-sized batch: the module path runs then."""
        from engines.fast_linear import BULK_FROM

        if rows >= BULK_FROM:
            return None
        one_thread = torch.get_num_threads() == 1
        key = (one_thread, rows == 1)
        if key not in self._kinds:
            codes: list[int] | None = []
            for lin in self.linears:
                chosen = lin.single if one_thread and lin.single is not None else (lin.one, lin.many, lin.bulk)
                code = KERNELS.get(chosen[0 if rows == 1 else 1])
                if code is None:
                    codes = None
                    break
                codes.append(code)
            self._kinds[key] = codes
        return self._kinds[key]

    def usable(self, rows: int) -> bool:
        """Whether the fused step runs a decode step of `rows` rows (every block Linear's kernel is one
        it calls, exactly as the module path would: the two paths are then the same ops)."""
        return self.kinds(rows) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """input_ids, positions (1, M) of M decode tokens -> hidden states (1, M, C) after the final norm."""
        model = self.model
        x = model.wte(input_ids) + model.wpe(positions)  # (1, M, C), as GPT.forward
        x = self.mod.decode_bound(self.handle, x[0], self.kinds(input_ids.shape[1]), slots, table, lens, block_size,
                                  self.n_head, self.ffn, self.eps, self.gelu_tanh)
        return model.norm_f(x[None])

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            self.mod.unbind(handle)  # the engine is gone: its weights and caches may be freed


