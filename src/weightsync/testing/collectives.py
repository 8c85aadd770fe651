"""`no_collectives`: a context in which any torch.distributed communication raises.

For tests that require a piece of code (an export's holding and stream) to run no
collective: every op of torch's ``c10d`` and ``_c10d_functional`` namespaces (what
``torch.distributed``'s collectives, point-to-point calls and DTensor redistributions all
dispatch to) raises `CollectiveRan`, and so do the ``torch.distributed`` functions
themselves, before they reach a process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
_FUNCTIONS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class CollectiveRan(RuntimeError):
    """A torch.distributed communication ran where none may."""


class _Refuse(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if func.namespace in _NAMESPACES:
            raise CollectiveRan(f"torch.distributed op {func} ran inside no_collectives()")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Raise `CollectiveRan` from any torch.distributed communication meanwhile."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved: list[tuple[Any, str, Any]] = []

    def refuse(name: str):
        def raiser(*args: Any, **kwargs: Any) -> None:
            raise CollectiveRan(f"torch.distributed.{name} ran inside no_collectives()")

        return raiser

    for module in (dist, c10d):
        for name in _FUNCTIONS:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refuse(name))
    try:
        with _Refuse():
            yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
