"""P-tuning in the engine: PEFT interop both ways, mixed-task batches, snapshots, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engines import LLM, SamplingParams
from engines.core.config import EngineConfig
from engines.core.llm_engine import LLMEngine
from engines.transforms.ptuning import ModelShape, TaskError, UnknownTaskError, write_task_dir

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["the king said", "to be or not to be that is", "my lord", "love is a smoke raised with the fume of sighs"]


def _table(n: int, hidden: int, seed: int) -> np.ndarray:
    # large enough rows to change the continuation (a near-zero table would not test injection)
    return np.random.default_rng(seed).normal(0, 1.0, (n, hidden)).astype(np.float32)


def _prefix_table(n: int, shape: ModelShape, seed: int) -> np.ndarray:
    """A task of every layer: (n, layers x 2 x KV width) keys/values."""
    return np.random.default_rng(seed).normal(0, 1.0, (n, shape.prefix_width)).astype(np.float32)


def _peft_model(model_dir, peft_type: str, n: int):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if peft_type == "P_TUNING":
        cfg = PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, encoder_hidden_size=32)
    elif peft_type == "PREFIX_TUNING":
        cfg = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n)
    elif peft_type == "PREFIX_TUNING+projection":  # PEFT saves the projected keys/values
        cfg = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, prefix_projection=True,
                                 encoder_hidden_size=32)
    else:
        cfg = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n)
    return base, get_peft_model(base, cfg)


def _peft_greedy(model, tok_ids: list[int], max_new: int) -> list[int]:
    """Greedy continuation by PEFT's own forward (it prepends the virtual tokens), recomputed in full
    at every step: PEFT's generate() with a KV cache went wrong for prompt learning with
    transformers 5.24 (it drifts from its own forward after the first token), so it is no reference."""
    seq = list(tok_ids)
    with torch.no_grad():
        for _ in range(max_new):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(tok_ids):]


@pytest.mark.parametrize("family,peft_type", [("gpt2", "P_TUNING"), ("llama", "PROMPT_TUNING"),
                                              ("gpt2", "PREFIX_TUNING"), ("llama", "PREFIX_TUNING"),
                                              ("gpt2", "PREFIX_TUNING+projection")])
def test_peft_adapter_loads_and_matches_peft_generate(gpt2_dir, llama_dir, tmp_path, family, peft_type):
    model_dir = gpt2_dir if family == "gpt2" else llama_dir
    torch.manual_seed(0)
    _, pm = _peft_model(model_dir, peft_type, n=6)
    # a few real training steps through PEFT (the base stays frozen), so the table is PEFT's own
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=0.05)
    batch = torch.randint(1, 300, (2, 12))
    for _ in range(3):
        loss = pm(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    pm.eval()
    pm.save_pretrained(tmp_path / "peft_task")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tmp_path / "peft_task")
    llm = LLM(model_dir)
    llm.load_task("peft_task", tmp_path / "peft_task")
    outs = llm.generate(PROMPTS[:2], GREEDY, task="peft_task")
    plain = llm.generate(PROMPTS[:2], GREEDY)
    for p, o, q in zip(PROMPTS[:2], outs, plain):
        ids = llm.tokenizer.encode(p)
        assert o.prompt_token_ids == ids and o.num_virtual_tokens == 6 and o.task == "peft_task"
        assert o.outputs[0].token_ids == _peft_greedy(ref, ids, 10)
        assert o.outputs[0].token_ids != q.outputs[0].token_ids  # the virtual tokens did something


def test_our_task_loads_in_peft(llama_dir, tmp_path):
    model_dir = llama_dir
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(model_dir)
    hidden = llm.engine.model_config.n_embd
    write_task_dir(tmp_path / "ours", "ours", _table(5, hidden, 1), base_model=str(model_dir))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tmp_path / "ours")
    llm.load_task("ours", tmp_path / "ours")
    for p, o in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], GREEDY, task="ours")):
        assert o.outputs[0].token_ids == _peft_greedy(ref, llm.tokenizer.encode(p), 10)


def test_our_every_layer_task_loads_in_peft(llama_dir, tmp_path):
    """PREFIX_TUNING both ways: our table's layout is PEFT's (keys and values per layer, KV heads)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(llama_dir)
    shape = ModelShape.of(llm.engine.model_config)
    write_task_dir(tmp_path / "deep", "deep", _prefix_table(5, shape, 2), peft_type="PREFIX_TUNING",
                   base_model=str(llama_dir), shape=shape)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir).eval(), tmp_path / "deep")
    llm.load_task("deep", tmp_path / "deep")
    outs = llm.generate(PROMPTS[:2], GREEDY, task="deep")
    for p, o, q in zip(PROMPTS[:2], outs, llm.generate(PROMPTS[:2], GREEDY)):
        assert o.outputs[0].token_ids == _peft_greedy(ref, llm.tokenizer.encode(p), 10)
        assert o.outputs[0].token_ids != q.outputs[0].token_ids


def _write_tasks(model_dir, shape: ModelShape) -> None:
    for i, n in enumerate((4, 9, 20)):
        write_task_dir(model_dir / "ptuning" / f"t{i}", f"t{i}", _table(n, shape.hidden, 10 + i), base_model="x")
    write_task_dir(model_dir / "ptuning" / "t3", "t3", _prefix_table(6, shape, 13), base_model="x",
                   peft_type="PREFIX_TUNING", shape=shape)  # every layer's keys/values


def test_mixed_batch_invariance_with_chunked_prefill_and_preemption(gpt2_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(gpt2_dir, d)
    llm = LLM(d)
    _write_tasks(d, ModelShape.of(llm.engine.model_config))
    for i in range(4):
        llm.load_task(f"t{i}")
    reqs = [(p, t) for p in PROMPTS[1:] for t in (None, "t0", "t1", "t2", "t3")]
    alone = {(p, t): llm.generate(p, GREEDY, task=t)[0].outputs[0].token_ids for p, t in reqs}
    assert len({tuple(v) for v in alone.values()}) > len(PROMPTS)  # tasks change the outputs
    # small token budget (chunked prefill, chunks ending inside the virtual tokens) and few KV blocks
    # admission_reserves_growth off: admit on what a request needs now, so the pool runs dry (preemption)
    eng = LLMEngine(d, EngineConfig(block_size=4, num_kv_blocks=18, max_num_batched_tokens=7,
                                    admission_reserves_growth=False))
    eng.tasks.load_dir()
    got: dict[int, list[int]] = {}
    pending = list(enumerate(reqs))
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:  # admitted at different steps
            for _ in range(2):
                if pending:
                    i, (p, t) = pending.pop(0)
                    eng.add_request(str(i), p, GREEDY, task=t)
        for out in eng.step():
            if out.finished:
                got[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
    assert eng.stats()["num_preemptions"] > 0
    for i, key in enumerate(reqs):
        assert got[i] == alone[key], key


def test_running_request_keeps_its_snapshot(gpt2_dir, tmp_path):
    llm = LLM(gpt2_dir)
    hidden = llm.engine.model_config.n_embd
    write_task_dir(tmp_path / "a", "a", _table(6, hidden, 1))
    write_task_dir(tmp_path / "b", "b", _table(6, hidden, 2))
    llm.load_task("t", tmp_path / "a")
    want_a = llm.generate(PROMPTS[0], GREEDY, task="t")[0].outputs[0].token_ids
    eng = llm.engine
    eng.add_request("r1", PROMPTS[0], GREEDY, task="t")
    eng.step()
    llm.load_task("t", tmp_path / "b")  # replaced mid-flight
    eng.add_request("r2", PROMPTS[0], GREEDY, task="t")
    llm.unload_task("t")
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs["r1"].outputs[0].token_ids == want_a
    assert outs["r2"].outputs[0].token_ids != want_a  # r2 took b's table
    with pytest.raises(UnknownTaskError):
        llm.generate(PROMPTS[0], GREEDY, task="t")


def test_bad_tasks_are_refused_and_nothing_changes(gpt2_dir, llama_dir, tmp_path):
    llm = LLM(gpt2_dir, max_model_len=64)
    hidden = llm.engine.model_config.n_embd
    write_task_dir(tmp_path / "good", "good", _table(30, hidden, 3))
    llm.load_task("good", tmp_path / "good")
    before = llm.generate(PROMPTS[0], GREEDY, task="good")[0].outputs[0].token_ids
    for bad in ("../x", "a/b", "..", "", "x" * 65, ".hidden"):
        with pytest.raises(TaskError) as e:
            llm.load_task(bad, tmp_path / "good")
        assert e.value.code == "invalid_task_name"
    write_task_dir(tmp_path / "wide", "wide", _table(4, hidden + 8, 4))
    with pytest.raises(TaskError, match="is 72 wide but this model's hidden size is 64"):
        llm.load_task("good", tmp_path / "wide")
    shape = ModelShape.of(llm.engine.model_config)
    other = ModelShape(shape.hidden, shape.n_layer + 1, shape.kv_heads, shape.head_dim)
    write_task_dir(tmp_path / "deeper", "deeper", _prefix_table(4, other, 4), peft_type="PREFIX_TUNING", shape=other)
    with pytest.raises(TaskError, match="num_layers is 3 but this model has 2") as e:
        llm.load_task("good", tmp_path / "deeper")
    assert e.value.code == "task_model_mismatch"
    # a task trained for another base model (task.json hashes) is refused
    write_task_dir(tmp_path / "other", "other", _table(4, hidden, 5), meta={"base_model_sha256": "0" * 64})
    with pytest.raises(TaskError, match="another base model"):
        llm.load_task("good", tmp_path / "other")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text(json.dumps({"peft_type": "P_TUNING"}))
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(TaskError, match="never unpickled"):
        llm.load_task("good", tmp_path / "pickle")
    with pytest.raises(UnknownTaskError) as e:
        llm.generate(PROMPTS[0], GREEDY, task="nope")
    assert e.value.code == "task_not_found"
    # 30 virtual + prompt + 10 new tokens beyond a 64-token window
    long_prompt = [5] * 30  # token ids
    assert llm.generate(long_prompt, GREEDY)  # fits without the task
    with pytest.raises(Exception, match="context window") as e:
        llm.generate(long_prompt, GREEDY, task="good")
    assert e.value.code == "context_length_exceeded"
    assert llm.engine.tasks.names() == ["good"]
    assert llm.generate(PROMPTS[0], GREEDY, task="good")[0].outputs[0].token_ids == before
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tp_and_pp_equal_one_shard_with_a_task(llama_dir, tmp_path, layout):
    """TP adds the table after the vocabulary-parallel lookup's all-reduce (never times 2); PP
    injects on the first stage only. Chunked prefill splits the virtual tokens across steps."""
    opts = {"num_kv_blocks": 64, "max_num_batched_tokens": 16}
    ref_llm = LLM(llama_dir, **opts)
    shape = ModelShape.of(ref_llm.engine.model_config)
    write_task_dir(tmp_path / "t", "t", _table(7, shape.hidden, 7))
    # every layer: each stage injects its layers' rows, each TP rank its KV heads'
    write_task_dir(tmp_path / "d", "d", _prefix_table(9, shape, 8), peft_type="PREFIX_TUNING", shape=shape)
    tasks = ["t", None, "t", "d"]
    for name in ("t", "d"):
        ref_llm.load_task(name, tmp_path / name)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS, GREEDY, task=tasks)]
    assert ref[3] != ref_llm.generate(PROMPTS[3], GREEDY)[0].outputs[0].token_ids
    llm = LLM(llama_dir, **opts, **layout, worker_threads=1)
    try:
        for name in ("t", "d"):
            llm.load_task(name, tmp_path / name)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, task=tasks)] == ref
    finally:
        llm.engine.shutdown()
