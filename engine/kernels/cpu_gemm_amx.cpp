// The batch-invariant bf16 GEMM on Intel AMX (AMX-TILE + AMX-BF16): out = x W^T + b, with W
// packed by cpu_gemm.cpp's pc_gemm_pack_bf16 ([N/64][K/2][64] words of k-pairs).
//
// Built and loaded by cpu_gemm.py beside cpu_gemm.cpp, used for every bf16 call of a weight
// whose K is a multiple of 32 where the CPU has AMX and the kernel grants its use. Each
// output element is one fp32 tile accumulator: TDPBF16PS over the ascending 32-wide k steps,
// from zero, then + bias and one rounding to bf16. A row is always computed by that sequence
// whatever the tile holds beside it (rows past M are zero padding in a scratch tile), so a
// row's result is a function of that row alone, as in the AVX-512 kernel. The two kernels'
// bits differ from each other, so one weight always takes the same one (cpu_gemm.py).
//
// Tiles (cpu_amx.h's configuration): 0-3 the 2 x 2 blocks of C (16 rows x 16 fp32), 4-5 two
// A blocks (16 rows x 32 bf16, read in place from x, or from a zero-padded scratch for the
// last rows), 6-7 two B blocks (16 k-pairs x 16 columns, read in place from the packed panel
// at its 256-byte row stride).
//
// pc_gemm_q8_amx and pc_gemm_q4_amx run the same row tiles on B tiles they write from a
// weight's GGUF blocks (cpu_gemm.py's q8_pack, q4_pack): the dequantized weight's bf16 values,
// so the bits of pc_gemm_bf16_amx on that weight, from 1.06 or 0.75 bytes a weight, not 2.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>

#include "cpu_amx.h"

namespace {

constexpr int64_t NP = 64;         // columns per panel (cpu_gemm.cpp's layout)
constexpr int64_t KSTEP = 32;      // k per tile step (16 pairs)
constexpr int64_t ROW_CHUNK = 256;  // rows a chunk holds at least (x_chunk_rows)
// A task's first two row tiles prefetch B (both 64-byte halves of each k-pair row) this many
// k steps ahead: its B comes from L3 or memory once, and at a few row tiles (a warm suffix)
// the tile loads waited on it. Gemma 3's 72 layer GEMMs at 64 rows, interleaved runs of
// bench/layer_gemms.py: 8.6-11.4 -> 8.0-8.9 ms on a busy box, 7.5-8.4 -> 7.5 on a quiet one;
// 2 and 8 steps, or one half only, were no better; 2,048 rows unchanged.
constexpr int64_t PF_STEPS = 4;

inline __mmask16 lane_mask(int64_t n) {
  if (n >= 16) return 0xFFFF;
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

// C block (16 x 16 fp32, row stride 64 B) + bias, rounded to bf16 (or kept fp32: f32_out),
// into out's valid rows and columns.
PC_AMX void store_block(const float* c, int rows, int64_t col, int64_t n, const float* bias,
                        uint16_t* out, int64_t ldo, bool f32_out) {
  const __mmask16 mk = lane_mask(n - col);
  if (mk == 0) return;
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + col) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * i), bv);
    if (f32_out)
      _mm512_mask_storeu_ps(reinterpret_cast<float*>(out) + i * ldo + col, mk, v);
    else
      _mm256_mask_storeu_epi16(out + i * ldo + col, mk, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Where a task's B tiles are: the first k step's left tile at `b`, its right one `second`
// words on, tile rows `row` words apart, the next k step `step` words on.
struct BTiles {
  const uint32_t* b;
  int64_t row, second, step;
};

// B in a packed panel (pc_gemm_pack_bf16): the 32 columns of panel `pn` from column c0.
inline BTiles panel_tiles(const uint32_t* packed, int64_t k, int64_t pn, int64_t c0) {
  return {packed + pn * (k / 2 * NP) + c0, NP, 16, (KSTEP / 2) * NP};
}

// Rows [r0, r0 + 16 * MT) (those below m) x the 32 columns from `col` whose B `bt` holds.
// `pad` is a 2 x 16 x 32 bf16 scratch whose rows past m stay zero.
// `fill(step)` runs before each k step's B tiles load (writing them, for Q8 weights).
struct NoFill {
  void operator()(int64_t) const {}
};

template <int MT, bool PREFETCH, class Fill = NoFill>
PC_AMX void block(const uint16_t* x, int64_t ldx, int64_t r0, int64_t m, BTiles bt, int64_t k,
                  int64_t n, int64_t col, const float* bias, uint16_t* out, int64_t ldo,
                  bool f32_out, uint16_t* pad, const Fill& fill = Fill(),
                  int64_t x_rows = -1) {
  // rows stored: those below m; rows x holds (zero past m where x_rows > m): tiles of x
  // rows read in place, others from pad
  const int64_t live[2] = {std::min<int64_t>(16, m - r0),
                           MT == 2 ? std::min<int64_t>(16, m - r0 - 16) : 0};
  if (x_rows < 0) x_rows = m;
  const bool in_place[2] = {r0 + 16 <= x_rows, r0 + 32 <= x_rows};
  for (int a = 0; a < MT; ++a)
    if (!in_place[a]) std::memset(pad + a * 16 * KSTEP, 0, 16 * KSTEP * sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  if (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint32_t* b = bt.b;
  for (int64_t k0 = 0; k0 < k; k0 += KSTEP, b += bt.step) {
    if (PREFETCH && k0 + PF_STEPS * KSTEP < k) {
      const uint32_t* ahead = b + PF_STEPS * bt.step;
      for (int r = 0; r < KSTEP / 2; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + r * bt.row), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + r * bt.row + bt.second), _MM_HINT_T0);
      }
    }
    fill(k0 / KSTEP);
    PC_TILE_LOAD(6, b, bt.row * 4);
    PC_TILE_LOAD(7, b + bt.second, bt.row * 4);
    for (int a = 0; a < MT; ++a) {
      const uint16_t* rows = x + (r0 + 16 * a) * ldx + k0;
      const void* src = rows;
      int64_t stride = ldx * 2;
      if (!in_place[a]) {
        uint16_t* p = pad + a * 16 * KSTEP;
        for (int64_t i = 0; i < live[a]; ++i)
          std::memcpy(p + i * KSTEP, rows + i * ldx, KSTEP * sizeof(uint16_t));
        src = p;
        stride = KSTEP * 2;
      }
      if (a == 0) {
        PC_TILE_LOAD(4, src, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      } else {
        PC_TILE_LOAD(5, src, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  alignas(64) float c[16 * 16];
  // rows r0.. of out: in fp32 elements where f32_out (store_block indexes by element)
  uint16_t* o0 = f32_out ? reinterpret_cast<uint16_t*>(reinterpret_cast<float*>(out) + r0 * ldo)
                         : out + r0 * ldo;
  PC_TILE_STORE(0, c, 64);
  store_block(c, static_cast<int>(live[0]), col, n, bias, o0, ldo, f32_out);
  PC_TILE_STORE(1, c, 64);
  store_block(c, static_cast<int>(live[0]), col + 16, n, bias, o0, ldo, f32_out);
  if (MT == 2) {
    uint16_t* o1 = f32_out ? reinterpret_cast<uint16_t*>(reinterpret_cast<float*>(o0) + 16 * ldo)
                           : o0 + 16 * ldo;
    PC_TILE_STORE(2, c, 64);
    store_block(c, static_cast<int>(live[1]), col, n, bias, o1, ldo, f32_out);
    PC_TILE_STORE(3, c, 64);
    store_block(c, static_cast<int>(live[1]), col + 16, n, bias, o1, ldo, f32_out);
  }
}

// One row tile [r0, r0 + 16) (rows below m) x the 64 columns of a packed panel from `col`:
// block<1>'s tile operations for both of the panel's 32-column halves at once (each output
// element the same TDPBF16PS sequence: the same bits), so that a k step reads 16 whole
// 256-byte panel rows, 4 KB in one run, where a half's task read the half of each; the step
// after next prefetched. C in tiles 0-3, A in 4, the four B tiles through 5-7. Alternated in
// one process (bench/kernel_ab.py, PREFIXCACHE_GGUF_BLOCKS=0): Gemma 3's layer pass at 1-16
// rows 0.82-0.86x, its bf16 head at one row 0.82x, its decode step 0.88-0.90x; without the
// prefetch 0.87-0.89x.
PC_AMX void block_panel(const uint16_t* x, int64_t ldx, int64_t r0, int64_t m,
                        const uint32_t* panel, int64_t k, int64_t n, int64_t col,
                        const float* bias, uint16_t* out, int64_t ldo, bool f32_out,
                        uint16_t* pad) {
  const int64_t live = std::min<int64_t>(16, m - r0);
  const bool in_place = r0 + 16 <= m;
  if (!in_place) std::memset(pad, 0, 16 * KSTEP * sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint32_t* b = panel;
  for (int64_t k0 = 0; k0 < k; k0 += KSTEP, b += (KSTEP / 2) * NP) {
    const uint16_t* rows = x + r0 * ldx + k0;
    const void* src = rows;
    int64_t stride = ldx * 2;
    if (!in_place) {
      for (int64_t i = 0; i < live; ++i)
        std::memcpy(pad + i * KSTEP, rows + i * ldx, KSTEP * sizeof(uint16_t));
      src = pad;
      stride = KSTEP * 2;
    }
    for (int r = 0; r < KSTEP / 2; ++r)  // the step after next: its 16 whole rows
      for (int line = 0; line < NP; line += 16)
        _mm_prefetch(reinterpret_cast<const char*>(b + KSTEP * NP + r * NP + line), _MM_HINT_T0);
    PC_TILE_LOAD(4, src, stride);
    PC_TILE_LOAD(5, b, NP * 4);
    _tile_dpbf16ps(0, 4, 5);
    PC_TILE_LOAD(6, b + 16, NP * 4);
    _tile_dpbf16ps(1, 4, 6);
    PC_TILE_LOAD(7, b + 32, NP * 4);
    _tile_dpbf16ps(2, 4, 7);
    PC_TILE_LOAD(5, b + 48, NP * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float c[16 * 16];
  uint16_t* o = f32_out ? reinterpret_cast<uint16_t*>(reinterpret_cast<float*>(out) + r0 * ldo)
                        : out + r0 * ldo;
  PC_TILE_STORE(0, c, 64);
  store_block(c, static_cast<int>(live), col, n, bias, o, ldo, f32_out);
  PC_TILE_STORE(1, c, 64);
  store_block(c, static_cast<int>(live), col + 16, n, bias, o, ldo, f32_out);
  PC_TILE_STORE(2, c, 64);
  store_block(c, static_cast<int>(live), col + 32, n, bias, o, ldo, f32_out);
  PC_TILE_STORE(3, c, 64);
  store_block(c, static_cast<int>(live), col + 48, n, bias, o, ldo, f32_out);
}

// Weights from GGUF blocks (cpu_gemm.py's q8_pack / q4_pack), one block per group of 32
// columns and k step of 32, turned into its two B tiles as the dequantized model's bf16
// weights: each value is formed in fp32 as the gguf package's dequantizer forms it, then
// rounded to bf16 nearest-even as torch's cast rounds.
//
// Q8: 1,024 int8 as [16 k-pairs][32 columns][2], then the 32 columns' fp16 scales (Q8_0's
// and Q5_0's d; 64 bytes, not fp32's 128: 5.6 % fewer a weight): w = q * scale, exact in
// fp32 (11 + 8 significant bits).
struct Q8Blocks {
  static constexpr int64_t BYTES = 1024 + 32 * 2;
  PC_AMX static void to_tiles(const uint8_t* blk, uint32_t* tiles);
};
// Q8H: Q8's integers, then 64 fp32 scales, the 32 columns' for k 0-15 and for k 16-31
// (Q6_K: a scale per 16 weights); w = q * scale as in Q8.
struct Q8HalvesBlocks {
  static constexpr int64_t BYTES = 1024 + 64 * 4;
  PC_AMX static void to_tiles(const uint8_t* blk, uint32_t* tiles);
};
// Q4: per k-pair row and tile, 16 bytes whose byte j holds the tile row's value j (low
// nibble) and j + 16 (high nibble), 0..15; then 32 scales, 32 minimums, fp32, or fp16 where
// they are fp16 values (Q4_0's and Q4_1's d and m; HALF: 640 bytes a block, not 768):
// w = fma(q, scale, minimum), one rounding, the value of gguf's (d * q) + m (Q4_1) and
// d * q - dm (Q4_K) whose products are exact (Q4_0 comes as q + 8, minimum -8 d: exact).
template <bool HALF>
struct Q4BlocksOf {
  static constexpr int64_t BYTES = 512 + 32 * (HALF ? 2 : 4) * 2;
  PC_AMX static void to_tiles(const uint8_t* blk, uint32_t* tiles);
};
using Q4Blocks = Q4BlocksOf<false>;
using Q4HalfBlocks = Q4BlocksOf<true>;
// A block's conversion prefetches the block BLOCKS_AHEAD on into L1 and the one BLOCKS_FAR on
// into L2, a line or two of each per tile row converted (pc_amx::prefetch_part). In one burst
// before the conversion they cost 1.4x the time: Gemma 3's 262K head at one row took 8.8-9.5
// ms with a burst of 4 ahead (the distance and hint alone changed nothing), 6.1-6.5 ms spread
// with the far one, 7.0 spread without it (alternated in one process); the weight streams at
// 28-31 GB/s, where this box's two cores read 33 GB/s at most.
constexpr int64_t BLOCKS_AHEAD = 4, BLOCKS_FAR = 40;

// The 32 columns' values at `at` (fp16 where HALF, else fp32) into out as fp32.
template <bool HALF>
PC_AMX inline void column_values(const uint8_t* at, float* out) {
  if constexpr (HALF) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)at)));
    _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(at + 32))));
  } else {
    std::memcpy(out, at, 32 * sizeof(float));
  }
}

// Each of the 32 columns' values twice (a tile row's k-pairs): [tile][cols 0-7 | 8-15].
PC_AMX inline void pair_columns(const float* per_column, __m512 out[2][2]) {
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  for (int t = 0; t < 2; ++t) {
    const __m512 cols = _mm512_loadu_ps(per_column + 16 * t);
    out[t][0] = _mm512_permutexvar_ps(lo_cols, cols);
    out[t][1] = _mm512_permutexvar_ps(hi_cols, cols);
  }
}

PC_AMX void Q8Blocks::to_tiles(const uint8_t* blk, uint32_t* tiles) {
  const int8_t* q = reinterpret_cast<const int8_t*>(blk);
  __m512 s[2][2];
  alignas(64) float scales[32];
  column_values<true>(blk + 1024, scales);
  pair_columns(scales, s);
  for (int r = 0; r < 16; ++r) {
    pc_amx::prefetch_part<BYTES, 16>(blk, r, BLOCKS_AHEAD, BLOCKS_FAR);
    for (int t = 0; t < 2; ++t) {
      const int8_t* src = q + r * 64 + t * 32;
      const __m512 lo = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src))), s[t][0]);
      const __m512 hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16)))),
          s[t][1]);
      _mm512_store_si512(tiles + t * 256 + r * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

PC_AMX void Q8HalvesBlocks::to_tiles(const uint8_t* blk, uint32_t* tiles) {
  const int8_t* q = reinterpret_cast<const int8_t*>(blk);
  __m512 s[2][2][2];  // [k half][tile][columns 0-7 | 8-15]
  pair_columns(reinterpret_cast<const float*>(blk + 1024), s[0]);
  pair_columns(reinterpret_cast<const float*>(blk + 1024 + 128), s[1]);
  for (int r = 0; r < 16; ++r) {  // k-pair r holds k 2r, 2r + 1: the first half below 8
    pc_amx::prefetch_part<BYTES, 16>(blk, r, BLOCKS_AHEAD, BLOCKS_FAR);
    const int h = r / 8;
    for (int t = 0; t < 2; ++t) {
      const int8_t* src = q + r * 64 + t * 32;
      const __m512 lo = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src))),
          s[h][t][0]);
      const __m512 hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16)))),
          s[h][t][1]);
      _mm512_store_si512(tiles + t * 256 + r * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

template <bool HALF>
PC_AMX void Q4BlocksOf<HALF>::to_tiles(const uint8_t* blk, uint32_t* tiles) {
  __m512 s[2][2], mn[2][2];
  alignas(64) float values[32];
  column_values<HALF>(blk + 512, values);
  pair_columns(values, s);
  column_values<HALF>(blk + 512 + 32 * (HALF ? 2 : 4), values);
  pair_columns(values, mn);
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int r = 0; r < 16; ++r) {
    pc_amx::prefetch_part<BYTES, 16>(blk, r, BLOCKS_AHEAD, BLOCKS_FAR);
    for (int t = 0; t < 2; ++t) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + r * 32 + t * 16)));
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), s[t][0],
                                        mn[t][0]);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[t][1],
                                        mn[t][1]);
      _mm512_store_si512(tiles + t * 256 + r * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

constexpr int64_t XPAD_GROUPS = 1024;  // column groups (32 each) from which x is padded once
// Rows of x per pass of the block kernels' longer calls: a chunk of this many bytes of x stays
// in L2 while each thread's groups pass it, converted once per chunk. Gemma 3's and SmolLM2's
// layer GEMMs at 2,048 rows (bench/layer_gemms.py's blocks against panels, alternated): 0.5
// and 1 MB 0.91 / 0.97-0.99x the bf16 panels' time, 1.5 MB 0.96 / 1.01x, one chunk of every
// row 1.25 / 1.32x (x re-read per group); the former 256-row tasks with one shared conversion
// 1.17-1.20x.
constexpr int64_t X_CHUNK_BYTES = int64_t{1} << 20;

// Rows of x a chunk of the longer calls holds: X_CHUNK_BYTES of bf16 rows, at least ROW_CHUNK.
inline int64_t x_chunk_rows(int64_t k) {
  return std::max<int64_t>(ROW_CHUNK, X_CHUNK_BYTES / (2 * k) / 32 * 32);
}

// pc_gemm_bf16_amx's contract for weights packed as Format's blocks (k a multiple of 32):
// each 32 columns' blocks are turned into bf16 B tiles (the dequantized weights to the bit),
// then pc_gemm_bf16_amx's row tiles run on them: that kernel's outputs on those weights, bit
// for bit, from fewer bytes a weight.
template <class Format>
PC_AMX void gemm_blocks(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed,
                        int64_t n, int64_t k, const float* bias, uint16_t* out, int64_t ldo,
                        int f32_out, int nthreads) {
  constexpr int64_t QB = Format::BYTES;
  const int64_t groups = (n + 31) / 32, steps = k / KSTEP;
  const int64_t group_bytes = steps * 2048;
  const int64_t chunk_rows = x_chunk_rows(k);
  // A one-block call of a head-wide weight whose row tile is partial (the LM head's one row
  // of a warm request or a decode): x copied once into whole tiles, zero past m, so no k step
  // copies its rows into the scratch tile just before loading it. Gemma 3's Q8_0 head at one
  // row took 13.3 ms against 10.5 at five (same code, more rows, less time); with the copy
  // once 10.0-10.3 at both, alternated in one process (SmolLM2's 49K head 0.95-0.98x). Why
  // the per-step copy cost that much at 1-4 rows only is not established (tile loads of rows
  // stored just before are one suspect); calls of few groups (the layers) were 1.03-1.09x
  // slower with the copy, so only head-wide ones take it.
  uint16_t* xpad = nullptr;
  int64_t x_rows = m, lda = ldx;  // what one-block calls read: x, or its padded copy
  if (m <= 32 && m % 16 && groups >= XPAD_GROUPS) {
    x_rows = (m + 15) / 16 * 16;
    lda = k;
    xpad = static_cast<uint16_t*>(std::aligned_alloc(64, x_rows * k * 2));
    for (int64_t i = 0; i < x_rows; ++i)
      if (i < m)
        std::memcpy(xpad + i * k, x + i * ldx, k * 2);
      else
        std::memset(xpad + i * k, 0, k * 2);
  }
  const uint16_t* xa = xpad ? xpad : x;
#pragma omp parallel num_threads(nthreads)
  {
    pc_amx::configure();
    alignas(64) uint16_t pad[2 * 16 * KSTEP];
    // A task of one row block converts each step just before its tile loads (the block
    // reads overlap the tile work). More rows run in chunks; within one, each thread runs its
    // groups in turn, converting the next group's steps while this one's row blocks run (two
    // buffers).
    const bool one_block = m <= 32;
    const int64_t buffer_bytes = one_block ? 2048 : 2 * group_bytes;
    uint32_t* tiles = static_cast<uint32_t*>(std::aligned_alloc(64, buffer_bytes));
    auto convert_into = [&](int64_t g, int64_t s, uint32_t* dst) {
      Format::to_tiles(packed + (g * steps + s) * QB, dst);
    };
    if (one_block) {
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g) {
        auto convert = [&](int64_t s) { convert_into(g, s, tiles); };
        const BTiles bt = {tiles, 16, 256, 0};
        if (m <= 16)
          block<1, false>(xa, lda, 0, m, bt, k, n, g * 32, bias, out, ldo, f32_out, pad,
                          convert, x_rows);
        else
          block<2, false>(xa, lda, 0, m, bt, k, n, g * 32, bias, out, ldo, f32_out, pad,
                          convert, x_rows);
      }
    } else {
      // The next group's conversion is spread over this group's row blocks, step by step, so
      // it overlaps all of their tile work. Converting a group first left the tile unit idle
      // meanwhile; within its first block only, idle for the later ones. Alternated in one
      // process: Gemma 3's layer GEMMs 0.81-0.88x the first-block version's time at 48-256
      // rows (that one 0.91-0.93x the convert-first one at 48-64), its 262K head 0.92-0.94x.
      // At 32 rows and fewer the two buffers' trip through L2 cost 1.1-1.3x: one step kept.
      const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
      for (int64_t c0 = 0; c0 < m; c0 += chunk_rows) {
        const int64_t mc = std::min(chunk_rows, m - c0);  // the chunk's rows, from row c0
        const uint16_t* xc = x + c0 * ldx;
        uint16_t* oc = out + c0 * ldo * (f32_out ? 2 : 1);  // (fp32 rows: two words each)
        const int64_t blocks = (mc + 31) / 32, slots = blocks * steps;
        if (g0 < g1)
          for (int64_t s = 0; s < steps; ++s) convert_into(g0, s, tiles + s * 512);
        for (int64_t g = g0; g < g1; ++g) {
          uint32_t* cur = tiles + ((g - g0) % 2) * steps * 512;
          uint32_t* next = tiles + ((g - g0 + 1) % 2) * steps * 512;
          const BTiles bt = {cur, 16, 256, 512};
          int64_t done = g + 1 < g1 ? 0 : steps;  // the next group's steps converted
          for (int64_t b = 0; b < blocks; ++b) {
            auto convert = [&](int64_t s) {
              for (const int64_t due = (b * steps + s + 1) * steps / slots; done < due; ++done)
                convert_into(g + 1, done, next + done * 512);
            };
            if (mc - 32 * b <= 16)
              block<1, false>(xc, ldx, 32 * b, mc, bt, k, n, g * 32, bias, oc, ldo, f32_out,
                              pad, convert);
            else
              block<2, false>(xc, ldx, 32 * b, mc, bt, k, n, g * 32, bias, oc, ldo, f32_out,
                              pad, convert);
          }
        }
      }
    }
    std::free(tiles);
    pc_amx::release();
  }
  std::free(xpad);
}

}  // namespace

extern "C" {

// Asks the kernel for the AMX tile state (Linux's ARCH_REQ_XCOMP_PERM for XTILEDATA): 0 when
// granted, else the errno-style failure (then the caller keeps the AVX-512 kernel).
int pc_amx_enable() { return pc_amx::request() ? 0 : 1; }

// Same contract as pc_gemm_bf16 (cpu_gemm.cpp), for k a multiple of 32.
PC_AMX
void pc_gemm_bf16_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint32_t* packed,
                      int64_t n, int64_t k, const float* bias, uint16_t* out, int64_t ldo,
                      int f32_out, int nthreads) {
  const int64_t panels = (n + NP - 1) / NP;
  // Rows in equal chunks of at most 512 (and X_CHUNK_BYTES of x), each a pass over the
  // weight: 300 rows in 256-row chunks read it twice. Gemma 3's and SmolLM2's layer GEMMs on
  // panels (bench/layer_gemms.py, PREFIXCACHE_GGUF_BLOCKS=0, alternated): 300 rows 0.70x the
  // 256-row chunks' time, 1,024 0.91-0.99x, 2,048 0.96-1.03x; chunks of X_CHUNK_BYTES alone
  // (800 rows at K 640) 1.3-1.6x at 1,024 and 1.1x at 2,048.
  const int64_t most = std::min<int64_t>(512, x_chunk_rows(k)), parts = (m + most - 1) / most;
  const int64_t chunk_rows = ((m + parts - 1) / parts + 31) / 32 * 32;
  const int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
  // (row chunk, panel, half), chunk-major: a chunk's rows stay in L2 while every panel passes
  // them, and x is read from memory once (panel-major re-read all of a long prefill's rows
  // once per half panel, from L3: 1.5x the time at 2,048 rows).
  const int64_t tasks = chunks * panels * 2;
#pragma omp parallel num_threads(nthreads)
  {
    pc_amx::configure();
    alignas(64) uint16_t pad[2 * 16 * KSTEP];
    if (m <= 16) {  // one row tile (a decode step, a head's row): whole panels a task
#pragma omp for schedule(static)
      for (int64_t pn = 0; pn < panels; ++pn)
        block_panel(x, ldx, 0, m, packed + pn * (k / 2 * NP), k, n, pn * NP, bias, out, ldo,
                    f32_out, pad);
    } else {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t chunk = t / (2 * panels), pn = (t / 2) % panels, half = t % 2;
        const BTiles bt = panel_tiles(packed, k, pn, half * 32);
        const int64_t col = pn * NP + half * 32;
        const int64_t r_end = std::min(m, (chunk + 1) * chunk_rows);
        for (int64_t r0 = chunk * chunk_rows; r0 < r_end; r0 += 32) {
          // A task's first two row tiles prefetch (later ones find B in L1 / L2); a last
          // row tile of 16 rows or fewer never does (2-3 % slower with it at one row, before
          // those calls took block_panel).
          if (r_end - r0 <= 16)
            block<1, false>(x, ldx, r0, m, bt, k, n, col, bias, out, ldo, f32_out, pad);
          else if (r0 == chunk * chunk_rows)
            block<2, true>(x, ldx, r0, m, bt, k, n, col, bias, out, ldo, f32_out, pad);
          else
            block<2, false>(x, ldx, r0, m, bt, k, n, col, bias, out, ldo, f32_out, pad);
        }
      }
    }
    pc_amx::release();
  }
}

// pc_gemm_bf16_amx's contract for weights packed by cpu_gemm.py's q8_pack (Q8Blocks).
PC_AMX
void pc_gemm_q8_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                    int64_t k, const float* bias, uint16_t* out, int64_t ldo, int f32_out,
                    int nthreads) {
  gemm_blocks<Q8Blocks>(x, ldx, m, packed, n, k, bias, out, ldo, f32_out, nthreads);
}

// The same for q8_pack's layout with a scale per 16 k (Q8HalvesBlocks).
PC_AMX
void pc_gemm_q8h_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                     int64_t k, const float* bias, uint16_t* out, int64_t ldo, int f32_out,
                     int nthreads) {
  gemm_blocks<Q8HalvesBlocks>(x, ldx, m, packed, n, k, bias, out, ldo, f32_out, nthreads);
}

// The same for q4_pack's layout (Q4Blocks).
PC_AMX
void pc_gemm_q4_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                    int64_t k, const float* bias, uint16_t* out, int64_t ldo, int f32_out,
                    int nthreads) {
  gemm_blocks<Q4Blocks>(x, ldx, m, packed, n, k, bias, out, ldo, f32_out, nthreads);
}

// The same for q4_pack's layout with fp16 scales and minimums (Q4HalfBlocks).
PC_AMX
void pc_gemm_q4f16_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed,
                       int64_t n, int64_t k, const float* bias, uint16_t* out, int64_t ldo,
                       int f32_out, int nthreads) {
  gemm_blocks<Q4HalfBlocks>(x, ldx, m, packed, n, k, bias, out, ldo, f32_out, nthreads);
}

}  // extern "C"
