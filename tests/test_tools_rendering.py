"""Tools in the prompt: ids equal transformers' ``apply_chat_template(messages, tools=...)``
for a Qwen2.5-style and a Llama-3.1-style template on the demo tokenizer; canonical tools
render the same whatever the key order; a template without tools support is a 400."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from sidecar_fake_engine import FakeEngine
from tokenizers import Tokenizer as HFTokenizer
from tool_templates import LLAMA31_STYLE, QWEN25_STYLE

from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sidecar.chat.tool_prompt import ToolTemplate
from prefixcache.sidecar.server.app import SidecarSettings, create_app

transformers = pytest.importorskip("transformers")

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "model" / "demo_assets"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"], "type": "string"},
                "city": {"type": "string", "description": "City name"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
ARGS = '{"unit": "c", "city": "Paris"}'
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And tomorrow?"},
]


def sort_keys(value: object) -> object:
    return json.loads(json.dumps(value, sort_keys=True))


def reorder(value: object) -> object:
    """The same data with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(v) for v in value]
    return value


def hf_messages(messages: list[dict]) -> list[dict]:
    """What the sidecar hands the template (as vLLM): arguments as objects, content as text."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": sort_keys(json.loads(c["function"]["arguments"])),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def folder_with(root: Path, name: str, template: str, specials: dict[str, str]) -> Path:
    folder = root / name
    folder.mkdir()
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {**specials, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool_templates")
    return {
        "qwen25": folder_with(root, "qwen25", QWEN25_STYLE, {"eos_token": "<|im_end|>"}),
        "llama31": folder_with(
            root,
            "llama31",
            LLAMA31_STYLE,
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ),
    }


async def post(folder: Path | None, body: dict) -> tuple[httpx.Response, FakeEngine]:
    engine = FakeEngine(max_model_len=8192)
    if folder is not None:
        engine.tokenizer = Tokenizer.from_folder(folder)  # type: ignore[assignment]
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    return response, engine


@pytest.mark.parametrize("kind", ["qwen25", "llama31"])
@pytest.mark.parametrize("turns", [2, 5])
async def test_tool_conversation_ids_equal_transformers(
    folders: dict[str, Path], kind: str, turns: int
) -> None:
    messages = CONVERSATION[:turns]
    tools = [WEATHER, SEARCH]
    hf = transformers.AutoTokenizer.from_pretrained(folders[kind])
    expected = hf.apply_chat_template(
        hf_messages(messages), tools=sort_keys(tools), add_generation_prompt=True, tokenize=True
    )
    expected = list(expected["input_ids"]) if not isinstance(expected, list) else expected
    response, engine = await post(folders[kind], {"messages": messages, "tools": tools})
    assert response.status_code == 200, response.text
    got = list(engine.received[-1].prompt_token_ids)
    assert got == expected
    # The tools block is there (the template rendered them) ...
    text = engine.tokenizer.decode(got, skip_special_tokens=False)
    assert '"get_weather"' in text and '"search"' in text
    # ... and its bytes do not depend on the client's key order.
    again, engine2 = await post(
        folders[kind], {"messages": reorder(messages), "tools": reorder(tools)}
    )
    assert again.status_code == 200, again.text
    assert list(engine2.received[-1].prompt_token_ids) == got


@pytest.mark.parametrize(("kind", "parser"), [("qwen25", "hermes"), ("llama31", "llama3_json")])
def test_the_parser_comes_from_the_template(
    folders: dict[str, Path], kind: str, parser: str
) -> None:
    template = ToolTemplate(Tokenizer.from_folder(folders[kind]))  # type: ignore[arg-type]
    assert template.supports_tools
    assert template.model_parser.name == parser
    assert (
        ToolTemplate(Tokenizer.from_folder(folders[kind]), "mistral").model_parser.name == "mistral"
    )  # type: ignore[arg-type]


async def test_a_template_without_tools_support_gets_them_as_text() -> None:
    """A template that renders no tools: they reach the model in the generic JSON format
    (test_generic_tools.py), its reply held to that format by a grammar."""
    response, engine = await post(
        None, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    )
    assert response.status_code == 200, response.text
    (request,) = engine.received
    assert '"get_weather"' in engine.tokenizer.decode(request.prompt_token_ids)
    assert '"tool_calls"' in request.sampling.grammar.text


async def test_tool_choice_none_on_a_template_without_tools_is_the_plain_prompt() -> None:
    """No call wanted: the prompt the template renders without the tools is served (what
    LangChain and llama-index send when tools are bound but not to be called)."""
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    plain, engine = await post(None, hi)
    none, engine2 = await post(None, {**hi, "tools": [WEATHER], "tool_choice": "none"})
    assert plain.status_code == none.status_code == 200, none.text
    assert engine2.received[-1].prompt_token_ids == engine.received[-1].prompt_token_ids
    assert none.json()["choices"][0]["message"].get("tool_calls") is None


@pytest.mark.parametrize("kind", ["qwen25", "llama31"])
async def test_empty_arguments_sent_back_are_the_empty_object(
    folders: dict[str, Path], kind: str
) -> None:
    """Some clients send a call without arguments back as ``"arguments": ""``: the template
    sees ``{}``, the prompt of ``"{}"``."""

    def history(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": arguments}}
        return {
            "messages": [
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            ],
            "tools": [{"type": "function", "function": {"name": "now", "parameters": {}}}],
        }

    empty, engine = await post(folders[kind], history(""))
    braces, engine2 = await post(folders[kind], history("{}"))
    assert empty.status_code == braces.status_code == 200, empty.text
    assert engine.received[-1].prompt_token_ids == engine2.received[-1].prompt_token_ids
    bad, _ = await post(folders[kind], history('{"a": '))
    assert bad.status_code == 400 and "JSON text of an object" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
async def test_inconsistent_tool_fields_are_400(
    folders: dict[str, Path], body: dict, param: str
) -> None:
    response, engine = await post(
        folders["qwen25"], {"messages": [{"role": "user", "content": "hi"}], **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.received == []


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},  # no tool_call_id
        {
            "role": "user",
            "content": "x",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1"}}
            ],
        },
    ],
)
async def test_malformed_tool_history_is_400(folders: dict[str, Path], message: dict) -> None:
    messages = [{"role": "user", "content": "hi"}, message]
    response, engine = await post(folders["qwen25"], {"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 400, response.text
    assert engine.received == []
