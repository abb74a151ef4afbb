"""Where a model's replicas run: their Ray Serve placement options and the engine's executor factory.

Apart from serving/deployments.py so that `shardserve serve` checks a config (serving/launcher.py
check_config) without importing Ray Serve, whose Python side then loads while Ray's processes start.
"""

from __future__ import annotations

from typing import Any

from deploy.schema import ModelSpec


class UnsupportedConfig(ValueError):
    """The config asks for something a later issue brings; the message names the field."""


def placement(spec: ModelSpec) -> dict[str, Any]:
    """Ray Serve deployment options that place one replica of `spec`: one actor, or, for a split
    model (tensor x pipeline parallel), a placement group with the replica in bundle 0 and one
    bundle per shard worker, so Ray reserves and co-schedules the whole model copy."""
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}}
    if spec.world_size > 1:
        from serving.ray_executor import placement_bundles

        options["placement_group_bundles"] = placement_bundles(
            spec.engine.tensor_parallel_size or 1, spec.engine.pipeline_parallel_size or 1,
            replica_cpus=spec.num_cpus, replica_gpus=spec.num_gpus, cpus_per_worker=spec.shard_num_cpus,
            gpus_per_worker=spec.shard_num_gpus)
        options["placement_group_strategy"] = "PACK"
    return options


def executor_factory(spec: ModelSpec):
    """The engine's executor factory for `spec` (None: the in-process executor)."""
    if spec.world_size > 1:  # TP x PP shard-worker actors in the replica's placement group
        from serving.ray_executor import ray_executor_factory

        return ray_executor_factory(spec.shard_num_cpus, spec.shard_num_gpus)
    return None
