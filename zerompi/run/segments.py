"""MPI's shared-memory segments that killed jobs leave in /dev/shm: found and removed.

A rank killed (a fault, a lost node, the supervisor ending a failed attempt) never unlinks its launcher's
segment: MPICH's ``mpich_shm_*`` and Open MPI's ``sm_segment.*`` pile up, one per failed run. :func:`sweep`
removes only the segments that appeared since a listing taken before (:func:`present`) and that no process maps
or holds open, so the other jobs on the machine keep theirs. The supervisor sweeps after each failed attempt;
the test session (tests/shm.py) at its end.
"""
import os
import re
from pathlib import Path
from typing import Iterable, List, Set

SHM = Path("/dev/shm")
SEGMENT = re.compile(r"(mpich_shm_|sm_segment\.|vader_segment\.)")   # MPICH's and Open MPI's names


def present(folder: Path = SHM) -> Set[str]:
    """The names in ``folder`` now (empty where there is no such folder)."""
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def held(folder: Path = SHM) -> Set[str]:
    """The paths under ``folder`` that some process maps or holds open (read from /proc)."""
    prefix, out = str(folder) + "/", set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    out.add(path.replace(" (deleted)", ""))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    out.add(target)
        except OSError:        # a process that ended meanwhile, or one this user may not read
            continue
    return out


def sweep(before: Iterable[str], folder: Path = SHM) -> List[str]:
    """Remove the MPI segments in ``folder`` that are not in ``before`` and that no process holds; their names."""
    new = sorted(n for n in present(folder) - set(before) if SEGMENT.match(n))
    if not new:
        return []
    busy, gone = held(folder), []
    for name in new:
        path = folder / name
        if str(path) in busy:
            continue
        try:
            path.unlink()
            gone.append(name)
        except OSError:
            pass
    return gone
