"""The train job as one rank of a job that does not fit here: ``--simulate-world N [--simulate-rank R]``.

This process runs rank R's engine over a comm/simulated_world.SimulatedWorld whose stand-ins mirror it (its
RULE), so what it measures is rank R's memory and traffic in the real job, beside zerompi.estimate's numbers.
The loss is not a real run's: every step line says so.
"""
import resource
from typing import Optional

import numpy as np

from ..errors import check
from ..estimate.machine import human_bytes


def check_config(cfg) -> None:
    """ConfigError (one line) unless the TrainConfig's --simulate-world / --simulate-rank fit its other
    settings (simulate_rank defaults to 0 here)."""
    if cfg.simulate_world is None:
        check(cfg.simulate_rank is None,
              f"simulate_rank={cfg.simulate_rank!r} needs simulate_world (--simulate-world N)")
        return
    from ..comm.simulated_world import check_world_rank
    if cfg.simulate_rank is None:
        object.__setattr__(cfg, "simulate_rank", 0)
    check_world_rank(cfg.simulate_world, cfg.simulate_rank)
    n = cfg.simulate_world
    for name in ("save_dir", "resume"):
        check(getattr(cfg, name) is None, f"{name}={getattr(cfg, name)!r} is not available with simulate_world={n}: "
                                           "a simulated rank holds one shard of a checkpoint; drop one of the two")
    check(cfg.zero.trace is None, f"trace={cfg.zero.trace!r} is not available with simulate_world={n} (a timeline "
                                   "of one real rank beside N - 1 stand-ins); drop one of the two")
    check(cfg.device == "cpu", f"device={cfg.device!r} is not available with simulate_world={n} yet; use --device cpu")


def world(cfg):
    """The SimulatedWorld of cfg (rank simulate_rank of simulate_world), or None for a real job."""
    if cfg.simulate_world is None:
        return None
    from ..comm.simulated_world import SimulatedWorld
    return SimulatedWorld(cfg.simulate_world, cfg.simulate_rank)


def loss_note(cfg, stage=None) -> str:
    """What follows the loss on every step line: nothing for a real run; for a simulated rank, that the loss is
    not a real run's, or (``stage``: a pipeline stage without the last chunk) that none is computed there."""
    if not cfg.simulate_world:
        return ""
    if stage is not None:
        return f" (simulated rank of stage {stage}: no loss is computed there)"
    return " (simulated rank: not a real run's loss)"


def no_held_out(cfg, stage=None) -> str:
    """Why an evaluation found no held-out row anywhere (console.held_out's note)."""
    if not cfg.simulate_world:
        return "no rank has a row of the held-out set"
    if stage is not None:
        return f"simulated rank of stage {stage}, which computes no loss"
    return (f"simulated rank {cfg.simulate_rank}'s share of the held-out set is empty, and its stand-ins mirror it "
            "(a short --data file has fewer held-out rows than data-parallel ranks)")


def banner(cfg) -> str:
    from ..comm.simulated_world import RULE
    return (f"  SIMULATED: this one process is rank {cfg.simulate_rank} of {cfg.simulate_world}; the other "
            f"{cfg.simulate_world - 1} ranks are stand-ins: {RULE}")


def peak_rss_bytes() -> int:
    """The most resident memory this process has held (getrusage; Linux counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def estimate_row(engine) -> dict:
    """zerompi.estimate's stage row for an engine's own settings and layout (exact model states); an expert
    engine's (--ep K: K sources per reduce-scatter) with its reduce-scatters' K partials (estimate/moe_bytes.py)."""
    from ..estimate.stages import estimate
    z, t = engine.config, engine.topology
    row = estimate(layout=engine.layout, ranks=t.size, dtype=z.dtype, prefetch=z.prefetch,
                   micro_batches=z.micro_batches, overlap=z.overlap, align=z.align, node_size=t.node_size,
                   shard_size=t.shard_size, hpz=z.hpz,
                   offload_optimizer=z.offload_optimizer, offload_params=z.offload_params,
                   quantize_weights=z.quantize_weights, quantize_grads=z.quantize_grads,
                   quant_block=z.quant_block)["stages"][z.stage]
    sources = engine.reducer.sources
    if sources > 1:
        from collections import Counter
        from ..estimate.moe_bytes import sources_bytes
        extra = sources_bytes(Counter(b.numel for b in engine.layout.buckets), np.dtype(engine.dtype).itemsize,
                              t.size, sources, z.micro_batches, t.node_size, t.shard_size, engine.reducer.per_node)
        row = dict(row, comm_bytes_per_step=row["comm_bytes_per_step"] + extra)
    return row


def estimate_rows(engines, what: str = "chunks") -> dict:
    """The estimate beside this rank: the sum of its engines' rows (a pipeline stage's chunks; with --ep, the
    dense and the expert engine)."""
    from ..estimate.stages import sum_rows
    return sum_rows([estimate_row(e) for e in engines], what)


def metrics(cfg, engines, comm, log, base: dict) -> dict:
    """The "simulated" entry of the metrics: who this process stood for, the rule, the estimate beside, and the
    bytes and calls per step of each collective."""
    from ..comm.simulated_world import RULE
    est = estimate_rows(engines, "engines (the dense over its N ranks, the experts over their N/K)"
                        if cfg.moe.ep > 1 else "chunks")
    steady, first = log.steady_per_op() or {}, log.first_per_op() or {}
    by_op = {op: {"bytes": steady.get(op), "first_step_bytes": first.get(op), "calls": s.calls}
             for op, s in sorted(comm.stats.items())}
    return {"simulated": {
        "world_size": cfg.simulate_world, "rank": cfg.simulate_rank, "rule": RULE,
        "peak_rss_bytes": peak_rss_bytes(),
        # steps whose stand-in gradients were not finite, applied with zero gradients (engine/step.py), not skipped
        "stand_in_overflows": max(e.stand_in_overflows for e in engines),
        "comm_by_op": by_op,          # bytes: a steady step's, the mean of the steps after the first (None: one
                                      # step ran); first_step_bytes: the first's; calls: every one, the start's too
        "estimate": est,
        "measured": {"model_state_bytes": base["memory_bytes"]["total"], "buffer_bytes": base["peak_buffer_bytes"],
                     "activation_bytes": base["activation_bytes"], "comm_bytes_per_step": base["comm_bytes_per_step"]},
    }}


def summary(m: dict) -> str:
    """The lines printed after the run's tables: this rank's memory beside the estimate, and the RSS."""
    sim = m["simulated"]
    est, got = sim["estimate"], sim["measured"]
    act: Optional[int] = got["activation_bytes"]
    known = got["model_state_bytes"] + got["buffer_bytes"] + (act or 0)
    rows = [("model states", got["model_state_bytes"], f"{human_bytes(est['model_state_bytes'])} ({est['formula']})"),
            ("buffers, peak", got["buffer_bytes"], f"{human_bytes(est['buffer_bytes_best_case'])} best case, "
                                                   f"{human_bytes(est['buffer_bytes'])} with 2 reductions pending"),
            ("peak RSS", sim["peak_rss_bytes"], f"{human_bytes(sim['peak_rss_bytes'] - known)} beyond model states, "
                                                "buffers and activations (interpreter, NumPy, MPI, the model's compute "
                                                "copies of a layer)")]
    lines = [f"simulated rank {sim['rank']} of {sim['world_size']} (stand-ins; the loss is not a real run's): "
             "measured beside zerompi.estimate for the same flags",
             f"  {'':14} {'measured':>12}   estimate"]
    lines += [f"  {name:14} {human_bytes(v):>12}   {text}" for name, v, text in rows]
    if sim["stand_in_overflows"]:
        lines.append(f"  {sim['stand_in_overflows']} step(s) had stand-in gradients that were not finite (the mirrored "
                     "values, no real run's): applied with zero gradients, not skipped, so their traffic is the "
                     "real job's")
    return "\n".join(lines)
