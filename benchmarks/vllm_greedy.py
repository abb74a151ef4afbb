"""Does vLLM's CPU build serve our imported directory with the same greedy tokens as we do? (issue 35.4)

The 20 chat prompts of benchmarks/bench_quality.py, the model's chat template applied (transformers'
`apply_chat_template` on the directory, so both engines get the same prompt ids), greedy decoding of up to
`--max-tokens` tokens stopping at the model's EOS, through our engine (in this process) and through vLLM
(a child process in vLLM's own venv, with both cores bound as its CPU docs advise). Prints how many of
the 20 token-id lists are equal and, for each other one, the first position where they part.

    PYTHONPATH=. nice -n 5 .venv/bin/python benchmarks/vllm_greedy.py \
        [--model models/smollm2] [--vllm-python .vllm-venv/bin/python] [--dtype float32]

Raw output: runs/vllm_greedy.json. The child mode (`--child IN OUT`) imports only vllm and json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(inp: Path, out: Path) -> None:
    """Runs in vLLM's venv: greedy token ids for each prompt of `inp` into `out`."""
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.loads(inp.read_text())
    t = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, kv_cache_memory_bytes=1 << 28, seed=0)
    load_s = time.perf_counter() - t
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
    # vLLM reports the dtype it ran, which may differ from the one asked for on some CPUs
    ran = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    out.write_text(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "vllm": vllm.__version__,
                               "dtype": ran, "load_s": round(load_s, 1)}))


def all_cores() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    """Both engines stop at EOS; one may report the EOS token and the other not, so compare without it."""
    return ids[:-1] if ids and ids[-1] in eos else ids


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len of the shorter when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    from benchmarks.bench_quality import PROMPTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".vllm-venv" / "bin" / "python")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the vLLM child")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engines import LLM, SamplingParams
    from engines.loading.tokenizer import Tokenizer

    model = args.model.resolve()
    hf_tk = AutoTokenizer.from_pretrained(str(model))
    prompts = []
    for q in PROMPTS:
        ids = hf_tk.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    gen_eos = json.loads((model / "generation_config.json").read_text()).get("eos_token_id")
    eos = {int(hf_tk.convert_tokens_to_ids(hf_tk.eos_token))}
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])

    t = time.perf_counter()
    llm = LLM(str(model), dtype=args.dtype, num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    ours_s = time.perf_counter() - t
    llm.engine.shutdown()
    del llm

    work = ROOT / "runs" / "vllm_greedy"
    work.mkdir(parents=True, exist_ok=True)
    inp, outp = work / "job.json", work / "vllm_out.json"
    outp.unlink(missing_ok=True)
    inp.write_text(json.dumps({"model": str(model), "dtype": args.dtype, "max_tokens": args.max_tokens,
                               "prompts": prompts}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores()  # every core, as vLLM's CPU docs advise
    t = time.perf_counter()
    r = subprocess.run([str(args.vllm_python), str(Path(__file__).resolve()), "--child", str(inp), str(outp)],
                       capture_output=True, text=True, timeout=args.timeout, env=env, cwd=str(work))
    vllm_s = time.perf_counter() - t
    (work / "vllm_stderr.log").write_text(r.stderr)
    if r.returncode != 0 or not outp.is_file():
        sys.exit(f"vLLM child failed (rc {r.returncode}); its log: {work / 'vllm_stderr.log'}\n{r.stderr[-3000:]}")
    res = json.loads(outp.read_text())
    theirs = res["tokens"]

    tk = Tokenizer.from_dir(model)
    rows, equal = [], 0
    for q, a, b in zip(PROMPTS, ours, theirs):
        a, b = strip_eos(a, eos), strip_eos(b, eos)
        same = a == b
        equal += same
        row = {"q": q, "same": same, "ours": a, "vllm": b}
        if not same:
            i = first_divergence(a, b)
            row.update(at=i, prefix=tk.decode(a[:i]), ours_next=tk.decode(a[i:i + 4]), vllm_next=tk.decode(b[i:i + 4]))
        rows.append(row)
    summary = {"equal": equal, "prompts": len(PROMPTS), "dtype_ours": args.dtype, "dtype_vllm": res["dtype"],
               "vllm": res["vllm"], "max_tokens": args.max_tokens, "model": str(model), "ours_s": round(ours_s, 1),
               "vllm_s": round(vllm_s, 1), "vllm_load_s": res["load_s"], "bind": env["VLLM_CPU_OMP_THREADS_BIND"],
               "rows": rows}
    (ROOT / "runs" / "vllm_greedy.json").write_text(json.dumps(summary, indent=2))
    print(f"greedy tokens, {len(PROMPTS)} chat prompts (template applied), up to {args.max_tokens} tokens, "
          f"ours {args.dtype} vs vLLM {res['vllm']} {res['dtype']} (bind {summary['bind']}) on {model}:")
    print(f"equal: {equal}/{len(PROMPTS)}")
    for row in rows:
        if not row["same"]:
            print(f"  {row['q']!r}: first divergence at token {row['at']} after {row['prefix']!r}: "
                  f"ours {row['ours_next']!r} vs vLLM {row['vllm_next']!r}")
    print(f"(ours {ours_s:.1f} s incl. load; vLLM {vllm_s:.1f} s incl. start, load {res['load_s']} s)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
