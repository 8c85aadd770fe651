"""Draw the guide's benchmark plots (SVG, no plotting library) from the measured numbers.

``python docs/plots.py`` rewrites ``docs/img/*.svg`` from ``docs/data/*.json``; a test
checks that the committed plots are what the data draws.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

DOCS = Path(__file__).resolve().parent
_BAR_H, _GAP, _LEFT, _WIDTH = 18, 14, 230, 640
_COLORS = {"p2p": "#2b7bb9", "broadcast": "#c8c8c8"}
_LABELS = {"p2p": "weightsync P2P", "broadcast": "broadcast baseline"}


def sync_time_svg(data: dict) -> str:
    """Horizontal bars: each workload's sync time, P2P beside the broadcast baseline."""
    rows = data["rows"]
    longest = max(max(row["p2p"], row["broadcast"]) for row in rows)
    scale = (_WIDTH - _LEFT - 90) / longest
    group_h = 2 * _BAR_H + _GAP
    height = 40 + len(rows) * group_h + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">Sync time ({escape(data["unit"])}), lower is '
        "better</text>",
    ]
    for index, row in enumerate(rows):
        top = 36 + index * group_h
        parts.append(f'<text x="10" y="{top + _BAR_H + 4}">{escape(row["workload"])}</text>')
        for offset, key in enumerate(("p2p", "broadcast")):
            y = top + offset * _BAR_H
            width = row[key] * scale
            parts.append(
                f'<rect x="{_LEFT}" y="{y}" width="{width:.1f}" height="{_BAR_H - 2}" '
                f'fill="{_COLORS[key]}"/>'
            )
            label = f"{row[key]:.3f} s"
            if key == "broadcast":
                # The ratio of the unrounded times, as the benchmark printed it.
                label += f" ({row['speedup']:.2f}x P2P speedup)"
            parts.append(f'<text x="{_LEFT + width + 6:.1f}" y="{y + 12}">{label}</text>')
    legend_y = height - 14
    for offset, key in enumerate(("p2p", "broadcast")):
        x = _LEFT + offset * 170
        parts.append(
            f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{_COLORS[key]}"/>'
        )
        parts.append(f'<text x="{x + 18}" y="{legend_y}">{_LABELS[key]}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


PLOTS = {"img/gpu_sync.svg": ("data/gpu_sync.json", sync_time_svg)}


def render() -> dict[str, str]:
    """``{path relative to docs/: SVG text}`` of every plot."""
    return {out: draw(json.loads((DOCS / data).read_text())) for out, (data, draw) in PLOTS.items()}


if __name__ == "__main__":
    for out, text in render().items():
        (DOCS / out).write_text(text)
        print(f"wrote docs/{out}")
