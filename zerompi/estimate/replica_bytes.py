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

With --pp P each of a rank's model chunks is a part (its stage's V chunks: V = 1, or --chunks V interleaved), and
its buddy is the rank at the same place on the next node, which may be of another stage: a rank holds its own
chunks' shards and its source's (pipeline_replicas). The stages differ (the first chunk holds the embeddings, the
last the final LayerNorm), so the ranks do: the estimate gives every rank's bytes and names the rank with the most.
"""
from typing import Dict, List, Optional, Sequence

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


def pipeline_replicas(chunk_sizes: Sequence[Sequence[int]], chunks_of: Dict[int, List[int]], ranks: int,
                      node_size: int, dtype: str, bucket_mb: float, optimizer: str = "adamw") -> dict:
    """The replicas' bytes of every rank of a pipelined run: ``chunk_sizes`` the layer sizes (elements) of each
    model chunk, ``chunks_of`` {stage: its chunks} (the schedule's placement), the stages contiguous blocks of
    ranks/P data-parallel ranks (comm/mesh.py), in nodes of ``node_size`` ranks (blocks of the world). Each chunk's
    engine shards its layers over its stage's ranks (plan.plan_layer_sizes: the engine's padded buckets); a rank
    holds per step a file of R rows of S_c float32 and a header for each of its chunks and of its source's (the
    rank whose buddy it is: the same place on the previous node), two steps."""
    from .plan import bucket_numel, plan_layer_sizes
    pp = len(chunks_of)
    check(ranks % pp == 0, f"pp={pp} does not divide ranks={ranks}; each stage holds ranks/pp of them")
    check(isinstance(node_size, int) and node_size >= 1 and ranks % node_size == 0,
          f"node_size={node_size!r} must divide ranks={ranks} (nodes of equal size)")
    check(ranks // node_size >= 2, f"--replicas keeps each shard's second copy on another node, and {ranks} ranks "
                                   f"in nodes of {node_size} make 1 node: give --node-size K with 2 nodes or more")
    dp, cap = ranks // pp, bucket_numel(dtype, bucket_mb)
    shard = [plan_layer_sizes(sizes, dp, cap).shard_numel for sizes in chunk_sizes]
    return _by_rank([[shard[c] for c in chunks_of[s]] for s in range(pp)], ranks, node_size,
                    bytes_per_param(optimizer) // 4, shard, len(chunks_of[0]))


def pipeline_moe_replicas(pm: dict, ranks: int, node_size: int, optimizer: str = "adamw") -> dict:
    """The replicas' bytes of every rank of a pipelined MoE run from its stages' engines (moe_bytes.pipeline_moe:
    each stage's chunks' dense engines, then their expert engines with --ep K > 1, each engine's padded shard S):
    a rank holds per step a file of R rows of S float32 and a header for each of its engines and of its source's,
    two steps (train/moe/checkpoints.py's parts)."""
    check(isinstance(node_size, int) and node_size >= 1 and ranks % node_size == 0,
          f"node_size={node_size!r} must divide ranks={ranks} (nodes of equal size)")
    check(ranks // node_size >= 2, f"--replicas keeps each shard's second copy on another node, and {ranks} ranks "
                                   f"in nodes of {node_size} make 1 node: give --node-size K with 2 nodes or more")
    per_stage = [st["shard_numel"] for st in pm["pipeline_stages"]]
    return dict(_by_rank(per_stage, ranks, node_size, bytes_per_param(optimizer) // 4,
                         [n for st in per_stage for n in st], pm["chunks_per_stage"]),
                engines="each stage's chunks' dense engines, then their expert engines")


def _by_rank(per_stage: List[List[int]], ranks: int, node_size: int, rows: int, shards: List[int],
             chunks_per_stage: int) -> dict:
    """Every rank's replica bytes: stage s's ranks (ranks/P consecutive) each hold one shard file of each of
    ``per_stage[s]`` (elements) and of its source's (the same place on the previous node), two steps."""
    from ..checkpoint.replica_files import HEADER_BYTES
    pp = len(per_stage)
    dp = ranks // pp
    own = [per_stage[r // dp] for r in range(ranks)]
    nodes = ranks // node_size
    source = [((r // node_size - 1) % nodes) * node_size + r % node_size for r in range(ranks)]
    files = [own[r] + own[source[r]] for r in range(ranks)]
    by_rank = [2 * sum(4 * rows * s + HEADER_BYTES for s in f) for f in files]
    top = max(range(ranks), key=lambda r: (by_rank[r], -r))
    return {"pp": pp, "chunks_per_stage": chunks_per_stage, "node_size": node_size, "rows": rows,
            "header_bytes": HEADER_BYTES, "chunk_shard_numel": shards, "by_rank": by_rank, "rank": top,
            "source": source[top], "shard_numel": files[top][0], "expert_shard_numel": None,
            "files": len(files[top]), "per_step": by_rank[top] // 2, "total": by_rank[top]}


def gpt_chunk_sizes(vocab: int, seq_len: int, d_model: int, n_layer: int, chunks: int) -> List[List[int]]:
    """The layer sizes of each of ``chunks`` model chunks of the built-in GPT (train/models/chunks.py's
    chunk_layers: the embeddings on the first, the final LayerNorm on the last, an equal run of blocks each)."""
    from .activations import gpt_layer_sizes
    check(n_layer % chunks == 0, f"n_layer={n_layer} is not divisible into {chunks} equal chunks of blocks; use "
                                 f"a multiple of {chunks}")
    sizes, per = gpt_layer_sizes(vocab, seq_len, d_model, n_layer), n_layer // chunks
    return [([sizes[0]] if c == 0 else []) + sizes[1 + c * per:1 + (c + 1) * per] +
            ([sizes[-1]] if c == chunks - 1 else []) for c in range(chunks)]


def equal_chunk_sizes(params: int, layers: int, chunks: int) -> List[List[int]]:
    """The layer sizes of each chunk of a model of ``layers`` equal layers (plan.plan_buckets' rule: the first
    params mod layers one element larger)."""
    check(layers % chunks == 0, f"layers={layers} is not divisible into {chunks} equal chunks; use a multiple "
                                f"of {chunks}")
    small, extra = divmod(params, layers)
    sizes, per = [small + 1] * extra + [small] * (layers - extra), layers // chunks
    return [sizes[c * per:(c + 1) * per] for c in range(chunks)]


def format_replicas(rep: dict) -> str:
    if rep.get("by_rank") is not None:
        shards = ", ".join(f"{s:,}" for s in rep["chunk_shard_numel"])
        return (f"\nreplicas (--replicas, host shared memory): {rep['total']:,} bytes on rank {rep['rank']}, the "
                f"most of the {len(rep['by_rank'])} ranks (--pp {rep['pp']}, {rep['chunks_per_stage']} chunk(s) "
                f"per stage, nodes of {rep['node_size']}) = 2 steps x {rep['files']} files x ({4 * rep['rows']} "
                f"S_c + {rep['header_bytes']}): its chunks' and its source's (rank {rep['source']}); S_c = {shards} "
                f"elements ({rep.get('engines', 'each chunk')}: padded shards), R = {rep['rows']} float32 rows "
                "(the master and the optimizer's state); every rank: "
                f"{', '.join(f'{b:,}' for b in rep['by_rank'])}; plus the step's manifests (docs/failures.md)")
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
