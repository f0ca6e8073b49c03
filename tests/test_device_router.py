"""The device router (coordinator/gpu/router.py) against the host's (host/backend.py's route: the top_k
loop): the same ids and the same weights' bits, for every architecture's fixture under
tests/fixtures/hf (its router's geometry, its real router weights on random hidden states) and for the
full-size geometries; and both against float64 loops. On a GPU through CuPy (`-m gpu`), everywhere else through
tests/cuda_emulator.py."""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from coordinator.gpu import router
from coordinator.gpu.backend import GpuBackend
from coordinator.host import backend as host
from coordinator.model.ops import RouterSpec
from coordinator.model.model_config import load_model_config
from shm.checkpoint import Checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
GATE = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.gate\.weight")


@dataclass(frozen=True)
class Router:
    E: int
    k: int
    normalize: bool
    n_group: int = 1
    topk_group: int = 1
    softmax: bool = True
    scaling: float = 1.0


FULL_SIZE = {  # the Hub configs' routers
    "Qwen3-30B-A3B": Router(128, 8, True),
    "Mixtral-8x7B": Router(8, 2, True),
    "Qwen1.5-MoE-A2.7B": Router(60, 4, False),
    "DeepSeek-V3": Router(256, 8, True, 8, 4, False, 2.5),
    "DeepSeek-V2": Router(160, 6, False, 8, 3, True, 16.0),
    "GLM-4.5-Air": Router(128, 8, True, 1, 1, False, 1.0),
}


def fixture_router(name: str) -> tuple[Router, np.ndarray, np.ndarray | None]:
    """A fixture's router geometry, its first MoE layer's router weights [E, H] and bias [E] (or None)."""
    cfg = load_model_config(FIXTURES / name)
    g = cfg.group_router
    r = Router(cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) if g is None else Router(
        cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, g.n_group, g.topk_group, g.scoring == "softmax",
        g.routed_scaling_factor)
    ckpt = Checkpoint(FIXTURES / name)
    try:
        gate = next(n for n in ckpt.names() if (m := GATE.fullmatch(n)) and int(m.group(1)) == cfg.moe_layers[0])
        bias_name = gate.replace(".weight", ".e_score_correction_bias")
        bias = np.array(ckpt.float32(bias_name)) if bias_name in ckpt.names() else None
        return r, np.array(ckpt.float32(gate)), bias
    finally:
        ckpt.close()


def logit_rows(rng, E: int, gate: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """16 rows of router logits [16, E], and loose [16]: the rows where float32 may rank sigmoid choices otherwise
    than float64 (sigmoids rounded to 1, equal float64 sums of other biases). The router on hidden states
    (random rows where there are no weights), random scales, exact ties (the row's largest logit three times,
    every logit zero, every logit equal), large magnitudes (softmax's e^x at its clamp), tiny ones."""
    if gate is not None:
        hidden = rng.standard_normal((6, gate.shape[1])).astype(np.float32) * np.float32([1, 1, 4, 4, 16, 16])[:, None]
        routed = hidden @ gate.T
    else:
        routed = rng.standard_normal((6, E)).astype(np.float32) * np.float32([0.5, 1, 2, 3, 5, 8])[:, None]
    scaled = rng.standard_normal((3, E)).astype(np.float32) * np.float32([0.01, 1, 4])[:, None]
    tied = rng.standard_normal(E).astype(np.float32)
    tied[[E // 2, 0, E - 1]] = tied.max() + 1
    large = rng.standard_normal((2, E)).astype(np.float32) * 100
    extreme = np.where(np.arange(E) % 3 == 0, 1e4, -1e4).astype(np.float32) * rng.random(E).astype(np.float32)
    tiny = rng.standard_normal(E).astype(np.float32) * np.float32(1e-30)
    rows = np.concatenate([routed, scaled, tied[None], np.zeros((1, E), np.float32), np.full((1, E), 3, np.float32),
                           large, extreme[None], tiny[None]])
    loose = np.zeros(16, bool)
    loose[[4, 5, 8, 9, 11, 12, 13, 14]] = True  # the largest routed and scaled rows, two tie rows, the large ones
    return rows, loose


def spec(r: Router) -> RouterSpec:
    return RouterSpec(r.k, r.n_group, r.topk_group, r.softmax, r.normalize, r.scaling,
                      grouped=not (r.n_group == 1 and r.softmax))


def host_route(logits: np.ndarray, bias: np.ndarray | None, r: Router) -> tuple[np.ndarray, np.ndarray]:
    return host.route(logits, bias, spec(r))


def device_route(cp, logits: np.ndarray, bias: np.ndarray | None, r: Router) -> tuple[np.ndarray, np.ndarray]:
    packed = router.route(cp.asarray(logits), None if bias is None else cp.asarray(bias), spec(r))
    assert packed.dtype == np.uint32 and packed.shape == (logits.shape[0], 2 * r.k)
    return router.unpack(cp.asnumpy(packed), r.k)


def exp64(x: np.ndarray) -> np.ndarray:
    """silu.exp's e^x in float64: its argument clamped to [-87, 87]."""
    return np.exp(np.clip(x, -87.0, 87.0))


def reference(logits: np.ndarray, bias: np.ndarray | None, r: Router) -> tuple[np.ndarray, np.ndarray]:
    """transformers' routers in float64, a row at a time: (ids [T, k], scores [T, E]). Softmax's choice ranks the
    logits (the probabilities' order, where float64 probabilities underflow too)."""
    l = logits.astype(np.float64)
    if r.softmax:
        z = exp64(l - l.max(-1, keepdims=True))
        scores, choice = z / z.sum(-1, keepdims=True), l
    else:
        scores = 1.0 / (1.0 + exp64(-l))
        choice = scores + (0.0 if bias is None else bias.astype(np.float64))
    size = r.E // r.n_group
    ids = []
    for row in choice:
        groups = row.reshape(r.n_group, size)
        group_scores = groups.max(-1) if r.softmax or size < 2 else np.sort(groups, -1)[:, -2:].sum(-1)
        kept = np.argsort(-group_scores, kind="stable")[: r.topk_group]
        ids.append(np.argsort(-np.where(np.isin(np.arange(r.E) // size, kept), row, -np.inf), kind="stable")[: r.k])
    return np.array(ids), scores


def reference_weights(scores: np.ndarray, ids: np.ndarray, r: Router) -> np.ndarray:
    """The float64 weights [T, k] of the experts ``ids``: their scores, normalised (+1e-20), scaled."""
    w = np.take_along_axis(scores, ids, -1)
    if r.normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * r.scaling


def check(cp, r: Router, logits: np.ndarray, bias: np.ndarray | None, loose: np.ndarray, what: str) -> None:
    """Device == host bit for bit; the ids float64's but on the loose rows (softmax: on all of them), the
    weights float64's for the chosen ids within float32 rounding (weight_tolerance)."""
    ids, weights = host_route(logits, bias, r)
    dev_ids, dev_weights = device_route(cp, logits, bias, r)
    assert dev_ids.dtype == np.int64 and dev_weights.dtype == np.float32, what
    assert np.array_equal(dev_ids, ids), (what, dev_ids, ids)
    assert np.array_equal(dev_weights.view(np.uint32), weights.view(np.uint32)), (what, dev_weights - weights)
    want_ids, scores = reference(logits, bias, r)
    exact = np.ones(len(logits), bool) if r.softmax else ~loose
    assert np.array_equal(ids[exact], want_ids[exact]), (what, ids, want_ids)
    want = reference_weights(scores, ids, r)
    assert (np.abs(weights - want) <= weight_tolerance(logits, ids, want, r)).all(), (what, weights, want)


def weight_tolerance(logits: np.ndarray, ids: np.ndarray, want: np.ndarray, r: Router) -> np.ndarray:
    """[T, k]: float32's error in the weights. E + 16 roundings (the sum over the experts, e^x's few, the
    divisions), and softmax's l - max rounded by |l - max| 2^-24 (the row's largest of the chosen), which e^x
    makes a relative error of as much; below e^-87 (the clamp) the float32 values are subnormal."""
    shift = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    spread = np.minimum(np.abs(np.take_along_axis(shift, ids, -1)).max(-1, keepdims=True), 87) if r.softmax else 0
    return (r.E + 16 + spread) * 2.0**-24 * np.abs(want) + 1e-37


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()))
def test_the_device_router_is_the_hosts_on_every_fixture(cp, name):
    """A fixture's router geometry (E, k, norm_topk_prob, groups, scoring, scaling) and its real router weights
    and bias: the device's ids and weights are the host's bits; and float64's."""
    r, gate, bias = fixture_router(name)
    assert gate.shape[0] == r.E and (bias is None) == r.softmax  # the sigmoid routers have one
    logits, loose = logit_rows(np.random.default_rng(len(name)), r.E, gate)
    check(cp, r, logits, bias, loose, name)


@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_the_device_router_is_the_hosts_at_full_size(cp, name):
    """The Hub models' routers (DeepSeek-V3: 256 experts in 8 groups, 4 kept, k 8), random rows and a bias in
    steps of 1/8 (equal biases: exact ties of equal logits); through the GPU backend's route too."""
    r = FULL_SIZE[name]
    rng = np.random.default_rng(r.E + r.k)
    bias = None if r.softmax else (np.round(rng.standard_normal(r.E) * 8) / 64).astype(np.float32)
    logits, loose = logit_rows(rng, r.E, None)
    check(cp, r, logits, bias, loose, name)
    ids, weights = host_route(logits, bias, r)
    group = None if r.n_group == 1 and r.softmax else types.SimpleNamespace(
        n_group=r.n_group, topk_group=r.topk_group, routed_scaling_factor=r.scaling,
        scoring="softmax" if r.softmax else "sigmoid")
    cfg = types.SimpleNamespace(top_k=r.k, norm_topk_prob=r.normalize, group_router=group)
    got = GpuBackend(cp).route(cp.asarray(logits), None if bias is None else cp.asarray(bias), RouterSpec.of(cfg))
    got_ids, got_weights = (cp.asnumpy(a) for a in got)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_weights.view(np.uint32), weights.view(np.uint32))


def test_the_normalisations_guard_is_one_value_on_both_sides():
    """The host loop keeps its own copy of the guard (its compiled code depends on no file outside the build key,
    shm/jit.py); the device router takes model/ops.py's: the two are one value."""
    from coordinator.host import ops as host_ops
    from coordinator.model import ops

    assert host_ops.NORM_EPS == ops.ROUTER_NORM_EPS == np.float32(1e-20) and router.NORM_EPS == ops.ROUTER_NORM_EPS


def test_ties_go_to_the_lower_expert_and_the_lower_group(cp):
    """Every logit equal: the first k experts of the first topk_group groups. The largest logit three times
    (groups 1, 1 and 2 of four experts; groups 0 and 3 tie below them): those three in id order, then the
    lowest expert of the kept groups; the softmax router takes the three alike."""
    r = Router(16, 4, True, 4, 2, False, 2.0)
    bias = np.zeros(16, np.float32)
    logits = np.zeros((2, 16), np.float32)
    logits[1, [9, 5, 6]] = 5.0
    ids, _ = device_route(cp, logits, bias, r)
    assert ids.tolist() == [[0, 1, 2, 3], [5, 6, 9, 4]]
    assert np.array_equal(ids, host_route(logits, bias, r)[0])
    soft = Router(16, 3, False)
    assert device_route(cp, logits, None, soft)[0].tolist() == [[0, 1, 2], [5, 6, 9]]


def test_a_router_the_kernel_cannot_hold_is_refused():
    """More experts than a block holds, k beyond the kept groups' experts, groups that do not divide E, a bias
    with softmax scores: refused before a launch (the kernel would read astray)."""
    logits = np.zeros((1, 16), np.float32)
    too_many = np.zeros((1, router.MAX_EXPERTS + 1), np.float32)
    for rows, bias, rule in [(logits, None, RouterSpec(9, 4, 2, False, True)),
                             (logits, None, RouterSpec(2, 5, 1, False, True)),
                             (logits, np.zeros(16, np.float32), RouterSpec(2, 1, 1, True, True)),
                             (too_many, None, RouterSpec(2, 1, 1, True, True))]:
        with pytest.raises(ValueError, match="route"):
            router.route(rows, bias, rule)
