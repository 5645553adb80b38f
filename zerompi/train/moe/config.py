"""The GPT's mixture-of-experts settings (MoEConfig, held by TrainConfig) and the compositions the MoE refuses.

``--experts E`` (0: the dense GPT) puts a routed MLP of E experts in every ``--moe-every``-th block: a router
(softmax over the experts, top-k, renormalised weights), dropless unless ``--capacity-factor`` is given, and
the Switch/GShard load-balancing loss times ``--aux-coef``. moe/mlp.py has the mathematics, docs/moe.md the
design and what is built.
"""
from dataclasses import dataclass, field
from typing import Optional

from ...errors import check
from ...flags import flag, flag_name


@dataclass(frozen=True)
class MoEConfig:
    """The MoE MLP of the GPT's blocks; ``experts == 0``: none (the dense GPT)."""

    experts: int = field(default=0, metadata=flag("GPT: experts per MoE block (0 = the dense MLP; default {default})",
                                                   metavar="E"))
    top_k: int = field(default=2, metadata=flag("with --experts: experts each token goes to (default {default})",
                                                 metavar="K"))
    moe_every: int = field(default=1, metadata=flag(
        "with --experts: every K-th block is MoE, the others dense (default {default}: all)", metavar="K"))
    capacity_factor: Optional[float] = field(default=None, metadata=flag(
        "with --experts: each expert takes at most ceil(f x tokens x top_k / experts) of a micro-batch's "
        "tokens, the rest dropped and counted (default: dropless)", metavar="F"))
    aux_coef: float = field(default=0.01, metadata=flag(
        "with --experts: coefficient of the load-balancing loss E x sum_e f_e p_e (default {default})"))
    expert_hidden: Optional[int] = field(default=None, metadata=flag(
        "with --experts: hidden width of each expert's MLP (default 4 x d_model)", metavar="H"))
    ep: int = field(default=1, metadata=flag("with --experts: expert-parallel ranks (default {default})",
                                             metavar="K"))
    bias_update: float = field(default=0.0, metadata=flag(
        "with --experts: aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the router's probabilities "
        "for the top-k choice only, moved by this much towards balance after each step (default {default}: off)",
        metavar="G"))
    shared_experts: int = field(default=0, metadata=flag(
        "with --experts: always-on shared expert MLPs per MoE block (DeepSeek): every token goes through each, "
        "summed with the routed output, no router weight (default {default}: none)", metavar="S"))

    def __post_init__(self):
        check(isinstance(self.experts, int) and self.experts >= 0,
              f"experts={self.experts!r} must be an integer >= 0 (0 = the dense MLP)")
        check(isinstance(self.top_k, int) and self.top_k >= 1, f"top_k={self.top_k!r} must be an integer >= 1")
        check(self.experts == 0 or self.top_k <= self.experts,
              f"top_k={self.top_k} is more than experts={self.experts}; use a top_k of at most {self.experts}")
        check(isinstance(self.moe_every, int) and self.moe_every >= 1,
              f"moe_every={self.moe_every!r} must be an integer >= 1")
        check(self.capacity_factor is None or self.capacity_factor > 0,
              f"capacity_factor={self.capacity_factor} must be > 0 (leave --capacity-factor out for dropless)")
        check(self.aux_coef >= 0, f"aux_coef={self.aux_coef} must be >= 0")
        check(self.expert_hidden is None or (isinstance(self.expert_hidden, int) and self.expert_hidden >= 1),
              f"expert_hidden={self.expert_hidden!r} must be an integer >= 1")
        check(isinstance(self.ep, int) and self.ep >= 1, f"ep={self.ep!r} must be an integer >= 1")
        check(isinstance(self.shared_experts, int) and self.shared_experts >= 0,
              f"shared_experts={self.shared_experts!r} must be an integer >= 0 (0 = none)")
        check(self.bias_update >= 0, f"bias_update={self.bias_update} must be >= 0 (0 = off)")
        check(self.experts == 0 or self.experts % self.ep == 0,
              f"experts={self.experts} is not divisible by ep={self.ep}; each expert-parallel rank holds "
              f"experts / ep of them, so use a divisor of {self.experts}")

    @property
    def on(self) -> bool:
        return self.experts > 0


def stacked_patterns() -> tuple:
    """ZeroConfig.muon_stacked of an MoE run: the routed and shared experts' parameters, stacked over the experts
    (each expert's weight a matrix of its own for Muon, its bias a vector)."""
    from .mlp import EXPERT_KEYS, SHARED_KEYS
    return tuple("*." + k for k in EXPERT_KEYS + SHARED_KEYS)


def check_given(given: dict) -> None:
    """ConfigError unless the MoE flags other than --experts come with --experts > 0."""
    if given.get("experts", 0):
        return
    for name, value in given.items():
        if name != "experts":
            check(False, f"{name}={value!r} ({flag_name(MoEConfig, name)}) applies with --experts > 0 only; "
                         "drop it or add --experts E")


def check_job(cfg) -> None:
    """ConfigError (one line, naming the flag) where the MoE meets what it does not compose with yet."""
    moe = cfg.moe
    if not moe.on:
        return
    check(cfg.model == "gpt", f"experts={moe.experts} applies to model gpt only (the MoE replaces the GPT's MLP); "
                              "drop --experts or use --model gpt")
    check(cfg.init_from is None, f"--init-from with --experts {moe.experts} is not supported yet (docs/moe.md); "
                                 "drop one of the two")
    if moe.ep > 1:
        z = cfg.zero
        for name, given in (("--quantize-weights", bool(z.quantize_weights)),
                            ("--quantize-grads", bool(z.quantize_grads))):
            check(not given, f"{name} with --ep {moe.ep} is not supported yet (docs/moe.md); drop one of the two")


def check_world(cfg, world_size: int) -> None:
    """ConfigError unless --ep divides the ranks (with --tp, the data-parallel ranks of each TP rank)."""
    ep, tp = cfg.moe.ep, cfg.mesh.tp
    dp = world_size // tp
    ranks = f"{world_size} ranks" if tp == 1 else f"{dp} data-parallel ranks ({world_size} ranks / tp {tp})"
    check(not cfg.moe.on or dp % ep == 0,
          f"ep={ep} does not divide the {ranks}; the ranks form groups of ep that hold all the experts, "
          f"so use a divisor of {dp}")


def moe_spec(cfg):
    """moe/mlp.py's MoESpec of cfg (the hidden width resolved), or None for the dense GPT."""
    m = cfg.moe
    if not m.on:
        return None
    from .mlp import MoESpec
    return MoESpec(m.experts, m.top_k, m.expert_hidden or 4 * cfg.d_model, m.moe_every, m.capacity_factor,
                   m.aux_coef, m.bias_update, m.shared_experts)
