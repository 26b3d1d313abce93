"""Step benchmarks: one engine step against its hardware floor, the host's share of a step, and
the attention kernels (Triton on a GPU, C on the CPU) that a step runs."""
