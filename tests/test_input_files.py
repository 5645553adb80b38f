"""Input files and the counts in them are bounded (zerompi/inputs.py, pipeline/validate.py): a FIFO, a device or
an oversized file named as an input is one line and exit 2 before anything is read; a chunk number far past any
schedule's is refused without a range of it being made; a long schedule validates in time linear in its actions.

Oracles: a subprocess timeout (a FIFO made the old tools wait forever, /dev/zero and the chunk number exhausted
memory, the quadratic validator ran for minutes) under a memory limit; and a brute-force count over every
(micro-batch, chunk, kind) for the validator's first miscounted action, on randomly broken schedules.
"""
import os
import random
import resource
import subprocess
import sys
from collections import Counter

import pytest

from tests.mpirun import ROOT
from zerompi.pipeline import actions, schedules, validate
from zerompi.pipeline.actions import Action, Schedule, ScheduleError

LIMIT = 60
MEMORY = 2 << 30                      # address space of a tool run here: a huge allocation fails, not the machine


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def tool(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=LIMIT, cwd=str(ROOT), preexec_fn=_limit_memory)


def one_line(proc, needle):
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_fifo_or_a_device_as_the_schedule_file_is_refused(fifo):
    one_line(tool("zerompi.estimate", "--pp", "2", "--micro-batches", "2", "--schedule-file", fifo),
             f"schedule file '{fifo}' is a FIFO (named pipe), not a regular file")
    one_line(tool("zerompi.estimate", "--pp", "2", "--micro-batches", "2", "--schedule-file", "/dev/zero"),
             "schedule file '/dev/zero' is a character device, not a regular file")


def test_a_fifo_as_a_run_s_metrics_is_refused(fifo):
    one_line(tool("zerompi.estimate", "--from-run", fifo), f"from_run='{fifo}' is a FIFO (named pipe), not a regular")
    one_line(tool("zerompi.plot", fifo), f"{fifo} is a FIFO (named pipe), not a regular file")


def test_a_schedule_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:                    # sparse: no disk used
        f.truncate(actions.MAX_FILE_BYTES + 1)
    with pytest.raises(ScheduleError, match=f"schedule file '{big}' has 67,108,865 bytes, more than the "
                                            "67,108,864 allowed"):
        actions.read(str(big))


def test_a_huge_chunk_number_is_refused_without_a_range_of_it(tmp_path):
    good = schedules.make("1f1b", 2, 2).text()
    path = tmp_path / "s.csv"
    path.write_text(good.replace("0F0,", "99999999999F0,", 1))
    one_line(tool("zerompi.estimate", "--pp", "2", "--micro-batches", "2", "--schedule-file", path),
             "are never computed; every chunk 0..99999999999 needs its F and B")
    few = Schedule(((Action("F", 0, 0), Action("B", 0, 0)), (Action("F", 0, 3), Action("B", 0, 3))))
    with pytest.raises(ScheduleError, match=r"chunks \[1, 2\] are never computed"):     # few: all of them named
        validate.check(few)


def test_a_long_schedule_validates_in_linear_time():
    """8 stages x 2000 micro-batches of ZB-H1 (80,000 actions): minutes when each action rescanned the schedule."""
    proc = tool("zerompi.estimate", "--pp", "8", "--micro-batches", "2000", "--schedule", "zb-h1")
    assert proc.returncode == 0 and "bubble fraction        0.0012" in proc.stdout, proc.stderr


def _first_miscounted_brute(s: Schedule):
    """The old validator's loop: every (micro-batch, chunk, kind) in order, the first not there once."""
    count = Counter(a for acts in s.actions for a in acts)
    for mb in range(s.micro_batches):
        for ch in range(s.chunks):
            for kind in ("F", "B") + (("W",) if s.split_backward else ()):
                if count[Action(kind, mb, ch)] != 1:
                    return Action(kind, mb, ch)
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_linear_compute_check_names_the_action_the_full_scan_names(seed):
    rng = random.Random(seed)
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved"])
    p = rng.choice([1, 2, 3])
    m = p * rng.choice([1, 2, 3])
    rows = [list(acts) for acts in schedules.make(name, p, m, 2 if name == "interleaved" else 1).actions]
    for _ in range(rng.choice([1, 2, 3])):        # drop, repeat or renumber a compute action
        r = rng.randrange(p)
        i = rng.choice([k for k, a in enumerate(rows[r]) if a.kind in actions.COMPUTE])
        a, how = rows[r][i], rng.choice(["drop", "repeat", "mb"])
        if how == "drop":
            del rows[r][i]
        elif how == "repeat":
            rows[r].insert(rng.randrange(len(rows[r]) + 1), a)
        else:
            rows[r][i] = Action(a.kind, rng.randrange(m + 1), a.chunk)
    s = Schedule(tuple(map(tuple, rows)), "broken")
    try:
        where = validate._placement(s)
    except ScheduleError:
        return                                    # a chunk or a rank left with nothing: another check's line
    want = _first_miscounted_brute(s)
    if want is None:
        validate._check_compute(s, where)
        return
    with pytest.raises(ScheduleError) as e:
        validate._check_compute(s, where)
    assert str(e.value).startswith(f"schedule broken: {want} appears "), (str(e.value), want)
