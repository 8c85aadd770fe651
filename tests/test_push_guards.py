"""Guards on what a push costs, per transport: deterministic, no timing.

For fixed presets and layouts (`push_guards`), the programs a sender lowers are compared with
the expected writes per target, bytes direct and staged and copies per byte, and with the
cost model's two extremes (stage everything, write everything direct), so that a change that
multiplies the writes of a network push fails here, on shapes whose rows are long enough to
be written directly. Forcing direct writes over a network transport is shown to fail them.
"""

from __future__ import annotations

import pytest

from push_guards import EXPECTED, LAYOUTS, PRESETS, TRANSPORTS, problems
from weightsync.plan.direct import DirectSpec


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_the_default_push_has_the_expected_shape_per_transport(preset, layout, transport):
    assert (preset, layout, transport) in EXPECTED
    assert problems(preset, layout, transport) == []


@pytest.mark.parametrize(
    ("preset", "transport"),
    [("dense-1g", "mooncake-tcp"), ("dense-1g", "mooncake-rdma"), ("moe-small", "mooncake-tcp")],
)
def test_forcing_direct_writes_over_a_network_fails_the_guards(preset, transport):
    found = problems(preset, "2 replicas x tp2, 2 ranks", transport, direct="always")
    text = "\n".join(found)
    # Every row of a row-parallel slice becomes a write: hundreds of times the writes.
    assert "max writes per target" in text and "modelled fixed costs" in text, text


def test_staging_everything_over_a_network_fails_the_guards_too():
    # Copies per byte go up where whole tensors could have been written from the trainer.
    found = problems("dense-1g", "1 replica x tp1, 1 rank", "mooncake-tcp", direct="never")
    assert any("copies per byte" in line for line in found), found


@pytest.mark.parametrize(
    ("spec", "num_writes", "num_bytes", "continues", "direct"),
    [
        # 1 us a write, 1 GB/s into the ring: a KB of copy costs what a write does.
        (dict(write_s=1e-6, stage_bytes_per_s=1e9), 1, 64, False, True),  # one write either way
        (dict(write_s=1e-6, stage_bytes_per_s=1e9), 1, 64, True, False),  # staged joins a run
        (dict(write_s=1e-6, stage_bytes_per_s=1e9), 1, 2000, True, True),  # copy > a write
        (dict(write_s=1e-6, stage_bytes_per_s=1e9), 8, 8 * 500, False, False),  # short rows
        (dict(write_s=1e-6, stage_bytes_per_s=1e9), 8, 8 * 2000, False, True),  # long rows
        (dict(write_s=0.0, stage_bytes_per_s=1e12), 1000, 1000, True, True),  # free writes
        (dict(policy="always", write_s=1.0), 10**6, 1, True, True),
        (dict(policy="never"), 1, 1 << 30, False, False),
    ],
)
def test_a_piece_goes_direct_where_its_writes_cost_less_than_staging_it(
    spec, num_writes, num_bytes, continues, direct
):
    assert (
        DirectSpec(devices=("cpu",), **spec).pays(num_writes, num_bytes, continues=continues)
        is direct
    )


def test_a_pitched_copy_is_one_write_for_evenly_spaced_rows_only():
    pitched = DirectSpec(devices=("cuda:0",), pitched=True)
    assert pitched.writes_of(num_runs=512, num_outer_dims=1) == 1
    assert pitched.writes_of(num_runs=512, num_outer_dims=2) == 512
    assert DirectSpec(devices=("cpu",)).writes_of(num_runs=512, num_outer_dims=1) == 512


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(policy="sometimes"), "policy must be one of"),
        (dict(write_s=-1.0), "write_s must be >= 0"),
        (dict(stage_bytes_per_s=0.0), "stage_bytes_per_s must be > 0"),
    ],
)
def test_a_direct_spec_refuses_what_it_cannot_weigh(fields, message):
    with pytest.raises(ValueError, match=message):
        DirectSpec(**fields)
