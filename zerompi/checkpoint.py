"""Sharded checkpoints: each rank writes its slices, rank 0 a manifest; load at any N and stage.

On disk (format version 1, see docs/checkpoint.md)::

    DIR/latest                        name of the newest complete checkpoint ("step_000010")
    DIR/step_000010/manifest.json     model, layout, step, optimizer, loss scale, config, checksums
    DIR/step_000010/shard_00000.npy   rank 0's slices, float32 (3, shard_numel):
                                      rows master, exp_avg, exp_avg_sq, padding included

A checkpoint is written into a hidden temporary directory, fsynced, renamed into place,
and only then named by ``latest`` (itself replaced by an atomic rename), so a crash at
any point leaves the previous checkpoint loadable. Loading maps every parameter through
the saved layout, so the world size, stage and bucket size may all change; each rank
reads only the pieces of the old shards that make up its new slices.

    python -m zerompi.checkpoint consolidate DIR OUT.npz   # full fp32 parameters by name
    python -m zerompi.checkpoint inspect DIR               # the manifest as a table
"""
import hashlib
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .errors import ConfigError
from .layout import Bucket, ParamRange
from .watchdog import watched

FORMAT = "zerompi-checkpoint"
FORMAT_VERSION = 1
ROWS = ("master", "exp_avg", "exp_avg_sq")   # engine attributes, one row each in a shard file
MANIFEST = "manifest.json"
LATEST = "latest"
CHUNK_BYTES = 1 << 20                        # read size when checksumming a shard
CRASH_ENV = "ZEROMPI_CHECKPOINT_CRASH"       # test hook: "POINT@STEP" exits the process there
F32 = np.float32


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved or loaded. In a multi-rank save or load every rank
    raises it together (the ranks agree first), so catching it never leaves a rank hanging."""


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""
    path: str          # the checkpoint directory that was read
    manifest: dict     # its manifest (``manifest["extra"]`` is the caller's extra_state)
    bytes_read: int    # bytes of shard data this rank copied (checksumming not counted)


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


# ---- save -------------------------------------------------------------------------
def save(engine, directory: str, extra_state: Optional[dict] = None) -> str:
    """Write ``engine``'s state as ``directory``/step_NNNNNN/ and point ``directory``/latest at it.

    A collective: every rank writes its own shard file, rank 0 the manifest. NNNNNN is
    ``engine.steps_taken``. ``extra_state``: JSON-able dict stored as ``manifest["extra"]``.
    Returns the new checkpoint's directory. Every rank sees ``directory`` (a shared file system).
    """
    comm, rank, step = engine.comm, engine.rank, engine.steps_taken
    mpi = comm.mpi
    engine._guard.at("save", step)        # ZEROMPI_FAULT=KIND@rankR:stepS:save (faults.py)
    tmp = err = None
    if rank == 0:
        try:
            tmp = _make_temp_dir(directory, step)
        except OSError as e:
            err = f"cannot create a checkpoint in {directory}: {e}"
    # Each collective is timed by the watchdog: a rank that dies or hangs in a save ends the job.
    with watched(comm, "checkpoint save: broadcast of the temporary directory", step):
        tmp, err = mpi.bcast((tmp, err), root=0)
    if err:
        raise CheckpointError(err)
    entry = err = None
    try:
        entry = _write_shard(engine, tmp)
    except OSError as e:
        err = f"rank {rank} could not write its shard in {tmp}: {e}"
    _crash_point("after_shards", step)
    with watched(comm, "checkpoint save: gather of shard entries", step):
        entries = mpi.gather((entry, err), root=0)
    result = None
    if rank == 0:
        errors = [e for _, e in entries if e]
        try:
            result = (None, errors[0]) if errors else \
                (_publish(engine, directory, tmp, [e for e, _ in entries], extra_state), None)
        except OSError as e:
            result = (None, f"cannot finish the checkpoint {tmp}: {e}")
    with watched(comm, "checkpoint save: broadcast of the result (manifest written, latest moved)", step):
        path, err = mpi.bcast(result, root=0)
    if err:
        raise CheckpointError(err)
    return path


def _make_temp_dir(directory: str, step: int) -> str:
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


def _own_pieces(engine, arr) -> list:
    """This rank's slices of an optimizer array, in shard order (stage 0 holds the whole buffer)."""
    if engine.config.stage > 0:
        return [arr]
    return [arr[b.world_slice(engine.rank)] for b in engine.layout.buckets]


def _write_shard(engine, tmp: str) -> dict:
    name = f"shard_{engine.rank:05d}.npy"
    path = os.path.join(tmp, name)
    header = {"descr": "<f4", "fortran_order": False, "shape": (len(ROWS), engine.layout.shard_numel)}
    with open(path, "wb") as f:
        out = _HashingWriter(f)
        np.lib.format.write_array_header_1_0(out, header)
        for row in ROWS:
            for piece in _own_pieces(engine, getattr(engine, row)):
                out.write(np.ascontiguousarray(_to_host(piece), dtype="<f4").data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "bytes": os.path.getsize(path), "sha256": out.sha.hexdigest()}


def _publish(engine, directory: str, tmp: str, shards: List[dict], extra_state) -> str:
    """Rank 0, once every shard is on disk: manifest, rename into place, then move ``latest``."""
    step = engine.steps_taken
    _write_durable(os.path.join(tmp, MANIFEST), json.dumps(_manifest(engine, shards, extra_state), indent=1))
    _fsync_dir(tmp)
    _crash_point("before_rename", step)
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
    _crash_point("before_latest", step)
    _write_durable(os.path.join(directory, f".{LATEST}.tmp"), name + "\n")
    os.replace(os.path.join(directory, f".{LATEST}.tmp"), os.path.join(directory, LATEST))
    _fsync_dir(directory)
    # An older checkpoint of the same step is replaced only now that ``latest`` names the new one.
    for old in taken:
        if old == base or old.startswith(base + "-"):
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return final


def _manifest(engine, shards: List[dict], extra_state) -> dict:
    lay, c = engine.layout, engine.config
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": engine.steps_taken,                 # step() calls, skipped ones included: the data position
        "world_size": engine.world_size,
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


def _crash_point(point: str, step: int) -> None:
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
        if names != [f"shard_{r:05d}.npy" for r in range(saved.world_size)]:
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


# ---- load -------------------------------------------------------------------------
def load(engine, path: str) -> LoadInfo:
    """Restore ``engine`` from a checkpoint saved at any world size, stage or bucket size (a collective).

    ``path``: a checkpoint directory or a save directory (its ``latest`` is used). Restores
    the fp32 master, exp_avg and exp_avg_sq, the step counters and (same dtype only) the
    loss scaler, then republishes the stored parameters from the master. The ranks share the
    checksumming and agree on one verdict: on bad input every rank raises CheckpointError.
    """
    comm = engine.comm
    ckpt = manifest = saved = None
    try:
        ckpt = resolve(path)
        manifest, saved = read_manifest(ckpt)
        check_model(ckpt, saved, engine.layout)
        for r in range(engine.rank, saved.world_size, engine.world_size):
            verify_shard(ckpt, manifest, r)
        err = None
    except Exception as e:  # any failure must reach the agreement below, or the other ranks hang
        err = str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the manifest and checksums")
    try:
        nbytes, err = _restore(engine, ckpt, saved), None
    except Exception as e:
        nbytes, err = 0, f"{ckpt}: reading the shards failed on rank {engine.rank}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the shard reads")
    engine.steps_taken = manifest["step"]
    engine.step_count = manifest["optimizer"]["step"]
    if manifest["dtype"] == engine.config.dtype:   # fp32 runs have no loss scale to carry over
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    engine._publish_params(all_gather=True)
    return LoadInfo(ckpt, manifest, nbytes)


def _agree(comm, err: Optional[str], op: str) -> None:
    """One small collective: if any rank failed, every rank raises the first failure (in rank order).

    ``comm``: the engine's Communicator; the all-gather is timed by the watchdog as ``op``.
    """
    with watched(comm, op):
        errors = comm.mpi.allgather(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def copy_plan(saved: SavedLayout, layout, rank: int, stage: int) -> List[Tuple[int, int, int, int]]:
    """Runs ``(dst, old_rank, src, numel)`` that fill this rank's optimizer buffers from old shards.

    ``dst`` indexes the engine's buffer (stage 0: the world buffer; else the shard), ``src``
    the old rank's shard. Adjacent runs are merged. Padding is not covered (it stays zero).
    """
    runs: List[List[int]] = []
    for bucket in layout.buckets:
        lo, hi = (0, bucket.numel) if stage == 0 else bucket.slice_bounds(rank)
        base = bucket.start if stage == 0 else bucket.shard_start
        for layer in bucket.layers:
            for name in layout.layer_params[layer]:
                pr = layout.params[name]
                a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                if a < z:
                    _locate(saved, name, a - pr.bucket_offset, z - a, base + a - lo, runs)
    return [tuple(r) for r in runs]


def _locate(saved: SavedLayout, name: str, offset: int, numel: int, dst: int, runs: list) -> None:
    """Append the old-shard pieces of elements [offset, offset + numel) of parameter ``name``."""
    pr = saved.params[name]
    bucket = saved.buckets[pr.bucket]
    x, end = pr.bucket_offset + offset, pr.bucket_offset + offset + numel
    while x < end:
        r = x // bucket.slice_numel
        lo, hi = bucket.slice_bounds(r)
        n = min(end, hi) - x
        src = bucket.shard_start + x - lo
        last = runs[-1] if runs else None
        if last and last[1] == r and last[0] + last[3] == dst and last[2] + last[3] == src:
            last[3] += n
        else:
            runs.append([dst, r, src, n])
        x, dst = x + n, dst + n


def _restore(engine, ckpt: str, saved: SavedLayout) -> int:
    runs = copy_plan(saved, engine.layout, engine.rank, engine.config.stage)
    shards: Dict[int, np.ndarray] = {}
    nbytes = 0
    for k, row in enumerate(ROWS):
        target = getattr(engine, row)
        host = target if isinstance(target, np.ndarray) else np.empty(target.size, F32)
        host[...] = 0
        for dst, r, src, n in runs:
            if r not in shards:   # memory-mapped: only the pages of the pieces copied are read
                shards[r] = np.load(os.path.join(ckpt, f"shard_{r:05d}.npy"), mmap_mode="r")
            host[dst:dst + n] = shards[r][k, src:src + n]
            nbytes += 4 * n
        if host is not target:
            target[...] = engine.xp.asarray(host)
    return nbytes


# ---- offline tools (one process, no MPI, so no collective and no watchdog) ------------
def consolidate(path: str, out: str) -> Dict[str, np.ndarray]:
    """Write the full fp32 parameters by name to ``out`` (.npz) and return them.

    Shards are checksummed, then read one at a time (memory-mapped, master row only): peak
    memory is the output plus a read buffer. ``out`` is written under a temporary name and
    renamed, and may not lie inside the checkpoint.
    """
    ckpt = resolve(path)
    manifest, saved = read_manifest(ckpt)
    here, there = os.path.realpath(os.path.dirname(os.path.abspath(out))), os.path.realpath(ckpt)
    if os.path.commonpath([here, there]) == there:
        raise CheckpointError(f"{out}: would be written inside the checkpoint {ckpt}; choose another path")
    paths = [verify_shard(ckpt, manifest, r) for r in range(saved.world_size)]
    params = {name: np.empty(pr.shape, F32) for name, pr in saved.params.items()}
    for r, shard_path in enumerate(paths):
        master = np.load(shard_path, mmap_mode="r")[0]
        for bucket, members in zip(saved.buckets, saved.bucket_params):
            lo, hi = bucket.slice_bounds(r)
            for pr in members:
                a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                if a < z:
                    src = bucket.shard_start + a - lo
                    params[pr.name].reshape(-1)[a - pr.bucket_offset:z - pr.bucket_offset] = master[src:src + z - a]
        del master
    partial = out + ".partial"
    with open(partial, "wb") as f:
        np.savez(f, **params)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, out)
    return params


def inspect_text(path: str) -> str:
    """The manifest of the checkpoint ``path`` names, as a table."""
    ckpt = resolve(path)
    m, saved = read_manifest(ckpt)
    opt, sc = m["optimizer"], m["loss_scaler"]
    lines = [f"checkpoint {ckpt}  ({m['format']} v{m['format_version']})",
             f"  step {m['step']} (optimizer updates {opt['step']}), world size {m['world_size']}, "
             f"stage {m['stage']}, dtype {m['dtype']}, {m['params_numel']:,} parameters, "
             f"shard {m['shard_numel']:,} elements",
             f"  loss scale {sc['scale']:g} (good steps {sc['good_steps']}); optimizer {opt['name']} "
             f"lr {opt['lr']:g} betas ({opt['beta1']:g}, {opt['beta2']:g}) eps {opt['eps']:g} "
             f"weight decay {opt['weight_decay']:g}",
             "  config: " + " ".join(f"{k}={v}" for k, v in m["config"].items())]
    if m["extra"]:
        lines.append("  extra: " + json.dumps(m["extra"], sort_keys=True))
    w = max(len("parameter"), *(len(n) for n in saved.params))
    lines.append(f"  {'parameter':<{w}}  {'shape':>14} {'numel':>12} {'bucket':>6} {'start':>12}")
    for pr in saved.params.values():
        shape = "x".join(str(d) for d in pr.shape)
        lines.append(f"  {pr.name:<{w}}  {shape:>14} {pr.numel:>12,} {pr.bucket:>6} {pr.start:>12,}")
    lines.append(f"  {'bucket':>6} {'start':>12} {'numel':>12} {'used':>12} {'slice':>10} {'shard_start':>12}  layers")
    for b in saved.buckets:
        lines.append(f"  {b.index:>6} {b.start:>12,} {b.numel:>12,} {b.used:>12,} {b.slice_numel:>10,} "
                     f"{b.shard_start:>12,}  {','.join(m['layer_names'][i] for i in b.layers)}")
    lines.append(f"  {'shard':<16} {'bytes':>14}  sha256")
    for s in m["shards"]:
        lines.append(f"  {s['file']:<16} {s['bytes']:>14,}  {s['sha256']}")
    return "\n".join(lines)


def _to_host(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if len(args) == 3 and args[0] == "consolidate":
            params = consolidate(args[1], args[2])
            print(f"wrote {args[2]}: {len(params)} parameters, "
                  f"{sum(p.size for p in params.values()):,} fp32 values")
        elif len(args) == 2 and args[0] == "inspect":
            print(inspect_text(args[1]))
        else:
            raise CheckpointError(f"arguments {args} are not allowed; use 'consolidate DIR OUT.npz' or 'inspect DIR'")
    except (CheckpointError, OSError) as e:
        sys.stderr.write(f"zerompi.checkpoint: error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
