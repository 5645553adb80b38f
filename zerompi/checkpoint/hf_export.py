"""``export-hf``: a GPT checkpoint as a Hugging Face GPT-2 directory, streamed one run of a tensor at a time.

One concern: the export, offline and without MPI (``python -m zerompi.checkpoint export-hf CKPT OUT_DIR``).
It reads a checkpoint of any world size, stage, TP and pipeline layout -- each shard file checksummed,
then each tensor's elements read straight from the shards' master rows (``os.preadv``, CHUNK elements at
a time; a TP-split tensor's pieces put together a block of rows at a time) and written into the
safetensors file behind a header made first (safetensors_files.StreamWriter). Peak memory is a read
buffer, not a tensor and not the model (measured: docs/interop.md). OUT_DIR is made whole in a hidden
folder beside it and renamed into place: an interrupted export leaves nothing at OUT_DIR.
"""
import json
import os
import shutil
import uuid
from typing import Dict, Iterator, List, Optional

import numpy as np

from ..errors import ConfigError
from ..inputs import open_regular
from .parts import part_folders, tp_parts
from .format import PP_FOLDER, CheckpointError, read_manifest, resolve, verify_shard
from .hf_names import DTYPES, gpt2_config, hf_name, our_names
from .outputs import check_folder, check_roles
from .safetensors_files import INDEX, ITEMSIZE, StreamWriter, numpy_dtype, parse_size, plan_shards, shard_names
from .savedir import folders_read

F32 = np.float32
CHUNK = 1 << 20            # elements read at a time (4 MiB of float32)
GPT_KEY = "gpt"            # manifest["extra"][GPT_KEY]: the GPT's sizes that its shapes do not tell (n_head)


class Part:
    """One ordinary checkpoint (a run's, one TP rank's or one pipeline chunk's), its shards checked and open:
    ``read(name, lo, hi)`` gives flattened elements lo .. hi-1 of its parameter ``name`` (float32 master)."""

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self.manifest, self.saved = read_manifest(ckpt)
        self.fds, self.starts = [], []
        for r in range(self.saved.world_size):
            path = verify_shard(ckpt, self.manifest, r)          # size, CRC-32 and array header
            fd = open_regular(path, path, CheckpointError)
            with open(path, "rb") as f:                          # where row 0 (the master) starts
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                read(f)
                self.starts.append(f.tell())
            self.fds.append(fd)

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        pr = self.saved.params[name]
        b = self.saved.buckets[pr.bucket]
        out = np.empty(hi - lo, F32)
        a0, z0 = pr.bucket_offset + lo, pr.bucket_offset + hi          # in the bucket
        for r, fd in enumerate(self.fds):
            slo, shi = b.slice_bounds(r)
            a, z = max(a0, slo), min(z0, shi)
            if a < z:
                view = memoryview(out[a - a0:z - a0]).cast("B")
                at = self.starts[r] + 4 * (b.shard_start + a - slo)
                if os.preadv(fd, [view], at) != view.nbytes:
                    raise CheckpointError(f"{self.ckpt}: shard {r} was truncated while it was read")
        return out

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class Source:
    """A whole parameter: in one Part, or cut over TP ranks' Parts by ``split`` (axis, groups)."""

    def __init__(self, name: str, parts: List[Part], split=None):
        self.name, self.parts, self.split = name, parts, split
        shape = list(parts[0].saved.params[name].shape)
        if split:
            shape[split[0]] *= len(parts)
        self.shape = tuple(shape)

    def chunks(self) -> Iterator[np.ndarray]:
        """The parameter's elements in row-major order, CHUNK or so at a time (float32)."""
        n = int(np.prod(self.shape, dtype=np.int64))
        if not self.split:
            for lo in range(0, n, CHUNK):
                yield self.parts[0].read(self.name, lo, min(n, lo + CHUNK))
            return
        axis, groups = self.split
        k = len(self.parts)
        length = self.shape[axis]
        if axis == 0:     # whole rows: part g's run r is rows [g L/groups + r per, + per) of rank r's piece g
            per, row = length // (groups * k), n // length
            for g in range(groups):
                for part in self.parts:
                    lo, hi = g * per * row, (g + 1) * per * row
                    for a in range(lo, hi, CHUNK):
                        yield part.read(self.name, a, min(hi, a + CHUNK))
            return
        if axis != 1 or len(self.shape) != 2:
            raise CheckpointError(f"{self.name}: a tensor-parallel split on axis {axis} of {self.shape} is not "
                                  "one the GPT makes")
        from ..comm.tp_pieces import merge
        rows, width = self.shape[0], length // k                 # a piece's row
        step = max(1, CHUNK // length)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            pieces = [p.read(self.name, a * width, b * width).reshape(b - a, width) for p in self.parts]
            yield merge(pieces, 1, groups).reshape(-1)


def sources(path: str) -> Dict[str, Source]:
    """{parameter name: Source} of the checkpoint ``path`` names (a checkpoint, a save folder, TP and pipeline
    parts merged as consolidate does: checkpoint/cli.py); CheckpointError unless they belong together."""
    chunks = part_folders(path, PP_FOLDER, "pipeline")
    wholes = [(c, tp_parts(c)) for c in chunks] if chunks else [(path, tp_parts(path))]
    out: Dict[str, Source] = {}
    steps = {}
    for where, folders in wholes:
        parts = [Part(resolve(p)) for p in (folders or [where])]
        infos = [p.manifest["extra"].get("tensor_parallel") for p in parts]
        steps[where] = {p.manifest["step"] for p in parts}
        if folders and (any(i is None for i in infos) or [i["rank"] for i in infos] != list(range(len(parts)))
                        or len(steps[where]) > 1):
            raise CheckpointError(f"{parts[0].ckpt}: the tensor-parallel pieces do not belong to one checkpoint "
                                  f"(steps {sorted(steps[where])})")
        split = infos[0]["split"] if folders else {}
        for name in parts[0].saved.params:
            if name in out:
                raise CheckpointError(f"{where}: parameter {name!r} is in two pipeline chunks' checkpoints")
            out[name] = Source(name, parts, split.get(name))
    if len({s for v in steps.values() for s in v}) > 1:
        raise CheckpointError(f"{path}: the pipeline chunks' checkpoints are of different steps; export checkpoints "
                              "of one step")
    return out


def gpt_sizes(path: str, srcs: Dict[str, Source], n_head: Optional[int]) -> Dict[str, int]:
    """{vocab, n_positions, n_layer, n_head, d_model} of the GPT whose parameters ``srcs`` are."""
    blocks = {n.split(".")[0] for n in srcs if n.startswith("block")}
    n_layer = len(blocks)
    if "wte" not in srcs or "wpe" not in srcs or set(srcs) != set(our_names(n_layer)):
        odd = sorted(set(srcs) ^ set(our_names(n_layer)))[:3]
        raise CheckpointError(f"{path}: not a checkpoint of zerompi's GPT (parameters {odd} do not fit one); "
                              "only the GPT exports to GPT-2")
    vocab, d_model = srcs["wte"].shape
    saved = [p.manifest["extra"].get(GPT_KEY, {}).get("n_head") for s in srcs.values() for p in s.parts[:1]]
    recorded = next((h for h in saved if h), None)
    if n_head is not None and recorded is not None and n_head != recorded:
        raise ConfigError(f"n_head={n_head} contradicts the checkpoint's n_head {recorded}; leave --n-head out")
    heads = n_head or recorded
    if heads is None:
        raise ConfigError(f"{path}: the checkpoint does not record its n_head (saved by an older zerompi); give it "
                          "with --n-head H, as the run had it")
    if d_model % heads:
        raise ConfigError(f"n_head={heads} does not divide the model's width {d_model}")
    return {"vocab": vocab, "n_positions": srcs["wpe"].shape[0], "n_layer": n_layer, "n_head": heads,
            "d_model": d_model}


def check_out_dir(out: str, ckpt: str) -> None:
    """ConfigError unless ``out`` can take the export: a new folder or an empty one, not the checkpoint nor
    inside it (nothing is ever written over)."""
    check_roles([("out_dir", out)], folders_read("checkpoint", ckpt))
    check_folder(out, "out_dir")
    if os.path.isdir(out) and os.listdir(out):
        names = os.listdir(out)
        holds = "a zerompi checkpoint" if any(n in ("manifest.json", "latest") or n.startswith("step_")
                                                or n.startswith(("tp", "pp")) for n in names) else \
            "a Hugging Face model" if "config.json" in names else f"{len(names)} entries"
        raise ConfigError(f"out_dir={out!r} holds {holds}, which the export would mix with or replace; give a new "
                          "folder or an empty one")


def export(path: str, out: str, dtype: str = "fp32", max_shard_size: str = "2GB",
           n_head: Optional[int] = None) -> dict:
    """Write the GPT checkpoint ``path`` to ``out`` as GPT-2 (config.json, safetensors, the index when sharded);
    returns what was written: {files, tensors, bytes, config}."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    limit = parse_size(max_shard_size)
    check_out_dir(out, path)
    srcs = sources(path)
    try:
        sizes = gpt_sizes(path, srcs, n_head)
        config = gpt2_config(sizes["vocab"], sizes["n_positions"], sizes["n_layer"], sizes["n_head"],
                             sizes["d_model"], dtype)
        st = DTYPES[dtype][0]
        names = our_names(sizes["n_layer"])
        tensors = [(hf_name(n), st, srcs[n].shape) for n in names]
        files = plan_shards(tensors, limit)
        file_names = shard_names(len(files))
        parent, base = os.path.split(os.path.abspath(out))
        tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)
        try:
            for fname, members in zip(file_names, files):
                w = StreamWriter(os.path.join(tmp, fname), [tensors[i] for i in members], {"format": "pt"})
                for i in members:
                    for chunk in srcs[names[i]].chunks():
                        w.write(_convert(chunk, st, tensors[i][0]))
                w.close()
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            total = sum(ITEMSIZE[st] * int(np.prod(s, dtype=np.int64)) for _, _, s in tensors)
            if len(files) > 1:
                weight_map = {tensors[i][0]: fname for fname, members in zip(file_names, files) for i in members}
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            if os.path.isdir(out):
                os.rmdir(out)                   # empty (checked): replaced by the finished folder
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        for s in srcs.values():
            for p in s.parts:
                p.close()
    params = sum(int(np.prod(s, dtype=np.int64)) for _, _, s in tensors)
    return {"files": file_names, "tensors": len(tensors), "bytes": total, "params": params, "config": config}


def _convert(chunk: np.ndarray, st: str, name: str) -> np.ndarray:
    """``chunk`` (float32) in the safetensors dtype ``st``; ConfigError when a value does not fit fp16."""
    if st == "F32":
        return chunk
    out = chunk.astype(numpy_dtype(st))
    if st == "F16" and not np.isfinite(out).all() and np.isfinite(chunk).all():
        raise ConfigError(f"tensor {name!r} has values beyond fp16's range (largest |value| "
                          f"{float(np.abs(chunk).max()):g}); export with --dtype bf16 or fp32")
    return out


def add_parser(sub) -> None:
    """The ``export-hf`` subcommand of ``python -m zerompi.checkpoint`` (cli.py's parser)."""
    e = sub.add_parser("export-hf", help="write a GPT checkpoint as a Hugging Face GPT-2 folder (safetensors)",
                       description="Write a GPT checkpoint (any world size, stage, --tp, --pp) as a folder that "
                                   "transformers.GPT2LMHeadModel.from_pretrained loads: config.json and safetensors, "
                                   "one read buffer in memory at a time (docs/interop.md).")
    e.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run's --save-dir (its latest)")
    e.add_argument("out", metavar="OUT_DIR", help="a new folder, or an empty one (made whole, then renamed)")
    e.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="the tensors' dtype (default fp32)")
    e.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="larger models go into several files of at most SIZE each, with an index (default 2GB)")
    e.add_argument("--n-head", type=int, default=None, metavar="H",
                   help="attention heads, for a checkpoint that does not record them (saved by an older zerompi)")


def run(a) -> None:
    """Export as ``a`` (the parsed export-hf flags) says, and print what was written and the memory it took."""
    import tracemalloc
    tracemalloc.start()
    try:
        done = export(a.dir, a.out, a.dtype, a.max_shard_size, a.n_head)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    c = done["config"]
    print(f"wrote {a.out}: GPT-2 {c['n_layer']} x {c['n_embd']}, {c['n_head']} heads, vocab {c['vocab_size']}, "
          f"{c['n_positions']} positions; {done['tensors']} tensors, {done['bytes']:,} bytes of {a.dtype} in "
          f"{len(done['files'])} file{'s' if len(done['files']) > 1 else ''}; peak memory {peak / 2**20:.1f} MiB "
          f"(traced allocations; the model is {4 * done['params'] / 2**20:.1f} MiB in fp32)")
