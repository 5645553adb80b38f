"""The train CLI's job: TrainConfig (model, data, schedule; engine knobs in ``zero``) and its flags.

``python -m zerompi.train --help`` lists the flags; ``parse_config`` turns them into a TrainConfig.
"""
import argparse
import os
from dataclasses import dataclass
from typing import List, Optional

from ..engine.config import PROGRESS, ZeroConfig
from ..pipeline.config import PipelineConfig
from ..comm.device import DEVICES
from ..comm.watchdog import default_timeout_s
from ..errors import ConfigError, RankParser, check
from . import pipeline_flags
from .console import PROGRESS_MODES

# --help's description: the train module's docstring, where the parser used to live.
DESCRIPTION = "``mpiexec -n N python -m zerompi.train``: train a built-in model with ZeRO stage 0-3."
MODELS = ("gpt", "mlp")
COMMS = ("mpi", "nccl")   # how device buffers are reduced and gathered (--comm)
# Per-model defaults of the fields left as None: the GPT needs more steps than the MLP's 30 to learn.
MODEL_DEFAULTS = {"gpt": {"steps": 300, "batch": 48, "log_every": 10},
                  "mlp": {"steps": 30, "batch": 64, "log_every": 1}}
# The fields (and flags) that only one model reads: given with the other model, they are an error.
MODEL_ONLY = {"gpt": ("n_layer", "n_head", "d_model", "seq_len", "data", "eval_every", "checkpoint_activations"),
              "mlp": ("width", "depth")}
PATHS = ("data", "metrics_json", "save_dir", "resume", "stop_file")   # path fields: None = not given, never ""
# The parameters each model exempts from weight decay by default (--no-decay replaces them, --decay-all
# drops them): the GPT's biases (".b"), LayerNorm gains (".g") and embeddings, as GPT-2 recipes do.
NO_DECAY = {"gpt": ("wte", "wpe", "*.b", "*.g"), "mlp": ()}
# ZeroConfig fields whose flag has another name:
FLAG_OF_FIELD = {"init_loss_scale": "--loss-scale", "progress": "--comm-progress"}


@dataclass(frozen=True)
class TrainConfig:
    """The training job: model, data and schedule. Engine knobs live in ``zero``."""

    model: str = "gpt"
    """Built-in model: one of MODELS ("gpt": docs/gpt.md; "mlp": a regression toy)."""
    steps: Optional[int] = None
    """Last step of the run (>= 1), counted from step 0: a resumed run stops where a straight run would.
    None = the model's default (MODEL_DEFAULTS)."""
    batch: Optional[int] = None
    """Global batch per step over all ranks (MLP: rows; GPT: sequences of seq_len tokens); must divide
    by ranks x micro-batches. None = the model's default."""
    width: int = 256
    """MLP: features per layer."""
    depth: int = 4
    """MLP: number of Linear+GELU blocks."""
    n_layer: int = 2
    """GPT: transformer blocks (>= 1)."""
    n_head: int = 4
    """GPT: attention heads per block; must divide d_model."""
    d_model: int = 64
    """GPT: channels of the residual stream, i.e. the embedding width (>= 1)."""
    seq_len: int = 64
    """GPT: tokens per sequence, the context length (>= 1)."""
    data: Optional[str] = None
    """GPT: train on this file's bytes (vocab 256, the last 10% held out); None = the generated corpus."""
    eval_every: int = 50
    """GPT: held-out loss every this many steps and after the last one (>= 0; 0 = never)."""
    checkpoint_activations: bool = False
    """GPT: keep only each block's input through the forward, run the block's forward again in its
    backward (the same bits, less activation memory; docs/activations.md)."""
    seed: int = 0
    """Seeds the initial parameters and the generated data."""
    log_every: Optional[int] = None
    """Print a progress line every this many steps. None = the model's default."""
    metrics_json: Optional[str] = None
    """Write the run's metrics as one JSON object to this path (rank 0)."""
    save_dir: Optional[str] = None
    """Write checkpoints under this directory (step_NNNNNN/ and a ``latest`` pointer; docs/checkpoint.md)."""
    save_every: int = 0
    """Save every this many steps (>= 0) and after the last step; 0 = after the last step only. Needs save_dir."""
    resume: Optional[str] = None
    """Resume from this checkpoint (a save_dir, whose ``latest`` is used, or one step_NNNNNN/ directory);
    the world size, stage and bucket size may differ from the saving run's."""
    async_save: bool = False
    """Save the checkpoints of save_every in the background: each rank copies its shard to host memory and
    training goes on while a thread writes it (the last step's save still waits). Needs save_dir."""
    keep_last: Optional[int] = None
    """Keep only the newest this many checkpoints in save_dir (>= 1); None keeps every one. Needs save_dir."""
    overwrite: bool = False
    """Allow a run to save into a save_dir that holds another run's checkpoints (a run without resume, or
    resumed from another folder); they are removed once this run's first checkpoint is saved. Resumed into
    its own folder: remove the checkpoints of later steps than the one resumed from, which are otherwise
    kept. Needs save_dir."""
    device: str = "cpu"
    """Where the engine's buffers and the model's compute live: cpu (NumPy), gpu (CuPy; rank r binds GPU
    local rank mod GPUs) or auto (gpu when CuPy sees one). cpu is the default until the GPU path has
    passed scripts/gpu_check.sh on a GPU."""
    comm: str = "mpi"
    """How device buffers are reduced and gathered: mpi (staged through pinned host buffers on a GPU) or
    nccl (device to device; needs device gpu and one GPU per rank)."""
    progress: str = "auto"
    """How rank 0 shows the steps: bar (redrawn in place), lines (one per logged step) or auto (a bar
    only for a person at a terminal; console.py)."""
    stop_file: Optional[str] = None
    """Stop after the step at which this file appears (as rank 0 sees it), saving a checkpoint when
    save_dir is set, and exit 0: a graceful stop under any launcher. Must not exist at the start."""
    simulate_world: Optional[int] = None
    """Run this one process as one rank of a job of this many ranks, the others stood in for under
    comm/simulated.py's rule: memory and bytes sent are that rank's in the real job, the loss is not a
    real run's. None: a real job of the processes launched."""
    simulate_rank: Optional[int] = None
    """With simulate_world: the rank this process is, 0 .. simulate_world - 1 (None: 0)."""
    zero: ZeroConfig = ZeroConfig()
    """Engine configuration."""
    pipeline: PipelineConfig = PipelineConfig()
    """With zero.pp > 1: the pipeline's schedule and options (zerompi/pipeline/config.py)."""

    def __post_init__(self):
        check(self.model in MODELS, f"model={self.model!r} is not allowed; use one of {', '.join(MODELS)}")
        check(self.device in DEVICES, f"device={self.device!r} is not allowed; use one of {', '.join(DEVICES)}")
        check(self.comm in COMMS, f"comm={self.comm!r} is not allowed; use {' or '.join(COMMS)}")
        check(self.comm == "mpi" or self.device == "gpu",
              f"comm={self.comm!r} needs --device gpu (NCCL moves GPU memory); use --comm mpi on the CPU")
        for name, value in MODEL_DEFAULTS[self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in PATHS:
            check(getattr(self, name) != "", f"{name}='' is an empty path; give a path, or leave --{_flag(name)} out")
        self._check_gpt()
        if self.zero.tp > 1:
            from .tp_run import check_model
            check_model(self)
        if self.zero.sp > 1:
            from .sp_run import check_model as check_sp_model
            check_sp_model(self)
        from .pipeline import check_model as check_pipeline
        check_pipeline(self)
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(isinstance(self.seed, int) and self.seed >= 0,
              f"seed={self.seed!r} must be an integer >= 0 (it seeds NumPy's generators)")
        check(self.batch >= 1, f"batch={self.batch} must be >= 1")
        check(self.width >= 1, f"width={self.width} must be >= 1")
        check(self.depth >= 1, f"depth={self.depth} must be >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        check(isinstance(self.save_every, int) and self.save_every >= 0,
              f"save_every={self.save_every!r} must be an integer >= 0 (steps between checkpoints; 0 = at the end)")
        check(self.save_every == 0 or self.save_dir, f"save_every={self.save_every} needs save_dir (--save-dir DIR)")
        check(self.keep_last is None or (isinstance(self.keep_last, int) and self.keep_last >= 1),
              f"keep_last={self.keep_last!r} must be an integer >= 1 (checkpoints kept; leave it out to keep all)")
        for name in ("async_save", "keep_last", "overwrite"):
            check(getattr(self, name) in (None, False) or self.save_dir,
                  f"{name}={getattr(self, name)!r} needs save_dir (--save-dir DIR)")
        self._check_progress()
        self._check_stop_file()
        self._check_simulation()

    def _check_simulation(self) -> None:
        from .simulated_run import check_config
        check_config(self)

    def world_size(self, processes: int) -> int:
        """The ranks of the job: the ``processes`` launched, or simulate_world (ConfigError unless one was)."""
        if self.simulate_world is None:
            return processes
        check(processes == 1, f"simulate_world={self.simulate_world} runs one process as rank {self.simulate_rank} of "
                              f"{self.simulate_world}, and {processes} were launched; start it as one process (no "
                              "mpiexec, or mpiexec -n 1)")
        return self.simulate_world

    def _check_progress(self) -> None:
        moved = f" (how collectives advance is --comm-progress {self.progress})" if self.progress in PROGRESS else ""
        check(self.progress in PROGRESS_MODES,
              f"progress={self.progress!r} is not allowed; use one of {', '.join(PROGRESS_MODES)}{moved}")

    def _check_stop_file(self) -> None:
        check(self.stop_file is None or not os.path.lexists(self.stop_file),
              f"stop_file={self.stop_file!r} already exists; remove it before starting "
              f"(the job stops after the step at which it appears)")

    def _check_gpt(self) -> None:
        check(self.n_layer >= 1, f"n_layer={self.n_layer} must be >= 1")
        check(self.n_head >= 1, f"n_head={self.n_head} must be >= 1")
        check(self.d_model >= 1, f"d_model={self.d_model} must be >= 1")
        check(self.d_model % self.n_head == 0,
              f"d_model={self.d_model} is not divisible by n_head={self.n_head}; use a multiple of {self.n_head}")
        check(self.seq_len >= 1, f"seq_len={self.seq_len} must be >= 1")
        check(self.eval_every >= 0, f"eval_every={self.eval_every} must be >= 0 (0 = no held-out loss)")
        check(not self.checkpoint_activations or self.model == "gpt",
              "checkpoint_activations=True applies to model gpt only; drop --checkpoint-activations or use --model gpt")
        if self.data is not None:
            from .data import check_file
            check(self.model == "gpt", f"data={self.data!r} applies to model gpt only; drop --data or use --model gpt")
            check_file(self.data, self.seq_len)

    def check_world(self, world_size: int) -> None:
        """Raises ConfigError unless the ranks fit: --tp, --sp, --pp, --node-size (or $ZEROMPI_NODE_SIZE, named
        when it is the culprit) and --shard-size in the user's units (a node size MPI's split gives is checked
        once the ranks have met: preflight.topology_error), and batch splits evenly over the data-parallel
        ranks x micro-batches."""
        from ..comm.topology import check_sizes, node_size_env
        z, t = self.zero, self.zero.tp
        env = node_size_env() if z.node_size is None else None
        check_sizes(world_size, z.node_size or env or t, z.shard_size, t, env=env is not None)
        if z.sp > 1 or z.pp > 1:
            from ..comm.mesh import check_mesh         # sp and pp (tp again: checked above)
            check_mesh(world_size, t, z.pp, z.node_size or env, z.shard_size, sp=z.sp)
        dp = world_size // (t * z.sp * z.pp)
        parts = dp * z.micro_batches
        check(self.batch % parts == 0,
              f"batch={self.batch} does not split over {dp} data-parallel ranks x {z.micro_batches} "
              f"micro-batches; use a multiple of {parts}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = RankParser(prog="python -m zerompi.train", description=DESCRIPTION)
    p.add_argument("--stage", type=int, default=ZeroConfig.stage, help="ZeRO stage 0, 1, 2 or 3")
    p.add_argument("--model", default=TrainConfig.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--dtype", default=ZeroConfig.dtype, help="fp16 (with loss scaling), bf16 or fp32 storage")
    p.add_argument("--bucket-mb", type=float, default=ZeroConfig.bucket_mb, help="bucket size in MiB")
    p.add_argument("--lr", type=float, default=ZeroConfig.lr)
    p.add_argument("--weight-decay", type=float, default=ZeroConfig.weight_decay)
    p.add_argument("--no-decay", action="append", default=None, metavar="PATTERN",
                   help="parameters exempt from weight decay, by name pattern (repeat for more; default: "
                        "gpt: wte, wpe, *.b, *.g (biases, LayerNorm gains, embeddings); mlp: none)")
    p.add_argument("--decay-all", action="store_true", help="decay every parameter (no exemptions)")
    p.add_argument("--micro-batches", type=int, default=ZeroConfig.micro_batches)
    p.add_argument("--clip", type=float, default=ZeroConfig.clip, help="global-norm clip, 0 = off")
    p.add_argument("--loss-scale", type=float, default=None,
                   help=f"fp16 initial loss scale (default {ZeroConfig.init_loss_scale:g})")
    p.add_argument("--loss-scale-window", type=int, default=None,
                   help=f"fp16: good steps before the scale doubles (default {ZeroConfig.loss_scale_window})")
    p.add_argument("--optimizer-impl", default=ZeroConfig.optimizer_impl,
                   help="AdamW step: fused (one-pass kernels), numpy (reference) or auto")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    # The model-specific flags default to None (given or not must be known); TrainConfig has the defaults.
    p.add_argument("--width", type=int, default=None, help=f"MLP: features per layer (default {TrainConfig.width})")
    p.add_argument("--depth", type=int, default=None, help=f"MLP: Linear+GELU blocks (default {TrainConfig.depth})")
    p.add_argument("--n-layer", type=int, default=None, help=f"GPT: transformer blocks (default {TrainConfig.n_layer})")
    p.add_argument("--n-head", type=int, default=None, help=f"GPT: attention heads (default {TrainConfig.n_head})")
    p.add_argument("--d-model", type=int, default=None, help=f"GPT: embedding width (default {TrainConfig.d_model})")
    p.add_argument("--seq-len", type=int, default=None, help=f"GPT: tokens per sequence (default {TrainConfig.seq_len})")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="GPT: train on this file's bytes (default: a generated corpus with a known entropy)")
    p.add_argument("--eval-every", type=int, default=None, metavar="K",
                   help=f"GPT: held-out loss every K steps (0 = never; default {TrainConfig.eval_every})")
    p.add_argument("--checkpoint-activations", action="store_true", default=None,
                   help="GPT: keep only each block's input, recompute the block's forward in its backward")
    p.add_argument("--batch", type=int, default=TrainConfig.batch,
                   help="global batch: MLP rows, GPT sequences (default: gpt 48, mlp 64)")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--metrics-json", default=None, metavar="PATH")
    p.add_argument("--prefetch", type=int, default=ZeroConfig.prefetch,
                   help="stage 3: buckets gathered ahead of the computing layer (0 = off)")
    p.add_argument("--no-overlap", action="store_true",
                   help="wait for every collective as soon as it starts (the serial baseline)")
    p.add_argument("--progress", default=TrainConfig.progress,
                   help="auto (a bar for a person at a terminal, else step lines), bar or lines")
    p.add_argument("--comm-progress", default=ZeroConfig.progress, help="how collectives advance: test or thread")
    p.add_argument("--stop-file", default=None, metavar="PATH",
                   help="stop after the step at which PATH appears, save (with --save-dir) and exit 0")
    p.add_argument("--save-dir", default=None, metavar="DIR", help="write checkpoints here (after the last step)")
    p.add_argument("--save-every", type=int, default=TrainConfig.save_every, metavar="K",
                   help="also save every K steps (needs --save-dir)")
    p.add_argument("--resume", default=None, metavar="DIR", help="resume from a checkpoint (any world size/stage)")
    p.add_argument("--async-save", action="store_true",
                   help="write the --save-every checkpoints in the background while training goes on")
    p.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="keep only the newest K checkpoints in --save-dir (default: all)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another run's checkpoints in --save-dir (else refused); resumed into its own "
                        "folder: the checkpoints of later steps there (else kept)")
    p.add_argument("--device", default=TrainConfig.device,
                   help="cpu (NumPy), gpu (CuPy, GPU local-rank mod GPUs) or auto (gpu when CuPy sees one)")
    p.add_argument("--comm", default=TrainConfig.comm,
                   help="with --device gpu: mpi (staged through pinned host buffers) or nccl (one GPU per rank)")
    p.add_argument("--timeout-s", type=float, default=None, metavar="S",
                   help="abort the job when one collective waits longer (default: $ZEROMPI_TIMEOUT_S or 300)")
    p.add_argument("--max-skipped-steps", type=int, default=None, metavar="K",
                   help=f"fp16: K consecutive steps skipped for non-finite gradients is an error (default "
                        f"{ZeroConfig.max_skipped_steps})")
    p.add_argument("--node-size", type=int, default=None, metavar="K",
                   help="ranks per node (default: $ZEROMPI_NODE_SIZE, else MPI's shared-memory split); "
                        "smaller than the ranks of one machine, it simulates several nodes")
    p.add_argument("--shard-size", type=int, default=None, metavar="K",
                   help="shard the model states over groups of K ranks (whole nodes), replicated across "
                        "the groups (MiCS / hybrid sharding; default: all ranks)")
    p.add_argument("--quantize-weights", default=None, metavar="int8",
                   help="stages 1-3: all-gather the parameters as int8 blocks with a scale each (ZeRO++ qwZ)")
    p.add_argument("--quantize-grads", default=None, metavar="int8|int4",
                   help="reduce-scatter the gradients as int8 or int4 blocks (ZeRO++ qgZ)")
    p.add_argument("--quant-block", type=int, default=None, metavar="B",
                   help=f"elements per quantization block (a power of two >= 8; default {ZeroConfig.quant_block})")
    p.add_argument("--offload-optimizer", default=ZeroConfig.offload_optimizer, metavar="none|cpu|nvme",
                   help="stages 1-3: keep the fp32 master and Adam moments in host memory (cpu) or in files "
                        "under --offload-dir (nvme), updated there bucket by bucket")
    p.add_argument("--offload-params", default=ZeroConfig.offload_params, metavar="none|nvme",
                   help="stage 3: keep the stored parameter shard in a file under --offload-dir")
    p.add_argument("--offload-dir", default=None, metavar="DIR", help="the folder of the offload files (nvme)")
    p.add_argument("--offload-io", default=ZeroConfig.offload_io, metavar="direct|buffered",
                   help="nvme: read and write the optimizer's file with O_DIRECT (direct, the default) or through "
                        "the page cache (buffered)")
    p.add_argument("--offload-delayed-update", action="store_true",
                   help="with --offload-optimizer cpu: run step k's update behind step k+1 (one step stale)")
    p.add_argument("--offload-delayed-warmup", type=int, default=0, metavar="K",
                   help="with --offload-delayed-update: the first K updates are not delayed (warm-up)")
    p.add_argument("--tp", type=int, default=ZeroConfig.tp, metavar="K",
                   help="tensor parallelism: N ranks as N/K data-parallel groups x K adjacent TP ranks; ZeRO "
                        "shards each TP rank's pieces over its data-parallel group (docs/tensor-parallel.md)")
    p.add_argument("--sp", type=int, default=ZeroConfig.sp, metavar="K",
                   help="sequence parallelism (DeepSpeed-Ulysses, the GPT): each sequence cut into K chunks over K "
                        "adjacent ranks (TP groups), an all-to-all before and after attention; ZeRO shards over the "
                        "data- x sequence-parallel ranks (docs/sequence-parallel.md)")
    p.add_argument("--pp", type=int, default=ZeroConfig.pp, metavar="P",
                   help="pipeline parallelism: the model's layers in P stages of N/P ranks (data x tensor "
                        "parallel inside each), micro-batches through them by --schedule (docs/pipeline.md)")
    pipeline_flags.add_flags(p)
    p.add_argument("--hpz", action="store_true",
                   help="stage 3: keep a node-local copy of the parameters after each gather across nodes "
                        "(ZeRO++ hpZ)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write a timeline of every rank's compute and collectives to FILE (Chrome trace-event "
                        "JSON: open it in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--simulate-world", type=int, default=None, metavar="N",
                   help="run this one process as one rank of an N-rank job, the other ranks stood in for (each a "
                        "mirror of this one): memory and bytes sent are that rank's, the loss is not a real run's")
    p.add_argument("--simulate-rank", type=int, default=None, metavar="R",
                   help="with --simulate-world: the rank this process is (default 0)")
    p.add_argument("--trace-steps", type=int, default=None, metavar="K",
                   help=f"with --trace: keep the last K steps (default {ZeroConfig.trace_steps})")
    return p


def parse_config(argv: Optional[List[str]] = None, environ=None) -> TrainConfig:
    """CLI flags -> TrainConfig (raises ConfigError on bad input, HelpRequested on --help).

    Reads ZEROMPI_TIMEOUT_S (from ``environ``, default os.environ) when --timeout-s is not given:
    the job's settings are read when it starts, so a bad value is one line and exit status 2.
    """
    a = build_parser().parse_args(argv)
    timeout_s = a.timeout_s if a.timeout_s is not None else (
        default_timeout_s() if environ is None else default_timeout_s(environ))
    check(not (a.decay_all and a.no_decay), "--decay-all and --no-decay contradict each other; give one")
    no_decay = () if a.decay_all else tuple(a.no_decay) if a.no_decay else NO_DECAY.get(a.model, ())
    given = {field: getattr(a, flag) for field, flag in (("init_loss_scale", "loss_scale"),
             ("loss_scale_window", "loss_scale_window"), ("quant_block", "quant_block"), ("trace_steps", "trace_steps"),
             ("max_skipped_steps", "max_skipped_steps"), ("offload_dir", "offload_dir"))
             if getattr(a, flag) is not None}        # flags that apply in one setting only: checked below
    try:
        zero = ZeroConfig(stage=a.stage, dtype=a.dtype, bucket_mb=a.bucket_mb, lr=a.lr, weight_decay=a.weight_decay,
                          no_decay=no_decay,
                          clip=a.clip, micro_batches=a.micro_batches, **given,
                          optimizer_impl=a.optimizer_impl,
                          overlap=not a.no_overlap, prefetch=a.prefetch,
                          progress=a.comm_progress, timeout_s=timeout_s,
                          node_size=a.node_size, shard_size=a.shard_size, hpz=a.hpz, tp=a.tp, sp=a.sp, pp=a.pp,
                          quantize_weights=a.quantize_weights, quantize_grads=a.quantize_grads,
                          offload_optimizer=a.offload_optimizer,
                          offload_params=a.offload_params, offload_io=a.offload_io,
                          offload_delayed_update=a.offload_delayed_update,
                          offload_delayed_warmup=a.offload_delayed_warmup, trace=a.trace,
                          lazy_publish=True)   # the built-in models read parameters through unshard() every step
    except ConfigError as e:         # ZeroConfig names its fields; say the flag where its name differs
        flag = next((f for field, f in FLAG_OF_FIELD.items() if str(e).startswith(field + "=")), None)
        raise ConfigError(f"{flag}: {e}" if flag else str(e)) from None
    for field, needs, ok in (("init_loss_scale", "--dtype fp16 (bf16 and fp32 use no loss scale)", a.dtype == "fp16"),
                             ("loss_scale_window", "--dtype fp16 (bf16 and fp32 use no loss scale)", a.dtype == "fp16"),
                             ("quant_block", "--quantize-weights or --quantize-grads",
                              bool(a.quantize_weights or a.quantize_grads)),
                             ("trace_steps", "--trace FILE", a.trace is not None),
                             ("max_skipped_steps", "--dtype fp16 (only fp16 skips steps)", a.dtype == "fp16"),
                             ("offload_dir", "--offload-optimizer nvme or --offload-params nvme (the files it holds)",
                              "nvme" in (a.offload_optimizer, a.offload_params))):
        flag = FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        check(field not in given or ok, f"{field}={given.get(field)!r} ({flag}) applies with {needs} only; drop it")
    pipeline = pipeline_flags.pipeline_config(a)
    specific = {}                   # model-specific flags given; the other model's are an error
    for model, names in MODEL_ONLY.items():
        for name in names:
            value = getattr(a, name)
            if value is None:
                continue
            check(a.model not in MODELS or a.model == model,
                  f"{name}={value!r} applies to model {model} only; drop --{_flag(name)} or use --model {model}")
            specific[name] = value
    return TrainConfig(model=a.model, steps=a.steps, batch=a.batch, seed=a.seed,
                       log_every=a.log_every, metrics_json=a.metrics_json, save_dir=a.save_dir,
                       save_every=a.save_every, resume=a.resume, device=a.device, comm=a.comm,
                       progress=a.progress, stop_file=a.stop_file, zero=zero, pipeline=pipeline,
                       async_save=a.async_save, keep_last=a.keep_last, overwrite=a.overwrite,
                       simulate_world=a.simulate_world, simulate_rank=a.simulate_rank, **specific)
