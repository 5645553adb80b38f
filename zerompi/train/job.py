"""The unpipelined job, and what it shares with the pipelined one (train/pipeline.py's PipelineJob).

``Job``: the two strategies of train/run.py's one step loop answer the same questions -- a step, its loss
over the world, the held-out loss, a resume, the facts of the final metrics -- so that the loop, the report
and the metrics are one. ``SingleJob``: one stage holding the whole model in one chunk (models/chunks.py),
one ZeroEngine (over a Mesh when the blocks are split over TP or the sequences over SP).
"""
import hashlib
from typing import Callable, List, Optional

import numpy as np

from ..comm.simulated_world import simulated


def step_losses(model: str) -> Callable[..., List[float]]:
    """The built-in model's ``train_losses(engine, model, data, step, batch, micro_batches)``: this rank's
    micro-batches of the step forward and backward, gradients to the engine; returns their losses."""
    if model == "gpt":
        from .models.gpt_chunk import train_losses
    else:
        from .models.mlp import train_losses
    return train_losses


class Job:
    """What both strategies share: ``cfg``, ``comm``, and ``groups`` (the TP and SP groups, metered per step)."""

    pipelined = False
    replicas = None          # --replicas: the run's train/replicas.ReplicaRun, set by the driver (run.py)

    def metered(self, log, run):
        """``run()``, its TP all-reduces and SP all-to-alls recorded into ``log`` (per step, apart)."""
        g0 = {name: (c.bytes_sent(), c.seconds()) for name, c in self.groups.items()}
        out = run()
        for name, c in self.groups.items():
            log.record_group(name, c.bytes_sent() - g0[name][0], c.seconds() - g0[name][1])
        return out

    def reduce_loss(self, losses: Optional[List[float]], flag: float = 0.0):
        """(the step's loss, the summed stop flag): the last stage's mean micro-batch losses summed over the world
        in rank order (zeros elsewhere) over one stage's ranks: the same bits with --pp as without."""
        mine = sum(losses) / len(losses) if losses else 0.0
        total = self.comm.sum_scalars([mine, flag])
        if self.pipelined and simulated(self.comm):
            return float(mine), total[1]          # the stand-ins' sum is N copies of it
        return float(total[0] / (self.comm.size // self.cfg.mesh.pp)), total[1]

    def _tp_joined(self, digest: str) -> str:
        """The sha256 of every TP rank's ``digest`` in TP rank order (a collective over the TP group)."""
        return hashlib.sha256("".join(self.mesh.tp_mpi.allgather(digest)).encode()).hexdigest()

    @staticmethod
    def _params(engines, tp: int) -> int:
        """Ψ of the engines' layouts, a TP-split parameter at its full size (``tp`` pieces)."""
        return sum(pr.numel * (tp if e.tp and name in e.tp.split else 1)
                   for e in engines for name, pr in e.layout.params.items())


class SingleJob(Job):
    """This rank's part of a run without --pp; ``build(cfg, xp, mesh)``: train/run.py's build_model."""

    def __init__(self, cfg, comm, build, placement=None):
        from ..comm.staging import device_communicator
        from ..engine.zero_engine import ZeroEngine
        from .parallel import make_mesh, metered_groups
        self.cfg, self.comm = cfg, comm
        xp = placement.xp if placement is not None else np
        z = cfg.zero
        m = cfg.mesh
        self.mesh = make_mesh(cfg, comm, placement) if m.tp > 1 or m.sp > 1 else None   # ZeRO over dp x sp
        self.model, self.data = build(cfg, xp, self.mesh)
        self.dev_comm = comm if self.mesh else device_communicator(comm, xp, cfg.comm, z.timeout_s)
        layers, self.ep = self.model.lazy_layers(), None
        if cfg.moe.ep > 1:                        # the experts in an engine of their own (train/moe/expert_parallel.py)
            from .moe.expert_parallel import ExpertParallel
            self.ep = ExpertParallel(cfg, comm, self.model, layers, xp)
            layers = self.ep.dense_layers
        self.engine = ZeroEngine(layers, self.ep.dense_config if self.ep else z, self.mesh or self.dev_comm, xp=xp,
                                 mesh_config=cfg.mesh,
                                 tp_split=self.model.tp_split() if self.mesh and self.mesh.tp > 1 else None)
        self.engines = [self.engine] + ([self.ep.engine] if self.ep else [])
        self.groups = metered_groups(self.mesh)   # TP all-reduces, SP all-to-alls: counted per step, apart
        self._losses = step_losses(cfg.model)
        from .moe.routing import MoELog
        self.moe_log = MoELog(cfg, self.model, comm, self.ep) if cfg.moe.on else None   # routing per step

    @property
    def checkpoints(self):
        """What saves and loads the run's checkpoints (checkpoint layout: the engine's own; an MoE run's:
        train/moe/checkpoints.py)."""
        if self.cfg.moe.on:
            from .moe.checkpoints import MoECheckpoints
            return MoECheckpoints(self)
        return self.engine

    @property
    def computes_loss(self) -> bool:
        return True

    def train_step(self, step: int, log):
        """This rank's micro-batches through the engine, then its step; (StepResult, micro-batch losses)."""
        z = self.cfg.zero
        if self.moe_log is not None:
            self.moe_log.begin()
        local = self.metered(log, lambda: self._losses(self.engine, self.model, self.data, step, self.cfg.batch,
                                                       z.micro_batches))
        if self.moe_log is not None:
            self.moe_log.record()
        result = self.ep.step(self.engine) if self.ep else self.engine.step()
        if self.moe_log is not None:
            self.moe_log.norms.append(result.grad_norm)   # every expert counted once (tests/test_moe_ep.py)
        return result, local

    def validation_loss(self):
        """data.HeldOut: the held-out loss and its rows (a collective)."""
        from .models.gpt_chunk import held_out_loss
        return held_out_loss(self.engine, self.model, self.data)

    # ---- the facts of the final metrics ------------------------------------------------------------
    def params_total(self) -> int:
        """Ψ of the whole model (a TP-split parameter at its full size; with --ep, every expert)."""
        if self.ep:
            return self.ep.params_total(self.engine, self._params([self.engine], self.mesh.tp if self.mesh else 1))
        return self._params(self.engines, self.mesh.tp if self.mesh else 1)

    def digest(self) -> Optional[str]:
        """sha256 of the parameters in layout order (no padding); with TP, of every TP rank's; None when simulated."""
        from ..pipeline.digest import bucket_bytes
        if simulated(self.comm):
            return None
        tp = self.mesh is not None and self.mesh.tp > 1
        if self.ep:
            return self._tp_joined(self.ep.digest(self.engine)) if tp else self.ep.digest(self.engine)
        digest = hashlib.sha256()
        for data in bucket_bytes(self.engine):
            digest.update(data.data)
        return self._tp_joined(digest.hexdigest()) if tp else digest.hexdigest()

    def activations(self):
        """(measured, formula) activation bytes per rank: the GPT's on its C kernels, else (None, None)."""
        from ..estimate.activations import gpt_activation_bytes
        cfg, model, m = self.cfg, self.model, self.cfg.mesh
        measured = getattr(model, "activation_bytes", None)
        if measured is None:
            return None, None
        rows = cfg.batch // (self.comm.size // (m.tp * m.sp) * cfg.zero.micro_batches)   # sequences per dp rank
        return measured, gpt_activation_bytes(
            rows, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head, model.vocab, cfg.checkpoint_activations,
            np.dtype(model.dtype).itemsize, m.sp, m.tp)["total"]

    def tp_theory(self) -> int:
        from .tp_run import theory_bytes_per_step
        return theory_bytes_per_step(self.cfg, self.model, self.mesh.dp)

    def sp_theory(self) -> int:
        from .sp_run import theory_bytes_per_step
        return theory_bytes_per_step(self.cfg, self.model, self.mesh.dp)

    def close(self) -> None:
        self.engine.close()
        if self.ep:
            self.ep.close()
        if self.dev_comm is not self.comm:
            getattr(self.dev_comm, "close", lambda: None)()   # NCCL's communicator is destroyed here
