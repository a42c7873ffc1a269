"""KV cache for incremental decoding: per layer K and V, [Hkv, S, Dh], grown geometrically."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_length: int, initial: int = 256):
        self.max_length = max_length
        self.length = 0  # positions committed (visible to the next pass)
        self._shape = (num_kv_heads, head_dim)
        self._dtype = dtype
        self._cap = 0
        self._initial = initial
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def _ensure(self, i: int, need: int) -> None:
        if self.k[i] is not None and self.k[i].shape[1] >= need:
            return
        cap = max(self._initial, self.k[i].shape[1] if self.k[i] is not None else 0)
        while cap < need:
            cap *= 2
        cap = min(max(cap, need), max(self.max_length, need))
        h, d = self._shape
        k = torch.empty(h, cap, d, dtype=self._dtype)
        v = torch.empty(h, cap, d, dtype=self._dtype)
        if self.k[i] is not None:
            k[:, : self.length] = self.k[i][:, : self.length]
            v[:, : self.length] = self.v[i][:, : self.length]
        self.k[i], self.v[i] = k, v

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's k, v ([Hkv, T, Dh]) after the committed positions; return views of all S = length+T."""
        end = self.length + k.shape[1]
        self._ensure(i, end)
        self.k[i][:, self.length:end] = k
        self.v[i][:, self.length:end] = v
        return self.k[i][:, :end], self.v[i][:, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        """Drop positions >= length (rejected speculative tokens, or a reused prefix)."""
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() * 2 for t in self.k if t is not None)
