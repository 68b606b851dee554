"""Upstream mode (``prefixcache route``): a cache-aware router in front of OpenAI-compatible
servers: routing policies (rendezvous hashing, precise over KV events, an approximate tree),
the KV event readers and indexes, and the proxy app."""
