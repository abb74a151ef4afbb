"""B1: batch-1 decode speed against transformers `generate` and against the memory roofline.

    .venv/bin/python benchmarks/bench_decode.py [--tokens 64] [--rounds 4] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_decode.py --fused-ab [--tokens 32] [--rounds 3]
    .venv/bin/python benchmarks/bench_decode.py --real [--model DIR] [--tokens 48] [--rounds 5] [--threads 2]

--real: the real SmolLM2-135M-Instruct (default /work/main/models/smollm2) at batch 1 in fp32, bf16 and FP8
weight-only, bf16 activations: "fp8" the `shardserve quantize --calibration` file (GPTQ on the Shakespeare
training split, every block FP8: the file whose perplexity BENCHMARKS.md reports, -0.1 % against bf16), "fp8h"
the same file with lm_head_dtype fp8 (its GPTQ e4m3 head for the logits), "fp8rtn" the default file (round to
nearest, the end blocks kept float); each written once into the bench cache (--fp8 DIR: another file). The fused
CPU decode step on: decode tok/s (a 1-token and a (1 + N)-token generation timed back to back, the
difference), rounds interleaved, best of each; the weight bytes a decode token reads and the replica's
weight memory (the model's tensors: parameters, kernel copies, scales), FP8 / bf16 both ways; and the
fraction of the memory roofline: weight bytes per token over the best of a streaming read (fp32 sum) and a
copy (bytes read + written), measured between the rounds.

--fused-ab: on a random-weight Llama of SmolLM2-135M's shape (30 layers, width 576, 9 q / 3 kv heads,
FFN 1536, vocabulary 49152, tied head), our engine with the fused CPU decode step against the same
engine without it (engines/cpu/fused_decode.py), batch 1 and 8, fp32 and bf16: rounds interleaved, best
of each, the ratio printed.

GPT-2-124M shape, random weights, 2 threads on CPU. Each round times transformers and our
engine back to back (interleaved, so a noisy neighbour hurts both), and the best round of each
is kept. The roofline is the weight bytes one decode step must read (every matrix, the LM head
included; embedding lookups read one row) over the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gemv_stream_bandwidth, gpt2_124m_dir, read_bandwidth

TARGET_VS_HF, TARGET_ROOFLINE_BF16 = 1.5, 0.60


def weight_bytes_per_token(cfg, itemsize: int) -> int:
    params = cfg.num_params(include_embeddings=False)  # blocks + final norm
    return (params + cfg.vocab_size * cfg.n_embd) * itemsize  # + the LM head matrix


def smollm2_shape_dir() -> Path:
    """A random-weight Llama checkpoint of SmolLM2-135M's shape (written once, reused)."""
    from benchmarks.common import CACHE
    from engines.core.config import ModelConfig
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    d = CACHE / "smollm2-135m-shape-random"
    if (d / "config.json").is_file():
        return d
    cfg = ModelConfig(model_type="llama", vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                      intermediate_size=1536, max_position_embeddings=2048, rope_theta=100000.0, bias=False,
                      activation="silu", tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
    save_checkpoint(GPT(cfg).init_weights(seed=0), cfg, d)
    return d


def fused_ab(args) -> None:
    """Fused decode step on / off on the SmolLM2 shape (see the module doc)."""
    from engines import LLM, SamplingParams

    d = smollm2_shape_dir()
    n = args.tokens
    print(f"fused decode step A/B, SmolLM2-135M shape (random weights), {n} tokens, threads={args.threads}")
    for dtype_name in args.dtypes.split(","):
        llms = {f: LLM(d, dtype=dtype_name, fused_decode=f, decode_steps=1) for f in ("off", "auto")}  # a step a call
        fused = llms["auto"].engine.executor.runner.fused
        assert fused is not None, "the fused step did not apply"
        from engines.cpu.cpu_threads import intra_op_threads

        for t in sorted({1, args.threads}):
            with intra_op_threads(t):
                print(f"  {dtype_name}: fused step usable on {t} thread(s) at batch 1: {fused.usable(1)}, "
                      f"batch 8: {fused.usable(8)}")
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for batch in (1, 8):
            prompts = [list(range(100 + i, 108 + i)) for i in range(batch)]
            best = {f: float("inf") for f in llms}
            for llm in llms.values():
                llm.generate(prompts, params)  # warm-up
            for _ in range(args.rounds):
                for f, llm in llms.items():
                    t = time.perf_counter()
                    llm.generate(prompts, params)
                    best[f] = min(best[f], time.perf_counter() - t)
            tps = {f: batch * n / s for f, s in best.items()}
            print(f"  {dtype_name:9s} batch {batch}: module path {tps['off']:7.1f} tok/s | fused {tps['auto']:7.1f} "
                  f"tok/s | fused / module {tps['auto'] / tps['off']:4.2f}x")
        del llms


FP8_OVER_BF16, ROOFLINE = 1.6, 0.80
"""Issue 40 targets: batch-1 FP8 / bf16 decode, and the fraction of the memory roofline."""


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s moved by a large copy (read + written, STREAM's convention), best of N."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct tensor storages (parameters and buffers: weights, kernel copies, scales)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t is None or t.device.type != "cpu":
            continue
        try:
            key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except NotImplementedError:  # oneDNN's packed weight (opaque): its elements
            key, n = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += n
    return total


def read_bytes_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one batch-1 decode token reads: each block Linear's weight as its kernel stores it (FP8
    panels one byte a weight plus the scales), the LM head, the norms (embedding lookups: one row, left out)."""
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.cpu.fused_decode import blocks_of

    total = 0
    for b in blocks_of(model):
        for lin in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down):
            if isinstance(lin, Fp8PanelLinear):
                total += lin.panels.numel() + 4 * lin.scales.numel()
            elif lin.weight is None:  # a FastLinear that kept only its panels (padded to 16 outputs)
                total += lin.panels.numel() * lin.panels.element_size()
            else:
                total += lin.weight.numel() * lin.weight.element_size()
        total += sum(p.numel() * p.element_size() for n in (b.norm1, b.norm2) for p in n.parameters())
    head = model.lm_head
    if isinstance(head, Fp8PanelLinear):  # lm_head_dtype fp8: e4m3 rows plus their scales
        return total + head.panels.numel() + 4 * head.scales.numel()
    return total + head.weight.numel() * head.weight.element_size()


def fp8_dir(model: Path, gptq: bool) -> Path:
    """`shardserve quantize` of `model` (gptq: with --calibration on the Shakespeare training split's text, never
    the validation text), written once into the bench cache."""
    import subprocess

    from benchmarks.common import CACHE

    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / f"{model.name}-fp8{'-gptq' if gptq else ''}"
    extra = []
    if gptq:
        from benchmarks.bench_quality import shakespeare_texts, training_text

        text = CACHE / "shakespeare-train.txt"
        if not text.is_file():
            text.write_text(training_text(shakespeare_texts()), encoding="utf-8")
        extra = ["--calibration", str(text)]
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "shardserve", "quantize", "--model", str(model), "--out", str(out),
                        *extra], check=True, cwd=Path(__file__).resolve().parents[1])
    return out


def real_model(args) -> None:
    """fp32, bf16 and FP8 batch-1 decode on the real model against the memory roofline (see the module doc)."""
    import os

    from engines import LLM, SamplingParams
    from engines.core.hardware import cpu_name, read_cpu_flags
    from engines.cpu.panel_kernel import fp8_variant

    model = Path(args.model)
    flags = sorted(f for f in (read_cpu_flags() or ()) if f.startswith(("avx", "fma", "f16c", "amx")))
    print(f"batch-1 decode, {model.name}, {args.tokens} tokens, threads={args.threads}; CPU {cpu_name()} "
          f"({' '.join(flags)}); FP8 kernel variant {fp8_variant('auto', torch.bfloat16)} (bf16 rows); load average {os.getloadavg()[0]:.1f}")
    fp8 = Path(args.fp8) if args.fp8 else fp8_dir(model, gptq=True)
    runs = {"fp32": (model, "float32", "auto"), "bf16": (model, "bfloat16", "auto"), "fp8": (fp8, "bfloat16", "auto"),
            "fp8h": (fp8, "bfloat16", "fp8"),  # fp8h: the same file, lm_head_dtype fp8 (an e4m3 head for the logits)
            "fp8rtn": (fp8_dir(model, gptq=False), "bfloat16", "auto")}
    # a fixed thread count (the adaptive chooser would pick per step, on a busy host unlike run to run)
    llms = {k: LLM(d, dtype=dt, lm_head_dtype=h, worker_threads=args.threads) for k, (d, dt, h) in runs.items()}
    for k, llm in llms.items():
        runner = llm.engine.executor.runner
        if runner.fused is None:
            print(f"  {k}: the fused step does not apply ({runner.why_not.get('fused')})")
    prompt = [list(range(100, 108))]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=1 + args.tokens, ignore_eos=True)
    best = {k: float("inf") for k in llms}
    bw_read = bw_copy = 0.0
    for llm in llms.values():
        llm.generate(prompt, many)  # warm-up
    for _ in range(args.rounds):
        for k, llm in llms.items():  # A/B/C interleaved: a neighbour's burst hits all alike
            t0 = time.perf_counter()
            llm.generate(prompt, one)
            t1 = time.perf_counter()
            llm.generate(prompt, many)
            t2 = time.perf_counter()
            best[k] = min(best[k], ((t2 - t1) - (t1 - t0)) / args.tokens)
        bw_read = max(bw_read, read_bandwidth(1 << 28))
        bw_copy = max(bw_copy, copy_bandwidth())
    bw = max(bw_read, bw_copy)
    print(f"  memory: streaming read {bw_read / 1e9:.1f} GB/s, copy {bw_copy / 1e9:.1f} GB/s (read + written); "
          f"roofline on {bw / 1e9:.1f} GB/s; load average now {os.getloadavg()[0]:.1f}")
    res = {}
    for k, llm in llms.items():
        m = llm.engine.executor.runner.model
        rb, mem = read_bytes_per_token(m), tensor_bytes(m)
        tps = 1 / best[k]
        res[k] = (tps, rb, mem)
        print(f"  {k:5s} {tps:7.1f} tok/s ({best[k] * 1e3:6.2f} ms/token) | reads {rb / 1e6:6.1f} MB/token -> "
              f"{rb * tps / 1e9:5.1f} GB/s = {100 * rb * tps / bw:4.1f}% of the roofline | weight memory "
              f"{mem / 1e6:6.1f} MB | paths {dict(llm.engine.executor.runner.paths)}")
    b = res["bf16"]
    for k in ("fp8", "fp8h", "fp8rtn"):
        f = res[k]
        print(f"  {k} / bf16: {f[0] / b[0]:.2f}x tok/s [{'MET' if f[0] / b[0] >= FP8_OVER_BF16 else 'MISSED'} "
              f">= {FP8_OVER_BF16}x]; bytes read a token {f[1] / b[1]:.3f}x (the ceiling of the speed-up: "
              f"{b[1] / f[1]:.2f}x); weight memory {f[2] / b[2]:.3f}x")
    print(f"  bf16 / fp32: {b[0] / res['fp32'][0]:.2f}x tok/s")
    for k, (tps, rb, _) in res.items():
        frac = rb * tps / bw
        print(f"  roofline {k}: {100 * frac:.1f}% [{'MET' if frac >= ROOFLINE else 'MISSED'} >= {100 * ROOFLINE:.0f}%]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--fused-ab", action="store_true", help="fused decode step on / off, SmolLM2 shape")
    ap.add_argument("--real", action="store_true", help="fp32 / bf16 / FP8 batch 1 on the real model, roofline")
    ap.add_argument("--model", default="/work/main/models/smollm2", help="--real: the model directory")
    ap.add_argument("--fp8", help="--real: the FP8 directory of the fp8 / fp8h rows (default: the GPTQ file)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.fused_ab:
        return fused_ab(args)
    if args.real:
        return real_model(args)
    from transformers import AutoModelForCausalLM

    from engines import LLM, SamplingParams
    from engines.core.config import ModelConfig

    d = gpt2_124m_dir()
    cfg = ModelConfig.from_dir(d)
    prompt = list(range(100, 108))
    n = args.tokens
    print(f"B1 batch-1 decode, GPT-2-124M shape, {n} tokens, device={args.device}, threads={args.threads}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(args.device).eval()
        llm = LLM(d, dtype=dtype_name, device=args.device)
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ids = torch.tensor([prompt], device=args.device)

        def run_hf(hf=hf, ids=ids):
            with torch.inference_mode():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        def run_ours(llm=llm, params=params):
            llm.generate([prompt], params)

        def sync():
            if args.device == "cuda":
                torch.cuda.synchronize()

        run_hf(), run_ours()  # warm-up
        best_hf = best_ours = float("inf")
        bw = 0.0
        for _ in range(args.rounds):
            for fn, which in ((run_hf, "hf"), (run_ours, "ours")):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                dt = time.perf_counter() - t
                if which == "hf":
                    best_hf = min(best_hf, dt)
                else:
                    best_ours = min(best_ours, dt)
            bw = max(bw, read_bandwidth(device=args.device))
        # time per token excludes the prompt's prefill only approximately; both pay it alike
        hf_tps, ours_tps = n / best_hf, n / best_ours
        wbytes = weight_bytes_per_token(cfg, dtype.itemsize)
        roof_tps = bw / wbytes
        rows.append((dtype_name, hf_tps, ours_tps, ours_tps / hf_tps, roof_tps, ours_tps / roof_tps))
        print(f"  {dtype_name:9s} transformers {hf_tps:7.1f} tok/s | ours {ours_tps:7.1f} tok/s | "
              f"ratio {ours_tps / hf_tps:5.2f}x (target >= {TARGET_VS_HF}x) | read bw {bw / 1e9:5.1f} GB/s, "
              f"{wbytes / 1e6:.0f} MB/token -> roofline {roof_tps:6.1f} tok/s, ours at "
              f"{100 * ours_tps / roof_tps:4.1f}%")
        if args.device == "cpu":
            # the same matrices through torch's matrix-vector kernel with nothing in between: the
            # fraction of the roofline a decode step could reach if everything else took no time
            c = cfg.n_embd
            shapes = [s for _ in range(cfg.n_layer) for s in ((3 * c, c), (c, c), (cfg.ffn_dim, c), (c, cfg.ffn_dim))]
            gemv_bw = gemv_stream_bandwidth([*shapes, (cfg.vocab_size, c)], dtype)
            print(f"  {'':9s} bare GEMV loop over the same matrices: {gemv_bw / 1e9:5.1f} GB/s = "
                  f"{100 * gemv_bw / bw:4.1f}% of the read bandwidth (the ceiling of 'ours / roofline' with "
                  f"torch's kernel); ours reaches {100 * (ours_tps * wbytes) / gemv_bw:4.1f}% of it")
        del hf, llm
    for name, _, _, ratio, _, frac in rows:
        ok_ratio = "MET" if ratio >= TARGET_VS_HF else "MISSED"
        line = f"  {name}: vs transformers {ratio:.2f}x [{ok_ratio}]"
        if name == "bfloat16":
            line += f"; roofline {100 * frac:.1f}% [{'MET' if frac >= TARGET_ROOFLINE_BF16 else 'MISSED'}]"
        print(line)


if __name__ == "__main__":
    main()
