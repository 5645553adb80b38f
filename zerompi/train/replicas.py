"""The train CLI's ``--replicas JOB``: every step's state in memory on two nodes, and the records of a recovery.

:class:`ReplicaRun` (every rank): at the start, rank 0 removes what an earlier run of the same job left in its
folder (never the restore folder being resumed from); each rank registers its pid, host and node
(``JOB/ranks/``, which the supervisor watches); after every step the state is committed twice
(checkpoint/replicas.py) and the rank's step recorded; at the end the rank folders go. After a relaunch
(``JOB/failures.json``, written by ``python -m zerompi.run``) rank 0 completes the failure's record once the
first step after the restore is done: relaunch (failure detected -> ranks up) and restore (ranks up -> that
step done) seconds. The records are the metrics' ``failures`` (one schema: train/report.py).
"""
import json
import os
import shutil
import socket
import statistics
import time
from typing import List, Optional, Tuple

from ..checkpoint.replica_files import HEADER_BYTES, JOB_NAME, RANKS, RESTORE, clean, job_dir
from ..errors import check

FAILURES = "failures.json"     # the supervisor's records of this job's failures, completed by the job
RECORD_KEYS = ("rank", "host", "started", "failed_step", "restored_step", "steps_lost", "detect_s", "relaunch_s",
               "restore_s", "recovery_s")   # one failure, as the metrics' ``failures`` list holds it (``started``:
                                            # false for a launcher that failed before any rank ran)
HISTORY = 1000                 # commit times kept
COMMITS = ("sync", "behind")   # --replicas-commit: agreed before the next step, or finished after it
STEPS_LOST = {"sync": 1, "behind": 2}   # the most steps a failure loses: the one in flight (and, behind, the one
                               # before it, whose commit may not be finished)
UP = time.time()               # first imported at the flags' parse, MPI started: after a relaunch, its end


def replica_bytes(shard_numel: int, rows: int = 3) -> dict:
    """The formula of one rank's replica memory (shared memory, host), a slice of S = shard_numel elements
    (S = Ψ/N padded) and ``rows`` float32 rows (the master and the optimizer's state: AdamW 3): per step two
    shard files (its own and its source's copy), 4 rows S bytes and a header each; two steps held (the
    committed one and the spare the next overwrites). No host buffer besides."""
    files = 2 * (4 * rows * shard_numel + HEADER_BYTES)
    return {"per_step": files, "total": 2 * files, "rows": rows}


def summary_line(entry: dict) -> str:
    """The memory table's row of the replicas (rank 0's metrics ``replicas`` entry)."""
    t = entry["theory_bytes"]
    behind = ", finished behind the next step: at most 2 steps lost" if entry.get("commit") == "behind" else ""
    commit = "" if entry["commit_s"] is None else f"; a commit takes {entry['commit_s'] * 1e3:.1f} ms (median{behind})"
    files = t.get("files", 2)
    return (f"  replicas (shared memory, {entry['job']}): {entry['shm_bytes']:,} bytes per rank, "
            f"{entry['shard_bytes']:,} of them in shard files, formula {t['total']:,} = 2 steps x {files} file"
            f"{'s' if files > 1 else ''} x ({4 * t['rows']} S + {HEADER_BYTES}){', S each part' if files > 2 else ''}"
            f"; the rest the manifest{'s' if files > 2 else ''}{commit}")


def job_parts(job) -> List[Tuple[str, object]]:
    """[(part folder, engine)] of this rank: the folders its engines' disk checkpoints have ('' for none; a
    tensor-parallel rank's ``tp{r}-of-{K}``, a pipeline chunk's ``pp{c}-of-{C}``, ``pp{c}-of-{C}/tp{r}-of-{K}``, an
    expert-parallel rank's experts ``ep{j}-of-{K}`` beside each of those)."""
    if job.cfg.moe.on:          # an MoE run's (train/moe/checkpoints.py): each dense engine's, with --ep its experts'
        return job.checkpoints.parts()
    if job.pipelined:
        from ..pipeline.engines import chunk_folder
        pairs = [(chunk_folder(c, job.engines.chunks), e) for c, e in job.engines.engines.items()]
    else:
        pairs = [("", job.engine)]
    return [(e.tp.path(part) if e.tp else part, e) for part, e in pairs]


def ring(job, comm) -> Tuple[object, int, List[int]]:
    """(communicator, this rank, every rank's node) the replicas go round: a plain run's engine's (its ranks
    as placed in nodes), else the world's with the mesh's nodes."""
    if job.mesh is None:
        e = job.engine
        return e.comm, e.rank, [e.topology.node_of(r) for r in range(e.world_size)]
    return comm, comm.mpi.Get_rank(), [job.mesh.node_of(r) for r in range(comm.size)]


def _folder_bytes(folder: str) -> Tuple[int, int]:
    """(bytes of every file in ``folder``, of its shard files alone: what replica_bytes' formula counts)."""
    sizes = [(f, os.path.getsize(os.path.join(d, f))) for d, _, names in os.walk(folder) for f in names]
    return sum(b for _, b in sizes), sum(b for f, b in sizes if f.startswith("shard_"))


def check_config(cfg) -> None:
    """ConfigError (one line) unless the job name is a folder name and the run is one --replicas supports."""
    check(isinstance(cfg.replicas, str) and JOB_NAME.fullmatch(cfg.replicas) is not None,
          f"replicas={cfg.replicas!r} is not a job name; use 1 to 64 letters, digits, '_', '-' or '.'")
    check(cfg.simulate_world is None, f"replicas={cfg.replicas!r} needs a real job; drop --simulate-world")


def check_nodes(cfg, world: int, node_size: int) -> None:
    nodes = world // node_size
    check(nodes >= 2, f"replicas={cfg.replicas!r} keeps each shard's second copy on another node, and {world} ranks "
                      f"in nodes of {node_size} make {nodes} node: use 2 nodes or more (--node-size K makes nodes "
                      f"of K ranks on one host)")


def continues_job(cfg) -> bool:
    """The run resumes from its own job's replicas (a relaunch by zerompi.run): it continues the run whose
    checkpoints its --save-dir holds."""
    if not (cfg.replicas and cfg.resume):
        return False
    return os.path.realpath(cfg.resume).startswith(os.path.realpath(job_dir(cfg.replicas)) + os.sep)


def read_failures(job: str) -> List[dict]:
    try:
        with open(os.path.join(job_dir(job), FAILURES)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def write_failures(job: str, records: List[dict]) -> None:
    """Atomically (a reader never sees half a file)."""
    path = os.path.join(job_dir(job), FAILURES)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(records, f)
    os.replace(path + ".tmp", path)


def public(records: List[dict]) -> List[dict]:
    """The records as the metrics hold them (RECORD_KEYS; the supervisor's clock readings left out)."""
    return [{k: r.get(k) for k in RECORD_KEYS} for r in records]


class ReplicaRun:
    """``--replicas JOB`` of a job (every rank: a SingleJob's engine, a PipelineJob's chunks, each a part);
    ``after_step`` after each step, ``close`` at the end."""

    def __init__(self, cfg, job, comm):
        from ..checkpoint.replicas import Replicas
        from ..checkpoint.replica_files import rank_dir
        self.name, self.mpi = cfg.replicas, comm.mpi
        if self.mpi.Get_rank() == 0:                 # a stale run of this job: its folders, not the restore
            clean(self.name, keep=cfg.resume, whole=False)
        self.mpi.Barrier()
        self.parts = job_parts(job)
        self.extra = getattr(job.checkpoints, "manifest_extra", dict)   # an MoE run's: its biases and --ep
        ring_comm, self.rank, self.nodes = ring(job, comm)
        self.commit = cfg.replicas_commit            # sync: agreed before the next step; behind: after it
        self.replicas = Replicas(self.parts, self.name, ring_comm, self.rank, self.nodes,
                                 rank_dir(self.name, self.nodes[self.rank], self.rank), behind=self.commit == "behind")
        self.pending: List[dict] = []                # the failures this run recovers from (rank 0): the last, and
        if self.mpi.Get_rank() == 0:                 # those whose relaunch never started a rank
            self.pending = [r for r in read_failures(self.name) if r.get("restore_s") is None]
        self.restored = continues_job(cfg)          # resumed from JOB/restore, a copy of a whole step
        self.seconds: List[float] = []                # each commit's, the last HISTORY
        self.shm_bytes = 0                            # the most this rank's folder held after a commit
        self.shard_bytes = 0                          # ... of it in shard files (the rest: the manifests)
        self._note(None)

    def metrics(self) -> dict:
        """This rank's: the commits' median seconds (after the step, before the next), the most its folder held
        (host memory: /dev/shm) and the most of that in shard files, and the formula of those (replica_bytes)."""
        r = self.replicas
        one = r.theory_bytes()
        return {"job": self.name, "commit": self.commit, "steps_lost_at_most": STEPS_LOST[self.commit],
                "commit_s": statistics.median(self.seconds) if self.seconds else None,
                "commit_times_s": list(self.seconds),
                "shm_bytes": self.shm_bytes, "shard_bytes": self.shard_bytes,
                "parts": [part for part, _ in self.parts],
                "theory_bytes": {"per_step": one, "total": 2 * one, "rows": r.shape[0],
                                 "files": len(r.table[r.rank]) + len(r.theirs)}}

    def after_step(self, done: int, seed: int) -> None:
        """After step ``done`` - 1 (``done`` steps taken): sync, its commit; behind, the last step's commit finished
        and this one's started (finished after the next step, or at :meth:`flush`)."""
        t0 = time.perf_counter()
        meta = self.extra({"data_step": done, "seed": seed})
        if self.commit == "behind":
            self.replicas.commit_behind(done, meta)
        else:
            self.replicas.commit_step(done, meta)
        self._committed(t0, done)
        if self.pending:                             # the first step after a restore: the recovery is over
            now = time.time()
            for r in self.pending:                   # a failed relaunch's failure recovers with the last one
                r["relaunch_s"] = round(UP - r["detected_at"], 3)
                r["restore_s"] = round(now - UP, 3)
                r["recovery_s"] = round(r["detect_s"] + r["relaunch_s"] + r["restore_s"], 3)
            records = read_failures(self.name)      # the pending ones are its last (each recovery ends them all)
            write_failures(self.name, records[:len(records) - len(self.pending)] + self.pending)
            self.pending = []

    def flush(self) -> None:
        """After the last step (every rank): behind, its commit finished; sync, nothing to do."""
        if self.commit == "behind":
            t0 = time.perf_counter()
            self.replicas.finish()
            self._committed(t0, self.done)

    def _committed(self, t0: float, done: int) -> None:
        """After a commit call: the restore folder freed once a step of this run is committed, the time, the
        folder's bytes, this rank's note."""
        if self.restored and self.replicas.step is not None:   # committed past it: the copies it linked are freed
            if self.mpi.Get_rank() == 0:
                shutil.rmtree(os.path.join(job_dir(self.name), RESTORE), ignore_errors=True)
            self.restored = False
        self.seconds.append(time.perf_counter() - t0)
        del self.seconds[:-HISTORY]
        held, shards = _folder_bytes(self.replicas.folder)
        self.shm_bytes, self.shard_bytes = max(self.shm_bytes, held), max(self.shard_bytes, shards)
        self._note(done)

    def failures(self) -> List[dict]:
        return public(read_failures(self.name))

    def close(self) -> None:
        """At the end: every rank marks itself done (its exit is then no failure to the supervisor), then rank 0
        removes the rank folders."""
        self.replicas.close()
        self._note(self.done, done=True)
        self.mpi.Barrier()
        if self.mpi.Get_rank() == 0:
            clean(self.name, whole=False)

    def _note(self, step: Optional[int], done: bool = False) -> None:
        """This rank's pid, host, node, the steps it has taken (``step``: the supervisor's step in flight is the
        next) and its last committed step (``committed``: sync, the same; behind, one less), for the supervisor
        (written whole, renamed)."""
        self.done = step
        path = os.path.join(job_dir(self.name), RANKS, f"rank{self.rank:05d}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                       "node": self.nodes[self.rank], "step": step, "committed": self.replicas.step,
                       "t": time.time(), "done": done}, f)
        os.replace(path + ".tmp", path)
