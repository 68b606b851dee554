"""The errors both engine clients raise (``AsyncEngine`` on a thread, ``ProcessEngine`` over a
process): one hierarchy, torch-free. ``ValueError`` stays the answer to refused input."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot serve the call (it is not running)."""


class EngineNotReadyError(EngineError):
    """The engine is still loading, or shutting down."""


class EngineDeadError(EngineError):
    """The engine core failed to start, or stopped (its process exited, its thread died)."""


class EngineStartError(EngineDeadError):
    """The engine could not start, for a reason its message says in full (a model that cannot
    be loaded or fetched, a bad setting, a file it cannot read): said once, with no traceback."""


EngineProcessError = EngineDeadError  # the name ProcessEngine callers know


def start_failure(exc: BaseException) -> EngineStartError | None:
    """``exc``, raised while the engine loaded, as an ``EngineStartError`` when it is one an
    operator fixes from its message alone; None for anything else (a bug: keep its traceback)."""
    from ..model.named_models import ModelFetchError

    if isinstance(exc, EngineStartError):
        return exc
    if isinstance(exc, ValueError | OSError | MemoryError | ModelFetchError):
        return EngineStartError(str(exc) or type(exc).__name__)
    return None
