"""The parts of a save folder: its pipeline chunks' folders (``pp{c}-of-{C}``) and tensor-parallel ranks'
(``tp{r}-of-{K}``), each a whole set, in order; what the offline tools (consolidate, export-hf) read. An
expert-parallel save's ``ep{j}-of-{K}`` folders (train/moe/checkpoints.py) hold the experts beside the save
folder's own (dense) checkpoints, each step under the dense checkpoint's name.
"""
import os
import re
from typing import List

from .format import TP_FOLDER, CheckpointError

EP_FOLDER = re.compile(r"ep(\d+)-of-(\d+)")   # one expert-parallel rank's experts (train/moe/checkpoints.py)


def tp_parts(path: str) -> List[str]:
    """The ``tp{r}-of-{K}`` folders of a tensor-parallel save directory, in TP rank order ([] if none)."""
    return part_folders(path, TP_FOLDER, "tensor-parallel")


def ep_parts(ckpt: str, manifest: dict) -> List[str]:
    """The expert-parallel parts of the checkpoint ``ckpt`` (train/moe/checkpoints.py): the checkpoint of the
    same name in each ``ep{j}-of-{K}`` folder beside it, K the ``--ep`` its manifest records ([] when 1); or,
    where ``ckpt`` holds them itself (one step's parts in its folder: the in-memory replicas' restore,
    checkpoint/replica_files.py), those."""
    k = int(manifest.get("extra", {}).get("moe", {}).get("ep", 1))
    if k == 1:
        return []
    inside = [os.path.join(ckpt, f"ep{j}-of-{k}") for j in range(k)]
    if any(os.path.isdir(p) for p in inside):
        return inside
    root, name = os.path.split(os.path.normpath(ckpt))
    return [os.path.join(root, f"ep{j}-of-{k}", name) for j in range(k)]


def part_folders(path: str, pattern, what: str) -> List[str]:
    """The folders of ``path`` named by ``pattern`` (``tp{r}-of-{K}``, ``pp{c}-of-{C}``), in order ([] if none);
    CheckpointError unless they are one whole set of K."""
    if not os.path.isdir(path):
        return []
    found = {n: m for n in os.listdir(path) for m in [pattern.fullmatch(n)] if m}
    if not found:
        return []
    names = sorted(found)
    k = int(found[names[0]].group(2))
    ranks = sorted(int(m.group(1)) for m in found.values() if int(m.group(2)) == k)   # no list of k names
    if k < 1 or len(found) != k or ranks != list(range(k)):
        raise CheckpointError(f"{path}: {what} folders {names[:4] + ['...'] * (len(names) > 4)} "
                              f"are not one whole set of {k}")
    prefix = pattern.pattern.split("(")[0]
    return [os.path.join(path, f"{prefix}{r}-of-{k}") for r in range(k)]
