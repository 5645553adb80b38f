"""Checkpoints whose every shard was written but that no one published: found, and published.

One concern: the temporary folder of a save its job never finished (``--async-save``: the job
failed in the steps after the shards were written, before the agreement that publishes them; a
kill between the last shard and the rename). Each save leaves what its publication needs in that
folder from the start (pointer.py's names): rank 0's manifest draft (the manifest without its shard
list) and, beside each shard file once it is fsynced, its entry (bytes, CRC-32). A folder with the
draft and an entry for every shard of the saving run, each file of the size its entry says, is a
complete checkpoint; so is one whose publication wrote its manifest (which checks, its own checksum
included) and ended before the rename, each shard of the size the manifest says (format.publish
writes the manifest before it removes the draft and the entries). :func:`recover` publishes it as
format.publish does (manifest, rename, ``latest`` when it is newer than what ``latest`` names),
instead of the next save deleting it. The shards' checksums are not read here (every load and
``inspect`` verifies them).

Who calls it, each alone in the folder (no MPI here): the train CLI at start (rank 0, holding the
save folder's lock: train/saves.py), every save before it makes its own temporary folder (rank 0),
and :func:`salvage` (collective.py) on a rank whose job ends with a save under way. Two callers at
once cannot publish one folder twice: each first renames the folder to a name of its own
(:func:`claim`), as rank 0 does before its own publication of the save (writer.PendingSave.publish). The
salvaging ranks of one job leave each other's claimed folders alone (``claimed=False``): another
rank is publishing it, and taking it from that rank midway would leave its publication to the taker
alone. A claimed folder whose publisher died midway is published by the next run into the folder
(the callers that hold the save folder's lock take claimed folders too).
"""
import json
import os
from typing import List, Optional, Tuple

from ..inputs import JSON_BYTES, read_bytes
from .format import MANIFEST_SHA, CheckpointError, is_part_folder, part_folders_of, publish, read_manifest, shard_file
from .pointer import DRAFT, ENTRY, TEMP_PREFIX, latest_name, step_of

CLAIM = "-recovering-"      # a temporary folder renamed by the caller publishing it: NAME-recovering-PID


def complete_manifest(tmp: str) -> Optional[dict]:
    """The manifest of the temporary folder ``tmp`` when every shard it needs is there (see the module), else None."""
    try:
        manifest = _written(tmp) or _drafted(tmp)
        if all(os.path.getsize(os.path.join(tmp, s["file"])) == s["bytes"] for s in manifest["shards"]):
            return manifest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _written(tmp: str) -> Optional[dict]:
    """The manifest a publication wrote before it ended (it checks, its own checksum included), without that
    checksum; None when there is none that checks."""
    try:
        manifest, _ = read_manifest(tmp)
    except CheckpointError:
        return None
    return {k: v for k, v in manifest.items() if k != MANIFEST_SHA}


def _drafted(tmp: str) -> dict:
    """The manifest rank 0's draft and every shard's entry make (OSError, ValueError or KeyError when one is missing
    or unreadable)."""
    draft = json.loads(read_bytes(os.path.join(tmp, DRAFT), DRAFT, JSON_BYTES, OSError))
    shards = [json.loads(read_bytes(os.path.join(tmp, shard_file(r) + ENTRY), ENTRY, JSON_BYTES, OSError))
              for r in range(int(draft["world_size"]))]
    return {**draft, "shards": shards}


def orphans(directory: str, claimed: bool = True) -> List[Tuple[str, dict]]:
    """(temporary folder, manifest) of every complete unpublished checkpoint in ``directory``, by step;
    ``claimed`` False: not those another caller has claimed (renamed to publish them, ``CLAIM``)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX) and (claimed or CLAIM not in n))
    except OSError:
        return []
    found = [(os.path.join(directory, n), complete_manifest(os.path.join(directory, n))) for n in names]
    return sorted(((t, m) for t, m in found if m is not None), key=lambda tm: tm[1]["step"])


def recover(directory: str, claimed: bool = True) -> List[str]:
    """Publish the complete unpublished checkpoints of the save folder ``directory``; returns one line for
    each. ``claimed`` False: leave alone those another caller is publishing (a salvage: see the module). A
    save folder of a tensor-parallel or pipelined run (``tp{r}-of-{K}``, ``pp{c}-of-{C}`` folders) gets a step
    published only when every part folder holds a complete one of it (pieces of two steps would make a model
    that never was); one part folder alone (a TP rank's or a chunk's save) is left to a caller that sees them
    all (the train CLI at start)."""
    if is_part_folder(os.path.basename(os.path.realpath(directory))):
        return []
    subs = part_folders_of(directory)
    if not subs:
        return [line for tmp, manifest in orphans(directory, claimed) for line in _publish(directory, tmp, manifest)]
    found = [{m["step"]: (t, m) for t, m in orphans(sub, claimed)} for sub in subs]
    whole = sorted(set.intersection(*(set(f) for f in found)))
    return [line for step in whole for sub, f in zip(subs, found) for line in _publish(sub, *f[step])]


def claim(tmp: str) -> Optional[str]:
    """Rename the temporary folder ``tmp`` to this process's claimed name (``CLAIM``) before publishing it
    from there: one caller wins, and the salvaging ranks leave it alone. Returns the new path, or None when
    another caller has taken it (or it is gone)."""
    claimed = f"{tmp}{CLAIM}{os.getpid()}"
    try:
        os.rename(tmp, claimed)
    except OSError:
        return None
    return claimed


def claimed_copies(tmp: str) -> List[str]:
    """The folders ``tmp`` became when some caller claimed it (:func:`claim`) and has not finished publishing."""
    parent, name = os.path.split(tmp)
    try:
        return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(name + CLAIM)]
    except OSError:
        return []


def _publish(directory: str, tmp: str, manifest: dict) -> List[str]:
    step = manifest["step"]
    claimed = claim(tmp)
    if claimed is None:
        return []
    current = step_of(latest_name(directory) or "")
    newer = current is None or step > current
    try:
        path = publish(directory, claimed, step, manifest, keep=os.listdir(directory), point=newer)
    except OSError as e:
        return [f"could not publish the complete checkpoint of step {step} left unpublished in {claimed}: {e}"]
    named = newer or latest_name(directory) == os.path.basename(path)
    where = f"{os.path.join(directory, 'latest')} names it" if named else \
        f"{os.path.join(directory, 'latest')} still names the later {latest_name(directory)}"
    return [f"published {path}, the complete checkpoint of step {step} that a job which ended before publishing "
            f"it left in {tmp} ({where})"]
