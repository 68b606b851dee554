"""``prefixcache route``: the upstream-mode sidecar, a cache-aware router in front of
OpenAI-compatible servers, served by uvicorn. No engine here, and no torch."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..environment import SidecarEnvironment
from ..http.redaction import redacted_log_config
from ..http.uvicorn_protocol import HalfCloseHTTPProtocol
from .shared_options import MIB, configure_logging

if TYPE_CHECKING:
    from ..router.app import EventSource


def parse_upstream(spec: str) -> tuple[str, EventSource | None]:
    """``URL[,events=ZMQ[,replay=ZMQ]]`` -> (URL, its event source)."""
    from ..router.app import EventSource

    url, *options = [part.strip() for part in spec.split(",")]
    fields: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in ("events", "replay") or not value or name in fields:
            raise ValueError(f"--upstream {spec!r}: expected URL[,events=ZMQ[,replay=ZMQ]]")
        fields[name] = value
    if "replay" in fields and "events" not in fields:
        raise ValueError(f"--upstream {spec!r}: replay= needs events=")
    if "events" not in fields:
        return url, None
    return url, EventSource(fields["events"], fields.get("replay"))


def route(
    args: argparse.Namespace,
    environment: SidecarEnvironment | None = None,
    command: str = "prefixcache route",
) -> None:
    """``command``: how errors name the command (``prefixcache serve`` when run as the
    deprecated ``serve --upstream``)."""
    import uvicorn

    from ..http.tenancy import KeyStore
    from ..router.app import UpstreamSettings, create_upstream_app
    from ..router.cache_aware import RoutingSettings

    configure_logging(args)
    environment = environment or SidecarEnvironment.read()
    try:
        parsed = [parse_upstream(spec) for spec in args.upstream]
        tokenizer = None
        if args.tokenizer is not None:
            from prefixcache.engine.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_folder(args.tokenizer)
        settings = UpstreamSettings(
            upstreams=tuple(url for url, _ in parsed),
            routing=args.routing,
            events={url: source for url, source in parsed if source is not None},
            tokenizer=tokenizer,
            cache_aware=RoutingSettings(
                match_threshold=args.match_threshold,
                balance_abs_threshold=args.balance_abs_threshold,
                balance_rel_threshold=args.balance_rel_threshold,
                prefill_weight=args.prefill_weight,
                running_weight=args.running_weight,
                host_tier_credit=args.host_tier_credit,
                storage_tier_credit=args.storage_tier_credit,
            ),
            keys=KeyStore.from_file(args.api_keys_file) if args.api_keys_file else KeyStore(),
            upstream_api_key=args.upstream_api_key or environment.upstream_api_key,
            load_factor=args.load_factor,
            min_load=args.min_load,
            timeout_s=args.upstream_timeout,
            max_body_bytes=int(args.max_body_mib * MIB),
        )
        app = create_upstream_app(settings)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{command}: {exc}") from None
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        http=HalfCloseHTTPProtocol,
        log_config=redacted_log_config(),  # the access log never shows a key
    )
