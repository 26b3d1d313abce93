"""Serving benchmarks: a cluster (or any OpenAI-compatible server) under load, pdserve beside
vLLM, and the parts a request passes through (the router, the KV handoff and its transfer)."""
