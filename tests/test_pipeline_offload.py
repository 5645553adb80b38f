"""Offload inside pipeline stages (--pp with --offload-optimizer / --offload-params): the in-memory bits.

The oracle is the same pipelined run without offload (itself equal to the unpipelined run,
tests/test_pipeline.py): every chunk's engine offloads its own shard -- to host memory, or to files in
a folder of its own under --offload-dir (two chunks of one rank: the interleaved schedule) -- and the
final parameters, every loss and every held-out loss must be equal, with clipping too. The files and
the chunks' folders are gone after the run.
"""
import pytest

from tests.test_pipeline import FP32, SCHEDULES, key, launch, same

GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "2", "--micro-batches", "4", "--bucket-mb", "0.01", "--log-every", "1000", "--pp", "2"]
CASES = [("1f1b", "2", ["--offload-optimizer", "cpu"]), ("1f1b", "2", ["--offload-optimizer", "nvme"]),
         ("zb-h1", "3", ["--offload-optimizer", "nvme", "--offload-params", "nvme"]),
         ("interleaved", "3", ["--offload-optimizer", "nvme", "--offload-params", "nvme"]),
         ("gpipe", "1", ["--offload-optimizer", "nvme", "--offload-io", "buffered"])]


def files(mode, folder):
    return mode + (["--offload-dir", str(folder)] if "nvme" in mode else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    base = sorted({(name, stage) for name, stage, _ in CASES})
    configs = [GPT + FP32 + ["--stage", s] + SCHEDULES[name] for name, s in base]
    configs += [GPT + FP32 + ["--stage", s] + SCHEDULES[name] + files(mode, folder) for name, s, mode in CASES]
    out = {key(c): m for c, m in zip(configs, launch(4, configs))}
    return out, folder


@pytest.mark.parametrize("name,stage,mode", CASES, ids=[f"{n}-stage{s}-{'-'.join(m[1::2])}" for n, s, m in CASES])
def test_offloaded_stages_give_the_in_memory_bits(runs, name, stage, mode):
    out, folder = runs
    ref = out[key(GPT + FP32 + ["--stage", stage] + SCHEDULES[name])]
    run = out[key(GPT + FP32 + ["--stage", stage] + SCHEDULES[name] + files(mode, folder))]
    assert same(run, ref), (name, stage, mode, run["losses"], ref["losses"])
    assert run["memory_bytes"]["total"] == ref["memory_bytes"]["total"]     # the ledger counts them where they are
    assert list(folder.iterdir()) == []                                       # no file, no chunk folder left
