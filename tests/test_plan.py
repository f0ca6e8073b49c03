"""The pool plan (shm/plan.py): which intermediate rows of every CPU expert each node holds.

Every plan is checked against the properties the module promises rather than
against numbers copied from its output: the slices cover ``0..I`` exactly once,
contiguously and in node order; every boundary but the last is a whole block;
each node's whole-block count is within one block of its exact quota; the rows
past the last whole block go to the last node that holds rows; a node whose
share rounds to zero is left out with a reason and never has an empty slice.
"""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm.plan import DEFAULT_BLOCK, NodeShare, PlanError, PoolPlan, RowSlice, make_plan, single_node_plan

BLOCKS = (1, 16, 32, 64, 128)


def check_size(plan: PoolPlan, size: int) -> None:
    """Every promise the plan makes about one intermediate size."""
    shares = plan.nodes
    block = plan.block
    slices = plan.slices_for(size)
    order = [s.node for s in shares]
    weight = {s.node: s.workers for s in shares}
    total = sum(weight.values())
    whole, tail = divmod(size, block)

    # coverage and disjointness: contiguous from 0 to I, no empty slice
    assert slices, f"size {size}: no slices at all"
    assert slices[0].start == 0
    assert slices[-1].stop == size
    for a, b in zip(slices, slices[1:]):
        assert a.stop == b.start, f"size {size}: gap or overlap between {a} and {b}"
    for s in slices:
        assert s.rows > 0 and s.rows == s.stop - s.start, s
    covered = [r for s in slices for r in range(s.start, s.stop)]
    assert covered == list(range(size))

    # in node order, each node at most once; slices and left_out partition the nodes
    held = [s.node for s in slices]
    assert len(set(held)) == len(held)
    assert held == [n for n in order if n in held], f"size {size}: slices out of node order"
    dropped = {n: reason for i, n, reason in plan.left_out if i == size}
    assert set(held).isdisjoint(dropped)
    assert set(held) | set(dropped) == set(order)

    # alignment: every boundary except the final stop is a whole number of blocks
    for s in slices:
        assert s.start % block == 0, f"size {size}: slice {s} starts off a {block}-row block"
    for s in slices[:-1]:
        assert s.stop % block == 0, f"size {size}: slice {s} stops off a {block}-row block"

    # remainder rows go to the last node that holds rows; nobody else has a partial block
    for s in slices[:-1]:
        assert s.rows % block == 0
    assert slices[-1].rows % block == tail
    blocks = {s.node: s.rows // block for s in slices}  # whole blocks (tail excluded)
    if whole == 0:
        # nobody gets a whole block: the tail goes to the last node of the plan
        assert [(s.node, s.start, s.stop) for s in slices] == [(order[-1], 0, size)]
    else:
        assert blocks[slices[-1].node] > 0, "the tail went to a node without whole blocks"
    assert sum(blocks.values()) == whole

    # proportionality: within one block of the exact quota whole * w / W
    for node in order:
        quota = Fraction(whole * weight[node], total)
        got = blocks.get(node, 0)
        assert abs(got - quota) < 1, f"size {size}: node {node} has {got} blocks, quota {quota}"

    # left-out nodes: reason says zero rows, slice_of is None
    for node, reason in dropped.items():
        assert "zero rows" in reason, reason
        assert str(size) in reason
        assert plan.slice_of(size, node) is None
    for s in slices:
        assert plan.slice_of(size, s.node) == s

    # turns: each a cut of its own with the same promises, every node holding rows, the first one the slices
    turns = plan.turns.get(size)
    if turns:
        assert len(turns) == len(order) and turns[0] == slices and not dropped and len(set(turns)) > 1
        for e, cut in enumerate(turns * 2):
            assert [s.node for s in cut] == order
            assert [r for s in cut for r in range(s.start, s.stop)] == list(range(size))
            assert all(s.start % block == 0 and s.rows >= block for s in cut)
            assert all(s.rows % block == 0 for s in cut[:-1]) and cut[-1].rows % block == tail
            for s in cut:
                assert abs(s.rows // block - Fraction(whole * weight[s.node], total)) < 1
                assert plan.slice_of(size, s.node, e) == s
        for node in order:  # over the turns too, each node's whole blocks within one block of its quota
            mean_blocks = sum(s.rows // block for cut in turns for s in cut if s.node == node) / len(turns)
            assert abs(mean_blocks - Fraction(whole * weight[node], total)) < 1
        # equal nodes (the same workers) hold the same rows on average when the turns go round all of them
        if len(set(weight.values())) == 1:
            means = {plan.mean_rows(size, node) for node in order[:-1]}  # the last node also holds the tail
            assert max(means) - min(means) < 1e-9


def check_plan(plan: PoolPlan, shares, sizes, block) -> None:
    assert plan.nodes == tuple(shares)
    assert plan.node_ids == tuple(s.node for s in shares)
    assert plan.block == block
    assert sorted(plan.slices) == sorted(set(sizes))
    assert {i for i, _, _ in plan.left_out} <= set(sizes)
    for size in set(sizes):
        check_size(plan, size)


CASES = [
    # (sizes, workers per node, block)
    ([80], [1], 32),
    ([80], [1, 1], 32),
    ([80], [1, 1, 1], 32),
    ([80], [1] * 8, 32),  # 2 whole blocks over 8 nodes: most left out
    ([300], [1] * 8, 32),
    ([768], [28, 28], 32),
    ([1408], [56, 56, 56, 56], 64),
    ([2048, 1408, 768], [16, 48], 128),
    ([7], [3, 5], 32),  # no whole block at all
    ([31, 32, 33], [1, 1], 32),
    ([1], [1, 2, 3, 4, 5, 6, 7, 8], 1),
    ([20000], [1, 64, 1, 64, 1, 64, 1, 64], 16),
    ([100], [64, 1], 1),
    ([4096], [7, 11, 13], 128),
]


@pytest.mark.parametrize("sizes,workers,block", CASES)
def test_plan_properties_on_chosen_cases(sizes, workers, block):
    shares = [NodeShare(n, w) for n, w in enumerate(workers)]
    check_plan(make_plan(shares, sizes, block), shares, sizes, block)


def test_node_ids_need_not_be_small_or_sorted():
    shares = [NodeShare(7, 2), NodeShare(3, 1), NodeShare(100, 1)]
    plan = make_plan(shares, [512], block=32)
    check_plan(plan, shares, [512], 32)
    assert [s.node for s in plan.slices_for(512)] == [7, 3, 100]


@st.composite
def plan_inputs(draw):
    count = draw(st.integers(1, 8))
    ids = draw(st.lists(st.integers(0, 63), min_size=count, max_size=count, unique=True))
    workers = draw(st.lists(st.integers(1, 64), min_size=count, max_size=count))
    sizes = draw(st.lists(st.integers(1, 20000), min_size=1, max_size=3))
    block = draw(st.sampled_from(BLOCKS))
    return [NodeShare(n, w) for n, w in zip(ids, workers)], sizes, block


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_plan_properties_hold_for_any_input(inputs):
    shares, sizes, block = inputs
    check_plan(make_plan(shares, sizes, block), shares, sizes, block)


@settings(max_examples=150, deadline=None)
@given(plan_inputs())
def test_plan_and_digest_are_deterministic(inputs):
    shares, sizes, block = inputs
    a = make_plan(shares, sizes, block)
    b = make_plan(list(shares), list(reversed(sizes)) + sizes, block)  # order and repeats of sizes do not matter
    assert a.slices == b.slices
    assert a.left_out == b.left_out
    assert a.digest == b.digest
    assert re.fullmatch(r"[0-9a-f]{16}", a.digest)


@settings(max_examples=150, deadline=None)
@given(plan_inputs(), plan_inputs())
def test_different_inputs_give_different_digests(x, y):
    (sx, ix, bx), (sy, iy, by) = x, y
    same = tuple(sx) == tuple(sy) and set(ix) == set(iy) and bx == by
    assert (make_plan(sx, ix, bx).digest == make_plan(sy, iy, by).digest) == same


BASE = ([NodeShare(0, 4), NodeShare(1, 4)], [768, 80], 32)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s, i, b: (s, i, 64), id="block"),
        pytest.param(lambda s, i, b: (s, i, 16), id="block-16"),
        pytest.param(lambda s, i, b: ([NodeShare(0, 4), NodeShare(1, 5)], i, b), id="workers"),
        pytest.param(lambda s, i, b: ([NodeShare(0, 8), NodeShare(1, 8)], i, b), id="workers-same-ratio"),
        pytest.param(lambda s, i, b: ([NodeShare(0, 4), NodeShare(2, 4)], i, b), id="node-id"),
        pytest.param(lambda s, i, b: ([NodeShare(1, 4), NodeShare(0, 4)], i, b), id="node-order"),
        pytest.param(lambda s, i, b: (s + [NodeShare(2, 4)], i, b), id="extra-node"),
        pytest.param(lambda s, i, b: (s, [768], b), id="fewer-sizes"),
        pytest.param(lambda s, i, b: (s, [768, 81], b), id="size"),
        pytest.param(lambda s, i, b: (s, i + [1408], b), id="extra-size"),
    ],
)
def test_any_change_of_input_changes_the_digest(change):
    base = make_plan(*BASE)
    assert make_plan(*BASE).digest == base.digest
    assert make_plan(*change(*BASE)).digest != base.digest


def test_ties_go_to_the_later_node():
    # one whole block, two equal nodes: quotas 1/2 and 1/2, the later node takes it
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [32, 40], block=32)
    assert plan.slices_for(32) == (RowSlice(1, 0, 32),)
    assert plan.slices_for(40) == (RowSlice(1, 0, 40),)
    assert {(i, n) for i, n, _ in plan.left_out} == {(32, 0), (40, 0)}


def test_a_spare_block_goes_round_the_tied_nodes_expert_by_expert():
    """768 rows in 256-row blocks (a GGUF K type's) over two equal nodes: 1.5 blocks each. The spare block
    goes to node 1 for even experts, node 0 for odd ones: 384 rows a node on average, not 256 and 512."""
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [768, 1024], block=256)
    assert plan.turns[768] == ((RowSlice(0, 0, 256), RowSlice(1, 256, 768)),
                               (RowSlice(0, 0, 512), RowSlice(1, 512, 768)))
    assert [plan.slice_of(768, 0, e).rows for e in range(4)] == [256, 512, 256, 512]
    assert plan.mean_rows(768, 0) == plan.mean_rows(768, 1) == 384
    assert 1024 not in plan.turns  # an even split has one cut
    assert plan.digest != make_plan([NodeShare(0, 1), NodeShare(1, 1)], [1024], block=256).digest
    # a turn that would leave a node without rows is not taken: one block over two nodes stays with node 1
    one = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [256], block=256)
    assert one.turns == {} and [s.node for s in one.slices_for(256)] == [1]


def test_largest_remainder_wins_over_node_order():
    # 3 whole blocks split 2:1 -> exact quotas 2 and 1; 4 blocks -> 8/3 and 4/3, remainders 2/3 > 1/3
    plan = make_plan([NodeShare(0, 2), NodeShare(1, 1)], [96, 128], block=32)
    assert plan.slices_for(96) == (RowSlice(0, 0, 64), RowSlice(1, 64, 96))
    assert plan.slices_for(128) == (RowSlice(0, 0, 96), RowSlice(1, 96, 128))


def test_tail_goes_to_last_node_holding_rows_not_last_node():
    # 80 rows, block 32: 2 whole blocks and 16 tail rows over 3 equal nodes.
    # quotas 2/3 each: the two later nodes get a block each, node 0 none.
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 1), NodeShare(2, 1)], [80], block=32)
    assert plan.slices_for(80) == (RowSlice(1, 0, 32), RowSlice(2, 32, 80))
    # make the last node too light to get a block: the tail must go to the node before it
    plan = make_plan([NodeShare(0, 10), NodeShare(1, 10), NodeShare(2, 1)], [80], block=32)
    check_size(plan, 80)
    sl = plan.slices_for(80)
    assert [s.node for s in sl] == [0, 1]
    assert sl[-1] == RowSlice(1, 32, 80)
    assert plan.slice_of(80, 2) is None


def test_left_out_nodes_have_reason_and_no_slice():
    shares = [NodeShare(n, 1) for n in range(8)]
    plan = make_plan(shares, [80], block=32)
    held = [s.node for s in plan.slices_for(80)]
    left = [n for i, n, _ in plan.left_out if i == 80]
    assert len(held) == 2 and len(left) == 6
    for _, node, reason in plan.left_out:
        assert re.search(r"rounds to zero rows", reason)
        assert plan.slice_of(80, node) is None
    assert all(s.rows > 0 for s in plan.slices_for(80))


def test_left_out_is_per_size():
    # node 0 is too light for the small expert but holds rows of the large one
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 7)], [64, 2048], block=32)
    assert plan.slice_of(64, 0) is None
    assert plan.slice_of(2048, 0) is not None
    assert [(i, n) for i, n, _ in plan.left_out] == [(64, 0)]


def test_unknown_size_is_refused():
    plan = make_plan([NodeShare(0, 1)], [80])
    with pytest.raises(PlanError, match="no slices for intermediate size 81"):
        plan.slices_for(81)
    with pytest.raises(PlanError, match="81"):
        plan.slice_of(81, 0)


@pytest.mark.parametrize(
    "nodes,sizes,block,message",
    [
        ([], [80], 32, r"at least one node"),
        ([NodeShare(0, 1), NodeShare(1, 1), NodeShare(0, 2)], [80], 32, r"node 0 appears twice"),
        ([NodeShare(0, 1), NodeShare(1, 0)], [80], 32, r"node 1 has 0 workers"),
        ([NodeShare(3, -2)], [80], 32, r"node 3 has -2 workers"),
        ([NodeShare(0, 1)], [80], 0, r"block must be a positive number of rows, got 0"),
        ([NodeShare(0, 1)], [80], -32, r"block must be a positive number of rows, got -32"),
        ([NodeShare(0, 1)], [], 32, r"at least one expert intermediate size"),
        ([NodeShare(0, 1)], [80, 0], 32, r"intermediate size must be positive, got 0"),
        ([NodeShare(0, 1)], [-5], 32, r"intermediate size must be positive, got -5"),
    ],
)
def test_refusals(nodes, sizes, block, message):
    with pytest.raises(PlanError, match=message):
        make_plan(nodes, sizes, block)


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


def test_sizes_may_be_any_iterable():
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], (i for i in (768, 80)), block=32)
    assert sorted(plan.slices) == [80, 768]


@pytest.mark.parametrize("sizes", [[80], [7, 80, 300], [1, 20000]])
@pytest.mark.parametrize("node,workers", [(0, 1), (5, 12)])
def test_single_node_plan_holds_whole_experts(sizes, node, workers):
    plan = single_node_plan(sizes, node=node, workers=workers)
    assert plan.nodes == (NodeShare(node, workers),)
    assert plan.block == DEFAULT_BLOCK
    assert plan.left_out == ()
    for size in sizes:
        assert plan.slices_for(size) == (RowSlice(node, 0, size),)
        assert plan.slice_of(size, node).rows == size
        assert plan.slice_of(size, node + 1) is None
    assert single_node_plan(sizes, node=node, workers=workers).digest == plan.digest
    assert single_node_plan(sizes, node=node + 1, workers=workers).digest != plan.digest
