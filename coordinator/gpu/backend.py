"""The GPU backend: the network on CuPy arrays (model/backend.py's protocol).

Chosen once at open where a usable GPU is there (probe.py). It registers CuPy with model/xp.py, keeps the dense
weights in their storage formats (weights.py) with each layer's q, k and v as one matrix, runs the per-row ops as
the fused kernels of ops.py and the router on the device (router.py), moves the pool's rows through page-locked
buffers and runs the device experts on a stream of their own (transfer.py), and makes small decode steps
graph-ready (graph_steps.py) where the pool can be driven from the stream.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np

from ..model import xp as model_xp
from ..model.backend import Backend, Loaded, Placement
from ..model.decoder import FusedQKV
from ..model.ops import RouterSpec
from . import linear_attention, load, router
from . import ops as device_ops
from .transfer import HostStaging, SideStream, host_functions_refused
from .weights import DeviceMatrix, nbytes, upload

log = logging.getLogger(__name__)

DEVICE_ATTENTION_TOKENS = 64  # up to this many query tokens one launch (ops.gqa_attention); longer prompts take
# the batched matmuls, whose work grows as T x S once, not per block


def upload_tree(obj, xp, _uploaded: dict | None = None):
    """A weights dataclass (nested), list, dict or array with every NumPy array uploaded; an array met twice (a
    tied embedding and lm_head) is uploaded once and shared."""
    uploaded = {} if _uploaded is None else _uploaded  # id(host array) -> device array
    if isinstance(obj, np.ndarray):
        if id(obj) not in uploaded:
            uploaded[id(obj)] = xp.asarray(obj)
        return uploaded[id(obj)]
    if isinstance(obj, list):
        return [upload_tree(v, xp, uploaded) for v in obj]
    if isinstance(obj, dict):
        return {k: upload_tree(v, xp, uploaded) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{k: upload_tree(getattr(obj, k), xp, uploaded) for k in obj.__dataclass_fields__})
    return obj


def fuse_qkv(lw, xp):
    """The layer with q, k and v (and their biases) as views of one new matrix, and that matrix (one matmul
    in place of three: at decode each call costs more than its work); an MLA layer, or one whose q, k and v
    are stored in different formats (a Q4_K_M file's Q6_K v), as it is, and None."""
    if lw.q is None:
        return lw, None
    mats = (lw.q, lw.k, lw.v)
    q_end, k_end = lw.q.shape[0], lw.q.shape[0] + lw.k.shape[0]
    if all(isinstance(m, DeviceMatrix) for m in mats) and len({(m.fmt, m.shape[1]) for m in mats}) == 1:
        weight = DeviceMatrix.stack(list(mats), xp)
        views = dict(q=weight.rows(0, q_end), k=weight.rows(q_end, k_end), v=weight.rows(k_end, weight.shape[0]))
    elif not any(isinstance(m, DeviceMatrix) for m in mats):
        weight = xp.concatenate(list(mats))
        views = dict(q=weight[:q_end], k=weight[q_end:k_end], v=weight[k_end:])
    else:
        return lw, None
    bias = None
    if lw.q_bias is not None:
        bias = xp.concatenate([lw.q_bias, lw.k_bias, lw.v_bias])
        views.update(q_bias=bias[:q_end], k_bias=bias[q_end:k_end], v_bias=bias[k_end:])
    return dataclasses.replace(lw, **views), FusedQKV(weight, bias, q_end, k_end)


class GpuBackend(Backend):
    name = "cupy"
    gpu = True

    def __init__(self, xp=None):
        """``xp``: the CuPy module (None: ``import cupy``, the module in use now; tests install a CPU stand-in
        under that name)."""
        if xp is None:
            import cupy as xp
        self.xp = xp
        model_xp.register(xp)

    @functools.cached_property
    def staging(self) -> HostStaging:
        """Page-locked host buffers for the pool's rows and partials."""
        return HostStaging("cupy")

    @functools.cached_property
    def side(self) -> SideStream:
        """The device experts' own stream."""
        return SideStream("cupy")

    # -- at open --------------------------------------------------------------------------------------------
    def place(self, mcfg, ckpt, config) -> Placement:
        """The hot experts chosen and the GPU's memory planned and checked from the index (load.place): its KV
        cache is in that plan, so check_memory has nothing of its own to check."""
        return load.place(mcfg, ckpt, config)

    def load(self, weights, placement: Placement, ckpt, mcfg, config, compile_missing) -> Loaded:
        """The dense weights uploaded in their storage formats and the hot experts in their layers' formats (a
        failed allocation refused naming the plan), every CUDA module built now (NVRTC, not in the first
        request), the upload's temporaries handed back; the plan's figures become what was uploaded."""
        memory = placement.memory
        with load.out_of_memory(memory):
            placed = upload(weights, self.xp, ckpt, config.dense_dtype, config.batch_invariant)
            experts = load.load_experts(ckpt, weights.experts, placement.experts, placement.formats, mcfg, self.xp)
        load.compile_kernels()
        load.release_pool()
        memory = dataclasses.replace(memory, dense=nbytes(placed), hot_experts=experts.nbytes)
        return Loaded(experts, placed, memory.dense_formats, memory=memory)

    # -- where arrays live ----------------------------------------------------------------------------------
    def upload(self, obj):
        return upload_tree(obj, self.xp)

    def place_weights(self, weights, placed=None):
        return placed or upload(weights, self.xp, dense_dtype="f32")

    def fuse_qkv(self, lw):
        return fuse_qkv(lw, self.xp)

    def kv_b_heads(self, kv_b, nh: int, dn: int, dv: int, c: int):
        """Views of kv_b's rows (the device keeps kv_b alone, not a second copy split by head); where it is stored
        compact, (ops.CompactKvB, None): its rows read as they lie, never widened to float32."""
        if isinstance(kv_b, DeviceMatrix):
            return device_ops.CompactKvB(kv_b.fmt, kv_b.data, nh, dn, dv, c), None
        return super().kv_b_heads(kv_b, nh, dn, dv, c)

    # -- the pool's traffic ---------------------------------------------------------------------------------
    def rows_to_host(self, a) -> np.ndarray:
        return self.staging.rows_to_host(a)

    def partials_buffer(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return self.staging.partials_buffer(shape, dtype)

    def to_device(self, host: np.ndarray):
        return self.staging.to_device(host)

    def side_stream(self):
        return self.side.run()

    def join_side(self) -> None:
        self.side.join()

    # -- numerics: the fused kernels ------------------------------------------------------------------------
    def rms_norm(self, x, weight, eps: float):
        return device_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float):
        return device_ops.add_rms_norm(h, delta, weight, eps)

    def norm_rope(self, x, weight, eps: float, cos, sin):
        """One launch, equal to the two ops, that reads x's rows where they lie (a column slice of the fused QKV
        output)."""
        return device_ops.norm_rope(x, weight, eps, cos, sin)

    def apply_rope(self, x, cos, sin):
        return device_ops.apply_rope(x, cos, sin)

    def apply_rope_interleaved(self, x, cos, sin):
        return device_ops.apply_rope_interleaved(x, cos, sin)

    def swiglu_mlp(self, x, gate, up, down):
        return device_ops.silu_mul(x @ gate.T, x @ up.T) @ down.T

    def widen(self, a):
        return device_ops.from_bf16(a) if a.dtype == np.uint16 else a

    def masked_softmax(self, scores, mask, scale: float):
        return device_ops.masked_softmax(scores, mask, scale)

    def gqa_attention(self, q, k, v, mask):
        if q.shape[0] <= DEVICE_ATTENTION_TOKENS:  # reads bf16 keys and values as they are
            return device_ops.gqa_attention(q, k, v, mask, q.shape[2] ** -0.5)
        return super().gqa_attention(q, k, v, mask)

    def mla_attention_absorbed(self, rows, w_uk, w_uv, mask, scale: float):
        """One fused kernel; w_uv read where it lies (a view, or None beside a compact kv_b)."""
        return device_ops.mla_attention_absorbed(rows, w_uk, None if w_uv is None else w_uv.transpose(0, 2, 1), mask,
                                                 scale)

    def route(self, logits, bias, spec: RouterSpec) -> tuple[np.ndarray, np.ndarray]:
        """Routed on the device; only the choice comes back, [T, 2k] words where the logits are [T, E] floats: the
        same bits as the host's (router.py)."""
        return router.unpack(self.to_host(self.route_packed(logits, bias, spec)), spec.k)

    @staticmethod
    def route_packed(logits, bias, spec: RouterSpec):
        """Device logits [T, E] -> the router's choice packed [T, 2k] on the device (router.route)."""
        return router.route(logits, bias, spec)

    # -- what a GPU adds ------------------------------------------------------------------------------------
    def to_bf16(self, x, out):
        return device_ops.to_bf16(x, out=out)

    def linear_states(self, lc, layers: list[int]):
        return linear_attention.DeviceLinearStates(lc, layers, self.xp)

    def linear_step(self, seqs, lengths: list[int]):
        """Each sequence's states begun for this step and the kernel's tables, (states, tables) uploaded once for
        every Gated DeltaNet layer."""
        states = [cache.linear for _, cache in seqs]
        steps = [(n, st.begin(cache.length, n)) for (_, cache), st, n in zip(seqs, states, lengths)]
        return states, linear_attention.device_tables(self.xp, steps)

    def linear_layer(self, lw, cfg, x, i: int, step, bounds):
        states, tables = step
        return linear_attention.device_layer(lw, cfg.linear, x, i, states, tables, bounds, cfg.rms_norm_eps)

    def graph_runner(self, decoder, context: int | None, capture: bool, step_buffer: int):
        """Graph-ready small steps (graph_steps.py) where the model, the pool and the experts allow them, else
        None. ``context``: the longest sequence (None: the model's), what their caches are reserved to;
        ``capture``: each shape's steps replayed as a CUDA graph from its second step (else queued launch by
        launch); ``step_buffer``: the bytes of the steps' buffer made now (the VRAM plan's; 0: sized by the first
        step)."""
        from .graph_steps import GraphSteps
        from .stream import StreamLink

        cfg, pool = decoder.cfg, decoder.pool
        if cfg.linear is not None:  # a graph-ready step has no Gated DeltaNet layer (nor the attention's gate)
            return None
        if any(d.any() for d in decoder.on_device.values()) and not hasattr(decoder.device_experts, "run_split"):
            return None  # experts kept whole in float32 run an expert at a time from Python
        stream = None
        try:
            link = pool.stream_link(lambda p: StreamLink(p, len(cfg.moe_layers), self.xp))
        except Exception as e:  # cudaHostRegister of the pool's segment refused (drivers have refused such mappings)
            link, why = None, f"the pool's segment could not be registered with the device ({type(e).__name__}: {e})"
        else:
            if link is None:  # a pool driven from Python only
                return None
            stream = self.xp.cuda.Stream()  # the steps' own: a capture needs one
            why = host_functions_refused(stream)  # libcuda loaded and a host function run now, not in a request
            if why is not None:
                pool.close_stream_link()
        if why is not None:
            log.warning("decode steps run eagerly, one layer at a time: %s", why)
            return None
        context = context or cfg.max_position_embeddings
        return GraphSteps(decoder, link, context, capture, step_buffer, stream)
