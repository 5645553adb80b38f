"""The checkpoints of an MoE run: the experts resharded to the resuming run's ``--ep``, the selection biases kept.

With ``--ep K`` the dense engine saves in ``DIR`` as a run without EP does, and the expert engine of EP rank j
(experts j·E/K .. (j+1)·E/K - 1, ZeRO over its expert-data-parallel ranks) in ``DIR/ep{j}-of-{K}``: each an
ordinary checkpoint. With ``--tp T`` the experts are whole on every TP rank (replicated), and each TP rank's
expert engine (ZeRO over the expert-data-parallel ranks of its TP coordinate) saves beside its dense
checkpoint, in ``DIR/tp{r}-of-{T}/ep{j}-of-{K}``: T copies of the same bits, each read back by its own TP rank.
An expert parameter's rows are expert-major, so the experts of the resuming run's EP rank
are one contiguous range of the whole tensor, cut over the saved EP ranks' parts: checkpoint/part_load.py
copies each piece through its part's saved layout (any world size, stage, ``--ep``, 1 included). ``python -m
zerompi.checkpoint consolidate DIR`` joins the parts into the names and shapes of an ``--ep 1`` run.
``--bias-update``'s per-block biases (the same on every rank) go once into the dense manifest's extra.

A pipelined run (``--pp``, :class:`StageMoECheckpoints`) does the same per model chunk: the chunk's dense engine
in ``DIR/pp{c}-of-{C}`` as without EP, its expert engine (``--ep K``) in ``DIR/pp{c}-of-{C}/ep{j}-of-{K}``, the
biases in every chunk's dense manifest; any ``--ep`` dividing the stage's ranks resumes it (1 included). With
``--tp`` each TP rank's in ``DIR/pp{c}-of-{C}/tp{r}-of-{T}`` and ``DIR/pp{c}-of-{C}/tp{r}-of-{T}/ep{j}-of-{K}``.
The in-memory replicas keep the same folders (``parts``), their manifests the same ``moe`` extra.
"""
import os

import numpy as np

from ...checkpoint.format import CheckpointError, read_manifest, resolve
from ...checkpoint.parts import ep_parts
from .expert_parallel import short_name
from .mlp import EXPERT_KEYS


def ep_folder(rank: int, size: int) -> str:
    return f"ep{rank}-of-{size}"


def dense_folder(engine, folder: str) -> str:
    """Where ``engine`` (a dense engine) saves under ``folder``: with --tp its TP rank's ``tp{r}-of-{T}``."""
    return engine.tp.path(folder) if engine.tp else folder


def expert_folder(engine, folder: str, rank: int, size: int) -> str:
    """Where EP rank ``rank`` of ``size``'s expert engine saves, beside the dense engine ``engine``'s checkpoint
    under ``folder`` (with --tp in its TP rank's folder: each TP rank's copy of the experts)."""
    return os.path.join(dense_folder(engine, folder), ep_folder(rank, size))


class MoECheckpoints:
    """What saves and loads an MoE job's checkpoints (``job.checkpoints``): its engines and biases as one."""

    def __init__(self, job):
        self.job, self.cfg = job, job.cfg
        self.engine, self.ep = job.engine, job.ep

    @property
    def steps_taken(self) -> int:
        return self.engine.steps_taken

    def saved_engines(self):
        """(engine, how many such parts one checkpoint holds): the dense engine's, every EP rank's experts."""
        return [(self.engine, 1)] + ([(self.ep.engine, self.ep.k)] if self.ep else [])

    def parts(self):
        """[(part folder, engine)] of this rank: the dense engine's ('': the save folder itself), this EP rank's
        experts' (``ep{j}-of-{K}``; with --tp ``tp{r}-of-{T}`` and ``tp{r}-of-{T}/ep{j}-of-{K}``): the folders its disk
        checkpoint has, what the in-memory replicas keep (train/replicas.py)."""
        return [(dense_folder(self.engine, ""), self.engine)] + (
            [(expert_folder(self.engine, "", self.ep.ep.rank, self.ep.k), self.ep.engine)] if self.ep else [])


    def manifest_extra(self, extra_state=None) -> dict:
        """``extra_state`` and the run's ``moe``: experts, --ep (where the parts are) and the selection biases."""
        return moe_extra(self.job, extra_state)

    def save(self, path: str, extra_state=None, blocking: bool = True, keep_last=None):
        """Each EP rank's experts in ``path``/ep{j}-of-{K}, then the dense engine's checkpoint in ``path`` (a
        blocking save moves ``path``/latest only once every part is published); returns the dense one's
        directory, or a PendingSaves (in the background the parts and the dense one publish independently:
        a job that dies meanwhile can leave ``latest`` naming a step a part lacks, refused in one line at a
        resume, whose step before is whole)."""
        extra = self.manifest_extra(extra_state)
        part = self.ep.engine.save(expert_folder(self.engine, path, self.ep.ep.rank, self.ep.k), extra, blocking,
                                   keep_last) if self.ep else None
        dense = self.engine.save(path, extra, blocking, keep_last)    # last: DIR/latest moves once the parts are in
        if blocking:
            return dense
        from ...pipeline.engines import PendingSaves
        return PendingSaves([dense] + ([part] if part else []))

    def load(self, path: str):
        """Every engine from ``path`` (a save folder or one of its step_NNNNNN: the dense checkpoint, its EP
        parts those of the same name), whatever --ep saved it; the biases restored with --bias-update. With --tp
        ``path`` is the save folder (each TP rank's ``tp{r}-of-{T}`` in it), after the world agreed that every TP
        rank's checkpoint and parts are of one step."""
        tp = self.engine.tp
        dense, parts = _parts(path) if tp is None else _agreed_tp(tp, path, self.engine.comm.waiting)
        E = self.cfg.moe.experts
        info = None
        for engine, rank, size in [(self.engine, 0, 1)] + ([(self.ep.engine, self.ep.ep.rank, self.ep.k)]
                                                           if self.ep else []):
            if not parts and not self.ep:
                got = engine.load(dense if tp is None else path)     # an --ep 1 save into an --ep 1 run: as a GPT's
            else:
                got = _load(engine, dense, parts, E, rank, size)
            info = info or got
        restore_bias(self.job, info)
        return info


def moe_extra(job, extra_state=None) -> dict:
    """``extra_state`` and the run's ``moe``: experts, --ep (where the parts are) and the selection biases."""
    extra = dict(extra_state or {})
    mlp = job.model.moe_blocks.mlp
    extra["moe"] = {"experts": job.cfg.moe.experts, "ep": job.cfg.moe.ep,
                    "bias": {str(b): v.tolist() for b, v in sorted(mlp.bias.items())}}
    return extra


def restore_bias(job, info) -> None:
    """With --bias-update, the selection biases of the loaded checkpoint ``info`` (its manifest's extra)."""
    bias = info.manifest["extra"].get("moe", {}).get("bias", {})
    if job.cfg.moe.bias_update > 0:
        mlp = job.model.moe_blocks.mlp
        mlp.bias.clear()
        mlp.bias.update({int(b): np.array(v, np.float64) for b, v in bias.items()})


class StageMoECheckpoints:
    """A pipelined MoE job's checkpoints (``job.checkpoints`` with --pp): per model chunk, the dense engine's in
    ``DIR/pp{c}-of-{C}`` (pipeline/engines.py's layout) and, with --ep K, the chunk's expert engine's in
    ``DIR/pp{c}-of-{C}/ep{j}-of-{K}`` beside it; a resume reshards each chunk's experts to this run's --ep."""

    def __init__(self, job):
        self.job, self.cfg = job, job.cfg
        self.stages, self.experts = job.engines, job.experts

    @property
    def steps_taken(self) -> int:
        return self.stages.steps_taken

    def _expert_engine(self, chunk: int):
        return self.experts.engines.get(chunk) if self.experts else None

    def parts(self):
        """[(part folder, engine)] of this rank, the folders of its disk checkpoint: per chunk ``pp{c}-of-{C}``
        (``pp{c}-of-{C}/tp{r}-of-{T}``) and its expert engine's ``.../ep{j}-of-{K}``; what the in-memory replicas
        keep (train/replicas.py)."""
        out = []
        for c, engine in self.stages.engines.items():
            folder = self.stages.folder("", c)
            out.append((dense_folder(engine, folder), engine))
            x = self._expert_engine(c)
            if x is not None:
                out.append((expert_folder(engine, folder, self.experts.ep.rank, self.experts.k), x))
        return out

    def manifest_extra(self, extra_state=None) -> dict:
        """``extra_state`` and the run's ``moe`` (experts, --ep, the selection biases), as a save's manifests."""
        return moe_extra(self.job, extra_state)

    def save(self, path: str, extra_state=None, blocking: bool = True, keep_last=None):
        """Each chunk (in chunk order): its expert engine's part, then its dense engine's checkpoint (its
        ``latest`` moves once the chunk's parts are in). Returns the first chunk's dense checkpoint directory,
        or a PendingSaves."""
        from ...pipeline.engines import PendingSaves
        extra = self.manifest_extra(extra_state)
        done, dense = [], []
        for c, engine in self.stages.engines.items():
            folder = self.stages.folder(path, c)
            x = self._expert_engine(c)
            if x is not None:
                done.append(x.save(expert_folder(engine, folder, self.experts.ep.rank, self.experts.k), extra,
                                   blocking, keep_last))
            dense.append(engine.save(folder, extra, blocking, keep_last))
        return dense[0] if blocking else PendingSaves(dense + done)

    def load(self, path: str):
        """Every chunk's engines from ``path`` (a save folder: each chunk's latest), after the whole mesh agreed
        that every chunk's checkpoint and EP parts are of one step (CheckpointError on every rank otherwise)."""
        stages = self.stages
        mine, problem, found = {}, None, {}
        for c, engine in stages.engines.items():
            try:
                dense, parts, mine[c] = _found(dense_folder(engine, stages.folder(path, c)))
                found[c] = (dense, parts)
            except (CheckpointError, OSError, KeyError, TypeError) as e:
                problem = str(e)
        stages.agree_loadable(path, mine, problem)
        E, infos = self.cfg.moe.experts, []
        for c, engine in stages.engines.items():
            dense, parts = found[c]
            infos.append(_load(engine, dense, parts, E, 0, 1) if parts or self.experts
                         else engine.load(stages.folder(path, c)))         # as without MoE
            x = self._expert_engine(c)
            if x is not None:
                _load(x, dense, parts, E, self.experts.ep.rank, self.experts.k)
        restore_bias(self.job, infos[0])
        return infos[0]


def _found(folder: str):
    """(the dense checkpoint, its EP parts, their one step) of a dense engine's save ``folder``; CheckpointError when
    the parts are of different steps."""
    dense, parts = _parts(folder)
    steps = {read_manifest(p)[0]["step"] for p in [dense] + parts}
    if len(steps) > 1:
        raise CheckpointError(f"{dense}: its EP parts are of different steps ({sorted(steps)}); "
                              "resume a step that every part saved")
    return dense, parts, steps.pop()


def _agreed_tp(tp, path: str, waiting):
    """Unpipelined --tp: this TP rank's (dense checkpoint, EP parts) under ``path``, after every rank of the run
    found its own of one step (one all-gather; CheckpointError on every rank alike otherwise)."""
    from types import SimpleNamespace

    from ...comm.watchdog import watched
    got = problem = None
    try:
        dense, parts, step = _found(tp.load_path(path))
        got = (dense, parts)
    except (CheckpointError, OSError, KeyError, TypeError) as e:
        problem, step = str(e), None
    mpi = tp.mesh.stage_mpi
    with watched(SimpleNamespace(waiting=waiting), "MoE load: agreement on the TP ranks' checkpoints"):
        everyone = mpi.allgather((step, problem))
    bad = next((p for _, p in everyone if p), None)
    if bad:
        raise CheckpointError(bad)
    steps = sorted({s for s, _ in everyone})
    if len(steps) > 1:
        raise CheckpointError(f"{path}: the tensor-parallel ranks' checkpoints are of different steps ({steps}); "
                              "resume a step that every TP rank and EP part saved")
    return got


def _parts(path: str):
    """(the dense checkpoint, its EP parts' checkpoints of the same name ([] for an --ep 1 save))."""
    dense = resolve(path)
    return dense, [resolve(p) for p in ep_parts(dense, read_manifest(dense)[0])]


def _load(engine, dense: str, parts, experts: int, rank: int, size: int):
    """``engine`` (EP rank ``rank`` of ``size``; the dense engine: 0 of 1) from the dense checkpoint and the
    saved EP parts (none: the experts whole in ``dense``)."""
    from ...checkpoint.part_load import load_parts
    ckpts = [dense] + parts
    saved_k = max(len(parts), 1)
    if experts % saved_k:
        raise CheckpointError(f"{dense}: saved with --ep {saved_k}, which does not divide this run's --experts "
                              f"{experts}; use the model it was saved with")

    def sources(name, shape):
        numel = int(np.prod(shape))
        if short_name(name) not in EXPERT_KEYS:
            return [(0, name, 0, numel, 0)]
        per_expert = numel // (shape[0] or 1)
        base = rank * numel                          # this EP rank's first element of the whole tensor
        chunk = experts // saved_k * per_expert      # one saved part's elements
        segs = []
        for p in range(saved_k):
            a, z = max(base, p * chunk), min(base + numel, (p + 1) * chunk)
            if a < z:
                segs.append((p + 1 if parts else 0, name, a - base, z - base, a - p * chunk))
        return segs
    own = os.path.join(os.path.dirname(dense), ep_folder(rank, size)) if size > 1 else None   # where it saves
    return load_parts(engine, ckpts, sources, own)
