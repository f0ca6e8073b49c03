"""Per-sequence key/value cache: one growing buffer per layer."""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int = 64, xp=np):
        self.length = 0  # tokens already cached
        self.xp = xp  # NumPy, or CuPy when the cache lives on the device
        self._shape = (num_kv_heads, head_dim)
        self._k = [xp.zeros((capacity, *self._shape), np.float32) for _ in range(num_layers)]  # [cap, nkv, hd]
        self._v = [xp.zeros((capacity, *self._shape), np.float32) for _ in range(num_layers)]

    def _reserve(self, layer: int, needed: int) -> None:
        cap = self._k[layer].shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        for buf in (self._k, self._v):
            grown = self.xp.zeros((new_cap, *self._shape), np.float32)
            grown[:cap] = buf[layer]
            buf[layer] = grown

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v [T, nkv, hd] after the cached tokens; returns all keys and values [S, nkv, hd]."""
        start, stop = self.length, self.length + k.shape[0]
        self._reserve(layer, stop)
        self._k[layer][start:stop] = k
        self._v[layer][start:stop] = v
        return self._k[layer][:stop], self._v[layer][:stop]

    def advance(self, tokens: int) -> None:
        """Mark ``tokens`` new positions as cached (after every layer has extended)."""
        self.length += tokens
