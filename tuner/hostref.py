"""A host-state reference: how fast this host runs right now, against when the profile was measured.

A shared or cloud host (a VM with stolen cycles, neighbours streaming memory) does not run at one
speed: on the 2-core VM of BENCHMARKS.md the same probe steps took 13-72% longer in one profile than
in another, and the read bandwidth swings between ~30 and ~63 GB/s minute to minute. A profile's
constants are fitted in minutes of one host state and a deployment may run in another.

`host_reference` takes about a second of medians (not best-of: a slowed host is the point):
- `decode_us`: one decode-shaped token through two transformer blocks of width 384 (layer norms,
  the QKV / projection / MLP Linears, attention over a 64-token context, a residual add per block),
  bfloat16, one thread: the op dispatch and small cache-resident matmuls that an engine step on a
  small model is made of;
- `read_gb_s`: a float32 sum over a buffer four times the last-level cache (the weight-streaming
  rate of a model copy that outgrows the cache);
- `steal_pct`: the share of the CPUs' time the hypervisor gave to other guests meanwhile
  (/proc/stat), `matmul_us` (a 4-row 768 -> 3072 Linear) and `load1` (the 1-minute load average):
  diagnostics, not used to scale.

`tune profile` takes it with no server of its own up, before its probe server starts and after it
stops, and saves it as the profile's `host_reference` (with one taken with the idle probe server up
as served_decode_us / served_read_gb_s, a diagnostic); `recalibrated(profile, now)`
scales the profile's CPU-bound step terms (matmuls, attention, fixed per-step / layer / sequence
costs, collectives, the request overhead) by now.decode_us / profile's, and the weight-streaming
term by profile's read_gb_s / now's (HardwareProfile.host_scale). The constants of a prediction are
still all measured before the run it predicts.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Collection
from pathlib import Path

from tuner.profiles import HardwareProfile

SCALE_RANGE = (0.5, 2.0)
"""Clamp of a recalibration ratio: a reference taken in a moment of extreme contention should not
halve or double a prediction beyond what the profiles of this host have ever differed by."""
WIDTH, CONTEXT, BLOCKS = 384, 64, 2


def _steal_jiffies() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    vals = [int(v) for v in first[1:]]
    return (vals[7] if len(vals) > 7 else 0), sum(vals[:8])


def host_reference(budget_s: float = 0.6, cache_mib: float = 32.0) -> dict[str, float]:
    """Medians of this host's speed now (module docstring): decode_us, read_gb_s, steal_pct."""
    import torch
    import torch.nn.functional as F

    before = torch.get_num_threads()
    s0 = _steal_jiffies()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        bf = torch.bfloat16

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) * 0.02).to(bf)

        blocks = [(rnd(3 * WIDTH, WIDTH), rnd(WIDTH, WIDTH), rnd(4 * WIDTH, WIDTH), rnd(WIDTH, 4 * WIDTH))
                  for _ in range(BLOCKS)]
        k = rnd(1, 6, CONTEXT, WIDTH // 6)
        v = rnd(1, 6, CONTEXT, WIDTH // 6)
        x0 = rnd(1, WIDTH)

        def decode() -> None:
            x = x0
            for qkv, proj, up, down in blocks:
                h = F.layer_norm(x, (WIDTH,))
                q = F.linear(h, qkv)[:, :WIDTH].view(1, 6, 1, WIDTH // 6)  # (B, nh, T, hs)
                a = F.scaled_dot_product_attention(q, k, v).reshape(1, WIDTH)
                x = x + F.linear(a, proj)
                h = F.layer_norm(x, (WIDTH,))
                x = x + F.linear(F.gelu(F.linear(h, up)), down)

        times = []
        t_end = time.perf_counter() + budget_s * 0.5
        decode()
        while time.perf_counter() < t_end or len(times) < 20:
            t0 = time.perf_counter()
            decode()
            times.append(time.perf_counter() - t0)
        decode_us = statistics.median(times) * 1e6
        # a diagnostic (not used to scale): a 4-row (768 -> 3072) Linear, the rate table's shape
        xw, ww = rnd(4, 768), rnd(3072, 768)
        mms = []
        t_end = time.perf_counter() + budget_s * 0.15
        F.linear(xw, ww)
        while time.perf_counter() < t_end or len(mms) < 20:
            t0 = time.perf_counter()
            F.linear(xw, ww)
            mms.append(time.perf_counter() - t0)
        buf = torch.ones(int(4 * max(cache_mib, 8.0) * 2**20) // 4, dtype=torch.float32)
        reads = []
        t_end = time.perf_counter() + budget_s * 0.35
        buf.sum()
        while time.perf_counter() < t_end or len(reads) < 5:
            t0 = time.perf_counter()
            buf.sum()
            reads.append(time.perf_counter() - t0)
        read_gb_s = buf.numel() * 4 / statistics.median(reads) / 1e9
    finally:
        torch.set_num_threads(before)
    s1 = _steal_jiffies()
    steal = 100.0 * (s1[0] - s0[0]) / max(s1[1] - s0[1], 1) if s0 and s1 else 0.0
    return {"decode_us": round(decode_us, 2), "read_gb_s": round(read_gb_s, 2), "steal_pct": round(steal, 2),
            "matmul_us": round(statistics.median(mms) * 1e6, 2),
            "load1": float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else 0.0}


SERVER_PROCESSES = ("raylet", "gcs_server", "ray::", "shardserve.cli serve", "default_worker.py")
"""Command-line fragments of a served deployment's processes (the CLI, Ray's daemons and workers)."""


def _session(pid_dir: Path) -> int | None:
    """The session id of a /proc/<pid> entry (its stat's sixth field, after the parenthesised name)."""
    try:
        return int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def server_processes(proc: Path = Path("/proc"), sessions: Collection[int] | None = None) -> int:
    """How many processes of a shardserve server (SERVER_PROCESSES) run on this host (Linux /proc;
    0 elsewhere); with `sessions`, only those in these sessions (a tuner.server.Server starts the CLI
    in a session of its own, and Ray's daemons and workers stay in it)."""
    n = 0
    for cmd in proc.glob("[0-9]*/cmdline"):
        if sessions is not None and _session(cmd.parent) not in sessions:
            continue
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        n += any(frag in text for frag in SERVER_PROCESSES)
    return n


def reference_without_server(max_wait_s: float = 15.0, budget_s: float = 0.6, cache_mib: float = 32.0,
                             sessions: Collection[int] | None = None) -> dict[str, float]:
    """host_reference once no server process is left (at most max_wait_s of waiting): a server that
    was just stopped keeps its Ray processes exiting for seconds, which slowed one reference 34% in
    pass 23 (BENCHMARKS.md). The wait is recorded as waited_s, what was still running as left.
    `sessions`: wait only for the processes of these sessions (the servers this process stopped,
    tuner.server.stopped_sessions); those of other servers on the host (left_others) do not exit
    for waiting, and on a shared host (a CI whose test workers start servers of their own) waiting
    for them spent the whole max_wait_s before every validated candidate."""
    t0 = time.monotonic()
    while (left := server_processes(sessions=sessions)) and time.monotonic() - t0 < max_wait_s:
        time.sleep(0.25)
    waited = time.monotonic() - t0
    others = {} if sessions is None else {"left_others": float(server_processes() - left)}
    return {**host_reference(budget_s=budget_s, cache_mib=cache_mib), "waited_s": round(waited, 2), "left": float(left),
            **others}


def combine(refs: list[dict[str, float]]) -> dict[str, float]:
    """One reference of several taken over a measurement (geometric means; the diagnostics: means)."""
    out = {}
    for key in ("decode_us", "read_gb_s"):
        out[key] = round(math.exp(sum(math.log(r[key]) for r in refs) / len(refs)), 2)
    for key in ("steal_pct", "matmul_us", "load1", "served_decode_us", "served_read_gb_s"):
        if any(key in r for r in refs) and not all(key in r for r in refs):
            out[key] = next(r[key] for r in refs if key in r)
            continue
        if all(key in r for r in refs):
            out[key] = round(sum(r[key] for r in refs) / len(refs), 2)
    out["samples"] = len(refs)
    out["decode_us_first"], out["decode_us_last"] = refs[0]["decode_us"], refs[-1]["decode_us"]
    return out


def host_scales(then: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """{"cpu": time ratio of the CPU-bound work, "memory": of weight streaming}, now against
    then, each clamped to SCALE_RANGE; 1.0 where either reference lacks the measurement."""
    lo, hi = SCALE_RANGE

    def ratio(num: float | None, den: float | None) -> float:
        if not num or not den or num <= 0 or den <= 0:
            return 1.0
        return round(min(max(num / den, lo), hi), 4)

    return {"cpu": ratio(now.get("decode_us"), then.get("decode_us")),
            "memory": ratio(then.get("read_gb_s"), now.get("read_gb_s"))}


def recalibrated(profile: HardwareProfile, now: dict[str, float]) -> HardwareProfile:
    """`profile` with host_scale set from its host_reference and `now` (a host_reference taken just
    before the run to predict). A profile without a reference is returned unchanged."""
    if not profile.host_reference:
        return profile
    return profile.replace(host_scale=host_scales(profile.host_reference, now))
