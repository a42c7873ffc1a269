"""Paged KV cache: positions in blocks of `block` tokens; recent blocks in RAM, older ones in the swap file.

One sequence's cache (`KVCache`) keeps, per layer, K and V for the positions [base, length) in a RAM window of
`window` tokens (a ring over whole blocks); blocks before `base` were written to the swap file when the window
filled and are read back, one layer at a time with the next layer's reads in flight, when attention needs them.
While nothing has left RAM (base == 0) attention reads the window in place. Once blocks live on disk, each layer's
keys and values are assembled into one scratch buffer per pass: the values attention sees are the same either
way, so placement never changes tokens. Sliding-window layers read back only the blocks inside their window.

A block's bytes, the unit of the swap file, of the prefix cache and of saved sessions, are per layer one
4096-aligned segment: K [Hkv, block, Dh], V [Hkv, block, Dh] in the storage dtype, then (q8 only) their f32
scales [Hkv, block, Dh / group].

`--kv-quant q8` (lossy, opt-in) stores K and V as int8 with one f32 scale per `group` (32) values of a head
vector; every use dequantizes, so a position's keys are the same wherever they are stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from colibri.errors import InputError
from colibri.io import DEMAND, PREFETCH, AlignedBuffer, align_up

if TYPE_CHECKING:
    from colibri.prefix import KVSpace

BLOCK = 64  # tokens per block: a 48 KiB segment per layer for SmolLM2 in bf16
QUANTS = (None, "q8")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # compute dtype: what attention reads
    block: int = BLOCK
    quant: str | None = None

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise InputError(f"--kv-quant {self.quant!r} is not supported (choose q8, or leave it unset)")
        if self.block < 2 or self.block % 2:
            raise InputError(f"KV block size must be an even number of tokens >= 2 (got {self.block})")

    @property
    def group(self) -> int:
        return 32 if self.head_dim % 32 == 0 else self.head_dim

    @property
    def store_dtype(self) -> torch.dtype:
        return torch.int8 if self.quant else self.dtype

    def value_bytes(self, tokens: int) -> int:
        return self.num_kv_heads * tokens * self.head_dim * torch.empty((), dtype=self.store_dtype).element_size()

    def scale_bytes(self, tokens: int) -> int:
        return self.num_kv_heads * tokens * (self.head_dim // self.group) * 4 if self.quant else 0

    @property
    def token_bytes(self) -> int:
        """RAM bytes of one position in every layer (K, V and their scales)."""
        return self.num_layers * 2 * (self.value_bytes(1) + self.scale_bytes(1))

    @property
    def seg_bytes(self) -> int:
        return align_up(2 * (self.value_bytes(self.block) + self.scale_bytes(self.block)))

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.seg_bytes

    def identity(self) -> dict:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).removeprefix("torch."), "block": self.block, "kv_quant": self.quant}

    def views(self, seg: torch.Tensor, n: int = 1):
        """(k, v, k_scales, v_scales) views of `n` consecutive segments (uint8 [n, seg_bytes] or [seg_bytes]):
        values [n, Hkv, block, Dh]; scales [n, Hkv, block, Dh / group] or None."""
        seg = seg.view(n, self.seg_bytes)
        h, b, d = self.num_kv_heads, self.block, self.head_dim
        vb, sb = self.value_bytes(b), self.scale_bytes(b)
        k = seg[:, :vb].view(self.store_dtype).view(n, h, b, d)
        v = seg[:, vb:2 * vb].view(self.store_dtype).view(n, h, b, d)
        if not self.quant:
            return k, v, None, None
        g = d // self.group
        ks = seg[:, 2 * vb:2 * vb + sb].view(torch.float32).view(n, h, b, g)
        vs = seg[:, 2 * vb + sb:2 * vb + 2 * sb].view(torch.float32).view(n, h, b, g)
        return k, v, ks, vs


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Dh] -> int8 values [..., Dh] and f32 scales [..., Dh / group] (symmetric, amax / 127)."""
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    s = g.abs().amax(-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g = q.unflatten(-1, (s.shape[-1], q.shape[-1] // s.shape[-1])).float() * s[..., None]
    return g.flatten(-2).to(dtype)


class KVCache:
    """One sequence's KV; see the module docstring. `space` provides the swap file (None: RAM only)."""

    def __init__(self, layout: KVLayout, max_length: int, window: int | None = None,
                 space: "KVSpace | None" = None, layer_windows: list[int | None] | None = None,
                 initial: int = 256):
        self.layout = layout
        B = layout.block
        self.max_length = max_length
        full = align_up(max_length, B)
        self.window = full if window is None else min(full, window // B * B)
        if self.window < full and self.window < 2 * B:  # spilling needs one block in RAM beside the oldest
            raise InputError(f"a KV window of {self.window} tokens is too small; it must hold two blocks "
                             f"({2 * B} tokens)")
        self.space = space
        self.layer_windows = layer_windows or [None] * layout.num_layers
        self.length = 0  # positions committed (visible to the next pass)
        self.base = 0  # first position held in RAM; the blocks before it are on disk
        self.ids: list[int] = []  # the token at each committed position
        self.slots: list[int] = []  # swap slot of each block before base
        self._initial = max(B, align_up(initial, B))
        self.cap = 0
        L = layout.num_layers
        self.k: list[torch.Tensor | None] = [None] * L
        self.v: list[torch.Tensor | None] = [None] * L
        self.ks: list[torch.Tensor | None] = [None] * L
        self.vs: list[torch.Tensor | None] = [None] * L
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._staging: list[AlignedBuffer] = []
        self._pending: dict[int, tuple[tuple[int, int], list, int]] = {}  # layer -> (blocks, futures, buffer)
        self._wbuf: AlignedBuffer | None = None
        self._out: tuple[int, list[int]] | None = None  # swapped out: (base before, slots of its RAM blocks)

    # -- bookkeeping ---------------------------------------------------------------------------------------

    @property
    def max_pass(self) -> int:
        """The most tokens one forward pass may add: the window keeps one block for the oldest in-RAM one."""
        return self.window - self.layout.block if self.window < align_up(self.max_length, self.layout.block) \
            else self.max_length

    def ram_bytes(self) -> int:
        """RAM held by this cache: the window, plus the scratch and read buffers once it has offloaded."""
        lay = self.layout
        n = self.cap * lay.token_bytes
        if self._scratch is not None:
            n += sum(t.numel() * t.element_size() for t in self._scratch)
        return n + sum(b.nbytes for b in self._staging) + (self._wbuf.nbytes if self._wbuf else 0)

    def _cap_for(self, need: int, cap: int | None = None) -> int:
        """The ring capacity after growing from `cap` (None: the current one) to hold `need` positions: doubling
        from the initial size, at most the window."""
        cap = self.cap if cap is None else cap
        if cap >= need:
            return cap
        cap = max(self._initial, cap)
        while cap < need:
            cap *= 2
        return min(max(cap, need), self.window)

    def ram_after(self, tokens: int) -> int:
        """RAM this cache will hold once room for `tokens` more positions is reserved (a swapped-out cache
        being read back first)."""
        lay = self.layout
        if self._out is None:
            base, cap, extra = self.base, self.cap, self.ram_bytes() - self.cap * lay.token_bytes
        else:
            base, extra = self._out[0], 0
            cap = self._cap_for(self.window if base else min(self.window, align_up(self.length, lay.block)), 0)
        held = self.length + tokens - base
        grown = self._cap_for(min(self.window, held), cap)
        if grown > cap and cap:
            extra += cap * lay.token_bytes // lay.num_layers // 2  # while one layer's K (or V) is copied over
        if held > self.window and self._scratch is None:
            # spilling starts: attention then assembles each layer's K/V in a scratch for the whole context and
            # reads the blocks on disk through two buffers; blocks leave through a write buffer
            full = align_up(self.max_length, lay.block)
            extra += 2 * lay.num_kv_heads * full * lay.head_dim * torch.empty((), dtype=lay.dtype).element_size()
            extra += 2 * (full // lay.block) * lay.seg_bytes + lay.block_bytes
        return grown * lay.token_bytes + extra

    def _ensure_cap(self, need: int) -> None:
        if self.cap >= need:
            return
        cap = self._cap_for(need)
        lay = self.layout
        h, d = lay.num_kv_heads, lay.head_dim
        for i in range(lay.num_layers):
            for name in ("k", "v"):
                new = torch.empty(h, cap, d, dtype=lay.store_dtype)
                old = getattr(self, name)[i]
                if old is not None:
                    new[:, :self.cap] = old
                getattr(self, name)[i] = new
                if lay.quant:
                    snew = torch.empty(h, cap, d // lay.group, dtype=torch.float32)
                    sold = getattr(self, name + "s")[i]
                    if sold is not None:
                        snew[:, :self.cap] = sold
                    getattr(self, name + "s")[i] = snew
        self.cap = cap

    @torch.inference_mode()
    def reserve(self, tokens: int) -> None:
        """Make room in the window for a pass of `tokens` positions, spilling the oldest blocks to disk."""
        if self.length + tokens > self.max_length:
            raise InputError(f"{self.length + tokens} positions exceed the context of {self.max_length} tokens")
        if tokens > self.max_pass:
            raise ValueError(f"a pass of {tokens} tokens does not fit a {self.window}-token KV window")
        self._drain()
        self._ensure_cap(min(self.window, self.length - self.base + tokens))
        while self.length + tokens - self.base > self.window:
            self._spill()

    def _ring(self, pos: int) -> int:
        return pos % self.window

    # -- writing -------------------------------------------------------------------------------------------

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(ring offset, position, count) covering positions [start, end): two pieces where the ring wraps."""
        o, n = self._ring(start), end - start
        first = min(n, self.window - o)
        out = [(o, start, first)] if n > 0 else []
        if n > first:
            out.append((0, start + first, n - first))
        return out

    def _put(self, store: list, i: int, src: torch.Tensor, pos: int) -> None:
        """Write src [Hkv, T, x] at positions pos.. of the ring."""
        for o, p, n in self._pieces(pos, pos + src.shape[1]):
            store[i][:, o:o + n] = src[:, p - pos:p - pos + n]

    @torch.inference_mode()
    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's k, v ([Hkv, T, Dh]) after the committed positions; return K and V of all
        S = length + T positions ([Hkv, S, Dh], compute dtype) for attention."""
        T = k.shape[1]
        if self.cap == 0 or self.length - self.base + T > self.cap:
            self.reserve(T)  # callers that skip reserve() (a bare forward) get it here
        lay = self.layout
        if lay.quant:
            kq, ksc = quantize(k, lay.group)
            vq, vsc = quantize(v, lay.group)
            self._put(self.k, i, kq, self.length)
            self._put(self.v, i, vq, self.length)
            self._put(self.ks, i, ksc, self.length)
            self._put(self.vs, i, vsc, self.length)
        else:
            self._put(self.k, i, k, self.length)
            self._put(self.v, i, v, self.length)
        end = self.length + T
        if self.base == 0 and not lay.quant:
            return self.k[i][:, :end], self.v[i][:, :end]
        return self._assemble(i, end)

    def advance(self, n: int, ids=None) -> None:
        if ids is not None:
            self.ids.extend(int(t) for t in ids)
        self.length += n

    # -- attention input when blocks are on disk or quantized ----------------------------------------------

    def _needed_blocks(self, i: int) -> tuple[int, int]:
        """(first, end) block indices on disk that layer i's queries of this pass can see."""
        w = self.layer_windows[i]
        lo = 0 if w is None else max(0, self.length - w + 1)  # the pass's first query is at `length`
        nb = self.base // self.layout.block
        return min(lo // self.layout.block, nb), nb

    def _submit(self, i: int, priority: int) -> None:
        blocks = self._needed_blocks(i)
        if blocks[1] - blocks[0] <= 0:
            return
        lay = self.layout
        if not self._staging:
            n = align_up(self.max_length, lay.block) // lay.block
            self._staging = [AlignedBuffer(n * lay.seg_bytes) for _ in range(2)]
        buf = i % 2
        futures = self.space.swap.read_layer(self.slots[blocks[0]:blocks[1]], i, self._staging[buf], priority)
        self._pending[i] = (blocks, futures, buf)

    def _drain(self) -> None:
        """Wait out reads still in flight (a failed pass leaves some): their buffers are about to be reused."""
        for _, futures, _ in self._pending.values():
            for f in futures:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - already reported by the pass that failed
                    pass
        self._pending.clear()

    def _decode_into(self, dst_k: torch.Tensor, dst_v: torch.Tensor, k, v, ks, vs) -> None:
        """dst [Hkv, n*B, Dh] <- block-major values [n, Hkv, B, Dh] (dequantized when quantized)."""
        n, h, b, d = k.shape
        dk, dv = dst_k.view(h, n, b, d), dst_v.view(h, n, b, d)
        if ks is None:
            dk.copy_(k.permute(1, 0, 2, 3))
            dv.copy_(v.permute(1, 0, 2, 3))
        else:
            dk.copy_(dequantize(k, ks, self.layout.dtype).permute(1, 0, 2, 3))
            dv.copy_(dequantize(v, vs, self.layout.dtype).permute(1, 0, 2, 3))

    def _assemble(self, i: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        B = lay.block
        if self._scratch is None:
            full = align_up(self.max_length, B)
            self._scratch = tuple(torch.zeros(lay.num_kv_heads, full, lay.head_dim, dtype=lay.dtype)
                                  for _ in range(2))
        sk, sv = self._scratch
        first, nb = self._needed_blocks(i)
        if nb:
            pend = self._pending.pop(i, None)
            if pend is None or pend[0] != (first, nb):
                if pend is not None:
                    for f in pend[1]:
                        f.result()
                self._submit(i, DEMAND)
                pend = self._pending.pop(i, None)
            if i + 1 < lay.num_layers and i + 1 not in self._pending:
                self._submit(i + 1, PREFETCH)
            if first:
                sk[:, :first * B].zero_()  # outside a sliding window: masked, but never stale NaNs
                sv[:, :first * B].zero_()
            if pend is not None:
                blocks, futures, buf = pend
                t0 = time.perf_counter()
                for f in futures:
                    self.space.promote(f)
                for f in futures:
                    f.result()
                self.space.read_wait_s += time.perf_counter() - t0
                n = nb - first
                raw = self._staging[buf].tensor(0, n * lay.seg_bytes)
                self._decode_into(sk[:, first * B:nb * B], sv[:, first * B:nb * B], *lay.views(raw, n))
        # the RAM window, in position order
        for o, p, n in self._pieces(self.base, end):
            for dst, vals, scales in ((sk, self.k, self.ks), (sv, self.v, self.vs)):
                piece = vals[i][:, o:o + n]
                dst[:, p:p + n] = dequantize(piece, scales[i][:, o:o + n], lay.dtype) if lay.quant else piece
        return sk[:, :end], sv[:, :end]

    # -- blocks in and out ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_block(self, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bytes of block b (uint8 [block_bytes]) from the RAM window or, for a block on disk, the swap."""
        lay = self.layout
        out = torch.empty(lay.block_bytes, dtype=torch.uint8) if out is None else out
        B = lay.block
        if b < self.base // B:
            buf = AlignedBuffer(lay.block_bytes)
            for f in self.space.swap.read_block(self.slots[b], buf):
                f.result()
            out.copy_(buf.tensor(0, lay.block_bytes))
            return out
        o = self._ring(b * B)
        segs = out.view(lay.num_layers, lay.seg_bytes)
        for i in range(lay.num_layers):
            k, v, ks, vs = lay.views(segs[i])
            k[0].copy_(self.k[i][:, o:o + B])
            v[0].copy_(self.v[i][:, o:o + B])
            if lay.quant:
                ks[0].copy_(self.ks[i][:, o:o + B])
                vs[0].copy_(self.vs[i][:, o:o + B])
        return out

    def _decode_block(self, block: torch.Tensor, pos: int) -> None:
        """Write a block's bytes into the ring at block-aligned position `pos`."""
        lay = self.layout
        o, B = self._ring(pos), lay.block
        segs = block.view(lay.num_layers, lay.seg_bytes)
        for i in range(lay.num_layers):
            k, v, ks, vs = lay.views(segs[i])
            self.k[i][:, o:o + B] = k[0]
            self.v[i][:, o:o + B] = v[0]
            if lay.quant:
                self.ks[i][:, o:o + B] = ks[0]
                self.vs[i][:, o:o + B] = vs[0]

    def _spill(self) -> None:
        lay = self.layout
        if self.space is None:
            raise InputError(f"the KV cache needs more than its {self.window}-token RAM window and has no swap "
                             "file; give --swap or a larger --kv-ram")
        b = self.base // lay.block
        if self._wbuf is None:
            self._wbuf = AlignedBuffer(lay.block_bytes)
        data = self.encode_block(b, self._wbuf.tensor(0, lay.block_bytes))
        slot = self.space.alloc_slot()
        try:
            self.space.swap.write(slot, data)
        except BaseException:
            self.space.free_slot(slot)  # the block stays in the window; the slot is not leaked
            raise
        self.slots.append(slot)
        self.base += lay.block

    @torch.inference_mode()
    def append_block(self, block: torch.Tensor, ids: list[int]) -> None:
        """Append a block's bytes (a cached prefix, a saved session) at the block-aligned end; `ids` are its
        tokens (fewer than a block for a sequence's last one)."""
        if self.length % self.layout.block:
            raise ValueError("blocks are appended at block boundaries only")
        self.reserve(self.layout.block if self.length + self.layout.block <= self.max_length else len(ids))
        self._decode_block(block, self.length)
        self.advance(len(ids), ids)

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Drop positions >= length (a reused prefix, rejected speculative tokens)."""
        length = max(0, min(self.length, length))
        self._drain()
        if length < self.base:
            B = self.layout.block
            nb = length // B
            if length % B:
                self.length = nb * B  # the block comes back into the window at its ring position
                block = self.encode_block(nb)
                self.base = nb * B
                self._decode_block(block, nb * B)
            for s in self.slots[nb:]:
                self.space.free_slot(s)
            del self.slots[nb:]
            self.base = nb * B
        self.length = length
        del self.ids[length:]

    # -- preemption: the whole sequence out to the swap file and back, nothing recomputed -------------------

    @property
    def swapped(self) -> bool:
        return self._out is not None

    @torch.inference_mode()
    def swap_out(self) -> None:
        """Write the blocks held in RAM to the swap file and free every RAM buffer (blocks already on disk stay
        where they are). The swap file must have room; InputError otherwise, with the cache unchanged."""
        if self._out is not None:
            return
        self._drain()
        lay = self.layout
        first, end = self.base // lay.block, -(-self.length // lay.block)
        slots: list[int] = []
        try:
            for b in range(first, end):
                if self._wbuf is None:
                    self._wbuf = AlignedBuffer(lay.block_bytes)
                data = self.encode_block(b, self._wbuf.tensor(0, lay.block_bytes))
                slot = self.space.alloc_slot()
                slots.append(slot)
                self.space.swap.write(slot, data)
        except BaseException:
            for slot in slots:
                self.space.free_slot(slot)
            raise
        self._out = (self.base, slots)
        L = lay.num_layers
        self.k, self.v, self.ks, self.vs = [None] * L, [None] * L, [None] * L, [None] * L
        self.cap = 0
        self._scratch, self._staging, self._wbuf = None, [], None

    @torch.inference_mode()
    def swap_in(self) -> None:
        """Read the blocks `swap_out` wrote back into a fresh RAM window and free their slots."""
        if self._out is None:
            return
        base, slots = self._out
        lay = self.layout
        self._ensure_cap(self.window if base else min(self.window, align_up(self.length, lay.block)))
        buf = AlignedBuffer(lay.block_bytes)
        for j, slot in enumerate(slots):
            for f in self.space.swap.read_block(slot, buf):
                f.result()
            self._decode_block(buf.tensor(0, lay.block_bytes), base + j * lay.block)
        for slot in slots:
            self.space.free_slot(slot)
        self._out = None

    def reset(self) -> None:
        self.truncate(0)

    @torch.inference_mode()
    def release(self) -> None:
        """Free this cache's swap slots and buffers."""
        self._drain()
        for s in self.slots + (self._out[1] if self._out else []):
            self.space.free_slot(s)
        self.slots, self._out = [], None
        self.base = self.length = 0
        self.ids = []
