"""The HTTP edge both apps share (engine mode, server/; upstream mode, router/): OpenAI-shaped
errors, body reading and decoding, the Starlette app frame with /health and /metrics, HTTP
metrics, SSE streaming with disconnect detection, API keys and tenants, and the uvicorn
protocol both are served with."""
