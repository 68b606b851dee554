"""Serving front-ends: the engine core loop and its two clients, on a thread (``AsyncEngine``) or
over a process pipe (``ProcessEngine``), with their messages and errors."""
