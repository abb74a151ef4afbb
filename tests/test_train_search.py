"""`shardserve tune train`: candidates, the memory pruning and a real timed search (one rank, tiny model)."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from engines.core.config import ModelConfig
from tuner.train_search import Candidate, enumerate_candidates, memory_estimate

CFG = ModelConfig("gpt2", vocab_size=128, n_layer=2, n_head=4, n_embd=32, max_position_embeddings=32)


def test_candidates_respect_the_layout_rules():
    cands = enumerate_candidates(CFG, 16, 8, 4)
    assert {(c.tp, c.pp) for c in cands} == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)}  # PP 4 > 2 layers
    assert all(c.tp > 1 or not c.sequence_parallel for c in cands)
    assert all((8 // c.dp) % c.micro_batch_size == 0 for c in cands)
    assert not [c for c in cands if c.pp > CFG.n_layer]


def test_memory_estimate_orders_the_layouts_like_the_paper():
    big = CFG.replace(n_embd=256, n_head=8)
    est = {rc: memory_estimate(big, Candidate(2, 1, 1, sp, rc, 4), 256, 4)
           for sp, rc in ((False, "none"), (True, "selective"), (False, "full"))}
    assert est["full"] < est["selective"] < est["none"]
    assert memory_estimate(big, Candidate(2, 1, 1, True, "none", 4), 256, 4) < est["none"]


def test_search_times_every_survivor_and_writes_a_recipe(tmp_path):
    from shardserve.cli import app

    recipe = {"model": {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "max_position_embeddings": 32,
                        "vocab_size": 128},
              "data": {"dir": str(tmp_path / "none"), "seq_len": 16},
              "train": {"batch_size": 2, "micro_batch_size": 1, "precision": "fp32"}, "optim": {"warmup_steps": 0}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    # 0.0006 GiB prunes the layouts that keep the most activations (mb=2 without full recomputation)
    res = CliRunner().invoke(app, ["tune", "train", "--config", str(tmp_path / "r.yaml"), "--devices", "1",
                                   "--steps", "1", "--device-memory-gib", "0.0006", "--out", str(tmp_path / "best.yaml")])
    assert res.exit_code == 0, res.output
    assert "pruned by the memory estimate" in res.output and "fastest: TP1 PP1 DP1" in res.output
    timed = [line for line in res.output.splitlines() if line.startswith("TP1 PP1 DP1 rc=")]
    assert 1 <= len(timed) < 6  # some of the 6 candidates pruned, the others timed
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["train"]["recompute"] in ("none", "selective", "full")
