"""benchmarks/bench_decode_attention.py on a tiny shape: every table layout runs and prints its row, and a bad
--tables names the option and what it takes."""

import sys

import pytest
import torch

from benchmarks import bench_decode_attention as bench
from engines.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.load()[0] is None, reason="the C++ kernels cannot be built here")

TINY = ["--rows", "3", "--context", "20-40", "--layers", "2", "--repeats", "1", "--dtypes", "float32,bfloat16"]


def test_every_table_layout_prints_a_row(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_decode_attention.py", *TINY, "--tables", "scattered,sequential,cached"])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith(("| float32", "| bfloat16"))]
    assert [(r[0], r[1]) for r in rows] == [(d, t) for d in ("float32", "bfloat16")
                                            for t in ("scattered", "sequential", "cached")]
    for r in rows:  # ms a layer and ns a position are measured, positive numbers (GB/s may print 0.0 at this size)
        assert float(r[2]) > 0 and float(r[6]) > 0


def test_a_bad_layout_names_the_option(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_decode_attention.py", *TINY, "--tables", "scattered,diagonal"])
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert "--tables" in err and "'diagonal'" in err and "scattered, sequential or cached" in err


def test_layouts_lie_as_named():
    g = torch.Generator().manual_seed(0)
    rows, per_seq, layers, blocks = 20, 5, 3, 20 * 5 * 3 + 16
    scattered = bench.layout_tables("scattered", rows, per_seq, layers, blocks, g)
    sequential = bench.layout_tables("sequential", rows, per_seq, layers, blocks, g)
    cached = bench.layout_tables("cached", rows, per_seq, layers, blocks, g)
    for t in scattered:  # distinct blocks, not in order
        assert t.shape == (rows, per_seq) and t.unique().numel() == t.numel() and int(t.max()) < blocks
        assert not bool((t.flatten().diff() == 1).all())
    all_seq = torch.cat([t.flatten() for t in sequential])  # every sequence's blocks one after another, no layer shares
    assert torch.equal(all_seq, torch.arange(rows * per_seq * layers)) and int(all_seq.max()) < blocks
    assert len(cached) == layers and all(t is cached[0] for t in cached)  # one small working set, read every layer
    assert cached[0].shape == (bench.CACHED_ROWS, per_seq) and bool((cached[0].flatten().diff() == 1).all())
    with pytest.raises(ValueError, match="diagonal"):
        bench.layout_tables("diagonal", rows, per_seq, layers, blocks, g)
