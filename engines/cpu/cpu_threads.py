"""CPU threading for the engine: how idle OpenMP threads wait, and single-threaded tiny ops.

Two measured facts on a 2-core AMD EPYC shared with other processes (load average 4-8,
torch 2.13+cpu, libgomp), see BENCHMARKS.md, "Peer benchmark against vLLM's CPU build":

- libgomp lets a thread that finished its share of a parallel region spin before it sleeps
  (GOMP_SPINCOUNT pause loops: 300,000 by default, several ms; 0 with OMP_WAIT_POLICY=PASSIVE).
  When the machine is oversubscribed, a long spin burns the time slice its partner (or the Python
  thread that would issue the next op) needs: with the default, the decode step's per-sequence
  attention loop took 123-916 ms per layer on 2 threads against 16 ms with PASSIVE, and a
  (57 x 768) @ (768 x 2304) matmul 22.6 ms against 6.4 ms (load 4-8). But no spin at all makes
  every region of a step wake its partner through the kernel: on the same machine quiet, PASSIVE
  cost 12 % of batch-1 decode and 20 % of the offline mix against the default (BENCHMARKS.md issue
  12 run 11). A short spin keeps nearly all of that (10,000 pauses, a fraction of a ms: batch 1
  53-54 tok/s against 55 unbounded and 49 PASSIVE; mix 191-208 against 199-215 and 170-176), so a
  thread still sleeps soon when the step is over or the host is busy; on a busy host the chooser
  below also moves steps to one thread. `configure_openmp_env` sets GOMP_SPINCOUNT to
  SPIN_COUNT_DEFAULT in a process that imports `engines` before torch; a user's own
  OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
- With two threads on two cores shared with other work, every parallel region of the step waits
  for both threads to be scheduled: a batch-57 decode step took 1,860 ms on 2 threads against
  875 ms on 1 (load average 4.2-4.6). On the same machine idle (load ~1) it is the other way round:
  an offline mix of 24 requests ran at 94 / 73 tok/s on 2 threads against 71 / 66 on 1, batch-1
  decode level (BENCHMARKS.md). vLLM's CPU build binds its model to all cores but one (its scheduler
  runs beside the model); ours schedules on the same thread between steps, so a reserved core would
  sit idle. `engine_threads` therefore uses all cores of the process's affinity (or
  OMP_NUM_THREADS) as the most a step uses, and `AdaptiveThreads` picks each step's count by
  timing steps while the engine runs (EngineConfig.worker_threads fixes it instead).
- Decode attention issues one small op per sequence and layer (a context of a few hundred keys:
  ~1 MFLOP). Splitting such an op over threads buys little and costs a fork/join each time;
  `single_threaded()` runs such a loop on the calling thread only.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import sys
from collections.abc import Iterator

SPIN_COUNT_DEFAULT = "10000"
"""GOMP_SPINCOUNT of an engine process: pause loops an idle OpenMP thread waits for the next region."""


def configure_openmp_env(environ: dict[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT to SPIN_COUNT_DEFAULT unless the user set it or OMP_WAIT_POLICY, or torch
    (hence libgomp, which reads them once at load) is already imported. Returns whether it set it."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env or "torch" in sys.modules:
        return False
    env["GOMP_SPINCOUNT"] = SPIN_COUNT_DEFAULT
    return True


def release_openmp_pool() -> bool:
    """End the calling thread's OpenMP thread team (OpenMP 5's omp_pause_resource_all, soft); its next
    parallel region starts a new one. Returns whether the runtime did it.

    Why: libgomp keeps a team of threads for every thread that ever entered a parallel region, for as
    long as that thread lives, and once the teams' threads outnumber the cores, its idle threads spin only
    briefly (libgomp's throttled spin) and then sleep in the kernel at every join. A model loaded on one
    thread (Ray Serve's replica loads it on an asyncio.to_thread worker, which lives on) and stepped on
    the engine's loop thread left two teams. Measured on the 2-core Xeon: a (64 x 576) @ (576 x 1536)
    matmul plus SiLU, on a second thread, took 745-755 us with the first thread's team alive against
    592-615 us once it was released.
    """
    import ctypes

    import torch

    for path in (None, *sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*")))):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn(1) == 0  # omp_pause_soft
    return False


def engine_threads(worker_threads: int = 0, cpu_count: int | None = None,
                   environ: dict[str, str] | None = None) -> int:
    """torch intra-op threads of an in-process engine: worker_threads when > 0, else
    OMP_NUM_THREADS when set, else every core this process may run on."""
    if worker_threads > 0:
        return worker_threads
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(1, cpu_count if cpu_count is not None else host_cores())


def host_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block's torch ops on n intra-op threads, then restore the calling thread's count
    (~0.2 us each way), so an engine built in a user's process leaves the rest of it alone."""
    import torch

    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded() -> contextlib.AbstractContextManager[None]:
    """Run the block's torch ops with one intra-op thread, then restore the count."""
    return intra_op_threads(1)


EXPLORE_MIN, EXPLORE_MAX = 8, 256
"""Steps between two trials of another thread count: the shortest (after a switch, or when measurements
drift), and the longest (backed off to while the current count keeps winning)."""
TRIAL_GAP = 2
"""Steps between the trials of a count that has fewer than MIN_SAMPLES fresh samples: spread a little,
so that one burst of a neighbour does not disturb all of them alike, but soon."""
SAMPLES, MIN_SAMPLES = 7, 3
"""Each count's recent step times kept per step class, and how many it needs before it can win or lose:
a decision compares medians, so one disturbed step (a neighbour's burst, a page fault) decides nothing."""
SWITCH_MARGIN = 0.9
"""Another count takes over when its median is under this fraction of the current count's."""
DRIFT = 1.5
"""A count's new median (or a trial's time) this many times above or below the median the last decision
saw means the machine changed: every count's samples are dropped as stale and measured again soon."""
CLEAR_LOSS = 1.4
"""A trial this many times slower than the current count's median loses at once (the interval backs off, as
after a decided loss), not after MIN_SAMPLES: only a count that looks competitive is sampled again soon. A
disturbed trial can only look slower, which keeps the current count. On SmolLM2 bf16 one thread took
1.8-2.2x as long as two for every decode class of the peer mix: three trials a class, each about a step more,
were ~5 % of a 13 s run."""
COSTLY_STEP_S = 0.1
"""A class whose steps take this long on all threads (a prefill chunk: SmolLM2 bf16, 2,048 tokens, ~0.45 s on
2 cores) tries fewer threads only while the host shows itself busy: while some cheaper class (a decode step) runs
on fewer threads than all. Such a trial costs about a step (873 against 444 ms on one thread), and a burst of
prompts holds a handful of these steps, every prompt behind the trial waiting for it: 64 prompts, one prefill
burst of 5 steps a repetition, ran at 2,959-3,031 tok/s in the repetitions that held the three trials of one
thread against 3,700-4,300 in the others; with this rule 4,150-4,500 after the first, as with the count fixed
(the Xeon of BENCHMARKS.md, alternated runs)."""


def step_class(num_tokens: int, has_prefill: bool) -> tuple[bool, int]:
    """Steps compared with each other: prefill or decode-only, and tokens by power of two."""
    return has_prefill, max(0, num_tokens - 1).bit_length()


def median(xs) -> float:
    """The median of a non-empty sequence of numbers (the mean of the middle two for an even count)."""
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class _ClassState:
    __slots__ = ("countdown", "current", "fresh", "interval", "ref", "samples")

    def __init__(self, current: int):
        self.current = current
        self.samples: dict[int, collections.deque[float]] = {}
        """The last SAMPLES step times (seconds) of this class, per thread count."""
        self.ref: float | None = None
        """The current count's median when it was last decided on (None: not yet MIN_SAMPLES)."""
        self.fresh = 0
        """The current count's samples since `ref` was set."""
        self.interval = EXPLORE_MIN
        # the first trial of another count comes after EXPLORE_MIN steps on this one, not at the
        # second step: a class may hold a handful of long steps (a 16-request mix ran two ~0.6 s
        # prefills, and trying one thread on the second cost 0.45 s, 6% of the run: issue 12 run 11,
        # in BENCHMARKS.md's git history), and a trial only pays back over the steps that follow it
        self.countdown = EXPLORE_MIN + 1

    def add(self, threads: int, seconds: float) -> collections.deque[float]:
        q = self.samples.setdefault(threads, collections.deque(maxlen=SAMPLES))
        q.append(seconds)
        return q


class AdaptiveThreads:
    """Chooses the intra-op thread count of each engine step by measuring steps while they run.

    Measured on a 2-core AMD EPYC shared with other processes (BENCHMARKS.md, issue 12, run 7):
    with any other runnable process on the cores, even a nice-19 one, each parallel region of a
    2-thread step waits for a descheduled partner thread for a scheduler tick (~4 ms): a
    (8 x 768) @ (768 x 2304) matmul took 4-8 ms on 2 threads against 0.8 ms on 1; on the same
    machine idle, 2 threads win the batched steps (run 2). Which is faster changes minute by minute
    on a shared host, so it is measured, per class of step (step_class), by running a step every
    `interval` steps on another candidate count. A decision compares the median of each count's last
    SAMPLES step times, and only once both have MIN_SAMPLES: a single disturbed sample once locked
    decode steps to one thread for a whole run (86 ms against 28 ms; the bf16 mix then ran at 355
    tok/s, and at 924 ten minutes later: issue 40). The other count takes over when its median is
    under SWITCH_MARGIN of the current's. The interval doubles (to EXPLORE_MAX) while the current
    count keeps winning, so a losing trial costs little; it drops to EXPLORE_MIN after a switch and
    when measurements drift (DRIFT: the current count's median, or one trial, far from what the last
    decision saw); a drift of the current count's median drops every sample, all measured again. A costly class
    (COSTLY_STEP_S: prefill chunks) tries fewer threads only while a cheap class runs on fewer. Changing the count
    does not change results: the linears and attention of a step were measured bitwise equal on 1
    and 2 threads (tests check it).
    """

    def __init__(self, max_threads: int):
        self.max_threads = max_threads
        counts = {max_threads}
        n = max_threads
        while n > 1:  # halving ladder: 8 -> 4, 2, 1
            n //= 2
            counts.add(max(1, n))
        self.candidates = tuple(sorted(counts, reverse=True))
        self._states: dict[tuple[bool, int], _ClassState] = {}
        self._trial: dict[tuple[bool, int], int] = {}  # next candidate index tried, per class
        self.switches = 0

    def choose(self, cls: tuple[bool, int]) -> int:
        """Thread count for the next step of class `cls`."""
        if len(self.candidates) == 1:
            return self.max_threads
        st = self._states.get(cls)
        if st is None:
            st = self._states[cls] = _ClassState(self.max_threads)
        st.countdown -= 1
        if st.countdown > 0 or len(st.samples.get(st.current, ())) < MIN_SAMPLES:
            return st.current
        if st.current == self.max_threads and self._costly(st) and not self._host_busy():
            st.countdown = st.interval  # see COSTLY_STEP_S: all threads, and no trial, while the host is quiet
            return st.current
        others = [c for c in self.candidates if c != st.current]
        i = self._trial.get(cls, 0) % len(others)
        if len(st.samples.get(others[i], ())) >= MIN_SAMPLES:
            self._trial[cls] = i + 1  # a count still short of samples is tried again first
        return others[i]

    def record(self, cls: tuple[bool, int], threads: int, seconds: float) -> None:
        """The measured wall time of a step of class `cls` run on `threads` threads."""
        st = self._states.get(cls)
        if st is None or len(self.candidates) == 1:
            return
        if threads == st.current:
            cur = median(st.add(threads, seconds))
            st.fresh += 1
            if st.ref is None:
                if len(st.samples[threads]) >= MIN_SAMPLES:
                    st.ref, st.fresh = cur, 0
            elif st.fresh >= MIN_SAMPLES and not st.ref / DRIFT <= cur <= DRIFT * st.ref:
                self._drifted(st, cur)
            return
        before = st.samples.get(threads)
        known = before is not None and len(before) >= MIN_SAMPLES
        moved = known and not median(before) / DRIFT <= seconds <= DRIFT * median(before)
        trial = st.add(threads, seconds)
        if len(trial) < MIN_SAMPLES:
            cur = st.samples.get(st.current)
            if cur and seconds >= CLEAR_LOSS * median(cur):  # lost at once (CLEAR_LOSS)
                st.interval = min(EXPLORE_MAX, 2 * st.interval)
                st.countdown = st.interval
            else:
                st.countdown = TRIAL_GAP
            return
        if median(trial) < SWITCH_MARGIN * median(st.samples[st.current]):
            st.current, st.interval = threads, EXPLORE_MIN
            st.ref, st.fresh = median(trial), 0
            self.switches += 1
        elif moved:
            st.interval = EXPLORE_MIN  # this count's time moved: confirm or refute it soon
        elif known:
            st.interval = min(EXPLORE_MAX, 2 * st.interval)  # it lost again, as before: try it more rarely
        st.countdown = st.interval

    @staticmethod
    def _costly(st: _ClassState) -> bool:
        """Whether the class's steps on its current count take COSTLY_STEP_S or more (median)."""
        times = st.samples.get(st.current)
        return bool(times) and median(times) >= COSTLY_STEP_S

    def _host_busy(self) -> bool:
        """Whether a cheap class (measured, under COSTLY_STEP_S) runs on fewer threads than all: its trials found
        the host busy enough that a descheduled partner thread costs more than the second core gives."""
        return any(st.current < self.max_threads and st.samples.get(st.current) and not self._costly(st)
                   for st in self._states.values())

    def _drifted(self, st: _ClassState, cur: float) -> None:
        """The current count's median moved past DRIFT: every count's samples are stale (the others' were
        taken on another machine state; the current's window mixes both): all are measured afresh, the
        current count MIN_SAMPLES steps, then the others' trials TRIAL_GAP apart."""
        st.samples, st.ref, st.fresh = {}, None, 0
        st.interval, st.countdown = EXPLORE_MIN, TRIAL_GAP

    def current_of(self, cls: tuple[bool, int]) -> int:
        """The count steps of class `cls` run on now (between trials)."""
        st = self._states.get(cls)
        return st.current if st is not None else self.max_threads

    def summary(self) -> dict[str, str]:
        """Per step class: the current count and the median step time of each count tried, e.g.
        {"decode<=8": "1 (2: 41.0 ms, 1: 12.3 ms)"}."""
        return {f"{'prefill' if p else 'decode'}<={1 << b}": f"{st.current} (" + ", ".join(
            f"{n}: {median(t) * 1e3:.1f} ms" for n, t in sorted(st.samples.items(), reverse=True) if t) + ")"
            for (p, b), st in sorted(self._states.items())}


FORK_JOIN_QUIET_S = 5e-4
"""Several threads' timings are trusted only when torch's threads fork and join around a small parallel fill
in less than this (median of 15 calls, before and after the timing; ~20-40 us on the quiet 2-core EPYC): on
2 cores shared with a busy process each multi-thread call waits a scheduler slice for its partner thread and
the times are the scheduler's. Seen there: SmolLM2's bf16 576 x 576 at one row timed panel 11.9 ms, linear
12.0, pretransposed 0.73 (the one kernel not waiting on a partner); pretransposed was saved, and every later
bf16 decode step left the fused team path (12.6 tok/s against 57)."""


def fork_join_s() -> float:
    """Median seconds of a parallel fill of 512 KB on torch's intra-op threads (0 on one thread: nothing
    to wait for)."""
    import time

    import torch

    if torch.get_num_threads() < 2:
        return 0.0
    x = torch.empty(1 << 17)  # 4 grains of at::parallel_for: every thread takes part
    times = []
    for _ in range(15):
        t = time.perf_counter()
        x.fill_(1.0)
        times.append(time.perf_counter() - t)
    return median(times)
