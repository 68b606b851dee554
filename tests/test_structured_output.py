"""Constrained decoding on the random demo model: hypothesis-generated JSON schemas, batched
several per step; every output that ends with "stop" parses and validates; unconstrained
requests in the same batch sample exactly what they sample alone; grammars compile once."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.grammar import closed_objects, compiled_grammar
from prefixcache.engine.request import EngineRequest, GrammarSpec, SamplingParams
from prefixcache.sdk.canonical import canonical_json

pytest.importorskip("llguidance")

NAMES = st.sampled_from(["id", "name", "tags", "score", "ok", "kind", "items", "meta"])
WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)

LEAVES = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(0, 2)),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(WORDS | st.integers(0, 9), min_size=1, max_size=4, unique=True),
    ),
    st.builds(lambda v: {"const": v}, WORDS),
)


def objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(props: dict[str, dict], required: list[bool]) -> dict:
        names = list(props)
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(names, required, strict=False) if r],
        }

    return st.builds(
        build,
        st.dictionaries(NAMES, children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
    )


def arrays(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.builds(
        lambda items, lo, extra: {
            "type": "array",
            "items": items,
            "minItems": lo,
            "maxItems": lo + extra,
        },
        children,
        st.integers(0, 2),
        st.integers(0, 2),
    )


SCHEMAS = st.recursive(LEAVES, lambda c: objects(c) | arrays(c), max_leaves=6)
TOP = objects(SCHEMAS) | arrays(SCHEMAS) | SCHEMAS


@pytest.fixture(scope="module")
def engine(demo_loaded: Any) -> LLMEngine:
    config = EngineConfig(
        model="demo", dtype="float32", device="cpu", attention_backend="torch", num_blocks=512
    )
    return LLMEngine(config, loaded=demo_loaded)


PROMPT_TEXT = "Reply with JSON only:"
RESULTS = {"stop": 0, "length": 0}
IDS = itertools.count()


@given(schemas=st.lists(TOP, min_size=25, max_size=25), seed=st.integers(0, 2**31))
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_constrained_outputs_parse_and_validate(
    engine: LLMEngine, schemas: list[dict], seed: int
) -> None:
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    requests = []
    for i, schema in enumerate(schemas):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        sampling = SamplingParams(
            max_tokens=32, temperature=0.0 if i % 4 == 0 else 1.0, seed=seed + i, grammar=spec
        )
        requests.append(EngineRequest(f"s{next(IDS)}", prompt, sampling))
    for schema, result in zip(schemas, engine.generate(requests), strict=True):
        RESULTS[result.finish_reason] += 1
        if result.finish_reason == "length":
            continue
        assert result.finish_reason == "stop"
        value = json.loads(result.text)
        jsonschema.validate(value, schema)
        assert_in_schema_order(value, schema)


def assert_in_schema_order(value: Any, schema: dict) -> None:
    """Every object's keys come in the order its schema's properties are written in (OpenAI's
    Structured Outputs contract), at every depth."""
    if isinstance(value, dict) and "properties" in schema:
        order = list(schema["properties"])
        keys = list(value)
        assert keys == sorted(keys, key=order.index), (keys, order)
        for key in keys:
            assert_in_schema_order(value[key], schema["properties"][key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            assert_in_schema_order(item, schema["items"])


def test_most_constrained_outputs_finish() -> None:
    """The validation above is not vacuous: most outputs ended inside max_tokens."""
    total = RESULTS["stop"] + RESULTS["length"]
    if total == 0:
        pytest.skip("runs after test_constrained_outputs_parse_and_validate")
    assert total >= 200
    assert RESULTS["stop"] >= total * 0.25, RESULTS


def test_json_object_mode_gives_objects(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    requests = [
        EngineRequest(
            f"obj-{i}",
            prompt,
            SamplingParams(max_tokens=64, temperature=1.0, seed=i, grammar=GrammarSpec("json")),
        )
        # The random model rarely closes an open-ended key: 16 draws, so that some finish
        for i in range(16)
    ]
    results = engine.generate(requests)
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished
    for r in finished:
        assert isinstance(json.loads(r.text), dict)


def test_unconstrained_requests_in_a_constrained_batch_sample_the_same(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    plain = [tok.encode(t) for t in ("The cache", "A block of tokens is", "Prefix sharing")]
    params = [
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=16, temperature=0.9, seed=7),
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=3),
    ]
    alone = [
        engine.generate([EngineRequest(f"alone-{i}", p, s)])[0].token_ids
        for i, (p, s) in enumerate(zip(plain, params, strict=True))
    ]
    schema = canonical_json(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    mixed: list[EngineRequest] = []
    for i, (p, s) in enumerate(zip(plain, params, strict=True)):
        mixed.append(
            EngineRequest(
                f"mixed-{i}",
                p,
                SamplingParams(
                    **{f: getattr(s, f) for f in ("max_tokens", "temperature", "top_k", "seed")}
                ),
            )
        )
        grammar = GrammarSpec("json_schema", schema) if i % 2 else GrammarSpec("json")
        mixed.append(
            EngineRequest(
                f"constrained-{i}",
                p,
                SamplingParams(max_tokens=16, temperature=1.0, seed=i, grammar=grammar),
            )
        )
    results = {r.request_id: r for r in engine.generate(mixed)}
    assert [results[f"mixed-{i}"].token_ids for i in range(3)] == alone
    # and the constrained ones were constrained
    assert all(results[f"constrained-{i}"].text.startswith("{") for i in range(3))


def test_grammars_compile_once_per_schema(engine: LLMEngine) -> None:
    schema = canonical_json(
        {"type": "object", "properties": {"z": {"enum": ["q", "r"]}}, "required": ["z"]}
    )
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    before = engine.structured.num_compiled
    for round_ in range(3):
        requests = [
            EngineRequest(
                f"c{round_}-{i}",
                prompt,
                SamplingParams(max_tokens=16, grammar=GrammarSpec("json_schema", schema)),
            )
            for i in range(2)
        ]
        for r in engine.generate(requests):
            assert json.loads(r.text)["z"] in ("q", "r")
    assert engine.structured.num_compiled == before + 1
    assert "c2-0" not in engine.structured  # matchers are dropped when requests end


def test_a_schema_the_grammar_engine_refuses_is_a_value_error(engine: LLMEngine) -> None:
    bad = GrammarSpec(
        "json_schema", canonical_json({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    )
    with pytest.raises(ValueError, match="JSON schema"):
        engine.add_request(
            EngineRequest("bad", engine.tokenizer.encode("x"), SamplingParams(grammar=bad))
        )
    assert not engine.has_unfinished


def test_a_finished_grammar_with_ignore_eos_does_not_break_the_step(engine: LLMEngine) -> None:
    """After the value ends only the stop token is allowed; with ignore_eos the request goes
    on past it, unconstrained, and the rest of the batch is unharmed."""
    schema = canonical_json({"enum": ["a"]})
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    grammar = GrammarSpec("json_schema", schema)
    requests = [
        EngineRequest(
            "eos-ignored", prompt, SamplingParams(max_tokens=8, ignore_eos=True, grammar=grammar)
        ),
        EngineRequest("plain-neighbour", prompt, SamplingParams(max_tokens=8)),
    ]
    ignored, plain = engine.generate(requests)
    assert ignored.finish_reason == "length" and ignored.text.startswith('"a"')
    assert (
        plain.token_ids
        == engine.generate([EngineRequest("plain-alone", prompt, SamplingParams(max_tokens=8))])[
            0
        ].token_ids
    )


def test_objects_allow_only_their_named_properties_unless_the_schema_says() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "type": {"type": "string"},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {"type": "null"}}}},
        },
        "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "integer"}]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == {"properties", "type", "open", "list"}  # names untouched
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["type"]
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


def test_a_json_schema_output_holds_no_undeclared_property(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    spec = GrammarSpec("json_schema", canonical_json(schema))
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    requests = [
        EngineRequest(f"closed-{i}", prompt, SamplingParams(max_tokens=16, seed=i, grammar=spec))
        for i in range(8)
    ]
    for r in engine.generate(requests):
        if r.finish_reason == "stop":
            assert set(json.loads(r.text)) <= {"a"}, r.text


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    ],
)
def test_a_schema_whose_refs_only_loop_is_refused(schema: dict) -> None:
    """It compiled, then allowed only the stop token: an empty answer that is no JSON (200 on
    every API); now a ValueError (the sidecar's 400) naming why. Recursion with content stays."""
    with pytest.raises(ValueError, match="allows no JSON value"):
        compiled_grammar(GrammarSpec("json_schema", canonical_json(schema)))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert compiled_grammar(GrammarSpec("json_schema", canonical_json(tree)))
