"""A cluster on one machine: nodes as network namespaces, joined by shaped links (a test fixture).

    python scripts/cluster.py --nodes 2 --ranks-per-node 2 --link 250mbit -- python -m zerompi.train --steps 5

makes the cluster, runs one MPI job across it (the MPI of this Python's mpi4py), prints what
crossed each node's link, and takes everything down again, whatever happens. The tests use
the same :class:`Cluster` through the ``cluster`` fixture (tests/conftest.py).

The shape (docs/cluster.md): a namespace ``<prefix>-s`` holds a bridge; every node is a
namespace ``<prefix>-n<K>`` whose ``eth0`` is one end of a veth pair, the other end (``p<K>``)
made inside the bridge's namespace and attached to the bridge. Addresses live only inside the
node namespaces; ``/etc/netns/<prefix>-n<K>/hosts`` names the nodes ``node0 .. node<K-1>``
(``ip netns exec`` mounts it over /etc/hosts), and every process started in node K runs in a
UTS namespace of its own named ``node<K>``, so MPI sees K hosts. The machine's own network
namespace gets no address, route or link: all traffic stays between the namespaces made here.
A link's rate is a ``tbf`` qdisc on both of its ends (there is no netem: no added latency or
loss); a cut link is its bridge port set down.

The launcher runs inside node 0 and reaches the other nodes through a remote-shell agent (a
script in the cluster's temporary folder that runs the command in that node's namespaces, as
ssh would on a real cluster); MPICH's hydra and Open MPI's prte both take one.

Teardown: :meth:`Cluster.down` kills every process left in the node namespaces (they were all
started here), deletes the namespaces and the /etc/netns files. It runs on leaving the ``with``
block, at exit (atexit), and on SIGTERM / SIGHUP (the handler tears down, then lets the signal
end the process as it would have); a later harness also removes the namespaces of a harness
process that was killed with SIGKILL. Namespace names carry the harness's PID and a counter,
so two runs never collide.
"""
import argparse
import atexit
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

STEM = "zmc"                       # every namespace made here starts with it: zmc<pid>x<n>-<role>
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213.0"                # inside the node namespaces only; each cluster has its own bridge
TOOLS = ("ip", "tc", "unshare")
_counter = itertools.count()
_live: Dict[int, "Cluster"] = {}   # id -> every cluster up in this process (atexit, signals)
_lock = threading.Lock()


class ClusterError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message says which command and why)."""


def _sh(*argv, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, argv))}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can): not root, a tool missing, or the kernel
    refusing (no CAP_NET_ADMIN, no veth or bridge). Tries a throwaway namespace with a veth."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{STEM}{os.getpid()}x{next(_counter)}-probe"
    try:
        _sh("ip", "netns", "add", probe)
        try:
            _sh("ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
            _sh("ip", "-n", probe, "link", "add", "name", "vbr", "type", "bridge")
        finally:
            _sh("ip", "netns", "del", probe, check=False)
    except (ClusterError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make network namespaces here: {e}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> List[str]:
    """Delete the namespaces (and /etc/netns folders) and the temporary folders (the agent script) of
    harness processes that no longer run (killed with SIGKILL: no teardown ran). Returns their names."""
    out = _sh("ip", "netns", "list", check=False).stdout.split()
    gone = []
    for name in out:
        if _stale(name):
            _kill_namespace(name)
            gone.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{STEM}*x*-*"):
        if folder.is_dir() and _stale(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(str(folder))
    return gone


def _stale(name: str) -> bool:
    """``name`` (zmc<pid>x<n>-...) is made by a harness process that no longer runs."""
    if not name.startswith(STEM) or "x" not in name:
        return False
    pid = name[len(STEM):].split("x", 1)[0]
    return pid.isdigit() and not _alive(int(pid))


def _namespace_pids(ns: str) -> List[int]:
    return [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]


def _kill_namespace(ns: str) -> None:
    for _ in range(50):                      # processes may fork while being killed: until none is left
        pids = _namespace_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def parse_rate(text: str) -> float:
    """'250mbit' / '1gbit' / '500kbit' -> bits per second (tc's units, decimal)."""
    t = text.strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(suffix):
            try:
                value = float(t[:-len(suffix)])
            except ValueError:
                break
            if value > 0:
                return value * scale
    raise ValueError(f"link rate {text!r} is not allowed; use a rate such as 250mbit or 1gbit")


REACH = """import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=2).close()
except ConnectionRefusedError:
    pass
except OSError as e:
    sys.exit(f"cluster agent: cannot reach {sys.argv[1]}: {e.strerror or 'no answer in 2 s'} (its link is down)")
"""   # the agent's check that a node answers, from the launcher's node


class Cluster:
    """``nodes`` nodes (network namespaces) on one bridge; ``with Cluster(2) as c:`` brings it up
    and always takes it down. ``node(k)`` is node k's host name, ``link_bytes(k)`` its link's
    counters, ``shape``, ``cut`` and ``restore`` act on node k's link, ``command(k, argv)`` runs
    argv inside node k (its network and host name), ``kill_node(k)`` kills every process there."""

    def __init__(self, nodes: int, prefix: Optional[str] = None):
        if not 1 <= nodes <= 16:
            raise ValueError(f"nodes={nodes!r} is not allowed; use 1 .. 16")
        self.nodes = nodes
        self.prefix = prefix or f"{STEM}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.prefix}-s"
        self.namespaces = [f"{self.prefix}-n{k}" for k in range(nodes)]
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(nodes)]
        self.rates: Dict[int, Optional[str]] = {k: None for k in range(nodes)}
        self.tmp: Optional[Path] = None        # the agent script and job files
        self.agent: Optional[Path] = None
        self.is_up = False

    # ---- up and down -------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> bool:
        self.down()
        return False

    def up(self) -> "Cluster":
        remove_stale()
        _guard_teardown()
        with _lock:
            _live[id(self)] = self
        self.is_up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {self.node(k)}\n" for k, a in enumerate(self.addresses))
        for k, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts)
            # made inside the bridge's namespace, its peer moved straight into the node's
            _sh("ip", "-n", self.switch, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", self.switch, "link", "set", f"p{k}", "master", "br0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        self.agent = self.tmp / "agent"
        self.agent.write_text(self._agent_script())
        self.agent.chmod(0o755)

    def down(self) -> None:
        """Kill every process in the node namespaces, delete the namespaces and the files. Idempotent."""
        if not self.is_up:
            return
        self.is_up = False
        for ns in self.namespaces + [self.switch]:
            _kill_namespace(ns)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        with _lock:
            _live.pop(id(self), None)

    # ---- nodes and commands ------------------------------------------------------------------------
    @staticmethod
    def node(k: int) -> str:
        return f"node{k}"

    def command(self, k: int, argv: Sequence[str]) -> List[str]:
        """argv run inside node k: its network namespace, and a UTS namespace named node<k>."""
        return ["ip", "netns", "exec", self.namespaces[k], "unshare", "--uts", "sh", "-c",
                f'hostname {self.node(k)} && exec "$@"', "sh"] + [str(a) for a in argv]

    def _agent_script(self) -> str:
        """The remote shell: ``agent [ssh options] HOST COMMAND...`` runs COMMAND (the words joined,
        as ssh does) inside HOST's namespaces. hydra calls ``agent -x node1 hydra_pmi_proxy ...``,
        prte ``agent node1 'PATH=...; prted ...'``."""
        cases = "\n".join(f"  {self.node(k)}) ns={ns} ;;" for k, ns in enumerate(self.namespaces))
        return (
            "#!/bin/sh\n"
            "# zerompi's emulated cluster: a remote shell into a node's namespaces\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            'host=$1; shift\n'
            'case $host in\n' + cases + '\n'
            '  *) echo "cluster agent: no node named $host" >&2; exit 255 ;;\n'
            'esac\n'
            '# as ssh does: reach the node over the network first (a closed port answers at once)\n'
            f'{shlex.quote(sys.executable)} -c {shlex.quote(REACH)} "$host" || exit 255\n'
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $host && $*"\n')

    def pids(self, k: int) -> List[int]:
        """Every process now in node k's network namespace."""
        return _namespace_pids(self.namespaces[k])

    def kill_node(self, k: int, sig: int = signal.SIGKILL) -> List[int]:
        """Send ``sig`` to every process in node k (its ranks and MPI daemon); returns their PIDs."""
        pids = self.pids(k)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    # ---- links -------------------------------------------------------------------------------
    def shape(self, k: int, rate: Optional[str]) -> None:
        """Limit node k's link to ``rate`` (tc's units: 250mbit, 1gbit) in both directions; None: unshaped."""
        ends = [(self.namespaces[k], "eth0"), (self.switch, f"p{k}")]
        for ns, dev in ends:
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        if rate is not None:
            parse_rate(rate)                 # a bad rate is a ValueError naming it, not tc's message
            for ns, dev in ends:
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "50ms")
        self.rates[k] = rate

    def shape_all(self, rate: Optional[str]) -> None:
        for k in range(self.nodes):
            self.shape(k, rate)

    def cut(self, k: int) -> None:
        """Node k's link goes down (its bridge port): nothing crosses, nothing says so."""
        _sh("ip", "-n", self.switch, "link", "set", f"p{k}", "down")

    def restore(self, k: int) -> None:
        _sh("ip", "-n", self.switch, "link", "set", f"p{k}", "up")

    def link_bytes(self, k: int) -> Dict[str, int]:
        """Node k's link counters: {"tx": bytes node k sent, "rx": bytes it received} (Ethernet
        frames, headers included), read off its eth0."""
        info = json.loads(_sh("ip", "-n", self.namespaces[k], "-s", "-j", "link", "show", "eth0").stdout)[0]
        stats = info["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def all_link_bytes(self) -> List[Dict[str, int]]:
        return [self.link_bytes(k) for k in range(self.nodes)]


# ---- teardown on exit and on signals ----------------------------------------------------------------
def down_all() -> None:
    with _lock:
        clusters = list(_live.values())
    for c in clusters:
        c.down()


atexit.register(down_all)
_guarded: Dict[int, object] = {}


def _on_signal(signum, frame) -> None:
    down_all()
    previous = _guarded.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)         # end as the signal would have


def _guard_teardown() -> None:
    """Tear down on SIGTERM and SIGHUP too (SIGINT raises KeyboardInterrupt: finally blocks run)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current is not _on_signal:
            _guarded[sig] = current
            signal.signal(sig, _on_signal)


# ---- the command line ------------------------------------------------------------------------------
def main(argv=None) -> int:
    from cluster_mpi import Job      # noqa: E402  (scripts/cluster_mpi.py: the MPI job across the nodes)

    p = argparse.ArgumentParser(description="Run one MPI job across an emulated cluster (network namespaces).")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--link", default=None,
                   help="rate of every node's link, tc's units (250mbit, 1gbit); default unshaped")
    p.add_argument("--placement", choices=("block", "round-robin"), default="block")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the job is killed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the program to run after --")
    why = unavailable()
    if why:
        print(f"cluster: {why}", file=sys.stderr)
        return 2
    with Cluster(a.nodes) as c:
        if a.link:
            c.shape_all(a.link)
        before = c.all_link_bytes()
        proc = Job(c, a.ranks_per_node, cmd, placement=a.placement).run(timeout=a.timeout, capture=False)
        after = c.all_link_bytes()
    for k, (b, e) in enumerate(zip(before, after)):
        print(f"cluster: node{k} link: sent {e['tx'] - b['tx']:,} B, received {e['rx'] - b['rx']:,} B", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
