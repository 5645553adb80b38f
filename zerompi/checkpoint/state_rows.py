"""The optimizer's rows in a checkpoint, by name: an engine's, and those a manifest says its shard files hold.

A shard file is a float32 array (rows, shard_numel), the master first, then the optimizer's state rows
in the order its manifest's ``optimizer.state`` lists them (AdamW: exp_avg, exp_avg_sq; Muon:
momentum, exp_avg, exp_avg_sq), so a load copies each row by its name and a checkpoint of another
optimizer is recognised by ``optimizer.name``.
"""
from typing import Tuple

ROWS = ("master", "exp_avg", "exp_avg_sq")   # AdamW's rows: checkpoints whose manifest names none


def engine_rows(engine) -> Tuple[str, ...]:
    """The rows of ``engine``'s optimizer in its shard files (the master first), by name."""
    return tuple(getattr(engine.optimizer, "row_names", ROWS))


def optimizer_name(engine) -> str:
    """The name of ``engine``'s optimizer, as a manifest records it."""
    return getattr(engine.optimizer, "name", "adamw")


def saved_rows(manifest: dict) -> Tuple[str, ...]:
    """The rows a checkpoint's shard files hold, by name (older checkpoints: AdamW's)."""
    return tuple(manifest.get("optimizer", {}).get("state") or ROWS)
