"""Engine mode (``prefixcache serve``): the Starlette app over an embedded ``EngineAPI``, with
its request gate, admission, generation routes, replies, cache admin routes and dashboard."""
