"""A rank's parameters, allocated from its layout table and handed out to the modules."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from weightsync.layout.types import ParamLayout
from weightsync.torch_dtypes import torch_dtype

# Every parameter starts at a multiple of this many bytes of the buffer (any dtype's element
# size divides it, and it keeps vectorized kernels on aligned addresses).
_ALIGN = 256


class LayoutParameters:
    """Allocates the parameters of a rank's layout and hands each out once, by name.

    Modules take their parameters from here while they are built, so the layout package is
    the only place that says a parameter's shape. Every parameter starts zeroed, which is what
    the padding rows must stay. Call protocol: build the modules with `take`, then call
    `arrange` once on the root module.

    Each parameter gets the dtype its layout says (the rollout dtype, but for parameters SGLang
    keeps in another one, such as DeepSeek's float32 router bias). All of them are carved out
    of one buffer, in layout order and aligned: the rank registers one memory region, and a
    sync's digests of every parameter are one gather.

    Args:
        layout: the rank's parameter table, as ``weightsync.layout.rank_layout`` returns it.
        device: where the parameters live.
    """

    def __init__(self, layout: Mapping[str, ParamLayout], *, device: torch.device) -> None:
        self._layout = dict(layout)
        self._positions = {name: index for index, name in enumerate(self._layout)}
        self._device = device
        self._taken: dict[str, torch.nn.Parameter] = {}
        self._offsets: dict[str, int] = {}
        end = 0
        for name, param in self._layout.items():
            start = -(-end // _ALIGN) * _ALIGN
            self._offsets[name] = start
            end = start + param.numel * param.element_size
        self._buffer = torch.zeros(max(end, 1), dtype=torch.uint8, device=device)

    def has(self, name: str) -> bool:
        """Whether the layout holds parameter ``name``."""
        return name in self._layout

    def take(self, name: str) -> torch.nn.Parameter:
        """Allocate parameter ``name`` (zeros, no gradient) for the module that owns it.

        Raises:
            KeyError: the layout has no such parameter.
            ValueError: the parameter was already taken.
        """
        if name in self._taken:
            raise ValueError(f"parameter {name!r} is taken twice")
        layout = self._layout[name]
        start = self._offsets[name]
        raw = self._buffer[start : start + layout.numel * layout.element_size]
        data = raw.view(torch_dtype(layout.dtype)).view(layout.shape)
        param = torch.nn.Parameter(data, requires_grad=False)
        self._taken[name] = param
        return param

    def arrange(self, root: torch.nn.Module) -> None:
        """Re-register ``root``'s submodules so that parameters come in the layout's order.

        Modules are built in whatever order reads best; SGLang's order differs by family
        (``q_norm`` before or after ``qkv_proj``, the layer norms after the MLP, the experts
        before the router). Each module's children are sorted by the first layout position
        among their parameters; children without parameters go last.

        Raises:
            ValueError: a layout parameter was never taken, or the parameters still do not
                follow the layout (a module's parameters are not contiguous in it).
        """
        left = [name for name in self._layout if name not in self._taken]
        if left:
            raise ValueError(
                f"the engine's modules left {len(left)} parameters untaken: {left[:5]}"
            )
        positions = {id(param): self._positions[name] for name, param in self._taken.items()}
        self._arrange(root, positions)
        names = [name for name, _ in root.named_parameters()]
        expected = list(self._layout)
        if names != expected:
            index = next(
                (i for i, (a, b) in enumerate(zip(names, expected, strict=False)) if a != b),
                min(len(names), len(expected)),
            )
            raise ValueError(
                f"the engine's parameter {index} is {names[index : index + 1]}, "
                f"the layout's is {expected[index : index + 1]}"
            )

    def _arrange(self, module: torch.nn.Module, positions: dict[int, int]) -> float:
        """Sort ``module``'s children recursively; returns its first parameter's position."""
        first = min(
            (positions.get(id(p), math.inf) for p in module.parameters(recurse=False)),
            default=math.inf,
        )
        children = dict(module.named_children())
        firsts = {name: self._arrange(child, positions) for name, child in children.items()}
        for name in sorted(children, key=firsts.__getitem__):
            # Deleting and re-adding a child moves it to the end of the registration order.
            delattr(module, name)
            module.add_module(name, children[name])
        return min([first, *firsts.values()])
