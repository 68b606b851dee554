"""The blocking Client's event-loop thread never outlives the client: closing it (once or
twice), dropping it unclosed, or leaving it open at interpreter exit all end the thread."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import pytest

from prefixcache.sdk import APIConnectionError, Client

EVENT_LOOPS = pytest.mark.parametrize("event_loop", ["asyncio", "trio"])
CLOSED_PORT_URL = "http://127.0.0.1:9/v1"  # discard: nothing listens, refused at once


def _portal_threads() -> set[threading.Thread]:
    return set(threading.enumerate())  # a new one, after a client starts, is its loop's


def _exits_quickly(code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    return done


@EVENT_LOOPS
def test_an_unclosed_client_does_not_keep_the_interpreter_alive(event_loop: str) -> None:
    done = _exits_quickly(
        f"""
        from prefixcache.sdk import Client
        client = Client({CLOSED_PORT_URL!r}, event_loop={event_loop!r})
        print("end of script")
        """
    )
    assert done.stdout.strip() == "end of script"


def test_an_unclosed_client_after_a_failed_call_does_not_keep_it_alive() -> None:
    done = _exits_quickly(
        f"""
        from prefixcache.sdk import APIConnectionError, Client
        client = Client({CLOSED_PORT_URL!r}, max_retries=0)
        try:
            client.models()
        except APIConnectionError:
            print("refused")
        """
    )
    assert done.stdout.strip() == "refused"


@EVENT_LOOPS
def test_close_ends_the_thread_and_may_be_called_twice(event_loop: str) -> None:
    before = _portal_threads()
    with Client(CLOSED_PORT_URL, event_loop=event_loop, max_retries=0) as client:
        (thread,) = _portal_threads() - before
        with pytest.raises(APIConnectionError):
            client.models()
        assert not client.closed
    assert client.closed and not thread.is_alive()
    client.close()  # a no-op
    assert client.closed


def test_a_dropped_client_ends_its_thread() -> None:
    before = _portal_threads()
    client = Client(CLOSED_PORT_URL)
    (thread,) = _portal_threads() - before
    del client
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
