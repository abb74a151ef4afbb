"""One step on one device or one shard: the model runner (a stage: a range of layers, first/last, and its
communicator), its decode paths (fused C++ step, compiled step, CUDA graphs), the sampler and the
grammar masks it applies."""
