"""What a CPU decode step costs outside its kernels: the engine's own share of the step (scheduler, runner, sampler,
outputs), against the whole step measured in the same run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_step_overhead.py [--model models/smollm2] [--dtype bfloat16]
        [--rows 1,64] [--fp8] [--tokens 64] [--rounds 3]

For each batch size B: B greedy requests (8-token prompts, --tokens new tokens each) through LLM.generate, the median
time of its decode steps (the prefill steps left out), first as they run, then with the step's C++ kernels answered
from a table: the fused decode step (decode_bound) returns a fixed hidden row block and the vocabulary head's kernel
(panel_linear_f32 / fp8_linear_f32 at the vocabulary's width) fixed logits, so what remains is everything else the
step does. Printed: both medians and the share outside the kernels. --fp8: the GPTQ FP8 file of bench_decode.py
with an FP8 head (its fp8h row). The kernel-less steps run no parallel region, so the intra-op worker thread sleeps
between steps and the few parallel ATen calls left (the embedding lookup, the final norm) wake it each time: the
share printed is a little above what the engine costs inside a real step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CannedKernels:
    """The kernel module with decode_bound and the vocabulary head's kernels answering from a table (when `on`)."""

    HEAD = ("panel_linear_f32", "fp8_linear_f32", "fp8_linear", "panel_linear")

    def __init__(self, mod, width: int, vocab: int):
        self.mod, self.width, self.vocab, self.on = mod, width, vocab, False
        self._hidden: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._logits: dict[tuple[str, int], torch.Tensor] = {}

    def __getattr__(self, name: str):
        f = getattr(self.mod, name)
        if name == "decode_bound":
            def decode_bound(handle, x, *args):
                if not self.on:
                    return f(handle, x, *args)
                key = (x.shape[0], x.dtype)
                if key not in self._hidden:
                    self._hidden[key] = torch.randn(x.shape[0], self.width).to(x.dtype)
                return self._hidden[key].clone()  # the step's residual stream is its own
            return decode_bound
        if name in self.HEAD:
            def head(x, panels, *args):
                n = args[1] if name.startswith("fp8") else args[0]  # out_features
                if not self.on or n < self.vocab:
                    return f(x, panels, *args)
                key = (name, x.shape[0])
                if key not in self._logits:
                    dtype = torch.float32 if name.endswith("_f32") else x.dtype
                    self._logits[key] = torch.randn(x.shape[0], n).to(dtype)
                return self._logits[key]
            return head
        return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "smollm2"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,64", help="comma list of batch sizes")
    ap.add_argument("--fp8", action="store_true", help="the GPTQ FP8 file with an FP8 head (bench_decode.py fp8h)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if any(r < 1 for r in rows) or args.tokens < 2 or args.rounds < 1:
        ap.error("--rows each >= 1, --tokens >= 2, --rounds >= 1")

    from engines import LLM, SamplingParams
    from engines.core.hardware import cpu_name
    from engines.cpu import panel_kernel

    model = Path(args.model)
    if args.fp8:
        from benchmarks.bench_decode import fp8_dir

        # a token a step (decode_steps=1): the step around the canned fused call is what is measured
        llm = LLM(fp8_dir(model, gptq=True), dtype="bfloat16", lm_head_dtype="fp8", worker_threads=2, decode_steps=1)
    else:
        llm = LLM(model, dtype=args.dtype, worker_threads=2, decode_steps=1)
    engine, runner = llm.engine, llm.engine.executor.runner
    if runner.fused is None:
        sys.exit(f"the fused decode step does not apply here: {runner.why_not.get('fused')}")
    cfg = runner.model.cfg
    canned = CannedKernels(runner.fused.mod, cfg.n_embd, cfg.vocab_size)
    runner.fused.mod = canned
    panel_kernel.load = lambda: (canned, "")  # the head's kernels (their module-level loader)
    times: list[float] = []
    step = engine.step

    def timed_step(*a, **k):
        eager = runner.paths["eager"]  # a step with a prompt in it runs the module path
        t = time.perf_counter()
        out = step(*a, **k)
        if runner.paths["eager"] == eager:  # a decode-only step
            times.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    print(f"{model.name}{' FP8 + FP8 head' if args.fp8 else ' ' + args.dtype}, {args.tokens} tokens a request, "
          f"2 threads; CPU {cpu_name()}; torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    for b in rows:
        prompts = [torch.randint(100, cfg.vocab_size - 100, (8,), generator=gen).tolist() for _ in range(b)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        med = {}
        for on in (False, True):
            canned.on = on
            runs = []
            for _ in range(args.rounds):
                times.clear()
                llm.generate(prompts, params)
                runs.append(statistics.median(times[1:]) if len(times) > 1 else float("nan"))
            med[on] = statistics.median(runs)
        canned.on = False
        print(f"  {b:3d} rows: decode step {med[False] * 1e3:7.3f} ms; without its kernels {med[True] * 1e3:6.3f} ms "
              f"({med[True] / b * 1e6:5.1f} us a row) = {100 * med[True] / med[False]:4.1f}% of the step")


if __name__ == "__main__":
    main()
