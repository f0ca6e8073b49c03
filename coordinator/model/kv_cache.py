"""Per-sequence key/value cache: one growing buffer per layer.

Each cached token holds two entries per layer: the key and the value
([kv heads, head dim] each), or, for multi-head latent attention (``latent``),
the compressed latent after kv_a_layernorm [kv_lora_rank] and the roped shared
key [qk_rope_head_dim]: (kv_lora_rank + qk_rope_head_dim) values a layer, not
2 x heads x head dim. Values are float32, or on the device bf16 (``dtype``), held
as uint16 bits (CuPy has no bfloat16): written rounded to nearest even
(the backend's to_bf16), read by the attention kernels as they are.

A model with Gated DeltaNet layers (Qwen3-Next) caches keys and values in its attention layers only
(``attention_layers``); each of the other layers keeps a fixed-size state per sequence here
(linear_attention.LinearState, made by the layer on first use), rewound with the cache by ``truncate``; on the
device the states of all those layers are one linear_attention.DeviceLinearStates (``linear``), made with the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheLayout:
    """What a sequence's cache holds per token and layer."""

    num_layers: int
    num_kv_heads: int = 1
    head_dim: int = 1
    latent: tuple[int, int] | None = None  # MLA: (kv_lora_rank, qk_rope_head_dim) in place of keys and values
    dtype: str = "f32"  # "f32" or "bf16" (uint16 bits)
    attention_layers: tuple[int, ...] | None = None  # the layers that cache keys and values (None: all)
    first_layer: int = 0  # the model's id of the cache's first layer (an MTP layer's own cache: num_layers)

    @property
    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The two entries' shapes per token: (key, value), or MLA's (latent, rope key)."""
        if self.latent is None:
            return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)
        return (self.latent[0],), (self.latent[1],)


class KVCache:
    def __init__(self, layout: CacheLayout, capacity: int = 64, xp=np, to_bf16=None):
        """``xp``: NumPy, or the GPU's module where the cache lives on the device; ``to_bf16(x, out)``: writes float32
        rows as bf16 bits into a bf16 cache (the backend's, Backend.to_bf16)."""
        num_layers = layout.num_layers
        self.length = 0  # tokens already cached
        self.start = 0  # the position of the first of them (restart: an MTP cache that dropped the earlier ones)
        self.first_layer = layout.first_layer
        self.xp = xp  # NumPy, or CuPy when the cache lives on the device
        self.bf16 = layout.dtype == "bf16"
        self._to_bf16 = to_bf16
        self._dtype = np.uint16 if self.bf16 else np.float32
        self._shapes = layout.shapes
        attending = set(range(num_layers) if layout.attention_layers is None else layout.attention_layers)
        caps = [capacity if i in attending else 0 for i in range(num_layers)]  # no keys in a state layer
        self._k = [xp.zeros((cap, *self._shapes[0]), self._dtype) for cap in caps]  # [cap, ...]
        self._v = [xp.zeros((cap, *self._shapes[1]), self._dtype) for cap in caps]
        self._attending = len(attending)
        self._attention_buffers = sorted(attending)  # the buffers that hold keys (a state layer's are empty)
        self.moves = 0  # how often a buffer moved (grew): whoever keeps their addresses reads them again
        self.states: dict = {}  # layer -> its state (a Gated DeltaNet layer's LinearState)
        self.linear = None  # on the device: every Gated DeltaNet layer's state (DeviceLinearStates)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over the attention layers."""
        per_layer = sum(int(np.prod(s)) for s in self._shapes) * np.dtype(self._dtype).itemsize
        return self._attending * per_layer

    @property
    def state_bytes(self) -> int:
        """Bytes of the fixed-size states (Gated DeltaNet layers), whatever the length."""
        return sum(state.nbytes for state in self.states.values()) + (self.linear.nbytes if self.linear else 0)

    def _reserve(self, layer: int, needed: int, exact: bool = False) -> None:
        """``layer``: an index into this cache's buffers; ``exact``: grown to ``needed`` (not doubled)."""
        cap = self._k[layer].shape[0]
        if needed <= cap:
            return
        new_cap = needed if exact else max(needed, 2 * cap)
        for buf, shape in zip((self._k, self._v), self._shapes):
            grown = self.xp.zeros((new_cap, *shape), self._dtype)
            grown[:cap] = buf[layer]
            buf[layer] = grown
        self.moves += 1

    def buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's two buffers [capacity, ...] (keys and values, or latents and rope keys), whole."""
        return self._k[layer], self._v[layer]

    @property
    def capacity(self) -> int:
        """Tokens every attention layer's buffers hold without growing."""
        return min((self._k[i].shape[0] for i in self._attention_buffers), default=0)

    def reserve(self, tokens: int, exact: bool = False) -> None:
        """Room for ``tokens`` cached tokens in every attention layer now, so that the next extends move no buffer;
        ``exact``: that many, not the doubling's more (a graph-ready step's reserve to the context)."""
        for layer in self._attention_buffers:
            self._reserve(layer, tokens, exact)

    @property
    def nbytes(self) -> int:
        """Bytes the key/value buffers take, as reserved (the states apart)."""
        return sum(b.nbytes for b in self._k + self._v)

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v [T, ...] after the cached tokens (key and value, or latent and rope key); returns all of
        them [S, ...]."""
        start = self.length
        keys, values = self._open(layer, k.shape[0])
        if self.bf16:
            self._to_bf16(k, out=keys[start:])
            self._to_bf16(v, out=values[start:])
        else:
            keys[start:] = k
            values[start:] = v
        return keys, values

    def open_row(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's keys and values [length + 1, ...] with room for one more token, whose slot (the last row)
        the caller writes: the host's attention block (host/blocks.py), which computes the key and value in the
        same call as the attention over them."""
        return self._open(layer, 1)

    def _open(self, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The model's layer ``layer``'s buffers up to the cached tokens and ``tokens`` more, room reserved."""
        stop = self.length + tokens
        layer -= self.first_layer  # the model's layer id -> this cache's buffer
        self._reserve(layer, stop)
        return self._k[layer][:stop], self._v[layer][:stop]

    @property
    def position(self) -> int:
        """The position the next cached token takes."""
        return self.start + self.length

    def restart(self, start: int) -> None:
        """Hold nothing, the next token cached at position ``start`` (an MTP layer's cache that goes on from a
        recent position rather than feeding every one it skipped: the keys keep their positions' RoPE, the
        earlier positions are not attended to). The buffers are kept."""
        if start < 0:
            raise ValueError(f"cannot restart a cache at position {start}")
        self.truncate(0)
        self.start = start

    def advance(self, tokens: int) -> None:
        """Mark ``tokens`` new positions as cached (after every layer has extended)."""
        self.length += tokens

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (drafts that did not stand); the next extend overwrites them. The
        states go back to what they were after ``length`` tokens (only within the last step: LinearState.rewind)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        for state in self.states.values():
            state.rewind(length)
        if self.linear is not None:
            self.linear.rewind(length)
        self.length = length
