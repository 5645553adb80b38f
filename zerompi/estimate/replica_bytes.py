"""``--replicas``: the host shared memory one rank's in-memory shard replicas take (train/replicas.py), before
launch.

After every step each rank copies its shard (the fp32 master and the optimizer's state rows of its S = Ψ/N
padded elements) into shared memory and receives its source's copy: two shard files of R rows of S float32 and
a 128-byte header each, for two steps (the committed one and the spare the next overwrites), so
2 x 2 x (4 R S + 128) bytes per rank, plus the step's manifest (docs/failures.md, Replicas).
"""
from ..engine.optimizers import bytes_per_param
from ..errors import check


def check_replicas(ranks: int, node_size: int, other: dict) -> None:
    """ConfigError (one line) where the estimate cannot price --replicas: ``other`` maps a flag to its value where
    it does not yet (the run takes them: one part per engine, docs/failures.md); the second copy of each shard
    lives on another node."""
    for name, value in other.items():
        check(False, f"the estimate does not price --replicas with {name} {value} yet (the run takes it: one part "
                     f"per engine, docs/failures.md); drop --replicas or {name}")
    check(ranks // node_size >= 2, f"--replicas keeps each shard's second copy on another node, and {ranks} ranks "
                                   f"in nodes of {node_size} make 1 node: give --node-size K with 2 nodes or more")


def replica_estimate(est: dict) -> dict:
    """The replicas' bytes per rank for the estimate ``est`` (its padded layout, shard group and optimizer)."""
    from ..checkpoint.replica_files import HEADER_BYTES
    shard = est["padded_params"] // est["shard_size"]
    rows = bytes_per_param(est.get("optimizer", "adamw")) // 4     # fp32 rows: the master and the optimizer's
    files = 2 * (4 * rows * shard + HEADER_BYTES)
    return {"shard_numel": shard, "rows": rows, "header_bytes": HEADER_BYTES, "per_step": files, "total": 2 * files}


def format_replicas(rep: dict) -> str:
    return (f"\nreplicas (--replicas, host shared memory): {rep['total']:,} bytes per rank at every stage = 2 steps "
            f"x 2 files x ({4 * rep['rows']} S + {rep['header_bytes']}), S = {rep['shard_numel']:,} elements (the "
            f"rank's padded shard), R = {rep['rows']} float32 rows (the master and the optimizer's state), plus the "
            f"step's manifest (docs/failures.md)")
