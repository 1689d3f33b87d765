"""The sampler graph: filters without a sort, penalties, FlashInfer's kernels, and the sampled outputs the executor holds."""
