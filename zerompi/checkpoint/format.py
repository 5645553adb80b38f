"""The on-disk checkpoint format: what the files hold and how they get there without a torn state.

One concern: files. Nothing here is a collective or touches MPI; the save/load protocol
that decides which rank writes or reads what is in checkpoint/collective.py. Format version 1
(docs/checkpoint.md)::

    DIR/latest                        name of the newest complete checkpoint ("step_000010")
    DIR/step_000010/manifest.json     model, layout, step, optimizer, loss scale, config, checksums
    DIR/step_000010/shard_00000.npy   rank 0's slices, float32 (3, shard_numel):
                                      rows master, exp_avg, exp_avg_sq, padding included

A checkpoint is written into a hidden temporary directory, fsynced, renamed into place,
and only then named by ``latest`` (itself replaced by an atomic rename), so a crash at
any point leaves the previous checkpoint loadable. Reading checks the manifest, and each
shard's size, sha256 and array header, before any of it is used.
"""
import hashlib
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict
from typing import Iterable, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError
from ..layout import Bucket, ParamRange

FORMAT = "zerompi-checkpoint"
FORMAT_VERSION = 1
ROWS = ("master", "exp_avg", "exp_avg_sq")   # engine.optimizer's arrays, one row each in a shard file
MANIFEST = "manifest.json"
LATEST = "latest"
CHUNK_BYTES = 1 << 20                        # read size when checksumming a shard
CRASH_ENV = "ZEROMPI_CHECKPOINT_CRASH"       # test hook: "POINT@STEP" exits the process there
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
    """Rank 0: a fresh hidden directory; leftovers of crashed saves are removed first."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    tmp = os.path.join(directory, f".tmp-step_{step:06d}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


class _HashingWriter:
    """A file wrapper that feeds every byte written into a sha256."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> None:
        self.sha.update(data)
        self.f.write(data)


def write_shard(tmp: str, rank: int, shard_numel: int, chunks: Iterable[np.ndarray]) -> dict:
    """Write and fsync ``rank``'s shard file in ``tmp``; returns its manifest entry (file, bytes, sha256).

    ``chunks``: host arrays, row by row (ROWS order) and in shard order within a row, that
    add up to ``len(ROWS) * shard_numel`` elements; consumed one at a time, so a caller's
    generator keeps at most one piece on the host.
    """
    name = shard_file(rank)
    path = os.path.join(tmp, name)
    header = {"descr": "<f4", "fortran_order": False, "shape": (len(ROWS), shard_numel)}
    with open(path, "wb") as f:
        out = _HashingWriter(f)
        np.lib.format.write_array_header_1_0(out, header)
        for chunk in chunks:
            out.write(np.ascontiguousarray(chunk, dtype="<f4").data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "bytes": os.path.getsize(path), "sha256": out.sha.hexdigest()}


def build_manifest(engine, shards: List[dict], extra_state) -> dict:
    """The manifest of ``engine``'s state; ``shards``: the entries write_shard returned, in slice order."""
    lay, c = engine.layout, engine.config
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": engine.steps_taken,                 # step() calls, skipped ones included: the data position
        "world_size": lay.world_size,               # slices per bucket: one shard file each
        "stage": c.stage,
        "dtype": c.dtype,
        "shard_numel": lay.shard_numel,
        "params_numel": lay.params_numel,
        "layer_names": list(lay.layer_names),
        "params": [asdict(p) for p in lay.params.values()],
        "buckets": [asdict(b) for b in lay.buckets],
        "optimizer": {"name": "adamw", "step": engine.step_count, "state": list(ROWS), "lr": c.lr,
                      "beta1": c.beta1, "beta2": c.beta2, "eps": c.eps, "weight_decay": c.weight_decay},
        "loss_scaler": engine.scaler.state_dict(),
        "config": c.to_dict(),
        "extra": extra_state or {},
        "shards": shards,
    }


def publish(directory: str, tmp: str, step: int, manifest: dict) -> str:
    """Rank 0, once every shard is on disk: manifest, rename into place, then move ``latest``.

    Returns the checkpoint's final directory.
    """
    _write_durable(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    crash_point("before_rename", step)
    base = f"step_{step:06d}"
    if os.path.isdir(os.path.join(directory, base)) and _latest_name(directory) != base:
        shutil.rmtree(os.path.join(directory, base))   # a stray of a crashed save: nothing points at it
    taken = set(os.listdir(directory))
    # ``latest`` may name a checkpoint of this very step: write beside it, never over it.
    name = base if base not in taken else next(f"{base}-{k}" for k in range(1, len(taken) + 2)
                                               if f"{base}-{k}" not in taken)
    final = os.path.join(directory, name)
    os.rename(tmp, final)
    _fsync_dir(directory)
    crash_point("before_latest", step)
    _write_durable(os.path.join(directory, f".{LATEST}.tmp"), name + "\n")
    os.replace(os.path.join(directory, f".{LATEST}.tmp"), os.path.join(directory, LATEST))
    _fsync_dir(directory)
    # An older checkpoint of the same step is replaced only now that ``latest`` names the new one.
    for old in taken:
        if old == base or old.startswith(base + "-"):
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return final


def _latest_name(directory: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def _write_durable(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crash_point(point: str, step: int) -> None:
    """Test hook: ``ZEROMPI_CHECKPOINT_CRASH=POINT@STEP`` ends the process here, without cleanup."""
    if os.environ.get(CRASH_ENV) == f"{point}@{step}":
        sys.stderr.write(f"zerompi.checkpoint: simulated crash at {point}, step {step}\n")
        sys.stderr.flush()
        os._exit(17)


# ---- read and verify ----------------------------------------------------------------
def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself if it holds a manifest, else what ``latest`` says."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        what = "does not exist" if not os.path.exists(path) else f"has neither {MANIFEST} nor a {LATEST} pointer"
        raise CheckpointError(f"{path}: {what}; pass a checkpoint directory or the --save-dir of a run")
    name = _latest_name(path)
    if not name or os.sep in name or not os.path.isfile(os.path.join(path, name, MANIFEST)):
        raise CheckpointError(f"{latest}: names {name!r}, which is not a complete checkpoint")
    return os.path.join(path, name)


def read_manifest(ckpt: str) -> Tuple[dict, SavedLayout]:
    """Parse and sanity-check ``ckpt``/manifest.json (raises CheckpointError naming the file)."""
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest: {e}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zerompi checkpoint manifest (format {manifest.get('format')!r})"
                              if isinstance(manifest, dict) else f"{path}: not a zerompi checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')!r}; "
                              f"this zerompi reads version {FORMAT_VERSION}")
    try:
        saved = SavedLayout(manifest)
        names = [s["file"] for s in manifest["shards"]]
        if names != [shard_file(r) for r in range(saved.world_size)]:
            raise ValueError(f"shard list {names} does not match world_size {saved.world_size}")
        manifest["step"], manifest["optimizer"]["step"] = int(manifest["step"]), int(manifest["optimizer"]["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed manifest: {type(e).__name__}: {e}")
    return manifest, saved


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
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            sha.update(block)
    if sha.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 checksum mismatch: the file is corrupted")
    arr = np.load(path, mmap_mode="r")
    want = (len(ROWS), manifest["shard_numel"])
    if arr.shape != want or arr.dtype != np.dtype("<f4"):
        raise CheckpointError(f"{path}: holds {arr.dtype} {arr.shape}, expected float32 {want}")
    return path
