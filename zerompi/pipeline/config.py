"""PipelineConfig: how the pipeline runs (the schedule, its chunks, where the gradients are reduced).

The mesh's size (``pp``, the stages) is MeshConfig's and zerompi.Mesh's; this says what the stages do.
"""
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..errors import check
from ..flags import flag
from .schedules import NAMES

GRAD_REDUCE = ("micro-batch", "step")
GATHER = ("micro-batch", "step")


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline's knobs; invalid values raise ConfigError (one line)."""

    schedule: str = field(default="1f1b", metadata=flag(
        "with --pp: gpipe, 1f1b (default), interleaved (with --chunks) or zb-h1", metavar="NAME"))
    """One of gpipe, 1f1b, interleaved, zb-h1 (zerompi/pipeline/schedules.py)."""
    chunks: int = field(default=1, metadata=flag(
        "with --pp --schedule interleaved: model chunks per stage (>= 2)", metavar="V"))
    """Model chunks per stage (the interleaved schedule: >= 2; every other: 1)."""
    schedule_file: Optional[str] = field(default=None, metadata=flag(
        "with --pp: run the schedule in FILE (one line of actions per stage: docs/pipeline.md)",
        metavar="FILE"))
    """Run the schedule in this file instead (zerompi/pipeline/actions.py: one line of actions per rank)."""
    grad_reduce: str = field(default="micro-batch", metadata=flag(
        "with --pp: reduce each chunk's gradients per micro-batch (default; the same bits as without --pp) "
        "or once per step (Megatron's; m x less traffic)", name="--pp-grad-reduce", metavar="micro-batch|step"))
    """Where each chunk's gradients are reduced over its data-parallel group: "micro-batch" (as soon as each
    micro-batch's backward of the chunk is done, summed in micro-batch order: the same bits as a run
    without pipelining) or "step" (Megatron's: accumulated locally in fp32 and reduced once after the
    chunk's last micro-batch: m times less data-parallel traffic, a gradient accumulator of 4 bytes per
    parameter, not the same bits)."""
    gather: str = field(default="micro-batch", metadata=flag(
        "with --pp, stage 3: gather a chunk's parameters per micro-batch (default) or once per step, kept "
        "until its last backward", name="--pp-gather", metavar="micro-batch|step"))
    """Stage 3: gather a chunk's parameters for every micro-batch's forward and backward ("micro-batch", as
    without pipelining) or once per step, kept until the chunk's last backward ("step", torchtitan's choice:
    the chunk's whole parameters held through the step, m times fewer gathers)."""

    def __post_init__(self):
        check(self.schedule in NAMES or self.schedule_file is not None,
              f"schedule={self.schedule!r} is not allowed; use one of {', '.join(NAMES)} (or a schedule file)")
        check(isinstance(self.chunks, int) and not isinstance(self.chunks, bool) and self.chunks >= 1,
              f"chunks={self.chunks!r} must be a whole number of model chunks per stage >= 1")
        check(self.schedule_file is None or (isinstance(self.schedule_file, str) and self.schedule_file != ""),
              f"schedule_file={self.schedule_file!r} must be a file's path")
        check(self.grad_reduce in GRAD_REDUCE, f"grad_reduce={self.grad_reduce!r} is not allowed; use "
                                               f"{' or '.join(GRAD_REDUCE)}")
        check(self.gather in GATHER, f"gather={self.gather!r} is not allowed; use {' or '.join(GATHER)}")

    def to_dict(self) -> dict:
        return asdict(self)
