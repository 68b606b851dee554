"""Encoding piece by piece between special tokens gives a whole-text encode's ids, exactly.

The sidecar encodes every chat prompt this way so that a long system prompt is tokenized once.
Tokenizers are built here from the demo vocabulary (byte-level BPE) and a SentencePiece-style
Metaspace BPE trained on the demo corpus, each with every prepend scheme.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from prefixcache.engine.text.piece_encoder import PieceEncoder
from prefixcache.engine.text.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "model" / "demo_assets"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|im_start|>x", "[INST]", "[/INST]", "<s>"]
FRAGMENTS = [
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "a",
    "Hello",
    " world",
    "café",
    "東京",
    "🙂",
    "123",
    "x=y;",
    "<|im",  # part of a special token: must stay text
    "_end|>",
    *SPECIALS,
]


def with_specials(tok: HFTokenizer, *, lstrip: bool = False) -> HFTokenizer:
    tok.add_special_tokens([AddedToken(t, lstrip=lstrip, normalized=False) for t in SPECIALS])
    return tok


def byte_level() -> HFTokenizer:
    tok = with_specials(HFTokenizer.from_file(str(ASSETS / "tokenizer.json")))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", bos)]
    )
    return tok


def metaspace(scheme: str, *, lstrip: bool = False) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train(
        [str(ASSETS / "corpus.txt")],
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *alphabet]),
    )
    return with_specials(tok, lstrip=lstrip)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, HFTokenizer]:
    return {
        "byte_level": byte_level(),
        "metaspace_always": metaspace("always"),
        "metaspace_never": metaspace("never"),
        "metaspace_first": metaspace("first"),
        "lstrip_special": metaspace("always", lstrip=True),
    }


texts = st.lists(st.sampled_from(FRAGMENTS), max_size=24).map("".join)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace_always", "metaspace_never"])
@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_piece_encode_equals_whole_encode(
    tokenizers: dict[str, HFTokenizer], kind: str, text: str
) -> None:
    hf = tokenizers[kind]
    tok = Tokenizer(hf)
    assert tok.piece_cache is not None
    for add_special_tokens in (False, True):
        expected = hf.encode(text, add_special_tokens=add_special_tokens).ids
        assert tok.encode(text, add_special_tokens) == expected
        assert tok.encode(text, add_special_tokens) == expected  # now from the cache


@pytest.mark.parametrize("kind", ["metaspace_first", "lstrip_special"])
def test_position_dependent_tokenizers_encode_whole(
    tokenizers: dict[str, HFTokenizer], kind: str
) -> None:
    hf = tokenizers[kind]
    tok = Tokenizer(hf)
    assert tok.piece_cache is None
    text = "Hello<|im_start|> world [INST]x"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_probes_catch_a_position_dependent_pre_tokenizer(
    tokenizers: dict[str, HFTokenizer],
) -> None:
    """If the configuration check missed Metaspace "first", the probe strings would not."""
    encoder = PieceEncoder(tokenizers["metaspace_first"], SPECIALS)
    assert not encoder._agrees_on_probes(SPECIALS)


def test_repeated_pieces_come_from_the_cache(tokenizers: dict[str, HFTokenizer]) -> None:
    hf = tokenizers["byte_level"]
    tok = Tokenizer(hf)
    cache = tok.piece_cache
    assert cache is not None
    system = "You answer questions about train timetables. " * 50
    for question in ("When does train 1 leave?", "And train 2?", "Is train 3 late?"):
        text = f"<|im_start|>system\n{system}<|im_end|><|im_start|>user\n{question}<|im_end|>"
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    # "system\n...", "user\n<question>" x3: the system prompt was encoded once
    assert cache.stats.misses == 4
    assert cache.stats.hits == 2


def test_cache_stays_within_its_character_budget(tokenizers: dict[str, HFTokenizer]) -> None:
    hf = tokenizers["byte_level"]
    encoder = PieceEncoder.create(hf, max_chars=200)
    assert encoder is not None
    for i in range(50):
        text = f"[INST] question {i} " * 3 + "[/INST]" + "answer " * i
        assert encoder.encode(text) == hf.encode(text, add_special_tokens=False).ids
        assert encoder.stats.chars <= 200
    assert encoder.stats.entries == len(encoder._pieces)
    big = "x" * 500  # longer than the whole budget: encoded, never stored
    assert encoder.encode(big) == hf.encode(big, add_special_tokens=False).ids
    assert ("", big) not in encoder._pieces


def test_truncation_and_padding_in_tokenizer_json_never_cut_a_prompt(
    tokenizers: dict[str, HFTokenizer],
) -> None:
    """transformers encodes prompts with truncation and padding off; so do we."""
    hf = HFTokenizer.from_str(tokenizers["byte_level"].to_str())
    hf.enable_truncation(max_length=8)
    hf.enable_padding(length=64)
    assert PieceEncoder.create(hf) is None  # pieces would be cut and padded one by one
    text = "<|im_start|>system\n" + "Hello world " * 40 + "<|im_end|>"
    tok = Tokenizer(hf)
    reference = HFTokenizer.from_str(tokenizers["byte_level"].to_str())
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert len(tok.encode(text)) > 64 and tok.piece_cache is not None


@pytest.mark.parametrize(
    "kind", ["byte_level", "metaspace_always", "metaspace_first", "lstrip_special"]
)
def test_tokenizer_reads_its_pipeline_as_a_whole_parse_does(
    tokenizers: dict[str, HFTokenizer], kind: str
) -> None:
    """``Tokenizer`` decodes only the pipeline's decoder, pre-tokenizer and added tokens (not
    its vocabulary): the piece encoder and the byte-level reading it sets up are those of a
    whole parse, built directly and through ``to_spec`` / ``from_spec``."""
    tok = tokenizers[kind]
    whole = PieceEncoder.create(tok)  # parses tok.to_str() whole
    for built in (Tokenizer(tok), Tokenizer.from_spec(Tokenizer(tok).to_spec())):
        assert (built.piece_cache is None) == (whole is None)
        if whole is not None:
            assert built.piece_cache._split.pattern == whole._split.pattern
    if kind == "byte_level":  # "Ġthe" stands for the bytes " the"
        (the,) = tok.encode(" the", add_special_tokens=False).ids
        assert tok.id_to_token(the) == "\u0120the"
        assert Tokenizer.from_spec(Tokenizer(tok).to_spec()).token_bytes(the) == b" the"
