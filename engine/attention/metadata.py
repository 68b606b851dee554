"""Per-step attention metadata in FlashInfer's paged form, built once and shared by every layer.

The runner orders a step's sequences as::

    [ prefills (qo_len > 1) | plain decodes | cascade group 0 | cascade group 1 | ... ]

so each kind of work is a contiguous slice of the flattened query rows. For sequence ``b``:

    kv_len[b]  = start_pos[b] + qo_len[b]          (the new tokens are already in the table)
    pages      = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    last page  = kv_len[b] - (num_pages - 1) * page_size   (1 .. page_size)

``window`` (0: none) is a sliding window: the query at position p attends keys k with
``p - window < k <= p`` only. One metadata serves one layer group; the sliding layers get
their own (their block tables map pages that slid out of every window to a null page, and
they are built without cascade or prefill groups).

A cascade group is a run of decodes whose tables start with the same ``shared_blocks`` full
blocks; attention reads that prefix once for the whole group, then each member's own suffix.
Prefills that start after the same cached blocks (a burst of requests over one system prompt)
form prefill groups the same way, inside the prefill slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIN_CASCADE_SHARED_BLOCKS = 4  # below 64 shared tokens the split costs more than it saves


@dataclass(slots=True, frozen=True)
class SeqSpec:
    """One sequence's work this step, as attention sees it."""

    start_pos: int  # tokens already in the cache
    num_new: int  # tokens computed (and written) this step
    block_table: Sequence[int]

    @property
    def kv_len(self) -> int:
        return self.start_pos + self.num_new


@dataclass(slots=True, frozen=True)
class CascadeGroup:
    begin: int  # first sequence index (== first query row: decodes have one row each)
    end: int
    num_shared_blocks: int


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # int32 [B]
    positions: torch.Tensor  # int64 [T]: position of each query row within its sequence
    batch_indices: torch.Tensor  # int32 [T]: sequence of each query row
    seqs: list[SeqSpec]
    num_prefills: int  # sequences [0, num_prefills) have qo_len > 1
    num_plain_decodes: int  # then this many decodes outside any cascade group
    cascade_groups: list[CascadeGroup] = field(default_factory=list)
    prefill_groups: list[CascadeGroup] = field(default_factory=list)  # within the prefills
    window: int = 0  # sliding window in keys; 0 = full causal attention

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs[: self.num_prefills])

    @property
    def decode_begin(self) -> int:
        return self.num_prefills

    @property
    def cascade_begin(self) -> int:
        return self.num_prefills + self.num_plain_decodes

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSpec],
        block_size: int,
        device: torch.device | str = "cpu",
        cascade_groups: Sequence[CascadeGroup] = (),
        prefill_groups: Sequence[CascadeGroup] = (),
        window: int = 0,
    ) -> AttentionMetadata:
        """Build from sequences already in runner order (prefills, plain decodes, groups)."""
        seqs = list(seqs)
        num_prefills = 0
        while num_prefills < len(seqs) and seqs[num_prefills].num_new > 1:
            num_prefills += 1
        assert all(s.num_new == 1 for s in seqs[num_prefills:]), "prefills must come first"
        groups = list(cascade_groups)
        cascade_begin = groups[0].begin if groups else len(seqs)
        for i, g in enumerate(groups):
            assert g.end - g.begin >= 2 and g.num_shared_blocks >= 1
            assert g.begin == (groups[i - 1].end if i else cascade_begin)
        assert not groups or groups[-1].end == len(seqs)
        assert all(g.end <= num_prefills for g in prefill_groups), "prefill groups hold prefills"
        assert window >= 0 and not (window and (groups or prefill_groups)), "no groups in a window"

        qo_indptr, kv_indptr, kv_indices, last_lens = [0], [0], [], []
        positions: list[int] = []
        batch_indices: list[int] = []
        for b, s in enumerate(seqs):
            if s.num_new < 1:
                raise ValueError("every sequence must compute at least one token")
            num_pages = -(-s.kv_len // block_size)
            if len(s.block_table) < num_pages:
                raise ValueError(
                    f"block table has {len(s.block_table)} blocks, {num_pages} needed for "
                    f"{s.kv_len} tokens"
                )
            kv_indices.extend(s.block_table[:num_pages])
            kv_indptr.append(len(kv_indices))
            qo_indptr.append(qo_indptr[-1] + s.num_new)
            last_lens.append(s.kv_len - (num_pages - 1) * block_size)
            positions.extend(range(s.start_pos, s.kv_len))
            batch_indices.extend([b] * s.num_new)

        def i32(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(
            block_size=block_size,
            qo_indptr=i32(qo_indptr),
            kv_indptr=i32(kv_indptr),
            kv_indices=i32(kv_indices),
            kv_last_page_len=i32(last_lens),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            batch_indices=i32(batch_indices),
            seqs=seqs,
            num_prefills=num_prefills,
            num_plain_decodes=cascade_begin - num_prefills,
            cascade_groups=groups,
            prefill_groups=list(prefill_groups),
            window=window,
        )


def plan_step_order(
    seqs: Sequence[SeqSpec],
    block_size: int,
    enable_cascade: bool = True,
    min_shared_blocks: int = MIN_CASCADE_SHARED_BLOCKS,
) -> tuple[list[int], list[CascadeGroup]]:
    """Order a step's sequences for ``AttentionMetadata.build`` and find cascade groups.

    Returns ``order`` (``order[j]`` is the caller's index of the j-th sequence) and the groups,
    whose ``begin``/``end`` index the reordered list. Decodes are grouped by their first block;
    a group shares the longest common run of leading blocks that lie fully before every
    member's ``start_pos`` (those blocks are read-only), and needs at least two members and
    ``min_shared_blocks`` shared blocks.
    """
    prefills = [i for i, s in enumerate(seqs) if s.num_new > 1]
    decodes = [i for i, s in enumerate(seqs) if s.num_new == 1]
    if not enable_cascade:
        return prefills + decodes, []
    # Prefills after the same cached first block sit next to each other (prefill groups).
    prefills.sort(key=lambda i: _first_cached_block(seqs[i], block_size))

    by_first: dict[int, list[int]] = {}
    for i in decodes:
        s = seqs[i]
        if s.start_pos >= block_size * min_shared_blocks:
            by_first.setdefault(int(s.block_table[0]), []).append(i)

    plain = list(decodes)
    grouped: list[tuple[list[int], int]] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        shared = _common_cached_blocks([seqs[i] for i in members], block_size)
        if shared >= max(1, min_shared_blocks):
            grouped.append((members, shared))
            taken = set(members)
            plain = [i for i in plain if i not in taken]

    order = prefills + plain
    groups: list[CascadeGroup] = []
    for members, shared in grouped:
        groups.append(CascadeGroup(len(order), len(order) + len(members), shared))
        order.extend(members)
    return order, groups


def _first_cached_block(s: SeqSpec, block_size: int) -> int:
    return int(s.block_table[0]) if s.start_pos >= block_size else -1


def find_prefill_groups(
    seqs: Sequence[SeqSpec],
    block_size: int,
    min_shared_blocks: int = MIN_CASCADE_SHARED_BLOCKS,
) -> list[CascadeGroup]:
    """Runs of prefills (in ``plan_step_order``'s order) that start after the same cached full
    blocks: their queries attend to that prefix in one product, reading its KV once."""
    groups: list[CascadeGroup] = []
    begin = 0
    num_prefills = sum(1 for s in seqs if s.num_new > 1)
    while begin < num_prefills:
        first = _first_cached_block(seqs[begin], block_size)
        end = begin + 1
        while end < num_prefills and _first_cached_block(seqs[end], block_size) == first:
            end += 1
        if first >= 0 and end - begin >= 2:
            shared = _common_cached_blocks(seqs[begin:end], block_size)
            if shared >= max(1, min_shared_blocks):
                groups.append(CascadeGroup(begin, end, shared))
        begin = end
    return groups


def _common_cached_blocks(members: Sequence[SeqSpec], block_size: int) -> int:
    """Leading blocks every member shares that lie fully before every member's new tokens."""
    shared = min(s.start_pos // block_size for s in members)
    ref = members[0].block_table
    for s in members[1:]:
        n = 0
        while n < shared and s.block_table[n] == ref[n]:
            n += 1
        shared = n
    return shared
