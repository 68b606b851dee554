"""A ``tokenizers`` pipeline rebuilt from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges or scores, token
types and special token ids as metadata. Two kinds are rebuilt here:

- ``gpt2``: byte-level BPE with the file's merges; text is split by the regex that the
  file's ``tokenizer.ggml.pre`` names (GPT-2's own for names not listed, as transformers does).
- ``llama``: SentencePiece-style BPE (Metaspace, byte fallback) whose merges are derived from
  the vocabulary and its scores: every way to cut a token in two known halves, best score first.
- ``llama`` in a Gemma file (``general.architecture`` gemma, gemma2, gemma3): as transformers'
  GGUF converter builds it, ``GemmaTokenizer``'s pipeline (spaces normalized to U+2581, no
  prefix space), whitespace-only tokens respelled with U+2581, and merges ranked by the
  tokens' order in the file, not their scores (Gemma's scores do not follow its merge order).

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole in text. ``add_bos_token`` / ``add_eos_token`` become the
post-processor, so ``encode(text, add_special_tokens=True)`` adds them as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 6 byte)
SPM_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's names).
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing, of an unsupported kind, or inconsistent."""


@dataclass(slots=True)
class GGUFTokenizerParts:
    """What ``Tokenizer`` needs: the pipeline and the special tokens, as strings."""

    tokenizer: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_tokens: list[str]  # eos first, then eot / eom where the file names them
    special_tokens: dict[str, str] = field(default_factory=dict)  # what templates see


def build_gguf_tokenizer(meta: dict[str, Any]) -> GGUFTokenizerParts:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFTokenizerError(
            f"unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model): prefixcache reads "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFTokenizerError("the GGUF file has no tokenizer.ggml.tokens")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFTokenizerError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        add_bos_default = False
    elif meta.get("general.architecture") in GEMMA_ARCHITECTURES:
        tok = _gemma_bpe(tokens, token_of("unknown_token_id"))
        add_bos_default = True
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFTokenizerError(
                "a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores"
            )
        add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece_bpe(
            tokens, list(scores), token_of("unknown_token_id"), add_prefix_space
        )
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary by default

    byte_alphabet = set(_gpt2_bytes_to_unicode().values())
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, types, strict=True)
        if kind_ == CONTROL and (kind != "gpt2" or set(t) <= byte_alphabet)
    ]
    tok.add_special_tokens(control)
    # As transformers: only those the vocabulary holds as spelled (a Gemma file's user-defined
    # runs of spaces are in it as U+2581 runs, and stay plain tokens).
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind_ in zip(tokens, types, strict=True)
        if kind_ == USER_DEFINED and tok.token_to_id(t) is not None
    ]
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFTokenizerError(
            f"the rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids for "
            f"{len(tokens)} tokens in the file (duplicate token strings?)"
        )

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tok.post_processor = _post_processor(tok, bos if add_bos else None, eos if add_eos else None)

    eos_tokens = [t for t in (eos, token_of("eot_token_id"), token_of("eom_token_id")) if t]
    specials = {
        name: value
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if (value := token_of(key)) is not None
    }
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizerParts(
        tokenizer=tok,
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos,
        eos_tokens=list(dict.fromkeys(eos_tokens)),
        special_tokens=specials,
    )


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> HFTokenizer:
    spelling = _gpt2_bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (a few files store added tokens as plain UTF-8) are
    # respelled byte by byte, so that the BPE model can hold them.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="")
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_level_pre_tokenizer(pre: Any) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(str(pre))
    if split is None:  # GPT-2's regex, as transformers falls back to
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], unk: str | None, add_prefix_space: bool
) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _gemma_bpe(tokens: list[str], unk: str | None) -> HFTokenizer:
    respelled = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=ordered_merges(respelled),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def ordered_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Merges ranked by the merged token's place in the vocabulary (earlier first), then the
    longer left half, then the longer right half; a token's own splits by their halves' ids
    (transformers' ``generate_merges`` with each token scored by minus its index)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: -i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, int]] = []
    for token, score in rank.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce a SentencePiece vocabulary: every split of a token into two
    tokens of the vocabulary, ordered by the whole token's score (best first), then by the
    longer left half, then the longer right half; ties keep the vocabulary's order."""
    known = set(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in known and right in known:
                ranked.append((-float(score), -len(left), -len(right), left, right))
    ranked.sort(key=lambda r: r[:3])  # a stable sort: ties stay in vocabulary order
    return [(r[3], r[4]) for r in ranked]


def _post_processor(tok: HFTokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    def sequence(name: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos else []
        parts.append(f"${name}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if eos else []))

    special = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=f"{sequence('A', 0)} {sequence('B', 1)}",
        special_tokens=special,
    )


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others for code
    points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    keep = set(printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in keep)})
    return table
