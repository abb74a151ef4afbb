"""Shared fixtures: tiny random checkpoints written by transformers, with a real BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.cpu.cpu_threads import configure_openmp_env

# The engine's OpenMP wait (GOMP_SPINCOUNT 10,000 pauses, engines/cpu/cpu_threads.py) is set when `engines` is
# imported before torch, as the CLI and the servers do; libgomp reads it once, when torch loads. Test files import
# torch first (isort order), so without this line every worker, and every engine process and Ray node it starts,
# ran libgomp's default 300,000-pause spin after each parallel region: on make test's 4 workers over 2 cores,
# an idle thread's spin took the slice its partner, or another worker, was waiting for.
configure_openmp_env()

CORPUS = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles "
    "and by opposing end them. Héllo wörld — naïve café, 東京 and emoji 🙂 too. "
) * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(out_dir: Path, vocab_size: int = 400) -> int:
    """Byte-level BPE trained on CORPUS; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([CORPUS], trainer)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    return tk.get_vocab_size()


def make_checkpoint(out_dir: Path, family: str, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out_dir)
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(**{"vocab_size": vocab, "n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
                            "bos_token_id": 0, "eos_token_id": 0, **overrides})
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(**{"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                             "bos_token_id": 0, "eos_token_id": 0, **overrides})
        model = LlamaForCausalLM(cfg)
    # wider-than-default weights so that logits are far from ties (robust greedy comparisons)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.eval().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpt2"), "gpt2")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(params=["gpt2", "llama"])
def model_dir(request, gpt2_dir, llama_dir) -> Path:
    return gpt2_dir if request.param == "gpt2" else llama_dir


@pytest.fixture(autouse=True, scope="session")
def _cpu_without_bf16():
    """Engine tests compare fp32 numerics (1e-4); dtype="auto" (the default) would pick bf16 on an
    AMX or AVX512-BF16 machine. Every test poses as a CPU without bf16 unless it poses its own
    flags (tests/test_hardware_dtype.py). Shard workers get the resolved config from the parent.
    Session-scoped, so that module- and session-scoped engines (built before any function-scoped
    fixture runs) are posed too."""
    from engines.core import hardware

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hardware, "read_cpu_flags", lambda *a, **k: frozenset({"avx2"}))
        yield


# --- process exit -------------------------------------------------------------------------------
# One CI run (stop 23) passed every test and then died with SIGSEGV while the interpreter tore
# itself down (669 passed, then `make: *** Segmentation fault`). The suite's process has hosted a
# Ray driver, inductor-compiled kernels, gloo process groups and engine threads by then, and
# tearing down such C++ state in interpreter finalization is a known crash site (ray-project/ray
# #885, #34508). So, once pytest has reported: run the atexit handlers (Ray's shutdown, inductor's
# worker pool, multiprocessing's children) while the interpreter is whole, report any thread still
# running (a test that leaked an engine), and leave with pytest's own status, skipping finalization.
# A crash inside a test still fails the run (make test sets PYTHONFAULTHANDLER for its stacks).
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import atexit
    import os
    import sys
    import threading

    if not _EXIT_STATUS:
        return  # pytest stopped before a session ran (e.g. a usage error): its normal exit path
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if left:
        sys.stderr.write(f"threads still running after the session: {', '.join(sorted(left))}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])


# --- tiers -------------------------------------------------------------------------------------
# `make test-fast` (pytest --fast) collects only the unit and parity tier below: tiny configs, no
# servers, no subprocess worlds, under 2 minutes on 2 cores. `make test` runs every file (CI).
# A new test file belongs to the whole suite only until it is named here. Left out on purpose:
# test_tuner.py (times this host's kernels), test_ptuning_engine.py (trains), test_engine_fast_linear.py
# (times each Linear's layouts): 80-150 s each on a loaded host.
FAST_TIER = frozenset({
    "test_import_graph.py", "test_deploy_schema.py", "test_deploy_files.py", "test_dense_attention.py",
    "test_engine_batching.py", "test_engine_decode_runner.py", "test_engine_errors.py",
    "test_engine_fairness.py", "test_engine_kv_sizing.py", "test_engine_paged.py", "test_engine_parity.py",
    "test_engine_sampling.py", "test_fp8.py", "test_hardware_dtype.py", "test_loadtest_unit.py",
    "test_parallel_layers.py", "test_training_data.py",
    "test_tuner_fit.py", "test_tuner_decode_fit.py", "test_tuner_hostref.py", "test_tuner_stream.py",
    "test_train_search.py",
})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="only the unit and parity tier (tests/conftest.py FAST_TIER): make test-fast")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --fast, test files outside FAST_TIER are not even imported (no ray/fastapi import cost)."""
    if config.getoption("--fast") and collection_path.is_file() and collection_path.name.startswith("test_"):
        return collection_path.name not in FAST_TIER or None
    return None


# --- order: the longest files first ------------------------------------------------------------
# `make test` hands whole files to four workers in collection order (--dist loadfile
# --no-loadscope-reorder; xdist by default puts the files with the most tests first), so a long
# file with few tests (test_tuner_validate.py: 5 tests, 4 minutes) went last and became the tail:
# the other workers idled while it ran. The files that take over a minute of a 2-core host start
# first (longest-processing-time-first), alternating between files that start a Ray instance and
# files that only compute: four Ray instances starting at once on two loaded cores miss Ray's own
# 30 s node-registration wait (seen here at load 17). Measured by --durations; the order inside
# each file is kept.
SLOW_FIRST = (  # AVX2 EPYC, 2026-12-01: the real model's file 235 s (fetch, import, timing), two nodes 169 s
    "test_engine_compile.py", "test_tuner_validate.py",
    "test_gguf_real_model.py", "test_cluster_two_nodes.py",
    "test_training_parallel.py", "test_parallel_ray_http_parity.py",
    "test_serving_openapi.py", "test_training_loop.py",
    "test_training_megatron_loop.py", "test_serving_ingress.py",
    "test_parallel_mp_gpt2.py", "test_parallel_ray_http.py",
    "test_engine_panel_kernel.py", "test_serving_ray.py",
    "test_ptuning_training.py",
    "test_fp8_parallel.py", "test_tuner.py",
    "test_families.py",
    "test_ptuning_engine.py", "test_serving_cli.py",
    "test_engine_fast_linear.py", "test_parallel_ray.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order


def quantize_dir(src: Path, out: Path) -> Path:
    """`shardserve quantize --format fp8` through the real CLI (tests/test_fp8*.py)."""
    from typer.testing import CliRunner

    from shardserve.cli import app

    r = CliRunner().invoke(app, ["quantize", "--model", str(src), "--out", str(out), "--format", "fp8"])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def llama_fp8(llama_dir, tmp_path_factory) -> Path:
    return quantize_dir(llama_dir, tmp_path_factory.mktemp("q") / "llama-fp8")


@pytest.fixture(scope="module")
def gpt2_fp8(gpt2_dir, tmp_path_factory) -> Path:
    return quantize_dir(gpt2_dir, tmp_path_factory.mktemp("q") / "gpt2-fp8")
