"""Multiprocess executor (gloo), GPT-2 family: see parallel_mp_cases.py."""

FAMILY = "gpt2"

from parallel_mp_cases import *


def test_llm_picks_the_multiprocess_executor_for_tp(gpt2_dir):
    """LLM(..., tensor_parallel_size=2) shards without any executor named."""
    from parallel_fixtures import PROMPTS as P

    from engines.core.llm_engine import LLM
    from engines.core.sampling_params import SamplingParams as SP
    from engines.parallel.mp_executor import MultiprocExecutor

    params = SP(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(gpt2_dir, num_kv_blocks=64).generate(P, params)]
    llm = LLM(gpt2_dir, num_kv_blocks=64, tensor_parallel_size=2, worker_threads=1)
    try:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        assert [o.outputs[0].token_ids for o in llm.generate(P, params)] == ref
    finally:
        llm.engine.shutdown()
