"""MeshConfig: how the ranks are arranged (tensor, sequence and pipeline parallelism, nodes, shard groups).

The engine's knobs are ZeroConfig's (engine/config.py), the pipeline's schedule PipelineConfig's; this
says only how many ranks each axis of the mesh has (comm/mesh.py) and where nodes and shard groups
are. Whether the sizes fit a world of N ranks is checked once N is known (comm/mesh.check_mesh).
"""
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..errors import check
from ..flags import flag
from ..strict import strict_fields

FIELDS = ("tp", "sp", "pp", "node_size", "shard_size")


@dataclass(frozen=True)
class MeshConfig:
    """The mesh's sizes, in ranks; invalid values raise ConfigError (one line naming the value)."""

    tp: int = field(default=1, metadata=flag(
        "tensor parallelism: N ranks as N/K data-parallel groups x K adjacent TP ranks; ZeRO shards each TP "
        "rank's pieces over its data-parallel group (docs/tensor-parallel.md)", metavar="K"))
    """Tensor-parallel ranks per group (comm/mesh.py): N ranks form N/tp data-parallel groups x tp adjacent
    TP ranks, and the engine shards each TP rank's pieces over its data-parallel group (needs tp_split)."""
    sp: int = field(default=1, metadata=flag(
        "sequence parallelism (DeepSpeed-Ulysses, the GPT): each sequence cut into K chunks over K adjacent "
        "ranks (TP groups), an all-to-all before and after attention; ZeRO shards over the data- x "
        "sequence-parallel ranks (docs/sequence-parallel.md)", metavar="K"))
    """Sequence-parallel ranks per group (DeepSpeed-Ulysses; comm/mesh.py): each sequence is cut into sp
    contiguous chunks, one per rank of the group, whose all-to-alls give attention the whole sequence for
    n_head / sp of the heads. Those ranks hold the same parameters: ZeRO shards over dp x sp ranks together."""
    pp: int = field(default=1, metadata=flag(
        "pipeline parallelism: the model's layers in P stages of N/P ranks (data x tensor parallel inside "
        "each), micro-batches through them by --schedule (docs/pipeline.md)", metavar="P"))
    """Pipeline stages (comm/mesh.py): N ranks = pp stages x N/(tp pp) data-parallel x tp. An engine holds one
    model chunk of one stage (give it the zerompi.Mesh); zerompi.pipeline runs the stages (docs/pipeline.md)."""
    node_size: Optional[int] = field(default=None, metadata=flag(
        "ranks per node (default: $ZEROMPI_NODE_SIZE, else MPI's shared-memory split); smaller than the "
        "ranks of one machine, it simulates several nodes", metavar="K"))
    """Ranks per node: blocks of consecutive ranks that share the fast links. None: $ZEROMPI_NODE_SIZE,
    else MPI's shared-memory split. Setting it on one machine simulates several nodes (comm/topology.py)."""
    shard_size: Optional[int] = field(default=None, metadata=flag(
        "shard the model states over groups of K ranks (whole nodes), replicated across the groups (MiCS / "
        "hybrid sharding; default: all ranks)", metavar="K"))
    """Ranks that share one sharded copy of the model states (MiCS / hybrid sharding): groups of this
    many consecutive ranks, whole nodes, each replicated across the N / shard_size groups. None: all N."""

    def __post_init__(self):
        strict_fields(self)
        for name in ("node_size", "shard_size"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                  f"{name}={v!r} must be a whole number of ranks >= 1 (or None)")
        if self.node_size and self.shard_size:
            check(self.shard_size % self.node_size == 0,
                  f"shard_size={self.shard_size} is not a multiple of node_size={self.node_size}; shard groups are "
                  "whole nodes")
        for name, what in (("tp", "ranks >= 1 (tensor-parallel group size)"),
                           ("sp", "ranks >= 1 (sequence-parallel group size)"), ("pp", "pipeline stages >= 1")):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                  f"{name}={v!r} must be a whole number of {what}")

    def to_dict(self) -> dict:
        return asdict(self)
