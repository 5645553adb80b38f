"""The train CLI's pipeline flags (--schedule, --schedule-file, --chunks, --pp-grad-reduce, --pp-gather):
the parser's arguments and the PipelineConfig they make (zerompi/pipeline/config.py)."""
from ..errors import check
from ..pipeline.config import PipelineConfig

# PipelineConfig field -> the flag's argparse name
FLAGS = (("schedule", "schedule"), ("schedule_file", "schedule_file"), ("chunks", "chunks"),
         ("grad_reduce", "pp_grad_reduce"), ("gather", "pp_gather"))


def add_flags(p) -> None:
    """The pipeline's flags on the train CLI's parser (beside --pp)."""
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help="with --pp: gpipe, 1f1b (default), interleaved (with --chunks) or zb-h1")
    p.add_argument("--schedule-file", default=None, metavar="FILE",
                   help="with --pp: run the schedule in FILE (one line of actions per stage: docs/pipeline.md)")
    p.add_argument("--chunks", type=int, default=None, metavar="V",
                   help="with --pp --schedule interleaved: model chunks per stage (>= 2)")
    p.add_argument("--pp-grad-reduce", default=None, metavar="micro-batch|step",
                   help="with --pp: reduce each chunk's gradients per micro-batch (default; the same bits as "
                        "without --pp) or once per step (Megatron's; m x less traffic)")
    p.add_argument("--pp-gather", default=None, metavar="micro-batch|step",
                   help="with --pp, stage 3: gather a chunk's parameters per micro-batch (default) or once per "
                        "step, kept until its last backward")


def pipeline_config(a) -> PipelineConfig:
    """The PipelineConfig of the parsed flags ``a``: ConfigError (one line) for a flag given without --pp > 1,
    or --schedule beside --schedule-file."""
    pipe = {field: getattr(a, name) for field, name in FLAGS if getattr(a, name) is not None}
    for field, name in FLAGS:
        flag = "--" + name.replace("_", "-")
        check(field not in pipe or a.pp > 1, f"{flag} {pipe.get(field)} applies with --pp > 1 only; drop it or add --pp")
    check(not ("schedule" in pipe and "schedule_file" in pipe), "--schedule and --schedule-file contradict each "
                                                                "other; give one")
    return PipelineConfig(**pipe)
