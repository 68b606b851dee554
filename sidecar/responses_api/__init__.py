"""OpenAI's Responses API (``POST /v1/responses``) over the engine-mode chat path (docs/sidecar.md)."""
