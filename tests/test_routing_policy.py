"""The cache-aware routing policy without I/O: approximate tree, precise cost, balance rule,
and the subscriber's gap and restart handling (fed by hand, no sockets)."""

from __future__ import annotations

import random
from typing import Any

import msgspec

from prefixcache.engine.observability.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from prefixcache.sidecar.router.approx_tree import ApproxTree
from prefixcache.sidecar.router.cache_aware import (
    CacheAwareRouter,
    PendingPrefill,
    Replica,
    RoutingSettings,
)
from prefixcache.sidecar.router.kv_event_wire import decode_batch
from prefixcache.sidecar.router.kv_index import ReplicaIndex
from prefixcache.sidecar.router.kv_subscriber import EventSubscriber
from prefixcache.sidecar.router.pool import UpstreamPool

A, B, C = "http://a/v1", "http://b/v1", "http://c/v1"


def payload(events: list[object], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts, events))  # type: ignore[arg-type]


def wire(events: list[object]) -> list[Any]:
    """Engine-side events as a router reads them off the wire."""
    return list(decode_batch(payload(events)).events)


# --- the approximate tree -----------------------------------------------------------------


def test_tree_longest_prefix_and_most_recent_holder() -> None:
    tree = ApproxTree()
    tree.insert("system: be brief|user: hi", A)
    tree.insert("system: be brief|user: bye", B)
    assert tree.match("system: be brief|user: hi|assistant: hello") == (25, [A])
    chars, holders = tree.match("system: be brief|user: what")
    assert chars == len("system: be brief|user: ") and holders == [B, A]
    assert tree.match("other") == (0, [])
    assert tree.chars[A] == len("system: be brief|user: hi")


def test_tree_prunes_least_recent_leaves_under_its_bound() -> None:
    tree = ApproxTree(max_chars=100, prune_to=0.5)
    rng = random.Random(3)
    texts = ["".join(rng.choice("abcdefgh") for _ in range(30)) for _ in range(10)]
    for text in texts:
        tree.insert(text, A)
        assert tree.chars[A] <= 100
    assert tree.match(texts[-1])[0] == 30  # the newest survives
    assert tree.match(texts[0]) != (30, [A])  # the oldest went
    tree.forget(A)
    assert tree.chars[A] == 0 and tree.num_nodes == 0


def test_tree_character_counts_match_a_recount() -> None:
    tree = ApproxTree(max_chars=400)
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 40)))
        tree.insert(text, rng.choice([A, B]))
        for replica in (A, B):
            recount = sum(len(n.text) for n in tree._nodes() if replica in n.marks)
            assert recount == tree.chars.get(replica, 0)
            assert recount <= 400


# --- the router ---------------------------------------------------------------------------


def router(events: bool = True, **knobs: float) -> CacheAwareRouter:
    pool = UpstreamPool([A, B, C])
    replicas = []
    for upstream in pool.upstreams:
        replica = Replica(upstream)
        if events:
            replica.index = ReplicaIndex()
            replica.subscriber = EventSubscriber("tcp://unused:1", replica.index)
            replica.subscriber.last_event_at = 0.0  # live
        replicas.append(replica)
    return CacheAwareRouter(pool, replicas, RoutingSettings(**knobs))  # type: ignore[arg-type]


def store(r: CacheAwareRouter, url: str, tokens: list[int], bs: int = 4) -> None:
    n = len(tokens) // bs
    index = r.replicas[url].index
    assert index is not None
    index.apply(wire([BlockStored(list(range(n)), None, tokens[: n * bs], bs, None, "GPU", None)]))


def test_precise_goes_where_the_longest_prefix_is_cached() -> None:
    r = router()
    prompt = list(range(40))
    store(r, B, prompt[:32])
    store(r, C, prompt[:8])
    decision = r.choose("text", prompt)
    assert decision is not None
    assert (decision.upstream.url, decision.reason, decision.predicted_tokens) == (B, "precise", 32)
    assert decision.prefill_tokens == 8


def test_precise_weighs_load_against_the_hit() -> None:
    r = router(running_weight=10.0, balance_abs_threshold=100)
    prompt = list(range(40))
    store(r, B, prompt[:32])
    r.replicas[B].upstream.in_flight = 3  # 8 + 30 < 40: B still wins
    assert r.choose("t", prompt).upstream.url == B  # type: ignore[union-attr]
    r.replicas[B].upstream.in_flight = 4  # 8 + 40 > 40: an idle replica recomputes
    decision = r.choose("t", prompt)
    assert decision is not None and decision.upstream.url != B and decision.reason == "balance"


def test_the_balance_rule_needs_both_thresholds() -> None:
    r = router(balance_abs_threshold=4, balance_rel_threshold=1.5, running_weight=1.0)
    prompt = list(range(40))
    store(r, A, prompt)
    r.replicas[A].upstream.in_flight = 9
    r.replicas[B].upstream.in_flight = 6  # 9 - 6 = 3: not over the absolute threshold
    r.replicas[C].upstream.in_flight = 6
    assert r.choose("t", prompt, ()).upstream.url == A  # type: ignore[union-attr]
    r.replicas[B].upstream.in_flight = 4  # 9 - 4 = 5 > 4 and 9 > 1.5 * 4
    decision = r.choose("t", prompt)
    assert decision is not None and (decision.upstream.url, decision.reason) == (B, "balance")
    assert decision.overflow


def test_approximate_sticks_to_history_and_spreads_new_prefixes() -> None:
    r = router(events=False)
    seen = set()
    for i in range(3):
        decision = r.choose(f"conversation {i} " + "x" * 50, None)
        assert decision is not None and decision.reason == "balance"
        seen.add(decision.upstream.url)
    assert seen == {A, B, C}  # new prefixes go to the replica with the smallest tree share
    home = r.choose("conversation 1 " + "x" * 50 + " turn two", None)
    assert home is not None and home.reason == "approximate"
    again = r.choose("conversation 1 " + "x" * 50 + " turn two and three", None)
    assert again is not None and again.upstream is home.upstream


def test_stale_events_fall_back_to_the_tree_guess() -> None:
    r = router()
    prompt = list(range(40))
    store(r, A, prompt)
    sub = r.replicas[A].subscriber
    assert sub is not None
    sub.clock = lambda: 100.0
    sub.expect()
    sub.clock = lambda: 100.0 + sub.stale_after_s + 1  # a request finished, no events since
    assert not sub.is_live()
    decision = r.choose("text", prompt)
    assert decision is not None and decision.predicted_tokens == 0  # the index is not trusted


def test_failover_is_named() -> None:
    r = router()
    decision = r.choose("t", list(range(8)), exclude={A})
    assert decision is not None and decision.reason == "failover" and decision.upstream.url != A


# --- the subscriber's numbering -----------------------------------------------------------


def test_a_gap_without_replay_clears_the_index_and_a_restart_too() -> None:
    index = ReplicaIndex()
    sub = EventSubscriber("tcp://unused:1", index)
    sub.on_message(0, payload([AllBlocksCleared()]))
    sub.on_message(1, payload([BlockStored([7], None, [1, 2, 3, 4], 4, None, None, None)]))
    assert index.match([1, 2, 3, 4, 5]) == 4
    sub.on_message(1, payload([BlockStored([7], None, [1, 2, 3, 4], 4, None, None, None)]))
    assert index.match([1, 2, 3, 4]) == 4 and sub.stats.restarts == 0  # a duplicate
    sub.on_message(3, payload([BlockStored([8], None, [9, 9, 9, 9], 4, None, None, None)]))
    assert sub.stats.missed == 1 and sub.stats.unfilled_gaps == 1
    assert index.match([1, 2, 3, 4]) == 0 and index.match([9, 9, 9, 9]) == 4
    sub.on_message(0, payload([AllBlocksCleared()], ts=2.0))  # numbering started over
    assert sub.stats.restarts == 1 and len(index) == 0


def test_index_removals_and_eviction_of_a_parent() -> None:
    index = ReplicaIndex()
    index.apply(wire([BlockStored([1, 2], None, [1, 1, 2, 2], 2, None, None, None)]))
    assert index.match([1, 1, 2, 2, 3]) == 4
    index.apply(wire([BlockRemoved([1], None)]))
    assert index.match([1, 1, 2, 2]) == 0  # the child cannot be hit without its parent
    index.apply(wire([BlockStored([3], None, [1, 1], 2, None, None, None)]))
    assert index.match([1, 1, 2, 2]) == 4
    index.apply(wire([BlockRemoved([3, 2], None)]))
    assert len(index) == 0 and index.cached_paths() == set()


def test_a_block_held_in_a_lower_tier_stays_cached_until_every_medium_lets_go() -> None:
    index = ReplicaIndex()
    prompt = [1, 1, 2, 2, 3]
    index.apply(wire([BlockStored([1, 2], None, [1, 1, 2, 2], 2, None, "GPU", None)]))
    index.apply(wire([BlockStored([2], 1, [2, 2], 2, None, "CPU", None)]))  # spilled
    index.apply(wire([BlockRemoved([2], "GPU")]))  # ... and evicted from the pool
    match = index.match_by_medium(prompt)
    assert (match.tokens, match.by_medium) == (4, {"GPU": 2, "CPU": 2})
    index.apply(wire([BlockRemoved([2], "STORAGE")]))  # a medium that never held it
    assert index.match(prompt) == 4
    index.apply(wire([BlockStored([2], 1, [2, 2], 2, None, "GPU", None)]))  # reloaded
    assert index.match_by_medium(prompt).by_medium == {"GPU": 4}  # the fastest holder serves
    index.apply(wire([BlockRemoved([2], "GPU"), BlockRemoved([2], "CPU")]))
    assert index.match(prompt) == 2 and len(index) == 1
    index.apply(wire([BlockStored([3], 1, [2, 2], 2, None, "STORAGE", None)]))
    index.apply(wire([BlockRemoved([1, 3], None)]))  # no medium: every medium lets go
    assert index.match(prompt) == 0 and len(index) == 0 and index.cached_paths() == set()


def test_precise_prefers_the_pool_to_a_lower_tier_and_a_lower_tier_to_nothing() -> None:
    r = router()
    prompt = list(range(40))
    store(r, A, prompt[:32])
    index_b = r.replicas[B].index
    assert index_b is not None
    index_b.apply(wire([BlockStored(list(range(8)), None, prompt[:32], 4, None, "CPU", None)]))
    decision = r.choose("t", prompt)
    assert decision is not None and (decision.upstream.url, decision.reason) == (A, "precise")
    r.replicas[A].upstream.in_flight = 1  # a running request costs more than a tier's copy
    decision = r.choose("t2", prompt)
    assert decision is not None and decision.upstream.url == B and decision.predicted_tokens == 32
    assert RoutingSettings().credit({"GPU": 10, "CPU": 10, "STORAGE": 10}) == 10 + 9 + 7


def test_a_prompt_counts_as_held_from_its_sending_until_its_request_ends() -> None:
    r = router()  # no events at all: only what was sent tells
    prompt, follow_up = list(range(40)), list(range(40)) + [99] * 8
    replica = r.replicas[B]
    replica.pending[1] = PendingPrefill(prompt, 40)
    assert replica.in_flight_hit(follow_up, 4) == 40 and replica.pending_prefill == 40
    replica.answering(1)  # first byte: prefill done, blocks held while it answers
    assert replica.pending_prefill == 0 and replica.in_flight_hit(follow_up, 4) == 40
    decision = r.choose("x", follow_up)
    assert decision is not None and (decision.upstream.url, decision.reason) == (B, "precise")
    assert decision.predicted_tokens == 32  # whole blocks; 16 before any event says the size
    replica.finished(1)
    assert replica.in_flight_hit(follow_up, 4) == 0 and not replica.running


def test_upstream_specs_parse_and_bad_ones_are_refused() -> None:
    import pytest

    from prefixcache.sidecar.cli.route_command import parse_upstream
    from prefixcache.sidecar.router.app import EventSource

    assert parse_upstream("http://a/v1") == ("http://a/v1", None)
    assert parse_upstream("http://a/v1,events=tcp://a:5557") == (
        "http://a/v1",
        EventSource("tcp://a:5557"),
    )
    both = parse_upstream("http://a/v1,events=tcp://a:5557,replay=tcp://a:5558")
    assert both == ("http://a/v1", EventSource("tcp://a:5557", "tcp://a:5558"))
    for bad in ("http://a/v1,replay=tcp://a:1", "http://a/v1,evnts=x", "http://a/v1,events="):
        with pytest.raises(ValueError):
            parse_upstream(bad)
