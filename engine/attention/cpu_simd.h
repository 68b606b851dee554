// SIMD helpers shared by the engine's attention kernels (cpu_attention.cpp, cpu_row_attention.cpp).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pc {

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// 2^x for x <= 0 (clamped at -127; callers zero masked lanes themselves).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, xi), _mm512_set1_ps(0.69314718056f));
  // e^f for |f| <= ln2 / 2: Taylor to degree 7 (relative error < 2e-9).
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, xi);
}

// cap2 * tanh(x): Gemma 2's attention logit softcap (cap2 = cap * log2 e, x the score over
// cap), as (1 - e) / (1 + e) with e = e^(-2|x|) <= 1 and x's sign: no overflow at any x, and
// within 1e-7 of tanh absolutely.
inline __m512 softcap_ps(__m512 x, __m512 cap2) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i xi = _mm512_castps_si512(x);
  const __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, xi));
  const __m512 e = exp2_ps(_mm512_mul_ps(ax, _mm512_set1_ps(-2.88539008178f)));  // -2 log2 e
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 signed_t = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign_bit, xi)));
  return _mm512_mul_ps(signed_t, cap2);
}

inline __mmask16 prefix_mask(int64_t n) {  // the first n of 16 lanes
  if (n >= 16) return 0xFFFF;
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

// Calls fn with the head dim as a compile-time constant; -1 for one the kernels lack.
template <typename Fn>
int with_head_dim(int64_t d, Fn&& fn) {
  switch (d) {
    case 32:
      fn(std::integral_constant<int, 32>{});
      return 0;
    case 64:
      fn(std::integral_constant<int, 64>{});
      return 0;
    case 96:  // Phi-3 and Phi-3.5 mini
      fn(std::integral_constant<int, 96>{});
      return 0;
    case 128:
      fn(std::integral_constant<int, 128>{});
      return 0;
    case 256:  // Gemma 3
      fn(std::integral_constant<int, 256>{});
      return 0;
    default:
      return -1;
  }
}

// fp8 KV pages (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): one byte per element, no scale (a
// scale of 1, as vLLM's default). Every fp8 value is exact in bf16 and fp32, so a page read
// through to_ps gives the same operands whatever the compute dtype's path does next.
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};
template <typename KV>
constexpr bool kFp8 = std::is_same_v<KV, Fp8E4M3> || std::is_same_v<KV, Fp8E5M2>;

// 16 fp8 values at p as fp32, exactly (subnormals, signed zeros and NaN included).
template <typename KV>
inline __m512 fp8x16_to_ps(const KV* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<KV, Fp8E5M2>) {  // the top byte of an fp16
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  } else {  // e4m3fn: bias 7, no infinities, S.1111.111 is NaN
    const __m512i w = _mm512_cvtepu8_epi32(b);
    const __m512i em = _mm512_and_si512(w, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24);
    // Normal: exponent and mantissa moved into fp32's fields, the bias raised by 127 - 7.
    const __m512 normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    // Subnormal (exponent 0): mantissa x 2^-9.
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
    __m512 mag = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal, sub);
    mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)), mag,
                               _mm512_set1_ps(NAN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
  }
}

// D fp8 values at src into dst as T (bf16 as uint16_t, or float): exact.
template <int D, typename T, typename KV>
inline void fp8_row_to(const KV* src, T* dst) {
  for (int c = 0; c < D; c += 16) {
    const __m512 x = fp8x16_to_ps(src + c);
    if constexpr (std::is_same_v<T, float>)
      _mm512_storeu_ps(dst + c, x);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

// Query rows per register tile: 4 rows x D/16 accumulators must fit 32 vector registers.
// With PC_NARROW_VECTORS (the AVX2 build: each 512-bit value two of 16 ymm registers) four
// rows, as attend_packed_f32_ymm groups them (its bf16 is emulated, at any tile about the
// same speed); a row's arithmetic is the same whatever the tile.
#ifdef PC_NARROW_VECTORS
template <int D>
constexpr int kTileRows = 4;
#else
template <int D>
constexpr int kTileRows = D == 128 ? 2 : 4;
#endif

}  // namespace pc
