"""The greedy screen of an fp32 head (engines/cpu/greedy_head.py) against the full fp32 head, on SmolLM2-135M.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_greedy_head.py [--model models/smollm2] [--reps 4]

Two figures, each a ratio measured in one process with both ways alternating: (1) the head alone (fp32 logits and
their argmax, against the screen's tokens) on hidden rows the model produced, 1 row and 64 rows, median of 15, with
the screen's candidates a row; (2) an engine's 64-row decode steps (64 prompts of 16-256 tokens, 64 greedy tokens
each) with the screen on and off, two engines side by side, alternating runs, the steps' median each run. Both check
that the tokens agree.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from benchmarks.common import cpu_line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2"))
    ap.add_argument("--reps", type=int, default=4, help="engine runs of each way (alternating)")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    if args.reps < 1 or args.rows < 1:
        ap.error("--reps and --rows: integers >= 1")

    from engines import LLM, SamplingParams
    from engines.core.step_record import STEP_FIELDS
    from engines.cpu.greedy_head import GreedyScreen
    from engines.cpu.panel_kernel import panel_linear_f32
    from engines.model.transformer import head_logits

    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    # a token a step: the full head's runs would otherwise take several steps a call (decode_steps), the screen's not
    llms = {on: LLM(args.model, dtype="float32", kv_cache_bytes=1 << 30, greedy_head_screen=on, decode_steps=1)
            for on in (True, False)}
    runner = llms[False].engine.executor.runner
    head = runner.model.lm_head
    screen = GreedyScreen(head.weight, runner.model_config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(16, 256))] for _ in range(args.rows)]

    # (1) the head alone, on the model's own hidden rows (its last layer's output for the prompts' last tokens)
    hidden = []
    step_head = runner.head
    add_rows = step_head.add_rows
    step_head.add_rows = lambda ws, h: hidden.append(h.detach().clone()) or add_rows(ws, h)
    llms[False].generate(prompts, [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True) for _ in prompts])
    step_head.add_rows = add_rows
    h_all = torch.cat([h for h in hidden if h.shape[0] == args.rows][-1:] or hidden, 0)[: args.rows]
    print("| rows | full fp32 head + argmax ms | screen ms | full / screen | candidates a row (median, max) | tokens |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in (1, args.rows):
            h = h_all[:rows].contiguous()
            tf, ts = [], []
            for _ in range(15):
                t = time.perf_counter()
                want = head_logits(head, h).argmax(dim=-1)
                tf.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = screen.tokens(h)
                ts.append(time.perf_counter() - t)
            a = panel_linear_f32(h.bfloat16(), screen.panels, head.weight.shape[0])[:, : screen.vocab].contiguous()
            pairs = screen._near(a, (h.norm(dim=1) * screen.c).float(), screen.norms)
            count = torch.bincount(pairs[:, 0], minlength=rows).float()
            f, s = statistics.median(tf), statistics.median(ts)
            same = got is not None and torch.equal(got, want)
            print(f"| {rows} | {f * 1e3:.2f} | {s * 1e3:.2f} | **{f / s:.2f}x** | {count.median():.0f}, {count.max():.0f} | "
                  f"{'same' if same else 'DIFFER'} |", flush=True)

    # (2) an engine's decode steps, screen on and off
    steps = {True: [], False: []}
    outs = {}
    for rep in range(args.reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            llm = llms[on]
            llm.reset_prefix_cache()
            t = time.monotonic()
            res = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True) for _ in prompts])
            outs[on] = [r.outputs[0].token_ids for r in res]
            rec = [dict(zip(STEP_FIELDS, s)) for s in llm.engine.step_recorder.rows() if s[0] >= t]
            dec = [x["seconds"] for x in rec if not x["prefill_seqs"] and x["decode_seqs"] == args.rows]
            steps[on].append(statistics.median(dec))
            print(f"run {rep} screen {'on ' if on else 'off'}: {len(dec)} decode steps of {args.rows} rows, median "
                  f"{statistics.median(dec) * 1e3:.1f} ms", flush=True)
    ratio = statistics.median(b / a for a, b in zip(steps[True], steps[False]))
    print(f"| decode step, {args.rows} rows | screen off {statistics.median(steps[False]) * 1e3:.1f} ms | on "
          f"{statistics.median(steps[True]) * 1e3:.1f} ms | off / on (median of the runs' ratios) **{ratio:.3f}x** | "
          f"greedy streams {'the same' if outs[True] == outs[False] else 'DIFFER'} |")


if __name__ == "__main__":
    main()
