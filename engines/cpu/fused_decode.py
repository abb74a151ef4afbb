"""A CPU decode step's transformer blocks in one C++ call: no Python between the ops.

At batch 1 a GPT-2-124M decode token is ~10 ms of weight streaming (the Linears) and, in the module path,
~1.7 ms of ~300 small ops each entered from Python (norms, the QKV split, KV writes, attention, GELU,
residual adds, FastLinear's dispatch; issue 12 run 12, in BENCHMARKS.md's git history): the host waits on
the interpreter while no weight is read; on a small model at a decode batch of 2-16 those ops are most of
the step. Here the blocks of a decode-only step run as one C++ function calling the same kernels in the same
order as engines/model/transformer.py with the kernel each FastLinear chose for the step's row count and
engines/paged_kernel attention: at::layer_norm, the QKV Linear with its bias, the KV writes (one memcpy a
row: what index_copy_ does), paged decode attention, the output projection plus the residual (the panel
kernel adds it in its store loop, after its result is rounded, as torch's add; the other kernels through
torch's add), layer_norm, the up projection, GELU, the down projection plus the residual. The same
arithmetic on the same inputs: the hidden states are bitwise those of the module path (tests). The blocks'
weight, kernel-copy and cache tensors are handed to C++ once (`bind`); a step passes a handle and the
Linears' kernel codes.

Where every block Linear runs the panel or the FP8 kernel (fp32 or bf16 rows), the step is ONE OpenMP
parallel region (csrc/fused_team.cpp) instead of one a Linear and one an attention (~150 a token on
SmolLM2, each a fork and a join of the thread pool): the team walks the layers together with a spin barrier
between phases; thread 0 runs the small ops (the same ATen calls as above, so the same bits) while the
others pull the back of the next Linear's panels into their caches; then each Linear's panels are claimed
in groups from both ends (thread 0 the front, the others the back) and each group computed exactly as
the kernel computes it alone. Several sequences split the attention by sequence, one sequence by kv heads
(as the paged kernel splits them outside the team: the same bits), at any context length.

The same loop computes the Llama family (engines/fused_decode.Family): RMSNorm in place of
LayerNorm (normalised in fp32, rounded, then scaled, as engines/model/transformer.py RMSNorm), the rotary embedding
of q and k in place (rotate-half; cos / sin computed per step in Python by the model file's own rope
function, so rope scaling needs nothing here), grouped-query attention (the paged kernel reads a kv
head once for its group of query heads), the SwiGLU MLP on the fused gate/up Linear, and optional
parts that other families add: a bias on any Linear (Qwen2's qkv), per-head q / k RMSNorm before the
rotation (Qwen3). The LM head (tied or not) is outside the blocks and unchanged.

It applies where the module path would run exactly those kernels: a model whose every part the loop
knows (`family`; anything else, sliding-window attention included, is refused by name), on CPU, every
block Linear a FastLinear whose timed choice for this row count and thread count is one the loop calls
(KERNELS: panel and panel_avx2, packed (oneDNN's prepacked linear), linear, pretransposed, gemv), an FP8 weight-only
Fp8PanelLinear (its e4m3 panels through the FP8 kernel's variant the layer runs, the residual added in
the kernel's store loop as the panel kernel does) or a plain nn.Linear (F.linear), decode attention
through the paged kernel, a decode-only step. Anything else (prefill chunks, W8A8 or dequantizing FP8
layers, a "halves" / "sliced" kernel chosen, more than BULK_FROM - 1 rows) runs the module path.

Shards take it too (engines/runner/model_runner.py). A pipeline stage (engines/parallel/pp.StageModel) runs its own
layers: the first embeds, a later one starts from the hidden states it received, and only the last
applies the final norm. A tensor-parallel shard's row-parallel Linears (the attention's output and the
MLP's down projection) end in an all-reduce, which the C++ loop cannot call, so its step is split at
those points: one C++ call per half-layer (`decode_half_bound`: norm .. the closing Linear's partial
product, F.linear without bias, exactly RowParallelLinear's local product), then in Python the
all-reduce over the shard's communicator, the bias and the residual add, as RowParallelLinear and the
block compute them: 2 calls and 2 all-reduces a layer instead of ~20 Python-entered ops. The
source is the panel, FP8 and paged kernels' own source, each in a namespace of its own, plus the loop in
csrc/fused_decode.cpp, built once per machine as the engine's one C++ module (engines/cpu/kernels.py,
which binds the panel and paged kernels' functions too); EngineConfig.fused_decode "off" never uses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from engines.cpu import panel_kernel


@functools.lru_cache(maxsize=1)
def load() -> tuple[object | None, str]:
    """(the module with the loop, why) or (None, why it is unavailable): the engine's one C++ module
    (engines/cpu/kernels.py), built on first use."""
    from engines.cpu import kernels

    return kernels.load()


KERNELS = {"panel": 0, "packed": 1, "linear": 2, "pretransposed": 3, "gemv": 4, "panel_avx2": 12}
"""FastLinear kernels the C++ loop calls (block_linear's codes; "panel_avx2" after FP8's); a step whose Linears chose
another runs the module path."""
FP8_KERNEL = 5
"""block_linear's code of an FP8 weight-only Linear (engines/cpu/fp8_linear.Fp8PanelLinear) is this plus its
kernel variant's code (engines/cpu/panel_kernel.FP8_VARIANTS): the loop runs the variant the layer runs."""

HEAD_FP8_F32, HEAD_PANEL_F32 = 100, 200
"""decode_steps_bound's head codes beyond block_linear's (csrc/fused_steps.cpp): the FP8 kernel's fp32 sums (plus its
variant's code) and the bf16 panel kernel's fp32 sums, as the heads' forward_float computes them."""

ACTS = {"gelu": 0, "gelu_tanh": 1, "silu": 2}
"""The MLP activations the loop computes (its `act` codes): "silu" is the gated SwiGLU MLP."""

_CHILDREN = {"block": {"norm1", "attn", "norm2", "mlp"}, "attn": {"qkv", "proj", "resid_drop", "q_norm", "k_norm"},
             "mlp": {"up", "down", "drop"}}
"""The submodules the loop knows how to compute; a block with any other (a family's new part) runs the
module path, named in why_not."""


@dataclass(frozen=True)
class Family:
    """What the C++ loop computes differently between families, read from the built model."""

    act: int
    """ACTS code of the MLP."""
    rms: bool
    """RMSNorm block norms (Llama, Qwen, Mistral); LayerNorm otherwise (GPT-2)."""
    rope: bool
    """Rotary embedding of q and k (cos / sin from the model's own rope function, per step)."""
    qk_norm: bool
    """Per-head RMSNorm of q and k before the rotation (Qwen3)."""
    qk_eps: float
    """Those norms' epsilon (0 where there are none)."""


def given(t: torch.Tensor | None) -> torch.Tensor:
    """t, or an empty tensor for a part not built (the C++ loop's "none")."""
    return t if t is not None else torch.empty(0)


def linear_tensors(lin: nn.Module, with_bias: bool = True) -> list[torch.Tensor]:
    """A Linear's 5 tensors as the C++ loop's block_linear reads them: an FP8 weight-only layer's per-output scales,
    bias and e4m3 panels; otherwise its weight (none: a FastLinear that dropped it, decode runs its panels), bias,
    panels, packed and pretransposed weights; empty where not built (the bias also where not with_bias: a
    row-parallel Linear's is added after the all-reduce)."""
    from engines.cpu.fp8_linear import Fp8PanelLinear

    bias = given(getattr(lin, "bias", None)) if with_bias else torch.empty(0)
    if isinstance(lin, Fp8PanelLinear):
        return [lin.scales, bias, lin.panels, torch.empty(0), torch.empty(0)]
    return [given(getattr(lin, "weight", None)), bias, *(given(getattr(lin, t, None)) for t in ("panels", "packed",
                                                                                               "weight_t"))]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT (a ModuleList) or of a pipeline stage (a ModuleDict), in order."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def row_parallel(lin: nn.Module) -> bool:
    """Whether a block Linear is a tensor-parallel row-parallel one (its output all-reduced)."""
    from engines.parallel.tp import RowParallelLinear

    return isinstance(lin, RowParallelLinear)


def family(model: nn.Module) -> Family | str:
    """The loop's description of this model's (or pipeline stage's) blocks, or why the loop cannot
    compute them."""
    from engines.model.transformer import RMSNorm

    cfg = model.cfg
    for field in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, field, None):
            return f"{field} is set: the fused step does not compute it"
    if cfg.activation not in ACTS:
        return f"activation {cfg.activation!r}: the fused step computes {sorted(ACTS)}"
    first = getattr(model, "first", True)  # a later pipeline stage holds no embeddings
    if (first and cfg.uses_rope != (getattr(model, "wpe", None) is None)) or (cfg.uses_rope and cfg.hd % 2):
        return "positions neither learned (wpe) nor rotary over an even head size"
    blocks = blocks_of(model)
    if not blocks:
        return "no transformer blocks"
    rms = isinstance(blocks[0].norm1, RMSNorm)
    qk = getattr(blocks[0].attn, "q_norm", None) is not None
    qk_eps = blocks[0].attn.q_norm.eps if qk else 0.0
    for i, block in enumerate(blocks):
        for part, mod in (("block", block), ("attn", block.attn), ("mlp", block.mlp)):
            extra = {n for n, _ in mod.named_children()} - _CHILDREN[part]
            if extra:
                return f"block {i} has {part} parts the fused step does not compute: {sorted(extra)}"
        for norm in (block.norm1, block.norm2):
            ok = isinstance(norm, RMSNorm) if rms else isinstance(norm, nn.LayerNorm)
            if not ok or norm.eps != cfg.norm_eps:
                return f"block {i}: norms neither all RMSNorm nor all LayerNorm with eps {cfg.norm_eps}"
        if getattr(block.attn, "kv_hook", None) is not None:
            return "a kv_hook is set (p-tuning of every layer, training)"
        if block.mlp.gated != (cfg.activation == "silu"):
            return "a gated MLP whose activation is not silu, or silu without the gate"
        for name in ("q_norm", "k_norm"):
            n = getattr(block.attn, name, None)
            if (n is not None) != qk or (n is not None and (
                    not isinstance(n, RMSNorm) or n.weight.numel() != cfg.hd or n.eps != qk_eps)):
                return f"block {i}: {name} is not an RMSNorm over the head size in every block (eps {qk_eps})"
    return Family(act=ACTS[cfg.activation], rms=rms, rope=cfg.uses_rope, qk_norm=qk, qk_eps=qk_eps)


def why_not(model: nn.Module, device: torch.device) -> str | None:
    """Why the fused step cannot run this model here (None: it can, for some row and thread counts)."""
    from engines.cpu.fast_linear import FastLinear
    from engines.cpu.fp8_linear import Fp8PanelLinear

    if device.type != "cpu":
        return "not a CPU engine"
    if getattr(model, "cfg", None) is None:
        return "not an engines.model.transformer.GPT"
    fam = family(model)
    if isinstance(fam, str):
        return fam
    for block in blocks_of(model):
        for lin in (block.attn.qkv, block.mlp.up):
            if not isinstance(lin, (FastLinear, Fp8PanelLinear)) and type(lin) is not nn.Linear:
                return (f"a block Linear is a {type(lin).__name__}, neither a FastLinear, an Fp8PanelLinear nor a "
                        "plain nn.Linear")
        for lin in (block.attn.proj, block.mlp.down):
            if (not isinstance(lin, (FastLinear, Fp8PanelLinear)) and type(lin) is not nn.Linear
                    and not row_parallel(lin)):
                return (f"a block Linear is a {type(lin).__name__}, neither a FastLinear, an Fp8PanelLinear, a "
                        "plain nn.Linear nor a tensor-parallel RowParallelLinear")
    return None


def rope(model: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (M, hd / 2) float32 of positions (1, M), from the model file's own rope function (rope
    scaling included), as GPT.forward computes them."""
    from engines.model.transformer import rope_cache

    cos, sin = rope_cache(model.cfg, positions)  # (1, M, hd / 2) each
    return cos[0].float().contiguous(), sin[0].float().contiguous()


class FusedDecode:
    """The blocks of a model or of a shard as C++ calls for decode-only steps (see the module doc):
    one call for all blocks, or, on a tensor-parallel shard, one a half-layer between its all-reduces."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        from engines.cpu.fp8_linear import Fp8PanelLinear

        mod, why = load()
        if mod is None:
            raise RuntimeError(why)
        fam = family(model)
        if isinstance(fam, str):
            raise ValueError(f"fused decode step: {fam}")  # noqa: TRY004 (a model it cannot compute)
        self.mod, self.model, self.family, cfg = mod, model, fam, model.cfg
        self.first, self.last = getattr(model, "first", True), getattr(model, "last", True)
        blocks = blocks_of(model)
        self.split = row_parallel(blocks[0].attn.proj)
        """A tensor-parallel shard: the step runs half a layer a call, all-reducing in between."""
        if any(row_parallel(lin) != self.split for b in blocks for lin in (b.attn.proj, b.mlp.down)):
            raise ValueError("fused decode step: some block Linears are row-parallel and some are not")
        self.linears = [lin for b in blocks for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down)]
        self.comm = blocks[0].attn.proj.comm if self.split else None
        # a row-parallel Linear's bias is added after the all-reduce (RowParallelLinear), in Python
        self.biases = [(b.attn.proj.bias, b.mlp.down.bias) for b in blocks] if self.split else []
        weights: list[torch.Tensor] = []
        for b in blocks:
            weights += [b.norm1.weight, given(getattr(b.norm1, "bias", None)), b.norm2.weight,
                        given(getattr(b.norm2, "bias", None))]
            weights += [given(getattr(getattr(b.attn, n, None), "weight", None)) for n in ("q_norm", "k_norm")]
            for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down):  # a plain nn.Linear: F.linear, no copies
                weights += linear_tensors(lin, with_bias=not row_parallel(lin))
        self.handle = mod.bind(weights, k_caches, v_caches)  # held in C++ (kept alive there): a step passes the handle
        # this shard's query heads and MLP width (the whole model's on one device)
        self.n_head = blocks[0].attn.n_head
        down = blocks[0].mlp.down
        dense = None if isinstance(down, Fp8PanelLinear) else down.weight  # None: no dense weight kept
        self.ffn = down.in_features if dense is None else dense.shape[1]
        self.eps = cfg.norm_eps
        self._kinds: dict[tuple[bool, bool], list[int] | None] = {}
        self._heads: dict[tuple[int, bool], tuple[int, list[torch.Tensor], int] | None] = {}
        self._rope_table = (torch.empty(0), torch.empty(0))
        """cos, sin (P, hd / 2) fp32 of positions [0, P), grown on demand: the model file's rope function run
        once over the positions rather than each step (~0.1-0.2 ms a step of a dozen small ops); elementwise, so
        each row has the bits of rope() on that position alone (the fused-vs-module tests check)."""

    def kinds(self, rows: int) -> list[int] | None:
        """The kernel code (KERNELS) of every block Linear at `rows` rows on this thread count, as
        FastLinear.forward picks it (a row-parallel Linear: F.linear, as RowParallelLinear); None when
        one of them is a kernel the C++ loop does not call ("halves", "sliced") or the rows are a
        prefill-sized batch: the module path runs then."""
        from engines.cpu.fast_linear import BULK_FROM
        from engines.cpu.fp8_linear import Fp8PanelLinear

        if rows >= BULK_FROM:
            return None
        one_thread = torch.get_num_threads() == 1
        key = (one_thread, rows == 1)
        if key not in self._kinds:
            codes: list[int] | None = []
            for lin in self.linears:
                if type(lin) is nn.Linear or row_parallel(lin):  # plain: kept by apply_fast_linear, or autotuning off
                    codes.append(KERNELS["linear"])
                    continue
                if isinstance(lin, Fp8PanelLinear):  # its kernel at any decode row count
                    codes.append(FP8_KERNEL + panel_kernel.FP8_VARIANTS[lin.variant])
                    continue
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

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """x: input ids (1, M) of M decode tokens on a first stage (one device: always), the previous
        stage's hidden states (1, M, C) otherwise; positions (1, M) -> hidden states (1, M, C), after the
        final norm on the last stage."""
        model, fam = self.model, self.family
        if self.first:  # as GPT.forward / StageModel.forward
            x = model.wte(x)  # (1, M, C)
            if not fam.rope:
                x = x + model.wpe(positions)
        cos, sin = self._rope_rows(positions) if fam.rope else (torch.empty(0), torch.empty(0))
        kinds = self.kinds(positions.shape[1])
        args = (slots, table, lens, block_size, self.n_head, self.ffn, self.eps, fam.act, fam.rms, fam.qk_eps, cos, sin)
        if not self.split:
            h = self.mod.decode_bound(self.handle, x[0], kinds, *args)
        else:
            h = x[0]
            for layer, biases in enumerate(self.biases):
                for half, bias in enumerate(biases):
                    part = self.mod.decode_half_bound(self.handle, h, layer, half, kinds[4 * layer:4 * layer + 4],
                                                      *args)  # (M, C) this rank's partial product
                    y = self.comm.all_reduce(part, "tp_layer")
                    h = h + (y + bias if bias is not None else y)
        return model.norm_f(h[None]) if self.last else h[None]

    def steps_why_not(self, rows: int) -> str | None:
        """Why run_steps cannot run `rows` rows (None: it can): it needs the whole model on one device (the embeddings,
        the blocks in one call, the final norm and the head), the blocks' kernels for this row count, and a head whose
        logits it computes as head_logits does."""
        if not (self.first and self.last) or self.split:
            return "a shard of the model (several greedy steps a call need its every part on one device)"
        if type(self.model.wte) is not nn.Embedding or (not self.family.rope and type(self.model.wpe) is not nn.Embedding):
            return "the embeddings are not plain nn.Embedding tables"
        if not self.usable(rows):
            return f"the fused step does not run {rows} rows on this thread count"
        if self._head(rows) is None:
            return f"the head ({type(self.model.lm_head).__name__}) runs a kernel the loop does not call"
        return None

    def _head(self, rows: int) -> tuple[int, list[torch.Tensor], int] | None:
        """(head_kind, its 5 tensors, its rows) of decode_steps_bound for `rows` rows: the kernel the model's head runs
        in engines/model/transformer.head_logits (forward_float where it has one), or None where it is not one the loop
        calls."""
        from engines.cpu.fast_linear import BULK_FROM, FastLinear
        from engines.cpu.fp8_linear import Fp8PanelLinear
        from engines.model.transformer import RMSNorm

        model, key = self.model, (rows, torch.get_num_threads() == 1)
        if key in self._heads:
            return self._heads[key]
        head, norm, dtype = model.lm_head, model.norm_f, model.wte.weight.dtype
        spec = None
        norm_ok = (isinstance(norm, RMSNorm) if self.family.rms else type(norm) is nn.LayerNorm)
        if norm_ok and norm.eps == self.eps and norm.weight.dtype == dtype and rows < BULK_FROM:
            t = linear_tensors(head)
            if isinstance(head, Fp8PanelLinear):  # forward_float: the kernel's fp32 sums
                spec = (HEAD_FP8_F32 + panel_kernel.FP8_VARIANTS[head.variant], t, head.out_features)
            elif isinstance(head, FastLinear):
                if head.panels is not None and dtype == torch.bfloat16 and head.bias is None:  # forward_float's path
                    spec = (HEAD_PANEL_F32, t, head.out_features)
                elif KERNELS.get(head.kind_for(rows)) is not None:
                    spec = (KERNELS[head.kind_for(rows)], t, head.out_features)
            elif type(head) is nn.Linear:
                spec = (KERNELS["linear"], t, head.out_features)
        self._heads[key] = spec
        return spec

    def run_steps(self, ids: list[int], positions: list[int], table: torch.Tensor, block_size: int, steps: int,
                  stops: list[list[int]], vocab: int, screen=None) -> torch.Tensor:
        """Up to `steps` greedy decode tokens of M sequences in one C++ call (csrc/fused_steps.cpp): ids (M) the tokens to
        feed at positions (M), table (M, blocks) covering each row's positions up to position + steps - 1, stops each
        row's stop tokens -> tokens (n, M) int64, n = steps or fewer where a row drew a stop token at step n - 1. Each
        step the same ops as run() then the head's logits (head_logits) and the argmax of their first `vocab` columns,
        or the tokens of `screen` (an engines/cpu/greedy_head.GreedyScreen of this head: its ops, the full head where it
        cannot tell), as the step head draws them (steps_why_not must be None)."""
        model, fam = self.model, self.family
        m = len(ids)
        kind, head, out = self._head(m)
        cos, sin = self._rope_upto(max(positions) + steps) if fam.rope else (torch.empty(0), torch.empty(0))
        from engines.model.attention import padded_tables

        norm = model.norm_f
        around = [model.wte.weight, given(None if fam.rope else model.wpe.weight), norm.weight,
                  given(getattr(norm, "bias", None))]
        return self.mod.decode_steps_bound(
            self.handle, torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), steps,
            self.kinds(m), table, block_size, self.n_head, self.ffn, self.eps, fam.act, fam.rms, fam.qk_eps, cos, sin,
            around, kind, head, out, vocab, padded_tables(stops, fill=-1), [] if screen is None else [screen.panels, screen.weight, screen.norms],
            0.0 if screen is None else screen.c, 0 if screen is None else panel_kernel.PANEL_VARIANTS[screen.variant])

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (M, hd / 2) fp32 of positions (1, M), rows of the table (grown to a power of two past the
        largest position asked)."""
        cos, sin = self._rope_upto(int(positions.max()) + 1)
        idx = positions[0]
        return cos.index_select(0, idx), sin.index_select(0, idx)

    def _rope_upto(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope table (cos, sin), grown to hold positions [0, top)."""
        if top > self._rope_table[0].shape[0]:
            n = 1 << max(8, (top - 1).bit_length())
            self._rope_table = rope(self.model, torch.arange(n)[None])
        return self._rope_table

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            self.mod.unbind(handle)  # the engine is gone: its weights and caches may be freed
