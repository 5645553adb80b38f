"""The per-stage arithmetic of ``zerompi.estimate``: bytes per rank and communication per step.

One concern: given a :class:`~zerompi.estimate.plan.BucketPlan`, the bytes one rank holds under
ZeRO stages 0-3, model states (parameters, gradients, fp32 master + Adam m and v, by
``memory.theory_bytes``) and the buffers this engine allocates on top of them (gradient
buckets, stage-3 gathered layers, spare bucket buffers, the micro-batch accumulator, the
reduce-scatter receive scratch), and the bytes and time of one step's communication
(``memory.theory_comm_bytes``, alpha-beta time model). :func:`estimate` checks its input and
returns the whole table as a dict; printing it is cli.py's.

The buffers follow the engine's bound on gradient reductions pending at once
(``reducer.MAX_PENDING_REDUCES``): the default figure is the most a rank can hold under it,
whatever the network's timing; the best case is the figure when every reduction is done
before the next bucket's gradients arrive.
"""
import math
from types import SimpleNamespace
from typing import Optional, Sequence

# The engine's own rules, imported (no copy here to go stale): the cap on gradient
# reductions pending at once, and how many bucket buffers are live at once.
from ..engine.buffers import buffer_counts
from ..engine.config import DTYPES, STAGES, ZeroConfig
from ..layout import FlatLayout
from ..engine.memory import OPTIMIZER_BYTES, theory_by_place, theory_bytes, theory_comm_bytes
from ..engine.optimizers import OPTIMIZERS, bytes_per_param
from ..engine import reducer
from ..comm.quantized import DEFAULT_BLOCK, check_quantization, quantization
from ..errors import check
from .levels import Levels, check_levels, flat_traffic, level_traffic, scratch_elements
from .plan import BucketPlan, bucket_numel, layer_layout, plan_buckets

DEFAULT_PREFETCH = getattr(ZeroConfig, "prefetch", 0)   # the engine's default stage-3 prefetch depth
# the table's names of the optimizer (estimate(optimizer=...) prices its rows: engine/optimizers.py)
OPTIMIZER_LABELS = {"adamw": ("AdamW", "optimizer (master, m, v)"), "muon": ("Muon", "optimizer (master,mom,m,v)")}
# The keys of a stage row's "buffers" dict (bytes per rank), in the order the table prints them.
BUFFER_ROWS = ("grad_buckets", "gathered_params", "spare_buffers", "grad_accumulator", "comm_scratch")


def formula(stage: int, itemsize: int, group: str = "N", node: Optional[str] = None,
            optimizer_bytes: int = OPTIMIZER_BYTES) -> str:
    """The model-state formula of a stage, e.g. '4Ψ + 12Ψ/N', read off theory_bytes itself.
    ``group``: the letter of the ranks one copy is sharded over (S for shard groups); ``node``: the
    letter of the node size when hpZ keeps its copy (1/node of the parameters), else None."""
    whole = theory_bytes(stage, 1, 1, itemsize, shard_numel=0, optimizer_bytes=optimizer_bytes)["total"]  # kept whole
    shard = theory_bytes(stage, 0, 1, itemsize, shard_numel=1, optimizer_bytes=optimizer_bytes)["total"]  # sharded
    extra = theory_bytes(stage, 0, 1, itemsize, shard_numel=0, secondary=1).get("secondary", 0) if node else 0
    parts = ([f"{whole}Ψ"] if whole else []) + ([f"{shard}Ψ/{group}"] if shard else []) + \
        ([f"{extra}Ψ/{node}"] if extra else [])
    return " + ".join(parts)


def ring_bytes(stage: int, plan: BucketPlan, itemsize: int, micro_batches: int, ahead: int, weights=None,
               grads=None):
    """(bytes one rank sends per step, of them what stage 3 need not send at the turns) by ring volumes
    over the plan's ranks: every pass sends a bucket's slice to each of the N - 1 peers, its wire block
    when quantized (``grads``: the reduce-scatters, qgZ; ``weights``: the parameter gathers of stages
    1-3, qwZ); ``memory.theory_comm_bytes`` when nothing is.

    At a turn the engine keeps what it holds gathered (the bucket in use and up to ``ahead`` more)
    instead of freeing it and gathering it again: the last buckets at each forward->backward turn,
    the first ones at each backward->forward turn."""
    n, m = plan.world_size, micro_batches
    weights = weights if stage > 0 else None          # stage 0 all-gathers gradients, unquantized
    if weights is None and grads is None:
        first, last = plan.ends(1 + ahead) if stage == 3 else (0, 0)
        return (theory_comm_bytes(stage, plan.numel, n, itemsize, m),
                itemsize * (m * last + (m - 1) * first) * (n - 1) // n)
    size = lambda q, b: (b // n) * itemsize if q is None else q.wire_bytes(b // n)   # one slice of a bucket
    gathers = 2 * m if stage == 3 else 1
    comm = sum(c * (n - 1) * (m * size(grads, b) + gathers * size(weights, b)) for b, c in plan.runs)
    first, last = plan.ends(1 + ahead, lambda b: size(weights, b)) if stage == 3 else (0, 0)
    return comm, (n - 1) * (m * last + (m - 1) * first)


def _stage_row(stage: int, plan: BucketPlan, itemsize: int, micro_batches: int, prefetch: int, overlap: bool,
               pending: int, bandwidth_gbps: float, latency_us: float, cap: int, lv: Levels, gbps: tuple,
               quant: tuple = (None, None), optimizer_bytes: int = OPTIMIZER_BYTES) -> dict:
    """One stage's bytes per rank (model states, buffers) and communication per step.

    ``pending``: reductions pending when a bucket fills (the timing this row is for);
    ``cap``: the engine's bound on them, which its buffer classes are sized for; ``lv``: nodes
    and shard groups (the plan is cut for one shard group); ``gbps``: (inside, across) nodes;
    ``quant``: the Quantization of (weights, grads), or None each: bytes and time on the wire.
    """
    n, isz, m = plan.world_size, itemsize, micro_batches
    ahead = prefetch if overlap else 0
    secondary = lv.secondary_numel(stage, plan.numel)
    states = theory_bytes(stage, plan.numel, n, isz, plan.shard_numel, secondary=secondary,
                          optimizer_bytes=optimizer_bytes)
    staged, gathered = buffer_counts(stage, plan.num_buckets, pending, ahead)
    classes = plan.classes(*buffer_counts(stage, plan.num_buckets, cap, ahead))
    buffers = {
        # stages 2/3 keep a bucket's local gradients until its reduce-scatter is retired
        "grad_buckets": isz * plan.largest(staged),
        # stage 3: the bucket of the layer in use, plus the ones being prefetched
        "gathered_params": isz * plan.largest(gathered),
        # the rest of what the buffer pool holds: released buffers kept for reuse, and a short
        # bucket's slack in a buffer of its class; nothing when every bucket has one length
        "spare_buffers": isz * (plan.pooled(staged, gathered, classes) - plan.largest(staged) - plan.largest(gathered)),
        # stages 0/1 rewrite the local gradient every micro-batch: the reduced sum needs a home
        "grad_accumulator": isz * plan.shard_numel if stage < 2 and m > 1 else 0,
        # reduce-scatter receive buffers (the N-1 peers' slices of a bucket), pooled per bucket
        # length and kept: as many of a length as were ever in flight at once (one at least)
        # (with nodes and shard groups: the two levels' and the all-reduce across groups', levels.py)
        "comm_scratch": isz * scratch_elements(plan, lv, pending),
    }
    comm, reuse = ring_bytes(stage, plan, isz, m, ahead, *quant)
    logical, _ = ring_bytes(stage, plan, isz, m, ahead)
    buckets = plan.num_buckets
    calls = m * 3 * buckets if stage == 3 else (m + 1) * buckets
    # Ring collectives: N-1 latency-bound steps each; every byte crosses this rank's link once.
    seconds = calls * (n - 1) * latency_us * 1e-6 + comm * 8 / (bandwidth_gbps * 1e9) if n > 1 else 0.0
    buffer_bytes = sum(buffers.values())
    by_level = level_traffic(stage, plan, isz, lv, m, ahead, latency_us, *gbps, *quant)
    flat = flat_traffic(stage, plan, isz, lv, m, ahead, latency_us, *gbps, *quant)
    logical_levels = level_traffic(stage, plan, isz, lv, m, ahead, latency_us, *gbps)["bytes"]
    return {
        "stage": stage,
        "params_bytes": states["params"],
        "grads_bytes": states["grads"],
        "optimizer_bytes": states["optimizer"],
        "secondary_bytes": states.get("secondary", 0),
        "model_state_bytes": states["total"],
        "formula": formula(stage, isz, "N" if lv.replicas == 1 else "S", "K" if secondary else None,
                           optimizer_bytes),
        "buffers": buffers,
        "buffer_bytes": buffer_bytes,
        "total_bytes": states["total"] + buffer_bytes,
        "comm_bytes_per_step": comm,                  # on the wire (values + scales when quantized)
        "comm_logical_bytes_per_step": logical,       # what the same step would send unquantized
        "comm_bytes_kept_at_turns": reuse,
        "comm_calls_per_step": calls,
        "comm_seconds_per_step": seconds,
        # what the engine sends (engine.traffic, to the byte), inside and across nodes, and its time
        "comm_bytes_per_step_by_level": by_level["bytes"],
        "comm_logical_bytes_per_step_by_level": logical_levels,
        "comm_messages_per_step_by_level": by_level["messages"],
        "comm_seconds_per_step_by_level": by_level["seconds"],
        "comm_seconds_per_step_levels": sum(by_level["seconds"].values()),
        # the same collectives flat over the group, unaware of nodes (as before two levels)
        "comm_bytes_per_step_if_flat": flat["bytes"],
        "comm_seconds_per_step_if_flat": flat["seconds"],
    }


def estimate(params: Optional[float] = None, ranks: Optional[int] = None, dtype: str = "fp16",
             bucket_mb: float = ZeroConfig.bucket_mb, layers: Optional[int] = None,
             largest_layer: Optional[int] = None, prefetch: int = DEFAULT_PREFETCH, micro_batches: int = 1,
             in_flight: Optional[int] = None, bandwidth_gbps: float = 100.0, latency_us: float = 5.0,
             layout: Optional[FlatLayout] = None, align: int = ZeroConfig.align, overlap: bool = True,
             node_size: Optional[int] = None, shard_size: Optional[int] = None, hpz: bool = False,
             intra_gbps: Optional[float] = None, inter_gbps: Optional[float] = None,
             offload_optimizer: str = "none", offload_params: str = "none", quantize_weights: Optional[str] = None,
             quantize_grads: Optional[str] = None, quant_block: int = DEFAULT_BLOCK, zero=None, mesh=None,
             optimizer: str = "adamw") -> dict:
    """Bytes per rank and communication per step for ZeRO stages 0-3.

    ``params``: Psi, parameters of the model; ``ranks``: N. Or ``layout``: the engine's
    FlatLayout (then Psi, N and the buckets are its own and the model states are exact).
    ``bucket_mb``: MiB per bucket; ``layers`` / ``largest_layer``: how the model splits into
    layers (elements); ``prefetch``: stage-3 buckets gathered ahead (ZeroConfig.prefetch);
    ``overlap``: ZeroConfig.overlap (False: every collective is waited for as it starts).
    ``in_flight``: gradient reductions still pending when the next bucket's gradients arrive,
    at most (default: the engine's cap, reducer.MAX_PENDING_REDUCES = 2, so the buffers are
    the most a rank holds whatever the network's timing; 0: each reduction is done first,
    the best case, always given as ``total_bytes_best_case``; a K above the cap describes an
    engine with a cap of K).
    ``bandwidth_gbps``: link speed in gigabits per second; ``latency_us``: per message.
    Nodes and shard groups (docs/hierarchical.md): ``node_size`` K ranks per node (default: one
    node of all N), ``shard_size`` S ranks share one sharded copy of the model states (whole nodes;
    default N: the plan is cut for S ranks, the states follow the stage formulas with S in place
    of N), ``hpz`` ZeRO++'s node-local secondary copy (the stage-3 row only; it changes nothing
    when a shard group is one node), ``intra_gbps`` / ``inter_gbps`` the bandwidth inside and
    across nodes (default ``bandwidth_gbps``). With a ``layout``, ``ranks`` defaults to the
    layout's and the layout must be cut for the shard group, as the engine cuts it.
    Quantized communication (ZeRO++, docs/quantized.md), as ZeroConfig's: ``quantize_weights``
    None or "int8" (qwZ: the parameter gathers of stages 1-3), ``quantize_grads`` None, "int8"
    or "int4" (qgZ: the reduce-scatters), ``quant_block`` elements per scale: the communication
    bytes and times are then those on the wire (a slice's values and scales,
    ``Quantization.wire_bytes``), and ``comm_logical_bytes_per_step[_by_level]`` what the same
    step would send unquantized.
    ``zero`` (a ZeroConfig) and ``mesh`` (a MeshConfig, without tp, sp or pp): the run's configs, in place of
    the keywords of their fields (estimate/configs.py).
    Returns ``{"stages": [{stage, model_state_bytes, params_bytes, grads_bytes,
    optimizer_bytes, secondary_bytes, buffers, buffer_bytes, total_bytes, total_bytes_best_case,
    comm_bytes_per_step (the ring volumes over one shard group: 2 or 3 passes per micro-batch),
    comm_bytes_per_step_by_level ({"intra", "inter"}: what the engine sends, engine.traffic),
    comm_seconds_per_step_by_level, comm_logical_bytes_per_step, ...}], ...}`` with every size in
    bytes per rank. Raises ConfigError on bad input.
    """
    if zero is not None or mesh is not None:
        given = dict(locals())
        from .configs import with_configs
        return estimate(**with_configs(estimate, given, zero, mesh))
    check(dtype in DTYPES, f"dtype={dtype!r} is not allowed; use fp16, bf16 or fp32")
    check(offload_optimizer in ("none", "cpu", "nvme"), f"offload_optimizer={offload_optimizer!r} is not allowed; "
                                                        "use none, cpu or nvme")
    check(offload_params in ("none", "nvme"), f"offload_params={offload_params!r} is not allowed; use none or nvme")
    check_quantization(quantize_weights, quantize_grads, quant_block)
    check(optimizer in OPTIMIZERS, f"optimizer={optimizer!r} is not allowed; use one of {', '.join(OPTIMIZERS)}")
    quant = (quantization(quantize_weights, quant_block), quantization(quantize_grads, quant_block))
    itemsize = ZeroConfig(dtype=dtype).itemsize
    check(isinstance(micro_batches, int) and micro_batches >= 1,
          f"micro_batches={micro_batches!r} must be an integer >= 1")
    check(isinstance(prefetch, int) and prefetch >= 0, f"prefetch={prefetch!r} must be an integer >= 0 (0 = off)")
    check(bandwidth_gbps > 0, f"bandwidth_gbps={bandwidth_gbps!r} must be > 0 (gigabits per second)")
    check(latency_us >= 0, f"latency_us={latency_us!r} must be >= 0 (microseconds)")
    check(isinstance(overlap, bool), f"overlap={overlap!r} must be True or False")
    gbps = tuple(bandwidth_gbps if g is None else g for g in (intra_gbps, inter_gbps))
    for name, g in zip(("intra_gbps", "inter_gbps"), gbps):
        check(isinstance(g, (int, float)) and math.isfinite(g) and g > 0,
              f"{name}={g!r} must be a finite number > 0 (gigabits per second)")
    target = bucket_numel(dtype, bucket_mb)
    if layout is not None:
        ranks = layout.world_size if ranks is None else ranks
        check(isinstance(ranks, int) and ranks >= 1, f"ranks={ranks!r} must be an integer >= 1")
        lv = check_levels(ranks, node_size, shard_size, hpz)
        check(layout.world_size == lv.shard_size, f"layout is cut for {layout.world_size} ranks; with {ranks} ranks "
                                                  f"and shard_size={lv.shard_size} it must be cut for {lv.shard_size}, "
                                                  "the shard group (as the engine cuts it)")
        plan = BucketPlan.from_layout(layout)
    else:
        shown = f"{params:g}" if isinstance(params, float) else repr(params)
        check(isinstance(params, (int, float)) and math.isfinite(params) and params >= 1,
              f"params={shown} must be a number >= 1 (parameters, e.g. 10e9)")
        check(params == int(params), f"params={shown} must be a whole number of parameters")
        psi = int(params)
        check(isinstance(ranks, int) and ranks >= 1, f"ranks={ranks!r} must be an integer >= 1")
        check(layers is None or largest_layer is None, "give --layers or --largest-layer, not both")
        check(layers is None or (isinstance(layers, int) and 1 <= layers <= psi),
              f"layers={layers!r} must be an integer in 1..params ({psi})")
        check(largest_layer is None or (isinstance(largest_layer, int) and 1 <= largest_layer <= psi),
              f"largest_layer={largest_layer!r} must be an integer in 1..params ({psi})")
        lv = check_levels(ranks, node_size, shard_size, hpz)
        # as the engine: buckets cut into S slices, each a multiple of align x R (the all-reduce splits it)
        plan = plan_buckets(psi, lv.shard_size, target, layers, largest_layer, align * lv.replicas)
    check(in_flight is None or (isinstance(in_flight, int) and not isinstance(in_flight, bool) and in_flight >= 0),
          f"in_flight={in_flight!r} must be an integer >= 0 (reductions pending at once; "
          f"default: the engine's cap, {reducer.MAX_PENDING_REDUCES})")
    check(overlap or in_flight is None, f"in_flight={in_flight!r} has no effect with overlap off "
                                        "(every reduction is waited for as it starts); leave it out")
    pending = (reducer.MAX_PENDING_REDUCES if in_flight is None else in_flight) if overlap else 0
    cap = max(pending, reducer.MAX_PENDING_REDUCES) if overlap else 0   # what the engine's buffer pool is sized for
    # the best case's receive buffers of each bucket length (one pooled set each, whatever the stage): what engines
    # sharing one flat group's Communicator (a pipeline stage's chunks) hold once between them (sum_rows)
    by_length = {str(n): itemsize * scratch_elements(SimpleNamespace(per_size=lambda k, n=n: n), lv, 0)
                 for n in plan.lengths()}
    stages = []
    for s in STAGES:
        common = (bandwidth_gbps, latency_us, cap, lv, gbps, quant, bytes_per_param(optimizer))
        row = _stage_row(s, plan, itemsize, micro_batches, prefetch, overlap, pending, *common)
        best = _stage_row(s, plan, itemsize, micro_batches, prefetch, overlap, 0, *common)
        row["buffer_bytes_best_case"] = best["buffer_bytes"]
        row["total_bytes_best_case"] = best["total_bytes"]
        row["total_bytes_one_in_flight"] = best["total_bytes"]   # the best case's name before the cap
        row["comm_scratch_by_length_best_case"] = by_length
        row["comm_scratch_shared"] = lv.m == 1 and lv.replicas == 1   # the group's Communicator is the one given
        # where offload puts the model states (stage 0 offloads nothing, params only at stage 3)
        where = SimpleNamespace(offload_optimizer=offload_optimizer if s > 0 else "none",
                                offload_params=offload_params if s == 3 else "none")
        row["model_state_bytes_by_place"] = theory_by_place(
            {"params": row["params_bytes"], "grads": row["grads_bytes"], "optimizer": row["optimizer_bytes"],
             "secondary": row.get("secondary_bytes", 0)}, where)
        stages.append(row)
    return {
        "params": plan.params_numel,
        "padded_params": plan.numel,
        "ranks": lv.ranks,
        "dtype": dtype,
        "optimizer": optimizer,
        "bucket_mb": bucket_mb,
        "bucket_numel": target,
        "buckets": plan.num_buckets,
        "largest_bucket_bytes": itemsize * plan.largest(1),
        "prefetch": prefetch,
        "overlap": overlap,
        "micro_batches": micro_batches,
        "in_flight": pending,
        "offload": {"optimizer": offload_optimizer, "params": offload_params},
        "engine_max_pending": reducer.MAX_PENDING_REDUCES,
        "bandwidth_gbps": bandwidth_gbps,
        "latency_us": latency_us,
        "node_size": lv.node_size,
        "shard_size": lv.shard_size,
        "nodes": lv.nodes,
        "shard_groups": lv.replicas,
        "hpz": hpz,
        "hpz_applies": lv.hpz_applies,
        "intra_gbps": gbps[0],
        "inter_gbps": gbps[1],
        "quantization": {"weights": quantize_weights, "grads": quantize_grads, "block": quant_block},
        "quantized": quantize_weights is not None or quantize_grads is not None,
        # the table prints the levels when a topology or a bandwidth per level was asked for
        "by_level": any(v is not None for v in (node_size, shard_size, intra_gbps, inter_gbps)) or hpz,
        "stages": stages,
    }


def sum_rows(rows, what: str = "engines") -> dict:
    """One rank's stage row when it holds several engines over one group (a pipeline stage's model chunks),
    from each engine's row: the numbers summed, the tables summed by key, one formula ("16Ψ/N for each of 2
    chunks"). Over a flat group the engines share its Communicator, which pools receive buffers by length:
    in the best case (every reduction done before the next) a length two engines use is held once."""
    def add(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: add([v.get(k, 0) for v in values]) for k in set().union(*values)}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return sum(values)
        return first
    skip = ("stage", "formula", "comm_scratch_by_length_best_case", "comm_scratch_shared")
    out = {k: add([r[k] for r in rows]) for k in rows[0] if k not in skip}
    if all(r["comm_scratch_shared"] for r in rows):
        held: dict = {}                       # bucket length -> each engine's pooled receive buffers of it
        for r in rows:
            for n, b in r["comm_scratch_by_length_best_case"].items():
                held.setdefault(n, []).append(b)
        twice = sum(sum(bs) - bs[0] for bs in held.values())      # every set but one: the same buffers
        out["buffer_bytes_best_case"] -= twice
        out["total_bytes_best_case"] -= twice
        out["total_bytes_one_in_flight"] -= twice
    formulas = sorted({r["formula"] for r in rows})
    out["stage"] = rows[0]["stage"]
    out["formula"] = " + ".join(formulas) + (f" for each of {len(rows)} {what}" if len(rows) > 1 else "")
    return out


EXACT_LAYERS = 10_000     # a GPT of at most this many blocks is estimated over its own layers, one by one


def layers_estimate(sizes: Sequence[int], ranks: int, dtype: str, opts: dict, topo: dict) -> dict:
    """:func:`estimate` of a model whose engine layers hold ``sizes`` parameters (the built-in GPT's), over the
    engine's own layout of them (plan.layer_layout, cut for the shard groups of ``topo``: node_size, shard_size,
    hpz): the buckets kept at stage 3's turns and the bytes by level are the engine's, to the byte. ``opts``: the
    estimate's keywords (bucket_mb, prefetch, micro_batches, ...)."""
    lv = check_levels(ranks, topo.get("node_size"), topo.get("shard_size"), bool(topo.get("hpz")))
    layout = layer_layout(sizes, lv.shard_size, lv.replicas, dtype, opts.get("bucket_mb", ZeroConfig.bucket_mb))
    return estimate(dtype=dtype, layout=layout, ranks=ranks, **{k: v for k, v in opts.items() if k != "bucket_mb"},
                    **topo)
