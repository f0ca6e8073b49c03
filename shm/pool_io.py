"""The process pool's data path: one shared-memory segment per pool, owned by the coordinator.

The coordinator writes a layer's rows X and its routing once for all nodes,
rings each node's doorbell, and sleeps on its own; each node worker computes
from the segment, writes its partial Y_n in place, and rings back. ZeroMQ is
left to the start-up handshake and the control messages (errors, last words,
STREAM reads, shutdown); no array crosses a socket on the hot path.

Layout (the data part of a segments.py segment, layout kind "pool-io"; every
region starts on a 64-byte line)::

    line 0         request:  seq i64 | layer i64 | T i64 | P i64 | kind i64 (1 compute, 2 ping) | 3 x i64 spare
    line 1         coordinator's doorbell: uint32 (futex word) the workers ring when they are done
    line 2 + n     node n:   doorbell u32 + pad | go i64 (the seq node n is asked for) | done i64 (the last
                             seq it finished) | status i64 (0 ok, 1 error: text in message_n) |
                             compute_ns | bytes_read | received_ns | sent_ns  (monotonic ns)
    X              [max_tokens, H] float32
    tokens         [max_pairs] int32, experts [max_pairs] int32, weights [max_pairs] float32
    Y_n            [max_tokens, H] float32, one per node
    message_n      [MESSAGE_BYTES] utf-8, one per node

Protocol: the coordinator writes X, the routing and the request line, then for
each node stores ``go = seq`` (release) and rings the node's doorbell. A
worker that sees ``go != done`` reads the request, checks it (fixed fields,
bounded arrays), computes into Y_n, stores its timings and ``done = go``
(release) and rings the coordinator. Before a worker is restarted the
coordinator sets its ``go`` back to its ``done``, so a new incarnation never
starts on a request the coordinator has moved past; to resend, it stores
``go`` again and rings.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from . import doorbell, segments

LINE = 64
MESSAGE_BYTES = 512
KIND_COMPUTE, KIND_PING = 1, 2
REQ_SEQ, REQ_LAYER, REQ_T, REQ_P, REQ_KIND = range(5)
NODE_GO, NODE_DONE, NODE_STATUS, NODE_COMPUTE_NS, NODE_BYTES, NODE_RECEIVED_NS, NODE_SENT_NS = range(1, 8)
STATUS_OK, STATUS_ERROR = 0, 1
LAYOUT_KIND = "pool-io"


def _align(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


@dataclass(frozen=True)
class PoolIoLayout:
    nodes: int
    max_tokens: int
    max_pairs: int
    hidden: int

    @property
    def x_offset(self) -> int:
        return (2 + self.nodes) * LINE

    @property
    def rows_bytes(self) -> int:
        return _align(self.max_tokens * self.hidden * 4)

    @property
    def pairs_bytes(self) -> int:
        return _align(self.max_pairs * 4)

    @property
    def routing_offset(self) -> int:
        return self.x_offset + self.rows_bytes

    def y_offset(self, node_index: int) -> int:
        return self.routing_offset + 3 * self.pairs_bytes + node_index * self.rows_bytes

    def message_offset(self, node_index: int) -> int:
        return self.y_offset(self.nodes) + node_index * MESSAGE_BYTES

    @property
    def data_bytes(self) -> int:
        return self.message_offset(self.nodes)

    def as_dict(self) -> dict:
        return {"kind": LAYOUT_KIND, "nodes": self.nodes, "max_tokens": self.max_tokens,
                "max_pairs": self.max_pairs, "hidden": self.hidden}

    @classmethod
    def from_dict(cls, d: dict) -> PoolIoLayout:
        if d.get("kind") != LAYOUT_KIND:
            raise segments.SegmentError(f"not a pool-io segment (layout kind {d.get('kind')!r})")
        return cls(int(d["nodes"]), int(d["max_tokens"]), int(d["max_pairs"]), int(d["hidden"]))


class PoolIo:
    """Views of the pool segment, the same on both sides."""

    def __init__(self, segment: segments.Segment, layout: PoolIoLayout):
        self.segment = segment
        self.layout = layout
        data = segment.data  # uint8 [data_bytes]
        L = layout
        self.request = data[:LINE].view(np.int64)  # [8]
        self.coordinator_bell = data[LINE:2 * LINE].view(np.uint32)  # [16], word 0
        self.node_lines = [data[(2 + n) * LINE:(3 + n) * LINE].view(np.int64) for n in range(L.nodes)]  # [8] each
        self.node_bells = [line.view(np.uint32) for line in self.node_lines]  # word 0 of each line
        self.x = data[L.x_offset:L.x_offset + L.max_tokens * L.hidden * 4].view(np.float32).reshape(
            L.max_tokens, L.hidden)
        r, pb = L.routing_offset, L.pairs_bytes
        self.tokens = data[r:r + L.max_pairs * 4].view(np.int32)
        self.experts = data[r + pb:r + pb + L.max_pairs * 4].view(np.int32)
        self.weights = data[r + 2 * pb:r + 2 * pb + L.max_pairs * 4].view(np.float32)
        self.y = [data[L.y_offset(n):L.y_offset(n) + L.max_tokens * L.hidden * 4].view(np.float32).reshape(
            L.max_tokens, L.hidden) for n in range(L.nodes)]
        self.messages = [data[L.message_offset(n):L.message_offset(n) + MESSAGE_BYTES] for n in range(L.nodes)]

    # -- the coordinator's side ----------------------------------------------------------------------------
    def post(self, seq: int, layer: int, x: np.ndarray, tokens: np.ndarray, experts: np.ndarray,
             weights: np.ndarray, kind: int = KIND_COMPUTE) -> None:
        """Write one request (X and the routing once for every node); the nodes are asked with ``ask``."""
        T, P = x.shape[0], tokens.size
        self.x[:T] = x
        self.tokens[:P] = tokens
        self.experts[:P] = experts
        self.weights[:P] = weights
        req = self.request
        req[REQ_LAYER], req[REQ_T], req[REQ_P], req[REQ_KIND] = layer, T, P, kind
        doorbell.store_release(req, REQ_SEQ, np.int64(seq))

    def ask(self, node_index: int, seq: int) -> None:
        doorbell.store_release(self.node_lines[node_index], NODE_GO, np.int64(seq))
        doorbell.ring(self.node_bells[node_index], 0)

    def cancel(self, node_index: int) -> None:
        """Before a restart: the node's next incarnation has nothing to do until asked again."""
        line = self.node_lines[node_index]
        doorbell.store_release(line, NODE_GO, doorbell.load_acquire(line, NODE_DONE))

    def done(self, node_index: int) -> int:
        return int(doorbell.load_acquire(self.node_lines[node_index], NODE_DONE))

    def bell_count(self) -> int:
        return int(doorbell.load_acquire(self.coordinator_bell, 0))

    def wait_bell(self, seen: int, timeout_s: float, threads: int = 1) -> None:
        """Sleep on the coordinator's doorbell, with ``threads`` of numba's team (doorbell.wait_ring_team)."""
        doorbell.wait_ring_team(self.coordinator_bell, 0, seen, timeout_s, threads)

    def error_message(self, node_index: int) -> str:
        raw = bytes(self.messages[node_index])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    # -- a worker's side -------------------------------------------------------------------------------------
    def asked(self, node_index: int) -> int:
        """The seq node ``node_index`` is asked for (== done when there is nothing to do)."""
        return int(doorbell.load_acquire(self.node_lines[node_index], NODE_GO))

    def my_bell_count(self, node_index: int) -> int:
        return int(doorbell.load_acquire(self.node_bells[node_index], 0))

    def wait_my_bell(self, node_index: int, seen: int, timeout_s: float, threads: int = 1) -> None:
        """Sleep on node ``node_index``'s doorbell, with ``threads`` of numba's team (doorbell.wait_ring_team)."""
        doorbell.wait_ring_team(self.node_bells[node_index], 0, seen, timeout_s, threads)

    def bell_address(self, node_index: int) -> int:
        """The address of node ``node_index``'s doorbell word (for compiled code: node_worker/answer.py)."""
        return doorbell.word_address(self.node_bells[node_index], 0)

    def finish(self, node_index: int, seq: int, status: int, compute_ns: int, bytes_read: int, received_ns: int,
               message: str = "") -> None:
        line = self.node_lines[node_index]
        if message:
            raw = message.encode("utf-8", "replace")[:MESSAGE_BYTES - 1]
            self.messages[node_index][:len(raw) + 1] = np.frombuffer(raw + b"\0", np.uint8)
        line[NODE_STATUS], line[NODE_COMPUTE_NS], line[NODE_BYTES] = status, compute_ns, bytes_read
        line[NODE_RECEIVED_NS], line[NODE_SENT_NS] = received_ns, time.monotonic_ns()
        doorbell.store_release(line, NODE_DONE, np.int64(seq))
        doorbell.ring(self.coordinator_bell, 0)

    def close(self) -> None:
        self.segment.close()


NAME_PREFIX = f"/{segments.PREFIX}pool."


def remove_stale() -> list[str]:
    """Remove the data-path segments whose coordinator is gone (a SIGKILL); their names."""
    gone = []
    for info in segments.list_segments():
        if info.name.startswith(NAME_PREFIX) and info.header is not None and not info.owner_alive:
            if segments.unlink(info.name):
                gone.append(info.name)
    return gone


def segment_name() -> str:
    return f"{NAME_PREFIX}{os.getpid()}.{secrets.token_hex(4)}"


def create(layout: PoolIoLayout, model_digest: str, plan_digest: str) -> PoolIo:
    seg = segments.create(segment_name(), -1, model_digest, plan_digest, layout.as_dict(), layout.data_bytes)
    seg.data[:] = 0
    seg.mark_complete()
    return PoolIo(seg, layout)


def attach(name: str, model_digest: str, plan_digest: str) -> PoolIo:
    seg = segments.attach(name, model_digest, plan_digest)
    try:
        return PoolIo(seg, PoolIoLayout.from_dict(seg.header.layout))
    except BaseException:
        seg.close()
        raise
