"""Frozen configuration of the engine; the model's shape is engines.model.model_config.ModelConfig (re-exported).

One source of truth: the CLI, the deployment schema (deploy/, which derives its EngineOptions from
EngineConfig's fields) and the tuner all build these objects; nothing changes them after
construction. Derived values are properties or pure functions of the fields. At module level this
imports the standard library and three modules of the same kind (engines.model.model_config,
engines.core.step_record, engines.core.sampling_params) only: deploy/ imports it without torch
(tests/test_deploy_schema.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.core.sampling_params import MAX_LOGPROBS
from engines.core.step_record import STEP_RECORD_MAX
from engines.model.model_config import MODEL_TYPES, ConfigError, ModelConfig, _require

__all__ = ["DTYPES", "ENGINE_DTYPES", "MODEL_TYPES", "WEIGHT_DTYPES", "ConfigError", "EngineConfig", "ModelConfig",
           "kv_bytes_per_block", "max_model_len", "num_kv_blocks", "resolve_engine_config", "resolved_dtype"]

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
ENGINE_DTYPES = ("auto", *DTYPES)
WEIGHT_DTYPES = ("auto", "fp8")
DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")
"""The torch devices the engine runs on; anything else would fail only once the engine is built
(after Ray started, under `shardserve serve`), so a config refuses it where it is read."""


@dataclass(frozen=True)
class EngineConfig:
    """Options of the inference engine; the names follow vLLM where one exists."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights, activations and KV cache. auto: bfloat16 where the hardware has native bf16 (AMX or
    AVX512-BF16 CPUs, confirmed by a forward probe; bf16-capable CUDA GPUs), float32 otherwise
    (engines/core/hardware.py). The engine resolves it once, when it is built, into a new config with
    the concrete dtype, and logs why; `resolved_dtype` gives it for a config not yet resolved."""
    device: str = "cpu"
    """cpu, cuda or cuda:N (DEVICE); shard workers take cuda:rank on a multi-GPU host."""
    weight_dtype: Literal["auto", "fp8"] = "auto"
    """Storage of the blocks' Linear weights. auto: what the checkpoint holds (FP8 for a
    compressed-tensors FP8 file, else `dtype`). fp8: FP8 e4m3 with per-channel scales, quantizing
    a float checkpoint at load. FP8 runs W8A8 (torch._scaled_mm) on CUDA with compute capability
    >= 8.9 and is dequantized to `dtype` at load elsewhere (engines/transforms/fp8.py)."""
    lm_head_dtype: Literal["auto", "fp8"] = "auto"
    """Storage of the LM head used for the logits. auto: the model's head in `dtype`. fp8: a per-row
    (per vocabulary entry) scaled e4m3 copy of the head, one byte a weight, for the logits only; the
    embedding lookup of a tied head stays in `dtype` (engines/transforms/fp8.py apply_fp8_head). At batch
    1 the head is a fifth of SmolLM2-135M's bf16 bytes a token and a third of its FP8 file's; CPU only (a
    non-CPU engine refuses it), on one device or a pipeline stage (a tensor-parallel vocabulary shard keeps
    its head). The codes are the GPTQ ones `shardserve quantize --calibration` writes to fp8_head/ where the
    directory has them, else rounded to nearest at load: on SmolLM2-135M (8 x 256 validation tokens) the GPTQ
    FP8 file with its GPTQ head measured -0.148 % perplexity against bf16, a round-to-nearest head alone
    +2.14 %."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = 0
    """Memory budget of the paged KV cache (all layers, keys and values); 0 sizes it from the
    device's memory with kv_cache_memory_fraction (see engines.core.kv_sizing). A CPU cache sized
    here (or by num_kv_blocks) is mapped whole before the engine runs, as vLLM allocates its own
    (engines/core/llm_engine.py LLMEngine._map_cache: on a 2-core EPYC VM 5-9 s a GiB of start, and
    TTFT p90 of a first 64-stream burst ~13 s against ~17-19 s with its pages mapped on first write)."""
    kv_cache_memory_fraction: float = 0.9
    """With kv_cache_bytes 0: the fraction of the device's memory this engine may hold in all
    (like vLLM's gpu_memory_utilization, default 0.9). On CUDA: of the device's total memory, less
    what is already in use after the weights are loaded. On CPU: of the memory available to the
    process (MemAvailable, and the cgroup limit if lower) after the weights are loaded. Pages of
    a CPU cache are only touched as blocks are used (a serving engine, while idle, maps them up to
    512 MiB above the blocks used so far: engines/core/async_engine.py PREFAULT_AHEAD)."""
    num_kv_blocks: int = 0
    """Explicit number of KV blocks; 0 derives it from kv_cache_bytes."""
    max_num_seqs: int = 64
    """Most sequences in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunk tokens). 2048 is vLLM's CPU default for
    its OpenAI server (its LLM class: 4096): on SmolLM2 bf16, 2-core Xeon, the offline 64-request mix
    ran at 523 / 583 tok/s against 498 / 492 with 1024 (two alternating runs; prefill chunks of 2048
    tokens keep the cores busier), at the cost of a longer step (decode rows wait ~0.4 s) while a long
    prompt is prefilled."""
    max_model_len: int = 0
    """Longest prompt + output; 0 means the model's max_position_embeddings."""
    admission_reserves_growth: bool = True
    """Admission keeps the blocks the running sequences will still need (their max_tokens), so an
    admitted stream is not preempted mid-way by later arrivals (bounded inter-token gaps); off
    admits optimistically (more sequences per step, recompute preemption when blocks run out)."""
    admission_overtakes: int = 64
    """Waiting requests are admitted shortest prompt first while the KV cache and max_num_seqs take every one of
    them (64 streams of 16-256-token prompts at once, served fp32 SmolLM2 on 2 cores: time to first token mean
    7.47 -> 6.26 s, p50 8.79 -> 5.97 s, p90 11.83 -> 12.13 s; engines/core/scheduler.py), but no request is passed
    over by more than this many later arrivals; 0 admits in arrival order."""
    whole_prompt_steps: bool = True
    """A step that already prefills a prompt starts no prompt it cannot finish (chunked prefill splits only a prompt
    alone in its step, decodes aside): a first token comes at the end of the step that finishes its prompt, and the
    next prompt's first chunk would hold back every prompt the step finishes. 64 prompts of 16-256 tokens at once,
    the Scheduler under a cost model of 2-core fp32 SmolLM2 (2,048-token steps, 30 draws): time to first token p50
    5.00 -> 4.84 s, p90 10.70 -> 10.63 s (per draw 0.93-1.12x: a percentile moves a whole step or not at all),
    output tok/s the same; off: the budget's rest goes to the next prompt's first chunk."""
    seed: int = 0
    """Seed of the engine's default generator (requests without their own seed)."""
    max_logprobs: int = 20
    greedy_head_screen: bool = True
    """On CPU with an fp32 head: the tokens of greedy rows (nothing that needs their whole logit row) from a bf16 pass
    over the head and fp32 logits of the entries within a proven bound of the best (engines/cpu/greedy_head.py), where
    that times faster than the full head at load; off: every sampled row's fp32 logits."""
    cpu_linear_autotune: bool = True
    """On CPU, time each Linear shape's kernels (F.linear, addmm on a transposed weight, mv, oneDNN
    on a reordered weight) at load for one row, a decode batch and a prefill chunk, keep the fastest
    of each (engines/cpu/fast_linear.py), and save the choices per CPU, torch build and thread count
    (SHARDSERVE_FAST_LINEAR_CACHE; "" saves nothing); off keeps the model's plain nn.Linear layers."""
    static_decode: Literal["auto", "on", "off"] = "auto"
    """Decode-only steps through engines.runner.decode_runner (padded batch buckets, persistent buffers,
    no host sync in the step). auto: on for CUDA, off on CPU, where the eager per-sequence
    in-place attention measured faster."""
    cuda_graphs: bool = True
    """With the static decode path on CUDA: capture one CUDA graph per bucket and replay it."""
    cuda_graph_capture_s: float = 30.0
    """CUDA: seconds the engine may spend at load capturing decode graphs for the batch and context
    buckets its max_num_seqs and max_model_len allow (every batch bucket's widest context first);
    steps later use the nearest captured context and never capture. 0 captures lazily instead, the
    first time a (batch, context) bucket is met, while that step's requests wait."""
    compile_decode: Literal["auto", "on", "off"] = "auto"
    """CUDA: "on" compiles the static decode step (inductor, Triton) and captures the compiled step in
    the CUDA graphs; auto replays graphs of the eager step. CPU: compile the static decode step with torch.compile (inductor's C++ kernels), two graphs
    (batch 1; any batch >= 2 and context) compiled at load and cached on disk (engines/runner/compiled.py).
    on: turns the static decode path on and fails at load if no C++ compiler is found or inductor
    fails. auto: eager decode on CPU (measured on a 2-core AMD EPYC: bf16 batched decode +12-33%,
    fp32 and batch 1 level, a first start ~105 s of compiling: issue 12 run 4, in BENCHMARKS.md's git
    history); where no compiler is found it says so with a warning. off: never."""
    decode_attention: Literal["auto", "kernel", "loop"] = "auto"
    """CPU decode attention of the eager step. kernel: engines.cpu.paged_kernel, one C++ op per layer
    over the block table on the step's threads (built once per machine with the C++ compiler
    torch.utils.cpp_extension finds; load fails when it cannot be built). loop: one SDPA call per
    sequence on one thread. auto: the kernel where it builds, else the loop with a warning."""
    fused_decode: Literal["auto", "off"] = "auto"
    """CPU: run the transformer blocks of a decode-only step as one C++ call (engines/cpu/fused_decode.py:
    the same kernels in the same order, bitwise the module path's result, without ~300 Python-entered
    ops a token). auto: for GPT-2 and Llama-family models (RMSNorm, rotary, GQA, SwiGLU; Linear biases
    and per-head q / k norms too) whose block Linears chose kernels it calls and whose attention is the
    paged kernel, where it builds (else the module path, with the reason logged). off: never."""
    decode_steps: int = 8
    """Offline generation (LLM.generate, whose caller waits for whole requests): where every running sequence is
    plain greedy (no logprobs, penalties, min_tokens or grammar) and nothing waits, one engine step runs up to this
    many decode tokens a sequence, each drawn token fed to the next step by the runner (on CPU in the fused step's
    C++ loop: embeddings, blocks, head and argmax, no interpreter between tokens; engines/core/scheduler.py). The
    same tokens as single steps; a stop token or string ends a sequence where it occurs. 1: a token a step. One
    device only; a serving engine streams a token a step."""
    tensor_parallel_size: int = 1
    """Shards of every layer (Megatron-style: attention heads, MLP width and vocabulary split)."""
    pipeline_parallel_size: int = 1
    """Stages of contiguous layers; activations go stage to stage."""
    pipeline_microbatches: int = 0
    """Micro-batches a step's sequences are split into so that pipeline stages overlap; 1 turns
    micro-batching off. 0 (auto) splits a step into pipeline_parallel_size micro-batches only when
    each would still be compute-bound (engines.parallel.pp.MIN_MICROBATCH_TOKENS tokens or more):
    a memory-bound decode micro-batch re-reads the stage's weights, so splitting it costs more
    than the bubble it removes."""
    worker_threads: int = 0
    """torch threads per shard worker; 0 shares the host's cores evenly among the shards (in
    process on CPU: OMP_NUM_THREADS when set, else every core, see engines.cpu.cpu_threads)."""
    adaptive_threads: bool = True
    """In-process CPU engine whose count is not fixed by worker_threads: run each step on the
    fewer-or-equal thread count measured fastest for that kind of step while the engine runs
    (OMP_NUM_THREADS, or every core, is then the most it uses; engines.cpu.cpu_threads.AdaptiveThreads).
    On a shared host a 2-thread step can wait ~4 ms per op for a descheduled thread. False runs
    every step on the full count, as does compile_decode "on" (dynamo guards on the count)."""
    dist_timeout_s: float = 120.0
    """Deadline of one step in a multi-process executor: a hung or dead shard worker fails the step
    with ExecutorError naming that shard instead of hanging it. The shards' collectives time out a
    little later (engines.parallel.worker_proc.collective_timeout_s), so the driver names the hung
    shard rather than a peer waiting on it."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching: full KV blocks are kept by content (hash of the parent block, the
    block's token ids and a p-tuning task's identity) and a new request reuses those of its longest
    cached prefix instead of computing them again (a chat's system prompt is computed once); blocks
    no request holds stay cached and are evicted least recently used when the pool needs them
    (engines/core/block_manager.py). False: every prompt is computed in full."""
    step_record_len: int = 256
    """Working steps the engine's step recorder keeps (engines/core/step_record.py), the most that
    `GET /v1/admin/steps` returns: the tuner's served-step fit reads them; its accuracy runs keep a
    whole run (tuner.validate.RUN_STEPS_KEPT). At most 1,000,000 (about 100 bytes a step)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Reserved for executor-specific options (tp/pp arrive with model parallelism)."""

    def __post_init__(self) -> None:
        _require(self.dtype in ENGINE_DTYPES, "dtype", f"must be one of {', '.join(ENGINE_DTYPES)}, got {self.dtype!r}")
        _require(isinstance(self.device, str) and DEVICE.match(self.device) is not None, "device",
                 f"must be cpu, cuda or cuda:N, got {self.device!r}")
        _require(self.weight_dtype in WEIGHT_DTYPES, "weight_dtype",
                 f"must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        _require(self.lm_head_dtype in ("auto", "fp8"), "lm_head_dtype",
                 f"must be auto or fp8, got {self.lm_head_dtype!r}")
        _require(self.lm_head_dtype == "auto" or str(self.device).startswith("cpu"), "lm_head_dtype",
                 f"fp8 runs on a CPU engine only (the e4m3 head kernel is a CPU kernel), got device {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, f"must be a positive integer, got {value!r}")
        _require(isinstance(self.kv_cache_bytes, int) and self.kv_cache_bytes >= 0, "kv_cache_bytes",
                 f"must be an integer >= 0 (0 sizes the cache from free memory), got {self.kv_cache_bytes!r}")
        _require(isinstance(self.kv_cache_memory_fraction, (int, float))
                 and 0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction",
                 f"must be a number in (0, 1], got {self.kv_cache_memory_fraction!r}")
        _require(self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0 (0 derives it from kv_cache_bytes)")
        _require(self.max_model_len >= 0, "max_model_len", "must be >= 0 (0 uses the model's limit)")
        _require(isinstance(self.admission_overtakes, int) and self.admission_overtakes >= 0, "admission_overtakes",
                 f"must be an integer >= 0 (0: arrival order), got {self.admission_overtakes!r}")
        # no more than a request may ever ask for (SamplingParams' own bound): a larger one would promise nothing
        _require(isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS, "max_logprobs",
                 f"must be an integer in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}")
        _require(self.static_decode in ("auto", "on", "off"), "static_decode",
                 f"must be auto, on or off, got {self.static_decode!r}")
        _require(self.decode_attention in ("auto", "kernel", "loop"), "decode_attention",
                 f"must be auto, kernel or loop, got {self.decode_attention!r}")
        _require(self.fused_decode in ("auto", "off"), "fused_decode",
                 f"must be auto or off, got {self.fused_decode!r}")
        _require(isinstance(self.decode_steps, int) and not isinstance(self.decode_steps, bool)
                 and 1 <= self.decode_steps <= 256, "decode_steps",
                 f"must be an integer in [1, 256] (1: a token a step), got {self.decode_steps!r}")
        _require(self.cuda_graph_capture_s >= 0, "cuda_graph_capture_s",
                 f"must be >= 0 seconds (0 captures lazily), got {self.cuda_graph_capture_s!r}")
        _require(self.compile_decode in ("auto", "on", "off"), "compile_decode",
                 f"must be auto, on or off, got {self.compile_decode!r}")
        _require(not (self.compile_decode == "on" and self.static_decode == "off"), "compile_decode",
                 "'on' compiles the static decode step, but static_decode is 'off'; set static_decode to auto or on")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _require(not (self.compile_decode == "on" and self.tensor_parallel_size > 1), "compile_decode",
                 "'on' compiles the decode step of one device or of a pipeline stage; a tensor-parallel shard "
                 "all-reduces inside every layer, which one compiled graph cannot hold (its decode steps take the "
                 "fused CPU step, or CUDA graphs of the eager step): set tensor_parallel_size to 1 or "
                 "compile_decode to auto/off")
        _require(isinstance(self.pipeline_microbatches, int) and self.pipeline_microbatches >= 0,
                 "pipeline_microbatches", f"must be an integer >= 0 (0 chooses per step), "
                 f"got {self.pipeline_microbatches!r}")
        _require(isinstance(self.worker_threads, int) and self.worker_threads >= 0, "worker_threads",
                 f"must be an integer >= 0 (0 shares the cores), got {self.worker_threads!r}")
        _require(isinstance(self.adaptive_threads, bool), "adaptive_threads",
                 f"must be true or false, got {self.adaptive_threads!r}")
        _require(isinstance(self.whole_prompt_steps, bool), "whole_prompt_steps",
                 f"must be true or false, got {self.whole_prompt_steps!r}")
        _require(isinstance(self.greedy_head_screen, bool), "greedy_head_screen",
                 f"must be true or false, got {self.greedy_head_screen!r}")
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                 f"must be true or false, got {self.enable_prefix_caching!r}")
        _require(isinstance(self.step_record_len, int) and not isinstance(self.step_record_len, bool)
                 and 1 <= self.step_record_len <= STEP_RECORD_MAX, "step_record_len",
                 f"must be an integer in [1, {STEP_RECORD_MAX}], got {self.step_record_len!r}")
        _require(isinstance(self.dist_timeout_s, (int, float)) and 0 < self.dist_timeout_s < 10**7, "dist_timeout_s",
                 f"must be a number of seconds in (0, 1e7), got {self.dist_timeout_s!r}")

    @property
    def world_size(self) -> int:
        """Shard workers of one model copy: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "extra")


def resolved_dtype(engine: EngineConfig) -> str:
    """The concrete dtype of `engine`: its own, or what dtype "auto" picks on this host's hardware
    (an engine resolves its config once with a probe on bf16 CPUs; the rule here is the same
    without the probe, engines/core/hardware.py)."""
    if engine.dtype != "auto":
        return engine.dtype
    from engines.core.hardware import engine_dtype  # torch: only when a config is left on auto

    return engine_dtype(engine.device).precision


def resolve_engine_config(engine_cfg: EngineConfig, model_cfg: ModelConfig | None = None) -> EngineConfig:
    """`engine_cfg` with dtype "auto" replaced by the concrete dtype (a new config; the same one
    if it was concrete already), the reason logged. `model_cfg` gives the widths of the confirming
    bf16 probe (engines.core.hardware.engine_dtype)."""
    if engine_cfg.dtype != "auto":
        return engine_cfg
    from engines.core.hardware import engine_dtype  # torch: only when a config is left on auto

    widths = (model_cfg.n_embd, model_cfg.ffn_dim) if model_cfg is not None else (0, 0)
    choice = engine_dtype(engine_cfg.device, *widths)
    log.info(choice.reason)
    return engine_cfg.replace(dtype=choice.precision)


def kv_bytes_per_block(model: ModelConfig, engine: EngineConfig) -> int:
    """Bytes of one block across all layers: keys and values, block_size tokens each."""
    itemsize = 4 if resolved_dtype(engine) == "float32" else 2
    return 2 * model.n_layer * engine.block_size * model.kv_heads * model.hd * itemsize


def num_kv_blocks(model: ModelConfig, engine: EngineConfig, budget_bytes: int | None = None) -> int:
    """Blocks of the cache: num_kv_blocks if set, else the byte budget (kv_cache_bytes, or
    `budget_bytes` measured from free memory when kv_cache_bytes is 0) over the block size."""
    if engine.num_kv_blocks:
        return engine.num_kv_blocks
    budget = engine.kv_cache_bytes or budget_bytes
    if budget is None:
        raise ConfigError("kv_cache_bytes: 0 sizes the cache from free memory; pass the measured budget")
    return max(1, budget // kv_bytes_per_block(model, engine))


def max_model_len(model: ModelConfig, engine: EngineConfig) -> int:
    if engine.max_model_len:
        return min(engine.max_model_len, model.max_position_embeddings)
    return model.max_position_embeddings
