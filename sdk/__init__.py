"""prefixcache.sdk: build cache-friendly prompts and send them. Never imports torch."""

from .canonical import canonical_json
from .client import AsyncClient
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
    UnsupportedError,
)
from .fingerprint import Divergence, Fingerprint, SegmentDigest, diff
from .lint import RULES, Finding, lint
from .prompt import Prompt, PromptBuilder, Segment, Tool
from .session_report import FamilyReport, Miss, Price, SessionReport
from .stream import CompletionStream
from .sync_client import Client
from .timeouts import Timeouts
from .types import (
    CacheReport,
    CacheStats,
    Completion,
    Delta,
    LoadResult,
    ResetPrefixCacheResult,
    SaveResult,
    SegmentReport,
    UpstreamReset,
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
    "FamilyReport",
    "Finding",
    "Fingerprint",
    "InternalServerError",
    "LoadResult",
    "Miss",
    "NotFoundError",
    "PermissionDeniedError",
    "PrefixCacheError",
    "Price",
    "Prompt",
    "PromptBuilder",
    "RateLimitError",
    "ResetPrefixCacheResult",
    "ResponseFormatError",
    "SaveResult",
    "Segment",
    "SegmentDigest",
    "SegmentReport",
    "ServiceUnavailableError",
    "SessionReport",
    "StreamError",
    "Timeouts",
    "Tool",
    "UnprocessableEntityError",
    "UnsupportedError",
    "UpstreamReset",
    "Usage",
    "WarmResult",
    "canonical_json",
    "diff",
    "lint",
]
