"""The SDK's doc snippets run as written: the worked lint examples in docs/prompt-layout.md
(and they flag what they say they flag), every other snippet there, and the README's SDK
snippet against a stub sidecar."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prefixcache.sdk import Prompt

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "prompt-layout.md"
_EXAMPLE = re.compile(r"\*\*(PC\d{3}) [\w-]+\.\*\*.*?```python\n(.*?)```", re.DOTALL)
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    section = DOC.read_text().split("### One worked example per rule", 1)[1]
    return _EXAMPLE.findall(section)


def _run(code: str, name: str) -> dict:
    namespace: dict = {"__name__": "__main__"}  # nothing given: the snippet imports it all
    exec(compile(code, name, "exec"), namespace)
    return namespace


def test_every_rule_has_a_worked_example() -> None:
    assert [rule for rule, _ in _examples()] == [f"PC00{i}" for i in range(1, 10)]


@pytest.mark.parametrize(("rule", "code"), _examples())
def test_worked_example(rule: str, code: str) -> None:
    bad: Prompt = _run(code, f"{DOC.name}:{rule}")["bad"]
    flagged = {
        bad.segment(f.tag).content[s:e] for f in bad.lint() if f.rule == rule for s, e in f.spans
    }
    assert flagged, f"{rule}'s example does not trigger it"
    # the texts the example's "# PCxxx ...: 'text'" comment quotes are what the spans cover
    claim = next(line for line in code.splitlines() if f"# {rule}" in line)
    quoted = re.findall(r"'([^']+)'", claim.split(f"# {rule}", 1)[1])
    quoted = [q.encode().decode("unicode_escape") for q in quoted]
    assert quoted
    assert set(quoted) <= flagged | {s.tag for s in bad.segments}, (quoted, flagged)


@pytest.mark.parametrize("index", range(len(_BLOCK.findall(DOC.read_text()))))
def test_every_prompt_layout_snippet_runs_as_shown(index: int) -> None:
    _run(_BLOCK.findall(DOC.read_text())[index], f"{DOC.name}#{index}")


class _Sidecar(BaseHTTPRequestHandler):
    """Answers a chat completion with the sidecar's per-segment report, all of it cached."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        tags = [s["tag"] for s in body["segments"]]
        report = {
            "cached_tokens": 10 * len(tags),
            "prompt_tokens": 10 * len(tags),
            "computed_tokens": 0,
            "segments": [{"tag": t, "tokens": 10, "cached_tokens": 10} for t in tags],
        }
        usage = {"prompt_tokens": 10 * len(tags), "completion_tokens": 1, "total_tokens": 31}
        usage["prompt_tokens_details"] = {"cached_tokens": 10 * len(tags)}
        message = {"role": "assistant", "content": "Yes."}
        reply = {
            "id": "c1",
            "model": "demo",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": usage,
            "prefixcache": report,
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sidecar_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sidecar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_readme_sdk_snippet_runs_as_shown(
    sidecar_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("The SDK adds tagged segments", 1)[1]
    code = _BLOCK.search(section)
    assert code is not None
    monkeypatch.setenv("PREFIXCACHE_BASE_URL", sidecar_url)
    _run(code.group(1), "README.md")
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["Yes. 30", "[('rules', 10), ('doc:policy', 10), ('question', 10)]"]
