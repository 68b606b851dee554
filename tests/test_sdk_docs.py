"""The worked lint examples in docs/prompt-layout.md run, and flag what they say they flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefixcache.sdk import Prompt, Segment, lint

DOC = Path(__file__).resolve().parent.parent / "docs" / "prompt-layout.md"
_EXAMPLE = re.compile(r"\*\*(PC\d{3}) [\w-]+\.\*\*.*?```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    section = DOC.read_text().split("### One worked example per rule", 1)[1]
    return _EXAMPLE.findall(section)


def test_every_rule_has_a_worked_example() -> None:
    assert [rule for rule, _ in _examples()] == [f"PC00{i}" for i in range(1, 10)]


@pytest.mark.parametrize(("rule", "code"), _examples())
def test_worked_example(rule: str, code: str) -> None:
    namespace: dict = {"Prompt": Prompt, "Segment": Segment, "lint": lint}
    exec(compile(code, f"{DOC.name}:{rule}", "exec"), namespace)
    bad: Prompt = namespace["bad"]
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
