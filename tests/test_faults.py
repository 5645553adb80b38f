"""A job that fails must end, quickly, and say why (docs/failures.md).

Faults are injected with ZEROMPI_FAULT=KIND@rankR:stepS into `mpiexec -n 3 ... --stage 3`;
each job must end with a non-zero status and a message naming the cause, within the
subprocess timeout (a hang fails the test, never CI). The oracle for "parameters never
take a non-finite value" is a run without the fault that stops one step earlier.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, mpiexec, one_line, run_mpi, run_train
from zerompi.engine.config import ZeroConfig
from zerompi.comm.consistency import flatten, mismatch_message, rank_set
from zerompi.errors import EXIT_TIMEOUT, ConfigError
from zerompi.engine.faults import Fault, GradientGuard, InjectedFault, parse_fault, range_limit
from zerompi.comm.watchdog import TIMEOUT_ENV, WaitRecord, Watchdog, default_timeout_s, describe_wait, watched

pytestmark = pytest.mark.every_mpi       # CI runs these under Open MPI too (.ci/run)

SMALL = ["--model", "mlp", "--width", "32", "--depth", "3", "--batch", "12", "--bucket-mb", "0.002"]
TIMEOUT_S = 5      # the watchdog's timeout in these jobs: short, so a hang ends fast
LIMIT = 90         # every job must end within this (the bar)


def train_args(*flags):
    return ["-m", "zerompi.train", *SMALL, *flags]


def env_with(**kv):
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROMPI_FAULT", TIMEOUT_ENV)}
    env.update(kv)
    return env


# ---- injected faults end the whole job ------------------------------------------------
@pytest.mark.parametrize("kind", ["raise", "exit", "hang"])
def test_fault_on_one_rank_ends_the_job(kind):
    proc = run_mpi(3, train_args("--stage", "3", "--steps", "50", "--timeout-s", TIMEOUT_S), timeout=LIMIT,
                   env=env_with(ZEROMPI_FAULT=f"{kind}@rank1:step3"), check=False)
    assert proc.returncode != 0, proc.stderr
    err = proc.stderr
    assert "step     4/" not in proc.stdout       # nobody went on past the failing step
    if kind == "raise":
        assert "rank 1 failed" in err and "injected fault 'raise' on rank 1 at step 3" in err
    else:
        assert f"injected fault '{kind}' on rank 1 at step 3" in err
    if kind == "hang":
        # The others' watchdogs end it, naming the operation, bucket, step and timeout.
        assert proc.returncode == EXIT_TIMEOUT, err
        lines = [err_line for err_line in err.splitlines() if "collective timeout" in err_line]
        assert lines, err
        line = lines[0]
        assert ("reduce_scatter of bucket" in line or "all_gather of bucket" in line), line
        assert "at step 3" in line and f"timeout {TIMEOUT_S} s" in line
        assert line.startswith("zerompi: rank 0:") or line.startswith("zerompi: rank 2:"), line


# ---- faults outside the step: every collective of the job is watched --------------------------
FAST_TIMEOUT_S = 2   # the watchdog's timeout in the tests below
FAST_LIMIT = 60      # without the watchdog these jobs hang: the subprocess timeout fails the test


def _timeout_line(err: str) -> str:
    lines = [err_line for err_line in err.splitlines() if "collective timeout" in err_line]
    assert lines, err
    waited = float(lines[0].split("waited ")[1].split(" s in ")[0])
    assert FAST_TIMEOUT_S <= waited < FAST_TIMEOUT_S + 1.5, lines[0]   # fired on time, not late
    assert f"timeout {FAST_TIMEOUT_S} s" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("fault, op", [("hang@rank1:step2:save", "checkpoint save: "),
                                       ("exit@rank1:step2:save", None),
                                       ("hang@rank1:step2:metrics", "final metrics: all-reduce (max)")])
def test_fault_outside_the_step_ends_the_job(tmp_path, fault, op):
    """A rank that hangs (or exits) right before a checkpoint save or the final metrics: the
    others' watchdogs name the operation and end the job (status 3), or mpiexec ends it."""
    flags = ["--stage", "3", "--steps", "2", "--timeout-s", FAST_TIMEOUT_S, "--save-dir", tmp_path / "ck"]
    proc = run_mpi(3, train_args(*flags), timeout=FAST_LIMIT, env=env_with(ZEROMPI_FAULT=fault), check=False)
    err = proc.stderr
    where = "the checkpoint save's" if fault.endswith("save") else "the final metrics'"
    assert f"injected fault '{fault.split('@')[0]}' on rank 1 at step 2, before {where} first collective" in err
    assert not (tmp_path / "ck" / "latest").exists() or fault.endswith("metrics")
    if op is None:                               # os._exit: mpiexec sees it and ends the others
        assert proc.returncode in (1, 9), err
        return
    assert proc.returncode == EXIT_TIMEOUT, err
    line = _timeout_line(err)
    assert f"in {op}" in line and "at step 2" in line, line
    assert line.startswith("zerompi: rank 0:") or line.startswith("zerompi: rank 2:"), line


HANG_BEFORE = """
import sys, time
from mpi4py import MPI
from zerompi import ZeroConfig, ZeroEngine
from zerompi.train.models.mlp import MLP
comm = MPI.COMM_WORLD
what, ck = sys.argv[1], sys.argv[2]
comm.Barrier()                     # start together: uneven start-up is not what is tested
engine = ZeroEngine(MLP(16, 3).init_layers(), ZeroConfig(stage=3, bucket_mb=0.0005, timeout_s=float(sys.argv[3])))
if what == "load":
    engine.save(ck)
if comm.rank == 1:
    time.sleep(3600)               # never joins the collective below
engine.full_parameters() if what == "full_parameters" else engine.load(ck)
"""


@pytest.mark.parametrize("what, op", [("full_parameters", "gather_master (fp32 all-gather) of bucket 0 at step 0"),
                                      ("load", "checkpoint load: agreement on the manifest and checksums")])
def test_hang_before_a_library_collective_ends_the_job(tmp_path, what, op):
    """The library path: engine.full_parameters() and engine.load() are watched too."""
    proc = run_mpi(3, ["-c", HANG_BEFORE, what, tmp_path / "ck", FAST_TIMEOUT_S], timeout=FAST_LIMIT,
                   env=env_with(), check=False)
    assert proc.returncode == EXIT_TIMEOUT, proc.stderr
    line = _timeout_line(proc.stderr)
    assert f"in {op} (timeout" in line, line


def test_config_mismatch_mpmd_ends_at_once():
    """`mpiexec -n 1 ... --width 64 : -n 1 ... --width 128`: both parse; the check names field and ranks."""
    t = time.monotonic()
    proc = run_mpmd([["-m", "zerompi.train", "--model", "mlp", "--width", "64"],
                     ["-m", "zerompi.train", "--model", "mlp", "--width", "128"]])
    one_line(proc, 2, "mismatch", "width = 64 on rank 0, 128 on rank 1")
    assert time.monotonic() - t < LIMIT


ENGINE_MISMATCH = """
import json
from mpi4py import MPI
from zerompi import ZeroConfig, ZeroEngine
from zerompi.errors import MismatchError
from zerompi.train.models.mlp import MLP
comm = MPI.COMM_WORLD
try:
    ZeroEngine(MLP(16, 2).init_layers(), ZeroConfig(stage=2, bucket_mb=0.001 if comm.rank == 2 else 1.0))
    error = None
except MismatchError as e:
    error = str(e)
errors = comm.gather(error)     # every rank raised together, so the job is still whole
if comm.rank == 0:
    print(json.dumps(errors))
"""


def test_engine_mismatch_raises_on_every_rank():
    """The library path: every rank raises the same MismatchError naming the field and the ranks."""
    proc = run_mpi(3, ["-c", ENGINE_MISMATCH], timeout=LIMIT)
    errors = json.loads(proc.stdout)
    assert len(errors) == 3 and len(set(errors)) == 1, errors     # the same message on every rank
    assert errors[0].startswith("engine configuration mismatch")
    assert "zero.bucket_mb = 1.0 on ranks 0-1, 0.001 on rank 2" in errors[0] and "layout.buckets" in errors[0]


# ---- non-finite gradients -----------------------------------------------------------------
def test_nan_in_fp32_is_an_error_naming_step_bucket_rank():
    proc = run_mpi(3, train_args("--stage", "2", "--dtype", "fp32", "--steps", "6"), timeout=LIMIT,
                   env=env_with(ZEROMPI_FAULT="nan@rank2:step2"), check=False)
    # Every gradient of rank 2 is NaN, so the first bucket (0) is the first non-finite one.
    one_line(proc, 1, "non-finite gradients at step 2: first in bucket 0 on rank 2;")
    assert "step     2/" not in proc.stdout


@pytest.mark.parametrize("mesh,rank,where", [
    (["--tp", "2"], 3, "first in bucket 0 on rank 3 (TP rank 1);"),
    (["--tp", "2"], 1, "first in bucket 0 on rank 1 (TP rank 1);"),
    (["--pp", "2", "--micro-batches", "2"], 3, "first in bucket 0 of model chunk 1 on rank 3;"),
])
def test_nan_under_tp_or_pp_names_the_world_rank_that_had_it(mesh, rank, where):
    """The report was gathered over the data-parallel group alone, and rank 0 printed 'bucket -1, in the slice
    rank -1 reduces: every rank's own gradients were finite' (another TP rank's, or stage's, NaN), or named a
    data-parallel index as a rank; it now looks at every rank the step's non-finite count is summed over."""
    proc = run_mpi(4, ["-m", "zerompi.train", *SMALL[:4], "--depth", "4", "--batch", "8", "--stage", "2", "--dtype",
                       "fp32", "--steps", "3", *mesh], timeout=LIMIT,
                   env=env_with(ZEROMPI_FAULT=f"nan@rank{rank}:step2"), check=False)
    line = one_line(proc, 1, f"non-finite gradients at step 2: {where}")
    assert "bucket -1" not in line and "rank -1" not in line


@pytest.mark.parametrize("stage", [1, 3])
def test_nan_in_fp16_skips_the_step_and_keeps_the_parameters(tmp_path, stage):
    """nan at the last step: the step is skipped, the scale halves, and the parameters are
    bit-equal to those of a run without the fault that stops one step before."""
    flags = ["--stage", str(stage), "--dtype", "fp16"]
    faulty = run_train(3, tmp_path, *SMALL, *flags, "--steps", "4", env=env_with(ZEROMPI_FAULT="nan@rank1:step4"),
                       tag="faulty")
    clean = run_train(3, tmp_path, *SMALL, *flags, "--steps", "3", env=env_with(), tag="clean")
    assert faulty["steps_applied"] == 3 == clean["steps_applied"]
    assert faulty["loss_scale"] == clean["loss_scale"] / 2
    assert faulty["final_params_sha256"] == clean["final_params_sha256"]
    assert faulty["losses"][:3] == clean["losses"]


def test_max_skipped_steps_is_an_error():
    """A loss scale of 1e30 overflows fp16 every step: the 4th skip in a row stops the job."""
    proc = run_mpi(3, train_args("--stage", "2", "--steps", "20", "--loss-scale", "1e30", "--max-skipped-steps", "4"),
                   timeout=LIMIT, env=env_with(), check=False)
    assert proc.returncode == 1, proc.stderr
    assert ("4 consecutive steps skipped for non-finite fp16 gradients (ZeroConfig.max_skipped_steps, "
            "--max-skipped-steps: 4)") in proc.stderr
    assert "every parameter is still finite" in proc.stderr
    assert "step 4: first in bucket 0 on rank 0" in proc.stderr
    assert proc.stdout.count("(skipped: overflow)") == 3


def test_guard_names_first_bad_bucket_and_range():
    """Unit: the local check flags NaN, inf and fp16-overflowing values, and keeps the lowest bucket."""
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(range_limit(np.float16))) and np.float16(65519.9) == 65504
        assert np.isinf(np.float32(range_limit(np.float32)))
        assert np.float32(np.nextafter(range_limit(np.float32), 0)) == np.finfo(np.float32).max
    g = GradientGuard(rank=0, dtype=np.float16, max_skipped_steps=3)
    ok = {"w": np.ones(4, np.float32)}
    g.on_grads(1, 5, ok)
    assert g.first_bad_bucket == -1
    g.on_grads(1, 4, {"w": np.array([1, 65520.0], np.float32)})
    g.on_grads(1, 2, {"w": np.array([np.nan, 0], np.float32)})
    g.on_grads(1, 3, {"w": np.array([-np.inf], np.float32)})
    assert g.first_bad_bucket == 2
    g.on_grads(2, 1, {"w": np.array([65519.0], np.float32)})   # a new step resets; 65519 rounds to 65504
    assert g.first_bad_bucket == -1
    nan = GradientGuard(rank=1, dtype=np.float32, max_skipped_steps=3, fault=Fault("nan", 1, 2))
    assert np.isfinite(nan.on_grads(1, 0, ok)["w"]).all()
    assert np.isnan(nan.on_grads(2, 0, ok)["w"]).all() and nan.first_bad_bucket == 0


# ---- fault grammar, timeout settings ------------------------------------------------------
@pytest.mark.parametrize("text", ["bogus", "hang@rank1", "sleep@rank0:step1", "nan@rank1:step0", "raise@1:2",
                                  "exit@rank-1:step2"])
def test_bad_fault_grammar_is_a_config_error(text):
    with pytest.raises(ConfigError, match=r"ZEROMPI_FAULT=.*KIND@rankR:stepS"):
        parse_fault(text)


def test_fault_grammar_parses():
    assert parse_fault("hang@rank1:step3") == Fault("hang", 1, 3) == Fault("hang", 1, 3, "backward")
    assert str(parse_fault(" nan@rank12:step40 ")) == "nan@rank12:step40"
    assert parse_fault("exit@rank0:step2:save") == Fault("exit", 0, 2, "save")
    assert str(parse_fault("hang@rank2:step5:metrics")) == "hang@rank2:step5:metrics"
    for bad in ("nan@rank1:step2:save", "hang@rank1:step2:load", "hang@rank1:step2:"):
        with pytest.raises(ConfigError, match="POINT one of backward"):
            parse_fault(bad)


def test_fault_points_fire_only_where_asked():
    """Unit: a save/metrics fault never fires in the backward, and only at its own step and point."""
    g = GradientGuard(rank=1, dtype=np.float32, max_skipped_steps=3, fault=Fault("raise", 1, 2, "save"))
    g.on_grads(2, 0, {"w": np.ones(2, np.float32)})
    g.at("metrics", 2)
    g.at("save", 1)
    with pytest.raises(InjectedFault, match="on rank 1 at step 2, before the checkpoint save's first collective"):
        g.at("save", 2)


def test_watched_labels_name_the_operation_and_step():
    record = WaitRecord()
    comm = type("C", (), {"waiting": record})()
    with watched(comm, "checkpoint save: gather of shard entries", 7):
        op, tag, _ = record.current
    assert describe_wait(op, tag, step=99) == "checkpoint save: gather of shard entries at step 7"
    with watched(comm, "checkpoint load: agreement"):
        op, tag, _ = record.current
    assert describe_wait(op, tag, step=99) == "checkpoint load: agreement"    # not the watchdog's step
    assert describe_wait("all_gather", (4, 7), None) == "all_gather of bucket 4 at step 7"
    with watched(object(), "a bare mpi4py communicator: not timed"):
        assert record.current is None


def test_bad_fault_env_exits_2_with_one_line():
    proc = run_mpi(3, train_args("--steps", "2"), timeout=LIMIT, env=env_with(ZEROMPI_FAULT="nan@rank1"), check=False)
    one_line(proc, 2, "ZEROMPI_FAULT='nan@rank1' is not a fault")


def test_timeout_setting_precedence_and_validation():
    assert default_timeout_s({}) == 300.0
    assert default_timeout_s({TIMEOUT_ENV: "12.5"}) == 12.5
    for bad in ("0", "-3", "abc", "inf", "nan"):
        with pytest.raises(ConfigError, match=f"{TIMEOUT_ENV}='{bad}'"):
            default_timeout_s({TIMEOUT_ENV: bad})
    with pytest.raises(ConfigError, match="timeout_s=0"):
        ZeroConfig(timeout_s=0)
    assert ZeroConfig(timeout_s=7).timeout_s == 7
    with pytest.raises(ConfigError, match="max_skipped_steps=0"):
        ZeroConfig(max_skipped_steps=0)


# ---- the watchdog ----------------------------------------------------------------------------
def _wait_for(cond, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
    return cond()


def test_watchdog_fires_on_a_long_wait_and_names_it():
    record, codes = WaitRecord(), []
    dog = Watchdog(record, 0.3, rank=2, step=lambda: 9, abort=codes.append)
    with record("all_gather", (4, 7)):
        assert _wait_for(lambda: codes)
    dog.close(wait=True)
    assert codes == [EXIT_TIMEOUT]
    assert "rank 2: collective timeout" in dog.fired and "all_gather of bucket 4 at step 7" in dog.fired
    assert "timeout 0.3 s" in dog.fired


def test_watchdog_ignores_compute_and_short_waits():
    """Only one wait longer than the timeout counts: many short waits and long gaps do not."""
    record, codes = WaitRecord(), []
    dog = Watchdog(record, 0.3, rank=0, abort=codes.append)
    t = time.monotonic()
    while time.monotonic() - t < 1.0:           # 1 s of "compute" with 0.1 s waits in between
        with record("sum_scalars"):
            time.sleep(0.1)
        time.sleep(0.1)
    with record("all_gather", 0):
        with record("nested"):                   # nested waits keep the outer one
            assert record.current[0] == "all_gather"
    assert record.current is None
    dog.close(wait=True)
    assert codes == [] and dog.fired is None


LONG_COMPUTE = """
import time
from mpi4py import MPI
from zerompi import ZeroConfig, ZeroEngine
from zerompi.train.loop import run_micro_batch
from zerompi.train.models.mlp import MLP, TeacherData
comm = MPI.COMM_WORLD
model, data = MLP(16, 3), TeacherData(16, 3, 0)
comm.Barrier()                     # start together: the first wait must not absorb uneven start-up
engine = ZeroEngine(model.init_layers(), ZeroConfig(stage=3, bucket_mb=0.0005, timeout_s=1.5))
slow_backward = model.backward_layer
def backward_layer(i, *args):
    if engine.steps_taken == 0:
        time.sleep(0.8)            # a slow first step (say, compilation): 2.4 s of compute > timeout_s
    return slow_backward(i, *args)
model.backward_layer = backward_layer
for step in range(3):
    x, y = data.global_batch(step, 6)
    run_micro_batch(engine, model, x[comm.rank * 2:comm.rank * 2 + 2], y[comm.rank * 2:comm.rank * 2 + 2])
    engine.step()
engine.close()
done = comm.gather(f"done {comm.rank}")    # one print: ranks' lines would interleave
if comm.rank == 0:
    print(" ".join(done))
"""


def test_long_compute_does_not_trip_the_watchdog():
    proc = run_mpi(3, ["-c", LONG_COMPUTE], timeout=LIMIT, env=env_with())
    assert proc.stdout.strip() == "done 0 done 1 done 2"


# ---- SIGTERM / SIGINT / SIGUSR1 and the stop file: tests/test_stop.py ----------------------------------


# ---- the consistency message ---------------------------------------------------------------------
def test_mismatch_message_names_fields_and_rank_ranges():
    tables = [flatten({"a": 1, "z": {"s": 2}}) for _ in range(6)]
    tables[3] = flatten({"a": 1, "z": {"s": 3}})
    tables[5] = flatten({"a": 2, "z": {"s": 3}})
    msg = mismatch_message("train", tables)
    assert "mismatch" in msg
    assert "a = 1 on ranks 0-4, 2 on rank 5" in msg and "z.s = 2 on ranks 0-2, 4, 3 on ranks 3, 5" in msg
    assert rank_set([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7"


# ---- soak ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_soak_memory_is_flat_and_a_leak_is_caught():
    proc = run_mpi(2, ["scripts/soak.py", "--steps", "2000"], timeout=900)
    report = json.loads(proc.stdout)
    assert report["ok"] and report["steps"] == 2000, report["checks"]
    leak = run_mpi(2, ["scripts/soak.py", "--steps", "400", "--warmup", "100", "--every", "50",
                       "--leak-bytes", str(1 << 16)], timeout=900, check=False)
    leaked = json.loads(leak.stdout)
    assert leak.returncode == 1 and not leaked["checks"]["rss_slope_below_ceiling"]
    assert not leaked["checks"]["object_slope_below_ceiling"]


# ---- helpers -----------------------------------------------------------------------------------
def _env():
    return mpi_env(env_with(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))


def run_mpmd(programs, timeout=LIMIT) -> subprocess.CompletedProcess:
    """``mpiexec -n 1 python A... : -n 1 python B...`` (one rank each), with a timeout."""
    cmd = [mpiexec()]
    for i, args in enumerate(programs):
        cmd += ([":"] if i else []) + ["-n", "1", sys.executable, *[str(a) for a in args]]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
