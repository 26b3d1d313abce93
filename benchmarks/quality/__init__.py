"""Quality benchmarks: how far 8-bit KV pages move the answers from bf16 pages, and whether a
greedy answer depends on the prefix cache or the load around it."""
