"""A save folder's names: which of its folders are published checkpoints, and ``latest``, the pointer to the newest.

One concern: the pointer and the names around it (format.py writes and reads the checkpoints
themselves). ``DIR/latest`` holds two lines::

    step_000010
    sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

the name of the checkpoint it points at, then the sha256 of that checkpoint's ``manifest.json``
file, so a pointer edited by hand to name another checkpoint, or damaged, is found and refused
instead of followed (format.resolve). A pointer of one line (an older zerompi's, or one written
by hand) is still read; what it names is then unverified, and the readers say so
(savedir.pointer_notes). Also here: the names of what a save leaves in its temporary folder for
orphans.py (a checkpoint whose every shard was written can be published later), and the small
durable writes (fsynced file, fsynced folder) the pointer and the manifest are made with.
Nothing here touches MPI.
"""
import hashlib
import os
import re
from typing import List, Optional, Tuple

from ..inputs import JSON_BYTES, read_bytes

LATEST = "latest"
MANIFEST = "manifest.json"
CHECKPOINT_NAME = re.compile(r"step_(\d+)(?:-(\d+))?")   # a published checkpoint's directory name
DIGEST = re.compile(r"sha256 ([0-9a-f]{64})")              # the pointer's second line
TEMP_PREFIX = ".tmp-step_"          # a save under way (or left by a job that ended): DIR/.tmp-step_NNNNNN-XXXXXXXX/
DRAFT = "manifest.draft.json"       # in it from the start (rank 0): the manifest without its shard list
ENTRY = ".entry"                    # shard_00001.npy.entry beside each shard once fsynced: its bytes and crc32


def complete_checkpoints(directory: str) -> List[str]:
    """The published checkpoints in a save directory (``step_NNNNNN`` or ``step_NNNNNN-K`` with a
    manifest), by step; temporary directories of saves under way or interrupted are not listed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(int(m.group(1)), int(m.group(2) or 0), n) for n in names
             if (m := CHECKPOINT_NAME.fullmatch(n)) and os.path.isfile(os.path.join(directory, n, MANIFEST))]
    return [n for _, _, n in sorted(found)]


def step_of(name: str) -> Optional[int]:
    """The step a checkpoint's name says (``step_000010-1`` -> 10), or None for another name."""
    m = CHECKPOINT_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def manifest_digest(ckpt: str) -> Optional[str]:
    """The sha256 of ``ckpt``/manifest.json's bytes, or None when it cannot be read."""
    try:
        return hashlib.sha256(read_bytes(os.path.join(ckpt, MANIFEST), MANIFEST, JSON_BYTES, OSError)).hexdigest()
    except OSError:
        return None


def read_latest(directory: str) -> Tuple[Optional[str], Optional[str]]:
    """(the name ``directory``/latest holds, the manifest sha256 it carries): (None, None) when it is
    missing or unreadable; the digest None for a pointer of one line (or a second line that is no digest)."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            lines = f.read(4096).splitlines()
    except (OSError, UnicodeDecodeError):
        return None, None
    name = lines[0].strip() if lines else ""
    m = DIGEST.fullmatch(lines[1].strip()) if len(lines) > 1 else None
    return name, m.group(1) if m else None


def latest_name(directory: str) -> Optional[str]:
    """The name ``directory``/latest holds (stripped), or None when it is missing or unreadable."""
    return read_latest(directory)[0]


def point_latest(directory: str, name: str) -> None:
    """Make ``directory``/latest name the checkpoint ``name`` (already in place), with its manifest's
    sha256: written beside, fsynced, renamed over the old pointer, the folder fsynced."""
    tmp = os.path.join(directory, f".{LATEST}.tmp")
    write_durable(tmp, f"{name}\nsha256 {manifest_digest(os.path.join(directory, name))}\n")
    os.replace(tmp, os.path.join(directory, LATEST))
    fsync_dir(directory)


def write_durable(path: str, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
