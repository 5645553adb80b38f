"""The ``cluster`` fixture: nodes as network namespaces on this machine (scripts/cluster.py).

``cluster(nodes)`` makes a cluster of that many nodes and returns it (a scripts/cluster.py
Cluster); every cluster a test made is taken down when the test ends, passed, failed or
interrupted. Where namespaces cannot be made (not root, no CAP_NET_ADMIN, no iproute2) the
test is skipped with the reason. Tests that use it are marked ``cluster``.

At the end of the session, the MPI shared-memory segments that the session's killed jobs left in
/dev/shm are removed (tests/shm.py).
"""
import functools
import sys

import pytest

from tests import shm
from tests.mpirun import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import cluster as harness  # noqa: E402  (scripts/cluster.py)


@functools.lru_cache(maxsize=None)
def _unavailable():
    return harness.unavailable()


@pytest.fixture
def cluster():
    why = _unavailable()
    if why:
        pytest.skip(why)
    made = []

    def make(nodes: int = 2) -> "harness.Cluster":
        c = harness.Cluster(nodes)
        made.append(c)
        return c.up()

    try:
        yield make
    finally:
        for c in made:
            c.down()


@pytest.fixture(scope="session", autouse=True)
def _mpi_segments_swept():
    before = shm.present()
    yield
    shm.sweep(before)
