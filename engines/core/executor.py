"""Executors run a step plan on the model's shards and return the sampled tokens.

The contract is `execute(plan) -> StepResult`. InProcessExecutor runs one ModelRunner (engines/runner/model_runner.py) in the
driver's process; the multiprocess (torch.distributed) and Ray executors of model parallelism
implement the same three methods, so the engine never knows which one it drives.
"""

from __future__ import annotations

import abc
import contextlib
import time
from pathlib import Path

from engines.core.config import EngineConfig, ModelConfig
from engines.core.plan import StepPlan, StepResult
from engines.cpu.cpu_threads import AdaptiveThreads, engine_threads, intra_op_threads, step_class


class ExecutorError(RuntimeError):
    """A worker failed; the requests of the failed step cannot complete."""


class Executor(abc.ABC):
    num_blocks: int
    """KV blocks available on every shard (the scheduler's pool size)."""
    model_config: ModelConfig
    multi_step: bool = False
    """Whether execute takes plans of several decode steps (StepPlan.steps > 1): one runner with the whole model."""

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_health(self) -> None:
        """Raise ExecutorError when a worker is gone."""

    def prefault(self, max_bytes: int, upto_block: int) -> int:
        """Map up to `max_bytes` more of the KV cache's blocks [0, upto_block) ahead of their first writes
        (engines.model.attention.KVCache.prefault); returns n: blocks [0, n) are mapped. Executors whose caches
        live in other processes map nothing and return num_blocks (every block alike for the block manager)."""
        return self.num_blocks

    def shutdown(self) -> None:
        """Release workers and memory."""


class InProcessExecutor(Executor):
    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, model=None):
        from engines.runner.model_runner import ModelRunner

        # CPU: load (the kernel timing of engines.cpu.fast_linear included) and every step run on
        # engine_threads() intra-op threads; the caller's own setting is restored after each
        self.threads = engine_threads(engine_cfg.worker_threads) if engine_cfg.device == "cpu" else 0
        # unless worker_threads fixes it, that count is the most a step uses: each step's count is
        # chosen by measurement (engines.cpu.cpu_threads.AdaptiveThreads); results do not depend on it
        self.adaptive = (AdaptiveThreads(self.threads) if self.threads > 1 and engine_cfg.adaptive_threads
                         and engine_cfg.worker_threads == 0 else None)
        with self._threads(self.threads):
            self.runner = ModelRunner(model_dir, engine_cfg, model=model)
        if getattr(self.runner.decode_runner, "compiled", None) is not None:
            # dynamo guards on the intra-op thread count: another count would recompile the step
            self.adaptive = None
        self.num_blocks = self.runner.num_blocks
        self.model_config = self.runner.model_config
        self.multi_step = self.runner.multi_step

    @staticmethod
    def _threads(n: int) -> contextlib.AbstractContextManager[None]:
        return intra_op_threads(n) if n else contextlib.nullcontext()

    def execute(self, plan: StepPlan) -> StepResult:
        if self.adaptive is None or plan.empty:
            with self._threads(self.threads):
                return self.runner.execute(plan)
        cls = step_class(sum(len(w.token_ids) for w in (*plan.decode, *plan.prefill)), bool(plan.prefill))
        n = self.adaptive.choose(cls)
        t = time.perf_counter()
        with self._threads(n):
            result = self.runner.execute(plan)
        # a plan of several steps: the seconds of one (its first row's count; every row runs them all)
        steps = 1 + len(next(iter(result.seqs.values())).more) if plan.steps > 1 and result.seqs else 1
        self.adaptive.record(cls, n, (time.perf_counter() - t) / steps)
        return result

    def prefault(self, max_bytes: int, upto_block: int) -> int:
        return self.runner.cache.prefault(max_bytes, upto_block) if self.runner is not None else self.num_blocks

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]
