/* zck64: the checksum of the offload files' records and of the in-memory replicas' shard files, loaded by
 * zerompi/checkpoint/checksums.py through ctypes.
 *
 *   zck_checksum(data, nbytes, seed)        a 64-bit hash of nbytes bytes, chained through seed
 *   zck_init(state, seed)                   the same hash fed in pieces: zck_update as often as needed, then
 *   zck_update(state, data, nbytes)         zck_final; equal to zck_checksum over the pieces' concatenation
 *   zck_copy_update(state, dst, src, n)     memcpy(dst, src, n) and zck_update over those bytes, in one pass
 *   zck_final(state)                        (the copy's blocks are hashed while they are in cache)
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

#define ZCK_ABI_VERSION 2
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define COPY_CHUNK 16384             /* zck_copy_update: copied, then hashed while in L1/L2 */

typedef struct {
    uint64_t lane[8];
    uint64_t seed;
    int64_t total;                   /* bytes fed so far */
    int64_t held;                    /* bytes in block[] not yet hashed (< 64) */
    unsigned char block[64];
} zck_state;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t round64(uint64_t acc, uint64_t word) { acc += word * P2; return rotl(acc, 31) * P1; }

static inline void blocks(uint64_t *lane, const unsigned char *p, int64_t count)
{
    for (int64_t i = 0; i < count; i++, p += 64) {
        uint64_t w[8];
        memcpy(w, p, 64);
        for (int j = 0; j < 8; j++)
            lane[j] = round64(lane[j], w[j]);
    }
}

int64_t zck_state_size(void) { return (int64_t)sizeof(zck_state); }

void zck_init(zck_state *s, uint64_t seed)
{
    for (int j = 0; j < 8; j++)
        s->lane[j] = seed + P1 * (uint64_t)(j + 1);
    s->seed = seed;
    s->total = 0;
    s->held = 0;
}

void zck_update(zck_state *s, const void *data, int64_t nbytes)
{
    const unsigned char *p = data;
    s->total += nbytes;
    if (s->held) {                   /* fill the held block first */
        int64_t take = 64 - s->held < nbytes ? 64 - s->held : nbytes;
        memcpy(s->block + s->held, p, (size_t)take);
        s->held += take;
        p += take;
        nbytes -= take;
        if (s->held < 64)
            return;
        blocks(s->lane, s->block, 1);
        s->held = 0;
    }
    blocks(s->lane, p, nbytes / 64);
    p += nbytes / 64 * 64;
    s->held = nbytes % 64;
    memcpy(s->block, p, (size_t)s->held);
}

void zck_copy_update(zck_state *s, void *dst, const void *src, int64_t nbytes)
{
    unsigned char *d = dst;
    const unsigned char *p = src;
    for (int64_t at = 0; at < nbytes; at += COPY_CHUNK) {
        int64_t n = nbytes - at < COPY_CHUNK ? nbytes - at : COPY_CHUNK;
        memcpy(d + at, p + at, (size_t)n);
        zck_update(s, d + at, n);
    }
}

uint64_t zck_final(const zck_state *s)
{
    uint64_t h = s->seed ^ ((uint64_t)s->total * P3);
    for (int j = 0; j < 8; j++)
        h = rotl(h ^ round64(0, s->lane[j]), 27) * P1 + P3;
    for (int64_t i = 0; i < s->held; i++)
        h = rotl(h ^ (s->block[i] * P3), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t zck_checksum(const void *data, int64_t nbytes, uint64_t seed)
{
    zck_state s;
    zck_init(&s, seed);
    zck_update(&s, data, nbytes);
    return zck_final(&s);
}

int zck_abi_version(void) { return ZCK_ABI_VERSION; }
