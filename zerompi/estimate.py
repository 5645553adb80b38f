"""``python -m zerompi.estimate``: memory and communication per rank, before you launch.

    python -m zerompi.estimate --params 10e9 --ranks 64

prints, for ZeRO stages 0-3, the bytes one rank holds: model states (parameters,
gradients, fp32 master + Adam m and v, by ``memory.theory_bytes``), then the buffers this
engine allocates on top of them (gradient buckets, stage-3 gathered layers, spare bucket
buffers, the micro-batch accumulator, the reduce-scatter receive scratch), and the bytes and
time of one step's communication (``memory.theory_comm_bytes``, alpha-beta time model).

The buffers follow the engine's bound on gradient reductions pending at once
(``engine.MAX_PENDING_REDUCES``): the default figure is the most a rank can hold under it,
whatever the network's timing; the best case is the figure when every reduction is done
before the next bucket's gradients arrive.

The bucket layout is the engine's (FlatLayout's rule: buckets cut at layer boundaries,
each padded to a multiple of ranks x align), computed for a model described by ``--layers``
or ``--largest-layer``; with neither, every bucket is assumed full. Given the engine's own
FlatLayout, the model-state figures equal what the engine allocates, to the byte.

In Python, ``zerompi.estimate(params=10e9, ranks=64)`` returns the same table as a dict
(the module is callable: it calls :func:`estimate`).
"""
import argparse
import json
import math
import sys
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# engine.MAX_PENDING_REDUCES, the cap on gradient reductions pending at once, is read when an
# estimate is made (no copy here to go stale); engine.py does not import this module.
from . import engine
from .config import DTYPES, STAGES, ZeroConfig
from .errors import ConfigError, check
from .layout import FlatLayout
from .memory import theory_bytes, theory_comm_bytes

DEFAULT_PREFETCH = getattr(ZeroConfig, "prefetch", 0)   # the engine's default stage-3 prefetch depth
BUFFER_ROWS = ("grad_buckets", "gathered_params", "spare_buffers", "grad_accumulator", "comm_scratch")


@dataclass(frozen=True)
class BucketPlan:
    """The bucket sizes of a layout, run-length encoded so a 10^10-parameter model stays small.

    All sizes in elements. ``runs`` lists (padded bucket elements, how many) in layer order.
    """
    params_numel: int                 # Psi, unpadded
    world_size: int                   # ranks the layout is cut for
    runs: Tuple[Tuple[int, int], ...] # (padded elements of a bucket, consecutive buckets of that size)

    @property
    def numel(self) -> int:
        """Padded elements of the world buffer."""
        return sum(n * c for n, c in self.runs)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (every bucket divides into world_size equal slices)."""
        return self.numel // self.world_size

    @property
    def num_buckets(self) -> int:
        return sum(c for _, c in self.runs)

    def largest(self, k: int) -> int:
        """Elements of the k largest buckets together (k is capped at the number of buckets)."""
        return _top(self.runs, k)

    def lengths(self) -> Dict[int, int]:
        """Buckets of each distinct padded length: {elements: how many}."""
        out: Dict[int, int] = {}
        for n, c in self.runs:
            out[n] = out.get(n, 0) + c
        return out

    def ends(self, k: int) -> Tuple[int, int]:
        """Elements of the first k and of the last k buckets (k is capped at the number of buckets)."""
        def take(runs):
            total, left = 0, k
            for n, c in runs:
                got = min(c, left)
                total, left = total + got * n, left - got
            return total
        return take(self.runs), take(reversed(self.runs))

    def per_size(self, k: int) -> int:
        """Elements of up to k buckets of every distinct length together.

        The Communicator pools receive buffers by shape and keeps them: with k reductions in
        flight at most, it ends up holding min(k, buckets of that length) buffers of each length.
        """
        return sum(n * min(c, k) for n, c in self.lengths().items())

    def classes(self, staged: int, gathered: int) -> Dict[int, int]:
        """The engine's buffer classes for these buckets: {bucket length: elements of its buffers}
        (``buffers.buffer_classes``, for the most buffers live at once the engine is sized for)."""
        return engine.buffer_classes(self.lengths(), staged, gathered)

    def pooled(self, staged: int, gathered: int, classes: Dict[int, int]) -> int:
        """Elements of bucket buffers the engine's pool can hold, live and spare together.

        ``staged``/``gathered``: staging and stage-3 gathered buffers live at once, at most;
        ``classes``: :meth:`classes`. A buffer is allocated only when none of its class is
        spare and is kept until close, so a class holds at most min(its buckets, staged) +
        min(its buckets, gathered) buffers, each of the class's size.
        """
        per_class: Dict[int, int] = {}
        for n, c in self.lengths().items():
            per_class[classes[n]] = per_class.get(classes[n], 0) + c
        return sum(size * (min(c, staged) + min(c, gathered)) for size, c in per_class.items())

    @classmethod
    def from_layout(cls, layout: FlatLayout) -> "BucketPlan":
        return cls(layout.params_numel, layout.world_size, _merge((b.numel, 1) for b in layout.buckets))


def _top(runs, k: int) -> int:
    """Sum of the k largest of a multiset given as (value, count) pairs (all of it if fewer)."""
    total, left = 0, max(k, 0)
    for n, c in sorted(runs, reverse=True):
        take = min(c, left)
        total, left = total + take * n, left - take
    return total


def _merge(runs) -> Tuple[Tuple[int, int], ...]:
    out: List[List[int]] = []
    for n, c in runs:
        if c <= 0:
            continue
        if out and out[-1][0] == n:
            out[-1][1] += c
        else:
            out.append([n, c])
    return tuple((n, c) for n, c in out)


def _group_runs(layer_runs: Sequence[Tuple[int, int]], cap: int) -> List[Tuple[int, int]]:
    """(used elements, count) of the buckets FlatLayout cuts from layers given as runs
    (layer elements, count): a layer joins the open bucket while the bucket stays <= cap.

    Done on runs, not layer by layer, so that a model of 10^5 layers costs nothing;
    tests check it against FlatLayout itself.
    """
    buckets: List[Tuple[int, int]] = []
    used = 0                                   # elements in the open bucket
    for size, count in layer_runs:
        if count <= 0:
            continue
        if used:
            fit = min(count, (cap - used) // size) if used + size <= cap else 0
            used, count = used + fit * size, count - fit
            if count:
                buckets.append((used, 1))
                used = 0
        if count:
            per = max(1, cap // size)          # layers of this run that share one bucket
            whole, left = divmod(count, per)
            if left == 0:                      # keep the last bucket open for the next run
                whole, left = whole - 1, per
            buckets.append((per * size, whole))
            used = left * size
    buckets.append((used, 1))
    return [(u, c) for u, c in buckets if c > 0 and u > 0]


def _padded(used: int, world_size: int, align: int) -> int:
    """Padded elements of a bucket holding ``used`` elements (asks FlatLayout, the one owner of padding)."""
    return FlatLayout([("bucket", [("p", (used,))])], world_size, used, align).numel


def plan_buckets(params: int, ranks: int, bucket_numel: int, layers: Optional[int] = None,
                 largest_layer: Optional[int] = None, align: int = ZeroConfig.align) -> BucketPlan:
    """The engine's buckets for a model of ``params`` elements described by its layers.

    ``layers``: that many layers as equal as possible; ``largest_layer``: layers of that
    many elements, the last one takes the rest; neither: layers that fill a bucket each.
    """
    if layers is not None:
        small, extra = divmod(params, layers)
        layer_runs = [(small + 1, extra), (small, layers - extra)]
    else:
        size = largest_layer if largest_layer is not None else min(bucket_numel, params)
        layer_runs = [(size, params // size), (params % size, 1)]
    layer_runs = [(s, c) for s, c in layer_runs if s > 0 and c > 0]
    runs = [(_padded(used, ranks, align), c) for used, c in _group_runs(layer_runs, bucket_numel)]
    return BucketPlan(params, ranks, _merge(runs))


def bucket_numel(dtype: str, bucket_mb: float) -> int:
    """Elements per bucket target, as the engine derives it from ``bucket_mb`` MiB of storage dtype."""
    cfg = ZeroConfig(dtype=dtype, bucket_mb=bucket_mb)
    return max(1, cfg.bucket_bytes // cfg.itemsize)


def formula(stage: int, itemsize: int) -> str:
    """The model-state formula of a stage, e.g. '4Ψ + 12Ψ/N', read off theory_bytes itself."""
    whole = theory_bytes(stage, 1, 1, itemsize, shard_numel=0)["total"]   # bytes per element kept whole
    shard = theory_bytes(stage, 0, 1, itemsize, shard_numel=1)["total"]   # bytes per element sharded
    parts = ([f"{whole}Ψ"] if whole else []) + ([f"{shard}Ψ/N"] if shard else [])
    return " + ".join(parts)


# (staging buffers, stage-3 gathered buffers) live at once, at most: the engine's own rule.
buffer_counts = engine.buffer_counts


def _stage_row(stage: int, plan: BucketPlan, itemsize: int, micro_batches: int, prefetch: int, overlap: bool,
               pending: int, bandwidth_gbps: float, latency_us: float, cap: int) -> dict:
    """One stage's bytes per rank (model states, buffers) and communication per step.

    ``pending``: reductions pending when a bucket fills (the timing this row is for);
    ``cap``: the engine's bound on them, which its buffer classes are sized for.
    """
    n, isz, m = plan.world_size, itemsize, micro_batches
    ahead = prefetch if overlap else 0
    states = theory_bytes(stage, plan.numel, n, isz, plan.shard_numel)
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
        "comm_scratch": isz * plan.per_size(max(pending, 1)) * (n - 1) // n,
    }
    comm = theory_comm_bytes(stage, plan.numel, n, isz, m)
    buckets = plan.num_buckets
    calls = m * 3 * buckets if stage == 3 else (m + 1) * buckets
    # Ring collectives: N-1 latency-bound steps each; every byte crosses this rank's link once.
    seconds = calls * (n - 1) * latency_us * 1e-6 + comm * 8 / (bandwidth_gbps * 1e9) if n > 1 else 0.0
    reuse = 0
    if stage == 3:
        # At a turn the engine keeps what it holds gathered (the bucket in use and up to
        # `ahead` more) instead of freeing it and gathering it again: the last buckets at
        # each forward->backward turn, the first ones at each backward->forward turn.
        first, last = plan.ends(1 + ahead)
        reuse = isz * (m * last + (m - 1) * first) * (n - 1) // n
    buffer_bytes = sum(buffers.values())
    return {
        "stage": stage,
        "params_bytes": states["params"],
        "grads_bytes": states["grads"],
        "optimizer_bytes": states["optimizer"],
        "model_state_bytes": states["total"],
        "formula": formula(stage, isz),
        "buffers": buffers,
        "buffer_bytes": buffer_bytes,
        "total_bytes": states["total"] + buffer_bytes,
        "comm_bytes_per_step": comm,
        "comm_bytes_kept_at_turns": reuse,
        "comm_calls_per_step": calls,
        "comm_seconds_per_step": seconds,
    }


def estimate(params: Optional[float] = None, ranks: Optional[int] = None, dtype: str = "fp16",
             bucket_mb: float = ZeroConfig.bucket_mb, layers: Optional[int] = None,
             largest_layer: Optional[int] = None, prefetch: int = DEFAULT_PREFETCH, micro_batches: int = 1,
             in_flight: Optional[int] = None, bandwidth_gbps: float = 100.0, latency_us: float = 5.0,
             layout: Optional[FlatLayout] = None, align: int = ZeroConfig.align, overlap: bool = True) -> dict:
    """Bytes per rank and communication per step for ZeRO stages 0-3.

    ``params``: Psi, parameters of the model; ``ranks``: N. Or ``layout``: the engine's
    FlatLayout (then Psi, N and the buckets are its own and the model states are exact).
    ``bucket_mb``: MiB per bucket; ``layers`` / ``largest_layer``: how the model splits into
    layers (elements); ``prefetch``: stage-3 buckets gathered ahead (ZeroConfig.prefetch);
    ``overlap``: ZeroConfig.overlap (False: every collective is waited for as it starts).
    ``in_flight``: gradient reductions still pending when the next bucket's gradients arrive,
    at most (default: the engine's cap, engine.MAX_PENDING_REDUCES = 2, so the buffers are
    the most a rank holds whatever the network's timing; 0: each reduction is done first,
    the best case, always given as ``total_bytes_best_case``; a K above the cap describes an
    engine with a cap of K).
    ``bandwidth_gbps``: link speed in gigabits per second; ``latency_us``: per message.
    Returns ``{"stages": [{stage, model_state_bytes, params_bytes, grads_bytes,
    optimizer_bytes, buffers, buffer_bytes, total_bytes, total_bytes_best_case,
    comm_bytes_per_step, ...}], ...}`` with every size in bytes per rank. Raises ConfigError on bad input.
    """
    check(dtype in DTYPES, f"dtype={dtype!r} is not allowed; use fp16 or fp32")
    itemsize = ZeroConfig(dtype=dtype).itemsize
    check(isinstance(micro_batches, int) and micro_batches >= 1, f"micro_batches={micro_batches!r} must be an integer >= 1")
    check(isinstance(prefetch, int) and prefetch >= 0, f"prefetch={prefetch!r} must be an integer >= 0 (0 = off)")
    check(bandwidth_gbps > 0, f"bandwidth_gbps={bandwidth_gbps!r} must be > 0 (gigabits per second)")
    check(latency_us >= 0, f"latency_us={latency_us!r} must be >= 0 (microseconds)")
    check(isinstance(overlap, bool), f"overlap={overlap!r} must be True or False")
    target = bucket_numel(dtype, bucket_mb)
    if layout is not None:
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
        plan = plan_buckets(psi, ranks, target, layers, largest_layer, align)
    check(in_flight is None or (isinstance(in_flight, int) and not isinstance(in_flight, bool) and in_flight >= 0),
          f"in_flight={in_flight!r} must be an integer >= 0 (reductions pending at once; "
          f"default: the engine's cap, {engine.MAX_PENDING_REDUCES})")
    check(overlap or in_flight is None, f"in_flight={in_flight!r} has no effect with overlap off "
                                        "(every reduction is waited for as it starts); leave it out")
    pending = (engine.MAX_PENDING_REDUCES if in_flight is None else in_flight) if overlap else 0
    cap = max(pending, engine.MAX_PENDING_REDUCES) if overlap else 0   # what the engine's buffer pool is sized for
    stages = []
    for s in STAGES:
        row = _stage_row(s, plan, itemsize, micro_batches, prefetch, overlap, pending, bandwidth_gbps, latency_us, cap)
        best = _stage_row(s, plan, itemsize, micro_batches, prefetch, overlap, 0, bandwidth_gbps, latency_us, cap)
        row["buffer_bytes_best_case"] = best["buffer_bytes"]
        row["total_bytes_best_case"] = best["total_bytes"]
        row["total_bytes_one_in_flight"] = best["total_bytes"]   # the best case's name before the cap
        stages.append(row)
    return {
        "params": plan.params_numel,
        "padded_params": plan.numel,
        "ranks": plan.world_size,
        "dtype": dtype,
        "bucket_mb": bucket_mb,
        "bucket_numel": target,
        "buckets": plan.num_buckets,
        "largest_bucket_bytes": itemsize * plan.largest(1),
        "prefetch": prefetch,
        "overlap": overlap,
        "micro_batches": micro_batches,
        "in_flight": pending,
        "engine_max_pending": engine.MAX_PENDING_REDUCES,
        "bandwidth_gbps": bandwidth_gbps,
        "latency_us": latency_us,
        "stages": stages,
    }


# ---- the command line --------------------------------------------------------------

UNITS = ((1e9, "GB", 2 ** 30, "GiB"), (1e6, "MB", 2 ** 20, "MiB"), (1e3, "kB", 2 ** 10, "KiB"), (1, "B", 1, "B"))


def _units(largest: float):
    return next(u for u in UNITS if largest >= u[0])


def parse_count(text: str) -> float:
    """'10e9', '1.3e9', '7B', '350M' -> a number of parameters."""
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:], 1)
    try:
        return float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 10e9 or 10B")


def format_table(est: dict) -> str:
    """The estimate as the text table the CLI prints: model states first, then buffers, then communication."""
    rows = est["stages"]
    big, unit, bin_, bunit = _units(max(r["total_bytes"] for r in rows))
    dec = lambda b: f"{b / big:12.4f}"
    binary = lambda b: f"{b / bin_:12.4f}"
    line = lambda label, cells: f"  {label:<28}" + "".join(f"{c:>14}" for c in cells)
    out = [f"zerompi.estimate: Ψ = {est['params']:,} parameters, N = {est['ranks']} ranks, {est['dtype']} storage, "
           f"AdamW with an fp32 master ({unit} = {big:,.0f} bytes)",
           line(f"bytes per rank, {unit}", [f"stage {r['stage']}" for r in rows])]
    for key, label in (("params_bytes", "params"), ("grads_bytes", "grads"),
                       ("optimizer_bytes", "optimizer (master, m, v)")):
        out.append(line(label, [dec(r[key]) for r in rows]))
    out.append(line(f"model states, {unit}", [dec(r["model_state_bytes"]) for r in rows]))
    out.append(line(f"model states, {bunit}", [binary(r["model_state_bytes"]) for r in rows]))
    out.append(line("formula", [r["formula"] for r in rows]))
    labels = {"grad_buckets": "gradient buckets", "gathered_params": "gathered layers (stage 3)",
              "spare_buffers": "spare bucket buffers", "grad_accumulator": "micro-batch accumulator",
              "comm_scratch": "reduce-scatter scratch"}
    for key in BUFFER_ROWS:
        out.append(line(f"+ {labels[key]}", [dec(r["buffers"][key]) if r["buffers"][key] else "-" for r in rows]))
    pending = est["in_flight"]
    out.append(line(f"total ({pending:,} pending), {unit}", [dec(r["total_bytes"]) for r in rows]))
    out.append(line(f"total ({pending:,} pending), {bunit}", [binary(r["total_bytes"]) for r in rows]))
    if pending > 0:
        out.append(line(f"total (best case), {unit}", [dec(r["total_bytes_best_case"]) for r in rows]))
    out.append(line(f"communication per step, {unit}", [dec(r["comm_bytes_per_step"]) for r in rows]))
    out.append(line("collective calls per step", [f"{r['comm_calls_per_step']:,}" for r in rows]))
    out.append(line("communication time, s", [f"{r['comm_seconds_per_step']:.4f}" for r in rows]))
    padding = est["padded_params"] - est["params"]
    out += ["",
            f"layout: {est['buckets']:,} buckets of up to {est['bucket_numel']:,} elements ({est['bucket_mb']:g} MiB), "
            f"{padding:,} padding elements; stage-3 prefetch {est['prefetch']}; "
            f"{est['micro_batches']} micro-batch(es)",
            _pending_note(est),
            f"communication: ring volumes, (N-1)/N of the buffer per pass; time = calls x (N-1) x "
            f"{est['latency_us']:g} us + bytes / {est['bandwidth_gbps']:g} Gbit/s",
            f"stage 3 moves 3 passes per micro-batch (gather forward, gather backward, reduce-scatter); the engine "
            f"keeps the buckets it holds gathered across each forward/backward turn, so it sends up to "
            f"{rows[3]['comm_bytes_kept_at_turns']:,} bytes less than that"]
    return "\n".join(out)


def _pending_note(est: dict) -> str:
    """The footer line that says which bound on pending reductions the totals assume."""
    cap, pending = est["engine_max_pending"], est["in_flight"]
    if not est["overlap"]:
        return ("overlap off: every collective is waited for as it starts, so no reduction is pending when the "
                "next bucket's gradients arrive (the best case)")
    whose = (f"the engine's cap (MAX_PENDING_REDUCES = {cap})" if pending == cap
             else f"--in-flight {pending}; the engine's cap is {cap}")
    return (f"pending: gradient reductions still in flight when the next bucket's gradients arrive, at most "
            f"{pending}: {whose}; best case: none pending (each reduction done before the next bucket fills)")


def run_estimate(metrics: dict, **overrides) -> dict:
    """The estimate for the configuration of a train run (its --metrics-json output)."""
    cfg = metrics.get("config", {})
    zero = cfg.get("zero", {})
    # The MLP's blocks are equal, so --layers depth reproduces its layout exactly.
    layers = cfg.get("depth") if cfg.get("model") == "mlp" else None
    kwargs = dict(params=metrics["params"], ranks=metrics["world_size"], dtype=metrics["dtype"],
                  bucket_mb=zero.get("bucket_mb", ZeroConfig.bucket_mb), layers=layers,
                  micro_batches=zero.get("micro_batches", 1), prefetch=zero.get("prefetch", DEFAULT_PREFETCH),
                  overlap=zero.get("overlap", True), align=zero.get("align", ZeroConfig.align))
    kwargs.update(overrides)
    return estimate(**kwargs)


def compare_run(est: dict, metrics: dict) -> dict:
    """Measured bytes of a run beside the estimate for its stage (buffers: at the cap and the best case)."""
    row = est["stages"][metrics["stage"]]
    mem = metrics["memory_bytes"]
    measured = {"params_bytes": mem["params"], "grads_bytes": mem["grads"], "optimizer_bytes": mem["optimizer"],
                "model_state_bytes": mem["total"], "buffer_bytes": metrics["peak_buffer_bytes"],
                "total_bytes": mem["total"] + metrics["peak_buffer_bytes"],
                "comm_bytes_per_step": metrics["comm_bytes_per_step"]}
    best = {"buffer_bytes": row["buffer_bytes_best_case"], "total_bytes": row["total_bytes_best_case"]}
    return {"stage": metrics["stage"], "measured": measured, "estimate": {k: row[k] for k in measured},
            "estimate_best_case": best, "estimate_one_in_flight": best}   # the latter: its name before the cap


def format_compare(cmp: dict, est: dict) -> str:
    lines = [f"measured in the run (stage {cmp['stage']}) beside the estimate for its configuration, bytes per rank",
             f"  {'':22}{'measured':>14}{'estimate':>14}{'difference':>12}{'best case':>14}"]
    for key, m in cmp["measured"].items():
        e = cmp["estimate"][key]
        best = cmp["estimate_best_case"].get(key)
        lines.append(f"  {key:22}{m:>14,}{e:>14,}{m - e:>12,}" + (f"{best:>14,}" if best is not None else ""))
    bound = (f"up to {est['in_flight']} reductions pending while the next bucket fills"
             if est["overlap"] else "overlap off, no reduction pending while the next bucket fills")
    lines.append(f"  (estimate: {bound}, the most a rank holds; best case: each reduction done before the next "
                 "bucket fills)")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and exit 2, not argparse's usage dump
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zerompi.estimate", description="Memory and communication per rank for ZeRO stages 0-3.")
    p.add_argument("--params", type=parse_count, help="Ψ, parameters of the model (10e9, 10B, 350M)")
    p.add_argument("--ranks", type=int, help="N, data-parallel ranks")
    p.add_argument("--dtype", default="fp16", help="fp16 or fp32 storage of parameters and gradients")
    p.add_argument("--bucket-mb", type=float, default=ZeroConfig.bucket_mb, help="bucket size in MiB")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--layers", type=int, help="the model has this many layers of equal size")
    shape.add_argument("--largest-layer", type=parse_count, help="parameters of the largest layer")
    p.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH, help="stage-3 buckets gathered ahead")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=None, metavar="K",
                   help="gradient reductions still pending when the next bucket's gradients arrive, at most "
                        f"(default: the engine's cap, {engine.MAX_PENDING_REDUCES}; 0: the best case)")
    p.add_argument("--no-overlap", action="store_true",
                   help="as zerompi.train --no-overlap: every collective waited for as it starts")
    p.add_argument("--bandwidth-gbps", type=float, default=100.0, help="link bandwidth, gigabits per second")
    p.add_argument("--latency-us", type=float, default=5.0, help="latency per message, microseconds")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--from-run", metavar="METRICS.json",
                   help="a train run's --metrics-json: estimate its configuration and show measured beside it")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        a = build_parser().parse_args(argv)
        largest = None if a.largest_layer is None else int(a.largest_layer)
        opts = dict(bucket_mb=a.bucket_mb, prefetch=a.prefetch, micro_batches=a.micro_batches,
                    in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps, latency_us=a.latency_us,
                    overlap=not a.no_overlap)
        if a.from_run:
            try:
                with open(a.from_run) as f:
                    metrics = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"from_run={a.from_run!r} is not a readable metrics JSON ({e})")
            given = {k: v for k, v in (("params", a.params), ("ranks", a.ranks), ("layers", a.layers),
                                       ("largest_layer", largest)) if v is not None}
            est = run_estimate(metrics, in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps,
                               latency_us=a.latency_us, **given)
            cmp = compare_run(est, metrics)
        else:
            check(a.params is not None and a.ranks is not None, "give --params and --ranks (or --from-run)")
            est = estimate(a.params, a.ranks, a.dtype, layers=a.layers, largest_layer=largest, **opts)
            cmp = None
    except ConfigError as e:
        sys.stderr.write(f"zerompi.estimate: error: {e}\n")
        return 2
    print(format_table(est))
    if cmp is not None:
        print()
        print(format_compare(cmp, est))
        est = dict(est, from_run=cmp)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(est, f, indent=1)
    return 0


class _CallableModule(types.ModuleType):
    """``zerompi.estimate`` is this module and the function at once: calling it calls estimate()."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
