"""The network: one plain decoder (transformer.py) for every family the engine loads, its attention over
the paged KV cache, RoPE with the scaling types real checkpoints use, and the config reader that turns a
model directory's config.json into a ModelConfig."""
