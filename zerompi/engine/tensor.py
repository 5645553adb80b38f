"""The engine's tensor-parallel part: ZeRO over the data-parallel group of a Mesh.

Each TP rank's engine holds the layout of its own pieces (``tp_split`` names the pieces: parameter
-> (axis, groups), every other parameter is replicated on the TP ranks) and shards them over its
data-parallel group. What crosses the TP group here: the global gradient norm and the overflow
flag (each split piece counted on its own rank, the replicated parameters once, on TP rank 0),
so that clipping and skipping agree with a run without TP. Checkpoints go to ``DIR/tp{r}-of-{K}``,
one ordinary checkpoint per TP rank, with the split recorded for ``consolidate``.
"""
import os
from typing import Mapping, Optional, Tuple

from ..comm.mesh import Mesh, check_tp
from ..errors import UsageError
from ..optim import impl

TP_KEY = "tensor_parallel"    # manifest["extra"][TP_KEY]: {"size", "rank", "split": {name: [axis, groups]}}


def tp_folder(rank: int, size: int) -> str:
    return f"tp{rank}-of-{size}"


class TensorParallel:
    """One rank's place in the mesh and which of its parameters are split."""

    def __init__(self, mesh: Mesh, split: Mapping[str, Tuple[int, int]]):
        self.mesh, self.split = mesh, {k: (int(a), int(g)) for k, (a, g) in split.items()}

    @staticmethod
    def of(comm, config, split, names) -> Optional["TensorParallel"]:
        """The engine's TensorParallel for ``comm`` (a Mesh, or a communicator with config.tp > 1), else None."""
        if isinstance(comm, Mesh):
            if config.tp not in (1, comm.tp):
                raise UsageError(f"config.tp={config.tp} but the Mesh passed has tp={comm.tp}; give one")
            mesh = comm
        elif config.tp > 1:
            mesh = Mesh(comm, config.tp, config.node_size)
        else:
            if split:
                raise UsageError("tp_split given without tensor parallelism; pass a Mesh or set config.tp")
            return None
        if split is None:
            raise UsageError("tensor parallelism needs tp_split={parameter name: (axis, groups)} for the split "
                             "parameters (every other one is taken as replicated on the TP ranks)")
        unknown = sorted(set(split) - set(names))
        if unknown:
            raise UsageError(f"tp_split names parameters the model does not have: {unknown[:5]}")
        return TensorParallel(mesh, split)

    def sizes(self, config) -> Tuple[Optional[int], Optional[int]]:
        """(node_size, shard_size) of the data-parallel group: the world's, divided by tp."""
        out = []
        for name in ("node_size", "shard_size"):
            v = getattr(config, name)
            if name == "node_size" and v is None:
                text = os.environ.get("ZEROMPI_NODE_SIZE", "").strip()
                v = int(text) if text.isdigit() else None
            if v is not None:
                check_tp(self.mesh.tp, self.mesh.world.Get_size(), **{name: v})
                v //= self.mesh.tp
            out.append(v)
        return out[0], out[1]

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

    def combine(self, total):
        """The data-parallel group's (sum of squares, non-finite count) summed over the TP ranks."""
        return self.mesh.tp_comm.sum_scalars(total[:2])

    def path(self, path: str) -> str:
        return os.path.join(path, tp_folder(self.mesh.tp_rank, self.mesh.tp))

    def load_path(self, path: str) -> str:
        """This TP rank's checkpoint under ``path``; CheckpointError (on every rank alike: one file system)
        when ``path`` holds no pieces of this TP size."""
        from ..checkpoint.format import CheckpointError
        mine = self.path(path)
        if not os.path.isdir(mine):
            there = sorted(n for n in os.listdir(path) if n.startswith("tp")) if os.path.isdir(path) else []
            raise CheckpointError(f"{path}: no tensor-parallel checkpoint for tp={self.mesh.tp} (found "
                                  f"{there or 'none'}); resume with the TP size it was saved at, or consolidate it")
        return mine

    def extra(self, extra: Optional[dict]) -> dict:
        return dict(extra or {}, **{TP_KEY: {"size": self.mesh.tp, "rank": self.mesh.tp_rank,
                                             "split": {k: list(v) for k, v in self.split.items()}}})
