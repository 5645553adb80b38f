"""In-memory replicas of the ranks' shards: their folders in node-local shared memory, and a checkpoint made of them.

A job's replicas live in ``ROOT/zerompi-replicas-JOB/`` (ROOT: /dev/shm, memory that outlives the process),
one folder per node and rank: ``node001/rank00002/step_000007/`` holds that rank's own shard file of step 7 and
the copy of its buddy's (the rank on another node that sends it its shard), in the checkpoint's own file format
(format.py), and, once every rank's copies of step 7 are complete (the agreement of replicas.py), the step's
manifest: its presence marks the step committed. :func:`assemble` hard-links the newest step whose every shard
survives somewhere into one checkpoint folder, which the train CLI's ``--resume`` restores (resharding to the
new world size) like any disk checkpoint. No MPI here.
"""
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

from .format import CheckpointError, manifest_text, read_manifest, shard_file
from .pointer import MANIFEST, fsync_dir

ROOT_ENV = "ZEROMPI_REPLICAS_ROOT"     # where the job folders live (default /dev/shm: node-local shared memory)
PREFIX = "zerompi-replicas-"
JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESTORE = "restore"                    # the assembled checkpoint the relaunched job resumes from
HEADER_BYTES = 128                     # a shard file's .npy header (version 1.0: padded to 64-byte lines)
RANKS = "ranks"                        # each rank's pid, host and step (the supervisor watches them)
STEP_DIR = re.compile(r"step_(\d{6})")
SPARE = ".spare"                       # a rank's step before the committed one: its files reused by the next step


def root() -> str:
    return os.environ.get(ROOT_ENV) or "/dev/shm"


def job_dir(job: str) -> str:
    return os.path.join(root(), PREFIX + job)


def rank_dir(job: str, node: int, rank: int) -> str:
    return os.path.join(job_dir(job), f"node{node:03d}", f"rank{rank:05d}")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step:06d}")


def commit(folder: str, step: int, manifest: dict) -> None:
    """Mark ``step`` committed in a rank's folder (its manifest, written whole then renamed into place), then
    remove the rank's older steps: the previous committed copy goes only once this one is."""
    here = step_dir(folder, step)
    for name in os.listdir(here):
        if name.endswith(".entry"):
            os.unlink(os.path.join(here, name))
    tmp = os.path.join(here, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest_text(manifest))
    os.rename(tmp, os.path.join(here, MANIFEST))
    for name in os.listdir(folder):
        m = STEP_DIR.fullmatch(name)
        if m and int(m.group(1)) != step:
            old = os.path.join(folder, name)
            if os.path.exists(os.path.join(folder, SPARE)):
                shutil.rmtree(old, ignore_errors=True)
            else:                      # its files are the next step's, overwritten in place (no new pages)
                os.unlink(os.path.join(old, MANIFEST)) if os.path.exists(os.path.join(old, MANIFEST)) else None
                os.rename(old, os.path.join(folder, SPARE))


def prepare(folder: str, step: int) -> str:
    """The folder of ``step`` in a rank's folder: the previous step's, once committed past (SPARE), renamed."""
    here, spare = step_dir(folder, step), os.path.join(folder, SPARE)
    if os.path.isdir(spare) and not os.path.exists(here):
        os.rename(spare, here)
    os.makedirs(here, exist_ok=True)
    return here


def _steps(job: str) -> Dict[int, List[str]]:
    """{step: the step folders of every rank folder of the job that hold something of it}."""
    out: Dict[int, List[str]] = {}
    base = job_dir(job)
    for node in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if not node.startswith("node") and node != RESTORE:   # the restore folder: a copy until the next commit
            continue
        for rank in sorted(os.listdir(os.path.join(base, node))):
            folder = os.path.join(base, node, rank)
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                m = STEP_DIR.fullmatch(name)
                if m:
                    out.setdefault(int(m.group(1)), []).append(os.path.join(folder, name))
    return out


def assemble(job: str) -> Tuple[int, str]:
    """Hard-link the newest committed step whose every shard has a surviving copy into ``JOB/restore/step_N``
    (its manifest beside them); returns (step, that folder). CheckpointError (one line) when no step is
    complete: it names the newest committed step and the shards of which no copy survives."""
    steps = _steps(job)
    missing: Optional[Tuple[int, List[int]]] = None
    for step in sorted(steps, reverse=True):
        manifests = [os.path.join(d, MANIFEST) for d in steps[step] if os.path.isfile(os.path.join(d, MANIFEST))]
        if not manifests:
            continue                   # written but never committed
        manifest, _ = read_manifest(os.path.dirname(manifests[0]))
        found, lost = {}, []
        for r, entry in enumerate(manifest["shards"]):
            copies = [os.path.join(d, entry["file"]) for d in steps[step]
                      if os.path.isfile(os.path.join(d, entry["file"]))
                      and os.path.getsize(os.path.join(d, entry["file"])) == entry["bytes"]]
            if copies:
                found[r] = copies[0]
            else:
                lost.append(r)
        if lost:
            missing = missing or (step, lost)
            continue
        out = os.path.join(job_dir(job), RESTORE, f"step_{step:06d}")
        if os.path.dirname(manifests[0]) == out:
            return step, out           # the restore folder of the last relaunch is the newest copy
        shutil.rmtree(os.path.join(job_dir(job), RESTORE), ignore_errors=True)
        os.makedirs(out)
        for r, path in found.items():
            os.link(path, os.path.join(out, shard_file(r)))
        shutil.copyfile(manifests[0], os.path.join(out, MANIFEST))
        fsync_dir(out)
        return step, out
    if missing:
        step, lost = missing
        raise CheckpointError(f"no surviving copy of shard{'s' if len(lost) > 1 else ''} "
                              f"{', '.join(map(str, lost))} of committed step {step} (a node and its buddy both "
                              f"lost) in {job_dir(job)}: the job cannot go on from memory")
    raise CheckpointError(f"no committed step in {job_dir(job)}: the job failed before its first step was "
                          "replicated")


def committed_step(job: str) -> Optional[int]:
    """The newest step committed in any rank folder of the job (None: none)."""
    done = [s for s, dirs in _steps(job).items() if any(os.path.isfile(os.path.join(d, MANIFEST)) for d in dirs)]
    return max(done) if done else None


def clean(job: str, keep: Optional[str] = None, whole: bool = True) -> None:
    """Remove the job's folder (``whole``), else its rank folders and pids only (a job's start and end: the
    supervisor's records stay); never ``keep`` (the restore folder being resumed from)."""
    base = job_dir(job)
    if not os.path.isdir(base):
        return
    keep = os.path.realpath(keep) if keep else None
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if keep and (keep == os.path.realpath(path) or keep.startswith(os.path.realpath(path) + os.sep)):
            continue
        if whole or name.startswith("node") or name in (RANKS, RESTORE):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    if whole and not keep or not os.listdir(base):
        shutil.rmtree(base, ignore_errors=True)
