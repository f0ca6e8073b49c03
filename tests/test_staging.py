"""The host side of the pool's traffic (rows out, partials back) and the device experts' side stream,
on the NumPy backend; tests/test_gpu.py checks the same on CuPy (pinned buffers, no synchronisation)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model
from coordinator.gpu.transfer import HostStaging, SideStream
from coordinator.pool import sum_in_node_order

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("staging") / "m", seed=4)


def test_sum_into_a_buffer_has_the_same_bits_as_a_new_array():
    rng = np.random.default_rng(0)
    partials = [rng.standard_normal((5, 64)).astype(np.float32) * 10.0 ** i for i in range(4)]
    first = partials[0].copy()
    want = sum_in_node_order(partials)
    out = np.full((5, 64), np.nan, np.float32)
    got = sum_in_node_order(partials, out)
    assert got is out and np.array_equal(got, want)
    assert np.array_equal(partials[0], first)  # the partials themselves are left alone
    assert not np.array_equal(want, sum_in_node_order(partials[::-1]))  # the order is what makes the bits


@pytest.mark.parametrize("shape,dtype", [((4, 64), np.float32), ((5, 64), np.float64)])
def test_sum_refuses_a_buffer_of_another_shape_or_dtype(shape, dtype):
    partials = [np.ones((5, 64), np.float32)] * 2
    with pytest.raises(ValueError, match="output buffer"):
        sum_in_node_order(partials, np.empty(shape, dtype))


def test_numpy_staging_reuses_one_partials_buffer_and_passes_rows_through():
    staging = HostStaging("numpy")
    a = staging.partials_buffer((3, 16))
    b = staging.partials_buffer((2, 16))
    assert a.shape == (3, 16) and b.shape == (2, 16) and a.dtype == np.float32
    assert np.shares_memory(a, b)  # one buffer for every layer
    big = staging.partials_buffer((5000, 16))  # grows when a batch outgrows it
    assert big.shape == (5000, 16) and not np.shares_memory(big, a)
    assert staging.to_device(big) is big
    rows = np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2]  # not contiguous
    host = staging.rows_to_host(rows)
    assert host.flags.c_contiguous and np.array_equal(host, rows)


def test_numpy_side_stream_runs_in_order():
    """With NumPy there is no stream: run() records nothing for join() to wait on, and an error in the
    block reaches the caller."""
    side = SideStream("numpy")
    assert side.stream is None
    with side.run():
        pass
    assert side._done is None
    side.join()
    with pytest.raises(RuntimeError, match="device experts failed"):
        with side.run():
            raise RuntimeError("device experts failed")


@pytest.mark.parametrize("pool", ["inproc", "process"])
def test_pool_sums_into_the_coordinators_reused_buffer(model, pool):
    """Every MoE layer's partials land in the decoder's one staging buffer, and the output is unchanged."""
    with Engine.open(model, EngineConfig(pool="inproc")) as plain:
        want = plain.logits(PROMPT)
    split = dict(numa_split=True, nodes=2) if pool == "process" else {}
    with Engine.open(model, EngineConfig(pool=pool, gpu_experts=4, **split)) as eng:
        outs = []
        collect = eng.pool.collect

        def spying(out=None):
            outs.append(out)
            got = collect(out=out)
            assert got is out
            return got

        eng.pool.collect = spying
        got = eng.logits(PROMPT)
        moe_layers = len(eng.model_config.moe_layers)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert len(outs) == moe_layers  # one collect per MoE layer
    assert all(o is not None for o in outs)
    assert all(np.shares_memory(o, outs[0]) for o in outs)  # the same buffer every layer


class FakeCuda:
    """Just enough of CuPy's stream and event API to log the order of events (the real thing: test_gpu.py)."""

    def __init__(self):
        self.log = []
        self.null = self.Stream(self, "main")
        self.current = self.null

    class Event:
        def __init__(self, cuda, name):
            self.cuda, self.name = cuda, name

        def synchronize(self):
            self.cuda.log.append(("host waits", self.name))

    class Stream:
        def __init__(self, cuda, name="side", non_blocking=False):
            self.cuda, self.name, self.non_blocking, self.events = cuda, name, non_blocking, 0

        def record(self):
            self.events += 1
            event = FakeCuda.Event(self.cuda, f"{self.name}#{self.events}")
            self.cuda.log.append(("record", event.name))
            return event

        def wait_event(self, event):
            self.cuda.log.append((f"{self.name} waits", event.name))

        def __enter__(self):
            self.previous, self.cuda.current = self.cuda.current, self
            return self

        def __exit__(self, *exc):
            self.cuda.current = self.previous

    def get_current_stream(self):
        return self.current


@pytest.fixture
def fake_cupy(monkeypatch):
    import sys
    import types

    import coordinator.gpu.transfer as xp_module

    cuda = FakeCuda()
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=lambda non_blocking=False: FakeCuda.Stream(cuda, non_blocking=non_blocking),
        get_current_stream=cuda.get_current_stream))
    cupy.asarray = lambda host: (cuda.log.append(("upload on", cuda.current.name)), np.array(host))[1]
    monkeypatch.setattr(xp_module, "_cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.empty(shape, dtype)))
    return cuda


def test_partials_buffer_is_handed_out_again_only_after_its_upload(fake_cupy):
    staging = HostStaging("cupy")
    first = staging.partials_buffer((2, 8))
    assert fake_cupy.log == []  # nothing in flight yet: no wait
    staging.to_device(first)
    assert fake_cupy.log == [("upload on", "main"), ("record", "main#1")]
    second = staging.partials_buffer((3, 8))
    assert fake_cupy.log[-1] == ("host waits", "main#1")  # that upload, and nothing else
    assert np.shares_memory(first, second)
    staging.partials_buffer((3, 8))
    assert fake_cupy.log[-1] == ("host waits", "main#1")  # no second wait for the same upload


def test_side_stream_forks_and_joins_by_events(fake_cupy):
    side = SideStream("cupy")
    assert side.stream.non_blocking  # no implicit ordering with the legacy default stream
    with side.run():
        assert fake_cupy.current is side.stream  # the device experts queue here
    assert fake_cupy.current is fake_cupy.null
    assert fake_cupy.log == [("record", "main#1"), ("side waits", "main#1"), ("record", "side#1")]
    side.join()
    assert fake_cupy.log[-1] == ("main waits", "side#1")
    side.join()  # nothing new queued on the side: nothing to wait for
    assert len(fake_cupy.log) == 4 and not any(kind == "host waits" for kind, _ in fake_cupy.log)


def test_an_array_met_twice_is_uploaded_once():
    """A tied embedding and lm_head share one device copy."""
    import types

    from coordinator.gpu.backend import upload_tree as on_device
    from coordinator.model.weights import MLPWeights

    uploads = []
    fake = types.SimpleNamespace(asarray=lambda a: (uploads.append(a), a.copy())[1])
    shared = np.ones((3, 2), np.float32)
    moved = on_device([MLPWeights(gate=shared, up=shared, down=np.zeros((2, 3), np.float32))], fake)[0]
    assert len(uploads) == 2
    assert moved.gate is moved.up and moved.gate is not shared and moved.down.shape == (2, 3)
