"""Per-rank memory against the number of ranks, ZeRO stages 0-3, with measured runs on it.

    python scripts/plot_memory.py --params 10e9 --out docs/memory.png runs/*.json

The curves come from ``zerompi.estimate`` for a model of ``--params`` parameters at
N = 1..--max-ranks (log scale). The left axis is bytes per rank per parameter, so that
the runs given as metrics JSON files (``python -m zerompi.train --metrics-json``), whatever
their size, sit on the same curves: filled markers are their measured model states,
hollow ones add their peak buffers. The right axis reads the curves in GB for --params.
Solid lines: model states; dashed: plus buffers in the best case (each gradient reduction
done before the next bucket's gradients arrive); dotted: plus buffers with as many
reductions pending as the engine allows (engine.MAX_PENDING_REDUCES), the most a rank holds.
Needs matplotlib: pip install -e '.[plot]'. Prints a JSON summary of what it drew.
"""
import argparse
import json
import sys

import zerompi
from zerompi.errors import ConfigError
from zerompi.estimate.cli import parse_count
from zerompi.estimate.fromrun import run_estimate

COLORS = ("tab:red", "tab:orange", "tab:green", "tab:blue")


def curves(params: float, max_ranks: int, **kw) -> dict:
    """{stage: {"n": [...], "states": [...], "best": [...], "at_cap": [...]}} in bytes per rank per parameter."""
    ns = sorted({max(1, round(max_ranks ** (i / 60))) for i in range(61)})
    out = {s: {"n": ns, "states": [], "best": [], "at_cap": []} for s in range(4)}
    for n in ns:
        rows = zerompi.estimate(params=params, ranks=n, **kw)["stages"]
        for r in rows:
            c = out[r["stage"]]
            c["states"].append(r["model_state_bytes"] / params)
            c["best"].append(r["total_bytes_best_case"] / params)
            c["at_cap"].append(r["total_bytes"] / params)
    return out


def measured_points(paths, dtype: str) -> list:
    """(stage, ranks, model-state bytes per parameter, total bytes per parameter, run) of each run."""
    points = []
    for path in paths:
        with open(path) as f:
            m = json.load(f)
        if m["dtype"] != dtype:
            print(f"plot_memory: skipping {path}: dtype {m['dtype']}, the curves are {dtype}", file=sys.stderr)
            continue
        states = m["memory_bytes"]["total"]
        est = run_estimate(m)["stages"][m["stage"]]
        run = {"path": path, "stage": m["stage"], "ranks": m["world_size"], "params": m["params"],
               "model_state_bytes": states, "estimate_model_state_bytes": est["model_state_bytes"],
               "total_bytes": states + m["peak_buffer_bytes"],
               "estimate_total_bytes": [est["total_bytes_best_case"], est["total_bytes"]]}   # [best, at the cap]
        points.append((m["stage"], m["world_size"], states / m["params"],
                       (states + m["peak_buffer_bytes"]) / m["params"], run))
    return points


def draw(data: dict, points: list, params: float, dtype: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for stage, c in data.items():
        color = COLORS[stage]
        ax.plot(c["n"], c["states"], color=color, lw=2, label=f"stage {stage}: model states")
        ax.plot(c["n"], c["best"], color=color, lw=1, ls="--")
        ax.plot(c["n"], c["at_cap"], color=color, lw=1, ls=":")
    for stage, n, states, total, _ in points:
        ax.plot([n], [states], "o", color=COLORS[stage], ms=7)
        ax.plot([n], [total], "o", mfc="none", color=COLORS[stage], ms=7)
    if points:
        ax.plot([], [], "o", color="gray", label="measured: model states")
        ax.plot([], [], "o", mfc="none", color="gray", label="measured: + peak buffers")
    ax.plot([], [], "--", color="gray", lw=1, label="+ buffers, best case (no reduction pending)")
    ax.plot([], [], ":", color="gray", lw=1,
            label=f"+ buffers, {zerompi.engine.reducer.MAX_PENDING_REDUCES} reductions pending (the engine's cap)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_yscale("log")
    ax.set_xlabel("N, data-parallel ranks")
    ax.set_ylabel("bytes per rank per parameter")
    right = ax.secondary_yaxis("right", functions=(lambda b: b * params / 1e9, lambda g: g * 1e9 / params))
    right.set_ylabel(f"GB per rank at Ψ = {params / 1e9:g} billion")
    ax.set_title(f"ZeRO memory per rank, {dtype} storage + fp32 AdamW")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", help="metrics JSON files of real runs (python -m zerompi.train --metrics-json)")
    p.add_argument("--params", type=parse_count, default=10e9, help="Ψ for the curves (10e9, 7B)")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prefetch", type=int, default=zerompi.estimate.stages.DEFAULT_PREFETCH)
    p.add_argument("--max-ranks", type=int, default=1024)
    p.add_argument("--out", default="memory.png", help="PNG to write")
    a = p.parse_args(argv)
    try:
        if a.max_ranks < 1:
            raise ConfigError(f"max_ranks={a.max_ranks} must be >= 1")
        data = curves(a.params, a.max_ranks, dtype=a.dtype, bucket_mb=a.bucket_mb, layers=a.layers,
                      prefetch=a.prefetch)
        points = measured_points(a.runs, a.dtype)
    except (ConfigError, OSError, KeyError, ValueError) as e:
        print(f"plot_memory: error: {e}", file=sys.stderr)
        return 2
    try:
        draw(data, points, a.params, a.dtype, a.out)
    except ImportError:
        print("plot_memory: error: matplotlib is missing; pip install -e '.[plot]'", file=sys.stderr)
        return 2
    summary = {"out": a.out, "params": a.params, "dtype": a.dtype,
               "at_max_ranks_bytes_per_param": {s: c["states"][-1] for s, c in data.items()},
               "measured": [run for *_, run in points]}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
