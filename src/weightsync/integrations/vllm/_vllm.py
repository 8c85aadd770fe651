"""Every use of vLLM's private API by the integration, in one place.

Written against vLLM 0.32.0 (`WRITTEN_FOR`): its in-place reload machinery
(``vllm/model_executor/model_loader/reload/``: ``layerwise.py``, ``meta.py``, ``utils.py``),
which records each layer's loaded-shape metadata when the model is built
(``record_metadata_for_reloading``) and, per layer, materialises the loaded-shape tensors,
runs the original weight loaders, then ``quant_method.process_weights_after_loading`` and
copies the processed values back into the original kernel storage
(``_copy_and_restore_kernel_tensors``), so storage addresses stay put across reloads. The
integration reuses exactly those steps (`reprocess_layer`). A vLLM without them fails with
`VllmApiError`, naming what is missing and the version this was written for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from weightsync.errors import WeightSyncError

WRITTEN_FOR = "0.32.0"
# What `wrap_processing` sets on a quant method (while the capture runs).
HOOK_ATTRS = ("process_weights_after_loading", "_weightsync_hook")

_REQUIRED: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.model_loader.reload.layerwise": (
        "get_layerwise_info",
        "_copy_and_restore_kernel_tensors",
        "_place_kernel_tensors",
    ),
    "vllm.model_executor.model_loader.reload.meta": ("restore_layer_on_meta", "materialize_layer"),
    "vllm.model_executor.model_loader.reload.utils": ("get_layer_params_buffers",),
    "vllm.model_executor.layers.quantization.base_config": ("QuantizeMethodBase",),
    "vllm.distributed.parallel_state": ("get_tensor_model_parallel_rank",),
}


class VllmApiError(WeightSyncError):
    """The running vLLM lacks a private function the integration relies on."""


_api: SimpleNamespace | None = None


def vllm_version() -> str:
    """The running vLLM's version."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def api() -> SimpleNamespace:
    """vLLM's private functions the integration uses, looked up once.

    Raises:
        VllmApiError: one is missing (another vLLM version than `WRITTEN_FOR`).
    """
    global _api
    if _api is not None:
        return _api
    found: dict[str, Any] = {}
    missing: list[str] = []
    for module_name, names in _REQUIRED.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing += [f"{module_name}.{name}" for name in names]
            continue
        for name in names:
            if hasattr(module, name):
                found[name.lstrip("_")] = getattr(module, name)
            else:
                missing.append(f"{module_name}.{name}")
    if missing:
        raise VllmApiError(
            f"weightsync's vLLM integration was written for vLLM {WRITTEN_FOR} and needs its "
            f"in-place reload machinery; vLLM {vllm_version()} lacks: {', '.join(missing)}"
        )
    _api = SimpleNamespace(**found)
    return _api


def tp_rank() -> int:
    """This worker's tensor-parallel rank."""
    return int(api().get_tensor_model_parallel_rank())


def quant_method_of(layer: torch.nn.Module) -> Any | None:
    """The layer's quantisation method (vLLM's ``QuantizeMethodBase``; the unquantised ones
    too), or None: a layer vLLM post-processes only through it."""
    method = getattr(layer, "quant_method", None)
    return method if isinstance(method, api().QuantizeMethodBase) else None


def process_weights_after_loading(layer: torch.nn.Module) -> None:
    """Run the layer's post-load processing as vLLM's reload does (and reconcile its TP state
    afterwards, as vLLM does: the processing may create new parameters)."""
    quant_method = quant_method_of(layer)
    if quant_method is None:
        return
    quant_method.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()


def reprocess_layer(layer: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> int:
    """Process `layer` again from loaded-shape values, through vLLM's own steps, into the
    storage its kernel tensors already have.

    The steps of vLLM's ``_layerwise_process``, with the weight loaders replaced by copies:
    keep the layer's kernel tensors, restore its loaded-shape tensors (``restore_layer_on_meta``
    + ``materialize_layer`` with the metadata vLLM recorded at load), fill each from
    `values` (by the layer's own tensor name) or, for a tensor not in `values`, from its kernel
    tensor (it kept the loaded shape: an in-place parameter, or a buffer), run
    ``quant_method.process_weights_after_loading``, and copy the processed values back into
    the kernel storage (``_copy_and_restore_kernel_tensors``).

    On failure the layer gets its kernel tensors back (what it held before, less what the
    processing may have replaced outside them, such as a oneDNN handle) and the error is
    raised: the layer may then compute with stale or partly new weights.

    Returns:
        How many tensors were filled from `values`.

    Raises:
        RuntimeError: a restored tensor has neither a value nor a kernel tensor of its shape
            and dtype; or what vLLM's processing raised.
    """
    vllm = api()
    info = vllm.get_layerwise_info(layer)
    info.kernel_tensors = vllm.get_layer_params_buffers(layer)
    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
    kernel_params, kernel_buffers = info.kernel_tensors
    kernel = {**kernel_buffers, **kernel_params}
    used = 0
    try:
        vllm.restore_layer_on_meta(layer, info)
        vllm.materialize_layer(layer, info)
        # As vLLM's reload does, so that online quantisation processes again.
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        restored = {**dict(layer.named_buffers(recurse=False))}
        restored.update(layer.named_parameters(recurse=False))
        for name, tensor in restored.items():
            if tensor is kernel.get(name):
                continue  # never moved to meta (a bias): it is the live tensor itself
            source = values.get(name)
            if source is not None:
                used += 1
            else:
                source = kernel.get(name)
                if source is None or source.shape != tensor.shape or source.dtype != tensor.dtype:
                    raise RuntimeError(
                        f"{type(layer).__name__}.{name}: no staged value and no kernel tensor "
                        f"of its loaded shape {tuple(tensor.shape)} ({tensor.dtype}) to "
                        "process it from"
                    )
            tensor.data.copy_(source)
        process_weights_after_loading(layer)
        vllm.copy_and_restore_kernel_tensors(layer, info)
    except BaseException:
        vllm.place_kernel_tensors(layer, info)
        raise
    finally:
        info.reset()
    return used


def wrap_processing(
    layer: torch.nn.Module, hook: Callable[[torch.nn.Module, Callable[[], None]], None]
) -> Callable[[], None]:
    """Route `layer`'s ``quant_method.process_weights_after_loading(layer)`` through
    ``hook(layer, run)`` (`run` runs vLLM's processing), until the returned undo is called.

    The hook is set on the quant-method instance, which vLLM looks the method up on for
    every call; an instance shared by several layers is wrapped once and passes each layer.
    """
    quant_method = quant_method_of(layer)
    if quant_method is None or "_weightsync_hook" in vars(quant_method):
        return lambda: None
    original = quant_method.process_weights_after_loading  # bound method

    def wrapped(target: torch.nn.Module) -> None:
        hook(target, lambda: original(target))

    quant_method.process_weights_after_loading = wrapped
    quant_method._weightsync_hook = True

    def undo() -> None:
        vars(quant_method).pop("process_weights_after_loading", None)
        vars(quant_method).pop("_weightsync_hook", None)

    return undo
