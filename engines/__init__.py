"""The torch model engine: model, checkpoints, paged KV cache, scheduler, sampling, executors.

Imports torch, safetensors, tokenizers and numpy only, so it runs on a bare GPU host.
"""

from engines.cpu.cpu_threads import configure_openmp_env

configure_openmp_env()  # before anything imports torch: libgomp reads it once, at load

from engines.core.config import ConfigError, EngineConfig, ModelConfig
from engines.core.outputs import CompletionOutput, RequestOutput
from engines.core.plan import TokenLogprob
from engines.core.sampling_params import RequestError, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]


def __getattr__(name: str):
    # the torch-heavy parts load on first use, so `import engines` for configs stays cheap
    if name in ("LLM", "LLMEngine"):
        from engines.core import llm_engine

        return getattr(llm_engine, name)
    if name == "AsyncLLMEngine":
        from engines.core.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
