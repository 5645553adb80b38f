"""Nodes and shard groups in the estimate: the topology's checks, and bytes and time per level.

One concern: what changes when the N ranks sit in nodes of K (``node_size``) and shard the
model states over groups of S (``shard_size``, whole nodes, replicated across the R = N / S
groups; MiCS, FSDP's hybrid sharding), with ZeRO++'s hpZ for stage 3. The bytes per level are
the engine's own formula (``engine.traffic``, run-length encoded); the time per level is an
alpha-beta model: every collective costs its ring steps on that level times the latency, plus
its bytes at that level's bandwidth; the two levels are added (nothing overlaps: an upper
figure). The rules for K and S are comm/topology.py's (that module needs MPI; the estimate must
not), checked here with the same words.
"""
from dataclasses import dataclass
from typing import Dict, Optional

from ..engine import traffic
from ..errors import check
from .plan import BucketPlan

LEVELS = ("intra", "inter")


@dataclass(frozen=True)
class Levels:
    """``ranks`` in nodes of ``node_size`` and shard groups of ``shard_size``; ``hpz`` asked for."""
    ranks: int
    node_size: int
    shard_size: int
    hpz: bool = False

    @property
    def k(self) -> int:
        """Ranks of a shard group on one node."""
        return traffic.levels(self.ranks, self.node_size, self.shard_size)[0]

    @property
    def m(self) -> int:
        """Nodes a shard group spans."""
        return self.shard_size // self.k

    @property
    def replicas(self) -> int:
        """Shard groups (copies of the sharded model states)."""
        return self.ranks // self.shard_size

    @property
    def nodes(self) -> int:
        return self.ranks // self.node_size

    @property
    def hpz_applies(self) -> bool:
        """hpZ changes something: stage 3 with shard groups across nodes (else no gather leaves a node)."""
        return self.hpz and self.m > 1

    def secondary_numel(self, stage: int, numel: int) -> int:
        """Elements of hpZ's node-local copy one rank holds: its super-slice, 1/K of every bucket."""
        return numel // self.k if stage == 3 and self.hpz_applies else 0


def check_levels(ranks: int, node_size: Optional[int], shard_size: Optional[int], hpz: bool) -> Levels:
    """The topology, or ConfigError naming the value and what is allowed. ``node_size`` None: one
    node of every rank; ``shard_size`` None: one shard group of every rank."""
    for name, v in (("node_size", node_size), ("shard_size", shard_size)):
        check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
              f"{name}={v!r} must be a whole number of ranks >= 1")
    check(isinstance(hpz, bool), f"hpz={hpz!r} must be True or False")
    k = ranks if node_size is None else node_size
    s = ranks if shard_size is None else shard_size
    check(ranks % k == 0, f"node_size={k} does not divide the {ranks} ranks; use a divisor of {ranks}")
    one_node = " (no node_size given: all ranks on one node)" if node_size is None else ""
    check(ranks % s == 0 and s % k == 0,
          f"shard_size={s} is not allowed with {ranks} ranks in nodes of {k}{one_node}; use a divisor of {ranks} "
          f"that is a multiple of the node size {k} (shard groups are whole nodes)")
    return Levels(ranks, k, s, hpz)


def scratch_elements(plan: BucketPlan, lv: Levels, in_flight: int) -> int:
    """Elements of the communicators' receive scratch, kept pooled per bucket length, with
    ``in_flight`` reductions (one at least) in flight at once.

    A group inside one node is a flat Communicator: the S - 1 peers' slices of a bucket. Across
    nodes (comm/hierarchical.py): the node's reduce-scatter receives the K - 1 peers' parts
    ((K - 1) / K of the bucket), keeps the node's partial sum (1 / K), and the reduce-scatter
    across nodes receives the M - 1 peers' slices of it ((M - 1) / S). With shard groups, the
    blocking all-reduce across groups receives (R - 1) / R of a slice, one per bucket length.
    """
    live = plan.per_size(max(in_flight, 1))
    s, k, m, r = lv.shard_size, lv.k, lv.m, lv.replicas
    group = live * (s - 1) // s if m == 1 else live * (k - 1) // k + live // k + live * (m - 1) // s
    return group + (plan.per_size(1) // s) * (r - 1) // r


def level_traffic(stage: int, plan: BucketPlan, itemsize: int, lv: Levels, micro_batches: int, ahead: int,
                  latency_us: float, intra_gbps: float, inter_gbps: float, weights=None,
                  grads=None) -> Dict[str, Dict[str, float]]:
    """Bytes one rank sends per step inside its node and across nodes (engine.traffic), the ring steps
    (latency-bound messages) of its collectives on each level, and the seconds of each level.
    ``weights`` / ``grads``: the comm.quantized.Quantization of qwZ and qgZ, or None: the bytes on
    the wire, as the engine counts them (None for both: the logical bytes)."""
    calls = traffic.step_calls(stage, plan.runs, lv.ranks, lv.node_size, lv.shard_size, micro_batches, ahead,
                               lv.hpz and stage == 3)
    k, m, r = lv.k, lv.m, lv.replicas
    steps_per_call = dict.fromkeys(traffic.GROUP_KINDS, (k - 1, m - 1))
    steps_per_call.update(node=(k - 1, 0), replicas=(0, 2 * (r - 1)))
    sent, steps = dict.fromkeys(LEVELS, 0), dict.fromkeys(LEVELS, 0)
    for kind, per in calls.items():
        for b, times in per.items():
            nbytes = traffic.call_bytes(kind, b, itemsize, lv.ranks, lv.node_size, lv.shard_size, weights, grads)
            for level, e, st in zip(LEVELS, nbytes, steps_per_call[kind]):
                sent[level] += times * e
                steps[level] += times * st
    gbps = {"intra": intra_gbps, "inter": inter_gbps}
    seconds = {lvl: steps[lvl] * latency_us * 1e-6 + sent[lvl] * 8 / (gbps[lvl] * 1e9) for lvl in LEVELS}
    return {"bytes": sent, "messages": steps, "seconds": seconds}


def flat_traffic(stage: int, plan: BucketPlan, itemsize: int, lv: Levels, micro_batches: int, ahead: int,
                 latency_us: float, intra_gbps: float, inter_gbps: float, weights=None,
                 grads=None) -> Dict[str, Dict[str, float]]:
    """:func:`level_traffic` if the shard group's collectives were flat, unaware of nodes (as before
    there were two levels): a rank sends a bucket's slice to each of its S - 1 peers, K - 1 of them
    on its node (a slice's wire block when quantized); hpZ needs two levels, so it is left out."""
    calls = traffic.step_calls(stage, plan.runs, lv.ranks, lv.node_size, lv.shard_size, micro_batches, ahead)
    s, k = lv.shard_size, lv.k
    quant = {"reduce_scatter": grads, "gather": weights}
    sent, steps = dict.fromkeys(LEVELS, 0), dict.fromkeys(LEVELS, 0)
    for kind in traffic.GROUP_KINDS:
        q = quant.get(kind)
        for b, times in calls[kind].items():
            block = (b // s) * itemsize if q is None else q.wire_bytes(b // s)
            sent["intra"] += times * (k - 1) * block
            sent["inter"] += times * (s - k) * block
            steps["intra"] += times * (k - 1)
            steps["inter"] += times * (s - k)
    for b, times in calls["replicas"].items():
        sent["inter"] += times * traffic.call_bytes("replicas", b, itemsize, lv.ranks, lv.node_size, s)[1]
        steps["inter"] += times * 2 * (lv.replicas - 1)
    gbps = {"intra": intra_gbps, "inter": inter_gbps}
    seconds = {lvl: steps[lvl] * latency_us * 1e-6 + sent[lvl] * 8 / (gbps[lvl] * 1e9) for lvl in LEVELS}
    return {"bytes": sent, "messages": steps, "seconds": seconds}
