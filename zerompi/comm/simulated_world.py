"""A simulated world: one process as rank R of an N-rank job, the other ranks stood in for.

Megatron's ``--fake-process-group`` and torchtitan's ``fake_backend`` check a big configuration on
one device; this is zerompi's. :class:`SimulatedWorld` takes an mpi4py communicator's place
(``ZeroEngine(layers, cfg, comm=SimulatedWorld(64, 0))``, ``Mesh(SimulatedWorld(8, 3), tp=2)``, or
``python -m zerompi.train --simulate-world N --simulate-rank R``). Everything above MPI is the
real thing: the Communicator and its receive buffers, the layout, the buckets, the kernels, the
step, and the counters of the bytes each collective sends. Only the messages are stood in for,
under one deterministic rule (:data:`RULE`): every other rank is a mirror of this one, so what a
peer would send this rank is a copy of this rank's own contribution. A reduce-scatter sums N
copies of this rank's own slice; an all-gather fills every slice with this rank's; every number
or object gathered is this rank's own. A non-blocking collective arrives when this rank waits for
it (the peers are never ahead of it): the engine then holds what a real rank holds when MPI has not
moved a collective on by the time its next one starts -- up to its cap of reductions pending, the
estimate's figure, which ranks of a real job reach (a blocking one, and a pipeline neighbour's
message, arrive at once). So the memory and the traffic are rank R's in the real job; the values
-- the loss, the parameters -- are not a real run's.

Sub-communicators (nodes, shard groups, the tensor- and data-parallel groups) come from
:func:`comm.subcomm.split`, whose colors are a function of the rank: a simulated world evaluates it
for the ranks it stands in for. Nodes are blocks of ``node_size`` consecutive ranks (default: one
node of all N, as N ranks on this machine would be).
"""
import copy
from typing import List, Optional

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError

RULE = ("every other rank mirrors this one: a peer sends this rank a copy of what this rank contributes itself "
        "(a reduce-scatter sums N copies of its own slice, an all-gather fills every slice with its own, every "
        "gathered number is its own), a point-to-point message from another pipeline stage holds zeros, a "
        "non-blocking collective arrives when this rank waits for it, every other message at once; an "
        "expert-parallel all-to-allv's block from a peer is this rank's own block, repeated or cut to the length "
        "that peer sends; memory and bytes sent are this rank's in the real job, the loss and the parameters are "
        "not a real run's")



def simulated(comm) -> bool:
    """True for a Communicator (or mpi4py communicator) over a SimulatedWorld."""
    return bool(getattr(getattr(comm, "mpi", comm), "simulated", False))

class Arrived:
    """The request of a stood-in message that has arrived when it starts (a pipeline neighbour's)."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        pass

    def Cancel(self) -> None:
        pass


class ArrivesWhenWaited(Arrived):
    """The request of a stood-in non-blocking collective. Its messages arrive once this rank has waited for it
    or for a collective started after it (MPI moves a rank's collectives on in the order they started, and a
    wait moves them all): tested while this rank is blocked in a wait (its Communicator's WaitRecord shows
    one), it has arrived, and so has every one started before it; tested between waits (the engine's polls
    while it computes), it has not, unless a later one has been waited for. A real rank whose peers have not
    caught up is in that state: its engine retires a reduction when its cap of pending ones, or a gather it
    needs, makes it wait, and holds the buffers it holds then."""

    __slots__ = ("_world", "_order")

    def __init__(self, world: "SimulatedWorld"):
        self._world = world
        clock = world.clock
        clock[0] += 1
        self._order = clock[0]                 # this rank's collectives, numbered as they start

    def Test(self) -> bool:
        world, clock = self._world, self._world.clock
        record = world.wait_record
        if record is None or record.current is not None:
            clock[1] = max(clock[1], self._order)   # every collective started up to this one has arrived
        return self._order <= clock[1]

    def Wait(self) -> None:
        clock = self._world.clock
        clock[1] = max(clock[1], self._order)


def _bytes(buf) -> np.ndarray:
    """A buffer (ndarray, or mpi4py's MPI.buffer) as flat writable bytes."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)


class SimulatedWorld:
    """Rank ``rank`` of ``size`` ranks in nodes of ``node_size`` (default: one node): the mpi4py calls zerompi
    makes, each answered under :data:`RULE`. Its sub-communicators (:meth:`split_by`) are SimulatedWorlds too."""

    simulated = True
    rule = RULE
    wait_record = None        # the WaitRecord of the Communicator over it (None: collectives arrive at once)

    def __init__(self, size: int, rank: int = 0, node_size: Optional[int] = None):
        check_world_rank(size, rank, node_size)
        self.members: List[int] = list(range(size))   # this communicator's ranks, as ranks of the world
        self.world_size = size                          # the simulated world's ranks (a group's too)
        self.node_size = node_size or size              # consecutive world ranks per node
        self.clock = [0, 0]      # [collectives started, the last arrived] on this communicator
        self._rank = rank

    # ---- who is here -------------------------------------------------------------
    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return len(self.members)

    @property
    def world_rank(self) -> int:
        """This rank in the simulated world (what the job's rank R is): for a group, its member's."""
        return self.members[self._rank]

    @property
    def shared_size(self) -> int:
        """The ranks of this communicator on this rank's node (what MPI's shared-memory split finds)."""
        node = self.members[self._rank] // self.node_size
        return sum(1 for m in self.members if m // self.node_size == node)

    def split_by(self, color_of) -> "SimulatedWorld":
        """comm.subcomm.split: the ranks whose color (``color_of(rank)``) is this rank's, in rank order."""
        mine = color_of(self._rank)
        same = [r for r in range(self.Get_size()) if color_of(r) == mine]
        sub = copy.copy(self)
        sub.members, sub._rank = [self.members[r] for r in same], same.index(self._rank)
        sub.clock = [0, 0]       # MPI orders the collectives of each communicator on its own
        return sub

    def Split(self, color=0, key=0):
        raise UsageError("a simulated world cannot split by this rank's color alone; use zerompi.comm.subcomm.split, "
                         "which gives the colors as a function of the rank")

    def Split_type(self, *args, **kwargs):
        raise UsageError("a simulated world has no shared-memory split; its nodes are node_size ranks (shared_size)")

    def Dup(self) -> "SimulatedWorld":
        return self.split_by(lambda r: 0)

    def Free(self) -> None:
        pass

    def waits_in(self, record) -> None:
        """Its non-blocking collectives arrive while ``record`` (a comm.watchdog.WaitRecord: the Communicator's
        over this world) shows a wait (ArrivesWhenWaited)."""
        self.wait_record = record

    def Barrier(self) -> None:
        pass

    def Iprobe(self, *args, **kwargs) -> bool:
        return False             # no peer sends anything of its own

    def Abort(self, code: int = 1) -> None:
        MPI.COMM_WORLD.Abort(code)

    # ---- objects: every rank's is this rank's ------------------------------------------
    def allgather(self, obj) -> list:
        return [obj] * self.Get_size()

    def gather(self, obj, root: int = 0):
        return [obj] * self.Get_size() if self._rank == root else None

    def bcast(self, obj, root: int = 0):
        return obj

    def allreduce(self, obj, op=MPI.SUM):
        if op in (MPI.MIN, MPI.MAX, MPI.LAND, MPI.LOR, MPI.BAND, MPI.BOR):
            return obj
        if op == MPI.SUM:
            return obj * self.Get_size()
        raise UsageError(f"a simulated world does not stand in for the reduction {op}")

    # ---- buffers --------------------------------------------------------------------
    def Allgather(self, send, recv) -> None:
        """Every row of ``recv`` is this rank's ``send`` (in place: every block, this rank's block)."""
        if send is MPI.IN_PLACE:
            self._fill(recv)
            return
        src, dst = _bytes(send), _bytes(recv[0] if isinstance(recv, (list, tuple)) else recv)
        dst.reshape(self.Get_size(), src.size)[...] = src

    def Iallgather(self, send, recv) -> Arrived:
        self.Allgather(send, recv)
        return ArrivesWhenWaited(self)

    def _fill(self, spec) -> None:
        """In place: every block of ``spec`` ([buffer, count, datatype] or a buffer) is this rank's."""
        buf = _bytes(spec[0] if isinstance(spec, (list, tuple)) else spec)
        rows = buf.reshape(self.Get_size(), -1)
        rows[...] = rows[self._rank].copy()

    def Alltoall(self, send, recv) -> None:
        """Row r of ``recv`` is what peer r sends this rank: a copy of this rank's own row of ``send``."""
        n = self.Get_size()
        src, dst = _bytes(send).reshape(n, -1), _bytes(recv).reshape(n, -1)
        dst[...] = src[self._rank].copy()

    def Ialltoall(self, send, recv) -> Arrived:
        """:meth:`Alltoall` started (the expert engine's reduce-scatter of sources, comm/sources_reduce.py)."""
        self.Alltoall(send, recv)
        return ArrivesWhenWaited(self)

    def Alltoallv(self, send, recv) -> None:
        """Peer r's block of ``recv`` (counts and displacements in elements of the datatype) is this rank's own
        block of ``send``, repeated or cut to the length peer r sends (``rc[r]``; zeros where this rank sends
        itself nothing). comm/ep_alltoall.py's rows: the counts came first from the mirrors (every peer routes
        as this rank does), so the tokens sent to this rank's experts are exactly its own block; the outputs a
        peer returns from experts this rank does not hold cannot be mirrored, and are this rank's own outputs in
        their place -- the lengths, so the bytes, are the real job's when the routing is."""
        sbuf, (sc, sd), stype = send
        rbuf, (rc, rd), rtype = recv
        unit, me = stype.Get_size(), self._rank
        if rtype.Get_size() != unit:
            raise UsageError("a simulated all-to-allv sends and receives one datatype")
        own = _bytes(sbuf)[int(sd[me]) * unit:(int(sd[me]) + int(sc[me])) * unit].copy()
        dst = _bytes(rbuf)
        for r in range(self.Get_size()):
            block = dst[int(rd[r]) * unit:(int(rd[r]) + int(rc[r])) * unit]
            if not own.size:
                block[...] = 0
            elif block.size:
                block[...] = np.resize(own, block.size)     # repeated, or cut

    def Ialltoallv(self, send, recv) -> Arrived:
        """Each peer's block of ``recv`` (displacements in blocks of the datatype) is a copy of this rank's own
        block of ``send``: what a mirror addresses to this rank. One block per peer, as zerompi sends."""
        sbuf, (_, sd), stype = send
        rbuf, (rc, rd), rtype = recv
        block = stype.Get_size()
        if rtype.Get_size() != block or any(c not in (0, 1) for c in rc):
            raise UsageError("a simulated all-to-all moves one block of one datatype per peer")
        src, dst = _bytes(sbuf), _bytes(rbuf)
        own = src[sd[self._rank] * block:(sd[self._rank] + 1) * block]
        starts = [rd[r] for r in range(self.Get_size()) if rc[r]]
        if starts and starts == list(range(starts[0], starts[0] + len(starts))):   # packed: one broadcast copy
            dst[starts[0] * block:(starts[0] + len(starts)) * block].reshape(len(starts), block)[...] = own
        else:
            for at in starts:
                dst[at * block:(at + 1) * block] = own
        return ArrivesWhenWaited(self)

    def Allreduce(self, send, recv, op=MPI.SUM) -> None:
        """``recv`` = the reduction of N copies of this rank's values (MIN, MAX: themselves; SUM: N times)."""
        if send is not MPI.IN_PLACE:
            _bytes(recv)[...] = _bytes(send)
        if op == MPI.SUM:
            np.multiply(recv, self.Get_size(), out=recv)
        elif op not in (MPI.MIN, MPI.MAX):
            raise UsageError(f"a simulated world does not stand in for the reduction {op}")

    def Bcast(self, buf, root: int = 0) -> None:
        pass                     # this rank holds what the root holds

    # ---- point to point: another stage's message holds zeros -------------------------------------
    # A mirror cannot stand in for a pipeline neighbour (it runs other layers): what arrives from it is
    # an array of zeros of the size posted (activations, their gradients, a tied weight's value), and
    # what this rank sends goes nowhere; both at once. The bytes are counted where they are posted.
    def _peer(self, peer: int, what: str) -> None:
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.Get_size() and peer != self._rank):
            raise UsageError(f"a simulated {what}: peer={peer!r} is not another rank of the {self.Get_size()}")

    def Isend(self, buf, dest: int, tag: int = 0) -> Arrived:
        self._peer(dest, "send")
        return Arrived()

    def Irecv(self, buf, source: int, tag: int = 0) -> Arrived:
        self._peer(source, "receive")
        _bytes(buf)[...] = 0
        return Arrived()

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        self.Isend(buf, dest, tag)

    def Recv(self, buf, source: int, tag: int = 0, status=None) -> None:
        self.Irecv(buf, source, tag)


def check_world_rank(size, rank, node_size=None) -> None:
    """ConfigError (one line, naming the value) unless rank R of N ranks in nodes of K can be simulated."""
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ConfigError(f"simulate_world={size!r} is not allowed; use a number of ranks >= 1")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < size):
        raise ConfigError(f"simulate_rank={rank!r} is out of range; a world of {size} ranks has ranks 0..{size - 1}")
    if node_size is not None and not (isinstance(node_size, int) and node_size >= 1 and size % node_size == 0):
        raise ConfigError(f"node_size={node_size!r} does not divide the {size} simulated ranks; "
                          f"use a divisor of {size}")
