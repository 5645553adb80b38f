"""One figure of one or more train runs, from their ``--metrics-json`` files.

Four panels (axes, titled):

  loss          the training loss against the step, the held-out loss as markers and the
                entropy floor as a dashed line (GPT)
  throughput    tokens/s of each step (GPT; the MLP: rows/s), from the step's wall time
  step time     the breakdown of each step, stacked: forward / backward / optimizer /
                waiting / other (ms); several runs (or a metrics file without
                ``step_breakdown_s``): one stacked bar per run, of the medians
  memory        model-state bytes per rank, measured beside the formula (on the padded
                layout, which the measurement must equal), as bars

Several files overlay, each labelled by what sets it apart (stage, dtype, ranks, quantized
communication, model; the file's name when that is not enough).
"""
import importlib.util
import json
import os
import statistics
import sys
from typing import List, Optional

from ..checkpoint.outputs import check_file, check_image, check_roles, write_atomic
from ..errors import ConfigError, OneLineParser, check
from ..inputs import JSON_BYTES, read_bytes

REQUIRED = ("model", "stage", "dtype", "world_size", "losses", "first_step", "step_times_s", "memory_bytes",
            "theory_bytes_padded", "config")
PARTS = (("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer"), ("comm_wait", "waiting"),
         ("other", "other"))                        # (key of time_breakdown_s, label)
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:gray")
MEMORY = ("params", "grads", "optimizer", "secondary", "total")
TITLES = ("loss", "throughput", "step time", "memory per rank")
PROG = "zerompi.plot"


def load_run(path: str) -> dict:
    """A --metrics-json file's object; ConfigError (one line naming the file) when it is not one."""
    try:
        run = json.loads(read_bytes(path, path, JSON_BYTES).decode("utf-8"))
    except ConfigError:                             # not a regular file, or too large: its own line
        raise
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not JSON ({e}); give a file zerompi.train --metrics-json wrote")
    if isinstance(run, list):
        raise ConfigError(f"{path}: a JSON list (zerompi.bench --json records?), not a run's metrics; give a file "
                          "zerompi.train --metrics-json wrote (zerompi.bench draws its own with --plot PNG)")
    check(isinstance(run, dict), f"{path}: a JSON {type(run).__name__}, not a run's metrics; give a file "
                                 "zerompi.train --metrics-json wrote")
    missing = [k for k in REQUIRED if k not in run]
    check(not missing, f"{path}: not a zerompi.train --metrics-json file (no {', '.join(missing)})")
    n = len(run["losses"])
    check(isinstance(run["losses"], list) and n > 0 and isinstance(run["step_times_s"], list)
          and len(run["step_times_s"]) == n and all(isinstance(v, (int, float)) for v in run["losses"]),
          f"{path}: losses and step_times_s must be lists of numbers of one length (a --metrics-json file)")
    return run


def labels(runs: List[dict], paths: List[str]) -> List[str]:
    """What sets each run apart from the others (all of it for one run); the file name when that is not enough."""
    def facts(m):
        q = m.get("quantization") or {}
        return {"model": m["model"], "stage": f"stage {m['stage']}", "dtype": m["dtype"],
                "ranks": f"N={m['world_size']}",
                "quant": ", ".join(f"{k} {v}" for k, v in (("qwZ", q.get("weights")), ("qgZ", q.get("grads"))) if v)
                or "unquantized"}
    all_facts = [facts(m) for m in runs]
    keys = [k for k in all_facts[0] if len(runs) == 1 or len({f[k] for f in all_facts}) > 1]
    out = [", ".join(f[k] for k in keys) for f in all_facts]
    if len(set(out)) < len(out) or not all(out):
        out = [f"{os.path.basename(p)}" + (f" ({o})" if o else "") for p, o in zip(paths, out)]
    return out


def figure(runs: List[dict], names: List[str]):
    """The figure (a matplotlib Figure, not drawn) of ``runs`` labelled ``names``."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(13, 9), layout="constrained")
    ax_loss, ax_tput, ax_time, ax_mem = fig.subplots(2, 2).reshape(-1)
    for ax, title in zip((ax_loss, ax_tput, ax_time, ax_mem), TITLES):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    floors = set()
    for m, name in zip(runs, names):
        steps = [m["first_step"] + i + 1 for i in range(len(m["losses"]))]     # 1-based, as the progress lines
        line, = ax_loss.plot(steps, m["losses"], label=f"{name}: train")
        if m.get("val_losses"):
            vs, vl = zip(*m["val_losses"])
            ax_loss.plot(vs, vl, "o", color=line.get_color(), label=f"{name}: held-out")
        if m.get("entropy_floor") is not None:
            floors.add(m["entropy_floor"])
        per_step = m["config"]["batch"] * (m["config"]["seq_len"] if m["model"] == "gpt" else 1)
        ax_tput.plot(steps, [per_step / t for t in m["step_times_s"]], label=name)
    for floor in sorted(floors):
        ax_loss.axhline(floor, linestyle="--", color="black", label=f"entropy floor {floor:.3f}")
    models = {m["model"] for m in runs}
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)" if models == {"gpt"} else "loss")
    ax_tput.set(xlabel="step", ylabel={frozenset({"gpt"}): "tokens/s", frozenset({"mlp"}): "rows/s"}.get(
        frozenset(models), "tokens/s (gpt), rows/s (mlp)"))
    _step_time(ax_time, runs, names)
    _memory(ax_mem, runs, names)
    for ax in (ax_loss, ax_tput, ax_time, ax_mem):
        ax.legend(fontsize="small")
    fig.suptitle("zerompi.train: " + ("; ".join(names) if len(names) == 1 else f"{len(names)} runs"))
    return fig


def _step_time(ax, runs, names) -> None:
    per_step = len(runs) == 1 and "step_breakdown_s" in runs[0]
    if per_step:                                      # one run: every step, stacked
        m = runs[0]
        parts = m["step_breakdown_s"]
        steps = [m["first_step"] + i + 1 for i in range(len(parts["forward"]))]
        ax.stackplot(steps, *[[v * 1e3 for v in parts[k]] for k, _ in PARTS], labels=[label for _, label in PARTS],
                     colors=COLORS)
        ax.set(xlabel="step", ylabel="ms per step")
        return
    for i, m in enumerate(runs):                      # several: a stacked bar of the medians per run
        bottom = 0.0
        for (key, label), color in zip(PARTS, COLORS):
            value = _median_part(m, key) * 1e3
            ax.bar(i, value, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += value
    ax.set_xticks(range(len(runs)), names, rotation=15, fontsize="small")
    ax.set(ylabel="ms per step (medians over steps)")


def _median_part(m: dict, key: str) -> float:
    if "step_breakdown_s" in m:
        return statistics.median(m["step_breakdown_s"][key])
    return m.get("time_breakdown_s", {}).get(key, 0.0)


def _memory(ax, runs, names) -> None:
    rows = [k for k in MEMORY if any(k in m["memory_bytes"] for m in runs)]
    width = 0.8 / (2 * len(runs))
    top = max(max(m["memory_bytes"].values(), default=0) for m in runs)
    unit, scale = next((u, 2 ** (10 * e)) for e, u in ((3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "bytes"))
                       if top >= 2 ** (10 * e) or e == 0)
    for i, (m, name) in enumerate(zip(runs, names)):
        at = [r - 0.4 + width * (2 * i + 0.5) for r in range(len(rows))]
        measured = [m["memory_bytes"].get(k, 0) / scale for k in rows]
        formula = [m["theory_bytes_padded"].get(k, 0) / scale for k in rows]
        bars = ax.bar(at, measured, width, label=f"{name}: measured")
        ax.bar([x + width for x in at], formula, width, color=bars.patches[0].get_facecolor(), alpha=0.45,
               hatch="//", label=f"{name}: formula")
    ax.set_xticks(range(len(rows)), rows)
    ax.set(ylabel=f"{unit} per rank")


def save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path`` atomically, in the format its suffix names (png when none)."""
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=110))


def main(argv: Optional[List[str]] = None) -> int:
    p = OneLineParser(prog=f"python -m {PROG}", description="One figure of one or more zerompi.train --metrics-json "
                                                       "files: loss, throughput, step-time breakdown, memory.")
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="--metrics-json files (several overlay, labelled)")
    p.add_argument("--out", default=None, metavar="PNG", help="the image (default: the first RUN with .png)")
    try:
        a = p.parse_args(argv)
        out = a.out if a.out is not None else os.path.splitext(a.runs[0])[0] + ".png"
        check_roles([("out", out)], [("run", run) for run in a.runs])   # never over a file it draws
        check_file(out, "out")
        runs = [load_run(path) for path in a.runs]
        check(importlib.util.find_spec("matplotlib") is not None,
              "drawing needs matplotlib; pip install 'zerompi[plot]'")
        check_image(out, "out")
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    try:
        save_figure(figure(runs, labels(runs, a.runs)), out)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"{PROG}: error: cannot write out={out!r} ({getattr(e, 'strerror', None) or e})\n")
        return 1
    print(f"{PROG}: wrote {out}")
    return 0
