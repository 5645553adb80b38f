"""Checked collectives: one collective's messages, and the comparison of the ranks' signatures.

:class:`Checks` holds a communicator's private link (a duplicate: only checked collectives'
messages travel on it); :meth:`Checks.exchange` starts one collective as point-to-point
messages, a header (comm/signature.py) and the data to and from every peer, the data tagged
with the signature's hash; the returned :class:`Exchange` compares the headers as soon as they
are in, and raises MismatchError (the same on every rank: every rank has every header) before
the caller reads any result.
"""
import zlib
from typing import Optional

from mpi4py import MPI

from ..errors import MismatchError
from .signature import HEADER_BYTES, HEADER_TAG, MAX_TAG, mismatch_message, signature


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


class Exchange:
    """A checked collective in flight, with the request interface (``Test``, ``Wait``) a Handle
    drives: the headers first, compared as soon as they are in; then the data."""

    __slots__ = ("_checks", "_headers", "_heads", "_data", "_checked")

    def __init__(self, checks: Checks, sig: bytes, sends, recvs):
        link, me, n = checks.link, checks.rank, HEADER_BYTES
        headers = bytearray(sig * checks.size)            # every rank's header, this rank's in place
        tag = 1 + zlib.crc32(sig) % checks.max_tag
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
            rows = [bytes(headers[p * n:(p + 1) * n]) for p in range(self._checks.size)]
            error = self._checks.error = MismatchError(mismatch_message(rows, self._checks.ranks))
            raise error
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
