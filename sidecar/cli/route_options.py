"""The options of ``prefixcache route`` (upstream mode) beyond the shared ones: the upstreams
and how they are called, the routing policy, and its weights and bounds."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_route_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream",
        action="append",
        required=True,
        metavar="URL[,events=ZMQ[,replay=ZMQ]]",
        help="(repeatable) route each request to one of these OpenAI-compatible servers "
        "(vLLM, SGLang, other sidecars; base URLs like http://10.0.0.7:8000/v1). events=: the "
        "upstream's KV event PUB address (vLLM's --kv-events-config endpoint, or prefixcache "
        "serve's --kv-events-endpoint), replay=: its replay address; with --tokenizer, "
        "requests go to the replica that holds their longest prefix, weighed against load "
        "(docs/sidecar.md)",
    )
    parser.add_argument(
        "--routing",
        choices=["cache_aware", "hash"],
        default="cache_aware",
        help="cache_aware (precise over KV events, else an approximate tree of what was sent "
        "where) or hash (rendezvous hash of the system prompt)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="the upstreams' model folder (tokenizer.json, chat template), for precise "
        "routing over KV events; torch is not needed",
    )
    parser.add_argument(
        "--upstream-api-key",
        default=None,
        help="bearer key sent to the upstreams, else $PREFIXCACHE_UPSTREAM_API_KEY; clients' "
        "own keys are never forwarded",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        help="longest wait, in seconds, for an upstream's answer or next stream chunk (504 "
        "after it)",
    )
    precise = parser.add_argument_group("precise routing", "over the upstreams' KV events")
    precise.add_argument(
        "--running-weight",
        type=float,
        default=32.0,
        help="cost of one request in flight, in prompt tokens",
    )
    precise.add_argument(
        "--prefill-weight",
        type=float,
        default=0.25,
        help="cost of one pending prefill token on a replica",
    )
    precise.add_argument(
        "--host-tier-credit",
        type=float,
        default=0.9,
        help="what a cached token in a replica's host-memory tier (KV events medium CPU) is "
        "worth against one in its pool",
    )
    precise.add_argument(
        "--storage-tier-credit",
        type=float,
        default=0.7,
        help="... and one in its file tier (medium STORAGE)",
    )
    approximate = parser.add_argument_group(
        "approximate routing", "over a tree of what was sent where (no events)"
    )
    approximate.add_argument(
        "--match-threshold",
        type=float,
        default=0.5,
        help="share of the prompt a replica's match must cover to take the request",
    )
    balance = parser.add_argument_group("balance", "both cache-aware rules")
    balance.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=4,
        help="a replica is overloaded (and its pick goes to another) when its in-flight "
        "count exceeds the least loaded's by more than this and ...",
    )
    balance.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="... is more than this times it",
    )
    bound = parser.add_argument_group(
        "load bound", "--routing hash: bounded-load rendezvous hashing"
    )
    bound.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="an upstream takes a request while its in-flight count is under load-factor x "
        "the average; past that the next-best replica does",
    )
    bound.add_argument(
        "--min-load",
        type=int,
        default=8,
        help="an upstream with fewer requests in flight than this always takes the requests "
        "whose prefix it owns (the load bound applies above it)",
    )
