"""Every path against its floor, in one table, from one command.

    python scripts/bench_suite.py --json perf.json --doc docs/performance.md     # the full table (long)
    python scripts/bench_suite.py --quick --json perf.json                       # smaller sizes, fewer rounds
    python scripts/bench_suite.py --check                                        # every path runs, bits hold
    python scripts/bench_suite.py --quick --only floor,signature,adam

Drives the project's benchmark scripts (each one measures its path and its floor in the same run,
interleaved, medians; this file measures nothing itself) and turns their JSON into rows
``{name, measured, floor, ratio, goal, unit, met}`` (scripts/suite_rows.py); a path that cannot run
here (PyTorch missing, no network namespaces for the emulated cluster) is a row with ``skipped``.
``--torch-python PY``: the interpreter that has PyTorch (it needs only torch and NumPy) when it is
not zerompi's own: the rows ``gpt_n2_vs_torch_ddp`` and ``gpt_n4_vs_torch_fsdp2`` run there.
``--quick`` shrinks sizes, steps and rounds (PATHS: each path's quick arguments); ``--check`` runs
every path at its smallest size and keeps only whether it ran and its bit checks (the stages'
parity, offload's hash against the in-memory run, the collectives' oracle), never its timings.
``--doc`` writes the Markdown table, the machine, the date and a plot beside it
(scripts/suite_doc.py). Exit status 0, or 1 when a path failed or a bit check did not hold (a
missed goal is a row of the table, not a failure).
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from launch import job_env, mpicc, mpiexec  # noqa: E402  (one launcher and environment for every script)
import suite_rows as sr  # noqa: E402

MODES = ("full", "quick", "check")
PY = sys.executable


def script(name: str) -> list:
    return [PY, str(ROOT / "scripts" / name)]


def pick(mode: str, full, quick, check):
    return {"full": full, "quick": quick, "check": check}[mode]


# ---- the paths: (argv for a mode, how its output becomes rows, why it is skipped here) -------------
def floor_argv(mode, tmp):
    reps = pick(mode, ["--repeats", "5", "--rounds", "3"], ["--repeats", "5", "--rounds", "2"],
                ["--repeats", "1", "--rounds", "1"])
    return script("bench_floor.py") + ["--models", "gpt-6x256", "--ranks", "1", "--no-cli",
                                       "--stages", "0,3" if mode == "check" else "0"] + reps


def collectives_argv(mode, tmp):
    size = ["-b", "1M", "-e", "1M"] if mode == "check" else ["-b", "1M", "-e", "64M", "-f", "64"]
    iters = pick(mode, ["--iters", "20"], ["--iters", "10"], ["--iters", "2", "--warmup", "1", "--check"])
    base = [mpiexec(), "-n", "2", PY, "-m", "zerompi.bench", "--no-overlap", *size, *iters]
    return [base + ["--json", str(tmp / "coll.json")], base + ["--sp", "2", "--json", str(tmp / "sp.json")]]


def collectives_parse(outs, tmp):
    return sr.collective_rows(json.loads((tmp / "coll.json").read_text()) + json.loads((tmp / "sp.json").read_text()))


def signature_argv(mode, tmp):
    args = pick(mode, ["--sizes", "1M,64M", "--rounds", "15"], ["--sizes", "1M,64M", "--rounds", "9"],
                ["--sizes", "1M", "--rounds", "1", "--seconds", "0.005"])
    return [mpiexec(), "-n", "2"] + script("bench_signature.py") + args


def check_floor_argv(mode, tmp):
    return script("bench_check_floor.py") + pick(mode, ["--rounds", "51"], ["--rounds", "31"],
                                                 ["--sizes", "1M", "--rounds", "1", "--seconds", "0.002"])


def check_floor_missing():
    return None if mpicc() else "no mpicc here (it builds scripts/bench_check_floor.c)"


def adam_argv(mode, tmp):
    args = pick(mode, ["--sizes", "64"], ["--sizes", "16", "--repeats", "9", "--numpy-repeats", "1"],
                ["--sizes", "0.25", "--repeats", "1", "--numpy-repeats", "1"])
    return script("bench_adam.py") + ["--backend", "cpu"] + args


def stages_argv(mode, tmp):
    args = pick(mode, ["--stages", "2,3", "--width", "2048", "--rounds", "2"],
                ["--stages", "2,3", "--width", "2048", "--steps", "4", "--rounds", "2"],
                ["--stages", "0,1,2,3", "--width", "128", "--depth", "2", "--steps", "2", "--rounds", "1"])
    return script("bench_stages.py") + ["--ranks", "2", "--dtypes", "fp16"] + args


def tp_argv(mode, tmp):
    args = pick(mode, ["--rounds", "3", "--steps", "12"], ["--rounds", "2", "--steps", "8"],
                ["--rounds", "1", "--steps", "2"])
    return script("bench_tp_step.py") + ["--ranks", "2"] + args


def offload_argv(mode, tmp):
    args = pick(mode, ["--rounds", "3", "--steps", "8"], ["--rounds", "2", "--steps", "6"],
                ["--rounds", "1", "--steps", "2", "--passes", "1"])
    return script("bench_offload.py") + ["--dir", str(OFFLOAD_DIR or tmp), "--cases", "gpt-8x512", "--stages", "2",
                                         "--modes", "cpu,nvme"] + args


def checkpoint_argv(mode, tmp):
    args = pick(mode, [], ["--params", "50e6", "--rounds", "3", "--settle-s", "0.5"],
                ["--params", "1e6", "--layers", "2", "--rounds", "1", "--settle-s", "0"])
    return script("bench_checkpoint.py") + ["--dir", str(tmp)] + args


def pipeline_argv(ranks, mesh, schedule):
    def argv(mode, tmp):
        steps = pick(mode, "30", "20", "3")
        return script("bench_pipeline.py") + ["--ranks", str(ranks), "--meshes", mesh, "--schedules", schedule,
                                              "--ms", "8", "--no-stage-rows", "--steps", steps]
    return argv


def torch_argv(mode, tmp):
    args = pick(mode, ["--repeats", "10", "--warmup", "3"], ["--repeats", "3", "--warmup", "1"],
                ["--repeats", "1", "--warmup", "0"])
    return [torch_gpt_python(), str(ROOT / "scripts" / "bench_torch_gpt.py"), "--models", "gpt-6x256"] + args


def torch_gpt_python() -> str:
    """The interpreter of the N = 1 row, which times both in one process: zerompi's own where it has torch,
    else --torch-python's where zerompi's dependencies import there too (this checkout on PYTHONPATH)."""
    return PY if importlib.util.find_spec("torch") or not TORCH_PYTHON else TORCH_PYTHON


def torch_missing():
    if importlib.util.find_spec("torch"):
        return None
    if not TORCH_PYTHON:
        return "PyTorch is not installed (pip install torch)"
    proc = subprocess.run([TORCH_PYTHON, "-c", "import torch, mpi4py.MPI, zerompi.engine"], capture_output=True,
                          text=True, cwd=str(ROOT), env=job_env(ROOT), timeout=300)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return f"--torch-python's interpreter cannot import zerompi beside torch ({last}); the N = 2 and 4 rows ran there"


TORCH_PYTHON = None     # --torch-python: an interpreter with torch (default: zerompi's own)
TORCH_DIST = (  # row, N, zerompi's stage, PyTorch's wrapper: data parallelism against DDP, ZeRO-3 against FSDP2
    ("gpt_n2_vs_torch_ddp", 2, 0, "ddp"), ("gpt_n4_vs_torch_fsdp2", 4, 3, "fsdp2"))
TORCH_DIST_WARMUP = 2   # steps of each run left out (FSDP2's first step builds its shards)


def gpt_6x256() -> dict:
    """The GPT 6 x 256's shapes (bench_floor.py's flags; the generated corpus's vocabulary), for the torch side."""
    from bench_floor import MODELS
    from zerompi.train.data import GENERATED_VOCAB
    flags = MODELS["gpt-6x256"]
    shape = {k: flags[flags.index(f"--{k}") + 1] for k in ("n-layer", "d-model", "n-head", "seq-len", "batch")}
    return dict(shape, vocab=str(GENERATED_VOCAB))


def torch_dist_argv(mode, tmp):
    """Interleaved rounds: zerompi's train CLI (fp32) and PyTorch's DDP / FSDP2 (fp32, gloo) on the same shapes."""
    from bench_floor import MODELS
    steps, rounds = str(TORCH_DIST_WARMUP + pick(mode, 8, 4, 1)), pick(mode, 3, 2, 1)
    shape = [x for k, v in gpt_6x256().items() for x in (f"--{k}", v)]
    argvs = []
    for r in range(rounds):
        for name, n, stage, kind in TORCH_DIST:
            argvs.append([mpiexec(), "-n", str(n), PY, "-m", "zerompi.train", *MODELS["gpt-6x256"], "--dtype", "fp32",
                          "--stage", str(stage), "--steps", steps, "--log-every", steps, "--eval-every", "0",
                          "--metrics-json", str(tmp / f"{name}-{r}.json")])
            argvs.append([TORCH_PYTHON or PY, str(ROOT / "scripts" / "bench_torch_dist_gpt.py"), "--model", "builtin",
                          "--mode", kind, "--ranks", str(n), "--steps", steps, *shape])
    return argvs


def torch_dist_parse(outs, tmp):
    runs = {name: [] for name, *_ in TORCH_DIST}
    for i, name in enumerate(n for _ in range(len(outs) // (2 * len(TORCH_DIST))) for n, *_ in TORCH_DIST):
        zerompi = json.loads((tmp / f"{name}-{len(runs[name])}.json").read_text())["step_times_s"]
        torch = lines(outs[2 * i + 1])[-1]["step_s"]
        runs[name].append((zerompi, torch))
    return sr.torch_dist_rows(runs, {name: (n, stage, kind) for name, n, stage, kind in TORCH_DIST},
                              TORCH_DIST_WARMUP)


def torch_dist_missing():
    """Why PyTorch's distributed side cannot run here (None when it can)."""
    try:
        proc = subprocess.run([TORCH_PYTHON or PY, "-c", "import torch.distributed as d; assert d.is_available()"],
                              capture_output=True, text=True, timeout=300)
        ok = proc.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if ok:
        return None
    return ("PyTorch (with torch.distributed) is not installed beside zerompi (pip install torch)"
            if TORCH_PYTHON is None else "--torch-python's interpreter cannot import torch.distributed")


def cluster_argv(mode, tmp):
    import cluster_mpi
    steps = pick(mode, ["--steps", "30", "--warmup", "5"], ["--steps", "20", "--warmup", "5"],
                 ["--steps", "3", "--warmup", "1"])
    return script("bench_cluster.py") + ["--nodes", "4", "--ranks-per-node", "1", "--link", "250mbit", "--mpi",
                                         cluster_mpi.flavour(), "--only", "flat3,zeropp",
                                         "--json", str(tmp / "cluster.json")] + steps


def cluster_missing():
    import cluster
    why = cluster.unavailable()
    return f"the emulated cluster cannot be built here: {why}" if why else None


def lines(text):
    """The JSON objects of a script's stdout, one per line (other lines ignored)."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def document(text):
    """The one JSON document a script prints (indented), from its first line that opens an object."""
    at = [i for i, line in enumerate(text.splitlines()) if line.startswith("{")]
    return json.loads("\n".join(text.splitlines()[at[0]:]))


def path(name, argv, parse, rows_if_skipped=(), missing=None, ok_rc=(0,)):
    return {"name": name, "argv": argv, "parse": parse, "skip_rows": rows_if_skipped, "missing": missing,
            "ok_rc": ok_rc}


OFFLOAD_DIR = None      # --offload-dir: a folder on the disk under test (default: the suite's temporary folder)
PATHS = [
    path("floor", floor_argv, lambda o, t: sr.floor_rows(lines(o[0]))),
    path("collectives", collectives_argv, collectives_parse),
    path("signature", signature_argv, lambda o, t: sr.signature_rows(document(o[0]))),
    path("check_floor", check_floor_argv, lambda o, t: sr.check_floor_rows(document(o[0])),
         ("check_c_1mib_all_gather", "check_c_64mib_all_gather"), check_floor_missing),
    path("adam", adam_argv, lambda o, t: sr.adam_rows(lines(o[0]))),
    path("stages", stages_argv, lambda o, t: sr.stages_rows(lines(o[0]))),
    path("tp", tp_argv, lambda o, t: sr.tp_rows(document(o[0]))),
    path("offload", offload_argv, lambda o, t: sr.offload_rows(document(o[0]))),
    path("checkpoint", checkpoint_argv, lambda o, t: sr.checkpoint_rows(document(o[0])), ok_rc=(0, 1)),
    path("pipeline_1f1b", pipeline_argv(4, "dp", "1f1b"),
         lambda o, t: sr.pipeline_rows(document(o[0]), "bubble_1f1b_pp2_dp2")),
    path("pipeline_zbh1", pipeline_argv(2, "pp", "zb-h1"),
         lambda o, t: sr.pipeline_rows(document(o[0]), "bubble_zbh1")),
    path("torch", torch_argv, lambda o, t: sr.torch_rows(lines(o[0])), ("gpt_vs_torch_gpt-6x256",), torch_missing),
    path("torch_dist", torch_dist_argv, torch_dist_parse, tuple(n for n, *_ in TORCH_DIST), torch_dist_missing),
    path("cluster", cluster_argv, lambda o, t: sr.cluster_rows(json.loads((t / "cluster.json").read_text())),
         ("zeropp_4x1", "estimate_error_flat3_4x1", "estimate_error_zeropp_4x1"), cluster_missing, ok_rc=(0, 1)),
]


def shown(argv, tmp: Path) -> str:
    """A command as the table shows it: no path of this machine."""
    names = {PY: "python", mpiexec(): "mpiexec", **({TORCH_PYTHON: "TORCH_PYTHON"} if TORCH_PYTHON else {})}
    out = []
    for a in argv:
        a = names.get(a, a).replace(str(tmp), "TMP").replace(str(ROOT) + os.sep, "")
        out.append(a.replace(str(OFFLOAD_DIR), "DIR") if OFFLOAD_DIR else a)
    return " ".join(out)


def run_path(p, mode: str, timeout: float) -> dict:
    """Runs one path's commands; its rows and checks, or its error (the command's tail)."""
    t0 = time.perf_counter()
    why = p["missing"]() if p["missing"] else None
    if why:
        goal = {n: sr.GOALS.get(n) for n in p["skip_rows"]}
        return {"rows": [sr.skipped(n, why, goal[n]) for n in p["skip_rows"]], "checks": [], "seconds": 0.0}
    tmp = Path(tempfile.mkdtemp(prefix="bench_suite-"))
    try:
        return run_commands(p, mode, timeout, tmp, t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_commands(p, mode: str, timeout: float, tmp: Path, t0: float) -> dict:
    argv, fail = [], lambda what: {"error": what, "rows": [], "checks": [], "seconds": time.perf_counter() - t0}
    try:
        argvs = p["argv"](mode, tmp)
        argvs = argvs if isinstance(argvs[0], list) else [argvs]
        outs = []
        for argv in argvs:
            proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(ROOT), env=job_env(ROOT),
                                  timeout=timeout)
            if proc.returncode not in p["ok_rc"]:
                return fail(f"exit {proc.returncode}: {shown(argv, tmp)}\n{proc.stderr[-1500:]}")
            outs.append(proc.stdout)
    except (subprocess.TimeoutExpired, OSError) as e:
        what = f"timed out after {timeout:.0f} s" if isinstance(e, subprocess.TimeoutExpired) else str(e)
        return fail(f"{what}: {shown(argv, tmp)}")
    try:
        rows, checks = p["parse"](outs, tmp)
    except (ValueError, KeyError, IndexError, TypeError, StopIteration, OSError) as e:
        return fail(f"its output could not be read ({type(e).__name__}: {e}): {shown(argv, tmp)}")
    return {"rows": rows, "checks": checks, "seconds": time.perf_counter() - t0,
            "commands": list(dict.fromkeys(shown(argv, tmp) for argv in argvs))}


def run_suite(names, mode: str, timeout: float, log=lambda s: None) -> dict:
    """Every named path in turn; the suite's result (rows, checks, errors, seconds per path)."""
    rows, checks, errors, seconds, commands = [], [], {}, {}, []
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    for p in PATHS:
        if p["name"] not in names:
            continue
        r = run_path(p, mode, timeout)
        rows += r["rows"]
        checks += r["checks"]
        commands += r.get("commands", [])
        seconds[p["name"]] = round(r["seconds"], 1)
        if "error" in r:
            errors[p["name"]] = r["error"]
        log(f"{p['name']}: {r['seconds']:.1f} s" + (f", ERROR {r['error'].splitlines()[0]}" if "error" in r else ""))
    load.append(os.getloadavg()[0])
    return {"mode": mode, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - start, 1), "seconds_per_path": seconds,
            "load_average_1min": load, "commands": commands, "rows": rows, "checks": checks, "errors": errors}


def ran(rows) -> list:
    """--check: every row not skipped has a finite measurement and floor (its path ran and reported)."""
    return [sr.check(f"ran {r['name']}", r["ratio"] is not None and math.isfinite(r["ratio"]),
                     "measured and floor reported, finite") for r in rows if not r.get("skipped")]


def main(argv=None) -> int:
    global OFFLOAD_DIR, TORCH_PYTHON
    names = [p["name"] for p in PATHS]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smaller sizes, fewer steps and rounds")
    group.add_argument("--check", action="store_true", help="every path at its smallest size: it runs, bits hold")
    ap.add_argument("--json", help="write the result (rows, checks, errors) here")
    ap.add_argument("--doc", help="write the Markdown table here, and its plot beside it (.png)")
    ap.add_argument("--only", default=",".join(names), help=f"comma-separated paths, of {', '.join(names)}")
    ap.add_argument("--note", default="", help="a paragraph for --doc (e.g. that other jobs loaded the machine)")
    ap.add_argument("--under-load", action="store_true", help="--doc says the machine was shared (a standard note)")
    ap.add_argument("--offload-dir", help="where offload's files go (a real disk; default a temporary folder)")
    ap.add_argument("--torch-python", metavar="PY",
                    help="the interpreter that has PyTorch, for torch_dist (default: this one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one command may run")
    a = ap.parse_args(argv)
    only = a.only.split(",")
    unknown = [n for n in only if n not in names]
    if unknown:
        ap.error(f"--only: unknown paths {unknown}; use some of {', '.join(names)}")
    OFFLOAD_DIR = a.offload_dir
    if a.torch_python and not shutil.which(a.torch_python):
        ap.error(f"--torch-python {a.torch_python}: no such program; give a Python interpreter that has torch")
    TORCH_PYTHON = shutil.which(a.torch_python) if a.torch_python else None
    mode = "quick" if a.quick else "check" if a.check else "full"
    result = run_suite(only, mode, a.timeout, log=lambda s: print(s, file=sys.stderr, flush=True))
    import suite_doc
    result["machine"] = suite_doc.machine()
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    if a.doc:
        suite_doc.write(result, Path(a.doc), " ".join(filter(None, [a.note, suite_doc.NOTE_UNDER_LOAD
                                                                     if a.under_load else ""])))
    if mode == "check":
        result["checks"] += ran(result["rows"])
    else:
        print(suite_doc.table(result["rows"]))
    for c in result["checks"]:
        print(f"{'ok    ' if c['ok'] else 'BROKEN'}  {c['name']}: {c['what']}")
    for name, err in result["errors"].items():
        print(f"FAILED  {name}: {err}")
    print(f"suite ({mode}): {result['seconds']:.0f} s")
    return 1 if result["errors"] or not all(c["ok"] for c in result["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
