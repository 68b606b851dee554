"""Gemma 3 fidelity: the 270M base model from its GGUF (the named model ``gemma3``) against
transformers' ``Gemma3ForCausalLM`` on the same file, in float32.

A dozen completion prompts: eight that share a 1.5K-token document (the Apache License 2.0,
almost three 512-token sliding windows) and end in different questions, and four short ones.
The engine's prompt token ids equal transformers' tokenizer, and its greedy continuations equal
transformers' greedy ``generate``: cold (no prefix cache), warm (the document cached: a hybrid
hit, global layers from position 0, sliding layers only their last window), chunked (prefill
cut into 80-token steps) and batched (all twelve at once). At the default dtype the four give
bit-identical tokens among themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.model.loader import LoadedModel, load_model  # noqa: E402
from prefixcache.engine.model.named_models import ModelFetchError, ensure_named_model  # noqa: E402
from prefixcache.engine.request import EngineRequest, SamplingParams  # noqa: E402

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
def reference(gguf_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """transformers on the same GGUF: prompt ids and greedy continuations."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
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


def shared_tokens(loaded: LoadedModel) -> int:
    # BOS and the document, less its last token (which may merge with the "\n\n" after it)
    return len(loaded.tokenizer.encode(DOCUMENT, add_special_tokens=True)) - 1


@pytest.mark.timeout(900)  # its set-up loads both models and runs transformers' generate
def test_prompt_token_ids_equal_transformers(
    loaded: LoadedModel, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, _ = reference
    ours = [r.prompt_token_ids for r in requests(loaded, "ids")]
    for i, (mine, theirs) in enumerate(zip(ours, prompts, strict=True)):
        assert mine == theirs, f"prompt {i}: token ids differ"
    assert shared_tokens(loaded) > 1400  # the document spans almost three 512-token windows


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["cold", "warm", "chunked", "batched"])
def test_greedy_continuations_equal_transformers(
    loaded: LoadedModel, reference: tuple[list[list[int]], list[list[int]]], mode: str
) -> None:
    _, answers = reference
    tok = loaded.tokenizer
    overrides: dict[str, object] = {}
    if mode in ("cold", "chunked"):
        overrides["enable_prefix_caching"] = False
    if mode == "chunked":
        overrides["max_num_batched_tokens"] = 80
    eng = engine(loaded, **overrides)
    reqs = requests(loaded, mode)
    if mode == "batched":
        results = eng.generate(reqs)
    else:
        if mode == "warm":
            eng.generate(requests(loaded, "warm-up")[:1])  # computes the document's KV once
        results = [eng.generate([r])[0] for r in reqs]
    for i, (result, expected) in enumerate(zip(results, answers, strict=True)):
        assert result.token_ids == expected, (
            f"{mode} {i}: {tok.decode(result.token_ids)!r} != {tok.decode(expected)!r}"
        )
    if mode == "warm":  # the document is reported cached and was not recomputed
        shared = shared_tokens(loaded)
        for i, result in enumerate(results[:NUM_SHARED]):
            assert result.usage.cached_tokens >= shared // BLOCK_SIZE * BLOCK_SIZE, i
            prompt_len = len(reqs[i].prompt_token_ids)
            assert result.usage.computed_prompt_tokens <= prompt_len - shared + BLOCK_SIZE, i
    if mode == "cold":
        assert all(r.usage.cached_tokens == 0 for r in results)


@pytest.fixture(scope="module")
def loaded_default(gguf_path: Path) -> LoadedModel:
    """The same GGUF at the default dtype (bf16 where the CPU has it)."""
    return load_model("gemma3", dtype="auto", device="cpu")


@pytest.mark.timeout(900)
def test_default_dtype_tokens_are_the_same_cold_warm_chunked_and_batched(
    loaded_default: LoadedModel,
) -> None:
    def run(tag: str, **overrides: object) -> list[list[int]]:
        eng = engine(loaded_default, **overrides)
        if tag == "batched":
            return [r.token_ids for r in eng.generate(requests(loaded_default, tag))]
        if tag == "warm":
            eng.generate(requests(loaded_default, "warm-up")[:1])
        return [eng.generate([req])[0].token_ids for req in requests(loaded_default, tag)]

    cold = run("cold", enable_prefix_caching=False)
    for tag, overrides in (
        ("warm", {}),
        ("chunked", {"max_num_batched_tokens": 80, "enable_prefix_caching": False}),
        ("batched", {}),
    ):
        got = run(tag, **overrides)
        for i, (mine, ref) in enumerate(zip(got, cold, strict=True)):
            assert mine == ref, f"{tag} {i}: {mine} != cold {ref}"
