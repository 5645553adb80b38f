"""The train job with pipeline stages (--pp P): its checks, the chunks and their engines, the step.

P stages of N/P ranks (comm/mesh.py); the model's layers cut into C chunks (models/chunks.py), placed by the
schedule, one ZeroEngine per chunk over its stage's data-parallel group. Each step the schedule's actions run
(pipeline/executor.py), then every engine takes the step decided over the whole mesh (pipeline/step.py). The
loss is the last stage's, summed over the mesh in world rank order: the same bits as without --pp.
"""
import os
import statistics
import time
from collections import deque
from fnmatch import fnmatchcase
from types import SimpleNamespace
from typing import Dict

import numpy as np

from ..engine.decay import exempt_names
from ..engine.matrix_owners import matrix_names, muon_names
from ..errors import check
from ..pipeline.config import PipelineConfig
from .job import Job
from ..comm.simulated_world import simulated


def check_model(cfg) -> None:
    """ConfigError (one line) unless cfg's pipeline settings fit its model and its other settings."""
    pp, p = cfg.mesh.pp, cfg.pipeline
    if pp == 1:
        check(p == PipelineConfig(), f"pipeline={p.to_dict()} applies with pp > 1 only; set --pp, or drop it")
        return
    z = cfg.zero
    check(p.gather == "micro-batch" or z.stage == 3, f"gather={p.gather!r} (--pp-gather) applies with stage 3 only "
                                                      f"(stage={z.stage} keeps the parameters whole)")
    if p.schedule_file is None:
        from ..pipeline.schedules import check_args
        check_args(p.schedule, pp, z.micro_batches, p.chunks)
        check_blocks(cfg, pp * p.chunks, p.chunks)


def check_blocks(cfg, chunks: int, per_stage: int) -> None:
    """ConfigError unless the model's blocks split into ``chunks`` equal chunks (``per_stage`` per stage)."""
    blocks, what = (cfg.n_layer, "n_layer") if cfg.model == "gpt" else (cfg.depth, "depth")
    pp = chunks // per_stage
    check(blocks % pp == 0, f"pp={pp} does not divide {what}={blocks}; each pipeline stage holds an equal run "
                            f"of blocks, so use a pp dividing {blocks}")
    check((blocks // pp) % per_stage == 0, f"chunks={per_stage} does not divide the {blocks // pp} blocks per "
                                           f"stage ({what}={blocks}, pp={pp}); use a divisor of {blocks // pp}")


def load_schedule(cfg):
    """The validated schedule of the run (made, or read from the file): ScheduleError (a ConfigError) else."""
    from ..pipeline import actions, schedules, validate
    p, pp = cfg.pipeline, cfg.mesh.pp
    if p.schedule_file is None:
        s = schedules.make(p.schedule, pp, cfg.zero.micro_batches, p.chunks)
    else:
        s = actions.read(p.schedule_file)
    validate.check(s, micro_batches=cfg.zero.micro_batches, ranks=pp)
    check(not (cfg.checkpoint_activations and s.split_backward),
          f"checkpoint_activations=True is not available with the {s.name} schedule, whose backward is split into "
          "B and W (W reads the activations a recomputing block does not keep); use another schedule or drop one")
    per = {r: len(s.chunks_of(r)) for r in range(pp)}
    check(len(set(per.values())) == 1, f"the schedule puts {per} chunks on the stages ({{stage: chunks}}); every "
                                       "stage must hold as many")
    check_blocks(cfg, s.chunks, s.chunks // pp)
    return s


class PipelineJob(Job):
    """This rank's part of a pipelined run: mesh, schedule, chunk runners, engines, executor; ``build``: train/run.py's
    build_model."""

    pipelined = True

    def __init__(self, cfg, comm, build, placement=None):
        from ..comm.mesh import Mesh
        from .parallel import place_mesh
        from ..comm.consistency import check_consistent
        from ..pipeline.engines import StageEngines
        from ..pipeline.executor import PipelineExecutor
        self.cfg, self.comm = cfg, comm
        z, m = cfg.zero, cfg.mesh
        self.xp = xp = placement.xp if placement is not None else np
        self.mesh = mesh = place_mesh(Mesh(comm, m.tp, sp=m.sp, pp=m.pp, node_size=m.node_size), cfg, placement)
        self.schedule = load_schedule(cfg)
        check_consistent(comm, "pipeline schedule", {"schedule": self.schedule.text()})   # a file per rank
        self.where = self.schedule.placement()
        self.local = self.schedule.chunks_of(mesh.pp_rank)
        self.model, self.data = build(cfg, xp, mesh if m.tp > 1 or m.sp > 1 else None)   # train/run.py's build_model
        names = [n for _, params in self.model.lazy_layers() for n in params]
        exempt_names(SimpleNamespace(params=dict.fromkeys(names)), z.no_decay)   # over the whole model, as unpipelined
        if z.optimizer == "muon":                # ... and Muon's patterns (each chunk takes those of its matrices)
            muon_names({n: np.shape(a) for _, params in self.model.lazy_layers() for n, a in params.items()},
                       z.muon_params, z.muon_stacked)
        from .models.activations import MeteredWorkspace
        self.shared = MeteredWorkspace()          # the GPT's one-layer buffers: one set for all of this rank's chunks
        self.runners = {c: self._runner(c) for c in self.local}
        self.experts = None
        if cfg.moe.ep > 1:                         # each chunk's experts in an engine of their own, EP in the stage
            from .moe.stage_experts import StageExperts
            self.experts = StageExperts(cfg, mesh, comm, self.model, self.runners, self._chunk_config(),
                                        self.schedule.chunks, xp)
        engines = {c: self._engine(c, xp) for c in self.local}
        if self.experts:
            self.experts.dense = engines
        self.engines = StageEngines(engines, self.schedule.chunks, mesh, self.experts)
        keep = {c: e for c, e in engines.items()} if z.stage == 3 and cfg.pipeline.gather == "step" else None
        self.executor = PipelineExecutor(self.schedule, mesh.pp_comm, self.runners, keep)
        from .moe.routing import MoELog
        self.moe_log = MoELog(cfg, self.model, comm, self.experts, stages=m.pp) if cfg.moe.on else None   # per step

    @property
    def rows(self) -> int:
        """Sequences (MLP: rows) of one micro-batch on this data-parallel rank."""
        return self.cfg.batch // self.mesh.dp // self.cfg.zero.micro_batches

    @property
    def leads_stage(self) -> bool:
        """This rank is its stage's first (data-, sequence- and tensor-parallel rank 0)."""
        return self.mesh.dp_rank == self.mesh.sp_rank == self.mesh.tp_rank == 0

    def _runner(self, c: int):
        """Chunk c's walk (models/chunks.py, models/gpt_chunk.py), fed this data-parallel rank's rows."""
        from .models.chunks import Chunk, WorkspacePool, chunk_layers
        cfg, mesh, m, m_b, chunks, rows = self.cfg, self.mesh, self.model, self.cfg.zero.micro_batches, \
            self.schedule.chunks, self.rows
        if cfg.model == "mlp":
            from .models.mlp import step_batches
            feed = lambda step: step_batches(self.data, step, cfg.batch, mesh.dp_rank, mesh.dp, m_b, self.xp)  # noqa: E731
            return Chunk(m, chunk_layers(m.depth, [], [], m.depth, c, chunks), m.depth, feed, rows)
        from .models.gpt_fast import FRESH
        from .models.gpt_chunk import GPTChunk, step_batches
        feed = lambda step: step_batches(m, self.data, step, cfg.batch, mesh.dp_rank, mesh.dp, m_b)  # noqa: E731
        pool = WorkspacePool(self.shared) if m.layers.name == "c" else None   # shared: the rank's one-layer set
        layers = chunk_layers(m.num_layers, [0], [m.n_layer + 1], m.n_layer, c, chunks)
        return GPTChunk(m, layers, feed, rows, self.tie(), pool, FRESH)

    def tie(self):
        """The tied embedding / head weight between chunk 0's stage and the last chunk's (the GPT)."""
        if getattr(self, "_tie", None) is None:
            from ..engine.contract import storage_dtype
            from ..pipeline.tied import TiedWeight
            owner, reader = self.where[0], self.where[self.schedule.chunks - 1]
            self._tie = TiedWeight(self.mesh.pp_comm, owner, reader, (self.model.vocab, self.model.d_model),
                                   storage_dtype(self.cfg.zero.dtype, np))
        return self._tie

    def _chunk_config(self):
        """A chunk's engine's ZeroConfig before its patterns: no trace; one micro-batch where reduced per step."""
        from dataclasses import replace
        z = self.cfg.zero
        return replace(z, trace=None, micro_batches=1 if self.cfg.pipeline.grad_reduce == "step" else z.micro_batches)

    def _engine(self, c: int, xp):
        from dataclasses import replace
        from ..engine.zero_engine import ZeroEngine
        from ..pipeline.engines import offload_folder
        from ..pipeline.grads import GradSink
        z = self.cfg.zero
        runner = self.runners[c]
        layers = self.experts.dense_layers[c] if self.experts else runner.lazy_layers()   # --ep: without the experts
        names = [n for _, params in layers for n in params]
        matrices = matrix_names(layers, z.muon_stacked)
        zc = replace(self._chunk_config(),                                           # the patterns the chunk matches
                     no_decay=tuple(p for p in z.no_decay if any(fnmatchcase(n, p) for n in names)),
                     muon_params=tuple(p for p in z.muon_params if any(fnmatchcase(n, p) for n in matrices)),
                     offload_dir=offload_folder(z, c, self.schedule.chunks))
        engine = ZeroEngine(layers, zc, self.mesh, xp=xp, mesh_config=self.cfg.mesh,
                            tp_split=runner.tp_split() if self.cfg.mesh.tp > 1 else None)
        runner.attach(engine, GradSink(engine, self.cfg.pipeline.grad_reduce, z.micro_batches))
        return engine

    # ---- one step ------------------------------------------------------------------------------------
    @property
    def checkpoints(self):
        """What saves and loads the run's checkpoints (DIR/pp{c}-of-{C}/ per chunk: pipeline/engines.py; an MoE
        run's expert parts beside each chunk's: train/moe/checkpoints.py)."""
        if self.cfg.moe.on:
            from .moe.checkpoints import StageMoECheckpoints
            return StageMoECheckpoints(self)
        return self.engines

    @property
    def computes_loss(self) -> bool:
        return self.schedule.chunks - 1 in self.runners    # a stage without the last chunk computes no loss

    def begin(self, log) -> None:
        """Before the first step: the log's pipeline series, and the clock aligned over the mesh (a collective)."""
        from ..comm.watchdog import watched
        from ..engine.trace import align_clocks
        from .parallel import metered_groups
        log.pp_bytes, log.pp_times = deque(maxlen=log.cap), deque(maxlen=min(log.cap, 64))
        log.pp_msgs = deque(maxlen=self.cfg.zero.trace_steps)     # --trace: each kept step's messages
        self.groups = metered_groups(self.mesh)
        with watched(self.comm, "pipeline: aligning the clocks"):
            self.offset = align_clocks(self.comm, time.perf_counter)[0]

    def train_step(self, step: int, log):
        """step_once measured into ``log`` (the bytes of each kind of message, the TP and SP groups', the actions'
        times); returns (StepResult, this rank's micro-batch losses or None)."""
        pc, offset = self.mesh.pp_comm, self.offset
        p0 = {k: s.bytes for k, s in pc.stats.items()}
        pc.events = [] if self.cfg.zero.trace else None
        result, losses, times = self.metered(log, lambda: self.step_once(step))
        if pc.events is not None:
            log.pp_msgs.append([(k, sd, peer, n, t0 + offset, t1 + offset) for k, sd, peer, n, t0, t1 in pc.events])
            pc.events = None
        log.pp_bytes.append({k: s.bytes - p0.get(k, 0) for k, s in pc.stats.items()})
        log.pp_times.append([(a.action, a.start + offset, a.ready + offset, a.end + offset) for a in times])
        return result, losses

    def step_once(self, step: int):
        """The schedule's actions, then the step over the mesh, unmeasured: (StepResult, this rank's micro-batch
        losses or None, the executor's action times)."""
        if self.moe_log is not None:
            self.moe_log.begin()
        times = self.executor.run(step)
        if self.moe_log is not None:
            self.moe_log.record()
        result = self.engines.step()
        if self.moe_log is not None:
            self.moe_log.norms.append(result.grad_norm)
        last = self.runners.get(self.schedule.chunks - 1)
        losses = [last.losses[mb] for mb in range(self.cfg.zero.micro_batches)] if last is not None else None
        return result, losses, times

    def validation_loss(self, chunk: int = 32):
        """data.HeldOut: the GPT's mean held-out token loss through the pipeline and its rows (a collective over
        the mesh): this data-parallel rank's rows in passes of ``chunk`` as models/gpt_chunk.held_out_loss makes
        them, each through every chunk in model order; the last chunk's sums summed over the world (the last
        stage's ranks of TP rank 0; zeros elsewhere) as there: the same bits."""
        from .data import HeldOut, held_out_passes, rank_rows
        from ..pipeline.executor import KINDS, TAGS
        mesh, data, comm = self.mesh, self.data, self.mesh.pp_comm
        mine = rank_rows(data.val_size, mesh.dp_rank, mesh.dp)
        rows = [data.val_rows(r) for r in held_out_passes(data.val_size, mesh.dp_rank, mesh.dp, chunk)]
        C, me, total = self.schedule.chunks, mesh.pp_rank, 0.0
        last = self.runners.get(C - 1)
        if last is not None:
            last.tie.expect_value()
        outputs: Dict[tuple, np.ndarray] = {}
        for c in self.local:
            runner = self.runners[c]
            runner.sent_value = False
            for k, r in enumerate(rows):
                x = None
                if c > 0:
                    src = self.where[c - 1]
                    if src == me:
                        x = outputs.pop((k, c - 1))
                    else:
                        buf = np.empty((len(r), data.seq_len // mesh.sp, self.model.d_model), self.model.dtype)
                        x = comm.wait(comm.irecv(buf, src, TAGS["F"], KINDS["F"]), "pipeline: held-out activations")
                out = runner.evaluate(r, x)
                if c == C - 1:
                    total += out
                elif self.where[c + 1] == me:
                    outputs[(k, c)] = out.copy()
                else:
                    comm.isend_copy(out, self.where[c + 1], TAGS["F"], KINDS["F"])
        comm.wait_all()
        keep = last is not None and mesh.tp_rank == 0
        tokens = len(mine) * (data.seq_len // mesh.sp)
        summed = self.comm.sum_scalars([total if keep else 0.0, tokens if keep else 0])
        if simulated(self.comm):                      # N copies of this rank's sum: its own tokens' mean instead
            return HeldOut.of(total, tokens if last is not None else 0, data.seq_len // mesh.sp)
        return HeldOut.of(float(summed[0]), float(summed[1]), data.seq_len)

    # ---- the facts of the final metrics (collectives over the mesh) ----------------------------------
    def params_total(self) -> int:
        """Ψ of the whole model: every chunk's parameters once (a TP-split one at its full size)."""
        from ..comm.watchdog import watched
        from ..engine.lazy import Piece
        mesh = self.mesh
        if simulated(self.comm):                  # a simulated rank knows its own stage only: from the rules
            return sum((a.whole if isinstance(a, Piece) else a).size for _, params in self.model.lazy_layers()
                       for a in params.values())
        mine = self._params(self.engines.engines.values(), mesh.tp) + (self.experts.expert_params() if self.experts
                                                                       else 0) if self.leads_stage else 0
        with watched(self.comm, "final metrics: the model's size"):
            return int(sum(self.comm.mpi.allgather(mine)))

    def digest(self):
        """The whole model's sha256 in model order (pipeline/digest.py), on every rank; None when simulated."""
        from ..comm.watchdog import watched
        from ..pipeline.digest import model_digest
        mesh = self.mesh
        if simulated(self.comm):
            return None
        digest = model_digest(self.engines.engines, self.schedule, mesh,
                              self.experts.chunk_params if self.experts else None)
        if mesh.tp > 1 and mesh.pp_rank == 0 and mesh.dp_rank == 0:
            digest = self._tp_joined(digest)
        with watched(self.comm, "final metrics: the model's digest"):
            return self.comm.mpi.bcast(digest, root=0)

    def activations(self):
        """(measured, formula) activation bytes of this rank: the GPT's on its C kernels, else Nones."""
        from ..estimate.activations import gpt_chunks_activation_bytes
        from ..pipeline.timeline import in_flight
        from .models.chunks import pools_peak_bytes
        cfg, m, s = self.cfg, self.model, self.schedule
        if cfg.model != "gpt" or m.layers.name != "c":
            return None, None
        act = pools_peak_bytes([r.pool for r in self.runners.values() if getattr(r, "pool", None) is not None])
        return act, gpt_chunks_activation_bytes(in_flight(s, self.mesh.pp_rank), s.chunks, self.rows, cfg.seq_len,
                                                cfg.d_model, cfg.n_layer, cfg.n_head, m.vocab, s.split_backward,
                                                self.mesh.sp, cfg.checkpoint_activations, np.dtype(m.dtype).itemsize,
                                                self.mesh.tp)

    def tp_theory(self):
        return None                               # not derived per stage yet

    def sp_theory(self) -> int:
        """The SP all-to-all bytes this rank sends per step: the micro-batches through its chunks' blocks."""
        from ..estimate.sp_bytes import all_to_all_bytes
        cfg, mesh = self.cfg, self.mesh
        blocks = len(self.runners) * (cfg.n_layer // self.schedule.chunks)
        return cfg.zero.micro_batches * all_to_all_bytes(blocks, self.rows, cfg.seq_len // mesh.sp,
                                                         cfg.d_model // mesh.tp, mesh.sp,
                                                         recompute=cfg.checkpoint_activations)

    def message_theory(self) -> Dict[str, int]:
        """Bytes this rank sends per step by kind of message, from its schedule and the messages' sizes."""
        from ..pipeline.measure import message_bytes
        gpt = self.cfg.model == "gpt"
        return message_bytes(self.schedule, self.mesh.pp_rank, self.runners, self.tie() if gpt else None,
                             self.model.vocab * self.model.d_model if gpt else 0)

    def pipeline_metrics(self, log) -> dict:
        """The pipeline's entries of the metrics (pipeline/measure.py; None where a simulated rank cannot know)."""
        from ..comm.watchdog import watched
        from ..pipeline import measure, timeline
        cfg, mesh, s, comm = self.cfg, self.mesh, self.schedule, self.comm
        theory = self.message_theory()
        kinds = sorted({k for step in log.pp_bytes for k in step} | set(theory))
        mine = ([log.steady_median([step.get(k, 0) for step in log.pp_bytes]) for k in kinds],   # None: one step
                [theory.get(k, 0) for k in kinds])
        with watched(comm, "final metrics: the messages of each stage"):
            everyone = comm.mpi.allgather(mine)
        firsts = [r for r in range(comm.size) if all(mesh.coords(r)[a] == 0 for a in ("dp", "sp", "tp"))]
        alone = simulated(comm)
        per_stage = lambda j: {k: [everyone[r][j][i] if not alone or st == mesh.pp_rank else None  # noqa: E731
                                   for st, r in enumerate(firsts)] for i, k in enumerate(kinds)}
        mine = {c: e.layout.params_numel + (self.experts.k * self.experts.engines[c].layout.params_numel
                                            if self.experts and c in self.experts.engines else 0)
                for c, e in self.engines.engines.items()} if self.leads_stage else {}
        with watched(comm, "final metrics: each chunk's size"):
            sizes = {c: n for table in comm.mpi.allgather(mine) for c, n in table.items()}
        bubbles = [] if alone else measure.bubble(log.pp_times, mesh, comm)
        replays = [] if alone else measure.replayed(log.pp_times, mesh, comm, s)
        costs = measure.costs(log.pp_times, comm)
        sim = timeline.run(s, lambda a: costs.get((a.kind, a.chunk), 0.0)) if costs and not alone else None
        unit = timeline.run(s)
        return {
            "pipeline": {"pp": mesh.pp, "dp": mesh.dp, "sp": mesh.sp, "tp": mesh.tp, "schedule": s.name,
                         "chunks": s.chunks, "micro_batches": s.micro_batches, "split_backward": s.split_backward,
                         "grad_reduce": cfg.pipeline.grad_reduce, "gather": cfg.pipeline.gather,
                         "stage_of_chunk": [self.where[c] for c in range(s.chunks)],
                         "chunk_params": [sizes.get(c) for c in range(s.chunks)],   # on its ranks (None: not known)
                         "costs_s": {f"{k}{c}": v for (k, c), v in sorted(costs.items())},
                         "bubble_fraction_per_step": bubbles},
            "bubble_fraction": statistics.median(bubbles) if bubbles else None,
            "bubble_fraction_schedule": sim.bubble_fraction if sim is not None else None,
            "bubble_fraction_replayed": statistics.median(replays) if replays else None,
            "bubble_fraction_unit": unit.bubble_fraction, "peak_activations_schedule": unit.peak_activations,
            "pp_bytes_per_step": per_stage(0), "pp_theory_bytes_per_step": per_stage(1)}

    def banner(self) -> list:
        m, s, z = self.mesh, self.schedule, self.cfg.zero
        return [f"zerompi: {self.comm.size} ranks, stage {z.stage}, dtype {z.dtype}, model {self.cfg.model}; "
                f"pipeline: {m.describe()}",
                f"  schedule {s.name}: {s.chunks} model chunks ({s.chunks // m.pp} per stage), {s.micro_batches} "
                f"micro-batches, backward {'split into B and W' if s.split_backward else 'whole'}; gradients reduced "
                f"per {self.cfg.pipeline.grad_reduce}" + (f", stage-3 gathers per {self.cfg.pipeline.gather}"
                                                           if z.stage == 3 else "")]

    def write_trace(self, log):
        """--trace: a collective; rank 0 writes the ranks' timeline (its one line when that failed)."""
        from ..pipeline.trace import write_trace
        k = len(log.pp_msgs)
        return write_trace(self.cfg.zero.trace, self, list(log.pp_times)[-k:] if k else [], list(log.pp_msgs))

    def close(self) -> None:
        self.engines.close()                      # each engine removes its offload files ...
        for e in reversed(list(self.engines)):    # ... and the chunk's folder goes once empty (its experts' first)
            folder = e.config.offload_dir
            if folder is not None and folder != self.cfg.zero.offload_dir:
                try:
                    os.rmdir(folder)
                except OSError:                   # another rank's files still there, or it went first
                    pass

