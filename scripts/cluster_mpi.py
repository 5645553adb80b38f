"""One MPI job across an emulated cluster (scripts/cluster.py): MPICH's or Open MPI's launcher in
node 0, the other nodes reached through the cluster's remote-shell agent.

The settings each MPI needs here (docs/cluster.md says why, and what carries to a real cluster):

- MPICH: ``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp``. Its default transport (UCX) sees one
  kernel and moves the data through shared memory even between namespaces: nothing would
  cross the links. hydra passes the launcher's whole environment to the ranks.
- Open MPI: ``--bind-to none --mca mpi_yield_when_idle 1`` (else the ranks of different
  "nodes" are bound to the same cores and busy-poll), TCP and its out-of-band channel kept on
  ``eth0``, and every variable the ranks need forwarded by name (``-x``).

Placement: ``block`` puts ranks ``k*R .. k*R + R-1`` on node k; ``round-robin`` deals them out
one per node in turn (``mpirun --map-by node``; hydra's ``-ppn 1``).
"""
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from launch import mpiexec  # noqa: E402  (one launcher and environment for every script)
MPICH_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
OPEN_MPI_FLAGS = ["--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "--mca", "btl", "self,sm,tcp",
                  "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
PLACEMENTS = ("block", "round-robin")
# forwarded to Open MPI's ranks by name (hydra forwards everything)
FORWARD = ("PYTHONPATH", "PATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# What a launcher prints when it could not start at all, before any rank ran, on stdout or stderr: Open MPI's PMIx
# server in a fresh namespace, now and then (seen once in four runs of the cluster tests), and its daemons' wire-up
# over the fresh links (PRRTE's two messages below; one ended a CI run's straight 4-node job with exit 213). Job.run
# and Job.start_until start such a job again. A node the cluster's agent cannot reach is no such failure: its link
# is down, and starting again would only say so again.
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",
                   "A daemon was unable to complete a TCP connection",
                   "A daemon failed to report back after being spawned")
UNREACHABLE = "cluster agent: cannot reach"
LAUNCH_TRIES = 3


def launch_failed(proc: subprocess.CompletedProcess) -> bool:
    """The launcher itself failed to start (no rank ran): starting the job again is safe."""
    said = (proc.stdout or "") + (proc.stderr or "")
    return proc.returncode != 0 and UNREACHABLE not in said and any(m in said for m in LAUNCH_FAILURES)


def _collect(stream, into: list) -> None:
    for line in stream:
        into.append(line)


@functools.lru_cache(maxsize=None)
def flavour() -> str:
    """"openmpi" or "mpich": whose mpiexec :func:`mpiexec` is."""
    text = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60).stdout
    return "openmpi" if ("Open MPI" in text or "PRRTE" in text or "OpenRTE" in text) else "mpich"


class Job:
    """``ranks_per_node`` ranks on each node of ``cluster`` running ``argv`` (``python`` is this
    Python) under this Python's MPI; ``env``: variables for the ranks; ``nodes``: how many of the
    cluster's nodes (default all)."""

    def __init__(self, cluster, ranks_per_node: int, argv: Sequence[str], placement: str = "block",
                 env: Optional[Dict[str, str]] = None, nodes: Optional[int] = None, launcher_flags=()):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not allowed; use one of {PLACEMENTS}")
        self.cluster, self.r, self.placement = cluster, ranks_per_node, placement
        self.nodes = nodes or cluster.nodes
        self.argv = [sys.executable if a == "python" else str(a) for a in argv]
        self.env = dict(env or {})
        self.launcher_flags = list(launcher_flags)
        self.proc: Optional[subprocess.Popen] = None
        self.seconds: Optional[float] = None     # wall time of the job, once it ended

    @property
    def size(self) -> int:
        return self.nodes * self.r

    def rank_env(self) -> Dict[str, str]:
        env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        env["PATH"] = os.environ.get("PATH", "")
        env.update(MPICH_ENV if flavour() == "mpich" else {})
        env.update(self.env)
        return env

    def launch_command(self) -> List[str]:
        """The launcher's command line, to run inside node 0."""
        c, n = self.cluster, self.nodes
        hosts = [c.node(k) for k in range(n)]
        if flavour() == "mpich":
            ppn = 1 if self.placement == "round-robin" else self.r
            return [mpiexec(), "-hosts", ",".join(hosts), "-launcher", "ssh", "-launcher-exec", str(c.agent),
                    "-n", str(self.size), "-ppn", str(ppn)] + self.launcher_flags + self.argv
        mapping = ["--map-by", "node"] if self.placement == "round-robin" else ["--map-by", "slot"]
        forward = []
        for key in sorted(set(FORWARD) | set(self.env)):
            forward += ["-x", key]
        return ([mpiexec(), "--host", ",".join(f"{h}:{self.r}" for h in hosts), "--mca", "plm_rsh_agent",
                 str(c.agent), "-n", str(self.size)] + mapping + OPEN_MPI_FLAGS + forward + self.launcher_flags
                + self.argv)

    def process_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.pop("ZEROMPI_NODE_SIZE", None)       # the nodes are real here
        env.update(self.rank_env())
        if flavour() == "openmpi":
            env.update(OPEN_MPI_ENV)
        return env

    def start(self, capture: bool = True) -> subprocess.Popen:
        """Start the launcher in node 0 (its own process group); returns the Popen. ``capture``: its
        output is collected line by line (:meth:`lines`, :meth:`wait_for`)."""
        out = subprocess.PIPE if capture else None
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cluster.command(0, self.launch_command()), stdout=out, stderr=out,
                                     text=True, env=self.process_env(), cwd=str(ROOT), start_new_session=True)
        self._out, self._err, self._readers = [], [], []
        if capture:
            for stream, into in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
                reader = threading.Thread(target=_collect, args=(stream, into), daemon=True)
                reader.start()
                self._readers.append(reader)
        return self.proc

    def lines(self) -> List[str]:
        """The job's stdout lines so far."""
        return list(self._out)

    def stderr(self) -> str:
        """What the job printed on stderr so far."""
        return "".join(self._err)

    def wait_for(self, prefix: str, timeout: float, stream: str = "stdout") -> float:
        """Block until the job printed a line starting with ``prefix`` on ``stream`` ("stdout" or
        "stderr"); returns the seconds since the start. TimeoutError (the job killed) when it did not
        within ``timeout`` s or ended first."""
        end = time.monotonic() + timeout
        lines = self._out if stream == "stdout" else self._err
        while time.monotonic() < end:
            if any(line.startswith(prefix) for line in list(lines)):
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        raise TimeoutError(f"no line {prefix!r} within {timeout:g} s (exit {self.proc.poll()}):\n"
                           + "".join(self._out)[-3000:] + "".join(self._err)[-3000:])

    def start_until(self, prefix: str, timeout: float) -> float:
        """:meth:`start`, then :meth:`wait_for` the line ``prefix`` on stdout; a launcher that failed to start
        (launch_failed) is started again, up to LAUNCH_TRIES times. Returns the seconds from the last start."""
        for _ in range(LAUNCH_TRIES - 1):
            self.start()
            try:
                return self.wait_for(prefix, timeout)
            except TimeoutError:                # ended without the line, or killed by wait_for
                self.proc.wait(timeout=30)
                self._join()
                said = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self._out),
                                                   "".join(self._err))
                if not launch_failed(said):
                    raise
        self.start()
        return self.wait_for(prefix, timeout)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the job; after ``timeout`` s kill it and every process on its nodes, and raise
        TimeoutError with what it printed. Returns a CompletedProcess (stdout, stderr, returncode)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            self._join()
            raise TimeoutError(f"the job ran past {timeout:g} s: {' '.join(self.launch_command())}\n"
                               f"stdout:\n{''.join(self._out)}\nstderr:\n{''.join(self._err)}")
        finally:
            self.seconds = time.monotonic() - self.started
        self._join()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self._out), "".join(self._err))

    def _join(self) -> None:
        for reader in self._readers:
            reader.join(timeout=10)

    def run(self, timeout: float = 300, capture: bool = True) -> subprocess.CompletedProcess:
        """Start the job and wait for it; a launcher that failed to start (launch_failed) is started again, up
        to LAUNCH_TRIES times."""
        for _ in range(LAUNCH_TRIES):
            self.start(capture)
            proc = self.wait(timeout)
            if not (capture and launch_failed(proc)):
                break
        return proc

    def kill(self) -> None:
        """The launcher's process group, then whatever is left on the job's nodes."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for k in range(self.nodes):
            self.cluster.kill_node(k)

    def leftovers(self) -> Dict[int, List[int]]:
        """{node: PIDs} of the processes still in the job's nodes (none once it ended cleanly)."""
        return {k: p for k in range(self.nodes) if (p := self.cluster.pids(k))}

    def ranks_left(self) -> Dict[int, List[int]]:
        """{node: PIDs} of the job's ranks (this Python running the job's program) still alive."""
        out = {}
        for k, pids in self.leftovers().items():
            mine = [p for p in pids if _cmdline(p)[:3] == self.argv[:3]]
            if mine:
                out[k] = mine
        return out

    def wait_gone(self, timeout: float) -> Dict[int, List[int]]:
        """Wait up to ``timeout`` s for every rank of the job to have ended; returns those left."""
        end = time.monotonic() + timeout
        while (left := self.ranks_left()) and time.monotonic() < end:
            time.sleep(0.1)
        return left


def _cmdline(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []
