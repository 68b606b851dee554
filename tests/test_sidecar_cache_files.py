"""/v1/cache/save and /v1/cache/load: pinned prefixes survive a restart without their prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server, ServerLoop, demo_engine, serve

from prefixcache.sidecar.server.app import SidecarSettings, create_app

SYSTEM = "You are the timetable assistant of a small railway. Answer in one sentence. " * 6
SECRET = b"a fixed secret for both servers"


def chat(url: str, question: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def start(loop: ServerLoop, loaded: Any, cache_dir: Path, load: tuple[str, ...] = ()) -> Server:
    settings = SidecarSettings(secret=SECRET, cache_dir=cache_dir, load_on_start=load)
    return serve(loop, create_app(demo_engine(loaded), settings))


def test_saved_prefixes_are_cached_after_a_restart(
    server_loop: ServerLoop, demo_loaded: Any, tmp_path: Path
) -> None:
    first = start(server_loop, demo_loaded, tmp_path)
    try:
        warm = {"messages": [{"role": "system", "content": SYSTEM}], "pin": True}
        pinned = httpx.post(f"{first.url}/cache/warm", json=warm, timeout=60).json()
        assert pinned["pinned_blocks"] > 0
        saved = httpx.post(f"{first.url}/cache/save", json={"name": "railway"}).json()
        assert saved["name"] == "railway" and saved["prefixes"] == 1
        assert saved["blocks"] == pinned["pinned_blocks"]
        expected = chat(first.url, "When is the last train?")
    finally:
        first.stop()
    assert (tmp_path / "railway.safetensors").is_file()

    second = start(server_loop, demo_loaded, tmp_path, load=("railway",))
    try:
        stats = httpx.get(f"{second.url}/cache/stats").json()
        assert stats["blocks"]["pinned"] == saved["blocks"]  # loaded before /health said ok
        got = chat(second.url, "When is the last train?")  # this server's first request
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= saved["blocks"] * 16
        assert (
            got["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        )
        again = httpx.post(f"{second.url}/cache/load", json={"name": "railway"}).json()
        assert again["restored_blocks"] == 0 and again["reused_blocks"] == saved["blocks"]
    finally:
        second.stop()


def test_bad_cache_files_are_refused_and_the_server_stays_healthy(
    server_loop: ServerLoop, demo_loaded: Any, tmp_path: Path
) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    server = start(server_loop, demo_loaded, tmp_path, load=("missing",))  # logged, not fatal
    try:
        for name, code in (("junk", "cache_file_refused"), ("missing", "cache_file_refused")):
            response = httpx.post(f"{server.url}/cache/load", json={"name": name})
            assert response.status_code == 400
            assert response.json()["error"]["code"] == code
        for name in ("../etc/passwd", ".hidden", "a/b", "", "pinned\n"):
            response = httpx.post(f"{server.url}/cache/save", json={"name": name})
            assert response.status_code == 400, name
        assert not list(tmp_path.parent.glob("*.safetensors"))
        assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
        default = httpx.post(f"{server.url}/cache/save").json()  # no body: "pinned"
        assert default["name"] == "pinned" and default["blocks"] == 0
        # Now the file exists and nothing is pinned: a save would wipe it (a scheduled save
        # after a restart whose load failed), so it is refused unless asked for.
        kept = httpx.post(f"{server.url}/cache/save", json={"name": "pinned"})
        assert kept.status_code == 409 and kept.json()["error"]["code"] == "nothing_pinned"
        forced = httpx.post(f"{server.url}/cache/save", json={"allow_empty": True})
        assert forced.status_code == 200 and forced.json()["blocks"] == 0
        typo = httpx.post(f"{server.url}/cache/save", json={"nmae": "pinned"})
        assert typo.status_code == 400  # unknown fields are refused on the cache routes
    finally:
        server.stop()


@pytest.mark.parametrize("route", ["save", "load"])
def test_without_a_cache_dir_the_routes_say_how_to_enable_them(
    sidecar_server: Server, route: str
) -> None:
    response = httpx.post(f"{sidecar_server.url}/cache/{route}", json={"name": "x"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "cache_dir_not_configured" and "--cache-dir" in error["message"]


def test_the_sdk_saves_and_loads(server_loop: ServerLoop, demo_loaded: Any, tmp_path: Path) -> None:
    from prefixcache.sdk import APIStatusError, Client, Prompt

    prompt = Prompt.builder().static(SYSTEM, tag="rules").dynamic("Any delays?", tag="q").build()
    server = start(server_loop, demo_loaded, tmp_path)
    try:
        with Client(server.url) as client:
            warmed = client.warm(prompt, pin=True)
            saved = client.cache_save("sdk")
            assert saved.blocks == warmed.pinned_blocks and saved.bytes > 0
            loaded = client.cache_load("sdk")
            assert (loaded.reused_blocks, loaded.restored_blocks) == (saved.blocks, 0)
            client.unpin(prompt)
            with pytest.raises(APIStatusError) as kept:  # nothing pinned: the file stays
                client.cache_save("sdk")
            assert kept.value.status_code == 409
            assert client.cache_save("sdk", allow_empty=True).blocks == 0
    finally:
        server.stop()


def test_evict_including_pinned_frees_prefixes_nobody_can_unpin(
    server_loop: ServerLoop, demo_loaded: Any, tmp_path: Path
) -> None:
    """Prefixes pinned under a namespace nobody uses any more (here a salt) never match, so
    nobody unpins them. (A file saved under another server secret is refused outright: files
    are signed with a key derived from the secret.)"""
    first = start(server_loop, demo_loaded, tmp_path)
    try:
        warm = {"messages": [{"role": "system", "content": SYSTEM}], "pin": True}
        httpx.post(f"{first.url}/cache/warm", json={**warm, "cache_salt": "v1"}, timeout=60)
        httpx.post(f"{first.url}/cache/save", json={"name": "old"})
    finally:
        first.stop()
    other = SidecarSettings(secret=b"another secret!!", cache_dir=tmp_path)
    third = serve(server_loop, create_app(demo_engine(demo_loaded), other))
    try:
        refused = httpx.post(f"{third.url}/cache/load", json={"name": "old"})
        assert refused.status_code == 400, refused.text
    finally:
        third.stop()
    settings = SidecarSettings(secret=SECRET, cache_dir=tmp_path, load_on_start=("old",))
    second = serve(server_loop, create_app(demo_engine(demo_loaded), settings))
    try:
        pinned = httpx.get(f"{second.url}/cache/stats").json()["blocks"]["pinned"]
        assert pinned > 0
        usage = chat(second.url, "Any delays?")["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # another namespace now
        httpx.post(f"{second.url}/cache/evict", json={})
        assert httpx.get(f"{second.url}/cache/stats").json()["blocks"]["pinned"] == pinned
        evicted = httpx.post(f"{second.url}/cache/evict", json={"include_pinned": True}).json()
        assert evicted["evicted_blocks"] == pinned
        assert httpx.get(f"{second.url}/cache/stats").json()["blocks"]["pinned"] == 0
    finally:
        second.stop()


@pytest.mark.parametrize(("errno_", "status"), [(28, 507), (30, 500)])  # ENOSPC, EROFS
def test_a_save_that_cannot_write_names_the_cause(
    server_loop: ServerLoop,
    demo_loaded: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    errno_: int,
    status: int,
) -> None:
    """A read-only or full --cache-dir was a bare 500 internal_error with two tracebacks."""
    import os

    server = start(server_loop, demo_loaded, tmp_path)
    try:
        engine = server.app.state.sidecar.engine

        async def cannot_write(path: Path, key: bytes) -> Any:
            raise OSError(errno_, os.strerror(errno_), str(path))

        monkeypatch.setattr(engine, "save_pinned", cannot_write)
        warm = {"messages": [{"role": "system", "content": SYSTEM}], "pin": True}
        assert httpx.post(f"{server.url}/cache/warm", json=warm, timeout=60).status_code == 200
        saved = httpx.post(f"{server.url}/cache/save", json={"name": "railway"}, timeout=60)
        assert saved.status_code == status, saved.text
        error = saved.json()["error"]
        assert error["code"] == "cache_file_unwritable" and os.strerror(errno_) in error["message"]
        assert httpx.get(f"{server.root}/health").status_code == 200
    finally:
        server.stop()


def test_a_failed_start_up_load_is_counted_on_metrics(
    server_loop: ServerLoop, demo_loaded: Any, tmp_path: Path
) -> None:
    """A --load-cache that fails leaves the server serving (/health ok): only the log said so;
    prefixcache:cache_file_loads_total{result} is what an operator alerts on."""
    server = start(server_loop, demo_loaded, tmp_path, load=("missing",))
    try:
        assert httpx.get(f"{server.root}/health").status_code == 200
        text = httpx.get(f"{server.root}/metrics").text
        assert 'prefixcache:cache_file_loads_total{result="refused"} 1.0' in text
        assert 'prefixcache:cache_file_loads_total{result="loaded"} 0.0' in text
        refused = httpx.post(f"{server.url}/cache/load", json={"name": "missing"})
        assert refused.status_code == 400
        text = httpx.get(f"{server.root}/metrics").text
        assert 'prefixcache:cache_file_loads_total{result="refused"} 2.0' in text
    finally:
        server.stop()
