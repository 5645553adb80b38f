"""The train job's model parallelism (--tp, --sp): the Mesh and the groups metered.

The engine runs ZeRO over the mesh's dp x sp ranks (engine/tp_groups.py); the TP models split their
blocks over its TP group (models/gpt.py, models/mlp_tp.py), the SP GPT its sequences over its
SP group (models/gpt_sp.py). train/tp_run.py and train/sp_run.py check and report each.
"""
import numpy as np


def make_mesh(cfg, comm, placement):
    """The Mesh of the job (a collective); its ZeRO group counts into ``comm``'s table."""
    from ..comm.mesh import Mesh
    mesh = Mesh(comm, cfg.mesh.tp, sp=cfg.mesh.sp, node_size=cfg.mesh.node_size)
    return place_mesh(mesh, cfg, placement)


def place_mesh(mesh, cfg, placement):
    """``mesh`` with its ZeRO group's collectives staged for the placement's arrays (comm/staging.py; the host's
    on the CPU) and its pipeline messages received into them; the TP and SP exchanges and the pipeline's sends
    stage device arrays themselves (comm/mesh.py, comm/alltoall.py, comm/p2p.py)."""
    if placement is not None and placement.xp is not np:
        from ..comm.staging import device_communicator
        mesh.zero_comm = device_communicator(mesh.zero_comm, placement.xp, cfg.comm, cfg.zero.timeout_s)
        mesh.pp_comm.xp = placement.xp
    return mesh


def metered_groups(mesh) -> dict:
    """{"tp": TPComm, "sp": SPComm} of the mesh's groups of more than one rank, whose bytes and seconds the
    step loop records per step (around the forward and backward)."""
    if mesh is None:
        return {}
    return {name: c for name, c in (("tp", mesh.tp_comm), ("sp", mesh.sp_comm)) if c.size > 1}
