"""P-tuning over REST (in-process gateway, real engine, real job process, real openai client)."""

from __future__ import annotations

import json
import random
import shutil
import time

import numpy as np
import pytest
from starlette.testclient import TestClient

from deploy.schema import validate_config
from engines import LLM, SamplingParams
from engines.transforms.ptuning import write_task_dir
from serving.app import create_local_app
from serving.ptuning_admin import RECIPE_KEYS, _job_alive

ADMIN, USER = {"Authorization": "Bearer adm-key"}, {"Authorization": "Bearer usr-key"}
WORDS = ["king", "queen", "love", "war", "sword", "heart", "night", "fair"]


def _client(model_dir, api_keys=("usr-key",), admin_keys=("adm-key",)) -> TestClient:
    cfg = validate_config({"models": [{"name": "m", "path": str(model_dir), "engine": {
        "num_kv_blocks": 256, "max_num_seqs": 8, "cpu_linear_autotune": False}}], "server": {"log_requests": False}})
    return TestClient(create_local_app(cfg, api_keys=list(api_keys), admin_keys=list(admin_keys)),
                      raise_server_exceptions=False)


def _jsonl(n: int) -> str:
    rng = random.Random(1)
    return "".join(json.dumps({"input": " ".join(rng.choices(WORDS, k=4)), "output": " yes"}) + "\n"
                   for _ in range(n))


def _wait(c: TestClient, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/v1/ptuning/jobs/{job_id}", headers=ADMIN).json()
        if job["state"] in states or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


@pytest.fixture(scope="module")
def model_dir(gpt2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("rest") / "m"
    shutil.copytree(gpt2_dir, d)
    return d


def test_recipe_keys_match_the_training_recipe():
    from training.ptune_recipe import PtuneRecipe

    assert set(RECIPE_KEYS) == set(PtuneRecipe.__dataclass_fields__)


def test_admin_runs_typed_operations(tmp_path):
    """The replica side takes typed operations (serving/ptuning_ops.py), no op-name strings; errors
    come back as data, naming the field."""
    from engines.transforms.ptuning import ModelShape, TaskRegistry
    from serving.ptuning_admin import PtuningAdmin
    from serving.ptuning_ops import DeleteTask, GetJob, ListJobs, ListTasks, StartJob

    admin = PtuningAdmin("m", tmp_path, TaskRegistry(tmp_path, ModelShape(hidden=8, n_layer=1,
                                                                          kv_heads=1, head_dim=8)))
    assert admin.run(ListTasks()) == (None, []) and admin.run(ListJobs()) == (None, [])
    err, _ = admin.run(GetJob("ptj-0000"))
    assert (err.status, err.code, err.param) == (404, "job_not_found", "id")
    err, _ = admin.run(DeleteTask("../x"))
    assert err.status == 400 and err.code == "invalid_task_name"
    err, _ = admin.run(StartJob("t", data=_jsonl(2), recipe={"batch_size": "many"}))
    assert (err.status, err.code, err.param) == (400, "invalid_value", "recipe.batch_size"), err
    assert not (tmp_path / "ptuning").exists()  # a refused job leaves nothing behind


def test_job_trains_registers_and_serves_then_restart_keeps_it(model_dir):
    import openai

    body = {"model": "m", "task": "yes", "data": _jsonl(24),
            "recipe": {"num_virtual_tokens": 4, "max_steps": 12, "eval_every": 4, "lr": 0.05, "batch_size": 8}}
    with _client(model_dir) as c:
        assert c.post("/v1/ptuning/jobs", json=body).status_code == 401
        r = c.post("/v1/ptuning/jobs", json=body, headers=USER)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert c.get("/v1/ptuning/tasks", headers=USER).status_code == 403
        r = c.post("/v1/ptuning/jobs", headers=ADMIN, json={"model": "m", "task": "long", "data": _jsonl(8),
                                                             "recipe": {"max_steps": 100000, "eval_every": 1000}})
        long_id = r.json()["id"]
        r = c.post("/v1/ptuning/jobs", json=body, headers=ADMIN)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        r = c.post("/v1/ptuning/jobs", json=body, headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_conflict"
        # cancel the long job once it has made progress: it leaves no task behind
        job = _wait(c, long_id, ("running",))
        while not (job.get("progress") or {}).get("step"):
            job = c.get(f"/v1/ptuning/jobs/{long_id}", headers=ADMIN).json()
            time.sleep(0.2)
        r = c.delete(f"/v1/ptuning/jobs/{long_id}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert not (model_dir / "ptuning" / "long").exists()
        assert c.delete(f"/v1/ptuning/jobs/{long_id}", headers=ADMIN).status_code == 409
        seen_progress = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = c.get(f"/v1/ptuning/jobs/{job_id}", headers=ADMIN).json()
            if job["progress"]:
                seen_progress.append(job["progress"])
            if job["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.2)
        assert job["state"] == "succeeded", job
        assert job["progress"]["step"] == job["progress"]["total"] == 12 and "eta_s" in job["progress"]
        assert job["metrics"]["base_grad_bytes"] == 0
        tasks = c.get("/v1/ptuning/tasks", headers=ADMIN).json()["data"]
        assert [t["name"] for t in tasks] == ["yes"] and tasks[0]["num_virtual_tokens"] == 4
        # served answers equal the in-process engine's with the same task files
        llm = LLM(model_dir)
        llm.load_task("yes")
        prompts = ["king and queen", "love and war"]
        want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                                                          task="yes")]
        oa = openai.OpenAI(base_url="http://testserver/v1", api_key="usr-key", http_client=c)
        got = oa.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, extra_body={"task": "yes"})
        assert [ch.text for ch in sorted(got.choices, key=lambda ch: ch.index)] == want
        assert got.usage.model_extra["virtual_tokens"] == 8 and got.usage.prompt_tokens == sum(
            len(llm.tokenizer.encode(p)) for p in prompts)
        chat = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"task": "yes"})
        assert chat.usage.model_extra["virtual_tokens"] == 4
        kv = c.post("/v2/models/m/generate", headers=USER, json={
            "text_input": prompts[0], "parameters": {"max_tokens": 6, "temperature": 0, "task": "yes"}})
        assert kv.status_code == 200 and kv.json()["text_output"] == want[0]
        with pytest.raises(openai.NotFoundError) as e:
            oa.completions.create(model="m", prompt="x", max_tokens=2, extra_body={"task": "nope"})
        assert e.value.body["code"] == "task_not_found"
        with pytest.raises(openai.BadRequestError):
            oa.completions.create(model="m", prompt="x", max_tokens=2, extra_body={"task": "../etc"})
    with _client(model_dir) as c:  # a restarted server still serves the task and knows the job
        assert [t["name"] for t in c.get("/v1/ptuning/tasks", headers=ADMIN).json()["data"]] == ["yes"]
        assert c.get(f"/v1/ptuning/jobs/{job_id}", headers=ADMIN).json()["state"] == "succeeded"
        r = c.post("/v1/completions", headers=USER, json={"model": "m", "prompt": prompts[1], "max_tokens": 6,
                                                           "temperature": 0, "task": "yes"})
        assert r.json()["choices"][0]["text"] == want[1]


def test_a_job_killed_with_its_server_runs_again_on_restart(model_dir):
    import os
    import signal

    body = {"model": "m", "task": "again", "data": _jsonl(16),
            "recipe": {"num_virtual_tokens": 4, "max_steps": 16, "eval_every": 8, "lr": 0.05, "batch_size": 8}}
    with _client(model_dir) as c:
        r = c.post("/v1/ptuning/jobs", json=body, headers=ADMIN)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        job = _wait(c, job_id, ("running", "succeeded", "failed"))
        assert job["state"] == "running", job
    # what a kill -9 of the server does to a job it started (Ray reaps the replica's children)
    state_file = model_dir / "ptuning" / ".jobs" / job_id / "state.json"
    pid = json.loads(state_file.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _job_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if json.loads(state_file.read_text())["state"] != "running":
        pytest.skip("the job finished before it could be killed")
    with _client(model_dir) as c:  # the restarted server starts the job again, once
        job = _wait(c, job_id, ("succeeded", "failed", "cancelled"))
        assert job["state"] == "succeeded" and job["restarts"] == 1, job
        assert job["progress"]["step"] == 16
        assert "again" in [t["name"] for t in c.get("/v1/ptuning/tasks", headers=ADMIN).json()["data"]]
        assert c.delete("/v1/ptuning/tasks/again", headers=ADMIN).status_code == 200


def test_bad_jobs_change_nothing(model_dir):
    with _client(model_dir) as c:
        before = sorted(p.name for p in (model_dir / "ptuning").iterdir()) if (model_dir / "ptuning").exists() else []
        bad = [({"task": "../x", "data": _jsonl(4)}, 400, "invalid_task_name"),
               ({"task": "t", "data": "{\"input\": \"a\", \"output\": \"b\"}\nnot json\n"}, 400, "invalid_dataset"),
               ({"task": "t", "data": _jsonl(30), "recipe": {"max_examples": 10}}, 413, "invalid_dataset"),
               ({"task": "t", "data": _jsonl(4), "recipe": {"lrr": 1}}, 400, "unknown_parameter"),
               # every value is checked by the recipe type at the boundary, not by a job that fails later
               ({"task": "t", "data": _jsonl(4), "recipe": {"lr": -1}}, 400, "invalid_value"),
               ({"task": "t", "data": _jsonl(4), "recipe": {"max_examples": 0}}, 400, "invalid_value"),
               ({"task": "t", "data": _jsonl(4), "recipe": {"prompt_depth": "every_layer", "encoder": "mlp"}}, 400,
                "invalid_value"),
               ({"task": "t", "dataset_path": "/nonexistent.jsonl"}, 400, "invalid_dataset"),
               ({"model": "zz", "task": "t", "data": _jsonl(4)}, 404, "model_not_found")]
        for extra, status, code in bad:
            r = c.post("/v1/ptuning/jobs", headers=ADMIN, json={"model": "m", **extra})
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (extra, r.text)
        after = sorted(p.name for p in (model_dir / "ptuning").iterdir()) if (model_dir / "ptuning").exists() else []
        assert after == before
        assert c.get("/v1/ptuning/jobs/ptj-0000", headers=ADMIN).status_code == 404
    with _client(model_dir, admin_keys=()) as c:  # user keys but no admin keys: admin routes are off
        r = c.get("/v1/ptuning/tasks", headers=USER)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    with _client(model_dir, api_keys=(), admin_keys=()) as c:  # no keys at all: an open dev server
        assert c.get("/v1/ptuning/tasks").status_code == 200


def test_hot_load_and_delete_while_requests_run(model_dir, tmp_path):
    hidden = 64
    write_task_dir(tmp_path / "hot", "hot", np.random.default_rng(0).normal(0, 1, (5, hidden)).astype(np.float32))
    write_task_dir(tmp_path / "wide", "wide", np.zeros((5, hidden + 1), np.float32))
    long = {"model": "m", "prompt": "the king", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with _client(model_dir) as c:
        alone = c.post("/v1/completions", headers=USER, json=long).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", headers=USER, json={**long, "stream": True}) as running:
            lines = running.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))  # the request is running now
            r = c.post("/v1/ptuning/tasks", headers=ADMIN, json={"model": "m", "name": "hot",
                                                                  "path": str(tmp_path / "hot")})
            assert r.status_code == 201 and r.json()["num_virtual_tokens"] == 5, r.text
            hot = c.post("/v1/completions", headers=USER, json={**long, "max_tokens": 5, "task": "hot"})
            assert hot.status_code == 200 and hot.json()["usage"]["virtual_tokens"] == 5
            r = c.post("/v1/ptuning/tasks", headers=ADMIN, json={"model": "m", "name": "hot2",
                                                                  "path": str(tmp_path / "wide")})
            assert r.status_code == 400 and "65 wide but this model's hidden size is 64" in r.json()["error"]["message"]
            assert c.delete("/v1/ptuning/tasks/hot", headers=ADMIN).status_code == 200
            events = [json.loads(ln[6:]) for ln in [first, *lines] if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == alone  # never noticed
        r = c.post("/v1/completions", headers=USER, json={**long, "max_tokens": 5, "task": "hot"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found"
        assert c.delete("/v1/ptuning/tasks/hot", headers=ADMIN).status_code == 404


def test_one_server_a_model_its_two_tasks_and_another_model_answer_as_alone(llama_dir, gpt2_dir, tmp_path):
    """Issue 39's serving point on tiny models: one server with two models, one of them with a task of
    every layer and an input task in its ptuning/ folder (as a fine-tuned export and the tasks
    trained on it); every (model, task) answers, in concurrent requests, the greedy tokens it gives
    alone. (That mixed-task batches equal single requests is test_ptuning_engine's; here the routing
    by model and task name through the gateway, with requests in flight together.)"""
    from concurrent.futures import ThreadPoolExecutor

    from engines.core.config import ModelConfig
    from engines.transforms.ptuning import ModelShape

    tuned = tmp_path / "tuned"
    shutil.copytree(llama_dir, tuned)
    shape = ModelShape.of(ModelConfig.from_dir(tuned))
    rng = np.random.default_rng(0)
    write_task_dir(tuned / "ptuning" / "play", "play", rng.normal(0, 1, (4, shape.prefix_width)).astype(np.float32),
                   peft_type="PREFIX_TUNING", shape=shape)
    write_task_dir(tuned / "ptuning" / "speaker", "speaker", rng.normal(0, 1, (3, shape.hidden)).astype(np.float32))
    cfg = validate_config({"models": [
        {"name": "tuned", "path": str(tuned), "engine": {"num_kv_blocks": 128, "max_num_seqs": 8,
                                                        "cpu_linear_autotune": False}},
        {"name": "other", "path": str(gpt2_dir), "engine": {"num_kv_blocks": 64, "cpu_linear_autotune": False}}],
        "server": {"log_requests": False}})
    prompts = ["the king said", "love is a smoke raised with the fume of sighs"]
    asks = [(m, t, p) for m, t in (("tuned", None), ("tuned", "play"), ("tuned", "speaker"), ("other", None))
            for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {}
    for name, d in (("tuned", tuned), ("other", gpt2_dir)):
        llm = LLM(d)
        llm.engine.tasks.load_dir()  # the tasks under ptuning/, as the server loads them
        for m, t, p in asks:
            if m == name:  # one request at a time: each served alone
                alone[m, t, p] = llm.generate([p], params, task=t)[0].outputs[0].text
    assert len({alone["tuned", t, p] for t in (None, "play", "speaker") for p in prompts}) > 2  # tasks change answers

    def ask(c, m, t, p):
        body = {"model": m, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", json=body if t is None else {**body, "task": t})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with TestClient(create_local_app(cfg), raise_server_exceptions=False) as c, ThreadPoolExecutor(len(asks)) as pool:
        got = dict(zip(asks, pool.map(lambda a: ask(c, *a), asks)))
    assert got == alone
