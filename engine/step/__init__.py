"""The parts of one engine step: schedule, execute, sample, update (``LLMEngine.step`` in
engine.py puts them together)."""
