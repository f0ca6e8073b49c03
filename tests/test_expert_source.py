"""One node's rows of an expert, read straight from the checkpoint (shm/expert_source.py)
and placed in its shared-memory store (shm/node_store.py).

The reference tensors are read independently of shm/checkpoint.py: with
``safetensors.numpy.load_file`` for F32 and F16, and for BF16 from the raw
file bytes (our own header parse and bit widening), cross-checked against the
F32 checkpoint of the same seed rounded to BF16 by a separate method.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from coordinator.cli.make_model import make_model
from coordinator.model.model_config import load_model_config
from coordinator.model.weights import load_weights
from shm.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from shm.expert_source import ExpertRefs, TensorRef, read_columns, read_expert_slice, read_rows
from shm.node_store import open_node_store
from shm.plan import NodeShare, make_plan
from shm.segments import SHM_DIR

INTER = 301  # 9 whole 32-row blocks and an odd 13-row tail: 8 nodes all get rows, some slices odd-sized
HIDDEN = 40  # 160-byte rows: slices are not 64-byte multiples, so alignment must come from the layout
GEOMETRY = dict(moe_intermediate_size=INTER, num_layers=2, num_experts=4, hidden_size=HIDDEN)
SEED = 11
VARIANTS = ["F32", "F16", "BF16", "F32-sharded", "BF16-sharded"]
NODE_COUNTS = [1, 2, 3, 8]
BLOCK = 32


# --- independent reference readers -------------------------------------------------------


def raw_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype tag, storage array) from the file's bytes, without shm.checkpoint."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    storage = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
    out = {}
    for name, entry in header.items():
        a, b = entry["data_offsets"]
        dt = np.dtype(storage[entry["dtype"]])
        arr = np.frombuffer(data, dtype=dt, count=(b - a) // dt.itemsize, offset=8 + n + a)
        out[name] = (entry["dtype"], arr.reshape(entry["shape"]))
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 is the upper half of an IEEE float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest BF16 value (ties to even mantissa), as float32, by comparing both neighbours."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    lo_bits = bits & np.uint32(0xFFFF0000)
    hi_bits = lo_bits + np.uint32(0x10000)  # next BF16 away from zero
    lo, hi = lo_bits.view(np.float32), hi_bits.view(np.float32)
    d_lo = np.abs(x.astype(np.float64) - lo.astype(np.float64))
    d_hi = np.abs(hi.astype(np.float64) - x.astype(np.float64))
    lo_even = ((lo_bits >> 16) & 1) == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & lo_even)
    return np.where(pick_lo, lo, hi).astype(np.float32)


def reference_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32, read without shm.checkpoint."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        raw = raw_safetensors(path)
        if any(tag == "BF16" for tag, _ in raw.values()):
            out.update({k: bf16_bits_to_f32(a) for k, (_, a) in raw.items()})
        else:
            out.update({k: v.astype(np.float32) for k, v in load_file(path).items()})
    return out


# --- models -------------------------------------------------------------------------------


class Model:
    def __init__(self, directory: Path):
        self.dir = directory
        self.cfg = load_model_config(directory)
        self.ckpt = Checkpoint(directory)
        self.weights = load_weights(self.cfg, self.ckpt)
        self.ref = reference_tensors(directory)

    @property
    def experts(self) -> dict[tuple[int, int], ExpertRefs]:
        return self.weights.experts

    def store_map(self) -> dict[tuple[int, int], tuple[ExpertRefs, int]]:
        return {k: (refs, self.cfg.moe_intermediate_size) for k, refs in self.experts.items()}

    def whole(self, refs: ExpertRefs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, H], up [I, H], down [H, I]) from the reference tensors."""
        assert refs.gate.expert is None and refs.gate.row_offset == 0
        return self.ref[refs.gate.name], self.ref[refs.up.name], self.ref[refs.down.name]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Model] = {}
    for variant in VARIANTS:
        dtype, _, sharded = variant.partition("-")
        d = make_model(root / variant, seed=SEED, dtype=dtype, max_shard_bytes=40_000 if sharded else None, **GEOMETRY)
        built[variant] = Model(d)
    yield built
    for m in built.values():
        m.ckpt.close()


def plan_over(count: int):
    return make_plan([NodeShare(n, 1) for n in range(count)], [INTER], block=BLOCK)


# --- the models are what the test means them to be ------------------------------------------


def test_models_are_the_intended_checkpoints(models):
    for variant, m in models.items():
        dtype = variant.split("-")[0]
        assert m.ckpt.dtypes() == {dtype}
        assert m.cfg.moe_intermediate_size == INTER
        assert len(m.experts) == GEOMETRY["num_layers"] * GEOMETRY["num_experts"]
        sharded = (m.dir / INDEX_NAME).exists()
        assert sharded == variant.endswith("sharded")
        if sharded:
            assert len(list(m.dir.glob("*.safetensors"))) > 3
        for refs in m.experts.values():
            gate, up, down = m.whole(refs)
            assert gate.shape == up.shape == (INTER, m.cfg.hidden_size)
            assert down.shape == (m.cfg.hidden_size, INTER)
            assert np.count_nonzero(gate) > gate.size // 2  # real random numbers, not zeros


def test_bf16_file_holds_the_f32_values_rounded(models):
    f32, bf16 = models["F32"], models["BF16"]
    for name in f32.ref:
        assert np.array_equal(bf16.ref[name], round_to_bf16(f32.ref[name])), name
    # and the rounding matters: BF16 differs from F32 somewhere
    assert any(not np.array_equal(bf16.ref[n], f32.ref[n]) for n in f32.ref)


def test_f16_file_holds_the_f32_values_rounded(models):
    f32, f16 = models["F32"], models["F16"]
    for name in f32.ref:
        assert np.array_equal(f16.ref[name], f32.ref[name].astype(np.float16).astype(np.float32)), name


def test_sharded_file_holds_the_same_values(models):
    for a, b in (("F32", "F32-sharded"), ("BF16", "BF16-sharded")):
        assert models[a].ref.keys() == models[b].ref.keys()
        for name in models[a].ref:
            assert np.array_equal(models[a].ref[name], models[b].ref[name]), name


# --- read_expert_slice -----------------------------------------------------------------------


def check_slice(sl, gate, up, down, start, stop):
    rows, hidden = stop - start, gate.shape[1]
    for part, shape in ((sl.gate, (rows, hidden)), (sl.up, (rows, hidden)), (sl.down, (hidden, rows))):
        assert part.dtype == np.float32
        assert part.shape == shape
        assert part.flags.c_contiguous
    np.testing.assert_array_equal(sl.gate, gate[start:stop])
    np.testing.assert_array_equal(sl.up, up[start:stop])
    np.testing.assert_array_equal(sl.down, down[:, start:stop])
    assert sl.rows == rows
    assert sl.nbytes == 3 * rows * hidden * 4


@pytest.mark.parametrize("count", NODE_COUNTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_node_rows_equal_slices_of_whole_tensors(models, variant, count):
    m = models[variant]
    plan = plan_over(count)
    slices = plan.slices_for(INTER)
    assert [s.node for s in slices] == list(range(count)), "every node should hold rows of this size"
    for key, refs in m.experts.items():
        gate, up, down = m.whole(refs)
        parts = []
        for s in slices:
            sl = read_expert_slice(m.ckpt, refs, s.start, s.stop)
            check_slice(sl, gate, up, down, s.start, s.stop)
            parts.append(sl)
        # the nodes' slices put together are the whole expert, exactly
        np.testing.assert_array_equal(np.concatenate([p.gate for p in parts]), gate)
        np.testing.assert_array_equal(np.concatenate([p.up for p in parts]), up)
        np.testing.assert_array_equal(np.concatenate([p.down for p in parts], axis=1), down)


def test_reads_do_not_write_the_checkpoint(models):
    m = models["F32"]
    refs = m.experts[(0, 0)]
    sl = read_expert_slice(m.ckpt, refs, 0, 32)
    # F32 rows may be views of the read-only map; they must not be writable into the file
    assert not sl.gate.flags.writeable or not np.shares_memory(sl.gate, m.ckpt.raw(refs.gate.name))
    assert sl.down.flags.writeable  # a copy of the columns
    assert not np.shares_memory(sl.down, m.ckpt.raw(refs.down.name))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_other_architectures_name_their_experts_and_read_the_same(tmp_path, arch):
    m = Model(make_model(tmp_path / arch, arch=arch, seed=SEED, dtype="BF16", **GEOMETRY))
    try:
        wanted = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        refs = m.experts[(1, 3)]
        assert [refs.gate.name.split(".")[-2], refs.up.name.split(".")[-2], refs.down.name.split(".")[-2]] == list(wanted)
        assert ".experts.3." in refs.gate.name and ".layers.1." in refs.gate.name
        for s in plan_over(3).slices_for(INTER):
            check_slice(read_expert_slice(m.ckpt, refs, s.start, s.stop), *m.whole(refs), s.start, s.stop)
    finally:
        m.ckpt.close()


def fuse(tensors: dict[str, np.ndarray], layers: int, experts: int) -> dict[str, np.ndarray]:
    """transformers 5 layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    out = dict(tensors)
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(experts):
            g, u, d = (out.pop(f"{p}.{e}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
            gate_up.append(np.concatenate([g, u]))
            down.append(d)
        out[f"{p}.gate_up_proj"] = np.stack(gate_up)
        out[f"{p}.down_proj"] = np.stack(down)
    return out


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_fused_expert_tensors_read_the_same_rows(models, tmp_path, dtype):
    from shm.checkpoint_writer import save_checkpoint

    source = models[dtype]
    d = make_model(tmp_path / "fused", seed=SEED, dtype=dtype, **GEOMETRY)
    for f in d.glob("*.safetensors"):
        f.unlink()
    save_checkpoint(d, fuse(models["F32"].ref, GEOMETRY["num_layers"], GEOMETRY["num_experts"]), dtype=dtype)
    fused = Model(d)
    try:
        for key, refs in fused.experts.items():
            assert refs.gate.expert == key[1] and refs.up.row_offset == INTER
            gate, up, down = source.whole(source.experts[key])
            for s in plan_over(8).slices_for(INTER):
                check_slice(read_expert_slice(fused.ckpt, refs, s.start, s.stop), gate, up, down, s.start, s.stop)
    finally:
        fused.ckpt.close()


def test_read_rows_and_columns_of_a_plain_tensor(models):
    m = models["F16"]
    name = "model.layers.0.self_attn.q_proj.weight"
    whole = m.ref[name]
    ref = TensorRef(name)
    np.testing.assert_array_equal(read_rows(m.ckpt, ref, 5, 9), whole[5:9])
    np.testing.assert_array_equal(read_columns(m.ckpt, ref, 3, 40), whole[:, 3:40])
    np.testing.assert_array_equal(read_rows(m.ckpt, TensorRef(name, row_offset=10), 0, 4), whole[10:14])


# --- the node store in shared memory ----------------------------------------------------------


@pytest.mark.parametrize("count", NODE_COUNTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_node_store_views_equal_the_slices(models, variant, count):
    m = models[variant]
    plan = plan_over(count)
    cpus = sorted(os.sched_getaffinity(0))
    for node in range(count):
        store, report = open_node_store(m.ckpt, plan, node, m.store_map(), m.cfg.hidden_size, cpus)
        path = SHM_DIR / report.segment.lstrip("/")
        try:
            assert report.reloaded and report.threads >= 1
            assert path.exists()
            assert store.keys() == sorted(m.experts)
            data = store.segment.data
            expected_bytes = 0
            for key, refs in m.experts.items():
                view = store.get(*key)
                rows = plan.slice_of(INTER, node, key[1])  # the expert's turn: 9 blocks over 2 nodes go 4 + 5, 5 + 4
                want = read_expert_slice(m.ckpt, refs, rows.start, rows.stop)
                assert store.row_ranges[key] == (rows.start, rows.stop)
                for got, exp in ((view.gate, want.gate), (view.up, want.up), (view.down, want.down)):
                    assert got.dtype == np.float32 and got.shape == exp.shape
                    np.testing.assert_array_equal(got, exp)
                    assert got.flags.c_contiguous
                    assert got.ctypes.data % 64 == 0
                    assert np.shares_memory(got, data)
                expected_bytes += view.nbytes
            assert report.bytes == store.nbytes >= expected_bytes
            del data, view, got
        finally:
            store.close()
        assert not path.exists(), f"{report.segment} left behind"


def test_node_store_slices_reassemble_the_expert(models):
    m = models["BF16-sharded"]
    plan = plan_over(3)
    cpus = sorted(os.sched_getaffinity(0))
    stores = []
    try:
        for node in range(3):
            stores.append(open_node_store(m.ckpt, plan, node, m.store_map(), m.cfg.hidden_size, cpus)[0])
        for key, refs in m.experts.items():
            gate, up, down = m.whole(refs)
            np.testing.assert_array_equal(np.concatenate([s.get(*key).gate for s in stores]), gate)
            np.testing.assert_array_equal(np.concatenate([s.get(*key).up for s in stores]), up)
            np.testing.assert_array_equal(np.concatenate([s.get(*key).down for s in stores], axis=1), down)
        assert len({s.segment.name for s in stores}) == 3
    finally:
        for s in stores:
            s.close()
    assert not any((SHM_DIR / s.segment.name.lstrip("/")).exists() for s in stores)


# --- errors and memory ------------------------------------------------------------------------


def assert_load_refused(d, pattern: str) -> None:
    """Loading the checkpoint in ``d`` fails with a CheckpointError matching ``pattern``."""
    ckpt = Checkpoint(d)
    try:
        with pytest.raises(CheckpointError, match=pattern):
            load_weights(load_model_config(d), ckpt)
    finally:
        ckpt.close()


def test_missing_expert_tensor_is_named(tmp_path):
    d = make_model(tmp_path / "m", seed=SEED, **GEOMETRY)
    tensors = load_file(d / "model.safetensors")
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    del tensors[gone]
    (d / "model.safetensors").unlink()
    save_file(tensors, d / "model.safetensors")
    assert_load_refused(d, gone.replace(".", r"\."))


def test_misshaped_expert_tensor_is_named(tmp_path):
    d = make_model(tmp_path / "m", seed=SEED, **GEOMETRY)
    tensors = load_file(d / "model.safetensors")
    bad = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[bad] = np.ascontiguousarray(tensors[bad].T)  # [I, H] instead of [H, I]
    (d / "model.safetensors").unlink()
    save_file(tensors, d / "model.safetensors")
    assert_load_refused(d, bad.replace(".", r"\.") + rf".*expected \[{HIDDEN}, {INTER}\]")


def test_missing_fused_expert_tensor_is_named(models, tmp_path):
    from shm.checkpoint_writer import save_checkpoint

    d = make_model(tmp_path / "fused", seed=SEED, **GEOMETRY)
    (d / "model.safetensors").unlink()
    tensors = fuse(models["F32"].ref, GEOMETRY["num_layers"], GEOMETRY["num_experts"])
    gone = "model.layers.1.mlp.experts.down_proj"
    del tensors[gone]
    save_checkpoint(d, tensors)
    assert_load_refused(d, gone.replace(".", r"\."))


def test_bf16_rows_are_converted_alone(models):
    m = models["BF16"]
    refs = m.experts[(1, 2)]
    name = refs.gate.name
    rows_, cols = m.ckpt.info(name).shape
    assert m.ckpt.raw(name).dtype == np.uint16
    part = m.ckpt.rows(name, 40, 47)
    assert part.dtype == np.float32 and part.shape == (7, cols)
    assert part.nbytes == 7 * cols * 4
    np.testing.assert_array_equal(part, m.ref[name][40:47])
    cols_part = m.ckpt.rows(refs.down.name, 10, 20, axis=1)
    assert cols_part.shape == (m.cfg.hidden_size, 10) and cols_part.nbytes == m.cfg.hidden_size * 10 * 4
    np.testing.assert_array_equal(cols_part, m.ref[refs.down.name][:, 10:20])
    # and no whole-tensor float32 copy is made on the way: the allocation peak stays far below it
    whole_f32 = rows_ * cols * 4
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        m.ckpt.rows(name, 40, 47)
        read_expert_slice(m.ckpt, refs, 40, 47)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < whole_f32 / 2, f"peak {peak} bytes vs whole tensor {whole_f32}"


def test_f32_rows_are_views_of_the_file(models):
    m = models["F32"]
    name = m.experts[(0, 1)].gate.name
    part = m.ckpt.rows(name, 32, 64)
    assert np.shares_memory(part, m.ckpt.raw(name))
    assert not part.flags.writeable
    assert part.nbytes == 32 * m.cfg.hidden_size * 4
