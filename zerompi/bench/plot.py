"""``zerompi.bench --plot PNG``: bus bandwidth against size, one panel per collective, one line
per implementation, the copy bandwidth of the same buffers (the ceiling) dashed.

matplotlib (the ``plot`` extra) is imported only when a figure is made.
"""
import importlib.util
import os
from typing import List, Optional

from ..checkpoint.outputs import check_file, check_image, write_atomic
from ..errors import check

OPS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_allv")


def busbw_figure(records: List[dict]):
    """A matplotlib Figure from the benchmark's records (its --json list): per op an axes titled
    with the op, x the buffer's bytes (log 2), y busbw in GB/s; a line per implementation
    (labelled with it) and the copy ceiling (labelled "copy ceiling", dashed)."""
    from matplotlib.figure import Figure
    ops = [op for op in OPS if any(r["op"] == op for r in records)]
    fig = Figure(figsize=(5 * len(ops), 4), layout="constrained")
    axes = fig.subplots(1, len(ops), squeeze=False)[0]
    ranks = records[0]["ranks"] if records else "?"
    for ax, op in zip(axes, ops):
        mine = [r for r in records if r["op"] == op]
        for impl, counts in dict.fromkeys((r["impl"], r.get("counts")) for r in mine):   # --ep: a line per pattern
            rows = sorted((r["bytes"], r["busbw"]) for r in mine if (r["impl"], r.get("counts")) == (impl, counts))
            ax.plot([b for b, _ in rows], [bw for _, bw in rows], marker="o",
                    label=impl if counts is None else f"{impl} ({counts})")
        copy = sorted({r["bytes"]: r["copy_GBps"] for r in mine}.items())
        ax.plot([b for b, _ in copy], [c for _, c in copy], linestyle="--", color="gray", label="copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("buffer size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"zerompi.bench: {ranks} ranks, {records[0]['dtype'] if records else ''}")
    return fig


def check_plot(path: Optional[str]) -> None:
    """ConfigError unless ``path`` (None passes) can take the image, in a format matplotlib writes,
    and matplotlib is there (that it is not the --json file: bench/run.py's check_roles)."""
    if path is None:
        return
    check_file(path, "plot")
    check(importlib.util.find_spec("matplotlib") is not None,
          f"plot={path!r} needs matplotlib; pip install 'zerompi[plot]' (or leave --plot out)")
    check_image(path, "plot")


def save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path`` atomically, in the format its suffix names (png when none)."""
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=120))


def save_plot(records: List[dict], path: str) -> Optional[str]:
    """Draw :func:`busbw_figure` into ``path``: None, or the one line that says why it could not be."""
    try:
        save_figure(busbw_figure(records), path)
    except (OSError, ValueError) as e:      # a full disk; a suffix matplotlib has no writer for
        return f"cannot write plot={path!r} ({getattr(e, 'strerror', None) or e})"
    return None
