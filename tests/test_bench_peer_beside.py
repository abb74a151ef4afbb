"""The peer benchmark's read ceiling beside each batch-1 repetition (benchmarks/bench_peer_vllm.py beside): a worker
reads the memory before each repetition of its round and once after its last; the rounds' reads are appended."""

from benchmarks.bench_peer_vllm import beside


def test_one_repetition_a_round_takes_the_larger_read_around_it():
    # three rounds of one repetition: (before, after) pairs
    assert beside([1, 1, 1], [10.0, 12.0, 30.0, 31.0, 29.0, 28.0]) == [12.0, 31.0, 29.0]


def test_several_repetitions_in_one_round_share_the_reads_between_them():
    assert beside([3], [1.0, 5.0, 2.0, 4.0]) == [5.0, 5.0, 4.0]


def test_counts_that_do_not_match_give_nothing():
    assert beside([1, 1], [1.0, 2.0, 3.0]) == []
    assert beside([1], [1.0, 2.0, 3.0]) == []
