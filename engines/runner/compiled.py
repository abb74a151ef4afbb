"""torch.compile (inductor: C++ codegen on CPU, Triton on CUDA) of the static-shape decode step.

On CUDA (compile_decode "on") the compiled step is what each decode graph captures: inductor fuses
the norms, RoPE, the attention gather and FP8 activation quantization with their neighbours, and the
graph removes the launches.

The eager static step (engines.runner.decode_runner.StaticDecodeBackend) writes each layer's new keys and
values into the cache inside the step. Compiled, that in-place write into a view of a graph input
makes AOTAutograd copy the whole cache back every step (measured: 2.7 s for a batch-1 step that
takes 37 ms eagerly). So the compiled step only *reads* the cache: each row attends to its cached
context (keys at positions < pos, gathered through the block table) and to its own new key, with
one softmax over both, and returns the new keys and values; the runner writes them for all layers
with one index_copy_ after the graph (`write_new_kv`). The maths is the same attention; only the
order of the fp reductions differs from SDPA (greedy tokens compared in tests/test_engine_compile.py).

Shapes are bucketed: the batch B is a DecodeRunner bucket, the context width is the block count
of the longest row (at least 2). Both are marked dynamic, so inductor compiles one graph for B = 1
(dynamo specialises size-1 dims; a batch of one padded into the dynamic graph measured 2x slower
than its own graph, BENCHMARKS.md run 4) and one for every B >= 2 and any context: two compiles
per engine, at warm-up, instead of one per (bucket, context) pair.

Compilation needs a C++ compiler. `resolve_compile` decides once, at load, and logs why: auto falls
back to the eager path with a warning when there is none; on raises CompileUnavailable. Inductor's
caches (FX graph and AOTAutograd) live in TORCHINDUCTOR_CACHE_DIR, which this module points at
~/.cache/shardserve/inductor unless the user set it, so a second start reuses the first one's code.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MIN_CONTEXT_BLOCKS = 2
"""The context width is never 1 block: dynamo would specialise a size-1 dim into a third graph."""


class CompileUnavailable(RuntimeError):
    """compile_decode is "on" but this process cannot compile (no C++ compiler, or inductor failed)."""


def cpp_compiler() -> str | None:
    """Path of the C++ compiler inductor would run on CPU ($CXX, else c++ / g++ / clang++ on PATH)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def default_cache_dir() -> Path:
    """~/.cache/shardserve/inductor ($XDG_CACHE_HOME honoured): survives restarts, unlike /tmp."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardserve" / "inductor"


def configure_cache() -> str:
    """Point inductor's on-disk caches at default_cache_dir() unless TORCHINDUCTOR_CACHE_DIR is set
    (torch reads it at each lookup); returns the directory in use."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir()))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def resolve_compile(mode: str, device: torch.device) -> tuple[bool, str]:
    """(compile or not, why) for EngineConfig.compile_decode on `device`; raises CompileUnavailable
    when mode is "on" and compilation is impossible here."""
    if mode == "off":
        return False, "compile_decode off"
    if device.type == "cuda":
        if mode == "on":  # inductor's Triton kernels, captured inside the runner's CUDA graphs
            return True, "compile_decode on: inductor (Triton) step captured in CUDA graphs"
        return False, "compile_decode auto: CUDA replays eager-step CUDA graphs (compile_decode='on' compiles them)"
    if device.type != "cpu":
        if mode == "on":
            raise CompileUnavailable(f"compile_decode: 'on' is implemented for CPU and CUDA, not {device.type}")
        return False, f"compile_decode auto: not on {device.type}"
    cxx = cpp_compiler()
    if cxx is None:
        why = "no C++ compiler found ($CXX, c++, g++ or clang++ on PATH); inductor cannot generate CPU kernels"
        if mode == "on":
            raise CompileUnavailable(f"compile_decode: 'on' but {why}")
        log.warning("compile_decode auto: decode runs eagerly: %s", why)
        return False, why
    if mode == "auto":
        # measured on a 2-core AMD EPYC (issue 12 run 4, in BENCHMARKS.md's git history): +12-33% on bf16
        # batched decode, level in fp32 and at batch 1, ~105 s of compiling on a first start: not a default
        return False, ("compile_decode auto: eager on CPU (compiled decode gains only on bf16 batches and "
                       "costs ~100 s at a first start; compile_decode='on' opts in)")
    return True, f"compile_decode on: inductor with {cxx}"


class ReadOnlyDecodeBackend:
    """Attention of one padded decode step that reads the cache and records the new keys/values."""

    def __init__(self, data: torch.Tensor, index: torch.Tensor, mask: torch.Tensor):
        self.data, self.index, self.mask = data, index, mask  # index, mask: (B, L)
        self.new: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, hd), k/v (B, nkv, hd) -> (B, nh, hd)."""
        B, nh, hd = q.shape
        nkv = k.shape[1]
        k_cache, v_cache = self.data[layer]  # (slots, nkv, hd)
        ks, vs = k_cache[self.index], v_cache[self.index]  # (B, L, nkv, hd)
        qg = q.view(B, nkv, nh // nkv, hd).float() * hd ** -0.5  # (B, nkv, g, hd), g query heads per kv head
        s = torch.einsum("bkgd,blkd->bkgl", qg, ks.float())  # (B, nkv, g, L)
        s = s.masked_fill(~self.mask[:, None, None, :], float("-inf"))
        s_self = (qg * k.float()[:, :, None, :]).sum(-1, keepdim=True)  # (B, nkv, g, 1): the row's own key
        p = torch.softmax(torch.cat([s, s_self], dim=-1), dim=-1)  # (B, nkv, g, L + 1)
        y = torch.einsum("bkgl,blkd->bkgd", p[..., :-1], vs.float()) + p[..., -1:] * v.float()[:, :, None, :]
        self.new.append(torch.stack([k, v]))  # (2, B, nkv, hd)
        return y.reshape(B, nh, hd).to(q.dtype)


def decode_step(model: torch.nn.Module, data: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The function inductor compiles: ids, pos (B,), table (B, nblk) block ids, data the whole cache
    (n_layer, 2, slots, nkv, hd), read only -> hidden (B, C) and new keys/values (n_layer, 2, B, nkv, hd)."""
    B, nblk = table.shape
    offsets = torch.arange(block_size, device=table.device)
    index = (table[:, :, None] * block_size + offsets).reshape(B, nblk * block_size)  # (B, L) cache slots
    mask = torch.arange(nblk * block_size, device=table.device)[None, :] < pos[:, None]  # keys before pos
    backend = ReadOnlyDecodeBackend(data, index, mask)
    hidden = model(ids[None], pos[None], backend)[0]
    return hidden, torch.stack(backend.new)


def write_new_kv(data: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """All layers' new keys and values into their slots: one index_copy_ over (n_layer * 2) planes."""
    L2 = data.shape[0] * data.shape[1]
    data.view(L2, *data.shape[2:]).index_copy_(1, slots, new.view(L2, *new.shape[2:]))


class CompiledDecode:
    """decode_step compiled with inductor for one model; `compile_s` sums the warm-up compiles."""

    def __init__(self, model: torch.nn.Module, block_size: int, freezing: bool = False):
        configure_cache()
        self.model, self.block_size = model, block_size
        # no freezing by default: with frozen weights (constants prepacked for oneDNN) the bf16 mix ran
        # ~4-16% faster, but AOTAutograd refuses to cache such graphs and a second start recompiled
        # for 77 s instead of 10 s (BENCHMARKS.md, issue 12, run 4)
        self.fn = torch.compile(self._step, fullgraph=True, dynamic=None, options={"freezing": freezing})
        self.compile_s = 0.0

    def _step(self, data, ids, pos, table):
        return decode_step(self.model, data, ids, pos, table, self.block_size)

    def __call__(self, data: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                 table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for t in (ids, pos, table):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        # every engine built in one process recompiles the same code object (new model): raise the
        # limit so the 9th engine of a test run does not silently drop to eager
        with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
            return self.fn(data, ids, pos, table)

    def warm_up(self, data: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor,
                batches: tuple[int, ...]) -> None:
        """Compile (or load from the cache) the graphs of `batches` rows on the given (padded) buffers."""
        for B in batches:
            t = time.perf_counter()
            self(data, ids[:B], pos[:B], table[:B, :MIN_CONTEXT_BLOCKS])
            self.compile_s += time.perf_counter() - t
