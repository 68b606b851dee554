// The bf16 flash step (cpu_flash_block.h's attend_packed) on AMX tiles, for the batch-invariant
// kernel where the CPU has AMX: the same packed block (K as [D/2][kKeyBlock] pairs along D, V
// as [kKeyBlock/2][D] pairs of keys), the same online-softmax update per row, with the two
// products on TDPBF16PS. Rows go 16 to a tile, two tiles at a time; rows past the task's end
// are zeros in a scratch tile and never stored, so a row's arithmetic is the same whichever
// rows share its tiles.
// Its bits differ from the AVX-512 step's, so a process uses one of the two for every bf16
// row (cpu_row_attention.cpp's use_amx, set once at load).
//
// Tiles (cpu_amx.h's configuration): 0-3 four 16 x 16 fp32 accumulators (two row tiles x
// 32 keys of scores, or x 32 columns of P V), 4-5 the A operands (16 query rows x 32 d, or 16
// rows of P x 32 keys), 6-7 the B operands (16 pairs x 16 keys of K, or 16 key pairs x 16
// columns of V).
#pragma once

#ifndef PC_NARROW_VECTORS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../kernels/cpu_amx.h"
#include "cpu_flash_block.h"

namespace pc {

// 2^x for the bf16 step's probabilities: f = x - round(x) through a degree-5 polynomial fitted
// to 2^f on [-1/2, 1/2] with p(0) = 1 (relative error 1.9e-7 evaluated in float32, far inside
// P's bf16 rounding), 3 instructions fewer than exp2_ps's degree-7 series: the exponentials
// were a fifth of a long prefill chunk. Every row of the AMX step uses it (its bits differ
// from the AVX-512 step's anyway).
inline __m512 exp2_p5(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, xi);
  __m512 p = _mm512_set1_ps(0.0013264709850773215f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009671507403254509f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550733581185341f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022242426872253f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931470036506653f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, xi);
}

// The 2 x 2 tile product: C0 += A4 B6, C1 += A4 B7 and, for a second row tile (two), C2 +=
// A5 B6, C3 += A5 B7, with A rows at a (and a + 16 rows), B at b and b + 16 words.
PC_AMX inline void dp_two_by_two(const void* a0, const void* a1, int64_t a_stride,
                                 const uint32_t* b, int64_t b_stride, bool two) {
  PC_TILE_LOAD(4, a0, a_stride);
  PC_TILE_LOAD(6, b, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  PC_TILE_LOAD(7, b + 16, b_stride);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    PC_TILE_LOAD(5, a1, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

PC_AMX inline void zero_four() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C tiles into c (row stride `stride` bytes) as rows 0-15 / 16-31 x columns 0-15 / 16-31.
PC_AMX inline void store_two_by_two(float* c, int64_t stride, bool two) {
  PC_TILE_STORE(0, c, stride);
  PC_TILE_STORE(1, c + 16, stride);
  if (two) {
    float* c1 = c + 16 * (stride / 4);
    PC_TILE_STORE(2, c1, stride);
    PC_TILE_STORE(3, c1 + 16, stride);
  }
}

// The online-softmax update of R rows that see every key of the tile ([0, nvec * 16): a long
// prompt's interior blocks), R at once: each row's arithmetic is update_rows_amx's per-row
// loop (the same max, the same exp2 and the same ascending sum), interleaved so that the
// rows' dependency chains (the max, its reduction, the sum) overlap instead of queueing.
template <int R>
PC_AMX inline void softmax_seen_rows(const float (*sbuf)[kKeyBlock], int64_t nvec, int64_t pv_keys,
                                     int i0, const int64_t* rowp, float* m, float* l,
                                     uint16_t (*pbf)[kKeyBlock], float* corr, float scale2f) {
  const __m512 scale2 = _mm512_set1_ps(scale2f);
  __m512 vmax[R];
  for (int j = 0; j < R; ++j) vmax[j] = _mm512_load_ps(&sbuf[i0 + j][0]);
  for (int64_t c = 1; c < nvec; ++c)
    for (int j = 0; j < R; ++j) vmax[j] = _mm512_max_ps(vmax[j], _mm512_load_ps(&sbuf[i0 + j][c * 16]));
  __m512 mv[R], sum[R];
  float m_new[R];
  for (int j = 0; j < R; ++j) {
    m_new[j] = std::max(m[rowp[j]], _mm512_reduce_max_ps(vmax[j]) * scale2f);
    mv[j] = _mm512_set1_ps(m_new[j]);
    sum[j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < nvec; ++c)
    for (int j = 0; j < R; ++j) {
      const __m512 e = exp2_p5(_mm512_fmsub_ps(_mm512_load_ps(&sbuf[i0 + j][c * 16]), scale2, mv[j]));
      sum[j] = _mm512_add_ps(sum[j], e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&pbf[i0 + j][c * 16]),
                         (__m256i)_mm512_cvtneps_pbh(e));
    }
  for (int j = 0; j < R; ++j) {
    if (nvec * 16 < pv_keys) std::memset(&pbf[i0 + j][nvec * 16], 0, sizeof(uint16_t) * 16);
    const int64_t row = rowp[j];
    corr[i0 + j] = std::exp2(m[row] - m_new[j]);
    l[row] = l[row] * corr[i0 + j] + _mm512_reduce_add_ps(sum[j]);
    m[row] = m_new[j];
  }
}

// The online-softmax update of rows [r0, r0 + nr) (nr <= 32) from their scores for the block
// at k0 (sbuf, raw: unscaled, query-major, keys [0, tile_keys) of each row written), then
// O = O * corr + P V with V packed as pairs of keys: attend_packed's arithmetic on tiles.
// Every way of computing the scores (attend_packed_amx, the decode step that reads K in
// place) ends here, so a row's bits do not depend on which one ran.
template <int D>
PC_AMX void update_rows_amx(float (*sbuf)[kKeyBlock], const uint32_t* vblk, int64_t k0,
                            int64_t r0, int nr, int64_t tile_keys, const int64_t* limit,
                            const int64_t* begin, float* m, float* l, float* obuf,
                            float scale2f, float cap2f) {
  constexpr int64_t BK = kKeyBlock;
  const bool two = nr > 16;
  const int rows = two ? 32 : 16;  // rows the tiles compute (those past nr are zeros)
  if (cap2f > 0.0f) {  // softcapped in place (attend_packed's arithmetic), then unscaled
    const __m512 s2 = _mm512_set1_ps(scale2f), cap2 = _mm512_set1_ps(cap2f);
    for (int i = 0; i < nr; ++i)
      for (int64_t c = 0; c * 16 < tile_keys; ++c)
        _mm512_store_ps(&sbuf[i][c * 16],
                        softcap_ps(_mm512_mul_ps(_mm512_load_ps(&sbuf[i][c * 16]), s2), cap2));
    scale2f = 1.0f;
  }
  const __m512 scale2 = _mm512_set1_ps(scale2f);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  alignas(64) uint16_t pbf[32][BK];
  alignas(64) float pv[32][D];
  // The online-softmax update per row, as attend_packed; P in bf16, zero past the row's keys.
  const int64_t nvec = (tile_keys + 15) / 16;
  const int64_t pv_keys = (tile_keys + 31) / 32 * 32;  // keys the P V pass reads
  float corr[32];
  constexpr int R = 4;
  for (int i = 0; i < rows; ++i) {
    if (i % R == 0 && i + R <= nr) {  // R rows that see every key of the tile: interleaved
      bool all_seen = true;
      int64_t rowp[R];
      for (int j = 0; j < R; ++j) {
        rowp[j] = r0 + i + j;
        all_seen = all_seen && limit[rowp[j]] - k0 >= nvec * 16 && (!begin || begin[rowp[j]] <= k0);
      }
      if (all_seen) {
        softmax_seen_rows<R>(sbuf, nvec, pv_keys, i, rowp, m, l, pbf, corr, scale2f);
        i += R - 1;
        continue;
      }
    }
    uint16_t* p = pbf[i];
    const int64_t row = r0 + i;
    const int64_t valid = i < nr ? limit[row] - k0 : 0;
    const int64_t skip = i < nr && begin ? begin[row] - k0 : 0;
    if (valid <= 0 || skip >= BK) {
      corr[i] = 1.0f;
      std::memset(p, 0, sizeof(uint16_t) * pv_keys);
      continue;
    }
    // The max of the raw scores, then scaled: rounding a product by scale2 > 0 keeps the
    // order, so it is the max of the scaled scores, one multiply per row, not per key.
    __m512 vmax = neg_inf;
    for (int64_t c = 0; c < nvec; ++c)
      vmax = _mm512_max_ps(
          vmax, _mm512_mask_mov_ps(neg_inf, seen(valid, skip, c), _mm512_load_ps(&sbuf[i][c * 16])));
    const float m_new = std::max(m[row], _mm512_reduce_max_ps(vmax) * scale2f);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < nvec; ++c) {
      const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(&sbuf[i][c * 16]), scale2, mv);
      const __m512 e = _mm512_maskz_mov_ps(seen(valid, skip, c), exp2_p5(x));
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p + c * 16), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (nvec * 16 < pv_keys) std::memset(p + nvec * 16, 0, sizeof(uint16_t) * 16);
    corr[i] = std::exp2(m[row] - m_new);  // m[row] = -inf at first: 0
    l[row] = l[row] * corr[i] + _mm512_reduce_add_ps(sum);
    m[row] = m_new;
  }
  // P V from zero on the tiles, 32 columns a pass, key pairs in ascending 32-key steps;
  // then O = O * corr + P V per row in one FMA (a tile loaded from O just written by vector
  // code waits for those stores: the round trip cost more than the P V itself).
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    zero_four();
    for (int64_t ks = 0; ks < pv_keys / 32; ++ks)
      dp_two_by_two(&pbf[0][ks * 32], &pbf[16][ks * 32], BK * 2, vblk + ks * 16 * D + c0,
                    D * 4, two);
    store_two_by_two(&pv[0][c0], D * 4, two);
  }
  for (int i = 0; i < nr; ++i) {
    float* o = obuf + (r0 + i) * D;
    const __m512 cv = _mm512_set1_ps(corr[i]);
    for (int c = 0; c < D; c += 16)
      _mm512_storeu_ps(o + c, _mm512_fmadd_ps(_mm512_loadu_ps(o + c), cv, _mm512_load_ps(&pv[i][c])));
  }
}

// Keys of the block at k0 that any of rows [r0, r0 + nr) sees, at most kKeyBlock.
inline int64_t keys_seen(const int64_t* limit, int64_t k0, int64_t r0, int nr) {
  int64_t keys = 0;
  for (int i = 0; i < nr; ++i)
    keys = std::max(keys, std::min<int64_t>(limit[r0 + i] - k0, kKeyBlock));
  return keys;
}

// One key block [k0, k0 + kKeyBlock) for rows [ra, rb): attend_packed's contract (bf16), the
// tile configuration loaded on this thread. Rows go 32 at a time (two row tiles, the last
// group one where 16 rows remain): scores as 2 x 2 tile products, each K tile loaded once
// for both row tiles, then update_rows_amx. D >= 64 (a multiple of 64).
template <int D>
PC_AMX void attend_packed_amx(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                              int64_t rb, const uint32_t* qw, const int64_t* limit,
                              const int64_t* begin, float* m, float* l, float* obuf,
                              float scale2f, float cap2f) {
  static_assert(D % 64 == 0, "the AMX step takes 32 columns of O a pass");
  constexpr int64_t KW = D / 2;  // words per query row
  constexpr int64_t BK = kKeyBlock;
  alignas(64) uint32_t qpad[32 * KW];
  alignas(64) float sbuf[32][BK];
  for (int64_t r0 = ra; r0 < rb; r0 += 32) {
    const int nr = static_cast<int>(std::min<int64_t>(32, rb - r0));
    const bool two = nr > 16;
    const int rows = two ? 32 : 16;
    const int64_t tile_keys = keys_seen(limit, k0, r0, nr);
    if (tile_keys <= 0) continue;
    const uint32_t* q = qw + r0 * KW;
    if (nr < rows) {
      std::memcpy(qpad, q, sizeof(uint32_t) * nr * KW);
      std::memset(qpad + nr * KW, 0, sizeof(uint32_t) * (rows - nr) * KW);
      q = qpad;
    }
    // Scores, 32 keys a pass: S = Q K over ascending 32-wide d steps, from zero.
    for (int64_t kp = 0; kp * 32 < tile_keys; ++kp) {
      zero_four();
      for (int64_t s = 0; s < D / 32; ++s)
        dp_two_by_two(q + s * 16, q + 16 * KW + s * 16, KW * 4, kblk + s * 16 * BK + kp * 32,
                      BK * 4, two);
      store_two_by_two(&sbuf[0][kp * 32], BK * 4, two);
    }
    update_rows_amx<D>(sbuf, vblk, k0, r0, nr, tile_keys, limit, begin, m, l, obuf, scale2f,
                       cap2f);
  }
}

}  // namespace pc

#endif  // PC_NARROW_VECTORS
