"""The train job's expert parallelism (--ep K): the EP and expert-data-parallel groups, the expert engine, the
step over both engines, the model's digest and size.

The ranks form N/K EP groups of K consecutive ranks; EP rank j holds experts j·E/K .. (j+1)·E/K - 1 of every MoE
block. Two engines per rank: the dense one (every parameter but the experts', ZeRO over all N ranks) and the
expert one (this rank's experts, ZeRO over the expert-data-parallel group: the N/K ranks holding the same
experts, its gradients handed in per source rank: engine/reducer.py's ``sources``). They step together as a
pipeline's engines do (pipeline/step.py): one gradient norm over the whole model, every expert counted once,
one non-finite flag, one loss scale. docs/moe.md.
"""
import hashlib
import os
from dataclasses import replace
from fnmatch import fnmatchcase

import numpy as np

from ...comm.subcomm import split
from ...engine import lazy
from ...engine.matrix_owners import matrix_names, muon_names
from .mlp import EXPERT_KEYS


def short_name(name: str) -> str:
    """``block3.experts.fc.w`` -> ``experts.fc.w``."""
    return name.split(".", 1)[1] if name.startswith("block") else name


def split_experts(layers, ep_rank: int, K: int):
    """(dense layers, expert layers, MoE blocks) of engine layers ``layers``: every layer kept with its parameters
    but the experts' (the dense engine's); a layer ``{name}.experts`` of EP rank ``ep_rank``'s E/K experts of each
    MoE block (the expert engine's); the blocks' numbers, in that engine's layer order."""
    dense, experts, blocks = [], [], []
    for lname, params in layers:
        mine = {n: lazy.Piece(a, 0, 1, ep_rank, K) for n, a in params.items() if short_name(n) in EXPERT_KEYS}
        dense.append((lname, {n: a for n, a in params.items() if n not in mine}))
        if mine:
            experts.append((lname + ".experts", mine))
            blocks.append(int(lname[len("block"):]))
    return dense, experts, blocks


def engine_configs(zero, dense, experts):
    """(the dense engine's, the expert engine's) ZeroConfig of ``zero``: each with the --no-decay patterns that
    match its parameters (a pattern matching neither: the dense engine's, whose check names it), and with
    --optimizer muon the --muon-params patterns that match its matrices (the whole model's are checked by
    :func:`check_muon_params`)."""
    dense_names = [n for _, p in dense for n in p]
    expert_names = [n for _, p in experts for n in p]
    matches = lambda pat, names: any(fnmatchcase(n, pat) for n in names)   # noqa: E731
    muon = lambda layers: {} if zero.optimizer != "muon" else {                # noqa: E731
        "muon_params": tuple(p for p in zero.muon_params if matches(p, matrix_names(layers, zero.muon_stacked)))}
    return (replace(zero, no_decay=tuple(p for p in zero.no_decay if matches(p, dense_names)
                                         or not matches(p, expert_names)), **muon(dense)),
            replace(zero, no_decay=tuple(p for p in zero.no_decay if matches(p, expert_names)), **muon(experts)))


def check_muon_params(zero, layers) -> None:
    """With --optimizer muon, AgreedConfigError (one line) where a --muon-params pattern matches no parameter of
    the whole model ``layers`` or the patterns no matrix (as one engine holding them all checks them)."""
    if zero.optimizer == "muon":
        muon_names({n: np.shape(a) for _, p in layers for n, a in p.items()}, zero.muon_params, zero.muon_stacked)


def whole_params(engines, order, ep_mpi):
    """The fp32 master parameters of ``engines`` (a dense and an expert engine, or either) as little-endian arrays
    in ``order`` (parameter names), every expert parameter whole: the EP group's pieces (``ep_mpi``) joined in
    EP rank order, the bytes an --ep 1 run holds. Collectives over each engine's group and the EP group."""
    values = {}
    for engine in engines:
        lay = engine.layout
        engine.synchronize()
        for bucket, data in engine.optimizer.gather_buckets(engine.group, engine.steps_taken):
            for layer in bucket.layers:
                for name in lay.layer_params[layer]:
                    pr = lay.params[name]
                    values[name] = np.ascontiguousarray(data[pr.bucket_offset:pr.bucket_offset + pr.numel], "<f4")
    for name in order:
        if short_name(name) in EXPERT_KEYS:       # every EP rank's experts, in EP rank order
            yield np.frombuffer(b"".join(ep_mpi.allgather(values[name].tobytes())), "<f4")
        else:
            yield values[name]


def trace_path(path, j: int, k: int):
    """The expert engine's timeline beside the dense engine's (one per EP rank: its expert-data-parallel group's
    rank 0 writes it): ``trace.json`` -> ``trace.ep1-of-2.json``; None without --trace."""
    if path is None:
        return None
    root, ext = os.path.splitext(path)
    return f"{root}.ep{j}-of-{k}{ext or '.json'}"


def offload_dir(z, folder=None):
    """The expert engine's offload files (nvme) in a folder of their own, ``experts`` under ``folder`` (its dense
    engine's: DIR, or a pipeline chunk's DIR/pp{c}-of-{C}; made here): each engine names its files by its rank in
    its own group, so the dense and the expert engine's would meet in one folder."""
    if z.offload_dir is None or "nvme" not in (z.offload_optimizer, z.offload_params):
        return z.offload_dir
    path = os.path.join(folder or z.offload_dir, "experts")
    os.makedirs(path, exist_ok=True)
    return path


def expert_groups(cfg, comm, stage=None):
    """(node_size, shard_size, per_node) of the expert engine's group (estimate/moe_bytes.expert_topology), from
    the world's nodes (--node-size, $ZEROMPI_NODE_SIZE or MPI's; a collective) and --shard-size, in data-parallel
    ranks; ``stage``: the world ranks of one pipeline stage (its EP groups are of its data-parallel ranks, a node
    inside it or holding whole stages: comm/mesh.py), None without --pp. AgreedConfigError (one line, printed
    once) where the EP groups cut a node or a shard group, or the ranks are not placed in blocks per node."""
    from ...comm.topology import placement_from
    from ...errors import AgreedConfigError
    from ...estimate.moe_bytes import expert_topology
    K, T = cfg.moe.ep, cfg.mesh.tp
    ranks = stage or comm.size
    p, order = placement_from(comm.mpi, cfg.mesh.node_size)
    if order is not None:
        raise AgreedConfigError(f"--ep {K}: the ranks are not placed in blocks per node; place them in blocks "
                                "(mpiexec's block mapping)")
    shard = cfg.mesh.shard_size
    return expert_topology(ranks // T, K, max(min(p, ranks) // T, 1), shard // T if shard else None)


def expert_group(comm, color):
    """The expert engine's Communicator over the ranks of ``color(rank)``'s value (its bytes counted with the
    world's: the run's one traffic table). On a GPU the engine stages it for its device arrays (ZeroEngine: MPI's
    even under --comm nccl, since the reduce of sources runs on the host, comm/sources_reduce.py)."""
    from ...comm.communicator import Communicator
    return Communicator(split(comm.mpi, color), share=comm)


class ExpertParallel:
    """This rank's part of --ep: ``ep`` (EPComm), ``edp`` (Communicator), ``engine`` (the expert engine);
    ``dense_layers``: the model's lazy layers without the experts, for the dense engine. With --tp each TP rank
    holds its EP rank's experts whole and makes the same exchanges in its own EP group (one tp_i)."""

    def __init__(self, cfg, comm, model, layers, xp=np):
        from ...comm.meshconfig import MeshConfig
        from ...comm.ep_alltoall import EPComm
        from ...engine.zero_engine import ZeroEngine
        from .ep_mlp import ExpertStore
        K, T = cfg.moe.ep, cfg.mesh.tp
        self.k = K
        # with --tp T (world rank = tp_i + T dp_i): EP groups of K consecutive data-parallel ranks of one tp_i
        self.ep = EPComm(split(comm.mpi, lambda r: r % T + T * (r // T // K)), comm.waiting)
        self.edp = expert_group(comm, lambda r: r % T + T * (r // T % K))     # the expert engine's group
        self.order = [n for _, params in layers for n in params]           # the whole model's, in model order
        check_muon_params(cfg.zero, layers)
        self.dense_layers, experts, blocks = split_experts(layers, self.ep.rank, K)
        self.dense_config, expert_config = engine_configs(cfg.zero, self.dense_layers, experts)
        node_size, shard_size, per_node = expert_groups(cfg, comm)
        expert_config = replace(expert_config, trace=trace_path(cfg.zero.trace, self.ep.rank, K),
                                offload_dir=offload_dir(cfg.zero))
        self.engine = ZeroEngine(experts, expert_config, self.edp, sources=K, xp=xp,
                                 mesh_config=MeshConfig(node_size=node_size, shard_size=shard_size),
                                 sources_per_node=per_node)
        model.use_expert_parallel(self.ep, ExpertStore({b: (self.engine, i) for i, b in enumerate(blocks)},
                                                       model.dtype))

    def step(self, dense):
        """Both engines' step, decided together (a collective over the EP group); the dense engine's result."""
        from ...pipeline.step import step_together
        return step_together([dense, self.engine], self.ep, counted=[self.ep.rank == 0, True])[0]

    def params_total(self, dense, dense_total=None) -> int:
        """Ψ of the whole model: the dense engine's (``dense_total``: given whole, under TP) and every EP rank's
        experts."""
        return (dense.layout.params_numel if dense_total is None else dense_total) \
            + self.k * self.engine.layout.params_numel

    def digest(self, dense) -> str:
        """sha256 of the whole model's fp32 master parameters in model order, every expert whole (the bytes an
        --ep 1 run hashes); collectives over both engines' groups and the EP group. Holds the model at once."""
        digest = hashlib.sha256()
        for data in whole_params([dense, self.engine], self.order, self.ep.mpi):
            digest.update(data.data)
        return digest.hexdigest()

    def memory(self, dense) -> dict:
        """This rank's model states of the dense and the expert engine, measured and by formula (the dense over
        its N ranks, the experts over their N/K expert-data-parallel ranks)."""
        rows = {}
        for name, engine in (("dense", dense), ("experts", self.engine)):
            r = engine.memory_report()
            rows[name] = {"measured": r["measured"]["total"], "theory": r["theory"]["total"],
                          "params": engine.layout.params_numel, "ranks": engine.world_size}
        return {"memory_bytes_by_engine": rows}

    def close(self) -> None:
        self.engine.close()
