"""Wire types: the request bodies both apps decode (OpenAI-compatible plus the segment
extension and the cache admin bodies) and the reply bodies the engine-mode app sends."""
