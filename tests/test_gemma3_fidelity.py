"""Gemma 3 fidelity: the 270M base model from its GGUF (the named model ``gemma3``) against
transformers' ``Gemma3ForCausalLM`` on the same file, in float32.

A dozen completion prompts: eight that share a 1.5K-token document (the Apache License 2.0,
almost three 512-token sliding windows) and end in different questions, and four short ones.
The engine's prompt token ids equal transformers' tokenizer, and its greedy continuations equal
transformers' greedy ``generate``: cold (no prefix cache), warm (the document cached: a hybrid
hit, global layers from position 0, sliding layers only their last window), chunked (prefill
cut into 80-token steps) and batched (all twelve at once). At the default dtype the four give
bit-identical tokens among themselves.

The same file's config comes from its metadata, its logits equal transformers' (fp32, within
the dequantization tolerance) and its tokenizer's ids equal transformers' on hypothesis texts.
Both models are loaded once for the module (each load of this 262K-vocabulary file takes tens
of seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import hf_reference  # noqa: E402
from hf_reference import Reference  # noqa: E402
from test_gemma3 import run_chunks  # noqa: E402

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.model.loader import LoadedModel, load_model, resolve_dtype  # noqa: E402
from prefixcache.engine.model.named_models import ModelFetchError, ensure_named_model  # noqa: E402
from prefixcache.engine.request import EngineRequest, SamplingParams  # noqa: E402
from prefixcache.engine.text.tokenizer import ChatTemplateError  # noqa: E402

pytestmark = pytest.mark.slow

FULL_TEXT = (
    Path(__file__).resolve().parent.parent / "examples/documents/apache-license-2.0.txt"
).read_text(encoding="utf-8")
DOCUMENT = FULL_TEXT[: FULL_TEXT.index("5. Submission of Contributions")]
MAX_NEW_TOKENS = 12
BLOCK_SIZE = 16
QUESTIONS = [
    "Question: Which version of the Apache License is this?\nAnswer:",
    'Question: What does "Work" mean?\nAnswer:',
    "Question: When does the patent license terminate?\nAnswer:",
    "Question: What must you give recipients of the Work?\nAnswer:",
    "Question: What must modified files carry?\nAnswer:",
    "Question: Who is a Contributor?\nAnswer:",
    "Q: Is the copyright license royalty-free?\nA:",
    "In one sentence, the license",
]
SHORT = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
]
PROMPTS = [DOCUMENT + "\n\n" + q for q in QUESTIONS] + SHORT
NUM_SHARED = len(QUESTIONS)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return ensure_named_model("gemma3")
    except ModelFetchError as exc:  # offline: nothing to compare
        pytest.skip(f"gemma3 could not be fetched: {exc}")


@pytest.fixture(scope="module")
def loaded(gguf_path: Path) -> LoadedModel:
    return load_model("gemma3", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reference(gguf_path: Path, request: pytest.FixtureRequest) -> Reference:
    """transformers on the same GGUF: prompt ids and greedy continuations (kept once computed,
    tests/hf_reference.py)."""

    def compute() -> Reference:
        tok = request.getfixturevalue("hf_tokenizer")
        model = request.getfixturevalue("hf_model")
        prompts, answers = [], []
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            prompts.append(list(ids))
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=MAX_NEW_TOKENS,
                    min_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                )
            answers.append(out[0, len(ids) :].tolist())
        return prompts, answers

    inputs = {"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "min_new_tokens": True}
    return hf_reference.memoized("gemma3-fidelity", gguf_path, inputs, compute)


def engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    config = EngineConfig(model="gemma3", num_blocks=1024, block_size=BLOCK_SIZE)
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded=loaded)


def requests(loaded: LoadedModel, tag: str) -> list[EngineRequest]:
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [
        EngineRequest(f"{tag}-{i}", loaded.tokenizer.encode(p, add_special_tokens=True), sampling)
        for i, p in enumerate(PROMPTS)
    ]


# Each mode's engine settings; run() memoizes the tokens per (model, mode): on a CPU whose default
# dtype is fp32, the default-dtype test reads the fp32 tests' runs instead of repeating them.
MODES: dict[str, dict[str, object]] = {
    "cold": {"enable_prefix_caching": False},
    "warm": {},
    "chunked": {"enable_prefix_caching": False, "max_num_batched_tokens": 80},
    "batched": {},
    "reloaded": {"kv_offload": "host:0.5"},  # every hit copied back from the KV tier
}
_RUNS: dict[tuple[int, str], list] = {}


def run(loaded: LoadedModel, mode: str) -> list:
    """Every prompt's result in ``mode``: one at a time (warm: after the document's KV was
    computed by a first request; reloaded: the same, each request's hit reloaded from the KV
    tier), or all at once (batched)."""
    key = (id(loaded), mode)
    if key not in _RUNS:
        eng = engine(loaded, **MODES[mode])
        reqs = requests(loaded, mode)
        if mode == "batched":
            _RUNS[key] = eng.generate(reqs)
        else:
            if mode in ("warm", "reloaded"):
                eng.generate(requests(loaded, "warm-up")[:1])  # computes the document's KV once
            results = []
            for r in reqs:
                if mode == "reloaded":  # the pool emptied into the tier: global and local pages
                    eng.evict_all(keep_tier=True)
                results.append(eng.generate([r])[0])
            eng.close()
            _RUNS[key] = results
    return _RUNS[key]


def shared_tokens(loaded: LoadedModel) -> int:
    # BOS and the document, less its last token (which may merge with the "\n\n" after it)
    return len(loaded.tokenizer.encode(DOCUMENT, add_special_tokens=True)) - 1


@pytest.mark.timeout(900)  # its set-up loads both models and runs transformers' generate
def test_prompt_token_ids_equal_transformers(loaded: LoadedModel, reference: Reference) -> None:
    prompts, _ = reference
    ours = [r.prompt_token_ids for r in requests(loaded, "ids")]
    for i, (mine, theirs) in enumerate(zip(ours, prompts, strict=True)):
        assert mine == theirs, f"prompt {i}: token ids differ"
    assert shared_tokens(loaded) > 1400  # the document spans almost three 512-token windows


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_continuations_equal_transformers(
    loaded: LoadedModel, reference: Reference, mode: str
) -> None:
    _, answers = reference
    tok = loaded.tokenizer
    reqs = requests(loaded, mode)
    results = run(loaded, mode)
    for i, (result, expected) in enumerate(zip(results, answers, strict=True)):
        assert result.token_ids == expected, (
            f"{mode} {i}: {tok.decode(result.token_ids)!r} != {tok.decode(expected)!r}"
        )
    if mode in ("warm", "reloaded"):  # the document is reported cached, not recomputed
        shared = shared_tokens(loaded)
        for i, result in enumerate(results[:NUM_SHARED]):
            assert result.usage.cached_tokens >= shared // BLOCK_SIZE * BLOCK_SIZE, i
            prompt_len = len(reqs[i].prompt_token_ids)
            assert result.usage.computed_prompt_tokens <= prompt_len - shared + BLOCK_SIZE, i
    if mode == "cold":
        assert all(r.usage.cached_tokens == 0 for r in results)


@pytest.fixture(scope="module")
def loaded_default(loaded: LoadedModel) -> LoadedModel:
    """The same GGUF at the default dtype (bf16 where the CPU has it; where it is fp32, the
    fp32 model above, whose runs are already memoized)."""
    if resolve_dtype("auto", torch.device("cpu")) == torch.float32:
        return loaded
    return load_model("gemma3", dtype="auto", device="cpu")


@pytest.mark.timeout(900)
def test_default_dtype_tokens_are_the_same_cold_warm_chunked_and_batched(
    loaded_default: LoadedModel,
) -> None:
    cold = [r.token_ids for r in run(loaded_default, "cold")]
    for mode in ("warm", "chunked", "batched", "reloaded"):
        got = [r.token_ids for r in run(loaded_default, mode)]
        for i, (mine, ref) in enumerate(zip(got, cold, strict=True)):
            assert mine == ref, f"{mode} {i}: {mine} != cold {ref}"


def test_gguf_config_from_metadata(loaded: LoadedModel) -> None:
    cfg = loaded.config
    assert cfg.model_type == "gemma3" and cfg.num_layers == 18 and cfg.hidden_size == 640
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings
    assert loaded.tokenizer.chat_template is None  # the file has none: chat is refused
    with pytest.raises(ChatTemplateError):
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_logits_equal_transformers(loaded: LoadedModel, hf_model) -> None:
    hf = hf_model
    tok = loaded.tokenizer
    long_text = " ".join(
        f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60)
    )
    texts = ["The capital of France is", "def fib(n):\n    return", long_text]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    assert len(prompts[2]) > 600
    # logits of every 7th token and each prompt's last (the full [T, 262144] is large)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    rows = torch.cat([torch.arange(0, int(ends[-1]), 7), ends]).unique()
    with torch.inference_mode():
        hidden = torch.cat([hf.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
        ref = hf.lm_head(hidden[rows]).float()
        ours_hidden = run_chunks(loaded.model, prompts, chunk=256, hidden_only=True)
        ours = loaded.model.compute_logits(ours_hidden[rows])
    print("max |logit diff|", float((ours - ref).abs().max()), "of", float(ref.abs().max()))
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


TEXTS = [
    "",
    " ",
    "   leading and trailing   ",
    "Hello, world!",
    "a\tb\t\tc\n\nd\r\ne\n\n\n\nf",
    "x" * 40 + " " * 17 + "y",
    "1234567890 3.14159 -42 1e-9 0x1F",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<bos>hello<eos> <start_of_turn>user\nhi<end_of_turn>",
    "[multimodal] <unused5> <pad><mask>",
    "naïve café façade — “quotes” ‘single’ …",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ✨",
    "Ελληνικά русский עברית العربية हिन्दी",
    "e\u0301 a\u0308 \u200b zero\u200dwidth \ufeff bom",
    "\x00\x01\x7f control bytes",
]
_ALPHABET = st.sampled_from(
    list("abcXYZ019 \t\n\r.,;:!?'\"()[]{}<>/\\_-=+*&^%$#@~`|")
    + ["é", "ß", "中", "文", "😀", "👍🏽", "\u0301", "\u200d", "  ", "    ", "\n\n", "<eos>"]
)
_TEXT = st.one_of(
    st.text(max_size=60),
    st.lists(_ALPHABET, max_size=40).map("".join),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=30),
)


def _check_ids(ours, hf, text: str) -> None:
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf(text, add_special_tokens=special).input_ids, (text, special)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    if "\u2581" not in text and not any(t in text for t in ("<", "[multimodal]")):
        assert ours.decode(ids) == text


def test_gguf_tokenizer_equals_transformers(loaded: LoadedModel, hf_tokenizer) -> None:
    ours = loaded.tokenizer
    assert ours.vocab_size == len(hf_tokenizer) == 262144
    assert ours.encode("hi", add_special_tokens=True)[0] == 2  # BOS, as the metadata says
    for text in TEXTS:
        _check_ids(ours, hf_tokenizer, text)

    @settings(max_examples=400, deadline=None, database=None)
    @given(_TEXT)
    def check(text: str) -> None:
        _check_ids(ours, hf_tokenizer, text)

    check()
