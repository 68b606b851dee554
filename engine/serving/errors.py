"""The errors both engine clients raise (``AsyncEngine`` on a thread, ``ProcessEngine`` over a
process): one hierarchy, torch-free. ``ValueError`` stays the answer to refused input."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot serve the call (it is not running)."""


class EngineNotReadyError(EngineError):
    """The engine is still loading, or shutting down."""


class EngineDeadError(EngineError):
    """The engine core failed to start, or stopped (its process exited, its thread died)."""


EngineProcessError = EngineDeadError  # the name ProcessEngine callers know
