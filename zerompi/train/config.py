"""The train CLI's job: TrainConfig (model, data, schedule; engine knobs in ``zero``, the ranks in ``mesh``, the
pipeline in ``pipeline``) and its flags, made from the fields of the four (zerompi/flags.py).

``python -m zerompi.train --help`` lists the flags; ``parse_config`` turns them into a TrainConfig.
"""
import argparse
import os
from dataclasses import dataclass, field, replace
from typing import List, Optional

from ..comm.device import DEVICES
from ..comm.meshconfig import MeshConfig
from ..comm.watchdog import default_timeout_s
from ..engine.config import PROGRESS, ZeroConfig
from ..errors import ConfigError, RankParser, check
from ..flags import add_flags, flag, flag_name, given
from ..pipeline.config import PipelineConfig
from .console import PROGRESS_MODES
from .moe.config import MoEConfig, check_given, check_job, check_world

# --help's description: the train module's docstring, where the parser used to live.
DESCRIPTION = "``mpiexec -n N python -m zerompi.train``: train a built-in model with ZeRO stage 0-3."
MODELS = ("gpt", "mlp")
COMMS = ("mpi", "nccl")   # how device buffers are reduced and gathered (--comm)
# Per-model defaults of the fields left as None: the GPT needs more steps than the MLP's 30 to learn.
MODEL_DEFAULTS = {"gpt": {"steps": 300, "batch": 48, "log_every": 10},
                  "mlp": {"steps": 30, "batch": 64, "log_every": 1}}
# The fields (and flags) that only one model reads: given with the other model, they are an error.
MODEL_ONLY = {"gpt": ("n_layer", "n_head", "d_model", "seq_len", "data", "eval_every", "checkpoint_activations",
                     "init_from", "data_format", "token_dtype", "vocab"),
              "mlp": ("width", "depth")}
PATHS = ("data", "metrics_json", "save_dir", "resume", "stop_file",   # path fields: None = not given, never ""
         "init_from", "tensorboard")
# The parameters each model exempts from weight decay by default (--no-decay replaces them, --decay-all
# drops them): the GPT's biases (".b"), LayerNorm gains (".g") and embeddings, as GPT-2 recipes do.
NO_DECAY = {"gpt": ("wte", "wpe", "*.b", "*.g"), "mlp": ()}
MUON_PARAMS = {"gpt": ("*.w",), "mlp": ("*.weight",)}   # --optimizer muon: the hidden matrices (not wte, wpe)
# ... the MoE GPT's (--experts): the attention's and every MLP's, each expert a matrix; not the router's (C, E)
MOE_MUON_PARAMS = ("*.qkv.w", "*.proj.w", "*.fc.w", "*.out.w")


@dataclass(frozen=True)
class TrainConfig:
    """The training job: model, data and schedule. Engine knobs live in ``zero``."""

    model: str = field(default="gpt", metadata=flag(f"one of {', '.join(MODELS)}"))
    """Built-in model ("gpt": docs/gpt.md; "mlp": a regression toy)."""
    steps: Optional[int] = field(default=None, metadata=flag())
    """Last step (>= 1), counted from step 0: a resumed run stops where a straight run would. None: MODEL_DEFAULTS."""
    batch: Optional[int] = field(default=None, metadata=flag(
        "global batch: MLP rows, GPT sequences (default: gpt 48, mlp 64)"))
    """Global batch per step over all ranks; must divide by data-parallel ranks x micro-batches."""
    width: int = field(default=256, metadata=flag("MLP: features per layer (default {default})"))
    depth: int = field(default=4, metadata=flag("MLP: Linear+GELU blocks (default {default})"))
    n_layer: int = field(default=2, metadata=flag("GPT: transformer blocks (default {default})"))
    n_head: int = field(default=4, metadata=flag("GPT: attention heads (default {default})"))
    d_model: int = field(default=64, metadata=flag("GPT: embedding width (default {default})"))
    seq_len: int = field(default=64, metadata=flag("GPT: tokens per sequence (default {default})"))
    data: Optional[str] = field(default=None, metadata=flag(
        "GPT: train on this file's bytes (default: a generated corpus with a known entropy)", metavar="FILE"))
    """GPT: train on this file's bytes (vocab 256, the last 10% held out); None = the generated corpus."""
    eval_every: int = field(default=50, metadata=flag(
        "GPT: held-out loss every K steps (0 = never; default {default})", metavar="K"))
    """GPT: also after the last step."""
    checkpoint_activations: bool = field(default=False, metadata=flag(
        "GPT: keep only each block's input, recompute the block's forward in its backward",
        const=True))
    """The same bits, less activation memory (docs/activations.md)."""
    seed: int = field(default=0, metadata=flag())
    """Seeds the initial parameters and the generated data."""
    log_every: Optional[int] = field(default=None, metadata=flag())
    """Steps between progress lines. None: the model's default."""
    metrics_json: Optional[str] = field(default=None, metadata=flag(metavar="PATH"))
    """Write the run's metrics as one JSON object to this path (rank 0)."""
    save_dir: Optional[str] = field(default=None, metadata=flag(
        "write checkpoints here (after the last step)", metavar="DIR"))
    """Write checkpoints under this directory (step_NNNNNN/ and a ``latest`` pointer; docs/checkpoint.md)."""
    save_every: int = field(default=0, metadata=flag("also save every K steps (needs --save-dir)", metavar="K"))
    resume: Optional[str] = field(default=None, metadata=flag(
        "resume from a checkpoint (any world size/stage)", metavar="DIR"))
    """A save_dir (its ``latest``) or one step_NNNNNN/ directory, of any world size, stage and bucket size."""
    async_save: bool = field(default=False, metadata=flag(
        "write the --save-every checkpoints in the background while training goes on", const=True))
    """Each rank copies its shard to host memory, a thread writes it (the last step's save still waits)."""
    keep_last: Optional[int] = field(default=None, metadata=flag(
        "keep only the newest K checkpoints in --save-dir (default: all)", metavar="K"))
    overwrite: bool = field(default=False, metadata=flag(
        "replace another run's checkpoints in --save-dir (else refused); resumed into its own folder: "
        "the checkpoints of later steps there (else kept)", const=True))
    """The other run's checkpoints (or, resumed into its own folder, the later steps') are removed once this
    run's first checkpoint is saved."""
    device: str = field(default="cpu", metadata=flag(
        "cpu (NumPy), gpu (CuPy, GPU local-rank mod GPUs) or auto (gpu when CuPy sees one)"))
    """Where the buffers and the compute live; cpu is the default until the GPU path passes scripts/gpu_check.sh."""
    comm: str = field(default="mpi", metadata=flag(
        "with --device gpu: mpi (staged through pinned host buffers) or nccl (one GPU per rank)"))
    progress: str = field(default="auto", metadata=flag(
        "auto (a bar for a person at a terminal, else step lines), bar or lines"))
    """How rank 0 shows the steps (console.py)."""
    stop_file: Optional[str] = field(default=None, metadata=flag(
        "stop after the step at which PATH appears, save (with --save-dir) and exit 0", metavar="PATH"))
    """A graceful stop under any launcher (as rank 0 sees the file); it must not exist at the start."""
    simulate_world: Optional[int] = field(default=None, metadata=flag(
        "run this one process as one rank of an N-rank job, the other ranks stood in for (each a "
        "mirror of this one): memory and bytes sent are that rank's, the loss is not a real run's", metavar="N"))
    """The stand-ins follow comm/simulated_world.py's rule. None: a real job of the processes launched."""
    simulate_rank: Optional[int] = field(default=None, metadata=flag(
        "with --simulate-world: the rank this process is (default 0)", metavar="R"))
    init_from: Optional[str] = field(default=None, metadata=flag(
        "GPT: start from this Hugging Face GPT-2 folder (config.json and safetensors; its config sets the model's "
        "sizes), each rank reading only its own shard", metavar="DIR"))
    """train/hf_init.py; docs/interop.md. export-hf (python -m zerompi.checkpoint) writes such a folder."""
    data_format: str = field(default="bytes", metadata=flag(
        "GPT: what --data holds: bytes (each byte a token) or tokens (a flat file of token ids, "
        "python -m zerompi.data prepare's)"))
    token_dtype: Optional[str] = field(default=None, metadata=flag(
        "GPT, --data-format tokens: uint16 (default) or uint32 ids"))
    vocab: Optional[int] = field(default=None, metadata=flag(
        "GPT, --data-format tokens: the vocabulary (default: --init-from's, else the file's largest id + 1)",
        metavar="V"))
    tensorboard: Optional[str] = field(default=None, metadata=flag(
        "write the run's scalars (losses, lr, grad norm, loss scale, throughput, step times, memory) for "
        "TensorBoard into DIR (rank 0; needs tensorboardX: the hf extra)", metavar="DIR"))
    replicas: Optional[str] = field(default=None, metadata=flag(
        "after every step, copy each rank's state to shared memory on its node and on a buddy's node, under this "
        "job name (python -m zerompi.run restores from them after a failure)", metavar="JOB"))
    """train/replicas.py; the name of the job's folder in /dev/shm (letters, digits, '_', '-', '.')."""
    replicas_commit: str = field(default="sync", metadata=flag(
        "with --replicas: sync (each step's copies agreed before the next step: at most 1 step lost on a failure) "
        "or behind (copied and sent behind the next step's compute, agreed after it: at most 2 steps lost)"))
    """train/replicas.COMMITS; checkpoint/replicas.Replicas.commit_behind."""
    zero: ZeroConfig = ZeroConfig()
    """Engine configuration."""
    mesh: MeshConfig = MeshConfig()
    """Tensor, sequence and pipeline parallelism, nodes, shard groups; at its default, ZeroConfig(tp=...)'s."""
    pipeline: PipelineConfig = PipelineConfig()
    moe: MoEConfig = MoEConfig()
    """The GPT's mixture-of-experts blocks (train/moe/config.py); experts=0: none."""

    def __post_init__(self):
        if self.mesh == MeshConfig():
            object.__setattr__(self, "mesh", self.zero.mesh)
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
        check_job(self)                # the MoE's refusals before the GPT's files are read and the parallelisms' checks
        if self.moe.on and self.zero.optimizer == "muon":    # the experts are stacks: each expert a matrix
            from .moe.config import stacked_patterns
            zero = replace(self.zero, muon_stacked=stacked_patterns())
            if "mesh" in vars(self.zero):             # the deprecated ZeroConfig(tp=...) mesh, not a field
                object.__setattr__(zero, "mesh", self.zero.mesh)
            object.__setattr__(self, "zero", zero)
        self._check_gpt()
        if self.mesh.tp > 1:
            from .tp_run import check_model
            check_model(self)
        if self.mesh.sp > 1:
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
        moved = f" (how collectives advance is --comm-progress {self.progress})" if self.progress in PROGRESS else ""
        check(self.progress in PROGRESS_MODES,
              f"progress={self.progress!r} is not allowed; use one of {', '.join(PROGRESS_MODES)}{moved}")
        check(self.stop_file is None or not os.path.lexists(self.stop_file),
              f"stop_file={self.stop_file!r} already exists; remove it before starting "
              f"(the job stops after the step at which it appears)")
        from .simulated_run import check_config
        check_config(self)
        from .tensorboard import check_config as check_tensorboard
        check_tensorboard(self)
        from .replicas import COMMITS
        check(self.replicas_commit in COMMITS,
              f"replicas_commit={self.replicas_commit!r} is not allowed; use {' or '.join(COMMITS)}")
        check(self.replicas_commit == "sync" or self.replicas is not None,
              f"replicas_commit={self.replicas_commit!r} needs replicas (--replicas JOB, or python -m zerompi.run)")
        if self.replicas is not None:
            from .replicas import check_config as check_replicas
            check_replicas(self)

    def world_size(self, processes: int) -> int:
        """The ranks of the job: the ``processes`` launched, or simulate_world (ConfigError unless one was)."""
        if self.simulate_world is None:
            return processes
        check(processes == 1, f"simulate_world={self.simulate_world} runs one process as rank {self.simulate_rank} of "
                              f"{self.simulate_world}, and {processes} were launched; start it as one process (no "
                              "mpiexec, or mpiexec -n 1)")
        return self.simulate_world

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
        from .tokens import check_config as check_tokens, data_vocab
        check_tokens(self)
        if self.init_from is not None:
            from .hf_init import check_init
            check(self.model == "gpt", f"init_from={self.init_from!r} applies to model gpt only")
            check_init(self, data_vocab(self))

    def check_world(self, world_size: int) -> None:
        """ConfigError unless --tp, --sp, --pp, --node-size (or $ZEROMPI_NODE_SIZE, named when it is the culprit)
        and --shard-size fit the ranks (MPI's node split: preflight.topology_error) and batch splits evenly."""
        from ..comm.topology import check_sizes, node_size_env
        m, t, micro = self.mesh, self.mesh.tp, self.zero.micro_batches
        env = node_size_env() if m.node_size is None else None
        check_sizes(world_size, m.node_size or env or t, m.shard_size, t, env=env is not None)
        if m.sp > 1 or m.pp > 1:
            from ..comm.mesh import check_mesh         # sp and pp (tp again: checked above)
            check_mesh(world_size, t, m.pp, m.node_size or env, m.shard_size, sp=m.sp)
        check_world(self, world_size)
        from .moe.stage_experts import check_world as check_stage_ep
        check_stage_ep(self, world_size)               # --pp with --ep: the EP groups inside a stage
        if self.replicas is not None and (m.node_size or env):
            from .replicas import check_nodes
            check_nodes(self, world_size, m.node_size or env)
        dp = world_size // (t * m.sp * m.pp)
        parts = dp * micro
        check(self.batch % parts == 0,
              f"batch={self.batch} does not split over {dp} data-parallel ranks x {micro} "
              f"micro-batches; use a multiple of {parts}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


# ZeroConfig's flags that apply in one setting only (the library takes them anyway): the field, what it needs,
# and whether the ZeroConfig made has that.
APPLIES_WITH = (
    ("init_loss_scale", "--dtype fp16 (bf16 and fp32 use no loss scale)", lambda z: z.dtype == "fp16"),
    ("loss_scale_window", "--dtype fp16 (bf16 and fp32 use no loss scale)", lambda z: z.dtype == "fp16"),
    ("quant_block", "--quantize-weights or --quantize-grads", lambda z: bool(z.quantize_weights or z.quantize_grads)),
    ("trace_steps", "--trace FILE", lambda z: z.trace is not None),
    ("max_skipped_steps", "--dtype fp16 (only fp16 skips steps)", lambda z: z.dtype == "fp16"),
    ("offload_dir", "--offload-optimizer nvme or --offload-params nvme (the files it holds)",
     lambda z: "nvme" in (z.offload_optimizer, z.offload_params)),
    ("muon_params", "--optimizer muon", lambda z: z.optimizer == "muon"))


def build_parser() -> argparse.ArgumentParser:
    """The train CLI's parser: one flag per flagged field of TrainConfig, ZeroConfig, MeshConfig and
    PipelineConfig (zerompi/flags.py), and --decay-all."""
    p = RankParser(prog="python -m zerompi.train", description=DESCRIPTION)
    add_flags(p, TrainConfig)
    add_flags(p, ZeroConfig)
    p.add_argument("--decay-all", action="store_true", help="decay every parameter (no exemptions)")
    add_flags(p, MeshConfig)
    add_flags(p, PipelineConfig)
    add_flags(p, MoEConfig)
    return p


def made(cls, values: dict):
    """``cls(**values)``, its ConfigError naming the flag where the field's name is not the flag's."""
    try:
        return cls(**values)
    except ConfigError as e:
        opt = next((flag_name(cls, f) for f in values if str(e).startswith(f + "=")
                    and flag_name(cls, f) != "--" + _flag(f)), None)
        raise ConfigError(f"{opt}: {e}" if opt else str(e)) from None


def parse_config(argv: Optional[List[str]] = None, environ=None) -> TrainConfig:
    """CLI flags -> TrainConfig (ConfigError, HelpRequested on --help); ZEROMPI_TIMEOUT_S is read from ``environ``
    (default os.environ) without --timeout-s: now, so a bad value is one line and exit status 2."""
    a = build_parser().parse_args(argv)
    job, zero, pipe = given(a, TrainConfig), given(a, ZeroConfig), given(a, PipelineConfig)
    model = job.get("model", TrainConfig.model)
    if "timeout_s" not in zero:
        zero["timeout_s"] = default_timeout_s() if environ is None else default_timeout_s(environ)
    check(not (a.decay_all and "no_decay" in zero), "--decay-all and --no-decay contradict each other; give one")
    zero["no_decay"] = () if a.decay_all else zero.get("no_decay") or NO_DECAY.get(model, ())
    moe = given(a, MoEConfig)
    if zero.get("optimizer") == "muon" and "muon_params" not in zero:
        zero["muon_params"] = MOE_MUON_PARAMS if model == "gpt" and moe.get("experts", 0) else \
            MUON_PARAMS.get(model, ("*",))
    z = made(ZeroConfig, dict(zero, lazy_publish=True))   # the built-in models read parameters through unshard()
    for name, needs, ok in APPLIES_WITH:                  # every step
        opt = flag_name(ZeroConfig, name)
        check(name not in zero or ok(z), f"{name}={zero.get(name)!r} ({opt}) applies with {needs} only; drop it")
    mesh = made(MeshConfig, given(a, MeshConfig))
    for name, value in pipe.items():
        check(mesh.pp > 1, f"{flag_name(PipelineConfig, name)} {value} applies with --pp > 1 only; drop it or add --pp")
    check(not ("schedule" in pipe and "schedule_file" in pipe), "--schedule and --schedule-file contradict each "
                                                                "other; give one")
    pipeline = PipelineConfig(**pipe)
    for owner, names in MODEL_ONLY.items():        # model-specific flags given; the other model's are an error
        for name in (n for n in names if n in job):
            check(model not in MODELS or model == owner, f"{name}={job[name]!r} applies to model {owner} only; "
                                                         f"drop --{_flag(name)} or use --model {owner}")
    check_given(moe)
    if job.get("init_from") and model == "gpt":     # the model's sizes from the folder's config.json
        from .hf_init import apply_sizes
        apply_sizes(job, job["init_from"])
    return TrainConfig(**job, zero=z, mesh=mesh, pipeline=pipeline, moe=made(MoEConfig, moe))
