"""What every rank was doing when a collective timed out: each rank's reports, over TCP.

A watchdog that fires knows only its own rank's wait. To name the ranks that had not arrived,
every rank of an engine runs a :class:`Reporter`: a daemon thread with a TCP socket that
answers, to a caller holding this rank's token, what the rank is blocked in now (its
WaitRecord) and its last collectives (the WaitRecord's history: a flight recorder). The
addresses and tokens are exchanged once, when the engine starts (:meth:`Peers.start`, one
all-gather). When the watchdog fires it asks every rank at once (:meth:`Peers.ask`, at most
ASK_S seconds in all) -- over TCP, not MPI, so that neither a hung MPI nor a dead rank nor a
cut link can stop the answer -- and its line names (:func:`explain`):

- the ranks that wait in the same collective (arrived);
- those that wait in another one, or are in none (computing, or hung outside MPI): not arrived;
- those whose host refuses the connection: their process has ended;
- those that did not answer (hung with the interpreter held, or cut off): not arrived, grouped
  by their node's host name, so a node whose link is down reads as that node.

One rank also prints the summary, one line per rank: what it waits in and its last
collectives (the lowest rank, among those that answered, that has fired or is about to).
"""
import json
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

from .watchdog import describe_wait, watched

ASK_S = 3.0            # seconds the fired watchdog waits for every rank's report, in all
CONNECT_S = 2.0        # ... for one connection (a cut link never answers)
MAX_ASKED = 64         # ranks asked at once (each a thread for the time of the question)
MAX_NAMED = 8          # ranks in another collective named one by one in the line
MAX_SUMMARY = 16       # lines of the summary


def host_name() -> str:
    try:
        from mpi4py import MPI
        return MPI.Get_processor_name()
    except Exception:
        return socket.gethostname()


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


class Reporter:
    """This rank's answers: a daemon thread that serves :meth:`report` to callers with the token.

    ``record``: the rank's WaitRecord; ``rank``: its world rank (what every line names); ``step()``: the
    step a wait without one is named at; ``fired()``: whether this rank's watchdog has fired."""

    def __init__(self, record, rank: int, step: Callable[[], Optional[int]], fired: Callable[[], bool]):
        self.record, self.rank, self._step, self._fired = record, rank, step, fired
        self.host = host_name()
        self.token = secrets.token_hex(8)
        self._server = socket.create_server(("", 0))
        self._server.settimeout(0.5)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zerompi-reporter", daemon=True)
        self._thread.start()

    def address(self) -> dict:
        return {"rank": self.rank, "host": self.host, "ip": _address_of(self.host), "port": self.port,
                "token": self.token}

    def report(self) -> dict:
        """What this rank is blocked in now, and its last collectives (oldest first)."""
        try:
            step = self._step()
        except Exception:         # the engine may be half torn down
            step = None
        now = self.record.current
        waiting = None
        if now is not None:
            op, tag, since = now
            waiting = [describe_wait(op, tag, step), round(time.monotonic() - since, 1)]
        last = [describe_wait(op, tag, None) for op, tag in list(self.record.history)]   # steps as tagged
        return {"rank": self.rank, "host": self.host, "waiting": waiting, "last": last, "fired": bool(self._fired())}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    if conn.recv(64).decode(errors="replace").strip() == self.token:
                        conn.sendall((json.dumps(self.report()) + "\n").encode())
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        try:
            self._server.close()
        except OSError:
            pass


GONE = {"gone": True}   # a rank whose host refuses the connection: its process has ended


def ask_one(address: dict, same_host: bool, timeout: float) -> Optional[dict]:
    """One rank's report; GONE when its host refuses (nothing listens: the process ended); None when
    it does not answer within ``timeout`` seconds."""
    answer = None
    for ip in ([address["ip"], "127.0.0.1"] if same_host else [address["ip"]]):
        try:
            with socket.create_connection((ip, address["port"]), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall((address["token"] + "\n").encode())
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                return json.loads(data.decode())
        except ConnectionRefusedError:
            answer = GONE
        except (OSError, ValueError):
            continue
    return answer


class Peers:
    """Every rank's Reporter address (``table``, in the order of the engine's communicator, each
    naming its world rank), this rank's place in it (``position``) and its Reporter."""

    def __init__(self, reporter: Reporter, table: List[dict], position: int):
        self.reporter, self.table, self.position = reporter, table, position

    @classmethod
    def start(cls, comm, record, rank: int, step, fired) -> "Peers":
        """Start this rank's Reporter (``rank``: its world rank) and exchange the addresses over
        ``comm`` (a zerompi Communicator: a collective, every rank calls it, timed by its watchdog)."""
        reporter = Reporter(record, rank, step, fired)
        try:
            with watched(comm, "flight recorder: exchanging the report addresses"):
                table = comm.mpi.allgather(reporter.address())
        except BaseException:
            reporter.close()
            raise
        return cls(reporter, table, comm.rank)

    def ask(self, limit_s: float = ASK_S) -> List[Optional[dict]]:
        """Every rank's report (this rank's own at once), None for those that did not answer in time."""
        me = self.position
        out: List[Optional[dict]] = [None] * len(self.table)
        out[me] = self.reporter.report()
        others = [r for r in range(len(self.table)) if r != me]
        if not others:
            return out
        pool = ThreadPoolExecutor(max_workers=min(MAX_ASKED, len(others)), thread_name_prefix="zerompi-ask")
        try:
            futures = {r: pool.submit(ask_one, self.table[r], self.table[r]["host"] == self.reporter.host,
                                      min(CONNECT_S, limit_s)) for r in others}
            end = time.monotonic() + limit_s
            for r, fut in futures.items():
                try:
                    out[r] = fut.result(timeout=max(0.0, end - time.monotonic()))
                except Exception:      # not in time, or failed: no answer
                    out[r] = None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return out

    def explain(self, mine: str, timeout_s: float) -> Tuple[str, List[str]]:
        """(the clause for the watchdog's line, the summary lines or []) for this rank waiting in ``mine``
        (its watchdog's ``timeout_s``: a rank that has waited that long is about to fire too)."""
        reports = self.ask()
        return explain(self.position, mine, reports, self.table, timeout_s)

    def close(self) -> None:
        self.reporter.close()


def _ranks(positions: List[int], table: List[dict]) -> str:
    """'ranks 2-3' for these places in ``table``, by world rank."""
    from .consistency import rank_set
    return rank_set(sorted(_rank(p, table) for p in positions))


def _rank(position: int, table: List[dict]) -> int:
    return table[position].get("rank", position)


def explain(me: int, mine: str, reports: List[Optional[dict]], table: List[dict],
            timeout_s: float) -> Tuple[str, List[str]]:
    """The clause naming who had not arrived in ``mine`` (the collective the rank at place ``me`` of
    ``reports`` and ``table`` waits in), and the summary (one line per rank) when ``me`` prints it:
    the first rank, among those that answered, that has fired or waited ``timeout_s`` (and so fires
    now). Ranks are named by their world rank (``table[i]["rank"]``)."""
    same, elsewhere, silent, gone = [], [], {}, []
    for r, rep in enumerate(reports):
        if r == me:
            continue
        if rep is None:
            silent.setdefault(table[r]["host"], []).append(r)
        elif rep.get("gone"):
            gone.append(r)
        elif rep["waiting"] is not None and rep["waiting"][0] == mine:
            same.append(r)
        else:
            elsewhere.append(r)
    gone_hosts = ", ".join(sorted({table[r]["host"] for r in gone}))
    parts = [f"{_ranks(gone, table)} ended (nothing answers on {gone_hosts})"] if gone else []
    if silent:
        hosts = "; ".join(f"{_ranks(rs, table)} on {host}" for host, rs in silent.items())
        parts.append(f"no answer from {hosts} (dead, hung, or cut off: a node whose link is down)")
    for r in elsewhere[:MAX_NAMED]:
        rep = reports[r]
        if rep["waiting"] is not None:
            parts.append(f"rank {_rank(r, table)} ({rep['host']}) waits in {rep['waiting'][0]}")
        else:
            last = rep["last"][-1] if rep["last"] else "none"
            parts.append(f"rank {_rank(r, table)} ({rep['host']}) is in no collective (computing or hung; its last: "
                         f"{last})")
    if len(elsewhere) > MAX_NAMED:
        parts.append(f"{len(elsewhere) - MAX_NAMED} more ranks elsewhere")
    if parts:
        clause = "not arrived: " + "; ".join(parts)
    else:
        clause = "every rank waits in it (the data does not arrive: a link down, or a stuck transport)"
    if same:
        clause += f"; waiting in it too: {_ranks(same, table)}"
    firing = [r for r, rep in enumerate(reports) if r == me or (rep is not None and not rep.get("gone") and (
        rep["fired"] or (rep["waiting"] is not None and rep["waiting"][1] >= timeout_s)))]
    first = min(firing)
    return clause, (summary(reports, table, sorted(set(range(len(reports))) - set(same))) if first == me else [])


def summary(reports: List[Optional[dict]], table: List[dict], first: Optional[List[int]] = None) -> List[str]:
    """One line per rank: where it is and its last collectives (the flight recorder); at most
    MAX_SUMMARY lines, the ranks ``first`` (those not waiting with this one) before the others."""
    order = list(first or []) + [r for r in range(len(reports)) if r not in set(first or [])]
    lines = []
    for r in sorted(order[:MAX_SUMMARY], key=lambda p: _rank(p, table)):
        rep = reports[r]
        if rep is None or rep.get("gone"):
            lines.append(f"rank {_rank(r, table)} ({table[r]['host']}): {'ended' if rep else 'no answer'}")
            continue
        now = f"waiting {rep['waiting'][1]:.1f} s in {rep['waiting'][0]}" if rep["waiting"] else "in no collective"
        lines.append(f"rank {_rank(r, table)} ({rep['host']}): {now}; last collectives: "
                     f"{', '.join(rep['last']) or 'none'}")
    if len(order) > MAX_SUMMARY:
        lines.append(f"{len(order) - MAX_SUMMARY} more ranks not shown")
    return lines


def hosts_line(table: List[dict], limit: int = 4) -> str:
    """'node0: ranks 0-1; node1: ranks 2-3' (world ranks) from the address table ('' when every rank
    is on one host)."""
    hosts: Dict[str, List[int]] = {}
    for r, address in enumerate(table):
        hosts.setdefault(address["host"], []).append(r)
    if len(hosts) < 2:
        return ""
    shown = [f"{host}: {_ranks(rs, table)}" for host, rs in list(hosts.items())[:limit]]
    return "; ".join(shown) + (f"; {len(hosts) - limit} more hosts" if len(hosts) > limit else "")
