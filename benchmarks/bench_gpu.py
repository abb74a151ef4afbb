"""Every GPU point of the project in one run, for a lent CUDA machine (one call, under 8 minutes).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py --out $OUT/gpu.json --model-dir .gpu/default --val .gpu/val.bin
    .venv/bin/python benchmarks/bench_gpu.py --smoke          # here: the same code on CPU, tiny shapes

Sections, in priority order (each alone: one that fails is reported and the others go on; a section
that would start past --budget-s is skipped and says so):
  env      device, torch, the ceilings measured here: device-to-device copy (read + write bytes a
           second), 8192^3 bf16 and e4m3 products.
  decode   batch-1 bf16 decode, CUDA graphs of the eager step against graphs of the compiled step
           (compile_decode on): the Llama-8B shape as a fraction of the HBM roofline (weights + KV
           read once a step at the copy rate), GPT-2-medium tok/s (was 629 on the H200).
  fp8-kernels  (not in the default list) the FP8 load-time kernel timing alone on the Llama-8B Linear shapes.
  fp8      Llama-8B shape, FP8 (each layer shape's kernel measured at load) against bf16 at batch
           1 / 8 / 64, in the faster of the two step kinds above, with the kernel choice. --fp8-step,
           --fp8-batches and --fp8-tokens fit it to a short call (compiled, batch 1, 32 tokens: 163 s on
           the H200; more than 7 minutes at 1 / 8 / 64 with 64 tokens).
  capture  Llama-8B shape, max_model_len 2048, max_num_seqs 64: graphs captured at load within the
           default 30 s budget, and none captured while a batch then runs.
  parity   tiny random GPT-2 and Llama (transformers-written): fp32 greedy tokens with graphs on and
           off against transformers; bf16 graphs against bf16 eager; compiled graphs against eager
           graphs (bf16); FP8 with graphs against FP8 without.
  ppl      FP8 against bf16 perplexity of a trained model (--model-dir, --val token file).
  tuner    (not in the default list) the tuner's static-batch prediction against the engine.

Prints a summary table last; writes everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gpu_common import (
    RESULTS,
    SUMMARY,
    engine,
    hf_greedy,
    note,
    random_checkpoint,
    release,
    run_batch,
    section_env,
    sync,
    weight_bytes,
)

from engines import SamplingParams
from engines.core.config import ModelConfig
from engines.model.transformer import GPT

FP8_TARGETS = {1: 1.4, 8: 1.3, 64: 1.2}
FP8_BATCHES, FP8_TOKENS = (1, 8, 64), 64
"""The fp8 section's decode batches and greedy tokens a stream (--fp8-batches, --fp8-tokens: a shorter call)."""
FP8_STEP = "auto"
"""The step kind the fp8 section runs both weight kinds in (--fp8-step); auto: the decode section's faster one."""
STEP_KINDS = {"graphs": {"compile_decode": "off"}, "compiled": {"compile_decode": "on"}}


def measure(eng, batch: int, new_tokens: int, dev: str) -> dict:
    """Decode tok/s of `batch` greedy streams of 16-token prompts after the prefill step; round 0
    warms up (captures, compiles), round 1 is timed."""
    prompts = [[(7 * i + j) % 900 + 1 for j in range(16)] for i in range(batch)]
    res = {}
    for rnd in range(2):
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"{batch}-{rnd}-{i}", p, params)
        eng.step()  # prefill + first token
        sync(dev)
        t, steps = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        sync(dev)
        dt = time.perf_counter() - t
        res = {"tok_s": batch * (new_tokens - 1) / dt, "step_ms": dt / max(steps, 1) * 1e3}
    return res


def fp8_weight_bytes(cfg: ModelConfig) -> float:
    with torch.device("meta"):
        shapes = GPT(cfg)
    lin = sum(p.numel() for nm, p in shapes.named_parameters() if p.dim() == 2 and ("attn." in nm or "mlp." in nm))
    return weight_bytes(cfg, 2) - lin  # block Linears 1 byte a weight, the rest bf16


def rates(d: Path, dev: str, batches: tuple[int, ...], n: int, env: dict, **kw) -> dict:
    cfg = ModelConfig.from_dir(d)
    t = time.perf_counter()
    eng = engine(d, dev, "bfloat16", max_num_seqs=max(batches), max_num_batched_tokens=max(1024, 16 * max(batches)),
                 max_model_len=256, cuda_graph_capture_s=0, static_decode="on", cuda_graphs=True, **kw)
    out = {"load_s": time.perf_counter() - t}
    fp8 = eng.executor.runner.fp8
    out["backend"] = fp8.backend if fp8.fp8 else "bf16"
    wb = fp8_weight_bytes(cfg) if fp8.fp8 else weight_bytes(cfg, 2)
    kv_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.hd * 2
    for b in batches:
        t = time.perf_counter()
        r = measure(eng, b, n, dev)
        r["wall_s"] = time.perf_counter() - t
        r["roofline_fraction"] = r["tok_s"] / (b * env["copy_bytes_per_s"] / (wb + b * (16 + n / 2) * kv_token))
        out[b] = r
    release(eng)
    return out


def section_decode(dev, smoke, tmp, env) -> dict:
    out = {}
    for name, target in (("smoke-llama" if smoke else "llama-8b", "roofline >= 75% (was 53%)"),
                         ("smoke-gpt2" if smoke else "gpt2-medium", "tok/s >= 2x 629 = 1,258")):
        d = random_checkpoint(name, tmp)
        row = {}
        for kind, kw in STEP_KINDS.items():
            try:
                row[kind] = rates(d, dev, (1,), 16 if smoke else 128, env, **kw)[1]
            except Exception as exc:  # noqa: BLE001 (the other kind still runs)
                traceback.print_exc()
                row[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out[name] = row
        cells = [f"{k} " + (f"{r['tok_s']:,.0f} tok/s, {r['step_ms']:.2f} ms, {100 * r['roofline_fraction']:.0f}% of roofline"
                            if "tok_s" in r else f"FAILED {r['error']}") for k, r in row.items()]
        note(f"decode {name} bf16 batch 1: " + "; ".join(cells) + f"  [target {target}]")
    return out


def block_linear_shapes(cfg: ModelConfig) -> set[tuple[int, int]]:
    """(in, out) of each block Linear of `cfg` (gate and up in one Linear)."""
    c, q = cfg.n_embd, cfg.n_head * cfg.hd
    up = cfg.ffn_dim * (2 if cfg.activation == "silu" else 1)
    return {(c, q + 2 * cfg.kv_heads * cfg.hd), (q, c), (c, up), (cfg.ffn_dim, c)}


def weight_only_check(dev: str, shapes: set[tuple[int, int]]) -> dict:
    """The Triton weight-only FP8 kernel (engines/transforms/fp8_triton.py) against the dequantized product on this
    device, each Linear shape (in, out), every config, 1 / 8 / 64 rows: the worst error relative to the output's
    largest magnitude (the kernel's bf16 tl.dot is what the CPU interpreter cannot run), and whether a repeated
    call gives the same bits and leaves the split-K counters at zero."""
    from engines.transforms.fp8 import Fp8Linear
    from engines.transforms.fp8_triton import CONFIGS, WeightOnlyFp8Linear, triton_available

    if not triton_available(dev):
        return {"skipped": "triton unavailable (or compute capability < 8.9)"}
    worst, repeatable, failed = 0.0, True, []
    for k, n in sorted(shapes):
        ref = Fp8Linear.quantize(torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16))
        w = ref.weight.float() * ref.weight_scale.float()
        for config in CONFIGS:
            layer = WeightOnlyFp8Linear(ref, config)
            for m in (1, 8, 64):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                want = x.float() @ w.T
                try:
                    got = layer(x)
                except Exception as exc:  # noqa: BLE001 (a config this triton cannot compile: the others go on)
                    failed.append(f"{config} {n}x{k} m={m}: {type(exc).__name__}: {str(exc)[:300]}")
                    note(f"fp8 weight-only kernel FAILED: {failed[-1]}")
                    continue
                worst = max(worst, ((got.float() - want).abs().max() / want.abs().max()).item())
                repeatable &= bool(torch.equal(got, layer(x)) and not layer.counters.any())  # split-K: no race
        del ref
    note(f"fp8 weight-only kernel vs dequantized product ({len(shapes)} shapes x {len(CONFIGS)} configs x 1/8/64 "
         f"rows): worst error {worst:.2e} of the output's magnitude, repeated calls bitwise equal and counters "
         f"back at zero: {repeatable}, calls failed: {len(failed)}  [bf16 output: <= 1e-2; True; 0]")
    return {"worst_rel_err": worst, "repeatable": repeatable, "failed": failed,
            "ok": worst <= 1e-2 and repeatable and not failed}


def timing_line(ts: dict, plan: tuple[str, ...]) -> str:
    """One shape's load-time kernel timings (seconds a call per row count) as 'variant us/us/us; ... -> plan'."""
    return "; ".join(f"{v} " + "/".join(f"{t * 1e6:.1f}" if t else "-" for t in x) for v, x in ts.items()) + \
        f" -> {'/'.join(plan)}"


def section_fp8(dev, smoke, tmp, env) -> dict:
    name = "smoke-llama" if smoke else "llama-8b"
    d = random_checkpoint(name, tmp)
    check = RESULTS.get("fp8-kernels", {}).get("weight_only_check") or \
        weight_only_check(dev, block_linear_shapes(ModelConfig.from_dir(d)))  # once a run
    dec = RESULTS.get("decode", {}).get(name, {})
    kind = "compiled" if "tok_s" in dec.get("compiled", {}) and dec["compiled"]["tok_s"] > dec.get(
        "graphs", {}).get("tok_s", 0) else "graphs"
    kind = FP8_STEP if FP8_STEP != "auto" else kind
    n = 16 if smoke else FP8_TOKENS
    out = {"step": kind, "weight_only_check": check}
    for wd in ("auto", "fp8"):
        out["bf16" if wd == "auto" else "fp8"] = rates(d, dev, FP8_BATCHES, n, env, weight_dtype=wd, **STEP_KINDS[kind])
    note(f"fp8 {name} ({kind} step), FP8 kernels: {out['fp8']['backend']}")
    from engines.transforms.fp8_choice import TIMINGS, pick

    out["kernel_timings_us"] = {}
    for (k, n_out, _), ts in TIMINGS.items():  # the load-time timing, layers of a shape in turn (not L2-resident)
        out["kernel_timings_us"][f"{n_out}x{k}"] = {v: [round(t * 1e6, 1) if t else None for t in x] for v, x in ts.items()}
        note(f"  Linear {n_out}x{k}, us a call at 1 / 8 / 64 rows: {timing_line(ts, pick(ts))}")
    for b in FP8_BATCHES:
        bf, f8 = out["bf16"][b], out["fp8"][b]
        note(f"  batch {b:2d}: bf16 {bf['tok_s']:,.0f} tok/s ({100 * bf['roofline_fraction']:.0f}%), fp8 "
             f"{f8['tok_s']:,.0f} ({100 * f8['roofline_fraction']:.0f}%): {f8['tok_s'] / bf['tok_s']:.2f}x  "
             f"[target {FP8_TARGETS[b]}x; 2026-12-04: 1.14/1.13/1.03x compiled]")
    return out


LLAMA_8B_LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "up": (4096, 28672), "down": (14336, 4096)}  # (in, out)


def section_fp8_kernels(dev, smoke, tmp, env) -> dict:
    """The load-time FP8 kernel timing alone (engines/transforms/fp8_choice.py) on random e4m3 layers of the
    Llama-8B Linear shapes, every kernel the engine can pick: a minute, no model written or loaded."""
    from engines.transforms.fp8 import Fp8Linear, kernel_builders
    from engines.transforms.fp8_choice import TIMINGS, choose_kernels

    if dev != "cuda":
        note("fp8-kernels: skipped (CUDA graphs time the kernels)")
        return {"skipped": True}
    make = {("bf16" if k == "dequant" else k): v for k, v in kernel_builders(torch.bfloat16, dev).items()}
    layers = []
    for k, n in LLAMA_8B_LINEARS.values():
        for _ in range(8):
            lin = Fp8Linear(k, n, False, None, torch.bfloat16, dev)
            lin.weight.data = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
            lin.weight_scale.data = torch.rand(n, 1, device=dev) * 1e-2 + 1e-3
            layers.append(lin)
    check = weight_only_check(dev, set(LLAMA_8B_LINEARS.values()))
    TIMINGS.clear()
    plans = choose_kernels(layers, torch.bfloat16, make)
    out = {"weight_only_check": check}
    for name, (k, n) in LLAMA_8B_LINEARS.items():
        ts = TIMINGS[(k, n, False)]
        out[name] = {"plan": plans[(k, n, False)], "us": {v: [round(t * 1e6, 1) if t else None for t in x]
                                                          for v, x in ts.items()}}
        note(f"fp8-kernels {name} {n}x{k}, us at 1 / 8 / 64 rows: {timing_line(ts, plans[(k, n, False)])}")
    return out


def section_capture(dev, smoke, tmp, env) -> dict:
    name = "smoke-llama" if smoke else "llama-8b"
    d = random_checkpoint(name, tmp)
    t = time.perf_counter()
    eng = engine(d, dev, "bfloat16", max_num_seqs=64, max_model_len=2048, static_decode="on", cuda_graphs=True)
    load_s = time.perf_counter() - t
    runner = eng.executor.runner.decode_runner
    out = {"engine_start_s": load_s, "capture_s": runner.capture_s, "graphs_at_load": len(runner.graphs),
           "plan_size": len(runner.buckets) * len(runner.ctx_choices)}
    later = []
    orig = runner._capture
    runner._capture = lambda B, nblk: later.append((B, nblk)) or orig(B, nblk)
    prompts = [[(3 * i + j) % 900 + 1 for j in range(40 + 30 * i)] for i in range(8)]
    run_batch(eng, prompts, 24, "cap", dev)
    out["captured_later"] = len(later)
    release(eng)
    note(f"capture {name}: {out['graphs_at_load']} of {out['plan_size']} (batch, context) graphs at load in "
         f"{out['capture_s']:.1f} s (engine start {load_s:.1f} s); captured while serving: {len(later)}  "
         f"[target <= 30 s at load, none later]")
    return out


def section_parity(dev, smoke, tmp, env) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_checkpoint

    out, n = {}, 24
    prompts = [[(5 * i + 3 * j) % 390 + 1 for j in range(L)] for i, L in enumerate((3, 7, 12, 20))]

    def toks(d, dtype, **kw):
        eng = engine(d, dev, dtype, static_decode="on", max_num_seqs=8, **kw)
        got = run_batch(eng, prompts, n, "p", dev)["tokens"]
        release(eng)
        return got

    same = lambda a, b: sum(x == y for x, y in zip(a, b))
    for family in ("gpt2", "llama"):
        d = make_checkpoint(tmp / f"parity-{family}", family)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(dev).eval()
        ref = [hf_greedy(hf, p, n, dev) for p in prompts]
        del hf
        row = {"fp32_graphs": same(toks(d, "float32", cuda_graphs=True), ref),
               "fp32_no_graphs": same(toks(d, "float32", cuda_graphs=False), ref)}
        bf_graphs = toks(d, "bfloat16", cuda_graphs=True)
        row["bf16_graphs_vs_eager"] = same(bf_graphs, toks(d, "bfloat16", cuda_graphs=False))
        try:
            row["bf16_compiled_vs_graphs"] = same(toks(d, "bfloat16", cuda_graphs=True, compile_decode="on"), bf_graphs)
        except Exception as exc:  # noqa: BLE001
            row["bf16_compiled_vs_graphs"] = f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
        row["fp8_graphs_vs_no_graphs"] = same(toks(d, "bfloat16", cuda_graphs=True, weight_dtype="fp8"),
                                              toks(d, "bfloat16", cuda_graphs=False, weight_dtype="fp8"))
        out[family] = row
        note(f"parity {family} (of 4 prompts x {n} greedy tokens): " + ", ".join(f"{k} {v}" for k, v in row.items()))
    return out


def section_ppl(dev, smoke, tmp, env, model_dir: Path | None = None, val: Path | None = None) -> dict:
    import numpy as np

    from engines.loading.checkpoint import load_model
    from engines.transforms.fp8 import apply_fp8

    if model_dir is None or val is None or not model_dir.is_dir() or not val.is_file():
        note("ppl: skipped (no --model-dir / --val given or found)")
        return {"skipped": True}
    cfg = ModelConfig.from_dir(model_dir)
    dt = np.uint16 if cfg.vocab_size <= 65536 else np.uint32
    tokens = torch.from_numpy(np.fromfile(val, dtype=dt).astype(np.int64))
    T = min(256, cfg.max_position_embeddings)
    n_seq = min(8 if smoke else 64, len(tokens) // (T + 1))
    x = tokens[: n_seq * T].view(n_seq, T).to(dev)
    out = {"tokens": n_seq * (T - 1)}
    for wd in ("auto", "fp8"):
        model, _ = load_model(model_dir, dtype=torch.bfloat16, device=torch.device(dev))
        rep = apply_fp8(model, wd, dev, torch.bfloat16)
        with torch.inference_mode():
            nll = 0.0
            for i in range(0, n_seq, 8):
                logits = model.logits(model(x[i:i + 8]))[:, :-1]
                nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         x[i:i + 8, 1:].reshape(-1), reduction="sum").item()
        out["bf16" if wd == "auto" else "fp8"] = {"ppl": float(np.exp(nll / out["tokens"])), "backend": rep.backend}
        del model
    ratio = out["fp8"]["ppl"] / out["bf16"]["ppl"]
    note(f"ppl {model_dir.name} ({out['tokens']:,} val tokens): bf16 {out['bf16']['ppl']:.3f}, fp8 "
         f"{out['fp8']['ppl']:.3f} ({100 * (ratio - 1):+.2f}%)  [target <= +1%]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on this device (a CPU check of the code)")
    ap.add_argument("--sections", default="env,decode,fp8,capture,parity,ppl")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no section after this many seconds")
    ap.add_argument("--model-dir", type=Path, default=None, help="a trained model for the ppl section")
    ap.add_argument("--val", type=Path, default=None, help="its validation tokens (data/<corpus>/val.bin)")
    ap.add_argument("--fp8-batches", default="1,8,64", help="the fp8 section's decode batches (of 1, 8, 64)")
    ap.add_argument("--fp8-tokens", type=int, default=64, help="the fp8 section's greedy tokens a stream")
    ap.add_argument("--fp8-step", choices=("auto", *STEP_KINDS), default="auto",
                    help="the fp8 section's step kind (auto: the faster one in the decode section, else graphs)")
    args = ap.parse_args()
    global FP8_STEP, FP8_BATCHES, FP8_TOKENS
    FP8_STEP, FP8_TOKENS = args.fp8_step, args.fp8_tokens
    FP8_BATCHES = tuple(int(b) for b in args.fp8_batches.split(","))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        raise SystemExit("bench_gpu.py: no CUDA device here; --smoke runs the code on CPU with tiny shapes")
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    from gpu_tuner import section_tuner

    sections = {"decode": section_decode, "fp8": section_fp8, "fp8-kernels": section_fp8_kernels,
                "capture": section_capture,
                "parity": section_parity, "tuner": section_tuner,
                "ppl": lambda *a: section_ppl(*a, model_dir=args.model_dir, val=args.val)}
    env: dict = {}
    t_all = time.perf_counter()
    for sec in args.sections.split(","):
        if time.perf_counter() - t_all > args.budget_s:
            note(f"{sec}: skipped (past the {args.budget_s:.0f} s budget)")
            continue
        t = time.perf_counter()
        try:
            if not env:
                env = RESULTS["env"] = section_env(dev, args.smoke)
            if sec != "env":
                RESULTS[sec] = sections[sec](dev, args.smoke, tmp, env)
        except Exception as exc:  # noqa: BLE001 (report the section and go on with the next)
            traceback.print_exc()
            RESULTS[sec] = {"error": f"{type(exc).__name__}: {exc}"}
            note(f"{sec}: FAILED ({type(exc).__name__}: {str(exc)[:300]})")
        RESULTS.setdefault("seconds", {})[sec] = time.perf_counter() - t
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
