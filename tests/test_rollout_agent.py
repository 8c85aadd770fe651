"""RolloutAgent and the weights checker, with real Mooncake engines and a real bootstrap
server (uvicorn in a thread of the test process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from servers import app_in_thread
from weightsync.control import BootstrapClient
from weightsync.errors import RemoteReplicaError, TransferError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver import RolloutAgent, UpdateSessionError, WeightsChecker, memory_regions
from weightsync.server.bootstrap import BootstrapRegistry, create_bootstrap_app
from weightsync.transport import MooncakeConfig, MooncakeTransport

PARALLELISM = ParallelismConfig(tp_size=2, tp_rank=1)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # Two parameters carved out of one flat buffer (adjacent), one on its own, one bf16.
    flat = torch.randn(48)
    return {
        "a.weight": flat[:32].view(4, 8),
        "b.weight": flat[32:].view(16),
        "c.weight": torch.randn(3, 5),
        "d.weight": torch.randn(7, dtype=torch.float32).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def transports():
    receiver = MooncakeTransport(MooncakeConfig(timeout_s=10.0))
    sender = MooncakeTransport(MooncakeConfig(timeout_s=10.0))
    yield receiver, sender
    sender.close()
    receiver.close()


def _write(sender, agent: RolloutAgent, name: str, source: torch.Tensor) -> None:
    addr, numel, element_size = agent.weights_info()[name]
    assert source.numel() * source.element_size() == numel * element_size
    sender.register(source.data_ptr(), source.nbytes)
    try:
        handle = sender.write(agent.session_id, [source.data_ptr()], [addr], [numel * element_size])
        sender.wait(handle, 10.0)
    finally:
        sender.unregister(source.data_ptr())


def test_memory_regions_merge_only_within_one_storage():
    params = _params()
    regions = memory_regions(params.values())
    flat_ptr = params["a.weight"].data_ptr()
    assert (flat_ptr, 48 * 4) in regions
    assert len(regions) == 3
    assert memory_regions([torch.empty(0)]) == []


def test_weights_info_and_writes_land_in_parameters(transports):
    receiver, sender = transports
    params = _params()
    with RolloutAgent(params=params, parallelism=PARALLELISM, transport=receiver) as agent:
        assert agent.registered_regions == 3
        info = agent.weights_info()
        assert list(info) == list(params)
        for name, tensor in params.items():
            assert info[name] == [tensor.data_ptr(), tensor.numel(), tensor.element_size()]
        assert agent.transfer_engine_info() == {
            "session_id": receiver.session_id,
            "weights_info_dict": info,
        }
        new_b = torch.arange(16, dtype=torch.float32)
        _write(sender, agent, "b.weight", new_b)
        assert torch.equal(params["b.weight"], new_b)
    # Closed: the memory is unregistered, so a write is refused.
    with pytest.raises(TransferError):
        _write(sender, agent, "c.weight", torch.zeros(3, 5))


def test_rejects_non_contiguous_or_empty_params(transports):
    receiver, _ = transports
    with pytest.raises(ValueError, match=r"'t\.weight'.*not contiguous"):
        RolloutAgent(
            params={"t.weight": torch.randn(4, 6).t()}, parallelism=PARALLELISM, transport=receiver
        )
    with pytest.raises(ValueError, match="at least one parameter"):
        RolloutAgent(params={}, parallelism=PARALLELISM, transport=receiver)


def test_update_session_and_version(transports):
    receiver, _ = transports
    ended = []
    with RolloutAgent(
        params=_params(),
        parallelism=PARALLELISM,
        transport=receiver,
        on_update_end=lambda: ended.append(True),
    ) as agent:
        assert agent.weight_version == "default"
        with pytest.raises(UpdateSessionError, match="no weight-update session is open"):
            agent.end_update()
        with pytest.raises(ValueError, match="no draft model"):
            agent.begin_update("draft")
        # A fence is an event a GPU's digest completes at; these parameters are on the CPU.
        assert not agent.can_fence
        with pytest.raises(ValueError, match="tp rank 1 cannot fence"):
            agent.begin_update("target", fence=True)
        assert not agent.session_open
        agent.begin_update("target")
        assert agent.session_open
        with pytest.raises(UpdateSessionError, match="already open on tp rank 1"):
            agent.begin_update("all")
        agent.set_weight_version("3")
        agent.end_update()
        assert ended == [True]
        assert not agent.session_open
        assert agent.weight_version == "3"


def test_an_end_checks_the_trainers_digests_given_or_prepared(transports):
    receiver, _ = transports
    params = _params()
    with RolloutAgent(params=params, parallelism=PARALLELISM, transport=receiver) as agent:
        written = {"a.weight": torch.full((4, 8), 2.0), "c.weight": torch.full((3, 5), -1.0)}

        def session(expected, *, prepare: bool):
            agent.begin_update("target")
            for name, value in written.items():
                params[name].copy_(value)
            if prepare:
                agent.prepare_end(expected)
                return agent.end_update(prepared=True)
            return agent.end_update(expected)

        session(None, prepare=False)
        truth = agent.digests()  # what every session below writes
        for prepare in (False, True):
            check = session(truth, prepare=prepare)
            assert check.verified and check.mismatched == () and check.changed == ()
            wrong = {**truth, "b.weight": truth["b.weight"] + 1}
            del wrong["d.weight"]  # a parameter with no digest does not verify either
            check = session(wrong, prepare=prepare)
            assert not check.verified
            assert check.mismatched == ("b.weight", "d.weight")
        written = {"a.weight": torch.full((4, 8), 3.0)}
        # Without digests the end says what the session changed.
        check = session(None, prepare=True)
        assert not check.verified and check.changed == ("a.weight",)
        agent.begin_update("target")
        with pytest.raises(RuntimeError, match="without prepare_end"):
            agent.end_update(prepared=True)
        assert agent.session_open
        agent.prepare_end(truth)
        # Given digests win over prepared ones; the next session prepares again.
        assert agent.end_update(agent.digests()).verified
        agent.begin_update("target")
        with pytest.raises(RuntimeError, match="without prepare_end"):
            agent.end_update(prepared=True)
        agent.end_update()
        with pytest.raises(UpdateSessionError, match="no weight-update session"):
            agent.prepare_end(truth)


def test_checker_snapshot_reset_compare():
    params = _params()
    originals = {n: t.clone() for n, t in params.items()}
    ptrs = {n: t.data_ptr() for n, t in params.items()}
    checker = WeightsChecker(params)

    missing = checker.run("compare")
    assert not missing.success and "run weights_checker snapshot first" in missing.message

    assert checker.run("snapshot").success
    assert checker.run("reset_tensors", seed=1).success
    for name, tensor in params.items():
        assert tensor.data_ptr() == ptrs[name], f"{name} was reallocated"
        assert not torch.equal(tensor, originals[name]), f"{name} was not reset"
    report = checker.run("compare")
    assert not report.success
    for name in params:
        assert name in report.message
        assert report.details["differing"][name]["num_different"] > 0
    assert "max abs error" in report.message and "mean abs error" in report.message
    # compare frees the snapshot.
    assert not checker.has_snapshot

    for name, tensor in params.items():
        tensor.copy_(originals[name])
    checker.run("snapshot")
    result = checker.run("compare")
    assert result.success, result.message
    assert result.message == "4 parameters equal the snapshot (bitwise)"


def test_checker_quant_error_and_skip_list():
    params = _params()
    checker = WeightsChecker(params)
    bf16 = params["d.weight"]

    def bump(steps: int) -> None:
        bits = bf16.view(torch.int16)
        bits[0] += steps  # `steps` units in the last place of a bf16 value

    checker.run("snapshot")
    bump(1)
    assert not checker.run("compare").success
    # As in SGLang, the flag loosens block-FP8 weights only: other parameters stay bitwise.
    checker.run("snapshot")
    bump(1)
    report = checker.run("compare", allow_quant_error=True)
    assert not report.success and "d.weight: 1/7 elements differ" in report.message

    checker.run("snapshot")
    checker.run("reset_tensors", skip_tensor_list=["a.weight", "c."])
    report = checker.run("compare", skip_tensor_list=["a.weight", "c."])
    assert set(report.details["differing"]) == {"b.weight", "d.weight"}
    with pytest.raises(ValueError, match="match no parameter"):
        checker.run("snapshot", skip_tensor_list=["nope"])
    with pytest.raises(ValueError, match="unknown weights_checker action"):
        checker.run("reset")


def test_checker_checksum_follows_the_bytes():
    params = _params()
    checker = WeightsChecker(params)
    first = checker.run("checksum").details["checksums"]
    assert set(first) == set(params)
    assert first == checker.run("checksum").details["checksums"]
    params["c.weight"][0, 0] += 1.0
    second = checker.run("checksum").details["checksums"]
    assert second["c.weight"]["sha256"] != first["c.weight"]["sha256"]
    assert second["c.weight"]["sum"] == pytest.approx(first["c.weight"]["sum"] + 1.0)
    assert second["a.weight"] == first["a.weight"]


def test_publish_to_bootstrap_server(transports):
    receiver, _ = transports
    registry = BootstrapRegistry()
    with (
        app_in_thread(create_bootstrap_app(registry, api_key="k")) as url,
        RolloutAgent(params=_params(), parallelism=PARALLELISM, transport=receiver) as agent,
    ):
        with pytest.raises(RemoteReplicaError) as refused:
            agent.publish(url)
        assert refused.value.status_code == 401
        assert refused.value.route == "/register_transfer_engine_info"
        agent.publish(url, api_key="k")

        async def read() -> tuple:
            async with BootstrapClient(url, api_key="k") as client:
                return (
                    await client.get_transfer_engine_info(1),
                    await client.get_parallelism_config(1),
                )

        (session_id, weights_info), parallelism = asyncio.run(read())
        assert session_id == agent.session_id
        assert {k: list(v) for k, v in weights_info.items()} == agent.weights_info()
        assert parallelism == PARALLELISM


def test_checker_compares_block_fp8_weights_dequantised_as_sglang_does():
    """A block-FP8 weight and its scale are one pair compared in dequantised bf16: other
    bytes with the same values pass; one e4m3 step passes only with allow_quant_error; the
    scale is compared through its weight; raw parameters stay bitwise."""
    codes = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) % 57 - 28) / 4
    params = {
        "w.weight": codes.to(torch.float8_e4m3fn),
        "w.weight_scale_inv": torch.tensor([[0.5], [0.25]]),
        "n.weight": torch.ones(8, dtype=torch.bfloat16),
    }
    checker = WeightsChecker(params)
    checker.run("snapshot")
    # The same values in other bytes: codes doubled, scales halved.
    params["w.weight"].copy_((codes * 2).to(torch.float8_e4m3fn))
    params["w.weight_scale_inv"].mul_(0.5)
    report = checker.run("compare")
    assert report.success, report.message
    assert "block-FP8 weights dequantised" in report.message

    checker.run("snapshot")
    bits = params["w.weight"].view(torch.uint8)
    bits[3, 5] += 1  # one e4m3 step
    assert not checker.run("compare").success
    checker.run("snapshot")
    bits[3, 5] += 1
    assert checker.run("compare", allow_quant_error=True).success
    checker.run("snapshot")
    bits[3, 5] += 3  # three steps: beyond one of each side
    report = checker.run("compare", allow_quant_error=True)
    assert not report.success and "w.weight (FP8 with its weight_scale_inv" in report.message

    checker.run("snapshot")
    params["w.weight_scale_inv"][1, 0] *= 1.5  # a stale scale shows in its weight
    report = checker.run("compare", allow_quant_error=True)
    assert set(report.details["differing"]) == {
        "w.weight (FP8 with its weight_scale_inv, dequantised)"
    }
