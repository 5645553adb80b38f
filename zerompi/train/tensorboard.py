"""``--tensorboard DIR``: the run's scalars for TensorBoard, written by rank 0 through tensorboardX.

One concern: the event files. Each step: the loss, the learning rate, the gradient norm, the loss
scale, tokens (GPT) or rows (MLP) per second, the step time and its breakdown (the engine's timers),
and memory (the engines' ledger by category and at peak, the process's peak resident set); each
held-out evaluation: the held-out loss. Tags are grouped ``train/``, ``time/``, ``memory/``; the x
axis is the step count (1 after the first step), as the step lines print it. docs/interop.md.
"""
import importlib.util
import resource
import sys

from ..errors import check

PACKAGE = "tensorboardX"


def check_config(cfg) -> None:
    """ConfigError (one line, every rank) unless --tensorboard's writer is installed and DIR can be a folder."""
    if cfg.tensorboard is None:
        return
    check(importlib.util.find_spec(PACKAGE) is not None,
          f"tensorboard={cfg.tensorboard!r} needs the {PACKAGE} package; pip install 'zerompi[hf]' "
          "(or -e '.[hf]' in a checkout)")
    from ..checkpoint.outputs import check_folder
    check_folder(cfg.tensorboard, "tensorboard")


class Board:
    """The writer of rank 0 (``lead``), else nothing: ``step`` after each step, ``held_out``, ``close``."""

    def __init__(self, cfg, lead: bool):
        self.cfg, self.writer = cfg, None
        if cfg.tensorboard is not None and lead:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(logdir=cfg.tensorboard, flush_secs=30)

    def step(self, step: int, loss: float, seconds: float, parts, result, engines) -> None:
        """The scalars of step ``step`` (0-based: written at step + 1)."""
        if self.writer is None:
            return
        cfg, n, add = self.cfg, step + 1, self.writer.add_scalar
        add("train/loss", loss, n)
        add("train/lr", cfg.zero.lr, n)
        add("train/grad_norm", result.grad_norm, n)
        add("train/loss_scale", result.loss_scale, n)
        if cfg.model == "gpt":
            add("train/tokens_per_s", cfg.batch * cfg.seq_len / seconds, n)
        else:
            add("train/rows_per_s", cfg.batch / seconds, n)
        add("time/step_ms", 1e3 * seconds, n)
        for part, value in parts.items():
            add(f"time/{part}_ms", 1e3 * value, n)
        held = {}
        for e in engines:
            for category, nbytes in e.ledger.current.items():
                held[category] = held.get(category, 0) + nbytes
        for category, nbytes in held.items():
            add(f"memory/{category}_bytes", nbytes, n)
        add("memory/engine_peak_bytes", sum(e.ledger.peak_total for e in engines), n)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        add("memory/max_rss_bytes", rss if sys.platform == "darwin" else 1024 * rss, n)

    def held_out(self, step: int, loss) -> None:
        if self.writer is not None and loss is not None:
            self.writer.add_scalar("train/held_out_loss", loss, step + 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
