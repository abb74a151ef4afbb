"""The deployment-config schema (one source of truth) and ready deployment files.

Imports pydantic and yaml only: the tuner emits these configs without a server or a GPU.
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
