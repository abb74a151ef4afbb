"""A search candidate as a deployment config (deploy/ schema) that `shardserve serve --config` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.profiles import HardwareProfile


def deployment(cand, model_path: str, profile: HardwareProfile, name: str = "default",
               block_size: int = 16) -> dict[str, Any]:
    """The deploy/ schema dict of one candidate, validated as `shardserve serve` will read it.

    On a CPU profile every shard gets cores // (tp * pp) threads, as the cost model assumes; a
    copy of one shard reserves every core and, where the profile keeps serving_cores for the
    serving side, runs its engine on the rest (worker_threads), else leaves the count to the engine.
    On a device profile (cores 0: a GPU) the engine runs on cuda and every shard reserves one GPU,
    as the layout was priced: the replica itself (num_gpus) when the model is one shard, else each
    shard worker (shard_num_gpus) while the replica, which only drives them, reserves none.
    Left at the engine's cpu default, the GPU-tuned layout would be served on the host's cores."""
    from deploy.schema import validate_config

    dtype = "bfloat16" if cand.weight_dtype == "fp8" else cand.weight_dtype
    shards = cand.tp * cand.pp
    model: dict[str, Any] = {
        "name": name, "path": model_path, "replicas": cand.replicas,
        # 16/32-bit weights are the engine's dtype; FP8 weights (a quantized checkpoint, or quantized
        # at load) are engine.weight_dtype, computing in bf16
        "engine": {"dtype": dtype, "block_size": block_size, "max_num_seqs": cand.max_num_seqs,
                   "max_num_batched_tokens": cand.max_num_batched_tokens,
                   "tensor_parallel_size": cand.tp, "pipeline_parallel_size": cand.pp,
                   **({"weight_dtype": "fp8"} if cand.weight_dtype == "fp8" else {})},
        "max_waiting": 1024,  # the load tester's open loop must queue, not be refused (429)
    }
    if cand.pp > 1:
        model["engine"]["pipeline_microbatches"] = 1
    if profile.cores:
        per_shard = profile.threads(shards)
        model["num_cpus"] = profile.cores if shards == 1 else 1
        if shards == 1 and profile.serving_cores:
            model["engine"]["worker_threads"] = per_shard
        if shards > 1:
            model["shard_num_cpus"] = per_shard
            model["engine"]["worker_threads"] = per_shard
    else:
        model["engine"]["device"] = "cuda"
        if shards == 1:
            model["num_gpus"] = 1
        else:
            model["shard_num_gpus"] = 1
    out = {"models": [model]}
    validate_config(out, "tuned")
    return out


def write_yaml(data: dict[str, Any], path: Path, header: str) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {header}\n" + yaml.safe_dump(data, sort_keys=False))
    return path
