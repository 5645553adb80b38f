"""``--replicas``: the host shared memory one rank's in-memory shard replicas take (train/replicas.py), before
launch.

After every step each rank copies its shard of every engine it has (the fp32 master and the optimizer's state rows
of its S padded elements) into shared memory and receives its source's copy: R rows of S float32 and a 128-byte
header per shard file, two files per engine (its own and its source's; one where shard groups are whole nodes:
the buddy then holds the same shard and its own copy is the second), for two steps (the committed one and the
spare the next overwrites), so 2 x 2 x (4 R S + 128) bytes per rank for one engine, plus the step's manifests
(docs/failures.md, Replicas). S is the padded shard of the rank's engine: Ψ/N; with --tp K the TP rank's Ψ/K
over its N/K data-parallel ranks; with --sp the same as without (one engine over the dp x sp ranks); with
--experts E --ep K a second engine, this EP rank's E/K experts over the N/K ranks that hold them (S_e).
"""
from typing import Optional

from ..engine.optimizers import bytes_per_param
from ..errors import check


def check_replicas(ranks: int, node_size: Optional[int], other: dict) -> None:
    """ConfigError (one line) where the estimate cannot price --replicas: ``other`` maps a flag to its value where
    it does not yet; the second copy of each shard lives on another node (``ranks`` in nodes of ``node_size``;
    None: the run's nodes are MPI's or $ZEROMPI_NODE_SIZE, as with --ep, and it checks them itself)."""
    for name, value in other.items():
        check(False, f"the estimate does not price --replicas with {name} {value} yet (the run takes it: one part "
                     f"per engine, docs/failures.md); drop --replicas or {name}")
    check(node_size is None or ranks // node_size >= 2,
          f"--replicas keeps each shard's second copy on another node, and {ranks} ranks in nodes of {node_size} "
          "make 1 node: give --node-size K with 2 nodes or more")


def expert_engine(moe: dict, dtype: str, opts: dict) -> dict:
    """The expert engine's estimate at --ep K > 1 (its padded layout over its N/K ranks: moe_bytes.with_layouts)."""
    from .stages import estimate
    return estimate(moe["expert_params"] // moe["ep"], moe["expert_ranks"], dtype, layers=moe["moe_blocks"], **opts)


def replica_estimate(est: dict, experts: Optional[dict] = None, mirrored: bool = False) -> dict:
    """The replicas' bytes per rank for the estimate ``est`` (its padded layout, shard group and optimizer);
    ``experts``: the expert engine's (expert_engine); ``mirrored``: shard groups of whole nodes (one file each)."""
    from ..checkpoint.replica_files import HEADER_BYTES
    shards = [e["padded_params"] // e["shard_size"] for e in [est] + ([experts] if experts else [])]
    rows = bytes_per_param(est.get("optimizer", "adamw")) // 4     # fp32 rows: the master and the optimizer's
    copies = 1 if mirrored else 2
    files = copies * sum(4 * rows * s + HEADER_BYTES for s in shards)
    return {"shard_numel": shards[0], "expert_shard_numel": shards[1] if experts else None, "rows": rows,
            "header_bytes": HEADER_BYTES, "files": copies * len(shards), "per_step": files, "total": 2 * files}


def format_replicas(rep: dict) -> str:
    one, mirror = f"{4 * rep['rows']} S + {rep['header_bytes']}", ""
    if rep["expert_shard_numel"] is None:
        sizes = f"{rep['files']} file{'s' if rep['files'] > 1 else ''} x ({one})"
        of = f"S = {rep['shard_numel']:,} elements (the rank's padded shard)"
        mirror = "; shard groups of whole nodes: the buddy holds the same shard" if rep["files"] == 1 else ""
    else:
        sizes = f"{rep['files'] // 2} x (({one}) + ({one.replace('S', 'S_e')}))"
        of = (f"S = {rep['shard_numel']:,} elements (the dense engine's padded shard), S_e = "
              f"{rep['expert_shard_numel']:,} (the expert engine's)")
    return (f"\nreplicas (--replicas, host shared memory): {rep['total']:,} bytes per rank at every stage = 2 steps "
            f"x {sizes}, {of}, R = {rep['rows']} float32 rows (the master and the optimizer's state){mirror}, plus "
            f"the step's manifests (docs/failures.md)")
