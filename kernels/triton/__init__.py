"""The Triton backend: attention over the paged pool, the KV store, and the elementwise and
batch-invariant kernels of a model on CUDA."""
