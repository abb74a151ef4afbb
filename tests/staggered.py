"""Six requests that join an engine at different steps and leave at different steps: the run that
the equality tests of the engine's decode paths share (static runner, paged kernel, fused step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engines import SamplingParams
from engines.core.llm_engine import LLMEngine

ARRIVALS = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5]}
"""Request i joins at these steps; prompt i is range(3 + i, 20 + 4 i) (17-37 tokens)."""


def run_staggered(engine: LLMEngine, params: list[SamplingParams],
                  pick: Callable[[Any], Any] = lambda completion: completion.token_ids) -> dict[str, Any]:
    """Six requests joining at steps 0, 0, 2, 5, 5, 9 with params[i] (give them different
    max_tokens so they leave at different steps); returns pick(completion) of every request."""
    arrivals = {step: list(ids) for step, ids in ARRIVALS.items()}
    final, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for i in arrivals.pop(step, []):
            engine.add_request(f"r{i}", list(range(3 + i, 20 + 4 * i)), params[i])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = pick(out.outputs[0])
        step += 1
    return final
