"""The cache page in a real browser: headless Chromium against a live sidecar (demo model).

Chromium comes from Debian's ``chromium`` package, installed by ``make test`` where it can
be; without it this test skips and says why. Set PREFIXCACHE_DASHBOARD_PNG to a path to keep
the screenshot (docs/img/dashboard.png is made that way).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cdp import Browser, find_chromium
from conftest import Server, ServerLoop, demo_engine, serve

from prefixcache.sidecar.server.app import SidecarSettings, create_app

PREFIXES = ("Atlas desk", "Poetry room", "Kitchen shelf")  # distinct from the first token
TOP_LEVEL = 'document.querySelectorAll(\'g[data-kind="prefix"][data-depth="1"]\').length'
MISS_ROWS = "document.querySelectorAll('#misses tbody tr').length"


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip(
            "Chromium is not installed (make test runs `apt-get install chromium` where it "
            "can: as root, or with passwordless sudo, on a Debian/Ubuntu machine)"
        )
    return path


@pytest.fixture(scope="module")
def own_sidecar(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[Server]:
    """A fresh engine with a host tier: the picture holds exactly what this test cached."""
    engine = demo_engine(demo_loaded, kv_offload="host:0.05")
    server = serve(server_loop, create_app(engine, SidecarSettings()))
    yield server
    server.stop()


def segments(intro: str, doc: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": f"{intro}: " + "answer briefly and cite shelves. " * 5,
         "tag": "rules", "stability": "static"},
        {"role": "user", "content": doc * 6, "tag": "doc", "stability": "shared"},
        {"role": "user", "content": question, "tag": "question"},
    ]  # fmt: skip


def ask(server: Server, intro: str, doc: str, question: str) -> dict:
    body = {"model": "demo", "segments": segments(intro, doc, question), "max_tokens": 2}
    res = httpx.post(f"{server.url}/chat/completions", json=body, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()


def top_level_in_tree(server: Server) -> int:
    tree = httpx.get(f"{server.root}/v1/cache/tree", timeout=30).json()
    namespaces = {n["id"] for n in tree["nodes"] if n["kind"] == "namespace"}
    return sum(1 for n in tree["nodes"] if n["kind"] == "prefix" and n["parent"] in namespaces)


def test_dashboard_in_chromium(chromium: str, own_sidecar: Server, tmp_path: Path) -> None:
    spill = {"prompt": "[spilled] the host tier keeps what the pool evicts. " * 4, "max_tokens": 1}
    assert httpx.post(f"{own_sidecar.root}/v1/completions", json=spill, timeout=120).is_success
    evicted = httpx.post(f"{own_sidecar.root}/v1/cache/evict", json={"keep_tier": True}).json()
    assert evicted["evicted_blocks"] > 0  # now in the host tier, out of the tree
    for intro in PREFIXES:
        for doc in ("Shelf A: atlases and maps. ", "Shelf B: poetry and plays. "):
            ask(own_sidecar, intro, doc, "Where is it?")
    pin = {"segments": segments(PREFIXES[0], "Shelf A: atlases and maps. ", "?"), "pin": True}
    warmed = httpx.post(f"{own_sidecar.root}/v1/cache/warm", json=pin, timeout=120)
    assert warmed.status_code == 200 and warmed.json()["pinned_blocks"] > 0, warmed.text
    ttl = {"segments": segments(PREFIXES[1], "Shelf B: poetry and plays. ", "?"), "pin": True,
           "ttl_s": 900}  # fmt: skip
    warmed = httpx.post(f"{own_sidecar.root}/v1/cache/warm", json=ttl, timeout=120)
    assert warmed.status_code == 200 and warmed.json()["pinned_blocks"] > 0, warmed.text
    assert top_level_in_tree(own_sidecar) == len(PREFIXES)

    browser = Browser.launch(chromium, tmp_path / "profile")
    try:
        browser.navigate(f"{own_sidecar.root}/dashboard")
        assert browser.wait_for(f"{TOP_LEVEL} === {len(PREFIXES)} && {TOP_LEVEL}")
        assert browser.wait_for(f"{MISS_ROWS} > 0 && {MISS_ROWS}")
        misses_before = browser.evaluate(MISS_ROWS)
        assert browser.evaluate("document.querySelectorAll('g[data-pinned=\"1\"]').length") > 0
        assert browser.evaluate("document.querySelectorAll('g[data-pin=\"pin\"]').length") > 0
        ttl_tips = browser.evaluate(
            "[...document.querySelectorAll('g[data-pin=\"ttl\"] title')].map(t => t.textContent)"
        )
        assert ttl_tips and all(
            re.search(r"TTL-pinned: lapses in 1\d min", tip) for tip in ttl_tips
        ), ttl_tips
        dashes = (
            "document.querySelector('g[data-pin=\"ttl\"] rect').getAttribute('stroke-dasharray')"
        )
        assert browser.evaluate(dashes)  # drawn dashed, unlike a pin without TTL
        sizes = browser.evaluate(
            "[...document.querySelectorAll('#top-size td')].map(td => td.textContent)"
        )
        assert "pinned" in sizes and any(re.fullmatch(r"TTL 1\d min", c) for c in sizes), sizes
        assert browser.wait_for("document.getElementById('tier-row').dataset.kind === 'host'")
        tier_legend = browser.evaluate("document.getElementById('tier-legend').textContent")
        assert f"host tier {evicted['evicted_blocks']}" in tier_legend, tier_legend
        assert browser.evaluate("document.getElementById('hit-rate').textContent") != "–"
        assert browser.evaluate("document.getElementById('ttft').textContent") != "–"
        # the requests before the page opened, from the server's window (7 asked, 2 warms)
        assert int(browser.evaluate("document.getElementById('rpm').textContent")) >= 7

        ask(own_sidecar, "Map annex", "Shelf C: cookery. ", "Anything else?")  # a new prefix
        assert browser.wait_for(f"{TOP_LEVEL} === {len(PREFIXES) + 1}")
        assert browser.wait_for(f"{MISS_ROWS} > {misses_before}")
        reasons = browser.evaluate(
            "[...document.querySelectorAll('#misses td.reason')].map(td => td.textContent)"
        )
        assert set(reasons) <= {"cold", "diverged", "partial_block", "evicted"} and reasons
        labels = browser.evaluate(
            "[...document.querySelectorAll('#icicle text')].map(t => t.textContent).join(' ')"
        )
        assert "rules" in labels  # segment tags label the prefixes

        shot = tmp_path / "dashboard.png"
        data = browser.screenshot(shot)
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
        keep = os.environ.get("PREFIXCACHE_DASHBOARD_PNG")
        if keep:
            shutil.copyfile(shot, keep)
        browser.evaluate("0")  # drain the events that came in meanwhile
        assert browser.errors == [], browser.errors
    finally:
        browser.close()
