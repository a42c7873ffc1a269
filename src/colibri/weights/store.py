"""Weight stores: where the model math gets its tensors from.

The model asks for tensors by HF checkpoint name, layer by layer, and keeps no reference between uses (what it
derives from them, `derived` keeps where the store can). That contract lets a streaming store load a layer's pages
just before `layer(i)` is entered and release them after. `RamStore` is the simplest store: everything resident in
the compute dtype. Every store has the whole protocol (the RAM store's budget and I/O methods are trivial), so
callers never probe a store for a capability.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Iterator, Protocol, TypeVar

import torch

from colibri.core.errors import ModelLoadError

if TYPE_CHECKING:
    from colibri.formats.container import ContainerCheckpoint
    from colibri.weights.placement import Placement

T = TypeVar("T")


class WeightStore(Protocol):
    placement: "Placement | None"  # which pages are pinned and which stream (None: all in RAM)
    timeline: list[dict] | None  # per-scope records of the first `timeline_passes` passes (None: none kept)
    timeline_passes: int

    def get(self, name: str) -> torch.Tensor:
        """The weight `name`, ready for compute (compute dtype, or a quantized object that ops.linear accepts)."""

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a lookup table (token embedding): [len(ids), D]."""

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """A head table as consecutive row blocks (one block: the whole table), inside the head's scope."""

    def begin_pass(self, tokens: int, longest: int | None = None) -> None:
        """A forward pass over `tokens` tokens starts; `longest`: the most tokens one sequence has in it (a batch
        of single-token decode steps is still decode; None: `tokens`)."""

    def layer(self, i: int) -> contextlib.AbstractContextManager:
        """Scope of layer i's compute (i == num_layers: the head): a streaming store makes its pages resident
        and prefetches ahead; tensors got inside are not used after it closes."""

    def expert(self, i: int, e: int) -> contextlib.AbstractContextManager:
        """Scope of one routed expert's compute in layer i."""

    def route(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> list[int]:
        """Layer i's router chose these experts (expert -> tokens routed to it; `names`: expert -> its tensors,
        needed next). Returns the order to compute them in."""

    def wants_lookahead(self, i: int) -> bool:
        """Whether guesses of layer i's experts (`predict`) would be used: its experts are read from disk."""

    def peek(self, name: str) -> torch.Tensor | None:
        """A tensor outside its scope if it is resident already (pinned, or its page read), else None."""

    def derived(self, key: Hashable, make: Callable[[], T], current: Callable[[T], bool]) -> T:
        """make(): a value made from this store's weights (the compute's arguments for a layer, say), kept under
        `key` where the weights stay resident for the store's life (a kept value holds their memory), made again
        otherwise; current(kept): whether a kept value still holds (its weights are the ones the store has now),
        made again and kept in its place where not."""

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        """A guess of layer i's routing (as `route`'s arguments), made before layer i runs: read ahead."""

    def fit(self, held: int, extra: int, pin: bool = True) -> None:
        """Share the memory limit with `held` bytes held besides the weights (the KV cache) and `extra` more the
        next pass takes: pin or unpin pages beyond the placement's (pin=False: only unpin)."""

    def kv_room(self, extra: int) -> int | None:
        """Bytes the KV cache may hold beside a pass taking `extra` (None: no limit)."""

    def spare(self, held: int) -> int | None:
        """Bytes a pass may take beside `held` without unpinning anything (None: no limit)."""

    def hold(self) -> None:
        """Keep to the placement's own pins from here on (for measuring a placement)."""

    def counters(self) -> dict:
        """Cumulative I/O counters and resident bytes ({}: nothing is read from disk)."""

    def picture(self) -> dict:
        """Per layer, page bytes by tier, and the MoE experts' use counts, for a dashboard ({}: nothing streams)."""

    def close(self) -> None: ...


_NONE = object()  # no value kept (RamStore.derived)
_NOTHING = contextlib.nullcontext()  # reusable: a layer or expert scope of a store with nothing to do


class RamStore:
    """All weights resident in RAM, converted once to the compute dtype: no limit, no reads, no timeline."""

    placement = None
    timeline = None
    timeline_passes = 0

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self.tensors = tensors
        self.dtype = dtype
        self._derived: dict = {}

    @classmethod
    def load(cls, names: Iterable[str], read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> "RamStore":
        tensors = {}
        for name in names:
            t = read(name)
            if isinstance(t, torch.Tensor):
                tensors[name] = t.to(dtype) if t.is_floating_point() else t
            else:  # a quantized weight: stays packed, computes in the activations' dtype
                tensors[name] = t
        return cls(tensors, dtype)

    @classmethod
    def load_container(cls, ckpt: "ContainerCheckpoint", names: Iterable[str], dtype: torch.dtype) -> "RamStore":
        """load() from a container, the tensors kept as read (quantized ones, and floats already in `dtype`) read
        into one Arena, in huge pages where the kernel gives them (a decode step streams them all from RAM); floats
        of another dtype are converted, their read bytes dropped."""
        from colibri.formats.container import FLOAT_KINDS
        from colibri.weights.io import Arena

        names = list(names)
        kept = {n for n in names
                if (t := ckpt.tensors.get(n)) is not None and FLOAT_KINDS.get(t.kind, dtype) == dtype}
        total = sum(Arena.size(ckpt.tensors[n].nbytes) for n in kept)
        try:
            arena = Arena(total)
        except OSError as e:  # ENOMEM: an address-space limit, or more than the kernel will commit
            raise ModelLoadError(f"{ckpt.path}: the weights need {total / 2**20:,.0f} MiB of RAM and this process"
                                 f" cannot have them ({e.strerror}); give --memory-limit to stream them from disk"
                                 ) from None
        return cls.load(names, lambda n: ckpt.load_into(n, arena.take if n in kept else None), dtype)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"tensor {name!r} is not in the loaded weights; the checkpoint is incomplete") from None

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        w = self.get(name)
        return w[ids] if isinstance(w, torch.Tensor) else w.rows(ids).to(self.dtype)

    def layer(self, i: int) -> contextlib.AbstractContextManager:
        return _NOTHING  # (a generator context manager cost every layer of a decode step)

    def expert(self, i: int, e: int) -> contextlib.AbstractContextManager:
        return _NOTHING

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        yield self.get(name)

    def begin_pass(self, tokens: int, longest: int | None = None) -> None:
        pass

    def route(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> list[int]:
        return sorted(uses)

    def wants_lookahead(self, i: int) -> bool:
        return False  # everything is resident: nothing to read early

    def picture(self) -> dict:
        return {}  # nothing streams: no tiers or expert heat to draw (StreamingStore.picture)

    def peek(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def derived(self, key: Hashable, make: Callable[[], T], current: Callable[[T], bool]) -> T:
        value = self._derived.get(key, _NONE)
        if value is _NONE or not current(value):
            value = self._derived[key] = make()
        return value

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        pass

    def fit(self, held: int, extra: int, pin: bool = True) -> None:
        pass  # nothing to pin or unpin

    def kv_room(self, extra: int) -> int | None:
        return None

    def spare(self, held: int) -> int | None:
        return None

    def hold(self) -> None:
        pass

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        self.tensors = {}
        self._derived = {}
