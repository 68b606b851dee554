"""Tokenizer (tokenizer.json via the ``tokenizers`` package, or a GGUF file's metadata), chat
template, detokenizing.

The chat template comes from ``chat_template.jinja`` (newer transformers) or the
``chat_template`` field of ``tokenizer_config.json``, rendered in a sandboxed jinja2 env that
offers what transformers' ``apply_chat_template`` offers (loop controls, ``{% generation %}``,
``strftime_now``, ``tojson``, ``raise_exception``, the special tokens).

``encode(text, add_special_tokens=True)`` adds what ``AutoTokenizer(text)`` adds: whatever
tokenizer.json's post-processor adds. Like transformers 5 when a tokenizer.json is present,
``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json are not consulted (transformers
writes them into the post-processor when it saves the file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from tokenizers import Tokenizer as HFTokenizer

from ..heap import release_freed_heap
from .piece_encoder import PieceEncoder

log = logging.getLogger("prefixcache.engine")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable."""


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception, an undefined value, ...)."""


class TokenizerSpec(msgspec.Struct, array_like=True):
    """Everything a ``Tokenizer`` is built from, so that another process builds the same one
    (ProcessEngine's core sends its API side this): same ids, template, stops, fingerprint."""

    pipeline: str  # tokenizer.json text: the tokenizers pipeline and the fingerprint's source
    chat_template: str | None
    bos_token: str | None
    eos_tokens: list[str]
    eos_token_ids: list[int]
    special_tokens: dict[str, str]


class _PipelineHead(msgspec.Struct):
    """What this module and the piece encoder read of a tokenizer.json."""

    decoder: Any = None
    pre_tokenizer: Any = None
    added_tokens: Any = None


# Told a tokenizer's spec as soon as loading knows it (loader.load_model's on_tokenizer).
TokenizerListener = Callable[[TokenizerSpec], None]


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        extra_eos_ids: Sequence[int] = (),
        fingerprint_source: bytes = b"",
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        # The pipeline's own text (tokenizer.json, or a GGUF file's rebuilt one): the
        # fingerprint's source, and what to_spec sends.
        self._source = fingerprint_source or tokenizer.to_str().encode()
        # As transformers encodes a prompt (truncation=False, padding=False): whatever
        # tokenizer.json says about truncation or padding must not cut or pad our prompts.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        _no_word_cache(tokenizer)
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        # What templates see as bos_token, eos_token, unk_token, pad_token, ...
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.special_tokens.setdefault("bos_token", bos_token or "")
        self.special_tokens.setdefault("eos_token", eos_tokens[0] if eos_tokens else "")
        # The source's parts read below, not its vocabulary: json.loads(to_str()) took 1.7-2 s
        # for Gemma 3's 262K (twice a server start: core and API side), this 0.03 s.
        head = msgspec.json.decode(self._source, type=_PipelineHead)
        pipeline = msgspec.structs.asdict(head)
        self._byte_level = _is_byte_level(pipeline)
        self._byte_decoder = _gpt2_byte_decoder()
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self._pieces = PieceEncoder.create(tokenizer, pipeline=pipeline)
        self._post_wrap = _post_processor_wrap(tokenizer) if self._pieces else None
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        eos_ids = [tokenizer.token_to_id(t) for t in eos_tokens]
        eos_ids += list(extra_eos_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self._eos_tokens = list(eos_tokens)
        self._template = None if chat_template is None else compile_template(chat_template)
        h = hashlib.sha256(self._source)
        h.update(json.dumps([chat_template, bos_token, list(eos_tokens)]).encode())
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())  # what templates see
        h.update(json.dumps(self.eos_token_ids).encode())
        self.fingerprint = h.hexdigest()[:32]
        # Parsing a pipeline frees most of what it allocates, and the heap keeps it: Gemma 3's
        # (262K tokens, 515K merges) held 350 MB, 80 once handed back.
        release_freed_heap()

    @classmethod
    def from_folder(cls, folder: str | Path, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{folder}: tokenizer.json not found (a fast tokenizer file is required)"
            )
        raw = tok_file.read_bytes()
        try:
            tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise TokenizerError(
                f"{tok_file}: cannot be read by the tokenizers package: {e}"
            ) from e
        cfg: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = _read_chat_template(folder, cfg)
        bos = _token_str(cfg.get("bos_token"))
        eos = _token_str(cfg.get("eos_token"))
        specials = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_str(cfg.get(k)))}
        return cls(
            tok,
            chat_template=template,
            bos_token=bos,
            eos_tokens=[eos] if eos else [],
            extra_eos_ids=extra_eos_ids,
            fingerprint_source=raw,
            special_tokens=specials,
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        """From a GGUF file's ``tokenizer.*`` metadata (engine/text/gguf_tokenizer.py rebuilds the
        pipeline); the fingerprint covers the rebuilt tokenizer.json."""
        from .gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer

        try:
            parts = build_gguf_tokenizer(metadata)
        except GGUFTokenizerError as exc:
            raise TokenizerError(str(exc)) from exc
        except Exception as exc:  # the tokenizers package refusing the vocabulary or merges
            raise TokenizerError(f"the GGUF tokenizer metadata cannot be used: {exc}") from exc
        return cls(
            parts.tokenizer,
            chat_template=parts.chat_template,
            bos_token=parts.bos_token,
            eos_tokens=parts.eos_tokens,
            extra_eos_ids=extra_eos_ids,
            fingerprint_source=parts.tokenizer.to_str().encode(),
            special_tokens=parts.special_tokens,
        )

    def to_spec(self) -> TokenizerSpec:
        return TokenizerSpec(
            pipeline=self._source.decode("utf-8"),
            chat_template=self.chat_template,
            bos_token=self.bos_token,
            eos_tokens=list(self._eos_tokens),
            eos_token_ids=list(self.eos_token_ids),
            special_tokens=dict(self.special_tokens),
        )

    @classmethod
    def from_spec(cls, spec: TokenizerSpec, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer ``to_spec`` described, built anew (torch-free, no model files read);
        ``chat_template`` replaces the spec's (``--chat-template``)."""
        return cls(
            HFTokenizer.from_str(spec.pipeline),
            chat_template=spec.chat_template if chat_template is None else chat_template,
            bos_token=spec.bos_token,
            eos_tokens=spec.eos_tokens,
            extra_eos_ids=spec.eos_token_ids,  # the eos tokens' ids first, then the extras
            fingerprint_source=spec.pipeline.encode("utf-8"),
            special_tokens=spec.special_tokens,
        )

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with ``chat_template`` in place of its own (``--chat-template``): what
        ``from_spec(to_spec(), chat_template)`` builds, on the same pipeline object."""
        return Tokenizer(
            self._tok,
            chat_template=chat_template,
            bos_token=self.bos_token,
            eos_tokens=self._eos_tokens,
            extra_eos_ids=self.eos_token_ids,
            fingerprint_source=self._source,
            special_tokens=self.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, namespace: str = "") -> list[int]:
        """``text``'s ids; the piece memo is used under the caller's cache ``namespace``."""
        if self._pieces is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return self._pieces.encode(text, namespace)
        if self._post_wrap is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        before, after = self._post_wrap
        return before + self._pieces.encode(text, namespace) + after

    def forget(self, text: str, namespace: str = "") -> None:
        """Keep nothing of ``text`` (encoded for a request that was refused) in the memo."""
        if self._pieces is not None:
            self._pieces.forget(text, namespace)

    @property
    def piece_cache(self) -> PieceEncoder | None:
        """The memo of text between special tokens, or None where it could change ids."""
        return self._pieces

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Added tokens marked special (control tokens, skipped when decoding)."""
        added = self._tok.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's string for a token (``convert_ids_to_tokens``: e.g. "Ġthe")."""
        return self._tok.id_to_token(token_id) or ""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (part of a UTF-8 character for some tokens)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            return piece.encode()
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The rendered conversation; ``extra`` are more template variables (chat_template_kwargs)."""
        from jinja2.exceptions import TemplateError

        if self._template is None:  # a base model: chat needs a template, completions do not
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json or chat_template.jinja); "
                "send a plain prompt to /v1/completions instead"
            )
        try:
            variables = {**self.special_tokens, "tools": None, "documents": None, **extra}
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except TemplateError as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from exc


def _no_word_cache(tok: HFTokenizer) -> None:
    """Turn off the model's own word cache (BPE and Unigram remember the words they split):
    one cache per tokenizer, shared by every namespace, so a word another tenant sent would
    encode faster. The piece memo, keyed by namespace, is the cache that pays; without the
    word cache a memo miss costs ~20 % more (docs/security.md)."""
    resize = getattr(tok.model, "_resize_cache", None)  # BPE, Unigram in recent tokenizers
    if resize is not None:
        resize(0)
    elif type(tok.model).__name__ in ("BPE", "Unigram"):
        log.warning("this tokenizers version cannot turn off its shared word cache: upgrade it")


def _post_processor_wrap(tok: HFTokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after one sequence, if that is all it does."""
    wraps = set()
    for probe in ("a", "Hello world, again"):
        inner = tok.encode(probe, add_special_tokens=False).ids
        outer = tok.encode(probe, add_special_tokens=True).ids
        starts = [
            i for i in range(len(outer) - len(inner) + 1) if outer[i : i + len(inner)] == inner
        ]
        if len(starts) != 1:
            return None
        start = starts[0]
        wraps.add((tuple(outer[:start]), tuple(outer[start + len(inner) :])))
    if len(wraps) != 1:
        return None
    before, after = wraps.pop()
    return list(before), list(after)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken saved as {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _is_byte_level(pipeline: dict[str, Any]) -> bool:
    """GPT-2 style byte-level BPE (``pipeline``: the tokenizer's JSON): tokens are bytes
    spelled with the GPT-2 byte alphabet."""
    decoder = pipeline.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def _gpt2_byte_decoder() -> dict[str, int]:
    """The GPT-2 byte alphabet, reversed: printable bytes stand for themselves, the other
    bytes for code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    keep = set(printable)
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def compile_template(source: str) -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; here it renders its body unchanged."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
