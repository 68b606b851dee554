"""The sidecar's prompt ids equal transformers' (what vLLM feeds its model).

Tiny tokenizer folders are built here (no downloads): byte-level BPE with a Llama-3 style and a
ChatML template, SentencePiece-style Metaspace BPE with a Mistral-style template (loaded by
transformers both as tokenizer.json as-is and through its Llama class), and a Qwen3-style
template that re-renders earlier turns. Chat ids must equal
``AutoTokenizer.apply_chat_template(..., tokenize=True)``; completion ids must equal
``AutoTokenizer(prompt)["input_ids"]``. Requests go through the app over the fake engine,
which records the ids it receives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from sidecar_fake_engine import FakeEngine
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from prefixcache.engine.text.tokenizer import Tokenizer, compile_template
from prefixcache.sidecar.server.app import SidecarSettings, create_app

transformers = pytest.importorskip("transformers")

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "model" / "demo_assets"

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim }}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a careful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Assistant turns before the last user turn lose their <think> part: adding a user turn
# changes how the previous assistant turn renders.
QWEN3 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3's switch: with enable_thinking=false the generation prompt carries an empty think block.
QWEN3_THINKING = QWEN3.replace(
    "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
)
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Keep answers short."}
MULTI = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello, how can I help you today?"},
    {"role": "user", "content": "Tell me about the prefix cache."},
]
THINKING = [
    {"role": "user", "content": "What is a block?"},
    {"role": "assistant", "content": "<think>\nrecall\n</think>\n\nA fixed run of tokens."},
    {"role": "user", "content": "And a page?"},
]
PROMPTS = ["Hello world", "The capital of France is", " leading space and café"]


def byte_level(folder: Path, template: str, specials: dict[str, str], bos: str | None) -> Path:
    folder.mkdir()
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    if bos is not None:  # as Llama-3's tokenizer.json: the post-processor adds BOS
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    tok.save(str(folder / "tokenizer.json"))
    config = {**specials, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def metaspace_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-style BPE (Metaspace, byte fallback) trained on the demo corpus."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *alphabet]
    )
    tok.train([str(ASSETS / "corpus.txt")], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tok.save(str(path))
    return path


def metaspace(folder: Path, source: Path, template: str, cls: str) -> Path:
    folder.mkdir()
    shutil.copy(source, folder / "tokenizer.json")
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": template,
        "tokenizer_class": cls,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, metaspace_json: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    chatml = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    llama3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return {
        "llama3": byte_level(root / "llama3", LLAMA3, llama3, "<|begin_of_text|>"),
        "chatml": byte_level(root / "chatml", CHATML, chatml, None),
        "qwen3": byte_level(root / "qwen3", QWEN3, chatml, None),
        "qwen3_thinking": byte_level(root / "qwen3_thinking", QWEN3_THINKING, chatml, None),
        "mistral": metaspace(root / "mistral", metaspace_json, MISTRAL, "PreTrainedTokenizerFast"),
        "mistral_llama": metaspace(
            root / "mistral_llama", metaspace_json, MISTRAL, "LlamaTokenizerFast"
        ),
    }


def hf_ids(value: object) -> list[int]:
    return list(value["input_ids"]) if not isinstance(value, list) else value  # type: ignore[index]


async def sidecar_ids(folder: Path, path: str, body: dict) -> list[int]:
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = Tokenizer.from_folder(folder)  # type: ignore[assignment]
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(path, json={**body, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return list(engine.received[-1].prompt_token_ids)


CASES = [
    ("llama3", [SYSTEM, {"role": "user", "content": "Hello, how are you?"}]),
    ("llama3", [SYSTEM, *MULTI]),
    ("chatml", [{"role": "user", "content": "Hello, how are you?"}]),
    ("chatml", [SYSTEM, *MULTI]),
    ("mistral", [{"role": "user", "content": "Hello, how are you?"}]),
    ("mistral", MULTI),
    ("mistral_llama", MULTI),
    ("qwen3", [SYSTEM, {"role": "user", "content": "What is a block?"}]),
    ("qwen3", [SYSTEM, *THINKING]),
    ("qwen3", MULTI),
]


@pytest.mark.parametrize(("kind", "messages"), CASES)
async def test_chat_ids_equal_apply_chat_template(
    folders: dict[str, Path], kind: str, messages: list[dict]
) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(folders[kind])
    expected = hf_ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    got = await sidecar_ids(folders[kind], "/v1/chat/completions", {"messages": messages})
    assert got == expected


@pytest.mark.parametrize("kind", ["llama3", "chatml", "mistral", "mistral_llama"])
async def test_completion_ids_equal_the_tokenizer_call(folders: dict[str, Path], kind: str) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(folders[kind])
    for prompt in PROMPTS:
        got = await sidecar_ids(folders[kind], "/v1/completions", {"prompt": prompt})
        assert got == hf(prompt)["input_ids"], prompt
    # Token ids are taken as given, whatever the tokenizer would add.
    assert await sidecar_ids(folders[kind], "/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_special_tokens_come_from_the_post_processor_alone(
    tmp_path: Path, metaspace_json: Path
) -> None:
    """transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists."""
    without = json.loads(metaspace_json.read_text())
    without["post_processor"] = None
    for i, (flags, post_processor) in enumerate(
        [
            ({"add_bos_token": False}, True),
            ({"add_eos_token": True}, True),
            ({}, False),
            ({"add_bos_token": True}, False),
        ]
    ):
        folder = metaspace(tmp_path / str(i), metaspace_json, "", "PreTrainedTokenizerFast")
        if not post_processor:
            (folder / "tokenizer.json").write_text(json.dumps(without))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("add_bos_token")
        config.pop("add_eos_token")
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        ours = Tokenizer.from_folder(folder).encode("a test", add_special_tokens=True)
        assert ours == hf("a test")["input_ids"], flags
        assert (ours[0] == 1) == post_processor


def test_template_environment_matches_transformers(folders: dict[str, Path]) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if loop.index0 == 1 %}{% break %}{% endif %}{% endfor %}"
        "|{{ messages[0] | tojson(indent=2, sort_keys=True) }}"
        "|{{ {'b': 'é', 'a': [1, 2]} | tojson(separators=(',', ':')) }}"
        "|{{ strftime_now('%Y') }}|{{ pad_token }}|{% if tools is none %}no tools{% endif %}"
    )
    folder = folders["chatml"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    custom = folder.parent / "env"
    shutil.copytree(folder, custom)
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(custom)
    messages = [{"role": "user", "content": "one"}, *MULTI]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert Tokenizer.from_folder(custom).apply_chat_template(messages) == expected


async def test_a_model_without_chat_template_answers_chat_with_400(tmp_path: Path) -> None:
    folder = byte_level(tmp_path / "base", "", {}, None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = Tokenizer.from_folder(folder)  # type: ignore[assignment]
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        chat = await c.post("/v1/chat/completions", json=body)
        assert chat.status_code == 400
        assert "no chat template" in chat.json()["error"]["message"]
        completion = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert completion.status_code == 200


async def test_chat_template_kwargs_equal_transformers(folders: dict[str, Path]) -> None:
    """vLLM's chat_template_kwargs reach the template as transformers' extra kwargs do."""
    folder = folders["qwen3_thinking"]
    messages = [SYSTEM, {"role": "user", "content": "What is a block?"}]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    got = {}
    for enable_thinking in (True, False):
        expected = hf_ids(
            hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, enable_thinking=enable_thinking
            )
        )
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": enable_thinking}}
        got[enable_thinking] = await sidecar_ids(folder, "/v1/chat/completions", body)
        assert got[enable_thinking] == expected
    assert len(got[False]) > len(got[True])  # the empty think block is there only when off


@pytest.mark.parametrize(
    ("kind", "final"),
    [
        ("llama3", "Sourdough, because it "),  # a trailing space the template trims
        ("chatml", "Sourdough, because it "),
        ("mistral", "Sourdough, because it "),
        ("chatml", "end"),  # text that also occurs in the template's own markup
        ("chatml", "m_"),
        ("chatml", ""),
    ],
)
async def test_continue_final_message_equals_transformers(
    folders: dict[str, Path], kind: str, final: str
) -> None:
    messages = [
        {"role": "user", "content": "Name a bread."},
        {"role": "assistant", "content": final},
    ]
    hf = transformers.AutoTokenizer.from_pretrained(folders[kind])
    expected = hf_ids(
        hf.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
        )
    )
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    got = await sidecar_ids(folders[kind], "/v1/chat/completions", body)
    assert got == expected
    closed = await sidecar_ids(
        folders[kind], "/v1/chat/completions", {**body, "continue_final_message": False}
    )
    assert len(closed) > len(got)  # without it the turn is closed (end-of-turn tokens)


@pytest.mark.parametrize("kind", ["llama3", "chatml"])
async def test_add_generation_prompt_false_equals_transformers(
    folders: dict[str, Path], kind: str
) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    hf = transformers.AutoTokenizer.from_pretrained(folders[kind])
    expected = hf_ids(hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))
    body = {"messages": messages, "add_generation_prompt": False}
    assert await sidecar_ids(folders[kind], "/v1/chat/completions", body) == expected


async def test_continue_final_message_a_template_drops_is_400(folders: dict[str, Path]) -> None:
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = Tokenizer.from_folder(folders["chatml"])  # type: ignore[assignment]
    engine.tokenizer._template = compile_template(  # drops assistant turns
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    body = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 1,
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "continue_final_message" in response.json()["error"]["message"]
    assert engine.received == []


async def test_a_developer_message_renders_as_a_system_message(folders: dict[str, Path]) -> None:
    """OpenAI's newer clients send role "developer" where older ones sent "system"."""
    question = {"role": "user", "content": "Hello"}
    developer = {"role": "developer", "content": SYSTEM["content"]}
    as_developer = await sidecar_ids(
        folders["llama3"], "/v1/chat/completions", {"messages": [developer, question]}
    )
    as_system = await sidecar_ids(
        folders["llama3"], "/v1/chat/completions", {"messages": [SYSTEM, question]}
    )
    assert as_developer == as_system
