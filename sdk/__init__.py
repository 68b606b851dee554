"""prefixcache.sdk: build cache-friendly prompts and send them. Never imports torch."""

from .canonical import canonical_json
from .client import AsyncClient, CompletionStream, Timeouts
from .errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    PrefixCacheError,
    RateLimitError,
    ResponseFormatError,
    ServiceUnavailableError,
    StreamError,
    UnprocessableEntityError,
)
from .fingerprint import Divergence, Fingerprint, diff
from .lint import RULES, Finding, lint
from .prompt import Prompt, PromptBuilder, Segment, Tool
from .sync_client import Client
from .types import (
    CacheReport,
    CacheStats,
    Completion,
    Delta,
    LoadResult,
    SaveResult,
    SegmentReport,
    Usage,
    WarmResult,
)

__all__ = [
    "RULES",
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "CacheReport",
    "CacheStats",
    "Client",
    "Completion",
    "CompletionStream",
    "Delta",
    "Divergence",
    "Finding",
    "Fingerprint",
    "InternalServerError",
    "LoadResult",
    "NotFoundError",
    "PermissionDeniedError",
    "PrefixCacheError",
    "Prompt",
    "PromptBuilder",
    "RateLimitError",
    "ResponseFormatError",
    "SaveResult",
    "Segment",
    "SegmentReport",
    "ServiceUnavailableError",
    "StreamError",
    "Timeouts",
    "Tool",
    "UnprocessableEntityError",
    "Usage",
    "WarmResult",
    "canonical_json",
    "diff",
    "lint",
]
