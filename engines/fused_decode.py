"""A CPU decode step's transformer blocks in one C++ call: no Python between the ops.

At batch 1 a GPT-2-124M decode token is ~10 ms of weight streaming (the Linears) and, in the
module path, ~1.7 ms of ~300 small ops each entered from Python (norms, the QKV split, KV writes,
attention, GELU, residual adds, FastLinear's dispatch; BENCHMARKS.md issue 12 run 12): the host
waits on the interpreter while no weight is read. Here the blocks of a decode-only step run as one
C++ function calling the same kernels in the same order as engines/model.py with FastLinear "panel"
Linears and engines/paged_kernel attention: at::layer_norm, the panel Linear (engines/panel_kernel.py)
with its bias, the KV writes (index_copy_), paged decode attention, the output projection plus the
residual, layer_norm, the up projection, GELU, the down projection plus the residual. The same ops
on the same inputs: the hidden states are bitwise those of the module path (tests).

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
}  // namespace

// x (M, C): the step's M decode tokens after the embeddings; w: 12 tensors a layer (norm1 weight,
// bias; qkv panels, bias; proj panels, bias; norm2 weight, bias; up panels, bias; down panels, bias;
// an empty tensor for no bias); k_caches / v_caches (slots, nkv, hd) a layer; slots (M) int64 cache
// slots of this step's keys; table (M, max_blocks), lens (M) as paged_decode -> (M, C) after the blocks
torch::Tensor decode_blocks(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor table,
                            torch::Tensor lens, int64_t block_size, int64_t n_head, int64_t ffn, double eps,
                            bool gelu_tanh) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && static_cast<int64_t>(w.size()) == 12 * L &&
              static_cast<int64_t>(v_caches.size()) == L, "decode_blocks: x (M, C), 12 tensors and 2 caches a layer");
  const int64_t M = x.size(0), C = x.size(1);
  const int64_t nkv = k_caches[0].size(1), hd = k_caches[0].size(2);
  const int64_t qn = n_head * hd, kn = nkv * hd;
  const c10::string_view approximate = gelu_tanh ? "tanh" : "none";
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = w.data() + 12 * l;
    auto h = at::layer_norm(x, {C}, p[0], p[1], eps);
    auto qkv = panel_src::panel_linear(h, p[2], qn + 2 * kn, given(p[3]));  // (M, qn + 2 kn)
    auto k = qkv.narrow(1, qn, kn).view({M, nkv, hd});
    auto v = qkv.narrow(1, qn + kn, kn).view({M, nkv, hd});
    k_caches[l].index_copy_(0, slots, k);
    v_caches[l].index_copy_(0, slots, v);
    auto y = paged_src::paged_decode(qkv.narrow(1, 0, qn).view({M, n_head, hd}), k_caches[l], v_caches[l],
                                     table, lens, block_size);  // (M, nh, hd)
    x = x + panel_src::panel_linear(y.view({M, qn}), p[4], C, given(p[5]));
    h = at::layer_norm(x, {C}, p[6], p[7], eps);
    auto u = at::gelu(panel_src::panel_linear(h, p[8], ffn, given(p[9])), approximate);
    x = x + panel_src::panel_linear(u, p[10], C, given(p[11]));
  }
  return x;
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
    head = "\n".join(includes) + "\n#include <vector>\n#if defined(__AVX512BF16__)\n#include <immintrin.h>\n#endif\n"
    return head + "".join(parts) + _LOOP


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the built module, why) or (None, why it is unavailable); built on first use."""
    return build("shardserve_fused_", combined_source(), ["decode_blocks"], "CPU fused decode step")


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
        x = self.mod.decode_blocks(x[0], self.weights, self.k_caches, self.v_caches, slots, table, lens,
                                   block_size, self.n_head, self.ffn, self.eps, self.gelu_tanh)
        return model.norm_f(x[None])


def _bias(lin: nn.Module, empty: torch.Tensor) -> torch.Tensor:
    return lin.bias if lin.bias is not None else empty
