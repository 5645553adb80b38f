"""Output files the tools write: checked before the work starts, written atomically.

One concern: the files a run leaves besides its checkpoints (``--metrics-json``, ``bench
--json``, ``estimate --json``, ``checkpoint consolidate``'s OUT, and the folder
``--save-dir``). Nothing here touches MPI.

- :func:`check_file` / :func:`check_folder`, before the work: one ConfigError line unless the
  path can take the output. A file must be a new name or a regular file (never a folder, a
  device such as /dev/full, a FIFO) in an existing folder where this process can create a
  file (tried: a temporary file is created and removed, which also catches read-only file
  systems and root-squashed mounts that permission bits do not show).
- :func:`write_atomic`: a temporary file beside the target, fsynced, renamed over it; on any
  failure (a full disk) the temporary file is removed and what was at the path stays.
- :func:`save_json` (:func:`save_bytes`): write_atomic of a JSON text; when that fails, a copy in the system's
  temporary folder, and one line that says which.
- :func:`check_roles`, before anything is written: the rule every tool applies to all of its paths
  at once, one ConfigError line naming both roles (docs/failures.md, "Outputs").
"""
import json
import os
import stat
import tempfile
from typing import BinaryIO, Callable, Iterable, Optional, Tuple

from ..errors import ConfigError, check

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def check_file(path: Optional[str], what: str) -> None:
    """ConfigError (naming ``what=path``) unless ``path`` can be written as an output file; None passes."""
    if path is None:
        return
    check(path != "", f"{what}='' is an empty path; give a file path")
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as e:
        raise ConfigError(f"{what}={path!r} cannot be used: {e.strerror}")
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
        raise ConfigError(f"{what}={path!r} is {kind}; give a new file name or a regular file to replace")
    _check_creatable(os.path.dirname(target), what, path)


def check_folder(path: Optional[str], what: str) -> None:
    """ConfigError unless ``path`` is a folder this process can create files in, or can be made
    one (its nearest existing ancestor is such a folder); None passes. Creates nothing."""
    if path is None:
        return
    check(path != "", f"{what}='' is an empty path; give a folder")
    target = os.path.realpath(path)
    probe = target
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if os.path.exists(probe) and not os.path.isdir(probe):
        where = "is a file" if probe == target else f"cannot be made: {probe!r} is a file"
        raise ConfigError(f"{what}={path!r} {where}, not a folder; give a folder (it is made if missing)")
    _check_creatable(probe, what, path)


def _check_creatable(folder: str, what: str, path: str) -> None:
    """ConfigError unless a file can be created in the existing folder ``folder``."""
    if not os.path.isdir(folder):
        why = "does not exist" if not os.path.lexists(folder) else "is a file, not a folder"
        raise ConfigError(f"{what}={path!r}: the folder {folder!r} {why}; create it first or give another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zerompi-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}={path!r}: cannot create files in {folder!r} ({e.strerror})")


def write_atomic(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write a file through ``write(f)``: into a temporary file beside ``path``, fsynced, then
    renamed over it (a symbolic link's target is what is replaced). Raises OSError; the
    temporary file is then removed and whatever was at ``path`` is untouched."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        raise IsADirectoryError(21, "not a regular file", path)    # changed since it was checked
    mode = _mode_for(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode_for(target: str) -> int:
    """The replaced file's permission bits, else what open() would give a new file (0666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def save_json(path: str, obj, what: str) -> Optional[str]:
    """Write ``obj`` as indented JSON to ``path`` (atomically): None, or the one line that says why it
    could not be and where a copy went instead (the system's temporary folder), if anywhere."""
    return save_bytes(path, json.dumps(obj, indent=1).encode(), what)


def save_bytes(path: str, data: bytes, what: str) -> Optional[str]:
    """:func:`save_json` of bytes already made (a trace's JSON text)."""
    try:
        write_atomic(path, lambda f: f.write(data))
        return None
    except OSError as e:
        reason = e.strerror or str(e)
    folder = tempfile.gettempdir()
    try:
        fd, kept = tempfile.mkstemp(prefix="zerompi-", suffix=f"-{os.path.basename(path) or 'out'}", dir=folder)
    except OSError as e:
        return f"cannot write {what}={path!r} ({reason}), nor a copy in {folder} ({e.strerror}): it is lost"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        os.unlink(kept)
        return f"cannot write {what}={path!r} ({reason}), nor a copy in {folder} ({e.strerror}): it is lost"
    return f"cannot write {what}={path!r} ({reason}); a copy is in {kept}"


def check_image(path: str, what: str) -> None:
    """ConfigError unless matplotlib (there: the caller checked) writes the format ``path``'s suffix
    names (png when none)."""
    from matplotlib.backend_bases import FigureCanvasBase
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    check(fmt in known, f"{what}={path!r}: no image format .{fmt}; use one of {', '.join(sorted(known))}")


Role = Tuple[str, Optional[str]]     # (the name the user knows the path by: "metrics_json", "save_dir"; the path)


def check_roles(outputs: Iterable[Role], inputs: Iterable[Role] = (), folders: Iterable[Role] = ()) -> None:
    """ConfigError, one line naming both roles, unless every output file of a tool has a path of its own.

    ``outputs``: the files the tool writes (the stop file counts as one: the tool must never make it
    appear); ``inputs``: the files and folders it reads (a folder: everything inside it, as a
    checkpoint's save folder); ``folders``: the folders it writes into (``--save-dir``,
    ``--offload-dir``). An output may not be an input or lie inside an input folder, be another
    output, be or lie inside a folder it writes into; two such folders may not be one. Paths compare
    as real paths (symbolic links followed, ``..`` resolved) and, where both exist, as files (a hard
    link is the same file). None paths are skipped. Reads nothing but the paths' metadata."""
    named = lambda role, path: f"{role}={path!r}" if role.isidentifier() else f"{role} {path!r}"
    outs = [(named(r, p), os.path.realpath(p), r == "stop_file") for r, p in outputs if p]
    ins = [(named(r, p), os.path.realpath(p)) for r, p in inputs if p]
    dirs = [(named(r, p), os.path.realpath(p)) for r, p in folders if p]
    for k, (out, real, stop) in enumerate(outs):
        for other, there, stops in outs[:k]:
            if _same(real, there):
                raise ConfigError(f"{other} and {out} are the same file: " + (
                    "the run would stop itself by writing it" if stop or stops else
                    "one output would replace the other") + "; give each its own path")
        for other, there in ins:
            if _same(real, there):
                raise ConfigError(f"{out} is also the input {other} and would replace it; give another path")
            if _inside(real, there):
                raise ConfigError(f"{out} lies inside the input {other}, which is read from there; give a path "
                                  "outside it")
        for other, there in dirs:
            if _same(real, there):
                raise ConfigError(f"{out} is the folder {other} itself; give a file path outside it")
            if _inside(real, there):
                raise ConfigError(f"{out} lies inside {other}, a folder the run writes into (its checkpoints, "
                                  "their latest pointer, offload files); give a path outside it")
    for k, (folder, real) in enumerate(dirs):
        for other, there in dirs[:k]:
            if _same(real, there):
                raise ConfigError(f"{other} and {folder} are one folder; give each its own")


def _same(a: str, b: str) -> bool:
    """Real paths ``a`` and ``b`` name one file (equal, or both exist and are one inode)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: str, folder: str) -> bool:
    """Real path ``path`` lies below real path ``folder``."""
    return path != folder and os.path.commonpath([path, folder]) == folder
