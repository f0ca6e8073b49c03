"""The CuPy device side against NumPy: `pytest -m gpu` (tools/gpu_check.sh). Skipped without a usable GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model
from coordinator.gpu.probe import probe_cuda

USABLE, WHY = probe_cuda()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
F32 = dict(kv_dtype="f32")  # the KV cache in float32: the GPU equals the CPU path to float32 rounding


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "large"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "large":
        return make_model(d, seed=3, hidden_size=512, moe_intermediate_size=384, num_experts=16, top_k=4,
                          num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)
    return make_model(d, arch=request.param, seed=3)


def test_cupy_and_numpy_backends_agree(model):
    with Engine.open(model, EngineConfig(device="cpu")) as cpu, Engine.open(model, EngineConfig(device="cuda", **F32)) as gpu:
        assert gpu.decoder.backend.name == "cupy"
        a, b = cpu.logits(PROMPT), gpu.logits(PROMPT)
        assert isinstance(b, np.ndarray)
        np.testing.assert_allclose(b, a, atol=2e-4, rtol=1e-4)
        assert cpu.generate(PROMPT[:4], max_new_tokens=8) == gpu.generate(PROMPT[:4], max_new_tokens=8)


def test_hot_experts_on_the_gpu_agree(model):
    with Engine.open(model, EngineConfig(device="cpu")) as cpu:
        want = cpu.logits(PROMPT)
    with Engine.open(model, EngineConfig(device="cuda", gpu_experts=6, **F32)) as gpu:
        got = gpu.logits(PROMPT)
        assert gpu.expert_report()["hit_rate"] > 0
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_split_pool_is_bitwise_across_the_cupy_coordinator(model):
    cfg = dict(device="cuda", numa_split=True, nodes=2)
    with Engine.open(model, EngineConfig(pool="process", **cfg)) as proc, \
            Engine.open(model, EngineConfig(pool="inproc", **cfg)) as inproc:
        assert np.array_equal(proc.logits(PROMPT), inproc.logits(PROMPT))


def test_graph_ready_steps_equal_eager_steps_on_the_gpu(model):
    """The stream-driven step (host functions through cuLaunchHostFunc, the segment registered, the arena) against
    eager steps on the same split process pool: the same logits bit for bit, prompt and decode."""
    cfg = dict(device="cuda", pool="process", numa_split=True, nodes=2)
    with Engine.open(model, EngineConfig(graph=False, **cfg)) as eager, \
            Engine.open(model, EngineConfig(graph=True, **cfg)) as graph:
        assert graph.graph is not None and eager.graph is None
        assert np.array_equal(graph.logits(PROMPT, steps=True), eager.logits(PROMPT, steps=True))
        assert graph.generate(PROMPT[:4], max_new_tokens=12) == eager.generate(PROMPT[:4], max_new_tokens=12)
        assert graph.graph.steps >= 12 and graph.graph.arena.stats.steps > 0
        assert graph.graph.captures >= 1 and graph.graph.replays >= 8  # CUDA graphs replayed


def test_captured_steps_of_several_shapes_equal_queued_steps_on_the_gpu(model):
    """Graph-ready steps replayed as CUDA graphs against the same steps queued launch by launch, on a real
    driver: greedy decode with prompt-lookup drafts (steps of several rows, every row's logits) and two requests
    together give the same tokens, and graphs were captured and launched."""
    from coordinator.request import GenerateRequest
    from coordinator.scheduler import Scheduler

    def run(eng):
        out = {}
        sched = Scheduler(eng, lambda client, event: out.setdefault(event["id"], []).append(event),
                          speculative="ngram", draft_max=3)
        for i in range(2):
            sched.add(b"c", GenerateRequest(id=f"r{i}", prompt_ids=tuple(PROMPT * 2)[i:], max_new_tokens=16,
                                            stream=False))
        while sched.busy:
            sched.step()
        return {rid: [e for e in events if e["type"] == "final"][0]["ids"] for rid, events in out.items()}

    cfg = dict(device="cuda", pool="process", numa_split=True, nodes=2)
    with Engine.open(model, EngineConfig(graph_capture=False, **cfg)) as queued, \
            Engine.open(model, EngineConfig(**cfg)) as captured:
        assert run(captured) == run(queued)
        assert captured.graph.captures >= 2 and captured.graph.replays > 0
        assert queued.graph.captures == 0


def is_pinned(a: np.ndarray) -> bool:
    import cupy

    return cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data).type == 1  # cudaMemoryTypeHost: page-locked


def test_pool_traffic_goes_through_reused_pinned_buffers(model):
    """Rows out and partials back: page-locked host buffers, the same ones every layer and step."""
    seen = {"rows": [], "partials": []}
    with Engine.open(model, EngineConfig(device="cuda", pool="inproc", numa_split=True, nodes=2)) as eng:
        submit, collect = eng.pool.submit, eng.pool.collect

        def spy_submit(req):
            seen["rows"].append(req.x)
            submit(req)

        def spy_collect(out=None):
            seen["partials"].append(out)
            return collect(out=out)

        eng.pool.submit, eng.pool.collect = spy_submit, spy_collect
        eng.logits(PROMPT)
        eng.logits(PROMPT[:3])
    assert seen["rows"] and len(seen["rows"]) == len(seen["partials"])
    for kind, arrays in seen.items():
        assert all(a is not None and is_pinned(a) for a in arrays), kind
        assert all(np.shares_memory(a, arrays[0]) for a in arrays), kind
    assert not is_pinned(np.empty(1 << 16, np.float32))  # the check can tell pageable memory apart


def test_device_experts_queue_on_their_own_stream_without_synchronising(model):
    """Between sending the CPU rows and needing the partials, the coordinator only queues device work."""
    import cupy
    import cupyx

    if not hasattr(cupyx, "allow_synchronize"):
        pytest.skip("this CuPy has no synchronisation detector (cupyx.allow_synchronize)")
    with Engine.open(model, EngineConfig(device="cpu")) as cpu:
        want = cpu.logits(PROMPT)
    with Engine.open(model, EngineConfig(device="cuda", pool="inproc", numa_split=True, nodes=2,
                                         gpu_experts=6, **F32)) as eng:
        dec = eng.decoder
        streams = []
        device_experts, to_device = dec._device_experts, dec.staging.to_device

        def no_sync(fn, record=False):
            def wrapped(*args):
                if record:
                    streams.append(cupy.cuda.get_current_stream().ptr)
                with cupyx.allow_synchronize(False):  # raises cupyx.DeviceSynchronized on a synchronisation
                    return fn(*args)
            return wrapped

        dec._device_experts = no_sync(device_experts, record=True)
        dec.staging.to_device = no_sync(to_device)
        got = eng.logits(PROMPT)
        assert eng.expert_report()["hit_rate"] > 0
        side = dec.side.stream.ptr
    assert side != 0 and side != cupy.cuda.Stream.null.ptr
    assert streams and set(streams) == {side}
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_device_experts_run_while_the_pool_computes(model):
    """A gate queued on the side stream ahead of the device experts opens only when the coordinator asks the
    pool for its partials. Had the coordinator waited on the device experts before that, the gate could not
    open and would time out; with the overlap it opens every layer."""
    import threading

    with Engine.open(model, EngineConfig(device="cuda", pool="inproc", numa_split=True, nodes=2,
                                         gpu_experts=6)) as eng:
        dec, pool = eng.decoder, eng.pool
        state = {"pool_work": False, "gate": None}
        gated_layers, timed_out = [], []
        submit, collect, device_experts = pool.submit, pool.collect, dec._device_experts

        def spy_submit(req):
            state["pool_work"] = True
            submit(req)

        def gated(*args):
            if state["pool_work"]:  # this layer has CPU work: the device experts must not need it first
                gate = state["gate"] = threading.Event()

                def wait_for_collect(_arg, gate=gate):
                    if not gate.wait(20):
                        timed_out.append(args[0])

                dec.side.stream.launch_host_func(wait_for_collect, None)
                gated_layers.append(args[0])
            return device_experts(*args)

        def opening_collect(out=None):
            state["pool_work"] = False
            if state["gate"] is not None:
                state["gate"].set()
            return collect(out=out)

        pool.submit, pool.collect, dec._device_experts = spy_submit, opening_collect, gated
        eng.logits(PROMPT)
    assert gated_layers, "no layer had both CPU and device work"
    assert not timed_out, f"the coordinator waited on the device experts before collecting (layers {timed_out})"


HF = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("case", ["deepseek_v3_basic", "deepseek_v3_no_q_lora", "deepseek_v2_lite", "glm4_moe_basic"])
def test_deepseek_on_the_gpu_matches_transformers(case):
    """MLA (both attention forms), the grouped router and the shared experts in CuPy, hot experts and a split pool."""
    ref = np.load(HF / case / "reference.npz")
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    cfg = dict(device="cuda", numa_split=True, nodes=2, **F32)
    with Engine.open(HF / case, EngineConfig(pool="process", gpu_experts=4, **cfg)) as gpu:
        assert gpu.decoder.backend.name == "cupy"
        assert float(np.max(np.abs(gpu.logits(prompt) - ref["logits"]))) < 2e-4
        steps = gpu.logits(prompt + greedy, steps=True)  # the absorbed form at every step
        assert float(np.max(np.abs(steps - ref["full_logits"]))) < 2e-4
        assert gpu.generate(prompt, max_new_tokens=len(greedy), temperature=0.0, stop_at_eos=False) == greedy
        gpu.decoder.mla_absorb = True
        assert float(np.max(np.abs(gpu.logits(prompt) - ref["logits"]))) < 2e-4


def test_fused_qkv_is_one_matrix_of_views(tmp_path):
    """The device side's q, k and v (and biases) are views of one uploaded matrix a layer, no second copy."""
    import cupy

    with Engine.open(make_model(tmp_path, arch="qwen2_moe", seed=5), EngineConfig(device="cuda")) as eng:
        dec = eng.decoder
        assert len(dec.qkv) == len(dec.w.layers) and all(f is not None for f in dec.qkv)
        for lw, f in zip(dec.w.layers, dec.qkv):
            assert f.weight.shape[0] == lw.q.shape[0] + lw.k.shape[0] + lw.v.shape[0]
            for part in (lw.q, lw.k, lw.v):
                assert cupy.shares_memory(part, f.weight)
            for part in (lw.q_bias, lw.k_bias, lw.v_bias):
                assert cupy.shares_memory(part, f.bias)


def test_compact_weights_and_a_bf16_cache_stay_near_the_cpu_path(tmp_path):
    """The GPU's defaults on a BF16 checkpoint (dense bf16, hot experts bf16, KV bf16) and a q8 setting: near the
    CPU path's logits, the same top tokens, the matrices held in their formats."""
    from coordinator.gpu.weights import DeviceMatrix

    model = make_model(tmp_path / "m", seed=3, dtype="BF16", hidden_size=256, moe_intermediate_size=256,
                       head_dim=32)
    for dense in ("auto", "q8"):
        with Engine.open(model, EngineConfig(device="cpu", dense_dtype=dense, activations="f32")) as cpu:
            want = cpu.logits(PROMPT)
        with Engine.open(model, EngineConfig(device="cuda", dense_dtype=dense, gpu_experts=8)) as gpu:
            got = gpu.logits(PROMPT)
            assert isinstance(gpu.decoder.w.lm_head, DeviceMatrix)
            assert gpu.decoder.w.lm_head.fmt == ("bf16" if dense == "auto" else "q8")
            assert gpu.gpu_memory.kv_tokens > 0 and gpu.gpu_memory.hot_experts > 0
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
