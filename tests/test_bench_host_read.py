"""The host-read timeline's summaries (benchmarks/bench_host_read.py): the read of back-to-back windows and the stays
above and below a split."""

import pytest

from benchmarks.bench_host_read import dwell, windows


def test_a_window_reads_at_the_harmonic_mean_of_its_samples():
    # a fixed amount of reading at 20 then at 60 GB/s takes the mean of the two times: 30 GB/s, not 40
    ts = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert windows(ts, [20.0, 60.0, 50.0, 50.0, 7.0], 2) == pytest.approx([30.0, 50.0])


def test_the_last_partial_window_is_left_out():
    assert windows([0.0, 1.0, 2.5], [10.0, 10.0, 10.0], 2) == [10.0]


def test_stays_above_and_below_the_split_in_order():
    ts = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0]
    rs = [50.0, 55.0, 30.0, 31.0, 52.0, 53.0]
    assert dwell(ts, rs, 40.0) == {"fast": [2.0, 2.0], "slow": [2.0]}
