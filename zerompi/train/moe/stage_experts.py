"""Expert parallelism inside a pipeline's stages (--pp P with --ep K): each stage's experts over its own ranks.

Each stage's data- and sequence-parallel ranks form their EP groups as an unpipelined run's ranks do (K
consecutive ranks of the stage's DP x SP ranks of one TP coordinate: the same sources, rows and exchanges as a
run without --pp of the stage's size), so an EP group and an expert-data-parallel group never leave a stage.
Each model chunk of this rank holding MoE blocks has an expert engine of its own (its EP rank's experts of those
blocks, ZeRO over the stage's expert-data-parallel ranks, the gradients handed in per source:
train/moe/expert_parallel.py), beside the chunk's dense engine. The step is decided once over the ranks of one
EP group index across the stages (pipeline/step.py): every dense engine's totals counted on EP rank 0, every
expert engine's on its own rank; the digest joins each chunk's experts in model order as the unpipelined run's.
Over nodes, shard groups and hpZ the expert engines reduce as an unpipelined run of the stage's ranks does (the
node map of the stage's expert-data-parallel group: expert_parallel.expert_groups), so a stage's experts get the
bits of that run; each chunk's expert engine offloads to a folder of its own, DIR/pp{c}-of-{C}/experts.
Checkpoints and the in-memory replicas: each chunk's expert engine a part of its own beside the chunk's dense one
(with --tp in its TP rank's folder; train/moe/checkpoints.py's StageMoECheckpoints). docs/moe.md.
"""
from types import SimpleNamespace

import numpy as np

from ...comm.subcomm import split
from ...errors import check
from .expert_parallel import engine_configs, expert_group, expert_groups, offload_dir, split_experts, whole_params


def check_world(cfg, world_size: int) -> None:
    """ConfigError unless --ep divides each stage's data-parallel ranks (with --pp; its EP groups stay in a stage)."""
    m, ep = cfg.mesh, cfg.moe.ep
    if m.pp == 1 or ep == 1:
        return
    dp = world_size // (m.tp * m.pp)          # the stage's data- and sequence-parallel ranks of one TP coordinate
    what = "data-parallel" if m.sp == 1 else "data- and sequence-parallel"
    check(dp % ep == 0, f"ep={ep} does not divide the {dp} {what} ranks of each pipeline stage ({world_size} "
                        f"ranks / (pp {m.pp} x tp {m.tp})); each stage's ranks form groups of ep that hold all the "
                        f"experts, so use a divisor of {dp}")


def _color(mesh, rank: int, stage: bool, part) -> int:
    """A split color of world ``rank``: its TP coordinate, its stage (``stage``) and ``part(i)`` of its index i among
    its stage's data- and sequence-parallel ranks of that TP coordinate (i = sp + SP · dp: world order)."""
    c = mesh.coords(rank)
    return c["tp"] + mesh.tp * ((c["pp"] if stage else 0) + mesh.pp * part(c["sp"] + mesh.sp * c["dp"]))


class StageExperts:
    """This rank's part of --ep in a pipelined run: ``ep`` (EPComm of its stage), ``edp`` (its expert-data-parallel
    Communicator), ``engines`` ({model chunk: expert engine}, chunks with MoE blocks only), ``dense_layers``
    ({chunk: its lazy layers without the experts}, for the chunks' dense engines); ``group``: the step's group
    (an object with ``mpi``, ``waiting``, ``ranks``) and ``lead``: whether this rank counts the dense totals.
    ``chunks``: the model's chunks (they name each chunk's offload folder)."""

    def __init__(self, cfg, mesh, comm, model, runners, chunk_config, chunks: int, xp=np):
        from dataclasses import replace
        from ...comm.ep_alltoall import EPComm
        from ...comm.meshconfig import MeshConfig
        from ...engine.zero_engine import ZeroEngine
        from ...pipeline.engines import offload_folder
        from ...pipeline.grads import GradSink
        from .ep_mlp import ExpertStore
        K = self.k = cfg.moe.ep
        group_of, ep_rank = (lambda d: d // K), (lambda d: d % K)
        self.ep = EPComm(split(comm.mpi, lambda r: _color(mesh, r, True, group_of)), comm.waiting)
        self.edp = expert_group(comm, lambda r: _color(mesh, r, True, ep_rank))
        # the step's: this EP group's index over every stage (stage, then EP rank order: world order)
        mine = _color(mesh, comm.rank, False, group_of)
        step_mpi = split(comm.mpi, lambda r: _color(mesh, r, False, group_of))
        self.group = SimpleNamespace(mpi=step_mpi, waiting=comm.waiting, ranks=[
            r for r in range(comm.size) if _color(mesh, r, False, group_of) == mine])
        self.lead = self.ep.rank == 0
        # the nodes and shard groups of the expert engines' group, as an unpipelined run of the stage's ranks has
        node_size, shard_size, per_node = expert_groups(cfg, comm, mesh.dp * mesh.sp * mesh.tp)
        topology = MeshConfig(node_size=node_size, shard_size=shard_size)
        self.engines, self.dense_layers, self.order, where = {}, {}, {}, {}
        per_step = cfg.pipeline.grad_reduce == "step"
        for chunk, runner in sorted(runners.items()):
            layers = runner.lazy_layers()
            self.order[chunk] = [n for _, params in layers for n in params]
            dense, experts, blocks = split_experts(layers, self.ep.rank, K)
            self.dense_layers[chunk] = dense
            if not experts:                   # a chunk of dense blocks only (--moe-every)
                continue
            zc = engine_configs(chunk_config, dense, experts)[1]    # its files beside the chunk's dense engine's
            zc = replace(zc, offload_dir=offload_dir(zc, offload_folder(zc, chunk, chunks)))
            engine = ZeroEngine(experts, zc, self.edp, sources=K, xp=xp, mesh_config=topology,
                                sources_per_node=per_node)
            sink = GradSink(engine, cfg.pipeline.grad_reduce, cfg.zero.micro_batches) if per_step \
                else engine.grads_ready
            self.engines[chunk] = engine
            where.update({b: (engine, i, sink) for i, b in enumerate(blocks)})
        model.use_expert_parallel(self.ep, ExpertStore(where, model.dtype))
        self.dense = {}                       # the chunks' dense engines, set by the job once made

    def counted(self, dense_engines: int):
        """step_together's ``counted`` for this rank's dense engines, then its expert engines."""
        return [self.lead] * dense_engines + [True] * len(self.engines)

    def chunk_params(self, chunk: int):
        """Chunk ``chunk``'s parameters (fp32 master) in model order, every expert whole (a collective over the
        stage's groups): the stream that pipeline/digest.py hashes."""
        engines = [self.dense[chunk]] + ([self.engines[chunk]] if chunk in self.engines else [])
        return whole_params(engines, self.order[chunk], self.ep.mpi)

    def expert_params(self) -> int:
        """Every EP rank's expert parameters of this rank's chunks (K × this rank's)."""
        return self.k * sum(e.layout.params_numel for e in self.engines.values())

    def memory(self, dense=None) -> dict:
        """This rank's model states of its dense and its expert engines, measured and by formula."""
        rows = {}
        for name, engines in (("dense", list(self.dense.values())), ("experts", list(self.engines.values()))):
            reports = [e.memory_report() for e in engines]
            rows[name] = {"measured": sum(r["measured"]["total"] for r in reports),
                          "theory": sum(r["theory"]["total"] for r in reports),
                          "params": sum(e.layout.params_numel for e in engines),
                          "ranks": engines[0].world_size if engines else 0}
        return {"memory_bytes_by_engine": rows}
