"""The command line of ``python -m zerompi.estimate``: its options and --from-run.

One concern: turning arguments into a call of :func:`~zerompi.estimate.stages.estimate` (and the sections of
--tp, --sp, --pp, --experts, --replicas). Parses the options (bad input: one line naming the value, exit status
2), prints the table (table.py), and with ``--from-run`` estimates a train run's configuration from its
``--metrics-json`` and puts the measured bytes beside it. No arithmetic about memory lives here.
"""
import argparse
import math
import sys
from typing import List, Optional

from ..checkpoint.outputs import check_file, check_roles, save_json
from ..comm.quantized import DEFAULT_BLOCK
from ..engine import reducer
from ..engine.config import ZeroConfig
from ..errors import EXIT_OUTPUT, ConfigError, OneLineParser, check, quiet_exit_on_closed_stdout
from .activations import GPT_FLAGS, gpt_activations, gpt_layer_sizes, with_activations
from .moe_bytes import MOE_FLAGS
from .fromrun import compare_run, format_compare, read_run, run_estimate
from .stages import DEFAULT_PREFETCH, EXACT_LAYERS, estimate, layers_estimate
from .table import format_table


def parse_count(text: str) -> float:
    """'10e9', '1.3e9', '7B', '350M' -> a number of parameters."""
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 10e9 or 10B")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; write e.g. 10e9 or 10B")
    return value


def parse_finite(text: str) -> float:
    """A float option: a finite number (inf and nan are refused here, with the option's name)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m zerompi.estimate",
                      description="Memory and communication per rank for ZeRO stages 0-3.")
    p.add_argument("--params", type=parse_count, help="Ψ, parameters of the model (10e9, 10B, 350M)")
    p.add_argument("--ranks", type=int, help="N, data-parallel ranks")
    p.add_argument("--dtype", default="fp16", help="fp16, bf16 or fp32 storage of parameters and gradients")
    p.add_argument("--bucket-mb", type=parse_finite, default=ZeroConfig.bucket_mb, help="bucket size in MiB")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--layers", type=int, help="the model has this many layers of equal size")
    shape.add_argument("--largest-layer", type=parse_count, help="parameters of the largest layer")
    p.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH, help="stage-3 buckets gathered ahead")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=None, metavar="K",
                   help="gradient reductions still pending when the next bucket's gradients arrive, at most "
                        f"(default: the engine's cap, {reducer.MAX_PENDING_REDUCES}; 0: the best case)")
    p.add_argument("--no-overlap", action="store_true",
                   help="as zerompi.train --no-overlap: every collective waited for as it starts")
    p.add_argument("--bandwidth-gbps", type=parse_finite, default=100.0, help="link bandwidth, gigabits per second")
    p.add_argument("--latency-us", type=parse_finite, default=5.0, help="latency per message, microseconds")
    p.add_argument("--node-size", type=int, default=None, metavar="K",
                   help="ranks per node (default: all ranks on one node); prints bytes and time per level")
    p.add_argument("--shard-size", type=int, default=None, metavar="S",
                   help="shard the model states over groups of S ranks (whole nodes), replicated across the "
                        "N/S groups (MiCS / hybrid sharding; default: all ranks)")
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ in the stage-3 column: a node-local copy of 1/K of the parameters, the "
                        "backward gathers inside the node")
    p.add_argument("--intra-gbps", type=parse_finite, default=None, help="bandwidth inside a node, Gbit/s "
                                                                         "(default: --bandwidth-gbps)")
    p.add_argument("--inter-gbps", type=parse_finite, default=None, help="bandwidth across nodes, Gbit/s "
                                                                         "(default: --bandwidth-gbps)")
    p.add_argument("--offload-optimizer", default="none", metavar="none|cpu|nvme",
                   help="where the master and Adam moments live (stages 1-3): the table splits the states by place")
    p.add_argument("--offload-params", default="none", metavar="none|nvme", help="stage 3: parameters in files")
    gpt = p.add_argument_group("the GPT's activations (all six together; Ψ and its layers follow from them)")
    for name, what in (("n_layer", "transformer blocks"), ("d_model", "embedding width"),
                       ("n_head", "attention heads"), ("seq_len", "tokens per sequence"),
                       ("batch", "sequences per step over all ranks (train's --batch)"),
                       ("vocab", "vocabulary (zerompi.train: 32 for the generated corpus, 256 for --data)")):
        gpt.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=what)
    gpt.add_argument("--checkpoint-activations", action="store_true", help="as zerompi.train --checkpoint-activations")
    p.add_argument("--tp", type=int, default=1, metavar="K",
                   help="tensor parallelism over K of the --ranks (a GPT given by its six dimensions above): model "
                        "states per rank for the TP split, then ZeRO over N/K; and the TP all-reduce bytes")
    p.add_argument("--sp", type=int, default=1, metavar="K",
                   help="sequence parallelism (DeepSpeed-Ulysses) over K of the --ranks (TP groups; the GPT's six "
                        "dimensions above): activations per rank of a T/K chunk, and the all-to-all bytes per step")
    p.add_argument("--quantize-weights", default=None, metavar="int8",
                   help="ZeRO++ qwZ as zerompi.train's: the parameter gathers travel as int8 blocks (stages 1-3)")
    p.add_argument("--quantize-grads", default=None, metavar="int8|int4",
                   help="ZeRO++ qgZ as zerompi.train's: the gradient reduce-scatters travel quantized")
    p.add_argument("--quant-block", type=int, default=None, metavar="B",
                   help="elements per quantization block (a power of two >= 8)")
    pipe = p.add_argument_group("pipeline parallelism: the schedule's bubble and activations (estimate/pipeline.py)")
    pipe.add_argument("--pp", type=int, default=None, metavar="P",
                      help="pipeline stages: print the bubble fraction and the peak activations of --schedule with "
                           "--micro-batches (alone: not with the memory table's options)")
    pipe.add_argument("--schedule", default=None, metavar="NAME", help="gpipe, 1f1b (default), interleaved or zb-h1")
    pipe.add_argument("--schedule-file", default=None, metavar="FILE", help="a schedule file (docs/pipeline.md)")
    pipe.add_argument("--chunks", type=int, default=None, metavar="V", help="chunks per stage (--schedule interleaved)")
    pipe.add_argument("--costs", default=None, metavar="F,B,W",
                      help="seconds (any unit) of one micro-batch's forward, input-gradient and weight-gradient "
                           "backward on one stage (default 1,1,1)")
    moe = p.add_argument_group("the MoE GPT (with the GPT's six dimensions; estimate/moe_bytes.py, docs/moe.md)")
    moe.add_argument("--experts", type=int, default=None, metavar="E", help="experts per MoE block: dense and "
                     "expert model states apart, and the expert-parallel all-to-all's bytes")
    moe.add_argument("--ep", type=int, default=None, metavar="K", help="expert-parallel ranks (default 1)")
    moe.add_argument("--top-k", type=int, default=None, metavar="K", help="experts each token goes to (default 2)")
    moe.add_argument("--moe-every", type=int, default=None, metavar="K", help="every K-th block is MoE (default 1)")
    moe.add_argument("--expert-hidden", type=int, default=None, metavar="H",
                     help="hidden width of each expert's MLP (default 4 x d_model)")
    moe.add_argument("--shared-experts", type=int, default=None, metavar="S",
                     help="always-on shared experts per MoE block: dense parameters (default 0)")
    p.add_argument("--replicas", action="store_true", help="as zerompi.train --replicas: the host shared memory "
                   "of each rank's in-memory shard replicas (docs/failures.md)")
    p.add_argument("--optimizer", default=None, metavar="adamw|muon", help="the optimizer whose state the table "
                   "prices (default adamw; muon: 16 bytes per parameter, docs/optimizers.md)")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--from-run", metavar="METRICS.json",
                   help="a train run's --metrics-json: estimate its configuration and show measured beside it")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Exit status: 0; 2 with one line on bad input; 1 (EXIT_OUTPUT) with one line when the table
    was printed but --json could not be written; 141, quietly, when stdout was closed (``| head``)."""
    try:
        try:
            a = build_parser().parse_args(argv)
        except SystemExit as e:              # --help: the usage is printed
            sys.stdout.flush()
            return e.code or 0
        check_roles([("json", a.json)], [("from_run", a.from_run), ("schedule_file", a.schedule_file)])
        check_file(a.json, "json")           # both before any work: a path that cannot take the file is bad input
        largest = None if a.largest_layer is None else int(a.largest_layer)
        opts = dict(bucket_mb=a.bucket_mb, prefetch=a.prefetch, micro_batches=a.micro_batches,
                    in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps, latency_us=a.latency_us,
                    overlap=not a.no_overlap, intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps,
                    offload_optimizer=a.offload_optimizer, offload_params=a.offload_params,
                    quantize_weights=a.quantize_weights, quantize_grads=a.quantize_grads,
                    quant_block=DEFAULT_BLOCK if a.quant_block is None else a.quant_block,
                    optimizer=a.optimizer or "adamw")
        check(a.optimizer != "muon" or (a.offload_optimizer, a.offload_params) == ("none", "none"),
              "--offload-optimizer and --offload-params are not available with --optimizer muon yet (Newton-Schulz "
              "needs every bucket's matrices before any is updated); drop one of the two")
        moe_flags = {k: getattr(a, k) for k in ("ep",) + MOE_FLAGS if getattr(a, k) is not None}
        for name, value in moe_flags.items():
            check(a.experts is not None, f"{name}={value!r} (--{name.replace('_', '-')}) applies with --experts "
                                         "only; drop it or add --experts E")
        check(a.quant_block is None or a.quantize_weights or a.quantize_grads,
              f"quant_block={a.quant_block} applies to quantized communication only; add --quantize-weights or "
              "--quantize-grads, or drop --quant-block")
        if any(v is not None for v in (a.pp, a.schedule, a.schedule_file, a.chunks, a.costs)):
            return _pipeline(a, opts)
        topo = {k: v for k, v in (("node_size", a.node_size), ("shard_size", a.shard_size), ("hpz", a.hpz or None))
                if v is not None}
        dims = {k: getattr(a, k) for k in GPT_FLAGS}
        given = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is not None]
        for name in ("tp", "sp"):
            v = getattr(a, name)
            check(v == 1 or a.from_run is None, f"{name}={v} does not apply with --from-run (it reads the run's "
                                                "configuration); drop it")
            check(v >= 1, f"{name}={v} must be a whole number >= 1")
            check(v == 1 or given, f"{name}={v}: give the GPT's dimensions (--n-layer --d-model --n-head --seq-len "
                                   "--batch --vocab) and --ranks, not --params: they decide what each rank holds")
        late = [k for k in ("experts", "optimizer") if getattr(a, k) is not None] + ["replicas"] * a.replicas
        check(not late or a.from_run is None, f"--{late[0] if late else ''} does not apply with --from-run (it reads "
                                              "the run's configuration); drop it")
        check(not given or a.from_run is None, f"{given[0] if given else ''} does not apply with --from-run "
                                               "(it reads the run's configuration); drop it")
        check(not given or len(given) == len(GPT_FLAGS), "the GPT's activations need all of --n-layer --d-model "
              f"--n-head --seq-len --batch --vocab; missing: "
              f"{' '.join('--' + k.replace('_', '-') for k, v in dims.items() if v is None)}")
        check(given or not a.checkpoint_activations, "--checkpoint-activations needs the GPT's dimensions "
                                                     "(--n-layer --d-model --n-head --seq-len --batch --vocab)")
        if given:
            check(a.params is None and a.layers is None and a.largest_layer is None,
                  "give --params (--layers, --largest-layer) or the GPT's dimensions, not both: "
                  "the dimensions give Ψ and its layers")
            check(a.ranks is not None, "give --ranks")
            act = gpt_activations(dims, a.ranks, a.micro_batches, a.checkpoint_activations, a.sp) \
                if a.tp == 1 else None   # with --tp: after the split's checks, below
            sizes = gpt_layer_sizes(a.vocab, a.seq_len, a.d_model, 1)   # each block's size once, not n_layer times
            a.params, largest = sum(sizes) + (a.n_layer - 1) * sizes[1], max(sizes)
        if a.from_run is not None:
            for name, value in (("params", a.params), ("ranks", a.ranks), ("layers", a.layers),
                                ("largest_layer", a.largest_layer)):
                check(value is None, f"{name}={value!r} (--{name.replace('_', '-')}) does not apply with --from-run "
                                     "(the run's configuration is estimated, to compare with what it measured); "
                                     "drop it")
            metrics = read_run(a.from_run)
            try:
                est = run_estimate(metrics, in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps,
                                   latency_us=a.latency_us, intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps,
                                   **topo)
                cmp = compare_run(est, metrics)
            except (KeyError, TypeError, IndexError, AttributeError) as e:
                raise ConfigError(f"from_run={a.from_run!r} is not the --metrics-json of a zerompi.train run "
                                  f"({type(e).__name__}: {e})")
        else:
            tp = sp = moe = None
            world = a.ranks
            if a.experts is not None:    # the MoE GPT: the table's engine layers, dense and expert states apart
                moe = _moe(a, dims, given)
                a.params, largest, act = moe["table_params"], moe["table_largest_layer"], None
            if a.tp != 1:                # the TP split of the GPT's dimensions, then ZeRO over N/K
                from .tp_bytes import gpt_tp
                tp = gpt_tp(a.tp, a.ranks, a.n_layer, a.d_model, a.vocab, a.seq_len, a.batch, a.micro_batches, a.sp,
                            a.checkpoint_activations)
                check(a.n_head % a.tp == 0, f"tp={a.tp} does not divide n_head={a.n_head}")
                act = gpt_activations(dims, tp["dp"], a.micro_batches, a.checkpoint_activations, a.sp, a.tp) \
                    if given and not moe else None   # a TP rank's (its heads, its columns of the split layers)
                if moe:                  # the MoE GPT's: its experts whole on every TP rank (moe_bytes.gpt_moe)
                    tp = dict(tp, params_total=moe["dense_params"] + moe["expert_params"],
                              params_local=moe["table_params"], tp_bytes_per_step=moe["tp_bytes_per_step"],
                              formula=f"{a.micro_batches} micro-batches x (4 x {a.n_layer - moe['moe_blocks']} "
                                      f"dense + 2 x {moe['moe_blocks']} MoE blocks) x 2(K-1)/K x "
                                      f"{tp['rows']}·{a.seq_len}·{a.d_model} x 4 B")
            if a.sp != 1:                # each sequence over K ranks (TP groups); ZeRO over the dp x sp ranks
                from .sp_bytes import gpt_sp
                sp = gpt_sp(a.sp, a.tp, a.ranks, a.n_layer, a.d_model, a.n_head, a.vocab, a.seq_len, a.batch,
                            a.micro_batches, a.checkpoint_activations)
            if tp:
                a.params, a.ranks, largest = tp["params_local"], tp["dp"], moe["table_largest_layer"] if moe else None
            check(a.params is not None and a.ranks is not None, "give --params and --ranks (or --from-run)")
            if given and not tp and a.n_layer <= EXACT_LAYERS:   # the GPT's own layers: the engine's bytes
                sizes = moe["table_layers"] if moe else gpt_layer_sizes(a.vocab, a.seq_len, a.d_model, a.n_layer)
                est = layers_estimate(sizes, a.ranks, a.dtype, opts, topo)
            else:
                est = estimate(a.params, a.ranks, a.dtype, layers=a.layers, largest_layer=largest, **opts, **topo)
            est = with_activations(est, act) if given and act else est
            if moe:
                from .moe_bytes import with_layouts
                est = dict(est, moe=with_layouts(moe, est, opts, topo))
            if a.replicas:               # each rank's shards twice in host shared memory, two steps
                from .replica_bytes import check_replicas, expert_engine, replica_estimate
                ep = moe["ep"] if moe else 1     # --ep without --node-size: the run's nodes (MPI's or the variable)
                refused = {"--shard-size": f"{a.shard_size} with --tp {a.tp}"} if tp and a.shard_size else {}
                if ep > 1 and a.shard_size:
                    refused["--shard-size"] = f"{a.shard_size} with --ep {ep}"
                check_replicas(world, a.node_size or (None if ep > 1 else world), refused)
                est = dict(est, replicas=replica_estimate(est, expert_engine(moe, est["dtype"], opts) if ep > 1
                                                          else None, a.shard_size is not None and
                                                          a.shard_size == a.node_size))
            est = dict(est, tensor_parallel=tp) if tp else est
            est = dict(est, sequence_parallel=sp) if sp else est
            cmp = None
    except ConfigError as e:
        sys.stderr.write(f"zerompi.estimate: error: {e}\n")
        return 2
    except BrokenPipeError:
        return quiet_exit_on_closed_stdout()
    try:
        print(format_table(est))
        if est.get("tensor_parallel"):
            from .tp_bytes import format_tp
            print(format_tp(est["tensor_parallel"]))
        if est.get("sequence_parallel"):
            from .sp_bytes import format_sp
            print(format_sp(est["sequence_parallel"]))
        if est.get("moe"):
            from .moe_bytes import format_moe
            print(format_moe(est["moe"]))
        if est.get("replicas"):
            from .replica_bytes import format_replicas
            print(format_replicas(est["replicas"]))
        if cmp is not None:
            print()
            print(format_compare(cmp, est))
            est = dict(est, from_run=cmp)
        sys.stdout.flush()
    except BrokenPipeError:
        return quiet_exit_on_closed_stdout()
    problem = save_json(a.json, est, "json") if a.json else None
    if problem:
        sys.stderr.write(f"zerompi.estimate: error: {problem}\n")
        return EXIT_OUTPUT
    return 0


def _moe(a, dims: dict, given: list) -> dict:
    """--experts: the run's refusals checked (train/moe/config.py), then the MoE section (moe_bytes.py)."""
    from .moe_bytes import check_moe, gpt_moe
    check(given, f"experts={a.experts}: give the GPT's dimensions (--n-layer --d-model --n-head --seq-len --batch "
                 "--vocab) and --ranks, not --params: they decide the dense and expert parameters")
    ep, top_k, every = a.ep or 1, 2 if a.top_k is None else a.top_k, 1 if a.moe_every is None else a.moe_every
    check_moe(a.experts, ep, top_k, every, a.expert_hidden, a.ranks,
              {"--sp": a.sp != 1, "--checkpoint-activations": a.checkpoint_activations,
               **{f"--{k.replace('_', '-')} (with --tp {a.tp} --ep {ep})": a.tp != 1 and ep > 1 and bool(getattr(a, k))
                  for k in ("node_size", "shard_size", "hpz")},
               "--optimizer muon": a.optimizer == "muon",
               "--offload-optimizer": ep > 1 and a.offload_optimizer != "none",
               "--offload-params": ep > 1 and a.offload_params != "none"},
              {"--quantize-weights": bool(a.quantize_weights), "--quantize-grads": bool(a.quantize_grads)},
              a.shared_experts or 0)
    check(a.ranks % a.tp == 0, f"tp={a.tp} does not divide the {a.ranks} ranks; use a divisor of {a.ranks}")
    check((a.ranks // a.tp) % ep == 0, f"ep={ep} does not divide the {a.ranks // a.tp} data-parallel ranks "
                                       f"({a.ranks} ranks / tp {a.tp}); use a divisor of {a.ranks // a.tp}")
    return gpt_moe(dims, a.ranks, a.experts, ep, top_k, every, a.expert_hidden, a.micro_batches,
                   ZeroConfig(dtype=a.dtype).itemsize, a.shared_experts or 0, a.tp)


PIPELINE_ALONE = ("largest_layer", "from_run", "node_size", "shard_size") + GPT_FLAGS
REPLICAS_WITH_PP = ("node_size",) + GPT_FLAGS       # --pp --replicas: the nodes, and the GPT's chunks
EXPERTS_WITH_PP = ("node_size", "shard_size") + GPT_FLAGS   # --pp --experts: each stage's nodes and shard groups


def _pipeline_moe(a, opts) -> dict:
    """``--pp P --experts E [--ep K]``: each pipeline stage's dense and expert model states (moe_bytes.pipeline_moe)
    for the chunks of the GPT of the six dimensions, in the stage's nodes and shard groups (--node-size,
    --shard-size, --hpz), after the run's refusals (moe_bytes.check_moe)."""
    from ..pipeline import actions, schedules
    from .moe_bytes import check_moe, pipeline_moe
    dims = {k: getattr(a, k) for k in GPT_FLAGS}
    missing = " ".join("--" + k.replace("_", "-") for k, v in dims.items() if v is None)
    check(not missing and a.params is None, f"--pp with --experts {a.experts} needs the GPT's six dimensions (not "
                                            f"--params) and --ranks; missing: {missing or 'none, drop --params'}")
    check(a.ranks is not None, f"--pp with --experts {a.experts} needs --ranks")
    ep, top_k, every = a.ep or 1, 2 if a.top_k is None else a.top_k, 1 if a.moe_every is None else a.moe_every
    check_moe(a.experts, ep, top_k, every, a.expert_hidden, a.ranks, {"--optimizer muon": a.optimizer == "muon"},
              {"--quantize-weights": bool(a.quantize_weights), "--quantize-grads": bool(a.quantize_grads)},
              a.shared_experts or 0)
    s = actions.read(a.schedule_file) if a.schedule_file else \
        schedules.make(a.schedule or "1f1b", a.pp, a.micro_batches, a.chunks or 1)
    check(a.tp == 1 or (a.d_model % a.tp == 0 and a.n_head % a.tp == 0),
          f"tp={a.tp} does not divide d_model={a.d_model} and n_head={a.n_head}; use a divisor of both")
    topo = {"node_size": a.node_size, "shard_size": a.shard_size, "hpz": a.hpz}
    return pipeline_moe(dims, a.ranks, {r: s.chunks_of(r) for r in range(a.pp)}, a.experts, ep, every,
                        a.expert_hidden, a.shared_experts or 0, a.dtype, opts, topo, top_k, a.tp)


def _pipeline_replicas(a, opts) -> dict:
    """``--pp P --replicas``: every rank's replica bytes (replica_bytes.pipeline_replicas) for the chunks of the GPT
    of the six dimensions, or of --params in --layers equal layers, on --ranks in nodes of --node-size."""
    from ..pipeline import actions, schedules
    from .replica_bytes import equal_chunk_sizes, gpt_chunk_sizes, pipeline_replicas
    dims = {k: getattr(a, k) for k in GPT_FLAGS}
    given = [k for k, v in dims.items() if v is not None]
    check(a.ranks is not None, "--pp with --replicas needs --ranks (and the model: the GPT's six dimensions, or "
                               "--params with --layers)")
    missing = " ".join("--" + k.replace("_", "-") for k in GPT_FLAGS if k not in given)
    check(not given or not missing, "the GPT's chunks need all of --n-layer --d-model --n-head --seq-len --batch "
                                    f"--vocab; missing: {missing}")
    check(bool(given) != (a.params is not None), "--pp with --replicas prices the chunks of the GPT of the six "
                                                 "dimensions or of --params with --layers: give one of the two")
    check(given or a.layers is not None, "--pp with --replicas and --params needs --layers (equal layers, cut into "
                                         "equal chunks)")
    s = actions.read(a.schedule_file) if a.schedule_file else \
        schedules.make(a.schedule or "1f1b", a.pp, a.micro_batches, a.chunks or 1)
    if given:
        sizes = gpt_chunk_sizes(a.vocab, a.seq_len, a.d_model, a.n_layer, s.chunks)
    else:
        check(a.params == int(a.params), f"params={a.params:g} must be a whole number of parameters")
        sizes = equal_chunk_sizes(int(a.params), a.layers, s.chunks)
    return pipeline_replicas(sizes, {r: s.chunks_of(r) for r in range(a.pp)}, a.ranks, a.node_size or a.ranks,
                             a.dtype, a.bucket_mb, opts["optimizer"])


def _pipeline(a, opts) -> int:
    """``--pp P``: the schedule's bubble and activations; with --params, --ranks: one stage's table (pipeline.py)."""
    from .pipeline import format_pipeline, parse_costs, pipeline_estimate, stage_estimate
    check(a.pp is not None, "--schedule, --schedule-file, --chunks and --costs need --pp P (the pipeline stages)")
    on = {"--tp": a.tp != 1 and a.experts is None, "--sp": a.sp != 1,      # --tp: the MoE GPT's stages price it
          "--hpz": a.hpz and (a.experts is None or a.replicas), "--checkpoint-activations": a.checkpoint_activations}
    with_pp = REPLICAS_WITH_PP if a.replicas else EXPERTS_WITH_PP if a.experts is not None else ()   # they price them
    alone = [k for k in PIPELINE_ALONE if k not in with_pp]
    other = [f"--{k.replace('_', '-')}" for k in alone if getattr(a, k) is not None] + [f for f in on if on[f]]
    check(not other, f"--pp estimates the schedule, and one stage's table from --params, --ranks and --layers; drop "
                     f"{' '.join(other)} (not estimated per stage)")
    check(not (a.schedule and a.schedule_file), "--schedule and --schedule-file contradict each other; give one")
    est = pipeline_estimate(a.pp, a.micro_batches, a.schedule or "1f1b", a.chunks or 1, a.schedule_file,
                            parse_costs(a.costs) if a.costs else (1.0, 1.0, 1.0))
    if a.params is not None or (a.ranks is not None and not a.replicas and a.experts is None):   # a stage's share
        est = dict(est, stage_table=stage_estimate(a.params, a.ranks, a.layers, a.pp, a.dtype, opts))
        print(format_table(est["stage_table"]))
    print(format_pipeline(est))
    if a.experts is not None:        # the MoE GPT's stages: each chunk's dense and expert engines
        from .moe_bytes import format_pipeline_moe
        est = dict(est, moe=_pipeline_moe(a, opts))
        print(format_pipeline_moe(est["moe"]))
    if a.replicas:                   # every rank's chunks and its source's, in host shared memory, two steps
        from .replica_bytes import format_replicas, pipeline_moe_replicas
        est = dict(est, replicas=pipeline_moe_replicas(est["moe"], a.ranks, a.node_size or a.ranks, opts["optimizer"])
                   if a.experts is not None else _pipeline_replicas(a, opts))
        print(format_replicas(est["replicas"]))
    sys.stdout.flush()
    problem = save_json(a.json, est, "json") if a.json else None
    if problem:
        sys.stderr.write(f"zerompi.estimate: error: {problem}\n")
        return EXIT_OUTPUT
    return 0
