"""Splitting a communicator into groups whose colors are a function of the rank.

MPI_Comm_split takes each rank's own color; every group zerompi builds (nodes, shard groups and
their replicas, the tensor- and data-parallel groups of a Mesh) has a color computed from the
rank, so :func:`split` takes that function. MPI is given this rank's color; a simulated world
(comm/simulated_world.py), one process standing in for every rank, evaluates it for all of them to
know which ranks share this one's group.
"""
from typing import Callable


def split(mpi_comm, color_of: Callable[[int], int]):
    """The sub-communicator of the ranks of ``mpi_comm`` whose ``color_of(rank)`` (rank in ``mpi_comm``)
    is this rank's, in rank order (a collective)."""
    by_rule = getattr(mpi_comm, "split_by", None)
    if by_rule is not None:
        return by_rule(color_of)
    rank = mpi_comm.Get_rank()
    return mpi_comm.Split(color_of(rank), rank)
