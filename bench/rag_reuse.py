"""RAG documents reused at any position: TTFT and the quality cost of position-independent KV.

A corpus of --passages passages (150-300 tokens each, built here, each holding facts about a
made-up town) and one question per fact asked. Every prompt is a system text, the top-4
passages in retrieval order (the right one and three distractors, in another order per
question) and the question, rendered through the chat template one segment at a time as the
sidecar renders segments. Three ways to serve it:

- full: no cache at all (the reference for quality);
- prefix: prefix caching only (the documents unflagged; each was computed before, as the
  first document of an earlier request);
- reuse k: the documents flagged ``reuse="anywhere"`` (each computed before, after the system text and without the other documents), the
  first k tokens of each placed document recomputed, for each k of --repair.

Quality is measured against full recomputation of the same prompt: greedy agreement (all
--max-tokens generated tokens equal), answer accuracy (the known answer in the output) and the
KL divergence of the first token's distribution. TTFT is wall time from submission to the
first token, one request at a time.

    python bench/rag_reuse.py --json                      # SmolLM2-135M-Instruct, 40 questions
    python bench/rag_reuse.py --model demo --passages 6 --questions 2 --max-tokens 4 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.request import EngineRequest, SamplingParams, SegmentSpan
from prefixcache.engine.step.engine_hooks import EngineHooks
from prefixcache.engine.text.tokenizer import ChatTemplateError, Tokenizer
from prefixcache.sidecar.chat.rendering import PromptRenderer

SYSTEM = (
    "You are a careful assistant. Answer the question using only the documents given. "
    "Reply with the answer only, in a few words."
)
SYLLABLES = ["var", "neth", "ko", "ral", "mi", "sten", "du", "brok", "al", "ve", "tor", "lin"]
EXPORTS = [
    "copper", "wool", "salt", "amber", "timber", "honey", "glass", "silk", "tin", "barley",
    "olives", "marble", "pepper", "cheese", "leather", "pottery", "rope", "wine", "iron", "flax",
]  # fmt: skip
COLOURS = ["red", "blue", "green", "white", "black", "yellow", "purple", "orange", "grey"]
ANIMALS = ["heron", "fox", "otter", "stag", "falcon", "badger", "wolf", "swan", "boar", "lynx"]
FILLER = [
    "The streets of {n} are narrow and paved with old grey stones.",
    "Travellers often stop in {n} on their way to the coast.",
    "Most houses in {n} have steep roofs to shed the winter snow.",
    "A weekly market fills the central square of {n} every morning.",
    "The people of {n} are known for their long evening songs.",
    "Several small bridges cross the canals that run through {n}.",
    "In spring the hills around {n} are covered with wild flowers.",
    "The old library of {n} keeps maps drawn by its first settlers.",
    "Children in {n} learn to swim in the cold lake north of the town.",
    "A stone tower at the edge of {n} once served as a lighthouse.",
    "The bakers of {n} rise long before dawn to light their ovens.",
    "Festivals in {n} end with lanterns floating down the river.",
]


class Passage:
    __slots__ = ("answers", "name", "questions", "text")

    def __init__(self, name: str, text: str, questions: list[str], answers: list[str]) -> None:
        self.name, self.text, self.questions, self.answers = name, text, questions, answers


def build_corpus(n: int, rng: random.Random, count_tokens: Callable[[str], int]) -> list[Passage]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.sample(SYLLABLES, 3)).capitalize())
    passages = []
    for name in sorted(names):
        year, export = rng.randrange(1100, 1900), rng.choice(EXPORTS)
        colour, animal = rng.choice(COLOURS), rng.choice(ANIMALS)
        mayor = "".join(rng.sample(SYLLABLES, 2)).capitalize()
        facts = [
            f"The town of {name} was founded in the year {year}.",
            f"The main export of {name} is {export}.",
            f"The flag of {name} is {colour} with a {animal} in the middle.",
            f"The current mayor of {name} is called {mayor}.",
        ]
        questions = [
            f"In which year was the town of {name} founded?",
            f"What is the main export of {name}?",
            f"Which animal is on the flag of {name}?",
            f"What is the name of the current mayor of {name}?",
        ]
        answers = [str(year), export, animal, mayor]
        sentences = list(facts)
        fillers = rng.sample(FILLER, len(FILLER))
        while count_tokens(" ".join(sentences)) < rng.randrange(150, 260) and fillers:
            sentences.insert(rng.randrange(1, len(sentences) + 1), fillers.pop().format(n=name))
        text = " ".join(sentences)
        assert count_tokens(text) <= 300, "a passage over 300 tokens"
        passages.append(Passage(name, text, questions, answers))
    return passages


class Rendered:
    __slots__ = ("answer", "spans", "tokens")

    def __init__(self, tokens: list[int], spans: list[SegmentSpan], answer: str) -> None:
        self.tokens, self.spans, self.answer = tokens, spans, answer


def render(renderer: PromptRenderer, docs: list[Passage], question: str, answer: str) -> Rendered:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": f"Document: {d.text}"} for d in docs]
    messages.append({"role": "user", "content": question})
    tags = ["system", *(f"doc:{d.name}" for d in docs), "question"]
    try:
        out = renderer.render_pieces(messages, tags, add_generation_prompt=True)
    except ChatTemplateError:  # a base checkpoint (no chat template): plain text pieces
        return render_plain(renderer.tokenizer, messages, tags, answer)
    return Rendered(list(out.token_ids), list(out.spans), answer)


def render_plain(
    tokenizer: Tokenizer, messages: list[dict[str, str]], tags: list[str], answer: str
) -> Rendered:
    """Each message as its own text piece, tokenized on its own, after a BOS token."""
    bos = tokenizer.bos_token_id
    tokens: list[int] = [bos] if bos is not None else []
    spans = []
    for message, tag in zip(messages, tags, strict=True):
        start = len(tokens)
        tokens += tokenizer.encode(f"{message['content']}\n\n")
        spans.append(SegmentSpan(tag, start, len(tokens)))
    tokens += tokenizer.encode("Answer:")
    return Rendered(tokens, spans, answer)


def flagged(spans: list[SegmentSpan], reuse: bool) -> list[SegmentSpan]:
    return [
        SegmentSpan(s.tag, s.start, s.end, "anywhere") if reuse and s.tag.startswith("doc:") else s
        for s in spans
    ]


class Runner:
    """One engine; each request alone, to completion: TTFT, output, first-token logits."""

    def __init__(self, loaded: LoadedModel, caching: bool, blocks: int, repair: int) -> None:
        self.first_logits: dict[str, torch.Tensor] = {}

        def capture(row: torch.Tensor, params: SamplingParams, request_id: str) -> None:
            self.first_logits.setdefault(request_id, row.detach().float().clone())

        config = EngineConfig(
            model=loaded.name,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device="cpu",
            num_blocks=blocks,
            enable_prefix_caching=caching,
            reuse_repair_tokens=repair,
        )
        self.engine = LLMEngine(config, loaded, EngineHooks(logits_processors=(capture,)))
        self.count = 0

    def run(self, prompt: Rendered, reuse: bool, max_tokens: int) -> dict:
        self.count += 1
        rid = f"q{self.count}"
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = EngineRequest(rid, prompt.tokens, sampling, segments=flagged(prompt.spans, reuse))
        start = time.perf_counter()
        self.engine.add_request(request)
        ttft, tokens, usage = None, [], None
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - start
                tokens += out.new_token_ids
                if out.finished:
                    usage = out.usage
        assert usage is not None and ttft is not None
        text = self.engine.tokenizer.decode(tokens)
        return {
            "ttft": ttft,
            "tokens": tokens,
            "correct": prompt.answer.lower() in text.lower(),
            "computed": usage.computed_prompt_tokens,
            "reused": usage.reused_tokens,
            "logits": self.first_logits.pop(rid),
        }


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of two first-token distributions, in nats."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def p50_ms(rows: list[dict]) -> float:
    return round(statistics.median(r["ttft"] for r in rows) * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3, demo or a path")
    parser.add_argument("--passages", type=int, default=40)
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repair", default="0,8,16,32", help="repair settings k, comma-separated")
    parser.add_argument("--default-repair", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    repairs = [int(k) for k in args.repair.split(",")]
    if args.default_repair not in repairs:
        repairs.append(args.default_repair)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)

    loaded = load_model(args.model, device="cpu")
    renderer = PromptRenderer(loaded.tokenizer)
    count = lambda text: len(loaded.tokenizer.encode(text))  # noqa: E731
    corpus = build_corpus(args.passages, rng, count)
    prompts = []
    for i in range(args.questions):
        right = corpus[i % len(corpus)]
        fact = rng.randrange(len(right.questions))
        docs = [right, *rng.sample([p for p in corpus if p is not right], args.top_k - 1)]
        rng.shuffle(docs)
        prompts.append(render(renderer, docs, right.questions[fact], right.answers[fact]))
    longest = max(len(p.tokens) for p in prompts)
    blocks = (args.passages * 320 + args.questions * (longest + args.max_tokens)) // 16 + 256

    full = Runner(loaded, caching=False, blocks=longest // 16 + 64, repair=0)
    prefix = Runner(loaded, caching=True, blocks=blocks, repair=0)
    reuse = Runner(loaded, caching=True, blocks=blocks, repair=args.default_repair)
    with progress_bar("rag reuse", len(corpus) + len(prompts)) as bar:
        # Every document computed before: as the first document of an earlier request
        # (prefix caching), on its own (the chunk store).
        for passage in corpus:
            warm = render(renderer, [passage], "Which town is this about?", passage.name)
            prefix.run(warm, reuse=False, max_tokens=1)
            reuse.run(warm, reuse=True, max_tokens=1)
            bar.update()
        full.run(prompts[0], reuse=False, max_tokens=1)  # kernels warm, untimed
        rows: dict[str, list[dict]] = {"full": [], "prefix": []}
        rows.update({f"k{k}": [] for k in repairs})
        for prompt in prompts:
            rows["full"].append(full.run(prompt, False, args.max_tokens))
            rows["prefix"].append(prefix.run(prompt, False, 1))
            for k in repairs:
                reuse.engine.chunk_reuse.repair = k
                rows[f"k{k}"].append(reuse.run(prompt, True, args.max_tokens))
            bar.update()

    ref = rows["full"]
    accuracy_full = 100 * statistics.mean(r["correct"] for r in ref)
    prefix_p50 = p50_ms(rows["prefix"])
    settings = []
    for k in repairs:
        got = rows[f"k{k}"]
        accuracy = 100 * statistics.mean(r["correct"] for r in got)
        settings.append(
            {
                "repair_tokens": k,
                "ttft_p50_ms": p50_ms(got),
                "ttft_speedup": round(prefix_p50 / p50_ms(got), 3),
                "compute_tokens": round(statistics.mean(r["computed"] for r in got), 1),
                "reused_tokens": round(statistics.mean(r["reused"] for r in got), 1),
                "accuracy": round(accuracy, 2),
                "accuracy_delta": round(accuracy - accuracy_full, 2),
                "agreement": round(
                    statistics.mean(
                        r["tokens"] == f["tokens"] for r, f in zip(got, ref, strict=True)
                    ),
                    3,
                ),
                "first_token_kl": round(
                    statistics.mean(
                        kl(f["logits"], r["logits"]) for r, f in zip(got, ref, strict=True)
                    ),
                    5,
                ),
            }
        )
    default = next((s for s in settings if s["repair_tokens"] == args.default_repair), {})
    result = {
        "model": loaded.name,
        "passages": len(corpus),
        "questions": len(prompts),
        "prompt_tokens": round(statistics.mean(len(p.tokens) for p in prompts), 1),
        "default_repair_tokens": args.default_repair,
        "ttft_speedup": default.get("ttft_speedup"),
        "accuracy_delta": default.get("accuracy_delta"),
        "agreement": default.get("agreement"),
        "first_token_kl": default.get("first_token_kl"),
        "full": {
            "ttft_p50_ms": p50_ms(ref),
            "accuracy": round(accuracy_full, 2),
            "compute_tokens": round(statistics.mean(r["computed"] for r in ref), 1),
        },
        "prefix_only": {
            "ttft_p50_ms": prefix_p50,
            "compute_tokens": round(statistics.mean(r["computed"] for r in rows["prefix"]), 1),
        },
        "settings": settings,
        "targets": {
            "ttft_speedup_min": 2.5,
            "accuracy_delta_max_abs": 2.0,
            "met": bool(default)
            and default["ttft_speedup"] >= 2.5
            and abs(default["accuracy_delta"]) <= 2.0,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
