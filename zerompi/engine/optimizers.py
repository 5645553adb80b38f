"""The optimizers the engine can run on its shard, by name: their state rows and how to make one.

Every optimizer keeps a float32 master and rows of state of the same length, slice-aligned with it
(engine/optimizer.py's interface), so that checkpoints save, load and reshard any of them by row
name and the memory formula is ``4 (1 + rows)`` bytes per parameter. MPI-free (the estimate's).
"""
STATE = {
    "adamw": ("exp_avg", "exp_avg_sq"),                  # Adam's moments
    "muon": ("momentum", "exp_avg", "exp_avg_sq"),       # Muon's momentum; AdamW's moments for the non-matrices
}
OPTIMIZERS = tuple(STATE)


def bytes_per_param(name: str) -> int:
    """The optimizer's bytes per parameter: the fp32 master and its state rows."""
    return 4 * (1 + len(STATE[name]))


def sharded_optimizer(layout, config, ledger, slot: int, rank: int, transfers, group):
    """The engine's optimizer for ``config.optimizer`` over its rows (the shard; stage 0: the model)."""
    if config.optimizer == "muon":
        from .muon import ShardedMuon
        return ShardedMuon(layout, config, ledger, slot, rank, transfers, group)
    from .optimizer import ShardedAdamW
    return ShardedAdamW(layout, config, ledger, slot, rank, transfers)
