"""Weights and tokenizers in: safetensors/HF checkpoints, GGUF import (dequantized, q/k rows
un-permuted), the tokenizer built from a GGUF's metadata, and where a model directory comes from."""
