"""Changes to a loaded model that keep its interface: FP8 weights (format, per-layer choice, the swap) and
p-tuning's virtual tokens injected at the embedding."""
