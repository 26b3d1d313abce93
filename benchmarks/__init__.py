"""pdserve's benchmarks, grouped by what they measure: ``serving/`` (a cluster under load, and
beside vLLM), ``step/`` (an engine step and its kernels), ``quality/`` (what 8-bit KV and
deterministic inference change in the answers), ``startup/`` (start-up time and memory). Each
script runs as ``python -m benchmarks.GROUP.NAME``; ``harness.py`` holds what they share."""
