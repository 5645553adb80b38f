"""``mpiexec -n N python -m zerompi.train``: train a built-in model with ZeRO stage 0-3.

This module runs the job, one in every mode: its strategy (train/job.py without --pp, train/pipeline.py
with it), the one step loop (progress, held-out loss, checkpoints, stopping on a signal) and main()'s error
handling. The flags and TrainConfig live in config.py, the banner, final metrics and tables in report.py.
"""
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from ..errors import (EXIT_OUTPUT, EXIT_TIMEOUT, ConfigError, HelpRequested, JobError, OutputError, agree_on_errors,
                      agree_on_start, end_together, install_abort_hook)
from ..engine.faults import fault_from_env
from .config import TrainConfig, parse_config
from .history import StepLog
from ..comm import watchdog
from ..comm.watchdog import StopSignal

def build_model(cfg: TrainConfig, xp=np, mesh=None):
    """(model, data) for cfg.model; the GPT computes on ``xp`` (the MLP's NumPy calls dispatch to CuPy); with a
    Mesh (tp or sp > 1), split over its TP group (models/gpt.py, models/mlp_tp.py) and SP group (the GPT)."""
    if cfg.model == "gpt":
        from .models.gpt import GPT
        from .moe.config import moe_spec
        from .tokens import make_gpt_data
        vocab, initial = None, None
        if cfg.init_from:                           # a Hugging Face GPT-2 folder's values and vocabulary
            from .hf_init import HFInit
            init = HFInit(cfg.init_from)
            vocab, initial = init.vocab, init.rule
        data = make_gpt_data(cfg, vocab)            # generated, a file's bytes, or a token file
        vocab = vocab or data.vocab
        return GPT(vocab, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seed, xp=xp,
                   checkpoint_activations=cfg.checkpoint_activations, sp=mesh.sp_comm if mesh else None,
                   tp=mesh.tp_comm if mesh else None, moe=moe_spec(cfg), initial=initial), data
    from .models.mlp import MLP, TeacherData
    from .models.mlp_tp import TPMLP
    model = MLP(cfg.width, cfg.depth, cfg.seed) if mesh is None else TPMLP(cfg.width, cfg.depth, cfg.seed, mesh.tp_comm)
    return model, TeacherData(cfg.width, cfg.depth, cfg.seed)


def train(cfg: TrainConfig, mpi_comm=None, stop=None, placement=None) -> dict:
    """Run the job (a SingleJob, or a PipelineJob with --pp); returns the metrics dict (identical on every rank).
    ``stop``: a watchdog.StopSignal (once a rank has one, every rank stops after the same step, and saves with
    save_dir); ``placement``: a device.Placement (None: the host, NumPy)."""
    from . import report, simulated_run
    from ..comm.communicator import as_communicator
    from ..comm.consistency import check_consistent, job_fields
    from ..checkpoint.collective import CheckpointError
    comm = as_communicator(mpi_comm if mpi_comm is not None else simulated_run.world(cfg),   # --simulate-world
                           cfg.zero.timeout_s)    # (a stand-in); its watchdog times every wait (the engine's too)
    check_consistent(comm, "train", job_fields(cfg))   # ranks given other flags stop here, not in a collective
    cfg.check_world(comm.size)
    if cfg.mesh.pp > 1:                          # pipeline stages: one engine per model chunk
        from .pipeline import PipelineJob
        job = PipelineJob(cfg, comm, build_model, placement)
    else:
        from .job import SingleJob
        job = SingleJob(cfg, comm, build_model, placement)
    report.print_banner(cfg, job, comm, placement)
    if cfg.simulate_world:
        report.print0(comm.mpi, simulated_run.banner(cfg))
    if job.mesh is not None and not job.pipelined:
        report.print0(comm.mpi, f"  mesh: {job.mesh.describe()}")
    start = _resume(job, cfg) if cfg.resume else 0    # the step a resumed run starts at
    if cfg.replicas:                             # every step's state in memory twice (train/replicas.py)
        from .replicas import ReplicaRun
        job.replicas = ReplicaRun(cfg, job, comm)
    if cfg.save_dir and not job.pipelined:
        from .saves import disk_line
        report.print0(comm.mpi, disk_line(cfg, job.checkpoints, start))
    try:
        log = _run_steps(cfg, job, comm, start, stop)
    except (JobError, CheckpointError) as e:   # meant to be raised on every rank together: --trace keeps what there is
        end_together(comm.mpi, e, "zerompi.train")   # ... else this rank's line ends the job (before --trace's)
        from ..checkpoint.collective import salvage
        for engine in job.engines:
            if engine.trace is not None:
                engine.trace.close()
            for line in salvage(engine):       # a background save whose shards are all written: published
                print(f"zerompi.train: note: {line}", flush=True)
        raise
    metrics = report.final_metrics(cfg, job, comm, log, placement)   # before the job closes: still watched
    if cfg.simulate_world:
        metrics.update(simulated_run.metrics(cfg, list(job.engines), comm, log, metrics))
    report.print_summary(metrics, job, comm, log.base_bytes)
    if cfg.simulate_world:
        report.print0(comm.mpi, simulated_run.summary(metrics))
    problem = None
    if cfg.metrics_json and report.leads(comm):      # atomically: a full disk leaves the old file, not an empty one
        from ..checkpoint.outputs import save_json
        problem = save_json(cfg.metrics_json, metrics, "metrics_json")
    if cfg.zero.trace:                           # --trace: a collective; rank 0 writes the ranks' timeline
        problem = (job.write_trace(log) if job.pipelined else job.engine.trace.write()) or problem
    if job.replicas:
        job.replicas.close()
    job.close()
    if problem:                                  # rank 0 only, after the last collective
        raise OutputError(problem)
    return metrics


def _run_steps(cfg: TrainConfig, job, comm, start: int, stop) -> StepLog:
    """Steps start .. cfg.steps - 1, or until a stop signal: train, log, evaluate (GPT), save."""
    from .console import after_step, choose_progress, evaluates, held_out, show_step
    from .report import leads, print0
    from ..engine.timers import format_breakdown
    from .saves import Saves
    from .simulated_run import loss_note, no_held_out
    saves = Saves(cfg, job.checkpoints, comm.mpi)   # checkpoints: --save-dir, --save-every, --async-save
    from .tensorboard import Board
    board = Board(cfg, leads(comm))                 # --tensorboard: rank 0's event files
    gpt = cfg.model == "gpt"
    floor = job.data.entropy_floor if gpt else None   # nats/token; None: a user's file, or the MLP
    stand_in = loss_note(cfg, None if job.computes_loss else job.mesh.pp_rank)
    bar = leads(comm) and choose_progress(cfg.progress) == "bar"    # auto: a bar only for a person at a terminal
    sent = lambda: sum(s.bytes for op, s in comm.stats.items() if op != "sum_scalars")
    log = StepLog(start, {op: s.bytes for op, s in comm.stats.items()}, stats=comm.stats)   # so far: the initial gather
    if job.pipelined:
        job.begin(log)                              # the pipeline's series; its clock aligned over the mesh
    show = lambda *text, **kw: print0(comm.mpi, *text, **kw)   # noqa: E731  (the printing rank)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        for e in job.engines:
            e.timers.take()                         # drop what ran between steps (checkpoints)
        b0, l0, q0 = sent(), comm.level_bytes(), comm.logical_bytes()
        result, local = job.train_step(step, log)
        loss, flag = job.reduce_loss(local, stop.flag if stop else 0.0)   # + the stop flag, summed
        stopping = flag > 0                     # a signal or the stop file on some rank: every rank stops here
        l1 = comm.level_bytes()
        parts = {}
        for e in job.engines:                   # the timers of every engine of this rank (a stage's chunks)
            for k, v in e.timers.take().items():
                parts[k] = parts.get(k, 0.0) + v
        log.record(loss, time.perf_counter() - t0, sent() - b0, parts,   # bounded (history.py)
                   (l1["intra"] - l0["intra"], l1["inter"] - l0["inter"], comm.logical_bytes() - q0))
        board.step(step, loss, log.times[-1], parts, result, job.engines)
        extra, evaluated, note = "", False, ""  # GPT: held-out loss, floor, throughput
        if gpt:
            if evaluates(cfg, step, stopping):
                why = no_held_out(cfg, None if job.computes_loss else job.mesh.pp_rank)
                evaluation = _validate(job, comm, log.base_bytes)
                val, note = held_out(log, step, evaluation, why)
                board.held_out(step, evaluation.loss)
                extra, evaluated = extra + val, True
            extra += f"  floor {floor:.4f}" if floor is not None else ""
            extra += f"  {cfg.batch * cfg.seq_len / log.times[-1]:,.0f} tok/s"
        show_step(show, cfg, step, loss, stand_in + extra, result, log.times[-1], format_breakdown(log.parts[-1]),
                  bar, evaluated)
        if note:
            show(note)
        if job.replicas:      # committed in memory twice before the next step (--replicas)
            job.replicas.after_step(step + 1, cfg.seed)
        if after_step(show, cfg, saves, stop, step, stopping):
            break
    if job.replicas:                            # --replicas-commit behind: the last step's commit finished
        job.replicas.flush()
    saves.finish()                              # a background save is published before the run ends
    board.close()
    return log


def _validate(job, comm, base_bytes: Dict[str, int]):
    """The held-out loss and its rows (data.HeldOut; a collective); its traffic goes to base_bytes."""
    before = {op: s.bytes for op, s in comm.stats.items()}
    loss = job.validation_loss()
    for op, s in comm.stats.items():
        base_bytes[op] = base_bytes.get(op, 0) + s.bytes - before.get(op, 0)
    return loss


def _resume(job, cfg: TrainConfig) -> int:
    """Load cfg.resume into the job's engines (every rank); returns the first step to run."""
    from ..checkpoint.collective import CheckpointError
    from .report import print0
    mpi = job.comm.mpi
    info = job.checkpoints.load(cfg.resume)
    extra = info.manifest["extra"]
    start = int(extra.get("data_step", info.manifest["step"]))
    if start >= cfg.steps:
        raise CheckpointError(f"{info.path}: is at step {start} and --steps {cfg.steps} leaves nothing to run; "
                              f"--steps counts from step 0, so use more than {start}")
    m = info.manifest
    n, tp = m["world_size"], job.mesh.tp if job.mesh is not None else 1
    by = f"{n} rank{'s' if n > 1 else ''}" if tp == 1 else \
        f"{n} data-parallel rank{'s' if n > 1 else ''} per TP rank ({tp} TP ranks)"
    chunk = " (chunk 0: each chunk's data-parallel ranks)" if job.pipelined else ""
    print0(mpi, f"  resumed from {info.path}: step {start}, saved by {by}{chunk} at stage {m['stage']} ({m['dtype']})")
    from ..checkpoint.savedir import pointer_notes
    for note in pointer_notes(cfg.resume):        # newer checkpoints, a pointer with no checksum
        print0(mpi, f"  note: {note}")
    if extra.get("seed", cfg.seed) != cfg.seed:
        print0(mpi, f"  note: the checkpoint was trained with seed {extra['seed']}, this run's data "
                    f"uses seed {cfg.seed}")
    return start


def _one_blas_thread() -> None:
    """One OpenBLAS thread per rank unless OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set: else it spins a thread
    per core in every rank (docs/gpt.md); parallelism comes from the ranks."""
    import ctypes
    import os
    if any(k in os.environ for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return
    for path in libs:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(ctypes.c_int(1))
                break


def main(argv: Optional[List[str]] = None) -> int:
    from mpi4py import MPI
    install_abort_hook(MPI.COMM_WORLD)
    comm = MPI.COMM_WORLD
    _one_blas_thread()
    from . import preflight
    from .saves import claim_save_dir
    error, world = None, comm.Get_size()
    try:
        cfg = parse_config(argv)          # reads ZEROMPI_TIMEOUT_S too: now, not at import
        world = cfg.world_size(world)     # --simulate-world N: N (one process launched), else the processes
        cfg.check_world(world)
        preflight.check_fault(fault_from_env(), world, cfg)   # a bad ZEROMPI_FAULT stops every rank here
        preflight.check_outputs(cfg, comm.Get_rank())                    # before the first step, not after the last
        if cfg.mesh.pp > 1:                               # the schedule made (or read) and validated on every rank
            from .pipeline import load_schedule
            load_schedule(cfg)
        claim_save_dir(cfg, comm.Get_rank())             # rank 0: the --save-dir lock; no silent overwrite
    except (ConfigError, HelpRequested) as e:
        error = e if isinstance(e, HelpRequested) else str(e)
    status = agree_on_start(comm, error, "zerompi.train")   # timed; --help on every rank prints it once
    if status is not None:
        return status
    if agree_on_errors(comm, preflight.topology_error(cfg, comm), "zerompi.train"):
        return 2                          # shard groups that do not fit MPI's nodes: one line, not one per rank
    from ..comm.device import place_every_rank
    placement = place_every_rank(cfg.device, comm, "zerompi.train")   # gpu: needs CuPy and a GPU
    if placement is None:
        return 2
    rank = cfg.simulate_rank if cfg.simulate_world else comm.Get_rank()     # --pp: each rank checks its stage
    if agree_on_errors(comm, preflight.memory_error(cfg, world, placement, rank), "zerompi.train"):
        return 2                          # a job that cannot fit stops before it allocates
    from ..checkpoint.collective import CheckpointError
    try:
        train(cfg, stop=StopSignal(cfg.stop_file if comm.Get_rank() == 0 else None), placement=placement)
    except (CheckpointError, JobError) as e:   # raised on every rank together: no rank is left in a collective ...
        end_together(comm, e, "zerompi.train")   # ... or on some only: that rank's line ends the job within seconds
        if comm.Get_rank() == 0:
            sys.stderr.write(f"zerompi.train: error: {e}\n")
            sys.stderr.flush()
        return 2 if isinstance(e, ConfigError) else 1
    except OutputError as e:                   # rank 0 only: the run is done, its metrics file is not
        sys.stderr.write(f"zerompi.train: error: {e}\n")
        sys.stderr.flush()
        return EXIT_OUTPUT
    return EXIT_TIMEOUT if watchdog.fired() else 0   # a watchdog that fired ends the job non-zero, even if it finished
