"""Drawing a trace as a timeline (matplotlib, imported only when a picture is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torchgpipe.trace import Trace

__all__ = ["default_title", "draw_timeline"]


class _Style(NamedTuple):
    alpha: float
    hatch: str | None
    height: float


# Forward solid, recomputation hatched, backward lighter, copies thin (a fraction of a row).
_STYLE = {
    "forward": _Style(1.0, None, 0.8),
    "recompute": _Style(0.55, "///", 0.8),
    "backward": _Style(0.45, None, 0.8),
    "weight": _Style(0.3, "..", 0.8),
    "copy": _Style(1.0, None, 0.2),
}


def draw_timeline(trace: Trace, path: Path, *, title: str | None = None) -> None:
    """Partitions as rows, time across, each micro-batch in a colour of its own."""
    try:
        # A figure of its own on an Agg canvas, not pyplot's: the process's backend and
        # pyplot's current figures stay as the caller had them.
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("drawing a timeline needs matplotlib: pip install matplotlib") from error

    begin = min(e.start for e in trace.events)
    span_ms = (max(e.end for e in trace.events) - begin) * 1e3
    # Ten distinct hues: tab20 pairs a dark and a light shade of each, and a light
    # forward beside the lighter (backward) dark one of the micro-batch before looked alike.
    colours = colormaps["tab10"]
    figure = Figure(figsize=(12, 1 + 0.6 * trace.n))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for kind, style in _STYLE.items():  # one call per kind: one per event took seconds
        events = [e for e in trace.events if e.kind == kind]
        if not events:
            continue
        lefts = [(e.start - begin) * 1e3 for e in events]
        widths = [e.duration * 1e3 for e in events]
        axes.barh(
            [e.j for e in events],
            widths,
            left=lefts,
            height=style.height,
            color=[colours(e.i % 10) for e in events],
            alpha=style.alpha,
            hatch=style.hatch,
            edgecolor="black",
            linewidth=0.3,
        )
        for e, left, width in zip(events, lefts, widths, strict=True):
            if kind != "copy" and width > span_ms / 60:
                axes.text(left + width / 2, e.j, f"{kind[0].upper()}{e.i}", ha="center",
                          va="center", fontsize=7)  # fmt: skip
    axes.set_yticks(range(trace.n), [f"partition {j}" for j in range(trace.n)])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_title(title or default_title(trace))
    # Right of the plot, not in it: inside, it would cover the last spans of a row.
    axes.legend(
        handles=[
            Patch(facecolor="grey", alpha=style.alpha, hatch=style.hatch, label=kind)
            for kind, style in _STYLE.items()
        ],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        borderaxespad=0.0,
        fontsize=7,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def default_title(trace: Trace) -> str:
    """The picture's title: the partitions, their ranks, the bubble and GPipe's ideal."""
    summary = trace.summary()
    # As the summary counts them: ranks hold v partitions each, traced here or not.
    traced = sorted(j for group in summary.ranks for j in group)
    v = summary.per_rank
    ranks = f" on {trace.n / v:g} ranks" if v > 1 else ""
    if len(traced) < trace.n:
        ranks += f" (traced here: partitions {traced})"
    return (
        f"timeline: n = {trace.n}{ranks}, m = {summary.m}, bubble {summary.bubble:.0%} "
        f"(ideal {summary.ideal_bubble:.0%})"
    )
