"""The smallest set of shims that run megatron-core 0.19.2 and Megatron-Bridge 0.6.2 on a CPU
without Transformer Engine or triton, on Python 3.11.

Call `apply_core` in a process before ``import megatron.core``, `after_parallel_init` after
``parallel_state.initialize_model_parallel``, and `apply_bridge` before ``import
megatron.bridge``. `cuda_is_noop` goes around the ``GPTModel`` constructor (tied embeddings
with PP > 1 only). On a CUDA machine with Transformer Engine none of this is needed.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any


class _Anything:
    """An import-only stand-in: any attribute or subscript is another one; called with one
    function (as a decorator) it hands the function back."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _Anything:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything(f"{self._name}()")

    def __getitem__(self, item: Any) -> _Anything:
        return _Anything(f"{self._name}[]")


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


def stub_module(name: str, **attrs: Any) -> types.ModuleType:
    """Register an import-only package `name` in ``sys.modules`` (with a real ``__spec__``, so
    ``importlib.util.find_spec`` works) and return it."""
    module = _StubModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__path__ = []
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


def cpu_causal_mask(sq: int):
    """Megatron's default causal mask (``True`` above the diagonal), on the CPU."""
    import torch

    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_core() -> None:
    """The shims ``import megatron.core`` and a ``GPTModel`` need on a CPU (idempotent).

    - ``triton``: ``megatron/core/transformer/moe/ops/paged_stash.py`` imports it
      unconditionally; an import-only stub goes in after the torch modules that probe for
      triton are imported (with the stub visible first, inductor takes it for triton);
    - ``torch.cuda.current_device`` returns ``"cpu"`` (rope's ``inv_freq``, the attention
      buffer and the MoE router move tensors to it even with ``use_cpu_initialization``);
    - the default causal mask is built on the CPU (Megatron builds it with
      ``device="cuda"``).
    """
    import torch
    import torch._dynamo
    import torch._dynamo.repro.after_dynamo
    import torch._inductor
    import torch._inductor.runtime.triton_compat

    if "triton" not in sys.modules:
        language = stub_module("triton.language", constexpr=_Anything("tl.constexpr"))
        stub_module("triton", language=language, __version__="0.0.0")
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    transformer_utils.get_default_causal_mask = cpu_causal_mask
    fused_softmax.get_default_causal_mask = cpu_causal_mask


def after_parallel_init(seed: int = 1234) -> None:
    """Seed every rank alike and use Megatron's inference RNG tracker, whose add / fork need
    no CUDA RNG (with ``use_cpu_initialization`` a weight is drawn whole and split, so TP
    ranks agree without the training tracker)."""
    import torch
    from megatron.core.tensor_parallel import random as megatron_random

    torch.manual_seed(seed)
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def apply_bridge() -> None:
    """The shims ``import megatron.bridge`` needs (after `apply_core`; idempotent):
    ``typing.override`` (Python 3.12), a Transformer Engine stub (one LoRA module imports it
    unconditionally; registered after ``import megatron.core``, which would otherwise take
    it for TE), and ``transformers.modeling_attn_mask_utils``, gone in transformers 5."""
    apply_core()
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    import megatron.core  # noqa: F401

    if "transformer_engine" not in sys.modules:
        engine = stub_module("transformer_engine", __version__="0.0.0")
        engine.pytorch = stub_module("transformer_engine.pytorch")  # type: ignore[attr-defined]
    try:
        import transformers.modeling_attn_mask_utils  # noqa: F401
    except ImportError:
        stub_module("transformers.modeling_attn_mask_utils")


@contextlib.contextmanager
def cuda_is_noop() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself meanwhile: Megatron moves the last stage's
    copy of tied embeddings to CUDA before all-reducing it (``language_module.py``)."""
    import torch

    original = torch.Tensor.cuda
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
