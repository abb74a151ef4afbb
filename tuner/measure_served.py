"""The served engine against the engine in isolation: one `shardserve serve` of two probe sizes in
every layout of this host, load-tested closed loop at 1, 4 and 8 requests in flight, and per layout
a fit of

    served step(w) = served_scale * (isolated step(w) - isolated attention(w))
                     + attention_scale * isolated attention(w) + per_step + per_token * sampled(w)

where `isolated` is the layout's cost model as fitted on its own probe steps
(tuner.measure_engine). served_scale is what sharing the cores with Ray, the gateway and the
client does to the engine's own work (it grows with the step: a 2-thread matmul waits for its
slower thread whenever another process runs); attention has its own factor because the isolated
fit's attention rate (from few long-context steps) is the constant its fit pins least, and the
served runs' contexts (17-145 tokens) tell it apart; per_step is what the serving loop adds per step
(for several shards: the Ray executor's actor calls, in place of the pipes the isolated fit ran
on); per_token is streaming one token through Ray, the gateway and the client. The fit replays
each run's own schedule in the simulator (sent times, lengths) and solves for the four
constants on every request's TPOT, by non-negative least squares on relative errors, twice over
(the schedule moves with the step times). The gateway's own cost per request (request_overhead)
is what the one-shard copies' TTFT, one request at a time, has beyond their served prefill step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

SERVE_PROMPT, SERVE_OUTPUT = 16, 17  # tokens of the one-at-a-time requests (as the load tester counts them)
CONCURRENCY = ((1, 3, SERVE_PROMPT), (4, 8, 128), (8, 16, 64))
"""(requests in flight, requests measured, prompt tokens) of each closed-loop run per copy: one at
a time with short prompts (the gateway's per-request cost, the per-step cost at batch 1), and
batches of 4 and 8 (the per-token cost, how the served step grows with the batch) with prompts
that put decode contexts at 65-145 tokens, not only the 17-34 of short prompts (attention's share
of a step grows with the context)."""
PRIOR_WEIGHT = 0.5
MIN_FACTOR = 0.25
FIT_ROUNDS = 2  # the schedule, simulated with the first fit, is refitted once


def serve_probes(copies: dict[str, tuple[Path, int, int, int]], work_dir: Path, dtype: str,
                 progress: Callable[[str], None] = print) -> dict[str, dict[int, object]]:
    """Serve every copy {name: (checkpoint, tp, pp, threads per shard)} in one `shardserve serve`
    (fractional CPU reservations, so that they all fit; threads as the tuner's deployments give
    them) and load-test them one at a time: {name: {requests in flight: loadtest Report}}."""
    import yaml

    from loadtest.config import LoadTestConfig
    from loadtest.runner import run
    from tuner.server import Server

    models = []
    for name, (path, tp, pp, threads) in copies.items():
        share = 0.9 / len(copies) / (tp * pp + 1)  # Ray needs only to place them; one copy is busy at a time
        models.append({"name": name, "path": str(path), "num_cpus": round(share, 3),
                       **({"shard_num_cpus": round(share, 3)} if tp * pp > 1 else {}),
                       "engine": {"dtype": dtype, "worker_threads": threads, "tensor_parallel_size": tp,
                                  "pipeline_parallel_size": pp, **({"pipeline_microbatches": 1} if pp > 1 else {})}})
    conf = work_dir / "probe.yaml"
    conf.write_text(yaml.safe_dump({"models": models}))
    out: dict[str, dict[int, object]] = {}
    with Server(["--config", str(conf)], work_dir / "serve.log") as url:
        for name, (path, *_rest) in copies.items():
            progress(f"served probe {name}: closed loop at {', '.join(str(c) for c, _, _ in CONCURRENCY)} in flight")
            base = {"url": url, "model": name, "backend": "openai-completions", "random_input_len": SERVE_PROMPT,
                    "tokenizer": path / "tokenizer.json", "ignore_eos": True, "progress": False, "seed": 1}
            run(LoadTestConfig(**base, random_output_len=4, closed_loop_concurrency=2, num_prompts=2))  # warm-up
            out[name] = {c: run(LoadTestConfig(**{**base, "random_input_len": plen}, random_output_len=SERVE_OUTPUT,
                                               closed_loop_concurrency=c, num_prompts=n)) for c, n, plen in CONCURRENCY}
    return out


def requests_of(report, extra_tokens: int) -> dict[str, np.ndarray]:
    """The completed, measured requests of a load-test Report as arrays (the engine's prompt
    lengths: `extra_tokens` added by the tokenizer's BOS)."""
    # full replies only: a reply cut short (fewer tokens than asked, despite ignore_eos) has no TPOT
    recs = [r for r in report.records if not r.warmup and r.ok and r.output_tokens == r.requested_output_tokens]
    if not recs:
        raise RuntimeError("a served probe run completed no request with every token it asked for")
    return {"arrivals": np.array([r.sent_s for r in recs]), "ins": np.array([r.input_tokens + extra_tokens for r in recs]),
            "outs": np.array([r.requested_output_tokens for r in recs]), "ttft": np.array([r.ttft_s for r in recs]),
            "tpot": np.array([r.tpot_s for r in recs])}



def _sched(req: dict[str, np.ndarray]):
    from engines.config import EngineConfig
    from engines.scheduler import SchedulerConfig

    d = EngineConfig()  # the probes are served with the engine's default limits
    return SchedulerConfig(max_num_seqs=d.max_num_seqs, max_num_batched_tokens=d.max_num_batched_tokens,
                           block_size=d.block_size, num_blocks=4096,
                           max_model_len=int(req["ins"].max() + req["outs"].max() + 1))


def fit_served(runs: list[tuple[object, dict[str, np.ndarray]]], request_overhead_s: float = 0.0,
               per_run: list[tuple[float, float]] | None = None) -> tuple[float, float, float, float, float]:
    """(served_scale, attention_scale, per_step_s, per_token_s, median |relative error| of the
    fitted TPOTs, %) from (isolated CostModel, requests of one run) pairs of one layout. Relative
    errors, reweighted toward least absolute deviations: a request that another process stretched
    pulls the fit by its count, not its square. `per_run` receives (measured, fitted) TPOT p50 (s)
    of each run."""
    from tuner.measure_engine import ROBUST_ITERATIONS, nnls
    from tuner.simulate import StepRecord, simulate

    x = np.array([1.0, 1.0, 0.0, 0.0])
    rel = np.zeros(0)
    caches: list[dict] = [{} for _ in runs]  # isolated (rest, attention) by StepWork: the steps repeat

    def iso(cost, cache: dict, w) -> tuple[float, float]:
        if w not in cache:
            parts = cost.components(w)
            attn = parts["attention"]
            cache[w] = (sum(parts.values()) - attn, attn)
        return cache[w]

    def served(cost, cache: dict, w, x: np.ndarray) -> float:
        rest, attn = iso(cost, cache, w)
        return x[0] * rest + x[1] * attn + x[2] + x[3] * w.sampled

    for _ in range(FIT_ROUNDS):
        rows, fitted = [], []
        for (cost, req), cache in zip(runs, caches, strict=True):
            steps: list[StepRecord] = []
            traces = simulate(lambda w, c=cost, k=cache, x=x: served(c, k, w, x), _sched(req), req["arrivals"],
                              req["ins"], req["outs"], request_overhead=request_overhead_s, steps_out=steps)
            ends = np.array([s.end for s in steps])
            feats = np.array([[*iso(cost, cache, s.work), 1.0, s.work.sampled] for s in steps])
            run_rows = []
            for tr, measured in zip(traces, req["tpot"], strict=True):
                n = len(tr.token_times)
                if n < 2 or not np.isfinite(measured) or measured <= 0:
                    continue
                sel = (ends > tr.token_times[0] + 1e-12) & (ends <= tr.token_times[-1] + 1e-12)
                run_rows.append(feats[sel].sum(axis=0) / (n - 1))
                rows.append(run_rows[-1] / measured)
            fitted.append((float(np.nanmedian(req["tpot"])), run_rows))
        a = np.array(rows)
        # a weak prior at the isolated fit (both factors 1, PRIOR_WEIGHT of one request each): where
        # the runs cannot tell the factor from the per-step and per-token costs, it stays near 1
        prior = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]) * PRIOR_WEIGHT
        a_all, y_all = np.vstack([a, prior]), np.concatenate([np.ones(len(a)), [PRIOR_WEIGHT, PRIOR_WEIGHT]])
        scale = np.maximum(np.abs(a_all).max(axis=0), 1e-30)
        robust = np.ones(len(a_all))
        for _ in range(ROBUST_ITERATIONS):
            x = nnls(a_all / scale * robust[:, None], y_all * robust) / scale
            robust[:len(a)] = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - 1), 0.02))
        x[:2] = np.maximum(x[:2], MIN_FACTOR)  # neither part of the step free: the constants stay > 0
        rel = np.abs(a @ x - 1)
    if per_run is not None:
        per_run.extend((m, float(np.median(np.array(r) @ x)) if r else float("nan")) for m, r in fitted)
    return float(x[0]), float(x[1]), float(x[2]), float(x[3]), float(np.median(rel) * 100)


def served_prefill_s(cost, scale: float, attention_scale: float, per_step_s: float, per_token_s: float,
                     prompt_len: int) -> float:
    """The served prefill step of one prompt of `prompt_len` tokens (s)."""
    from tuner.cost import StepWork

    w = StepWork(tokens=prompt_len, sampled=1, prefill_attn_pairs=prompt_len * (prompt_len + 1) // 2)
    parts = cost.components(w)
    return scale * (sum(parts.values()) - parts["attention"]) + attention_scale * parts["attention"] \
        + per_step_s + per_token_s


def apply_served(layout: dict[str, float], scale: float, attention_scale: float, per_step_s: float,
                 per_token_s: float) -> dict[str, float]:
    """A layout's constants (profiles.LAYOUT_KEYS) with its attention time times `attention_scale`,
    every other part of its step time times `scale`, plus the per-step and per-token serving costs."""
    out = dict(layout)
    for k in ("step_overhead_ms", "layer_overhead_us", "seq_layer_overhead_us", "seq_overhead_us", "matmul_scale",
              "comm_scale", "vocab_seq_ns"):
        if k in out:
            out[k] = out[k] * scale
    for k in ("attention_prefill_tflops", "attention_kv_gb_s"):
        out[k] = out[k] / attention_scale
    out["step_overhead_ms"] += per_step_s * 1e3
    out["seq_overhead_us"] += per_token_s * 1e6
    return {k: v if isinstance(v, int) else round(float(v), 4) for k, v in out.items()}
