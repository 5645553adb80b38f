"""How rank 0 shows the steps going by: a redrawn bar, or one line per logged step.

``--progress auto``: a bar only for a person at a terminal. isatty() cannot tell under Open MPI's mpirun
(a pseudo-terminal even when its output goes to a file), so a rank it started gets lines, as under MPICH
and Slurm (pipes).
"""
import os
import sys
from typing import Mapping, Optional, TextIO, Tuple

PROGRESS_MODES = ("auto", "bar", "lines")
# Set in every rank by a launcher that hands ranks a pseudo-terminal whatever its own output is:
# Open MPI's mpirun (both its runtimes, ORTE and PRRTE) and PRRTE's own prterun.
PTY_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PRTE_LAUNCHED")


def pty_launcher(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The variable that shows this rank was started by such a launcher, or None."""
    return next((name for name in PTY_LAUNCHER_VARS if name in environ), None)


def choose_progress(mode: str, stream: Optional[TextIO] = None, environ: Mapping[str, str] = os.environ) -> str:
    """"bar" or "lines" for ``--progress mode`` (one of PROGRESS_MODES) on ``stream``
    (default sys.stdout): auto is a bar only on a terminal that no launcher stands behind."""
    if mode != "auto":
        return mode
    stream = sys.stdout if stream is None else stream
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):        # a replaced or closed stream
        terminal = False
    return "bar" if terminal and pty_launcher(environ) is None else "lines"


def step_line(step: int, steps: int, loss: float, extra: str, result, seconds: float, parts: str, bar: bool) -> str:
    """The logged line of step ``step`` (0-based) of ``steps`` (``parts``: the time's breakdown, or "")."""
    skipped = " (skipped: overflow)" if result.skipped else ""
    lead = "\r\033[K" if bar else ""
    return (f"{lead}step {step + 1:5d}/{steps}  loss {loss:.6f}{extra}  scale {result.loss_scale:g}  norm "
            f"{result.grad_norm:.4g}  {seconds * 1e3:.1f} ms{f' ({parts})' if parts else ''}{skipped}")


def stopped_line(cfg, stop, step: int) -> str:
    """What rank 0 prints when a stop signal (or the stop file) ended the run after step ``step`` (0-based)."""
    saved = f"checkpoint saved in {cfg.save_dir}" if cfg.save_dir else "no checkpoint (no --save-dir)"
    return (f"zerompi.train: stopped by {stop.received or 'a signal on another rank'} after step {step + 1} of "
            f"{cfg.steps}; {saved}")


def progress_bar(done: int, total: int, width: int = 30) -> str:
    """``[#######.......]  45%`` for a terminal."""
    fill = width * done // total
    return f"[{'#' * fill}{'.' * (width - fill)}] {100 * done // total:3d}%"


def evaluates(cfg, step: int, stopping: bool) -> bool:
    """Whether the held-out loss follows step ``step`` (0-based): every --eval-every steps, the last, a stop."""
    return bool(cfg.eval_every) and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1 or stopping)


def show_step(show, cfg, step: int, loss: float, extra: str, result, seconds: float, parts: str, bar: bool,
              evaluated: bool) -> None:
    """The step's line (every --log-every steps, the last one, one with a held-out loss), else the bar redrawn."""
    if step % cfg.log_every == 0 or step == cfg.steps - 1 or evaluated:
        show(step_line(step, cfg.steps, loss, extra, result, seconds, parts, bar))
    elif bar:
        show(f"\r{progress_bar(step + 1, cfg.steps)}  loss {loss:.4f}", end="")


def after_step(show, cfg, saves, stop, step: int, stopping: bool) -> bool:
    """The step's checkpoint (saves.after_step), and the stop line when a signal ends the run here: True then."""
    saves.after_step(step + 1, stopping)
    if stopping:
        show(stopped_line(cfg, stop, step))
    return stopping


def held_out(log, step: int, result, none: str) -> Tuple[str, str]:
    """(the step line's held-out part, a note or "") for ``result`` (data.HeldOut), kept in ``log``; no row on any
    rank: no field, and the first time a note saying so (``none``: why)."""
    first = log.val_rows is None
    log.val_rows = result.rows
    if result.loss is None:
        return "", f"  note: no held-out loss: {none}" if first else ""
    log.val_losses.append([step + 1, result.loss])
    return f"  val {result.loss:.4f} ({result.rows} row{'' if result.rows == 1 else 's'})", ""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n:.2f} TiB"
