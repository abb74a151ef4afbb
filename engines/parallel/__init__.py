"""Model parallelism: tensor parallel (tp.py) and pipeline stages (pp.py) as transformations of the
plain model, a loader that reads only a shard's slices (sharded_loading.py) and the multiprocess
executor (mp_executor.py). A shard's step is engines/runner/model_runner.py, the same runner as one device's. The
Ray executor is serving/ray_executor.py; it runs the same worker loop (worker_proc.py) in actors.
"""

from __future__ import annotations

from collections.abc import Callable

from engines.core.config import EngineConfig
from engines.parallel.layout import ParallelLayout, check_parallel_config

__all__ = ["ParallelLayout", "check_parallel_config", "make_executor_factory"]


def make_executor_factory(engine_cfg: EngineConfig) -> Callable:
    """The executor for `engine_cfg`: in-process for one shard, else the multiprocess executor.
    Pass it to LLMEngine(model_dir, engine_cfg, executor_factory=...)."""
    if engine_cfg.world_size == 1:
        from engines.core.executor import InProcessExecutor

        return InProcessExecutor
    from engines.parallel.mp_executor import MultiprocExecutor

    return MultiprocExecutor
