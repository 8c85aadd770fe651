"""The reference a delta sync compares against: the bytes this rank last pushed, per tensor.

A delta sync writes only the elements whose bits differ from the bytes every target of the
delta verifiably holds. Those are the bytes this rank's last push produced (the rollout's
dtype, cast from the trainer's tensors), so the sender keeps a copy of them, per stream
tensor, flat in that dtype's raw bits. Encoding a tensor reads the new bytes and the
reference once, finds the changed elements, and writes them into the reference, which then
holds the new bytes: the reference is always the last push, and is usable only if that push
encoded every tensor (`DeltaReference.complete`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.delta_codec import as_bits
from weightsync.sender.config import ReferencePlacement


@dataclass(frozen=True, slots=True)
class Changes:
    """The elements of one tensor that changed since the reference.

    Attributes:
        elements: their flat indices into the tensor (int64, ascending).
        old: their bits in the reference (the base).
        new: their bits now.
        numel: the tensor's elements.
    """

    elements: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    numel: int


class DeltaReference:
    """The reference bytes of one sender, by ``(dtype, hf_name)``.

    Args:
        placement: ``"device"`` keeps each reference on its tensor's device (GPU memory for
            GPU tensors: encoding runs at memory speed there), ``"host"`` in host memory
            (pinned where CUDA is available; encoding then copies each tensor to the host).
    """

    def __init__(self, placement: ReferencePlacement = "device") -> None:
        if placement not in ("device", "host"):
            raise ValueError(f"reference placement must be 'device' or 'host', got {placement!r}")
        self.placement = placement
        self._refs: dict[tuple[str, str], torch.Tensor] = {}
        self._token: object | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes the reference holds."""
        return sum(ref.numel() * ref.element_size() for ref in self._refs.values())

    @property
    def token(self) -> object | None:
        """What the last complete push was labelled with (`complete`), None when the
        reference is not one whole push."""
        return self._token

    def invalidate(self) -> None:
        """Forget which push the reference holds (a push that did not encode every tensor
        left it part old, part new); the bytes stay allocated for the next push."""
        self._token = None

    def complete(self, token: object) -> None:
        """Every tensor of a push was encoded: the reference is that push, labelled `token`."""
        self._token = token

    def holds(self, keys: set[tuple[str, str]]) -> bool:
        """Whether a reference exists for every ``(dtype, hf_name)`` in `keys`."""
        return keys <= self._refs.keys()

    def free(self) -> None:
        """Drop every reference (the next push is full for every target)."""
        self._refs = {}
        self._token = None

    def _place(self, bits: torch.Tensor) -> torch.Tensor:
        if self.placement == "device" or bits.device.type == "cpu":
            return bits.clone()
        host = torch.empty(
            bits.shape, dtype=bits.dtype, pin_memory=torch.cuda.is_available(), device="cpu"
        )
        host.copy_(bits)
        return host

    def record(self, dtype_name: str, hf_name: str, tensor: torch.Tensor) -> None:
        """Make `tensor` (already in the rollout's dtype) the reference of ``hf_name``,
        without comparing (a full push: no target takes a delta of it)."""
        bits = as_bits(tensor.contiguous())
        ref = self._refs.get((dtype_name, hf_name))
        if ref is None or ref.numel() != bits.numel() or ref.dtype != bits.dtype:
            self._refs[(dtype_name, hf_name)] = self._place(bits)
        else:
            ref.copy_(bits)

    def encode(self, dtype_name: str, hf_name: str, tensor: torch.Tensor) -> Changes:
        """The elements of `tensor` (in the rollout's dtype) that differ from its reference,
        which then holds `tensor`'s bytes.

        Raises:
            ValueError: no reference of ``hf_name`` in this dtype and size (the caller
                checks `holds` before any write).
        """
        bits = as_bits(tensor.contiguous())
        ref = self._refs.get((dtype_name, hf_name))
        if ref is None or ref.numel() != bits.numel() or ref.dtype != bits.dtype:
            raise ValueError(
                f"no delta reference of {hf_name!r} ({dtype_name}, {bits.numel()} elements): "
                "its last push did not record it, so no target can take a delta of it"
            )
        if ref.device != bits.device:
            bits = bits.to(ref.device)
        elements = torch.ne(bits, ref).nonzero().reshape(-1)
        new = bits[elements]
        old = ref[elements]
        ref[elements] = new
        return Changes(elements=elements, old=old, new=new, numel=bits.numel())
