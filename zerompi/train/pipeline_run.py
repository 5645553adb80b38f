"""The step loop of a pipelined run (--pp P): train, log, evaluate, save, stop; then the metrics.

As train/run.py's loop for one engine, with the pipeline's measurements beside: per step the bytes each
kind of point-to-point message sent, the tensor-parallel all-reduce bytes, and the schedule's actions
timed on a clock aligned over the mesh (the measured bubble, and the costs the simulator is given).
"""
import time
from collections import deque

from ..comm.watchdog import watched
from .history import StepLog
from . import simulate
from .report import leads, print0


def train_pipelined(cfg, comm, build, stop=None) -> dict:
    """Run the pipelined job on ``comm`` (a zerompi Communicator over the world) with the model and data of
    ``build(cfg, xp, mesh)`` (train/run.py's build_model); the metrics dict."""
    from . import pipeline_report as report
    from .pipeline import PipelineJob
    job = PipelineJob(cfg, comm, build)
    report.print_banner(cfg, job, comm)
    if cfg.simulate_world:
        print0(comm.mpi, simulate.banner(cfg))
    start = _resume(job, cfg) if cfg.resume else 0
    log = _run_steps(cfg, job, comm, start, stop)
    metrics = report.final_metrics(cfg, job, comm, log)
    if cfg.simulate_world:
        metrics.update(simulate.metrics(cfg, list(job.engines), comm, log, metrics))
    report.print_summary(metrics, comm)
    if cfg.simulate_world:
        print0(comm.mpi, simulate.summary(metrics))
    problem = None
    if cfg.metrics_json and leads(comm):        # rank 0, or a simulated world's one process
        from ..checkpoint.outputs import save_json
        problem = save_json(cfg.metrics_json, metrics, "metrics_json")
    if cfg.zero.trace:                           # a collective; rank 0 writes the ranks' timeline
        from ..pipeline.trace import write_trace
        k = len(log.pp_msgs)
        problem = write_trace(cfg.zero.trace, job, list(log.pp_times)[-k:] if k else [], list(log.pp_msgs)) or problem
    job.close()
    if problem:
        from ..errors import OutputError
        raise OutputError(problem)
    return metrics


def _run_steps(cfg, job, comm, start: int, stop) -> StepLog:
    from .pipeline import validation_loss
    from .console import after_step, choose_progress, evaluates, held_out, show_step
    from .saves import Saves
    from ..engine.trace import align_clocks
    saves = Saves(cfg, job.engines, comm.mpi)
    bar = leads(comm) and choose_progress(cfg.progress) == "bar"
    sent = lambda: sum(s.bytes for op, s in comm.stats.items() if op != "sum_scalars")
    log = StepLog(start, {op: s.bytes for op, s in comm.stats.items()}, stats=comm.stats)
    keep = min(log.cap, 64)
    log.pp_bytes, log.tp_bytes, log.pp_times = deque(maxlen=log.cap), deque(maxlen=log.cap), deque(maxlen=keep)
    log.sp_bytes = deque(maxlen=log.cap)
    log.pp_msgs = deque(maxlen=cfg.zero.trace_steps)     # --trace: each kept step's messages
    pc, tc, sc = job.mesh.pp_comm, job.mesh.tp_comm, job.mesh.sp_comm
    with watched(comm, "pipeline: aligning the clocks"):
        offset = align_clocks(comm, time.perf_counter)[0]
    gpt = cfg.model == "gpt"
    last = job.schedule.chunks - 1 in job.runners    # a stage without the last chunk computes no loss at all
    stand_in = simulate.loss_note(cfg, None if last else job.mesh.pp_rank)
    show = lambda *text, **kw: print0(comm.mpi, *text, **kw)   # noqa: E731  (the printing rank)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        for e in job.engines:
            e.timers.take()
        b0, l0, q0 = sent(), comm.level_bytes(), comm.logical_bytes()
        p0, tp0, sp0 = {k: s.bytes for k, s in pc.stats.items()}, tc.bytes_sent(), sc.bytes_sent()
        pc.events = [] if cfg.zero.trace else None
        result, losses, times = job.train_step(step)
        if pc.events is not None:
            log.pp_msgs.append([(k, sd, peer, n, t0 + offset, t1 + offset) for k, sd, peer, n, t0, t1 in pc.events])
            pc.events = None
        loss, flag = job.reduce_loss(losses, stop.flag if stop else 0.0)
        stopping = flag > 0
        l1 = comm.level_bytes()
        parts = {}
        for e in job.engines:
            for k, v in e.timers.take().items():
                parts[k] = parts.get(k, 0.0) + v
        log.record(loss, time.perf_counter() - t0, sent() - b0, parts,
                   (l1["intra"] - l0["intra"], l1["inter"] - l0["inter"], comm.logical_bytes() - q0))
        log.pp_bytes.append({k: s.bytes - p0.get(k, 0) for k, s in pc.stats.items()})
        log.tp_bytes.append(tc.bytes_sent() - tp0)
        log.sp_bytes.append(sc.bytes_sent() - sp0)
        log.pp_times.append([(a.action, a.start + offset, a.ready + offset, a.end + offset) for a in times])
        extra, evaluated, note = "", False, ""
        if gpt and evaluates(cfg, step, stopping):
            before = {op: s.bytes for op, s in comm.stats.items()}
            held = validation_loss(job)
            for op, s in comm.stats.items():
                log.base_bytes[op] = log.base_bytes.get(op, 0) + s.bytes - before.get(op, 0)
            extra, note = held_out(log, step, held, simulate.no_held_out(cfg, None if last else job.mesh.pp_rank))
            evaluated = True
        show_step(show, cfg, step, loss, stand_in + extra, result, log.times[-1], "", bar, evaluated)
        if note:
            show(note)
        if after_step(show, cfg, saves, stop, step, stopping):
            break
    saves.finish()
    return log


def _resume(job, cfg) -> int:
    from ..checkpoint.collective import CheckpointError
    from .report import print0
    info = job.engines.load(cfg.resume)
    extra = info.manifest["extra"]
    start = int(extra.get("data_step", info.manifest["step"]))
    if start >= cfg.steps:
        raise CheckpointError(f"{info.path}: is at step {start} and --steps {cfg.steps} leaves nothing to run; "
                              f"--steps counts from step 0, so use more than {start}")
    n = info.manifest["world_size"]
    print0(job.comm.mpi, f"  resumed from {cfg.resume}: step {start}, chunk 0 saved by {n} data-parallel "
                         f"rank{'s' if n > 1 else ''} at stage {info.manifest['stage']} ({info.manifest['dtype']})")
    return start
