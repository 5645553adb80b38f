"""Who owns an offload file, and the folder check that clears the files of runs that are over.

Every offload file starts with a header (:data:`HEADER_BYTES`) naming its owner: the host, the
boot, the PID namespace, the process id and its start time, the rank. A run that ends badly
(an exception, an abort, kill -9) leaves its files behind; the next run's :func:`check_dir`
reads the header of every offload file in the folder and removes those whose owner is gone
(same host and boot, and no process with that id and start time), so their bytes count as
free before the free-space check. Files it cannot judge (another host's, another PID
namespace's, no readable header) are kept, and named when the space is short.
"""
import json
import os
import shutil
import socket
import sys
from typing import Dict, List, Optional, Tuple

from ...errors import AgreedConfigError, ConfigError

HEADER_BYTES = 4096                 # the owner header; the data starts here (a page: aligned)
MAGIC = b"zerompi offload file\n"
PATTERN = ("zerompi-", ".bin")      # an offload file's name: zerompi-<what>-rank<R>-pid<P>.bin


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22), None if it does not exist."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        return int(text.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_owner(rank: int) -> Dict[str, object]:
    """The owner record of a file this process makes."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace(), "pid": pid, "start": _start_time(pid), "rank": rank}


def header_bytes(owner: Dict[str, object], data_bytes: int) -> bytes:
    """The header of a file of ``data_bytes`` data bytes owned by ``owner``."""
    text = MAGIC + json.dumps(dict(owner, data_bytes=data_bytes), sort_keys=True).encode() + b"\n"
    assert len(text) <= HEADER_BYTES, text
    return text.ljust(HEADER_BYTES, b"\0")


def read_owner(path: str) -> Optional[Dict[str, object]]:
    """The owner record in a file's header, None when it has none (not an offload file, or cut short)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        return None
    if not head.startswith(MAGIC):
        return None
    try:
        owner = json.loads(head[len(MAGIC):].split(b"\n", 1)[0])
    except ValueError:
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def owner_state(owner: Dict[str, object]) -> Tuple[str, str]:
    """("alive" | "gone" | "unknown", why) for a file's owner, judged from this process."""
    here = this_owner(-1)
    who = f"pid {owner['pid']} on {owner.get('host')!r}"
    if owner.get("host") != here["host"]:
        return "unknown", f"{who}, another host"
    if owner.get("boot") != here["boot"]:
        return "gone", f"{who}, before the last reboot"
    if owner.get("pid_ns") != here["pid_ns"]:
        return "unknown", f"{who}, another PID namespace (container)"
    start = _start_time(int(owner["pid"]))
    if start is None and here["start"] is None:       # no /proc: ask the process table
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return "gone", f"{who}, ended"
        except OSError:
            pass
        return "alive", who
    if start is None or start != owner.get("start"):
        return "gone", f"{who}, ended"
    return "alive", who


def sweep(directory: str) -> Tuple[List[Tuple[str, int, str]], List[Tuple[str, int, str]]]:
    """Remove the offload files in ``directory`` whose owner is gone. Returns (removed, unknown): each a
    list of (path, bytes, why); ``unknown``: files whose owner this process cannot judge."""
    removed, unknown = [], []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed, unknown
    for name in names:
        if not (name.startswith(PATTERN[0]) and name.endswith(PATTERN[1])):
            continue
        path = os.path.join(directory, name)
        try:
            size = os.stat(path).st_blocks * 512       # what it holds on the disk (fallocate'd: its size)
        except OSError:
            continue
        owner = read_owner(path)
        if owner is None:
            unknown.append((path, size, "no owner header (an older zerompi's file, or cut short)"))
            continue
        state, why = owner_state(owner)
        if state == "unknown":
            unknown.append((path, size, why))
        elif state == "gone":
            try:
                os.unlink(path)
            except FileNotFoundError:                  # another rank removed it first
                continue
            except OSError as e:
                unknown.append((path, size, f"{why}; cannot remove it: {e.strerror}"))
                continue
            removed.append((path, size, why))
            sys.stderr.write(f"zerompi: removed {path} ({size:,} bytes), an offload file of a run that ended "
                             f"({why}, rank {owner.get('rank')})\n")
    return removed, unknown


def check_dir(path: str, need: int) -> int:
    """ConfigError unless ``path`` is a writable folder (AgreedConfigError unless it has ``need`` bytes free), after
    removing the offload files of ended runs there (``need`` > 0); returns the free bytes (0 when not
    asked)."""
    if not path:
        raise ConfigError("offload to nvme needs offload_dir (--offload-dir DIR): a folder for the state files")
    if not os.path.isdir(path):
        raise ConfigError(f"offload_dir={path!r} is not a folder; create it or name another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload_dir={path!r} is not writable; name a folder this job can write")
    if need <= 0:
        return 0
    _, unknown = sweep(path)
    free = shutil.disk_usage(path).free
    if free < need:
        held = ""
        if unknown:
            listed = ", ".join(f"{p} ({n:,} bytes: {why})" for p, n, why in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            held = (f"; {sum(n for _, n, _ in unknown):,} bytes there are offload files this run cannot tell are "
                    f"over: {listed}{more}; remove those whose runs have ended")
        # Found inside the run (the engine knows its files' size): every rank short of room raises it at the same
        # point, and the train CLI prints it once (the rank named when only some are short), exit status 2.
        raise AgreedConfigError(f"offload_dir={path!r} has {free:,} bytes free; this rank's offload files need "
                                f"{need:,}{held}")
    return free
