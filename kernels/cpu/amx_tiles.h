/* AMX's tile registers for the kernels that multiply on them (bf16_pair_tiles.c,
 * prefill_attention.c): asking the OS for them, and one configuration they all share. */
#ifndef PDSERVE_AMX_TILES_H
#define PDSERVE_AMX_TILES_H

#ifdef __AMX_BF16__
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use the tiles: the kernel hands AMX's 8 KB of tile registers to a
 * process only when it asks (and refuses where the OS does not support them). */
static inline int amx_tiles_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
}

/* The layout of `ldtilecfg`'s 64-byte operand (palette 1). */
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* All eight tiles 16 rows of 64 bytes: 16 rows of 16 float32 sums, 16 rows of 16 bf16 pairs.
 * The tile registers are a thread's state, and loading a configuration costs more than a
 * decode step's small GEMM is worth: a thread keeps ours loaded between calls, and loads it
 * again only where something else (oneDNN's GEMMs run on the same threads) loaded another. */
static inline void configure_tiles(void) {
    /* A constant, not a local filled in here: gcc 12 does not see that ldtilecfg reads its
     * operand and dropped the stores of the row counts, so the instruction faulted on a
     * configuration of empty tiles. For the same reason the compiler is told that sttilecfg
     * wrote `current` before it is compared. */
    static const struct tile_config ours = {
        .palette = 1,
        .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    struct tile_config current;
    _tile_storeconfig(&current);
    __asm__ volatile("" : : "m"(current) : "memory");
    if (memcmp(&ours, &current, sizeof current) != 0) _tile_loadconfig(&ours);
}
#endif

#endif
