"""Structured output's cost in a batch: 32 requests, 8 of them constrained by a JSON schema.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_structured.py [--model models/smollm2] [--repeats 3]

The model: --model DIR (the real default, SmolLM2-135M-Instruct, 49,152-token vocabulary: `make serve`
or `shardserve fetch-default --out models/smollm2` puts it there), else a GPT-2-124M-shaped random
model whose vocabulary is a byte-level BPE trained here on synthetic text (no hub download; --vocab
tokens). Greedy, every request decoding exactly --tokens tokens (the 24 plain ones ignore EOS; the 8
constrained ones follow a schema that cannot be complete before then, an array of at least 200
short strings), so the batch keeps its shape. Three kinds of run in one process, fill32 and mixed32
interleaved --repeats times (the machine is shared and noisy: the ratio is taken per pair and the
median pair reported, with the range):

- plain24: the 24 unconstrained requests alone;
- fill32: the same 24 plus 8 unconstrained fillers of the same length (the same batch shape);
- mixed32: the same 24 plus the 8 JSON-schema requests.

Reported: the 24 plain requests' tokens per second in each run, mixed32 / fill32 (what the
grammars cost them: target >= 0.95) and mixed32 / plain24 (also the 8 extra rows' model work),
and per step of mixed32: the host thread's bitmask fill (overlapped with the forward; masked-first
rows only) and the step's critical-path grammar cost (waiting for that fill + applying masks +
testing checked-first rows' tokens + filling and applying the masks of refused rows and drawing
them again), as fractions of the step (target <= 10 %), and how many checked-first rows the grammar
refused. --masks masked-first is the reference mode (every constrained row's mask filled on the
host thread while the model runs).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import CACHE

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["log"], "properties": {
    "log": {"type": "array", "minItems": 200, "items": {"type": "string", "maxLength": 12}}}}


def checkpoint(vocab: int) -> Path:
    """GPT-2-124M shape, random weights, with a byte-level BPE tokenizer of `vocab` tokens (cached)."""
    d = CACHE / f"gpt2-124m-random-bpe{vocab}"
    if (d / "tokenizer.json").is_file():
        return d
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engines.core.config import ModelConfig
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[:rng.randint(6, 26)]) for _ in range(rng.randint(1, 9)))
             for _ in range(60_000)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) + f' {{"k": {rng.randint(0, 9999)}, "v": "x"}}'
              for _ in range(20_000)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    n = tk.get_vocab_size()
    cfg = ModelConfig(model_type="gpt2", vocab_size=n, n_layer=12, n_head=12, n_embd=768,
                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=(0,))
    save_checkpoint(GPT(cfg).init_weights(seed=0), cfg, d)
    tk.save(str(d / "tokenizer.json"))
    return d


class MaskClock:
    """Seconds the sampler spends on masks: the host thread's fills, and on the step's path."""

    def __init__(self, sampler):
        from engines.runner import grammar

        self.fill = self.path = 0.0
        self._depth = 0  # path time is counted by the outermost timed call only
        fill, masks, check, apply = sampler._fill_masks, sampler._masks, sampler._check_first, grammar.apply_bitmask

        def timed_fill(*a):
            t = time.perf_counter()
            try:
                return fill(*a)
            finally:
                self.fill += time.perf_counter() - t

        def timed(fn):
            def run(*a):
                t = time.perf_counter()
                self._depth += 1
                try:
                    return fn(*a)
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self.path += time.perf_counter() - t
            return run

        sampler._fill_masks, sampler._masks, sampler._check_first = timed_fill, timed(masks), timed(check)
        grammar.apply_bitmask = timed(apply)


def lockstep(d: Path, args, plain, shaped, prompts: list[str]) -> None:
    """fill32 and mixed32 (one engine per --masks mode) in one process, stepped in turn (who goes first
    rotates every step), so a load that drifts hits all alike: --repeats bursts of the same requests."""
    import os
    import statistics

    from engines.core.config import EngineConfig
    from engines.core.llm_engine import LLMEngine

    cfg = EngineConfig(max_num_seqs=32, max_model_len=256, worker_threads=args.threads)
    modes = ("check-first", "masked-first") if args.masks == "both" else (args.masks,)
    engines = {"fill32": LLMEngine(d, cfg)} | {m: LLMEngine(d, cfg) for m in modes}
    clocks = {}
    for m in modes:
        engines[m].executor.runner.sampler.check_first = m == "check-first"
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    k = 0
    for b in range(-1, args.repeats):  # burst -1: the warm-up (grammar compiled, kernels loaded)
        n_tok = 8 if b < 0 else args.tokens
        for name, e in engines.items():
            for i, p in enumerate(prompts):
                e.add_request(f"b{b}-{i}", p, (shaped if name != "fill32" and i >= 24 else plain).replace(
                    max_tokens=n_tok))
        if b == 0:
            clocks = {m: MaskClock(engines[m].executor.runner.sampler) for m in modes}
        for c in clocks.values():
            c.fill = c.path = 0.0
        counts = {m: (engines[m].executor.runner.sampler.grammar_checked,
                      engines[m].executor.runner.sampler.grammar_refused) for m in modes}
        steps: dict[str, list[float]] = {n: [] for n in engines}
        load0 = os.getloadavg()[0]
        names = list(engines)
        while any(e.has_unfinished_requests() for e in engines.values()):
            for name in names[k % len(names):] + names[:k % len(names)]:  # who goes first rotates
                e = engines[name]
                if e.has_unfinished_requests():
                    t = time.perf_counter()
                    e.step()
                    steps[name].append(time.perf_counter() - t)
            k += 1
        if b < 0:
            continue
        line = f"  burst {b}: fill32 {24 * n_tok / sum(steps['fill32']):6.1f} plain tok/s"
        for m in modes:
            s = engines[m].executor.runner.sampler
            pair = [x / f for f, x in zip(steps["fill32"], steps[m])]
            ratios[m].append(sum(steps["fill32"]) / sum(steps[m]))  # the plain rows' tok/s, mixed32 / fill32
            busy = sum(steps[m])
            line += (f" | mixed32 {m} {24 * n_tok / busy:6.1f}, / fill32 {ratios[m][-1]:.3f} (per-step median "
                     f"{1 / statistics.median(pair):.3f}), step {1000 * busy / len(steps[m]):.1f} ms, fill "
                     f"{clocks[m].fill / busy:.1%}, on the path {clocks[m].path / busy:.1%}, refused "
                     f"{s.grammar_refused - counts[m][1]}/{s.grammar_checked - counts[m][0]} checked")
        print(line + f" | load {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    for m in modes:
        r = ratios[m]
        print(f"mixed32 ({m}) / fill32 = {statistics.median(r):.3f} median of {len(r)} lockstep bursts "
              f"(range {min(r):.3f}-{max(r):.3f}; target >= 0.95)")
    for e in engines.values():
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--model", type=Path, default=None, help="a model directory (default: the random GPT-2 shape)")
    ap.add_argument("--repeats", type=int, default=3, help="fill32 / mixed32 pairs, interleaved")
    ap.add_argument("--masks", choices=("check-first", "masked-first", "both"), default="check-first",
                    help="the sampler's mode for the constrained (greedy) rows: the default tests each row's own "
                         "choice and masks only refused rows; masked-first fills every row's mask on the host thread; both (with --lockstep): one engine each")
    ap.add_argument("--lockstep", action="store_true",
                    help="fill32 and mixed32 as two engines stepped alternately in one process (drift-proof)")
    ap.add_argument("--threads", type=int, default=0, help="EngineConfig.worker_threads (0: adaptive)")
    args = ap.parse_args()
    if args.masks == "both" and not args.lockstep:
        ap.error("--masks both needs --lockstep (one engine per mode)")
    from engines import LLM, SamplingParams
    from engines.runner.grammar import StructuredOutput

    d = args.model or checkpoint(args.vocab)
    prompts = [f"request {i}: the story of {i * 7} words" for i in range(32)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=args.tokens, temperature=0,
                            structured=StructuredOutput.json_schema(SCHEMA, "bench"))
    if args.lockstep:
        from engines.core.hardware import cpu_name

        print(f"{d.name}, 24 plain + 8 others, {args.tokens} tokens each, greedy, masks {args.masks}, threads "
              f"{args.threads or 'adaptive'}, lockstep; CPU {cpu_name()}")
        return lockstep(d, args, plain, shaped, prompts)
    llm = LLM(d, max_num_seqs=32, max_model_len=256)
    sampler = llm.engine.executor.runner.sampler
    sampler.check_first = args.masks == "check-first"
    llm.generate(prompts[:8], [shaped] * 4 + [plain] * 4)  # warm-up: grammar compiled, kernels loaded
    clock = MaskClock(sampler)

    def run(params):
        eng = llm.engine
        s0, b0 = eng.num_steps, eng.busy_seconds
        t = time.perf_counter()
        outs = llm.generate(prompts[:len(params)], params)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs), "a request ended early"
        return 24 * args.tokens / wall, eng.num_steps - s0, eng.busy_seconds - b0, outs

    import statistics

    from engines.core.hardware import cpu_name

    cpu = cpu_name()
    name = d.name if args.model else "GPT-2-124M shape (random)"
    print(f"{name}, vocab {sampler.vocab_size}, 24 plain + 8 others, {args.tokens} tokens each, greedy, masks "
          f"{args.masks}; "
          f"{args.repeats} interleaved pairs; CPU {cpu}")
    tps_plain, *_ = run([plain] * 24)
    ratios, fills, paths, steps_ms = [], [], [], []
    for _ in range(args.repeats):
        tps_fill, *_ = run([plain] * 32)
        clock.fill = clock.path = 0.0
        checked, refused = sampler.grammar_checked, sampler.grammar_refused
        tps_mixed, steps, busy, outs = run([plain] * 24 + [shaped] * 8)
        checked, refused = sampler.grammar_checked - checked, sampler.grammar_refused - refused
        assert all(o.outputs[0].text.startswith('{"log": [') for o in outs[24:]), outs[24].outputs[0].text[:40]
        ratios.append(tps_mixed / tps_fill)
        fills.append(clock.fill / busy)
        paths.append(clock.path / busy)
        steps_ms.append(1000 * busy / steps)
        print(f"  pair: fill32 {tps_fill:7.1f} tok/s | mixed32 {tps_mixed:7.1f} | ratio {ratios[-1]:.3f} | "
              f"step {steps_ms[-1]:.1f} ms, fill {fills[-1]:.1%}, on the path {paths[-1]:.1%}"
              + (f", refused {refused}/{checked} rows checked first" if checked else ""))
    med = statistics.median
    print(f"plain24 alone: {tps_plain:.1f} tok/s (the 24 plain requests)")
    print(f"mixed32 / fill32 = {med(ratios):.3f} median (range {min(ratios):.3f}-{max(ratios):.3f}; "
          "target >= 0.95: the grammars' cost to the others)")
    print(f"mixed32 per step ({med(steps_ms):.1f} ms): bitmask fill on the host thread {med(fills):.1%} of the step "
          f"(overlapped); on the step's path (wait, apply, check, refused rows) {med(paths):.1%} (range {min(paths):.1%}-{max(paths):.1%}; "
          "target <= 10 %)")


if __name__ == "__main__":
    main()
