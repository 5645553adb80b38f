"""The rows of the performance table (scripts/bench_suite.py): one row per path against its floor.

A row is ``{name, measured, floor, ratio, goal, unit, met}``: ``ratio = measured / floor``, ``goal`` the
bound the ratio must not exceed (null where there is none), ``met`` whether it holds (null without a goal
or a ratio). A path that cannot run here is a row with ``skipped``: why. The functions below turn each
benchmark script's own JSON into rows and bit checks (``{name, ok, what}``); they measure nothing.
"""
import math
import statistics
from typing import Optional

GOALS = {   # the bounds of the issue and of the docs the scripts' own goals come from
    "gpt_vs_gemm": 1.15, "check": 1.02, "adamw_vs_copy": 2.0, "stage3_vs_stage2": 1.15,
    "offload_cpu_vs_memory": 1.05, "nvme_vs_io": 1.1, "nvme_vs_memory": 1.15,
    "checkpoint_async_stall": 0.10, "checkpoint_sync_vs_disk": 1.5, "bubble": 1.2, "zeropp_4x1": 0.35,
    "estimate_error": 0.25,
}
MIB = 1 << 20


def row(name: str, measured: float, floor: float, goal: Optional[float] = None, unit: str = "s", **extra) -> dict:
    """One row; ratio null where it cannot be taken (a floor of zero, a value not finite)."""
    ratio = measured / floor if floor and math.isfinite(measured) and math.isfinite(floor) else None
    met = None if goal is None or ratio is None else ratio <= goal
    return {"name": name, "measured": measured, "floor": floor, "ratio": ratio, "goal": goal, "unit": unit,
            "met": met, **extra}


def skipped(name: str, why: str, goal: Optional[float] = None, unit: str = "s") -> dict:
    return {"name": name, "measured": None, "floor": None, "ratio": None, "goal": goal, "unit": unit,
            "met": None, "skipped": why}


def check(name: str, ok: bool, what: str) -> dict:
    """A bit check (a path's claim of bit-identity or validation), never a timing."""
    return {"name": name, "ok": bool(ok), "what": what}


def size_tag(nbytes: int) -> str:
    return f"{nbytes // MIB}mib" if nbytes >= MIB else f"{nbytes // 1024}kib"


# ---- one function per script: its JSON -> (rows, checks) ----------------------------------------
def floor_rows(records: list) -> tuple:
    """bench_floor.py's record for gpt-6x256 at N = 1: stage 0's step against its matrix multiplies; the rest
    of the step named by the engine's breakdown (shares of the step)."""
    rec = next(r for r in records if r.get("model") == "gpt-6x256" and r.get("N") == 1)
    stage = rec["stages"].get("0") or rec["stages"].get(0)
    step = stage["step_s"]
    rest = {k: round(v / step, 3) for k, v in stage["breakdown_s"].items()}
    rows = [row("gpt_vs_gemm", step, rec["floor_s"], GOALS["gpt_vs_gemm"], paired_ratio=stage["over_floor"],
                fwd_bwd_over_floor=rec["fwd_bwd_over_floor"], step_shares=rest)]
    checks = [check("gpt_stages_bit_identical", rec["stages_bit_identical"],
                    f"bench_floor: stages {', '.join(sorted(map(str, rec['stages'])))} end on the same parameters")]
    return rows, checks if len(rec["stages"]) > 1 else []


def collective_rows(records: list) -> tuple:
    """``python -m zerompi.bench --json``: the engine's collective (its default, checked) against the MPI
    library's own, per op and size (µs, the ranks' average of their medians)."""
    by = {(r["op"], r["impl"], r["bytes"]): r for r in records}
    rows = []
    for (op, impl, nbytes), r in by.items():
        mpi = by.get((op, "mpi", nbytes))
        if impl == "mpi" or mpi is None:
            continue
        rows.append(row(f"{op}_{size_tag(nbytes)}_vs_mpi", r["time_us"], mpi["time_us"], None, "µs",
                        impl=impl))
    checks = [check("collectives_oracle", all(r["wrong"] in (0, None) for r in records),
                    "zerompi.bench: no element outside the float64 oracle's tolerance")]
    return rows, checks


def signature_rows(doc: dict) -> tuple:
    """bench_signature.py: each collective checked against the same unchecked (MPI's own call), µs."""
    rows = [row(f"check_{size_tag(c['bytes'])}_{c['op']}", c["checked_us"], c["unchecked_us"], GOALS["check"],
                "µs", best_ratio=c["best_ratio"]) for c in doc["cases"]]
    return rows, []


def check_floor_rows(doc: dict) -> tuple:
    """bench_check_floor.py: the check's messages made from C against MPI's own all-gather, µs."""
    rows = [row(f"check_c_{size_tag(r['bytes'])}_all_gather", r["checked_us"], r["mpi_us"], GOALS["check"], "µs",
                round_ratio=r["ratio"], data_only_us=r["data_only_us"]) for r in doc["records"]]
    return rows, []


def adam_rows(records: list) -> tuple:
    """bench_adam.py: the fused AdamW against a copy of the same 28 bytes per parameter, at the largest size."""
    cpu = [r for r in records if r.get("backend") == "cpu"]
    big = max(cpu, key=lambda r: r["n"])
    return [row("adamw_vs_copy", big["fused_s"], big["copy_s"], GOALS["adamw_vs_copy"], params=big["n"])], []


def stages_rows(lines: list) -> tuple:
    """bench_stages.py: stage 3's median step against stage 2's of the same run; the stages' parity."""
    bars = [x for x in lines if x.get("bar")]
    parity = next(x for x in lines if "check" in x)
    rows = []
    for b in bars:
        recs = {r["stage"]: r for r in lines if r.get("N") == b["N"] and r.get("dtype") == b["dtype"]
                and "stage" in r and "median_step_s" in r}
        rows.append(row("stage3_vs_stage2", recs[3]["median_step_s"], recs[2]["median_step_s"],
                        GOALS["stage3_vs_stage2"], N=b["N"], dtype=b["dtype"]))
    return rows, [check("stages_bit_identical", parity["ok"], "bench_stages: " + parity["check"])]


def tp_rows(doc: dict) -> tuple:
    """bench_tp_step.py: the ``--tp 2`` step against the ``--tp 1`` step (pure data parallelism), per N."""
    step = {(r["ranks"], r["tp"]): r["step_time_s"] for r in doc["summary"] if r["code"] == "new"}
    rows = [row(f"tp_step_vs_dp_step_n{n}", step[(n, 2)], step[(n, 1)], None)
            for n in sorted({n for n, _ in step}) if (n, 1) in step and (n, 2) in step]
    return rows, [check("tp_activations_formula", not doc["validation"], "; ".join(doc["validation"]) or
                        "bench_tp_step: activation bytes measured = formula")]


def offload_rows(doc: dict) -> tuple:
    """bench_offload.py: cpu offload against the in-memory step; nvme against the state's I/O alone (its bound
    where that I/O is longer than the in-memory backward) and against the in-memory step (its bound where the
    I/O is shorter): both rows always, the bound that does not apply with ``met`` null and a note; the bits."""
    rows, checks = [], []
    for c in doc["cases"]:
        g, modes, tag = c["goals"], c["modes"], f"{c['case']} stage {c['stage']}"
        if not g:
            continue
        none, nvme, io = modes["none"]["step_s"], modes["nvme"]["step_s"], c["io_alone_s"]["direct"]
        io_longer = io >= modes["none"]["backward_s"]
        rows.append(row("offload_cpu_vs_memory", modes["cpu"]["step_s"], none, GOALS["offload_cpu_vs_memory"],
                        case=tag))
        for name, floor, applies in (("nvme_vs_io", io, io_longer), ("nvme_vs_memory", none, not io_longer)):
            r = row(name, nvme, floor, GOALS[name], case=tag, io_vs_backward=g["io_alone_vs_backward"])
            if not applies:
                r["met"] = None
                r["note"] = (f"the state's I/O alone is {'longer' if io_longer else 'shorter'} than the in-memory "
                             f"backward here ({g['io_alone_vs_backward']:.2f}x): the bound is "
                             f"{'nvme_vs_io' if io_longer else 'nvme_vs_memory'}'s")
            rows.append(r)
        checks.append(check(f"offload_bit_identical ({tag})", g["bit_identical"],
                            "bench_offload: every mode's final parameters hash as the in-memory run's"))
    return rows, checks


def checkpoint_rows(doc: dict) -> tuple:
    """bench_checkpoint.py: the async save's stall against the sync one's; the sync save against the disk."""
    return [row("checkpoint_async_stall", doc["async"]["median_stall_s"], doc["sync"]["median_stall_s"],
                GOALS["checkpoint_async_stall"], params=doc["params"]),
            row("checkpoint_sync_vs_disk", doc["sync"]["median_stall_s"], doc["ceiling"]["median_s"],
                GOALS["checkpoint_sync_vs_disk"], params=doc["params"])], []


def pipeline_rows(doc: dict, name: str) -> tuple:
    """bench_pipeline.py: the measured bubble (the actions' timers) against the simulator's on each step's own
    action costs (the stage's data-parallel waits and the costs' spread in them: what the executor adds is the
    rest), for the one row the suite asked for; the simulator's on the median costs kept beside it."""
    (r,) = doc["rows"]          # the suite asks for one mesh, one schedule, one m
    return [row(name, r["bubble_measured"], r["bubble_replayed"], GOALS["bubble"], "fraction", mesh=r["mesh"],
                schedule=r["schedule"], m=r["m"], step_s=r["step_time_s"], simulated_median_costs=r["bubble_simulated"],
                over_median_costs=r["bubble_measured"] / r["bubble_simulated"] if r["bubble_simulated"] else None)], []


def torch_rows(records: list) -> tuple:
    """bench_torch_gpt.py: zerompi's step (N = 1, fp32) against PyTorch's on the same model."""
    rows = [row(f"gpt_vs_torch_{r['model']}", r["step_s"]["zerompi_fp32"], r["step_s"]["torch_fp32"], None,
                paired_ratio=r.get("zerompi_over_torch_fp32")) for r in records if "zerompi_fp32" in r["step_s"]]
    return rows, [check("torch_parity", all(r["parity"]["ok"] for r in records),
                        "bench_torch_gpt: PyTorch's loss and gradients equal zerompi's")]


def torch_dist_rows(runs: dict, what: dict, warmup: int) -> tuple:
    """zerompi's train CLI step at N ranks (fp32) against PyTorch's DDP / FSDP2 step on the same shapes (fp32,
    gloo): ``runs`` {row: [(zerompi's step times, torch's step times) per round]}, ``what`` {row: (N, zerompi's
    stage, torch's wrapper)}; each run's first ``warmup`` steps left out, medians over every round's steps, and
    the ratio of each round's medians (the same moment), then their median."""
    med = statistics.median
    rows = []
    for name, pairs in runs.items():
        n, stage, kind = what[name]
        z = [t for zs, _ in pairs for t in zs[warmup:]]
        t = [t for _, ts in pairs for t in ts[warmup:]]
        rows.append(row(name, med(z), med(t), None, N=n, zerompi_stage=stage, torch=kind, dtype="fp32",
                        paired_ratio=med([med(zs[warmup:]) / med(ts[warmup:]) for zs, ts in pairs]),
                        rounds=len(pairs)))
    return rows, []


def cluster_rows(records: list, tag: str = "4x1") -> tuple:
    """bench_cluster.py: ZeRO++ against flat stage 3; the estimator's error against each measured step."""
    by = {r["name"]: r for r in records}
    rows = []
    if "zeropp" in by and "flat3" in by:
        rows.append(row(f"zeropp_{tag}", by["zeropp"]["step_s"], by["flat3"]["step_s"], GOALS["zeropp_4x1"],
                        link=by["zeropp"]["link"]))
    for name, r in by.items():
        rows.append(row(f"estimate_error_{name}_{tag}", abs(r["estimate_step_s"] - r["step_s"]), r["step_s"],
                        GOALS["estimate_error"], estimate_s=r["estimate_step_s"]))
    return rows, []

