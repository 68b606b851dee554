"""``EngineHooks``: what a caller attaches to an ``LLMEngine`` when it builds one (tests,
benchmarks, tools), instead of patching its parts afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..attention import AttentionMetadata
    from ..text.tokenizer import TokenizerListener
    from .sampler import RowProcessor
    from .scheduler import SchedulerOutput


@dataclass(slots=True, frozen=True)
class EngineHooks:
    # every step's attention plan, as the model runner built it (cascade groups, prefills)
    on_plan: Callable[[AttentionMetadata], None] | None = None
    # every schedule, before the model step, with the blocks requests hold then (their peak
    # within the step)
    on_schedule: Callable[[SchedulerOutput, int], None] | None = None
    # extra logits processors, after the penalties, one row at a time
    logits_processors: tuple[RowProcessor, ...] = ()
    # the clock TTL pins run on (monotonic seconds; tests inject one they can move)
    clock: Callable[[], float] = time.monotonic
    # the tokenizer's spec as soon as loading knows it, before the weights (ProcessEngine's
    # core sends it ahead of Ready)
    on_tokenizer: TokenizerListener | None = None
