"""The supervisor: a training job that carries on after a lost rank or node; ``python -m zerompi.run``.

Modules:
- supervisor: launch, relaunch from the replicas after a failure, give up with one line; the failure records
- watch: one attempt, watched until it ends or a registered rank dies, then ended whole
- segments: the MPI shared-memory segments that killed jobs leave in /dev/shm, found and removed

May import every room above it (it runs train's job); importing this package imports nothing.
"""
