"""The serving benchmarks' checkpoint: a random 55M-parameter Llama, saved by transformers.

hidden 512, 8 layers, 8 query / 2 KV heads of 64, intermediate 1408, vocab 32,000, random
weights (seeded), written with ``LlamaForCausalLM.save_pretrained`` so that every server
(prefixcache, vLLM) loads the very same folder. The tokenizer is a byte-level BPE trained here
on seeded pseudo-words until it has exactly ``vocab`` entries, so every id the model can emit
decodes to text.

    .venv/bin/python bench/make_bench_model.py --out /tmp/bench-llama55m
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from prefixcache.engine.model.progress import progress_bar, progress_wanted

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def corpus(seed: int, num_words: int, length: int) -> list[str]:
    """Zipf-distributed pseudo-words: enough distinct ones for a 32K BPE vocabulary."""
    rng = random.Random(seed)
    words = list(
        dict.fromkeys(
            "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(num_words * 2)
        )
    )[:num_words]
    weights = [1.0 / (r + 1) ** 0.8 for r in range(len(words))]
    lines = []
    for _ in range(length // 16):
        lines.append(" ".join(rng.choices(words, weights, k=16)))
    lines.extend(
        " ".join(words[i : i + 16]) for i in range(0, len(words), 16)
    )  # each at least once
    return lines


def train_tokenizer(vocab: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=progress_wanted(),  # the tokenizers library's own bars, on stderr
    )
    tok.train_from_iterator(corpus(seed, 60_000, 600_000), trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab:
        raise SystemExit(f"tokenizer trained to {size} entries, not {vocab}: grow the corpus")
    return tok.to_str()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="/tmp/bench-llama55m")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-positions",
        type=int,
        default=8192,
        help="max_position_embeddings (32768: long context)",
    )
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bar = progress_bar("tokenizer, model, save", 3)
    tok_json = train_tokenizer(args.vocab, args.seed)
    bar.update()
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    ids = {t["content"]: t["id"] for t in json.loads(tok_json)["added_tokens"]}
    bos, eos, eot = (ids[t] for t in SPECIAL)

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=[eos, eot],
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    bar.update()
    model.save_pretrained(out, safe_serialization=True)
    tok_config = {
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[2],
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    bar.update()
    bar.close()
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({params / 1e6:.1f}M parameters, vocab {args.vocab})")


if __name__ == "__main__":
    main()
