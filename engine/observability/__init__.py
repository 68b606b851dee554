"""What the engine reports: Prometheus metrics, step stats, KV events, the cache's activity and
its stats."""
