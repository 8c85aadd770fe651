"""Delta syncs into SGLang as released, through its custom weight loader
(`weightsync.integrations.sglang.apply_delta`).

The descriptor crosses hosts as a plain pickle and every malformed one is refused; in this
process, the loader reads payloads from a trainer's registered memory over real Mooncake
TCP, proves the base, applies, checks and replies, and refuses what does not fit without
writing. weightsync installs beside SGLang's pinned set with no new broken requirement. Then
real SGLang 0.5.23 on this CPU (float32 weights of a bf16 checkpoint), started with the
loader, takes three delta syncs from a simulated bf16 trainer (fp32 master weights, so few
bf16 elements change per step): after each, every parameter read back over Mooncake equals
the trainer's bytes, SGLang's own weights checker finds them equal to a snapshot of the same
change written in full, and the reply's checksums are the next base. A wrong base is refused
with the weights untouched and the server serving.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from conftest import SGLANG_API_KEY
from weightsync.delta_codec import (
    BLOCK_ELEMENTS,
    Section,
    as_bits,
    checksum_change,
    checksums,
    encode_payload,
)
from weightsync.integrations.sglang import (
    DESCRIPTOR_NAME,
    LOAD_FORMAT,
    DeltaDescriptor,
    DeltaReply,
    DescriptorError,
    Remote,
    ReplyError,
    ReplyStatus,
    apply_delta,
    reply_bytes,
    request_body,
)
from weightsync.integrations.sglang import loader as sglang_loader
from weightsync.transport import MooncakeConfig, MooncakeTransport

ROOT = Path(__file__).resolve().parents[1]
TRAINER_SESSION = "127.0.0.1:15999"


# --- the trainer's side ------------------------------------------------------------------


class Trainer:
    """What a trainer holds for a delta call: a transport and host memory registered with
    it, handed out in 8-byte aligned pieces (payloads, reply slots, copies read back)."""

    def __init__(self, num_bytes: int) -> None:
        self.transport = MooncakeTransport(MooncakeConfig(timeout_s=10.0))
        self.memory = torch.zeros(num_bytes, dtype=torch.uint8)
        self.transport.register(self.memory.data_ptr(), num_bytes)
        self._used = 0

    def take(self, num_bytes: int) -> tuple[int, torch.Tensor]:
        """A zeroed piece of the memory: its address and its bytes."""
        offset = self._used
        self._used = (offset + num_bytes + 7) // 8 * 8
        assert self._used <= self.memory.numel(), "the test's trainer memory is too small"
        piece = self.memory[offset : offset + num_bytes]
        piece.zero_()
        return self.memory.data_ptr() + offset, piece

    def put(self, payload: torch.Tensor) -> Remote:
        """`payload` placed in registered memory, where a rank can read it."""
        addr, piece = self.take(payload.numel())
        piece.copy_(payload)
        return Remote(session_id=self.transport.session_id, addr=addr, num_bytes=payload.numel())

    def slot(self, num_params: int) -> Remote:
        """A zeroed reply slot for a rank of `num_params` parameters."""
        addr, _ = self.take(reply_bytes(num_params))
        return Remote(
            session_id=self.transport.session_id, addr=addr, num_bytes=reply_bytes(num_params)
        )

    def reply(self, descriptor: DeltaDescriptor, names: Sequence[str]) -> DeltaReply:
        """The reply the rank wrote into the descriptor's slot."""
        offset = descriptor.reply.addr - self.memory.data_ptr()
        raw = bytes(self.memory[offset : offset + descriptor.reply.num_bytes].numpy())
        return DeltaReply.decode(raw, call_id=descriptor.call_id, names=names)

    def reset(self) -> None:
        """Hand the memory out again from its start."""
        self._used = 0

    def close(self) -> None:
        self.transport.close()


def sections_between(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> dict[str, Section]:
    """One sparse section per parameter whose bits differ, numbered by sorted names."""
    order = {name: index for index, name in enumerate(sorted(old))}
    out = {}
    for name in sorted(new):
        before, after = as_bits(old[name]), as_bits(new[name])
        elements = (before != after).nonzero().flatten()
        if elements.numel():
            out[name] = Section(param_index=order[name], elements=elements, values=after[elements])
    return out


def descriptor_for(
    trainer: Trainer,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    call_id: int,
    num_payloads: int = 2,
    finish: bool = True,
) -> tuple[DeltaDescriptor, int]:
    """The descriptor of the delta from `old` to `new` (every parameter of the rank), split
    over `num_payloads` payloads as that many trainer ranks would send it; and the number
    of elements it changes."""
    sections = sections_between(old, new)
    names = list(sections)
    shares = [names[i::num_payloads] for i in range(num_payloads)]
    payloads = tuple(
        trainer.put(encode_payload([sections[n] for n in share], "cpu"))
        for share in shares
        if share
    )
    base = checksums({name: old[name] for name in names})
    expected = checksums({name: new[name] for name in names})
    for name, section in sections.items():
        # The sender's way: base + the change of exactly the elements it writes, wrapping.
        change = checksum_change(
            section.elements,
            as_bits(old[name])[section.elements],
            section.values,
            numel=old[name].numel(),
        )
        assert _wrap(base[name] + int(change)) == expected[name], name
    descriptor = DeltaDescriptor(
        call_id=call_id,
        rank=0,
        protocol="tcp",
        payloads=payloads,
        base=base,
        expected=expected,
        reply=trainer.slot(len(old)),
        finish=finish,
        timeout_s=10.0,
    )
    return descriptor, sum(s.values.numel() for s in sections.values())


def _wrap(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _call(model: torch.nn.Module, descriptor: DeltaDescriptor) -> None:
    """Call the loader as SGLang does: with the rank's entry of `request_body`, unpickled."""
    body = request_body([descriptor])
    named_tensors = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
    apply_delta(model, named_tensors)


# --- the descriptor and the reply ----------------------------------------------------------


def _descriptor(**overrides) -> DeltaDescriptor:
    fields = {
        "call_id": 41,
        "rank": 0,
        "protocol": "tcp",
        "payloads": (Remote(session_id=TRAINER_SESSION, addr=0x7F00_0000_0000, num_bytes=4096),),
        "base": {"model.norm.weight": -5, "lm_head.weight": 1 << 62},
        "expected": {"model.norm.weight": 7},
        "reply": Remote(session_id=TRAINER_SESSION, addr=0x7F00_0000_2000, num_bytes=1024),
        "finish": True,
        "timeout_s": 12.5,
    }
    fields.update(overrides)
    return DeltaDescriptor(**fields)


class _SGLangAllowList(pickle.Unpickler):
    """Loads what SGLang 0.5.23's SafeUnpickler loads of a tensor pickled the plain way, and
    records every global the stream names; a shared-memory handle is refused."""

    ALLOWED = frozenset(
        {
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch.storage", "_load_from_bytes"),
            ("collections", "OrderedDict"),
            ("torch", "uint8"),
        }
    )

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.seen.add((module, name))
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} would not cross hosts or SGLang")
        return super().find_class(module, name)


def test_a_descriptor_crosses_hosts_as_a_plain_pickle() -> None:
    descriptors = [_descriptor(), _descriptor(rank=1, payloads=())]
    body = request_body(descriptors)
    assert body["load_format"] == LOAD_FORMAT == "weightsync.integrations.sglang.apply_delta"
    assert body["flush_cache"] is False and body["selector"] == "target"
    assert body["abort_all_requests"] is False
    json.dumps(body)  # the HTTP body is JSON
    entries = body["serialized_named_tensors"]
    for rank, (entry, sent) in enumerate(zip(entries, descriptors, strict=True)):
        raw = base64.b64decode(entry)
        assert raw[0] == 0x80  # a raw pickle, as SGLang recognises one
        unpickler = _SGLangAllowList(raw)
        named_tensors = unpickler.load()
        assert not any("reductions" in module for module, _ in unpickler.seen)
        assert named_tensors[0][0] == DESCRIPTOR_NAME
        assert DeltaDescriptor.from_named_tensors(named_tensors) == sent, rank


def test_a_call_lists_its_descriptors_in_rank_order() -> None:
    with pytest.raises(ValueError, match="rank order"):
        request_body([_descriptor(rank=1), _descriptor(rank=0)])
    with pytest.raises(ValueError, match="one descriptor per rank"):
        request_body([])


def _as_named(document: object, *, name: str = DESCRIPTOR_NAME) -> list:
    raw = json.dumps(document).encode() if not isinstance(document, bytes) else document
    return [(name, torch.frombuffer(bytearray(raw), dtype=torch.uint8))]


def _document(**overrides) -> dict:
    document = json.loads(bytes(_descriptor().to_tensor().numpy()))
    document.update(overrides)
    return document


@pytest.mark.parametrize(
    ("named_tensors", "match"),
    [
        (lambda: _as_named(_document(), name="model.norm.weight"), "expected one tensor named"),
        (lambda: _as_named(_document()) * 2, "expected one tensor named"),
        (lambda: [(DESCRIPTOR_NAME, torch.zeros(4))], "1-D uint8"),
        (lambda: _as_named(b"\x00not json"), "not JSON"),
        (lambda: _as_named(_document(version=2)), "descriptor version 2"),
        (lambda: _as_named({k: v for k, v in _document().items() if k != "reply"}), "reply"),
        (lambda: _as_named(_document(protocol="nvlink")), "protocol"),
        (lambda: _as_named(_document(call_id=0)), "call_id"),
        (lambda: _as_named(_document(base={})), "base must name every parameter"),
        (lambda: _as_named(_document(expected={"x": 1.5}, base={"x": 1})), "int64"),
        (
            lambda: _as_named(_document(reply={"session_id": "h:1", "addr": 8, "num_bytes": 16})),
            "at least 64 bytes",
        ),
        (
            lambda: _as_named(_document(payloads=[{"session_id": "", "addr": 8, "num_bytes": 1}])),
            "session id",
        ),
        (
            lambda: _as_named(
                _document(payloads=[{"session_id": "h:1", "addr": 8, "num_bytes": 0}])
            ),
            "num_bytes",
        ),
    ],
)
def test_a_malformed_descriptor_is_refused(named_tensors, match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        DeltaDescriptor.from_named_tensors(named_tensors())


def test_a_reply_round_trips_and_a_stale_slot_is_no_reply() -> None:
    names = ["b.weight", "a.weight", "c.bias"]
    reply = DeltaReply(
        call_id=9,
        status=ReplyStatus.FAILED,
        num_elements=12,
        checksums={"a.weight": -1, "b.weight": 1 << 62, "c.bias": 0},
        message="rank 0: 1 parameter(s) differ",
        seconds=0.25,
    )
    raw = reply.encode(reply_bytes(len(names)))
    assert len(raw) <= reply_bytes(len(names))
    assert DeltaReply.decode(raw, call_id=9, names=names) == reply
    with pytest.raises(ReplyError, match="no reply to call 10"):
        DeltaReply.decode(raw, call_id=10, names=names)
    with pytest.raises(ReplyError, match="no reply to call 9"):
        DeltaReply.decode(bytes(reply_bytes(3)), call_id=9, names=names)
    with pytest.raises(ReplyError, match="not the 3 named"):
        DeltaReply.decode(raw, call_id=9, names=["a.weight", "b.weight", "d.bias"])
    # A slot too small for the checksums still carries the verdict and what fits of why.
    small = DeltaReply.decode(reply.encode(80), call_id=9, names=names)
    assert small.status is ReplyStatus.FAILED and small.checksums == {}
    assert small.message == reply.message[:16]


# --- the loader in this process, against a trainer over Mooncake TCP ------------------------


class _Model(torch.nn.Module):
    """A rank's model: parameters in no sorted order, one past a 65,536-element block, and a
    post-load hook that counts its runs."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.z = torch.nn.Parameter(torch.randn(BLOCK_ELEMENTS + 500, generator=generator))
        self.a = torch.nn.Parameter(torch.randn(24, 16, generator=generator))
        self.m = torch.nn.Parameter(torch.randn(40, generator=generator).bfloat16())
        self.post_loads = 0

    def post_load_weights(self) -> None:
        self.post_loads += 1

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named_parameters()}


def _changed(params: Mapping[str, torch.Tensor], *, seed: int) -> dict[str, torch.Tensor]:
    """`params` with a few elements of every parameter set to new values."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in params.items():
        flat = tensor.clone().reshape(-1)
        index = torch.randperm(flat.numel(), generator=generator)[: max(2, flat.numel() // 50)]
        flat[index] += 1
        out[name] = flat.view_as(tensor)
    return out


@pytest.fixture(scope="module")
def trainer() -> Iterator[Trainer]:
    trainer = Trainer(4 << 20)
    yield trainer
    trainer.close()
    sglang_loader._WORKER.close()  # the transport the loader made in this process


@pytest.fixture
def model(trainer: Trainer) -> _Model:
    trainer.reset()
    return _Model()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def test_the_loader_applies_a_delta_bit_exactly_and_replies(trainer, model) -> None:
    old = model.snapshot()
    new = _changed(old, seed=1)
    descriptor, num_changed = descriptor_for(trainer, old, new, call_id=101)
    _call(model, descriptor)
    reply = trainer.reply(descriptor, sorted(old))
    assert reply.status is ReplyStatus.APPLIED, reply.message
    assert reply.num_elements == num_changed and "every checksum matched" in reply.message
    for name, tensor in _params(model).items():
        assert torch.equal(as_bits(tensor), as_bits(new[name])), name
    assert reply.checksums == checksums(new)
    assert model.post_loads == 1  # the session's last call ran post-load processing

    # A call without payloads reads the checksums: the base of the next delta.
    read = DeltaDescriptor(
        call_id=102, rank=0, protocol="tcp", payloads=(), reply=trainer.slot(3), timeout_s=10.0
    )
    _call(model, read)
    reply = trainer.reply(read, sorted(old))
    assert reply.status is ReplyStatus.APPLIED and reply.checksums == checksums(new)
    assert "read the checksums of 3" in reply.message and model.post_loads == 1


def _refused_untouched(trainer, model, descriptor, old, match: str) -> DeltaReply:
    _call(model, descriptor)
    reply = trainer.reply(descriptor, sorted(old))
    assert reply.status is ReplyStatus.REFUSED, reply.message
    assert match in reply.message and "nothing was written" in reply.message, reply.message
    for name, tensor in _params(model).items():
        assert torch.equal(as_bits(tensor), as_bits(old[name])), name
    assert reply.checksums == checksums(old) and model.post_loads == 0
    return reply


def test_a_wrong_base_is_refused_before_anything_is_written(trainer, model) -> None:
    old = model.snapshot()
    descriptor, _ = descriptor_for(trainer, old, _changed(old, seed=2), call_id=201)
    stale = {**descriptor.base, "z": descriptor.base["z"] + 1}
    wrong = DeltaDescriptor(**{**_fields(descriptor), "base": stale})
    _refused_untouched(trainer, model, wrong, old, "1 parameter(s) differ (z)")


def _fields(descriptor: DeltaDescriptor) -> dict:
    return {name: getattr(descriptor, name) for name in DeltaDescriptor.__slots__}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("unknown parameter", "does not have (lm_head.weight)"),
        ("not a payload", "payload 0 was refused (not a weightsync delta payload"),
        ("unreadable payload", "could not be read"),
        ("another rank", "rank 1 got the descriptor of rank 0"),
    ],
)
def test_a_call_that_does_not_fit_writes_nothing(
    trainer, model, monkeypatch, change: str, match: str
) -> None:
    old = model.snapshot()
    descriptor, _ = descriptor_for(trainer, old, _changed(old, seed=3), call_id=301)
    fields = _fields(descriptor)
    if change == "unknown parameter":
        fields["base"] = {**descriptor.base, "lm_head.weight": 0}
    elif change == "not a payload":
        first = descriptor.payloads[0]
        fields["payloads"] = (trainer.put(torch.full((first.num_bytes,), 7, dtype=torch.uint8)),)
    elif change == "unreadable payload":
        first = descriptor.payloads[0]  # a session nobody listens on
        fields["payloads"] = (Remote(session_id="127.0.0.1:1", addr=first.addr, num_bytes=64),)
    else:
        monkeypatch.setattr(sglang_loader, "_tp_rank", lambda: 1)
    _refused_untouched(trainer, model, DeltaDescriptor(**fields), old, match)


def test_a_later_payload_refused_leaves_the_rank_incomplete(trainer, model) -> None:
    old = model.snapshot()
    descriptor, _ = descriptor_for(trainer, old, _changed(old, seed=4), call_id=401)
    junk = trainer.put(torch.zeros(128, dtype=torch.uint8))
    broken = DeltaDescriptor(**{**_fields(descriptor), "payloads": (*descriptor.payloads, junk)})
    _call(model, broken)
    reply = trainer.reply(broken, sorted(old))
    assert reply.status is ReplyStatus.FAILED and not reply.verified
    assert "payload 2 of 3 was refused" in reply.message and "write it full" in reply.message
    assert reply.checksums == checksums(_params(model)) and model.post_loads == 0


def test_a_wrong_change_fails_the_after_check(trainer, model) -> None:
    old = model.snapshot()
    descriptor, _ = descriptor_for(trainer, old, _changed(old, seed=5), call_id=501)
    expected = {**descriptor.expected, "a": descriptor.expected["a"] ^ 1}
    wrong = DeltaDescriptor(**{**_fields(descriptor), "expected": expected})
    _call(model, wrong)
    reply = trainer.reply(wrong, sorted(old))
    assert reply.status is ReplyStatus.FAILED
    assert "1 parameter(s) differ from the trainers' checksums after applying (a)" in reply.message
    assert model.post_loads == 0


def test_an_unreadable_call_never_raises(model, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="weightsync.integrations.sglang"):
        apply_delta(model, [("model.norm.weight", torch.zeros(3))])
    assert "unreadable call, no reply sent" in caplog.text


def test_the_loader_imports_light() -> None:
    """What SGLang's worker loads with the loader: torch, delta_codec and the Mooncake
    transport; no web framework, no trainer-side code."""
    code = (
        "import sys, json, weightsync.integrations.sglang as m; m.apply_delta; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    heavy = {"fastapi", "starlette", "uvicorn", "aiohttp", "httpx", "pydantic", "transformers"}
    heavy |= {"typer", "rich", "safetensors"}
    assert not heavy & loaded, heavy & loaded
    ours = {m.split(".")[1] for m in loaded if m.startswith("weightsync.")}
    allowed = {"errors", "delta_codec", "delta_kernels", "delta_wire", "transport", "integrations"}
    assert ours <= allowed, ours


# --- real SGLang 0.5.23 on this CPU ---------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_venv() -> Path:
    from sglang_cpu.launch import venv_if_built

    venv = venv_if_built()
    if venv is None:
        pytest.skip("real SGLang's venv is not built here: run scripts/setup --tests")
    return venv


@pytest.mark.slow
@pytest.mark.sglang
def test_weightsync_installs_beside_sglangs_requirements(sglang_venv, tmp_path) -> None:
    """``pip install weightsync`` into an environment that holds SGLang's pinned set (a
    venv that sees the SGLang venv's packages, so that the cached venv stays as built),
    constrained to those pins: it adds only itself and what SGLang's set lacks, and
    ``pip check`` finds no requirement broken that was not broken before, none of
    weightsync's. (SGLang's own CUDA-only requirements are missing from the CPU set by
    design; tests/sglang_cpu/requirements.txt.)"""
    overlay = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(overlay)], check=True)
    python = str(overlay / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    sglang_site = next((sglang_venv / "lib").glob("python3.*/site-packages"))
    Path(site, "sglang-venv.pth").write_text(f"{sglang_site}\n")
    pip = [sys.executable, "-m", "pip", "--python", python]  # this pip, run for the overlay

    def pip_check() -> set[str]:
        done = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=120)
        return set(done.stdout.splitlines())

    before = pip_check()
    assert any(line.startswith("sglang 0.5.23 requires") for line in before)  # it sees SGLang
    pins = tmp_path / "pins.txt"
    requirements = (ROOT / "tests" / "sglang_cpu" / "requirements.txt").read_text()
    pins.write_text("\n".join(r for r in requirements.splitlines() if "==" in r) + "\n")
    done = subprocess.run(
        [*pip, "install", "-q", "--no-compile", "-c", str(pins), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    after = pip_check()
    assert after <= before, after - before
    assert not any("weightsync" in line for line in after), after
    added = {p.name.split("-")[0].lower() for p in Path(site).glob("*.dist-info")}
    # setuptools: torch 2.13's own requirement, which SGLang's venv leaves unmet.
    assert added <= {"weightsync", "httptools", "setuptools"}, added


@pytest.mark.sglang
def test_weightsync_admits_every_version_sglang_pins(sglang_venv) -> None:
    """Each of weightsync's requirements admits the exact version SGLang 0.5.23's metadata
    pins for the same package (the CPU venv runs torch 2.13, which hides this)."""
    from packaging.requirements import Requirement

    metadata = next((sglang_venv / "lib").glob("python3.*/site-packages/sglang-*.dist-info"))
    pinned = {}
    for line in (metadata / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            exact = [s.version for s in requirement.specifier if s.operator == "=="]
            if exact and requirement.marker is None:
                pinned[requirement.name.lower()] = exact[0]
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    excluded = []
    for line in ours:
        requirement = Requirement(line)
        version = pinned.get(requirement.name.lower())
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            excluded.append(f"{requirement} excludes SGLang's {requirement.name}=={version}")
    assert not excluded, excluded


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint in bf16."""
    from weightsync.testing.presets import preset_config, write_random_checkpoint

    return write_random_checkpoint(
        tmp_path_factory.mktemp("sglang-delta-qwen3"),
        preset_config("tiny"),
        dtype=torch.bfloat16,
        seed=23,
    )


@pytest.fixture(scope="module")
def replica(sglang_venv, bf16_checkpoint, tmp_path_factory) -> Iterator:
    """Real SGLang, tp 1, float32 weights loaded from a bf16 checkpoint (so they are bf16
    values, as a bf16 trainer's), started with the delta loader on its PYTHONPATH."""
    from sglang_cpu.launch import STUBS_DIR, start_sglang

    checkpoint = bf16_checkpoint
    server = start_sglang(
        sglang_venv,
        checkpoint,
        api_key=SGLANG_API_KEY,
        log_path=tmp_path_factory.mktemp("sglang-delta-log") / "sglang.log",
        # Sleeping when idle: the session's other SGLang servers spin on this machine's cores.
        extra_args=["--custom-weight-loader", LOAD_FORMAT, "--sleep-on-idle"],
        extra_env={"PYTHONPATH": os.pathsep.join([str(STUBS_DIR), str(ROOT / "src")])},
    )
    try:
        yield server
    finally:
        server.stop()


class Rank:
    """Rank 0 of the replica as the trainer sees it: its transfer engine and the parameters
    it published, read and written over Mooncake."""

    def __init__(self, server, trainer: Trainer) -> None:
        reply = server.get("/remote_instance_transfer_engine_info?rank=0")
        assert reply.status == 200, reply
        self.session_id, info = reply.body["remote_instance_transfer_engine_info"]
        self.info = {name: tuple(v) for name, v in info.items()}
        self.names = sorted(self.info)
        self.trainer = trainer

    def read(self) -> dict[str, torch.Tensor]:
        """Every parameter's bytes as the rank holds them (float32, flat)."""
        out = {}
        for name in self.names:
            ptr, numel, element_size = self.info[name]
            assert element_size == 4, (name, element_size)
            addr, piece = self.trainer.take(numel * 4)
            self.trainer.transport.read(self.session_id, addr, ptr, numel * 4)
            out[name] = piece.clone().view(torch.float32)
        return out

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write every parameter in full, one-sidedly (what a full sync does)."""
        for name in self.names:
            ptr, numel, _ = self.info[name]
            addr, piece = self.trainer.take(numel * 4)
            piece.copy_(tensors[name].view(torch.uint8))
            handle = self.trainer.transport.write(self.session_id, [addr], [ptr], [numel * 4])
            self.trainer.transport.wait(handle, 10.0)


def _bf16_step(master: dict[str, torch.Tensor], *, seed: int, lr: float) -> None:
    """One step of sign-descent on the trainer's fp32 master weights (Adam's update size)."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in master.values():
        tensor -= lr * torch.randn(tensor.shape, generator=generator).sign()


def _served(master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the bf16 trainer serves: its master weights rounded to bf16, as float32."""
    return {name: t.to(torch.bfloat16).to(torch.float32) for name, t in master.items()}


def _ok(reply, what: str) -> None:
    assert reply.status == 200 and reply.body.get("success", True), (what, reply)


@contextlib.contextmanager
def _session(server) -> Iterator[None]:
    """A weight-update session, ended however the block ends (an open one refuses the next
    test's begin)."""
    _ok(server.post("/begin_weight_update", {"selector": "target"}), "begin")
    try:
        yield
    finally:
        _ok(server.post("/end_weight_update", {}), "end")


@pytest.fixture(scope="module")
def sglang_trainer() -> Iterator[Trainer]:
    trainer = Trainer(32 << 20)
    yield trainer
    trainer.close()


@pytest.mark.slow
@pytest.mark.sglang
def test_real_sglang_applies_bf16_deltas_bit_exactly(replica, sglang_trainer) -> None:
    trainer = sglang_trainer
    rank = Rank(replica, trainer)
    assert LOAD_FORMAT in replica.get("/server_info").body["custom_weight_loader"]
    served = rank.read()
    assert all(torch.equal(t, t.bfloat16().float()) for t in served.values())  # bf16 values
    master = {name: t.clone() for name, t in served.items()}
    num_elements = sum(t.numel() for t in served.values())
    base: dict[str, int] | None = None
    seen = []
    for step in range(1, 4):
        trainer.reset()
        _bf16_step(master, seed=step, lr=3e-6)
        new = _served(master)
        with _session(replica):
            # The base proof at begin: a call without payloads reads every checksum.
            read = DeltaDescriptor(
                call_id=1000 + step,
                rank=0,
                protocol="tcp",
                payloads=(),
                reply=trainer.slot(len(rank.names)),
                timeout_s=10.0,
            )
            _ok(replica.post("/update_weights_from_tensor", request_body([read])), "checksums")
            proof = trainer.reply(read, rank.names)
            assert proof.status is ReplyStatus.APPLIED, proof.message
            assert proof.checksums == checksums(served)
            if base is not None:
                assert proof.checksums == base  # the replica holds the last verified sync

            # The oracle: SGLang's checker snapshots the same change written in full, then
            # the base goes back.
            rank.write(new)
            snapshot = {"action": "snapshot", "selector": "target"}
            _ok(replica.post("/weights_checker", snapshot), "snapshot")
            rank.write(served)

            descriptor, num_changed = descriptor_for(trainer, served, new, call_id=2000 + step)
            assert 0 < num_changed < num_elements // 4, (num_changed, num_elements)  # sparse
            started = time.perf_counter()
            answer = replica.post("/update_weights_from_tensor", request_body([descriptor]))
            seconds = time.perf_counter() - started
            assert answer.status == 200
            assert answer.body == {"success": True, "message": "Success"}
            reply = trainer.reply(descriptor, rank.names)
            assert reply.status is ReplyStatus.APPLIED, reply.message
            assert reply.num_elements == num_changed
            assert reply.checksums == checksums(new)

        check = replica.post("/weights_checker", {"action": "compare", "selector": "target"})
        assert check.status == 200 and check.body["success"], (step, check.body)
        now = rank.read()
        for name in rank.names:
            assert torch.equal(as_bits(now[name]), as_bits(new[name])), (step, name)
        served, base = new, reply.checksums
        seen.append((round(num_changed / num_elements, 4), round(seconds, 3), reply.seconds))
    print(f"delta syncs into real SGLang (density, call s, on-rank s): {seen}")


@pytest.mark.slow
@pytest.mark.sglang
def test_real_sglang_refuses_a_wrong_base_and_keeps_serving(replica, sglang_trainer) -> None:
    trainer = sglang_trainer
    trainer.reset()
    rank = Rank(replica, trainer)
    served = rank.read()
    master = {name: t.clone() for name, t in served.items()}
    _bf16_step(master, seed=99, lr=3e-6)
    descriptor, _ = descriptor_for(trainer, served, _served(master), call_id=3001)
    victim = sorted(descriptor.base)[0]
    stale = {**descriptor.base, victim: descriptor.base[victim] + 1}
    wrong = DeltaDescriptor(**{**_fields(descriptor), "base": stale})

    with _session(replica):
        answer = replica.post("/update_weights_from_tensor", request_body([wrong]))
        # SGLang answers success whatever the loader did: the verdict is in the reply slot.
        assert answer.status == 200 and answer.body["success"] is True
        reply = trainer.reply(wrong, rank.names)
        assert reply.status is ReplyStatus.REFUSED
        assert f"1 parameter(s) differ ({victim})" in reply.message
        assert "nothing was written" in reply.message
        assert reply.checksums == checksums(served)

    now = rank.read()
    assert all(torch.equal(as_bits(now[n]), as_bits(served[n])) for n in rank.names)
    tokens = replica.post(
        "/generate",
        {"input_ids": [1, 17, 42], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    )
    assert tokens.status == 200 and len(tokens.body["output_ids"]) == 2, tokens


PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))


@pytest.mark.slow
@pytest.mark.sglang
def test_trainer_sync_drives_real_sglangs_delta_loader(
    replica, bf16_checkpoint, sglang_trainer, monkeypatch
) -> None:
    """`TrainerSync(delta=True)` into real SGLang started with the loader: the first sync is
    full and checked against the trainers' checksums of every byte; the next ones are
    deltas through the loader, a fraction of the bytes; a write outside any sync makes the
    next one full (and verified) again; every parameter equals the trainer's after every sync
    and greedy generation equals the trainer's. A delta that fails its check leaves the
    replica paused; the next sync recovers it in full."""
    import asyncio

    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.layout import ParallelismConfig
    from weightsync.manager.delta_loader import LoaderCalls
    from weightsync.receiver.loader import shard_state_dict
    from weightsync.testing.reference import greedy_tokens, served_tokens

    model = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    master = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=256 << 10, timeout_s=10),
        control=ws.ControlConfig(api_key=SGLANG_API_KEY),
        delta=True,
    )
    trainer = sglang_trainer
    seen = []
    with ws.TrainerSync(config, hf_config=model.config, replicas=[replica.url]) as sync:
        for step in range(5):
            if step:
                # A bf16 trainer: fp32 master weights, served rounded to bf16 (few change).
                _bf16_step(master, seed=100 + step, lr=3e-6)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(master[name].to(torch.bfloat16).float())
            if step == 3:
                # Bytes written outside any sync: the replica no longer holds its base.
                trainer.reset()
                rank = Rank(replica, trainer)
                stray = rank.read()
                name = rank.names[0]
                stray[name].view(-1)[0] += 1.0
                rank.write(stray)
            report = sync.sync(ws.ModelExport(model))
            write = report.writes[replica.url]
            seen.append((write.mode, write.num_bytes, write.density))
            expected_mode = "full" if step in (0, 3) else "delta"
            assert write.mode == expected_mode, (step, write)
            if write.mode == "delta":
                assert write.num_bytes < write.full_bytes // 5, (step, write)
            else:
                assert write.why_full, write
            assert replica.url in report.replicas and not report.dropped, report

            trainer.reset()
            now = Rank(replica, trainer).read()
            laid_out = shard_state_dict(
                model.state_dict(),
                model.config.to_dict(),
                ParallelismConfig(tp_size=1, tp_rank=0),
                "float32",
            )
            assert set(now) <= set(laid_out), set(now) - set(laid_out)
            for name, value in now.items():
                wanted = laid_out[name].reshape(-1)
                assert torch.equal(as_bits(value), as_bits(wanted)), (step, name)
            served = asyncio.run(
                served_tokens([replica.url], PROMPTS, max_new_tokens=6, api_key=SGLANG_API_KEY)
            )
            assert served[replica.url] == greedy_tokens(model, torch.float32, PROMPTS, 6), step

        # A delta that does not verify (the trainers' expected checksum of one parameter is
        # off by one): the replica stays paused, and the error names it.
        real_call = LoaderCalls.call

        async def wrong_expected(self, client, targets, ranks, *, finish):
            ranks = {
                rank: dataclasses.replace(
                    share, expected={**share.expected, name: share.expected[name] + 1}
                )
                if share.payloads and (name := sorted(share.expected)[0])
                else share
                for rank, share in ranks.items()
            }
            return await real_call(self, client, targets, ranks, finish=finish)

        _bf16_step(master, seed=200, lr=3e-6)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(master[name].to(torch.bfloat16).float())
        monkeypatch.setattr(LoaderCalls, "call", wrong_expected)
        with pytest.raises(ws.WeightSyncError, match="differ from the trainers' checksums") as bad:
            sync.sync(ws.ModelExport(model), version="broken")
        monkeypatch.setattr(LoaderCalls, "call", real_call)
        notes = " ".join(getattr(bad.value, "__notes__", []))
        assert "stay paused" in notes and replica.url in notes, notes
        assert replica.get("/ready").status == 503  # paused: no request starts

        # The next sync writes it in full, checks every byte, and it serves again.
        report = sync.sync(ws.ModelExport(model))
        write = report.writes[replica.url]
        assert write.mode == "full" and "no verified base" in write.why_full, write
        served = asyncio.run(
            served_tokens([replica.url], PROMPTS, max_new_tokens=6, api_key=SGLANG_API_KEY)
        )
        assert served[replica.url] == greedy_tokens(model, torch.float32, PROMPTS, 6)
    print(f"TrainerSync into real SGLang's delta loader (mode, bytes, density): {seen}")


@pytest.mark.parametrize(
    ("loaders", "serves"),
    [
        ([LOAD_FORMAT], True),
        (["my.loader", LOAD_FORMAT], True),
        (LOAD_FORMAT, True),
        (["my.loader"], False),
        ([], False),
        (None, False),
        (7, False),
    ],
)
def test_a_replica_serves_delta_calls_only_with_the_loader(loaders, serves) -> None:
    from weightsync.delta_wire import serves_delta_loader

    assert serves_delta_loader({"custom_weight_loader": loaders}) is serves
    assert serves_delta_loader({}) is False
