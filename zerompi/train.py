"""``mpiexec -n N python -m zerompi.train``: train a built-in model with ZeRO stage 0-3."""
import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, fields
from typing import List, Optional

import numpy as np

from .config import DTYPES, STAGES, ZeroConfig
from .errors import ConfigError, check, install_abort_hook

MODELS = ("mlp",)


@dataclass(frozen=True)
class TrainConfig:
    """The training job: model, data and schedule. Engine knobs live in ``zero``."""

    model: str = "mlp"
    """Built-in model: one of MODELS."""
    steps: int = 30
    """Optimizer steps to run (>= 1)."""
    batch: int = 64
    """Global batch (rows per step over all ranks); must divide by ranks x micro-batches."""
    width: int = 256
    """MLP: features per layer."""
    depth: int = 4
    """MLP: number of Linear+GELU blocks."""
    seed: int = 0
    """Seeds the initial parameters and the generated data."""
    log_every: int = 1
    """Print a progress line every this many steps."""
    metrics_json: Optional[str] = None
    """Write the run's metrics as one JSON object to this path (rank 0)."""
    zero: ZeroConfig = ZeroConfig()
    """Engine configuration."""

    def __post_init__(self):
        check(self.model in MODELS, f"model={self.model!r} is not allowed; use one of {', '.join(MODELS)}")
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.batch >= 1, f"batch={self.batch} must be >= 1")
        check(self.width >= 1, f"width={self.width} must be >= 1")
        check(self.depth >= 1, f"depth={self.depth} must be >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")

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
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--width", type=int, default=TrainConfig.width)
    p.add_argument("--depth", type=int, default=TrainConfig.depth)
    p.add_argument("--batch", type=int, default=TrainConfig.batch, help="global batch")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--metrics-json", default=None, metavar="PATH")
    return p


def parse_config(argv: Optional[List[str]] = None) -> TrainConfig:
    """CLI flags -> TrainConfig (raises ConfigError on bad input)."""
    a = build_parser().parse_args(argv)
    zero = ZeroConfig(stage=a.stage, dtype=a.dtype, bucket_mb=a.bucket_mb, lr=a.lr, weight_decay=a.weight_decay,
                      clip=a.clip, micro_batches=a.micro_batches, init_loss_scale=a.loss_scale,
                      loss_scale_window=a.loss_scale_window)
    return TrainConfig(model=a.model, steps=a.steps, batch=a.batch, width=a.width, depth=a.depth, seed=a.seed,
                       log_every=a.log_every, metrics_json=a.metrics_json, zero=zero)


def build_model(cfg: TrainConfig):
    """(model, data) for cfg.model."""
    from .models.mlp import MLP, TeacherData
    return MLP(cfg.width, cfg.depth, cfg.seed), TeacherData(cfg.width, cfg.depth, cfg.seed)


def train(cfg: TrainConfig, mpi_comm=None) -> dict:
    """Run the job; returns the metrics dict (identical on every rank)."""
    from . import optim
    from .comm import Communicator
    from .engine import ZeroEngine
    from .loop import local_rows, micro_batches, run_micro_batch
    from .report import comm_table, memory_table, mpi_library, print0

    comm = Communicator(mpi_comm)
    cfg.check_world(comm.size)
    model, data = build_model(cfg)
    engine = ZeroEngine(model.init_layers(), cfg.zero, comm)
    z, lay = cfg.zero, engine.layout
    print0(comm.mpi, f"zerompi: {comm.size} ranks, stage {z.stage}, Ψ={lay.params_numel:,} parameters, "
                     f"dtype {z.dtype}, model {cfg.model}")
    print0(comm.mpi, f"  MPI: {mpi_library()}; reduce-scatter = Alltoall + fp32 sum in rank order; "
                     f"all-gather = Allgather in place; host buffers (NumPy)")
    print0(comm.mpi, f"  layout: {len(lay.buckets)} buckets (target {z.bucket_mb} MiB), "
                     f"{lay.numel - lay.params_numel:,} padding elements; optimizer: {optim.adamw_update.__name__}")
    losses, times, comm_bytes = [], [], []
    sent = lambda: sum(s.bytes for op, s in comm.stats.items() if op != "sum_scalars")
    start_bytes = {op: s.bytes for op, s in comm.stats.items()}   # the initial parameter all-gather
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        b0 = sent()
        x, y = data.global_batch(step, cfg.batch)
        rows = local_rows(cfg.batch, comm.rank, comm.size)
        local = [run_micro_batch(engine, model, xm, ym)
                 for xm, ym in micro_batches(x[rows], y[rows], z.micro_batches)]
        result = engine.step()
        loss = float(comm.sum_scalars([sum(local) / len(local)])[0] / comm.size)
        times.append(time.perf_counter() - t0)
        comm_bytes.append(sent() - b0)
        losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            skipped = " (skipped: overflow)" if result.skipped else ""
            print0(comm.mpi, f"step {step + 1:5d}/{cfg.steps}  loss {loss:.6f}  scale {result.loss_scale:g}  "
                             f"norm {result.grad_norm:.4g}  {times[-1] * 1e3:.1f} ms{skipped}")
    metrics = _metrics(cfg, engine, comm, losses, times, comm_bytes)
    report = engine.memory_report()
    print0(comm.mpi, memory_table(metrics["memory_bytes"], report["theory"], report["theory_padded"],
                                  z.stage, comm.size, engine.config.itemsize))
    per_op = {op: (s.bytes - start_bytes.get(op, 0)) / cfg.steps
              for op, s in sorted(comm.stats.items()) if op != "sum_scalars"}
    print0(comm.mpi, comm_table(per_op, engine.comm_theory_bytes(), z.stage))
    print0(comm.mpi, f"  transient buffers at peak: {report['peak_buffers']['bytes']:,} bytes; "
                     f"median step {metrics['step_time_s'] * 1e3:.1f} ms")
    if cfg.metrics_json and comm.rank == 0:
        with open(cfg.metrics_json, "w") as f:
            json.dump(metrics, f, indent=1)
    engine.close()
    return metrics


def _metrics(cfg, engine, comm, losses, times, comm_bytes) -> dict:
    from mpi4py import MPI
    report = engine.memory_report()
    mem = {k: comm.mpi.allreduce(v, op=MPI.MAX) for k, v in report["measured"].items()}
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
        "peak_buffer_bytes": comm.mpi.allreduce(report["peak_buffers"]["bytes"], op=MPI.MAX),
        "comm_bytes_per_step": comm.mpi.allreduce(max(comm_bytes), op=MPI.MAX),
        "comm_theory_bytes_per_step": engine.comm_theory_bytes(),
        "step_time_s": statistics.median(times),
        "steps_applied": engine.step_count,
        "loss_scale": engine.loss_scale,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "zero"} | {"zero": cfg.zero.to_dict()},
    }


def main(argv: Optional[List[str]] = None) -> int:
    from mpi4py import MPI
    install_abort_hook(MPI.COMM_WORLD)
    comm = MPI.COMM_WORLD
    error = None
    try:
        cfg = parse_config(argv)
        cfg.check_world(comm.Get_size())
    except ConfigError as e:
        error = str(e)
    # One small collective so that ranks given different flags stop together, not hang.
    errors = comm.allgather(error)
    if any(errors):
        if comm.Get_rank() == 0:
            rank, msg = next((r, m) for r, m in enumerate(errors) if m)
            where = "" if all(m == msg for m in errors) else f" (rank {rank})"
            sys.stderr.write(f"zerompi.train: error{where}: {msg}\n")
            sys.stderr.flush()
        return 2
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
