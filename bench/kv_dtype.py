"""fp8 KV pages against the model's dtype: cached tokens per GiB, recomputed tokens at a fixed
KV budget, the quality cost, and decode speed.

- capacity: tokens a GiB of pages holds at each ``--kv-cache-dtype`` (from the pool's own
  page size: every layer's K and V for a block).
- recompute: a fixed KV budget (the Zipf working set's bytes at the model's dtype over each
  of ``--working-set-ratios``, default 2 and 4: the working set twice, then four times, the
  baseline pool) and a trace of ``--zipf-prompts``
  prefixes of ``--zipf-prefix`` tokens with Zipf(1.1) popularity, each request one of them plus
  a question of its own; requests run through the block manager alone (match, allocate, commit,
  free, as hit_rate.py), with the pool each dtype gets from the budget. The figure is the
  prompt tokens recomputed (computed again after an eviction: every miss but each prefix's
  first computation and the questions), the model's dtype over fp8.
- quality: greedy answers through the engine, one engine per KV dtype, requests in the same
  order (the document cached after the first), on ``--prompt-set``: ``fidelity`` (default;
  issue 28's definition) is the SmolLM2 fidelity conversations (tests/fidelity_prompts.py),
  answers of at most 16 tokens ending at EOS; ``document`` is 20 chat prompts (questions over
  a longer slice of the Apache License 2.0, and short prompts), 32 tokens each past EOS.
  Against the model's dtype: greedy agreement (all tokens equal), the first token, and the
  KL divergence of the first token's distribution. The floor those are read against: the
  model's dtype against float32 (the same prompts on a float32 load; ``--no-floor`` skips
  it). Also, at the model's dtype and at fp8: the cached answers against an engine with
  prefix caching off (equal on the batch-invariant kernels; on the torch reference, the
  noise floor of the agreement figure).
- decode: one stream, inter-token latency after a ``--decode-context``-token prompt.

    python bench/kv_dtype.py --json                 # SmolLM2-135M-Instruct, bf16
    python bench/kv_dtype.py --prompt-set document --json   # the stricter 32-token figure
    python bench/kv_dtype.py --model demo --prompts 3 --max-tokens 4 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from hit_rate import BLOCK, replay

from prefixcache.engine.attention import kv_dtype
from prefixcache.engine.config import KV_CACHE_DTYPES, EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.engine_hooks import EngineHooks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fidelity_prompts  # the prompts tests/test_real_model.py checks

GIB = 1024**3
DOCUMENT = Path(__file__).resolve().parent.parent / "examples/documents/apache-license-2.0.txt"
QUESTIONS = [
    "Which version of the Apache License is this?",
    "What does the copyright license allow you to do?",
    "When does the patent license end?",
    "What must you give every recipient of the Work?",
    "What notice must modified files carry?",
    "Does the License let you use the Licensor's trademarks?",
    "What is a Derivative Work?",
    "Who is a Contributor?",
    "What does the Disclaimer of Warranty say?",
    "Can a Contributor be liable for damages?",
    "What may you offer when redistributing the Work?",
    "How do you apply the License to your work?",
]
SHORT = [
    "What is the capital of France?",
    "Write a haiku about bread.",
    "List three colours of the rainbow.",
    "Explain what a prefix cache is in one sentence.",
    "What is 17 times 3?",
    "Name a planet with rings.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'quick'.",
]
DTYPES = [d for d in KV_CACHE_DTYPES if d != "fp8"]  # fp8 is fp8_e4m3


def capacity(loaded: LoadedModel) -> dict[str, dict]:
    out = {}
    for name in DTYPES:
        spec = loaded.kv_cache_spec(BLOCK, kv_dtype.resolve(name, loaded.dtype))
        out[name] = {
            "page_dtype": kv_dtype.name_of(spec.dtype),
            "bytes_per_token": spec.bytes_per_block // BLOCK,
            "tokens_per_gib": GIB // spec.bytes_per_block * BLOCK,
        }
    return out


def zipf_trace(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], int]:
    """The requests, and the tokens any pool computes (each prefix once, every question)."""
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(3, vocab) for _ in range(args.zipf_prefix)] for _ in range(args.zipf_prompts)
    ]
    weights = [1 / (k + 1) ** 1.1 for k in range(args.zipf_prompts)]
    picks = rng.choices(range(args.zipf_prompts), weights, k=args.zipf_requests)
    trace = [prefixes[k] + [rng.randrange(3, vocab) for _ in range(32)] for k in picks]
    return trace, len(set(picks)) * args.zipf_prefix + 32 * len(trace)


def computed(requests: list[list[int]], num_blocks: int) -> int:
    """Prompt tokens a pool of ``num_blocks`` computes over the trace (all but the hits)."""
    stats = replay(requests, num_blocks)
    return stats.query_tokens - stats.hit_tokens


def recompute(args: argparse.Namespace, loaded: LoadedModel, cap: dict[str, dict]) -> list[dict]:
    """Per working-set size (``--working-set-ratios`` times the baseline pool) the tokens each
    KV dtype's pool recomputes from one budget; ratio: baseline over fp8_e4m3 (None when fp8
    recomputes nothing)."""
    base = cap["auto"]["bytes_per_token"]
    working_set = args.zipf_prompts * (args.zipf_prefix + 32) * base
    trace, compulsory = zipf_trace(args, loaded.config.vocab_size)
    out = []
    for ratio in (float(r) for r in args.working_set_ratios.split(",")):
        budget = int(working_set / ratio)
        rows = {}
        for name in DTYPES:
            blocks = max(1, budget // (cap[name]["bytes_per_token"] * BLOCK))
            done = computed(trace, blocks)
            rows[name] = {"pool_blocks": blocks, "computed_tokens": done}
            rows[name]["recomputed_tokens"] = done - compulsory  # computed, evicted, again
        fp8 = rows["fp8_e4m3"]["recomputed_tokens"]
        out.append(
            {
                "working_set_over_pool": ratio,
                "budget_bytes": budget,
                "compulsory_tokens": compulsory,
                "rows": rows,
                "ratio": rows["auto"]["recomputed_tokens"] / fp8 if fp8 else None,
            }
        )
    return out


class Runner:
    """One engine at one KV dtype: greedy answers and first-token logits, in request order."""

    def __init__(self, loaded: LoadedModel, kv: str, caching: bool = True) -> None:
        self.first: dict[str, torch.Tensor] = {}

        def capture(row: torch.Tensor, params: SamplingParams, request_id: str) -> None:
            self.first.setdefault(request_id, row.detach().double().clone())

        config = EngineConfig(
            model=loaded.name,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device="cpu",
            num_blocks=4096,
            kv_cache_dtype=kv,
            enable_prefix_caching=caching,
        )
        self.engine = LLMEngine(config, loaded, EngineHooks(logits_processors=(capture,)))

    def answer(
        self, rid: str, prompt: list[int], sampling: SamplingParams
    ) -> tuple[list[int], torch.Tensor]:
        (result,) = self.engine.generate([EngineRequest(rid, prompt, sampling)])
        return result.token_ids, self.first.pop(rid)


def prompt_set(
    loaded: LoadedModel, name: str, n: int | None, max_tokens: int | None
) -> tuple[list[list[int]], SamplingParams]:
    """The prompts' token ids and how each is answered.

    ``fidelity`` (issue 28's definition): the SmolLM2 fidelity conversations
    (tests/fidelity_prompts.py), 16 new tokens at most, an answer ending at EOS as a user sees
    it. ``document``: 12 questions over a longer slice of the same document and 8 short
    prompts, 32 tokens each past EOS: every answer the same length, a stricter figure."""
    if name == "fidelity":
        chats = list(fidelity_prompts.CONVERSATIONS)
        sampling = SamplingParams(max_tokens=max_tokens or fidelity_prompts.MAX_NEW_TOKENS)
    else:
        system = "Answer questions about the document below.\n\n" + DOCUMENT.read_text()[:6000]
        chats = [
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in QUESTIONS
        ]
        chats += [[{"role": "user", "content": q}] for q in SHORT]
        sampling = SamplingParams(max_tokens=max_tokens or 32, ignore_eos=True)
    tok = loaded.tokenizer
    chats = chats[:n]
    if tok.chat_template:
        return [tok.encode(tok.apply_chat_template(c)) for c in chats], sampling
    return [tok.encode("\n\n".join(m["content"] for m in c)) for c in chats], sampling


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(P || Q) of two next-token distributions (logits), in nats."""
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return float((lp.exp() * (lp - lq)).sum())


Answers = list[tuple[list[int], torch.Tensor]]


def compare(ref: Answers, other: Answers) -> dict[str, float]:
    """``other`` against ``ref``: the share of answers equal in full, of first tokens equal,
    and the first token's KL."""
    kls = [kl(a[1], b[1]) for a, b in zip(ref, other, strict=True)]
    return {
        "agreement": sum(a[0] == b[0] for a, b in zip(ref, other, strict=True)) / len(ref),
        "first_token_kl_mean": statistics.fmean(kls),
        "first_token_kl_max": max(kls),
        "first_token_same": sum(
            int(a[1].argmax()) == int(b[1].argmax()) for a, b in zip(ref, other, strict=True)
        )
        / len(ref),
    }


def quality(args: argparse.Namespace, loaded: LoadedModel) -> dict:
    ids, sampling = prompt_set(loaded, args.prompt_set, args.prompts, args.max_tokens)
    runs: dict[str, Answers] = {}
    for name in progress_iter([*DTYPES, "auto/uncached", "fp8_e4m3/uncached"], "quality runs"):
        kv, _, uncached = name.partition("/")
        runner = Runner(loaded, kv, caching=not uncached)
        runs[name] = [runner.answer(f"{kv}-{i}", p, sampling) for i, p in enumerate(ids)]
    ref = runs["auto"]
    rows = {name: compare(ref, runs[name]) for name in DTYPES[1:]}

    def same(a: str, b: str) -> float:
        return sum(x[0] == y[0] for x, y in zip(runs[a], runs[b], strict=True)) / len(ids)

    out = {
        "prompt_set": args.prompt_set,
        "prompts": len(ids),
        "prompt_tokens_mean": statistics.fmean(len(p) for p in ids),
        "max_tokens": sampling.max_tokens,
        "rows": rows,
        # 1.0 on the batch-invariant kernels by construction; on the torch reference (CPUs
        # without AVX512_BF16) the noise floor the agreement above is read against
        "cached_equals_uncached": {k: same(k, f"{k}/uncached") for k in ("auto", "fp8_e4m3")},
    }
    if args.floor and loaded.dtype != torch.float32:
        # How far the model's own dtype moves the answers: its pages and arithmetic against
        # float32's, the same prompts. A KV format is read against this.
        wide = load_model(args.model, dtype="float32", device="cpu")
        runner = Runner(wide, "auto")
        fp32 = [runner.answer(f"fp32-{i}", p, sampling) for i, p in enumerate(ids)]
        out["model_dtype_vs_float32"] = compare(fp32, ref)
    return out


def decode_itl(args: argparse.Namespace, loaded: LoadedModel) -> dict[str, float]:
    rng = random.Random(1)
    prompt = [rng.randrange(3, loaded.config.vocab_size) for _ in range(args.decode_context)]
    out = {}
    for name in DTYPES:
        engine = Runner(loaded, name).engine
        sampling = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
        engine.add_request(EngineRequest("warmup", prompt, SamplingParams(max_tokens=2)))
        while engine.has_unfinished:
            engine.step()
        engine.add_request(EngineRequest("d", list(prompt), sampling))
        stamps = []
        while engine.has_unfinished:
            engine.step()
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # after the first token
        out[name] = round(statistics.median(gaps) * 1000, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", help="the model's (and the baseline KV's) dtype")
    ap.add_argument(
        "--prompt-set",
        choices=("fidelity", "document"),
        default="fidelity",
        help="the quality prompts (prompt_set()): the SmolLM2 fidelity conversations, 16 "
        "tokens to EOS (issue 28's definition), or 20 document and short prompts, 32 tokens",
    )
    ap.add_argument("--prompts", type=int, default=None, help="the first N of the set")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the set's")
    ap.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the model's dtype against float32 (the quality figures' noise floor)",
    )
    ap.add_argument("--zipf-prompts", type=int, default=40)
    ap.add_argument("--zipf-prefix", type=int, default=1024)
    ap.add_argument("--zipf-requests", type=int, default=2000)
    ap.add_argument(
        "--working-set-ratios",
        default="2,4",
        help="Zipf working set over the baseline pool, one KV budget each (comma-separated)",
    )
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    cap = capacity(loaded)
    result: dict[str, object] = {
        "cpu": cpu_model_name(),
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "capacity": cap,
        "tokens_per_gib_ratio": cap["fp8_e4m3"]["tokens_per_gib"] / cap["auto"]["tokens_per_gib"],
    }
    result["recompute"] = rec = recompute(args, loaded, cap)
    result["recompute_ratio"] = rec[0]["ratio"]  # the first working set (2x the pool)
    result["quality"] = q = quality(args, loaded)
    result["agreement"] = q["rows"]["fp8_e4m3"]["agreement"]
    result["first_token_kl"] = q["rows"]["fp8_e4m3"]["first_token_kl_mean"]
    result["decode_itl_ms"] = itl = decode_itl(args, loaded)
    result["decode_itl_ratio"] = itl["fp8_e4m3"] / itl["auto"]
    print(f"CPU: {result['cpu']}; {loaded.name} {result['dtype']}")
    for name in DTYPES:
        again = ", ".join(
            f"{r['rows'][name]['recomputed_tokens']} at {r['working_set_over_pool']:g}x"
            for r in rec
        )
        print(
            f"{name:>9}: {cap[name]['tokens_per_gib']:>9} tokens/GiB; recomputed {again} "
            f"(working set / pool); decode ITL {itl[name]} ms"
        )
    for name, row in q["rows"].items():
        print(
            f"{name:>9} vs {result['dtype']}: agreement {row['agreement']:.3f}, first-token KL "
            f"mean {row['first_token_kl_mean']:.5f} max {row['first_token_kl_max']:.5f}"
        )
    if "model_dtype_vs_float32" in q:
        row = q["model_dtype_vs_float32"]
        print(
            f"{result['dtype']:>9} vs float32 (the floor): agreement {row['agreement']:.3f}, "
            f"first token the same {row['first_token_same']:.3f}"
        )
    print(f"cached == uncached answers: {q['cached_equals_uncached']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
