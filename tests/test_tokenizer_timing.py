"""No timing oracle in the tokenize path across namespaces (issue 30, item 2).

Tenant "victim" encodes N secret texts; then tenant "attacker" encodes 2N probes in a random
order, N of them copies of the secrets (fresh string objects, as a request body gives) and N
texts nobody sent, and times each one. The attacker's single-probe guess is "seen if faster
than the median probe". Were anything in the path shared between namespaces (a memo, the
tokenizers library's own per-word BPE cache), the seen probes would be faster.

Why it does not flake on a loaded box:
- each probe is timed in this thread's CPU time (``time.thread_time_ns``, the tokenizers
  library kept on this thread), so a probe that waits for the CPU costs nothing extra; what
  load adds (cache contention) falls on both sides alike, as the sides are interleaved at
  random;
- the victim's texts are all encoded before any probe, as another tenant's request is, so
  what the CPU's own caches keep of one particular text is gone by its probe;
- with no signal, the median split's accuracy has a standard deviation of 1/sqrt(8N) = 1.6 %
  at N = 500: 60 % is 6 sigma away (P < 1e-8); the medians, over 500 probes of texts of one
  shape, differed by 0-3 % in trials here, against a bound of 10 %.

The control proves the probe can see a cache on this machine right now: the same measurement
with the library's word cache turned back on must fail the bound (it did: 80-93 % accuracy,
medians 24-26 % apart; today's main, which never turned it off, fails the same way).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import pytest

from prefixcache.engine.model.demo_model import ensure_demo_model
from prefixcache.engine.text.tokenizer import Tokenizer

TRIALS = 500  # per side
WORDS = 8  # per text
WORD_CHARS = 200  # under the library's cacheable word length (256)
MAX_ACCURACY = 0.60
MAX_MEDIAN_GAP = 0.10


@dataclass(slots=True, frozen=True)
class Oracle:
    accuracy: float  # the median split's single-probe accuracy (either direction)
    median_seen_us: float
    median_unseen_us: float

    @property
    def median_gap(self) -> float:
        return abs(self.median_seen_us - self.median_unseen_us) / self.median_unseen_us

    @property
    def closed(self) -> bool:
        return self.accuracy <= MAX_ACCURACY and self.median_gap <= MAX_MEDIAN_GAP

    def __str__(self) -> str:
        return (
            f"accuracy {self.accuracy:.1%}, medians seen {self.median_seen_us:.0f} us / "
            f"unseen {self.median_unseen_us:.0f} us ({self.median_gap:.1%} apart)"
        )


def text(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=WORD_CHARS)) for _ in range(WORDS))


def measure(tok: Tokenizer, seed: int) -> Oracle:
    rng = random.Random(seed)
    seen = [text(rng) for _ in range(TRIALS)]
    unseen = [text(rng) for _ in range(TRIALS)]
    for secret in seen:
        tok.encode(secret, namespace="victim")
    probes = [(True, s) for s in seen] + [(False, u) for u in unseen]
    rng.shuffle(probes)
    times: dict[bool, list[int]] = {True: [], False: []}
    for is_seen, probe in probes:
        probe = probe.encode().decode()  # a new object, as a request body gives
        began = time.thread_time_ns()
        tok.encode(probe, namespace="attacker")
        times[is_seen].append(time.thread_time_ns() - began)
    median = statistics.median(times[True] + times[False])
    below = sum(t < median for t in times[True]) / TRIALS
    return Oracle(
        max(below, 1 - below),
        statistics.median(times[True]) / 1000,
        statistics.median(times[False]) / 1000,
    )


@pytest.fixture
def tokenizer(monkeypatch: pytest.MonkeyPatch) -> Tokenizer:
    """A fresh demo tokenizer (nothing cached by other tests), its work on this thread."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    return Tokenizer.from_folder(ensure_demo_model())


def test_no_timing_oracle_in_the_tokenize_path(tokenizer: Tokenizer) -> None:
    oracle = measure(tokenizer, seed=30)
    print(f"no shared cache: {oracle}")
    assert oracle.closed, f"the attacker tells seen texts from unseen ones: {oracle}"


def test_the_probe_sees_the_library_word_cache_when_it_is_on(tokenizer: Tokenizer) -> None:
    tokenizer._tok.model._resize_cache(10_000)  # the library's default, as before the fix
    oracle = measure(tokenizer, seed=31)
    print(f"library word cache on: {oracle}")
    assert not oracle.closed, f"the probe cannot see a shared cache here: {oracle}"
