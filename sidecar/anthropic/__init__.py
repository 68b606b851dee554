"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
engine-mode chat path, with Anthropic's cache breakpoints and usage (docs/sidecar.md)."""
