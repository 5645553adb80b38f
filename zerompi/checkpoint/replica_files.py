"""In-memory replicas of the ranks' shards: their folders in node-local shared memory, and a checkpoint made of them.

A job's replicas live in ``ROOT/zerompi-replicas-JOB/`` (ROOT: /dev/shm, memory that outlives the process),
one folder per node and rank: ``node001/rank00002/step_000007/`` holds that rank's own shard file of step 7 and
the copy of its buddy's (the rank on another node that sends it its shard), in the checkpoint's own file format
(format.py), and, once every rank's copies of step 7 are complete (the agreement of replicas.py), the step's
manifest: its presence marks the step committed. A run with parts (``--tp``, ``--pp``) has them in the part
folders its disk checkpoints have (``pp1-of-2/shard_00000.npy``, a manifest each); an expert-parallel run (``--ep``)
its experts' in ``ep{j}-of-{K}/`` within the step's folder, beside the dense engine's shard files. :func:`assemble`
hard-links the newest step of which every part and shard survives somewhere into one checkpoint folder, which the
train CLI's ``--resume`` restores (resharding to the new data-parallel size) like any disk checkpoint. No MPI here.
"""
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

from .format import (PP_FOLDER, TP_FOLDER, CheckpointError, entry_kind, file_checksum, manifest_text, read_manifest,
                     shard_file)
from .parts import EP_FOLDER
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


def commit(folder: str, step: int, manifests: Dict[str, dict]) -> None:
    """Mark ``step`` committed in a rank's folder (the manifest of each part it holds: {part folder, '' for the
    step's folder itself: manifest}, each written whole then renamed into place), then remove the rank's older
    steps: the previous committed copy goes only once this one is."""
    here = step_dir(folder, step)
    for part, manifest in manifests.items():
        at = os.path.join(here, part)
        for name in os.listdir(at):
            if name.endswith(".entry"):
                os.unlink(os.path.join(at, name))
        tmp = os.path.join(at, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(manifest_text(manifest, indent=None))     # one line: json's C encoder, every step
        os.rename(tmp, os.path.join(at, MANIFEST))
    for name in os.listdir(folder):
        m = STEP_DIR.fullmatch(name)
        if m and int(m.group(1)) != step:
            old = os.path.join(folder, name)
            if os.path.exists(os.path.join(folder, SPARE)):
                shutil.rmtree(old, ignore_errors=True)
            else:                      # its files are the next step's, overwritten in place (no new pages)
                for at in part_dirs(old).values():
                    os.unlink(os.path.join(at, MANIFEST)) if os.path.exists(os.path.join(at, MANIFEST)) else None
                os.rename(old, os.path.join(folder, SPARE))


def part_dirs(here: str) -> Dict[str, str]:
    """{part: its folder} of a step folder ``here``: '' for ``here`` itself when it holds shard files or a manifest
    (a run without parts), else its part folders (``tp{r}-of-{K}``, ``pp{c}-of-{C}``, ``pp{c}-of-{C}/tp{r}-of-{K}``)."""
    out = {}
    for at, _, names in os.walk(here):
        if any(n == MANIFEST or n.startswith("shard_") for n in names):
            out["" if at == here else os.path.relpath(at, here)] = at
    return out


def whole_set(parts) -> List[str]:
    """The parts a whole step has, from the names of those found: every ``pp{c}-of-{C}`` and ``tp{r}-of-{K}`` of the
    largest C and K seen, crossed ([''] without parts); with expert-parallel parts (``ep{j}-of-{K}``: an MoE run's
    experts, beside its dense engine's part: '', ``tp{r}-of-{T}``, ``pp{c}-of-{C}``, ``pp{c}-of-{C}/tp{r}-of-{T}``)
    every one of the largest K too, beside each dense part of a chunk where any was seen (with --moe-every a
    chunk can hold no experts)."""
    def split(p):                     # (the dense part, K) of a part: K of its ep{j}-of-{K}, else 0
        m = EP_FOLDER.fullmatch(os.path.basename(p))
        return (os.path.dirname(p), int(m.group(2))) if m else (p, 0)
    chunk = lambda p: p.split(os.sep)[0] if PP_FOLDER.fullmatch(p.split(os.sep)[0]) else ""   # noqa: E731
    seen = [split(p) for p in parts]
    names = [p for p, k in seen if p and not k] + [p for p, k in seen if p and k]
    ep = max([k for _, k in seen] + [0])
    with_experts = {chunk(p) for p, k in seen if k}
    if not names:
        dense = [""]
    else:
        pp = [int(m.group(2)) for p in names for m in [PP_FOLDER.fullmatch(p.split(os.sep)[0])] if m]
        tp = [int(m.group(2)) for p in names for m in [TP_FOLDER.fullmatch(p.split(os.sep)[-1])] if m]
        chunks = [f"pp{c}-of-{max(pp)}" for c in range(max(pp))] if pp else [""]
        pieces = [f"tp{r}-of-{max(tp)}" for r in range(max(tp))] if tp else [""]
        dense = [os.path.join(c, t) if c and t else c or t for c in chunks for t in pieces]
    experts = [os.path.join(d, f"ep{j}-of-{ep}") for d in dense if chunk(d) in with_experts for j in range(ep)]
    return dense + experts


def prepare(folder: str, step: int) -> str:
    """The folder of ``step`` in a rank's folder: the previous step's, once committed past (SPARE), renamed."""
    here, spare = step_dir(folder, step), os.path.join(folder, SPARE)
    if os.path.isdir(spare) and not os.path.exists(here):
        os.rename(spare, here)
    os.makedirs(here, exist_ok=True)
    return here


def _steps(job: str) -> Dict[int, List[str]]:
    """{step: the step folders of the job that hold something of it}: every rank folder's, and the restore
    folder's (a copy of a whole step until the first commit after a relaunch)."""
    out: Dict[int, List[str]] = {}
    base = job_dir(job)
    folders = [os.path.join(base, RESTORE)]
    for node in _listdir(base):
        if node.startswith("node"):
            folders += [os.path.join(base, node, rank) for rank in _listdir(os.path.join(base, node))]
    for folder in folders:
        for name in _listdir(folder):
            m = STEP_DIR.fullmatch(name)
            if m:
                out.setdefault(int(m.group(1)), []).append(os.path.join(folder, name))
    return out


def _listdir(folder: str) -> List[str]:
    """Its names, sorted; [] when it is gone (a lost node's folder may be removed while it is read)."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _gather(folders: List[str], prefer: str) -> Tuple[Dict[Tuple[str, int], str], Dict[str, str], List[tuple]]:
    """For one step's ``folders``: (a copy of each shard {(part, slot): path}, a manifest of each part {part:
    folder}, what has no copy [(part, slot or None: the part's manifest)]); copies under ``prefer`` first. Where
    a shard has two copies of its size, the first whose checksum is its entry's (:func:`_sound`): a copy damaged
    in memory is passed over while the other is sound; a lone copy is taken as it is (the load verifies it and
    refuses a damaged one in one line)."""
    held: Dict[str, List[str]] = {}
    for d in sorted(folders, key=lambda d: not (d + os.sep).startswith(prefer)):
        for part, at in part_dirs(d).items():
            held.setdefault(part, []).append(at)
    found, manifests, lost = {}, {}, []
    for part in whole_set(held):
        dirs = held.get(part, [])
        with_manifest = [d for d in dirs if os.path.isfile(os.path.join(d, MANIFEST))]
        if not with_manifest:
            lost.append((part, None))
            continue
        manifests[part] = with_manifest[0]
        for r, entry in enumerate(read_manifest(with_manifest[0])[0]["shards"]):
            copies = [os.path.join(d, entry["file"]) for d in dirs
                      if _size(os.path.join(d, entry["file"])) == entry["bytes"]]
            if copies:
                found[(part, r)] = copies[0] if len(copies) == 1 else next(
                    (c for c in copies if _sound(c, entry)), copies[0])
            else:
                lost.append((part, r))
    return found, manifests, lost


def _sound(path: str, entry: dict) -> bool:
    """Whether the file at ``path`` has its manifest entry's checksum (zck64, or CRC-32: the replicas' kinds)."""
    kind = entry_kind(entry)
    try:
        return file_checksum(path, kind) == entry[kind]
    except (OSError, ValueError):      # gone meanwhile, or empty (no mapping)
        return False


def _lost_text(lost: List[tuple]) -> str:
    by_part: Dict[str, List[int]] = {}
    for part, slot in lost:
        by_part.setdefault(part, []).append(slot)
    said = []
    for part, slots in by_part.items():
        of = f" of {part}" if part else ""
        if None in slots:
            said.append(f"any shard{of}")
        else:
            said.append(f"shard{'s' if len(slots) > 1 else ''} {', '.join(map(str, slots))}{of}")
    return "; ".join(said)


def assemble(job: str) -> Tuple[int, str]:
    """Hard-link the newest committed step of which every part (the plain run's one, each ``tp{r}-of-{K}``,
    ``pp{c}-of-{C}``) has a manifest and every shard a surviving copy into ``JOB/restore/step_N`` (each part's
    manifest beside its shards, the folders of a disk checkpoint): never pieces of two steps. Returns (step, that
    folder). CheckpointError (one line) when no step is complete: it names the newest committed step and the
    shards of which no copy survives."""
    steps = _steps(job)
    restore = os.path.join(job_dir(job), RESTORE)
    missing: Optional[Tuple[int, List[tuple]]] = None
    for step in sorted(steps, reverse=True):
        if not any(os.path.isfile(os.path.join(at, MANIFEST)) for d in steps[step] for at in part_dirs(d).values()):
            continue                   # written but never committed
        out = os.path.join(restore, f"step_{step:06d}")
        found, manifests, lost = _gather(steps[step], out + os.sep)
        if lost:
            missing = missing or (step, lost)
            continue
        if all((p + os.sep).startswith(out + os.sep) for p in list(found.values()) + list(manifests.values())):
            return step, out           # the restore folder of the last relaunch is the newest copy
        fresh = restore + ".new"
        shutil.rmtree(fresh, ignore_errors=True)
        for part, at in manifests.items():
            os.makedirs(os.path.join(fresh, os.path.basename(out), part))
            shutil.copyfile(os.path.join(at, MANIFEST), os.path.join(fresh, os.path.basename(out), part, MANIFEST))
        for (part, r), path in found.items():
            os.link(path, os.path.join(fresh, os.path.basename(out), part, shard_file(r)))
        shutil.rmtree(restore, ignore_errors=True)
        os.rename(fresh, restore)
        for at in part_dirs(out).values():
            fsync_dir(at)
        return step, out
    if missing:
        step, lost = missing
        raise CheckpointError(f"no surviving copy of {_lost_text(lost)} of committed step {step} (a node and its "
                              f"buddy both lost) in {job_dir(job)}: the job cannot go on from memory")
    raise CheckpointError(f"no committed step in {job_dir(job)}: the job failed before its first step was "
                          "replicated")


def committed_step(job: str) -> Optional[int]:
    """The newest step committed in any step folder of the job (None: none)."""
    done = [s for s, dirs in _steps(job).items()
            if any(os.path.isfile(os.path.join(at, MANIFEST)) for d in dirs for at in part_dirs(d).values())]
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
        if whole or name.startswith("node") or name in (RANKS, RESTORE, RESTORE + ".new"):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    if whole and not keep or not os.listdir(base):
        shutil.rmtree(base, ignore_errors=True)
