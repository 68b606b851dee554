// The LM head from a Q8_0-style weight (int8 q, one fp32 scale per 32 k) in integer arithmetic
// (AVX512_VNNI): out = x W^T + b, W = q * scale, x bf16 rows, out fp32 (or bf16).
//
// A one-row call (every decode step, every first token) reads the whole head: Gemma 3's
// 262K x 640 is 189 MB in blocks. Forming each weight's bf16 value for a bf16 dot product
// (cpu_gemm_amx.cpp's q8 path) costs more than reading it, so that kernel ran at half the
// memory's rate. Here the weights are never converted: each row's activations become
// integers, exactly, and VPDPBUSD multiplies them with the weight bytes as they are.
//
// Activations, per row and block of 32 k: e = floor(log2(max |x|)); X = rint(x * 2^(13 - e)),
// |X| <= 2^14, so every x within 2^6 of the block's largest is exact and the rest are off by at
// most 2^-14 of it; X = 256 hi + lo with hi, lo signed bytes. Weights are stored as w = q + 128
// (unsigned bytes): sum_k q X = 256 sum w hi + sum w lo - 128 sum X, exact in int32 for any
// row count or order. Each block then adds fp32(S) * (scale * 2^(e - E)) into one fp32
// accumulator per output (E the row's largest e), blocks in ascending k, then times
// 2^(E - 13), + bias. A row's result is a function of
// that row alone (batch-invariant), and closer to the exact sum of q * scale * x than a bf16
// rounding of each weight (tests/test_cpu_head_int8.py measures both).
//
// Calls of more than 8 rows run the integer sums on AMX (TDPBSUD: signed bytes x unsigned, into
// int32) where the CPU has AMX-INT8 and the kernel grants the tile state: the same integers,
// so the same bits, at 1.0-1.3x VPDPBUSD's rate (a tile restart per block of 32 k bounds it).
// From 8 rows the default kernel, which forms the bf16 weights once a call, is faster.
//
// Layout (cpu_head_int8.py's pack): per group of 32 columns (N padded with zero columns) and
// block of 32 k, the weight bytes as [8 k-quads][32 columns][4] (one 64-byte vector holds 16
// columns' 4 consecutive k), then the block's 32 fp32 scales: 1,152 bytes a block.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu_amx.h"

#define PC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")))
#define PC_AMX_INT8 \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")))

namespace {

constexpr int64_t KB = 32;                      // k per block (one scale)
constexpr int64_t BLOCK_BYTES = 1024 + 32 * 4;  // weight bytes, then 32 fp32 scales
constexpr int64_t ROW_TILE = 4;                 // rows the VNNI path's registers carry
constexpr int64_t AMX_ROWS = 16;                // rows an AMX step takes (two A tiles of 8)
constexpr int64_t AMX_MIN_ROWS = 9;             // calls of fewer rows keep VNNI
constexpr int64_t ROW_CHUNK = 256;  // rows whose codes stay in L2 while the groups pass
constexpr int64_t AHEAD = 4, FAR = 40;  // blocks prefetched ahead into L1, and into L2

bool amx_granted = false;  // pc_head_i8_enable_amx

// Every row's activations as integers. Limb row 2r holds row r's hi bytes, 2r + 1 its lo
// bytes (k each, so an A tile of 8 rows is 16 limb rows at a stride of k); per row and block
// the correction 128 sum X and the exponent e - E, E the row's largest block exponent, and per
// row E - 13 (as the float scalef takes): a row's sums accumulate in units of 2^(E - 13), so
// no block's factor scale * 2^(e - 13) under- or overflows fp32 where the result does not
// (scaling by a power of two commutes with each rounding: the same bits otherwise).
struct Codes {
  int8_t* limbs;    // [rows][2][k]
  int32_t* corr;    // [rows][blocks]
  float* expo;      // [rows][blocks]
  float* row_expo;  // [rows]
  int64_t k, blocks;
  const int8_t* hi(int64_t r, int64_t b) const { return limbs + 2 * r * k + b * KB; }
  const int8_t* lo(int64_t r, int64_t b) const { return limbs + (2 * r + 1) * k + b * KB; }
};

PC_VNNI inline __m512 bf16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

PC_VNNI void encode_row(const uint16_t* x, int64_t r, const Codes& c) {
  const __m512i round = _mm512_set1_epi32(128), low = _mm512_set1_epi32(255);
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // QNaN, +inf, -inf, SNaN
  constexpr float kZero = -__builtin_inff();  // a block of zeros (its sums are 0)
  float top_e = kZero;
  float* expo_of = c.expo + r * c.blocks;
  for (int64_t b = 0; b < c.blocks; ++b) {
    const __m512 v0 = bf16_to_f32(x + b * KB), v1 = bf16_to_f32(x + b * KB + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const bool finite =
        !(_mm512_fpclass_ps_mask(v0, kNotFinite) | _mm512_fpclass_ps_mask(v1, kNotFinite));
    int8_t* hi = const_cast<int8_t*>(c.hi(r, b));
    int8_t* lo = const_cast<int8_t*>(c.lo(r, b));
    int32_t& corr = c.corr[r * c.blocks + b];
    float& expo = expo_of[b];
    if (!finite || top == 0.0f) {  // a NaN or infinity makes the row's logits NaN, as a dot would
      std::memset(hi, 0, KB);
      std::memset(lo, 0, KB);
      corr = 0;
      expo = finite ? kZero : __builtin_nanf("");
      continue;
    }
    // floor(log2(top)), exact for normal and subnormal floats alike
    const float e = _mm_cvtss_f32(_mm_getexp_ss(_mm_setzero_ps(), _mm_set_ss(top)));
    const __m512 shift = _mm512_set1_ps(13.0f - e);
    int32_t sum = 0;
    const __m512 halves[2] = {v0, v1};
    for (int h = 0; h < 2; ++h) {
      const __m512i xi = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(halves[h], shift),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(xi, round), low), round);
      const __m512i u = _mm512_srai_epi32(_mm512_sub_epi32(xi, l), 8);
      _mm_storeu_si128((__m128i*)(lo + 16 * h), _mm512_cvtepi32_epi8(l));
      _mm_storeu_si128((__m128i*)(hi + 16 * h), _mm512_cvtepi32_epi8(u));
      sum += _mm512_reduce_add_epi32(xi);
    }
    corr = 128 * sum;
    expo = e;
    top_e = std::max(top_e, e);
  }
  for (int64_t b = 0; b < c.blocks; ++b)  // NaN stays NaN
    expo_of[b] = expo_of[b] == kZero ? 0.0f : expo_of[b] - top_e;
  c.row_expo[r] = top_e == kZero ? 0.0f : top_e - 13.0f;
}

// One block's step for one row and 16 columns, whichever path summed the integers:
// S = 256 hsum + lsum - 128 sum X (exact), then acc += fp32(S) * (scale * 2^expo).
PC_VNNI inline __m512 accumulate(__m512 acc, __m512i hsum, __m512i lsum, int32_t corr,
                                 float expo, __m512 scale) {
  const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hsum, 8), lsum),
                                     _mm512_set1_epi32(corr));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_scalef_ps(scale, _mm512_set1_ps(expo)), acc);
}

// Row r's 32 accumulators, times 2^(E - 13), + bias into out's columns col.. (those below n).
PC_VNNI inline void store_row(const __m512 acc[2], const Codes& codes, int64_t r, int64_t col,
                              int64_t n, const float* bias, void* out, int64_t ldo, bool f32_out) {
  const __m512 unit = _mm512_set1_ps(codes.row_expo[r]);
  for (int h = 0; h < 2; ++h) {
    const int64_t c = col + 16 * h;
    if (c >= n) return;
    const __mmask16 mk = n - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - c)) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + c) : _mm512_setzero_ps();
    const __m512 v = _mm512_add_ps(_mm512_scalef_ps(acc[h], unit), bv);
    const int64_t at = r * ldo + c;
    if (f32_out)
      _mm512_mask_storeu_ps(static_cast<float*>(out) + at, mk, v);
    else
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + at, mk, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// VNNI: rows [r0, r0 + R) x the 32 columns of one group.
template <int R>
PC_VNNI void vnni_rows(const Codes& c, int64_t r0, const uint8_t* group, const float* bias,
                       int64_t col, int64_t n, void* out, int64_t ldo, bool f32_out) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* blk = group + b * BLOCK_BYTES;
    __m512i hs[R][2], ls[R][2];
    for (int i = 0; i < R; ++i) hs[i][0] = hs[i][1] = ls[i][0] = ls[i][1] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {  // k-quad q: k 4q .. 4q + 3
      pc_amx::prefetch_part<BLOCK_BYTES, 8>(blk, q, AHEAD, FAR);  // spread over the block
      const __m512i w0 = _mm512_loadu_si512(blk + q * 128);
      const __m512i w1 = _mm512_loadu_si512(blk + q * 128 + 64);
      for (int i = 0; i < R; ++i) {
        int32_t hq, lq;
        std::memcpy(&hq, c.hi(r0 + i, b) + 4 * q, 4);
        std::memcpy(&lq, c.lo(r0 + i, b) + 4 * q, 4);
        const __m512i hb = _mm512_set1_epi32(hq), lb = _mm512_set1_epi32(lq);
        hs[i][0] = _mm512_dpbusd_epi32(hs[i][0], w0, hb);
        hs[i][1] = _mm512_dpbusd_epi32(hs[i][1], w1, hb);
        ls[i][0] = _mm512_dpbusd_epi32(ls[i][0], w0, lb);
        ls[i][1] = _mm512_dpbusd_epi32(ls[i][1], w1, lb);
      }
    }
    const float* scale = reinterpret_cast<const float*>(blk + 1024);
    const __m512 s[2] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + 16)};
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * c.blocks + b;
      for (int h = 0; h < 2; ++h)
        acc[i][h] = accumulate(acc[i][h], hs[i][h], ls[i][h], c.corr[at], c.expo[at], s[h]);
    }
  }
  for (int i = 0; i < R; ++i) store_row(acc[i], c, r0 + i, col, n, bias, out, ldo, f32_out);
}

// AMX tiles: 0-3 C (int32, 16 limb rows x 16 columns: A tile a, B half h at 2a + h), 4-5 A
// (16 limb rows x 32 k), 6-7 B (8 k-quads x 16 columns x 4).
constexpr pc_amx::TileConfig kInt8Config = {
    1, 0, {}, {64, 64, 64, 64, 32, 32, 64, 64}, {16, 16, 16, 16, 16, 16, 8, 8}};

// AMX: rows [r0, r0 + 16) (codes padded with zero rows to a multiple of 16) x one group.
PC_AMX_INT8 void amx_rows(const Codes& c, int64_t r0, int64_t r_end, const uint8_t* group,
                          const float* bias, int64_t col, int64_t n, void* out, int64_t ldo,
                          bool f32_out) {
  alignas(64) int32_t sums[4][16][16];
  __m512 acc[AMX_ROWS][2];
  for (int i = 0; i < AMX_ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* blk = group + b * BLOCK_BYTES;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    PC_TILE_LOAD(6, blk, 128);
    PC_TILE_LOAD(7, blk + 64, 128);
    PC_TILE_LOAD(4, c.hi(r0, b), c.k);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    PC_TILE_LOAD(5, c.hi(r0 + 8, b), c.k);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
    PC_TILE_STORE(0, sums[0], 64);
    PC_TILE_STORE(1, sums[1], 64);
    PC_TILE_STORE(2, sums[2], 64);
    PC_TILE_STORE(3, sums[3], 64);
    const float* scale = reinterpret_cast<const float*>(blk + 1024);
    const __m512 s[2] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + 16)};
    for (int i = 0; i < AMX_ROWS; ++i) {
      const int a = i / 8, row = 2 * (i % 8);
      const int64_t at = (r0 + i) * c.blocks + b;
      for (int h = 0; h < 2; ++h) {
        const __m512i hsum = _mm512_load_si512(sums[2 * a + h][row]);
        const __m512i lsum = _mm512_load_si512(sums[2 * a + h][row + 1]);
        acc[i][h] = accumulate(acc[i][h], hsum, lsum, c.corr[at], c.expo[at], s[h]);
      }
    }
  }
  for (int i = 0; i < AMX_ROWS && r0 + i < r_end; ++i)
    store_row(acc[i], c, r0 + i, col, n, bias, out, ldo, f32_out);
}

PC_AMX_INT8 void amx_configure() { __asm__ volatile("ldtilecfg %0" ::"m"(kInt8Config)); }
PC_AMX_INT8 void amx_release() { _tile_release(); }

}  // namespace

extern "C" {

// Asks for the AMX tile state (cpu_amx.h): 0 when granted (then calls of more than 8 rows
// run on AMX), else 1 and every call keeps VNNI.
int pc_head_i8_enable_amx() {
  amx_granted = pc_amx::request();
  return amx_granted ? 0 : 1;
}

// Bytes of pack()'s layout for [n, k] (k a multiple of 32).
int64_t pc_head_i8_packed_bytes(int64_t n, int64_t k) {
  return (n + 31) / 32 * (k / KB) * BLOCK_BYTES;
}

// pc_gemm_bf16's contract (cpu_gemm.cpp) on pack()'s layout: x bf16 [m, k] (row stride
// ldx), out [m, n] fp32 where f32_out, else bf16 (row stride ldo), bias fp32 or null.
PC_VNNI
void pc_head_i8(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n,
                int64_t k, const float* bias, void* out, int64_t ldo, int f32_out, int nthreads) {
  if (m <= 0) return;
  const bool amx = amx_granted && m >= AMX_MIN_ROWS;
  const int64_t blocks = k / KB, groups = (n + 31) / 32;
  const int64_t rows = amx ? (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m;
  // one allocation: limbs (zero rows pad an AMX call), then corr, expo and row_expo
  uint8_t* mem = static_cast<uint8_t*>(std::calloc(rows * (2 * k + 8 * blocks + 4), 1));
  if (mem == nullptr) {
    std::fprintf(stderr, "pc_head_i8: out of memory for %lld rows\n", static_cast<long long>(m));
    std::abort();
  }
  const Codes c = {reinterpret_cast<int8_t*>(mem), reinterpret_cast<int32_t*>(mem + rows * 2 * k),
                   reinterpret_cast<float*>(mem + rows * (2 * k + 4 * blocks)),
                   reinterpret_cast<float*>(mem + rows * (2 * k + 8 * blocks)), k, blocks};
  const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK, tasks = chunks * groups;
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) encode_row(x + r * ldx, r, c);
    if (amx) amx_configure();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {  // chunk-major: a chunk's codes stay in L2
      const int64_t chunk = t / groups, g = t % groups;
      const uint8_t* group = packed + g * blocks * BLOCK_BYTES;
      const int64_t r_end = std::min(m, (chunk + 1) * ROW_CHUNK);
      int64_t r = chunk * ROW_CHUNK;
      if (amx) {
        for (; r < r_end; r += AMX_ROWS)
          amx_rows(c, r, r_end, group, bias, g * 32, n, out, ldo, f32_out);
        continue;
      }
      for (; r + ROW_TILE <= r_end; r += ROW_TILE)
        vnni_rows<ROW_TILE>(c, r, group, bias, g * 32, n, out, ldo, f32_out);
      switch (r_end - r) {  // the last one to three rows in one pass over the group's blocks
        case 3: vnni_rows<3>(c, r, group, bias, g * 32, n, out, ldo, f32_out); break;
        case 2: vnni_rows<2>(c, r, group, bias, g * 32, n, out, ldo, f32_out); break;
        case 1: vnni_rows<1>(c, r, group, bias, g * 32, n, out, ldo, f32_out); break;
        default: break;
      }
    }
    if (amx) amx_release();
  }
  std::free(mem);
}

}  // extern "C"
