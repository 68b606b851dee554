"""Cache-aware routing over upstream replicas: precise (KV events) or approximate (no I/O).

Each request comes as its rendered ``text`` (what the approximate tree keys) and, when the
router has the model's tokenizer, its prompt ``token_ids`` (what the event indexes key).

**Balance** (both rules): a candidate is overloaded when its in-flight count exceeds the
least loaded candidate's by more than ``balance_abs_threshold`` AND is more than
``balance_rel_threshold`` times it. If the rule below picks an overloaded candidate, it is
applied again without the overloaded ones (reason ``balance``): a hot prefix must not pile up
on one replica while others idle, and the move still goes where the cache is best among the
rest (SGLang's gateway sends it to the least loaded; this keeps more hits).

**Precise** (token ids known and at least one candidate's events are live): for every
candidate r, with L the prompt's length,

    hit_r  = tokens of the prompt replica r holds: the larger of its event index's match,
             credited by medium (a token in the pool counts 1, in host memory
             ``host_tier_credit``, in files ``storage_tier_credit``: a lower tier costs a copy
             back), and the full blocks shared with a prompt r is computing or answering now
             (sent, not finished) (live events); else the approximate tree's guess,
             L * matched_chars / len(text)
    cost_r = (L - hit_r) + prefill_weight * pending_prefill_r + running_weight * in_flight_r

where ``pending_prefill_r`` is the uncached prompt tokens of the requests sent to r that have
not sent a byte back yet, less the blocks r's events show stored since (``Replica``), and
``in_flight_r`` the requests not finished. The cheapest wins
(ties: fewer in flight, then the smaller share of the approximate tree, so new prefixes
spread, then configuration order). Reason ``precise`` when the winner has the
largest hit (and a hit at all), ``approximate`` the same with a guessed hit, else ``balance``.

**Approximate** (no token ids, or no live events), SGLang's cache-aware rule: the longest
prefix match in the tree decides: if it covers more than ``match_threshold`` of the text, the least loaded of
the replicas holding it takes the request (``approximate``); if not, the replica with the
smallest share of the tree does (``balance``), so new prefixes spread.

Every routed text is inserted into the tree under the chosen replica. A retry after a
connection failure is ``failover``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .approx_tree import ApproxTree
from .kv_index import ReplicaIndex
from .kv_subscriber import EventSubscriber
from .pool import Upstream, UpstreamPool

Reason = Literal["precise", "approximate", "balance", "failover"]
REASONS: tuple[Reason, ...] = ("precise", "approximate", "balance", "failover")


@dataclass(slots=True)
class RoutingSettings:
    match_threshold: float = 0.5  # approximate: share of the text the match must cover
    balance_abs_threshold: int = 4  # approximate: max - min in flight must exceed this ...
    balance_rel_threshold: float = 1.5  # ... and max must exceed this times min
    prefill_weight: float = 0.25  # precise: cost per token of pending prefill (docs/sidecar.md)
    running_weight: float = 32.0  # precise: cost, in prompt tokens, per request in flight
    tree_max_chars: int = 4_000_000  # approximate tree: characters per replica
    stale_after_s: float = 3.0  # events silent this long after a finished request: stale
    host_tier_credit: float = 0.9  # precise: a cached token in host memory ("CPU") counts this
    storage_tier_credit: float = 0.7  # ... and one in files ("STORAGE", other media) this

    def __post_init__(self) -> None:
        for name in ("host_tier_credit", "storage_tier_credit"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")

    def credit(self, by_medium: Mapping[str, int]) -> float:
        """Prompt tokens a hit saves, tier by tier: a pool hit saves its whole prefill, a
        lower tier's costs a copy back first."""
        total = 0.0
        for medium, tokens in by_medium.items():
            upper = medium.upper()
            weight = (
                1.0
                if upper == "GPU"
                else self.host_tier_credit
                if upper == "CPU"
                else self.storage_tier_credit
            )
            total += weight * tokens
        return total


@dataclass(slots=True)
class PendingPrefill:
    token_ids: Sequence[int] | None  # None: routed without token ids
    uncached: int  # prompt tokens the replica had to compute when the request was sent


@dataclass(slots=True)
class Replica:
    upstream: Upstream
    index: ReplicaIndex | None = None  # set when the upstream publishes KV events
    subscriber: EventSubscriber | None = None
    pending: dict[int, PendingPrefill] = field(default_factory=dict)  # without a byte back yet
    # past their first byte, not finished: a running request's prompt blocks are referenced
    # on the replica (never evicted under it), whatever the events have shown so far
    running: dict[int, Sequence[int]] = field(default_factory=dict)

    @property
    def events_live(self) -> bool:
        return self.subscriber is not None and self.subscriber.is_live()

    def in_flight_hit(self, token_ids: Sequence[int], block_size: int) -> int:
        """Full blocks ``token_ids`` shares with a prompt sent here and not finished: one not
        answered yet is being computed, so the replica will hold it before this request's
        prefill (as Dynamo's router counts active sequences); one answering holds its blocks
        until it ends. Events show the first only after its prefill, the second a little
        after (their lag), or never when the replica withholds token ids."""
        best = 0
        for item in self.pending.values():
            if item.token_ids is not None:
                best = max(best, _common_prefix(token_ids, item.token_ids))
        for prompt in self.running.values():
            best = max(best, _common_prefix(token_ids, prompt))
        return best // block_size * block_size

    def answering(self, key: int) -> None:
        """Request ``key`` sent its first byte: its prefill is done, its blocks held."""
        item = self.pending.pop(key, None)
        if item is not None and item.token_ids is not None:
            self.running[key] = item.token_ids

    def finished(self, key: int) -> None:
        self.pending.pop(key, None)
        self.running.pop(key, None)

    @property
    def pending_prefill(self) -> int:
        """Prompt tokens still to compute on this replica. With live events a request's
        prefill shrinks as its blocks are stored (chunked prefill commits them step by step),
        so a replica that already caches a prompt does not look busy for its whole decode."""
        live = self.events_live and self.index is not None
        total = 0
        for item in self.pending.values():
            left = item.uncached
            if live and item.token_ids is not None:
                assert self.index is not None
                full = (
                    len(item.token_ids)
                    // (self.index.block_size or 1)
                    * (self.index.block_size or 1)
                )
                left = min(left, max(0, full - self.index.match(item.token_ids)))
            total += left
        return total


@dataclass(slots=True, frozen=True)
class Decision:
    upstream: Upstream
    reason: Reason
    predicted_tokens: int  # cached prompt tokens expected on the chosen replica
    prefill_tokens: int  # prompt tokens expected to be computed there
    overflow: bool = False  # the imbalance rule moved it off the replica its cache picks


class CacheAwareRouter:
    def __init__(
        self, pool: UpstreamPool, replicas: Sequence[Replica], settings: RoutingSettings
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.replicas = {r.upstream.url: r for r in replicas}
        self.tree = ApproxTree(settings.tree_max_chars)

    def choose(
        self, text: str, token_ids: Sequence[int] | None, exclude: Collection[str] = ()
    ) -> Decision | None:
        candidates = [self.replicas[u.url] for u in self.pool.healthy() if u.url not in exclude]
        if not candidates:
            return None
        decision = self._by_cache(candidates, text, token_ids)
        overloaded = self._overloaded(candidates)
        if decision.upstream.url in overloaded:
            rest = [r for r in candidates if r.upstream.url not in overloaded]
            moved = self._by_cache(rest, text, token_ids)
            decision = Decision(
                moved.upstream, "balance", moved.predicted_tokens, moved.prefill_tokens, True
            )
        self.tree.insert(text, decision.upstream.url)
        if exclude:
            return Decision(
                decision.upstream,
                "failover",
                decision.predicted_tokens,
                decision.prefill_tokens,
                decision.overflow,
            )
        return decision

    def forget(self, url: str) -> None:
        """The replica lost its cache (a restart, a reset): the tree's guesses about it are
        wrong."""
        self.tree.forget(url)

    # ---- the two rules

    def _precise(self, candidates: list[Replica], text: str, token_ids: Sequence[int]) -> Decision:
        s, length = self.settings, len(token_ids)
        chars, holders = self.tree.match(text)
        guessed = int(length * chars / len(text)) if text else 0
        scored = []
        share = self.tree.chars
        for order, r in enumerate(candidates):
            pending = r.pending_prefill
            if r.events_live and r.index is not None:
                held = r.index.match_by_medium(token_ids)
                computing = r.in_flight_hit(token_ids, r.index.block_size or 16)
                hit = max(held.tokens, computing)
                credit = max(s.credit(held.by_medium), computing)
                precise = True
            else:
                hit, precise = (guessed if r.upstream.url in holders else 0), False
                credit = hit
            hit, credit = min(hit, length - 1), min(credit, length - 1)
            cost = (
                (length - credit)
                + s.prefill_weight * pending
                + s.running_weight * r.upstream.in_flight
            )
            tie = (r.upstream.in_flight, share.get(r.upstream.url, 0), order)
            scored.append((cost, tie, hit, precise, r))
        best_hit = max(item[2] for item in scored)
        _, _, hit, precise, chosen = min(scored, key=lambda item: item[:2])
        reason: Reason = "balance"
        if hit > 0 and hit == best_hit:
            reason = "precise" if precise else "approximate"
        return Decision(chosen.upstream, reason, hit, length - hit)

    def _by_cache(
        self, candidates: list[Replica], text: str, token_ids: Sequence[int] | None
    ) -> Decision:
        if token_ids and any(r.events_live for r in candidates):
            return self._precise(candidates, text, token_ids)
        return self._approximate(candidates, text, len(token_ids or ()))

    def _overloaded(self, candidates: list[Replica]) -> set[str]:
        """Candidates over both thresholds against the least loaded one (never all)."""
        s = self.settings
        low = min(r.upstream.in_flight for r in candidates)
        return {
            r.upstream.url
            for r in candidates
            if r.upstream.in_flight - low > s.balance_abs_threshold
            and r.upstream.in_flight > s.balance_rel_threshold * low
        }

    def _approximate(self, candidates: list[Replica], text: str, length: int) -> Decision:
        s = self.settings
        chars, holders = self.tree.match(text)
        ratio = chars / len(text) if text else 0.0
        holding = [r for r in candidates if r.upstream.url in holders]
        if holding and ratio > s.match_threshold:
            chosen = min(holding, key=lambda r: r.upstream.in_flight)
            hit = int(length * ratio)
            return Decision(chosen.upstream, "approximate", hit, length - hit)
        share = self.tree.chars
        chosen = min(candidates, key=lambda r: (share.get(r.upstream.url, 0), r.upstream.in_flight))
        return Decision(chosen.upstream, "balance", 0, length)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n
