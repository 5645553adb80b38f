/* The offload files' record checksum, loaded by zerompi/engine/offload/checksum.py through ctypes.
 *
 *   zck_checksum(data, nbytes, seed)   a 64-bit hash of nbytes bytes, chained through seed
 *
 * Eight independent 64-bit lanes of multiply-rotate rounds (the xxHash64 round) over 64-byte
 * blocks, a byte-wise tail, and a final avalanche: it runs at memory bandwidth, so checking
 * every read of an offload file costs a small part of the read itself. Not cryptographic: it
 * catches what a file that lies returns (zeros after a truncation, another run's bytes, a
 * stale or misplaced record), not a forger. Chaining (seed = the previous chunk's result)
 * lets a record be hashed chunk by chunk while each chunk is still in cache.
 */
#include <stdint.h>
#include <string.h>

#define ZCK_ABI_VERSION 1
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t round64(uint64_t acc, uint64_t word) { acc += word * P2; return rotl(acc, 31) * P1; }

uint64_t zck_checksum(const void *data, int64_t nbytes, uint64_t seed)
{
    const unsigned char *p = data;
    uint64_t lane[8];
    for (int j = 0; j < 8; j++)
        lane[j] = seed + P1 * (uint64_t)(j + 1);
    int64_t i = 0;
    for (; i + 64 <= nbytes; i += 64) {
        uint64_t w[8];
        memcpy(w, p + i, 64);
        for (int j = 0; j < 8; j++)
            lane[j] = round64(lane[j], w[j]);
    }
    uint64_t h = seed ^ ((uint64_t)nbytes * P3);
    for (int j = 0; j < 8; j++)
        h = rotl(h ^ round64(0, lane[j]), 27) * P1 + P3;
    for (; i < nbytes; i++)
        h = rotl(h ^ (p[i] * P3), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

int zck_abi_version(void) { return ZCK_ABI_VERSION; }
