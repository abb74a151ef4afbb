"""Our engine alone on the peer benchmark's workloads, one engine setting per process, for A/B runs
of one engine option (vLLM is not run: use bench_peer_vllm.py for ratios against it).

    python benchmarks/bench_engine_ab.py --task mix --dtype float32 --decode-attention kernel
    python benchmarks/bench_engine_ab.py --task b1 --dtype bfloat16 --worker-threads 2 --repeats 3

`mix`: bench_peer_vllm's 16-request offline mix (same lengths and seeds); `b1`: batch-1 greedy decode,
8 prompt + 96 new tokens. The model is the peer benchmark's GPT-2-124M-shaped directory (run
bench_peer_vllm.py once to build it). Prints the CPU model and output tok/s per repeat."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peer_vllm import mix_requests

from engines import LLM, SamplingParams
from engines.hardware import cpu_name

MODEL = os.path.expanduser("~/.cache/shardserve/bench/peer-gpt2-124m-hf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["mix", "b1"], required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--decode-attention", choices=["auto", "kernel", "loop"], default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--worker-threads", type=int, default=0, help="0: the engine's adaptive choice")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default=MODEL)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}; load {os.getloadavg()[0]:.2f}; {vars(a)}", flush=True)
    reqs = [([(7 * i + 3) % 50000 + 1 for i in range(8)], 96)] if a.task == "b1" else mix_requests(16)
    llm = LLM(a.model, dtype=a.dtype, kv_cache_bytes=a.kv_gib << 30, decode_attention=a.decode_attention,
              max_num_batched_tokens=a.max_num_batched_tokens, worker_threads=a.worker_threads)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate([reqs[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    for r in range(a.repeats):
        t = time.perf_counter()
        outs = llm.generate([ids for ids, _ in reqs], params)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{a.task} {a.dtype} repeat {r}: {n / dt:.1f} output tok/s ({n} tokens in {dt:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
