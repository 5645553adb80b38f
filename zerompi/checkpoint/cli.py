"""Offline checkpoint tools: consolidate the shards into full parameters, and inspect a manifest.

One concern: reading a finished checkpoint in one process, without MPI (so no collective
and no watchdog). Run through ``python -m zerompi.checkpoint`` (checkpoint/collective.py calls
:func:`main`)::

    python -m zerompi.checkpoint consolidate DIR OUT.npz   # full fp32 parameters by name
    python -m zerompi.checkpoint inspect DIR               # the manifest as a table, every checksum verified
    python -m zerompi.checkpoint export-hf DIR OUT_DIR     # a GPT as Hugging Face GPT-2 (hf_export.py)

Exit status 0 (``--help`` too), or 2 with one line ``zerompi.checkpoint: error: ...`` on bad
input (``inspect`` of a damaged checkpoint: the table, then that line naming every damaged
file); quietly 141 when stdout is closed under it (``inspect DIR | head -1``).
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError, OneLineParser, quiet_exit_on_closed_stdout
from .format import F32, MANIFEST_SHA, PP_FOLDER, CheckpointError, entry_kind, read_manifest, resolve, verify_shard
from .outputs import check_file, check_roles, write_atomic
from .parts import ep_parts, part_folders, tp_parts
from .state_rows import saved_rows
from .pointer import complete_checkpoints
from .savedir import folders_read, pointer_notes


def consolidate(path: str, out: str, state: bool = False) -> Dict[str, np.ndarray]:
    """Write the full fp32 parameters by name to ``out`` (.npz) and return them; ``state``: also the
    optimizer's state rows, by the manifest's names, as ``ROW/NAME`` (``exp_avg/wte``, ``momentum/...``).

    Shards are checksummed, then read one at a time (memory-mapped, master row only): peak
    memory is the output plus a read buffer. ``out`` is written under a temporary name and
    renamed, and may not lie inside the checkpoint; it must be a new path or a regular file
    (checked before any shard is read: never a folder or a device such as /dev/full).
    A tensor-parallel save directory (``tp{r}-of-{K}`` folders, engine/tp_groups.py) is merged:
    every TP rank's pieces put together, the same names and shapes as a run without TP; a
    pipelined one (``pp{c}-of-{C}`` folders, one per model chunk, each possibly with TP folders)
    is the union of its chunks' parameters: the names and shapes of a run without --pp. An expert-parallel
    save's ``ep{j}-of-{K}`` parts (beside the save's, or each pipeline chunk's, dense checkpoint; with TP beside
    TP rank 0's, whose experts every TP rank holds) are joined on the expert axis: an --ep 1 run's names and shapes.
    """
    check_roles([("out", out)], folders_read("dir", path))    # not inside what is read, its save folder included
    check_file(out, "out")
    chunks = part_folders(path, PP_FOLDER, "pipeline")
    wholes = [(c, tp_parts(c)) for c in chunks] if chunks else [(path, tp_parts(path))]
    params: Dict[str, np.ndarray] = {}
    steps = {}
    for where, parts in wholes:
        found = [resolve(p) for p in (parts or [where])]
        pieces = [_params(ckpt) for ckpt in found]
        steps[where] = pieces[0][1]["step"]
        got = _merge_tp(found, pieces) if parts else pieces[0][0]
        for k, row in enumerate(saved_rows(pieces[0][1])[1:] if state else (), 1):
            rows = [_params(ckpt, k) for ckpt in found]
            got.update({f"{row}/{n}": v for n, v in (_merge_tp(found, rows) if parts else rows[0][0]).items()})
        eps = ep_parts(found[0], pieces[0][1]) if chunks or parts else []
        if eps:   # a pipelined or TP --ep save: the EP parts beside the (first TP rank's) dense checkpoint: with --tp
            # each TP rank holds the same experts (replicated), TP rank 0's are taken
            got = _in_model_order(got, _merge_ep(where, eps, steps[where],
                                                 saved_rows(pieces[0][1])[1:] if state else ()))
        twice = sorted(set(got) & set(params))
        if twice:
            raise CheckpointError(f"{where}: parameters {twice[:3]} are in two pipeline chunks' checkpoints")
        params.update(got)
    dense = resolve(path) if not chunks and not wholes[0][1] else None    # no pipeline or TP parts
    manifest = read_manifest(dense)[0] if dense else {}
    if ep_parts(dense, manifest) if dense else []:   # an expert-parallel save: each EP rank's experts, joined
        params = _in_model_order(params, _merge_ep(path, ep_parts(dense, manifest), steps[path],
                                                   saved_rows(manifest)[1:] if state else ()))
    if len(set(steps.values())) > 1:
        raise CheckpointError(f"{path}: the pipeline chunks' checkpoints are of different steps ("
                              + ", ".join(f"{os.path.basename(w)}: step {s}" for w, s in steps.items())
                              + "); consolidate checkpoints of one step")
    write_atomic(out, lambda f: np.savez(f, **params))
    return params


def _in_model_order(dense: Dict[str, np.ndarray], experts: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Both, each block's experts right after that block's last dense parameter (an --ep 1 run's order, whose
    concatenation hashes to its final_params_sha256); state rows (``ROW/NAME``) last."""
    out: Dict[str, np.ndarray] = {}
    block = lambda n: n.split(".", 1)[0]                          # noqa: E731
    masters = [n for n in dense if "/" not in n]
    for i, name in enumerate(masters):
        out[name] = dense[name]
        if i + 1 == len(masters) or block(masters[i + 1]) != block(name):
            out.update({n: v for n, v in experts.items() if "/" not in n and block(n) == block(name)})
    out.update({n: v for n, v in experts.items() if "/" not in n and n not in out})
    out.update({n: v for n, v in dense.items() if "/" in n})
    out.update({n: v for n, v in experts.items() if "/" in n})
    return out


def _merge_ep(path: str, parts, step: int, rows) -> Dict[str, np.ndarray]:
    """The experts of every EP rank's part (``ep{j}-of-{K}``) joined on the expert axis, as an --ep 1 run names
    them; ``rows``: also these state rows (``ROW/NAME``)."""
    found = [resolve(p) for p in parts]         # each part's checkpoint of the dense one's name
    pieces = [_params(ckpt) for ckpt in found]
    if any(m["step"] != step for _, m in pieces):
        raise CheckpointError(f"{path}: its expert-parallel parts are of other steps than its dense checkpoint "
                              f"(step {step}: " + ", ".join(f"{os.path.basename(p)} step {m['step']}"
                                                            for p, (_, m) in zip(parts, pieces))
                              + "); consolidate checkpoints of one step")
    got = {name: np.concatenate([p[name] for p, _ in pieces]) for name in pieces[0][0]}
    for k, row in enumerate(rows, 1):
        more = [_params(ckpt, k)[0] for ckpt in found]
        got.update({f"{row}/{name}": np.concatenate([p[name] for p in more]) for name in more[0]})
    return got


def _merge_tp(ckpts, pieces) -> Dict[str, np.ndarray]:
    """The full parameters from every TP rank's (params, manifest), checking that they belong together."""
    from ..comm.tp_pieces import merge
    infos = [m["extra"].get("tensor_parallel") for _, m in pieces]
    steps = {m["step"] for _, m in pieces}
    if any(i is None for i in infos) or [i["rank"] for i in infos] != list(range(len(pieces))) or len(steps) > 1:
        raise CheckpointError(f"{ckpts[0]}: the tensor-parallel pieces do not belong to one checkpoint "
                              f"(steps {sorted(steps)})")
    split = infos[0]["split"]
    first = pieces[0][0]
    return {name: merge([p[name] for p, _ in pieces], *split[name]) if name in split else first[name]
            for name in first}


def _params(ckpt: str, row: int = 0):
    """(the fp32 parameters by name, the manifest) of one ordinary checkpoint; ``row``: another of its rows
    (state_rows.py), by parameter name."""
    manifest, saved = read_manifest(ckpt)
    paths = [verify_shard(ckpt, manifest, r) for r in range(saved.world_size)]
    params = {name: np.empty(pr.shape, F32) for name, pr in saved.params.items()}
    for r, shard_path in enumerate(paths):
        master = np.load(shard_path, mmap_mode="r")[row]
        for bucket, members in zip(saved.buckets, saved.bucket_params):
            lo, hi = bucket.slice_bounds(r)
            for pr in members:
                a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                if a < z:
                    src = bucket.shard_start + a - lo
                    params[pr.name].reshape(-1)[a - pr.bucket_offset:z - pr.bucket_offset] = master[src:src + z - a]
        del master
    return params, manifest


def inspect(path: str) -> Tuple[str, List[str]]:
    """The manifest of the checkpoint ``path`` names, as a table, with every checksum verified:
    (the table, the problems found). A damaged manifest raises CheckpointError."""
    ckpt = resolve(path)
    m, saved = read_manifest(ckpt)           # checks the manifest's own sha256 (format 2)
    opt, sc = m["optimizer"], m["loss_scaler"]
    own = "sha256 verified" if MANIFEST_SHA in m else "no checksum of its own (format 1)"
    lines = [f"checkpoint {ckpt}  ({m['format']} v{m['format_version']}; manifest {own})",
             f"  step {m['step']} (optimizer updates {opt['step']}), world size {m['world_size']}, "
             f"stage {m['stage']}, dtype {m['dtype']}, {m['params_numel']:,} parameters, "
             f"shard {m['shard_numel']:,} elements",
             f"  loss scale {sc['scale']:g} (good steps {sc['good_steps']}); optimizer {opt['name']} "
             f"lr {opt['lr']:g} betas ({opt['beta1']:g}, {opt['beta2']:g}) eps {opt['eps']:g} "
             f"weight decay {opt['weight_decay']:g}",
             "  config: " + " ".join(f"{k}={v}" for k, v in m["config"].items())]
    if m["extra"]:
        lines.append("  extra: " + json.dumps(m["extra"], sort_keys=True))
    w = max(len("parameter"), *(len(n) for n in saved.params))
    lines.append(f"  {'parameter':<{w}}  {'shape':>14} {'numel':>12} {'bucket':>6} {'start':>12}")
    for pr in saved.params.values():
        shape = "x".join(str(d) for d in pr.shape)
        lines.append(f"  {pr.name:<{w}}  {shape:>14} {pr.numel:>12,} {pr.bucket:>6} {pr.start:>12,}")
    lines.append(f"  {'bucket':>6} {'start':>12} {'numel':>12} {'used':>12} {'slice':>10} {'shard_start':>12}  layers")
    for b in saved.buckets:
        lines.append(f"  {b.index:>6} {b.start:>12,} {b.numel:>12,} {b.used:>12,} {b.slice_numel:>10,} "
                     f"{b.shard_start:>12,}  {','.join(m['layer_names'][i] for i in b.layers)}")
    lines.append(f"  {'shard':<16} {'bytes':>14}  {'checksum':<17}  verified")
    problems = []
    for r, s in enumerate(m["shards"]):
        try:
            verify_shard(ckpt, m, r)
            verdict = "ok"
        except CheckpointError as e:
            problems.append(str(e))
            verdict = "DAMAGED"
        kind = entry_kind(s)
        lines.append(f"  {s['file']:<16} {s['bytes']:>14,}  {kind} {s[kind][:10]:<10}  {verdict}")
    for part in ep_parts(ckpt, m):             # an expert-parallel save: each EP rank's experts beside it
        try:
            pm, psaved = read_manifest(part)
            for r in range(psaved.world_size):
                verify_shard(part, pm, r)
            verdict = f"step {pm['step']}, {len(psaved.params)} parameters, {psaved.world_size} shards: verified"
        except CheckpointError as e:
            problems.append(str(e))
            verdict = "DAMAGED or missing"
        lines.append(f"  expert-parallel part {os.path.relpath(part, os.path.dirname(ckpt))}: {verdict}")
    if os.path.realpath(ckpt) != os.path.realpath(path):      # a save directory: what else it holds
        lines.append(f"  complete checkpoints in {path}: {', '.join(complete_checkpoints(path))} "
                     f"(latest: {os.path.basename(ckpt)})")
        lines += [f"  note: {note}" for note in pointer_notes(path)]   # later steps than latest, no checksum
    return "\n".join(lines), problems


def inspect_text(path: str) -> str:
    """The table of :func:`inspect`; CheckpointError naming every damaged file, if any."""
    text, problems = inspect(path)
    if problems:
        raise CheckpointError("; ".join(problems))
    return text


class _Parser(OneLineParser):
    def error(self, message):   # the one line names the two commands
        super().error(f"{message}; use 'consolidate DIR OUT.npz', 'inspect DIR' or 'export-hf DIR OUT_DIR' "
                      "(--help for more)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zerompi.checkpoint",
                description="Offline checkpoint tools: one process, no MPI (docs/checkpoint.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{consolidate,inspect,export-hf}",
                           parser_class=_Parser)
    c = sub.add_parser("consolidate", help="write the full fp32 parameters by name to OUT.npz",
                       description="Write the full fp32 parameters by name to OUT.npz (a new path or a regular file).")
    c.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run's --save-dir (its latest)")
    c.add_argument("out", metavar="OUT.npz", help="the output file (written under a temporary name, then renamed)")
    c.add_argument("--state", action="store_true", help="also the optimizer's state rows, by name, as ROW/NAME")
    i = sub.add_parser("inspect", help="print the manifest as a table and verify every checksum",
                       description="Print the manifest as a table and verify every checksum (the manifest's own "
                                   "and every shard's): exit 2 naming the damaged files.")
    i.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run's --save-dir (its latest)")
    from .hf_export import add_parser
    add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """``consolidate DIR OUT.npz`` or ``inspect DIR``; returns the exit status (0, or 2 on bad input)."""
    try:
        status = _run(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return quiet_exit_on_closed_stdout()


def _run(args: List[str]) -> int:
    try:
        a = build_parser().parse_args(args)
        if a.command == "export-hf":
            from .hf_export import run
            run(a)
        elif a.command == "consolidate":
            params = consolidate(a.dir, a.out, a.state)
            print(f"wrote {a.out}: {len(params)} parameters, "
                  f"{sum(p.size for p in params.values()):,} fp32 values")
        else:
            text, problems = inspect(a.dir)
            print(text)
            if problems:                 # the table is printed; one line says what is damaged
                sys.stdout.flush()
                raise CheckpointError(f"{len(problems)} of the checkpoint's files damaged: " + "; ".join(problems))
    except SystemExit as e:          # --help: the usage is printed
        return e.code or 0
    except BrokenPipeError:
        raise
    except (ConfigError, OSError) as e:
        sys.stderr.write(f"zerompi.checkpoint: error: {e}\n")
        return 2
    return 0
