"""Per-request sampling: stops, lengths, n, penalties, logprobs, seeds, min_tokens, detokenization."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines import LLM, SamplingParams
from engines.loading.tokenizer import Tokenizer

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def llm(gpt2_dir):
    return LLM(gpt2_dir)


def greedy(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True, **kw))[0].outputs[0]


def test_max_tokens_and_finish_reason(llm):
    out = greedy(llm, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_truncates_text(llm):
    full = greedy(llm, max_tokens=30)
    text = full.text
    stop = text[10:12]
    expect = text[:text.find(stop)]
    out = greedy(llm, max_tokens=30, stop=[stop, "\x01never"])
    assert out.text == expect
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = greedy(llm, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == expect + stop


def test_streamed_deltas_hold_back_partial_stop_strings(gpt2_dir):
    from engines import EngineConfig
    from engines.core.llm_engine import LLMEngine

    llm_text = LLM(gpt2_dir).generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = llm_text[0].outputs[0].text
    stop = text[14:18]
    engine = LLMEngine(gpt2_dir, EngineConfig())
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text_delta
            assert stop not in streamed
    assert streamed == text[:text.find(stop)]


def test_final_only_steps_report_whole_requests_as_streaming_ends_them(gpt2_dir):
    """LLMEngine.step(final_only=True) (LLM.generate's): an output only for a request the step finished, holding
    everything the streamed deltas add up to (text with a stop string cut, tokens, finish reason)."""
    from engines import EngineConfig
    from engines.core.llm_engine import LLMEngine

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 12, 9)]
    text = LLM(gpt2_dir).generate([PROMPT], params[1])[0].outputs[0].text
    params[2] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text[10:13]])
    got: dict[str, list] = {}
    for final_only in (False, True):
        engine = LLMEngine(gpt2_dir, EngineConfig())
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", PROMPT, p)
        streamed: dict[str, tuple[str, list[int]]] = {}
        ends = []
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=final_only):
                c = out.outputs[0]
                t, ids = streamed.get(out.request_id, ("", []))
                streamed[out.request_id] = (t + c.text_delta, ids + c.token_ids_delta)
                assert out.finished or not final_only
                if out.finished:
                    ends.append((out.request_id, c.text, c.token_ids, c.finish_reason))
                    assert (c.text, c.token_ids) == streamed[out.request_id]
        got[final_only] = sorted(ends)
    assert got[True] == got[False] and len(got[True]) == 3
    assert [e[3] for e in got[True]] == ["length", "length", "stop"]


def test_stop_token_ids(llm):
    full = greedy(llm, max_tokens=20)
    tok = full.token_ids[4]
    first = full.token_ids.index(tok)
    out = greedy(llm, max_tokens=20, stop_token_ids=[tok])
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)


def test_stop_token_text_is_left_out_unless_asked_for(llm):
    full = greedy(llm, max_tokens=20)
    tok = full.token_ids[4]
    first = full.token_ids.index(tok)
    tk = llm.engine.tokenizer
    out = greedy(llm, max_tokens=20, stop_token_ids=[tok])
    assert out.text == tk.decode(full.token_ids[:first])  # as vLLM: the stop token's text is not output
    kept = greedy(llm, max_tokens=20, stop_token_ids=[tok], include_stop_str_in_output=True)
    assert kept.text == tk.decode(full.token_ids[:first + 1])


def test_stop_string_written_before_min_tokens_does_not_count(gpt2_dir):
    from engines import EngineConfig
    from engines.core.llm_engine import LLMEngine

    full = LLM(gpt2_dir).generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    tk = Tokenizer.from_dir(gpt2_dir)
    early = tk.decode(full.token_ids[:5])
    stop = early[-3:]  # ends in the 5th token's text, the last before stop strings may end the output
    assert len(stop) == 3
    engine = LLMEngine(gpt2_dir, EngineConfig())
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                   min_tokens=6))
    streamed, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text_delta
            last = out.outputs[0]
    assert streamed == last.text  # what was streamed is the final text: never cut behind it
    checked_from = len(tk.decode(full.token_ids[:5]))  # the 6th token's text on may end a stop string
    i = full.text.find(stop, checked_from - len(stop) + 1)
    if i >= 0:  # a later occurrence ends the output there
        assert (last.finish_reason, last.text) == ("stop", full.text[:i])
    else:
        assert last.finish_reason == "length" and last.text == full.text


def test_min_tokens_suppresses_stop_tokens(llm):
    first = greedy(llm, max_tokens=1).token_ids[0]
    out = greedy(llm, max_tokens=8, stop_token_ids=[first], min_tokens=4)
    assert first not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_eos_ends_unless_ignored(gpt2_dir):
    llm = LLM(gpt2_dir)
    first = greedy(llm, max_tokens=1).token_ids[0]
    engine = llm.engine
    engine.eos_token_ids = engine.scheduler.cfg.eos_token_ids  # keep the configured eos
    # make the first greedy token an end-of-sequence token for this test's scheduler
    import dataclasses

    engine.scheduler.cfg = dataclasses.replace(engine.scheduler.cfg, eos_token_ids=(first,))
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 5


def test_n_completions_seeded_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0]
    b = llm.generate([PROMPT], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    # nearby seeds share no completion (with seed + index, 7's second was 8's first)
    c = llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))[0]
    assert not {tuple(o.token_ids) for o in a.outputs} & {tuple(o.token_ids) for o in c.outputs}
    one = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert one.outputs[0].token_ids == a.outputs[0].token_ids  # completion 0 draws with the seed itself


def test_seeds_that_agree_in_their_low_32_bits_draw_apart(llm):
    """The CPU generator keeps a seed's low 32 bits: 2**32 + 5 drew what 5 drew, and -1 what 2**32 - 1 drew, until
    seeds outside [0, 2**32) were mixed into 32 bits; each of those still repeats itself."""

    def draw(seed):
        p = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return llm.generate([PROMPT], p)[0].outputs[0].token_ids

    for low, high in ((5, 2**32 + 5), (2**32 - 1, -1), (7, 2**63 - 2**32 + 7)):
        assert draw(low) != draw(high), (low, high)
        assert draw(high) == draw(high)


def _reference_penalised_greedy(hf, prompt_ids, steps, frequency=0.0, presence=0.0):
    ids = list(prompt_ids)
    counts = torch.zeros(hf.config.vocab_size)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        logits = logits - frequency * counts - presence * (counts > 0).float()
        tok = int(logits.argmax())
        counts[tok] += 1
        ids.append(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("kind", ["frequency", "presence", "repetition"])
def test_penalties_match_reference(llm, gpt2_dir, kind):
    hf = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).eval()
    prompt_ids = llm.tokenizer.encode(PROMPT)
    if kind == "repetition":
        expect = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
        out = greedy(llm, max_tokens=16, repetition_penalty=1.5)
    else:
        expect = _reference_penalised_greedy(hf, prompt_ids, 16, **{kind: 1.5})
        out = greedy(llm, max_tokens=16, **{f"{kind}_penalty": 1.5})
    assert out.token_ids == expect
    assert out.token_ids != greedy(llm, max_tokens=16).token_ids  # the penalty did something


def test_top_k_one_is_greedy(llm):
    g = greedy(llm, max_tokens=10).token_ids
    k1 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True,
                                                seed=3))[0].outputs[0].token_ids
    assert k1 == g


def test_tiny_top_p_is_greedy(llm):
    g = greedy(llm, max_tokens=10).token_ids
    p = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True))
    assert p[0].outputs[0].token_ids == g


def test_sampling_follows_the_distribution(gpt2_dir):
    """First-token frequencies over many seeds match softmax(logits / T) (loose chi-square-like bound)."""
    llm = LLM(gpt2_dir, max_num_seqs=128)
    ids = llm.tokenizer.encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([ids])).logits[0, -1] / 0.5, -1)
    n = 600
    outs = llm.generate([ids] * n, SamplingParams(temperature=0.5, max_tokens=1, ignore_eos=True))
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=len(probs))
    top = probs.topk(3).indices
    for t in top.tolist():
        expected = probs[t].item() * n
        assert abs(counts[t].item() - expected) <= 4 * (expected ** 0.5) + 3


def test_inverse_transform_draws_match_probabilities_and_skip_cut_tokens():
    """The sampler's draw, straight on crafted logits: 4,000 rows, top_k=3 of 6 tokens. Cut tokens
    (probability 0, including the last vocabulary entry) are never drawn; the others come at
    their renormalised probabilities, and a seeded row repeats whatever else is in the batch."""
    from engines.core.plan import SeqInit
    from engines.runner.sampler import Sampler

    logits = torch.tensor([0.0, 1.0, -30.0, 2.0, 0.5, -1.0])
    n = 4000
    sampler = Sampler(len(logits), seed=0, device=torch.device("cpu"))
    params = SamplingParams(temperature=1.0, top_k=3)
    for i in range(n):
        sampler.add(SeqInit(i, 0, params, [0], ()))
    tokens = [t for t, _ in sampler.sample(list(range(n)), logits.expand(n, -1).clone())]
    counts = torch.bincount(torch.tensor(tokens), minlength=len(logits))
    probs = torch.zeros(len(logits))
    keep = logits.topk(3).indices
    probs[keep] = torch.softmax(logits[keep], -1)
    assert counts[probs == 0].sum().item() == 0
    for t in keep.tolist():
        expected = probs[t].item() * n
        assert abs(counts[t].item() - expected) <= 4 * expected ** 0.5
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone, crowd = Sampler(6, seed=1, device=torch.device("cpu")), Sampler(6, seed=2, device=torch.device("cpu"))
    alone.add(SeqInit(0, 0, seeded, [0], ()))
    for i in range(5):
        crowd.add(SeqInit(i, 0, seeded if i == 3 else params, [0], ()))
    a = [alone.sample([0], logits[None].clone())[0][0] for _ in range(20)]
    c = [crowd.sample(list(range(5)), logits.expand(5, -1).clone())[3][0] for _ in range(20)]
    assert a == c


def test_min_tokens_suppression_after_the_argmax_equals_masking_first():
    """A greedy row with min_tokens (no penalties, no grammar) takes its argmax first and masks only its own row when
    that argmax is a suppressed id: the same tokens as masking every row first (the reference), beside penalised,
    sampled and finished-suppression rows, and the caller's logits left as the model gave them."""
    from engines.core.plan import SeqInit
    from engines.runner.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    V = 50
    logits = torch.randn(6, V, generator=g)
    logits[0, 7] = logits[1, 7] = logits[3, 7] = 9.0  # an EOS id on top
    logits[2, 11] = 9.0  # a stop token id on top
    logits[0, 4] = logits[0, 5] = 8.0  # the best allowed: a tie, the lower id
    rows = [SamplingParams(temperature=0, max_tokens=8, min_tokens=3),  # EOS on top, suppressed
            SamplingParams(temperature=0, max_tokens=8, min_tokens=1),  # its min_tokens reached: EOS stays
            SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[11]),
            SamplingParams(temperature=0, max_tokens=8, min_tokens=3, repetition_penalty=1.3),  # masked first
            SamplingParams(temperature=0, max_tokens=8, min_tokens=3),  # its argmax allowed: untouched
            SamplingParams(temperature=0.8, seed=5, max_tokens=8, min_tokens=3)]

    def run(after_pick: bool) -> list[int]:
        sampler = Sampler(V, seed=0, device=torch.device("cpu"))
        if not after_pick:
            sampler._suppress_after_pick = lambda st: False  # the reference: every row masked first
        for i, p in enumerate(rows):
            sampler.add(SeqInit(i, 0, p, [1, 2], (7,)))
        sampler.states[1].num_output = 1
        given = logits.clone()
        tokens = [t for t, _ in sampler.sample(list(range(len(rows))), given)]
        assert torch.equal(given, logits)
        return tokens

    got, want = run(True), run(False)
    assert got == want
    assert got[0] == 4 and got[1] == 7 and got[2] != 11 and got[4] == int(logits[4].argmax())


def test_degenerate_temperature_and_top_p_sample_the_argmax():
    """logits / 1e-300 overflows to inf and the softmax to NaN: the row takes the T -> 0 limit
    (the argmax); top_p=1e-300 is 0.0 in float32 and keeps just the top token. An ordinary row
    in the same batch still samples."""
    from engines.core.plan import SeqInit
    from engines.runner.sampler import Sampler

    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    sampler = Sampler(4, seed=0, device=torch.device("cpu"))
    sampler.add(SeqInit(0, 0, SamplingParams(temperature=1e-300), [0], ()))
    sampler.add(SeqInit(1, 0, SamplingParams(temperature=1.0, top_k=2), [0], ()))
    sampler.add(SeqInit(2, 0, SamplingParams(temperature=1.0, top_p=1e-300), [0], ()))  # 0.0 in float32
    for _ in range(20):
        (t0, _), (t1, _), (t2, _) = sampler.sample([0, 1, 2], logits.expand(3, -1).clone())
        assert t0 == 1 and t1 in (1, 3) and t2 == 1


def test_detokenizer_streams_whole_characters(gpt2_dir):
    tok = Tokenizer.from_dir(gpt2_dir)
    text = " naïve café 東京 🙂 Héllo wörld ß 中文 😀"  # the last three are not merges: split bytes
    ids = tok.encode(text)
    detok = tok.detokenizer([], skip_special_tokens=True)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens were partial characters and were held back


def test_detokenizer_flushes_a_partial_character_when_the_sequence_ends(gpt2_dir):
    tok = Tokenizer.from_dir(gpt2_dir)
    ids = tok.encode(" 😀")  # not a merge: split into byte tokens
    assert len(ids) > 2
    detok = tok.detokenizer(tok.encode("Hi"), skip_special_tokens=True)
    assert [detok.step(i) for i in ids[:-1]] == [""] * (len(ids) - 1)  # an incomplete character is held
    tail = detok.flush()
    assert tail == tok.decode(ids[:-1]) and "\ufffd" in tail
    assert detok.flush() == ""  # flushed once
    assert detok.step(tok.encode(" a")[0]) == " a"  # and the stream goes on from there


def test_output_text_is_the_decoded_tokens_even_when_they_end_mid_character(llm):
    # Random prompts make this tiny random model emit runs of stray byte tokens (e.g. one
    # continuation byte over and over) that never complete a UTF-8 character: the text must still
    # arrive when the sequence ends, not vanish with the held-back bytes.
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.tokenizer.vocab_size
    prompts = torch.randint(1, vocab, (48, 12), generator=g).tolist()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tok = llm.engine.tokenizer
    assert all(o.outputs[0].text == tok.decode(o.outputs[0].token_ids) for o in outs)
    assert any("\ufffd" in o.outputs[0].text for o in outs)  # the case above did occur


def test_stop_string_completed_by_the_last_allowed_token_still_stops(llm):
    full = greedy(llm, max_tokens=40).text
    for k in range(4, 40):  # a run whose stop string first appears only with its last token
        text = greedy(llm, max_tokens=k).text
        stop = text[-2:]
        if len(stop) == 2 and text.find(stop) == len(text) - 2 and full.startswith(text):
            break
    else:
        pytest.skip("no suitable stop string in this model's greedy text")
    out = greedy(llm, max_tokens=k, stop=[stop])
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:-2], "stop", stop)


def test_token_bytes_rebuild_the_text_even_for_parts_of_characters(gpt2_dir):
    tok = Tokenizer.from_dir(gpt2_dir)
    text = " naïve 東京 🙂 中文 😀"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_byte_fallback_pieces():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "\u2581a": 257}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(hf)
    emoji = "😀".encode()
    assert [tok.token_bytes(b + 1) for b in emoji] == [bytes([b]) for b in emoji]
    assert tok.token_bytes(257) == b" a"
