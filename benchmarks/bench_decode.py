"""B1: batch-1 decode speed against transformers `generate` and against the memory roofline.

    .venv/bin/python benchmarks/bench_decode.py [--tokens 64] [--rounds 4] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_decode.py --fused-ab [--tokens 32] [--rounds 3]

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
    from engines.loading.checkpoint import save_checkpoint
    from engines.core.config import ModelConfig
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
        llms = {f: LLM(d, dtype=dtype_name, fused_decode=f) for f in ("off", "auto")}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--fused-ab", action="store_true", help="fused decode step on / off, SmolLM2 shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.fused_ab:
        return fused_ab(args)
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
