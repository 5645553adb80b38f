"""Deprecated: the old name of :mod:`zerompi.pipeline.timeline` (a schedule's timeline on per-action costs).

Kept for one release so that ``from zerompi.pipeline import simulate`` still works; it re-exports the
timeline module's names and warns. Import ``zerompi.pipeline.timeline`` instead.
"""
import warnings

from .timeline import Deadlock, Simulation, in_flight, run, unit_costs

__all__ = ["Deadlock", "Simulation", "in_flight", "run", "unit_costs"]

warnings.warn("zerompi.pipeline.simulate is renamed zerompi.pipeline.timeline; the old name goes in the next "
              "release", DeprecationWarning, stacklevel=2)
