"""Deprecated: the old name of :mod:`zerompi.comm.simulated_world` (SimulatedWorld, the stand-in communicator).

Kept for one release so that ``from zerompi.comm.simulated import SimulatedWorld`` still works; it
re-exports the module's public names and warns. Use ``zerompi.SimulatedWorld`` (or
``zerompi.comm.simulated_world``) instead.
"""
import warnings

from .simulated_world import RULE, Arrived, ArrivesWhenWaited, SimulatedWorld, check_world_rank

__all__ = ["RULE", "Arrived", "ArrivesWhenWaited", "SimulatedWorld", "check_world_rank"]

warnings.warn("zerompi.comm.simulated is renamed zerompi.comm.simulated_world (zerompi.SimulatedWorld is "
              "unchanged); the old name goes in the next release", DeprecationWarning, stacklevel=2)
