"""Which of a vLLM rank's parameters trainers can write in place, and staging for the rest.

vLLM post-processes some parameters after loading (on the CPU it repacks every unquantised
linear weight into a oneDNN handle and leaves the parameter empty; fused MoE experts get new,
padded memory): their live memory is not the checkpoint's bytes in the checkpoint's layout, so
a trainer cannot write it. Others keep their bytes but vLLM computes from a copy it derives
from them (on the CPU, ``lm_head``'s oneDNN handle), so a write into them changes nothing
until vLLM derives it again. `capture` finds out which, by measurement: it re-runs vLLM's own
in-place reload from the checkpoint on disk with each layer's processing wrapped, copies
every published parameter of the layer just before the processing runs (its loaded shape:
the rank's layout) and notes what else of the layer the processing replaced, and compares
after the reload:

- **in place**: the live parameter has the loaded shape and dtype and holds the captured
  bytes (the same full checksum); trainers write its live memory. Parameters of layers that
  vLLM does not post-process (no quant method: norms) are in place without a look. Where the
  processing also set other state of the layer (an attribute other than its parameters,
  buffers and submodules: a packed copy, a kernel handle), the layer is **re-processed** at
  the end of each session (`StagedLayers.apply`).
- **staged**: anything else. Its captured bytes go into the rank's staging buffer (one
  allocation on the parameters' device, a view per parameter), which trainers write; at the
  end of each session `StagedLayers.apply` runs vLLM's processing again from the views.

Cost: one read of the checkpoint from disk per rank at first contact (what vLLM's reload
reads), one layer's parameters copied at a time while it runs, then the staged parameters
twice (their captures and the staging buffer) for a moment.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.delta_codec import as_bits, checksums
from weightsync.integrations.vllm import _vllm
from weightsync.layout.vllm import weightsync_name


@dataclass(frozen=True, slots=True, kw_only=True)
class Capture:
    """What `capture` measured on one rank.

    Attributes:
        in_place: weightsync names of the parameters trainers write in place.
        staged: ``{weightsync name: captured loaded-shape value}`` of the others.
        layers: ``{weightsync name: (module name, layer, the layer's own name of the
            tensor)}`` of every staged parameter.
        reprocess: ``{module name: layer}`` of every layer vLLM processes again at the end of
            each session (those with staged parameters, and those whose processing derived
            other state from in-place ones), in the model's order.
        reprocessed: weightsync names of the in-place parameters of those layers.
        seconds: what the reload with the capture took.
    """

    in_place: tuple[str, ...]
    staged: dict[str, torch.Tensor]
    layers: dict[str, tuple[str, torch.nn.Module, str]]
    reprocess: dict[str, torch.nn.Module]
    reprocessed: tuple[str, ...]
    seconds: float


def capture(model: torch.nn.Module, reload: Callable[[], None]) -> Capture:
    """Run `reload` (vLLM's in-place reload from the checkpoint on disk) with every layer's
    processing wrapped, and decide which published parameters are in place (module
    docstring).

    Raises:
        RuntimeError: a parameter of a post-processed layer was not reloaded (nothing says
            whether vLLM repacks it), or its live tensor changed after its processing in a
            way the capture cannot account for.
    """
    published = dict(model.named_parameters())  # vLLM name -> live parameter
    ids = {id(param): name for name, param in published.items()}
    owners: dict[str, torch.nn.Module] = {}
    prefixes: dict[int, str] = {}
    for module_name, module in model.named_modules():
        prefixes[id(module)] = module_name
        for local, param in module.named_parameters(recurse=False):
            name = ids.get(id(param))
            if name is not None and name == _join(module_name, local):
                owners[name] = module

    staged: dict[str, torch.Tensor] = {}
    checked: dict[str, tuple[torch.Size, torch.dtype, int]] = {}
    derives: set[str] = set()  # module names

    def hook(layer: torch.nn.Module, run: Callable[[], None]) -> None:
        # The layer holds its loaded-shape tensors, filled by vLLM's weight loaders.
        prefix = prefixes.get(id(layer), "")
        before: dict[str, torch.Tensor] = {}
        for local, tensor in layer.named_parameters(recurse=False):
            name = _join(prefix, local)
            if name in published:
                before[name] = tensor.detach().clone()
        state = _plain_state(layer)
        run()
        if before and not _same_state(state, _plain_state(layer)):
            derives.add(prefix)
        for name, value in before.items():
            after = getattr(layer, name.rsplit(".", 1)[-1])
            if (
                after.shape == value.shape
                and after.dtype == value.dtype
                and torch.equal(as_bits(after.detach()), as_bits(value))
            ):
                # Likely in place: vLLM copies the processed value into the live storage;
                # checked against the live parameter once the reload is done.
                checked[name] = (value.shape, value.dtype, checksums({name: value})[name])
                staged.pop(name, None)
            else:
                staged[name] = value
                checked.pop(name, None)

    layers = {id(module): module for module in owners.values()}
    undo = [_vllm.wrap_processing(layer, hook) for layer in layers.values()]
    start = time.perf_counter()
    try:
        reload()
    finally:
        for step in undo:
            step()
    seconds = time.perf_counter() - start

    in_place: list[str] = []
    live_checksums = checksums({name: published[name] for name in checked})
    for name, param in published.items():
        owner = owners.get(name)
        if owner is None or _vllm.quant_method_of(owner) is None:
            in_place.append(name)  # not post-processed by vLLM
        elif name in staged:
            continue
        elif name not in checked:
            raise RuntimeError(
                f"parameter {name!r} was not reloaded from the checkpoint, so the rank cannot "
                "tell whether vLLM repacks it; is it in the checkpoint?"
            )
        else:
            shape, dtype, expected = checked[name]
            if param.shape != shape or param.dtype != dtype or live_checksums[name] != expected:
                raise RuntimeError(
                    f"parameter {name!r} held its loaded bytes after vLLM's processing but "
                    f"not after the reload's copy-back (live {tuple(param.shape)} "
                    f"{param.dtype}, loaded {tuple(shape)} {dtype})"
                )
            in_place.append(name)
    staged_layers = {
        weightsync_name(name): (_split(name)[0], owners[name], _split(name)[1]) for name in staged
    }
    again = derives | {_split(name)[0] for name in staged}
    reprocess = {
        module_name: module for module_name, module in model.named_modules() if module_name in again
    }
    return Capture(
        in_place=tuple(weightsync_name(name) for name in in_place),
        staged={weightsync_name(name): value for name, value in staged.items()},
        layers=staged_layers,
        reprocess=reprocess,
        reprocessed=tuple(
            weightsync_name(name) for name in in_place if _split(name)[0] in reprocess
        ),
        seconds=seconds,
    )


class StagedLayers:
    """The rank's staging buffer and the layers vLLM processes again from it.

    Args:
        capture: what `capture` measured; its staged values are copied into one buffer
            (aligned to each dtype's element size) and dropped.
    """

    def __init__(self, capture: Capture) -> None:
        values = capture.staged
        offsets: dict[str, int] = {}
        num_bytes = 0
        for name, value in values.items():
            num_bytes = _align(num_bytes, value.element_size())
            offsets[name] = num_bytes
            num_bytes += value.nbytes
        device = next(iter(values.values())).device if values else torch.device("cpu")
        self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.views: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            start = offsets[name]
            view = self._buffer[start : start + value.nbytes].view(value.dtype).view(value.shape)
            view.copy_(value)
            self.views[name] = view
        values.clear()
        # Per layer processed again, its staged tensors by the layer's own names (none for a
        # layer that only derives state from in-place parameters), in model order.
        self._layers: dict[int, tuple[str, torch.nn.Module, dict[str, torch.Tensor]]] = {
            id(layer): (module_name, layer, {}) for module_name, layer in capture.reprocess.items()
        }
        for name, view in self.views.items():
            _, layer, local = capture.layers[name]
            self._layers[id(layer)][2][local] = view

    @property
    def num_bytes(self) -> int:
        """The staging buffer's size."""
        return self._buffer.numel()

    @property
    def num_layers(self) -> int:
        """How many layers vLLM processes again at the end of each session."""
        return len(self._layers)

    def apply(self) -> int:
        """Process every layer with staged parameters or derived state again from its staging
        views and the live values of its in-place parameters, through vLLM's own processing,
        into the storage vLLM computes with (`_vllm.reprocess_layer`).

        Returns:
            How many staged parameters were applied.

        Raises:
            RuntimeError: vLLM's processing of a layer failed (the message names it); the
                layers before it hold the new weights, it and those after the old ones.
        """
        applied = 0
        for index, (module_name, layer, views) in enumerate(self._layers.values()):
            try:
                applied += _vllm.reprocess_layer(layer, views)
            except Exception as err:
                raise RuntimeError(
                    f"vLLM's processing of {module_name} ({type(layer).__name__}, staged "
                    f"{sorted(views)}) failed after {index} of {len(self._layers)} layers "
                    f"were applied; it and the layers after it keep their old weights: {err}"
                ) from err
        return applied


def _plain_state(layer: torch.nn.Module) -> dict[str, object]:
    """The layer's own attributes other than its parameters, buffers and submodules, and its
    quant method's: what its processing may set besides them (a kernel handle, a packed
    copy, the function its forward calls). Held, not copied: `_same_state` compares
    identities."""
    state = {
        key: value
        for key, value in vars(layer).items()
        if key not in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
    }
    quant_method = _vllm.quant_method_of(layer)
    if quant_method is not None:
        state.update(
            (f"quant_method.{key}", value)
            for key, value in vars(quant_method).items()
            if key not in _vllm.HOOK_ATTRS
        )
    return state


def _same_state(before: dict[str, object], after: dict[str, object]) -> bool:
    """Whether every attribute is the same object in both (`_plain_state`)."""
    return before.keys() == after.keys() and all(after[key] is before[key] for key in before)


def _split(name: str) -> tuple[str, str]:
    """``(module name, tensor name)`` of a parameter's full name."""
    module_name, _, local = name.rpartition(".")
    return module_name, local


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


__all__ = ["Capture", "StagedLayers", "capture"]
