"""The served engine's own steps: one `shardserve serve` of three probe shapes in every layout of
this host, load-tested (one request at a time, then open loop), and per layout a fit of the cost model's step formula
(tuner.measure_engine.fit_layout) directly on the steps the served replicas ran.

Each replica's engine records every step (`GET /v1/admin/steps`, serving/steps_api.py): its wall
seconds, what it computed (decode sequences and their context, prefill tokens and attention pairs,
sequences sampled) and the gap before it (the serving loop's own time between two steps while
requests were unfinished: handing outputs to the streams, taking new requests in). A served step
cycle is a step plus the gap after it; that is the time between two tokens of a running request,
and it is what the simulator's step cost stands for. So the fit's target is the cycle, measured
where it happens: the engine shares the cores with Ray, the gateway, the streaming of every token
and the load tester, and for several shards it calls them through Ray actors.

The gateway's cost per request (request_overhead) is what the one-shard copies' TTFT, one request
at a time, has beyond the served cycle of its own prefill step (measured, not fitted).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SERVED_PROBES = ((2, 6, 384, 8192), (12, 12, 768, 512), (2, 12, 768, 50257), (6, 6, 384, 8192))
"""(n_layer, n_head, n_embd, vocab), head size 64: shallow and deep at each of two widths, so that
depth and width vary apart (2 and 6 layers at width 384, 2 and 12 at 768; widths 384 and 768 at 2
layers) and per-step, per-layer, per-FLOP, per-weight-byte, per-sequence and vocabulary costs can
be told apart; LM heads of 0.4M, 3.1M and 38.6M entries (the last GPT-2's own: the head's cost is
interpolated, not extrapolated, up to that size); weights of 13, 170, 106 and 28 MB in bf16, inside
and past a 32 MiB last-level cache; head counts even, so every probe splits over TP2. (Until pass 11 the
third was 4 x 256 with 50,257 entries and there was no fourth: with depth and width rising together
across the probes, the fit could not tell a per-layer constant from width-dependent work or a
per-step one. The fourth serves in the one-shard layout only, for the time budget.)"""
MULTI_SHARD_PROBES = (0, 1)
"""The probes a layout of several shards is served with (the profile's time budget: each such
copy starts tp x pp shard actors beside its replica, and starting processes is most of the profile).
Tried in pass 32: PP2 with 6 x 384 as a third probe. The fit's constants came out physical (6 ms a
step, the stages' coordination; the unfused layer path's matmuls 2.5x the rate table) and the
default model's PP2 decode steps went from 1.3-1.5x to 1.1-1.2x of measured, but the same matmul
scale then charged GPT-2's PP2 prefills 1.58x (TTFT +40%, from within 10% in passes 26-31):
not kept (BENCHMARKS.md, issue 15)."""
SERVE_OUTPUT = 17  # tokens of every probe request (as the load tester counts them)
CONCURRENCY = ((1, 2, 16),)
"""(requests in flight, requests measured, prompt tokens) of the closed-loop run per copy: one at
a time with short prompts (batch-1 steps at contexts 17-33, the gateway's per-request cost)."""
OPEN_LOOP = (4.0, 12, 96, 0.8)
"""(mean requests in flight, requests, prompt tokens, least seconds) of the open-loop run per copy
that follows: Poisson arrivals at OPEN_LOOP[0] / (the one-at-a-time run's median end-to-end
latency), spread over at least OPEN_LOOP[3] s, prompts that put decode contexts at 97-113. Open
loop, as deployments are loaded: a closed loop starts with all its requests at once, and the burst
through the gateway stretches the prefill steps it meets (3x on a 2-layer probe) far beyond what
spread arrivals do. Until pass 15 it aimed at 6 in flight with 16 requests, in pass 16 at 4 with 18,
with no least duration: the short probes then received all their requests within 0.13-0.5 s, 30-120
requests a second, a burst that the gateway's request path could not take in (TTFT p50 64-136 ms
where the simulated engine gives 35-84 ms: the gateway's queue, not the engine's) and that
made 400-800-token prefills and batches of 6-16, not the steady load of 1-5 sequences per step that
a deployment below saturation serves. 12 requests (17 tokens each, 204 with the one-at-a-time
run's 34) keep every measured step inside a replica's step window (EngineConfig.step_record_len,
256) even at batch 1."""
WARMUP = ((1, 2, 16, 9), (2, 4, 16, 9), (4, 8, 16, 9), (6, 6, 16, 9), (2, 4, 96, 3))
"""(in flight, requests, prompt tokens, output tokens) of closed-loop runs before the measured ones
(not kept): they take each step class the measured runs meet (decode batches of 1, 2, 3-4 and 5-8,
~8-16 steps each; prefills of 17 to 194 tokens, alone and beside decodes) through the engine's
thread chooser (engines.cpu.cpu_threads.AdaptiveThreads) first. Each class starts on every core, tries
the other count on its next step, then again after 8, 16, 32... steps; on this host a 2-thread step
of a small model waits for a descheduled partner thread (a short prefill ~5x, BENCHMARKS.md issue
12 run 8), so a class measured while the chooser is young runs more of its steps on the slow count
than a deployment serving for minutes (pass 16: the probes' decode steps at batches 2-5, a class
the warm-up then hardly met, took 1.3-1.6x what the fit gave them; those at batch 1 and 6+,
0.95-1.25x)."""
MULTI_SHARD_WARMUP = (WARMUP[0], WARMUP[-1])
"""The warm-up of a copy whose engine runs a fixed thread count (WARMUP's first and last runs):
several shards (worker_threads), or one where the profile keeps serving_cores; there is no thread
chooser to train, only first-step costs."""
PROBE_MAX_NUM_SEQS, PROBE_MAX_BATCHED_TOKENS = 16, 1024
"""Scheduler limits of every probe copy (its runs keep at most ~10 requests in flight)."""
PUSH_INTERVAL_S = 1.0
"""server.metrics_push_interval_s of the probe server (the deployments' default: publishing more
often would load the probes' cores more than a deployment's): how stale the step windows may be.
Every copy's steps fit in its replicas' windows (EngineConfig.step_record_len, 256), so they are read
once, after the last copy's runs."""


def probe_models(copies: dict[str, tuple[Path, int, int]], profile, dtype: str) -> list[dict]:
    """The probe server's `models` entries: each copy {name: (checkpoint, tp, pp)} exactly as the
    tuner deploys that layout (tuner.emit.deployment: engine options, threads per shard, whether
    the engine picks each step's thread count itself), except the CPU reservations, which are
    fractions so that every copy fits one Ray instance (one copy is busy at a time).

    Until pass 14 the probes set worker_threads for the one-shard layout too (every core), which
    fixes the engine's thread count; a deployed one-shard replica leaves it unset, and the engine's
    adaptive chooser (engines.cpu.cpu_threads.AdaptiveThreads) times each step class on both counts and
    keeps the faster, on a host shared with the gateway and the load tester mostly one thread (two
    wait on a descheduled partner): the one-shard probes' steps were 1.2-1.6x those of the same
    shapes deployed, and GPT-2's went from +26..+40% to +3..+7% with this (passes 14, 15, 17)."""
    from tuner.emit import deployment
    from tuner.search import Candidate

    models = []
    for name, (path, tp, pp) in copies.items():
        cand = Candidate(tp, pp, 1, PROBE_MAX_NUM_SEQS, PROBE_MAX_BATCHED_TOKENS, dtype)
        model = deployment(cand, str(path), profile, name=name)["models"][0]
        share = round(0.9 / len(copies) / (tp * pp + 1), 3)  # Ray needs only to place them
        model["num_cpus"] = share
        if tp * pp > 1:
            model["shard_num_cpus"] = share
        models.append(model)
    return models


def server_env(profile) -> dict[str, str]:
    """Environment of the probe server: OMP_NUM_THREADS as Ray sets it for a deployed one-shard
    replica (floor of its num_cpus, which tuner.emit makes every core). The probes' fractional
    reservations would make Ray set 1, and a replica whose engine does not fix its thread count
    takes OMP_NUM_THREADS as its most (engines.cpu.cpu_threads.engine_threads); shard workers and the
    multi-shard replicas' executors fix theirs (worker_threads)."""
    return {"OMP_NUM_THREADS": str(profile.cores or 1)}


def serve_probes(copies: dict[str, tuple[Path, int, int]], work_dir: Path, dtype: str, profile,
                 progress: Callable[[str], None] = print,
                 reference: Callable[[], dict] | None = None) -> dict[str, dict]:
    """Serve every copy {name: (checkpoint, tp, pp)} in one `shardserve serve` (probe_models: as
    the tuner deploys each layout, with fractional CPU reservations so that they all fit),
    load-test them one at a time and read each one's steps back:
    {name: {"runs": {requests in flight: loadtest Report}, "spans": {requests in flight: (start, end)
    on the monotonic clock}, "steps": [step dicts, oldest first]}}. With `reference`, its result
    taken with the server up before the first copy's requests is under the key "_host_reference"
    (a list of one: tuner.hostref; a diagnostic of what the idle server costs the host)."""
    import yaml

    from loadtest.config import LoadTestConfig
    from loadtest.runner import run
    from tuner.server import Server

    models = probe_models(copies, profile, dtype)
    fixed = {m["name"]: bool(m["engine"].get("worker_threads")) for m in models}  # no thread chooser to train
    conf = work_dir / "probe.yaml"
    conf.write_text(yaml.safe_dump({"models": models, "server": {"metrics_push_interval_s": PUSH_INTERVAL_S}}))
    out: dict[str, dict] = {}
    want = (sum(n for _, n, _ in CONCURRENCY) + OPEN_LOOP[1]) * SERVE_OUTPUT  # tokens each copy's measured runs sample
    refs = []
    with Server(["--config", str(conf)], work_dir / "serve.log", env=server_env(profile)) as url:
        if reference is not None:
            refs.append(reference())
        for name, (path, tp, pp) in copies.items():
            progress(f"served probe {name}: one request at a time, then Poisson arrivals")
            base = {"url": url, "model": name, "backend": "openai-completions", "tokenizer": path / "tokenizer.json",
                    "ignore_eos": True, "progress": False, "seed": 1}
            for c, n, plen, o in MULTI_SHARD_WARMUP if fixed[name] else WARMUP:
                run(LoadTestConfig(**base, random_input_len=plen, random_output_len=o, closed_loop_concurrency=c,
                                   num_prompts=n))
            runs, spans = {}, {}
            for c, n, plen in CONCURRENCY:
                t0 = time.monotonic()  # the replicas run on this host: the same monotonic clock
                runs[c] = run(LoadTestConfig(**base, random_input_len=plen, random_output_len=SERVE_OUTPUT,
                                             closed_loop_concurrency=c, num_prompts=n))
                spans[c] = (t0, time.monotonic())
            e2e = float(np.median([r.done_s - r.sent_s for r in runs[1].records if not r.warmup and r.ok]))
            in_flight, n, plen, least_s = OPEN_LOOP
            t0 = time.monotonic()
            runs["open"] = run(LoadTestConfig(**base, random_input_len=plen, random_output_len=SERVE_OUTPUT,
                                              request_rate=min(in_flight / e2e, n / least_s), num_prompts=n))
            spans["open"] = (t0, time.monotonic())
            out[name] = {"runs": runs, "spans": spans}
        for name in copies:
            out[name]["steps"] = fetch_steps(url, name, out[name]["spans"][CONCURRENCY[0][0]][0], want)
    if refs:
        out["_host_reference"] = refs
    return out


def fetch_steps(url: str, model: str, since: float, want_sampled: int, timeout_s: float = 10.0) -> list[dict]:
    """The steps of `model`'s replicas that ended after `since` (monotonic), once they hold
    `want_sampled` sampled tokens (the replicas publish every PUSH_INTERVAL_S)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/v1/admin/steps", params={"model": model}, timeout=30)
        r.raise_for_status()
        steps = [s for w in r.json()["data"] for s in w["steps"] if s["end_s"] > since]
        if sum(s["sampled"] for s in steps) >= want_sampled:
            return sorted(steps, key=lambda s: s["end_s"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"served probe {model}: the replicas reported {sum(s['sampled'] for s in steps)} "
                               f"sampled tokens in {timeout_s:.0f} s, expected {want_sampled}")
        time.sleep(PUSH_INTERVAL_S / 2)


def _cycle_pairs(steps: list[dict]):
    """(step, the next one) of each step that another followed without the engine idling between."""
    return ((s, nxt) for s, nxt in itertools.pairwise(steps) if nxt["gap_s"] is not None)


def cycle_ends(steps: list[dict]) -> list[float]:
    """end_s of each step step_cycles returns, in its order."""
    return [s["end_s"] for s, _ in _cycle_pairs(steps)]


def step_cycles(steps: list[dict]) -> list[tuple[object, float, float]]:
    """(StepWork, step seconds, gap after it) of each step that another followed without the engine
    idling in between (one replica's steps, oldest first)."""
    from tuner.cost import StepWork

    out = []
    for s, nxt in _cycle_pairs(steps):
        w = StepWork(tokens=s["decode_seqs"] + s["prefill_tokens"], sampled=s["sampled"],
                     prefill_attn_pairs=s["prefill_attention_pairs"], decode_context=s["decode_context_tokens"],
                     seqs=s["decode_seqs"] + s["prefill_seqs"])
        out.append((w, float(s["seconds"]), float(nxt["gap_s"])))
    return out


def requests_of(report) -> dict[str, np.ndarray]:
    """The completed, measured requests of a load-test Report: TTFT and TPOT (s)."""
    # full replies only: a reply cut short (fewer tokens than asked, despite ignore_eos) has no TPOT
    recs = [r for r in report.records if not r.warmup and r.ok and r.output_tokens == r.requested_output_tokens]
    if not recs:
        raise RuntimeError("a served probe run completed no request with every token it asked for")
    return {"ttft": np.array([r.ttft_s for r in recs]), "tpot": np.array([r.tpot_s for r in recs])}


def request_overheads_s(report, steps: list[dict], span: tuple[float, float]) -> list[float]:
    """The gateway's cost per request: each TTFT of a one-at-a-time run (`span`: its start and
    end, monotonic) minus the median served cycle (step + the gap after it) of its prefill steps."""
    steps = [s for s in steps if span[0] < s["end_s"] <= span[1]]
    cycles = [dt + gap for w, dt, gap in step_cycles(steps) if w.prefill_attn_pairs and w.seqs == 1]
    if not cycles:
        raise RuntimeError("the one-at-a-time probe run reported no prefill step")
    return [float(t - np.median(cycles)) for t in requests_of(report)["ttft"]]


PER_SEQ_GRID_MS = tuple(0.5 * i for i in range(17))
"""Coarse candidates (ms) of the overhead per held sequence (overhead_per_seq_s), refined to 0.1 ms."""


def open_loop_run(records, extra_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrivals, engine prompt lengths, output lengths, measured TTFT) of a run's measured requests,
    in seconds from its start; TTFT NaN for a request that failed. `extra_tokens`: what the
    server's tokenizer adds to each prompt (a BOS)."""
    recs = [r for r in records if not r.warmup]
    return (np.array([r.sent_s for r in recs], dtype=float),
            np.array([max(r.input_tokens, 1) + extra_tokens for r in recs], dtype=int),
            np.array([r.requested_output_tokens for r in recs], dtype=int),
            np.array([r.ttft_s if r.ok else np.nan for r in recs], dtype=float))


def overhead_per_seq_s(runs: list[tuple], grid_ms: tuple[float, ...] = PER_SEQ_GRID_MS) -> tuple[float, float]:
    """The request overhead per sequence the engine holds at a request's arrival (s) whose simulated
    TTFTs come closest to the measured ones: the least sum over requests of |log(simulated /
    measured)| (robust, and the same weight for short and long TTFTs); and that loss per request.
    `runs`: (step_cost, SchedulerConfig, arrivals, prompt lengths, output lengths, measured TTFT,
    the copy's own overhead per request (s)) per served copy, as the fitted layout predicts them."""
    from tuner.simulate import simulate

    def loss(k_ms: float) -> float:
        total, n = 0.0, 0
        for cost, cfg, arr, il, ol, ttft, base in runs:
            traces = simulate(cost, cfg, arr, il, ol, request_overhead=base, overhead_per_seq=k_ms * 1e-3)
            sim = np.array([t.ttft for t in traces])
            ok = np.isfinite(ttft) & (ttft > 0)
            total += float(np.abs(np.log(sim[ok] / ttft[ok])).sum())
            n += int(ok.sum())
        return total / max(n, 1)

    coarse = min(grid_ms, key=loss)
    fine = [max(0.0, coarse + 0.1 * d) for d in range(-4, 5)]
    best = min(dict.fromkeys(fine), key=loss)
    return best * 1e-3, loss(best)
