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

from weightsync import delta_kernels
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
        self._compare: np.ndarray | None = None

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

    def bits(self, dtype_name: str, hf_name: str) -> torch.Tensor | None:
        """The reference's flat bits of ``hf_name`` in ``dtype_name`` (None: none recorded),
        for an encoder that compares and updates them in place, as `encode` does."""
        return self._refs.get((dtype_name, hf_name))

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

        With the reference on a device, the whole tensor is cast and compared there at
        once. With it in host memory, the tensor (cast on its device first when it is not
        on the host) is read in cache-sized chunks: each is cast into one reused buffer and
        compared with the reference eight bytes at a time into one reused mask, and only the
        words that differ are gathered, written into the reference and split into their
        elements while the chunk is still in the cache. Memory sees one read of the tensor
        and one of the reference, and a write of the changed words and elements only.

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
        if ref.device.type != "cpu":
            if delta_kernels.ready(ref.device) and delta_kernels.fuses(
                flat.dtype, dtype, flat.numel()
            ):
                # One fused pass: the cast happens in the kernel, on the way from memory.
                source = flat.to(device=ref.device).contiguous()
                elements, new, old = delta_kernels.find_changes(source, ref, dtype)
                return Changes(elements=elements, old=old, new=new, numel=ref.numel())
            bits = as_bits(flat.to(device=ref.device, dtype=dtype).contiguous())
            return _device_changes(bits, ref)
        if flat.device.type != "cpu":
            # Cast where the tensor lives (half the bytes to move for fp32 -> bf16), compare
            # on the host.
            flat = flat.to(dtype=dtype).to("cpu")
        return self._host_changes(flat, ref, dtype)

    def _host_changes(self, flat: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Changes:
        """`encode` against a host reference: `flat` (host, any dtype) in chunks."""
        ref_np = ref.numpy()
        element = ref_np.dtype
        # Eight bytes at a time where the reference is aligned; element by element otherwise.
        per_word = 8 // element.itemsize if ref.data_ptr() % 8 == 0 else 1
        word = np.dtype(np.int64) if per_word > 1 else element
        numel = flat.numel()
        whole = numel - numel % per_word
        ref_words = ref_np[:whole].view(word)
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for start in range(0, whole, _HOST_CHUNK):
            stop = min(start + _HOST_CHUNK, whole)
            new_words = self._chunk_bits(flat[start:stop], dtype).view(word)
            ref_chunk = ref_words[start // per_word : stop // per_word]
            words = self._differing(new_words, ref_chunk)
            if words.size:
                new, old = new_words.take(words), ref_chunk.take(words)
                ref_chunk.put(words, new)
                # Split into elements while the chunk's words are still in the cache.
                found.append(_split_words(words, new, old, element, start // per_word))
        if whole < numel:  # the last elements, fewer than a word
            tail = self._chunk_bits(flat[whole:], dtype)
            ref_tail = ref_np[whole:]
            differ = np.flatnonzero(tail != ref_tail)
            found.append((differ + whole, tail[differ], ref_tail[differ]))
            ref_tail[differ] = tail[differ]
        elements, new, old = _joined(found, element)
        return Changes(
            elements=torch.from_numpy(elements),
            old=torch.from_numpy(old),
            new=torch.from_numpy(new),
            numel=numel,
        )

    def _chunk_bits(self, piece: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
        """`piece`'s raw bits in `dtype` as numpy: a view where it already is that dtype,
        contiguous and aligned, else cast into a reused host buffer."""
        if piece.dtype == dtype and piece.is_contiguous() and piece.data_ptr() % 8 == 0:
            return as_bits(piece).numpy()
        buffer = self._cast.get(dtype)
        if buffer is None:
            buffer = self._cast[dtype] = torch.empty(_HOST_CHUNK, dtype=dtype)
        buffer = buffer[: piece.numel()]
        buffer.copy_(piece)
        return as_bits(buffer).numpy()

    def _differing(self, new_words: np.ndarray, ref_words: np.ndarray) -> np.ndarray:
        """The indices (ascending) of the words where `new_words` and `ref_words` differ,
        compared into one reused mask.

        numpy finds the nonzeros of a bool array with a branchless loop above 10 % of them
        and a skip-the-zeros loop below, which mispredicts a branch at every changed word
        when they are a few percent and scattered (a delta's case): twice as slow. The mask
        is followed by a ninth of its length set, so the branchless loop always runs; the
        indices of that tail are dropped.
        """
        size = new_words.size
        pad = size // 9 + 1
        if self._compare is None or self._compare.size < size + pad:
            self._compare = np.empty(size + pad, dtype=np.bool_)
        mask = self._compare[: size + pad]
        np.not_equal(new_words, ref_words, out=mask[:size])
        mask[size:] = True
        found = mask.nonzero()[0]
        return found[: found.size - pad]


# Elements per host chunk: the chunk's cast (1 MiB of bf16), its reference and the compare's
# mask stay in the cache between the passes over them, and the Python of a chunk (a few
# calls) stays a small part of its time.
_HOST_CHUNK = 1 << 19


def _split_words(
    words: np.ndarray,
    new_words: np.ndarray,
    old_words: np.ndarray,
    element: np.dtype,
    first: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(elements, new, old)`` of the elements (raw bits of `element`) that differ inside
    the changed `words` (their indices counted from word `first`, ascending, and their new
    and old bits, words of 8 bytes or single elements), ascending."""
    per_word = new_words.itemsize // element.itemsize
    if per_word == 1:
        return words + first, new_words, old_words
    new_lanes, old_lanes = new_words.view(element), old_words.view(element)
    lanes = np.flatnonzero(new_lanes != old_lanes)
    shift = per_word.bit_length() - 1
    elements = words.take(lanes >> shift)
    elements += first
    elements <<= shift
    elements |= lanes & (per_word - 1)
    return elements, new_lanes.take(lanes), old_lanes.take(lanes)


def _joined(
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]], element: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks' ``(elements, new, old)`` of `found` joined (empty arrays of `element`
    bits where none changed)."""
    if not found:
        empty = np.zeros(0, dtype=element)
        return np.zeros(0, dtype=np.int64), empty, empty.copy()
    if len(found) == 1:
        return found[0]
    elements = np.concatenate([f[0] for f in found])
    new = np.concatenate([f[1] for f in found])
    old = np.concatenate([f[2] for f in found])
    return elements, new, old


def _device_changes(bits: torch.Tensor, ref: torch.Tensor) -> Changes:
    """Where `bits` differ from `ref` (same dtype, size and device), which then holds
    `bits`: one compare over the whole tensor."""
    elements = torch.ne(bits, ref).nonzero().reshape(-1)
    new, old = bits[elements], ref[elements]
    ref[elements] = new
    return Changes(elements=elements, old=old, new=new, numel=ref.numel())
