"""Offload files that cannot lie and do not pile up (engine/offload/files.py, owner.py): every read
is checked against what was written (a truncated file extended again must not read back as zeros),
and the files of runs that ended badly are removed by the next run, whose free-space check then
counts their bytes as free."""
import os
import shutil

import numpy as np
import pytest

from tests.mpirun import run_mpi
from zerompi import ConfigError, ZeroConfig, ZeroEngine
from zerompi.engine.offload import OffloadError

WIDTH = 96          # 4 layers of 96 x 96 + 96: a bucket per layer at bucket_mb=0.03


def layers(width=WIDTH, depth=4):
    rng = np.random.default_rng(0)
    return [(f"l{i}", {f"w{i}": rng.standard_normal(width * width + width).astype(np.float32)}) for i in range(depth)]


def one_step(engine, value=1.0):
    for i in range(engine.layout.num_layers):
        with engine.unsharded(i):
            pass
    for i in reversed(range(engine.layout.num_layers)):
        engine.grads_ready(i, {f"w{i}": np.full(WIDTH * WIDTH + WIDTH, value, np.float32)})
    return engine.step()


def nvme(tmp_path, **kw):
    return ZeroConfig(**dict(dict(stage=2, dtype="fp32", bucket_mb=0.03, offload_optimizer="nvme",
                                  offload_dir=str(tmp_path)), **kw))


@pytest.mark.parametrize("cut", ["optimizer", "params"])
def test_a_truncated_file_extended_again_is_an_error_naming_the_file_and_the_record(tmp_path, cut):
    """The file is cut to nothing between two steps, and a write of one row (as a checkpoint's load writes
    them) or of the last bucket's parameters extends it to its full length again: the next step's reads
    of the other records returned zeros (the run went on with zeroed values, exit 0). The read must fail,
    naming the file and the record."""
    kw = dict(stage=3, offload_params="nvme") if cut == "params" else {}
    engine = ZeroEngine(layers(), nvme(tmp_path, **kw))
    assert len(engine.layout.buckets) == 4
    one_step(engine)
    last = engine.layout.buckets[-1]
    if cut == "params":
        path = engine.gatherer.param_file.file.path
        os.truncate(path, 0)
        engine.gatherer.param_file.write(last.shard_slice, np.ones(last.slice_numel))
    else:
        path = engine.optimizer.rows.file.path
        values = engine.optimizer.read_row("exp_avg_sq")
        os.truncate(path, 0)
        engine.optimizer.write_row("exp_avg_sq", values, np)
    with pytest.raises(OffloadError) as err:
        for _ in range(2):
            one_step(engine)
    text = str(err.value)
    assert path in text and "failed at step" in text, text
    assert "other bytes than were written" in text or "(was it truncated?)" in text, text
    assert ("params of bucket" if cut == "params" else " of bucket ") in text, text
    engine.close()


def _files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("zerompi-"))


def test_files_of_a_killed_run_are_removed_and_their_bytes_count_as_free(tmp_path, monkeypatch):
    """A run killed with SIGKILL leaves its offload file; on a filesystem of 2 MiB, the next run refused to
    start (its free-space check counted the dead file's bytes). Now the next run removes it (its owner is
    gone), keeps the files of live owners, and names the files it cannot judge when space is short."""
    code = ("import os, signal, numpy as np; from zerompi import ZeroConfig, ZeroEngine; "
            f"ZeroEngine([('l', {{'w': np.zeros(90_000, np.float32)}})], ZeroConfig(stage=1, dtype='fp32', "
            f"offload_optimizer='nvme', offload_dir={str(tmp_path)!r})); os.kill(os.getpid(), signal.SIGKILL)")
    run_mpi(1, ["-c", code], timeout=60, check=False)
    dead = _files(tmp_path)
    assert len(dead) == 1, dead
    dead_bytes = os.stat(tmp_path / dead[0]).st_blocks * 512
    disk = 2 * 2 ** 20                 # a 2 MiB filesystem: what the offload files hold is not free
    real = shutil.disk_usage

    def small_disk(path):
        held = sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))
        return real(path)._replace(total=disk, free=disk - held)
    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    one = [("l", {"w": np.zeros(90_000, np.float32)})]
    assert dead_bytes > disk // 2          # with the dead file there, the next run would not fit
    engine = ZeroEngine(one, ZeroConfig(stage=1, dtype="fp32", offload_optimizer="nvme", offload_dir=str(tmp_path)))
    mine = _files(tmp_path)
    assert dead[0] not in mine and len(mine) == 1, (dead, mine)
    # A file of a live owner (this process's engine) is kept; one without an owner header is named when short.
    (tmp_path / "zerompi-optimizer-rank0-pid1.bin").write_bytes(b"\1" * (disk // 4))
    with pytest.raises(ConfigError) as err:
        ZeroEngine(one, ZeroConfig(stage=1, dtype="fp32", offload_optimizer="nvme", offload_dir=str(tmp_path)))
    assert "zerompi-optimizer-rank0-pid1.bin" in str(err.value) and "no owner header" in str(err.value), err.value
    assert set(mine) <= set(_files(tmp_path))
    engine.close()
    assert _files(tmp_path) == ["zerompi-optimizer-rank0-pid1.bin"]


@pytest.mark.parametrize("hash_name", ["kernel", "crc32"])
def test_every_read_is_checked_with_the_kernel_or_without_a_compiler(tmp_path, monkeypatch, hash_name):
    """A record read back as written passes; one byte changed in the file, or a record read at another
    length, is an OffloadError; a record never written reads back as the file's zeros. Both hashes (the C
    kernel's, and CRC-32 when no compiler is there) catch the change."""
    from zerompi.checkpoint import checksums as checksum
    from zerompi.engine.offload import files
    if hash_name == "crc32":
        monkeypatch.setattr(files, "checksum_function", lambda: checksum._crc32)
    else:
        assert checksum._library()[0] is not None, checksum._library()[1]
    f = files.OffloadFile(str(tmp_path), "zerompi-test.bin", 3 * files.CHUNK + 40, 0)
    data = np.arange((2 * files.CHUNK + 8) // 4, dtype=np.float32)
    f.write(data, 24, "row a")
    out = np.empty_like(data)
    f.read(out, 24, "row a")
    assert np.array_equal(out, data) and f.check_seconds > 0
    zeros = np.ones(10, np.float32)
    f.read(zeros, data.nbytes + 32, "row b")          # never written: the file's zeros
    assert not zeros.any()
    with open(f.path, "r+b") as raw:
        raw.seek(files.HEADER_BYTES + 24 + files.CHUNK + 5)
        raw.write(b"\x7f")
    with pytest.raises(OffloadError, match="zerompi-test.bin: read of row a .* other bytes than were written"):
        f.read(out, 24, "row a")
    with pytest.raises(OffloadError, match="the record written there was"):
        f.read(out[:8], 24, "row a")
    os.truncate(f.path, 0)                             # cut, then as long as it was again: zeros
    with pytest.raises(OffloadError, match=r"the file is 0 bytes; this run made it [\d,]+ \(was it truncated\?\)"):
        f.read(out, 24, "row a")
    os.truncate(f.path, f.size)
    with pytest.raises(OffloadError, match="other bytes than were written"):
        f.read(out, 24, "row a")
    f.close()
    assert not os.path.exists(f.path)


@pytest.mark.parametrize("direct,generations", [(True, 2), (False, 2), (True, 1)])
def test_the_rows_stream_through_the_buffer_sets_and_two_generations(tmp_path, direct, generations):
    """FileRows (engine/offload/stream.py): rows read ahead in the planned order, updated in their buffer set,
    written behind into the other generation and current only once committed (with one generation: in
    place); whole-row reads and writes wait for the pipeline. O_DIRECT where asked and possible (the records
    and buffers are 4 KiB-aligned), the page cache otherwise; the same bytes either way."""
    from zerompi.engine.offload.stream import FileRows
    slices = [slice(0, 1000), slice(1000, 3048), slice(3048, 3050), slice(3050, 9000), slice(9000, 9016)]
    rows = FileRows(str(tmp_path), "zerompi-rows.bin", slices, lambda k: np.zeros(k, np.float32), 0, generations,
                    direct, sets=2)
    assert (rows.file.direct_fd is not None) == direct and rows.spare == (generations == 2)
    master = np.arange(9016, dtype=np.float32)
    rows.write("master", slice(None), master)
    order, avg = slices[::-1], 0
    for step in range(3):
        rows.plan(order)
        for sl in order:
            m, a, v = rows.fetch(sl)
            assert np.array_equal(m, master[sl]) and np.array_equal(a, np.full(len(m), avg, np.float32))
            m += 1
            a += 1
            v[...] = -step
            rows.put(sl)
        if step == 1 and generations == 2:    # not committed: the pass is taken back, the old rows stay
            continue
        rows.commit(order)
        master, avg = master + 1, avg + 1
    assert np.array_equal(rows.read("master"), master)
    assert np.array_equal(rows.read("exp_avg", slices[3]), np.full(5950, avg, np.float32))
    rows.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("how,why", [("eio", "Input/output error"), ("truncate", "was it truncated?")])
def test_a_failing_file_on_one_rank_ends_the_job_in_seconds_naming_the_file(tmp_path, how, why):
    """Rank 1's optimizer file fails mid-run -- every transfer an EIO (a dying disk), or the file cut to
    nothing -- and only rank 1 sees it: the job ends with rank 1's line naming its file, not when the
    others' watchdog fires (300 s, "collective timeout"), which the 60 s limit here would not wait for."""
    from tests.mpirun import ROOT, zerompi_lines
    flags = ["--model", "mlp", "--width", "16", "--depth", "4", "--batch", "8", "--steps", "8", "--stage", "2",
             "--bucket-mb", "0.001", "--offload-optimizer", "nvme", "--offload-dir", tmp_path]
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "offload_eio.py", 1, 60, how, *flags], timeout=60, check=False,
                   env={"ZEROMPI_TEST_AGREEMENT_S": "1"})
    assert proc.returncode != 0 and "step     8/" not in proc.stdout, proc.stdout + proc.stderr
    assert "collective timeout" not in proc.stderr, proc.stderr
    lines = zerompi_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerompi.train: error (rank 1): offload file ") and "zerompi-optimizer-rank1" in lines[0]
    assert why in lines[0] and "rank 0 did not raise it" in lines[0], lines
