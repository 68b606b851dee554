// The decoder layer's elementwise work in one pass each (built by cpu_layer_ops.py): residual
// add + RMSNorm (Llama's, and Gemma's 1 + w form with its post-norms), rotary embedding in
// place on q and k (with per-head q/k norms), SiLU(gate) * up and GELU-tanh(gate) * up. bf16
// on AVX-512 (the native build); fp32, all but the two activations, on both builds (the AVX2
// one through SIMDe).
//
// Every result is rounded where torch's unfused ops round it (each op computes in fp32 and
// rounds its output to the tensor's dtype: bf16 nearest-even, or fp32, where the rounding
// point is a barrier against FMA contraction), and RMSNorm's sum of squares runs in torch's
// order, so the outputs are torch's bit for bit. The one fp32 step done differently is the
// exp inside SiLU (within an fp32 ulp of torch's); a gate is bf16, so the test checks every
// one of its 65,536 values, and fp32 SiLU stays torch's. Rows are independent and a row's
// arithmetic never depends on the row or thread count: a row's result is the same alone or
// in any batch.
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>

namespace {

// Work below this many elements runs on the calling thread (a parallel region's fork and
// barrier cost more than such a loop); torch's grain size for its elementwise ops, too. At
// 2 threads, SiLU-and-mul over 32 x 1408 (45K) runs in 20 us on two vs 34 us on one.
constexpr int64_t kParallelMinElements = 1 << 15;

inline __m512 load_bf16(const uint16_t* p) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 load_bf16_masked(const uint16_t* p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// fp32 -> bf16 bits, nearest-even, NaN -> 0x7fc0 (as c10::BFloat16 rounds; denormals kept).
inline __m512i round_bits(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

// x rounded to bf16 and back to fp32.
inline __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(round_bits(x), 16));
}

inline void store_bf16(uint16_t* p, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bits(x)));
}

inline void store_bf16_masked(uint16_t* p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(round_bits(x)));
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// How a tensor's elements load, round and store: bf16 bits, or fp32.
struct Bf16 {
    using T = uint16_t;
    static __m512 load(const T* p) { return load_bf16(p); }
    static __m512 load(const T* p, __mmask16 m) { return load_bf16_masked(p, m); }
    static void store(T* p, __m512 x) { store_bf16(p, x); }
    static void store(T* p, __m512 x, __mmask16 m) { store_bf16_masked(p, x, m); }
    static __m512 round(__m512 x) { return round_bf16(x); }
    static float scalar(T v) {
        uint32_t bits = static_cast<uint32_t>(v) << 16;
        float a;
        __builtin_memcpy(&a, &bits, 4);
        return a;
    }
    static __m256 load8(const T* p) {
        __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
};

struct F32 {
    using T = float;
    static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
    static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
    static void store(T* p, __m512 x) { _mm512_storeu_ps(p, x); }
    static void store(T* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
    // Already fp32: rounding is a no-op, but torch rounds each op's result, so the compiler
    // must not fuse across it (the AVX2 build compiles with -ffp-contract=off instead).
    static __m512 round(__m512 x) {
#ifndef PC_NARROW_VECTORS
        asm("" : "+v"(x));
#endif
        return x;
    }
    static float scalar(T v) { return v; }
    static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
};

// e^x in fp32: x = n ln2 + r (ln2 split in two), a polynomial for e^r, scaled by 2^n.
// Inf above ~88.72, 0 below ~-103.9, NaN stays NaN.
inline __m512 exp_ps(__m512 x) {
    // Clamped first (NaN kept: max/min return their second operand when it is NaN), so that
    // large x overflows to inf in the final scaling and very negative x underflows to 0.
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693145751953125f);
    const __m512 ln2_lo = _mm512_set1_ps(1.42860682030941723212e-6f);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(r, r), p, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);  // p * 2^n, one rounding
}

// Torch's order for summing a contiguous fp32 row (its CPU cascade sum, which runs on 8-lane
// vectors here), so that RMSNorm's mean of squares is torch's bit for bit: the vectors taken
// four at a time into four accumulators, folded up a ladder of four levels every 2^p steps;
// the last odd vectors into the first accumulator; the four added in order; then the scalar
// tail summed and the 8 lanes added to it one by one (a row shorter than a vector: four
// scalar accumulators, k % 4, the rest into the first). ``sq(v)`` yields the v-th vector of
// squares, ``sq_tail(k)`` the k-th square past them.
template <class Vec, class Tail>
inline float torch_order_sum(int64_t cols, Vec sq, Tail sq_tail) {
    if (cols < 8) {  // shorter than a vector: torch's scalar row sum, four accumulators
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t full = cols / 4 * 4;
        for (int64_t k = 0; k < full; ++k) part[k % 4] += sq_tail(k);
        for (int64_t k = full; k < cols; ++k) part[0] += sq_tail(k);
        return ((part[0] + part[1]) + part[2]) + part[3];
    }
    const int64_t num_vec = cols / 8;
    const int64_t groups = num_vec / 4;
    __m256 acc[4][4];  // [level][accumulator]
    for (auto& level : acc)
        for (auto& a : level) a = _mm256_setzero_ps();
    const int64_t ceil_log2 = groups <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(groups - 1));
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4;
    const int64_t step = int64_t{1} << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= groups) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(i * 4 + k));
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < groups; ++i)
        for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(i * 4 + k));
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    __m256 total = acc[0][0];
    for (int64_t v = groups * 4; v < num_vec; ++v) total = _mm256_add_ps(total, sq(v));
    for (int k = 1; k < 4; ++k) total = _mm256_add_ps(total, acc[0][k]);
    float result = 0.0f;
    for (int64_t k = num_vec * 8; k < cols; ++k) result += sq_tail(k);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total);
    for (float lane : lanes) result += lane;
    return result;
}

// 1 / sqrt(mean(src^2) + eps) over a row, the mean in torch's order.
template <class E>
inline float inv_rms(const typename E::T* src, int64_t cols, float eps) {
    // Each square rounded before it is added, as torch's pow(2) then sum rounds it: without
    // the barriers the native build (-ffp-contract=fast) fuses the two into an FMA.
    auto sq = [src](int64_t v) {
        __m256 a = E::load8(src + v * 8);
        a = _mm256_mul_ps(a, a);
        asm("" : "+x"(a));
        return a;
    };
    auto sq_tail = [src](int64_t k) {
        float a = E::scalar(src[k]);
        a *= a;
        asm("" : "+x"(a));
        return a;
    };
    float mean = torch_order_sum(cols, sq, sq_tail) / static_cast<float>(cols);
    return 1.0f / std::sqrt(mean + eps);
}

inline __mmask16 chunk_mask(int64_t cols, int64_t j) {
    return cols - j >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(cols - j);
}

// One row: (optionally residual = rnd(x + residual)), then
// out = rnd(w * rnd(r * rsqrt(mean(r^2) + eps))) over r = the (new) residual, or x.
template <class E, class T = typename E::T>
inline void rms_norm_row(const T* x, T* residual, const T* w, T* out, int64_t cols, float eps) {
    const T* src = residual != nullptr ? residual : x;
    if (residual != nullptr) {
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16)
            E::store(residual + j, E::round(_mm512_add_ps(E::load(x + j), E::load(residual + j))));
        if (j < cols) {
            __mmask16 m = tail_mask(cols - j);
            __m512 a = _mm512_add_ps(E::load(x + j, m), E::load(residual + j, m));
            E::store(residual + j, E::round(a), m);
        }
    }
    const __m512 scale = _mm512_set1_ps(inv_rms<E>(src, cols, eps));
    for (int64_t j = 0; j < cols; j += 16) {
        __mmask16 m = chunk_mask(cols, j);
        __m512 a = E::round(_mm512_mul_ps(E::load(src + j, m), scale));
        E::store(out + j, _mm512_mul_ps(E::load(w + j, m), a), m);
    }
}

// Gemma's RMSNorm of one row: out = rnd((x * rsqrt(mean(x^2) + eps)) * scale) in fp32,
// scale = 1 + w (fp32), rounded once at the end as transformers' Gemma3RMSNorm does.
template <class E, class T = typename E::T>
inline void gemma_norm_row(const T* x, const float* scale, T* out, int64_t cols, float eps) {
    const __m512 r = _mm512_set1_ps(inv_rms<E>(x, cols, eps));
    for (int64_t j = 0; j < cols; j += 16) {
        __mmask16 m = chunk_mask(cols, j);
        __m512 a = F32::round(_mm512_mul_ps(E::load(x + j, m), r));
        E::store(out + j, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, scale + j)), m);
    }
}

// Gemma's post-norm residual and the next pre-norm in one pass over a row:
// residual = rnd(residual + gemma_norm(h, post)), then out = gemma_norm(residual, pre).
template <class E, class T = typename E::T>
inline void gemma_add_norms_row(const T* h, T* residual, const float* post, const float* pre,
                                T* out, int64_t cols, float eps) {
    const __m512 r = _mm512_set1_ps(inv_rms<E>(h, cols, eps));
    for (int64_t j = 0; j < cols; j += 16) {
        __mmask16 m = chunk_mask(cols, j);
        __m512 a = F32::round(_mm512_mul_ps(E::load(h + j, m), r));
        __m512 n = E::round(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, post + j)));
        E::store(residual + j, _mm512_add_ps(E::load(residual + j, m), n), m);
    }
    gemma_norm_row<E>(residual, pre, out, cols, eps);
}

// out[i, j] = rotated halves of x (in place), torch's rounding:
//   x1' = rnd(rnd(x1 c) - rnd(x2 s)),  x2' = rnd(rnd(x2 c) + rnd(x1 s)).
template <class E, class T = typename E::T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
    for (int64_t j = 0; j < half; j += 16) {
        __mmask16 m = half - j >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(half - j);
        __m512 x1 = E::load(x + j, m), x2 = E::load(x + half + j, m);
        __m512 cv = E::load(c + j, m), sv = E::load(s + j, m);
        __m512 a = _mm512_sub_ps(E::round(_mm512_mul_ps(x1, cv)), E::round(_mm512_mul_ps(x2, sv)));
        __m512 b = _mm512_add_ps(E::round(_mm512_mul_ps(x2, cv)), E::round(_mm512_mul_ps(x1, sv)));
        E::store(x + j, a, m);
        E::store(x + half + j, b, m);
    }
}

// out = bf16(bf16(g / (1 + e^-g)) * u)
inline __m512 silu_mul(__m512 g, __m512 u) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return _mm512_mul_ps(silu, u);
}

// row(i) for i in [0, rows): on the calling thread below kParallelMinElements elements, else
// split statically across num_threads (a row's arithmetic is the same either way).
template <class Row>
inline void for_each_row(int64_t rows, int64_t elements, int num_threads, const Row& row) {
    if (elements < kParallelMinElements || num_threads <= 1) {
        for (int64_t i = 0; i < rows; ++i) row(i);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < rows; ++i) row(i);
}

// x, out: [rows, cols] with row strides (elements); residual (nullptr: plain RMSNorm)
// [rows, cols], updated in place to rnd(x + residual) and normalised. out may be x.
template <class E, class T = typename E::T>
int rms_norm(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight,
             T* out, int64_t out_stride, int64_t rows, int64_t cols, float eps, int num_threads) {
    if (cols <= 0) return 1;
    auto row = [&](int64_t i) {
        rms_norm_row<E>(x + i * x_stride, residual != nullptr ? residual + i * res_stride : nullptr,
                        weight, out + i * out_stride, cols, eps);
    };
    for_each_row(rows, rows * cols, num_threads, row);
    return 0;
}

// Gemma's norms, [rows, cols] contiguous, scales fp32 [cols] (1 + w). residual nullptr:
// out = gemma_norm(h, pre). Otherwise residual = rnd(residual + gemma_norm(h, post)) in place,
// then out = gemma_norm(residual, pre).
template <class E, class T = typename E::T>
int gemma_norms(const T* h, T* residual, const float* post, const float* pre, T* out,
                int64_t rows, int64_t cols, float eps, int num_threads) {
    if (cols <= 0) return 1;
    auto row = [&](int64_t i) {
        const int64_t o = i * cols;
        if (residual == nullptr)
            gemma_norm_row<E>(h + o, pre, out + o, cols, eps);
        else
            gemma_add_norms_row<E>(h + o, residual + o, post, pre, out + o, cols, eps);
    };
    for_each_row(rows, rows * cols, num_threads, row);
    return 0;
}

// q [tokens, hq, d] and k [tokens, hk, d] (strides in elements, the last axis contiguous)
// rotated in place; cos, sin [tokens, d/2] with row stride cs_stride, in the dtype of q.
// q_norm / k_norm (per-head RMSNorm weights [d], or nullptr): each head normalised first, in
// place, as torch's RMSNorm over the head would (its own rounding and sum order). gemma_norms
// 0: Qwen3's, weights in q's dtype; 1: Gemma's, fp32 scales 1 + w (gemma_norm_row).
template <class E, class T = typename E::T>
int rotary(T* q, int64_t q_stride_t, int64_t q_stride_h, int64_t hq, T* k, int64_t k_stride_t,
           int64_t k_stride_h, int64_t hk, const T* cos, const T* sin, int64_t cs_stride,
           int64_t tokens, int64_t head_dim, const void* q_norm, const void* k_norm, float q_eps,
           float k_eps, int gemma, int num_threads) {
    if (head_dim <= 0 || head_dim % 2 != 0) return 1;
    const int64_t half = head_dim / 2;
    auto norm = [&](T* head, const void* w, float eps) {
        if (w == nullptr) return;
        if (gemma != 0)
            gemma_norm_row<E>(head, static_cast<const float*>(w), head, head_dim, eps);
        else
            rms_norm_row<E>(head, static_cast<T*>(nullptr), static_cast<const T*>(w), head, head_dim, eps);
    };
    auto token = [&](int64_t t) {
        const T* c = cos + t * cs_stride;
        const T* s = sin + t * cs_stride;
        for (int64_t h = 0; h < hq; ++h) {
            T* head = q + t * q_stride_t + h * q_stride_h;
            norm(head, q_norm, q_eps);
            rotate_head<E>(head, c, s, half);
        }
        for (int64_t h = 0; h < hk; ++h) {
            T* head = k + t * k_stride_t + h * k_stride_h;
            norm(head, k_norm, k_eps);
            rotate_head<E>(head, c, s, half);
        }
    };
    for_each_row(tokens, tokens * (hq + hk) * head_dim, num_threads, token);
    return 0;
}

}  // namespace

extern "C" {

#define PC_LAYER_OPS(SUFFIX, E)                                                                   \
    int pc_rms_norm_##SUFFIX(const E::T* x, int64_t x_stride, E::T* residual, int64_t res_stride, \
                             const E::T* weight, E::T* out, int64_t out_stride, int64_t rows,     \
                             int64_t cols, float eps, int num_threads) {                          \
        return rms_norm<E>(x, x_stride, residual, res_stride, weight, out, out_stride, rows, cols, \
                           eps, num_threads);                                                     \
    }                                                                                             \
    int pc_gemma_norms_##SUFFIX(const E::T* h, E::T* residual, const float* post,                 \
                                const float* pre, E::T* out, int64_t rows, int64_t cols,          \
                                float eps, int num_threads) {                                     \
        return gemma_norms<E>(h, residual, post, pre, out, rows, cols, eps, num_threads);         \
    }                                                                                             \
    int pc_rotary_##SUFFIX(E::T* q, int64_t q_stride_t, int64_t q_stride_h, int64_t hq, E::T* k,  \
                           int64_t k_stride_t, int64_t k_stride_h, int64_t hk, const E::T* cos,   \
                           const E::T* sin, int64_t cs_stride, int64_t tokens, int64_t head_dim, \
                           const void* q_norm, const void* k_norm, float q_eps, float k_eps,      \
                           int gemma, int num_threads) {                                          \
        return rotary<E>(q, q_stride_t, q_stride_h, hq, k, k_stride_t, k_stride_h, hk, cos, sin,  \
                         cs_stride, tokens, head_dim, q_norm, k_norm, q_eps, k_eps, gemma,        \
                         num_threads);                                                            \
    }

PC_LAYER_OPS(f32, F32)

#ifndef PC_NARROW_VECTORS  // bf16 there would be emulated: torch's ops are faster
PC_LAYER_OPS(bf16, Bf16)

// gate_up [rows, 2 * inter] bf16 (row stride in elements: gate then up) -> out [rows, inter].
int pc_silu_and_mul_bf16(const uint16_t* gate_up, int64_t stride, uint16_t* out,
                         int64_t out_stride, int64_t rows, int64_t inter, int num_threads) {
    auto row = [&](int64_t i) {
        const uint16_t* g = gate_up + i * stride;
        const uint16_t* u = g + inter;
        uint16_t* o = out + i * out_stride;
        int64_t j = 0;
        for (; j + 16 <= inter; j += 16) store_bf16(o + j, silu_mul(load_bf16(g + j), load_bf16(u + j)));
        if (j < inter) {
            __mmask16 m = tail_mask(inter - j);
            store_bf16_masked(o + j, silu_mul(load_bf16_masked(g + j, m), load_bf16_masked(u + j, m)), m);
        }
    };
    for_each_row(rows, rows * inter, num_threads, row);
    return 0;
}

// out = bf16(gelu_tanh(g) * u) with gelu_tanh(g) looked up: table[bits of g] is torch's own
// bf16 GELU of that value (cpu_layer_ops.py tabulates all 65,536 once), so it is torch's to
// the bit whatever the math library; table holds one more element (a gather reads 32 bits).
inline __m512 gelu_mul(__m256i g_bits, __m512 u, const int* table) {
    __m512i idx = _mm512_cvtepu16_epi32(g_bits);
    __m512i looked = _mm512_i32gather_epi32(idx, table, 2);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(looked, 16)), u);
}

int pc_gelu_tanh_and_mul_bf16(const uint16_t* gate_up, int64_t stride, uint16_t* out,
                              int64_t out_stride, int64_t rows, int64_t inter, int num_threads,
                              const uint16_t* table) {
    const int* t = reinterpret_cast<const int*>(table);
    auto row = [&](int64_t i) {
        const uint16_t* g = gate_up + i * stride;
        const uint16_t* u = g + inter;
        uint16_t* o = out + i * out_stride;
        int64_t j = 0;
        for (; j + 16 <= inter; j += 16) {
            __m256i gb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
            store_bf16(o + j, gelu_mul(gb, load_bf16(u + j), t));
        }
        if (j < inter) {
            __mmask16 m = tail_mask(inter - j);
            __m256i gb = _mm256_maskz_loadu_epi16(m, g + j);
            store_bf16_masked(o + j, gelu_mul(gb, load_bf16_masked(u + j, m), t), m);
        }
    };
    for_each_row(rows, rows * inter, num_threads, row);
    return 0;
}

#endif  // PC_NARROW_VECTORS

}  // extern "C"
