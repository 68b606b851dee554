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

// Query rows per register tile: 4 rows x D/16 accumulators must fit 32 vector registers.
template <int D>
constexpr int kTileRows = D == 128 ? 2 : 4;

}  // namespace pc
