"""What users and operators see: the `--kv-*` flags, per-request `kv_evict`, API usage, counters,
`/get_server_info`, Prometheus metrics, which models eviction serves."""
