"""The run's Muon figures (--optimizer muon): the matrices, Newton-Schulz's time, and the bytes that bring
each matrix to its owner and back, measured beside the plan's count (engine/matrix_owners.py)."""
from typing import Optional


def metrics(job) -> Optional[dict]:
    """The metrics' ``muon`` section: this rank's figures summed over its engines (a pipeline's chunks);
    None unless the run uses Muon."""
    figs = [e.optimizer.figures() for e in job.engines if getattr(e.optimizer, "name", "") == "muon"]
    if not figs:
        return None
    total = {}
    for key in figs[0]:
        values = [f[key] for f in figs]
        total[key] = None if None in values else sum(values)
    return total


def summary(metrics: dict) -> Optional[str]:
    """One line beside the traffic table (rank 0's), or None without Muon."""
    m = metrics.get("muon")
    if m is None:
        return None
    if m["exchange_bytes_per_step"] is None:
        return f"  muon: {m['matrices']} matrices ({m['owned']} orthogonalised here); no step taken"
    return (f"  muon: {m['matrices']} matrices ({m['owned']} orthogonalised here), Newton-Schulz "
            f"{1e3 * m['newton_schulz_s_per_step']:.1f} ms per step; matrices to their owners and back "
            f"{m['exchange_bytes_per_step']:,.0f} bytes per step, formula {m['exchange_bytes_formula']:,} "
            "(its pieces of the others' matrices and the others' pieces of its own, 4 bytes each; "
            "not in the ZeRO rows above)")
