// Flash attention for x86 CPUs with AVX512_BF16: bf16 Q/K/V, fp32 softmax state, bf16 out.
//
// Built at first use by cpu_kernels.py (g++, no torch headers) and called through ctypes.
// Per (kv head, block of query tokens) the g query heads of that kv head are folded into
// the rows, so each K/V block is read once for all of them. K and V are first repacked into
// pairs along the dot-product axis, the layout VDPBF16PS consumes:
//   K: [key block][D/2][BK keys] words of (K[j][2p], K[j][2p+1])
//   V: [key block][BK/2][D]      words of (V[2i][d], V[2i+1][d])
// Scores are kept in base 2 (scale * log2 e folded in), so the LSE it returns is base 2.
// Causal masking is bottom-right aligned: query i sees keys j <= i + (Lk - Lq); a sliding
// window w > 0 (causal only) also drops keys j <= i + (Lk - Lq) - w, and keys before the first
// query's window are never read (a sliding layer's null page may hold them).

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_flash_block.h"
#include "cpu_simd.h"

namespace {

using namespace pc;

constexpr int BK = static_cast<int>(kKeyBlock);  // keys per block (8 vectors of 16)
constexpr int ROWS_BLOCK = 64;  // query rows (tokens x folded heads) per task, about

struct Problem {
  const uint16_t* q;
  int64_t q_tok, q_head;
  uint16_t* out;
  float* lse;
  int64_t lq, lk, hq, hk;
  float scale2;  // scale * log2(e)
  bool causal;
  int64_t window;  // 0: none (causal only)

  int64_t first_key() const {  // the first key any query sees
    return window > 0 ? std::max<int64_t>(0, lk - lq + 1 - window) : 0;
  }
};

// One task: kv head h, query tokens [t0, t1). Kp/Vp: that head's packed K/V.
template <int D, int R>
void attend_block(const Problem& pb, int64_t h, int64_t t0, int64_t t1, const uint32_t* kp,
                  const uint32_t* vp, float* obuf, float* pbuf, float* m, float* l) {
  constexpr int ND = D / 16;  // output vectors per row
  constexpr int NP = D / 2;   // dot-product pairs
  const int64_t g = pb.hq / pb.hk;
  const int64_t rows = (t1 - t0) * g;
  const int64_t offset = pb.lk - pb.lq;
  const int64_t key_end = pb.causal ? std::min(pb.lk, t1 - 1 + offset + 1) : pb.lk;
  const int64_t nkb = (key_end + BK - 1) / BK;

  std::vector<uint32_t> qw(rows * NP);  // the block's query rows as bf16 pairs
  std::vector<int64_t> limit(rows), begin(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / g, head = h * g + r % g;
    std::memcpy(&qw[r * NP], pb.q + t * pb.q_tok + head * pb.q_head, sizeof(uint16_t) * D);
    limit[r] = pb.causal ? std::min(pb.lk, t + offset + 1) : pb.lk;
    begin[r] = pb.window > 0 ? std::max<int64_t>(0, t + offset + 1 - pb.window) : 0;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  std::memset(obuf, 0, sizeof(float) * rows * D);
  for (int64_t kb = begin[0] / BK; kb < nkb; ++kb)  // row 0 has the earliest window
    attend_packed<D, R, uint16_t>(kp + kb * NP * BK, vp + kb * (BK / 2) * D, kb * BK, 0, rows,
                                  qw.data(), limit.data(), pb.window > 0 ? begin.data() : nullptr,
                                  m, l, obuf, pbuf, pb.scale2);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / g, head = h * g + r % g;
    uint16_t* dst = pb.out + (t * pb.hq + head) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* orow = obuf + r * D;
    for (int c = 0; c < ND; ++c) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(orow + c * 16), _mm512_set1_ps(inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(x));
    }
    pb.lse[t * pb.hq + head] = l[r] > 0.0f ? m[r] + std::log2(l[r]) : -INFINITY;
  }
}

// Where key j's K and V rows of kv head h are: contiguous [L, Hk, D] tensors (strided)...
struct DenseKV {
  const uint16_t *k, *v;
  int64_t k_tok, k_head, v_tok, v_head;
  const uint16_t* key(int64_t h, int64_t j) const { return k + h * k_head + j * k_tok; }
  const uint16_t* value(int64_t h, int64_t j) const { return v + h * v_head + j * v_tok; }
};

// ... or the paged layer [num_blocks, 2, bs, Hk, D] through a block table (read in place).
struct PagedKV {
  const uint16_t* kv;
  const int32_t* table;
  int64_t bs, row_words, d;  // row_words = Hk * D
  const uint16_t* key(int64_t h, int64_t j) const {
    return kv + (static_cast<int64_t>(table[j / bs]) * 2 * bs + j % bs) * row_words + h * d;
  }
  const uint16_t* value(int64_t h, int64_t j) const { return key(h, j) + bs * row_words; }
};

// Keys [first, lk) of key block kb, kv head h, packed (the others zero, unread).
template <typename Src>
void pack_head(const Src& src, int64_t h, int64_t first, int64_t lk, int64_t d, int64_t kb,
               uint32_t* kp, uint32_t* vp) {
  const int64_t np = d / 2, k0 = kb * BK;
  uint32_t* kdst = kp + kb * np * BK;
  for (int64_t j = 0; j < BK; ++j) {
    const int64_t key = k0 + j;
    const uint16_t* row = key >= first && key < lk ? src.key(h, key) : nullptr;
    for (int64_t p = 0; p < np; ++p) kdst[p * BK + j] = row ? load_pair(row + 2 * p) : 0u;
  }
  uint32_t* vdst = vp + kb * (BK / 2) * d;
  for (int64_t i = 0; i < BK / 2; ++i) {
    const int64_t a = k0 + 2 * i, b = a + 1;
    const uint16_t* ra = a >= first && a < lk ? src.value(h, a) : nullptr;
    const uint16_t* rb = b >= first && b < lk ? src.value(h, b) : nullptr;
    for (int64_t c = 0; c < d; ++c) {
      const uint32_t lo = ra ? ra[c] : 0u;
      const uint32_t hi = rb ? rb[c] : 0u;
      vdst[i * d + c] = lo | (hi << 16);
    }
  }
}

template <int D, int R, typename Src>
void run(const Problem& pb, const Src& src, int nthreads) {
  const int64_t nkb = (pb.lk + BK - 1) / BK;
  const int64_t head_words = nkb * BK * (D / 2);  // K and V alike
  std::vector<uint32_t> kp(pb.hk * head_words), vp(pb.hk * head_words);
  const int64_t first = pb.first_key(), kb0 = first / BK;  // blocks before kb0: not packed
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t task = 0; task < pb.hk * (nkb - kb0); ++task) {
    const int64_t h = task / (nkb - kb0), kb = kb0 + task % (nkb - kb0);
    pack_head(src, h, first, pb.lk, D, kb, kp.data() + h * head_words,
              vp.data() + h * head_words);
  }
  const int64_t g = pb.hq / pb.hk;
  const int64_t tokens_per_task = std::max<int64_t>(1, ROWS_BLOCK / g);
  const int64_t nqb = (pb.lq + tokens_per_task - 1) / tokens_per_task;
  const int64_t max_rows = tokens_per_task * g;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> obuf(max_rows * D), m(max_rows), l(max_rows);
    std::vector<float> pbuf(R * BK);
    // Causal tasks late in the sequence cost the most: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < pb.hk * nqb; ++task) {
      const int64_t qb = nqb - 1 - task / pb.hk, h = task % pb.hk;
      const int64_t t0 = qb * tokens_per_task, t1 = std::min(pb.lq, t0 + tokens_per_task);
      attend_block<D, R>(pb, h, t0, t1, kp.data() + h * head_words, vp.data() + h * head_words,
                         obuf.data(), pbuf.data(), m.data(), l.data());
    }
  }
}


// v[j]'s lanes summed, into lane j: four rounds of pairwise shuffles and adds.
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)  // chunks 0-1: v[2k]'s partial sums, chunks 2-3: v[2k+1]'s
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // chunk c: four partial sums of v[4k + c]
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // chunk c: two of v[8k + c], two of v[8k + 4 + c]
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  // lane 4c + i holds the sum of v[4i + c]
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                 _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// Decode: one query token per sequence over KV pages read in place (no gather).
// kv_layer is [num_blocks, 2, bs, hk, D]: K of (block, slot, head) at
// ((block * 2) * bs + slot) * hk * D + head * D, its V bs * hk * D further.
// Sequences of a cascade group share their first `shared` keys (the same pages): a task
// takes up to kCascadeRows query rows (members x the g heads of one kv head) over those keys
// together, then each member's own keys, and merges the two softmax states in fp32.
constexpr int64_t kCascadeRows = 32;
constexpr int64_t kPrefetchKeys = 32;  // how far ahead the K rows are fetched

template <int D>
struct DecodeScratch {
  std::vector<float> scores;          // [4 rows][len]: scores, then probabilities
  std::vector<uint16_t> probs;        // 4 rows' probabilities in bf16, zero-padded
  std::vector<const uint16_t*> keys;  // K row of every key (V is bs rows further)
  std::vector<float> acc, mx, sum;    // a task's shared-prefix states, [rows][D], [rows]
};

// Unnormalised softmax state of up to 4 query rows over `len` keys: acc[i][D] = sum_j
// 2^(s_ij - mx_i) v_j (P in bf16, as everywhere here), sum_i = sum_j 2^(s_ij - mx_i).
// len == 0 gives mx = -inf, sum = 0, acc = 0.
template <int D>
void attend_tile(const uint16_t* const* qrow, int nr, const uint16_t* const* krows, int64_t len,
                 int64_t v_offset, float scale2, DecodeScratch<D>& scratch, float (*acc)[D],
                 float* mx, float* sum) {
  constexpr int NK = D / 32;  // bf16 vectors per K/V row
  std::vector<float>& sbuf = scratch.scores;
  sbuf.resize(static_cast<size_t>(4 * len));
  const int64_t padded = (len + 16) & ~int64_t(15);  // room for an odd length's zero partner
  std::vector<uint16_t>& pb = scratch.probs;
  pb.resize(static_cast<size_t>(4 * padded));
  __m512bh qv[4][NK];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < NK; ++c)
      qv[i][c] = (__m512bh)_mm512_loadu_si512(qrow[i < nr ? i : 0] + c * 32);
  for (int i = 0; i < nr; ++i) mx[i] = -INFINITY;
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - j0));
    const uint16_t* const* krow = krows + j0;
    // Pages are scattered, so the hardware prefetcher stops at each one: ask for the K rows
    // kPrefetchKeys ahead (into L1) and this chunk's V rows (into L2, for the P V pass).
    for (int jj = 0; jj < 16 && j0 + kPrefetchKeys + jj < len; ++jj)
      for (int c = 0; c < D; c += 32)
        _mm_prefetch(reinterpret_cast<const char*>(krow[kPrefetchKeys + jj] + c), _MM_HINT_T0);
    for (int jj = 0; jj < n; ++jj)
      for (int c = 0; c < D; c += 32)
        _mm_prefetch(reinterpret_cast<const char*>(krow[jj] + v_offset + c), _MM_HINT_T1);
    for (int i = 0; i < nr; ++i) {
      __m512 a[16];
      for (int jj = 0; jj < 16; ++jj) {
        a[jj] = _mm512_setzero_ps();
        if (jj < n)
          for (int c = 0; c < NK; ++c)
            a[jj] = _mm512_dpbf16_ps(a[jj], qv[i][c],
                                     (__m512bh)_mm512_loadu_si512(krow[jj] + c * 32));
      }
      const __mmask16 mk = prefix_mask(n);
      const __m512 sc = _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale2));
      _mm512_mask_storeu_ps(&sbuf[i * len + j0], mk, sc);
      mx[i] = std::max(mx[i], _mm512_mask_reduce_max_ps(mk, sc));
    }
  }
  // Probabilities (unnormalised) in bf16, pairs of consecutive keys side by side.
  for (int i = 0; i < nr; ++i) {
    const float* srow = &sbuf[i * len];
    uint16_t* prow = &pb[i * padded];
    const __m512 mv = _mm512_set1_ps(mx[i]);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 mk = prefix_mask(len - j);
      const __m512 e =
          _mm512_maskz_mov_ps(mk, exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, srow + j), mv)));
      s = _mm512_add_ps(s, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    sum[i] = _mm512_reduce_add_ps(s);
  }
  // O = P V over key pairs: V rows j and j+1 interleaved per 16-bit element, so that one
  // VDPBF16PS per 16 output dims takes both keys. Within 128-bit lanes, unpacklo holds
  // dims 8L+0..3 and unpackhi dims 8L+4..7 of each 32-dim chunk.
  __m512 olo[4][NK], ohi[4][NK];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < NK; ++c) olo[i][c] = ohi[i][c] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < len; j += 2) {
    const uint16_t* v0 = krows[j] + v_offset;
    const uint16_t* v1 = j + 1 < len ? krows[j + 1] + v_offset : nullptr;
    __m512bh lo[NK], hi[NK];
    for (int c = 0; c < NK; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + c * 32);
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + c * 32) : zero;
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int i = 0; i < nr; ++i) {
      uint32_t w;
      std::memcpy(&w, &pb[i * padded + j], sizeof(w));
      const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int c = 0; c < NK; ++c) {
        olo[i][c] = _mm512_dpbf16_ps(olo[i][c], pw, lo[c]);
        ohi[i][c] = _mm512_dpbf16_ps(ohi[i][c], pw, hi[c]);
      }
    }
  }
  for (int i = 0; i < nr; ++i) {
    alignas(64) float acc_lo[NK][16], acc_hi[NK][16];
    for (int c = 0; c < NK; ++c) {
      _mm512_store_ps(acc_lo[c], olo[i][c]);
      _mm512_store_ps(acc_hi[c], ohi[i][c]);
    }
    for (int c = 0; c < NK; ++c)
      for (int lane = 0; lane < 4; ++lane)
        for (int e = 0; e < 4; ++e) {
          acc[i][32 * c + 8 * lane + e] = acc_lo[c][4 * lane + e];
          acc[i][32 * c + 8 * lane + 4 + e] = acc_hi[c][4 * lane + e];
        }
  }
}

// out = acc / sum in bf16 and lse = mx + log2(sum); with a second state (b_*), the two are
// merged first (b_acc == nullptr: none).
template <int D>
void finish_row(const float* acc, float mx, float sum, const float* b_acc, float b_mx,
                float b_sum, uint16_t* out, float* lse) {
  alignas(64) float row[D];
  if (b_acc != nullptr) {
    const float m = std::max(mx, b_mx);
    const float wa = sum > 0.0f ? std::exp2(mx - m) : 0.0f;
    const float wb = b_sum > 0.0f ? std::exp2(b_mx - m) : 0.0f;
    for (int c = 0; c < D; ++c) row[c] = acc[c] * wa + b_acc[c] * wb;
    sum = sum * wa + b_sum * wb;
    mx = m;
  } else {
    std::memcpy(row, acc, sizeof(row));
  }
  const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);
  for (int c = 0; c < D / 16; ++c)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(row + c * 16), inv)));
  *lse = sum > 0.0f ? mx + std::log2(sum) : -INFINITY;
}

struct DecodeBatch {
  const uint16_t* q;
  int64_t q_tok, q_head;
  const uint16_t* kv;
  int64_t bs, hk, g;
  const int32_t* tables;
  int64_t table_stride;
  const int64_t* lens;
  uint16_t* out;
  float* lse;
  float scale2;
  int64_t d;  // head dim
  int64_t window;  // 0: none; else each decode sees its last `window` keys (no groups)
};

// K rows of keys [from, to) of sequence s, kv head h, into keys.
inline void key_rows(const DecodeBatch& db, int64_t s, int64_t h, int64_t from, int64_t to,
                     std::vector<const uint16_t*>& keys) {
  const int64_t row_words = db.hk * db.d;
  const int32_t* table = db.tables + s * db.table_stride;
  keys.resize(static_cast<size_t>(to - from));
  for (int64_t j = from; j < to; ++j)
    keys[j - from] =
        db.kv + (static_cast<int64_t>(table[j / db.bs]) * 2 * db.bs + j % db.bs) * row_words +
        h * db.d;
}

// Members [s0, s1) of one group (sharing their first `shared` keys), kv head h.
template <int D>
void decode_chunk(const DecodeBatch& db, int64_t s0, int64_t s1, int64_t shared, int64_t h,
                  DecodeScratch<D>& scratch) {
  const int64_t g = db.g, v_offset = db.bs * db.hk * D;
  const int64_t rows = (s1 - s0) * g;
  auto q_of = [&](int64_t s, int64_t head) { return db.q + s * db.q_tok + head * db.q_head; };
  float (*sacc)[D] = nullptr;
  if (shared > 0) {
    scratch.acc.resize(static_cast<size_t>(rows * D));
    scratch.mx.resize(static_cast<size_t>(rows));
    scratch.sum.resize(static_cast<size_t>(rows));
    sacc = reinterpret_cast<float (*)[D]>(scratch.acc.data());
    key_rows(db, s0, h, 0, shared, scratch.keys);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, rows - r0));
      const uint16_t* qrow[4];
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        qrow[i] = q_of(s0 + r / g, h * g + r % g);
      }
      attend_tile<D>(qrow, nr, scratch.keys.data(), shared, v_offset, db.scale2, scratch,
                     sacc + r0, &scratch.mx[r0], &scratch.sum[r0]);
    }
  }
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t from = db.window > 0 ? std::max(shared, db.lens[s] - db.window) : shared;
    key_rows(db, s, h, from, db.lens[s], scratch.keys);
    const int64_t own = db.lens[s] - from;
    for (int64_t r0 = 0; r0 < g; r0 += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, g - r0));
      const uint16_t* qrow[4];
      for (int i = 0; i < nr; ++i) qrow[i] = q_of(s, h * g + r0 + i);
      alignas(64) float acc[4][D];
      float mx[4], sum[4];
      attend_tile<D>(qrow, nr, scratch.keys.data(), own, v_offset, db.scale2, scratch, acc, mx,
                     sum);
      for (int i = 0; i < nr; ++i) {
        const int64_t head = h * g + r0 + i;
        const int64_t r = (s - s0) * g + r0 + i;  // its row in the shared-prefix states
        finish_row<D>(acc[i], mx[i], sum[i], sacc ? sacc[r] : nullptr,
                      sacc ? scratch.mx[r] : 0.0f, sacc ? scratch.sum[r] : 0.0f,
                      db.out + (s * g * db.hk + head) * D, db.lse + s * g * db.hk + head);
      }
    }
  }
}

// groups: [n_groups][3] (first seq, end seq, shared keys), ascending and disjoint; every
// sequence outside them is a task of its own.
template <int D>
void decode_run(const DecodeBatch& db, int64_t b, const int64_t* groups, int64_t n_groups,
                int nthreads) {
  struct Chunk {
    int64_t s0, s1, shared;
  };
  std::vector<Chunk> chunks;
  const int64_t per_chunk = std::max<int64_t>(1, kCascadeRows / db.g);
  int64_t s = 0;
  for (int64_t gi = 0; gi <= n_groups; ++gi) {
    const int64_t begin = gi < n_groups ? groups[3 * gi] : b;
    for (; s < begin; ++s) chunks.push_back({s, s + 1, 0});
    if (gi == n_groups) break;
    const int64_t end = groups[3 * gi + 1], shared = groups[3 * gi + 2];
    for (int64_t c = begin; c < end; c += per_chunk)
      chunks.push_back({c, std::min(end, c + per_chunk), shared});
    s = end;
  }
  const int64_t ntasks = static_cast<int64_t>(chunks.size()) * db.hk;
#pragma omp parallel num_threads(nthreads)
  {
    DecodeScratch<D> scratch;
    // A chunk's kv heads in turn: the second head reads the pages the first one just
    // brought into cache (heads are interleaved within each slot).
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < ntasks; ++task) {
      const Chunk& c = chunks[task / db.hk];
      decode_chunk<D>(db, c.s0, c.s1, c.shared, task % db.hk, scratch);
    }
  }
}

}  // namespace

extern "C" {

// Two partial attention states over disjoint keys merged: per row (token x head) of d
// values, o = (o_a w_a + o_b w_b) / (w_a + w_b) with w = 2^(lse - max), lse = max + log2(sum).
// The same operations in the same order as torch_backend.merge_states in fp32 (no fused
// multiply-add), so the two differ only where exp2/log2 do, in the last bit.
void pc_merge_states_bf16(const uint16_t* oa, const float* la, const uint16_t* ob,
                          const float* lb, uint16_t* out, float* lse, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float m = std::max(la[r], lb[r]);
    if (std::isinf(m)) m = 0.0f;
    const float wa = std::exp2(la[r] - m), wb = std::exp2(lb[r] - m);
    const float total = wa + wb;
    const __m512 va = _mm512_set1_ps(wa), vb = _mm512_set1_ps(wb);
    const __m512 den = _mm512_set1_ps(total > 0.0f ? total : 1.0f);
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 mk = prefix_mask(d - c);
      const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, oa + r * d + c)), 16));
      const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, ob + r * d + c)), 16));
      const __m512 o = _mm512_div_ps(_mm512_add_ps(_mm512_mul_ps(a, va), _mm512_mul_ps(b, vb)), den);
      _mm256_mask_storeu_epi16(out + r * d + c, mk, (__m256i)_mm512_cvtneps_pbh(o));
    }
    lse[r] = m + std::log2(total);
  }
}

// q [lq, hq, d], k/v [lk, hk, d] with the given element strides (d contiguous);
// out [lq, hq, d] and lse [lq, hq] contiguous. Returns 0, or -1 for an unsupported d.
int pc_attention_bf16(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* k,
                      int64_t k_tok, int64_t k_head, const uint16_t* v, int64_t v_tok,
                      int64_t v_head, uint16_t* out, float* lse, int64_t lq, int64_t lk,
                      int64_t hq, int64_t hk, int64_t d, float scale, int causal, int nthreads) {
  const Problem pb{q,  q_tok, q_head, out, lse, lq, lk, hq, hk, scale * 1.44269504089f,
                   causal != 0, 0};
  const DenseKV src{k, v, k_tok, k_head, v_tok, v_head};
  return with_head_dim(d, [&](auto dim) { run<dim(), kTileRows<dim()>>(pb, src, nthreads); });
}

// The same over lk keys held in KV pages: kv_layer [num_blocks, 2, bs, hk, d], table int32
// [ceil(lk / bs)] block ids. Read in place, no gather. window > 0 (with causal only): the
// sliding window, in keys (the pages before the first query's window are not read).
int pc_paged_attention_bf16(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* kv,
                            int64_t bs, const int32_t* table, uint16_t* out, float* lse,
                            int64_t lq, int64_t lk, int64_t hq, int64_t hk, int64_t d,
                            float scale, int causal, int64_t window, int nthreads) {
  if (window > 0 && causal == 0) return -2;
  const Problem pb{q,  q_tok, q_head, out, lse, lq, lk, hq, hk, scale * 1.44269504089f,
                   causal != 0, window};
  const PagedKV src{kv, table, bs, hk * d, d};
  return with_head_dim(d, [&](auto dim) { run<dim(), kTileRows<dim()>>(pb, src, nthreads); });
}

// q [b, hq, d] (d contiguous); kv_layer as above; tables int32 [b, table_stride]; lens int64
// [b] (each >= 1); groups int64 [n_groups][3] (first seq, end seq, shared keys: cascade
// groups, see decode_run); out [b, hq, d] and lse [b, hq] contiguous; window: 0, or the
// sliding window in keys (each decode reads its last `window` keys only; no groups then).
int pc_paged_decode_bf16(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* kv,
                         int64_t bs, const int32_t* tables, int64_t table_stride,
                         const int64_t* lens, const int64_t* groups, int64_t n_groups,
                         uint16_t* out, float* lse, int64_t b, int64_t hq, int64_t hk, int64_t d,
                         float scale, int64_t window, int nthreads) {
  if (window > 0 && n_groups > 0) return -2;
  const DecodeBatch db{q,   q_tok, q_head, kv,  bs, hk, hq / hk, tables, table_stride,
                       lens, out,  lse,    scale * 1.44269504089f, d, window};
  return with_head_dim(d, [&](auto dim) { decode_run<dim()>(db, b, groups, n_groups, nthreads); });
}

}  // extern "C"
