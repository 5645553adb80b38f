"""Checked collectives: one collective's messages, and the comparison of the ranks' signatures.

:class:`Checks` holds a communicator's private link (a duplicate: only checked collectives'
messages travel on it); :meth:`Checks.exchange` starts one collective as point-to-point
messages, a header (comm/signature.py) and the data to and from every peer, the data tagged
with a hash of the signature's shape (operation, dtype, length, quantization: what fixes the
messages' sizes); the returned :class:`Exchange` compares the headers as soon as they are in, and
raises MismatchError (the same on every rank: every rank has every header) before the caller
reads any result.

:meth:`Checks.planned` does the same with a :class:`Plan`: the messages of one shape between the
same buffers made once as persistent requests (MPI_Send_init / MPI_Recv_init) and started again
at every call with one MPI_Startall. A bucket's collectives repeat every step with the same
shape and buffers; a fresh exchange's 4 (N - 1) request calls and their lists cost about as much
as the check's whole budget at 1 MiB (docs/performance.md).
"""
import zlib
from typing import Callable, Dict, Optional

from mpi4py import MPI

from ..errors import MismatchError
from .signature import HEADER_BYTES, HEADER_TAG, MAX_TAG, SHAPE_BYTES, mismatch_message, signature

PLANS = 64      # plans one link keeps (the oldest idle one is freed beyond): a model's buckets x their forms
LOOP = 4        # a plan waits up to this many requests one by one, more with one Waitall (Plan)


class Checks:
    """One communicator's checked collectives: its private link, the world ranks of its ranks, and
    :meth:`exchange`. Made with its Communicator, a collective: the link is a duplicate of
    ``mpi_comm``, made now (timed by the watchdog), never inside a collective's start, where two
    ranks making the links of two communicators in different orders would wait for each other.

    ``stats``: an OpStats that counts the headers (calls and bytes, shared by a topology's
    communicators); ``peers``: (peers on this node, on other nodes), as the Communicator counts."""

    def __init__(self, mpi_comm, stats, peers, waiting):
        self.mpi, self.stats, self.peers, self.waiting = mpi_comm, stats, peers, waiting
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.others = [r for r in range(self.size) if r != self.rank]
        with waiting("duplicating the communicator for the collectives' checks"):
            self.link = mpi_comm.Dup()              # private: only the checked collectives' messages
        self.link.Set_errhandler(MPI.ERRORS_RETURN)
        self.max_tag = min(MAX_TAG, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)   # set on COMM_WORLD only (Open MPI)
        world = MPI.COMM_WORLD.Get_group()
        self.ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(self.size)), world)   # world ranks
        self.error: Optional[MismatchError] = None   # the first mismatch seen: the link is not usable after it
        self.plans: Dict[tuple, "Plan"] = {}          # (shape, send address, receive address) -> its Plan

    def tag(self, sig: bytes) -> int:
        """The data's tag: a hash of the signature's shape, so that a message is only received into a
        buffer made for its size (the labels, scale and accumulation are compared in the headers only)."""
        return 1 + zlib.crc32(sig[:SHAPE_BYTES]) % self.max_tag

    def exchange(self, sig: bytes, sends, recvs) -> "Exchange":
        """Start a checked collective whose signature is ``sig`` (signature.signature): ``sends`` and
        ``recvs`` are (peer, mpi4py message) pairs, at most one each per peer (every rank sends and
        receives one header per peer of each collective, so the headers of any two collectives pair
        up, whatever they are)."""
        if self.error is not None:
            raise self.error
        self.stats.calls += 1
        self.stats.sent(HEADER_BYTES, self.peers)
        return Exchange(self, sig, sends, recvs)

    def planned(self, sig: bytes, key: tuple, messages: Callable[[], tuple]):
        """:meth:`exchange` through the :class:`Plan` of ``key`` (the buffers' addresses: with the
        signature's shape they name the messages), made from ``messages()`` = (sends, recvs) the first
        time. The messages must name their memory by address (``MPI.buffer.fromaddress``): a plan
        outlives the call and must not keep a buffer alive. A plan still in flight (its Handle not yet
        waited) is not started again: that call gets a fresh exchange."""
        if self.error is not None:
            raise self.error
        full = (sig[:SHAPE_BYTES],) + key
        plan = self.plans.get(full)
        if plan is None:
            if len(self.plans) >= PLANS:
                self._evict()                 # before the new one is in: it must not be the one freed
            plan = self.plans[full] = Plan(self, sig, *messages())
        elif plan.active:
            return self.exchange(sig, *messages())
        self.stats.calls += 1
        self.stats.sent(HEADER_BYTES, self.peers)
        plan.start(sig)
        return plan

    def _evict(self) -> None:
        for key, plan in self.plans.items():     # oldest first
            if not plan.active:
                del self.plans[key]
                plan.free()
                return

    def free_plans(self) -> None:
        """Forget every plan, freeing the idle ones' requests (the Communicator's free_scratch: the datatypes
        they use go next). One still in flight completes through its Handle and is never started again."""
        plans, self.plans = self.plans, {}
        for plan in plans.values():
            if not plan.active:
                plan.free()


def refusal(checks, headers) -> MismatchError:
    """The MismatchError of headers that differ (every rank's row in ``headers``, in group order), kept on
    ``checks`` so that later calls raise it too."""
    n = HEADER_BYTES
    rows = [bytes(headers[p * n:(p + 1) * n]) for p in range(checks.size)]
    checks.error = MismatchError(mismatch_message(rows, checks.ranks))
    return checks.error


class Exchange:
    """A checked collective in flight, with the request interface (``Test``, ``Wait``) a Handle
    drives: the headers first, compared as soon as they are in; then the data."""

    __slots__ = ("_checks", "_headers", "_heads", "_data", "_checked")

    def __init__(self, checks: Checks, sig: bytes, sends, recvs):
        link, me, n = checks.link, checks.rank, HEADER_BYTES
        headers = bytearray(sig * checks.size)            # every rank's header, this rank's in place
        tag = checks.tag(sig)
        view = memoryview(headers)
        heads = [link.Irecv([view[p * n:(p + 1) * n], MPI.BYTE], p, HEADER_TAG) for p in checks.others]
        data = [link.Irecv(message, p, tag) for p, message in recvs]
        mine = [view[me * n:(me + 1) * n], MPI.BYTE]
        heads += [link.Isend(mine, p, HEADER_TAG) for p in checks.others]
        data += [link.Isend(message, p, tag) for p, message in sends]
        self._checks, self._headers, self._heads, self._data, self._checked = checks, headers, heads, data, False

    def _check(self) -> None:
        headers, n, me = self._headers, HEADER_BYTES, self._checks.rank
        if headers != headers[me * n:(me + 1) * n] * self._checks.size:
            raise refusal(self._checks, headers)
        self._checked = True

    def Test(self) -> bool:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            if not MPI.Request.Testall(self._heads):
                return False
            self._check()
        return MPI.Request.Testall(self._data)

    def Wait(self) -> None:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            MPI.Request.Waitall(self._heads)
            self._check()
        MPI.Request.Waitall(self._data)


class Plan:
    """One checked collective's messages between the same buffers, as persistent requests: the
    headers (this rank's slot rewritten only when the signature changes, a new step's label), then
    the data; :meth:`start` starts all of them at once. The request interface of :class:`Exchange`
    (``Test``, ``Wait``): the headers compared as soon as they are in, before the data is waited.

    Up to LOOP requests are waited one by one: mpi4py's Waitall and Testall convert their list at
    every call (about 0.5 µs), one request's Wait costs 0.07 µs; more, at once."""

    __slots__ = ("_checks", "_headers", "_expected", "_sig", "_heads", "_rest", "_every", "_checked", "active")

    def __init__(self, checks: Checks, sig: bytes, sends, recvs):
        link, me, n = checks.link, checks.rank, HEADER_BYTES
        self._headers = headers = bytearray(sig * checks.size)   # every rank's header, this rank's in place
        view = memoryview(headers)
        tag = checks.tag(sig)
        heads = [link.Recv_init([view[p * n:(p + 1) * n], MPI.BYTE], p, HEADER_TAG) for p in checks.others]
        data = [link.Recv_init(message, p, tag) for p, message in recvs]
        mine = [view[me * n:(me + 1) * n], MPI.BYTE]
        sent = [link.Send_init(mine, p, HEADER_TAG) for p in checks.others]
        data += [link.Send_init(message, p, tag) for p, message in sends]
        self._checks, self._heads, self._rest, self._every = checks, heads, sent + data, heads + data + sent
        self._sig, self._expected = sig, bytes(headers)
        self._checked, self.active = True, False

    def start(self, sig: bytes) -> None:
        if sig != self._sig:
            me, n = self._checks.rank, HEADER_BYTES
            self._headers[me * n:(me + 1) * n] = sig
            self._sig, self._expected = sig, sig * self._checks.size
        self._checked, self.active = False, True
        MPI.Prequest.Startall(self._every)

    def _check(self) -> None:
        if self._headers != self._expected:
            raise refusal(self._checks, self._headers)
        self._checked = True

    def Test(self) -> bool:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            if not _test(self._heads):
                return False
            self._check()
        if self.active:
            if not _test(self._rest):
                return False
            self.active = False
        return True

    def Wait(self) -> None:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            _wait(self._heads)
            self._check()
        if self.active:
            _wait(self._rest)
            self.active = False

    def free(self) -> None:
        for request in self._every:
            request.Free()


def _test(requests) -> bool:
    if len(requests) > LOOP:
        return MPI.Request.Testall(requests)
    for request in requests:
        if not request.Test():
            return False
    return True


def _wait(requests) -> None:
    if len(requests) > LOOP:
        MPI.Request.Waitall(requests)
        return
    for request in requests:
        request.Wait()


def allgather_rows(mpi_comm, checks: Optional[Checks], op: str, local, table) -> None:
    """``table[r]`` = rank r's ``local`` (a few numbers: every rank must pass as many), checked by ``checks``
    (the operation ``op``, the dtype and the count agreed), or MPI's own Allgather when it is None."""
    if checks is None:
        mpi_comm.Allgather(local, table)
        return
    others = checks.others
    checks.exchange(signature(op, local.dtype, local.size), [(r, local) for r in others],
                    [(r, table[r]) for r in others]).Wait()
    table[checks.rank] = local
