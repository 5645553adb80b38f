"""The engine's tensor-parallel part: ZeRO over the data-parallel group of a Mesh.

Each TP rank's engine holds the layout of its own pieces (``tp_split`` names the pieces: parameter
-> (axis, groups), every other parameter is replicated on the TP ranks) and shards them over its
data-parallel group. What crosses the TP group here: the global gradient norm and the overflow
flag (each split piece counted on its own rank, the replicated parameters once, on TP rank 0),
so that clipping and skipping agree with a run without TP. Checkpoints go to ``DIR/tp{r}-of-{K}``,
one ordinary checkpoint per TP rank, with the split recorded for ``consolidate``.
"""
import os
from dataclasses import replace
from types import SimpleNamespace
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..comm.blocks import sum_table
from ..comm.consistency import check_consistent, rank_set
from ..comm.mesh import Mesh
from ..comm.meshconfig import MeshConfig
from ..comm.watchdog import watched
from ..errors import ConfigError, MismatchError, UsageError
from ..optim import impl
from .lazy import is_lazy

TP_KEY = "tensor_parallel"    # manifest["extra"][TP_KEY]: {"size", "rank", "split": {name: [axis, groups]}}


def mesh_config_of(comm, config, given: Optional[MeshConfig]) -> MeshConfig:
    """The mesh the engine runs with: ``given`` (ZeroEngine's mesh_config), else a deprecated ZeroConfig(tp=...)'s,
    with a Mesh passed as ``comm`` its tp, sp and pp (a size set otherwise must be its: UsageError) and, unless
    given, its node_size."""
    sizes = given if given is not None else config.mesh
    if not isinstance(comm, Mesh):
        return sizes
    where = "mesh_config" if given is not None else "config"
    for name in ("tp", "sp", "pp"):
        if getattr(sizes, name) not in (1, getattr(comm, name)):
            raise UsageError(f"{where}.{name}={getattr(sizes, name)} but the Mesh passed has {name}="
                             f"{getattr(comm, name)}; give one")
    return replace(sizes, tp=comm.tp, sp=comm.sp, pp=comm.pp, node_size=sizes.node_size or comm.node_size)


def mesh_of(comm, sizes: MeshConfig, where: str = "config") -> Optional[Mesh]:
    """The engine's Mesh: ``comm`` when it is one, a new one over ``comm`` when ``sizes`` has tp or sp > 1 (pp > 1
    needs a Mesh: UsageError), else None (plain data parallelism). ZeRO then runs over the mesh's zero_comm (its
    dp x sp ranks)."""
    if isinstance(comm, Mesh):
        return comm
    if sizes.pp > 1:
        raise UsageError(f"{where}.pp={sizes.pp}: an engine holds one pipeline stage's chunk; pass it the "
                         "zerompi.Mesh(tp=..., pp=...) and run the stages with zerompi.pipeline (docs/pipeline.md)")
    if sizes.tp > 1 or sizes.sp > 1:
        return Mesh(comm, sizes.tp, sp=sizes.sp, node_size=sizes.node_size)
    return None


def tp_folder(rank: int, size: int) -> str:
    return f"tp{rank}-of-{size}"


class TensorParallel:
    """One rank's place in the mesh and which of its parameters are split."""

    def __init__(self, mesh: Mesh, split: Mapping[str, Tuple[int, int]], config=None):
        self.mesh, self.split = mesh, {k: (int(a), int(g)) for k, (a, g) in split.items()}
        self.config = config          # what every rank of the mesh must have alike (agree)

    @staticmethod
    def of(mesh: Optional[Mesh], config, split, shapes) -> Optional["TensorParallel"]:
        """The engine's TensorParallel for ``mesh`` (mesh_of's) when it has tp > 1, else None.
        ``shapes``: {parameter name: shape of this rank's array}; ``split`` is checked against them."""
        if mesh is None or mesh.tp == 1:
            if split:
                raise UsageError("tp_split given without tensor parallelism; pass a Mesh with tp > 1 or set "
                                 "mesh_config.tp")
            return None
        if split is None:
            raise UsageError("tensor parallelism needs tp_split={parameter name: (axis, groups)} for the split "
                             "parameters (every other one is taken as replicated on the TP ranks)")
        check_split(split, shapes)
        return TensorParallel(mesh, split, config)

    def agree(self, zero_comm, values, mode: str, agree_values) -> None:
        """Across this rank's pipeline stage of the mesh (the whole mesh without pipelining; a collective,
        timed by ``zero_comm``'s watchdog): MismatchError on every rank unless every rank has the same config,
        tp_split, layers and replicated shapes, and the same initial values of the replicated parameters
        (``mode`` "broadcast": the stage's first rank's are taken). Without it a TP rank with another lr,
        split or replicated value trains silently apart from the others."""
        world = SimpleNamespace(mpi=self.mesh.stage_mpi, waiting=zero_comm.waiting)
        replicated = [(lname, {p: a for p, a in params.items() if p not in self.split}) for lname, params in values]
        check_consistent(world, "tensor-parallel engine", {
            "zero": self.config, "tp_split": {k: list(v) for k, v in self.split.items()},
            "layers": [[lname, list(params)] for lname, params in values],
            "replicated_shape": {p: list(a.shape) for _, params in replicated for p, a in params.items()},
            # a lazy replicated parameter (engine/lazy.py): the same rule and seed on every TP rank
            "replicated_rule": {p: a.describe() for _, params in replicated for p, a in params.items() if is_lazy(a)}})
        agree_values(world, replicated, mode)

    def world_view(self, zero_comm) -> SimpleNamespace:
        """This rank's pipeline stage of the mesh (the whole mesh without pipelining) as the trace sees a
        communicator (mpi, rank, size), its waits timed and its traffic counted by ``zero_comm`` (the engine's)."""
        world = self.mesh.stage_mpi
        return SimpleNamespace(mpi=world, rank=world.Get_rank(), size=world.Get_size(), waiting=zero_comm.waiting,
                               stats=zero_comm.stats)

    def stats(self, reducer, layout, slot: int):
        """(sum of squares, non-finite) of this rank's gradient shard, replicated parameters counted on
        TP rank 0 only (the same segments, in the same order, at every stage)."""
        if self.mesh.tp_rank == 0:
            return reducer.stats()
        sumsq, nonfinite = 0.0, False
        grads = reducer.reduced_slices()
        for bucket in layout.buckets:
            g = grads[bucket.index]
            nonfinite |= impl.grad_stats(g)[1]
            lo, hi = bucket.slice_bounds(slot)
            for layer in bucket.layers:
                for name in layout.layer_params[layer]:
                    pr = layout.params[name]
                    a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                    if name in self.split and a < z:
                        sumsq += impl.grad_stats(g[a - lo:z - lo])[0]
        return sumsq, nonfinite

    def combine(self, total, lr: float, step: int):
        """The data-parallel group's (sum of squares, non-finite count) summed over the TP ranks; MismatchError
        on the TP group's ranks unless they are at the same step with the same lr (before any update)."""
        tp = self.mesh.tp_comm
        local = np.array([total[0], total[1], lr, step], np.float64)
        table = np.empty((tp.size, 4), np.float64)
        with tp.waiting("tensor-parallel sum of the gradient norm"):
            tp.mpi.Allgather(local, table)
        ranks = self.mesh.tp_ranks
        for col, what, show in ((3, "ranks are at different steps", lambda v: f"step() call {int(v)}"),
                                (2, "ranks called step() with different learning rates", lambda v: f"lr={v:g}")):
            if (table[:, col] != table[0, col]).any():
                seen: Dict[float, List[int]] = {}
                for r, v in zip(ranks, table[:, col].tolist()):
                    seen.setdefault(v, []).append(r)
                raise MismatchError(f"{what} (tensor-parallel group {ranks}): " + ", ".join(
                    f"{show(v)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                    for v, rs in seen.items())
                    + "; every rank must call step() alike, with the same lr (and schedule)")
        return sum_table(table[:, :2])

    def path(self, path: str) -> str:
        return os.path.join(path, tp_folder(self.mesh.tp_rank, self.mesh.tp))

    def load_path(self, path: str) -> str:
        """This TP rank's checkpoint under ``path``; CheckpointError (on every rank alike: one file system)
        when ``path`` holds no pieces of this TP size."""
        from ..checkpoint.format import CheckpointError, resume_flags
        mine = self.path(path)
        if not os.path.isdir(mine):
            there = sorted(n for n in os.listdir(path) if n.startswith("tp")) if os.path.isdir(path) else []
            flags = resume_flags(path)     # what it was saved with, from its manifest
            raise CheckpointError(f"{path}: no tensor-parallel checkpoint for tp={self.mesh.tp} (found "
                                  f"{there or 'none'}); resume it with the mesh it was saved with "
                                  f"({flags or 'its TP size'}), or consolidate it")
        return mine

    def load(self, engine, path: str, load):
        """``load(engine, this TP rank's checkpoint under path)``, after every TP rank found (one all-gather over the
        mesh) a checkpoint of the same step saved with this tp_split; else CheckpointError on every rank, nothing
        loaded. Pieces of two steps (a save one TP group published and another did not, a ``latest`` moved by
        hand) or cut by another split would make a model that never existed."""
        from ..checkpoint.format import CheckpointError, read_manifest, resolve
        mine, got = self.load_path(path), None
        try:
            ckpt = resolve(mine)
            manifest = read_manifest(ckpt)[0]
            saved = (manifest.get("extra") or {}).get(TP_KEY, {}).get("split")
            got = (manifest["step"], os.path.relpath(ckpt, path), saved)
        except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
            pass                         # a bad checkpoint: load() says so, on every rank alike
        stage = SimpleNamespace(mpi=self.mesh.stage_mpi, waiting=engine.comm.waiting)
        with watched(stage, "tensor-parallel load: agreement on the checkpoint"):
            everyone = self.mesh.stage_mpi.allgather(got)
        found = [(r, g) for r, g in enumerate(everyone) if g is not None]
        split = {k: list(v) for k, v in self.split.items()}
        other = [(r, g[2]) for r, g in found if g[2] != split]
        if other:
            raise CheckpointError(f"{path}: the checkpoint of {rank_set([r for r, _ in other])} "
                                  f"was saved with tp_split={other[0][1]}, this engine has tp_split={split}; "
                                  "load it with the split it was saved with")
        if len({g[0] for _, g in found}) > 1:
            seen: Dict[tuple, List[int]] = {}
            for r, g in found:
                seen.setdefault(g[:2], []).append(r)
            raise CheckpointError(f"{path}: the tensor-parallel ranks would restore different steps: " + ", ".join(
                f"{where} (step {step}) on {rank_set(rs)}" for (step, where), rs in seen.items())
                + "; load a step that every TP rank saved (DIR/tp{r}-of-{K}/step_NNNNNN)")
        return load(engine, mine)

    def extra(self, extra: Optional[dict]) -> dict:
        return dict(extra or {}, **{TP_KEY: {"size": self.mesh.tp, "rank": self.mesh.tp_rank,
                                             "split": {k: list(v) for k, v in self.split.items()}}})


def group_sizes(mesh: Optional[Mesh], sizes: MeshConfig) -> Tuple[Optional[int], Optional[int]]:
    """(node_size, shard_size) of the engine's group: with a Mesh, of its ZeRO group (dp x sp ranks: the
    world's settings divided by tp, Mesh.zero_sizes); else ``sizes``'."""
    if mesh is None:
        return sizes.node_size, sizes.shard_size
    return mesh.zero_sizes(sizes.node_size, sizes.shard_size)


def check_split(split, shapes) -> None:
    """ConfigError naming the parameter unless each tp_split value is (axis, groups): whole numbers, the axis
    one of the piece's, ``groups`` >= 1 dividing the piece's length along it (as comm/tp_pieces.merge cuts it)."""
    if not isinstance(split, Mapping):
        raise ConfigError(f"tp_split={split!r:.60} is not allowed; use a mapping {{parameter name: (axis, groups)}}")
    unknown = sorted(set(split) - set(shapes))
    if unknown:
        raise UsageError(f"tp_split names parameters the model does not have: {unknown[:5]}")
    for name, value in split.items():
        shape = tuple(shapes[name])
        ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
        if not ok:
            raise ConfigError(f"tp_split[{name!r}]={value!r} is not allowed; use (axis, groups): two whole numbers")
        axis, groups = value
        if not 0 <= axis < len(shape):
            raise ConfigError(f"tp_split[{name!r}]=({axis}, {groups}): parameter {name!r} has shape {shape}, no "
                              f"axis {axis}; use an axis in 0..{len(shape) - 1}")
        if groups < 1 or shape[axis] % groups:
            raise ConfigError(f"tp_split[{name!r}]=({axis}, {groups}): groups must be >= 1 and divide the piece's "
                              f"length {shape[axis]} along axis {axis} (shape {shape})")
