"""Start-up never hangs: environment values are read when the job starts (one line, exit 2), every
rank reaches a timed agreement on start-up errors (a bad value or --help on one rank of an MPMD
launch, a rank that left, ranks running different programs), and a watchdog that fired ends
the job non-zero. Each job runs under mpiexec with a timeout: a hang fails the test."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.mpirun import ROOT, env_flag, launcher, launcher_env, mpiexec, no_python_noise, run_mpi, zerompi_lines
from zerompi.comm.watchdog import TIMEOUT_ENV
from zerompi.errors import EXIT_TIMEOUT

pytestmark = pytest.mark.every_mpi       # CI runs these under Open MPI too (.ci/run): MPMD, a rank that leaves

MLP = ["-m", "zerompi.train", "--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "2"]
LIMIT = 60     # seconds: each job here ends in about one start-up of the ranks; the old hangs were for ever


def clean_env(**kv):
    env = {k: v for k, v in os.environ.items() if k not in (TIMEOUT_ENV, "ZEROMPI_FAULT")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), **launcher_env(), **kv)
    return env


def mpmd(*parts, timeout=LIMIT):
    """``mpiexec -n 1 [-env K V] python ARGS : -n 1 ...``: one rank per part, (env, args) each."""
    cmd = [mpiexec()]
    for i, (env, args) in enumerate(parts):
        cmd += ([":"] if i else []) + ["-n", "1"]
        for k, v in env.items():
            cmd += env_flag(k, v)
        cmd += [sys.executable, *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"timed out after {timeout}s (a hang): {' '.join(cmd)}\n{e.stderr}")


def error_lines(proc):
    """zerompi's lines on stderr (and the leave_early driver's), not the launcher's (tests/mpirun.py)."""
    no_python_noise(proc.stderr)
    return zerompi_lines(proc.stderr, ("zerompi", "leave_early"))


# ---- ZEROMPI_TIMEOUT_S is read when the job starts ---------------------------------------------
@pytest.mark.parametrize("value", ["abc", "inf"])
def test_bad_timeout_env_does_not_break_help_or_import(value):
    env = clean_env(**{TIMEOUT_ENV: value})
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--help"], capture_output=True, text=True,
                          timeout=LIMIT, env=env, cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m zerompi.train"), proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import zerompi.train.run, zerompi.bench.run, zerompi.engine.config"],
                          capture_output=True, text=True, timeout=LIMIT, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr


def test_bad_timeout_env_is_one_line_when_the_job_starts():
    proc = run_mpi(2, MLP, timeout=LIMIT, check=False, env={TIMEOUT_ENV: "abc"})
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerompi.train: error: ZEROMPI_TIMEOUT_S='abc' is not allowed") and proc.stdout == ""
    assert run_mpi(2, MLP + ["--timeout-s", "30"], timeout=LIMIT, env={TIMEOUT_ENV: "abc"}).returncode == 0


def test_estimate_ignores_the_timeout_env():
    proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--params", "1e9", "--ranks", "8"],
                          capture_output=True, text=True, timeout=LIMIT, env=clean_env(**{TIMEOUT_ENV: "abc"}),
                          cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stderr == "" and "16Ψ/N" in proc.stdout, proc.stderr


# ---- MPMD: one rank differs ---------------------------------------------------------------------
def test_bad_timeout_env_on_one_rank_ends_the_job_naming_it():
    t = time.monotonic()
    proc = mpmd(({}, MLP), ({TIMEOUT_ENV: "abc"}, MLP))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerompi.train: error (rank 1): ZEROMPI_TIMEOUT_S='abc'"), lines[0]
    assert time.monotonic() - t < LIMIT


@pytest.mark.parametrize("module", ["zerompi.train", "zerompi.bench"])
def test_help_on_one_rank_of_an_mpmd_launch_ends_the_job(module):
    rest = MLP[2:] if module == "zerompi.train" else []
    proc = mpmd(({}, ["-m", module, *rest]), ({}, ["-m", module, *rest, "--help"]))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--help was given to rank 1 only" in lines[0], lines[0]


@pytest.mark.parametrize("module", ["zerompi.train", "zerompi.bench"])
def test_help_on_every_rank_prints_it_once(module):
    proc = run_mpi(3, ["-m", module, "--help"], timeout=LIMIT, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.count("usage:") == 1 and proc.stdout.startswith(f"usage: python -m {module}")


def test_train_beside_bench_is_found_at_once():
    proc = mpmd(({}, MLP), ({}, ["-m", "zerompi.bench", "-b", "1K", "-e", "1K"]))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert ("the ranks run different programs: zerompi.train on rank 0, zerompi.bench on rank 1"
            in lines[0]), lines[0]
    assert "step " not in proc.stdout


@pytest.mark.parametrize("leaver", [1, 0])
def test_a_rank_that_leaves_before_the_agreement_is_named(leaver):
    """The agreement is timed: a rank that never comes is named within its timeout (2 s here)."""
    t = time.monotonic()
    proc = run_mpi(3, ["tests/drivers/leave_early.py", leaver, 2], timeout=LIMIT, check=False)
    lines = error_lines(proc)
    assert proc.returncode == 2 or _open_mpi_died_in_the_abort(proc), proc.stderr
    assert len(lines) == 1, proc.stderr
    if leaver:
        assert "rank 1 did not reach the start-up agreement within 2 s" in lines[0], lines[0]
    else:
        assert "rank 0 sent no start-up verdict within 4 s" in lines[0], lines[0]
    assert time.monotonic() - t < LIMIT


def _open_mpi_died_in_the_abort(proc) -> bool:
    """Open MPI 5.0.11's mpirun itself sometimes dies of SIGSEGV while it ends a job in which
    one rank had already exited when another called MPI_Abort (5 of 24 runs here; other aborts
    never): its banner names the abort, and the ranks' part, the one line, is still checked."""
    return (launcher() == "openmpi" and proc.returncode in (-signal.SIGSEGV, 128 + signal.SIGSEGV)
            and "MPI_ABORT was invoked" in proc.stderr)


# ---- a watchdog that fired ends the job non-zero ---------------------------------------------------
def test_a_fired_watchdog_ends_the_job_non_zero():
    # The watchdog fires when its thread (checking every millisecond) sees a wait under way: 2 steps of the
    # tiny MLP could end between two checks (seen once under Open MPI), 60 steps hold hundreds of waits.
    proc = run_mpi(2, MLP[:-1] + ["60", "--log-every", "100", "--timeout-s", "1e-9"], timeout=LIMIT, check=False)
    assert proc.returncode == EXIT_TIMEOUT, (proc.returncode, proc.stderr)
    assert "collective timeout" in proc.stderr and "timeout 1e-09 s" in proc.stderr
