// Intel AMX (AMX-TILE, AMX-BF16) for the kernels that use it: the tile state's permission and
// the one tile configuration they share (8 tiles of 16 rows x 64 bytes), and the weight
// stream's prefetch that their block loops share.
//
// Compiled only in the native AVX-512 build, in functions marked PC_AMX, and called only after
// pc_amx_request() granted the state and the CPU reported AMX. The configuration is per thread
// and other libraries (oneDNN) load their own between our calls, so each parallel region of
// ours loads it on every thread first (amx_configure) and releases it at the end.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#define PC_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// Tile loads and stores that tell the compiler they read / write memory: gcc 12's _tile_loadd
// and _tile_stored are asm statements without memory operands or a clobber, so the stores
// that fill a scratch tile (or the loads after a tile store) may be dropped or moved past them.
#define PC_TILE_LOAD(tile, base, stride)                                                 \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(static_cast<const void*>(base)), \
                   "r"(static_cast<long>(stride))                                         \
                   : "memory")
#define PC_TILE_STORE(tile, base, stride)                                           \
  __asm__ volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(static_cast<void*>(base)), \
                   "r"(static_cast<long>(stride))                                    \
                   : "memory")

namespace pc_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes: C 16 x 16 fp32, A 16 rows x 32 bf16, B 16 pair-rows x 16
// columns of pairs.
inline constexpr TileConfig kConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// The whole 64-byte configuration as the asm's operand: gcc 12's _tile_loadconfig names only
// its first byte, so stores to the rest of a local configuration may be dropped as dead.
PC_AMX inline void configure() { __asm__ volatile("ldtilecfg %0" ::"m"(kConfig)); }

PC_AMX inline void release() { _tile_release(); }

// Part `part` of `PARTS` of the prefetches for the weight blocks (BYTES each) `ahead` blocks
// on from `blk` (into L1) and `far` blocks on (into L2): lines part, part + PARTS, ... A
// block kernel calls it once per part of its work on a block, so the prefetches go out
// spread over that work; issued in one burst before it, the weight stream stalled while the
// block was worked on (cpu_gemm_amx.cpp: Gemma 3's head at one row 1.4x the time).
template <int64_t BYTES, int PARTS>
inline void prefetch_part(const uint8_t* blk, int part, int64_t ahead, int64_t far) {
  for (int64_t line = part * 64; line < BYTES; line += PARTS * 64) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + ahead * BYTES + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + far * BYTES + line), _MM_HINT_T1);
  }
}

// Linux's ARCH_REQ_XCOMP_PERM for XTILEDATA (per process): true when granted.
inline bool request() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace pc_amx
