"""Megatron-style model parallelism for training, as transformations of the built GPT.

    groups.py       the process groups of a TP x DP x PP layout (passed in, never global)
    collectives.py  autograd functions for the collectives: f / g (TP) and g / g-bar (SP)
    rng.py          the dropout RNG tracker: per-TP-rank streams where tensors are split
    recompute.py    activation recomputation that restores every RNG stream
    layers.py       column / row / vocabulary-parallel layers and the vocabulary-parallel loss
    model.py        ParallelStage: a GPT -> this rank's pipeline stage, TP-sharded, SP and recompute applied
    setup.py        layout checks (clear errors naming the recipe key) and building a rank's stage
    schedule.py     pipeline schedules (1F1B, GPipe) over micro-batches
    grads.py        gradient reductions (SP norms, DP, tied embeddings) and the global norm
    state.py        gathering the full model from shards (export, tests) and per-rank checkpoints
    memory.py       measured saved-activation bytes per layer beside Korthikanti et al.'s Table 2
    loop.py         the training loop on a layout: schedule, gradient sync, clipping, shard checkpoints, export
"""
