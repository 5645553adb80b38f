"""MPI's shared-memory segments that killed jobs leave in /dev/shm, swept at the end of a test session.

The rule (only segments that appeared during the session and that no process maps or holds open) is the
supervisor's too: zerompi/run/segments.py.
"""
from zerompi.run.segments import SEGMENT, SHM, held, present, sweep

__all__ = ["SEGMENT", "SHM", "held", "present", "sweep"]
