"""Bytes one rank sends per optimizer step, by level (inside its node, across nodes): the formula.

Each collective is counted the way the Communicator counts it: a rank sends its block to
every peer of the collective, so a reduce-scatter or all-gather over G ranks of a bucket of
B elements sends (G - 1) * B / G. Over a shard group of S = K * M ranks (K per node, M
nodes), the two-level collectives (comm/hierarchical.py) send (K - 1) * B / K inside the
node and (M - 1) * B / S across nodes. Per step:

- every stage: a reduce-scatter of every bucket per micro-batch; with R = N / S shard groups,
  an all-reduce of the reduced shard across groups once per step (2 (R - 1) / R of it, all
  across nodes, since groups are whole nodes);
- stage 0: an all-gather of the gradient; stages 1/2: an all-gather of the new parameters;
- stage 3: a gather of every bucket in every forward and backward pass, except the
  buckets a turn keeps (the last ``1 + ahead`` of the forward are those the backward starts
  with; between micro-batches, the first ``1 + ahead``); with hpZ, only the first forward
  after a step gathers across nodes, every other gather stays inside the node.

The single-node, single-group case is the classic ZeRO table: 2 passes of (N - 1) / N Psi
for stages 0-2 (one reduce-scatter per micro-batch), 3 per micro-batch for stage 3.

Quantized (comm/quantized.py), a block travels as its wire size (the int8/int4 values,
padded to 4 bytes, and a float32 scale per quantization block): qgZ for the reduce-scatters
(the node level quantizes super-slices, the level across nodes slices), qwZ for the
parameter gathers; the all-reduce across groups, stage 0's gradient all-gather and hpZ's
gathers inside the node travel unquantized.

:func:`step_bytes` takes every bucket's length; :func:`step_calls` and :func:`step_bytes_runs`
take them run-length encoded, ``(length, consecutive buckets of it)`` as the estimate's
BucketPlan holds them, so a model of 10^10 parameters costs a few runs, not a list per bucket
(tested equal to :func:`step_bytes` on the engine's layouts).
"""
from typing import Dict, Optional, Sequence, Tuple


def step_bytes(stage: int, buckets: Sequence[int], itemsize: int, ranks: int, node_size: int, shard_size: int,
               micro_batches: int = 1, ahead: int = 0, hpz: bool = False, weights=None, grads=None,
               turns: bool = True) -> Dict[str, int]:
    """{"intra": bytes, "inter": bytes} one rank sends per step. ``buckets``: every bucket's padded
    length in elements, in layout order; ``ahead``: stage 3's prefetch depth (0 with overlap off);
    ``turns`` False: stage 3 gathers every bucket in every forward and backward, none kept across a
    turn (the most a pipeline's chunk sends, whose forwards and backwards a schedule interleaves).
    ``weights`` / ``grads``: the comm.quantized.Quantization of the parameter gathers (qwZ) and
    the gradient reduce-scatters (qgZ), or None; with them the bytes are those on the wire
    (values + scales), and the same call without them gives the logical bytes."""
    k = min(node_size, shard_size)
    m = shard_size // k
    r = ranks // shard_size
    intra = inter = 0

    def size(q: Optional[object], n: int) -> int:        # bytes one block of n elements travels as
        return n * itemsize if q is None else q.wire_bytes(n)

    def reduce_scatter(b: int, times: int) -> None:     # node level: super-slices; across: slices
        nonlocal intra, inter
        s = b // shard_size
        intra += times * (k - 1) * size(grads, m * s)
        inter += times * (m - 1) * size(grads, s)

    def gather(b: int, times: int, q) -> None:          # across: slices; node level: m of them
        nonlocal intra, inter
        s = b // shard_size
        inter += times * (m - 1) * size(q, s)
        intra += times * (k - 1) * m * size(q, s)

    for b in buckets:
        reduce_scatter(b, micro_batches)                        # the gradient reduce-scatters
        inter += 2 * (r - 1) * (b // shard_size) // r * itemsize   # the all-reduce across shard groups
        if stage == 0:
            gather(b, 1, None)                                   # the gradient all-gather
        elif stage < 3:
            gather(b, 1, weights)                                # the parameter publish
    if stage == 3:
        nb, t = len(buckets), min(1 + ahead, len(buckets))
        for i, b in enumerate(buckets):
            gathers = 2 * micro_batches - micro_batches * (i >= nb - t) - (micro_batches - 1) * (i < t)
            gathers = gathers if turns else 2 * micro_batches
            if hpz and m > 1:
                gather(b, 1, weights)                            # the first forward after the step
                intra += (gathers - 1) * (k - 1) * (b // k) * itemsize   # the others from the node-local copies
            else:
                gather(b, gathers, weights)
    return {"intra": intra, "inter": inter}


# ---- the same, run-length encoded ------------------------------------------------------------
KINDS = ("reduce_scatter", "gather", "grad_gather", "node", "replicas")
"""The collectives of a step, by kind: over the shard group (two-level when it spans nodes) a
gradient ``reduce_scatter`` (qgZ when quantized), a parameter ``gather`` (qwZ), stage 0's
gradient all-gather ``grad_gather``; ``node``: hpZ's gather inside the node from the secondary
copies; ``replicas``: the all-reduce of a bucket's reduced slice across the shard groups."""
GROUP_KINDS = KINDS[:3]


def levels(ranks: int, node_size: int, shard_size: int) -> Tuple[int, int, int]:
    """(K ranks of the group per node, M nodes per group, R shard groups)."""
    k = min(node_size, shard_size)
    return k, shard_size // k, ranks // shard_size


def call_bytes(kind: str, b: int, itemsize: int, ranks: int, node_size: int, shard_size: int,
               weights=None, grads=None) -> Tuple[int, int]:
    """(inside the node, across nodes): bytes one rank sends in one collective of ``kind`` on a
    bucket of ``b`` elements (a multiple of shard_size x R, as FlatLayout cuts the engine's buckets),
    counted as :func:`step_bytes` counts them."""
    k, m, r = levels(ranks, node_size, shard_size)
    s = b // shard_size
    q = {"reduce_scatter": grads, "gather": weights}.get(kind)
    size = (lambda n: n * itemsize) if q is None else q.wire_bytes
    if kind == "reduce_scatter":
        return (k - 1) * size(m * s), (m - 1) * size(s)
    if kind in ("gather", "grad_gather"):
        return (k - 1) * m * size(s), (m - 1) * size(s)
    if kind == "node":
        return (k - 1) * (b // k) * itemsize, 0
    return 0, 2 * (r - 1) * s // r * itemsize


def step_calls(stage: int, runs: Sequence[Tuple[int, int]], ranks: int, node_size: int, shard_size: int,
               micro_batches: int = 1, ahead: int = 0, hpz: bool = False) -> Dict[str, Dict[int, int]]:
    """{kind: {bucket length: collectives per step}} (KINDS), as :func:`step_bytes` counts them.
    ``runs``: (padded bucket length, consecutive buckets of that length), in layout order."""
    k, m, r = levels(ranks, node_size, shard_size)
    out: Dict[str, Dict[int, int]] = {kind: {} for kind in KINDS}

    def add(kind: str, b: int, times: int) -> None:
        if times:
            out[kind][b] = out[kind].get(b, 0) + times

    nb = sum(c for _, c in runs)
    t = min(1 + ahead, nb)
    pos = 0
    for b, c in runs:
        add("reduce_scatter", b, c * micro_batches)
        if r > 1:
            add("replicas", b, c)
        if stage == 0:
            add("grad_gather", b, c)
        elif stage < 3:
            add("gather", b, c)                                 # the parameter publish
        else:
            first = max(0, min(pos + c, t) - pos)               # of this run, among the first t buckets
            last = max(0, pos + c - max(pos, nb - t))           # ... and among the last t
            gathers = 2 * micro_batches * c - micro_batches * last - (micro_batches - 1) * first
            if hpz and m > 1:
                add("gather", b, c)                             # the first forward after the step
                add("node", b, gathers - c)                     # the others from the node-local copies
            else:
                add("gather", b, gathers)
        pos += c
    return out


def step_bytes_runs(stage: int, runs: Sequence[Tuple[int, int]], itemsize: int, ranks: int, node_size: int,
                    shard_size: int, micro_batches: int = 1, ahead: int = 0, hpz: bool = False, weights=None,
                    grads=None) -> Dict[str, int]:
    """:func:`step_bytes` for buckets given as runs (length, count) in layout order."""
    intra = inter = 0
    for kind, per in step_calls(stage, runs, ranks, node_size, shard_size, micro_batches, ahead, hpz).items():
        for b, times in per.items():
            a, e = call_bytes(kind, b, itemsize, ranks, node_size, shard_size, weights, grads)
            intra, inter = intra + times * a, inter + times * e
    return {"intra": intra, "inter": inter}


def sources_bytes_by_level(lengths: Dict[int, int], itemsize: int, ranks: int, sources: int, micro_batches: int,
                           node_size: Optional[int] = None, shard_size: Optional[int] = None,
                           per_node: Optional[int] = None) -> Dict[str, int]:
    """{"intra", "inter"}: what an expert engine's reduce-scatters send beyond one partial each, per step
    (comm/sources_reduce.py): inside the node K - 1 more per bucket and micro-batch; across nodes, where the
    sources span whole nodes of ``per_node``, K/per_node - 1 more (else none: a node's sum crosses). ``ranks``,
    ``node_size``, ``shard_size``: the expert engine's group (default: one node, one shard group)."""
    k, s = node_size or ranks, shard_size or ranks
    intra = inter = 0
    for n, c in lengths.items():
        a, e = call_bytes("reduce_scatter", n, itemsize, ranks, k, s)
        intra, inter = intra + c * a, inter + c * e
    more_inter = sources // per_node - 1 if per_node else 0
    return {"intra": (sources - 1) * micro_batches * intra, "inter": more_inter * micro_batches * inter}
