"""Real-model fidelity: SmolLM2-135M-Instruct from its GGUF (the named model ``smollm2``), in
float32, against transformers reading the same GGUF file.

A dozen chat prompts (tests/fidelity_prompts.py: a long document, the Apache License 2.0, as the system prompt with several
questions, multi-turn conversations, no system prompt): the engine's prompt token ids equal
transformers' ``apply_chat_template``, and its greedy answers equal transformers' greedy
``generate``, cold (no prefix cache), warm (the document cached) and all at once (batched).
The GGUF is fetched once into the models cache (engine/model/named_models.py) and reused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import hf_reference  # noqa: E402
from fidelity_prompts import CONVERSATIONS, MAX_NEW_TOKENS, NUM_SHARED, SYSTEM  # noqa: E402
from hf_reference import Reference  # noqa: E402

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.model.loader import LoadedModel, load_model  # noqa: E402
from prefixcache.engine.model.named_models import ModelFetchError, ensure_named_model  # noqa: E402
from prefixcache.engine.request import EngineRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return ensure_named_model("smollm2")
    except ModelFetchError as exc:  # offline: nothing to compare
        pytest.skip(f"smollm2 could not be fetched: {exc}")


@pytest.fixture(scope="module")
def loaded(gguf_path: Path) -> LoadedModel:
    return load_model("smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Reference:
    """transformers on the same GGUF: prompt ids and greedy answers (eos included), kept once
    computed (tests/hf_reference.py)."""

    def compute() -> Reference:
        folder, name = str(gguf_path.parent), gguf_path.name
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
        prompts, answers = [], []
        for messages in CONVERSATIONS:
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompts.append(list(ids))
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                )
            answers.append(out[0, len(ids) :].tolist())
        return prompts, answers

    inputs = {"conversations": CONVERSATIONS, "max_new_tokens": MAX_NEW_TOKENS}
    return hf_reference.memoized("smollm2-chat", gguf_path, inputs, compute)


def engine(loaded: LoadedModel, caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        model="smollm2",
        num_blocks=2048,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=caching,
        attention_backend="torch",
    )
    return LLMEngine(config, loaded=loaded)


def requests(loaded: LoadedModel, tag: str) -> list[EngineRequest]:
    tok = loaded.tokenizer
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS)
    return [
        EngineRequest(f"{tag}-{i}", tok.encode(tok.apply_chat_template(m)), sampling)
        for i, m in enumerate(CONVERSATIONS)
    ]


@pytest.mark.timeout(600)  # its set-up loads both models and runs transformers' generate
def test_prompt_token_ids_equal_transformers_apply_chat_template(
    loaded: LoadedModel, reference: Reference
) -> None:
    prompts, _ = reference
    ours = [r.prompt_token_ids for r in requests(loaded, "ids")]
    for i, (mine, theirs) in enumerate(zip(ours, prompts, strict=True)):
        assert mine == theirs, f"conversation {i}: prompt ids differ"
    assert len(ours[0]) > 800  # the document really is in the prompt


@pytest.mark.timeout(600)  # a shared 2-vCPU box can be several times slower than idle
def test_greedy_answers_equal_transformers_cold(loaded: LoadedModel, reference: Reference) -> None:
    _, answers = reference
    tok = loaded.tokenizer
    assert "Paris" in tok.decode(answers[9])  # the reference itself answers
    cold = engine(loaded, caching=False)
    for req, expected in zip(requests(loaded, "cold"), answers, strict=True):
        (result,) = cold.generate([req])
        assert result.usage.cached_tokens == 0
        assert result.token_ids == expected, f"{req.request_id}: {tok.decode(result.token_ids)!r}"


@pytest.mark.timeout(600)
def test_greedy_answers_equal_transformers_warm_with_the_document_cached(
    loaded: LoadedModel, reference: Reference
) -> None:
    _, answers = reference
    tok = loaded.tokenizer
    warm = engine(loaded)
    warm.generate(requests(loaded, "warm-up")[:1])  # computes the document's KV once
    shared = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}])))
    for i, (req, expected) in enumerate(zip(requests(loaded, "warm"), answers, strict=True)):
        (result,) = warm.generate([req])
        assert result.token_ids == expected, f"{req.request_id}: {tok.decode(result.token_ids)!r}"
        if i < NUM_SHARED:  # the document is reported as cached, and was not recomputed
            assert result.usage.cached_tokens >= shared // BLOCK_SIZE * BLOCK_SIZE, i
            computed = result.usage.computed_prompt_tokens
            assert computed <= len(req.prompt_token_ids) - shared + 2 * BLOCK_SIZE, i


@pytest.mark.timeout(600)
def test_greedy_answers_equal_transformers_batched(
    loaded: LoadedModel, reference: Reference
) -> None:
    _, answers = reference
    tok = loaded.tokenizer
    batch = requests(loaded, "batch")
    results = engine(loaded).generate(batch)
    for req, result, expected in zip(batch, results, answers, strict=True):
        assert result.token_ids == expected, f"{req.request_id}: {tok.decode(result.token_ids)!r}"
    # Arriving together, the document was computed once, not once per conversation.
    shared = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}])))
    computed = sum(r.usage.computed_prompt_tokens for r in results[:NUM_SHARED])
    assert computed < shared + NUM_SHARED * 4 * BLOCK_SIZE


@pytest.fixture(scope="module")
def loaded_default(gguf_path: Path) -> LoadedModel:
    """The same GGUF at the default dtype (bf16 where the CPU has it)."""
    return load_model("smollm2", dtype="auto", device="cpu")


@pytest.mark.timeout(900)
def test_default_dtype_answers_are_the_same_cold_warm_chunked_and_batched(
    loaded_default: LoadedModel,
) -> None:
    """At the default dtype and settings (batch-invariant), greedy answers are bit-identical
    however the prompts reach the model: one at a time without the cache, after the document
    was cached, with prefill cut into 48-token chunks, and all sent at once."""
    tok = loaded_default.tokenizer

    def run(tag: str, **overrides: object) -> list[list[int]]:
        config = EngineConfig(model="smollm2", num_blocks=2048, block_size=BLOCK_SIZE)
        for key, value in overrides.items():
            setattr(config, key, value)
        eng = LLMEngine(config, loaded=loaded_default)
        if tag == "batched":
            return [r.token_ids for r in eng.generate(requests(loaded_default, tag))]
        if tag == "warm":
            eng.generate(requests(loaded_default, "warm-up")[:1])
        return [eng.generate([req])[0].token_ids for req in requests(loaded_default, tag)]

    cold = run("cold", enable_prefix_caching=False)
    assert "Paris" in tok.decode(cold[9])
    for tag, overrides in (
        ("warm", {}),
        ("chunked", {"max_num_batched_tokens": 48, "enable_prefix_caching": False}),
        ("batched", {}),
    ):
        got = run(tag, **overrides)
        for i, (mine, ref) in enumerate(zip(got, cold, strict=True)):
            assert mine == ref, f"{tag} {i}: {tok.decode(mine)!r} != cold {tok.decode(ref)!r}"
