"""zck64 fed in pieces (checkpoint/checksums.py's Zck64Stream over kernels/checksum_cpu.c's zck_init, zck_update,
zck_copy_update, zck_final) against the one-call hash over the pieces' concatenation, and against an
independent Python transcription of the hash (the oracle); the copy's bytes against NumPy's."""
import numpy as np
import pytest

from zerompi.checkpoint import checksums

P1, P2, P3, M = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, (1 << 64) - 1


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M


def oracle(data: bytes, seed: int = 0) -> str:
    """zck64 written out from its description (kernels/checksum_cpu.c's header): eight lanes over 64-byte blocks,
    then the length, the lanes, the byte-wise tail and the avalanche."""
    rnd = lambda acc, w: (rotl((acc + w * P2) & M, 31) * P1) & M   # noqa: E731
    lane = [(seed + P1 * (j + 1)) & M for j in range(8)]
    full = len(data) // 64 * 64
    words = np.frombuffer(data[:full], "<u8").reshape(-1, 8)
    for block in words:
        lane = [rnd(lane[j], int(block[j])) for j in range(8)]
    h = (seed ^ (len(data) * P3)) & M
    for j in range(8):
        h = (rotl(h ^ rnd(0, lane[j]), 27) * P1 + P3) & M
    for b in data[full:]:
        h = (rotl(h ^ ((b * P3) & M), 11) * P1) & M
    for shift, mul in ((33, P2), (29, P3), (32, None)):
        h ^= h >> shift
        if mul:
            h = (h * mul) & M
    return f"{h:016x}"


@pytest.fixture(scope="module")
def lib():
    found = checksums.checksum_library()
    if found is None:
        pytest.skip(f"the checksum kernel does not build here: {checksums._library()[1]}")
    return found


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 200, 1000, 4096 + 17])
def test_one_call_is_the_oracle(lib, size):
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    assert checksums.zck64(data) == oracle(data)


@pytest.mark.parametrize("seed", range(6))
def test_pieces_hash_as_their_concatenation(lib, seed):
    """Random cuts (empty pieces, pieces under a block, across blocks, over the copy's 16 KiB chunk), fed by
    ``update`` or ``copy`` at random: the digest is the one call's over the whole, and every copied byte NumPy's."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(1, 70000)), np.uint8)
    cuts = np.sort(rng.integers(0, data.size + 1, int(rng.integers(0, 12))))
    stream, out = checksums.zck64_stream(), np.zeros_like(data)
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, data.size]):
        if rng.random() < 0.5:
            stream.copy(out[a:b], data[a:b])
        else:
            out[a:b] = data[a:b]
            stream.update(out[a:b])
    assert np.array_equal(out, data)
    assert stream.hexdigest() == checksums.zck64(data.tobytes()) == oracle(data.tobytes())


def test_a_copy_that_casts_or_strides_hashes_what_it_wrote(lib):
    """float64 into float32, a strided source: NumPy's copy, then the hash of the destination's bytes."""
    src = np.linspace(0, 1, 301)
    dst = np.empty(301, np.float32)
    stream = checksums.zck64_stream()
    stream.copy(dst, src)
    strided = np.arange(600, dtype=np.float32)[::2]
    dst2 = np.empty(300, np.float32)
    stream.copy(dst2, strided)
    assert np.array_equal(dst, src.astype(np.float32)) and np.array_equal(dst2, strided)
    assert stream.hexdigest() == oracle(dst.tobytes() + dst2.tobytes())


def test_a_shard_file_hashed_as_written_is_its_file_checksum(lib, tmp_path):
    """A replica's way (checkpoint/replicas.py): the .npy header, then each row's pieces copied into the mapped
    file, a row's uncovered tail hashed as it is: the digest is file_checksum's of the file."""
    rows, numel = 3, 1001
    path = tmp_path / "shard_00000.npy"
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, numel))
    stream = checksums.zck64_stream()
    header = np.fromfile(path, np.uint8, count=path.stat().st_size - arr.nbytes)
    stream.update(header)
    rng = np.random.default_rng(1)
    for k in range(rows):
        stream.copy(arr[k, :700], rng.random(700, np.float32))
        stream.copy(arr[k, 700:990], rng.random(290, np.float32))
        stream.update(arr[k, 990:])                     # not covered: its bytes as they are (zeros)
    arr.flush()
    del arr
    assert stream.hexdigest() == checksums.file_checksum(str(path), checksums.ZCK64)
