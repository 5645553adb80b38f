"""The on-disk checkpoint format: what the files hold and how they get there without a torn state.

One concern: files. Nothing here is a collective or touches MPI; the save/load protocol
that decides which rank writes or reads what is in checkpoint/collective.py. Format version 2
(docs/checkpoint.md; version 1 is still read: sha256 per shard, no checksum of the manifest)::

    DIR/latest                        name of the newest complete checkpoint ("step_000010") and the
                                      sha256 of its manifest.json (pointer.py)
    DIR/step_000010/manifest.json     model, layout, step, optimizer, loss scale, config, each shard's
                                      size and CRC-32, and last the sha256 of the manifest itself
    DIR/step_000010/shard_00000.npy   rank 0's slices, float32 (rows, shard_numel):
                                      rows master + the optimizer's (state_rows.py), padding included

A checkpoint is written into a hidden temporary directory, fsynced, renamed into place,
and only then named by ``latest`` (itself replaced by an atomic rename), so a crash at
any point leaves the previous checkpoint loadable. Reading checks the manifest (its own
sha256 over its exact bytes, then its fields), and each shard's size, CRC-32 and array
header, before any of it is used.
"""
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import uuid
from collections import OrderedDict
from dataclasses import asdict
from typing import List, Optional, Tuple

import numpy as np

from ..errors import ConfigError
from ..inputs import JSON_BYTES, read_bytes
from ..layout import Bucket, ParamRange
from .checksums import ZCK64, Crc32, entry_kind, file_checksum, zck64  # noqa: F401 (re-exported)
from .state_rows import ROWS, engine_rows, optimizer_name, saved_rows  # noqa: F401 (ROWS: AdamW's, re-exported)
from .pointer import (CHECKPOINT_NAME, DRAFT, ENTRY, LATEST, MANIFEST, TEMP_PREFIX, complete_checkpoints, fsync_dir,
                      latest_name, manifest_digest, point_latest, read_latest, write_durable)

FORMAT = "zerompi-checkpoint"
FORMAT_VERSION = 2                           # written; READ_VERSIONS are read
READ_VERSIONS = (1, 2)                       # 1: shards checked by sha256, no checksum of the manifest
MANIFEST_SHA = "manifest_sha256"             # the manifest's last key: sha256 of its text with this value zeroed
WRITE_CHUNK_BYTES = 64 << 20                 # a shard is written, checksummed and handed to the disk in such chunks
CRASH_ENV = "ZEROMPI_CHECKPOINT_CRASH"       # test hook: "POINT@STEP[:rankR|:all]" exits the process there
_ZERO_SHA = "0" * 64
F32 = np.float32


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved or loaded. In a multi-rank save or load every rank
    raises it together (the ranks agree first), so catching it never leaves a rank hanging."""


class SavedLayout:
    """The layout a checkpoint was saved with, rebuilt from its manifest (no offsets recomputed)."""

    def __init__(self, manifest: dict):
        self.world_size = int(manifest["world_size"])
        self.buckets = [Bucket(**{**b, "layers": tuple(b["layers"])}) for b in manifest["buckets"]]
        self.params = {p["name"]: ParamRange(**{**p, "shape": tuple(p["shape"])}) for p in manifest["params"]}
        self.shard_numel = int(manifest["shard_numel"])
        self.bucket_params: List[List[ParamRange]] = [[] for _ in self.buckets]
        for pr in self.params.values():
            self.bucket_params[pr.bucket].append(pr)
        self._check()

    def _check(self) -> None:
        if sum(b.slice_numel for b in self.buckets) != self.shard_numel:
            raise ValueError("bucket slices do not add up to shard_numel")
        for b in self.buckets:
            if b.slice_numel * self.world_size != b.numel or not 0 <= b.used <= b.numel:
                raise ValueError(f"bucket {b.index} is not cut into {self.world_size} slices")
        for pr in self.params.values():
            if not (0 <= pr.bucket < len(self.buckets) and 0 <= pr.bucket_offset
                    and pr.bucket_offset + pr.numel <= self.buckets[pr.bucket].used):
                raise ValueError(f"parameter {pr.name!r} lies outside its bucket")


def shard_file(rank: int) -> str:
    """The file name of the saving run's rank ``rank``'s shard, inside a checkpoint directory."""
    return f"shard_{rank:05d}.npy"


# ---- write ----------------------------------------------------------------------------
def make_temp_dir(directory: str, step: int) -> str:
    """Rank 0: a fresh hidden directory; leftovers of crashed saves (and of interrupted
    removals) are removed first. Only one job saves into a directory (savedir.SaveDirLock)
    and a save starts after the previous one finished, so no leftover is being written."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith((TEMP_PREFIX, ".trash-")):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{step:06d}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


_LAYOUT_FIELDS: "OrderedDict[int, tuple]" = OrderedDict()   # id(layout): (layout, its manifest fields), a few


def _layout_fields(lay) -> dict:
    """A layout's manifest fields (names, parameters, buckets), built once per layout: the in-memory replicas
    write a manifest every step, and these are most of its cost. Each call gets its own dicts."""
    held = _LAYOUT_FIELDS.get(id(lay))
    if held is None or held[0] is not lay:
        held = _LAYOUT_FIELDS[id(lay)] = (lay, {"layer_names": list(lay.layer_names),
                                                "params": [asdict(p) for p in lay.params.values()],
                                                "buckets": [asdict(b) for b in lay.buckets]})
        while len(_LAYOUT_FIELDS) > 16:
            _LAYOUT_FIELDS.popitem(last=False)
    return {key: [dict(v) for v in value] if key != "layer_names" else list(value) for key, value in held[1].items()}


def build_manifest(engine, shards: List[dict], extra_state) -> dict:
    """The manifest of ``engine``'s state; ``shards``: the entries write_shard returned, in slice order."""
    lay, c = engine.layout, engine.config
    fields = _layout_fields(lay)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": engine.steps_taken,                 # step() calls, skipped ones included: the data position
        "world_size": lay.world_size,               # slices per bucket: one shard file each
        "stage": c.stage,
        "dtype": c.dtype,
        "shard_numel": lay.shard_numel,
        "params_numel": lay.params_numel,
        **fields,                                   # layer_names, params, buckets
        "optimizer": {"name": optimizer_name(engine), "step": engine.step_count, "state": list(engine_rows(engine)),
                      "lr": c.lr, "beta1": c.beta1, "beta2": c.beta2, "eps": c.eps, "weight_decay": c.weight_decay},
        "loss_scaler": engine.scaler.state_dict(),
        "config": engine.recorded_config(),
        "extra": extra_state or {},
        "shards": shards,
    }


def manifest_text(manifest: dict, indent: Optional[int] = 1) -> str:
    """The manifest as JSON text whose last key, MANIFEST_SHA, is the sha256 of this very text
    with that value replaced by 64 zeros: any changed byte of the file is found. ``indent`` None: one
    line, by json's C encoder (the in-memory replicas' manifests, written every step)."""
    body = json.dumps({**manifest, MANIFEST_SHA: _ZERO_SHA}, indent=indent)
    head, marker, tail = body.rpartition(f'"{MANIFEST_SHA}": "{_ZERO_SHA}"')
    digest = hashlib.sha256(body.encode()).hexdigest()
    return f'{head}"{MANIFEST_SHA}": "{digest}"{tail}'


def publish(directory: str, tmp: str, step: int, manifest: dict, keep=(), point: bool = True) -> str:
    """Rank 0, once every shard is on disk: manifest, rename into place, then move ``latest``.

    ``keep``: names of checkpoints never removed here (those newer than the one the run resumed
    from: collective.kept); else an older checkpoint of the same step is replaced. ``point``
    False: ``latest`` is left alone (orphans.py publishing an old one). Returns the checkpoint's
    final directory. The manifest is written before the draft and the entries (what orphans.py would
    otherwise publish the folder from) are removed: at every moment one of the two describes it whole."""
    write_durable(os.path.join(tmp, MANIFEST), manifest_text(manifest))
    fsync_dir(tmp)
    for name in [n for n in os.listdir(tmp) if n == DRAFT or n.endswith(ENTRY)]:
        os.unlink(os.path.join(tmp, name))
    fsync_dir(tmp)
    crash_point("before_rename", step)
    base = f"step_{step:06d}"
    if os.path.isdir(os.path.join(directory, base)) and latest_name(directory) != base and base not in keep:
        shutil.rmtree(os.path.join(directory, base))   # a stray of a crashed save: nothing points at it
    taken = set(os.listdir(directory))
    # ``latest`` may name a checkpoint of this very step: write beside it, never over it.
    name = base if base not in taken else next(f"{base}-{k}" for k in range(1, len(taken) + 2)
                                               if f"{base}-{k}" not in taken)
    final = os.path.join(directory, name)
    os.rename(tmp, final)
    fsync_dir(directory)
    crash_point("before_latest", step)
    if not point:
        return final
    point_latest(directory, name)
    # An older checkpoint of the same step is replaced only now that ``latest`` names the new one.
    for old in taken:
        if (old == base or old.startswith(base + "-")) and old not in keep:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return final


def remove_dir(path: str, background: bool = False) -> None:
    """Remove a checkpoint or temporary directory: renamed to a hidden ``.trash-`` name first (one
    atomic step), so an interrupted removal never leaves a half-deleted checkpoint that looks complete.
    ``background``: the deletion itself runs on a thread (:func:`wait_removals` waits for it)."""
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".trash-{name.lstrip('.')}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    if not background:
        shutil.rmtree(trash, ignore_errors=True)
        return
    thread = threading.Thread(target=shutil.rmtree, args=(trash, True), name="zerompi-remove", daemon=True)
    thread.start()
    _removals.append(thread)


_removals: List[threading.Thread] = []     # deletions under way (remove_dir background=True)


def wait_removals() -> None:
    """Wait for the deletions remove_dir started in the background (before the next save, at close)."""
    while _removals:
        _removals.pop().join()


def crash_point(point: str, step: int, rank: Optional[int] = None) -> None:
    """Test hook: ``ZEROMPI_CHECKPOINT_CRASH=POINT@STEP`` ends the process here, without cleanup
    (``POINT@STEP:rankR``: only on rank R; ``POINT@STEP:all``: every rank, once all of MPI's world reached
    it, so that each rank's work before the point is done). Points: after_shards, mid_shard (the shard
    file half written; in the background writer with an async save), before_rename, before_latest."""
    spec = os.environ.get(CRASH_ENV)
    if spec == f"{point}@{step}:all":
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    if spec in (f"{point}@{step}", f"{point}@{step}:rank{rank}", f"{point}@{step}:all"):
        sys.stderr.write(f"zerompi.checkpoint: simulated crash at {point}, step {step}\n")
        sys.stderr.flush()
        os._exit(17)


# ---- read and verify ----------------------------------------------------------------
TP_FOLDER = re.compile(r"tp(\d+)-of-(\d+)")   # one TP rank's part of a save directory (engine/tp_groups.py)
PP_FOLDER = re.compile(r"pp(\d+)-of-(\d+)")   # one pipeline chunk's part (zerompi/pipeline/engines.py)


def is_part_folder(name: str) -> bool:
    """``name`` is a tensor-parallel or pipeline part of a save folder (``tp{r}-of-{K}``, ``pp{c}-of-{C}``)."""
    return bool(TP_FOLDER.fullmatch(name) or PP_FOLDER.fullmatch(name))


def part_folders_of(directory: str) -> List[str]:
    """The folders of the save folder ``directory`` that hold its checkpoints: its tensor-parallel and
    pipeline parts (``tp{r}-of-{K}``, ``pp{c}-of-{C}``, ``pp{c}-of-{C}/tp{r}-of-{K}``), in order; [] when
    it has none (a plain run's: ``directory`` itself holds them)."""
    if not os.path.isdir(directory):
        return []
    subs = [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if is_part_folder(n)]
    return [leaf for sub in subs for leaf in (part_folders_of(sub) or [sub])]


def resume_flags(directory: str) -> str:
    """The train CLI's flags that resume the save folder ``directory``: ``--resume DIR`` with the ``--tp`` and
    ``--pp`` (``--schedule interleaved --chunks V`` for more chunks than stages) its run had, read from the
    manifest of one of its complete checkpoints; '' when it holds none (nothing there can be resumed)."""
    for folder in part_folders_of(directory) or [directory]:
        found = complete_checkpoints(folder)
        if found:
            break
    else:
        return ""
    try:
        config = read_manifest(os.path.join(folder, found[-1]))[0].get("config", {})
    except CheckpointError:
        config = {}
    tp, pp = int(config.get("tp", 1) or 1), int(config.get("pp", 1) or 1)
    chunks = max([int(m.group(2)) for m in map(PP_FOLDER.fullmatch, os.listdir(directory)) if m] or [pp])
    flags = f"--resume {directory}" + (f" --tp {tp}" if tp > 1 else "") + (f" --pp {pp}" if pp > 1 else "")
    if chunks > pp:
        flags += f" --schedule interleaved --chunks {chunks // pp}"
    return flags


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself if it holds a manifest, else what ``latest`` says.

    A missing or broken ``latest`` is refused with the complete checkpoints that are there.
    """
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is a file, not a checkpoint directory"
        raise CheckpointError(f"{path}: {what}; pass a checkpoint directory or the --save-dir of a run")
    latest = os.path.join(path, LATEST)
    name, digest = read_latest(path)
    if name and CHECKPOINT_NAME.fullmatch(name) and os.path.isfile(os.path.join(path, name, MANIFEST)):
        target = os.path.join(path, name)
        if digest is None or manifest_digest(target) == digest or not _intact(target):
            # a pointer of one line: unverified (pointer.py); a damaged manifest: read_manifest says so
            return target
        problem = (f"{latest} names {name!r} but carries the sha256 of another {MANIFEST} (the pointer was "
                   "edited or is damaged)")
    elif not os.path.lexists(latest):
        problem = f"has neither {MANIFEST} nor a {LATEST} pointer"
    else:
        problem = f"{latest} names {name!r}, which is not a complete checkpoint" if name else \
            f"{latest} is empty or unreadable"
    found = complete_checkpoints(path)
    tp = sorted((m for m in map(TP_FOLDER.fullmatch, os.listdir(path)) if m), key=lambda m: int(m.group(1)))
    pp = sorted((m for m in map(PP_FOLDER.fullmatch, os.listdir(path)) if m), key=lambda m: int(m.group(1)))
    if not found and pp:             # a pipelined save directory: one part per model chunk
        raise CheckpointError(f"{path}: a pipeline save ({pp[0].group(0)}, ...: {pp[0].group(2)} model chunks): resume "
                              f"it with the mesh it was saved with ({resume_flags(path) or '--pp and --chunks'}), "
                              f"inspect one chunk's part ({os.path.join(path, pp[0].group(0))}), or consolidate it")
    if not found and tp:             # a tensor-parallel save directory: its pieces are one level down
        raise CheckpointError(f"{path}: a tensor-parallel save ({tp[0].group(0)}, ...): resume it with --tp "
                              f"{tp[0].group(2)} ({resume_flags(path) or f'--resume {path} --tp {tp[0].group(2)}'}), "
                              f"inspect one TP rank's part ({os.path.join(path, tp[0].group(0))}), or consolidate it")
    if not found:
        raise CheckpointError(f"{path}: {problem}, and holds no complete checkpoint; "
                              "pass a checkpoint directory or the --save-dir of a run")
    raise CheckpointError(f"{path}: {problem}; the complete checkpoints there are {', '.join(found)}: "
                          f"name one to use it, e.g. --resume {os.path.join(path, found[-1])}")


def _intact(ckpt: str) -> bool:
    """``ckpt``'s manifest reads and checks (its own checksum included)."""
    try:
        read_manifest(ckpt)
        return True
    except CheckpointError:
        return False


def read_manifest(ckpt: str) -> Tuple[dict, SavedLayout]:
    """Parse and sanity-check ``ckpt``/manifest.json (raises CheckpointError naming the file)."""
    path = os.path.join(ckpt, MANIFEST)
    try:
        raw = read_bytes(path, path, JSON_BYTES, CheckpointError)
        manifest = json.loads(raw)
    except CheckpointError:                         # not a regular file, or too large: its own line
        raise
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest: {e}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zerompi checkpoint manifest (format {manifest.get('format')!r})"
                              if isinstance(manifest, dict) else f"{path}: not a zerompi checkpoint manifest")
    version = manifest.get("format_version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{path}: format version {version!r}; this zerompi reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))}")
    if version >= 2 or MANIFEST_SHA in manifest:
        _check_manifest_sha(path, raw, manifest.get(MANIFEST_SHA))
    try:
        saved = SavedLayout(manifest)
        names = [s["file"] for s in manifest["shards"]]
        if names != [shard_file(r) for r in range(saved.world_size)]:
            raise ValueError(f"shard list {names} does not match world_size {saved.world_size}")
        for entry in manifest["shards"]:                  # each checked by verify_shard
            int(entry["bytes"]), str(entry["sha256" if version < 2 else entry_kind(entry)])
        manifest["step"], manifest["optimizer"]["step"] = int(manifest["step"]), int(manifest["optimizer"]["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed manifest: {type(e).__name__}: {e}")
    return manifest, saved


def _check_manifest_sha(path: str, raw: bytes, want) -> None:
    """Raise unless ``raw`` (the manifest file's bytes) hashes to ``want`` with ``want`` zeroed."""
    if not (isinstance(want, str) and re.fullmatch(r"[0-9a-f]{64}", want)):
        raise CheckpointError(f"{path}: the manifest's own checksum ({MANIFEST_SHA}) is missing or malformed: "
                              "the manifest was changed or is corrupted")
    head, marker, tail = raw.rpartition(f'"{MANIFEST_SHA}": "{want}"'.encode())
    body = head + f'"{MANIFEST_SHA}": "{_ZERO_SHA}"'.encode() + tail
    if not marker or hashlib.sha256(body).hexdigest() != want:
        raise CheckpointError(f"{path}: sha256 checksum mismatch: the manifest was changed or is corrupted")


def check_model(ckpt: str, saved: SavedLayout, layout) -> None:
    """Raise unless the checkpoint holds exactly ``layout``'s parameters (names and shapes, in order)."""
    ours = [(p.name, p.shape) for p in layout.params.values()]
    theirs = [(p.name, p.shape) for p in saved.params.values()]
    if ours == theirs:
        return
    where = os.path.join(ckpt, MANIFEST)
    diff = next(((a, b) for a, b in zip(theirs, ours) if a != b), None)
    if diff is None:
        detail = f"{len(theirs)} parameters there, {len(ours)} here"
    else:
        detail = f"parameter {diff[0][0]!r} {diff[0][1]} there, {diff[1][0]!r} {diff[1][1]} here"
    raise CheckpointError(f"{where}: saved from another model ({detail}); use the same model flags")


def verify_shard(ckpt: str, manifest: dict, r: int) -> str:
    """Check shard r's presence, size, checksum and array header; returns its path."""
    entry = manifest["shards"][r]
    path = os.path.join(ckpt, entry["file"])
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing shard of rank {r} (of {manifest['world_size']}); "
                              "the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry['bytes']}: the file is {what}")
    kind = entry_kind(entry)                           # format 2, the replicas', or format 1
    got = file_checksum(path, kind)
    if got is None:
        raise CheckpointError(f"{path}: its {ZCK64} checksum needs the C kernel kernels/checksum_cpu.c, "
                              "which does not build here (a C compiler is needed)")
    if got != entry[kind]:
        raise CheckpointError(f"{path}: {kind} checksum mismatch: the file is corrupted")
    arr = np.load(path, mmap_mode="r")
    want = (len(saved_rows(manifest)), manifest["shard_numel"])
    if arr.shape != want or arr.dtype != np.dtype("<f4"):
        raise CheckpointError(f"{path}: holds {arr.dtype} {arr.shape}, expected float32 {want}")
    return path
