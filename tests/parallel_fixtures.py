"""Helpers of the parallel tests: a thread-backed TP group and pipeline links (layers run without any
process group), an in-process TP x PP executor built on them, and small engine drivers shared by the
test files."""

from __future__ import annotations

import copy
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from engines.core.config import EngineConfig
from engines.core.executor import Executor
from engines.core.llm_engine import LLMEngine
from engines.core.plan import StepPlan, StepResult
from engines.core.sampling_params import SamplingParams
from engines.loading.checkpoint import load_model
from engines.parallel.comm import Comm
from engines.parallel.layout import ParallelLayout
from engines.parallel.pp import split_stage
from engines.parallel.tp import apply_tp
from engines.runner.model_runner import ModelRunner


class ThreadGroup:
    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n


class ThreadComm(Comm):
    """TP collectives between threads of one process (sums in rank order); with `links` (one FIFO per
    (tp rank, sending stage)), activations from stage to stage, in order (tags are not needed)."""

    def __init__(self, group: ThreadGroup, rank: int, pp_size: int = 1, pp_rank: int = 0,
                 links: dict | None = None):
        super().__init__()
        self.g, self.tp_size, self.tp_rank = group, group.n, rank
        self.pp_size, self.pp_rank, self.links = pp_size, pp_rank, links

    def send_next(self, t, tag):
        self.count("pp_send", t)
        self.links[self.tp_rank, self.pp_rank].put(t.clone())

    def recv_prev(self, shape, dtype, tag):
        t = self.links[self.tp_rank, self.pp_rank - 1].get(timeout=60)
        assert t.shape == shape and t.dtype == dtype, (t.shape, shape, t.dtype, dtype)
        return t

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.g.slots[self.tp_rank] = t
        self.g.barrier.wait()
        parts = list(self.g.slots)
        self.g.barrier.wait()
        return parts

    def all_reduce(self, t, what="tp_layer"):
        self.count(what, t)
        parts = self._exchange(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def gather(self, t, what="tp_logits"):
        if self.tp_rank:
            self.count(what, t)
        parts = self._exchange(t)
        return parts if self.tp_rank == 0 else None


class ThreadTPExecutor(Executor):
    """TP x PP shards as threads of this process, on one full model cut in memory (no loader, no
    process group): the tensor-parallel layers, the pipeline stages and the runner, tested without
    torch.distributed."""

    def __init__(self, model_dir, engine_cfg: EngineConfig):
        model, cfg = load_model(model_dir)
        tp, pp = engine_cfg.tensor_parallel_size, engine_cfg.pipeline_parallel_size
        self.layout = layout = ParallelLayout.build(cfg, tp, pp)
        groups = [ThreadGroup(tp) for _ in range(pp)]
        links = {(t, s): queue.Queue() for t in range(tp) for s in range(pp)}
        self.runners = []
        for r in range(layout.world_size):
            tp_rank, pp_rank = layout.coords(r)
            comm = ThreadComm(groups[pp_rank], tp_rank, pp, pp_rank, links)
            start, end = layout.stages[pp_rank]
            stage = apply_tp(split_stage(copy.deepcopy(model), start, end), cfg, comm)
            self.runners.append(ModelRunner(model_dir, engine_cfg, stage, layout=layout, rank=r, comm=comm))
        self.num_blocks = self.runners[0].num_blocks
        self.model_config = cfg
        self.pool = ThreadPoolExecutor(layout.world_size)

    def execute_with_logits(self, plan: StepPlan, want_logits: bool = True):
        outs = list(self.pool.map(lambda r: r.run(plan, want_logits), self.runners))
        return outs[self.layout.sampler_rank]

    def execute(self, plan: StepPlan) -> StepResult:
        return self.execute_with_logits(plan, False)[0]

    def shutdown(self) -> None:
        self.pool.shutdown()


class LogitsRecorder(Executor):
    """Wraps an executor that has execute_with_logits; keeps every sampled row's logits by seq id.
    `num_blocks` can be lowered to squeeze the scheduler's pool (preemption) on a shared executor."""

    def __init__(self, inner, num_blocks: int | None = None):
        self.inner = inner
        self.num_blocks = num_blocks or inner.num_blocks
        self.model_config = inner.model_config
        self.logits: dict[int, list[torch.Tensor]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        result, logits = self.inner.execute_with_logits(plan, True)
        for seq_id, row in (logits or {}).items():
            self.logits.setdefault(seq_id, []).append(row)
        return result

    def shutdown(self) -> None:
        pass


PROMPTS = [[5, 17, 42, 9, 77, 3, 150, 8], [101, 7, 7, 230, 12], list(range(20, 60)), [300, 2, 99]]


def run_engine(model_dir, executor, engine_cfg: EngineConfig, prompts=PROMPTS, params=None,
               arrivals: list[int] | None = None):
    """Drive an LLMEngine on `executor`; request i joins at step arrivals[i] (continuous batching).
    Returns {request index: output token ids} and the engine."""
    engine = LLMEngine(model_dir, engine_cfg, executor_factory=lambda d, c: executor)
    params = params or [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    arrivals = arrivals or [0] * len(prompts)
    step, added, outs = 0, 0, {}
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while added < len(prompts) or engine.has_unfinished_requests():
        while added < len(prompts) and arrivals[order[added]] <= step:
            i = order[added]
            engine.add_request(f"r{i}", prompts[i], params[i])
            added += 1
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id[1:])] = [list(c.token_ids) for c in out.outputs]
        step += 1
    return outs, engine


def reference_logits(model_dir, token_ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits that produced each generated token, from one plain full-sequence forward (no cache)."""
    model, _ = load_model(model_dir)
    with torch.no_grad():
        h = model(torch.tensor(token_ids)[None])[0]  # (T, C)
        return model.logits(h[prompt_len - 1:len(token_ids) - 1])  # (generated, V)


def make_own_checkpoint(out_dir, **cfg_fields):
    """A random checkpoint of any shape, written by our own saver (no tokenizer: prompts are ids)."""
    from engines.core.config import ModelConfig
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    cfg = ModelConfig(**cfg_fields)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.normal_(0, 0.02)
    save_checkpoint(model, cfg, out_dir)
    return out_dir


def max_logit_error(model_dir, prompts, outs, recorded: dict[int, list[torch.Tensor]]) -> float:
    """Largest |logit - reference| over every generated token (request i is seq i)."""
    err = 0.0
    for i, p in enumerate(prompts):
        ref = reference_logits(model_dir, p + outs[i][0], len(p))
        got = torch.stack(recorded[i])
        assert got.shape == ref.shape, (got.shape, ref.shape)
        err = max(err, (ref - got).abs().max().item())
    return err
