// The flash-attention step both CPU attention sources share: one key block for a run of
// query rows, in the packed layout (K as pairs or elements along D, V as pairs of keys or
// rows), with the online-softmax update. Every path that attends through it gives a row the
// same arithmetic, so the batch-invariant kernel (cpu_row_attention.cpp) and the split
// prefill kernel (cpu_attention.cpp) agree on any block they both see.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"

namespace pc {

constexpr int64_t kKeyBlock = 128;  // keys per block

// Lanes of key vector c (keys 16c .. 16c + 15 of a block) a row sees: those before `valid`
// and not before `skip`.
inline __mmask16 seen(int64_t valid, int64_t skip, int64_t c) {
  return static_cast<__mmask16>(prefix_mask(valid - c * 16) & ~prefix_mask(skip - c * 16));
}

template <typename T>
constexpr bool kF32 = std::is_same_v<T, float>;

// 32-bit words per packed key block, K and V alike: kKeyBlock keys x D elements.
template <int D, typename T>
constexpr int64_t kBlockWords = kKeyBlock * D * static_cast<int64_t>(sizeof(T)) / 4;

// One key block [k0, k0 + kKeyBlock) for rows [ra, rb) of a task: scores, the online-softmax
// update, O = O * corr + P V. qw: each row's query as KW words. Row r sees keys
// [begin[r], limit[r]) (begin == nullptr: from 0; a sliding window's first key otherwise); the
// packed words of the keys it does not see may be anything finite.
template <int D, int R, typename T>
void attend_packed(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                   int64_t rb, const uint32_t* qw, const int64_t* limit, const int64_t* begin,
                   float* m, float* l, float* obuf, float* pbuf, float scale2f) {
  constexpr int ND = D / 16;
  constexpr int KW = D * static_cast<int>(sizeof(T)) / 4;
  const __m512 scale2 = _mm512_set1_ps(scale2f);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  // bf16 probabilities live in the first half of each pbuf row (kKeyBlock words of 16 bits).
  uint16_t* pbuf16 = reinterpret_cast<uint16_t*>(pbuf);
  for (int64_t r0 = ra; r0 < rb; r0 += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, rb - r0));
    int64_t tile_keys = 0;  // keys of this block any row of the tile sees
    for (int i = 0; i < nr; ++i)
      tile_keys = std::max(tile_keys, std::min<int64_t>(limit[r0 + i] - k0, kKeyBlock));
    if (tile_keys <= 0) continue;
    alignas(64) float sbuf[R][kKeyBlock];
    for (int64_t half = 0; half * 64 < tile_keys; ++half) {
      __m512 s[R][4];
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < 4; ++c) s[i][c] = _mm512_setzero_ps();
      const uint32_t* kh = kblk + half * 64;
      for (int p = 0; p < KW; ++p) {
        __m512i kv[4];
        for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kh + p * kKeyBlock + c * 16);
        for (int i = 0; i < R; ++i) {
          const __m512i qb =
              _mm512_set1_epi32(static_cast<int>(qw[(r0 + (i < nr ? i : 0)) * KW + p]));
          for (int c = 0; c < 4; ++c) {
            if constexpr (kF32<T>)
              s[i][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(qb), _mm512_castsi512_ps(kv[c]),
                                        s[i][c]);
            else
              s[i][c] = _mm512_dpbf16_ps(s[i][c], (__m512bh)qb, (__m512bh)kv[c]);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < 4; ++c)
          _mm512_store_ps(&sbuf[i][half * 64 + c * 16], _mm512_mul_ps(s[i][c], scale2));
    }
    float corr[R];
    const int64_t nvec = (tile_keys + 15) / 16;
    for (int i = 0; i < nr; ++i) {
      const int64_t row = r0 + i;
      const int64_t valid = limit[row] - k0;
      const int64_t skip = begin ? begin[row] - k0 : 0;  // keys before the row's window
      if (valid <= 0 || skip >= kKeyBlock) {
        corr[i] = 1.0f;
        if constexpr (kF32<T>)
          std::memset(pbuf + i * kKeyBlock, 0, sizeof(float) * kKeyBlock);
        else
          std::memset(pbuf16 + i * 2 * kKeyBlock, 0, sizeof(uint16_t) * kKeyBlock);
        continue;
      }
      __m512 vmax = neg_inf;
      for (int64_t c = 0; c < nvec; ++c) {
        const __m512 x = _mm512_mask_mov_ps(neg_inf, seen(valid, skip, c),
                                            _mm512_load_ps(&sbuf[i][c * 16]));
        vmax = _mm512_max_ps(vmax, x);
      }
      const float m_new = std::max(m[row], _mm512_reduce_max_ps(vmax));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nvec; ++c) {
        const __m512 e = _mm512_maskz_mov_ps(
            seen(valid, skip, c),
            exp2_ps(_mm512_sub_ps(_mm512_load_ps(&sbuf[i][c * 16]), mv)));
        sum = _mm512_add_ps(sum, e);
        if constexpr (kF32<T>)
          _mm512_storeu_ps(pbuf + i * kKeyBlock + c * 16, e);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf16 + i * 2 * kKeyBlock + c * 16),
                              (__m256i)_mm512_cvtneps_pbh(e));
      }
      corr[i] = std::exp2(m[row] - m_new);  // m[row] = -inf at first: 0
      l[row] = l[row] * corr[i] + _mm512_reduce_add_ps(sum);
      m[row] = m_new;
    }
    // Rows past nr go to a scratch row, so that every index below is a constant and the
    // accumulators stay in registers.
    alignas(64) float spare[D];
    float* orow[R];
    __m512 o[R][ND];
    for (int i = 0; i < R; ++i) {
      orow[i] = i < nr ? obuf + (r0 + i) * D : spare;
      const __m512 cv = _mm512_set1_ps(i < nr ? corr[i] : 0.0f);
      for (int c = 0; c < ND; ++c)
        o[i][c] = i < nr ? _mm512_mul_ps(_mm512_loadu_ps(orow[i] + c * 16), cv)
                         : _mm512_setzero_ps();
    }
    if constexpr (kF32<T>) {
      const float* vf = reinterpret_cast<const float*>(vblk);
      for (int64_t j = 0; j < tile_keys; ++j) {
        __m512 vv[ND];
        for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(vf + j * D + c * 16);
        for (int i = 0; i < R; ++i) {
          const __m512 pw = _mm512_set1_ps(pbuf[(i < nr ? i : 0) * kKeyBlock + j]);
          for (int c = 0; c < ND; ++c) o[i][c] = _mm512_fmadd_ps(pw, vv[c], o[i][c]);
        }
      }
    } else {
      const int64_t pairs = (tile_keys + 1) / 2;
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512bh vv[ND];
        for (int c = 0; c < ND; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vblk + jp * D + c * 16);
        for (int i = 0; i < R; ++i) {
          const __m512bh pw = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(load_pair(pbuf16 + (i < nr ? i : 0) * 2 * kKeyBlock + 2 * jp)));
          for (int c = 0; c < ND; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pw, vv[c]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < ND; ++c) _mm512_storeu_ps(orow[i] + c * 16, o[i][c]);
  }
}

}  // namespace pc
