// Batch-invariant GEMM for x86 CPUs with AVX-512 (and AVX512_BF16 for bf16): out = x W^T + b.
//
// Built at first use by cpu_gemm.py (g++, no torch headers) and called through ctypes.
// Every output element is one fp32 accumulator that takes the products of its row and
// column in ascending k, by one instruction sequence whatever the tile it falls in: so a
// row's result never depends on how many rows share the call, where the row sits, or how
// the work is split between threads. (oneDNN's and MKL's GEMMs pick kernels, K blocking
// and tail paths by M, so there a row's bits change with its batch.)
//
// W is packed once at load into panels of 64 output columns:
//   bf16: [N/64][K/2][64] words of (W[n][2p], W[n][2p+1]), the pair VDPBF16PS consumes;
//   fp32: [N/64][K][64] floats.
// Columns past N and the odd k past K are zero.
//
// The avx2 build (cpu_library: SIMDe, PC_NARROW_VECTORS) runs fp32 on native 256-bit tiles
// (6 x 16, or 64 / 32 columns for one / up to three rows) and bf16 on the 512-bit code
// emulated, in 16-column tasks.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t NP = 64;  // columns per panel (4 vectors of 16)
constexpr int MR = 6;       // rows per register tile: 6 x 4 accumulators + 4 panel vectors

inline __mmask16 lane_mask(int64_t n) {
  if (n >= 16) return 0xFFFF;
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

inline int64_t panels_of(int64_t n) { return (n + NP - 1) / NP; }

// x row r's k-pair p as one 32-bit word; the odd k past K reads as zero.
inline uint32_t x_pair(const uint16_t* row, int64_t p, int64_t k) {
  if (2 * p + 1 < k) {
    uint32_t w;
    std::memcpy(&w, row + 2 * p, sizeof(w));
    return w;
  }
  return row[2 * p];
}

// Row i's 16 columns from col: rounded to bf16, or (f32_out) the fp32 sums themselves.
inline void store_out(uint16_t* out, int64_t i, int64_t ldo, int64_t col, __m512 v, __mmask16 mk,
                      bool f32_out) {
  if (f32_out)
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(out) + i * ldo + col, mk, v);
  else
    _mm256_mask_storeu_epi16(out + i * ldo + col, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows [r0, r0 + R) x the NV vectors of panel `pn` starting at vector c0.
template <int R, int NV>
void tile_bf16(const uint16_t* x, int64_t ldx, int64_t r0, const uint32_t* panel, int64_t k,
               int64_t n, int64_t pn, int c0, const float* bias, uint16_t* out, int64_t ldo,
               bool f32_out) {
  const int64_t pairs = (k + 1) / 2, full = k / 2;
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  const uint16_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  for (int64_t p = 0; p < full; ++p) {
    __m512bh b[NV];
    for (int c = 0; c < NV; ++c)
      b[c] = (__m512bh)_mm512_loadu_si512(panel + p * NP + (c0 + c) * 16);
    for (int i = 0; i < R; ++i) {
      uint32_t w;
      std::memcpy(&w, rows[i] + 2 * p, sizeof(w));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, b[c]);
    }
  }
  if (pairs > full) {  // odd K: the last pair's second half is zero in both operands
    __m512bh b[NV];
    for (int c = 0; c < NV; ++c)
      b[c] = (__m512bh)_mm512_loadu_si512(panel + full * NP + (c0 + c) * 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh a =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pair(rows[i], full, k)));
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, b[c]);
    }
  }
  for (int c = 0; c < NV; ++c) {
    const int64_t col = pn * NP + (c0 + c) * 16;
    const __mmask16 mk = lane_mask(n - col);
    if (mk == 0) continue;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      store_out(out, r0 + i, ldo, col, _mm512_add_ps(acc[i][c], bv), mk, f32_out);
  }
}

template <int R, int NV>
void tile_f32(const float* x, int64_t ldx, int64_t r0, const float* panel, int64_t k, int64_t n,
              int64_t pn, int c0, const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  const float* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  for (int64_t j = 0; j < k; ++j) {
    __m512 b[NV];
    for (int c = 0; c < NV; ++c) b[c] = _mm512_loadu_ps(panel + j * NP + (c0 + c) * 16);
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(rows[i][j]);
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(a, b[c], acc[i][c]);
    }
  }
  for (int c = 0; c < NV; ++c) {
    const int64_t col = pn * NP + (c0 + c) * 16;
    const __mmask16 mk = lane_mask(n - col);
    if (mk == 0) continue;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(out + (r0 + i) * ldo + col, mk, _mm512_add_ps(acc[i][c], bv));
  }
}

#ifdef PC_NARROW_VECTORS
// The 256-bit build (AVX2 + FMA, no AVX-512): R rows x NV8 half-vectors (8 columns each) of
// the panel from vector c0 (16 columns), R * NV8 <= 12 accumulators in the 16 ymm registers.
// Each element still takes one FMA per k in ascending order, the same per-lane operation as
// the 512-bit tile, whatever the width: a one-row call reads whole 256-byte panel rows
// (NV8 = 8), which streams a large weight (the LM head) at the memory's speed.
template <int R, int NV8>
void tile_f32_ymm(const float* x, int64_t ldx, int64_t r0, const float* panel, int64_t k,
                  int64_t n, int64_t pn, int c0, const float* bias, float* out, int64_t ldo) {
  __m256 acc[R][NV8];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV8; ++c) acc[i][c] = _mm256_setzero_ps();
  const float* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  const float* b = panel + c0 * 16;
  if constexpr (NV8 == 2) {  // the 6 x 16 tile: named registers (gcc spills the array form)
    __m256 lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; ++j, b += NP) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 a = _mm256_broadcast_ss(rows[i] + j);
        lo[i] = _mm256_fmadd_ps(a, b0, lo[i]);
        hi[i] = _mm256_fmadd_ps(a, b1, hi[i]);
      }
    }
    for (int i = 0; i < R; ++i) acc[i][0] = lo[i], acc[i][1] = hi[i];
  } else {
    for (int64_t j = 0; j < k; ++j, b += NP) {
      __m256 bj[NV8];  // each panel vector loaded once for all rows
      for (int c = 0; c < NV8; ++c) bj[c] = _mm256_loadu_ps(b + 8 * c);
      for (int i = 0; i < R; ++i) {
        const __m256 a = _mm256_broadcast_ss(rows[i] + j);
        for (int c = 0; c < NV8; ++c) acc[i][c] = _mm256_fmadd_ps(a, bj[c], acc[i][c]);
      }
    }
  }
  const int64_t col = pn * NP + c0 * 16;
  const int64_t live = std::min<int64_t>(8 * NV8, n - col);
  if (live <= 0) return;
  float bv[8 * NV8] = {};
  if (bias)
    for (int64_t c = 0; c < live; ++c) bv[c] = bias[col + c];
  for (int i = 0; i < R; ++i) {
    float row[8 * NV8];
    for (int c = 0; c < NV8; ++c)
      _mm256_storeu_ps(row + 8 * c, _mm256_add_ps(acc[i][c], _mm256_loadu_ps(bv + 8 * c)));
    std::memcpy(out + (r0 + i) * ldo + col, row, live * sizeof(float));
  }
}
#endif

// Calls fn.template operator()<R>() for the row count R = min(r, N), r >= 1 (a compile-time
// constant).
template <int N, typename Fn>
void with_count(int r, Fn&& fn) {
  if constexpr (N == 1) {
    fn(std::integral_constant<int, 1>{});
  } else if (r >= N) {
    fn(std::integral_constant<int, N>{});
  } else {
    with_count<N - 1>(r, fn);
  }
}

// The row count R in 1..MR of a panel tile.
template <typename Fn>
void with_rows(int r, Fn&& fn) {
  with_count<MR>(r, fn);
}

// The work split: a task is (a run of rows, one panel or a half panel). Few rows: half
// panels (2 vectors), so that a decode's few panels still keep every thread busy. The split
// changes which tile computes an element, never the element's arithmetic.
struct Split {
  int64_t row_chunk;  // rows per task (a multiple of MR, or all of them)
  int nv;             // vectors per task: 4 (a panel) or 2 (half)
};

inline Split split_for(int64_t m, int64_t n, int nthreads, bool narrow_f32) {
  const int64_t panels = panels_of(n);
  Split s{m, 4};
  if (m <= MR && panels < 8 * nthreads) s.nv = 2;
#ifdef PC_NARROW_VECTORS
  // 256-bit fp32: one row takes whole panels, up to 3 rows half panels (<= 12 accumulators);
  // the emulated 512-bit bf16 tile keeps quarter panels.
  s.nv = narrow_f32 && m == 1 && panels >= 2 * nthreads ? 4 : narrow_f32 && m <= 3 ? 2 : 1;
#else
  (void)narrow_f32;
#endif
  if (m > MR) {
    // Rows in chunks of 8 tiles: the panel is read from L2 once per chunk.
    s.row_chunk = 8 * MR;
  }
  return s;
}

template <typename T, typename P, typename Tile>
void run(const T* x, int64_t ldx, int64_t m, const P* packed, int64_t n, int64_t panel_words,
         int nthreads, Tile&& tile) {
  const Split s = split_for(m, n, nthreads, std::is_same_v<T, float>);
  const int64_t panels = panels_of(n);
  const int64_t parts = 4 / s.nv;
  const int64_t chunks = (m + s.row_chunk - 1) / s.row_chunk;
  const int64_t tasks = chunks * panels * parts;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t t = 0; t < tasks; ++t) {
    // Panel-major: a thread's contiguous run of tasks covers whole panels, all rows.
    const int64_t pn = t / (chunks * parts), rest = t % (chunks * parts);
    const int64_t chunk = rest / parts;
    const int c0 = static_cast<int>((rest % parts) * s.nv);
    const int64_t r_begin = chunk * s.row_chunk, r_end = std::min(m, r_begin + s.row_chunk);
    const P* panel = packed + pn * panel_words;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
      const int r = static_cast<int>(std::min<int64_t>(MR, r_end - r0));
      tile(r, s.nv, r0, panel, pn, c0);
    }
  }
}

// From a weight's GGUF blocks (gemm_blocks.py's q8_pack, q4_pack), on AVX-512 without AMX: per
// group of 32 columns and block of 32 k, Q8: int8 [16 k-pairs][32 columns][2], then the
// columns' scales, 32 fp16 (Q8_0, Q5_0) or, with a scale per 16 k (Q8Halves: Q6_K), 32 fp32
// for k 0-15 and 32 for k 16-31; Q4: per k-pair and 16-column tile 16 bytes (byte j: the tile
// row's value j in its low nibble, j + 16 in its high), then 32 scales and 32 minimums, fp16
// (Q4_0, Q4_1) or fp32 (Q4_K's d * sc, dmin * m). Each weight becomes bf16(q * scale (+
// minimum)), the value its bf16 panel holds (cpu_gemm.py checks that it is), and meets the
// same VDPBF16PS per k-pair as tile_bf16: pc_gemm_bf16's bits from 0.625-1.25 bytes a weight
// instead of 2. The conversion costs about seven rows' dot products, so it pays where the
// bytes bound the call: a few rows (a decode step, the LM head's row) stream the blocks at the
// memory's rate, the conversion hidden under it.

// A block's columns' values (fp16 or fp32, 32 of them at `at`), each twice (a k-pair's two
// weights), per vector c of 16 columns: [c][columns 0-7 | 8-15].
template <bool HALF>
inline void pair_values(const uint8_t* at, __m512 out[2][2]) {
  alignas(64) float cols[32];
  if constexpr (HALF) {
    _mm512_store_ps(cols, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)at)));
    _mm512_store_ps(cols + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(at + 32))));
  } else {
    std::memcpy(cols, at, sizeof(cols));
  }
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  for (int c = 0; c < 2; ++c) {
    const __m512 v = _mm512_load_ps(cols + 16 * c);
    out[c][0] = _mm512_permutexvar_ps(lo_cols, v);
    out[c][1] = _mm512_permutexvar_ps(hi_cols, v);
  }
}

// Int8 blocks: fp16 scales per 32 k, or (HALVES) fp32 ones per 16 k.
template <bool HALVES>
struct Q8Form {
  static constexpr int64_t BYTES = HALVES ? 1024 + 256 : 1024 + 64;  // one block of one group
  __m512 s[2][2];
  void start(const uint8_t* blk) { pair_values<!HALVES>(blk + 1024, s); }
  void at_pair(const uint8_t* blk, int p) {
    if (HALVES && p == 8) pair_values<false>(blk + 1024 + 128, s);
  }
  // Vector c's 16 columns at k-pair p: the panel word's two bf16 weights each.
  __m512bh vector(const uint8_t* blk, int p, int c) const {
    const uint8_t* src = blk + p * 64 + c * 32;
    const __m512 lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src))),
        s[c][0]);
    const __m512 hi = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16)))),
        s[c][1]);
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
};

// 4-bit blocks: 0..15, a scale and a minimum per 32 k, fp16 (HALF) or fp32.
template <bool HALF>
struct Q4Form {
  static constexpr int64_t VALUES = 32 * (HALF ? 2 : 4);
  static constexpr int64_t BYTES = 512 + 2 * VALUES;
  __m512 s[2][2], mn[2][2];
  void start(const uint8_t* blk) {
    pair_values<HALF>(blk + 512, s);
    pair_values<HALF>(blk + 512 + VALUES, mn);
  }
  void at_pair(const uint8_t*, int) {}
  __m512bh vector(const uint8_t* blk, int p, int c) const {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + p * 32 + c * 16)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))),
                                      s[c][0], mn[c][0]);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[c][1],
                                      mn[c][1]);
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
};

// Blocks on from the one being read, prefetched into L1 / L2 a line per k-pair.
constexpr int64_t BLOCKS_AHEAD = 4, BLOCKS_FAR = 32;

template <int64_t BYTES>
inline void prefetch_blocks(const uint8_t* blk, int p) {
  for (int64_t line = p * 64; line < BYTES; line += 16 * 64) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + BLOCKS_AHEAD * BYTES + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + BLOCKS_FAR * BYTES + line), _MM_HINT_T1);
  }
}

// Rows [r0, r0 + R) x group g's 32 columns, each block converted in registers (few rows).
template <int R, typename Form>
void tile_blocks(const uint16_t* x, int64_t ldx, int64_t r0, const uint8_t* group, int64_t k,
                 int64_t n, int64_t g, const float* bias, uint16_t* out, int64_t ldo,
                 bool f32_out) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint16_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = x + (r0 + i) * ldx;
  Form form;
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = group + b * Form::BYTES;
    form.start(blk);
    for (int p = 0; p < 16; ++p) {
      form.at_pair(blk, p);
      prefetch_blocks<Form::BYTES>(blk, p);
      const __m512bh b0 = form.vector(blk, p, 0), b1 = form.vector(blk, p, 1);
      for (int i = 0; i < R; ++i) {
        uint32_t w;
        std::memcpy(&w, rows[i] + b * 32 + 2 * p, sizeof(w));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
      }
    }
  }
  for (int c = 0; c < 2; ++c) {
    const int64_t col = g * 32 + c * 16;
    const __mmask16 mk = lane_mask(n - col);
    if (mk == 0) continue;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      store_out(out, r0 + i, ldo, col, _mm512_add_ps(acc[i][c], bv), mk, f32_out);
  }
}

// Rows per block tile: 2 x BMR accumulators, the two converted vectors and the broadcast row
// word (Q4's scales and minimums may spill: read once per k-pair).
constexpr int BMR = 12;

// Each group's blocks converted once per row tile of up to BMR rows: for few rows
// (cpu_gemm.py calls it for at most FEW_ROWS); past that the conversion outweighs the bytes
// saved and the panels run.
template <typename Form>
void gemm_blocks(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                 int64_t k, const float* bias, uint16_t* out, int64_t ldo, bool f32_out,
                 int nthreads) {
  const int64_t groups = (n + 31) / 32, group_bytes = k / 32 * Form::BYTES;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r0 = 0; r0 < m; r0 += BMR)
      with_count<BMR>(static_cast<int>(std::min<int64_t>(BMR, m - r0)), [&](auto rows) {
        tile_blocks<rows(), Form>(x, ldx, r0, packed + g * group_bytes, k, n, g, bias, out, ldo,
                                  f32_out);
      });
}

}  // namespace

extern "C" {

// Words of a packed bf16 weight [n, k] (and floats of a packed fp32 one).
int64_t pc_gemm_packed_words(int64_t n, int64_t k, int bf16) {
  return panels_of(n) * NP * (bf16 ? (k + 1) / 2 : k);
}

// w bf16 [n, k] row-major (row stride ldw) into packed (pc_gemm_packed_words words).
void pc_gemm_pack_bf16(const uint16_t* w, int64_t ldw, int64_t n, int64_t k, uint32_t* packed) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t pn = 0; pn < panels_of(n); ++pn) {
    uint32_t* panel = packed + pn * pairs * NP;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t c = 0; c < NP; ++c) {
        const int64_t col = pn * NP + c;
        panel[p * NP + c] = col < n ? x_pair(w + col * ldw, p, k) : 0u;
      }
  }
}

void pc_gemm_pack_f32(const float* w, int64_t ldw, int64_t n, int64_t k, float* packed) {
  for (int64_t pn = 0; pn < panels_of(n); ++pn) {
    float* panel = packed + pn * k * NP;
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < NP; ++c) {
        const int64_t col = pn * NP + c;
        panel[j * NP + c] = col < n ? w[col * ldw + j] : 0.0f;
      }
  }
}

// out bf16 [m, n] (row stride ldo) = x bf16 [m, k] (row stride ldx) W^T + bias (fp32 [n] or
// null), W packed by pc_gemm_pack_bf16; with f32_out, out is fp32 [m, n]: the sums unrounded.
void pc_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint32_t* packed, int64_t n,
                  int64_t k, const float* bias, uint16_t* out, int64_t ldo, int f32_out,
                  int nthreads) {
  const int64_t panel_words = (k + 1) / 2 * NP;
  run(x, ldx, m, packed, n, panel_words, nthreads,
      [&](int r, int nv, int64_t r0, const uint32_t* panel, int64_t pn, int c0) {
        with_rows(r, [&](auto rows) {
          if (nv == 4)
            tile_bf16<rows(), 4>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo, f32_out);
          else if (nv == 2)
            tile_bf16<rows(), 2>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo, f32_out);
#ifdef PC_NARROW_VECTORS
          else
            tile_bf16<rows(), 1>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo, f32_out);
#endif
        });
      });
}

void pc_gemm_f32(const float* x, int64_t ldx, int64_t m, const float* packed, int64_t n,
                 int64_t k, const float* bias, float* out, int64_t ldo, int nthreads) {
  const int64_t panel_words = k * NP;
  run(x, ldx, m, packed, n, panel_words, nthreads,
      [&](int r, int nv, int64_t r0, const float* panel, int64_t pn, int c0) {
        with_rows(r, [&](auto rows) {
#ifdef PC_NARROW_VECTORS
          // split_for gives nv 4 only to one row and nv 2 to at most 3
          if constexpr (rows() == 1) {
            if (nv == 4) return tile_f32_ymm<1, 8>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo);
          }
          if constexpr (rows() <= 3) {
            if (nv == 2) return tile_f32_ymm<rows(), 4>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo);
          }
          tile_f32_ymm<rows(), 2>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo);
#else
          if (nv == 4)
            tile_f32<rows(), 4>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo);
          else if (nv == 2)
            tile_f32<rows(), 2>(x, ldx, r0, panel, k, n, pn, c0, bias, out, ldo);
#endif
        });
      });
}

// An fp16 value's bits as the float it is (every fp16 value is one).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t magnitude = exp == 31 ? 0x7F800000u : (exp + 112) << 23;  // inf/NaN, rebiased
  const uint32_t bits = sign | magnitude | (man << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out = x W^T + bias as pc_gemm_bf16 (the same bits), W from its GGUF blocks (K a multiple of
// 32): q8_pack's with fp16 scales (pc_gemm_q8) or fp32 ones per 16 k (pc_gemm_q8h); q4_pack's
// with fp32 (pc_gemm_q4) or fp16 (pc_gemm_q4f16) scales and minimums.
#define PC_GEMM_BLOCKS(name, Form)                                                              \
  void name(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,      \
            int64_t k, const float* bias, uint16_t* out, int64_t ldo, int f32_out,             \
            int nthreads) {                                                                    \
    gemm_blocks<Form>(x, ldx, m, packed, n, k, bias, out, ldo, f32_out, nthreads);           \
  }
PC_GEMM_BLOCKS(pc_gemm_q8, Q8Form<false>)
PC_GEMM_BLOCKS(pc_gemm_q8h, Q8Form<true>)
PC_GEMM_BLOCKS(pc_gemm_q4, Q4Form<false>)
PC_GEMM_BLOCKS(pc_gemm_q4f16, Q4Form<true>)
#undef PC_GEMM_BLOCKS

// Rows ids[0..count) of a packed W [n, k] read back into out [count, k]: layout 0, bf16
// panels (out bf16); 1, fp32 panels (out fp32); 2 and 3, pc_gemm_q8_amx's and pc_gemm_q8h_amx's
// blocks (cpu_gemm.py's q8_pack: per 32 columns and 32 k, int8 [16 k-pairs][32 columns][2],
// then 32 fp16 scales, or 64 fp32 ones: k 0-15's, then 16-31's), each value q * scale (exact
// in fp32) rounded to bf16 nearest-even, as the weight those blocks were checked to be. An id
// outside [0, n) gives a row of zeros (cpu_gemm.py refuses them first), never a read past W.
void pc_gemm_weight_rows(const void* packed, int layout, int64_t n, int64_t k,
                         const int64_t* ids, int64_t count, void* out, int nthreads) {
  const int64_t pairs = (k + 1) / 2, q8_bytes = layout == 3 ? 1024 + 256 : 1024 + 64;
  const int64_t row_bytes = k * (layout == 1 ? 4 : 2);
  auto row = [&](int64_t i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= n) {
      std::memset(static_cast<uint8_t*>(out) + i * row_bytes, 0, row_bytes);
      return;
    }
    if (layout == 1) {
      const float* panel = static_cast<const float*>(packed) + id / NP * k * NP + id % NP;
      float* dst = static_cast<float*>(out) + i * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = panel[j * NP];
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(out) + i * k;
    if (layout == 0) {
      const uint32_t* panel =
          static_cast<const uint32_t*>(packed) + id / NP * pairs * NP + id % NP;
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t word = panel[p * NP];
        dst[2 * p] = static_cast<uint16_t>(word);
        if (2 * p + 1 < k) dst[2 * p + 1] = static_cast<uint16_t>(word >> 16);
      }
      return;
    }
    const int64_t blocks = k / 32, c = id % 32;
    const uint8_t* group = static_cast<const uint8_t*>(packed) + id / 32 * blocks * q8_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * q8_bytes;
      for (int64_t kk = 0; kk < 32; ++kk) {
        const int8_t q = static_cast<int8_t>(blk[kk / 2 * 64 + c * 2 + kk % 2]);
        float scale;
        if (layout == 2) {
          uint16_t half;
          std::memcpy(&half, blk + 1024 + c * 2, 2);
          scale = half_to_float(half);
        } else {
          std::memcpy(&scale, blk + 1024 + (kk >= 16 ? 128 : 0) + c * 4, 4);
        }
        const float w = static_cast<float>(q) * scale;
        uint32_t bits;
        std::memcpy(&bits, &w, 4);
        dst[b * 32 + kk] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      }
    }
  };
  if (count < 64 || nthreads <= 1) {
    for (int64_t i = 0; i < count; ++i) row(i);
    return;
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < count; ++i) row(i);
}

}  // extern "C"
