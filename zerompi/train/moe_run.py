"""The train job's mixture of experts (--experts): what the MoE blocks routed each step, over the world, and
the run's ``moe`` metrics section and summary row.

Each step the MoE blocks count (models/moe.py's MoEStats) the tokens each expert kept, the assignments dropped
over capacity and the load-balancing loss of every forward pass; ``MoELog.record`` sums them over the ranks (one
small collective) and keeps, per step, the tokens per expert (min / mean / max over the MoE blocks' experts),
the drops and the mean aux loss (E · Σ_e f_e p_e: 1 when balanced).
"""
from typing import List, Optional

import numpy as np


class MoELog:
    """The per-step routing record of ``model`` (a GPT with MoE blocks) over ``comm``'s ranks."""

    def __init__(self, cfg, model, comm):
        self.cfg, self.stats, self.comm = cfg, model.moe_blocks.mlp.stats, comm
        self.blocks = [i for i in range(model.n_layer) if model.is_moe(i)]
        self.steps: List[dict] = []
        self.norms: List[float] = []     # the step's gradient norm over the whole model (nan: skipped)
        self.ep = None                   # train/moe_ep_run.py's ExpertParallel with --ep > 1

    def begin(self) -> None:
        """Forget what ran since the last step (the held-out passes)."""
        self.stats.take()

    def record(self) -> None:
        """The step's routing summed over the ranks (a collective: every rank calls it)."""
        tokens, dropped, aux_sum, passes = self.stats.take()
        E = self.cfg.moe.experts
        per = [tokens.get(b, np.zeros(E, np.int64)) for b in self.blocks]
        local = np.concatenate(per + [np.array([dropped, aux_sum, passes], np.float64)])
        total = self.comm.sum_scalars([float(v) for v in local])
        t = total[:E * len(self.blocks)]
        self.steps.append({"tokens_min": int(t.min()), "tokens_mean": float(t.mean()), "tokens_max": int(t.max()),
                           "dropped": int(total[-3]), "aux_loss": float(total[-2] / max(total[-1], 1.0))})

    def metrics(self) -> dict:
        """The run's ``moe`` section: the settings, and the per-step series of this run's steps."""
        m = self.cfg.moe
        series = {key: [s[key] for s in self.steps] for key in
                  ("tokens_min", "tokens_mean", "tokens_max", "dropped", "aux_loss")}
        return {"experts": m.experts, "top_k": m.top_k, "moe_every": m.moe_every, "moe_blocks": self.blocks,
                "capacity_factor": m.capacity_factor, "aux_coef": m.aux_coef,
                "expert_hidden": m.expert_hidden or 4 * self.cfg.d_model, "ep": m.ep, **series,
                "grad_norms": list(self.norms)}


def metrics(job) -> Optional[dict]:
    """The ``moe`` section of a job's metrics (null without --experts)."""
    log = getattr(job, "moe_log", None)
    return log.metrics() if log is not None else None


def summary(metrics: dict) -> Optional[str]:
    """The MoE row under the communication table (None without --experts)."""
    m = metrics.get("moe")
    if not m or not m["aux_loss"]:
        return None
    tokens = f"{m['tokens_min'][-1]}/{m['tokens_mean'][-1]:.1f}/{m['tokens_max'][-1]}"
    return (f"  {'moe':16} {m['experts']} experts, top-{m['top_k']}, blocks {m['moe_blocks']}: last step's tokens "
            f"per expert min/mean/max {tokens}, dropped {m['dropped'][-1]} (over the run {sum(m['dropped'])}); "
            f"aux loss E·Σf·p {m['aux_loss'][0]:.4f} -> {m['aux_loss'][-1]:.4f} (1 = balanced)")


def banner(cfg) -> Optional[str]:
    """The MoE line of the start-up banner (None without --experts)."""
    m = cfg.moe
    if not m.on:
        return None
    cap = "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor}"
    where = "every block" if m.moe_every == 1 else f"the last block of every {m.moe_every}"
    return (f"  MoE: {m.experts} experts (hidden {m.expert_hidden or 4 * cfg.d_model}) in {where}, top-{m.top_k}, "
            f"{cap}, aux loss x {m.aux_coef}, ep {m.ep}")
