"""``--chat-template`` (``EngineConfig.chat_template``): a template replacing the model's, or
giving one to a model without (the base ``gemma3``), as vLLM's flag does: read from a file or
taken as written, compiled at start, used by the engine, the process engine's API side and
the chat routes alike."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.serving.process_engine import ProcessEngine
from prefixcache.sidecar.cli import build_parser
from prefixcache.sidecar.cli.serve_command import read_chat_template, serve

BRACKETS = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}<go>"
CONFIG = dict(model="demo", dtype="float32", device="cpu", num_blocks=64)


def test_the_value_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(BRACKETS)
    assert read_chat_template(str(path)) == BRACKETS
    assert read_chat_template(BRACKETS) == BRACKETS
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file, and not a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template("{% for m in messages %}never closed")
    # transformers' {% generation %} tag compiles as the engine compiles it
    assert read_chat_template("{% generation %}x{% endgeneration %}") is not None
    long = "{% for m in messages %}" + "x" * 300 + "{{ m.content }}{% endfor %}"
    assert read_chat_template(long) == long  # no path (ENAMETOOLONG), a template
    # escapes in a one-line value read as vLLM reads them; other characters kept
    assert read_chat_template(r"{{ bos_token }}\n[é]\t{{ x }}") == "{{ bos_token }}\n[é]\t{{ x }}"


def test_a_bad_template_stops_serve_at_start() -> None:
    args = build_parser().parse_args(["serve", "--chat-template", "{{ unclosed"])
    with pytest.raises(SystemExit, match="--chat-template"):
        serve(args)


def test_the_engine_renders_with_it_and_keys_its_cache_by_it() -> None:
    plain = LLMEngine(EngineConfig(**CONFIG))
    engine = LLMEngine(EngineConfig(**CONFIG, chat_template=BRACKETS), plain.loaded)
    messages = [{"role": "user", "content": "hi"}]
    assert engine.tokenizer.apply_chat_template(messages) == "[user: hi]<go>"
    assert plain.tokenizer.apply_chat_template(messages) != "[user: hi]<go>"
    assert engine.tokenizer.chat_template == BRACKETS
    assert engine.tokenizer.fingerprint != plain.tokenizer.fingerprint
    assert plain.loaded.tokenizer.chat_template != BRACKETS  # the shared model is untouched
    ids = engine.tokenizer.encode("[user: hi]<go>")
    assert ids == plain.tokenizer.encode("[user: hi]<go>")  # the same pipeline


async def test_the_process_engines_api_side_has_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built from the model's own spec, sent ahead of the weights, with the template swapped
    here: no second build after Ready (its fingerprint agrees)."""

    def second_build(ready: object) -> None:
        raise AssertionError("the tokenizer was built again after Ready")

    monkeypatch.setattr(ProcessEngine, "_load_tokenizer", staticmethod(second_build))
    engine = ProcessEngine(EngineConfig(**CONFIG, chat_template=BRACKETS))
    await engine.start()
    try:
        tokenizer = engine.tokenizer
        assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[user: x]<go>"
    finally:
        await engine.shutdown()


def test_chat_answers_where_the_model_had_no_template(tools_sidecar: object) -> None:
    """The tools fixture's template is given this way (``conftest.tools_sidecar``)."""
    url = tools_sidecar.url  # type: ignore[attr-defined]
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
