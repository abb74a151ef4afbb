"""Serving: the gateway app (OpenAI /v1, KServe v2 /v2, /metrics), the ModelServer that owns an
engine, and their Ray Serve deployments. See docs/serving.md.

The gateway side (app, gateway, openai_api, kserve_api, protocol, chat, backends, metrics) imports
no torch; torch loads only in ModelServer replicas (model_core) and shard workers (ray_executor).
"""
