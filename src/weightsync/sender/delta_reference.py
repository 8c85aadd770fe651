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

import numpy as np
import torch

from weightsync.delta_codec import as_bits
from weightsync.sender.config import ReferencePlacement
from weightsync.torch_dtypes import torch_dtype


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
        self._dtypes: dict[str, torch.dtype] = {}
        self._cast: dict[torch.dtype, torch.Tensor] = {}

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
        """The elements of `tensor` (any dtype: cast to the rollout's, ``dtype_name``) that
        differ from its reference, which then holds `tensor`'s bytes.

        On the host the tensor is read in cache-sized chunks, each cast into one reused
        buffer and compared with the reference eight bytes at a time: the elements of only
        the words that differ are compared one by one (8 GB/s of bytes read on one core of
        this project's CI machine, where torch's ``!=`` + ``nonzero`` reach 1.3). On a GPU
        the whole tensor is compared at once.

        Raises:
            ValueError: no reference of ``hf_name`` in this dtype and size (the caller
                checks `holds` before any write).
        """
        dtype = self._dtypes.setdefault(dtype_name, torch_dtype(dtype_name))
        flat = tensor.reshape(-1)
        ref = self._refs.get((dtype_name, hf_name))
        size = torch.empty((), dtype=dtype).element_size()
        if ref is None or ref.numel() != flat.numel() or ref.element_size() != size:
            raise ValueError(
                f"no delta reference of {hf_name!r} ({dtype_name}, {flat.numel()} elements): "
                "its last push did not record it, so no target can take a delta of it"
            )
        if ref.device != flat.device or flat.device.type != "cpu":
            bits = as_bits(flat.to(device=ref.device, dtype=dtype).contiguous())
            return _changes(bits, ref, 0)
        pieces = []
        for start in range(0, flat.numel(), _HOST_CHUNK):
            piece = flat[start : start + _HOST_CHUNK]
            if piece.dtype == dtype:
                bits = as_bits(piece.contiguous())
            else:
                buffer = self._buffer(dtype, piece.numel())
                buffer.copy_(piece)
                bits = as_bits(buffer)
            changes = _changes(bits, ref[start : start + piece.numel()], start)
            if changes.elements.numel():
                pieces.append(changes)
        if not pieces:
            empty = ref[:0]
            return Changes(
                elements=torch.zeros(0, dtype=torch.int64), old=empty, new=empty, numel=ref.numel()
            )
        return Changes(
            elements=torch.cat([p.elements for p in pieces]),
            old=torch.cat([p.old for p in pieces]),
            new=torch.cat([p.new for p in pieces]),
            numel=ref.numel(),
        )

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reused host buffer of `numel` elements of `dtype` (a chunk cast into it)."""
        buffer = self._cast.get(dtype)
        if buffer is None:
            buffer = self._cast[dtype] = torch.empty(_HOST_CHUNK, dtype=dtype)
        return buffer[:numel]


# Elements per host chunk: the chunk's cast, bits and masks stay in the cache.
_HOST_CHUNK = 1 << 18


def _changes(bits: torch.Tensor, ref: torch.Tensor, offset: int) -> Changes:
    """Where `bits` differ from `ref` (same dtype and size), which then holds `bits`;
    element indices shifted by `offset`."""
    if bits.device.type == "cpu":
        return _host_changes(bits, ref, offset)
    elements = torch.ne(bits, ref).nonzero().reshape(-1)
    new, old = bits[elements], ref[elements]
    ref[elements] = new
    return Changes(elements=elements + offset, old=old, new=new, numel=ref.numel())


def _host_changes(bits: torch.Tensor, ref: torch.Tensor, offset: int) -> Changes:
    """`_changes` on the host, with numpy: its nonzero is several times faster than
    torch's on CPU. Eight bytes are compared at a time where both are aligned; only the
    words that differ are looked at element by element."""
    new_np, ref_np = bits.numpy(), ref.numpy()
    per_word = 8 // new_np.itemsize
    if (
        per_word > 1
        and new_np.size % per_word == 0
        and bits.data_ptr() % 8 == 0
        and ref.data_ptr() % 8 == 0
    ):
        new_words, ref_words = new_np.view(np.int64), ref_np.view(np.int64)
        words = np.flatnonzero(new_words != ref_words)
        differ = (new_words[words] ^ ref_words[words]).view(new_np.dtype) != 0
        lanes = np.flatnonzero(differ)
        shift = per_word.bit_length() - 1
        elements = (words[lanes >> shift] << shift) + (lanes & (per_word - 1))
    else:
        elements = np.flatnonzero(new_np != ref_np)
    new = new_np[elements]
    old = ref_np[elements]
    ref_np[elements] = new
    if offset:
        elements += offset
    return Changes(
        elements=torch.from_numpy(elements),
        old=torch.from_numpy(old),
        new=torch.from_numpy(new),
        numel=ref.numel(),
    )
