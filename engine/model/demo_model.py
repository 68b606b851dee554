"""The built-in ``demo`` model: a small Llama checkpoint made locally, no download.

Weights are drawn from a seeded generator; the tokenizer is a byte-level BPE trained on the
text in ``demo_assets/corpus.txt`` (the trained ``tokenizer.json`` ships next to it, so every
install gets the same ids). The model's text is not meaningful: it exists to exercise the
engine end to end. On first use it is written as a real Hugging Face folder (config.json,
model.safetensors, tokenizer files) under ``$PREFIXCACHE_HOME/demo-v1`` (default
``~/.cache/prefixcache``), built in a temporary folder and renamed into place so that
concurrent first uses do not clash.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..settings import home_dir

DEMO_NAME = "demo"
DEMO_VERSION = "demo-v1"
DEMO_SEED = 20240611
ASSETS = Path(__file__).parent / "demo_assets"

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
BOS_TOKEN, EOS_TOKEN, EOT_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def demo_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
        "bos_token_id": None,  # filled from the tokenizer
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def demo_home() -> Path:
    return home_dir() / DEMO_VERSION


def ensure_demo_model(home: Path | None = None) -> Path:
    """The demo folder, created on first use (atomically) and reused afterwards."""
    folder = home or demo_home()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race to a partial folder?
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_demo_model(folder: Path) -> None:
    """Write the demo checkpoint into an existing empty folder."""
    from tokenizers import Tokenizer

    tok_json = (ASSETS / "tokenizer.json").read_text(encoding="utf-8")
    tok = Tokenizer.from_str(tok_json)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id, eot_id = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN))

    config = demo_config(vocab_size)
    config["bos_token_id"] = bos_id
    config["eos_token_id"] = [eos_id, eot_id]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {"bos_token_id": bos_id, "eos_token_id": [eos_id, eot_id], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    tok_config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    save_file(demo_weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})


def demo_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Seeded weights in a fixed order, float32."""
    gen = torch.Generator().manual_seed(DEMO_SEED)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    hq, hk = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    out_std = 0.02 / (2 * config["num_hidden_layers"]) ** 0.5
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = normal(hq, h)
        w[p + "self_attn.k_proj.weight"] = normal(hk, h)
        w[p + "self_attn.v_proj.weight"] = normal(hk, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, hq, std=out_std)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i, std=out_std)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    return {k: v.contiguous() for k, v in w.items()}


def train_demo_tokenizer(corpus: Path = ASSETS / "corpus.txt", vocab_size: int = 8192) -> str:
    """Train the demo's byte-level BPE on the shipped corpus; returns tokenizer.json text.

    The shipped ``demo_assets/tokenizer.json`` was made with this function (the vocabulary
    stops growing once every word of the corpus is one token, about 2.2K entries).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    return tok.to_str(pretty=True)


if (
    __name__ == "__main__"
):  # regenerate the shipped tokenizer: python -m prefixcache.engine.model.demo_model
    (ASSETS / "tokenizer.json").write_text(train_demo_tokenizer(), encoding="utf-8")
