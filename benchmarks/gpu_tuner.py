"""bench_gpu.py's tuner section: the tuner's static-batch prediction against our engine on the device."""

from __future__ import annotations

from pathlib import Path

import torch
from gpu_common import engine, note, random_checkpoint, release, run_batch

from engines.core.config import ModelConfig


def profile_name(env: dict) -> str | None:
    name = env.get("name", "").upper()
    for key, prof in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb")):
        if key in name:
            return prof
    return None


def section_tuner(dev: str, smoke: bool, tmp: Path, env: dict) -> dict:
    from tuner.cost import CostModel, static_batch
    from tuner.profiles import load_profile

    prof_name = profile_name(env) or "h200"
    profile = load_profile(prof_name)
    names = ("smoke-gpt2", "smoke-llama") if smoke else ("gpt2-medium", "gpt2-xl", "llama-1b", "llama-8b")
    I, O = 60, 20
    out = {"profile": prof_name, "rows": []}
    note(f"tuner: static batch {I} in / {O} out, measured on our engine (bf16, graphs) against built-in "
         f"profile {prof_name!r}: latency / TTFT / TPOT ms, measured vs predicted")
    fp8_ok = dev == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
    cases = [(n, "bfloat16") for n in names] + [(n, "fp8") for n in names[1:] if fp8_ok]
    for name, wd in cases:
        d = random_checkpoint(name, tmp)
        cfg = ModelConfig.from_dir(d)
        cost = CostModel(cfg, profile, tp=1, pp=1, weight_dtype=wd)
        eng = engine(d, dev, "bfloat16", max_num_seqs=64, max_num_batched_tokens=64 * I, max_model_len=256,
                     kv_cache_bytes=4 << 30, weight_dtype="fp8" if wd == "fp8" else "auto")
        for b in (1, 8, 64):
            prompts = [[(13 * i + 7 * j) % 900 + 1 for j in range(I)] for i in range(b)]
            run_batch(eng, prompts, O, f"w{b}", dev)  # warm-up: graph capture of this bucket
            runs = [run_batch(eng, prompts, O, f"t{b}-{k}", dev) for k in range(3)]
            m = min(runs, key=lambda r: r["total_s"])
            meas = {"latency_ms": m["total_s"] * 1e3, "ttft_ms": m["ttft_s"] * 1e3,
                    "tpot_ms": (m["total_s"] - m["ttft_s"]) / (O - 1) * 1e3}
            pred = static_batch(cost, b, I, O)
            row = {"model": name, "weight_dtype": wd, "batch": b, "measured": meas, "predicted": pred}
            out["rows"].append(row)
            err = {k: pred[k] / meas[k] - 1 for k in meas}
            note(f"  {name:12s} {wd[:4]} B={b:2d}: latency {meas['latency_ms']:8.2f} / {pred['latency_ms']:8.2f} "
                 f"({100 * err['latency_ms']:+.0f}%), TTFT {meas['ttft_ms']:7.2f} / {pred['ttft_ms']:7.2f} "
                 f"({100 * err['ttft_ms']:+.0f}%), TPOT {meas['tpot_ms']:6.2f} / {pred['tpot_ms']:6.2f} "
                 f"({100 * err['tpot_ms']:+.0f}%)")
        release(eng)
    return out


