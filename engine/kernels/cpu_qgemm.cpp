// Batch-invariant GEMM over block-quantized weights, dequantized in the kernel:
// out = x W^T + b with W held as small integers q with per-block fp32 scales, x bf16
// (AVX512_BF16) or fp32 (AVX2 + FMA, on either build target).
//
// Built at first use by cpu_qgemm.py (g++, no torch headers) and called through ctypes.
// W's k runs in blocks of 32. Two formats:
//   I8:  w = s * q,      q int8 (GGUF Q8_0, Q5_0, Q4_0 map here);
//   U4M: w = s * q + mn, q in 0..15 (Q4_1, Q4_K map here).
// bf16 x: small integers are exact in bf16, so for each output element and block, one fp32
// partial takes the 16 k-pairs of that block by VDPBF16PS in ascending k (a fresh partial per
// block), then acc = fma(partial, s, acc) (and acc = fma(sum(x over the block), mn, acc) for
// U4M), blocks in ascending k.
// fp32 x: per block two fresh partials, one over the even k and one over the odd k, each by
// FMA in ascending k; partial = even + odd; then acc as above (sum(x) in one fixed order).
// Either sequence is the same whatever tile, row position, row count or thread computes the
// element: a row's result never depends on its batch. Whether a tile converts the weights on
// the fly (few rows) or reads them from a per-task scratch (many rows) changes where the same
// integers come from, not the arithmetic.
//
// Packed layout: groups of 16 output columns (one 512-bit vector, two 256-bit ones); a group
// is its blocks in k order, each a record of the block's weights then 16 fp32 scales (then 16
// fp32 mins for U4M):
//   I8:  [16 pairs][16 columns][2] int8 (k = 2p, 2p + 1 of each column side by side);
//   U4M: [16 pairs][16 columns] bytes, low nibble k = 2p, high nibble k = 2p + 1.
// Columns past N are zero (scale 0). The AVX2 build (PC_NARROW_VECTORS) has the fp32 entry
// points and the packing only: bf16 there would be emulated.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QB = 32;    // k per block
constexpr int64_t GC = 16;    // columns per group (one vector)
constexpr int PAIRS = 16;     // k-pairs per block
constexpr int MR = 4;         // rows per register tile (4 x 2 partials + 4 x 2 accumulators)
constexpr int64_t CHUNK = 12 * MR;  // rows per task when the batch is large
constexpr int64_t PREFETCH_BLOCKS = 4;  // how far ahead a few-row tile prefetches its records

enum Format { I8 = 0, U4M = 1 };

inline int64_t qbytes_of(int fmt) { return fmt == I8 ? PAIRS * GC * 2 : PAIRS * GC; }
inline int64_t rec_bytes_of(int fmt) { return qbytes_of(fmt) + (fmt == I8 ? 64 : 128); }
inline int64_t groups_of(int64_t n) { return (n + GC - 1) / GC; }

#ifndef PC_NARROW_VECTORS
inline __mmask16 lane_mask(int64_t n) {
  if (n >= 16) return 0xFFFF;
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

// bf16 of 0..15 (the bits of the float, upper half), the U4M lookup table.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// The 32 bf16 weights of pair p of a block record: word 2c = column c's k = 2p, 2c + 1 its
// k = 2p + 1 (the layout VDPBF16PS pairs with a broadcast x pair).
template <bool U4>
inline __m512bh pair_weights(const uint8_t* rec, int p, __m512i table) {
  if constexpr (U4) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rec + p * GC)));
    const __m512i idx = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)),
                                         _mm512_set1_epi32(0x000F000F));
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
  } else {
    const uint8_t* q = rec + p * GC * 2;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

#endif  // PC_NARROW_VECTORS

struct QView {
  const uint8_t* packed;
  int64_t n, k, nblocks, rec_bytes, qbytes;
  const uint8_t* record(int64_t g, int64_t b) const {
    return packed + (g * nblocks + b) * rec_bytes;
  }
};

#ifndef PC_NARROW_VECTORS
inline void store_bf16(uint16_t* dst, __m512 v, __mmask16 mk) {
  _mm256_mask_storeu_epi16(dst, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows [r0, r0 + R) x groups [g0, g0 + NV). SCRATCH: weights from `scratch` (bf16 pairs of
// these groups, [block][pair][NV]) instead of converted from the records.
template <int R, int NV, bool U4, bool SCRATCH>
void qtile(const uint16_t* x, int64_t ldx, int64_t r0, const QView& w, int64_t g0,
           const uint32_t* scratch, const float* xsum, const float* bias, uint16_t* out,
           int64_t ldo) {
  const __m512i table = nibble_table();
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  const uint16_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  for (int64_t b = 0; b < w.nblocks; ++b) {
    const uint8_t* rec[NV];
    for (int c = 0; c < NV; ++c) rec[c] = w.record(g0 + c, b);
    __m512 part[R][NV];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NV; ++c) part[i][c] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; ++p) {
      if constexpr (!SCRATCH) {  // the records a few blocks ahead, a line a pair
        for (int c = 0; c < NV; ++c)
          if (p * 64 < w.rec_bytes && b + PREFETCH_BLOCKS < w.nblocks)
            _mm_prefetch((const char*)(rec[c] + PREFETCH_BLOCKS * w.rec_bytes + p * 64),
                         _MM_HINT_T0);
      }
      __m512bh bq[NV];
      for (int c = 0; c < NV; ++c)
        bq[c] = SCRATCH ? (__m512bh)_mm512_loadu_si512(scratch + ((b * PAIRS + p) * NV + c) * 16)
                        : pair_weights<U4>(rec[c], p, table);
      for (int i = 0; i < R; ++i) {
        uint32_t word;
        std::memcpy(&word, rows[i] + b * QB + 2 * p, sizeof(word));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int c = 0; c < NV; ++c) part[i][c] = _mm512_dpbf16_ps(part[i][c], a, bq[c]);
      }
    }
    for (int c = 0; c < NV; ++c) {
      const __m512 s = _mm512_loadu_ps((const float*)(rec[c] + w.qbytes));
      for (int i = 0; i < R; ++i) acc[i][c] = _mm512_fmadd_ps(part[i][c], s, acc[i][c]);
      if constexpr (U4) {
        const __m512 mn = _mm512_loadu_ps((const float*)(rec[c] + w.qbytes + 64));
        for (int i = 0; i < R; ++i)
          acc[i][c] =
              _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + i) * w.nblocks + b]), mn, acc[i][c]);
      }
    }
  }
  for (int c = 0; c < NV; ++c) {
    const int64_t col = (g0 + c) * GC;
    const __mmask16 mk = lane_mask(w.n - col);
    if (mk == 0) continue;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      store_bf16(out + (r0 + i) * ldo + col, _mm512_add_ps(acc[i][c], bv), mk);
  }
}

template <typename Fn>
void with_rows(int r, Fn&& fn) {
  switch (r) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// sum(x) over each block of each row, in one fixed order (U4M's min term).
void block_sums(const uint16_t* x, int64_t ldx, int64_t m, int64_t nblocks, float* xsum,
                int nthreads) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nblocks; ++b) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(x + r * ldx + b * QB);
      xsum[r * nblocks + b] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), v, ones));
    }
}

template <bool U4>
void run(const uint16_t* x, int64_t ldx, int64_t m, const QView& w, const float* xsum,
         const float* bias, uint16_t* out, int64_t ldo, int nthreads) {
  const int64_t groups = groups_of(w.n);
  // Columns per task: two groups (32), or four for one or two rows where there are enough:
  // each group's partial is a chain of 16 dependent VDPBF16PS a block, so a lone row's tile
  // runs at that latency unless it keeps four chains in flight.
  const int64_t per_task = m <= 2 && groups >= 8 * nthreads ? 4 : 2;
  const int64_t tiles = (groups + per_task - 1) / per_task;
  const int64_t chunk = m <= MR ? m : CHUNK;
  const int64_t chunks = (m + chunk - 1) / chunk;
  const int64_t tasks = tiles * chunks;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<uint32_t> scratch;  // 16 words (32 bf16) a pair and group
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t g0 = (t / chunks) * per_task, ch = t % chunks;
      const int nv = static_cast<int>(std::min<int64_t>(per_task, groups - g0));
      const int64_t r_begin = ch * chunk, r_end = std::min(m, r_begin + chunk);
      const bool use_scratch = r_end - r_begin > MR;
      if (use_scratch) {  // the task's weights as bf16 once, read by every row tile
        scratch.resize(w.nblocks * PAIRS * nv * 16);
        const __m512i table = nibble_table();
        for (int64_t b = 0; b < w.nblocks; ++b)
          for (int c = 0; c < nv; ++c) {
            const uint8_t* rec = w.record(g0 + c, b);
            for (int p = 0; p < PAIRS; ++p)
              _mm512_storeu_si512(scratch.data() + ((b * PAIRS + p) * nv + c) * 16,
                                  (__m512i)pair_weights<U4>(rec, p, table));
          }
      }
      for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
        const int r = static_cast<int>(std::min<int64_t>(MR, r_end - r0));
        with_rows(r, [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          if constexpr (R <= 2) {  // four groups a task (no scratch below MR rows)
            if (nv == 4) {
              qtile<R, 4, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
              return;
            }
            if (nv == 3) {
              qtile<R, 3, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
              return;
            }
          }
          if (use_scratch) {
            if (nv == 2)
              qtile<R, 2, U4, true>(x, ldx, r0, w, g0, scratch.data(), xsum, bias, out, ldo);
            else
              qtile<R, 1, U4, true>(x, ldx, r0, w, g0, scratch.data(), xsum, bias, out, ldo);
          } else if (nv == 2) {
            qtile<R, 2, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
          } else {
            qtile<R, 1, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
          }
        });
      }
    }
  }
}

#endif  // PC_NARROW_VECTORS

// ---- fp32 activations (256-bit AVX2 + FMA) ----

constexpr int64_t CHUNK_F32 = 48;  // rows per task when the batch is large (scratch reuse), 16 tiles of 3

// Pair p of a block record as fp32, columns [8h, 8h + 8): k = 2p into `even`, 2p + 1 `odd`.
template <bool U4>
inline void pair_f32(const uint8_t* rec, int p, int h, __m256& even, __m256& odd) {
  if constexpr (U4) {
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(rec + p * GC + h * 8)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
  } else {
    // 8 columns x 2 k as int16 words (low byte k = 2p), sign-extended to int32
    const __m256i d =
        _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(rec + p * GC * 2 + h * 16)));
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 24));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(d, 8));
  }
}

// Rows [r0, r0 + R) x NY 256-bit column vectors from group g0 (vector j: group g0 + j / 2,
// half j % 2). SCRATCH: weights from `scratch` (fp32, [block][pair][parity][NY][8]), else
// converted from the records. The 2 R NY FMA chains live in registers (R NY <= 6; the
// accumulators are in memory, touched once a block), which is why the loops are written out.
template <int R, int NY, bool U4, bool SCRATCH>
void qtile_f32(const float* x, int64_t ldx, int64_t r0, const QView& w, int64_t g0,
               const float* scratch, const float* xsum, const float* bias, float* out,
               int64_t ldo) {
  static_assert(R * NY <= 6, "the chains and operands must fit in 16 ymm registers");
  alignas(32) float acc[R][NY][8] = {};
  const float* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  for (int64_t b = 0; b < w.nblocks; ++b) {
    const uint8_t* rec[NY];
    for (int j = 0; j < NY; ++j) rec[j] = w.record(g0 + j / 2, b);
    __m256 pe[R][NY], po[R][NY];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NY; ++j) pe[i][j] = po[i][j] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int p = 0; p < PAIRS; ++p) {
      if constexpr (SCRATCH) {
        const float* s = scratch + ((b * PAIRS + p) * 2 * NY) * 8;
        __m256 xe[R];
        for (int i = 0; i < R; ++i) xe[i] = _mm256_broadcast_ss(rows[i] + b * QB + 2 * p);
        for (int j = 0; j < NY; ++j) {
          const __m256 we = _mm256_loadu_ps(s + j * 8);
          for (int i = 0; i < R; ++i) pe[i][j] = _mm256_fmadd_ps(xe[i], we, pe[i][j]);
        }
        for (int i = 0; i < R; ++i) xe[i] = _mm256_broadcast_ss(rows[i] + b * QB + 2 * p + 1);
        for (int j = 0; j < NY; ++j) {
          const __m256 wo = _mm256_loadu_ps(s + (NY + j) * 8);
          for (int i = 0; i < R; ++i) po[i][j] = _mm256_fmadd_ps(xe[i], wo, po[i][j]);
        }
      } else {
        for (int j = 0; j < NY; ++j) {
          __m256 we, wo;
          pair_f32<U4>(rec[j], p, j % 2, we, wo);
          for (int i = 0; i < R; ++i) {
            const float* xr = rows[i] + b * QB + 2 * p;
            pe[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), we, pe[i][j]);
            po[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), wo, po[i][j]);
          }
        }
      }
    }
    for (int j = 0; j < NY; ++j) {
      const float* sc = (const float*)(rec[j] + w.qbytes) + (j % 2) * 8;
      const __m256 s = _mm256_loadu_ps(sc);
      for (int i = 0; i < R; ++i) {
        __m256 a = _mm256_fmadd_ps(_mm256_add_ps(pe[i][j], po[i][j]), s, _mm256_load_ps(acc[i][j]));
        if constexpr (U4)
          a = _mm256_fmadd_ps(_mm256_set1_ps(xsum[(r0 + i) * w.nblocks + b]),
                              _mm256_loadu_ps(sc + 16), a);
        _mm256_store_ps(acc[i][j], a);
      }
    }
  }
  for (int j = 0; j < NY; ++j) {
    const int64_t col = g0 * GC + j * 8;
    const int64_t live = std::min<int64_t>(8, w.n - col);
    if (live <= 0) continue;
    for (int i = 0; i < R; ++i) {
      float* dst = out + (r0 + i) * ldo + col;
      for (int l = 0; l < live; ++l) dst[l] = bias ? acc[i][j][l] + bias[col + l] : acc[i][j][l];
    }
  }
}

// sum(x) over each 32-k block of each row: four 8-lane vectors added in order, then the
// lanes folded in one fixed order (U4M's min term).
void block_sums_f32(const float* x, int64_t ldx, int64_t m, int64_t nblocks, float* xsum,
                    int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (m * nblocks > 4096)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* v = x + r * ldx + b * QB;
      __m256 s = _mm256_loadu_ps(v);
      s = _mm256_add_ps(s, _mm256_loadu_ps(v + 8));
      s = _mm256_add_ps(s, _mm256_loadu_ps(v + 16));
      s = _mm256_add_ps(s, _mm256_loadu_ps(v + 24));
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      xsum[r * nblocks + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

template <bool U4>
void run_f32(const float* x, int64_t ldx, int64_t m, const QView& w, const float* xsum,
             const float* bias, float* out, int64_t ldo, int nthreads) {
  const int64_t groups = groups_of(w.n);
  if (m == 1) {  // one row: two groups (4 vectors, 8 FMA chains) a task, streamed once
    const int64_t tasks = (groups + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; ++t) {
      if (t * 2 + 1 < groups)
        qtile_f32<1, 4, U4, false>(x, ldx, 0, w, t * 2, nullptr, xsum, bias, out, ldo);
      else
        qtile_f32<1, 2, U4, false>(x, ldx, 0, w, t * 2, nullptr, xsum, bias, out, ldo);
    }
    return;
  }
  const int64_t chunk = m <= 2 ? m : CHUNK_F32;
  const int64_t chunks = (m + chunk - 1) / chunk;
  const int64_t tasks = groups * chunks;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scratch;  // one group's weights as fp32, [block][pair][parity][2][8]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t g0 = t / chunks, ch = t % chunks;
      const int64_t r_begin = ch * chunk, r_end = std::min(m, r_begin + chunk);
      const bool use_scratch = r_end - r_begin > 2;
      if (use_scratch) {
        scratch.resize(w.nblocks * PAIRS * 4 * 8);
        for (int64_t b = 0; b < w.nblocks; ++b) {
          const uint8_t* rec = w.record(g0, b);
          for (int p = 0; p < PAIRS; ++p) {
            float* s = scratch.data() + (b * PAIRS + p) * 32;
            for (int h = 0; h < 2; ++h) {
              __m256 even, odd;
              pair_f32<U4>(rec, p, h, even, odd);
              _mm256_storeu_ps(s + h * 8, even);
              _mm256_storeu_ps(s + (2 + h) * 8, odd);
            }
          }
        }
      }
      for (int64_t r0 = r_begin; r0 < r_end;) {
        const int64_t left = r_end - r0;
        if (use_scratch && left >= 3) {
          qtile_f32<3, 2, U4, true>(x, ldx, r0, w, g0, scratch.data(), xsum, bias, out, ldo);
          r0 += 3;
        } else if (use_scratch && left == 2) {
          qtile_f32<2, 2, U4, true>(x, ldx, r0, w, g0, scratch.data(), xsum, bias, out, ldo);
          r0 += 2;
        } else if (use_scratch) {
          qtile_f32<1, 2, U4, true>(x, ldx, r0, w, g0, scratch.data(), xsum, bias, out, ldo);
          r0 += 1;
        } else if (left >= 2) {
          qtile_f32<2, 2, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
          r0 += 2;
        } else {
          qtile_f32<1, 2, U4, false>(x, ldx, r0, w, g0, nullptr, xsum, bias, out, ldo);
          r0 += 1;
        }
      }
    }
  }
}

// One weight's fp32 value as the dequantizer computes it: s * q, then + mn as its own
// rounding (no FMA contraction; volatile keeps the product a rounded float).
inline float dequantized_f32(const uint8_t* rec, int64_t qbytes, int fmt, int64_t lane, int kk) {
  const float* s = reinterpret_cast<const float*>(rec + qbytes);
  const int p = kk / 2, j = kk % 2;
  if (fmt == I8) return s[lane] * static_cast<float>(static_cast<int8_t>(rec[p * GC * 2 + lane * 2 + j]));
  const uint8_t byte = rec[p * GC + lane];
  volatile float prod = s[lane] * static_cast<float>(j ? byte >> 4 : byte & 15);
  return prod + s[16 + lane];
}

inline uint16_t bf16_rne(float f) {  // finite values: round to nearest even, as torch casts
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace

extern "C" {

// Bytes of a packed [n, k] weight (k a multiple of 32).
int64_t pc_qgemm_packed_bytes(int64_t n, int64_t k, int fmt) {
  return groups_of(n) * (k / QB) * rec_bytes_of(fmt);
}

// q int8 [n, k] (U4M: 0..15), scale fp32 [n, k / 32], mn fp32 [n, k / 32] (U4M only).
void pc_qgemm_pack(const int8_t* q, const float* scale, const float* mn, int64_t n, int64_t k,
                   int fmt, uint8_t* packed) {
  const int64_t nblocks = k / QB, qb = qbytes_of(fmt), rb = rec_bytes_of(fmt);
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups_of(n); ++g)
    for (int64_t b = 0; b < nblocks; ++b) {
      uint8_t* rec = packed + (g * nblocks + b) * rb;
      std::memset(rec, 0, rb);
      float* s = reinterpret_cast<float*>(rec + qb);
      for (int64_t c = 0; c < GC; ++c) {
        const int64_t col = g * GC + c;
        if (col >= n) continue;
        const int8_t* qc = q + col * k + b * QB;
        for (int p = 0; p < PAIRS; ++p) {
          if (fmt == I8) {
            rec[p * GC * 2 + c * 2] = static_cast<uint8_t>(qc[2 * p]);
            rec[p * GC * 2 + c * 2 + 1] = static_cast<uint8_t>(qc[2 * p + 1]);
          } else {
            rec[p * GC + c] = static_cast<uint8_t>((qc[2 * p] & 15) | ((qc[2 * p + 1] & 15) << 4));
          }
        }
        s[c] = scale[col * nblocks + b];
        if (fmt == U4M) s[16 + c] = mn[col * nblocks + b];
      }
    }
}

// out fp32 [m, n] (row stride ldo) = x fp32 [m, k] (row stride ldx) W^T + bias (fp32 or null).
void pc_qgemm_f32(const float* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                  int64_t k, int fmt, const float* bias, float* out, int64_t ldo, int nthreads) {
  const QView w{packed, n, k, k / QB, rec_bytes_of(fmt), qbytes_of(fmt)};
  if (fmt == U4M) {
    std::vector<float> xsum(m * w.nblocks);
    block_sums_f32(x, ldx, m, w.nblocks, xsum.data(), nthreads);
    run_f32<true>(x, ldx, m, w, xsum.data(), bias, out, ldo, nthreads);
  } else {
    run_f32<false>(x, ldx, m, w, nullptr, bias, out, ldo, nthreads);
  }
}

// Rows ids[0..m) of W as fp32 into out [m, k]: exactly the dequantizing loader's values.
void pc_qgemm_gather_f32(const uint8_t* packed, int64_t n, int64_t k, int fmt,
                         const int64_t* ids, int64_t m, float* out) {
  const QView w{packed, n, k, k / QB, rec_bytes_of(fmt), qbytes_of(fmt)};
  for (int64_t i = 0; i < m; ++i) {
    const int64_t col = ids[i], g = col / GC, lane = col % GC;
    for (int64_t b = 0; b < w.nblocks; ++b)
      for (int kk = 0; kk < QB; ++kk)
        out[i * k + b * QB + kk] = dequantized_f32(w.record(g, b), w.qbytes, fmt, lane, kk);
  }
}

#ifndef PC_NARROW_VECTORS
// out bf16 [m, n] (row stride ldo) = x bf16 [m, k] (row stride ldx) W^T + bias (fp32 or null).
void pc_qgemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                   int64_t k, int fmt, const float* bias, uint16_t* out, int64_t ldo,
                   int nthreads) {
  const QView w{packed, n, k, k / QB, rec_bytes_of(fmt), qbytes_of(fmt)};
  if (fmt == U4M) {
    std::vector<float> xsum(m * w.nblocks);
    block_sums(x, ldx, m, w.nblocks, xsum.data(), nthreads);
    run<true>(x, ldx, m, w, xsum.data(), bias, out, ldo, nthreads);
  } else {
    run<false>(x, ldx, m, w, nullptr, bias, out, ldo, nthreads);
  }
}

// Rows ids[0..m) of W, dequantized (s * q (+ mn) in fp32, rounded to bf16) into out [m, k]:
// the embedding lookup, the same values a dequantizing loader casts to bf16.
void pc_qgemm_gather_bf16(const uint8_t* packed, int64_t n, int64_t k, int fmt,
                          const int64_t* ids, int64_t m, uint16_t* out) {
  const QView w{packed, n, k, k / QB, rec_bytes_of(fmt), qbytes_of(fmt)};
  for (int64_t i = 0; i < m; ++i) {
    const int64_t col = ids[i], g = col / GC, lane = col % GC;
    for (int64_t b = 0; b < w.nblocks; ++b) {
      const uint8_t* rec = w.record(g, b);
      const float* s = reinterpret_cast<const float*>(rec + w.qbytes);
      for (int kk = 0; kk < QB; ++kk) {
        const int p = kk / 2, j = kk % 2;
        float v;
        if (fmt == I8) {
          v = s[lane] * static_cast<float>(static_cast<int8_t>(rec[p * GC * 2 + lane * 2 + j]));
        } else {
          const uint8_t byte = rec[p * GC + lane];
          const float prod = s[lane] * static_cast<float>(j ? byte >> 4 : byte & 15);
          v = prod + s[16 + lane];
        }
        out[i * k + b * QB + kk] = bf16_rne(v);
      }
    }
  }
}

#endif  // PC_NARROW_VECTORS

}  // extern "C"
