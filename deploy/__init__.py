"""The deployment-config schema (one source of truth) and ready deployment files.

Imports pydantic, yaml and engines.core.config (standard library only, the source of the engine options):
the tuner emits these configs without torch, a server or a GPU.
"""

from deploy.schema import (
    AutoscalingSpec,
    ConfigFileError,
    DeploymentConfig,
    EngineOptions,
    ModelSpec,
    RaySpec,
    ServerSpec,
    load_config,
    read_api_keys,
    validate_config,
)

__all__ = [
    "AutoscalingSpec", "ConfigFileError", "DeploymentConfig", "EngineOptions", "ModelSpec", "RaySpec",
    "ServerSpec", "load_config", "read_api_keys", "validate_config",
]
