"""The unpipelined job: one stage holding the whole model in one chunk, one ZeroEngine (over a Mesh when the
blocks are split over TP or the sequences over SP).

It is one of the two strategies of train/run.py's one step loop (the other: train/pipeline.py's
PipelineJob, --pp P > 1); both answer the same questions -- a step, its loss over the world, the held-out
loss, a resume, the facts of the final metrics -- so that the loop, the report and the metrics are one.
"""
import hashlib
from typing import List, Optional

import numpy as np


class SingleJob:
    """This rank's part of a run without --pp; ``build(cfg, xp, mesh)``: train/run.py's build_model."""

    pipelined = False

    def __init__(self, cfg, comm, build, placement=None):
        from ..comm.staging import device_communicator
        from ..engine.zero_engine import ZeroEngine
        from .parallel import make_mesh, metered_groups
        self.cfg, self.comm = cfg, comm
        xp = placement.xp if placement is not None else np
        z = cfg.zero
        self.mesh = make_mesh(cfg, comm, placement) if z.tp > 1 or z.sp > 1 else None   # ZeRO over dp x sp
        self.model, self.data = build(cfg, xp, self.mesh)
        self.dev_comm = comm if self.mesh else device_communicator(comm, xp, cfg.comm, z.timeout_s)
        self.engine = ZeroEngine(self.model.lazy_layers(), z, self.mesh or self.dev_comm, xp=xp,
                                 tp_split=self.model.tp_split() if self.mesh and self.mesh.tp > 1 else None)
        self.engines = [self.engine]
        self.groups = metered_groups(self.mesh)   # TP all-reduces, SP all-to-alls: counted per step, apart
        from .run import step_losses
        self._losses = step_losses(cfg.model)

    @property
    def checkpoints(self):
        """What saves and loads the run's checkpoints (checkpoint layout: the engine's own)."""
        return self.engine

    @property
    def computes_loss(self) -> bool:
        return True

    def train_step(self, step: int, log):
        """This rank's micro-batches through the engine, then its step; (StepResult, micro-batch losses)."""
        g0 = {name: (c.bytes_sent(), c.seconds()) for name, c in self.groups.items()}
        local = self._losses(self.engine, self.model, self.data, step, self.cfg.batch, self.cfg.zero.micro_batches)
        for name, c in self.groups.items():
            log.record_group(name, c.bytes_sent() - g0[name][0], c.seconds() - g0[name][1])
        return self.engine.step(), local

    def reduce_loss(self, losses: List[float], flag: float = 0.0):
        """(the step's loss: the mean over ranks of their mean micro-batch loss, the summed stop flag)."""
        total = self.comm.sum_scalars([sum(losses) / len(losses), flag])
        return float(total[0] / self.comm.size), total[1]

    def validation_loss(self):
        """data.HeldOut: the held-out loss and its rows (a collective)."""
        from .models.gpt import held_out_loss
        return held_out_loss(self.engine, self.model, self.data)

    # ---- the facts of the final metrics ------------------------------------------------------------
    def params_total(self) -> int:
        """Ψ of the whole model (a TP-split parameter at its full size)."""
        split = self.engine.tp.split if self.engine.tp else {}
        k = self.mesh.tp if self.mesh else 1
        return sum(pr.numel * (k if name in split else 1) for name, pr in self.engine.layout.params.items())

    def digest(self) -> Optional[str]:
        """sha256 of the parameters in layout order (no padding), a bucket at a time; with TP, of every TP
        rank's digest in TP rank order; None for a simulated world (its stand-ins' slices mirror this rank's)."""
        engine = self.engine
        if getattr(self.comm.mpi, "simulated", False):
            return None
        digest, lay = hashlib.sha256(), engine.layout
        engine.synchronize()
        for bucket, values in engine.optimizer.gather_buckets(engine.group, engine.steps_taken):
            for layer in bucket.layers:
                for name in lay.layer_params[layer]:
                    pr = lay.params[name]
                    part = values[pr.bucket_offset:pr.bucket_offset + pr.numel]
                    digest.update(np.ascontiguousarray(part, "<f4").data)
        digest = digest.hexdigest()
        if self.mesh is not None and self.mesh.tp > 1:
            digest = hashlib.sha256("".join(self.mesh.tp_mpi.allgather(digest)).encode()).hexdigest()
        return digest

    def activations(self):
        """(measured, formula) activation bytes of this rank (report.activations)."""
        from .report import activations
        return activations(self.cfg, self.model, self.comm.size)

    def tp_theory(self) -> int:
        from .tp_run import theory_bytes_per_step
        return theory_bytes_per_step(self.cfg, self.model, self.mesh.dp)

    def sp_theory(self) -> int:
        from .sp_run import theory_bytes_per_step
        return theory_bytes_per_step(self.cfg, self.model, self.mesh.dp)

    def close(self) -> None:
        self.engine.close()
        if self.dev_comm is not self.comm:
            getattr(self.dev_comm, "close", lambda: None)()   # NCCL's communicator is destroyed here
