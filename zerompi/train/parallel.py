"""The train job's model parallelism (--tp, --sp): the Mesh and the groups metered.

The engine runs ZeRO over the mesh's dp x sp ranks (engine/tp_groups.py); the TP models split their
blocks over its TP group (models/gpt.py, models/mlp_tp.py), the SP GPT its sequences over its
SP group (models/gpt_sp.py). train/tp_run.py and train/sp_run.py check and report each.
"""
import numpy as np

from ..errors import ConfigError


def make_mesh(cfg, comm, placement):
    """The Mesh of the job (a collective); its ZeRO group counts into ``comm``'s table."""
    from ..comm.mesh import Mesh
    if placement is not None and placement.xp is not np:
        flag = f"tp={cfg.mesh.tp}" if cfg.mesh.tp > 1 else f"sp={cfg.mesh.sp}"
        raise ConfigError(f"{flag} runs on the CPU only for now; use --device cpu")
    return Mesh(comm, cfg.mesh.tp, sp=cfg.mesh.sp, node_size=cfg.mesh.node_size)


def metered_groups(mesh) -> dict:
    """{"tp": TPComm, "sp": SPComm} of the mesh's groups of more than one rank, whose bytes and seconds the
    step loop records per step (around the forward and backward)."""
    if mesh is None:
        return {}
    return {name: c for name, c in (("tp", mesh.tp_comm), ("sp", mesh.sp_comm)) if c.size > 1}
