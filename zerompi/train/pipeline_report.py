"""What a pipelined run prints and measures: its banner, its final metrics beside their formulas, its tables.

Measured per step and rank, then summarized (medians over the kept steps but the first, maxima or
per-stage lists over ranks):

- ``bubble_fraction``: of each pipeline group (the P ranks sharing a data-parallel and TP coordinate),
  1 - (the ranks' compute seconds in the schedule's actions) / (P x the schedule's span, from the first
  action's start to the last one's end, on a clock aligned over the mesh), averaged over the groups;
- ``bubble_fraction_schedule``: the simulator's (pipeline/simulate.py) on the measured median cost of
  each (kind, chunk) of action, ``bubble_fraction_unit`` its value on equal costs (F = B = W);
- ``pp_bytes_per_step``: what each stage sent per step by kind of message (activations, their gradients,
  the tied weight), beside ``pp_theory_bytes_per_step``: the schedule's sends x each message's size;
- model states per rank (every chunk's engine on it) beside the ZeRO formula on each chunk's Ψ over its
  data-parallel group; activations (the GPT on its C kernels) beside the micro-batches in flight per chunk
  (from the schedule) x estimate/activations.py's chunk formula;
- ``final_params_sha256``: the whole model's parameters in model order (pipeline/digest.py): the same
  digest as the run without --pp when the parameters are the same.
"""
import hashlib
import statistics
from dataclasses import fields
from typing import Dict, List

import numpy as np
from mpi4py import MPI

from ..comm.watchdog import watched
from .report import human_bytes, print0
from .models.chunks import pools_peak_bytes
from .simulate import simulated


def print_banner(cfg, job, comm) -> None:
    m, s, z = job.mesh, job.schedule, cfg.zero
    print0(comm.mpi, f"zerompi: {comm.size} ranks, stage {z.stage}, dtype {z.dtype}, model {cfg.model}; pipeline: "
                     f"{m.describe()}")
    print0(comm.mpi, f"  schedule {s.name}: {s.chunks} model chunks ({s.chunks // m.pp} per stage), "
                     f"{s.micro_batches} micro-batches, backward {'split into B and W' if s.split_backward else 'whole'}; "
                     f"gradients reduced per {cfg.pipeline.grad_reduce}"
                     + (f", stage-3 gathers per {cfg.pipeline.gather}" if z.stage == 3 else ""))


def _bubble(pp_times, mesh, comm) -> List[float]:
    """Per kept step (the first left out when more are kept): the measured bubble, mean over pipeline groups."""
    mine = [(min(t[1] for t in step), max(t[3] for t in step), sum(t[3] - t[2] for t in step)) if step else None
            for step in pp_times]
    with watched(comm, "final metrics: the schedule's times"):
        everyone = comm.mpi.allgather(mine)
    groups: Dict[tuple, List[int]] = {}
    for r in range(comm.size):
        c = mesh.coords(r)
        groups.setdefault((c["dp"], c["sp"], c["tp"]), []).append(r)
    out = []
    for k in range(1 if len(mine) > 1 else 0, len(mine)):
        values = []
        for ranks in groups.values():
            spans = [everyone[r][k] for r in ranks if everyone[r][k] is not None]
            span = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
            values.append(1.0 - sum(b for _, _, b in spans) / (len(ranks) * span) if span > 0 else 0.0)
        out.append(sum(values) / len(values))
    return out


def _costs(pp_times, comm) -> Dict[tuple, float]:
    """{(kind, chunk): median compute seconds} over the kept steps (but the first) and every rank."""
    mine: Dict[tuple, List[float]] = {}
    for step in list(pp_times)[1 if len(pp_times) > 1 else 0:]:
        for a, _, ready, end in step:
            mine.setdefault((a.kind, a.chunk), []).append(end - ready)
    with watched(comm, "final metrics: the actions' costs"):
        everyone = comm.mpi.allgather(mine)
    merged: Dict[tuple, List[float]] = {}
    for table in everyone:
        for k, v in table.items():
            merged.setdefault(k, []).extend(v)
    return {k: float(np.median(v)) for k, v in merged.items()}


def message_theory(job) -> Dict[str, int]:
    """Bytes this rank sends per step by kind, from its schedule and the messages' sizes."""
    out = {"activations": 0, "activation gradients": 0}
    runners, s = job.runners, job.schedule
    for a in s.actions[job.mesh.pp_rank]:
        if a.kind == "SEND_F":              # chunk c's output: the shape of its gradient
            shape, dt = runners[a.chunk].grad_spec(a.mb)
            out["activations"] += int(np.prod(shape)) * np.dtype(dt).itemsize
        elif a.kind == "SEND_B":
            shape, dt = runners[a.chunk].input_spec(a.mb)
            out["activation gradients"] += int(np.prod(shape)) * np.dtype(dt).itemsize
    if job.cfg.model == "gpt":
        tie = job.tie()
        vc = job.model.vocab * job.model.d_model
        sent = 0
        if not tie.local and 0 in runners:
            sent += vc * tie.value_dtype.itemsize
        if not tie.local and s.chunks - 1 in runners:
            sent += s.micro_batches * vc * 4
        out["tied weight"] = sent
    return out


def sp_theory(job) -> int:
    """The SP all-to-all bytes this rank sends per step (--sp): the micro-batches through its chunks' blocks
    (estimate/sequence.all_to_all_bytes, each micro-batch this rank's seq_len / sp positions of its rows)."""
    from ..estimate.sequence import all_to_all_bytes
    cfg, mesh, s = job.cfg, job.mesh, job.schedule
    if mesh.sp == 1 or cfg.model != "gpt":
        return 0
    rows = cfg.batch // mesh.dp // cfg.zero.micro_batches
    blocks = len(job.runners) * (cfg.n_layer // s.chunks)
    return cfg.zero.micro_batches * all_to_all_bytes(blocks, rows, cfg.seq_len // mesh.sp, cfg.d_model // mesh.tp,
                                                     mesh.sp, recompute=cfg.checkpoint_activations)


def activation_theory(job) -> int:
    """The GPT's activation bytes on this rank: per chunk, its micro-batches in flight x what each holds, and
    what they share (estimate/activations.gpt_chunks_activation_bytes)."""
    from ..estimate.activations import gpt_chunks_activation_bytes
    from ..pipeline.simulate import in_flight
    cfg, m, s = job.cfg, job.model, job.schedule
    rows = cfg.batch // job.mesh.dp // cfg.zero.micro_batches
    return gpt_chunks_activation_bytes(in_flight(s, job.mesh.pp_rank), s.chunks, rows, cfg.seq_len, cfg.d_model,
                                       cfg.n_layer, cfg.n_head, m.vocab, s.split_backward, job.mesh.sp,
                                       cfg.checkpoint_activations, np.dtype(m.dtype).itemsize, job.mesh.tp)


def final_metrics(cfg, job, comm, log) -> dict:
    """The metrics (a collective over the mesh); rank 0's dict is the one written."""
    from ..pipeline import simulate
    from ..pipeline.digest import model_digest
    mesh, s, engines = job.mesh, job.schedule, list(job.engines)
    measured = {}
    for e in engines:
        for k, v in e.memory_report()["measured"].items():
            measured[k] = measured.get(k, 0) + v
    theory = sum(e.memory_report()["theory"]["total"] for e in engines)
    padded = sum(e.memory_report()["theory_padded"]["total"] for e in engines)
    peak = peak_buffer_bytes(engines)
    act = pools_peak_bytes([r.pool for r in job.runners.values() if getattr(r, "pool", None) is not None])
    act_theory = activation_theory(job) if cfg.model == "gpt" and job.model.layers.name == "c" else 0
    names = sorted(measured)
    steady = lambda v: int(statistics.median(list(v)[1:] or list(v))) if v else 0   # noqa: E731
    top = np.array([measured[k] for k in names] + [theory, act, act_theory, steady(log.comm_bytes),
                    sum(e.comm_theory_bytes() for e in engines), steady(log.tp_bytes), padded,
                    sum(most_zero_bytes(e) for e in engines), peak, steady(log.sp_bytes), sp_theory(job)], np.int64)
    with watched(comm, "final metrics: all-reduce (max) of memory and traffic bytes"):
        comm.mpi.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    kinds = sorted({k for step in log.pp_bytes for k in step} | set(message_theory(job)))
    mine = ([steady([step.get(k, 0) for step in log.pp_bytes]) for k in kinds], [message_theory(job).get(k, 0) for k in kinds])
    with watched(comm, "final metrics: the messages of each stage"):
        everyone = comm.mpi.allgather(mine)
    stage_of = [mesh.coords(r) for r in range(comm.size)]
    firsts = [r for r in range(comm.size) if stage_of[r]["dp"] == stage_of[r]["sp"] == stage_of[r]["tp"] == 0]
    # A simulated rank (train/simulate.py) knows its own stage only: the others' entries are None, and the
    # digest, the bubble and the schedule on measured costs, which need every stage's, are not made.
    alone = simulated(comm)
    known = (lambda i: i == mesh.pp_rank) if alone else (lambda i: True)   # noqa: E731
    pp_bytes = {k: [everyone[r][0][i] if known(st) else None for st, r in enumerate(firsts)] for i, k in enumerate(kinds)}
    pp_theory = {k: [everyone[r][1][i] if known(st) else None for st, r in enumerate(firsts)] for i, k in enumerate(kinds)}
    digest = None if alone else model_digest(job.engines.engines, s, mesh)
    if mesh.tp > 1 and mesh.pp_rank == 0 and mesh.dp_rank == 0 and not alone:
        digest = hashlib.sha256("".join(mesh.tp_mpi.allgather(digest)).encode()).hexdigest()
    with watched(comm, "final metrics: the model's digest"):
        digest = comm.mpi.bcast(digest, root=0)
    bubbles = [] if alone else _bubble(log.pp_times, mesh, comm)
    costs = _costs(log.pp_times, comm)
    sim = simulate.run(s, lambda a: costs.get((a.kind, a.chunk), 0.0)) if costs and not alone else None
    params = whole_model_params(job.model) if alone else _params_total(engines, mesh, comm)
    n = len(names)
    times = list(log.times)
    return {
        "world_size": comm.size, "stage": cfg.zero.stage, "dtype": cfg.zero.dtype, "model": cfg.model,
        "params": params, "losses": list(log.losses), "final_params_sha256": digest,
        "memory_bytes": {k: int(v) for k, v in zip(names, top[:n])}, "theory_bytes": int(top[n]),
        "activation_bytes": int(top[n + 1]) if cfg.model == "gpt" and job.model.layers.name == "c" else None,
        "activation_theory_bytes": int(top[n + 2]) if cfg.model == "gpt" and job.model.layers.name == "c" else None,
        "comm_bytes_per_step": int(top[n + 3]), "comm_theory_bytes_per_step": int(top[n + 4]),
        "tp_bytes_per_step": int(top[n + 5]), "theory_bytes_padded": int(top[n + 6]),
        "comm_most_bytes_per_step": int(top[n + 7]),   # stage 3: no bucket kept across a turn (traffic.step_bytes)
        "peak_buffer_bytes": int(top[n + 8]),          # the engines' transient buffers at peak (stage 3's gathered ones)
        "sp_bytes_per_step": int(top[n + 9]), "sp_theory_bytes_per_step": int(top[n + 10]),   # the SP all-to-alls
        "pipeline": {"pp": mesh.pp, "dp": mesh.dp, "sp": mesh.sp, "tp": mesh.tp, "schedule": s.name, "chunks": s.chunks,
                     "micro_batches": s.micro_batches, "split_backward": s.split_backward,
                     "grad_reduce": cfg.pipeline.grad_reduce, "gather": cfg.pipeline.gather,
                     "costs_s": {f"{k}{c}": v for (k, c), v in sorted(costs.items())},
                     "bubble_fraction_per_step": bubbles},
        "bubble_fraction": statistics.median(bubbles) if bubbles else None,
        "bubble_fraction_schedule": sim.bubble_fraction if sim is not None else None,
        "bubble_fraction_unit": simulate.run(s).bubble_fraction,
        "peak_activations_schedule": simulate.run(s).peak_activations,
        "pp_bytes_per_step": pp_bytes, "pp_theory_bytes_per_step": pp_theory,
        "step_time_s": statistics.median(times) if times else None, "step_times_s": times,
        "steps_applied": job.engines.step_count, "loss_scale": job.engines.loss_scale,
        "val_losses": list(log.val_losses), "first_step": log.first_kept, "steps_run": log.steps_run,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("zero", "pipeline")}
        | {"zero": cfg.zero.to_dict(), "pipeline": cfg.pipeline.to_dict()},
    }


def peak_buffer_bytes(engines) -> int:
    """The transient bytes this rank's engines hold at most: each one's buffers at their peak, and the receive
    scratch of the communicators they share (every chunk's engine uses the stage's ZeRO group) counted once --
    each engine's own report counts all of its communicators' scratch."""
    comms = {id(c): c for e in engines for c in e.communicators()}
    return sum(e.ledger.peak["buffers"] for e in engines) + sum(c.peak_scratch_bytes for c in comms.values())


def most_zero_bytes(engine) -> int:
    """The engine's data-parallel bytes per step when no stage-3 bucket is kept across a forward/backward turn
    (a schedule that interleaves the chunk's forwards and backwards keeps fewer than an unpipelined run)."""
    from ..engine import traffic
    c, t = engine.config, engine.topology
    return sum(traffic.step_bytes(c.stage, [b.numel for b in engine.layout.buckets], np.dtype(engine.dtype).itemsize,
                                  t.size, t.node_size, t.shard_size, c.micro_batches, c.prefetch if c.overlap else 0,
                                  engine.gatherer.secondary is not None, turns=False).values())


def whole_model_params(model) -> int:
    """Ψ of the whole model from its rules (engine/lazy.py): a TP rank's piece at its full size."""
    from ..engine.lazy import Piece
    return sum((a.whole if isinstance(a, Piece) else a).size for _, params in model.lazy_layers() for a in params.values())


def _params_total(engines, mesh, comm) -> int:
    """Ψ of the whole model: every chunk's parameters once (a TP-split one at its full size)."""
    mine = 0
    if mesh.dp_rank == mesh.sp_rank == mesh.tp_rank == 0:
        for e in engines:
            split = e.tp.split if e.tp else {}
            mine += sum(pr.numel * (mesh.tp if name in split else 1) for name, pr in e.layout.params.items())
    with watched(comm, "final metrics: the model's size"):
        return int(sum(comm.mpi.allgather(mine)))


def print_summary(metrics: dict, comm) -> None:
    p = metrics["pipeline"]
    mem = metrics["memory_bytes"]
    print0(comm.mpi, f"  model states per rank (max): {human_bytes(mem.get('total', 0))} (formula "
                     f"{human_bytes(metrics['theory_bytes_padded'])} on the padded layout, "
                     f"{human_bytes(metrics['theory_bytes'])} unpadded); activations {human_bytes(metrics['activation_bytes'] or 0)}"
                     + (f" (formula {human_bytes(metrics['activation_theory_bytes'])})"
                        if metrics["activation_theory_bytes"] else ""))
    show = lambda b: "-" if b is None else human_bytes(b)   # noqa: E731  (None: a stage a simulated rank is not)
    for kind, per in metrics["pp_bytes_per_step"].items():
        print0(comm.mpi, f"  pipeline {kind:22} per stage per step: {', '.join(show(b) for b in per)} "
                         f"(formula {', '.join(show(b) for b in metrics['pp_theory_bytes_per_step'][kind])})")
    if p.get("sp", 1) > 1:
        print0(comm.mpi, f"  sp all-to-all per rank per step: {human_bytes(metrics['sp_bytes_per_step'])} (formula "
                         f"{human_bytes(metrics['sp_theory_bytes_per_step'])}: the micro-batches through this stage's "
                         f"blocks, {3 if metrics['config']['checkpoint_activations'] else 2} passes x 4nC x (K-1)/K "
                         f"x 4 B, K = {p['sp']})")
    b, sb = metrics["bubble_fraction"], metrics["bubble_fraction_schedule"]
    print0(comm.mpi, f"  bubble: measured {b:.3f}, simulated on the measured costs {sb:.3f}, on equal costs "
                     f"{metrics['bubble_fraction_unit']:.3f} ({p['schedule']}, P = {p['pp']}, m = {p['micro_batches']}); "
                     f"median step {metrics['step_time_s'] * 1e3:.1f} ms" if b is not None and sb is not None else
           f"  median step {metrics['step_time_s'] * 1e3:.1f} ms")
