"""A PNG timeline of a predicted sync: one row per receiving port, one bar per transfer.

Needs matplotlib, the optional extra ``plot`` (``pip install 'weightsync[plot]'``).
"""

from __future__ import annotations

from pathlib import Path

from weightsync.predict import SyncPrediction


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def write_timeline(prediction: SyncPrediction, path: Path, *, title: str) -> None:
    """Draw the network schedule's and the round robin's transfers per rollout GPU to `path`.

    Raises:
        PlotUnavailableError: matplotlib is missing; the message says how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'weightsync[plot]'"
        ) from exc
    results = (("network schedule", prediction.result), ("round robin", prediction.round_robin))
    num_targets = prediction.schedule.num_targets
    figure, axes = plt.subplots(
        len(results), 1, figsize=(12, 2 + 0.05 * num_targets * len(results)), squeeze=False
    )
    colors = plt.get_cmap("tab10")
    for axis, (name, result) in zip(axes[:, 0], results, strict=True):
        bars: dict[int, tuple[list, list]] = {}
        for entry in result.timeline:
            spans, faces = bars.setdefault(entry.target, ([], []))
            spans.append((entry.data_start_s, entry.end_s - entry.data_start_s))
            faces.append(colors(entry.window % 10))
        # One call per row: a call per transfer takes minutes at tens of thousands.
        for target, (spans, faces) in sorted(bars.items()):
            axis.broken_barh(spans, (target - 0.4, 0.8), facecolors=faces, linewidth=0)
        axis.set_title(f"{name}: {result.makespan_s:.3f} s")
        axis.set_ylabel("rollout GPU")
        axis.set_ylim(-1, num_targets)
        axis.axvline(prediction.lower_bound_s, color="black", linestyle="--", linewidth=0.8)
    axes[-1, 0].set_xlabel("seconds (colour: layer window; dashed: lower bound)")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
