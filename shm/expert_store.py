"""Where one node's expert slices live.

``HeapExpertStore`` keeps them in this process's memory (the in-process pool).
The node workers' shared-memory store exposes the same ``get`` interface.
"""

from __future__ import annotations

from typing import Mapping

from .checkpoint import Checkpoint
from .expert_source import ExpertRefs, ExpertSlice, read_expert_slice
from .plan import PoolPlan


class HeapExpertStore:
    """(layer, expert) -> this node's ExpertSlice, held in ordinary process memory."""

    def __init__(self, node: int, slices: dict[tuple[int, int], ExpertSlice]):
        self.node = node
        self._slices = slices

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        plan: PoolPlan,
        node: int,
        experts: Mapping[tuple[int, int], tuple[ExpertRefs, int]],
    ) -> "HeapExpertStore":
        """Read ``node``'s rows of every expert; ``experts`` maps (layer, e) -> (refs, intermediate size)."""
        slices: dict[tuple[int, int], ExpertSlice] = {}
        for key, (refs, intermediate) in experts.items():
            rows = plan.slice_of(intermediate, node)
            if rows is not None:
                slices[key] = read_expert_slice(ckpt, refs, rows.start, rows.stop)
        return cls(node, slices)

    def get(self, layer: int, expert: int) -> ExpertSlice | None:
        """This node's slice of the expert, or None when the node holds no rows of it."""
        return self._slices.get((layer, expert))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slices.values())

    def close(self) -> None:
        self._slices.clear()
