"""The rule engines/cpu/fast_linear.py picks a kernel by among the timed ones (_fastest), on scripted times: repeated
rounds decide, hopeless kernels are dropped, the fused step's team kernel is kept unless another is far faster, and
rounds follow the budget."""

from __future__ import annotations

import pytest

import engines.cpu.fast_linear as fl


def _scripted(times: dict[str, list[float]]):
    """Kernels that take the scripted seconds, round after round, on a fake clock (no real timing)."""
    now = [0.0]
    calls = {k: iter([0.0, *v]) for k, v in times.items()}  # the first call is the warm-up

    def fn(k):
        now[0] += next(calls[k])

    return {k: (lambda k=k: fn(k)) for k in times}, lambda: now[0]


def test_a_single_lucky_round_does_not_choose_a_kernel():
    """Timing decides on repeated rounds: a kernel with one lucky round (its best is 4x linear's) but a
    slower median stays unchosen; one faster on its median and best round wins; a 5 % gain is no win (but
    the fused step's team kernel is kept unless linear is 10 % faster)."""
    fns, clock = _scripted({"linear": [1.0] * 5, "panel": [0.25, 1.2, 1.1, 1.3, 1.2]})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "linear"
    fns, clock = _scripted({"linear": [1.0, 3.0, 1.0, 1.1, 1.0], "panel": [0.6, 0.7, 2.5, 0.6, 0.65]})
    chosen, med = fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)
    assert chosen == "panel" and med == pytest.approx({"linear": 1.0, "panel": 0.65})
    fns, clock = _scripted({"linear": [1.0] * 5, "packed": [0.95] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "linear"
    # the fused step's team kernel is kept unless linear beats it by the margin on its median
    fns, clock = _scripted({"linear": [1.0] * 5, "packed": [0.95] * 5, "panel": [0.97] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "panel"
    fns, clock = _scripted({"linear": [1.0] * 5, "panel": [0.9, 1.05, 1.04, 1.06, 1.05]})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "panel"
    fns, clock = _scripted({"linear": [1.0] * 5, "panel": [0.9, 1.2, 1.15, 1.2, 1.2]})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "linear"
    # a long prefill chunk (outright): the lowest median, neither linear's margin nor the team kernel
    for times, won in (({"linear": [1.0] * 5, "packed": [0.95] * 5, "panel": [0.97] * 5}, "packed"),
                       ({"linear": [1.0] * 5, "packed": [1.1] * 5, "panel": [1.05] * 5}, "linear")):
        fns, clock = _scripted(times)
        assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock, outright=True)[0] == won


def test_a_hopeless_kernel_is_timed_once():
    """A kernel whose first round takes over HOPELESS times the best one's is not called again (scripted one
    round: a second call would exhaust it); its one round stands as its time, and "linear" is dropped likewise."""
    fns, clock = _scripted({"linear": [1.0] * 5, "pretransposed": [9.0], "panel": [0.5] * 5})
    chosen, med = fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)
    assert chosen == "panel" and med["pretransposed"] == 9.0
    fns, clock = _scripted({"linear": [4.5], "panel": [0.5] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock) == ("panel", {"linear": 4.5, "panel": 0.5})
    fns, clock = _scripted({"linear": [1.0] * 5, "gemv": [7.9] * 5})  # under the factor: timed every round
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[1] == {"linear": 1.0, "gemv": 7.9}


def test_a_kernel_hopeless_at_its_warm_up_is_not_called_again():
    """A warm-up call over HOPELESS_WARM_S and HOPELESS times the fastest warm-up is that kernel's only call and its
    time ("linear" is timed whatever its warm-up); a slow warm-up under the floor (a first call's one-time cost)
    drops nothing. Scripted: the first value of each list is the warm-up call's seconds."""
    def scripted(times):
        now, calls = [0.0], {k: iter(v) for k, v in times.items()}

        def fn(k):
            now[0] += next(calls[k])  # a call past the script raises StopIteration

        return {k: (lambda k=k: fn(k)) for k in times}, lambda: now[0]

    fns, clock = scripted({"linear": [0.9] * 6, "pretransposed": [6.0], "panel": [0.05] * 6})
    chosen, med = fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)
    assert chosen == "panel" and med == pytest.approx({"linear": 0.9, "pretransposed": 6.0, "panel": 0.05})
    fns, clock = scripted({"linear": [9.0] + [1.0] * 5, "panel": [0.5] * 6})  # linear: timed on
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock) == ("panel", {"linear": 1.0, "panel": 0.5})
    fns, clock = scripted({"linear": [0.001] * 6, "packed": [0.4] + [0.0005] * 5})  # oneDNN's first call: under 0.5 s
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "packed"


def test_one_row_on_several_threads_keeps_the_team_kernel_unless_another_is_far_faster():
    """At one row on several threads (team_first) the panel kernel stays unless a kernel's median is under
    TEAM_MARGIN of its own: the fused step runs panels without a fork and join each (a 30 % slower panel alone
    still won the step, 97 against 69 tok/s); elsewhere the rule above picks gemv."""
    times = {"linear": [1.0] * 5, "gemv": [0.75] * 5, "panel": [1.0] * 5}
    fns, clock = _scripted(times)
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "gemv"
    fns, clock = _scripted(times)
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock, team_first=True)[0] == "panel"
    fns, clock = _scripted({"linear": [1.0] * 5, "gemv": [0.6] * 5, "panel": [1.0] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock, team_first=True)[0] == "gemv"


def test_of_two_team_kernels_the_lower_median_is_the_team_kernel():
    """Both panel kinds timed (an AVX-512 host's auto and the avx2 code): the one of lower median is kept as the team
    kernel (team_first, and where linear does not beat it by the margin), whichever is listed first."""
    times = {"linear": [1.0] * 5, "gemv": [0.75] * 5, "panel": [1.0] * 5, "panel_avx2": [0.9] * 5}
    fns, clock = _scripted(times)
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock, team_first=True)[0] == "panel_avx2"
    fns, clock = _scripted({"linear": [1.0] * 5, "panel": [0.97] * 5, "panel_avx2": [1.05] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock)[0] == "panel"
    fns, clock = _scripted({"linear": [1.0] * 5, "panel": [1.2] * 5, "panel_avx2": [0.5] * 5})
    assert fl._fastest(fns, budget_s=0.0, min_rounds=5, clock=clock, team_first=True)[0] == "panel_avx2"


def test_timing_rounds_follow_the_budget():
    """At least min_rounds, then rounds until the budget is spent (fake clock: 1 s a call, 2 kernels)."""
    fns, clock = _scripted({"linear": [1.0] * 9, "panel": [0.5] * 9})
    chosen, _ = fl._fastest(fns, budget_s=6.0, min_rounds=2, max_rounds=9, clock=clock)
    assert chosen == "panel" and clock() == pytest.approx(4 * 1.5)  # 4 rounds (warm-ups take 0 here): 6 s spent
