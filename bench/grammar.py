"""Constrained decoding's own cost: grammar compile time and mask time per step.

    .venv/bin/python bench/grammar.py [--json] [--vocab demo|smollm2] [--impl MODULE:CLASS]

1. Compile: ``--schemas`` JSON schemas drawn from tests/test_structured_output.py's
   hypothesis strategy (saved to ``--schema-file`` on first use, so that two runs compare
   the same schemas), each compiled by a fresh ``StructuredOutput.compile`` and given a
   matcher (``add``); total and median per schema.
2. Mask: ``--batch`` constrained requests over those schemas; each step masks a random
   logits batch, takes each row's best allowed token and accepts it (a finished request is
   replaced); the median ``mask`` time per step over ``--steps``.

``--impl`` measures another class with the same interface (e.g. the xgrammar version this
replaced, copied out of git), for the comparison in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import GrammarSpec
from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sdk.canonical import canonical_json

ROOT = Path(__file__).resolve().parent.parent


def draw_schemas(count: int, path: Path) -> list[dict]:
    if path.is_file():
        schemas = json.loads(path.read_text())
        if len(schemas) >= count:
            return schemas[:count]
    sys.path.insert(0, str(ROOT / "tests"))
    from hypothesis.errors import NonInteractiveExampleWarning
    from test_structured_output import TOP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        schemas = [TOP.example() for _ in range(count)]
    path.write_text(json.dumps(schemas))
    return schemas


def tokenizer_of(name: str) -> tuple[Tokenizer, int]:
    if name == "demo":
        from prefixcache.engine.model.loader import load_model

        loaded = load_model("demo", dtype="float32", device="cpu")
        return loaded.tokenizer, loaded.config.vocab_size
    from gguf import GGUFReader

    from prefixcache.engine.model.gguf_loader import read_metadata
    from prefixcache.engine.model.named_models import ensure_named_model

    meta = read_metadata(GGUFReader(ensure_named_model(name)))
    tok = Tokenizer.from_gguf(meta)
    return tok, tok.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="demo", help="demo or smollm2 (its tokenizer only)")
    parser.add_argument(
        "--impl", default="prefixcache.engine.step.structured_output:StructuredOutput"
    )
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--schema-file", default="/tmp/prefixcache-grammar-schemas.json")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    module, name = args.impl.split(":")
    cls: Any = getattr(importlib.import_module(module), name)
    tok, vocab = tokenizer_of(args.vocab)
    schemas = [canonical_json(s) for s in draw_schemas(args.schemas, Path(args.schema_file))]

    start = time.perf_counter()
    warm = cls(tok, vocab)
    warm.compile(GrammarSpec("json"))  # the vocabulary's one-time setup
    setup_s = time.perf_counter() - start
    per_schema, refused = [], 0
    for i, schema in enumerate(progress_iter(schemas, "compile")):
        so = cls(tok, vocab)
        so._compiler, so._lltok = getattr(warm, "_compiler", None), getattr(warm, "_lltok", None)
        so._executor = getattr(warm, "_executor", None)
        start = time.perf_counter()
        try:
            so.add(f"c{i}", GrammarSpec("json_schema", schema))
        except ValueError:
            refused += 1
        per_schema.append(time.perf_counter() - start)

    so = warm
    usable = [s for s in schemas if _usable(so, s)]
    gen = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(args.batch)]
    for i, rid in enumerate(ids):
        so.add(rid, GrammarSpec("json_schema", usable[i % len(usable)]))
    stops = set(tok.eos_token_ids)
    fresh = args.batch
    mask_s = []
    for _ in progress_iter(range(args.steps), f"mask, batch {args.batch}"):
        logits = torch.randn((args.batch, vocab), generator=gen)
        start = time.perf_counter()
        so.mask(logits, ids)
        mask_s.append(time.perf_counter() - start)
        tokens = logits.argmax(dim=-1).tolist()
        so.accept(ids, tokens)
        for k, token in enumerate(tokens):
            if token in stops:  # finished: a new request on the next schema
                so.forget(ids[k])
                ids[k] = f"r{fresh}"
                so.add(ids[k], GrammarSpec("json_schema", usable[fresh % len(usable)]))
                fresh += 1
    out = {
        "bench": "grammar",
        "impl": args.impl,
        "vocab": args.vocab,
        "vocab_size": vocab,
        "setup_s": setup_s,
        "schemas": len(schemas),
        "refused": refused,
        "compile_total_s": sum(per_schema),
        "compile_median_ms": statistics.median(per_schema) * 1e3,
        "compile_max_ms": max(per_schema) * 1e3,
        "batch": args.batch,
        "mask_median_ms": statistics.median(mask_s) * 1e3,
        "mask_p90_ms": sorted(mask_s)[int(0.9 * len(mask_s))] * 1e3,
        "requests_finished": fresh - args.batch,
    }
    print(
        f"{args.impl.split(':')[0]} ({args.vocab}, vocab {vocab}): setup {setup_s:.2f} s; "
        f"{len(schemas)} schemas compiled in {out['compile_total_s']:.2f} s "
        f"(median {out['compile_median_ms']:.1f} ms, max {out['compile_max_ms']:.0f} ms, "
        f"{refused} refused); mask at batch {args.batch}: median {out['mask_median_ms']:.2f} ms "
        f"(p90 {out['mask_p90_ms']:.2f} ms)"
    )
    if args.json:
        print(json.dumps(out))


def _usable(so: Any, schema: str) -> bool:
    try:
        so.compile(GrammarSpec("json_schema", schema))
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
