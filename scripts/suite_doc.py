"""docs/performance.md from a result of scripts/bench_suite.py: the table, the machine, the date, a plot.

``python scripts/suite_doc.py RESULT.json DOC.md [--under-load]`` writes it again from a saved result.
The table has one line per row (measured, floor, ratio, goal, met); the machine is what the numbers
depend on (CPU model and cores, the MPI library and its version, NumPy, Python); the plot (beside the
Markdown, same name, .png) draws each row's ratio against its goal. Nothing here measures.
"""
import argparse
import json
import os
import platform
import sys
from pathlib import Path

HEAD = "| path | measured | floor | ratio | goal | met |"
NOTE_UNDER_LOAD = ("Measured with `--quick` while other jobs shared this machine's cores: the ratios are "
                   "noisy; the final table is to be measured on a quiet machine.")


# What the check costs where it matters, measured ad hoc (the train CLI has no switch for it).
CHECK_IN_A_STEP = (
    "In a training step the check costs no measurable time: the GPT 6 × 256, stage 3, N = 2, with the "
    "Communicator's check turned off in the process, ran 0.3182 s a step, and 0.3173 s with it (medians of "
    "eight interleaved runs of 8 steps each, every run 0.312-0.325 s): the difference is below the runs' spread.")

# What stands between a debt's row and its goal here, measured (shown for each row that misses its goal; a key
# ending in "_" explains every row whose name starts with it).
WHY = {
    "gpt_vs_gemm": (
        "The step's own matrix multiplies run at the floor: timed one by one inside the forward and backward "
        "(one process, three passes), its 108 multiplies took 561.6 ms against 556.9 ms for the floor's same "
        "shapes alone, and the whole pass 694 ms. The rest, 133 ms: the C kernels 105 ms (GELU 65: its backward "
        "39, its forward 26; LayerNorm both ways 21; the softmax both ways 15; the bias + residual adds 4) and "
        "the bias-gradient sums, casts and Python 28 ms; the step adds the engine's 27 ms (the update 8 ms, the "
        "gradients' hand-back; scripts/bench_floor.py: floor 531 ms, forward and backward 655, step 682). "
        "Meeting 1.15 needs about 70 ms of those 160 gone, more than GELU's whole 65. Each kernel is already one "
        "vectorized pass of C over its arrays, and GELU is bound by its arithmetic, not by memory: 2.1-3.1 ns "
        "an element (8 float lanes, no fused multiply-add: the build keeps -ffp-contract=off so that every "
        "machine computes the same bits), where copying the same bytes takes 0.3 ns. Built with 512-bit vectors "
        "(-mprefer-vector-width=512) GELU took 2.2 ms instead of 2.9 ms a layer forward, yet the step's ratio "
        "stayed within the rounds' spread (1.232 and 1.235 as built, 1.245 and 1.241 with them): so that flag "
        "is not used. The rest would have to run inside the multiplies (GELU in their epilogue), which a BLAS "
        "call does not allow. The ratio moves with the BLAS, not with the rest: 1.108 on an AVX2 machine of the "
        "same kind, whose OpenBLAS kernels made the same multiplies slower, and 1.21-1.29 on this AVX-512 one."),
    "check_c_": (
        "These are the check's messages made from C, with no Python around them: every peer's 64-byte header "
        "beside its data, the headers waited and compared before the data. The headers add 0.2-0.9 µs to a "
        "1 MiB exchange against the same messages without them (its data_only_us in the JSON), and MPICH's "
        "Iallgather is itself slower than those point-to-point messages, so the ratio sits at 0.95-1.03 here; "
        "over 1.02 is the rounds' spread on a shared machine, not the check."),
    "check_64mib_": (
        "At 64 MiB the check's fixed cost (a few µs a call, below) is under 0.1% of a call of 4-15 ms: a ratio "
        "over 1.02 here is the rounds' spread, not the check. The same code's 64 MiB rows measured 0.98-1.06 "
        "from run to run (the all-reduce's 0.981 and 1.023 in two tables of one day), the per-round "
        "ratios of one run spreading wider. " + CHECK_IN_A_STEP),
    "check_": (
        "2% of a 1 MiB all-gather at N = 2 is under 1 µs. The MPI part of the check is within it, up to the "
        "rounds' spread: the same header and data messages made from C, in the same run, cost what MPI's own "
        "Iallgather does (row "
        "`check_c_1mib_all_gather`: 0.97-1.03 from run to run). What is left is Python's, per call, around those "
        "MPI calls: the signature packed (0.3 µs), the plan looked up and counted, one Startall and the waits "
        "through mpi4py (2-3 µs in all, measured at 1 KiB). Making the same MPI calls through ctypes was measured"
        " slower, not faster: 0.37 µs per ctypes call, so a plan's start and wait took 3.6 µs against 2.7 µs "
        "through mpi4py (1 KiB, N = 2, medians of 15 rounds). Within 2% needs the whole checked call (signature, "
        "look-up, start, waits, comparison) in one compiled extension against the CPython and mpi4py C APIs: not "
        "built. The header cannot ride in the data message (below). At 64 MiB the fixed cost is 0.1% of a call, "
        "and a ratio over 1.02 there is the rounds' spread (0.98-1.06 from run to run). " + CHECK_IN_A_STEP),
    "check_1mib_all_reduce": (
        "The engine's all-reduce is a checked reduce-scatter and an unchecked all-gather of the same buffer: "
        "one check per call, the reduce-scatter's. Its pieces, timed apart in two runs (41 interleaved rounds "
        "of 200 calls, N = 2; medians and fastest rounds): the reduce-scatter in place +0.5 to +4.5 µs with "
        "its check (60-83 µs), the all-gather within 0.7 µs of itself (24-29 µs), the all-reduce +6.5 to "
        "+9.6 µs (190-242 µs). The two pieces back to back cost twice their sum alone, checked or not (205-213 "
        "µs against 92 µs), a cost of the sequence that both forms pay. The part of the all-reduce's excess "
        "beyond its reduce-scatter's check (2-5 µs) is not accounted for; the per-round ratios spread "
        "0.96-1.25 (31 rounds of "
        "scripts/bench_signature.py). " + CHECK_IN_A_STEP),
    "nvme_vs_io": (
        "The floor is the state's O_DIRECT I/O alone; what the step adds is the records' hash, the integrity "
        "check of every read and write (issue 29), on the update thread. With the hash turned off in the "
        "process (measured ad hoc, two interleaved pairs of runs of this row's command) the step was 1.04 and "
        "1.13 times the I/O alone, against 1.33 and 1.33 with it. Per rank and step the hash reads the 151 MB "
        "of rows read (28 ms: bound by memory, a plain sum of the same bytes takes as long) and hashes the 151 "
        "MB written while they are in cache (12.6 ms); with 2 ranks on 2 cores there is no idle core for it, so "
        "it lengthens the step instead of running beside the I/O (check_s_per_step in the JSON: 0.13-0.15 s of "
        "hashing a step, the threads sharing the cores). A faster hash does not help: an additive, "
        "XXH3-style one measured 25 ms against 28 on the rows in memory and 9.4 against 12.6 in cache. Within "
        "1.1 with the check on needs the hash folded into the update's own pass over the rows (the fused AdamW "
        "kernel hashing what it reads and writes): not built."),
    "checkpoint_sync_vs_disk": (
        "The same code (this commit's and the one of the previous table) measured 1.36 to 2.06 in quick runs "
        "of 3 rounds on one day, and 1.146 round by round over 5 rounds (scripts/bench_checkpoint.py "
        "--params 50e6 --rounds 5: sync 0.359 s against 0.343 s for the disk alone): this virtual machine's "
        "disk varies from write to write (the floor itself 266-318 ms for the same bytes), and 3 rounds of a "
        "600 MB save do not settle it. What the save adds to the write is its checksum (CRC-32: 0.135 s of "
        "CPU for both ranks' shards, measured alone), the manifest and the fsyncs of the folders."),
    "bubble_1f1b_pp2_dp2": (
        "The floor is the simulator replaying each step's own action costs, the data-parallel waits inside them "
        "included; what the measured bubble adds is the executor's between actions (message latency, the "
        "sends' copies, polling), with 4 ranks on this machine's 2 cores. The same code measured 1.155-1.267 "
        "in twelve quick runs on a quiet machine on the day of this table (median 1.19), and 1.138-1.229 in "
        "five quick runs of an earlier day: the goal lies inside the spread of a quick run, where two ranks "
        "share each core and a rank's wait for its partner moves with the scheduler. Pushing each send out at "
        "once (testing it up to 50 or 1,000 times after the Isend, so that it does not wait for the sender's "
        "next poll) and MPICH's yielding progress (MPIR_CVAR_ENABLE_HEAVY_YIELD) both stayed within that spread."),
    "zeropp_4x1": (
        "With one rank per node every gather and reduce crosses a link: hpZ's secondary copy is then the whole "
        "node's share, so it saves only what a second gather would send (13.2 → 9.4 MB a step on node 1's "
        "link), and all of ZeRO++ still puts 3.7-3.9 MB a step on each link: the forward's int8 weights (2.4 MB, "
        "86 ms at the 0.22 Gbit/s measured through a 250 Mbit/s link) and the backward's int4 gradients (1.3 MB, "
        "47 ms). The backward's 55 ms of compute hides its gradients; the forward's 28 ms cannot hide its "
        "weights, so the forward is the link's. With every overlap perfect the step is 86 ms of forward, 55 of "
        "backward and 2.5 of update, 0.30× flat stage 3's 0.48 s; what the measured step adds to that is what "
        "nothing can overlap (the first gather, the last reduce-scatter) and 17 ms of its other work (the "
        "timers' `other`: the loss and the step's checks, over the same loaded link). Gathering deeper ahead does "
        "not move it: --prefetch 2 measured 0.385× and 0.36×, --prefetch 4 0.42× (the 4 ranks share 2 cores, "
        "and more buckets in flight cost compute), the progress thread 0.78×. On 2 nodes × 2 the same build is "
        "0.20× flat stage 3, and 0.30× on 4 × 1 on an AVX2 machine (slower compute hides more of the link)."),
}


def why_missed(name: str) -> str:
    return WHY.get(name) or next((text for key, text in WHY.items() if key.endswith("_") and name.startswith(key)),
                                 "not explained yet.")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import numpy
    try:
        from mpi4py import MPI
        mpi = " ".join(MPI.Get_library_version().split("\n")[0].split())
    except Exception as e:          # noqa: BLE001  (the table still says the rest)
        mpi = f"unknown ({type(e).__name__})"
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "mpi": mpi, "numpy": numpy.__version__,
            "python": platform.python_version(), "system": f"{platform.system()} {platform.release()}"}


def number(x, unit: str = "") -> str:
    if x is None:
        return "—"
    if unit == "µs":
        x, unit = x * 1e-6, "s"
    if unit == "s":
        return f"{x * 1e6:.3g} µs" if x < 1e-3 else f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"
    return f"{x:.3g}" + (f" {unit}" if unit and unit != "fraction" else "")


def met(r: dict) -> str:
    if r.get("skipped"):
        return "skipped: " + r["skipped"]
    mark = {True: "met", False: "**missed**", None: "—"}[r["met"]]
    return f"{mark} ({r['note']})" if r.get("note") else mark


def table(rows: list) -> str:
    lines = [HEAD, "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.3f}"
        goal = "—" if r["goal"] is None else f"≤ {r['goal']:g}"
        lines.append(f"| `{r['name']}` | {number(r['measured'], r['unit'])} | {number(r['floor'], r['unit'])} | "
                     f"{ratio} | {goal} | {met(r)} |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    """Each row's ratio (a bar) and its goal (a tick), on a log scale; skipped rows left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [r for r in rows if r["ratio"] is not None and r["ratio"] > 0]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(shown) + 1.2))
    y = range(len(shown))
    colors = ["tab:gray" if r["met"] is None else "tab:green" if r["met"] else "tab:red" for r in shown]
    ax.barh(list(y), [r["ratio"] for r in shown], color=colors)
    goals = [(i, r["goal"]) for i, r in enumerate(shown) if r["goal"] is not None]
    ax.scatter([g for _, g in goals], [i for i, _ in goals], marker="|", s=200, color="black", label="goal",
               zorder=3)
    ax.axvline(1.0, color="gray", lw=0.5)
    ax.set_xscale("log")
    ax.set_yticks(list(y))
    ax.set_yticklabels([r["name"] for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / floor (green: goal met, red: missed, gray: no goal, or its bound not this run's)")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict, image: str, note: str = "") -> str:
    m = result["machine"]
    rows = result["rows"]
    goals = [r for r in rows if r["met"] is not None]
    checks = "\n".join(f"- `{c['name']}`: {'holds' if c['ok'] else '**broken**'} ({c['what']})"
                       for c in result["checks"]) or "- none in this run"
    errors = "\n".join(f"- `{k}` failed: {v.splitlines()[0]}" for k, v in result["errors"].items())
    flag = {"quick": " --quick", "check": " --check"}.get(result["mode"], "")
    commands = "\n".join(result.get("commands", []))
    missed = [r for r in rows if r["met"] is False]
    why = "\n".join(f"- `{r['name']}` ({r['ratio']:.3f} against ≤ {r['goal']:g}): "
                    f"{why_missed(r['name'])}" for r in missed) \
        or "- none: every row with a goal meets it in this run"
    return f"""# Every path against its floor

One table from one command, `python scripts/bench_suite.py{flag} --json OUT --doc docs/performance.md`:
each path measured against what this machine allows for it (its floor), both in the same run of the
path's own benchmark script (interleaved rounds, medians). `ratio` = measured / floor; `goal` is the
bound the ratio must stay under (— where none is set); {sum(r['met'] for r in goals)} of {len(goals)} rows \
with a goal meet it.

{note}

- date: {result['date']} ({result['mode']} run, {result['seconds']:.0f} s; 1-minute load average
  {result['load_average_1min'][0]:.2f} at the start, {result['load_average_1min'][-1]:.2f} at the end)
- CPU: {m['cpu']}, {m['cores']} cores; {m['system']}
- MPI: {m['mpi']}; NumPy {m['numpy']}; Python {m['python']}

{table(rows)}

![ratio per row against its goal]({image})

## The goals missed in this run, and why

{why}

Bit checks of the same run (never timings):

{checks}
{errors}

## What each row measures

Each row comes from one script (its docstring says how it measures); the suite's `--quick` shrinks
sizes, steps and rounds, `--check` runs every path at its smallest size for its bits only.

- `gpt_vs_gemm`: scripts/bench_floor.py, the GPT 6 × 256 (seq 128, batch 16) training step at N = 1,
  stage 0, against the same step's matrix multiplies alone on the same BLAS; the JSON keeps the step's
  shares (forward, backward, optimizer, other) and the ratio paired within each repeat.
- `*_vs_mpi`: `python -m zerompi.bench` at N = 2, the engine's collective (checked, its default) against the
  MPI library's own on the same memory (all-to-all: `--sp 2`, the pack and unpack copies included). No goal:
  they say where the engine stands, each a single call after the buffer's reset and a barrier, the forms
  taking turns. At 64 MiB the reduce-scatter and all-reduce are 0.45-0.54× MPICH's (Reduce_scatter_block
  and Allreduce are slower here than the engine's exchange and fused sum) and the all-gather 1.01×. At
  1 MiB the engine's are 1.1-1.5×: a call is 50-300 µs and its fixed costs weigh. For the all-gather,
  timed apart (303 calls each, N = 2, medians): checked 77.4 µs, unchecked 63.0 µs, MPI's Allgather 53.9
  µs; without the reset before each call 29.2, 26.1 and 21.7 µs. Writing the rank's slice just before
  the call makes every form 2.5× slower, and the engine's start (its Python, the plan's four requests
  against one collective) then costs more than the few µs it costs on a warm buffer. The all-to-all's 3.5×
  is its copies, which the floor (contiguous blocks in and out) does not make: at 64 MiB the pack into
  rank order took 16.1 ms, the unpack 9.4 ms and a plain copy of the same bytes 9.7 ms, against 11.4 ms for
  MPI's Alltoall (39.5 ms in all); each is one NumPy copy, the pack's (256-byte runs) 1.7× a plain one.
- `check_*`: scripts/bench_signature.py, each collective with the in-band check against the same without it
  (MPI's own Ialltoallv / Iallgather). The check is a fixed cost per call, all of it Python's: the signature
  packed, the plan of the call's shape and buffers looked up and its persistent requests started (comm/checked.py:
  one Startall), the 64-byte headers waited and compared before the data. With the plans (this script as the
  suite runs it, 9 rounds, medians, N = 2, other jobs on the machine: 1-minute load 2.4), 1 MiB: reduce-scatter
  1.029, all-gather 1.084, all-reduce 1.048; 64 MiB: 0.978, 1.031, 0.996; the code before the plans, run right
  after: 1.163, 1.331, 1.111 and 1.035, 1.011, 1.019. Measured where a call is nothing but that cost (1 KiB, the
  fastest of 1,500 calls of each form, interleaved) the check adds 2.7 µs to an all-gather, 1.8 µs to a
  reduce-scatter and 3.1 µs to an all-reduce (before the plans: 6.7-9.6, 6.7-7.8 and 7.6-9.7 µs). So 1 MiB
  still misses 2%: 2% of a 41 µs all-gather is 0.8 µs, less than the check's own Python costs per call
  (measured: the signature 0.33 µs, the plan's look-up and counters 1 µs, one Startall of the 4 requests at
  N = 2 1.0 µs against 1.3 µs for MPI's Iallgather, then 4 Waits and the headers' comparison). The MPI part is
  no slower: the same persistent header and data messages timed in a bare loop take what Iallgather does
  (25.0 µs both). The header cannot ride in the data message: a data tag made from the length hangs a
  mismatched length instead of refusing it, one fixed tag would receive a longer message into a shorter buffer
  (Open MPI writes past its end, docs/failures.md), and a header packed beside the data (one struct datatype)
  made a 1 MiB all-gather 4× slower (MPICH packs it instead of copying once). At 64 MiB those µs are 0.1% of a
  call: the ratios there (0.98-1.03 from run to run) are noise.
- `check_c_*`: scripts/bench_check_floor.py, the check's floor: the checked all-gather's messages as the plan
  makes them (persistent requests, one Startall, the headers waited and compared, then the data), made from C
  (scripts/bench_check_floor.c, built by the MPI library's own mpicc), against MPI_Iallgather from C, N = 2;
  its JSON also has the same exchange without the headers (`data_only_us`). Skipped where no mpicc is found.
- `adamw_vs_copy`: scripts/bench_adam.py, the fused AdamW against a copy of the same 28 bytes per parameter.
- `stage3_vs_stage2`: scripts/bench_stages.py, N = 2, fp16, the MLP through the train CLI.
- `tp_step_vs_dp_step_n2`: scripts/bench_tp_step.py, the GPT 4 × 256 with `--tp 2` against `--tp 1`.
- `offload_cpu_vs_memory`, `nvme_vs_io`, `nvme_vs_memory`: scripts/bench_offload.py, the GPT 8 × 512 (chosen
  for its state's I/O longer than the backward) at N = 2, stage 2; the nvme step against the state's I/O
  alone (the bound where that I/O is longer than the in-memory backward) and against the in-memory step
  (the bound where it is shorter); the row whose bound does not apply in this run says so (met: —).
- `checkpoint_async_stall`, `checkpoint_sync_vs_disk`: scripts/bench_checkpoint.py, the async save's stall
  against the sync save's, and the sync save against the disk's own write of the same bytes.
- `bubble_1f1b_pp2_dp2`, `bubble_zbh1`: scripts/bench_pipeline.py, m = 8, the bubble measured from the
  actions' timers against the simulator's on the measured costs (pp 2 × dp 2 at N = 4; pp 2 at N = 2).
- `gpt_vs_torch_*`: scripts/bench_torch_gpt.py, where PyTorch is installed.
- `zeropp_4x1`, `estimate_error_*`: scripts/bench_cluster.py on the emulated cluster (4 nodes × 1 rank,
  250 Mbit/s links; needs root and network namespaces): all of ZeRO++ against flat stage 3, and the
  estimator's step against the measured one (ratio = |estimate − measured| / measured).

The commands of this run (`--quick` runs the same scripts with fewer steps, rounds and repeats and a
smaller AdamW and checkpoint; see `PATHS` in scripts/bench_suite.py for the full run's):

```
{commands}
```
"""


def write(result: dict, path: Path, note: str = "") -> None:
    """The Markdown at ``path`` and its plot beside it (same name, .png)."""
    path = Path(path)
    image = path.with_suffix(".png")
    plot(result["rows"], image)
    path.write_text(markdown(result, image.name, note))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="docs/performance.md again from a saved bench_suite.py --json result")
    ap.add_argument("result")
    ap.add_argument("doc")
    ap.add_argument("--under-load", action="store_true", help="say that other jobs shared the machine")
    a = ap.parse_args(argv)
    write(json.loads(Path(a.result).read_text()), Path(a.doc), NOTE_UNDER_LOAD if a.under_load else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
