"""Draw a pipelined run's trace (``zerompi.train --pp P --trace FILE``) as one row of boxes per rank.

    mpiexec -n 4 python -m zerompi.train --pp 4 --n-layer 8 --micro-batches 8 --batch 32 --steps 4 \
        --schedule zb-h1 --trace t.json --trace-steps 1
    python scripts/plot_pipeline.py t.json docs/pipeline-zb-h1.png

F boxes blue, B orange, W green, each labelled with its micro-batch; the gaps are the bubble. The
times are the run's own (a clock aligned over the mesh, pipeline/trace.py).
"""
import json
import sys
from collections import defaultdict

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def main(argv) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python scripts/plot_pipeline.py TRACE.json OUT.png\n")
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trace = json.load(open(argv[0]))
    info = trace["otherData"]["zerompi"]["pipeline"]
    rows = defaultdict(list)
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X" and e.get("cat") == "schedule":
            rows[e["pid"]].append(e)
    ranks = sorted(rows)
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(ranks) + 1.2))
    for y, r in enumerate(ranks):
        for e in rows[r]:
            t0, dt = e["ts"] / 1e3, e["dur"] / 1e3
            kind, mb = e["args"]["kind"], e["args"]["micro_batch"]
            ax.barh(len(ranks) - 1 - y, dt, left=t0, height=0.8, color=COLOURS[kind], edgecolor="white", linewidth=0.5)
            if dt > 0:
                ax.text(t0 + dt / 2, len(ranks) - 1 - y, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names.get(r, f"rank {r}") for r in reversed(ranks)], fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(f"{info['schedule']}: P = {info['pp']}, m = {info['micro_batches']}, {info['chunks']} chunks "
                 "(F blue, B orange, W green; the number is the micro-batch)", fontsize=9)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
