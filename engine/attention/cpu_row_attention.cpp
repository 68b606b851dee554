// Batch-invariant paged attention for x86 CPUs with AVX-512 (bf16 also AVX512_BF16).
//
// Built at first use by cpu_kernels.py (g++, no torch headers) and called through ctypes.
// Every query row (a token x a query head) attends to keys [0, limit) of its sequence, read
// from the KV pages, in key blocks of BK aligned to absolute key positions (block kb holds
// keys [kb*BK, kb*BK + BK)), with one online-softmax update per block, partitions of
// kPartBlocks blocks (also aligned to absolute positions) each from a fresh state, their
// states folded in ascending order, and one rounding of the output at the end. Prefill
// chunks, rows after cached pages, decodes (whose partitions may run on several threads),
// and members of a group that shares leading pages all run this same sequence of operations
// per row, so a row's result depends only on its query and its keys: not on how much of
// the prompt was cached, where chunked prefill cut, which rows share the call, or how many
// threads ran it. Rows that share pages (a group) take each fully shared key block packed
// once.
//
// A sliding window (window > 0; never with groups): the row at position p sees keys
// [max(0, p - window + 1), p], in the same absolute blocks from the one holding its first key.
// Keys before the first query's window of a sequence are never read (their pages may be a
// sliding layer's null page): a block that starts before it is packed with zeros there.
//
// Two element types, one structure. bf16 (T = uint16_t): K packed as [D/2][BK] pairs along
// D and V as [BK/2][D] pairs of keys, the layout VDPBF16PS consumes; P rounded to bf16.
// fp32 (T = float): K packed as [D][BK], V as [BK][D]; P kept in fp32; fused multiply-adds.
// Scores are in base 2 (scale * log2 e folded in).
//
// Built as two libraries (row_kernels.py), each loaded where its rows run: PC_ROW_PART 1
// holds the bf16 entries and AMX's switch, 2 the fp32 entries, both the K/V write; undefined,
// one library holds all.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_flash_block.h"
#include "cpu_simd.h"
#ifndef PC_NARROW_VECTORS
#include "cpu_flash_block_amx.h"
#endif

namespace {

using namespace pc;

constexpr int64_t BK = kKeyBlock;

// bf16 rows on AMX tiles (cpu_flash_block_amx.h), for head dims that are multiples of 64:
// set once, by pc_row_enable_amx before the first call, so every row of the process takes
// the same arithmetic.
bool use_amx = false;

template <int D, typename T>
inline bool amx_rows() {
#ifndef PC_NARROW_VECTORS
  return !kF32<T> && D % 64 == 0 && use_amx;
#else
  return false;
#endif
}

// One key block for rows [ra, rb): attend_packed, or its AMX twin where amx_rows.
template <int D, int R, typename T>
inline void attend_block(const uint32_t* kblk, const uint32_t* vblk, int64_t k0, int64_t ra,
                         int64_t rb, const uint32_t* qw, const int64_t* limit,
                         const int64_t* begin, float* m, float* l, float* obuf, float* pbuf,
                         float scale2, float cap2) {
#ifndef PC_NARROW_VECTORS
  if constexpr (!kF32<T> && D % 64 == 0) {  // the only instantiations the AMX step has
    if (amx_rows<D, T>()) {
      attend_packed_amx<D>(kblk, vblk, k0, ra, rb, qw, limit, begin, m, l, obuf, scale2, cap2);
      return;
    }
  }
#endif
  attend_packed<D, R, T>(kblk, vblk, k0, ra, rb, qw, limit, begin, m, l, obuf, pbuf, scale2,
                         cap2);
}

// The 16 x 16 dwords at rows[0..16) + col (row-major; a null row reads as zeros) transposed
// into dst[c * stride + r].
inline void transpose16(const uint32_t* const* rows, int64_t col, uint32_t* dst,
                        int64_t stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i)
    r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + col) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4a + b]: per 128-bit lane L, rows 4a..4a+3 of column 4L + b.
  for (int a = 0; a < 4; ++a) {
    const int i = 4 * a;
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    // x[h]: lanes 0 and 2 of row groups 2h, 2h+1; y[h]: lanes 1 and 3.
    const __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
    const __m512i y0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xDD);
    const __m512i x1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xDD);
    _mm512_storeu_si512(dst + b * stride, _mm512_shuffle_i32x4(x0, x1, 0x88));
    _mm512_storeu_si512(dst + (8 + b) * stride, _mm512_shuffle_i32x4(x0, x1, 0xDD));
    _mm512_storeu_si512(dst + (4 + b) * stride, _mm512_shuffle_i32x4(y0, y1, 0x88));
    _mm512_storeu_si512(dst + (12 + b) * stride, _mm512_shuffle_i32x4(y0, y1, 0xDD));
  }
}

// K rows krow[j] (nullptr: zeros), each with its V row v_offset elements further, packed:
// kbuf [KW][BK] (KW = D words of K per key: pairs for bf16, elements for fp32), vbuf
// (bf16: [BK/2][D] pairs of keys; fp32: [BK][D]).
#ifdef PC_NARROW_VECTORS
// The AVX2 build's fp32 packing: native 8 x 8 transposes of K, V rows copied (SIMDe's
// 512-bit shuffles go through memory and cost as much as the attention of a decode).
inline void transpose8_ps(const float* const* rows, int64_t col, float* dst, int64_t stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = rows[i] ? _mm256_loadu_ps(rows[i] + col) : _mm256_setzero_ps();
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[0..3]: columns 0, 1, 2, 3 of rows 0-3 (low lane) and columns 4-7 (high lane); r[4..7]
  // the same for rows 4-7.
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}

template <int D>
void pack_rows_f32(const float* const* krow, int64_t v_offset, uint32_t* kbuf, uint32_t* vbuf) {
  float* kf = reinterpret_cast<float*>(kbuf);
  for (int64_t j0 = 0; j0 < BK; j0 += 8)
    for (int64_t p0 = 0; p0 < D; p0 += 8) transpose8_ps(krow + j0, p0, kf + p0 * BK + j0, BK);
  for (int64_t j = 0; j < BK; ++j) {
    float* dst = reinterpret_cast<float*>(vbuf) + j * D;
    if (krow[j])
      std::memcpy(dst, krow[j] + v_offset, sizeof(float) * D);
    else
      std::memset(dst, 0, sizeof(float) * D);
  }
}
#endif

// with_k false: V alone (kbuf untouched), for the decode step that reads K in place.
template <int D, typename T, bool with_k = true>
void pack_rows(const T* const* krow, int64_t v_offset, uint32_t* kbuf, uint32_t* vbuf) {
#ifdef PC_NARROW_VECTORS
  if constexpr (kF32<T>) {
    pack_rows_f32<D>(krow, v_offset, kbuf, vbuf);
    return;
  }
#endif
  constexpr int KW = D * static_cast<int>(sizeof(T)) / 4;
  for (int64_t j0 = 0; with_k && j0 < BK; j0 += 16) {
    const uint32_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const uint32_t*>(krow[j0 + i]);
    for (int64_t p0 = 0; p0 < KW; p0 += 16) transpose16(rows, p0, kbuf + p0 * BK + j0, BK);
  }
  const __m512i zero = _mm512_setzero_si512();
  if constexpr (kF32<T>) {
    for (int64_t j = 0; j < BK; ++j) {
      uint32_t* dst = vbuf + j * D;
      for (int64_t c = 0; c < D; c += 16)
        _mm512_storeu_si512(dst + c, krow[j] ? _mm512_loadu_si512(krow[j] + v_offset + c) : zero);
    }
  } else {
    // V pairs: word (i, c) = V[2i][c] | V[2i + 1][c] << 16.
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41,
                                            9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2,
                                            33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < BK / 2; ++i) {
      const T* a = krow[2 * i];
      const T* b = krow[2 * i + 1];
      uint32_t* dst = vbuf + i * D;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i va = a ? _mm512_loadu_si512(a + v_offset + c) : zero;
        const __m512i vb = b ? _mm512_loadu_si512(b + v_offset + c) : zero;
        _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, lo_idx, vb));
        _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
      }
    }
  }
}

// Keys [k0, k0 + BK) of one sequence (those in [kv_begin, kv_end); the rest zero, unread),
// kv head h, read from pages of KV (T itself, or fp8 converted to T once) and packed.
template <int D, typename T, typename KV, bool with_k = true>
void pack_block(const KV* kv, const int32_t* table, int64_t bs, int64_t row_elems, int64_t h,
                int64_t k0, int64_t kv_begin, int64_t kv_end, int64_t v_offset, uint32_t* kbuf,
                uint32_t* vbuf) {
  // Each key's K row, walking the pages (one table lookup per page, no division per key).
  const KV* krow[BK];
  int64_t page = k0 / bs, slot = k0 % bs;
  const KV* row = kv + (static_cast<int64_t>(table[page]) * 2 * bs + slot) * row_elems + h * D;
  for (int64_t j = 0; j < BK; ++j) {
    if (k0 + j >= kv_end) {
      krow[j] = nullptr;
      continue;
    }
    krow[j] = k0 + j >= kv_begin ? row : nullptr;
    if (++slot == bs) {
      slot = 0;
      ++page;
      if (k0 + j + 1 < kv_end)
        row = kv + static_cast<int64_t>(table[page]) * 2 * bs * row_elems + h * D;
    } else {
      row += row_elems;
    }
  }
  if constexpr (std::is_same_v<KV, T>) {
    pack_rows<D, T, with_k>(krow, v_offset, kbuf, vbuf);
  } else {
    static_assert(kFp8<KV> && with_k, "pages hold T or fp8");
    // Each K and V row converted once into [BK][2][D] of T, then the same packing.
    thread_local std::vector<T> conv;
    conv.resize(static_cast<size_t>(BK * 2 * D));
    const T* trow[BK];
    for (int64_t j = 0; j < BK; ++j) {
      trow[j] = nullptr;
      if (!krow[j]) continue;
      T* dst = conv.data() + j * 2 * D;
      fp8_row_to<D>(krow[j], dst);
      fp8_row_to<D>(krow[j] + v_offset, dst + D);
      trow[j] = dst;
    }
    pack_rows<D, T>(trow, D, kbuf, vbuf);
  }
}

// Asks for keys [k0, k0 + BK) of one sequence (K and V rows of kv head h, those < kv_end)
// into L2 while the block before them is computed: the pages are scattered, so the hardware
// prefetcher stops at each one.
template <int D, typename T>
void prefetch_block(const T* kv, const int32_t* table, int64_t bs, int64_t row_elems, int64_t h,
                    int64_t k0, int64_t kv_end, int64_t v_offset) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  const int64_t end = std::min(kv_end, k0 + BK);
  for (int64_t key = k0; key < end;) {
    const int64_t page = key / bs, slot = key % bs, n = std::min(bs - slot, end - key);
    const T* row = kv + (static_cast<int64_t>(table[page]) * 2 * bs + slot) * row_elems + h * D;
    for (int64_t j = 0; j < n; ++j, row += row_elems)
      for (int64_t c = 0; c < D; c += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(row + v_offset + c), _MM_HINT_T1);
      }
    key += n;
  }
}

template <typename T, typename KV>
struct RowBatch {
  const T* q;
  int64_t q_tok, q_head;
  const KV* kv;
  int64_t bs, hq, hk;
  const int32_t* tables;
  int64_t table_stride;
  const int64_t* qo;       // [nseq + 1] query rows of each sequence
  const int64_t* kv_lens;  // [nseq] keys its last query sees
  T* out;                  // [tokens, hq, D]
  float scale2;    // scale * log2 e; with a softcap, scale / cap
  float cap2;      // 0: none; else the softcap * log2 e (attend_packed)
  int64_t window;  // 0: none

  // The first key any query of sequence s sees (its first query's window start).
  int64_t first_key(int64_t s) const {
    return window > 0 ? std::max<int64_t>(0, kv_lens[s] - (qo[s + 1] - qo[s]) + 1 - window) : 0;
  }
};

// Sequences whose rows span more tasks than there are threads have their keys packed once per
// call (the same words pack_block would produce per task), so long prefills do not repack
// them per task. With no more tasks than threads the tasks pack side by side, each into a
// block buffer in its own cache; a shared pass (its buffers written on one core and read on
// another) cost a warm 64-token Gemma 3 suffix's sliding layer 1.3x.
struct Prepacked {
  std::vector<int64_t> offset;  // [nseq]: first word of sequence s's K (and V) blocks, or -1
  std::unique_ptr<uint32_t[]> k, v;  // per (s, head): its key blocks back to back, from the
                                     // one holding its first key (first_key); not zeroed
};

// A task's rows come from segments: tokens [t0, t1) of sequence s (absolute query rows).
struct Segment {
  int64_t s, t0, t1;
};
struct RowTask {
  int64_t seg_begin, seg_end, shared;  // segments of `segments`; keys all of them share
};

// Rows (tokens x folded heads) per task, about. Each task packs (or reads prepacked) every key
// block its rows see, so small tasks repeat that per block: at 64, eight 64-token requests
// over one 32K-token prefix ran at 320-400 GFLOP/s against 850 at 256, a 64-row warm suffix
// 1.4x slower; long prefill chunks take the same time either way. Where tasks of kTaskRows
// would leave a thread without a work item (a short suffix over few kv heads, whose window
// keys may not span partitions to split), they halve, down to kMinTaskRows; a sequence's rows
// split into tasks of near-equal size. A row's arithmetic does not depend on its task.
constexpr int64_t kTaskRows = 256;
constexpr int64_t kMinTaskRows = 64;

// Key blocks per partition. A row's keys are attended partition by partition (partition i
// holds absolute keys [i * kPartKeys, (i + 1) * kPartKeys)), each from a fresh online-softmax
// state, and the partitions' states are folded in ascending order (fold_partition). The
// partitions of a task may then run on different threads (a long decode at batch 1) with the
// very same arithmetic as on one.
constexpr int64_t kPartBlocks = 8;
constexpr int64_t kPartKeys = kPartBlocks * BK;

// Per-row state over some keys: running max (base 2), sum of exponentials, unscaled output.
struct RowStates {
  std::vector<float> m, l, o;
  void reset(int64_t rows, int64_t d) {
    m.assign(static_cast<size_t>(rows), -INFINITY);
    l.assign(static_cast<size_t>(rows), 0.0f);
    o.assign(static_cast<size_t>(rows * d), 0.0f);
  }
};

// Folds one partition's state (m, l, o) of a row into its running state (M, L, O): a row's
// first partition with keys is copied; a later one is rescaled to the larger max. Written
// with explicit multiplies and FMAs, so every build and caller rounds the same way.
template <int D>
inline void fold_partition(float& M, float& L, float* O, float m, float l, const float* o) {
  if (m == -INFINITY) return;  // the row saw none of the partition's keys
  if (M == -INFINITY) {
    M = m;
    L = l;
    std::memcpy(O, o, sizeof(float) * D);
    return;
  }
  const float mx = std::max(M, m);
  const float a = std::exp2(M - mx), b = std::exp2(m - mx);
  L = std::fma(l, b, L * a);
  const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
  for (int c = 0; c < D; c += 16)
    _mm512_storeu_ps(O + c, _mm512_fmadd_ps(_mm512_loadu_ps(o + c), bv,
                                            _mm512_mul_ps(_mm512_loadu_ps(O + c), av)));
  M = mx;
}

// Each of `rows` rows' partition state (m, l, o) folded into acc (fold_partition).
template <int D>
void fold_rows(RowStates& acc, const float* m, const float* l, const float* o, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    fold_partition<D>(acc.m[r], acc.l[r], &acc.o[r * D], m[r], l[r], &o[r * D]);
}

// A task's rows for kv head h: their queries as words, the keys each sees ([begin, limit)),
// and for each segment that takes the in-place step (reads_k_in_place) its queries as the B
// operand (qt_at: first word in qt, or -1).
struct TaskRows {
  std::vector<uint32_t> qw, qt;
  std::vector<int64_t> limit, begin, qt_at;
  int64_t rows = 0, max_limit = 0, min_begin = 0;
};

// Segments of at most this many rows (a decode's query heads of one kv head) read K in place.
constexpr int64_t kInPlaceRows = 16;

// Whether a call's decode-shaped segments may read K rows from the pages as AMX tiles: bf16
// pages (not fp8), and pages of a multiple of 16 slots (a 16-key tile then lies in one page).
template <int D, typename T, typename KV>
inline bool reads_k_in_place(const RowBatch<T, KV>& rb) {
  return amx_rows<D, T>() && std::is_same_v<KV, T> && rb.bs % 16 == 0;
}

template <int D, typename T, typename KV>
void load_task_rows(const RowBatch<T, KV>& rb, const Segment* segs, const RowTask& task,
                    int64_t h, TaskRows& tr, bool for_attention = true) {
  constexpr int KW = D * static_cast<int>(sizeof(T)) / 4;  // words per query / key row
  const int64_t g = rb.hq / rb.hk;
  int64_t rows = 0;
  for (int64_t si = task.seg_begin; si < task.seg_end; ++si) rows += (segs[si].t1 - segs[si].t0) * g;
  tr.qw.resize(static_cast<size_t>(rows * KW));
  tr.limit.resize(static_cast<size_t>(rows));
  tr.begin.resize(static_cast<size_t>(rows));
  tr.rows = rows;
  tr.max_limit = 0;
  tr.min_begin = INT64_MAX;
  int64_t r = 0;
  for (int64_t si = task.seg_begin; si < task.seg_end; ++si) {
    const Segment& sg = segs[si];
    const int64_t n = rb.qo[sg.s + 1] - rb.qo[sg.s], first = rb.kv_lens[sg.s] - n;
    for (int64_t t = sg.t0; t < sg.t1; ++t)
      for (int64_t j = 0; j < g; ++j, ++r) {
        std::memcpy(&tr.qw[r * KW], rb.q + t * rb.q_tok + (h * g + j) * rb.q_head,
                    sizeof(T) * D);
        tr.limit[r] = first + (t - rb.qo[sg.s]) + 1;
        tr.begin[r] = rb.window > 0 ? std::max<int64_t>(0, tr.limit[r] - rb.window) : 0;
        tr.max_limit = std::max(tr.max_limit, tr.limit[r]);
        tr.min_begin = std::min(tr.min_begin, tr.begin[r]);
      }
  }
  // Queries of small segments transposed once into pairs along D (tile s: [16 pairs][16
  // rows], rows past the segment zero), the operand the in-place step multiplies K rows by.
  tr.qt_at.assign(static_cast<size_t>(task.seg_end - task.seg_begin), -1);
  if (!for_attention || !reads_k_in_place<D>(rb)) return;  // (planning reads spans only)
  int64_t words = 0;
  for (int64_t si = task.seg_begin; si < task.seg_end; ++si)
    if ((segs[si].t1 - segs[si].t0) * g <= kInPlaceRows) {
      tr.qt_at[si - task.seg_begin] = words;
      words += KW * 16;
    }
  tr.qt.resize(static_cast<size_t>(words));
  r = 0;
  for (int64_t si = task.seg_begin; si < task.seg_end; ++si) {
    const int64_t n = (segs[si].t1 - segs[si].t0) * g, at = tr.qt_at[si - task.seg_begin];
    if (at >= 0) {
      const uint32_t* rows[16];
      for (int64_t i = 0; i < 16; ++i) rows[i] = i < n ? &tr.qw[(r + i) * KW] : nullptr;
      for (int64_t c = 0; c < KW; c += 16) transpose16(rows, c, &tr.qt[at + c * 16], 16);
    }
    r += n;
  }
}

#ifndef PC_NARROW_VECTORS
// Rows [ra, ra + nr) (nr <= 16) of one sequence against keys [k0, k0 + BK) of kv head h
// (from kv_begin on: a sliding window's tiles wholly before it are never read, their page may
// be a null page), with K read from the pages in place: each 16-key tile of K rows is the A
// operand and the rows' queries (qt, pairs along D) the B operand, so the product is the
// scores transposed.
// TDPBF16PS gives each element the same dot product over the same pairs in the same order
// whichever operand holds which factor, so these are attend_packed_amx's score bits (held bit
// for bit by tests/test_row_partitions.py: a decode row against the same row inside a packed
// prefill chunk), without transposing K. The scores are
// turned query-major (16 x 16 transposes: one per 16 keys, not D / 32 as packing K takes),
// then update_rows_amx does the rest with V packed as ever.
template <int D>
PC_AMX void attend_in_place_amx(const uint16_t* kv, const int32_t* table, int64_t bs,
                                int64_t row_elems, int64_t h, int64_t k0, int64_t kv_begin,
                                int64_t ra, int nr, const uint32_t* qt, const uint32_t* vblk,
                                const int64_t* limit, const int64_t* begin, float* m, float* l,
                                float* obuf, float scale2f, float cap2f) {
  const int64_t tile_keys = keys_seen(limit, k0, ra, nr);
  if (tile_keys <= 0) return;
  alignas(64) float sbuf[16][BK];
  alignas(64) float st[2][16][16];  // two tiles of scores, key-major
  const int64_t stride = row_elems * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t ntiles = (tile_keys + 15) / 16;
  const int64_t t0 = std::max<int64_t>(0, kv_begin - k0) / 16;  // tiles before: unread, unseen
  auto k_tile = [&](int64_t t) {  // K rows of keys k0 + 16t .. k0 + 16t + 15, in one page
    const int64_t key = k0 + 16 * t;
    return kv + (static_cast<int64_t>(table[key / bs]) * 2 * bs + key % bs) * row_elems + h * D;
  };
  for (int64_t t = t0; t < ntiles; t += 2) {
    const bool two = t + 1 < ntiles;
    const uint16_t* ka = k_tile(t);
    const uint16_t* kb = two ? k_tile(t + 1) : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0; s < D / 32; ++s) {
      PC_TILE_LOAD(6, qt + s * 256, 64);
      PC_TILE_LOAD(4, ka + s * 32, stride);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        PC_TILE_LOAD(5, kb + s * 32, stride);
        _tile_dpbf16ps(1, 5, 6);
      }
    }
    PC_TILE_STORE(0, st[0], 64);
    if (two) PC_TILE_STORE(1, st[1], 64);
    for (int64_t u = 0; u < (two ? 2 : 1); ++u) {
      const uint32_t* rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const uint32_t*>(st[u][i]);
      transpose16(rows, 0, reinterpret_cast<uint32_t*>(&sbuf[0][(t + u) * 16]), BK);
    }
  }
  update_rows_amx<D>(sbuf, vblk, k0, ra, nr, tile_keys, limit, begin, m, l, obuf, scale2f,
                     cap2f);
}
#endif

// Key blocks [kb_from, kb_to) for every row of the task, into st (online softmax).
template <int D, int R, typename T, typename KV>
void attend_blocks(const RowBatch<T, KV>& rb, const Prepacked& pre, const Segment* segs,
                   const RowTask& task, int64_t h, const TaskRows& tr, int64_t kb_from,
                   int64_t kb_to, RowStates& st, float* pbuf, uint32_t* kbuf, uint32_t* vbuf) {
  constexpr int64_t WORDS = kBlockWords<D, T>;
  const int64_t g = rb.hq / rb.hk, row_elems = rb.hk * D, v_offset = rb.bs * row_elems;
  const int64_t* row_begin = rb.window > 0 ? tr.begin.data() : nullptr;
  for (int64_t kb = kb_from; kb < kb_to; ++kb) {
    const int64_t k0 = kb * BK;
    if (k0 + BK <= task.shared) {  // every segment's sequence holds these keys in the same pages
      const int64_t s = segs[task.seg_begin].s;
      pack_block<D, T>(rb.kv, rb.tables + s * rb.table_stride, rb.bs, row_elems, h, k0, 0,
                    rb.kv_lens[s], v_offset, kbuf, vbuf);
      attend_block<D, R, T>(kbuf, vbuf, k0, 0, tr.rows, tr.qw.data(), tr.limit.data(), nullptr,
                            st.m.data(), st.l.data(), st.o.data(), pbuf, rb.scale2, rb.cap2);
      continue;
    }
    int64_t ra = 0;
    for (int64_t si = task.seg_begin; si < task.seg_end; ++si) {
      const Segment& sg = segs[si];
      const int64_t seg_rows = (sg.t1 - sg.t0) * g;
      const int64_t seg_max = tr.limit[ra + seg_rows - 1], seg_begin = tr.begin[ra];
      if (seg_max > k0 && seg_begin < k0 + BK) {
        const uint32_t *kb_words = kbuf, *vb_words = vbuf;
        if (pre.offset[sg.s] >= 0) {
          const int64_t kb0 = rb.first_key(sg.s) / BK;
          const int64_t nb = (rb.kv_lens[sg.s] + BK - 1) / BK - kb0;
          kb_words = pre.k.get() + pre.offset[sg.s] + (h * nb + kb - kb0) * WORDS;
          vb_words = pre.v.get() + pre.offset[sg.s] + (h * nb + kb - kb0) * WORDS;
        } else {
          const int32_t* table = rb.tables + sg.s * rb.table_stride;
          if (k0 + BK < seg_max && kb + 1 < kb_to)
            prefetch_block<D>(rb.kv, table, rb.bs, row_elems, h, k0 + BK, seg_max, v_offset);
#ifndef PC_NARROW_VECTORS
          if constexpr (std::is_same_v<KV, T> && !kF32<T> && D % 64 == 0) {
            const int64_t qt_at = tr.qt_at[si - task.seg_begin];
            if (qt_at >= 0) {
              pack_block<D, T, KV, false>(rb.kv, table, rb.bs, row_elems, h, k0, seg_begin,
                                          seg_max, v_offset, kbuf, vbuf);
              attend_in_place_amx<D>(rb.kv, table, rb.bs, row_elems, h, k0, seg_begin, ra,
                                     static_cast<int>(seg_rows), tr.qt.data() + qt_at, vbuf,
                                     tr.limit.data(), row_begin, st.m.data(), st.l.data(),
                                     st.o.data(), rb.scale2, rb.cap2);
              ra += seg_rows;
              continue;
            }
          }
#endif
          pack_block<D, T>(rb.kv, table, rb.bs, row_elems, h, k0, seg_begin, seg_max, v_offset,
                        kbuf, vbuf);
        }
        attend_block<D, R, T>(kb_words, vb_words, k0, ra, ra + seg_rows, tr.qw.data(),
                              tr.limit.data(), row_begin, st.m.data(), st.l.data(), st.o.data(),
                              pbuf, rb.scale2, rb.cap2);
      }
      ra += seg_rows;
    }
  }
}

// The partitions a task's rows see: [first, end).
inline int64_t first_part(const TaskRows& tr) { return tr.min_begin / kPartKeys; }
inline int64_t end_part(const TaskRows& tr) { return (tr.max_limit + kPartKeys - 1) / kPartKeys; }

// Partition p for every row of the task, from a fresh state.
template <int D, int R, typename T, typename KV>
void attend_partition(const RowBatch<T, KV>& rb, const Prepacked& pre, const Segment* segs,
                      const RowTask& task, int64_t h, const TaskRows& tr, int64_t p,
                      RowStates& st, float* pbuf, uint32_t* kbuf, uint32_t* vbuf) {
  st.reset(tr.rows, D);
  const int64_t kb_from = std::max(p * kPartBlocks, tr.min_begin / BK);
  const int64_t kb_to = std::min((p + 1) * kPartBlocks, (tr.max_limit + BK - 1) / BK);
  attend_blocks<D, R, T, KV>(rb, pre, segs, task, h, tr, kb_from, kb_to, st, pbuf, kbuf, vbuf);
}

// Each row's output: its folded state normalized, in T.
template <int D, typename T, typename KV>
void store_rows(const RowBatch<T, KV>& rb, const Segment* segs, const RowTask& task, int64_t h,
                const float* l, const float* obuf) {
  const int64_t g = rb.hq / rb.hk;
  int64_t r = 0;
  for (int64_t si = task.seg_begin; si < task.seg_end; ++si) {
    const Segment& sg = segs[si];
    for (int64_t t = sg.t0; t < sg.t1; ++t)
      for (int64_t j = 0; j < g; ++j, ++r) {
        T* dst = rb.out + (t * rb.hq + h * g + j) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int c = 0; c < D / 16; ++c) {
          const __m512 x =
              _mm512_mul_ps(_mm512_loadu_ps(&obuf[r * D + c * 16]), _mm512_set1_ps(inv));
          if constexpr (kF32<T>)
            _mm512_storeu_ps(dst + c * 16, x);
          else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
  }
}

// A whole task on one thread: its partitions in ascending order, folded as they finish.
template <int D, int R, typename T, typename KV>
void run_row_task(const RowBatch<T, KV>& rb, const Prepacked& pre, const Segment* segs,
                  const RowTask& task, int64_t h, TaskRows& tr, RowStates& part, RowStates& acc,
                  float* pbuf, uint32_t* kbuf, uint32_t* vbuf) {
  load_task_rows<D, T, KV>(rb, segs, task, h, tr);
  const int64_t p0 = first_part(tr), p1 = end_part(tr);
  if (p1 - p0 == 1) {  // one partition: its state is the rows' (a fold would copy it)
    attend_partition<D, R, T, KV>(rb, pre, segs, task, h, tr, p0, acc, pbuf, kbuf, vbuf);
  } else {
    acc.reset(tr.rows, D);
    for (int64_t p = p0; p < p1; ++p) {
      attend_partition<D, R, T, KV>(rb, pre, segs, task, h, tr, p, part, pbuf, kbuf, vbuf);
      fold_rows<D>(acc, part.m.data(), part.l.data(), part.o.data(), tr.rows);
    }
  }
  store_rows<D, T, KV>(rb, segs, task, h, acc.l.data(), acc.o.data());
}

// Segments and tasks: a sequence outside the groups is split into tasks of about kTaskRows
// rows; a group's members are packed into tasks together (their shared keys read once).
template <typename T, typename KV>
void plan_row_tasks(const RowBatch<T, KV>& rb, int64_t nseq, const int64_t* groups,
                           int64_t n_groups, int nthreads, std::vector<Segment>& segs,
                           std::vector<RowTask>& tasks) {
  const int64_t g = rb.hq / rb.hk;
  const int64_t rows = (rb.qo[nseq] - rb.qo[0]) * g;
  int64_t task_rows = kTaskRows;
  while (task_rows > kMinTaskRows && (rows + task_rows - 1) / task_rows * rb.hk < nthreads)
    task_rows /= 2;
  const int64_t tokens = std::max<int64_t>(1, task_rows / g);
  auto add_alone = [&](int64_t s) {  // in tasks of near-equal size (threads finish together)
    const int64_t n = rb.qo[s + 1] - rb.qo[s], parts = (n + tokens - 1) / tokens;
    const int64_t each = parts > 0 ? (n + parts - 1) / parts : tokens;
    for (int64_t t0 = rb.qo[s]; t0 < rb.qo[s + 1]; t0 += each) {
      const int64_t t1 = std::min(rb.qo[s + 1], t0 + each);
      const int64_t b = static_cast<int64_t>(segs.size());
      segs.push_back({s, t0, t1});
      tasks.push_back({b, b + 1, 0});
    }
  };
  int64_t s = 0;
  for (int64_t gi = 0; gi <= n_groups; ++gi) {
    const int64_t begin = gi < n_groups ? groups[3 * gi] : nseq;
    for (; s < begin; ++s) add_alone(s);
    if (gi == n_groups) break;
    const int64_t end = groups[3 * gi + 1], shared = groups[3 * gi + 2];
    int64_t b = static_cast<int64_t>(segs.size()), used = 0;
    for (int64_t m = begin; m < end; ++m)
      for (int64_t t0 = rb.qo[m]; t0 < rb.qo[m + 1];) {
        const int64_t t1 = std::min(rb.qo[m + 1], t0 + std::max<int64_t>(1, tokens - used));
        segs.push_back({m, t0, t1});
        used += t1 - t0;
        t0 = t1;
        if (used >= tokens) {
          const int64_t e = static_cast<int64_t>(segs.size());
          tasks.push_back({b, e, shared});
          b = e;
          used = 0;
        }
      }
    if (static_cast<int64_t>(segs.size()) > b)
      tasks.push_back({b, static_cast<int64_t>(segs.size()), shared});
    s = end;
  }
}

// A (task, head) work item's partitions [p0, p1), rows, and keys summed over its rows (its
// cost).
struct ItemSpan {
  int64_t task, h, p0, p1, rows, keys;
};

// Whether whole items keep `nthreads` threads evenly busy: the longest thread, each item given
// to the least loaded one largest first, within 1/8 of an even share.
inline bool evenly_busy(const std::vector<ItemSpan>& spans, int nthreads) {
  std::vector<int64_t> cost, load(static_cast<size_t>(nthreads), 0);
  int64_t total = 0;
  for (const ItemSpan& sp : spans) {
    cost.push_back(sp.keys);
    total += sp.keys;
  }
  std::sort(cost.begin(), cost.end(), std::greater<int64_t>());
  for (const int64_t c : cost) *std::min_element(load.begin(), load.end()) += c;
  const int64_t longest = *std::max_element(load.begin(), load.end());
  return 8 * longest * nthreads <= 9 * total;
}

template <int D, int R, typename T, typename KV>
void row_run(const RowBatch<T, KV>& rb, int64_t nseq, const int64_t* groups, int64_t n_groups,
             int nthreads) {
  constexpr int64_t WORDS = kBlockWords<D, T>;  // per key block, K and V alike
  std::vector<Segment> segs;
  std::vector<RowTask> tasks;
  plan_row_tasks(rb, nseq, groups, n_groups, nthreads, segs, tasks);
  // A sequence in more tasks than threads (a long prefill chunk) gets its keys packed once.
  Prepacked pre;
  pre.offset.assign(static_cast<size_t>(nseq), -1);
  std::vector<int64_t> tasks_of(static_cast<size_t>(nseq), 0);
  for (const RowTask& t : tasks)
    for (int64_t si = t.seg_begin; si < t.seg_end; ++si) ++tasks_of[segs[si].s];
  struct PackJob {
    int64_t s, h, kb;
  };
  std::vector<PackJob> jobs;
  int64_t words = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    if (tasks_of[s] <= nthreads) continue;
    const int64_t kb0 = rb.first_key(s) / BK, nkb = (rb.kv_lens[s] + BK - 1) / BK;
    pre.offset[s] = words;
    words += rb.hk * (nkb - kb0) * WORDS;
    for (int64_t h = 0; h < rb.hk; ++h)
      for (int64_t kb = kb0; kb < nkb; ++kb) jobs.push_back({s, h, kb});
  }
  if (words > 0) {
    pre.k.reset(new uint32_t[static_cast<size_t>(words)]);
    pre.v.reset(new uint32_t[static_cast<size_t>(words)]);
    const int64_t row_elems = rb.hk * D, v_offset = rb.bs * row_elems;
    const int64_t njobs = static_cast<int64_t>(jobs.size());
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < njobs; ++j) {
      const PackJob& job = jobs[j];
      const int64_t first = rb.first_key(job.s), kb0 = first / BK;
      const int64_t nb = (rb.kv_lens[job.s] + BK - 1) / BK - kb0;
      const int64_t at = pre.offset[job.s] + (job.h * nb + job.kb - kb0) * WORDS;
      pack_block<D, T>(rb.kv, rb.tables + job.s * rb.table_stride, rb.bs, row_elems, job.h,
                    job.kb * BK, first, rb.kv_lens[job.s], v_offset, pre.k.get() + at,
                    pre.v.get() + at);
    }
  }
  // Work items: (task, head), or where they cannot keep the threads evenly busy (a long decode
  // at batch 1, unequal tasks fewer than twice the threads), (task, head, partition) for tasks
  // that span partitions, whose states are folded afterwards in ascending order: the same
  // arithmetic either way. Splitting costs each partition a copy and a fold of its rows'
  // states, which a warm suffix's equal halves (one per thread) need not pay.
  const int64_t nitems = static_cast<int64_t>(tasks.size()) * rb.hk;
  struct Item {
    int64_t task, h, part;  // part -1: the whole task
  };
  struct SplitTask {
    int64_t task, h, p0, p1, rows, at;  // partitions [p0, p1); states from `at` in parts
  };
  std::vector<Item> items;
  std::vector<SplitTask> splits;
  std::vector<int64_t> split_of;  // per (task, head): index into splits, or -1
  std::vector<ItemSpan> spans;
  if (nthreads > 1 && nitems < 2 * static_cast<int64_t>(nthreads)) {
    TaskRows tr;  // few tasks here: loading each one's rows to read its span is cheap
    for (int64_t i = 0; i < nitems; ++i) {
      const int64_t ti = static_cast<int64_t>(tasks.size()) - 1 - i / rb.hk, h = i % rb.hk;
      load_task_rows<D, T, KV>(rb, segs.data(), tasks[ti], h, tr, false);
      int64_t keys = 0;
      for (int64_t r = 0; r < tr.rows; ++r) keys += tr.limit[r] - tr.begin[r];
      spans.push_back({ti, h, first_part(tr), end_part(tr), tr.rows, keys});
    }
    if (evenly_busy(spans, nthreads)) spans.clear();
  }
  int64_t part_rows = 0;
  if (!spans.empty()) {
    split_of.assign(static_cast<size_t>(nitems), -1);
    for (const ItemSpan& sp : spans) {
      if (sp.p1 - sp.p0 < 2) {
        items.push_back({sp.task, sp.h, -1});
        continue;
      }
      split_of[sp.task * rb.hk + sp.h] = static_cast<int64_t>(splits.size());
      splits.push_back({sp.task, sp.h, sp.p0, sp.p1, sp.rows, part_rows});
      part_rows += (sp.p1 - sp.p0) * sp.rows;
      for (int64_t p = sp.p0; p < sp.p1; ++p) items.push_back({sp.task, sp.h, p});
    }
  } else {
    for (int64_t i = 0; i < nitems; ++i)  // largest tasks (the latest query rows) first
      items.push_back({static_cast<int64_t>(tasks.size()) - 1 - i / rb.hk, i % rb.hk, -1});
  }
  RowStates parts;  // split tasks' partition states: [part_rows] (and [part_rows * D])
  if (part_rows > 0) {
    parts.m.resize(static_cast<size_t>(part_rows));
    parts.l.resize(static_cast<size_t>(part_rows));
    parts.o.resize(static_cast<size_t>(part_rows * D));
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads)
  {
    TaskRows tr;
    RowStates part, acc;
    std::vector<float> pbuf(R * BK);
    std::vector<uint32_t> kbuf(WORDS), vbuf(WORDS);  // a key block packed on the fly
#ifndef PC_NARROW_VECTORS
    if (amx_rows<D, T>()) pc_amx::configure();  // per thread; others load their own between
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& it = items[i];
      if (it.part < 0) {
        run_row_task<D, R, T, KV>(rb, pre, segs.data(), tasks[it.task], it.h, tr, part, acc,
                                  pbuf.data(), kbuf.data(), vbuf.data());
        continue;
      }
      const SplitTask& sp = splits[split_of[it.task * rb.hk + it.h]];
      load_task_rows<D, T, KV>(rb, segs.data(), tasks[it.task], it.h, tr);
      attend_partition<D, R, T, KV>(rb, pre, segs.data(), tasks[it.task], it.h, tr, it.part,
                                    part, pbuf.data(), kbuf.data(), vbuf.data());
      const int64_t at = sp.at + (it.part - sp.p0) * sp.rows;
      std::memcpy(&parts.m[at], part.m.data(), sizeof(float) * sp.rows);
      std::memcpy(&parts.l[at], part.l.data(), sizeof(float) * sp.rows);
      std::memcpy(&parts.o[at * D], part.o.data(), sizeof(float) * sp.rows * D);
    }
    // The split tasks' partitions folded in ascending order, then stored.
    const int64_t n_splits = static_cast<int64_t>(splits.size());
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_splits; ++i) {
      const SplitTask& sp = splits[i];
      acc.reset(sp.rows, D);
      for (int64_t p = sp.p0; p < sp.p1; ++p) {
        const int64_t at = sp.at + (p - sp.p0) * sp.rows;
        fold_rows<D>(acc, &parts.m[at], &parts.l[at], &parts.o[at * D], sp.rows);
      }
      store_rows<D, T, KV>(rb, segs.data(), tasks[sp.task], sp.h, acc.l.data(), acc.o.data());
    }
#ifndef PC_NARROW_VECTORS
    if (amx_rows<D, T>()) pc_amx::release();
#endif
  }
}

template <typename T, typename KV>
int row_entry(const T* q, int64_t q_tok, int64_t q_head, const void* kv, int64_t bs,
              const int32_t* tables, int64_t table_stride, const int64_t* qo,
              const int64_t* kv_lens, int64_t nseq, const int64_t* groups, int64_t n_groups,
              T* out, int64_t hq, int64_t hk, int64_t d, float scale, float softcap,
              int64_t window, int nthreads) {
  if (window > 0 && n_groups > 0) return -2;
  if (!(softcap >= 0.0f)) return -3;
  constexpr float kLog2e = 1.44269504089f;
  const RowBatch<T, KV> rb{q,       q_tok, q_head, static_cast<const KV*>(kv), bs, hq, hk,
                           tables,  table_stride, qo, kv_lens, out,
                           softcap > 0.0f ? scale / softcap : scale * kLog2e,
                           softcap * kLog2e, window};
  return with_head_dim(d, [&](auto dim) {
    row_run<dim(), kTileRows<dim()>, T, KV>(rb, nseq, groups, n_groups, nthreads);
  });
}

}  // namespace

namespace {

// A float as fp8 with kMant mantissa bits and exponent bias kBias, clamped to +-max first
// (kv_dtype.to_kv), then torch's c10 conversion bit for bit: round to nearest even, the
// subnormals through an fp32 add of a magic number; a NaN (nothing else passes the clamp
// past the format's range) gives 0x7f with its sign.
template <int kMant, int kBias>
inline uint8_t fp8_of(float x, float max) {
  x = std::min(std::max(x, -max), max);  // NaN passes through both
  uint32_t f;
  std::memcpy(&f, &x, 4);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  constexpr int kShift = 23 - kMant;
  constexpr uint32_t kMinNormal = uint32_t(127 - kBias + 1) << 23;
  uint32_t out;
  if (f > 0x7F800000u) {
    out = 0x7f;
  } else if (f < kMinNormal) {
    const uint32_t magic = kMinNormal + (uint32_t(kShift) << 23);
    float a, b;
    std::memcpy(&a, &f, 4);
    std::memcpy(&b, &magic, 4);
    a += b;
    std::memcpy(&f, &a, 4);
    out = f - magic;
  } else {
    const uint32_t odd = (f >> kShift) & 1u;
    f += (uint32_t(kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) + odd;
    out = f >> kShift;
  }
  return static_cast<uint8_t>(out | (sign >> 24));
}

inline uint8_t fp8_e4m3_of(float x) { return fp8_of<3, 7>(x, 448.0f); }
inline uint8_t fp8_e5m2_of(float x) { return fp8_of<2, 15>(x, 57344.0f); }

}  // namespace

extern "C" {

#if PC_ROW_PART != 2  // bf16 rows: part 1; fp32 rows: part 2
// Puts every later bf16 call (head dims that are multiples of 64) on AMX tiles: 0 when the
// kernel granted the tile state (the caller has checked the CPU's AMX flags), else 1 and
// nothing changes. Call it once, before the first attention call, or never.
int pc_row_enable_amx() {
#ifndef PC_NARROW_VECTORS
  if (!pc_amx::request()) return 1;
  use_amx = true;
  return 0;
#else
  return 1;
#endif
}
#endif

// The batch-invariant attention (see row_run): q [T, hq, d] (d contiguous); kv_layer
// [num_blocks, 2, bs, hk, d]; tables int32 [nseq, table_stride]; qo int64 [nseq + 1]; kv_lens
// int64 [nseq] (keys the last query of each sequence sees; query i of sequence s sees
// kv_lens[s] - (qo[s+1] - qo[s]) + i + 1); groups int64 [n_groups][3] (first seq, end seq,
// keys they share in the same pages), ascending and disjoint; out [T, hq, d] contiguous;
// window: 0, or the sliding window in keys (then no groups; see the top of this file).
// Pages in q's dtype, or (the _e4m3 / _e5m2 entries) fp8 bytes read through exactly.
#if PC_ROW_PART != 2
int pc_row_attention_bf16(const uint16_t* q, int64_t q_tok, int64_t q_head, const void* kv,
                          int64_t bs, const int32_t* tables, int64_t table_stride,
                          const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                          const int64_t* groups, int64_t n_groups, uint16_t* out, int64_t hq,
                          int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<uint16_t, uint16_t>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

#if PC_ROW_PART != 1
int pc_row_attention_f32(const float* q, int64_t q_tok, int64_t q_head, const void* kv,
                         int64_t bs, const int32_t* tables, int64_t table_stride,
                         const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                         const int64_t* groups, int64_t n_groups, float* out, int64_t hq,
                         int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<float, float>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

#if PC_ROW_PART != 2
int pc_row_attention_bf16_e4m3(const uint16_t* q, int64_t q_tok, int64_t q_head, const void* kv,
                               int64_t bs, const int32_t* tables, int64_t table_stride,
                               const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                               const int64_t* groups, int64_t n_groups, uint16_t* out, int64_t hq,
                               int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<uint16_t, Fp8E4M3>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

#if PC_ROW_PART != 2
int pc_row_attention_bf16_e5m2(const uint16_t* q, int64_t q_tok, int64_t q_head, const void* kv,
                               int64_t bs, const int32_t* tables, int64_t table_stride,
                               const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                               const int64_t* groups, int64_t n_groups, uint16_t* out, int64_t hq,
                               int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<uint16_t, Fp8E5M2>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

#if PC_ROW_PART != 1
int pc_row_attention_f32_e4m3(const float* q, int64_t q_tok, int64_t q_head, const void* kv,
                              int64_t bs, const int32_t* tables, int64_t table_stride,
                              const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                              const int64_t* groups, int64_t n_groups, float* out, int64_t hq,
                              int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<float, Fp8E4M3>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

#if PC_ROW_PART != 1
int pc_row_attention_f32_e5m2(const float* q, int64_t q_tok, int64_t q_head, const void* kv,
                              int64_t bs, const int32_t* tables, int64_t table_stride,
                              const int64_t* qo, const int64_t* kv_lens, int64_t nseq,
                              const int64_t* groups, int64_t n_groups, float* out, int64_t hq,
                              int64_t hk, int64_t d, float scale, float softcap, int64_t window,
                          int nthreads) {
  return row_entry<float, Fp8E5M2>(q, q_tok, q_head, kv, bs, tables, table_stride, qo, kv_lens,
                          nseq, groups, n_groups, out, hq, hk, d, scale, softcap, window, nthreads);
}
#endif

// The step's new K and V into the pages, as backend.write_kv does: kv viewed as rows
// [num_rows, hk, d] of page elements (num_rows = num_blocks * 2 * bs); token t's K goes to
// row rows[t], its V to rows[t] + bs. k, v [T, hk, d] of `elem`-byte elements (2: bf16, 4:
// fp32) with strides in elements (token, head; d contiguous). `page` says what the pages
// hold: 0 the same elements (copied), 1 fp8 e4m3fn, 2 fp8 e5m2 (each value clamped to the
// format's finite range, then rounded to nearest even: kv_dtype.to_kv's bits, torch's c10
// conversion; a NaN stays a NaN, with its sign as torch's scalar cast keeps it). Every row
// is checked first: 1 (nothing written) where one falls outside the pages or is not a K row
// (slot bs..2bs-1 of a block holds V); 2 for an unknown `page`.
int pc_write_kv(void* kv, int64_t num_rows, const void* k, int64_t k_tok, int64_t k_head,
                const void* v, int64_t v_tok, int64_t v_head, const int64_t* rows, int64_t t,
                int64_t bs, int64_t hk, int64_t d, int64_t elem, int64_t page) {
  if (page < 0 || page > 2 || (page && elem != 2 && elem != 4)) return 2;
  for (int64_t i = 0; i < t; ++i)
    if (rows[i] < 0 || rows[i] + bs >= num_rows || rows[i] % (2 * bs) >= bs) return 1;
  char* pages = static_cast<char*>(kv);
  const char* kb = static_cast<const char*>(k);
  const char* vb = static_cast<const char*>(v);
  const int64_t page_elem = page ? 1 : elem;
  const int64_t head_bytes = d * page_elem, row_bytes = hk * head_bytes;
  auto put = [&](char* dst, const char* src) {
    if (!page) {
      std::memcpy(dst, src, d * elem);
      return;
    }
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    for (int64_t j = 0; j < d; ++j) {
      float x;
      if (elem == 2) {
        uint32_t bits = uint32_t(reinterpret_cast<const uint16_t*>(src)[j]) << 16;
        std::memcpy(&x, &bits, 4);
      } else {
        x = reinterpret_cast<const float*>(src)[j];
      }
      out[j] = page == 1 ? fp8_e4m3_of(x) : fp8_e5m2_of(x);
    }
  };
  for (int64_t i = 0; i < t; ++i) {
    char* k_row = pages + rows[i] * row_bytes;
    char* v_row = pages + (rows[i] + bs) * row_bytes;
    for (int64_t h = 0; h < hk; ++h) {
      put(k_row + h * head_bytes, kb + (i * k_tok + h * k_head) * elem);
      put(v_row + h * head_bytes, vb + (i * v_tok + h * v_head) * elem);
    }
  }
  return 0;
}

}  // extern "C"
