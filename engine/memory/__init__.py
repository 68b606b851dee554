"""KV memory: the page pool, the prefix tree, block tables, pins, the KV tier below the pool and
pinned prefixes on disk."""
