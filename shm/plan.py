"""The pool plan: which intermediate rows of every CPU expert each node holds.

Expert e computes ``W_down · (silu(W_gate·x) ⊙ (W_up·x))`` with ``W_gate, W_up:
I×H``. The plan cuts rows ``0..I`` into one contiguous slice per node, aligned
to ``block`` rows, sized in proportion to each node's workers (largest
remainder; ties go to the later node). The rows past the last whole block go
to the last node that holds rows. A node whose share rounds to zero rows is
left out, with the reason recorded. Partial outputs are summed in the plan's
node order.

Turns: where blocks do not split evenly among nodes whose remainders tie
(Qwen3-30B-A3B's 768 rows are 3 of a GGUF K type's 256-row blocks: 1.5 a node
for two equal nodes), the spare block would always go to the same node and
make it the slowest in every layer. So when every node holds at least one
block, expert e takes turn e mod N (N nodes): the tie is broken starting from
a different node each turn, and the spare blocks go round the tied nodes.
Each expert's slices still cover 0..I contiguously in node order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Sequence

PLAN_VERSION = 2  # 2: turns
DEFAULT_BLOCK = 32


class PlanError(ValueError):
    """No valid plan exists for the request; the message says why."""


@dataclass(frozen=True)
class NodeShare:
    node: int  # NUMA node id (real or virtual)
    workers: int  # threads the node contributes; the weight of its share


@dataclass(frozen=True)
class RowSlice:
    node: int
    start: int  # first intermediate row held
    stop: int  # one past the last row held

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PoolPlan:
    nodes: tuple[NodeShare, ...]
    block: int
    # intermediate size -> slices in summation (node) order
    slices: dict[int, tuple[RowSlice, ...]] = field(hash=False)
    # (intermediate size, node, reason) for every node left out of a size
    left_out: tuple[tuple[int, int, str], ...] = ()
    # intermediate size -> the slices of each turn (expert e takes turn e mod len), where the turns differ
    turns: dict[int, tuple[tuple[RowSlice, ...], ...]] = field(default_factory=dict, hash=False)

    @property
    def digest(self) -> str:
        doc = {
            "version": PLAN_VERSION,
            "block": self.block,
            "nodes": [[n.node, n.workers] for n in self.nodes],
            "slices": {str(i): [[s.node, s.start, s.stop] for s in sl] for i, sl in sorted(self.slices.items())},
            "turns": {str(i): [[[s.node, s.start, s.stop] for s in sl] for sl in turns]
                      for i, turns in sorted(self.turns.items())},
        }
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes)

    def slices_for(self, intermediate: int) -> tuple[RowSlice, ...]:
        try:
            return self.slices[intermediate]
        except KeyError:
            raise PlanError(f"the plan has no slices for intermediate size {intermediate}") from None

    def slice_of(self, intermediate: int, node: int, expert: int = 0) -> RowSlice | None:
        """The node's rows of expert ``expert`` (of this size), or None if it holds none."""
        turns = self.turns.get(intermediate)
        for s in turns[expert % len(turns)] if turns else self.slices_for(intermediate):
            if s.node == node:
                return s
        return None

    def mean_rows(self, intermediate: int, node: int) -> float:
        """The node's rows of an expert of this size, averaged over the turns."""
        turns = self.turns.get(intermediate) or (self.slices_for(intermediate),)
        return sum(s.rows for sl in turns for s in sl if s.node == node) / len(turns)


def split_rows(intermediate: int, shares: Sequence[NodeShare], block: int,
               turn: int = 0) -> tuple[list[RowSlice], list[tuple[int, str]]]:
    """Cut ``0..intermediate`` into per-node slices; returns (slices, [(node, reason)]). ``turn`` t: among
    equal remainders the node t places before the later ones goes first (t = 0: the later node first)."""
    whole_blocks, tail_rows = divmod(intermediate, block)
    total_workers = sum(s.workers for s in shares)
    quotas = [Fraction(whole_blocks * s.workers, total_workers) for s in shares]
    blocks = [int(q) for q in quotas]
    spare = whole_blocks - sum(blocks)
    # largest fractional part first; among equals the later node first (counted from the turn's node)
    n = len(shares)
    order = sorted(range(n), key=lambda k: (quotas[k] - blocks[k], (k + turn) % n), reverse=True)
    for k in order[:spare]:
        blocks[k] += 1
    if tail_rows:
        holders = [k for k, b in enumerate(blocks) if b > 0]
        last = holders[-1] if holders else len(shares) - 1
    slices: list[RowSlice] = []
    left_out: list[tuple[int, str]] = []
    start = 0
    for k, share in enumerate(shares):
        rows = blocks[k] * block + (tail_rows if tail_rows and k == last else 0)
        if rows == 0:
            left_out.append(
                (share.node, f"its share of {intermediate} rows ({share.workers}/{total_workers} of "
                 f"{whole_blocks} whole {block}-row blocks) rounds to zero rows")
            )
            continue
        slices.append(RowSlice(share.node, start, start + rows))
        start += rows
    assert start == intermediate, (start, intermediate)
    return slices, left_out


def make_plan(nodes: Sequence[NodeShare], intermediate_sizes: Iterable[int], block: int = DEFAULT_BLOCK) -> PoolPlan:
    """A plan over ``nodes`` (in summation order) for every expert size given."""
    if not nodes:
        raise PlanError("a plan needs at least one node")
    if block <= 0:
        raise PlanError(f"block must be a positive number of rows, got {block}")
    seen: set[int] = set()
    for share in nodes:
        if share.workers <= 0:
            raise PlanError(f"node {share.node} has {share.workers} workers; every node in a plan needs at least one")
        if share.node in seen:
            raise PlanError(f"node {share.node} appears twice in the plan")
        seen.add(share.node)
    sizes = sorted(set(int(i) for i in intermediate_sizes))
    if not sizes:
        raise PlanError("a plan needs at least one expert intermediate size")
    slices: dict[int, tuple[RowSlice, ...]] = {}
    turns: dict[int, tuple[tuple[RowSlice, ...], ...]] = {}
    left_out: list[tuple[int, int, str]] = []
    for size in sizes:
        if size <= 0:
            raise PlanError(f"intermediate size must be positive, got {size}")
        cut, dropped = split_rows(size, nodes, block)
        slices[size] = tuple(cut)
        left_out.extend((size, node, reason) for node, reason in dropped)
        rounds = [split_rows(size, nodes, block, t) for t in range(1, len(nodes))] if not dropped else []
        if any(r[0] != cut for r in rounds) and not any(r[1] for r in rounds):  # every node holds rows each turn
            turns[size] = (tuple(cut), *(tuple(r[0]) for r in rounds))
    return PoolPlan(tuple(nodes), block, slices, tuple(left_out), turns)


def single_node_plan(intermediate_sizes: Iterable[int], node: int = 0, workers: int = 1) -> PoolPlan:
    """The non-split plan: one node holds every row of every expert."""
    return make_plan([NodeShare(node, workers)], intermediate_sizes, block=DEFAULT_BLOCK)


def plan_to_dict(plan: PoolPlan) -> dict:
    return {
        "version": PLAN_VERSION,
        "block": plan.block,
        "nodes": [[n.node, n.workers] for n in plan.nodes],
        "sizes": sorted(plan.slices),
        "digest": plan.digest,
    }


def plan_from_dict(doc: dict) -> PoolPlan:
    """Rebuild a plan from plan_to_dict's output; the digest must come out the same."""
    if doc.get("version") != PLAN_VERSION:
        raise PlanError(f"plan version {doc.get('version')!r}; this build makes version {PLAN_VERSION}")
    plan = make_plan([NodeShare(int(n), int(w)) for n, w in doc["nodes"]], doc["sizes"], block=int(doc["block"]))
    if plan.digest != doc.get("digest"):
        raise PlanError(f"plan digest {plan.digest} differs from the one sent ({doc.get('digest')}): "
                        "coordinator and worker run different code")
    return plan
