"""The pool side: where the CPU experts' share of each MoE layer is computed.

base.py      the ExpertPool interface, the request and timing types, the node-order sum
inproc.py    InprocPool: the node workers' code in this process (the reference)
process.py   ProcessPool: one node worker process per node, over ZeroMQ
hot_experts.py  which experts stay whole on the device side (frozen profile, placement)
"""

from .base import (ExpertPool, LayerTiming, NodeHealth, PoolRequest, PoolStats, RowExperts, new_pool_stats,
                   sum_in_node_order)
from .inproc import InprocPool

__all__ = ["ExpertPool", "InprocPool", "LayerTiming", "NodeHealth", "PoolRequest", "PoolStats", "RowExperts",
           "new_pool_stats", "sum_in_node_order"]
