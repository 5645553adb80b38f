"""What rank 0 prints (the start-up banner, the progress bar, the final tables) and the
train run's final metrics, the dict that --metrics-json writes."""
import statistics
import sys
from dataclasses import fields
from typing import Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..estimate.activations import formula_text
from ..optim import impl
from ..comm.communicator import mpi_library
from ..comm.device import describe_buffers
from ..comm.flight import hosts_line
from ..engine.timers import format_breakdown, per_step, summarize
from ..comm.simulated_world import simulated
from ..comm.watchdog import watched
from .console import human_bytes
from . import muon_run
from .moe import routing as moe_run


def leads(comm) -> bool:
    """This process prints and writes the job's outputs: rank 0, or a simulated world's one process."""
    mpi = getattr(comm, "mpi", comm)
    return mpi.Get_rank() == 0 or simulated(mpi)


def print0(comm, *args, **kwargs) -> None:
    """print on rank 0 only (see leads), flushed."""
    if leads(comm):
        print(*args, **kwargs)
        sys.stdout.flush()


def memory_table(measured: Dict[str, int], theory: Dict[str, int], padded: Dict[str, int],
                 stage: int, world_size: int, itemsize: int, node_size: int = 1,
                 activations: Optional[Tuple[int, int, str]] = None, opt: int = 12) -> str:
    """Measured model-state bytes per rank beside DESIGN.md's formula (N: the ranks one copy is sharded over; hpZ's
    copy on its own row); ``activations``: (measured, formula, in words), a row, and the total of both below;
    ``opt``: the optimizer's bytes per parameter (engine/optimizers.py: AdamW 12, Muon 16)."""
    p, k = itemsize, opt
    formulas = {
        0: (f"{p}Ψ", f"{p}Ψ", f"{k}Ψ"),
        1: (f"{p}Ψ", f"{p}Ψ", f"{k}Ψ/N"),
        2: (f"{p}Ψ", f"{p}Ψ/N", f"{k}Ψ/N"),
        3: (f"{p}Ψ/N", f"{p}Ψ/N", f"{k}Ψ/N"),
    }[stage]
    totals = {0: f"{2 * p + k}Ψ", 1: f"{2 * p}Ψ + {k}Ψ/N", 2: f"{p}Ψ + {p + k}Ψ/N", 3: f"{2 * p + k}Ψ/N"}[stage]
    rows = [("params", formulas[0]), ("grads", formulas[1]), ("optimizer", formulas[2])]
    if "secondary" in measured:
        rows.append(("secondary", f"{p}Ψ/K (hpZ, K={node_size} per node)"))
        totals += f" + {p}Ψ/K"
    rows.append(("total", totals))
    lines = [f"memory per rank (stage {stage}, N={world_size}): measured vs formula",
             f"  {'':10} {'measured':>14} {'formula':>14} {'formula, padded':>16}  formula",
             ]
    if activations is not None:
        got, want, text = activations
        rows.insert(len(rows) - 1, ("activations", text))
        measured, theory, padded = ({**d, "activations": v}
                                    for d, v in ((measured, got), (theory, want), (padded, want)))
        lines[0] += "; activations: one micro-batch of the GPT"
    for key, text in rows:
        lines.append(f"  {key:10} {human_bytes(measured[key]):>14} {human_bytes(theory[key]):>14} "
                     f"{human_bytes(padded[key]):>16}  {text}")
    if activations is not None:
        lines.append(f"  {'+ activ.':10} {human_bytes(measured['total'] + got):>14} "
                     f"{human_bytes(theory['total'] + want):>14} "
                     f"{human_bytes(padded['total'] + want):>16}  model states + activations")
    return "\n".join(lines)


def comm_table(measured: Dict[str, float], theory: float, stage: int, levels=None, level_theory=None,
               logical=None, steady: bool = True) -> str:
    """Measured bytes sent per rank per step (a steady step's, else the first's) beside the formula; ``levels``:
    a steady step's inside the node and across nodes (None: not measured), beside ``level_theory``."""
    lines = ["communication per rank per step: measured (a steady step: the mean of the steps after the first) "
             "vs formula" if steady else
             "communication per rank: one step ran, so no steady step was measured; the first step's bytes (it can "
             "send more than a steady step) vs a steady step's formula"]
    for op, nbytes in measured.items():
        lines.append(f"  {op:16} {human_bytes(nbytes):>14}")
    total = sum(measured.values())
    what = "3Ψ (gather fwd + gather bwd + reduce-scatter), less the buckets kept at turns" if stage == 3 \
        else "2Ψ (reduce-scatter + all-gather)"
    lines.append(f"  {'total':16} {human_bytes(total):>14}   formula {human_bytes(theory)} = {what} × (N-1)/N bytes")
    if levels is not None and steady:
        lines.append("  a steady step (the median of the steps after the first):")
        for key, name in (("intra", "inside a node"), ("inter", "across nodes")):
            lines.append(f"  {name:16} {human_bytes(levels[key]):>14}   formula {human_bytes(level_theory[key])}")
    if logical is not None:
        lines.append(f"  {'unquantized':16} {human_bytes(logical[0]):>14}   formula {human_bytes(logical[1])} "
                     f"(what travels is {sum(levels.values()) / max(logical[0], 1):.2f} of it)")
    return "\n".join(lines)


def print_banner(cfg, job, comm, placement) -> None:
    """The train run's start-up lines (rank 0): the job, MPI and buffers, layout; the GPT's shape."""
    engine, data = next(iter(job.engines)), job.data
    if job.pipelined:
        for line in job.banner():
            print0(comm.mpi, line)
        print0(comm.mpi, f"  {describe_buffers(placement, engine.comm)}")      # where: the chunks' engines' one
    else:
        _engine_banner(cfg, engine, comm, placement)
    if cfg.model != "gpt":
        return
    print0(comm.mpi, f"  GPT: n_layer {cfg.n_layer}, n_head {cfg.n_head}, d_model {cfg.d_model}, vocab "
                     f"{data.vocab}, {cfg.batch} sequences x {cfg.seq_len} tokens = {cfg.batch * cfg.seq_len:,} "
                     f"tokens/step; data: {data.source}")
    if moe_run.banner(cfg):
        print0(comm.mpi, moe_run.banner(cfg))
    if data.entropy_floor is not None:
        print0(comm.mpi, f"  entropy floor {data.entropy_floor:.4f} nats/token: the lowest expected loss any model "
                         f"can reach on this corpus (uniform guessing: {np.log(data.vocab):.4f})")


def _optimizer_words(z) -> str:
    """The banner's optimizer: AdamW's kernel, or Muon's matrices beside it."""
    if z.optimizer == "muon":
        each = " (each expert a matrix)" if z.muon_stacked else ""
        return (f"muon on the 2-D parameters named {', '.join(z.muon_params)}{each}, {impl.adamw_update.__name__} on "
                "the rest")
    return impl.adamw_update.__name__


def _engine_banner(cfg, engine, comm, placement) -> None:
    z, lay = cfg.zero, engine.layout
    print0(comm.mpi, f"zerompi: {comm.size} ranks, stage {z.stage}, Ψ={lay.params_numel:,} parameters, "
                     f"dtype {z.dtype}, model {cfg.model}")
    print0(comm.mpi, f"  MPI: {mpi_library()}; reduce-scatter = Alltoallv + fp32 sum in rank order; "
                     f"all-gather = Allgather in place; {describe_buffers(placement, engine.comm)}")
    print0(comm.mpi, f"  layout: {len(lay.buckets)} buckets (target {z.bucket_mb} MiB), "
                     f"{lay.numel - lay.params_numel:,} padding elements; optimizer: {_optimizer_words(z)}")
    hpz = "; hpZ: a node-local copy of 1/node_size of the parameters" if engine.gatherer.secondary is not None else \
        ("; hpZ: nothing to keep (each shard group is one node)" if z.hpz else "")
    two = "; collectives in two levels (inside the node, then across)" if engine.group.hierarchical else ""
    peers = engine.watchdog.peers
    hosts = hosts_line(peers.table) if peers is not None else ""    # where the ranks run (MPI's hosts)
    print0(comm.mpi, f"  topology: {engine.topology.describe()}{f' ({hosts})' if hosts else ''}{two}{hpz}")


def _summed(dicts):
    """Per key, the sum of the dicts' numbers (nested dicts summed alike): a rank's facts over its engines."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = _summed([out.get(k, {}), v]) if isinstance(v, dict) else out.get(k, 0) + v
    return out


def peak_buffer_bytes(engines) -> int:
    """The transient bytes this rank's engines hold at most: their buffers at peak, and their communicators'
    receive scratch once each (a pipeline stage's chunks share one)."""
    comms = {id(c): c for e in engines for c in e.communicators()}
    return sum(e.ledger.peak["buffers"] for e in engines) + sum(c.peak_scratch_bytes for c in comms.values())


def most_zero_bytes(engine) -> int:
    """The engine's data-parallel bytes per step with no stage-3 bucket kept across a forward/backward turn."""
    from ..engine import traffic
    c, t = engine.config, engine.topology
    return sum(traffic.step_bytes(c.stage, [b.numel for b in engine.layout.buckets], np.dtype(engine.dtype).itemsize,
                                  t.size, t.node_size, t.shard_size, c.micro_batches, c.prefetch if c.overlap else 0,
                                  engine.gatherer.secondary is not None, turns=False).values())


def final_metrics(cfg, job, comm, log, placement) -> dict:
    """The train run's metrics, one schema for every run (rank 0's dict is written); ``job``: a SingleJob or
    PipelineJob, its engines' facts summed; a mode's facts are null where a run does not use it. A collective:
    call it before the job closes. Memory and traffic bytes are maxima over ranks, times this rank's clock."""
    engines = list(job.engines)
    first = engines[0]
    step = first.steps_taken
    first.guard.at("metrics", step)           # ZEROMPI_FAULT=KIND@rankR:stepS:metrics (engine/faults.py)
    reports = [e.memory_report() for e in engines]
    measured = _summed(r["measured"] for r in reports)
    names = list(measured)
    steady = log.traffic_figures()             # [a steady step's, intra, inter, unquantized; the first step's]
    activation = job.activations()
    groups = {name: log.steady_median(log.group_series(name)[0]) for name in ("tp", "sp")}
    theories = (activation[1], job.tp_theory() if cfg.mesh.tp > 1 else None,
                job.sp_theory() if cfg.mesh.sp > 1 else None)
    extra = [-1 if activation[0] is None else activation[0], sum(most_zero_bytes(e) for e in engines)] \
        + [-1 if v is None else v for v in groups.values()] + [-1 if t is None else t for t in theories]
    theory, padded = (_summed(r[key] for r in reports) for key in ("theory", "theory_padded"))   # this rank's
    formulas = [theory[k] for k in theory] + [padded[k] for k in padded] + [sum(e.comm_theory_bytes() for e in engines)]
    top = np.array([measured[k] for k in names] + [peak_buffer_bytes(engines)] + steady + extra + formulas, np.int64)
    # The buffer form: mpi4py's pickled allreduce holds the GIL while it waits (4.1), so no watchdog could fire.
    with watched(comm, "final metrics: all-reduce (max) of memory and traffic bytes", step):
        comm.mpi.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    n = len(names)
    mem = {k: int(v) for k, v in zip(names, top)}
    known = lambda v: None if v < 0 else int(v)    # noqa: E731  (-1: not measured)
    peak = int(top[n])
    traffic, intra, inter, logical, first_bytes = (known(v) for v in top[n + 1:n + 6])
    act, most, tp_bytes, sp_bytes, act_theory, tp_theory, sp_theory = (int(v) for v in top[n + 6:n + 13])
    theory = {k: int(v) for k, v in zip(theory, top[n + 13:])}             # formulas: maxima over ranks too
    padded = {k: int(v) for k, v in zip(padded, top[n + 13 + len(theory):])}
    comm_theory = int(top[-1])
    digest = job.digest()
    params = job.params_total()
    times = list(log.times)                            # the last history.HISTORY_STEPS steps
    breakdown, hidden = summarize(list(log.parts), times)
    tokens = cfg.batch * cfg.seq_len * log.steps_run    # GPT: the tokens of the steps run, over all ranks
    gpt = cfg.model == "gpt"
    mesh = job.mesh
    pipe = job.pipeline_metrics(log) if job.pipelined else dict.fromkeys(PIPELINE_KEYS)
    metrics = {
        "world_size": comm.size,
        "stage": cfg.zero.stage,
        "dtype": cfg.zero.dtype,
        "model": cfg.model,
        "params": params,                          # Ψ of the whole model (a TP-split parameter at its full size)
        "padded_params": sum(e.layout.numel for e in engines),   # this rank's layouts' elements, padding included
        "losses": list(log.losses),
        "final_params_sha256": digest,             # the whole model's, in model order; null for a simulated rank
        "memory_bytes": mem,                       # maxima over ranks, as peak_buffer_bytes and comm_bytes_per_step
        "memory_bytes_by_place": _summed(e.ledger.by_place() for e in engines),   # rank 0's: device, host, disk
        "theory_bytes_by_place": _summed(r["theory_by_place"] for r in reports),
        "offload": _summed(e.in_backward.stats() for e in engines),   # rank 0's: updates begun in the backward
        "theory_bytes": theory,
        "theory_bytes_padded": padded,
        "peak_buffer_bytes": peak,
        "activation_bytes": known(act),            # the GPT's, measured (max over ranks); null: not measured
        "activation_theory_bytes": known(act_theory),    # its formula (estimate/activations.py)
        "comm_bytes_per_step": traffic,            # a steady step's (the first left out); null: one step ran
        "comm_bytes_first_step": first_bytes,      # the run's first step's (null once no longer kept)
        "comm_bytes_per_step_by_op": log.steady_per_op(exclude=("sum_scalars",)),   # rank 0's, a steady step's
        "comm_theory_bytes_per_step": comm_theory,
        "comm_most_bytes_per_step": most,          # stage 3: no bucket kept across a turn (traffic.step_bytes)
        "comm_bytes_per_step_by_level": {"intra": intra, "inter": inter} if traffic is not None else None,
        "comm_theory_bytes_per_step_by_level": _summed(e.comm_theory_bytes_by_level() for e in engines),
        "comm_logical_bytes_per_step": logical,    # what the same step would send unquantized (= comm_bytes without)
        "comm_theory_logical_bytes_per_step": sum(sum(e.comm_theory_bytes_by_level(logical=True).values())
                                                  for e in engines),
        "comm_check_bytes": {"calls": comm.check_stats.calls, "bytes": comm.check_stats.bytes},   # rank 0's, apart
        "topology": {"node_size": first.topology.node_size, "shard_size": first.topology.shard_size,
                     "hpz": first.gatherer.secondary is not None},
        "quantization": {"weights": cfg.zero.quantize_weights, "grads": cfg.zero.quantize_grads,
                         "block": cfg.zero.quant_block},
        "tensor_parallel": None if cfg.mesh.tp == 1 else {
            "tp": mesh.tp, "dp": mesh.dp, "params_total": params,
            "params_local": sum(e.layout.params_numel for e in engines),
            "bytes_per_step": known(tp_bytes), "theory_bytes_per_step": known(tp_theory),
            "seconds_per_step": _steady_seconds(log, "tp")},
        "sequence_parallel": None if cfg.mesh.sp == 1 else {
            "sp": mesh.sp, "dp": mesh.dp, "tp": mesh.tp, "chunk": cfg.seq_len // mesh.sp,
            "heads_per_rank": cfg.n_head // (mesh.tp * mesh.sp), "bytes_per_step": known(sp_bytes),
            "theory_bytes_per_step": known(sp_theory), "seconds_per_step": _steady_seconds(log, "sp")},
        **pipe,                                    # the pipeline's facts (train/pipeline.py); null without --pp
        "step_time_s": statistics.median(times) if times else None,
        "steps_applied": first.step_count,
        "optimizer_impl": first.optimizer_impl,
        "loss_scale": first.loss_scale,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)
                   if f.name not in ("zero", "mesh", "pipeline", "moe")}
        | {"zero": dict(cfg.zero.to_dict(), **cfg.mesh.to_dict()), "pipeline": cfg.pipeline.to_dict()},
        "first_step": log.first_kept,              # losses[i] is the loss of step first_step + i
        "steps_run": log.steps_run,                # steps this run made; losses keeps the last history_steps
        "history_steps": log.cap,
        "time_breakdown_s": breakdown,
        "comm_hidden_fraction": hidden,
        "peak_gathered_buckets": max(e.gatherer.peak_gathered_buckets for e in engines),
        "step_times_s": times,                     # rank 0's wall seconds of each (kept) step, in order
        "step_breakdown_s": per_step(list(log.parts), times),   # the same steps' time_breakdown_s parts, each
        "val_losses": list(log.val_losses),        # [step, mean held-out loss (nats/token)] pairs
        "val_rows": log.val_rows,                  # held-out rows those losses cover, over every rank; null: none run
        "entropy_floor": job.data.entropy_floor if gpt else None,   # nats/token; null for --data and the MLP
        "tokens_per_s": tokens / log.total_time if gpt else None,   # global, rank 0's clock
        "device": placement.describe() if placement is not None else "cpu (NumPy)",
        "cupy_pool_bytes": None,                   # --device gpu: what CuPy's allocator holds (rank 0)
        "simulated": None,                         # --simulate-world: train/simulated_run.py's entry
        "moe": moe_run.metrics(job),               # --experts: train/moe/routing.py's section; null without
        "muon": muon_run.metrics(job),             # --optimizer muon: train/muon_run.py's section; null without
        "failures": job.replicas.failures() if job.replicas else [],   # recovered (zerompi.run)
        "replicas": job.replicas.metrics() if job.replicas else None,   # --replicas, rank 0's
    }
    if first.xp is not np:      # printed beside the engine's own accounting
        pool = first.xp.get_default_memory_pool()
        metrics["cupy_pool_bytes"] = {"used": int(pool.used_bytes()), "held": int(pool.total_bytes())}
    return metrics


PIPELINE_KEYS = ("pipeline", "bubble_fraction", "bubble_fraction_schedule", "bubble_fraction_replayed",
                 "bubble_fraction_unit",
                 "peak_activations_schedule", "pp_bytes_per_step", "pp_theory_bytes_per_step")


def _steady_seconds(log, group: str) -> float:
    """The median seconds a step spent in ``group``'s collectives (tp, sp): over the steps after the first."""
    seconds = log.group_series(group)[1]
    return statistics.median(log.steady(seconds) or seconds or [0.0])


def print_summary(metrics: dict, job, comm, base_bytes: Dict[str, int]) -> None:
    """The end-of-run tables (rank 0): memory and traffic beside the formulas, the model-parallel and pipeline rows,
    the step time. ``base_bytes``: comm.stats bytes per op not the steps' own (initial gather, held-out loss)."""
    from . import sp_run, tp_run
    from ..engine.optimizers import bytes_per_param
    engines = list(job.engines)
    first, cfg = engines[0], metrics["config"]
    z = first.config
    act = None
    if metrics["activation_bytes"] is not None:
        act = (metrics["activation_bytes"], metrics["activation_theory_bytes"],
               formula_text(cfg["checkpoint_activations"], sp=first.mesh_config.sp, tp=first.mesh_config.tp)
               + " (docs/activations.md)")
    print0(comm.mpi, memory_table(metrics["memory_bytes"], metrics["theory_bytes"], metrics["theory_bytes_padded"],
                                  z.stage, first.topology.shard_size, z.itemsize, first.topology.node_size, act,
                                  bytes_per_param(z.optimizer)))
    if metrics["replicas"] is not None:          # --replicas (train/replicas.py)
        from .replicas import summary_line
        print0(comm.mpi, summary_line(metrics["replicas"]))
    peak = peak_buffer_bytes(engines)
    if metrics["cupy_pool_bytes"] is not None:
        pool = metrics["cupy_pool_bytes"]
        print0(comm.mpi, f"  CuPy memory pool (rank 0): {pool['used']:,} bytes in use, {pool['held']:,} "
                         f"held; engine model states {_summed(e.ledger.model_states() for e in engines)['total']:,} "
                         f"+ buffers at peak {peak:,} bytes (these include the communicator's "
                         f"host-side scratch: pinned staging buffers on the MPI path)")
    per_op = metrics["comm_bytes_per_step_by_op"]     # None: one step ran, and its bytes are the first step's
    steady = per_op is not None
    if not steady:
        per_op = {op: s.bytes - base_bytes.get(op, 0) for op, s in sorted(comm.stats.items()) if op != "sum_scalars"}
    quantized = z.quantize_weights or z.quantize_grads
    print0(comm.mpi, comm_table(per_op, metrics["comm_theory_bytes_per_step"], z.stage,
                                metrics["comm_bytes_per_step_by_level"], metrics["comm_theory_bytes_per_step_by_level"],
                                (metrics["comm_logical_bytes_per_step"], metrics["comm_theory_logical_bytes_per_step"])
                                if quantized and steady else None, steady))
    for line in (tp_run.summary(metrics, job.cfg), sp_run.summary(metrics, job.cfg), moe_run.summary(metrics),
                 muon_run.summary(metrics)):
        if line:
            print0(comm.mpi, line)
    show = lambda b: "-" if b is None else human_bytes(b)   # noqa: E731  (None: a stage a simulated rank is not)
    for kind, per in (metrics["pp_bytes_per_step"] or {}).items():
        print0(comm.mpi, f"  pipeline {kind:22} per stage per step: {', '.join(show(b) for b in per)} "
                         f"(formula {', '.join(show(b) for b in metrics['pp_theory_bytes_per_step'][kind])})")
    b, sb, p = metrics["bubble_fraction"], metrics["bubble_fraction_schedule"], metrics["pipeline"]
    if b is not None and sb is not None:
        rb = metrics["bubble_fraction_replayed"]
        print0(comm.mpi, f"  bubble: measured {b:.3f}, simulated on each step's own action costs "
                         f"{'-' if rb is None else f'{rb:.3f}'}, on the median costs {sb:.3f}, on equal costs "
                         f"{metrics['bubble_fraction_unit']:.3f} ({p['schedule']}, P = {p['pp']}, "
                         f"m = {p['micro_batches']})")
    checks = metrics["comm_check_bytes"]
    print0(comm.mpi, f"  collective checks (comm/signature.py), not in the rows above: {checks['calls']:,} headers, "
                     f"{human_bytes(checks['bytes'])} over the run (64 bytes to each peer per collective)")
    print0(comm.mpi, f"  transient buffers at peak: {peak:,} bytes; median step {metrics['step_time_s'] * 1e3:.1f} ms")
    tb = metrics["time_breakdown_s"]
    print0(comm.mpi, f"  step time, median of steps: {format_breakdown(tb)}, other {tb['other'] * 1e3:.1f} ms; "
                     f"communication in flight {tb['comm_busy'] * 1e3:.1f} ms, "
                     f"{metrics['comm_hidden_fraction']:.0%} of it hidden behind compute")
