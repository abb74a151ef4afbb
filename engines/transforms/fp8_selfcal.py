"""Data-free calibration for GPTQ: token windows the model writes itself.

`shardserve quantize --self-calibrate` runs GPTQ (engines/transforms/fp8_gptq.py) on text sampled from
the model being quantized, the data-free recipe of LLM-QAT (Liu et al., 2023, section 2.1): each window starts from one token drawn uniformly from the vocabulary (special tokens
excluded), the next GREEDY_TOKENS are the model's top-1 choices, and the rest are sampled at
temperature 1 from the full distribution (LLM-QAT's hybrid of greedy first tokens and sampling, the
best of the variants it compared); end-of-sequence may be drawn and is ignored, so an instruct
model goes on into new chat turns, the text it is served in. The text therefore follows what the model itself expects, needs no data from
the user, and shares nothing with any evaluation text. A fixed seed makes the windows the same on
every run on the same machine (the engine's seeded sampling is per request, independent of the
batch).

Measured on SmolLM2-135M-Instruct against Shakespeare validation text (BENCHMARKS.md, issue 35): worse
than rounding to nearest (+1.48 % perplexity with TOP_P, +1.56 % sampling the full distribution, against
+1.16 %), while GPTQ on Shakespeare training text gives -0.10 %: a small model's own text is too far
from that domain for its Hessians to transfer. Hence an option, not the default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

GREEDY_TOKENS = 3
"""Top-1 tokens after the random first token (LLM-QAT: the first 3-5 tokens greedy, then sampled)."""
TOP_P = 0.9
"""Nucleus sampling (Holtzman et al., 2020) after the greedy tokens: a small model's unlikely tail at
temperature 1 drifts into text unlike what it reads or writes (SmolLM2-135M, full distribution: +1.56 %
perplexity after GPTQ, worse than rounding to nearest)."""


def start_tokens(vocab_size: int, special_ids: set[int], n: int, seed: int) -> list[int]:
    """n first tokens drawn uniformly (with a fixed seed) from [0, vocab_size) minus the special ids."""
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special_ids], dtype=torch.long)
    if len(allowed) == 0:
        raise ValueError("calibration: the vocabulary has no ordinary token to start a window with")
    pick = torch.randint(0, len(allowed), (n,), generator=torch.Generator().manual_seed(seed))
    return allowed[pick].tolist()


def self_generated_windows(model_dir: str | Path, n: int, length: int, seed: int = 0,
                           on_tokens: Callable[[int], None] | None = None) -> torch.Tensor:
    """(n, length') token ids written by the model in `model_dir` itself (see the module docstring);
    length' = min(length, the model's context). `on_tokens(k)` is called as k more tokens exist (a
    progress bar of n * length' in all). Raises ValueError naming the calibration field."""
    from engines.core.llm_engine import LLM
    from engines.core.sampling_params import SamplingParams

    if n < 1 or length < GREEDY_TOKENS + 2:
        raise ValueError(f"calibration: need n >= 1 windows of length >= {GREEDY_TOKENS + 2}, "
                         f"got n={n}, length={length}")
    # fp32: the same samples whatever dtype the host would pick
    llm = LLM(str(model_dir), dtype="float32")
    try:
        eng = llm.engine
        length = min(length, eng.max_model_len)
        vocab, special = eng.model_config.vocab_size, set()
        if llm.tokenizer is not None:
            vocab = min(vocab, llm.tokenizer.vocab_size)
            special = {i for i, t in llm.tokenizer.tk.get_added_tokens_decoder().items() if t.special}
        firsts = start_tokens(vocab, special, n, seed)
        greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        heads = [[t, *o.outputs[0].token_ids] for t, o in zip(firsts, llm.generate([[t] for t in firsts], greedy))]
        if on_tokens is not None:
            on_tokens(n * len(heads[0]))
        rest = length - len(heads[0])
        for i, head in enumerate(heads):
            eng.add_request(f"calibration-{i}", head, SamplingParams(
                temperature=1.0, top_p=TOP_P, top_k=0, max_tokens=rest, ignore_eos=True,
                seed=seed * 1_000_003 + i, skip_special_tokens=False))
        rows = list(heads)
        while eng.has_unfinished_requests():
            for out in eng.step():
                new = out.outputs[0].token_ids_delta
                if on_tokens is not None and new:
                    on_tokens(len(new))
                if out.finished:
                    i = int(out.request_id.rsplit("-", 1)[1])
                    rows[i] = heads[i] + list(out.outputs[0].token_ids)
    finally:
        llm.engine.shutdown()
    return torch.tensor(rows, dtype=torch.long)  # (n, length')
