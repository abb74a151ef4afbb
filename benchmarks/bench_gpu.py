"""Every GPU check of the project in one run, for a lent CUDA machine (one call, a few minutes).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py --out $OUT/gpu.json        # on the GPU machine
    .venv/bin/python benchmarks/bench_gpu.py --smoke                               # here: the same code on CPU, tiny

Sections (each runs alone: one that fails is reported and the others go on):
  env      device, torch, the two ceilings measured here: device-to-device copy (bytes read + written
           a second) and an 8192^3 bf16 (and e4m3 through torch._scaled_mm) matrix product on random data.
  parity   tiny random GPT-2 and Llama checkpoints (written by transformers): our engine on the device
           in fp32, CUDA graphs on and off, batch of 4 prompts of different lengths, 24 greedy tokens,
           against transformers' own forward (no cache, argmax each step) on the same device; and our
           bf16 graphs against our bf16 eager static path.
  graphs   GPT-2-medium shape, bf16, random weights: decode tok/s at batch 1 / 8 / 64 with CUDA graphs
           on and off (the same static decode path) and the eager paged path (static_decode off); the
           time and pool memory of each bucket's capture; each as a fraction of the HBM roofline
           (every weight and each stream's context read once a step at the copy rate measured here).
           Batch 64 also with max_model_len 1024: context buckets (the step reads the table columns its
           longest row needs) against the whole block table read every step (as before them).
  fp8      the same model with weight_dtype fp8 (W8A8 through torch._scaled_mm on sm89+) against bf16
           at batch 1 / 8 / 64, graphs on; and greedy-token agreement of fp8 with bf16.
  fp8big   the same on a Llama-8B shape (64 new tokens a stream).
  tuner    the static batch the tuner's `predict` describes (B requests of 60 input and 20 output
           tokens arriving together, until the last token) measured on our engine for GPT-2-medium,
           a GPT-2-XL, a Llama-1B (GQA) and a Llama-8B shape at B = 1, 8, 64 (bf16, and fp8 for all but
           GPT-2-medium), against the built-in profile of
           this device (h200 / h100-sxm / a100-80gb by name), so the analytic profile meets a real card.

Prints a summary table last; writes everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines import SamplingParams
from engines.checkpoint import save_checkpoint
from engines.config import EngineConfig, ModelConfig
from engines.llm_engine import LLMEngine
from engines.model import GPT

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


# ---------------------------------------------------------------------------------------- parity
def hf_greedy(hf, prompt: list[int], n: int, dev: str) -> list[int]:
    ids = torch.tensor([prompt], device=dev)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(hf(ids).logits[0, -1].float().argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


def section_parity(dev: str, smoke: bool, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_checkpoint

    out = {}
    n = 24
    prompts = [[(5 * i + 3 * j) % 390 + 1 for j in range(L)] for i, L in enumerate((3, 7, 12, 20))]
    for family in ("gpt2", "llama"):
        d = make_checkpoint(tmp / f"parity-{family}", family)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(dev).eval()
        ref = [hf_greedy(hf, p, n, dev) for p in prompts]
        del hf
        row = {}
        for graphs in (True, False):
            eng = engine(d, dev, "float32", cuda_graphs=graphs, static_decode="on", max_num_seqs=8)
            got = run_batch(eng, prompts, n, f"p{graphs}", dev)["tokens"]
            release(eng)
            row[f"fp32_graphs_{graphs}"] = sum(a == b for a, b in zip(got, ref))
        bf = {}
        for graphs in (True, False):
            eng = engine(d, dev, "bfloat16", cuda_graphs=graphs, static_decode="on", max_num_seqs=8)
            bf[graphs] = run_batch(eng, prompts, n, f"b{graphs}", dev)["tokens"]
            release(eng)
        row["bf16_graphs_vs_eager"] = sum(a == b for a, b in zip(bf[True], bf[False]))
        out[family] = row
        note(f"parity {family}: fp32 graphs on {row['fp32_graphs_True']}/4, off {row['fp32_graphs_False']}/4 "
             f"prompts token-equal to transformers ({n} greedy tokens); bf16 graphs = bf16 eager static "
             f"{row['bf16_graphs_vs_eager']}/4")
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


def decode_rate(d: Path, dev: str, batch: int, new_tokens: int, full_context: bool = False, **kw) -> dict:
    """Decode tok/s of `batch` greedy streams of 16-token prompts (after the prefill step), and
    the capture time and pool memory of the graphs the timed bucket needed. full_context: every
    step reads the whole block table (max_model_len), as the runner did before context buckets."""
    eng = engine(d, dev, "bfloat16", max_num_seqs=max(batch, 1), max_num_batched_tokens=max(1024, 16 * batch), **kw)
    runner = eng.executor.runner.decode_runner
    if full_context:
        runner.context_bucket = lambda decode, r=runner: r.max_blocks
    captures: list[tuple[float, int]] = []
    if runner is not None and runner.cuda_graphs:
        orig = runner._capture

        def timed_capture(B, nblk, orig=orig):
            sync(dev)
            m0, t = torch.cuda.memory_reserved(), time.perf_counter()
            r = orig(B, nblk)
            sync(dev)
            captures.append((time.perf_counter() - t, torch.cuda.memory_reserved() - m0))
            return r
        runner._capture = timed_capture
    prompts = [[(7 * i + j) % 900 + 1 for j in range(16)] for i in range(batch)]
    res = None
    for rnd in range(2):  # round 0 captures / warms up; round 1 is timed
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"{rnd}-{i}", p, params)
        eng.step()  # prefill + first token
        sync(dev)
        t = time.perf_counter()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        sync(dev)
        dt = time.perf_counter() - t
        res = {"tok_s": batch * (new_tokens - 1) / dt, "step_ms": dt / max(steps, 1) * 1e3}
    res["backend"] = eng.executor.runner.fp8.backend if eng.executor.runner.fp8.fp8 else "bf16"
    res["capture_s"] = sum(c[0] for c in captures)
    res["capture_bytes"] = sum(c[1] for c in captures)
    release(eng)
    return res


def section_graphs(dev: str, smoke: bool, tmp: Path, env: dict) -> dict:
    name = "smoke-gpt2" if smoke else "gpt2-medium"
    d = random_checkpoint(name, tmp)
    cfg = ModelConfig.from_dir(d)
    bw = env["copy_bytes_per_s"]
    wbytes = weight_bytes(cfg, 2)
    kv_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.hd * 2
    n = 16 if smoke else 128
    out = {"model": name, "weight_bytes": wbytes}
    note(f"graphs: {name}, bf16, {n} new tokens a stream, roofline = (weights + context KV) / copy rate")
    for b in (1, 8, 64):
        row = {}
        modes = {"graphs": {"static_decode": "on", "cuda_graphs": True, "max_model_len": 256},
                 "static_no_graphs": {"static_decode": "on", "cuda_graphs": False, "max_model_len": 256},
                 "eager_paged": {"static_decode": "off", "max_model_len": 256}}
        if b == 64:
            modes["graphs_len1024"] = {"static_decode": "on", "cuda_graphs": True, "max_model_len": 1024}
            modes["graphs_len1024_full_context"] = {"static_decode": "on", "cuda_graphs": True, "max_model_len": 1024,
                                                        "full_context": True}
        for mode, kw in modes.items():
            r = decode_rate(d, dev, b, n, **kw)
            roof = b * bw / (wbytes + b * (16 + n / 2) * kv_token)
            r["roofline_fraction"] = r["tok_s"] / roof
            row[mode] = r
        out[f"batch_{b}"] = row
        g = row["graphs"]
        note(f"  batch {b:2d}: graphs {g['tok_s']:,.0f} tok/s ({g['step_ms']:.2f} ms a step, "
             f"{100 * g['roofline_fraction']:.0f}% of roofline; capture {g['capture_s'] * 1e3:.0f} ms, "
             f"{g['capture_bytes'] / 2**20:.0f} MiB); no graphs {row['static_no_graphs']['tok_s']:,.0f} "
             f"({g['tok_s'] / row['static_no_graphs']['tok_s']:.2f}x); eager paged {row['eager_paged']['tok_s']:,.0f} "
             f"({g['tok_s'] / row['eager_paged']['tok_s']:.2f}x)"
             + (f"; graphs at max_model_len 1024: {row['graphs_len1024']['tok_s']:,.0f} with context buckets, "
                f"{row['graphs_len1024_full_context']['tok_s']:,.0f} reading the whole table" if b == 64 else ""))
    return out


def section_fp8big(dev: str, smoke: bool, tmp: Path, env: dict) -> dict:
    return section_fp8(dev, smoke, tmp, env, big=True)


def section_fp8(dev: str, smoke: bool, tmp: Path, env: dict, big: bool = False) -> dict:
    name = ("smoke-llama" if big else "smoke-gpt2") if smoke else ("llama-8b" if big else "gpt2-medium")
    d = random_checkpoint(name, tmp)
    cfg = ModelConfig.from_dir(d)
    n = 16 if smoke else (64 if big else 128)
    bw = env["copy_bytes_per_s"]
    out = {"model": name}
    note(f"fp8: {name}, W8A8 against bf16 weights, graphs on, {n} new tokens a stream")
    # the FP8 layout's weight bytes: block Linears 1 byte a weight (+ fp32 row scales), the rest bf16
    with torch.device("meta"):
        shapes = GPT(cfg)
    lin = sum(p.numel() for nm, p in shapes.named_parameters()
              if p.dim() == 2 and any(k in nm for k in ("attn.", "mlp.")))
    wb = {"bf16": weight_bytes(cfg, 2), "fp8": weight_bytes(cfg, 2) - lin}
    kv_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.hd * 2
    for b in (1, 8, 64):
        row = {}
        for wd in ("auto", "fp8"):
            r = decode_rate(d, dev, b, n, static_decode="on", cuda_graphs=True, max_model_len=256, weight_dtype=wd)
            key = "bf16" if wd == "auto" else "fp8"
            r["roofline_fraction"] = r["tok_s"] / (b * bw / (wb[key] + b * (16 + n / 2) * kv_token))
            row[key] = r
        row["speedup"] = row["fp8"]["tok_s"] / row["bf16"]["tok_s"]
        out[f"batch_{b}"] = row
        note(f"  batch {b:2d}: bf16 {row['bf16']['tok_s']:,.0f} tok/s ({100 * row['bf16']['roofline_fraction']:.0f}%), "
             f"fp8 {row['fp8']['tok_s']:,.0f} ({100 * row['fp8']['roofline_fraction']:.0f}%, {row['fp8']['backend']}): "
             f"{row['speedup']:.2f}x" + ("  (target >= 1.4x at batch 1)" if b == 1 else ""))
    # greedy agreement, fp8 against bf16, 8 streams x 32 tokens
    prompts = [[(11 * i + 5 * j) % 900 + 1 for j in range(12)] for i in range(8)]
    toks = {}
    for wd in ("auto", "fp8"):
        eng = engine(d, dev, "bfloat16", weight_dtype=wd, max_num_seqs=8, max_model_len=256)
        toks[wd] = run_batch(eng, prompts, 32, wd, dev)["tokens"]
        release(eng)
    agree = sum(x == y for a, b in zip(toks["auto"], toks["fp8"]) for x, y in zip(a, b)) / (8 * 32)
    first_div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32)
                 for a, b in zip(toks["auto"], toks["fp8"])]
    out["token_agreement"] = agree
    out["first_divergence"] = first_div
    note(f"  fp8 vs bf16 greedy tokens (random weights, 8 x 32): {100 * agree:.0f}% equal; first divergence {first_div}")
    return out


# ---------------------------------------------------------------------------------------- tuner
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on this device (a CPU check of the code)")
    ap.add_argument("--sections", default="env,parity,graphs,fp8,fp8big,tuner")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        raise SystemExit("bench_gpu.py: no CUDA device here; --smoke runs the code on CPU with tiny shapes")
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    env = {}
    t_all = time.perf_counter()
    for sec in args.sections.split(","):
        t = time.perf_counter()
        try:
            if sec == "env":
                env = RESULTS["env"] = section_env(dev, args.smoke)
            elif sec == "parity":
                RESULTS["parity"] = section_parity(dev, args.smoke, tmp)
            else:
                if not env:
                    env = RESULTS["env"] = section_env(dev, args.smoke)
                RESULTS[sec] = {"graphs": section_graphs, "fp8": section_fp8, "fp8big": section_fp8big,
                                "tuner": section_tuner}[sec](
                    dev, args.smoke, tmp, env)
        except Exception as exc:  # noqa: BLE001 (report the section and go on with the next)
            traceback.print_exc()
            RESULTS[sec] = {"error": f"{type(exc).__name__}: {exc}"}
            note(f"{sec}: FAILED ({type(exc).__name__}: {str(exc)[:300]})")
        print(f"[{sec}: {time.perf_counter() - t:.1f} s]", flush=True)
        if args.out:
            args.out.write_text(json.dumps(RESULTS, indent=2, default=str))
    print(f"\n==== summary ({time.perf_counter() - t_all:.0f} s) ====")
    print("\n".join(SUMMARY))
    if os.environ.get("KEEP_TMP") is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
