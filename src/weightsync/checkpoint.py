"""Reading an HF checkpoint folder: its config.json, and its safetensors files, checked.

A safetensors file is an 8-byte little-endian header length, a JSON header of
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (and an optional
``"__metadata__"`` of strings), then the data section the offsets index. Nothing in a header
is trusted: `check_safetensors_header` checks it like a format validator before any tensor
is read (see its docstring for the rules), and a violation is a `ValueError` naming the file,
the tensor, what is wrong and what to do.

Tensors are read with ordinary file reads (`os.preadv`) into memory the reader owns, never
through a memory map: a mapped page past the end of a file truncated while it is read kills
the process with SIGBUS, where a read comes back short and becomes an error naming the file
and the tensor. `SafetensorsCheckpoint.stream` reads one tensor at a time and gives each
tensor's memory back to the system once its consumer drops it, so reading a checkpoint holds
what the consumer holds, not the model.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.layout.dtypes import DTYPE_SIZES

# The safetensors dtype codes weightsync moves, and their torch names.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
}
# The largest header the safetensors library itself accepts.
MAX_HEADER_BYTES = 100_000_000
_METADATA = "__metadata__"
_RESAVE = (
    "the file is damaged or was not written by a safetensors writer: save the checkpoint again"
)
_RECOPY = "the file is truncated: copy or save it again"
# Tensors of one pass are read into anonymous mappings of at least this size (address space
# only: pages are committed as tensors are read and returned as they are dropped).
_ARENA_BYTES = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class SafetensorsEntry:
    """One tensor of a safetensors file, as its checked header describes it.

    Attributes:
        file: the file that holds it.
        name: its name (an HF name in an HF checkpoint).
        dtype: its torch dtype name without the ``torch.`` prefix.
        shape: its shape.
        offset: the file offset of its first byte (past the length and the header).
        num_bytes: its size: the product of `shape` times the element size.
    """

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


def load_config_dict(path: str | Path) -> dict[str, Any]:
    """Read a config.json, given the file or the checkpoint folder that holds it.

    Raises:
        ValueError: no config.json there, it is not a JSON object, or it has no `model_type`.
        OSError: it cannot be read.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {path}: pass a config.json or a checkpoint folder")
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(
            f"{file} is not valid JSON ({exc}); is it a Hugging Face config.json?"
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{file} has no 'model_type'; is it a Hugging Face config.json?")
    return data


def check_safetensors_header(
    header: Any, *, file: str | Path, data_start: int, file_bytes: int
) -> tuple[SafetensorsEntry, ...]:
    """The tensors a parsed safetensors header describes, once it is checked.

    Rules: the header is a JSON object; ``__metadata__``, when there, maps strings to
    strings; every other entry is an object with a ``dtype`` weightsync moves
    (`SAFETENSORS_DTYPES`), a ``shape`` of non-negative ints, and ``data_offsets``, a pair of
    ints ``[begin, end]`` with ``0 <= begin <= end`` inside the data section (the
    ``file_bytes - data_start`` bytes after the header) and ``end - begin`` exactly the
    shape's element count times the element size; no two tensors share a byte.

    Args:
        header: the parsed JSON header.
        file: the file, for the messages.
        data_start: where the data section starts (8 + the header's length).
        file_bytes: the file's size.

    Returns:
        The tensors in the order of their bytes in the file.

    Raises:
        ValueError: the first rule broken, naming the file, the tensor, what is wrong and
            what to do.
    """
    file = Path(file)
    if not isinstance(header, dict):
        raise _bad(file, f"its header is a JSON {type(header).__name__}, not an object; {_RESAVE}")
    data_bytes = file_bytes - data_start
    entries: list[SafetensorsEntry] = []
    for name, entry in header.items():
        if name == _METADATA:
            _check_metadata(file, entry)
            continue
        entries.append(_check_entry(file, name, entry, data_start, data_bytes))
    entries.sort(key=lambda e: (e.offset, e.num_bytes))
    previous: SafetensorsEntry | None = None
    for entry in entries:
        if entry.num_bytes == 0:
            continue  # an empty tensor has no bytes to share
        if previous is not None and entry.offset < previous.offset + previous.num_bytes:
            raise _bad(
                file,
                f"its bytes {_span(entry, data_start)} of the data section overlap those of "
                f"tensor {previous.name!r} {_span(previous, data_start)}: a tensor would read "
                f"another's bytes; {_RESAVE}",
                entry.name,
            )
        previous = entry
    return tuple(entries)


def read_safetensors_header(file: str | Path) -> tuple[SafetensorsEntry, ...]:
    """The checked tensors of one safetensors file (`check_safetensors_header`); reads the
    length and the header only.

    Raises:
        ValueError: the file is not a safetensors file, or its header breaks a rule.
        OSError: it cannot be opened or read.
    """
    file = Path(file)
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_header(fd, file, os.fstat(fd))
    finally:
        os.close(fd)


class SafetensorsCheckpoint:
    """The ``*.safetensors`` files of a checkpoint folder, every header checked, each file
    held open for reading.

    Call protocol: construct it (every header is read and checked, nothing else); read
    `entries`; read tensors with `read` or one pass at a time with `stream`, as often as
    needed; `close` it (or use it as a context manager).

    A file is read through the descriptor opened when its header was checked, so a file
    replaced since (a new file renamed over it) is still read as checked; a file truncated or
    rewritten in place while it is read is an error naming it and the tensor.
    """

    def __init__(self, folder: str | Path) -> None:
        """Open and check every ``*.safetensors`` file of `folder`.

        Raises:
            ValueError: no safetensors file, a file that is not safetensors or whose header
                breaks a rule of `check_safetensors_header`, or a tensor name found in two
                files.
            OSError: a file cannot be opened or read.
        """
        self.folder = Path(folder)
        self._files: dict[Path, tuple[int, os.stat_result]] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {folder}: pass an HF checkpoint folder")
        entries: list[SafetensorsEntry] = []
        seen: dict[str, Path] = {}
        try:
            for file in files:
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                status = os.fstat(fd)
                self._files[file] = (fd, status)
                for entry in _read_header(fd, file, status):
                    if entry.name in seen:
                        raise _bad(
                            file,
                            f"it is in {seen[entry.name].name} too: a tensor must be in one "
                            "file of a checkpoint; remove one of them",
                            entry.name,
                        )
                    seen[entry.name] = file
                    entries.append(entry)
        except BaseException:
            self.close()
            raise
        self.entries: tuple[SafetensorsEntry, ...] = tuple(entries)
        """Every tensor: files in name order, each file's tensors in the order of their bytes."""

    @property
    def num_bytes(self) -> int:
        """The bytes of every tensor."""
        return sum(entry.num_bytes for entry in self.entries)

    def read_into(self, entry: SafetensorsEntry, out: memoryview) -> None:
        """Read `entry`'s bytes from its file into `out` (exactly ``entry.num_bytes`` long).

        Raises:
            ValueError: the file ended early or changed since its header was checked
                (truncated or rewritten while being read), or the read failed; naming the
                file and the tensor.
        """
        fd, checked = self._descriptor(entry.file)
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if len(view) != entry.num_bytes:
            raise ValueError(
                f"read_into needs {entry.num_bytes} bytes for tensor {entry.name!r}, "
                f"got a buffer of {len(view)}"
            )
        try:
            done = _pread(fd, view, entry.offset)
            now = os.fstat(fd)
        except OSError as exc:
            raise _bad(entry.file, f"reading it failed: {exc.strerror or exc}", entry.name) from exc
        if done < entry.num_bytes or (now.st_size, now.st_mtime_ns) != (
            checked.st_size,
            checked.st_mtime_ns,
        ):
            raise _bad(
                entry.file,
                f"the file changed while it was read (it was {checked.st_size} bytes when its "
                f"header was checked and is {now.st_size} now; {done} of the tensor's "
                f"{entry.num_bytes} bytes were read): it was truncated or rewritten while being "
                "read; try again once the checkpoint is completely written",
                entry.name,
            )

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` in memory of its own.

        Raises:
            KeyError: no tensor of that name.
            ValueError: as `read_into`.
        """
        entry = next((e for e in self.entries if e.name == name), None)
        if entry is None:
            raise KeyError(f"no tensor {name!r} in {self.folder}")
        if entry.num_bytes == 0:
            return torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        buffer = bytearray(entry.num_bytes)
        self.read_into(entry, memoryview(buffer))
        return torch.frombuffer(buffer, dtype=getattr(torch, entry.dtype)).view(entry.shape)

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass over every tensor, in `entries` order, each read when the pass reaches it.

        Every tensor of a pass has an address of its own (a consumer may tell tensors apart
        by address), page-aligned; its pages go back to the system as soon as the consumer
        drops the tensor and every view of it. The tensors are read-only inference tensors
        (``torch.inference_mode``); empty tensors have no memory.

        Raises:
            ValueError: as `read_into`, when the pass reaches that tensor.
        """
        arenas = _Arenas()
        for entry in self.entries:
            dtype = getattr(torch, entry.dtype)
            region = arenas.take(entry.num_bytes) if entry.num_bytes else None
            if region is not None:
                self.read_into(entry, region)
            # Inference tensors: nothing writes them in place (outside inference mode), so
            # they have no version counter that a consumer would keep them alive to check.
            with torch.inference_mode():
                if region is None:
                    tensor = torch.empty(entry.shape, dtype=dtype)
                else:
                    tensor = torch.frombuffer(region, dtype=dtype).view(entry.shape)
            del region
            yield entry.name, tensor
            del tensor

    def close(self) -> None:
        """Close the files (tensors already read stay valid)."""
        files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _descriptor(self, file: Path) -> tuple[int, os.stat_result]:
        opened = self._files.get(file)
        if opened is None:
            raise ValueError(f"{file} is not open: the SafetensorsCheckpoint was closed")
        return opened


def open_safetensors(folder: str | Path) -> SafetensorsCheckpoint:
    """Open and check the safetensors files of a checkpoint folder (`SafetensorsCheckpoint`).

    Raises:
        ValueError: as `SafetensorsCheckpoint`.
        OSError: a file cannot be opened or read.
    """
    return SafetensorsCheckpoint(folder)


class _Arenas:
    """The memory one pass reads its tensors into: page-aligned regions of anonymous
    mappings. Every mapping stays mapped until the pass and its tensors are gone, so no two
    tensors of a pass share an address; a region's pages are given back (``MADV_DONTNEED``)
    once the memoryview that backs its tensor is released."""

    def __init__(self) -> None:
        self._mappings: list[mmap.mmap] = []
        self._used = 0

    def take(self, num_bytes: int) -> memoryview:
        size = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if not self._mappings or self._used + size > len(self._mappings[-1]):
            self._mappings.append(mmap.mmap(-1, max(size, _ARENA_BYTES), flags=mmap.MAP_PRIVATE))
            self._used = 0
        mapping, start = self._mappings[-1], self._used
        self._used += size
        region = memoryview(mapping)[start : start + num_bytes]
        release = weakref.finalize(region, mapping.madvise, mmap.MADV_DONTNEED, start, size)
        release.atexit = False
        return region


def _read_header(fd: int, file: Path, status: os.stat_result) -> tuple[SafetensorsEntry, ...]:
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{file} is not a regular file: pass a folder of safetensors files")
    file_bytes = status.st_size
    if file_bytes < 8:
        raise _bad(
            file,
            f"it is {file_bytes} bytes, shorter than the 8-byte header length a safetensors "
            f"file starts with; {_RECOPY}",
        )
    prefix = bytearray(8)
    if _pread(fd, memoryview(prefix), 0) < 8:
        raise _bad(file, f"it ended while its header length was read; {_RECOPY}")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > MAX_HEADER_BYTES:
        raise _bad(
            file,
            f"its header length says {header_bytes} bytes, more than the {MAX_HEADER_BYTES} "
            f"safetensors allows; {_RESAVE}",
        )
    if 8 + header_bytes > file_bytes:
        raise _bad(
            file,
            f"its header length says {header_bytes} bytes, but only {file_bytes - 8} follow "
            f"the length; {_RECOPY}",
        )
    text = bytearray(header_bytes)
    if _pread(fd, memoryview(text), 8) < header_bytes:
        raise _bad(file, f"it ended while its header was read; {_RECOPY}")
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _RepeatedKeyError as exc:
        raise _bad(file, f"its header names {exc.args[0]!r} twice; {_RESAVE}") from None
    except ValueError as exc:
        raise _bad(file, f"its header is not valid JSON ({exc}); {_RESAVE}") from None
    return check_safetensors_header(
        header, file=file, data_start=8 + header_bytes, file_bytes=file_bytes
    )


def _check_metadata(file: Path, metadata: Any) -> None:
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise _bad(file, f"its {_METADATA!r} is {metadata!r}, not an object of strings; {_RESAVE}")


def _check_entry(
    file: Path, name: str, entry: Any, data_start: int, data_bytes: int
) -> SafetensorsEntry:
    if not isinstance(entry, dict):
        raise _bad(file, f"its header entry is {entry!r}, not an object; {_RESAVE}", name)
    code = entry.get("dtype")
    if code not in SAFETENSORS_DTYPES:
        raise _bad(
            file,
            f"it has dtype {code!r}, which weightsync does not move (it moves "
            f"{', '.join(SAFETENSORS_DTYPES)}): convert the tensor, or leave it out",
            name,
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        raise _bad(
            file, f"its shape is {shape!r}, not a list of non-negative ints; {_RESAVE}", name
        )
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _bad(
            file,
            f"its data_offsets are {offsets!r}, not a pair of ints [begin, end]; {_RESAVE}",
            name,
        )
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _bad(file, f"its data_offsets {offsets} need 0 <= begin <= end; {_RESAVE}", name)
    if end > data_bytes:
        raise _bad(
            file,
            f"its bytes [{begin}, {end}) end past the data section, which has {data_bytes} "
            f"bytes (the file has {data_start + data_bytes}, its header {data_start - 8}); "
            f"{_RECOPY}",
            name,
        )
    dtype = SAFETENSORS_DTYPES[code]
    num_bytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != num_bytes:
        raise _bad(
            file,
            f"its shape {shape} of {code} needs {num_bytes} bytes, but its data_offsets "
            f"[{begin}, {end}] hold {end - begin}; {_RESAVE}",
            name,
        )
    return SafetensorsEntry(
        file=file,
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        offset=data_start + begin,
        num_bytes=num_bytes,
    )


class _RepeatedKeyError(ValueError):
    """A JSON object names a key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (a parser keeps one of the two, and another
    reader of the same file may keep the other)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKeyError(key)
        out[key] = value
    return out


def _pread(fd: int, into: memoryview, offset: int) -> int:
    """Read into all of `into` from `offset`; the bytes read (fewer where the file ends)."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _span(entry: SafetensorsEntry, data_start: int) -> str:
    begin = entry.offset - data_start
    return f"[{begin}, {begin + entry.num_bytes})"


def _bad(file: Path, what: str, tensor: str | None = None) -> ValueError:
    where = f"{file}: tensor {tensor!r}" if tensor is not None else str(file)
    return ValueError(f"{where}: {what}")
