// AVX-512 intrinsics on AVX2 CPUs, force-included (-include) by cpu_library's avx2 target.
//
// SIMDe (libsimde-dev) implements most of AVX-512 over 256-bit registers; this header adds
// the intrinsics its 0.7 release lacks or leaves out of the native aliases, each as the
// same per-lane operation on two 256-bit halves (or lane by lane where AVX2 has no form).
// bf16 rounding is round-to-nearest-even with quiet NaNs, as torch's conversion; the
// hardware instruction also flushes denormals, which only changes bits on AVX-512 CPUs that
// this build never runs on by default. Every function is deterministic, so the kernels'
// batch invariance carries over; their speed is that of the emulation (fp32 GEMM has its
// own 256-bit tile, PC_NARROW_VECTORS in cpu_gemm.cpp).
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <immintrin.h>
#include <simde/x86/avx512.h>
#include <cstdint>
#include <cstring>

namespace pc_avx2 {
inline simde__m256i cvtneps_pbh(simde__m512 a) {
  uint32_t u[16];
  std::memcpy(u, &a, 64);
  uint16_t h[16];
  for (int i = 0; i < 16; ++i) {
    const uint32_t x = u[i];
    h[i] = ((x & 0x7fffffffu) > 0x7f800000u) ? static_cast<uint16_t>((x >> 16) | 0x40u)
                                              : static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
  simde__m256i r;
  std::memcpy(&r, h, 32);
  return r;
}
inline float reduce_add_ps(simde__m512 a) {
  __m256 lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
inline float reduce_max_ps(simde__m512 a) {
  __m256 lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  const __m256 s8 = _mm256_max_ps(lo, hi);
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_max_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
inline void mask_storeu_epi16(void* p, uint16_t k, __m256i v) {
  uint16_t h[16];
  std::memcpy(h, &v, 32);
  uint16_t* d = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) d[i] = h[i];
}
inline simde__m512i cvtepu16_epi32(__m256i v) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m256i a = _mm256_cvtepu16_epi32(lo), b = _mm256_cvtepu16_epi32(hi);
  simde__m512i r;
  std::memcpy(&r, &a, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &b, 32);
  return r;
}
}  // namespace pc_avx2

#define _mm512_cvtneps_pbh(a) ((__m256bh)pc_avx2::cvtneps_pbh(a))
#define _mm512_reduce_add_ps(a) pc_avx2::reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) pc_avx2::reduce_max_ps(a)
#define _mm256_mask_storeu_epi16(p, k, v) pc_avx2::mask_storeu_epi16(p, k, v)
#define _mm512_cvtepu16_epi32(v) pc_avx2::cvtepu16_epi32(v)
#define _mm512_shuffle_f32x4(a, b, imm) \
  simde_mm512_castsi512_ps(simde_mm512_shuffle_i32x4(simde_mm512_castps_si512(a), simde_mm512_castps_si512(b), imm))

namespace pc_avx2 {
template <typename V>
inline void halves(const V& v, __m256i& lo, __m256i& hi) {
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
}
template <typename V>
inline V join(const void* lo, const void* hi) {
  V r;
  std::memcpy(&r, lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, hi, 32);
  return r;
}
inline simde__m512 cvtepi32_ps(simde__m512i v) {
  __m256i lo, hi;
  halves(v, lo, hi);
  const __m256 a = _mm256_cvtepi32_ps(lo), b = _mm256_cvtepi32_ps(hi);
  return join<simde__m512>(&a, &b);
}
inline simde__m512i cvtepu8_epi32(__m128i v) {
  const __m256i a = _mm256_cvtepu8_epi32(v), b = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
  return join<simde__m512i>(&a, &b);
}
inline uint16_t cmplt_epi32_mask(simde__m512i x, simde__m512i y) {
  __m256i xl, xh, yl, yh;
  halves(x, xl, xh);
  halves(y, yl, yh);
  const int lo = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(yl, xl)));
  const int hi = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(yh, xh)));
  return static_cast<uint16_t>(lo | hi << 8);
}
inline simde__m512 maskz_loadu_ps(uint16_t k, const void* p) {
  float f[16];
  const float* s = static_cast<const float*>(p);
  for (int i = 0; i < 16; ++i) f[i] = (k >> i & 1) ? s[i] : 0.0f;
  simde__m512 r;
  std::memcpy(&r, f, 64);
  return r;
}
inline void mask_storeu_ps(void* p, uint16_t k, simde__m512 v) {
  float f[16];
  std::memcpy(f, &v, 64);
  float* d = static_cast<float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) d[i] = f[i];
}
inline __m256i maskz_loadu_epi16(uint16_t k, const void* p) {
  uint16_t h[16];
  const uint16_t* s = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i) h[i] = (k >> i & 1) ? s[i] : 0;
  __m256i r;
  std::memcpy(&r, h, 32);
  return r;
}
inline __m256i cvtepi32_epi16(simde__m512i v) {
  int32_t w[16];
  std::memcpy(w, &v, 64);
  int16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = static_cast<int16_t>(w[i]);
  __m256i r;
  std::memcpy(&r, h, 32);
  return r;
}
}  // namespace pc_avx2

#define _mm512_cvtepi32_ps(v) pc_avx2::cvtepi32_ps(v)
#define _mm512_cvtepu8_epi32(v) pc_avx2::cvtepu8_epi32(v)
#define _mm512_cmplt_epi32_mask(a, b) pc_avx2::cmplt_epi32_mask(a, b)
#define _mm512_maskz_loadu_ps(k, p) pc_avx2::maskz_loadu_ps(k, p)
#define _mm512_mask_storeu_ps(p, k, v) pc_avx2::mask_storeu_ps(p, k, v)
#define _mm256_maskz_loadu_epi16(k, p) pc_avx2::maskz_loadu_epi16(k, p)
#define _mm512_cvtepi32_epi16(v) pc_avx2::cvtepi32_epi16(v)

namespace pc_avx2 {
inline simde__m512 cvtph_ps(__m256i v) {
  const __m256 a = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
  const __m256 b = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
  return join<simde__m512>(&a, &b);
}
inline float mask_reduce_max_ps(uint16_t k, simde__m512 a) {
  float f[16];
  std::memcpy(f, &a, 64);
  for (int i = 0; i < 16; ++i)
    if (!(k >> i & 1)) f[i] = -__builtin_inff();
  simde__m512 m;
  std::memcpy(&m, f, 64);
  return reduce_max_ps(m);
}
inline simde__m512i cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  const simde__m256i lo = cvtneps_pbh(b), hi = cvtneps_pbh(a);
  return join<simde__m512i>(&lo, &hi);
}
inline simde__m512i cvtepi8_epi32(__m128i v) {
  const __m256i a = _mm256_cvtepi8_epi32(v), b = _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8));
  return join<simde__m512i>(&a, &b);
}
}  // namespace pc_avx2

#define _mm512_cvtph_ps(v) pc_avx2::cvtph_ps(v)
#define _mm512_mask_reduce_max_ps(k, a) pc_avx2::mask_reduce_max_ps(k, a)
#define _mm512_cvtne2ps_pbh(a, b) ((__m512bh)pc_avx2::cvtne2ps_pbh(a, b))
#define _mm512_cvtepi8_epi32(v) pc_avx2::cvtepi8_epi32(v)

namespace pc_avx2 {
// 2^k as a float, for k in [-126, 127] (a normal number: exact).
inline __m256 pow2_ps(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
// a * 2^floor(b) with one rounding, as VSCALEFPS, for the kernels' operands: a within a factor
// of 2 of 1 (or NaN), |floor(b)| <= 252. SIMDe's a * exp2(floor(b)) calls exp2f per lane and
// overflows at b = 128 (where e^88.7 is still finite). Here 2^n is two normal factors,
// n = n1 + n2 with n1 = trunc(n / 2): a * 2^n1 is exact, so only the second product rounds.
inline simde__m512 scalef_ps(simde__m512 a, simde__m512 b) {
  __m256 al, ah, bl, bh;
  std::memcpy(&al, &a, 32);
  std::memcpy(&ah, reinterpret_cast<const char*>(&a) + 32, 32);
  std::memcpy(&bl, &b, 32);
  std::memcpy(&bh, reinterpret_cast<const char*>(&b) + 32, 32);
  const auto half = [](__m256 x, __m256 e) {
    e = _mm256_min_ps(_mm256_set1_ps(252.0f), _mm256_max_ps(_mm256_floor_ps(e), _mm256_set1_ps(-252.0f)));
    const __m256i n = _mm256_cvtps_epi32(e);
    const __m256i n1 = _mm256_srai_epi32(_mm256_sub_epi32(n, _mm256_srai_epi32(n, 31)), 1);
    const __m256i n2 = _mm256_sub_epi32(n, n1);
    return _mm256_mul_ps(_mm256_mul_ps(x, pow2_ps(n1)), pow2_ps(n2));
  };
  const __m256 lo = half(al, bl), hi = half(ah, bh);
  return join<simde__m512>(&lo, &hi);
}
}  // namespace pc_avx2

#define _mm512_scalef_ps(a, b) pc_avx2::scalef_ps(a, b)
