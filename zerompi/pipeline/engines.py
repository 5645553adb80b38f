"""The engines of one rank's model chunks, as one: the step over the mesh, checkpoints, closing.

Checkpoints: each chunk's engine writes an ordinary checkpoint of its layers under
``DIR/pp{c}-of-{C}/`` (c the model chunk, C the chunks of the whole model; with tensor parallelism
each TP rank's under ``DIR/pp{c}-of-{C}/tp{r}-of-{K}/``), so a pipelined run resumes at another
data-parallel size (each engine reshards its own checkpoint), and ``python -m zerompi.checkpoint
consolidate DIR`` merges every chunk (and TP piece) into the names and shapes of a run without
pipelining. Before a load every rank of the mesh checks that every chunk finds a checkpoint of the same
step (a save one stage published and another did not would load a model that never existed), and that
the save has this run's chunks; else CheckpointError on every rank, nothing loaded.
"""
import os
from types import SimpleNamespace
from typing import Dict, List

from ..checkpoint.format import PP_FOLDER, CheckpointError, read_manifest, resolve, resume_flags
from ..comm.consistency import rank_set
from ..comm.watchdog import watched
from .step import step_together


def chunk_folder(chunk: int, chunks: int) -> str:
    return f"pp{chunk}-of-{chunks}"


def offload_folder(z, chunk: int, chunks: int):
    """Where chunk ``chunk``'s engine keeps its offload files (nvme): a folder pp{c}-of-{C} of its own under
    offload_dir, made here, so two chunks of one rank never name the same file; else offload_dir."""
    if z.offload_dir is None or "nvme" not in (z.offload_optimizer, z.offload_params):
        return z.offload_dir
    path = os.path.join(z.offload_dir, chunk_folder(chunk, chunks))
    os.makedirs(path, exist_ok=True)
    return path


class PendingSaves:
    """Background saves of several engines, as one (checkpoint/writer.py's PendingSave each)."""

    def __init__(self, pendings):
        self.pendings = pendings

    @property
    def path(self):
        paths = [p.path for p in self.pendings]
        return paths[0] if all(paths) else None

    def wait(self):
        for p in self.pendings:
            p.wait()
        return self.path


class StageEngines:
    """``engines`` ({model chunk: ZeroEngine}) of this rank, of a model cut into ``chunks`` chunks; ``mesh`` the
    zerompi.Mesh (the step's totals go over its pipeline group, a load's agreement over its world)."""

    def __init__(self, engines: Dict[int, object], chunks: int, mesh, experts=None):
        self.engines, self.chunks, self.mesh = dict(sorted(engines.items())), chunks, mesh
        first = next(iter(self.engines.values()))
        self.first = first
        self.group = SimpleNamespace(mpi=mesh.pp_mpi, waiting=first.comm.waiting, ranks=mesh.pp_ranks)
        self.experts = experts        # --ep: train/moe/stage_experts.py's StageExperts (its expert engines, its group)
        for e in self.engines.values():     # one step over the mesh: a non-finite report looks at every chunk
            e.guard.pipeline_engines = self.engines
            e.guard.groups.append(("the pipeline group", self.group))

    def __iter__(self):
        """The chunks' engines, then (--ep) the chunks' expert engines."""
        return iter(list(self.engines.values()) + (list(self.experts.engines.values()) if self.experts else []))

    @property
    def steps_taken(self) -> int:
        return self.first.steps_taken

    @property
    def step_count(self) -> int:
        return self.first.step_count

    @property
    def loss_scale(self) -> float:
        return self.first.loss_scale

    def step(self, lr=None):
        """Every chunk's step, decided once over the mesh (pipeline/step.py); returns the first's StepResult. With
        --ep, the expert engines' too, over the stages' ranks of this rank's EP group index instead (the dense
        totals counted on EP rank 0 of each stage)."""
        if self.experts:
            return step_together(list(self), self.experts.group, lr, self.experts.counted(len(self.engines)))[0]
        return step_together(list(self.engines.values()), self.group, lr)[0]

    # ---- checkpoints -----------------------------------------------------------------------------
    def folder(self, path: str, chunk: int) -> str:
        return os.path.join(path, chunk_folder(chunk, self.chunks))

    def save(self, path: str, extra_state=None, blocking: bool = True, keep_last=None):
        """Each chunk's engine saves under ``path``/pp{c}-of-{C} (collectives over each chunk's ranks, in chunk
        order). Returns the first chunk's new checkpoint directory, or a PendingSaves."""
        done = [e.save(self.folder(path, c), extra_state, blocking, keep_last) for c, e in self.engines.items()]
        return done[0] if blocking else PendingSaves(done)

    def load(self, path: str):
        """Load every chunk's latest (or the step_NNNNNN each names) under ``path``, after the whole mesh
        agreed that they are of one step and this run's chunks (CheckpointError on every rank otherwise)."""
        mine = {}
        problem = None
        for c, e in self.engines.items():
            folder = e.tp.path(self.folder(path, c)) if e.tp else self.folder(path, c)
            try:
                mine[c] = read_manifest(resolve(folder))[0]["step"]
            except (CheckpointError, OSError, KeyError, TypeError) as e:
                problem = str(e)
        self.agree_loadable(path, mine, problem)
        infos = [e.load(self.folder(path, c)) for c, e in self.engines.items()]
        return infos[0]

    def agree_loadable(self, path: str, mine: Dict[int, int], problem) -> None:
        """Before a load from ``path``: the whole mesh's steps of its chunks (``mine``: this rank's, {chunk: step})
        and problems (``problem``: this rank's line, or None) gathered and checked: CheckpointError on every rank
        unless every chunk is of one step and the folder holds this run's chunks (a collective)."""
        saved = sorted(n for n in os.listdir(path) if PP_FOLDER.fullmatch(n)) if os.path.isdir(path) else []
        world = SimpleNamespace(mpi=self.mesh.world, waiting=self.first.comm.waiting)
        with watched(world, "pipeline load: agreement on the checkpoint"):
            everyone = self.mesh.world.allgather((mine, problem))
        _check_loadable(path, everyone, saved, self.chunks)

    def close(self) -> None:
        for e in self:
            e.close()


def _check_loadable(path: str, everyone, saved: List[str], chunks: int) -> None:
    """CheckpointError (the same on every rank: every rank sees the same table) unless every chunk of every
    rank found a checkpoint, all of one step."""
    wanted = [chunk_folder(c, chunks) for c in range(chunks)]
    flags = resume_flags(path)         # what it was saved with, from its manifest ('' when nothing there is whole)
    if saved and sorted(saved) != sorted(wanted):
        raise CheckpointError(f"{path}: saved as {len(saved)} pipeline chunks ({saved[0]}, ...), this run has "
                              f"{chunks} ({wanted[0]}, ...); resume it with the mesh it was saved with "
                              f"({flags or '--pp and --chunks'}), or consolidate it")
    if not saved and flags:            # a save without --pp: its checkpoints are not cut into chunks
        raise CheckpointError(f"{path}: not a pipeline save (no pp0-of-{chunks}, ...): it was saved without --pp; "
                              f"resume it with the mesh it was saved with ({flags}), or consolidate it")
    bad = [(r, p) for r, (_, p) in enumerate(everyone) if p]
    if bad:
        raise CheckpointError(f"{path}: {rank_set([r for r, _ in bad])} found no checkpoint to load: {bad[0][1]}")
    steps: Dict[int, List[str]] = {}
    for r, (mine, _) in enumerate(everyone):
        for c, step in mine.items():
            steps.setdefault(step, []).append(chunk_folder(c, chunks))
    if len(steps) > 1:
        raise CheckpointError(f"{path}: the pipeline chunks would restore different steps: " + ", ".join(
            f"step {s} in {', '.join(sorted(set(fs)))}" for s, fs in sorted(steps.items()))
            + "; load a step that every chunk saved (DIR/pp{c}-of-{C}/step_NNNNNN)")
