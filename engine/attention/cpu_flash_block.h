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

// Vectors of 16 output columns per pass: the most, up to `most`, that divide the row's `nd`
// evenly (head dim 96 at four rows: 3 of its 6).
constexpr int column_chunk(int nd, int most) {
  for (int ch = nd < most ? nd : most; ch > 1; --ch)
    if (nd % ch == 0) return ch;
  return 1;
}

// 32-bit words per packed key block, K and V alike: kKeyBlock keys x D elements.
template <int D, typename T>
constexpr int64_t kBlockWords = kKeyBlock * D * static_cast<int64_t>(sizeof(T)) / 4;

// One key block [k0, k0 + kKeyBlock) for rows [ra, rb) of a task: scores, the online-softmax
// update, O = O * corr + P V. With a softcap (cap2f = cap * log2 e > 0; scale2f is then
// scale / cap), each score s becomes cap2f * tanh(s * scale2f) before the softmax. qw: each
// row's query as KW words. Row r sees keys [begin[r], limit[r]) (begin == nullptr: from 0; a
// sliding window's first key otherwise); the packed words of the keys it does not see may be
// anything finite.
#ifdef PC_NARROW_VECTORS
// The AVX2 build's fp32 block (see attend_packed): native 256-bit code, one row at a time,
// because SIMDe's 512-bit values live in memory and spill every accumulator (7-9x slower
// than torch's attention). Per row the same steps: scores over ascending d, scaled; the
// block's max; exp2 of the seen keys (the same polynomial), their sum in lane order; O
// scaled by the correction, then one FMA per key in ascending order, 64 columns a pass.
inline __m256 exp2_ps_ymm(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 xi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, xi), _mm256_set1_ps(0.69314718056f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // p * 2^xi, xi in [-127, 0]: two normal factors, so only the second product rounds.
  const __m256i n = _mm256_cvtps_epi32(xi);
  const __m256i n1 = _mm256_srai_epi32(_mm256_sub_epi32(n, _mm256_srai_epi32(n, 31)), 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pc_avx2::pow2_ps(n1)),
                       pc_avx2::pow2_ps(_mm256_sub_epi32(n, n1)));
}

// Lanes of keys j0 .. j0 + 7 a row sees (skip <= j < valid) as an all-ones mask per lane.
inline __m256 seen_ymm(int64_t valid, int64_t skip, int64_t j0) {
  const __m256i j = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j0)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(skip)), j);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), j);
  return _mm256_castsi256_ps(_mm256_andnot_si256(lo, hi));
}

inline float hsum_ymm(__m256 v) {  // lanes (0+4, 1+5, 2+6, 3+7), then pairs, in that order
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float hmax_ymm(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// softcap_ps (cpu_simd.h) on 8 lanes: the same steps.
inline __m256 softcap_ymm(__m256 x, __m256 cap2) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign_bit, x);
  const __m256 e = exp2_ps_ymm(_mm256_mul_ps(ax, _mm256_set1_ps(-2.88539008178f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign_bit, x)), cap2);
}

// Scores of rows row .. row + NR - 1 for keys [0, keys) of the block, scaled, into sbuf[NR]:
// 8 * NC keys a pass, each K load shared by the NR rows (NR * NC accumulators: 2 x 4 or
// 4 x 2). A score is the same sum in the same order whatever NR and NC.
template <int D, int NR, int NC>
void scores_f32_ymm(const float* kf, const float* const* q, int64_t keys, __m256 scale2,
                    float (*sbuf)[kKeyBlock]) {
  for (int64_t j0 = 0; j0 < keys; j0 += 8 * NC) {
    __m256 s[NR][NC];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < NC; ++c) s[i][c] = _mm256_setzero_ps();
    const float* kj = kf + j0;
    for (int p = 0; p < D; ++p, kj += kKeyBlock) {
      __m256 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = _mm256_loadu_ps(kj + c * 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 qb = _mm256_broadcast_ss(q[i] + p);
        for (int c = 0; c < NC; ++c) s[i][c] = _mm256_fmadd_ps(qb, kv[c], s[i][c]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < NC; ++c)
        _mm256_store_ps(sbuf[i] + j0 + c * 8, _mm256_mul_ps(s[i][c], scale2));
  }
}

// O rows = O * corr + P V over keys [0, keys), 8 * NC columns a pass (a row's P is zero past
// its own keys, and O + 0 * v is O).
template <int D, int NR, int NC>
void pv_f32_ymm(const float* vf, const float* const* p, const float* corr, int64_t keys,
                float* const* orow) {
  for (int c0 = 0; c0 < D; c0 += 8 * NC) {
    __m256 o[NR][NC];
    for (int i = 0; i < NR; ++i) {
      const __m256 cv = _mm256_set1_ps(corr[i]);
      for (int c = 0; c < NC; ++c)
        o[i][c] = _mm256_mul_ps(_mm256_loadu_ps(orow[i] + c0 + c * 8), cv);
    }
    const float* vj = vf + c0;
    for (int64_t j = 0; j < keys; ++j, vj += D) {
      __m256 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(vj + c * 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 pw = _mm256_broadcast_ss(p[i] + j);
        for (int c = 0; c < NC; ++c) o[i][c] = _mm256_fmadd_ps(pw, vv[c], o[i][c]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(orow[i] + c0 + c * 8, o[i][c]);
  }
}

// Up to kYmmRows rows share each K and V load: the block (kKeyBlock keys x D, K and V) is
// read from cache once per four rows, which at D = 256 (128 KB each, past L1) bounds the speed.
constexpr int kYmmRows = 4;

template <int D>
void attend_packed_f32_ymm(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                           int64_t rb, const uint32_t* qw, const int64_t* limit,
                           const int64_t* begin, float* m, float* l, float* obuf, float* pbuf,
                           float scale2f, float cap2f) {
  static_assert(D % 32 == 0, "head dims are multiples of 32");
  const float* kf = reinterpret_cast<const float*>(kblk);  // [D][kKeyBlock]
  const float* vf = reinterpret_cast<const float*>(vblk);  // [kKeyBlock][D]
  const __m256 scale2 = _mm256_set1_ps(scale2f);
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  alignas(32) float sbuf[kYmmRows][kKeyBlock];
  for (int64_t r0 = ra; r0 < rb;) {
    // The next rows (up to kYmmRows) that see keys of this block.
    int64_t rows[kYmmRows], keys[kYmmRows], nr = 0;
    for (; r0 < rb && nr < kYmmRows; ++r0) {
      const int64_t valid = limit[r0] - k0, skip = begin ? begin[r0] - k0 : 0;
      if (valid <= 0 || skip >= kKeyBlock) continue;  // O * 1 + 0: unchanged
      rows[nr] = r0;
      keys[nr++] = std::min<int64_t>(valid, kKeyBlock);
    }
    if (nr == 0) break;
    int64_t tile_keys = 0;
    const float* q[kYmmRows];
    for (int64_t i = 0; i < kYmmRows; ++i) {  // a missing row repeats the last (not stored)
      const int64_t row = rows[std::min<int64_t>(i, nr - 1)];
      q[i] = reinterpret_cast<const float*>(qw) + row * D;
      if (i < nr) tile_keys = std::max(tile_keys, keys[i]);
    }
    if (nr > 2)
      scores_f32_ymm<D, 4, 2>(kf, q, tile_keys, scale2, sbuf);
    else if (nr == 2)
      scores_f32_ymm<D, 2, 4>(kf, q, tile_keys, scale2, sbuf);
    else
      scores_f32_ymm<D, 1, 4>(kf, q, tile_keys, scale2, sbuf);
    if (cap2f > 0.0f) {
      const __m256 cap2 = _mm256_set1_ps(cap2f);
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t c = 0; c * 8 < tile_keys; ++c)
          _mm256_store_ps(sbuf[i] + c * 8, softcap_ymm(_mm256_load_ps(sbuf[i] + c * 8), cap2));
    }
    float corr[kYmmRows];
    const float* prow[kYmmRows];
    float* orow[kYmmRows];
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t row = rows[i], valid = limit[row] - k0;
      const int64_t skip = begin ? begin[row] - k0 : 0;
      const int64_t nvec = (tile_keys + 7) / 8;
      __m256 vmax = neg_inf;
      for (int64_t c = 0; c < nvec; ++c)
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(neg_inf, _mm256_load_ps(sbuf[i] + c * 8),
                                                    seen_ymm(valid, skip, c * 8)));
      const float m_new = std::max(m[row], hmax_ymm(vmax));
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      float* p = pbuf + i * kKeyBlock;
      for (int64_t c = 0; c < nvec; ++c) {
        const __m256 e = _mm256_and_ps(
            seen_ymm(valid, skip, c * 8),
            exp2_ps_ymm(_mm256_sub_ps(_mm256_load_ps(sbuf[i] + c * 8), mv)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(p + c * 8, e);
      }
      corr[i] = std::exp2(m[row] - m_new);  // m[row] = -inf at first: 0
      l[row] = l[row] * corr[i] + hsum_ymm(sum);
      m[row] = m_new;
      prow[i] = p;
      orow[i] = obuf + row * D;
    }
    if (nr == 4)
      pv_f32_ymm<D, 4, 2>(vf, prow, corr, tile_keys, orow);
    else if (nr == 3)
      pv_f32_ymm<D, 3, 2>(vf, prow, corr, tile_keys, orow);
    else if (nr == 2)
      pv_f32_ymm<D, 2, 4>(vf, prow, corr, tile_keys, orow);
    else
      pv_f32_ymm<D, 1, 4>(vf, prow, corr, tile_keys, orow);
  }
}
#endif

template <int D, int R, typename T>
void attend_packed(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                   int64_t rb, const uint32_t* qw, const int64_t* limit, const int64_t* begin,
                   float* m, float* l, float* obuf, float* pbuf, float scale2f,
                   float cap2f = 0.0f) {
#ifdef PC_NARROW_VECTORS
  if constexpr (kF32<T>) {
    attend_packed_f32_ymm<D>(kblk, vblk, k0, ra, rb, qw, limit, begin, m, l, obuf, pbuf,
                             scale2f, cap2f);
    return;
  }
#endif
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
    if (cap2f > 0.0f) {  // softcapped: scale2 was scale / cap, so these are score / cap
      const __m512 cap2 = _mm512_set1_ps(cap2f);
      for (int i = 0; i < nr; ++i)
        for (int64_t c = 0; c < nvec; ++c)
          _mm512_store_ps(&sbuf[i][c * 16], softcap_ps(_mm512_load_ps(&sbuf[i][c * 16]), cap2));
    }
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
    // accumulators stay in registers: CH columns of 16 at a time (R x CH accumulators, CH
    // V vectors), all keys per chunk; each output element takes the same FMAs in the same
    // order whatever CH (D = 256 at R = 4 would otherwise hold 64 accumulators and spill).
    constexpr int CH = column_chunk(ND, 16 / R);
    static_assert(ND % CH == 0, "column chunks divide the head dim");
    alignas(64) float spare[D];
    float* orow[R];
    float cv[R];
    for (int i = 0; i < R; ++i) {
      orow[i] = i < nr ? obuf + (r0 + i) * D : spare;
      cv[i] = i < nr ? corr[i] : 0.0f;
    }
    for (int c0 = 0; c0 < ND; c0 += CH) {
      __m512 o[R][CH];
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < CH; ++c)
          o[i][c] = i < nr ? _mm512_mul_ps(_mm512_loadu_ps(orow[i] + (c0 + c) * 16),
                                           _mm512_set1_ps(cv[i]))
                           : _mm512_setzero_ps();
      if constexpr (kF32<T>) {
        const float* vf = reinterpret_cast<const float*>(vblk) + c0 * 16;
        for (int64_t j = 0; j < tile_keys; ++j) {
          __m512 vv[CH];
          for (int c = 0; c < CH; ++c) vv[c] = _mm512_loadu_ps(vf + j * D + c * 16);
          for (int i = 0; i < R; ++i) {
            const __m512 pw = _mm512_set1_ps(pbuf[(i < nr ? i : 0) * kKeyBlock + j]);
            for (int c = 0; c < CH; ++c) o[i][c] = _mm512_fmadd_ps(pw, vv[c], o[i][c]);
          }
        }
      } else {
        const int64_t pairs = (tile_keys + 1) / 2;
        const uint32_t* vc = vblk + c0 * 16;
        for (int64_t jp = 0; jp < pairs; ++jp) {
          __m512bh vv[CH];
          for (int c = 0; c < CH; ++c)
            vv[c] = (__m512bh)_mm512_loadu_si512(vc + jp * D + c * 16);
          for (int i = 0; i < R; ++i) {
            const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(
                load_pair(pbuf16 + (i < nr ? i : 0) * 2 * kKeyBlock + 2 * jp)));
            for (int c = 0; c < CH; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pw, vv[c]);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < CH; ++c) _mm512_storeu_ps(orow[i] + (c0 + c) * 16, o[i][c]);
    }
  }
}

}  // namespace pc
