"""``mpiexec -n N python -m zerompi.train``: train a built-in model with ZeRO stage 0-3."""
import argparse
import hashlib
import json
import statistics
import sys
import time
from contextlib import closing
from dataclasses import dataclass, fields
from typing import List, Optional

import numpy as np

from .config import ZeroConfig
from .device import DEVICES
from .errors import ConfigError, JobError, agree_on_errors, check, install_abort_hook
from .faults import fault_from_env
from .watchdog import StopSignal, Watchdog, watched

MODELS = ("gpt", "mlp")
COMMS = ("mpi", "nccl")   # how device buffers are reduced and gathered (--comm)
# Per-model defaults of the fields left as None: the GPT needs more steps than the MLP's 30 to learn.
MODEL_DEFAULTS = {"gpt": {"steps": 300, "batch": 48, "log_every": 10},
                  "mlp": {"steps": 30, "batch": 64, "log_every": 1}}


@dataclass(frozen=True)
class TrainConfig:
    """The training job: model, data and schedule. Engine knobs live in ``zero``."""

    model: str = "gpt"
    """Built-in model: one of MODELS ("gpt": docs/gpt.md; "mlp": a regression toy)."""
    steps: Optional[int] = None
    """Last step of the run (>= 1), counted from step 0: a resumed run stops where a straight run would.
    None = the model's default (MODEL_DEFAULTS)."""
    batch: Optional[int] = None
    """Global batch per step over all ranks (MLP: rows; GPT: sequences of seq_len tokens); must divide
    by ranks x micro-batches. None = the model's default."""
    width: int = 256
    """MLP: features per layer."""
    depth: int = 4
    """MLP: number of Linear+GELU blocks."""
    n_layer: int = 2
    """GPT: transformer blocks (>= 1)."""
    n_head: int = 4
    """GPT: attention heads per block; must divide d_model."""
    d_model: int = 64
    """GPT: channels of the residual stream, i.e. the embedding width (>= 1)."""
    seq_len: int = 64
    """GPT: tokens per sequence, the context length (>= 1)."""
    data: Optional[str] = None
    """GPT: train on this file's bytes (vocab 256, the last 10% held out); None = the generated corpus."""
    eval_every: int = 50
    """GPT: held-out loss every this many steps and after the last one (>= 0; 0 = never)."""
    seed: int = 0
    """Seeds the initial parameters and the generated data."""
    log_every: Optional[int] = None
    """Print a progress line every this many steps. None = the model's default."""
    metrics_json: Optional[str] = None
    """Write the run's metrics as one JSON object to this path (rank 0)."""
    save_dir: Optional[str] = None
    """Write checkpoints under this directory (step_NNNNNN/ and a ``latest`` pointer; docs/checkpoint.md)."""
    save_every: int = 0
    """Save every this many steps (>= 0) and after the last step; 0 = after the last step only. Needs save_dir."""
    resume: Optional[str] = None
    """Resume from this checkpoint (a save_dir, whose ``latest`` is used, or one step_NNNNNN/ directory);
    the world size, stage and bucket size may differ from the saving run's."""
    device: str = "cpu"
    """Where the engine's buffers and the model's compute live: cpu (NumPy), gpu (CuPy; rank r binds GPU
    local rank mod GPUs) or auto (gpu when CuPy sees one). cpu is the default until the GPU path has
    passed scripts/gpu_check.sh on a GPU."""
    comm: str = "mpi"
    """How device buffers are reduced and gathered: mpi (staged through pinned host buffers on a GPU) or
    nccl (device to device; needs device gpu and one GPU per rank)."""
    zero: ZeroConfig = ZeroConfig()
    """Engine configuration."""

    def __post_init__(self):
        check(self.model in MODELS, f"model={self.model!r} is not allowed; use one of {', '.join(MODELS)}")
        check(self.device in DEVICES, f"device={self.device!r} is not allowed; use one of {', '.join(DEVICES)}")
        check(self.comm in COMMS, f"comm={self.comm!r} is not allowed; use {' or '.join(COMMS)}")
        check(self.comm == "mpi" or self.device == "gpu",
              f"comm={self.comm!r} needs --device gpu (NCCL moves GPU memory); use --comm mpi on the CPU")
        for name, value in MODEL_DEFAULTS[self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._check_gpt()
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.batch >= 1, f"batch={self.batch} must be >= 1")
        check(self.width >= 1, f"width={self.width} must be >= 1")
        check(self.depth >= 1, f"depth={self.depth} must be >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        check(isinstance(self.save_every, int) and self.save_every >= 0,
              f"save_every={self.save_every!r} must be an integer >= 0 (steps between checkpoints; 0 = at the end)")
        check(self.save_every == 0 or self.save_dir, f"save_every={self.save_every} needs save_dir (--save-dir DIR)")

    def _check_gpt(self) -> None:
        check(self.n_layer >= 1, f"n_layer={self.n_layer} must be >= 1")
        check(self.n_head >= 1, f"n_head={self.n_head} must be >= 1")
        check(self.d_model >= 1, f"d_model={self.d_model} must be >= 1")
        check(self.d_model % self.n_head == 0,
              f"d_model={self.d_model} is not divisible by n_head={self.n_head}; use a multiple of {self.n_head}")
        check(self.seq_len >= 1, f"seq_len={self.seq_len} must be >= 1")
        check(self.eval_every >= 0, f"eval_every={self.eval_every} must be >= 0 (0 = no held-out loss)")
        if self.data is not None:
            from .data import check_file
            check(self.model == "gpt", f"data={self.data!r} applies to model gpt only; drop --data or use --model gpt")
            check_file(self.data, self.seq_len)

    def check_world(self, world_size: int) -> None:
        parts = world_size * self.zero.micro_batches
        check(self.batch % parts == 0,
              f"batch={self.batch} does not split over {world_size} ranks x {self.zero.micro_batches} "
              f"micro-batches; use a multiple of {parts}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own prints the whole usage)
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zerompi.train", description=__doc__)
    p.add_argument("--stage", type=int, default=ZeroConfig.stage, help="ZeRO stage 0, 1, 2 or 3")
    p.add_argument("--model", default=TrainConfig.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--dtype", default=ZeroConfig.dtype, help="fp16 or fp32 storage")
    p.add_argument("--bucket-mb", type=float, default=ZeroConfig.bucket_mb, help="bucket size in MiB")
    p.add_argument("--lr", type=float, default=ZeroConfig.lr)
    p.add_argument("--weight-decay", type=float, default=ZeroConfig.weight_decay)
    p.add_argument("--micro-batches", type=int, default=ZeroConfig.micro_batches)
    p.add_argument("--clip", type=float, default=ZeroConfig.clip, help="global-norm clip, 0 = off")
    p.add_argument("--loss-scale", type=float, default=ZeroConfig.init_loss_scale, help="fp16 initial loss scale")
    p.add_argument("--loss-scale-window", type=int, default=ZeroConfig.loss_scale_window)
    p.add_argument("--optimizer-impl", default=ZeroConfig.optimizer_impl,
                   help="AdamW step: fused (one-pass kernels), numpy (reference) or auto")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--width", type=int, default=TrainConfig.width)
    p.add_argument("--depth", type=int, default=TrainConfig.depth)
    p.add_argument("--n-layer", type=int, default=TrainConfig.n_layer, help="GPT: transformer blocks")
    p.add_argument("--n-head", type=int, default=TrainConfig.n_head, help="GPT: attention heads")
    p.add_argument("--d-model", type=int, default=TrainConfig.d_model, help="GPT: embedding width")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, help="GPT: tokens per sequence")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="GPT: train on this file's bytes (default: a generated corpus with a known entropy)")
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every, metavar="K",
                   help="GPT: held-out loss every K steps (0 = never)")
    p.add_argument("--batch", type=int, default=TrainConfig.batch,
                   help="global batch: MLP rows, GPT sequences (default: gpt 48, mlp 64)")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--metrics-json", default=None, metavar="PATH")
    p.add_argument("--prefetch", type=int, default=ZeroConfig.prefetch,
                   help="stage 3: buckets gathered ahead of the computing layer (0 = off)")
    p.add_argument("--no-overlap", action="store_true",
                   help="wait for every collective as soon as it starts (the serial baseline)")
    p.add_argument("--progress", default=ZeroConfig.progress, help="how collectives advance: test or thread")
    p.add_argument("--save-dir", default=None, metavar="DIR", help="write checkpoints here (after the last step)")
    p.add_argument("--save-every", type=int, default=TrainConfig.save_every, metavar="K",
                   help="also save every K steps (needs --save-dir)")
    p.add_argument("--resume", default=None, metavar="DIR", help="resume from a checkpoint (any world size/stage)")
    p.add_argument("--device", default=TrainConfig.device,
                   help="cpu (NumPy), gpu (CuPy, GPU local-rank mod GPUs) or auto (gpu when CuPy sees one)")
    p.add_argument("--comm", default=TrainConfig.comm,
                   help="with --device gpu: mpi (staged through pinned host buffers) or nccl (one GPU per rank)")
    p.add_argument("--timeout-s", type=float, default=None, metavar="S",
                   help="abort the job when one collective waits longer (default: $ZEROMPI_TIMEOUT_S or 300)")
    p.add_argument("--max-skipped-steps", type=int, default=ZeroConfig.max_skipped_steps, metavar="K",
                   help="fp16: K consecutive steps skipped for non-finite gradients is an error")
    return p


def parse_config(argv: Optional[List[str]] = None) -> TrainConfig:
    """CLI flags -> TrainConfig (raises ConfigError on bad input)."""
    a = build_parser().parse_args(argv)
    zero = ZeroConfig(stage=a.stage, dtype=a.dtype, bucket_mb=a.bucket_mb, lr=a.lr, weight_decay=a.weight_decay,
                      clip=a.clip, micro_batches=a.micro_batches, init_loss_scale=a.loss_scale,
                      optimizer_impl=a.optimizer_impl,
                      loss_scale_window=a.loss_scale_window, overlap=not a.no_overlap, prefetch=a.prefetch,
                      progress=a.progress, timeout_s=a.timeout_s, max_skipped_steps=a.max_skipped_steps)
    return TrainConfig(model=a.model, steps=a.steps, batch=a.batch, width=a.width, depth=a.depth,
                       n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, seq_len=a.seq_len, data=a.data,
                       eval_every=a.eval_every, seed=a.seed,
                       log_every=a.log_every, metrics_json=a.metrics_json, save_dir=a.save_dir,
                       save_every=a.save_every, resume=a.resume, device=a.device, comm=a.comm, zero=zero)


def build_model(cfg: TrainConfig, xp=np):
    """(model, data) for cfg.model; the GPT computes on ``xp`` (the MLP's NumPy calls dispatch to CuPy)."""
    if cfg.model == "gpt":
        from .data import make_data
        from .models.gpt import GPT
        data = make_data(cfg.data, cfg.seq_len, cfg.seed)
        return GPT(data.vocab, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seed, xp=xp), data
    from .models.mlp import MLP, TeacherData
    return MLP(cfg.width, cfg.depth, cfg.seed), TeacherData(cfg.width, cfg.depth, cfg.seed)


def train(cfg: TrainConfig, mpi_comm=None, stop=None, placement=None) -> dict:
    """Run the job; returns the metrics dict (identical on every rank).

    ``stop``: a watchdog.StopSignal; once any rank has received one, every rank stops
    after the same step (and saves a checkpoint when save_dir is set). ``placement``: a
    device.Placement (main() makes it from cfg.device; None: the host, NumPy).
    """
    from .consistency import check_consistent, job_fields
    from . import optim
    from .comm import Communicator
    from .engine import ZeroEngine
    from .loop import local_rows, micro_batches, run_micro_batch
    from .timers import format_breakdown, summarize
    from .report import comm_table, memory_table, mpi_library, print0

    comm = Communicator(mpi_comm)
    # The engine's watchdog starts with the engine and times every later wait; this one times the check.
    with closing(Watchdog(comm.waiting, cfg.zero.timeout_s, comm.rank, comm.mpi)):
        check_consistent(comm, "train", job_fields(cfg))   # ranks given other flags stop here, not in a collective
    cfg.check_world(comm.size)
    from .staging import device_communicator
    xp = placement.xp if placement is not None else np
    model, data = build_model(cfg, xp)
    engine = ZeroEngine(model.init_layers(), cfg.zero, device_communicator(comm, xp, cfg.comm), xp=xp)
    z, lay = cfg.zero, engine.layout
    print0(comm.mpi, f"zerompi: {comm.size} ranks, stage {z.stage}, Ψ={lay.params_numel:,} parameters, "
                     f"dtype {z.dtype}, model {cfg.model}")
    print0(comm.mpi, f"  MPI: {mpi_library()}; reduce-scatter = Alltoallv + fp32 sum in rank order; "
                     f"all-gather = Allgather in place; {_where(placement, engine.comm)}")
    print0(comm.mpi, f"  layout: {len(lay.buckets)} buckets (target {z.bucket_mb} MiB), "
                     f"{lay.numel - lay.params_numel:,} padding elements; optimizer: {optim.adamw_update.__name__}")
    gpt = cfg.model == "gpt"
    floor = data.entropy_floor if gpt else None       # nats/token; None: unknown (a user's file) or not a GPT
    if gpt:
        tokens_per_step = cfg.batch * cfg.seq_len
        print0(comm.mpi, f"  GPT: n_layer {cfg.n_layer}, n_head {cfg.n_head}, d_model {cfg.d_model}, vocab "
                         f"{data.vocab}, {cfg.batch} sequences x {cfg.seq_len} tokens = {tokens_per_step:,} "
                         f"tokens/step; data: {data.source}")
        if floor is not None:
            print0(comm.mpi, f"  entropy floor {floor:.4f} nats/token: the lowest expected loss any model "
                             f"can reach on this corpus (uniform guessing: {np.log(data.vocab):.4f})")
    val_losses = []                               # [step, held-out loss] pairs
    tty = comm.rank == 0 and sys.stdout.isatty()  # a progress bar only for a person at a terminal
    start = _resume(engine, cfg) if cfg.resume else 0    # the step a resumed run starts at
    losses, times, comm_bytes = [], [], []
    sent = lambda: sum(s.bytes for op, s in comm.stats.items() if op != "sum_scalars")
    start_bytes = {op: s.bytes for op, s in comm.stats.items()}   # the initial parameter all-gather
    parts = []                                    # per step: the engine's timers (timers.py)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        engine.timers.take()                      # drop what ran between steps (checkpoints)
        b0 = sent()
        if gpt:
            from .models.gpt import train_losses
            local = train_losses(engine, model, data, step, cfg.batch, z.micro_batches)
        else:
            x, y = data.global_batch(step, cfg.batch)
            rows = local_rows(cfg.batch, comm.rank, comm.size)
            local = [run_micro_batch(engine, model, xp.asarray(xm), xp.asarray(ym))
                     for xm, ym in micro_batches(x[rows], y[rows], z.micro_batches)]
        result = engine.step()
        total = comm.sum_scalars([sum(local) / len(local), stop.flag if stop else 0.0])   # + the stop flag
        loss = float(total[0] / comm.size)
        stopping = total[1] > 0               # SIGTERM/SIGINT on some rank: every rank stops after this step
        times.append(time.perf_counter() - t0)
        parts.append(engine.timers.take())
        comm_bytes.append(sent() - b0)
        losses.append(loss)
        extra, evaluated = "", False          # GPT: held-out loss, floor, throughput
        if gpt:
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1 or stopping):
                val_losses.append([step + 1, _validate(engine, model, data, start_bytes)])
                evaluated = True
                extra += f"  val {val_losses[-1][1]:.4f}"
            extra += f"  floor {floor:.4f}" if floor is not None else ""
            extra += f"  {tokens_per_step / times[-1]:,.0f} tok/s"
        if step % cfg.log_every == 0 or step == cfg.steps - 1 or evaluated:
            skipped = " (skipped: overflow)" if result.skipped else ""
            lead = "\r\033[K" if tty else ""                 # over the progress bar
            print0(comm.mpi, f"{lead}step {step + 1:5d}/{cfg.steps}  loss {loss:.6f}{extra}  "
                             f"scale {result.loss_scale:g}  norm {result.grad_norm:.4g}  {times[-1] * 1e3:.1f} ms "
                             f"({format_breakdown(parts[-1])}){skipped}")
        elif tty:
            print0(comm.mpi, f"\r{_bar(step + 1, cfg.steps)}  loss {loss:.4f}", end="")
        if cfg.save_dir and (step + 1 == cfg.steps or stopping or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
            # The data is a function of (seed, step): the next step is the whole data position.
            path = engine.save(cfg.save_dir, {"data_step": step + 1, "seed": cfg.seed})
            print0(comm.mpi, f"  saved checkpoint {path}")
        if stopping:
            saved = f"checkpoint saved in {cfg.save_dir}" if cfg.save_dir else "no checkpoint (no --save-dir)"
            print0(comm.mpi, f"zerompi.train: stopped by {stop.received or 'a signal on another rank'} "
                             f"after step {step + 1} of {cfg.steps}; {saved}")
            break
    metrics = _metrics(cfg, engine, comm, losses, times, comm_bytes)   # before engine.close(): still watched
    metrics["first_step"] = start                   # losses[i] is the loss of step first_step + i
    metrics["time_breakdown_s"], metrics["comm_hidden_fraction"] = summarize(parts, times)
    metrics["peak_gathered_buckets"] = engine.peak_gathered_buckets
    metrics["step_times_s"] = times                 # rank 0's wall seconds of each step, in order
    metrics["val_losses"] = val_losses              # [step, mean held-out loss (nats/token)] pairs
    metrics["entropy_floor"] = floor                # nats/token; null for --data and the MLP
    metrics["tokens_per_s"] = tokens_per_step * len(times) / sum(times) if gpt else None   # global, rank 0's clock
    report = engine.memory_report()
    print0(comm.mpi, memory_table(metrics["memory_bytes"], report["theory"], report["theory_padded"],
                                  z.stage, comm.size, engine.config.itemsize))
    metrics["device"] = placement.describe() if placement is not None else "cpu (NumPy)"
    if xp is not np:      # the engine's own accounting beside what CuPy's allocator holds (rank 0)
        pool = xp.get_default_memory_pool()
        metrics["cupy_pool_bytes"] = {"used": int(pool.used_bytes()), "held": int(pool.total_bytes())}
        print0(comm.mpi, f"  CuPy memory pool (rank 0): {pool.used_bytes():,} bytes in use, {pool.total_bytes():,} "
                         f"held; engine model states {report['measured']['total']:,} + buffers at peak "
                         f"{report['peak_buffers']['bytes']:,} bytes")
    per_op = {op: (s.bytes - start_bytes.get(op, 0)) / len(times)
              for op, s in sorted(comm.stats.items()) if op != "sum_scalars"}
    print0(comm.mpi, comm_table(per_op, engine.comm_theory_bytes(), z.stage))
    print0(comm.mpi, f"  transient buffers at peak: {report['peak_buffers']['bytes']:,} bytes; "
                     f"median step {metrics['step_time_s'] * 1e3:.1f} ms")
    tb = metrics["time_breakdown_s"]
    print0(comm.mpi, f"  step time, median of steps: {format_breakdown(tb)}, other {tb['other'] * 1e3:.1f} ms; "
                     f"communication in flight {tb['comm_busy'] * 1e3:.1f} ms, "
                     f"{metrics['comm_hidden_fraction']:.0%} of it hidden behind compute")
    if cfg.metrics_json and comm.rank == 0:
        with open(cfg.metrics_json, "w") as f:
            json.dump(metrics, f, indent=1)
    engine.close()
    return metrics


def _where(placement, comm) -> str:
    """The banner's words for where the buffers are and how MPI reaches them."""
    if placement is None or placement.kind == "cpu":
        return "host buffers (NumPy)" + (f"; {placement.note}" if placement is not None and placement.note else "")
    from .device import mpi_cuda_aware
    aware, how = mpi_cuda_aware()
    return (f"device buffers on {placement.describe()}, collectives {comm.path} "
            f"(MPI CUDA-aware: {'yes' if aware else 'no'}, {how})")


def _validate(engine, model, data, start_bytes) -> float:
    """The held-out loss; its traffic (stage 3 gathers) is kept out of the per-step table."""
    from .models.gpt import validation_loss
    before = {op: s.bytes for op, s in engine.comm.stats.items()}
    loss = validation_loss(engine, model, data)
    for op, s in engine.comm.stats.items():
        start_bytes[op] = start_bytes.get(op, 0) + s.bytes - before.get(op, 0)
    return loss


def _bar(done: int, total: int, width: int = 30) -> str:
    """``[#######.......]  45%`` for a terminal."""
    fill = width * done // total
    return f"[{'#' * fill}{'.' * (width - fill)}] {100 * done // total:3d}%"


def _resume(engine, cfg: TrainConfig) -> int:
    """Load cfg.resume into engine (every rank); returns the first step to run."""
    from .checkpoint import CheckpointError
    from .report import print0
    info = engine.load(cfg.resume)
    extra = info.manifest["extra"]
    start = int(extra.get("data_step", info.manifest["step"]))
    if start >= cfg.steps:
        raise CheckpointError(f"{info.path}: is at step {start} and --steps {cfg.steps} leaves nothing to run; "
                              f"--steps counts from step 0, so use more than {start}")
    m = info.manifest
    print0(engine.comm.mpi, f"  resumed from {info.path}: step {start}, saved by {m['world_size']} ranks "
                            f"at stage {m['stage']} ({m['dtype']})")
    if extra.get("seed", cfg.seed) != cfg.seed:
        print0(engine.comm.mpi, f"  note: the checkpoint was trained with seed {extra['seed']}, this run's data "
                                f"uses seed {cfg.seed}")
    return start


def _metrics(cfg, engine, comm, losses, times, comm_bytes) -> dict:
    """The run's metrics (a collective: its all-reduces are timed by the engine's watchdog)."""
    from mpi4py import MPI
    step = engine.steps_taken
    engine._guard.at("metrics", step)          # ZEROMPI_FAULT=KIND@rankR:stepS:metrics (faults.py)
    report = engine.memory_report()
    names = list(report["measured"])
    top = np.array([report["measured"][k] for k in names] + [report["peak_buffers"]["bytes"], max(comm_bytes)],
                   np.int64)
    # The buffer form, not mpi4py's pickled allreduce: that one holds the GIL while it waits
    # (measured, mpi4py 4.1), so the watchdog thread could never run and a hang here would be forever.
    with watched(comm, "final metrics: all-reduce (max) of memory and traffic bytes", step):
        comm.mpi.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    mem = {k: int(v) for k, v in zip(names, top)}
    peak, traffic = int(top[-2]), int(top[-1])
    master = engine.unpadded_master()
    return {
        "world_size": comm.size,
        "stage": cfg.zero.stage,
        "dtype": cfg.zero.dtype,
        "model": cfg.model,
        "params": engine.layout.params_numel,
        "padded_params": engine.layout.numel,
        "losses": losses,
        "final_params_sha256": hashlib.sha256(master.astype("<f4").tobytes()).hexdigest(),
        "memory_bytes": mem,
        "theory_bytes": report["theory"],
        "theory_bytes_padded": report["theory_padded"],
        "peak_buffer_bytes": peak,
        "comm_bytes_per_step": traffic,
        "comm_theory_bytes_per_step": engine.comm_theory_bytes(),
        "step_time_s": statistics.median(times),
        "steps_applied": engine.step_count,
        "optimizer_impl": engine.optimizer_impl,
        "loss_scale": engine.loss_scale,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "zero"} | {"zero": cfg.zero.to_dict()},
    }


def _one_blas_thread() -> None:
    """One OpenBLAS thread per rank, unless the user set OPENBLAS_NUM_THREADS or OMP_NUM_THREADS.

    OpenBLAS otherwise starts a spinning thread per core in every rank. Measured on a shared
    2-core machine: the default GPT step 5-7 s with them at 4 ranks, 0.1 s without; even one
    rank alone ran 16x slower (GPT, 3.8 s vs 0.23 s) and a width-1024 MLP 2x slower.
    Parallelism here comes from ranks; the per-rank matrices are small.
    """
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
    error = None
    try:
        cfg = parse_config(argv)
        cfg.check_world(comm.Get_size())
        fault_from_env()                  # a bad ZEROMPI_FAULT stops every rank here
    except ConfigError as e:
        error = str(e)
    if agree_on_errors(comm, error, "zerompi.train"):
        return 2
    from .device import place_every_rank
    placement = place_every_rank(cfg.device, comm, "zerompi.train")   # gpu: needs CuPy and a GPU
    if placement is None:
        return 2
    from .checkpoint import CheckpointError
    try:
        train(cfg, stop=StopSignal(), placement=placement)
    except (CheckpointError, JobError) as e:   # raised on every rank together: no rank is left in a collective
        if comm.Get_rank() == 0:
            sys.stderr.write(f"zerompi.train: error: {e}\n")
            sys.stderr.flush()
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
