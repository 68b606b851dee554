// The bf16 flash step (cpu_flash_block.h's attend_packed) on AMX tiles, for the batch-invariant
// kernel where the CPU has AMX: the same packed block (K as [D/2][kKeyBlock] pairs along D, V
// as [kKeyBlock/2][D] pairs of keys), the same online-softmax update per row, with the two
// products on TDPBF16PS. Rows go 16 to a tile; rows past the task's end are zeros in a scratch
// tile and never stored, so a row's arithmetic is the same whichever rows share its tile.
// Its bits differ from the AVX-512 step's, so a process uses one of the two for every bf16
// row (cpu_row_attention.cpp's use_amx, set once at load).
//
// Tiles (cpu_amx.h's configuration): 0-3 four 16 x 16 fp32 accumulators (64 keys of scores,
// or 64 columns of O), 4 the A operand (16 query rows x 32 d, or 16 rows of P x 32 keys),
// 5-7 the B operands (16 pairs x 16 keys of K, or 16 key pairs x 16 columns of V).
#pragma once

#ifndef PC_NARROW_VECTORS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../kernels/cpu_amx.h"
#include "cpu_flash_block.h"

namespace pc {

// C tiles 0..3 += A (tile 4, loaded by the caller) x the four B blocks at b, b + 16, b + 32,
// b + 48 words (stride bytes per pair row).
PC_AMX inline void dp_four(const uint32_t* b, int64_t stride) {
  PC_TILE_LOAD(5, b, stride);
  _tile_dpbf16ps(0, 4, 5);
  PC_TILE_LOAD(6, b + 16, stride);
  _tile_dpbf16ps(1, 4, 6);
  PC_TILE_LOAD(7, b + 32, stride);
  _tile_dpbf16ps(2, 4, 7);
  PC_TILE_LOAD(5, b + 48, stride);
  _tile_dpbf16ps(3, 4, 5);
}

PC_AMX inline void store_four(float* c, int64_t stride) {
  PC_TILE_STORE(0, c, stride);
  PC_TILE_STORE(1, c + 16, stride);
  PC_TILE_STORE(2, c + 32, stride);
  PC_TILE_STORE(3, c + 48, stride);
}

PC_AMX inline void load_four(const float* c, int64_t stride) {
  PC_TILE_LOAD(0, c, stride);
  PC_TILE_LOAD(1, c + 16, stride);
  PC_TILE_LOAD(2, c + 32, stride);
  PC_TILE_LOAD(3, c + 48, stride);
}

// One key block [k0, k0 + kKeyBlock) for rows [ra, rb): attend_packed's contract (bf16), the
// tile configuration loaded on this thread. D >= 64 (a multiple of 64).
template <int D>
PC_AMX void attend_packed_amx(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                              int64_t rb, const uint32_t* qw, const int64_t* limit,
                              const int64_t* begin, float* m, float* l, float* obuf,
                              float scale2f) {
  static_assert(D % 64 == 0, "the AMX step takes 64 columns of O a pass");
  constexpr int64_t KW = D / 2;  // words per query row
  constexpr int64_t BK = kKeyBlock;
  const __m512 scale2 = _mm512_set1_ps(scale2f);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  alignas(64) uint32_t qpad[16 * KW];
  alignas(64) float sbuf[16][BK];
  alignas(64) uint16_t pbf[16][BK];
  alignas(64) float otile[16][D];
  for (int64_t r0 = ra; r0 < rb; r0 += 16) {
    const int nr = static_cast<int>(std::min<int64_t>(16, rb - r0));
    int64_t tile_keys = 0;  // keys of this block any row of the tile sees
    for (int i = 0; i < nr; ++i)
      tile_keys = std::max(tile_keys, std::min<int64_t>(limit[r0 + i] - k0, BK));
    if (tile_keys <= 0) continue;
    const uint32_t* q = qw + r0 * KW;
    if (nr < 16) {
      std::memcpy(qpad, q, sizeof(uint32_t) * nr * KW);
      std::memset(qpad + nr * KW, 0, sizeof(uint32_t) * (16 - nr) * KW);
      q = qpad;
    }
    // Scores, 64 keys a pass: S = Q K over ascending 32-wide d steps, from zero.
    for (int64_t half = 0; half * 64 < tile_keys; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < D / 32; ++s) {
        PC_TILE_LOAD(4, q + s * 16, KW * 4);
        dp_four(kblk + s * 16 * BK + half * 64, BK * 4);
      }
      store_four(&sbuf[0][half * 64], BK * 4);
    }
    // The online-softmax update per row, as attend_packed; P in bf16, zero past the row's keys.
    const int64_t nvec = (tile_keys + 15) / 16;
    const int64_t pv_keys = (tile_keys + 31) / 32 * 32;  // keys the P V pass reads
    float corr[16];
    for (int i = 0; i < 16; ++i) {
      uint16_t* p = pbf[i];
      const int64_t row = r0 + i;
      const int64_t valid = i < nr ? limit[row] - k0 : 0;
      const int64_t skip = i < nr && begin ? begin[row] - k0 : 0;
      if (valid <= 0 || skip >= BK) {
        corr[i] = 1.0f;
        std::memset(p, 0, sizeof(uint16_t) * pv_keys);
        continue;
      }
      __m512 vmax = neg_inf;
      for (int64_t c = 0; c < nvec; ++c) {
        const __m512 x = _mm512_mask_mov_ps(neg_inf, seen(valid, skip, c),
                                            _mm512_mul_ps(_mm512_load_ps(&sbuf[i][c * 16]), scale2));
        vmax = _mm512_max_ps(vmax, x);
      }
      const float m_new = std::max(m[row], _mm512_reduce_max_ps(vmax));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nvec; ++c) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(&sbuf[i][c * 16]), scale2);
        const __m512 e = _mm512_maskz_mov_ps(seen(valid, skip, c), exp2_ps(_mm512_sub_ps(x, mv)));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(p + c * 16), (__m256i)_mm512_cvtneps_pbh(e));
      }
      if (nvec * 16 < pv_keys) std::memset(p + nvec * 16, 0, sizeof(uint16_t) * 16);
      corr[i] = std::exp2(m[row] - m_new);  // m[row] = -inf at first: 0
      l[row] = l[row] * corr[i] + _mm512_reduce_add_ps(sum);
      m[row] = m_new;
    }
    // O = O * corr + P V, 64 columns a pass, key pairs in ascending 32-key steps.
    for (int i = 0; i < 16; ++i) {
      const __m512 cv = _mm512_set1_ps(corr[i]);
      for (int c = 0; c < D; c += 16)
        _mm512_store_ps(&otile[i][c], i < nr ? _mm512_mul_ps(_mm512_loadu_ps(obuf + (r0 + i) * D + c), cv)
                                            : _mm512_setzero_ps());
    }
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      load_four(&otile[0][c0], D * 4);
      for (int64_t ks = 0; ks < pv_keys / 32; ++ks) {
        PC_TILE_LOAD(4, &pbf[0][ks * 32], BK * 2);
        dp_four(vblk + ks * 16 * D + c0, D * 4);
      }
      store_four(&otile[0][c0], D * 4);
    }
    for (int i = 0; i < nr; ++i) std::memcpy(obuf + (r0 + i) * D, otile[i], sizeof(float) * D);
  }
}

}  // namespace pc

#endif  // PC_NARROW_VECTORS
