"""Training: corpus and tokenizer preparation, GPT pretraining (data parallel), export.

The model trained here is `engines.model.transformer.GPT` itself; a finished run is exported with
`engines.loading.checkpoint.save_checkpoint`, so what training writes the engine serves unchanged.

    corpus.py       text inputs (.txt / .jsonl), Gutenberg stripping, the default Shakespeare corpus
    tokenizer.py    byte-level BPE training with `tokenizers`
    data.py         `prepare_data` (text -> memory-mapped token files) and `TokenData` (batches)
    recipe.py       the YAML recipe as frozen dataclasses
    optim.py        AdamW parameter groups and the warmup + cosine schedule
    state.py        full training state (model, optimizer, RNG, data position) on disk
    distributed.py  process groups and launchers (torch.multiprocessing, Ray Train)
    trainer.py      the training loop
    metrics.py      metrics JSONL, loss-curve PNG, progress bar
    export.py       training checkpoint -> HF-compatible model directory
    cli.py          `shardserve data | train | export`
"""
