"""An error raised on one rank only ends the job within seconds with that rank's line, whatever its
class (docs/failures.md, "An error on one rank"). The train CLI used to treat every JobError and
CheckpointError as raised on every rank at once and returned: raised on one rank (a read of its own
offload file failed), the others waited in their next collective until the watchdog (300 s) said
"collective timeout". Driver: tests/drivers/raise_one.py (rank 1 raises CLASS at step 2)."""
import ast

import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, zerompi_lines

DRIVER = ROOT / "tests" / "drivers" / "raise_one.py"
FLAGS = ["--model", "mlp", "--width", "16", "--depth", "2", "--batch", "12", "--steps", "4"]
LIMIT = 60        # far below the watchdog's default 300 s: a job left to the watchdog fails the test
FAST = {"ZEROMPI_TEST_AGREEMENT_S": "1"}   # the others' reports are awaited 1 s here, not ERROR_AGREEMENT_S

# Classes the CLI catches as raised on every rank: now confirmed first (errors.end_together).
TOGETHER = {"JobError": 1, "MismatchError": 2, "NonFiniteError": 1, "AgreedConfigError": 2, "OffloadError": 1,
            "CheckpointError": 2}
# Classes nobody catches: the abort hook prints them and ends every rank (as before; audited here too).
HOOKED = {"ConfigError": (2, "zerompi: error: raise_one: ConfigError"), "UsageError": (1, "zerompi: rank 1 failed:")}


def run_one(name, env=None, ranks=2):
    proc = run_mpi(ranks, [DRIVER, name, 1, *FLAGS], timeout=LIMIT, env=env, check=False)
    assert "step     4/" not in proc.stdout, proc.stdout         # nobody trained on past the failing step
    assert "collective timeout" not in proc.stderr, proc.stderr  # ended by the error, not by the watchdog
    return proc


@pytest.mark.parametrize("name", sorted(TOGETHER))
def test_an_error_the_cli_believes_agreed_but_raised_on_one_rank_ends_the_job(name):
    proc = run_one(name, FAST)
    lines = zerompi_lines(proc.stderr)
    assert proc.returncode == TOGETHER[name], (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"zerompi.train: error (rank 1): raise_one: {name} on rank 1 at step 2"), lines
    assert "rank 0 did not raise it" in lines[0], lines
    no_python_noise(proc.stderr)


@pytest.mark.every_mpi
def test_the_issues_case_a_one_rank_offload_error_ends_the_job_not_the_watchdog():
    """3 ranks, under both MPIs: the two that did not raise are named."""
    proc = run_one("OffloadError", FAST, ranks=3)
    assert proc.returncode == 1, proc.stderr
    line, = zerompi_lines(proc.stderr)
    assert "error (rank 1): raise_one: OffloadError" in line and "ranks 0, 2 did not raise it" in line, line


@pytest.mark.parametrize("name", sorted(HOOKED))
def test_an_error_nobody_catches_ends_the_job_by_the_abort_hook(name):
    proc = run_one(name)
    status, needle = HOOKED[name]
    assert proc.returncode == status and needle in proc.stderr, (proc.returncode, proc.stderr)


def test_every_error_class_is_audited():
    """Every exception class zerompi defines is in one of the lists above, or named here with the reason
    it cannot be raised on one rank mid-run: a new class must be sorted in."""
    elsewhere = {"HelpRequested": "start-up only: every rank reports it to the start-up agreement",
                 "OutputError": "rank 0 only, after the job's last collective: no rank waits for it",
                 "InjectedFault": "a RuntimeError: the abort hook (tests/test_faults.py)",
                 "BuildError": "a RuntimeError: the abort hook",
                 "ScheduleError": "start-up only: the train CLI makes and validates the schedule before the start-up "
                                  "agreement; a pipeline job agrees on it before any chunk runs",
                 "Deadlock": "a ScheduleError: the validator's, at start-up",
                 "UnknownFieldError": "a ConfigError of ZeroConfig(...): start-up (the CLI's agreement), or the "
                                      "library's abort hook as ConfigError"}
    defined = set()
    for path in (ROOT / "zerompi").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", "")).endswith(
                    ("Error", "Exception", "Requested", "Fault")) for b in node.bases):
                defined.add(node.name)
    assert defined - set(TOGETHER) - set(HOOKED) - set(elsewhere) == set(), defined
