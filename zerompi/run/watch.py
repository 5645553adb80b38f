"""One attempt of a supervised job: launched, watched until it ends or a rank dies, then ended whole.

The ranks of a ``--replicas`` job register their pid, host, the steps they have taken and their last committed
step in ``JOB/ranks/`` (train/replicas.py). :func:`attempt` polls them every POLL_S: a registered rank whose
process is gone (or a zombie) is a failure, detected then; the attempt's whole tree (the launcher, its proxies,
every registered rank) is killed at once (the survivors hold nothing the restore needs: the replicas are in
shared memory), and the MPI segments that appeared during the attempt and that no process holds are removed
(segments.py).
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..checkpoint.replica_files import RANKS, job_dir
from . import segments

POLL_S = 0.005      # how often the ranks' processes are looked at
READ_S = 0.1        # how often their files are read
GONE_S = 10.0       # the longest wait for the killed ranks to be gone before their segments are swept


@dataclass
class Outcome:
    """How an attempt ended: ``status`` (the launcher's exit status; None when the supervisor ended it),
    the ``dead`` ranks' records (pid, host, node, step), when the failure was detected, the ranks' records,
    and whether any rank of it registered (``started``: False when the launcher failed before any rank ran)."""
    status: Optional[int]
    dead: List[dict] = field(default_factory=list)
    detected_at: float = 0.0
    ranks: Dict[int, dict] = field(default_factory=dict)
    started: bool = False


def ranks_of(job: str) -> Dict[int, dict]:
    out = {}
    for path in glob.glob(os.path.join(job_dir(job), RANKS, "rank*.json")):
        try:
            with open(path) as f:
                info = json.load(f)
            out[info["rank"]] = info
        except (OSError, ValueError, KeyError):
            continue      # being replaced: read at the next poll
    return out


def alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(root: int) -> List[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def end_tree(proc: subprocess.Popen, pids=()) -> List[int]:
    """Kill the launcher, its descendants and ``pids`` (the ranks, which may have left its tree), then reap it;
    returns the processes signalled."""
    every = [proc.pid, *descendants(proc.pid), *pids]
    for pid in every:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    return every


def attempt(cmd: List[str], env: dict, job: str, poll: Callable[[], None]) -> Outcome:
    """Run ``cmd`` (the launcher) until it ends or a registered rank dies; ``poll()`` between looks."""
    before = segments.present()
    shutil.rmtree(os.path.join(job_dir(job), RANKS), ignore_errors=True)   # the last attempt's ranks
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    out, looked = Outcome(None), 0.0
    try:
        while proc.poll() is None:
            if time.monotonic() - looked > READ_S:      # the ranks' files: their steps, a relaunch's new pids
                out.ranks, looked = ranks_of(job), time.monotonic()
                poll()
            dead = [info for info in out.ranks.values() if not alive(info["pid"])]
            if dead:                             # a rank that finished (marked done, or its file gone) is no failure
                now, fresh = time.time(), ranks_of(job)
                dead = [d for d in dead if d["rank"] in fresh and fresh[d["rank"]]["pid"] == d["pid"]
                        and not fresh[d["rank"]].get("done")]
                out.ranks, looked = fresh, time.monotonic()
            if dead:
                out.dead, out.detected_at = dead, now
                break
            time.sleep(POLL_S)
        else:
            out.status, out.detected_at = proc.returncode, time.time()
            out.ranks = ranks_of(job) or out.ranks        # a rank registered since the last look
        out.started = bool(out.ranks)
    finally:
        pids = end_tree(proc, [info["pid"] for info in ranks_of(job).values()])
        until = time.monotonic() + GONE_S        # a killed process (a rank, a proxy) unmaps its segments as it goes
        while any(alive(p) for p in pids) and time.monotonic() < until:
            time.sleep(POLL_S)
        segments.sweep(before)
    return out
