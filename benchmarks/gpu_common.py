"""Shared parts of benchmarks/bench_gpu.py: the ceilings measured in the run, engines on random
checkpoints of named shapes, and batch runs. Runs with torch alone (the GPU image has no Ray)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines import SamplingParams
from engines.core.config import EngineConfig, ModelConfig
from engines.core.llm_engine import LLMEngine
from engines.loading.checkpoint import save_checkpoint
from engines.model.transformer import GPT

SUMMARY: list[str] = []
RESULTS: dict = {}


def note(line: str) -> None:
    print(line, flush=True)
    SUMMARY.append(line)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- env
def copy_rate(dev: str, nbytes: int) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(dev)
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        y.copy_(x)
    sync(dev)
    return n * 2 * nbytes / (time.perf_counter() - t)


def matmul_rate(dev: str, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    for _ in range(3):
        a @ b
    sync(dev)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return reps * 2 * n**3 / (time.perf_counter() - t)


def fp8_rate(dev: str, n: int) -> float:
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major second operand
    one = torch.ones((), device=dev)
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    for _ in range(3):
        mm()
    sync(dev)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        mm()
    sync(dev)
    return reps * 2 * n**3 / (time.perf_counter() - t)


def section_env(dev: str, smoke: bool) -> dict:
    out = {"torch": torch.__version__, "device": dev}
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, capability=list(torch.cuda.get_device_capability()), sms=p.multi_processor_count,
                   memory_gib=p.total_memory / 2**30)
    nbytes = (64 << 20) if smoke else (2 << 30)
    out["copy_bytes_per_s"] = copy_rate(dev, nbytes)
    n = 1024 if smoke else 8192
    out["bf16_flops"] = matmul_rate(dev, n, torch.bfloat16)
    if dev == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        out["fp8_flops"] = fp8_rate(dev, n)
    note(f"env: {out.get('name', 'cpu')} torch {out['torch']}; copy {out['copy_bytes_per_s'] / 1e9:,.0f} GB/s "
         f"(read + write); bf16 {n}^3 {out['bf16_flops'] / 1e12:,.1f} TFLOP/s"
         + (f"; e4m3 _scaled_mm {out['fp8_flops'] / 1e12:,.1f} TFLOP/s" if "fp8_flops" in out else ""))
    return out


# ---------------------------------------------------------------------------------------- helpers
def engine(d: Path, dev: str, dtype: str, **kw) -> LLMEngine:
    base = {"device": dev, "dtype": dtype, "kv_cache_bytes": kw.pop("kv_cache_bytes", 2 << 30)}
    if dev == "cpu":
        base["cpu_linear_autotune"] = False
    return LLMEngine(d, EngineConfig(**base, **kw))


def run_batch(eng: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str, dev: str) -> dict:
    """All prompts arrive together; greedy; returns tokens per prompt, first-step and total seconds."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    sync(dev)
    t0 = time.perf_counter()
    done: dict[str, list[int]] = {}
    first = None
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        if first is None:
            sync(dev)
            first = time.perf_counter() - t0
    sync(dev)
    total = time.perf_counter() - t0
    return {"tokens": [done[f"{tag}-{i}"] for i in range(len(prompts))], "ttft_s": first, "total_s": total,
            "steps": steps}


def release(eng: LLMEngine | None) -> None:
    if eng is not None:
        eng.shutdown()
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_greedy(hf, prompt: list[int], n: int, dev: str) -> list[int]:
    ids = torch.tensor([prompt], device=dev)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(hf(ids).logits[0, -1].float().argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


# ---------------------------------------------------------------------------------------- models
SHAPES = {
    "gpt2-medium": {"model_type": "gpt2", "vocab_size": 50257, "n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-xl": {"model_type": "gpt2", "vocab_size": 50257, "n_layer": 48, "n_head": 25, "n_embd": 1600},
    "llama-1b": {"model_type": "llama", "vocab_size": 32000, "n_layer": 22, "n_head": 32, "n_kv_head": 4, "n_embd": 2048,
                     "intermediate_size": 5632, "tie_word_embeddings": False, "bias": False, "activation": "silu",
                     "norm_eps": 1e-5},
    "llama-8b": {"model_type": "llama", "vocab_size": 128256, "n_layer": 32, "n_head": 32, "n_kv_head": 8,
                 "n_embd": 4096, "intermediate_size": 14336, "tie_word_embeddings": False, "bias": False,
                 "activation": "silu", "norm_eps": 1e-5, "rope_theta": 500000.0},
    "smoke-gpt2": {"model_type": "gpt2", "vocab_size": 1000, "n_layer": 2, "n_head": 4, "n_embd": 64},
    "smoke-llama": {"model_type": "llama", "vocab_size": 1000, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
                        "intermediate_size": 128, "tie_word_embeddings": False, "bias": False, "activation": "silu"},
}


def random_checkpoint(name: str, tmp: Path) -> Path:
    d = tmp / name
    if (d / "config.json").is_file():
        return d
    cfg = ModelConfig(**SHAPES[name], max_position_embeddings=2048 if "llama" in name else 1024,
                      bos_token_id=0, eos_token_id=(0,))
    t = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = GPT(cfg).to(torch.bfloat16)
        for name_, p in model.named_parameters():  # GPT.init_weights' scheme, drawn on the device
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0 if name_.endswith("weight") else 0.0)
                else:
                    std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name_.endswith(("proj.weight", "down.weight")) else 0.02
                    p.normal_(0, std)
    save_checkpoint(model.cpu(), cfg, d, dtype=torch.bfloat16)
    del model
    print(f"  wrote {name} ({cfg.num_params() / 1e9:.2f} B params) in {time.perf_counter() - t:.1f} s", flush=True)
    return d


def weight_bytes(cfg: ModelConfig, itemsize: float) -> float:
    """Bytes a decode step must read: every matrix once (the LM head too), norms and biases."""
    tied_head = cfg.vocab_size * cfg.n_embd if cfg.tie_word_embeddings else 0  # untied: counted already
    return (cfg.num_params(include_embeddings=False) + tied_head) * itemsize


