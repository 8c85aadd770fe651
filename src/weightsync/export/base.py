"""`WeightExport`: what a trainer rank offers a sync, and the base class of the exports.

A sync reads each trainer rank's weights as a stream of ``(hf_name, tensor)`` pairs: HF
checkpoint names with global layer numbers, and tensors that are views of the trainer's own
memory wherever possible (no copies, no collectives). Before it reads the stream it asks the
export what the rank holds (for the plan) and how the stream lies in memory (for the push
program, which is cached as long as that does not change).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.export.geometry import stream_geometry
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.types import TensorMeta


@runtime_checkable
class WeightExport(Protocol):
    """A trainer rank's weights as a re-iterable stream of HF-named tensors.

    Call protocol (by the sender, on the rank's own thread, between optimizer steps):

    1. `holding` once per sync: the tensors the rank can produce and their full HF shapes;
    2. `geometry`: how the stream lies in memory (cheap when nothing moved);
    3. iterate it once: every tensor `holding` named, in the order `geometry` gave,
       each laid out as it said. Iterating must not run collectives: ranks iterate at
       different speeds.

    A push may iterate more than once (a plan of several dtypes, the finite check): the
    sender calls `begin_push` once before a push's first iteration, so that an export that
    computes its tensors (`weightsync.export.Fp8Export`) computes them once per push. A
    sync holds `pinned` around all of it, and a push replays its last writes without
    iterating while `geometry_key` answers the key it captured them under
    (`weightsync.sender.replay`). `ExportDefaults` gives the answers of an export that needs
    none of the three.
    """

    def holding(self) -> Mapping[str, TensorMeta]:
        """``{hf_name: TensorMeta}`` of what the stream yields, in stream order."""
        ...

    def geometry(self) -> StreamGeometry:
        """How the stream's tensors lie in memory (shapes, strides, storage sharing)."""
        ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(hf_name, tensor)`` stream."""
        ...

    @property
    def geometry_key(self) -> Any:
        """A value equal between two pushes only when the stream yields views of the same
        memory laid out the same way (a push may then be replayed without reading the
        stream); None: never replay."""
        ...

    def begin_push(self) -> None:
        """A push starts: its iterations read the trainer's weights as they are now."""
        ...

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """A block within which the export's tensors do not move (the caller's promise: a
        sync runs between optimizer steps)."""
        ...


class ExportDefaults:
    """The optional parts of `WeightExport` for an export that needs none of them: never
    replayed, nothing to do as a push starts, nothing to pin. A base class of the exports."""

    @property
    def geometry_key(self) -> Any:
        """None: a push always reads the stream."""
        return None

    def begin_push(self) -> None:
        """Nothing to do as a push starts."""

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """A block that changes nothing."""
        return contextlib.nullcontext()


class ViewExport(ExportDefaults):
    """A base class of exports whose stream yields views of tensors that persist between
    steps (a model's parameters): subclasses give `__iter__` and `memory_key`.

    `geometry` is read off the stream and cached until `memory_key` changes, so a push that
    finds nothing moved skips one pass over the stream.
    """

    def __init__(self) -> None:
        self._geometry: StreamGeometry | None = None
        self._memory_key: Any = None
        self._holding: tuple[StreamGeometry, Mapping[str, TensorMeta]] | None = None
        self._pinned = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(hf_name, tensor)`` stream."""
        raise NotImplementedError

    def memory_key(self) -> Any:
        """A cheap value that changes whenever the stream's geometry may have changed (for
        a model: its parameters' names, addresses, shapes, strides and dtypes); None: never
        cache."""
        return None

    @property
    def geometry_key(self) -> Any:
        """The memory key the cached geometry was read under, when the stream yields only
        views of memory that persists (so a push may be replayed from the same addresses
        without reading the stream, `weightsync.sender.replay`); None otherwise."""
        return self._memory_key if self._geometry is not None and self.views_only() else None

    def views_only(self) -> bool:
        """Whether every tensor of the stream is a view of persistent memory (not a buffer
        the iteration fills); subclasses that compute tensors answer False."""
        return True

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Within the block the export's tensors do not move (the caller's promise: a sync
        runs between optimizer steps), so the memory key is computed once, not at every
        `geometry` call; nested blocks share the outer one's."""
        if not self._pinned:
            self._refresh()
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1

    def holding(self) -> Mapping[str, TensorMeta]:
        """``{hf_name: TensorMeta}`` of the stream's tensors (full tensors: their shapes);
        the same mapping while the geometry holds."""
        geometry = self.geometry()
        if self._holding is None or self._holding[0] is not geometry:
            metas = {
                key: TensorMeta(shape=tensor.shape, dtype=tensor.dtype)
                for key, tensor in zip(geometry.keys, geometry.tensors, strict=True)
            }
            self._holding = (geometry, metas)
        return self._holding[1]

    def geometry(self) -> StreamGeometry:
        """How the stream lies in memory; computed again only when `memory_key` changed
        (and not checked within `pinned`).

        Raises:
            ValueError: the stream repeats a name or yields something that is not a dense
                tensor.
        """
        if self._pinned and self._geometry is not None:
            return self._geometry
        return self._refresh()

    def _refresh(self) -> StreamGeometry:
        key = self.memory_key()
        if key is None or self._geometry is None or key != self._memory_key:
            self._geometry = stream_geometry(iter(self))
            self._memory_key = key
        return self._geometry
