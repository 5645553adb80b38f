"""What rank 0 prints (the start-up banner, the progress bar, the final tables) and the
train run's final metrics, the dict that --metrics-json writes."""
import hashlib
import statistics
import sys
from dataclasses import fields
from typing import Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..estimate.activations import formula_text, gpt_activation_bytes
from ..optim import impl
from ..comm.communicator import mpi_library
from ..comm.device import describe_buffers
from ..comm.flight import hosts_line
from ..engine.timers import format_breakdown, per_step, summarize
from ..comm.watchdog import watched


def leads(comm) -> bool:
    """This process prints and writes the job's outputs: rank 0, or a simulated world's one process
    (comm/simulated.py; ``comm``: an mpi4py communicator, a stand-in, or a zerompi Communicator)."""
    mpi = getattr(comm, "mpi", comm)
    return mpi.Get_rank() == 0 or getattr(mpi, "simulated", False)


def print0(comm, *args, **kwargs) -> None:
    """print on rank 0 only (see leads), flushed."""
    if leads(comm):
        print(*args, **kwargs)
        sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n:.2f} TiB"


def memory_table(measured: Dict[str, int], theory: Dict[str, int], padded: Dict[str, int],
                 stage: int, world_size: int, itemsize: int, node_size: int = 1,
                 activations: Optional[Tuple[int, int, str]] = None) -> str:
    """Measured model-state bytes per rank beside DESIGN.md's formula (N: the ranks one copy of
    the model states is sharded over; hpZ's node-local copy, when there is one, on its own row).
    ``activations``: (measured, formula, the formula in words) of the GPT's activations, a row
    after the model states' and the total of both below it."""
    p = itemsize
    formulas = {
        0: (f"{p}Ψ", f"{p}Ψ", "12Ψ"),
        1: (f"{p}Ψ", f"{p}Ψ", "12Ψ/N"),
        2: (f"{p}Ψ", f"{p}Ψ/N", "12Ψ/N"),
        3: (f"{p}Ψ/N", f"{p}Ψ/N", "12Ψ/N"),
    }[stage]
    totals = {0: f"{2 * p + 12}Ψ", 1: f"{2 * p}Ψ + 12Ψ/N", 2: f"{p}Ψ + {p + 12}Ψ/N", 3: f"{2 * p + 12}Ψ/N"}[stage]
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
        measured, theory, padded = ({**d, "activations": v} for d, v in ((measured, got), (theory, want), (padded, want)))
        lines[0] += "; activations: one micro-batch of the GPT"
    for key, text in rows:
        lines.append(f"  {key:10} {human_bytes(measured[key]):>14} {human_bytes(theory[key]):>14} "
                     f"{human_bytes(padded[key]):>16}  {text}")
    if activations is not None:
        lines.append(f"  {'+ activ.':10} {human_bytes(measured['total'] + got):>14} {human_bytes(theory['total'] + want):>14} "
                     f"{human_bytes(padded['total'] + want):>16}  model states + activations")
    return "\n".join(lines)


def comm_table(measured: Dict[str, float], theory: float, stage: int, levels=None, level_theory=None,
               logical=None) -> str:
    """Measured bytes sent per rank per step beside the formula; ``levels``: the bytes of a steady
    step inside the node and across nodes, beside ``level_theory`` (engine/traffic.py)."""
    lines = ["communication per rank per step: measured vs formula"]
    for op, nbytes in measured.items():
        lines.append(f"  {op:16} {human_bytes(nbytes):>14}")
    total = sum(measured.values())
    what = "3Ψ (gather fwd + gather bwd + reduce-scatter), less the buckets kept at turns" if stage == 3 \
        else "2Ψ (reduce-scatter + all-gather)"
    lines.append(f"  {'total':16} {human_bytes(total):>14}   formula {human_bytes(theory)} = {what} × (N-1)/N bytes")
    if levels is not None:
        lines.append("  a steady step (the rows above are means over every step run; the first can differ):")
        for key, name in (("intra", "inside a node"), ("inter", "across nodes")):
            lines.append(f"  {name:16} {human_bytes(levels[key]):>14}   formula {human_bytes(level_theory[key])}")
    if logical is not None:
        lines.append(f"  {'unquantized':16} {human_bytes(logical[0]):>14}   formula {human_bytes(logical[1])} "
                     f"(what travels is {sum(levels.values()) / max(logical[0], 1):.2f} of it)")
    return "\n".join(lines)


def print_banner(cfg, engine, comm, placement, data) -> None:
    """The train run's start-up lines (rank 0): job, MPI and buffers, layout; the GPT's shape and data."""
    z, lay = cfg.zero, engine.layout
    print0(comm.mpi, f"zerompi: {comm.size} ranks, stage {z.stage}, Ψ={lay.params_numel:,} parameters, "
                     f"dtype {z.dtype}, model {cfg.model}")
    print0(comm.mpi, f"  MPI: {mpi_library()}; reduce-scatter = Alltoallv + fp32 sum in rank order; "
                     f"all-gather = Allgather in place; {describe_buffers(placement, engine.comm)}")
    print0(comm.mpi, f"  layout: {len(lay.buckets)} buckets (target {z.bucket_mb} MiB), "
                     f"{lay.numel - lay.params_numel:,} padding elements; optimizer: {impl.adamw_update.__name__}")
    hpz = "; hpZ: a node-local copy of 1/node_size of the parameters" if engine.gatherer.secondary is not None else \
        ("; hpZ: nothing to keep (each shard group is one node)" if z.hpz else "")
    two = "; collectives in two levels (inside the node, then across)" if engine.group.hierarchical else ""
    peers = engine.watchdog.peers
    hosts = hosts_line(peers.table) if peers is not None else ""    # where the ranks run (MPI's hosts)
    print0(comm.mpi, f"  topology: {engine.topology.describe()}{f' ({hosts})' if hosts else ''}{two}{hpz}")
    if cfg.model != "gpt":
        return
    print0(comm.mpi, f"  GPT: n_layer {cfg.n_layer}, n_head {cfg.n_head}, d_model {cfg.d_model}, vocab "
                     f"{data.vocab}, {cfg.batch} sequences x {cfg.seq_len} tokens = {cfg.batch * cfg.seq_len:,} "
                     f"tokens/step; data: {data.source}")
    if data.entropy_floor is not None:
        print0(comm.mpi, f"  entropy floor {data.entropy_floor:.4f} nats/token: the lowest expected loss any model "
                         f"can reach on this corpus (uniform guessing: {np.log(data.vocab):.4f})")


def activations(cfg, model, world_size: int) -> Tuple[Optional[int], Optional[int]]:
    """(measured, formula) activation bytes per rank: the GPT's on its C kernels (models/activations.py,
    estimate/activations.py; with --sp K, of this rank's chunk; with --tp, of its heads and MLP columns), else
    (None, None) (the MLP, the GPT's plain array path)."""
    measured = getattr(model, "activation_bytes", None)
    if measured is None:
        return None, None
    z = cfg.zero
    rows = cfg.batch // (world_size // (z.tp * z.sp) * z.micro_batches)    # sequences per data-parallel rank
    theory = gpt_activation_bytes(rows, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head, model.vocab,
                                  cfg.checkpoint_activations, np.dtype(model.dtype).itemsize, z.sp, z.tp)
    return measured, theory["total"]


def final_metrics(cfg, engine, comm, log, entropy_floor, placement, activation=(None, None)) -> dict:
    """The train run's metrics, keys in the order the JSON has them (rank 0's dict is the one written).

    A collective (one all-reduce, timed by the engine's watchdog): call it before
    ``engine.close()``. Memory and traffic bytes are maxima over ranks; times are this
    rank's clock. ``log`` is the step loop's record (train.StepLog); ``entropy_floor`` in
    nats/token, None for the MLP and for --data; ``activation``: activations()'s pair.
    """
    step = engine.steps_taken
    engine.guard.at("metrics", step)          # ZEROMPI_FAULT=KIND@rankR:stepS:metrics (engine/faults.py)
    report = engine.memory_report()
    names = list(report["measured"])
    # A steady step's traffic: the median over steps (the first can differ: stage 3 gathers the next
    # forward's first buckets at the end of a step); then the maximum over ranks.
    steady = [int(statistics.median(v)) if v else 0 for v in [log.comm_bytes] + list(zip(*log.level_bytes or [(0, 0, 0)]))]
    act = -1 if activation[0] is None else activation[0]
    top = np.array([report["measured"][k] for k in names] + [report["peak_buffers"]["bytes"]] + steady + [act], np.int64)
    # The buffer form, not mpi4py's pickled allreduce: that one holds the GIL while it waits
    # (measured, mpi4py 4.1), so the watchdog thread could never run and a hang here would be forever.
    with watched(comm, "final metrics: all-reduce (max) of memory and traffic bytes", step):
        comm.mpi.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    mem = {k: int(v) for k, v in zip(names, top)}
    peak, traffic, levels = int(top[len(names)]), int(top[len(names) + 1]), [int(v) for v in top[len(names) + 2:-1]]
    levels, logical, act = levels[:2], levels[2], int(top[-1])
    digest, lay = hashlib.sha256(), engine.layout      # the parameters in layout order, no padding, hashed
    engine.synchronize()                                # a bucket at a time: the model is never whole here
    # (not for a simulated world: its stand-ins' slices are mirrors of this rank's, the hash would name no model)
    for bucket, values in [] if getattr(comm.mpi, "simulated", False) else engine.optimizer.gather_buckets(engine.group, step):
        for layer in bucket.layers:
            for name in lay.layer_params[layer]:
                pr = lay.params[name]
                digest.update(np.ascontiguousarray(values[pr.bucket_offset:pr.bucket_offset + pr.numel], "<f4").data)
    times = list(log.times)                            # the last history.HISTORY_STEPS steps
    breakdown, hidden = summarize(list(log.parts), times)
    tokens = cfg.batch * cfg.seq_len * log.steps_run    # GPT: the tokens of the steps run, over all ranks
    metrics = {
        "world_size": comm.size,
        "stage": cfg.zero.stage,
        "dtype": cfg.zero.dtype,
        "model": cfg.model,
        "params": engine.layout.params_numel,
        "padded_params": engine.layout.numel,
        "losses": list(log.losses),
        "final_params_sha256": None if getattr(comm.mpi, "simulated", False) else digest.hexdigest(),
        "memory_bytes": mem,                       # maxima over ranks, as peak_buffer_bytes and comm_bytes_per_step
        "memory_bytes_by_place": engine.ledger.by_place(),   # rank 0's: device, host (offloaded), disk (files)
        "theory_bytes_by_place": engine.memory_report()["theory_by_place"],
        "offload": engine.in_backward.stats(),    # rank 0's: updates begun in the backward, hashing seconds
        "theory_bytes": report["theory"],
        "theory_bytes_padded": report["theory_padded"],
        "peak_buffer_bytes": peak,
        "activation_bytes": act if act >= 0 else None,   # the GPT's, measured (max over ranks); null: not measured
        "activation_theory_bytes": activation[1],        # its formula (estimate/activations.py)
        "comm_bytes_per_step": traffic,
        "comm_theory_bytes_per_step": engine.comm_theory_bytes(),
        "comm_bytes_per_step_by_level": dict(zip(("intra", "inter"), levels)),
        "comm_theory_bytes_per_step_by_level": engine.comm_theory_bytes_by_level(),
        "comm_logical_bytes_per_step": logical,    # what the same step would send unquantized (= comm_bytes without)
        "comm_theory_logical_bytes_per_step": sum(engine.comm_theory_bytes_by_level(logical=True).values()),
        "comm_check_bytes": {"calls": comm.check_stats.calls, "bytes": comm.check_stats.bytes},   # rank 0's, apart
        "topology": {"node_size": engine.topology.node_size, "shard_size": engine.topology.shard_size,
                     "hpz": engine.gatherer.secondary is not None},
        "quantization": {"weights": cfg.zero.quantize_weights, "grads": cfg.zero.quantize_grads,
                         "block": cfg.zero.quant_block},
        "step_time_s": statistics.median(times),
        "steps_applied": engine.step_count,
        "optimizer_impl": engine.optimizer_impl,
        "loss_scale": engine.loss_scale,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("zero", "pipeline")}
        | {"zero": cfg.zero.to_dict(), "pipeline": cfg.pipeline.to_dict()},
        "first_step": log.first_kept,              # losses[i] is the loss of step first_step + i
        "steps_run": log.steps_run,                # steps this run made; losses keeps the last history_steps
        "history_steps": log.cap,
        "time_breakdown_s": breakdown,
        "comm_hidden_fraction": hidden,
        "peak_gathered_buckets": engine.gatherer.peak_gathered_buckets,
        "step_times_s": times,                     # rank 0's wall seconds of each (kept) step, in order
        "step_breakdown_s": per_step(list(log.parts), times),   # the same steps' time_breakdown_s parts, each
        "val_losses": list(log.val_losses),        # [step, mean held-out loss (nats/token)] pairs
        "entropy_floor": entropy_floor,            # nats/token; null for --data and the MLP
        "tokens_per_s": tokens / log.total_time if cfg.model == "gpt" else None,   # global, rank 0's clock
        "device": placement.describe() if placement is not None else "cpu (NumPy)",
    }
    if engine.xp is not np:      # what CuPy's allocator holds (rank 0), printed beside the engine's own accounting
        pool = engine.xp.get_default_memory_pool()
        metrics["cupy_pool_bytes"] = {"used": int(pool.used_bytes()), "held": int(pool.total_bytes())}
    return metrics


def print_summary(metrics: dict, engine, comm, base_bytes: Dict[str, int]) -> None:
    """The end-of-run tables (rank 0): memory and traffic per rank beside the formulas, then the step time.

    ``base_bytes``: comm.stats bytes per operation that are not the steps' own (the initial
    all-gather, the held-out loss); the rest, over the steps run, is the per-step table.
    """
    z = engine.config
    report = engine.memory_report()
    act = None
    if metrics["activation_bytes"] is not None:
        act = (metrics["activation_bytes"], metrics["activation_theory_bytes"],
               formula_text(metrics["config"]["checkpoint_activations"], sp=z.sp, tp=z.tp) + " (docs/activations.md)")
    print0(comm.mpi, memory_table(metrics["memory_bytes"], report["theory"], report["theory_padded"],
                                  z.stage, engine.topology.shard_size, z.itemsize, engine.topology.node_size, act))
    if "cupy_pool_bytes" in metrics:
        pool = metrics["cupy_pool_bytes"]
        print0(comm.mpi, f"  CuPy memory pool (rank 0): {pool['used']:,} bytes in use, {pool['held']:,} "
                         f"held; engine model states {report['measured']['total']:,} + buffers at peak "
                         f"{report['peak_buffers']['bytes']:,} bytes (these include the communicator's "
                         f"host-side scratch: pinned staging buffers on the MPI path)")
    steps = metrics["steps_run"]
    per_op = {op: (s.bytes - base_bytes.get(op, 0)) / steps
              for op, s in sorted(comm.stats.items()) if op != "sum_scalars"}
    quantized = z.quantize_weights or z.quantize_grads
    print0(comm.mpi, comm_table(per_op, engine.comm_theory_bytes(), z.stage, metrics["comm_bytes_per_step_by_level"],
                                metrics["comm_theory_bytes_per_step_by_level"],
                                (metrics["comm_logical_bytes_per_step"], metrics["comm_theory_logical_bytes_per_step"])
                                if quantized else None))
    checks = metrics["comm_check_bytes"]
    print0(comm.mpi, f"  collective checks (comm/signature.py), not in the rows above: {checks['calls']:,} headers, "
                     f"{human_bytes(checks['bytes'])} over the run (64 bytes to each peer per collective)")
    print0(comm.mpi, f"  transient buffers at peak: {report['peak_buffers']['bytes']:,} bytes; "
                     f"median step {metrics['step_time_s'] * 1e3:.1f} ms")
    tb = metrics["time_breakdown_s"]
    print0(comm.mpi, f"  step time, median of steps: {format_breakdown(tb)}, other {tb['other'] * 1e3:.1f} ms; "
                     f"communication in flight {tb['comm_busy'] * 1e3:.1f} ms, "
                     f"{metrics['comm_hidden_fraction']:.0%} of it hidden behind compute")
