"""The per-sync weight digest of a rollout parameter: which of its bytes are sampled, and how
they sum (the format both sides of a sync compute it in).

Every sync is verified cheaply: each sender sums a sample of the bytes it staged for each
destination parameter, the replica sums the same sample of what the parameter holds once the
session's writes are in, and the two must agree at ``end_weight_update``. Reading every byte
again would cost a large part of a sync on a GPU (a same-GPU copy reads and writes each byte
once; a full checksum would read it again); a sample costs next to nothing and still catches
what goes wrong in practice: a parameter, or any run of it longer than the sampling stride,
not written, written from the wrong source, to the wrong address or in the wrong order, or
overwritten from outside the session after the trainer wrote it.

The sample of a parameter of ``n`` bytes is the bytes at ``k * stride`` for ``k = 0, 1, ...``
(`sample_stride`: about `SAMPLES_PER_PARAMETER` per parameter, but never further apart than
`MAX_STRIDE`, so every run of a large parameter that long is sampled; every byte of a small
one) plus its last byte. Sample ``k`` holding byte ``b`` adds ``(b + 1) * weight(k)``, and
a parameter's digest is the sum of its samples. Sums of parts add up, so the ranks that
each wrote a part of one parameter send partial digests and the driver adds them; every term
is below 2**39 and a parameter of up to 8 TiB has at most 2**23 + 1 samples, so every sum
is exact in an int64 on any device.

The positions are fixed, so the digest is a check against accidents and against writes that
do not know the layout, not a MAC: the data plane itself is guarded by the API key and by
binding every listener to the configured host.
"""

from __future__ import annotations

from typing import NamedTuple

SAMPLES_PER_PARAMETER = 64
MAX_STRIDE = 1 << 20
# A multiplier and modulus of the sample weight: the weight differs between neighbouring
# samples (so a shifted or reordered run changes the sum) and stays below 2**31.
WEIGHT_MULTIPLIER = 2654435761
WEIGHT_MODULUS = (1 << 31) - 1


def sample_stride(num_bytes: int) -> int:
    """The distance between two sampled bytes of a parameter of `num_bytes` bytes."""
    return min(MAX_STRIDE, max(1, -(-num_bytes // SAMPLES_PER_PARAMETER)))


def num_samples(num_bytes: int) -> int:
    """How many bytes of a parameter of `num_bytes` bytes are sampled."""
    if num_bytes <= 0:
        return 0
    stride = sample_stride(num_bytes)
    strided = -(-num_bytes // stride)
    return strided + ((num_bytes - 1) % stride != 0)


def weight(k: int) -> int:
    """The weight of sample number `k` of a parameter (in ``[1, 2**31 - 1]``)."""
    return (k * WEIGHT_MULTIPLIER) % WEIGHT_MODULUS + 1


class SampleRun(NamedTuple):
    """The samples of a parameter that fall in one run of its bytes.

    The strided samples ``first_k .. first_k + count - 1`` lie at ``first_offset + i *
    stride`` from the run's start; when ``tail_offset >= 0`` the run also holds the
    parameter's last byte, sample number ``tail_k``, at ``tail_offset``.

    Attributes:
        first_offset: offset of the first strided sample from the run's start.
        stride: bytes between two strided samples.
        count: strided samples in the run.
        first_k: sample number of the first one.
        tail_offset: offset of the last byte from the run's start, or -1.
        tail_k: its sample number (meaningful when ``tail_offset >= 0``).
    """

    first_offset: int
    stride: int
    count: int
    first_k: int
    tail_offset: int
    tail_k: int


def sample_run(num_bytes: int, start: int, length: int) -> SampleRun:
    """The samples of a parameter of `num_bytes` bytes that lie in its bytes ``[start,
    start + length)``.

    Raises:
        ValueError: the run is empty or not inside the parameter.
    """
    if length <= 0 or start < 0 or start + length > num_bytes:
        raise ValueError(
            f"bytes [{start}, {start + length}) are not a run of a {num_bytes}-byte parameter"
        )
    stride = sample_stride(num_bytes)
    first_k = -(-start // stride)
    last_k = (start + length - 1) // stride
    count = max(0, last_k - first_k + 1)
    last = num_bytes - 1
    strided_last = last % stride == 0
    tail_offset = last - start if start <= last < start + length and not strided_last else -1
    return SampleRun(
        first_offset=first_k * stride - start,
        stride=stride,
        count=count,
        first_k=first_k,
        tail_offset=tail_offset,
        tail_k=-(-num_bytes // stride),
    )


def sample_positions(num_bytes: int) -> list[tuple[int, int]]:
    """Every ``(sample number, byte position)`` of a parameter of `num_bytes` bytes."""
    if num_bytes <= 0:
        return []
    run = sample_run(num_bytes, 0, num_bytes)
    positions = [(run.first_k + i, run.first_offset + i * run.stride) for i in range(run.count)]
    if run.tail_offset >= 0:
        positions.append((run.tail_k, run.tail_offset))
    return positions


def digest_of(data: bytes) -> int:
    """The digest of a whole parameter's bytes (the reference the vectorized sums match)."""
    return sum((data[position] + 1) * weight(k) for k, position in sample_positions(len(data)))


def run_digest(data: bytes, num_bytes: int, start: int) -> int:
    """The partial digest of the run `data` of a parameter of `num_bytes` bytes, starting at
    byte `start` of it."""
    run = sample_run(num_bytes, start, len(data))
    total = sum(
        (data[run.first_offset + i * run.stride] + 1) * weight(run.first_k + i)
        for i in range(run.count)
    )
    if run.tail_offset >= 0:
        total += (data[run.tail_offset] + 1) * weight(run.tail_k)
    return total
