"""Start-up and memory benchmarks: how long `pdserve up` takes to serve, and what each service
holds in memory across bursts of streams."""
