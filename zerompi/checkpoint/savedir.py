"""The save directory as a whole: one job at a time, no silent overwrite, bounded disk use.

One concern: the policy around a run's ``--save-dir``, on top of format.py's files. Nothing
here is a collective or touches MPI; rank 0 calls these, and the caller makes the ranks agree.

- :class:`SaveDirLock`: ``DIR/.zerompi.lock`` holds the host, pid and start of the job that
  saves there. A second job stops at start naming them. A lock left by a process that is gone
  (same host, that pid not running, or running since another time: the pid was reused) is
  taken over, and the taker is told so; a lock of another host cannot be checked from here
  and is refused with the file to delete. A holder on this host that still runs is waited for,
  HOLDER_WAIT_S at most, before the job is refused: a job that crashed (killed, or ended without its
  clean-up) can still be exiting when its launcher has returned (Open MPI's mpiexec was seen to),
  and a user who reruns at once must not be refused by it; an exited, unreaped process (a zombie)
  counts as gone. The holder itself removes the lock at exit and, on rank 0, when it aborts the job.
- :func:`check_fresh`: a run may not save into a directory that already holds checkpoints of
  another run (any, unless it resumes from one of them: :func:`own_folder`), unless told to
  replace them (``overwrite``).
- :func:`retain`: after a checkpoint is published, keep the newest ``keep_last`` (by the time
  they were published), never the one ``latest`` names nor those newer than the one the run
  resumed from; :func:`replace`: drop the checkpoints an ``overwrite`` run found there (a resumed
  run's: those newer than the one it resumed from), once its own first one is published.
- :func:`pointer_notes`: what a reader through ``latest`` is told (no checksum, newer checkpoints).
"""
import json
import os
import re
import socket
import time
from typing import List, Optional, Tuple

from ..errors import ConfigError
from .format import is_part_folder, part_folders_of, remove_dir, resume_flags
from .orphans import orphans
from .pointer import CHECKPOINT_NAME, LATEST, MANIFEST, complete_checkpoints, latest_name, read_latest, step_of

LOCK = ".zerompi.lock"
HOLDER_WAIT_S = 10.0            # how long a holder on this host that still runs may take to end before a job is refused
GONE_STATES = ("Z", "X")        # /proc/PID/stat states of a process that has exited (zombie, dead)


def _process_stat(pid: int) -> Optional[Tuple[str, str]]:
    """(state, start) of process ``pid`` (Linux: /proc/PID/stat fields 3 and 22, the start in clock ticks since
    boot), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read(4096).rpartition(")")[2].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot), or None."""
    stat = _process_stat(pid)
    return None if stat is None else stat[1]


def _alive(pid: int, start: Optional[str]) -> bool:
    """True when ``pid`` runs on this host (not exited and unreaped) and (where both are known) started at
    ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        pass                        # another user's process: it exists
    stat = _process_stat(pid)
    if stat is not None and stat[0] in GONE_STATES:
        return False
    return start is None or stat is None or stat[1] == start


def _ends_within(pid: int, start: Optional[str], seconds: float) -> bool:
    """True when process ``pid`` (started at ``start``) is gone, or goes within ``seconds``."""
    deadline = time.monotonic() + seconds
    while _alive(pid, start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class SaveDirLock:
    """``DIR/.zerompi.lock``, created atomically (O_EXCL) by :meth:`acquire`; :meth:`release` removes
    it if it is still this process's. ``note``: the line to print when a stale lock was taken over."""

    def __init__(self, directory: str):
        self.directory, self.path, self.note, self.held = directory, os.path.join(directory, LOCK), None, False
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> "SaveDirLock":
        """Take the lock or raise ConfigError naming its holder (a live job, or another host's)."""
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(3):          # a lock that vanishes or goes stale meanwhile: try again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise ConfigError(f"save_dir={self.directory!r}: cannot take the lock {self.path}; another job keeps "
                          "taking it")

    def _take_over_if_stale(self) -> None:
        try:
            with open(self.path) as f:
                other = json.loads(f.read(4096))
            host, pid, start, since = other["host"], int(other["pid"]), other.get("start"), other.get("since", "?")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"save_dir={self.directory!r}: the lock {self.path} is unreadable; if no job saves "
                              "there, delete it") from None
        if host != self.me["host"]:
            raise ConfigError(f"save_dir={self.directory!r} is locked by pid {pid} on host {host} since {since} "
                              f"({self.path}): another job saves there; use another --save-dir, or delete that "
                              "file if no job runs there")
        if not _ends_within(pid, start, HOLDER_WAIT_S):   # a crashed job's rank may still be exiting: wait a while
            raise ConfigError(f"save_dir={self.directory!r} is in use by another job (pid {pid} on this host, "
                              f"{host}, since {since}; {self.path}; still running after {HOLDER_WAIT_S:g} s); "
                              "use another --save-dir or wait for it to end")
        stale = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, stale)          # one taker wins; the others find the new lock
        except FileNotFoundError:
            return
        os.unlink(stale)
        self.note = (f"took over the lock {self.path} left by pid {pid} on this host ({host}, since {since}), "
                     "which is no longer running")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            with open(self.path) as f:
                mine = json.loads(f.read(4096)).get("pid") == self.me["pid"]
            if mine:
                os.unlink(self.path)
        except (OSError, ValueError, AttributeError):
            pass


def folders_read(role: str, path: Optional[str]) -> List[Tuple[str, str]]:
    """The (role, folder) pairs a reader of the checkpoint ``path`` (None: none) depends on, for
    outputs.check_roles: ``path`` itself and, where it is one checkpoint (``step_NNNNNN``) or one
    tensor-parallel or pipeline part (``tp{r}-of-{K}``, ``pp{c}-of-{C}``), each save folder above it (its
    ``latest``, its checkpoints)."""
    if not path:
        return []
    found, real = [(role, path)], os.path.realpath(path)
    while CHECKPOINT_NAME.fullmatch(os.path.basename(real)) or is_part_folder(os.path.basename(real)):
        real = os.path.dirname(real)
        found.append((f"{role}'s save folder", real))
    return found


def saved_checkpoints(directory: str) -> List[str]:
    """The complete checkpoints in ``directory`` and in its tensor-parallel and pipeline folders
    (``tp0-of-2/step_...``, ``pp1-of-2/tp0-of-2/step_...``: format.part_folders_of), as paths relative to it."""
    return complete_checkpoints(directory) + [f"{os.path.relpath(part, directory)}/{name}"
                                              for part in part_folders_of(directory)
                                              for name in complete_checkpoints(part)]


def own_folder(directory: str, resume: Optional[str]) -> bool:
    """True when ``directory`` is the save folder of what ``resume`` names (that folder itself, or the
    one its ``step_NNNNNN`` lies in): a resume there continues the run whose checkpoints it holds."""
    real = os.path.realpath(directory)
    return bool(resume) and any(os.path.realpath(f) == real for _, f in folders_read("", resume))


def check_fresh(directory: str, resume: Optional[str], overwrite: bool) -> List[str]:
    """A run into a ``directory`` that holds checkpoints (its own or in tensor-parallel or pipeline folders) of another
    run: ConfigError, unless ``overwrite``. Another run's: any, for a run without ``resume``; for a resumed
    run, any unless ``directory`` is the save folder of what it resumes (own_folder). Returns the
    checkpoints there (an ``overwrite`` run replaces them later)."""
    found = saved_checkpoints(directory)
    subs = {n.partition("/")[0] for n in found if "/" in n}
    latest_at = [d for d in [directory] + [os.path.join(directory, s) for s in sorted(subs)]
                 if os.path.lexists(os.path.join(d, LATEST))]
    if not found and not latest_at or own_folder(directory, resume) or overwrite:
        return found
    latest = latest_name(latest_at[0] if latest_at else directory)
    listed = ", ".join(found) if found else "none complete"
    whose = f"another run than the one --resume {resume} continues" if resume else "another run"
    flags = resume_flags(directory)        # none complete: nothing there can be resumed, so no --resume advised
    last = max((step_of(os.path.basename(n)) or 0 for n in found), default=0)
    cont = f"pass {flags} (and --steps above {last}) to continue that run, " if flags else ""
    raise ConfigError(f"save_dir={directory!r} already holds checkpoints ({listed}; {LATEST}: {latest}) of "
                      f"{whose}; {cont}--overwrite to replace them (removed once this run's first checkpoint is "
                      "saved), or another --save-dir")


def newer_checkpoints(directory: str, step: int) -> List[str]:
    """The complete checkpoints in ``directory`` (and its tensor-parallel folders, as saved_checkpoints) of
    a step after ``step``: the future of a run resumed from an older checkpoint."""
    return [n for n in saved_checkpoints(directory) if (step_of(os.path.basename(n)) or -1) > step]


def pointer_notes(path: str) -> List[str]:
    """What a reader of the save folder ``path`` (or each of its tensor-parallel and pipeline folders) through its
    ``latest`` is told beside the checkpoint it gets: a pointer that carries no checksum (followed
    unverified), complete checkpoints of later steps than the one it names, and complete ones never
    published (orphans.py). [] for a checkpoint named directly."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, MANIFEST)):
        return []
    notes = []
    for folder in part_folders_of(path) or [path]:
        name, digest = read_latest(folder)
        if not name or not os.path.isfile(os.path.join(folder, name, MANIFEST)):
            continue                      # resolve() refuses it, naming what is there
        latest = os.path.join(folder, LATEST)
        if digest is None:
            notes.append(f"{latest} carries no checksum of the manifest it names (written by hand or by an older "
                         f"zerompi): {name} is used unverified")
        newer = [n for n in complete_checkpoints(folder) if (step_of(n) or -1) > (step_of(name) or -1)]
        if newer:
            notes.append(f"{folder} holds complete checkpoints of later steps than {name}, which {latest} names: "
                         f"{', '.join(newer)}; to use one, name it (e.g. {os.path.join(folder, newer[-1])})")
    for tmp, manifest in [o for folder in part_folders_of(path) or [path] for o in orphans(folder)]:
        notes.append(f"{tmp} holds a complete checkpoint of step {manifest['step']} that was never published; the "
                     f"next run of zerompi.train with --save-dir {path} (or an engine.save into it) publishes it")
    return notes


def _published_at(directory: str, name: str) -> float:
    try:
        return os.path.getmtime(os.path.join(directory, name, MANIFEST))
    except OSError:
        return 0.0


def retain(directory: str, keep_last: Optional[int], current: str, keep=()) -> List[str]:
    """Remove all but the newest ``keep_last`` checkpoints (by publication time), ``current`` (the one
    ``latest`` names) always kept and ``keep`` (those newer than the one the run resumed from) never
    removed nor counted; None keeps everything. Returns the names removed."""
    if not keep_last:
        return []
    others = [n for n in complete_checkpoints(directory) if n != current and n not in keep]
    others.sort(key=lambda n: (_published_at(directory, n), n))
    doomed = others[:max(0, len(others) - (keep_last - 1))]
    for name in doomed:
        remove_dir(os.path.join(directory, name), background=True)
    return doomed


def layout(folder: str) -> str:
    """The part-folder pattern of ``folder`` (relative to its save folder): ``pp1-of-2/tp0-of-2`` ->
    ``pp*-of-2/tp*-of-2``, '' for the save folder itself: the folders of one run share it."""
    return "/".join(re.sub(r"^(pp|tp)\d+-of-", r"\1*-of-", p) for p in folder.split(os.sep) if p not in ("", "."))


def replace(directory: str, old: List[str], current: str, own: Optional[str] = None) -> List[str]:
    """Remove the checkpoints ``old`` (those an ``overwrite`` run found, relative paths), except those named
    ``current`` in this run's own folders (each part has just written its own); returns what was removed.

    ``own``: the folder, relative to ``directory``, of one of this run's new checkpoints, given when the run
    replaces another run as a whole: then what that run left in folders of another layout goes too, which a
    later --resume would otherwise continue: its part folders (a pipelined or tensor-parallel run's, replaced by
    a run of another --pp, --chunks or --tp, or by one without them), or the save folder's own ``latest`` (an
    unpartitioned run's, replaced by a partitioned one)."""
    mine = layout(current if own is None else own)
    gone: List[str] = []                  # part folders of another layout, removed whole
    if own is not None and os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            sub = os.path.join(directory, name)
            if not is_part_folder(name):
                continue
            leaves = [os.path.relpath(leaf, directory) for leaf in part_folders_of(sub) or [sub]]
            foreign = [leaf for leaf in leaves if layout(leaf) != mine]
            gone += [name] if foreign == leaves else foreign
    inside = lambda n: any(n.startswith(g + os.sep) for g in gone)
    doomed = [n for n in old if (os.path.basename(n) != current or own is not None and layout(os.path.dirname(n))
                                 != mine) and not inside(n) and os.path.isdir(os.path.join(directory, n))]
    for name in doomed + gone:
        remove_dir(os.path.join(directory, name), background=True)
    if own is not None and mine and os.path.lexists(os.path.join(directory, LATEST)):
        os.unlink(os.path.join(directory, LATEST))
        gone.append(LATEST)
    return doomed + gone
