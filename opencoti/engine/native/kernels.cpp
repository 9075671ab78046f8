// opencoti native CPU kernels: weight-only int4 / int8 projections, paged decode attention and the
// shared part of cascade (shared-prefix) attention.
//
// Plain C functions, no torch headers: ops.cpp includes this file and registers them as typed torch
// operators (torch.ops.opencoti.*), which check their tensors and call these; the tests also compile
// this file alone. Built on the machine that runs it (``-march=native``). Threads: OpenMP with the
// count passed by the caller (torch's thread count at the call); libgomp is the one torch already
// loaded (same soname), so both share one thread pool.
//
// Layouts
//   int4 ("q4"): per output row of K weights in nb = K/32 blocks: nb x 16 bytes of nibbles (byte j of
//                a block holds value j in its low nibble and value j + 16 in its high one, as GGUF
//                Q4_0/Q4_1 do), then nb fp16 scales d, then nb fp16 offsets m; W[n, k] = d * q + m.
//                (GGUF Q4_1's blocks hold the same numbers, interleaved per block.)
//   int8 ("q8"): int8 [N, K] and one fp32 scale per output row: W[n, k] = q * scale[n].
//   KV cache  : fp32, fp16 or bf16 [pages, page_size, Hkv, D] per layer (the caller says which), or q8:
//               int8 [pages, page_size, Hkv, D + 4], each vector's D values q then its fp32 scale s
//               (value = q * s; engine/kv/q8.py); page tables int64 [B, max_pages].
// Activations and outputs are fp32; accumulation is fp32 (weights are never rounded further).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#include <algorithm>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define OC_AVX2 1
#else
#define OC_AVX2 0
#endif

namespace {

constexpr int kQ4Block = 20;  // bytes per 32 weights
constexpr int kRows = 8;      // activation rows per register block (8 accumulators + 4 weight vectors)
// Below this |x| max a group of activations is all zeros to the int8 / int16 paths (32767 / max
// overflows fp32 under ~1e-34; the dropped products are under 1e-30 of a weight each).
constexpr float kTinyGroup = 1e-30f;

inline float half_to_float(uint16_t h) {
#if OC_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  // subnormal
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; --exp; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7F800000 | (mant << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
    float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

#if OC_AVX2
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// y[r, n] for R rows of x (stride K) against one int4 weight row; sx = per-block sums of x rows.
template <int R>
inline void q4_row(const float* x, int64_t K, const uint8_t* wrow, const float* sx, int64_t nb, float* out) {
#if OC_AVX2
    __m256 acc[R];
    float msum[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); msum[r] = 0.f; }
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const uint16_t* dp = (const uint16_t*)(wrow + nb * 16);
    const uint16_t* mp = dp + nb;
    for (int64_t b = 0; b < nb; ++b) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(dp[b]));
        const float m = _cvtsh_ss(mp[b]);
        const __m128i raw = _mm_loadu_si128((const __m128i*)(wrow + b * 16));
        const __m128i lo = _mm_and_si128(raw, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int r = 0; r < R; ++r) {
            const float* xb = x + r * K + b * 32;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), t);
            acc[r] = _mm256_fmadd_ps(d, t, acc[r]);
            msum[r] += m * sx[r * nb + b];
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + msum[r];
#else
    for (int r = 0; r < R; ++r) {
        float total = 0.f;
        uint16_t dh, mh;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* qs = wrow + b * 16;
            std::memcpy(&dh, wrow + nb * 16 + b * 2, 2);
            std::memcpy(&mh, wrow + nb * 18 + b * 2, 2);
            const float* xb = x + r * K + b * 32;
            float dot = 0.f;
            for (int j = 0; j < 16; ++j) dot += (qs[j] & 0x0F) * xb[j] + (qs[j] >> 4) * xb[j + 16];
            total += half_to_float(dh) * dot + half_to_float(mh) * sx[r * nb + b];
        }
        out[r] = total;
    }
#endif
}

#if OC_AVX2
// Per row of activations and block of an int4 weight row: dd = d * dx (the integer product's scale),
// and msum = sum over blocks of m * sum(x) (the offset term), 8 blocks at a time. dd is R x stride.
template <int R>
inline void q4_block_scales(const uint8_t* wrow, const float* dx, const float* sx, int64_t nb, float* dd,
                            int64_t stride, float* msum) {
    const uint16_t* dp = (const uint16_t*)(wrow + nb * 16);
    const uint16_t* mp = dp + nb;
    for (int r = 0; r < R; ++r) {
        float* ddr = dd + r * stride;
        __m256 ms = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8) {
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dp + b)));
            const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mp + b)));
            _mm256_store_ps(ddr + b, _mm256_mul_ps(d8, _mm256_loadu_ps(dx + r * nb + b)));
            ms = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + r * nb + b), ms);
        }
        float tail = 0.f;
        for (; b < nb; ++b) {
            ddr[b] = _cvtsh_ss(dp[b]) * dx[r * nb + b];
            tail += _cvtsh_ss(mp[b]) * sx[r * nb + b];
        }
        msum[r] = hsum(ms) + tail;
    }
}

// int32 lanes += a * b, pairwise over int16 lanes: one instruction on a CPU with VNNI (AVX512-VNNI or
// AVX-VNNI), else madd then add: the same integers either way (|x16| <= 32767, weights int8 or int4
// nibbles: no pair sum wraps), so a build with and one without VNNI give the same bits.
inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// step(i, chain) for i in [0, n), the chain alternating 0, 1, 0, ... (two FMA chains in flight; the
// chain is a constant at each call, so the accumulators it picks stay in registers).
template <typename F>
inline void two_chains(int64_t n, F&& step) {
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        step(i, 0);
        step(i + 1, 1);
    }
    if (i < n) step(i, 0);
}

// The same products with the activations as int16 per block of 32 (scale dx: |x| max / 32767, so
// each activation keeps 15 bits, more than the bf16 torch's int kernels use): the weights widen to
// int16 once per block and _mm256_madd_epi16 multiplies and pairs them, half the instructions of the
// fp32 path per weight at one or two rows.
template <int R>
inline void q4_row_i16(const int16_t* x16, const float* dx, int64_t K, const uint8_t* wrow, const float* sx,
                       int64_t nb, float* out) {
    constexpr int64_t kMaxBlocks = 512;  // K <= 16384 (callers check)
    alignas(32) float dd[R][kMaxBlocks];
    float msum[R];
    q4_block_scales<R>(wrow, dx, sx, nb, dd[0], kMaxBlocks, msum);
    // two blocks per iteration, each its own accumulator (two FMA chains in flight; the chain is
    // picked at compile time: an index computed at run time kept the accumulators in memory)
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    auto step = [&](int64_t b, int c) {
        // the block's 16 bytes widened once: each int16 holds a byte, its low nibble value j and its
        // high nibble (the byte >> 4, nothing above it) value j + 16
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wrow + b * 16)));
        const __m256i q0 = _mm256_and_si256(v, low4);
        const __m256i q1 = _mm256_srli_epi16(v, 4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int16_t* xb = x16 + r * K + b * 32;
            const __m256i p = dot_i16(_mm256_madd_epi16(q0, _mm256_loadu_si256((const __m256i*)xb)), q1,
                                      _mm256_loadu_si256((const __m256i*)(xb + 16)));
            acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + b), _mm256_cvtepi32_ps(p), acc[r][c]);
        }
    };
    two_chains(nb, step);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + msum[r];
}

// int8 weights x int16 activations quantized per group of S blocks of 32 (quantize_i16 with 32 * S
// values a scale): a group's products add up exactly in 8 int32 lanes (4 S products a lane, |lane| <=
// 4 S x 32767 x 128 < 2^31), and only then turn to fp32 (rounded above 2^24 when S = 2: the same
// rounding for every row and batch), scaled once: one conversion and one FMA per 32 * S weights and
// row instead of one per 32. Groups alternate between two accumulators (two FMA chains in flight); every
// R gives a row the same operations, so a row's result does not depend on the rows beside it.
template <int R, int S>
inline void q8_row_i16(const int16_t* x16, const float* dx, int64_t K, const int8_t* wrow, float scale, int64_t ng,
                       float* out) {
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    auto step = [&](int64_t g, int c) {
        const int8_t* wg = wrow + g * 32 * S;
        const int16_t* xg = x16 + g * 32 * S;
        __m256i p[R][2];  // even and odd 16-weight parts apart: two chains a row (VNNI's latency)
#pragma GCC unroll 8
        for (int i = 0; i < 2 * S; ++i) {  // 16 weights at a time, widened once for the R rows
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wg + i * 16)));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(xg + r * K + i * 16));
                p[r][i & 1] = i < 2 ? _mm256_madd_epi16(w, xv) : dot_i16(p[r][i & 1], w, xv);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(dx + r * ng + g),
                                        _mm256_cvtepi32_ps(_mm256_add_epi32(p[r][0], p[r][1])), acc[r][c]);
    };
    two_chains(ng, step);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) * scale;
}

// The same products with the activations as int8 per block of 32 (scale dx: |x| max / 127, as
// llama.cpp's Q8 activation blocks): one 32-byte load per row and block, and _mm256_maddubs_epi16
// multiplies the 4-bit weights (unsigned) by the int8 activations and pairs them (|pair| <= 2 x 15 x
// 127: no saturation), _mm256_madd_epi16 sums the pairs into 8 int32 lanes. The offset term m * sum(x)
// uses the exact fp32 block sums of x.
template <int R>
inline void q4_row_i8(const int8_t* x8, const float* dx, int64_t K, const uint8_t* wrow, const float* sx,
                      int64_t nb, float* out) {
    constexpr int64_t kMaxBlocks = 512;  // K <= 16384 (callers check)
    alignas(32) float dd[R][kMaxBlocks];
    float msum[R];
    q4_block_scales<R>(wrow, dx, sx, nb, dd[0], kMaxBlocks, msum);
    // two blocks per iteration; up to two rows, each block its own accumulator (two FMA chains in
    // flight); more rows are independent chains already (and 2 x R accumulators would spill)
    constexpr int C = R <= 2 ? 2 : 1;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    auto nibbles = [&](int64_t b) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(wrow + b * 16));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
    };
    auto dotb = [&](__m256i q, int r, int64_t b) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x8 + r * K + b * 32));
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i q0 = nibbles(b), q1 = nibbles(b + 1);
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + b), dotb(q0, r, b), acc[r][0]);
            acc[r][C - 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + b + 1), dotb(q1, r, b + 1), acc[r][C - 1]);
        }
    }
    if (b < nb) {
        const __m256i q0 = nibbles(b);
        for (int r = 0; r < R; ++r)
            acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + b), dotb(q0, r, b), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(C == 2 ? _mm256_add_ps(acc[r][0], acc[r][C - 1]) : acc[r][0]) + msum[r];
}

// int8 weights x int8 activations: maddubs takes |w| (unsigned) and x with w's sign moved onto it.
template <int R>
inline void q8_row_i8(const int8_t* x8, const float* dx, int64_t K, const int8_t* wrow, float scale, int64_t nb,
                      float* out) {
    constexpr int C = R <= 2 ? 2 : 1;  // as in q4_row_i8
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    auto dotb = [&](__m256i w, __m256i aw, int r, int64_t b) {
        const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x8 + r * K + b * 32)), w);
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wrow + b * 32));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wrow + b * 32 + 32));
        const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(dx + r * nb + b), dotb(w0, a0, r, b), acc[r][0]);
            acc[r][C - 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(dx + r * nb + b + 1), dotb(w1, a1, r, b + 1),
                                            acc[r][C - 1]);
        }
    }
    if (b < nb) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wrow + b * 32));
        const __m256i a0 = _mm256_sign_epi8(w0, w0);
        for (int r = 0; r < R; ++r)
            acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(dx + r * nb + b), dotb(w0, a0, r, b), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(C == 2 ? _mm256_add_ps(acc[r][0], acc[r][C - 1]) : acc[r][0]) * scale;
}

// Per row and block of 32: the int8 activations (rounded to nearest) and their scale.
inline void quantize_i8(const float* x, int64_t T, int64_t K, std::vector<int8_t>& x8, std::vector<float>& dx) {
    const int64_t nb = K / 32;
    x8.resize(T * K);
    dx.resize(T * nb);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * K + b * 32;
            __m256 v[4];
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm256_loadu_ps(xb + i * 8);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            dx[t * nb + b] = amax / 127.f;
            const __m256 inv = _mm256_set1_ps(amax > kTinyGroup ? 127.f / amax : 0.f);
            __m256i q[4];
            for (int i = 0; i < 4; ++i)
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i*)(x8.data() + t * K + b * 32), _mm256_permutevar8x32_epi32(p, perm));
        }
}
#endif

// Per row and group of 32 * S values (S = 1: blocks of 32; K a multiple of 32 * S): the int16
// activations and their scale (|x| max / 32767; see q4_row_i16). A group whose |x| max is under
// kTinyGroup quantizes to zeros (its scale's reciprocal would overflow to inf).
inline void quantize_i16(const float* x, int64_t T, int64_t K, std::vector<int16_t>& x16, std::vector<float>& dx,
                         int64_t S = 1) {
    const int64_t gs = 32 * S, ng = K / gs;
    x16.resize(T * K);
    dx.resize(T * ng);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < ng; ++g) {
            const float* xg = x + t * K + g * gs;
            float amax = 0.f;
            for (int64_t j = 0; j < gs; ++j) amax = std::max(amax, std::fabs(xg[j]));
            const float d = amax / 32767.f, inv = amax > kTinyGroup ? 32767.f / amax : 0.f;
            dx[t * ng + g] = d;
            for (int64_t j = 0; j < gs; ++j) x16[t * K + g * gs + j] = (int16_t)std::lrintf(xg[j] * inv);
        }
}

// Rows at or under these counts take the int8-activation path (int4 / int8 weights), else, up to
// kI16MaxRows, the int16 one (AVX2 only; oc_act_rows sets them: tests and A/B timings). The int8
// path is off by default: counted with callgrind on the bundled model's four projection shapes (one
// thread), int4 weights at one row take 8.6 M instructions on it, 10.3 M on the int16 path, 13.7 M on
// the int16 path before its accumulators were fixed; but its rounding (a step of amax / 127 per block
// of 32) costs accuracy: on SmolLM2 with every int4 projection run one row at a time, greedy top-1
// agreement with fp32 falls from 98.4 % (int16) to 94.5 %, under the accuracy gate's 95 %.
int64_t kI8MaxRowsQ4 = 0, kI8MaxRowsQ8 = 0;
// Up to this many rows the int16 path runs (rows by four, two, one: a row's result does not depend on the
// rows beside it, so a decode step gives every sequence the same numbers whatever the batch);
// below the panel paths' row counts, so up to 31 decode rows (a batch, a speculative draft's rows)
// every sequence gets the numbers it gets alone: 4-12 % slower at 3-8 rows than the fp32 row path
// on the bundled model's projections (2-core EPYC, one thread), which differs from one row in the
// last bits and so changed greedy outputs with the batch. oc_i16_rows sets it.
int64_t kI16MaxRows = 31;
// Up to this many rows the k-quant projections take int8 activations per super-block (Q8K below), else the
// int16 ones per block of 32 (0: never). oc_kquant_i8_rows sets it.
int64_t kI8MaxRowsK = INT64_MAX;

template <int R>
inline void q8_row(const float* x, int64_t K, const int8_t* wrow, float scale, float* out) {
    int64_t k = 0;
#if OC_AVX2
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(wrow + k));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
        for (int r = 0; r < R; ++r) {
            const float* xr = x + r * K + k;
            acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
            acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r]);
        }
    }
    float part[R];
    for (int r = 0; r < R; ++r) part[r] = hsum(acc[r]);
#else
    float part[R];
    for (int r = 0; r < R; ++r) part[r] = 0.f;
#endif
    for (int r = 0; r < R; ++r) {
        float s = part[r];
        for (int64_t j = k; j < K; ++j) s += wrow[j] * x[r * K + j];
        out[r] = s * scale;
    }
}

// Many rows (a prefill chunk): per tile of 16 output rows, the weights are dequantized once into an
// fp32 panel [K][16] and a 6 x 16 register-blocked kernel (12 accumulators) runs over the rows, so
// the weight unpacking is paid once per tile, not once per 8 rows, and the inner loop is 12 FMAs per
// 2 weight loads and 6 broadcasts. Filling the panels is a fixed cost per call (every weight of the
// matrix dequantized and transposed) that the row kernels do not pay, so these stay faster up to
// tens of rows: benchmarks/bench_prefill_kernels.py (the bundled model's projections, 2-core EPYC,
// AVX2, 2 threads, interleaved, two runs) put panels / rows at 1.29 and 1.58 (int8), 1.18 and 1.04
// (int4) for 24 rows, 1.29 / 1.39 and 1.08 / 1.13 for 32, 1.18 / 0.91 and 0.98 / 1.13 for 40, and
// 0.76-1.07 from 48. Whole prompts alone (prompt_ms, interleaved, one process, two runs): int8 24-47
// tokens 8-47 % faster on the row kernels; int4 24 tokens 10-14 % faster, 32 and up within the noise.
int64_t kGemmMinRowsQ4 = 32, kGemmMinRowsQ8 = 48;  // oc_gemm_min_rows sets them (tests, A/B timings)
constexpr int64_t kPanel = 16, kMr = 6;

#if OC_AVX2
template <int R>
inline void gemm_micro(const float* x, int64_t K, const float* panel, float* out) {
    __m256 c[R][2];
    for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m256 w0 = _mm256_load_ps(panel + k * kPanel), w1 = _mm256_load_ps(panel + k * kPanel + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            c[r][0] = _mm256_fmadd_ps(xb, w0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(xb, w1, c[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out + r * kPanel, c[r][0]);
        _mm256_storeu_ps(out + r * kPanel + 8, c[r][1]);
    }
}
#else
template <int R>
inline void gemm_micro(const float* x, int64_t K, const float* panel, float* out) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < kPanel; ++j) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * panel[k * kPanel + j];
            out[r * kPanel + j] = s;
        }
}
#endif

// deq(n, row) writes output row n of W as K floats into row (fp32).
template <typename Deq>
void gemm_panels(const float* x, int64_t T, int64_t K, int64_t N, const float* bias, float* y, int nt, Deq&& deq) {
    const int64_t tiles = (N + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(nt)
    {
        std::vector<float> row(K);
        float* panel = (float*)std::aligned_alloc(32, ((K * kPanel * sizeof(float) + 31) / 32) * 32);
        float out[kMr * kPanel];
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ++ti) {
            const int64_t n0 = ti * kPanel, cols = std::min(kPanel, N - n0);
            for (int64_t j = 0; j < kPanel; ++j) {
                if (j < cols) deq(n0 + j, row.data());
                for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = j < cols ? row[k] : 0.f;
            }
            for (int64_t t0 = 0; t0 < T; t0 += kMr) {
                const int64_t rows = std::min(kMr, T - t0);
                const float* xs = x + t0 * K;
                switch (rows) {
                    case 6: gemm_micro<6>(xs, K, panel, out); break;
                    case 5: gemm_micro<5>(xs, K, panel, out); break;
                    case 4: gemm_micro<4>(xs, K, panel, out); break;
                    case 3: gemm_micro<3>(xs, K, panel, out); break;
                    case 2: gemm_micro<2>(xs, K, panel, out); break;
                    default: gemm_micro<1>(xs, K, panel, out); break;
                }
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t j = 0; j < cols; ++j)
                        y[(t0 + r) * N + n0 + j] = out[r * kPanel + j] + (bias ? bias[n0 + j] : 0.f);
            }
        }
        std::free(panel);
    }
}

// Calls f(std::integral_constant<int, R>{}) with R = rows (1..kRows): the row count as a template argument.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
    switch (rows) {
        case 8: f(std::integral_constant<int, 8>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        default: f(std::integral_constant<int, 1>{}); break;
    }
}

// f(std::integral_constant<int, m>{}, r) over rows [0, rows) in runs of m = 4, then 2, then 1: the
// int16 row kernels' row counts (every count gives a row the same operations).
template <typename F>
inline void rows_421(int64_t rows, F&& f) {
    for (int64_t r = 0; r < rows;) {
        const int64_t m = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
        if (m == 4) f(std::integral_constant<int, 4>{}, r);
        else if (m == 2) f(std::integral_constant<int, 2>{}, r);
        else f(std::integral_constant<int, 1>{}, r);
        r += m;
    }
}

// y[t0 + r, n] = out[r] (+ bias[n]) for the rows of one register block.
inline void store_rows(float* y, int64_t N, int64_t t0, int64_t rows, int64_t n, const float* out, const float* bias) {
    const float b = bias ? bias[n] : 0.f;
    for (int64_t r = 0; r < rows; ++r) y[(t0 + r) * N + n] = out[r] + b;
}

// How far ahead of the weight row in use the row kernels ask for the weights (bytes): a step's weights
// come from memory (each layer's once), and the hardware's own prefetch alone left the int4 row kernel
// waiting on its loads (perf: the loads of the scales and nibbles held most samples).
constexpr int64_t kWeightPrefetch = 2048;

// Rows of x in blocks of kRows (and a remainder), output rows of W in tiles; threads split the tiles.
// w, row_bytes (optional): the weights, row n at w + n * row_bytes, asked for kWeightPrefetch ahead.
template <typename RowFn>
void matmul_driver(int64_t T, int64_t N, int nt, RowFn&& row, const void* w = nullptr, int64_t row_bytes = 0) {
    const int64_t tile = 16;
    const int64_t tiles = (N + tile - 1) / tile;
    const char* wb = (const char*)w;
    const int64_t end = N * row_bytes;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t ti = 0; ti < tiles; ++ti) {
        const int64_t n0 = ti * tile, n1 = std::min(N, n0 + tile);
        for (int64_t t0 = 0; t0 < T; t0 += kRows) {
            const int64_t rows = std::min<int64_t>(kRows, T - t0);
            for (int64_t n = n0; n < n1; ++n) {
                if (wb && t0 == 0)
                    for (int64_t at = n * row_bytes + kWeightPrefetch, stop = std::min(end, at + row_bytes); at < stop;
                         at += 64)
                        __builtin_prefetch(wb + at);
                row(t0, rows, n);
            }
        }
    }
}

// KV cache elements: fp32, fp16 (IEEE binary16), bf16 (the upper 16 bits of an fp32) or q8 (int8 with
// an fp32 scale per vector). Attention converts each element to fp32 as it loads it (q8: the integer,
// the vector's scale applied to the dot product / the softmax weight) and accumulates in fp32.
enum KvType : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvQ8 = 3 };
constexpr int64_t kQ8Scale = 4;  // bytes of a q8 vector's scale, after its values
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return (float)x; }
inline float to_float(f16 x) { return half_to_float(x.bits); }
inline float to_float(bf16 x) {
    const uint32_t b = (uint32_t)x.bits << 16;
    float f; std::memcpy(&f, &b, 4); return f;
}

// Round to nearest even, as torch converts (NaN stays NaN, overflow goes to inf).
inline uint16_t float_to_half(float f) {
#if OC_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    // FP16 library (Maratyszcza) fp16_ieee_from_fp32_value: the fp32 unit does the rounding
    uint32_t w; std::memcpy(&w, &f, 4);
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * to_inf) * to_zero;
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    float bf; std::memcpy(&bf, &bb, 4);
    base = bf + base;
    uint32_t bits; std::memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}
inline uint16_t float_to_bf16(float f) {
    uint32_t b; std::memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN (torch's)
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// One vector of D fp32 values as q8 (D int8 values, then the fp32 scale): s = max|x| / 127,
// q = round-half-even(x / s), as engine/kv/q8.py computes it (fp32 division, no reciprocal).
inline void store_q8(int8_t* dst, const float* src, int64_t D) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
    for (int64_t i = 0; i < D; ++i) {
        const float r = std::nearbyint(src[i] / div);
        dst[i] = (int8_t)std::min(127.f, std::max(-127.f, r));
    }
    std::memcpy(dst + D, &s, sizeof(float));
}

// Bytes of one vector of D values in a cache of type kv
inline int64_t kv_row_bytes(int kv, int64_t D) { return kv == kKvQ8 ? D + kQ8Scale : D * (kv == kKvF32 ? 4 : 2); }

// rows vectors of D fp32 values into cache elements of type kv (rows x kv_row_bytes bytes)
inline void store_kv(int kv, void* dst, const float* src, int64_t rows, int64_t D) {
    const int64_t n = rows * D;
    if (kv == kKvQ8) {
        for (int64_t r = 0; r < rows; ++r) store_q8((int8_t*)dst + r * (D + kQ8Scale), src + r * D, D);
        return;
    }
    if (kv == kKvF32) { std::memcpy(dst, src, n * sizeof(float)); return; }
    uint16_t* d = (uint16_t*)dst;
    int64_t i = 0;
    if (kv == kKvF16) {
#if OC_AVX2
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; ++i) d[i] = float_to_half(src[i]);
        return;
    }
    for (; i < n; ++i) d[i] = float_to_bf16(src[i]);
}


#if OC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// ---------------------------------------------------------------------------------------------
// Shared-prefix ("cascade") attention, the shared part: for each group of sequences that share a
// run of full KV pages (engine/attention/cascade.py), every query row of its members attends to
// those pages, each page read (and converted to fp32) once for the whole group: pages outer, the
// group's query vectors inner, an online softmax (running max / sum / accumulator) per vector.
// The group's result is merged exactly with the partial already in out / lse (the sequence's own
// pages, or an outer group) through their log-sum-exp. Shared pages lie strictly before every
// query position of their group, so there is no mask.

#if OC_AVX2
// e^x for 8 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~2 ulp); -inf -> 0
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365447504f), hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// S [R, kp] = Q [R, D] @ Kt [D, kp] (kp a multiple of 8): J blocks of 8 keys at a time, R x J
// independent FMA chains.
template <int R, int J>
inline void cascade_scores_blk(const float* Q, int64_t D, const float* Kt, int64_t kp, int64_t jb, float* S) {
    __m256 a[R][J];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        __m256 kv[J];
        for (int j = 0; j < J; ++j) kv[j] = _mm256_loadu_ps(Kt + d * kp + jb + 8 * j);
        for (int r = 0; r < R; ++r) {
            const __m256 qv = _mm256_broadcast_ss(Q + r * D + d);
            for (int j = 0; j < J; ++j) a[r][j] = _mm256_fmadd_ps(qv, kv[j], a[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) _mm256_storeu_ps(S + r * kp + jb + 8 * j, a[r][j]);
}
template <int R>
inline void cascade_scores(const float* Q, int64_t D, const float* Kt, int64_t kp, float* S) {
    int64_t jb = 0;
    for (; jb + 16 <= kp; jb += 16) cascade_scores_blk<R, 2>(Q, D, Kt, kp, jb, S);
    if (jb < kp) cascade_scores_blk<R, 1>(Q, D, Kt, kp, jb, S);
}

// acc_r [d0, d0 + 8 NV) = acc_r * alpha_r + sum_j p_r[j] V[j, d0 ..] for R query vectors: R x NV
// independent FMA chains, each V row slice loaded once for the R vectors (R x NV <= 12 accumulators,
// NV loads and one broadcast: 15 of AVX2's 16 registers at most).
template <int R, int NV>
inline void cascade_pv_blk(const float* p, int64_t kp, const float* alpha, const float* Vb, int64_t n, int64_t D,
                           float* const* acc, int64_t d0) {
    __m256 a[R][NV];
    for (int r = 0; r < R; ++r) {
        const __m256 al = _mm256_set1_ps(alpha[r]);
        for (int k = 0; k < NV; ++k) a[r][k] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d0 + 8 * k), al);
    }
    for (int64_t j = 0; j < n; ++j) {
        __m256 v[NV];
        for (int k = 0; k < NV; ++k) v[k] = _mm256_loadu_ps(Vb + j * D + d0 + 8 * k);
        for (int r = 0; r < R; ++r) {
            const __m256 pj = _mm256_broadcast_ss(p + r * kp + j);
            for (int k = 0; k < NV; ++k) a[r][k] = _mm256_fmadd_ps(pj, v[k], a[r][k]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc[r] + d0 + 8 * k, a[r][k]);
}
// The same over all D columns (D % 8 == 0): one or two vectors 32 columns at a time, three to six 16.
template <int R>
inline void cascade_pv(const float* p, int64_t kp, const float* alpha, const float* Vb, int64_t n, int64_t D,
                       float* const* acc) {
    constexpr int NV = R <= 2 ? 4 : 2;
    int64_t d0 = 0;
    for (; d0 + 8 * NV <= D; d0 += 8 * NV) cascade_pv_blk<R, NV>(p, kp, alpha, Vb, n, D, acc, d0);
    for (; d0 < D; d0 += 8) cascade_pv_blk<R, 1>(p, kp, alpha, Vb, n, D, acc, d0);
}
#endif

// D cache elements as fp32 (q8: the int8 values times the vector's scale s, as kv/q8.py dequantizes)
template <typename T>
inline void to_f32_row(const T* src, int64_t D, float s, float* dst) {
    constexpr bool kQ8 = std::is_same_v<T, int8_t>;
    int64_t i = 0;
#if OC_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(dst + i, kQ8 ? _mm256_mul_ps(load8(src + i), sv) : load8(src + i));
#endif
    for (; i < D; ++i) dst[i] = kQ8 ? to_float(src[i]) * s : to_float(src[i]);
}

// Kt [D, kp] = Kr [n, D] transposed (n <= kp), 8 x 8 tiles where the sizes allow
inline void transpose_keys(const float* Kr, int64_t n, int64_t D, float* Kt, int64_t kp) {
    int64_t j0 = 0;
#if OC_AVX2
    if (D % 8 == 0)
        for (; j0 + 8 <= n; j0 += 8)
            for (int64_t d0 = 0; d0 < D; d0 += 8) {
                const float* src = Kr + j0 * D + d0;
                __m256 r[8], t[8];
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * D);
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
                float* dst = Kt + d0 * kp + j0;
                for (int i = 0; i < 4; ++i) {
                    _mm256_storeu_ps(dst + i * kp, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                    _mm256_storeu_ps(dst + (i + 4) * kp, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
                }
            }
#endif
    for (int64_t j = j0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) Kt[d * kp + j] = Kr[j * D + d];
}

#if OC_AVX2
// The online softmax step of R score rows S [R, kp] (the first ps of each valid, kp a multiple of 8):
// each row's scores become e^(s - m_new) in place, its max m and sum l are updated and alpha[r] =
// e^(m_old - m_new) is what its accumulator must be scaled by.
inline void softmax_rows(float* S, int R, int64_t ps, int64_t kp, float* m, float* l, float* alpha) {
    for (int r = 0; r < R; ++r) {
        float* s = S + r * kp;
        for (int64_t j = ps; j < kp; ++j) s[j] = -INFINITY;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < kp; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float mold = m[r], mnew = std::max(mold, _mm_cvtss_f32(m4));
        alpha[r] = mold == -INFINITY ? 0.f : std::exp(mold - mnew);
        const __m256 mb = _mm256_set1_ps(mnew);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < kp; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
            _mm256_storeu_ps(s + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        l[r] = l[r] * alpha[r] + hsum(sum);
        m[r] = mnew;
    }
}

#endif

// One group's query vectors Q [nq, D] (scale folded in) against a block of ps keys (Kt [D, kp]
// transposed, Vb [kp, D], kp >= ps a multiple of 8): the online softmax update of
// (m, l, acc) of every vector, kCascadeRows vectors at a time (a 6 x 16 score tile and 6 x 16 output
// tiles: 12 accumulators each). S: scratch of kCascadeRows x kp floats.
constexpr int kCascadeRows = 6;
inline void cascade_page(const float* Q, int64_t nq, int64_t D, const float* Kt, const float* Vb, int64_t ps,
                         int64_t kp, float* m, float* l, float* acc, float* S) {
#if OC_AVX2
    if (D % 8 == 0) {
        for (int64_t i0 = 0; i0 < nq; i0 += kCascadeRows) {
            const int R = (int)std::min<int64_t>(kCascadeRows, nq - i0);
            const float* Qi = Q + i0 * D;
            switch (R) {
                case 6: cascade_scores<6>(Qi, D, Kt, kp, S); break;
                case 5: cascade_scores<5>(Qi, D, Kt, kp, S); break;
                case 4: cascade_scores<4>(Qi, D, Kt, kp, S); break;
                case 3: cascade_scores<3>(Qi, D, Kt, kp, S); break;
                case 2: cascade_scores<2>(Qi, D, Kt, kp, S); break;
                default: cascade_scores<1>(Qi, D, Kt, kp, S);
            }
            float alpha[kCascadeRows];
            softmax_rows(S, R, ps, kp, m + i0, l + i0, alpha);
            float* accs[kCascadeRows];
            for (int r = 0; r < R; ++r) accs[r] = acc + (i0 + r) * D;
            switch (R) {
                case 6: cascade_pv<6>(S, kp, alpha, Vb, ps, D, accs); break;
                case 5: cascade_pv<5>(S, kp, alpha, Vb, ps, D, accs); break;
                case 4: cascade_pv<4>(S, kp, alpha, Vb, ps, D, accs); break;
                case 3: cascade_pv<3>(S, kp, alpha, Vb, ps, D, accs); break;
                case 2: cascade_pv<2>(S, kp, alpha, Vb, ps, D, accs); break;
                default: cascade_pv<1>(S, kp, alpha, Vb, ps, D, accs);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < nq; ++i) {
        const float* qv = Q + i * D;
        float mx = -INFINITY;
        for (int64_t j = 0; j < ps; ++j) {
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qv[d] * Kt[d * kp + j];
            S[j] = s;
            mx = std::max(mx, s);
        }
        const float mnew = std::max(m[i], mx);
        const float alpha = m[i] == -INFINITY ? 0.f : std::exp(m[i] - mnew);
        float sum = 0.f;
        for (int64_t j = 0; j < ps; ++j) {
            S[j] = std::exp(S[j] - mnew);
            sum += S[j];
        }
        l[i] = l[i] * alpha + sum;
        m[i] = mnew;
        float* a = acc + i * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        for (int64_t j = 0; j < ps; ++j)
            for (int64_t d = 0; d < D; ++d) a[d] += S[j] * Vb[j * D + d];
    }
}

// Scratch of one thread for attend_block: a block of keys as fp32 rows (Kr), transposed (Kt [D, kp]),
// its values (Vb [kp, D]) and the scores of kCascadeRows vectors (S); the keys' row offsets (at).
// attend_direct uses S and at, and Kr for a q8 block's key and value scales (2 kp <= kp D: D >= 8).
struct BlockScratch {
    int64_t kp;
    std::vector<float> Kt, Vb, S, Kr;
    std::vector<int64_t> at;
    BlockScratch(int64_t D, int64_t kp_)
        : kp(kp_), Kt(D * kp_, 0.f), Vb(kp_ * D, 0.f), S(kCascadeRows * kp_), Kr(kp_ * D), at(kp_) {}
};

// Keys first .. first + n (n <= kp) of a page list (key j in pages[j / page_size]) for KV head kvh:
// converted to fp32 and transposed once, then the online softmax update of the nq query vectors Q
// (scale folded in) and their states (m, l, acc).
// at[j] = the element offset of key first + j's row (head offset head_off within a token) in a
// paged cache, computed a page at a time (no division per key)
inline void row_offsets(const int64_t* pages, int64_t first, int64_t n, int64_t page_size, int64_t tok_stride,
                        int64_t head_off, int64_t* at) {
    for (int64_t j = 0, key = first; j < n;) {
        const int64_t off = key % page_size, cnt = std::min(page_size - off, n - j);
        const int64_t base = pages[key / page_size] * page_size * tok_stride + off * tok_stride + head_off;
        for (int64_t t = 0; t < cnt; ++t) at[j + t] = base + t * tok_stride;
        j += cnt;
        key += cnt;
    }
}

// Ask for the K and V rows of keys j0 .. j1 (bytes from each row's start): one head's rows are
// strided by the other heads and the hardware does not fetch them ahead by itself
template <typename T>
inline void prefetch_rows(const T* k_cache, const T* v_cache, const int64_t* at, int64_t j0, int64_t j1,
                          int64_t bytes) {
    for (int64_t j = j0; j < j1; ++j)
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char*)(k_cache + at[j]) + b);
            __builtin_prefetch((const char*)(v_cache + at[j]) + b);
        }
}

constexpr int64_t kPrefetchKeys = 4;
template <typename T>
void attend_block(const T* k_cache, const T* v_cache, const int64_t* pages, int64_t first, int64_t n,
                  int64_t page_size, int64_t Hkv, int64_t D, int64_t kvh, const float* Q, int64_t nq, float* m,
                  float* l, float* acc, BlockScratch& sc) {
    constexpr bool kQ8 = std::is_same_v<T, int8_t>;
    const int64_t row = kQ8 ? D + kQ8Scale : D, tok_stride = Hkv * row;
    int64_t* at = sc.at.data();  // element offset of each key's row for this head, a page at a time
    row_offsets(pages, first, n, page_size, tok_stride, kvh * row, at);
    const int64_t bytes = row * (int64_t)sizeof(T);
    prefetch_rows(k_cache, v_cache, at, 0, std::min(n, kPrefetchKeys), bytes);  // the first rows at once
    for (int64_t j = 0; j < n; ++j) {
        // the loads of a few keys ahead are asked for now (without it the loop waited on memory: perf
        // put ~90 % of its samples on the stores after each row's conversion)
        if (j + kPrefetchKeys < n) prefetch_rows(k_cache, v_cache, at, j + kPrefetchKeys, j + kPrefetchKeys + 1, bytes);
        const T* kv = k_cache + at[j];
        const T* vv = v_cache + at[j];
        float ks = 1.f, vs = 1.f;
        if constexpr (kQ8) {
            std::memcpy(&ks, kv + D, sizeof(float));
            std::memcpy(&vs, vv + D, sizeof(float));
        }
        to_f32_row(kv, D, ks, sc.Kr.data() + j * D);
        to_f32_row(vv, D, vs, sc.Vb.data() + j * D);
    }
    transpose_keys(sc.Kr.data(), n, D, sc.Kt.data(), sc.kp);
    cascade_page(Q, nq, D, sc.Kt.data(), sc.Vb.data(), n, sc.kp, m, l, acc, sc.S.data());
}

#if OC_AVX2
// Scores of R (<= 3) query vectors Q [R, D] (scale folded in) against n keys read straight from the
// cache rows k_cache + at[j] (no copy, no transpose: the right shape for decode, where a KV head has
// only G = H / Hkv vectors): 4 keys at a time, R x 4 accumulators, each 4 sums reduced by hadd into
// S [R, kp]. ks: the keys' q8 scales (null for other types).
template <typename T, int R>
inline void direct_scores(const T* k_cache, const T* v_cache, const int64_t* at, int64_t n, int64_t D,
                          const float* Q, const float* ks, int64_t kp, float* S, int64_t bytes) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_rows(k_cache, v_cache, at, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), bytes);  // ahead
        __m256 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < 4; ++t) a[r][t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kv[4];
            for (int t = 0; t < 4; ++t) kv[t] = load8(k_cache + at[j + t] + d);
            for (int r = 0; r < R; ++r) {
                const __m256 qv = _mm256_loadu_ps(Q + r * D + d);
                for (int t = 0; t < 4; ++t) a[r][t] = _mm256_fmadd_ps(qv, kv[t], a[r][t]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            if (ks) s4 = _mm_mul_ps(s4, _mm_loadu_ps(ks + j));
            _mm_storeu_ps(S + r * kp + j, s4);
        }
    }
    for (; j < n; ++j) {
        __m256 a[R];
        for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 kv = load8(k_cache + at[j] + d);
            for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(Q + r * D + d), kv, a[r]);
        }
        for (int r = 0; r < R; ++r) S[r * kp + j] = hsum(a[r]) * (ks ? ks[j] : 1.f);
    }
}

// acc_r = acc_r * alpha_r + sum_j p_r[j] V[j] for R (<= 3) vectors, V rows read straight from the cache
// (v_cache + at[j]; q8: the scales are already in p): 16 columns at a time, R x 2 accumulators.
template <typename T, int R, int NV>
inline void direct_pv_blk(const T* v_cache, const int64_t* at, int64_t n, int64_t D, const float* p, int64_t kp,
                          const float* alpha, float* acc, int64_t d0) {
    __m256 a[R][NV];
    for (int r = 0; r < R; ++r) {
        const __m256 al = _mm256_set1_ps(alpha[r]);
        for (int k = 0; k < NV; ++k) a[r][k] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * k), al);
    }
    for (int64_t j = 0; j < n; ++j) {
        __m256 v[NV];
        for (int k = 0; k < NV; ++k) v[k] = load8(v_cache + at[j] + d0 + 8 * k);
        for (int r = 0; r < R; ++r) {
            const __m256 pj = _mm256_broadcast_ss(p + r * kp + j);
            for (int k = 0; k < NV; ++k) a[r][k] = _mm256_fmadd_ps(pj, v[k], a[r][k]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + r * D + d0 + 8 * k, a[r][k]);
}
// acc_r = acc_r * alpha_r + sum_j p_r[j] V[j] for R (<= 3) vectors, V rows read straight from the cache
// (v_cache + at[j]; q8: the scales are already in p): 32 columns at a time (R x 4 accumulators), then 8.
template <typename T, int R>
inline void direct_pv(const T* v_cache, const int64_t* at, int64_t n, int64_t D, const float* p, int64_t kp,
                      const float* alpha, float* acc) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) direct_pv_blk<T, R, 4>(v_cache, at, n, D, p, kp, alpha, acc, d0);
    for (; d0 < D; d0 += 8) direct_pv_blk<T, R, 1>(v_cache, at, n, D, p, kp, alpha, acc, d0);
}

// Decode's block step: keys first .. first + n (n <= kp) of a page list for KV head kvh against the
// nq query vectors Q [nq, D] (scale folded in), 3 at a time, rows read in place: attend_block's
// work without its fp32 copy and transpose, which cost more than the arithmetic when a head has
// 3 vectors. D % 8 == 0.
template <typename T>
void attend_direct(const T* k_cache, const T* v_cache, const int64_t* pages, int64_t first, int64_t n,
                   int64_t page_size, int64_t Hkv, int64_t D, int64_t kvh, const float* Q, int64_t nq, float* m,
                   float* l, float* acc, BlockScratch& sc, int64_t pf_heads) {
    constexpr bool kQ8 = std::is_same_v<T, int8_t>;
    const int64_t row = kQ8 ? D + kQ8Scale : D, tok_stride = Hkv * row;
    int64_t* at = sc.at.data();
    row_offsets(pages, first, n, page_size, tok_stride, kvh * row, at);
    // the rows of pf_heads heads from kvh on are asked for kPrefetchKeys keys ahead (the first ones
    // at once): a head's rows are strided, and the hardware does not fetch them ahead by itself
    const int64_t bytes = pf_heads * row * (int64_t)sizeof(T);
    prefetch_rows(k_cache, v_cache, at, 0, std::min(n, kPrefetchKeys), bytes);
    float* ks = nullptr;
    float* vs = nullptr;
    if constexpr (kQ8) {
        ks = sc.Kr.data();  // scratch: the block's key and value scales
        vs = sc.Kr.data() + sc.kp;
        for (int64_t j = 0; j < n; ++j) {
            std::memcpy(ks + j, k_cache + at[j] + D, sizeof(float));
            std::memcpy(vs + j, v_cache + at[j] + D, sizeof(float));
        }
    }
    const int64_t kp = sc.kp;
    float* S = sc.S.data();
    for (int64_t i0 = 0; i0 < nq; i0 += 3) {
        const int R = (int)std::min<int64_t>(3, nq - i0);
        const float* Qi = Q + i0 * D;
        if (R == 3) direct_scores<T, 3>(k_cache, v_cache, at, n, D, Qi, ks, kp, S, bytes);
        else if (R == 2) direct_scores<T, 2>(k_cache, v_cache, at, n, D, Qi, ks, kp, S, bytes);
        else direct_scores<T, 1>(k_cache, v_cache, at, n, D, Qi, ks, kp, S, bytes);
        float alpha[3];
        softmax_rows(S, R, n, kp, m + i0, l + i0, alpha);
        if constexpr (kQ8)
            for (int r = 0; r < R; ++r)
                for (int64_t j = 0; j < n; ++j) S[r * kp + j] *= vs[j];
        float* ai = acc + i0 * D;
        if (R == 3) direct_pv<T, 3>(v_cache, at, n, D, S, kp, alpha, ai);
        else if (R == 2) direct_pv<T, 2>(v_cache, at, n, D, S, kp, alpha, ai);
        else direct_pv<T, 1>(v_cache, at, n, D, S, kp, alpha, ai);
    }
}
#endif

// The shared part of cascade attention over a cache of element type T, merged into out [*, H, D]
// (fp32) and lse [*, H] (natural log) in place. Group g: pages group_pages[group_page_ptr[g] ..
// group_page_ptr[g + 1]), query rows group_rows[group_row_ptr[g] .. group_row_ptr[g + 1]) (rows of q,
// out and lse). Groups run one after another (a row is in one group per level: nested groups share
// rows); within a group the work is split by KV head and run of pages, each a partial state merged
// at the end.
template <typename T>
void cascade_groups(const float* q, int64_t H, int64_t Hkv, int64_t D, const T* k_cache, const T* v_cache,
                    int64_t page_size, int64_t n_groups, const int64_t* group_page_ptr, const int64_t* group_pages,
                    const int64_t* group_row_ptr, const int64_t* group_rows, float scale, float* out, float* lse,
                    int nt) {
    const int64_t G = H / Hkv;
    // keys are taken a block of whole pages at a time (about 64 keys: the running state of each query
    // vector is rescaled, loaded and stored once per block)
    const int64_t ppb = std::max<int64_t>(1, 64 / page_size), kp = (ppb * page_size + 7) / 8 * 8;
    std::vector<float> Qs, pm, pl, pacc;
    for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t* pages = group_pages + group_page_ptr[g];
        const int64_t np = group_page_ptr[g + 1] - group_page_ptr[g];
        const int64_t* rows = group_rows + group_row_ptr[g];
        const int64_t M = group_row_ptr[g + 1] - group_row_ptr[g], nq = M * G;
        if (np <= 0 || M <= 0) continue;
        // runs of blocks: enough tasks (x KV heads) to keep nt threads busy, at least one block each
        const int64_t nblocks = (np + ppb - 1) / ppb;
        const int64_t want = std::min(nblocks, std::max<int64_t>(1, (8 * (int64_t)nt + Hkv - 1) / Hkv));
        const int64_t chunk = (nblocks + want - 1) / want * ppb;  // pages per run
        const int64_t nc = (np + chunk - 1) / chunk;
        Qs.resize(Hkv * nq * D);
        for (int64_t kvh = 0; kvh < Hkv; ++kvh)  // [Hkv, M x G, D]: the vectors of a KV head, rows outer
            for (int64_t mi = 0; mi < M; ++mi)
                for (int64_t gi = 0; gi < G; ++gi) {
                    const float* src = q + (rows[mi] * H + kvh * G + gi) * D;
                    float* dst = Qs.data() + ((kvh * nq) + mi * G + gi) * D;
                    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
                }
        pm.assign(nc * Hkv * nq, -INFINITY);
        pl.assign(nc * Hkv * nq, 0.f);
        pacc.assign(nc * Hkv * nq * D, 0.f);
#pragma omp parallel num_threads(nt)
        {
            BlockScratch scratch(D, kp);
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < nc * Hkv; ++task) {
                const int64_t c = task / Hkv, kvh = task % Hkv;
                const int64_t st = (c * Hkv + kvh) * nq, end = std::min(np, (c + 1) * chunk);
                for (int64_t p0 = c * chunk; p0 < end; p0 += ppb) {
                    const int64_t n = std::min(ppb, end - p0) * page_size;  // keys in this block
                    attend_block(k_cache, v_cache, pages, p0 * page_size, n, page_size, Hkv, D, kvh, Qs.data() + kvh * nq * D,
                                 nq, pm.data() + st, pl.data() + st, pacc.data() + st * D, scratch);
                }
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M * H; ++t) {  // merge the runs, then into out / lse
                const int64_t mi = t / H, h = t % H, kvh = h / G, i = mi * G + h % G;
                float mx = -INFINITY;
                for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, pm[(c * Hkv + kvh) * nq + i]);
                if (mx == -INFINITY) continue;
                float* o = out + (rows[mi] * H + h) * D;
                float* la = lse + rows[mi] * H + h;
                float L = 0.f, w[64];
                std::vector<float> wv;
                float* wc = w;
                if (nc > 64) { wv.resize(nc); wc = wv.data(); }
                for (int64_t c = 0; c < nc; ++c) {
                    const int64_t s = (c * Hkv + kvh) * nq + i;
                    wc[c] = pm[s] == -INFINITY ? 0.f : std::exp(pm[s] - mx);
                    L += pl[s] * wc[c];
                }
                const float lg = mx + std::log(L);
                float wa = 0.f, wg = 1.f, nl = lg;
                if (*la != -INFINITY) {
                    const float top = std::max(*la, lg);
                    nl = top + std::log(std::exp(*la - top) + std::exp(lg - top));
                    wa = std::exp(*la - nl);
                    wg = std::exp(lg - nl);
                }
                const float f = wg / L;
                for (int64_t d = 0; d < D; ++d) {
                    float v = 0.f;
                    for (int64_t c = 0; c < nc; ++c) v += pacc[((c * Hkv + kvh) * nq + i) * D + d] * wc[c];
                    o[d] = (wa == 0.f ? 0.f : o[d] * wa) + v * f;
                }
                *la = nl;
            }
        }
    }
}

// Decode attention (one query token per sequence) straight from the paged cache, no gather, computed
// like the shared part of cascade attention: per sequence and KV head, the G = H / Hkv query vectors
// of that head run against blocks of whole pages (attend_direct: rows read in place, 3 vectors x 4
// keys at a time, an online softmax; attend_block where D % 8 != 0 or without AVX2), the sequence's
// keys split in chunks of kDecodeChunkKeys (a fixed size, so a row's result does not depend on the
// batch or the thread count), the chunks' partial states merged at the end. q [*, H, D] (row
// q_rows[b] for sequence b); out rows likewise; lse [*, H] (natural log) or null. Sequence b attends
// to its first kv_lens[b] tokens in pages page_idx[b, :]. The kernel it replaced took one query
// vector at a time (every key's dot product once per query head, its value row read once per head);
// benchmarks/results/amd-epyc-2c-fb86c92f/cascade_before_blocked_decode.json and cascade.json are the
// bench_cascade runs before and after (plain decode of 16 sessions over 2,048 shared tokens). Then
// the rows read in place, asked for ahead, all heads of a chunk in one task when there are chunks
// enough: one session, fp16 pages, 30 distinct layers, 2 threads, a step's attention at 30 / 300 /
// 1,000 / 3,000 keys 0.25 / 0.79 / 2.00 / 8.71 -> 0.18 / 0.40 / 1.10 / 5.52 ms.
constexpr int64_t kDecodeChunkKeys = 512;

template <typename T>
void paged_decode(const float* q, const int64_t* q_rows, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                  const T* k_cache, const T* v_cache, const int64_t* page_idx, int64_t max_pages,
                  const int64_t* kv_lens, int64_t page_size, float scale, float* out, float* lse, int nt) {
    const int64_t G = H / Hkv;
    const int64_t ppb = std::max<int64_t>(1, 64 / page_size), kp = (ppb * page_size + 7) / 8 * 8;
    const int64_t chunk = std::max<int64_t>(1, kDecodeChunkKeys / (ppb * page_size)) * ppb * page_size;  // keys
    // chunk c of sequence b is work item first[b] + c; its state for KV head kvh and vector i lives
    // at ((item * Hkv) + kvh) * G + i
    std::vector<int64_t> first(B + 1, 0);
    for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + std::max<int64_t>(1, (kv_lens[b] + chunk - 1) / chunk);
    const int64_t items = first[B];
    std::vector<int64_t> seq_of(items);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = first[b]; i < first[b + 1]; ++i) seq_of[i] = b;
    std::vector<float> pm(items * Hkv * G, -INFINITY), pl(items * Hkv * G, 0.f), pacc(items * Hkv * G * D, 0.f);
    // a task is one chunk of one sequence for hpt KV heads: all of them (each token's rows of every
    // head are adjacent: one stream through memory) when there are chunks enough for the threads,
    // else one (more tasks); the heads' results do not depend on which
    const int64_t hpt = items >= 2 * (int64_t)nt ? Hkv : 1, hgroups = Hkv / hpt;
#pragma omp parallel num_threads(nt)
    {
        BlockScratch scratch(D, kp);
        std::vector<float> Qs(G * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < items * hgroups; ++task) {
            const int64_t item = task / hgroups, b = seq_of[item];
            const int64_t j0 = (item - first[b]) * chunk, j1 = std::min(kv_lens[b], j0 + chunk);
            if (j1 <= j0) continue;
            const int64_t* pages = page_idx + b * max_pages;
            for (int64_t k0 = j0; k0 < j1; k0 += ppb * page_size) {
                const int64_t n = std::min(ppb * page_size, j1 - k0);  // keys in this block
                for (int64_t kvh = (task % hgroups) * hpt; kvh < (task % hgroups + 1) * hpt; ++kvh) {
                    const int64_t st = (item * Hkv + kvh) * G;
                    for (int64_t gi = 0; gi < G; ++gi) {
                        const float* src = q + (q_rows[b] * H + kvh * G + gi) * D;
                        for (int64_t d = 0; d < D; ++d) Qs[gi * D + d] = src[d] * scale;
                    }
#if OC_AVX2
                    if (D % 8 == 0) {
                        attend_direct(k_cache, v_cache, pages, k0, n, page_size, Hkv, D, kvh, Qs.data(), G,
                                      pm.data() + st, pl.data() + st, pacc.data() + st * D, scratch,
                                      kvh == (task % hgroups) * hpt ? hpt : 0);
                        continue;
                    }
#endif
                    attend_block(k_cache, v_cache, pages, k0, n, page_size, Hkv, D, kvh, Qs.data(), G, pm.data() + st,
                                 pl.data() + st, pacc.data() + st * D, scratch);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * H; ++t) {  // merge each sequence's chunks into out / lse
            const int64_t b = t / H, h = t % H, kvh = h / G, gi = h % G;
            float* o = out + (q_rows[b] * H + h) * D;
            float mx = -INFINITY;
            for (int64_t item = first[b]; item < first[b + 1]; ++item)
                mx = std::max(mx, pm[(item * Hkv + kvh) * G + gi]);
            if (mx == -INFINITY) {  // no keys
                std::fill(o, o + D, 0.f);
                if (lse) lse[q_rows[b] * H + h] = -INFINITY;
                continue;
            }
            float L = 0.f;
            std::fill(o, o + D, 0.f);
            for (int64_t item = first[b]; item < first[b + 1]; ++item) {
                const int64_t s = (item * Hkv + kvh) * G + gi;
                if (pm[s] == -INFINITY) continue;
                const float w = std::exp(pm[s] - mx);
                L += pl[s] * w;
                const float* a = pacc.data() + s * D;
                for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
            }
            const float inv = 1.f / L;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
            if (lse) lse[q_rows[b] * H + h] = mx + std::log(L);
        }
    }
}

// paged_decode over a cache of element type kv (KvType)
void paged_decode_kv(int kv, const float* q, const int64_t* q_rows, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     const void* k_cache, const void* v_cache, const int64_t* page_idx, int64_t max_pages,
                     const int64_t* kv_lens, int64_t page_size, float scale, float* out, float* lse, int nt) {
    if (kv == kKvQ8)
        paged_decode(q, q_rows, B, H, Hkv, D, (const int8_t*)k_cache, (const int8_t*)v_cache, page_idx, max_pages,
                     kv_lens, page_size, scale, out, lse, nt);
    else if (kv == kKvF16)
        paged_decode(q, q_rows, B, H, Hkv, D, (const f16*)k_cache, (const f16*)v_cache, page_idx, max_pages, kv_lens,
                     page_size, scale, out, lse, nt);
    else if (kv == kKvBF16)
        paged_decode(q, q_rows, B, H, Hkv, D, (const bf16*)k_cache, (const bf16*)v_cache, page_idx, max_pages,
                     kv_lens, page_size, scale, out, lse, nt);
    else
        paged_decode(q, q_rows, B, H, Hkv, D, (const float*)k_cache, (const float*)v_cache, page_idx, max_pages,
                     kv_lens, page_size, scale, out, lse, nt);
}

void cascade_groups_kv(int kv, const float* q, int64_t H, int64_t Hkv, int64_t D, const void* k_cache,
                       const void* v_cache, int64_t page_size, int64_t n_groups, const int64_t* gp_ptr,
                       const int64_t* gp, const int64_t* gr_ptr, const int64_t* gr, float scale, float* out,
                       float* lse, int nt) {
    if (kv == kKvQ8)
        cascade_groups(q, H, Hkv, D, (const int8_t*)k_cache, (const int8_t*)v_cache, page_size, n_groups, gp_ptr, gp,
                       gr_ptr, gr, scale, out, lse, nt);
    else if (kv == kKvF16)
        cascade_groups(q, H, Hkv, D, (const f16*)k_cache, (const f16*)v_cache, page_size, n_groups, gp_ptr, gp, gr_ptr,
                       gr, scale, out, lse, nt);
    else if (kv == kKvBF16)
        cascade_groups(q, H, Hkv, D, (const bf16*)k_cache, (const bf16*)v_cache, page_size, n_groups, gp_ptr, gp,
                       gr_ptr, gr, scale, out, lse, nt);
    else
        cascade_groups(q, H, Hkv, D, (const float*)k_cache, (const float*)v_cache, page_size, n_groups, gp_ptr, gp,
                       gr_ptr, gr, scale, out, lse, nt);
}

// The projection of one weight, as described by the caller (see OcProj in engine/native/__init__.py).
struct OcProj {
    int64_t kind;  // 4 = int4 blocks, 8 = int8 rows, 1 = GGUF k-quant rows in segments (ggml_segments_matmul)
    const void* w;
    const float* scale;  // int8 only
    const float* bias;   // or null
    int64_t n, k;
    const int64_t* seg = nullptr;  // kind 1: nseg x {ggml type, rows, k}
    int64_t nseg = 0;
    int64_t seg_bytes = 0;         // kind 1: the bytes its rows hold (checks)
};

void project(const OcProj& p, const float* x, int64_t T, float* y, int nt);

inline void rms_norm(const float* x, const float* w, int64_t T, int64_t n, float eps, float* out) {
    for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + t * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; ++i) ss += (double)xr[i] * xr[i];
        const float inv = 1.f / std::sqrt((float)(ss / n) + eps);
        for (int64_t i = 0; i < n; ++i) out[t * n + i] = xr[i] * inv * w[i];
    }
}

// ---------------------------------------------------------------------------------------- GGUF rows
// GGUF (ggml) tensor rows as a model file is read: Q4_0 / Q4_1 / Q4_K rows moved into the int4 layout
// above (as qformats.gguf_to_q4_blocks does), and rows of several types decoded to fp32 and quantized to
// int8 per row (qformats.quantize_int8 of gguf-py's dequantize). Both give the Python code's bits: the
// same fp32 operations in the same order (a product is rounded before the add that follows it, never
// fused into an FMA), fp16 by round to nearest even (numpy's astype(float16)).
enum GgmlType : int {
    kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8, kGgmlQ4_K = 12, kGgmlQ5_K = 13,
    kGgmlQ6_K = 14, kGgmlBF16 = 30
};

// Values and bytes of one block of a type; false for a type these kernels do not decode.
inline bool ggml_block(int type, int64_t* values, int64_t* bytes) {
    switch (type) {
        case kGgmlF32: *values = 1; *bytes = 4; return true;
        case kGgmlF16: *values = 1; *bytes = 2; return true;
        case kGgmlBF16: *values = 1; *bytes = 2; return true;
        case kGgmlQ4_0: *values = 32; *bytes = 18; return true;
        case kGgmlQ4_1: *values = 32; *bytes = 20; return true;
        case kGgmlQ8_0: *values = 32; *bytes = 34; return true;
        case kGgmlQ4_K: *values = 256; *bytes = 144; return true;
        case kGgmlQ5_K: *values = 256; *bytes = 176; return true;
        case kGgmlQ6_K: *values = 256; *bytes = 210; return true;
        default: return false;
    }
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// The floats at p are in memory, rounded, before the code after this runs: the product written before
// it cannot be fused with the add after it (g++ contracts a * b + c into an FMA by default; gguf-py's
// numpy rounds the product first).
inline void round_products(float* p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One GGUF row of k values of ``type`` to fp32, as gguf-py's dequantize computes it.
void gguf_decode_row(int type, const uint8_t* row, int64_t k, float* out) {
    switch (type) {
        case kGgmlF32: std::memcpy(out, row, k * sizeof(float)); return;
        case kGgmlF16: for (int64_t i = 0; i < k; ++i) out[i] = half_to_float(load_u16(row + 2 * i)); return;
        case kGgmlBF16:
            for (int64_t i = 0; i < k; ++i) out[i] = to_float(bf16{load_u16(row + 2 * i)});
            return;
        case kGgmlQ4_0:  // d * (q - 8)
            for (int64_t b = 0; b < k / 32; ++b) {
                const uint8_t* blk = row + b * 18;
                const float d = half_to_float(load_u16(blk));
                float* o = out + b * 32;
                for (int j = 0; j < 16; ++j) {
                    o[j] = d * (float)((int)(blk[2 + j] & 0x0F) - 8);
                    o[j + 16] = d * (float)((int)(blk[2 + j] >> 4) - 8);
                }
            }
            return;
        case kGgmlQ4_1:  // (d * q) + m
            for (int64_t b = 0; b < k / 32; ++b) {
                const uint8_t* blk = row + b * 20;
                const float d = half_to_float(load_u16(blk)), m = half_to_float(load_u16(blk + 2));
                float* o = out + b * 32;
                for (int j = 0; j < 16; ++j) {
                    o[j] = d * (float)(blk[4 + j] & 0x0F);
                    o[j + 16] = d * (float)(blk[4 + j] >> 4);
                }
                round_products(o);
                for (int j = 0; j < 32; ++j) o[j] += m;
            }
            return;
        case kGgmlQ8_0:  // q * d
            for (int64_t b = 0; b < k / 32; ++b) {
                const uint8_t* blk = row + b * 34;
                const float d = half_to_float(load_u16(blk));
                for (int j = 0; j < 32; ++j) out[b * 32 + j] = (float)(int8_t)blk[2 + j] * d;
            }
            return;
        case kGgmlQ4_K:  // (d * sc) * q - (dmin * m) per sub-block of 32
        case kGgmlQ5_K:
            for (int64_t s = 0; s < k / 256; ++s) {
                const uint8_t* blk = row + s * (type == kGgmlQ4_K ? 144 : 176);
                const float d = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
                const uint8_t* qh = blk + 16;                                   // Q5_K: 32 bytes of high bits
                const uint8_t* qs = blk + (type == kGgmlQ4_K ? 16 : 48);        // 128 bytes of nibbles
                for (int j = 0; j < 8; ++j) {
                    uint8_t sc, mn;
                    scale_min_k4(j, blk + 4, &sc, &mn);
                    const float dl = d * (float)sc, ml = dmin * (float)mn;
                    const uint8_t* q = qs + (j / 2) * 32;
                    const int shift = (j & 1) * 4;
                    float* o = out + s * 256 + j * 32;
                    if (type == kGgmlQ4_K) {
                        for (int i = 0; i < 32; ++i) o[i] = dl * (float)((q[i] >> shift) & 0x0F);
                    } else {
                        for (int i = 0; i < 32; ++i)
                            o[i] = dl * (float)(((q[i] >> shift) & 0x0F) | (((qh[i] >> j) & 1) << 4));
                    }
                    round_products(o);
                    for (int i = 0; i < 32; ++i) o[i] -= ml;
                }
            }
            return;
        case kGgmlQ6_K:  // (d * sc) * (q - 32) per group of 16
            for (int64_t s = 0; s < k / 256; ++s) {
                const uint8_t* blk = row + s * 210;
                const uint8_t* ql = blk;
                const uint8_t* qh = blk + 128;
                const int8_t* sc = (const int8_t*)(blk + 192);
                const float d = half_to_float(load_u16(blk + 208));
                // each half of 128 values: 4 runs of 32 (value 32 c + l: ql[l + 32 (c & 1)]'s nibble c / 2,
                // qh[l]'s bits 2 c, 2 c + 1), each of two groups of 16 with their own scale
                for (int h = 0; h < 2; ++h)
                    for (int c = 0; c < 4; ++c)
                        for (int g = 0; g < 2; ++g) {
                            const int at = h * 128 + c * 32 + g * 16;
                            const float dl = d * (float)sc[at / 16];
                            const uint8_t* l4 = ql + h * 64 + (c & 1) * 32 + g * 16;
                            const uint8_t* h2 = qh + h * 32 + g * 16;
                            float* o = out + s * 256 + at;
                            for (int i = 0; i < 16; ++i) {
                                const int q = (((l4[i] >> (4 * (c >> 1))) & 0x0F) | (((h2[i] >> (2 * c)) & 3) << 4)) - 32;
                                o[i] = dl * (float)q;
                            }
                        }
            }
            return;
        default: return;
    }
}

// k fp32 values as int8 with one scale: amax / 127 (1 when all are 0), q = round-half-even(w / scale)
// clamped to +-127 (qformats.quantize_int8: fp32 division).
void quantize_row_int8(const float* w, int64_t k, int8_t* q, float* scale) {
    float amax = 0.f;
    int64_t i = 0;
#if OC_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m8 = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, _mm256_loadu_ps(w + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; i < k; ++i) amax = std::max(amax, std::fabs(w[i]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    i = 0;
#if OC_AVX2
    const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= k; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + i + 8 * j), sv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        // the packs interleave per 128-bit lane: dwords v0[0:4] v1[0:4] v2[0:4] v3[0:4] v0[4:8] ...
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(b, order));
    }
#endif
    for (; i < k; ++i) q[i] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(w[i] / s)));
    *scale = s;
}


// ---------------------------------------------------------------------------------------- k-quant rows
// Projections that read a GGUF's Q4_K and Q6_K super-blocks as the file stores them (256 values a
// block: Q4_K 144 bytes, 4.5 bits a weight; Q6_K 210 bytes, 6.56 bits), so a k-quant file is served
// at its own size: the int4 layout above takes 5 bits a weight for a Q4_K row (fp16 d and m per 32),
// int8 8.1 for a Q6_K one. Activations as in the int16 row path (per block of 32, |x| max / 32767); a
// Q4_K sub-block's scale d * sc and offset dmin * m are computed in fp32 from the file's fp16 and
// 6-bit integers (exact), a Q6_K group's (q - 32) * sc in int16 (|.| <= 4096: a pair of products with
// 15-bit activations fits an int32 lane with room for two pairs more).

// The 6-bit scales and mins of a Q4_K / Q5_K super-block (its 12 bytes at s) as 8 + 8 bytes, four at a
// time in 32-bit words (scale_min_k4's values): sub-blocks 0-3 take the low 6 bits of bytes 0-3
// (scales) and 4-7 (mins); 4-7 take bytes 8-11's low (scales) and high (mins) nibbles, with the top
// two bits of bytes 0-3 (scales) and 4-7 (mins) above them.
inline void k4_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    uint32_t a, b, c;
    std::memcpy(&a, s, 4);
    std::memcpy(&b, s + 4, 4);
    std::memcpy(&c, s + 8, 4);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, low2 = 0x03030303u;
    const uint32_t words[4] = {a & low6, (c & low4) | (((a >> 6) & low2) << 4), b & low6,
                               ((c >> 4) & low4) | (((b >> 6) & low2) << 4)};
    std::memcpy(sc, words, 8);
    std::memcpy(mn, words + 2, 8);
}

#if OC_AVX2
// The 6-bit scales (bytes 0-7) and mins (bytes 8-15) of a Q4_K super-block whose 12 scale bytes are at s
// (k4_scales in 32-bit lanes; reads 16 bytes: a Q4_K block's nibbles follow its scales).
inline __m128i k4_scales_v(const uint8_t* s) {
    const __m128i v = _mm_loadu_si128((const __m128i*)s);  // lanes a, b, c (bytes 0-3, 4-7, 8-11)
    const __m128i acbc = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));
    const __m128i aabb = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(acbc, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    const __m128i top = _mm_and_si128(_mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(aabb, 6), _mm_set1_epi8(3)), 4),
                                      _mm_setr_epi32(0, -1, 0, -1));
    return _mm_or_si128(low, top);
}

// The four runs of 32 six-bit values (0..63, one a byte) of half h of a Q6_K super-block at blk: run c
// holds ql[l + 32 (c & 1)]'s nibble c / 2 and qh[l]'s bits 2c, 2c + 1 (as gguf_decode_row reads them).
inline void q6k_runs(const uint8_t* blk, int h, __m256i* runs) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(blk + h * 64));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(blk + h * 64 + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + h * 32));
    runs[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    runs[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    runs[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
    runs[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

// lane j of v in every lane (j a constant at each call)
inline __m256 lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

// The k-quant kernels take the int16 activations of each block of 32 with its even values first, then its
// odd ones (x0 x2 ... x30 x1 x3 ... x31: permute_even_odd): 32 weight bytes loaded as 16-bit lanes then
// give the even values' weights by a mask and the odd ones' by a shift, with no widening shuffles.
inline void permute_even_odd(int16_t* x16, int64_t n) {
    int16_t tmp[32];
    for (int64_t b = 0; b < n; b += 32) {
        for (int m = 0; m < 16; ++m) {
            tmp[m] = x16[b + 2 * m];
            tmp[16 + m] = x16[b + 2 * m + 1];
        }
        std::memcpy(x16 + b, tmp, sizeof(tmp));
    }
}

// Per row of activations, the scale of each Q4_K sub-block's integer products (d sc_j dx_j: dd, R x stride)
// and the offset term sum_j (dmin m_j) sx_j (msum), a super-block (8 sub-blocks) at a time.
template <int R>
inline void q4k_block_scales(const uint8_t* wrow, const float* dx, const float* sx, int64_t ns, float* dd,
                             int64_t stride, float* msum) {
    const int64_t nb = ns * 8;
    __m256 ms[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) ms[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* blk = wrow + s * 144;
        const __m128i sm = k4_scales_v(blk + 4);
        const __m256 scf = _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(blk))),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(blk + 2))),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            _mm256_store_ps(dd + r * stride + s * 8, _mm256_mul_ps(scf, _mm256_loadu_ps(dx + r * nb + s * 8)));
            ms[r] = _mm256_fmadd_ps(mf, _mm256_loadu_ps(sx + r * nb + s * 8), ms[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) msum[r] = hsum(ms[r]);
}

// One Q4_K weight row against R rows of int16 activations (x16 even/odd per block of 32, dx its scales,
// sx the exact fp32 block sums): out[r] = sum_j (d sc_j dx_j) <q_j, x16_j> - sum_j (dmin m_j) sx_j, the
// scales first (q4k_block_scales), then the products. A chunk of 64 values is 32 bytes: byte i holds value
// i of sub-block 2c (low nibble) and of 2c + 1 (high). K <= 16384 (callers check).
template <int R>
inline void q4k_row_i16(const int16_t* x16, const float* dx, int64_t K, const uint8_t* wrow, const float* sx,
                        float* out) {
    constexpr int64_t kMaxBlocks = 512;
    const int64_t ns = K / 256;
    alignas(32) float dd[R][kMaxBlocks];
    float msum[R];
    q4k_block_scales<R>(wrow, dx, sx, ns, dd[0], kMaxBlocks, msum);
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* qs = wrow + s * 144 + 16;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + c * 32));  // 16-bit lane m: bytes 2m, 2m+1
            const __m256i le = _mm256_and_si256(v, low4), lo = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
            const __m256i he = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), ho = _mm256_srli_epi16(v, 12);
            const int64_t j = s * 8 + 2 * c;  // sub-block of the low nibbles
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int16_t* xb = x16 + r * K + s * 256 + c * 64;
                const __m256i pl = dot_i16(_mm256_madd_epi16(le, _mm256_loadu_si256((const __m256i*)xb)), lo,
                                           _mm256_loadu_si256((const __m256i*)(xb + 16)));
                const __m256i ph = dot_i16(_mm256_madd_epi16(he, _mm256_loadu_si256((const __m256i*)(xb + 32))), ho,
                                           _mm256_loadu_si256((const __m256i*)(xb + 48)));
                acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + j), _mm256_cvtepi32_ps(pl), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd[r] + j + 1), _mm256_cvtepi32_ps(ph), acc[r][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - msum[r];
}

// One Q6_K weight row against R rows of int16 activations (even/odd per block of 32; gs: the sums of each
// group of 16 activations, as floats). Per half super-block (128 values) the low nibbles of ql[0..63] and
// the 2-bit pairs of qh[0..31] make four runs of 32 (run c: ql[l + 32 (c & 1)]'s nibble c / 2 and qh[l]'s
// bits 2c, 2c + 1, as gguf_decode_row reads them), each run one activation block whose two groups of 16
// have their own int8 scale. The weights are taken unsigned (q, 0..63) and the offset -32 applied once a
// super-block: out = sum_g S_g <q_g, x16_g> - 32 sum_g S_g sum(x16_g), S_g = d sc_g dx (the products fit
// fp32 exactly: 4 x 63 x 32767 < 2^24 a lane).
template <int R>
inline void q6k_row_i16(const int16_t* x16, const float* dx, const float* gs, int64_t K, const uint8_t* wrow,
                        float* out) {
    const int64_t ns = K / 256, nb = K / 32, ng = K / 16;
    __m256 acc[R][2], corr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = corr[r] = _mm256_setzero_ps();
    const __m256i low8 = _mm256_set1_epi16(0xFF);
    const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* blk = wrow + s * 210;
        const __m256 d = _mm256_set1_ps(half_to_float(load_u16(blk + 208)));
        const __m256 sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 192)))));
        const __m256 sc1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 200)))));
        __m256 S[R][2];  // S_g for groups 0-7 (the first half's) and 8-15
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m256 dxv = _mm256_loadu_ps(dx + r * nb + s * 8);
            S[r][0] = _mm256_mul_ps(sc0, _mm256_permutevar8x32_ps(dxv, pairs_lo));
            S[r][1] = _mm256_mul_ps(sc1, _mm256_permutevar8x32_ps(dxv, pairs_hi));
            corr[r] = _mm256_fmadd_ps(S[r][0], _mm256_loadu_ps(gs + r * ng + s * 16), corr[r]);
            corr[r] = _mm256_fmadd_ps(S[r][1], _mm256_loadu_ps(gs + r * ng + s * 16 + 8), corr[r]);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            __m256i runs[4];
            q6k_runs(blk, h, runs);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                const __m256i ev = _mm256_and_si256(runs[c], low8), od = _mm256_srli_epi16(runs[c], 8);
                const __m256i sel = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                      2 * c + 1);
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int16_t* xb = x16 + r * K + s * 256 + h * 128 + c * 32;
                    const __m256i p = dot_i16(_mm256_madd_epi16(ev, _mm256_loadu_si256((const __m256i*)xb)), od,
                                              _mm256_loadu_si256((const __m256i*)(xb + 16)));
                    acc[r][c & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(S[r][h], sel), _mm256_cvtepi32_ps(p),
                                                    acc[r][c & 1]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - 32.f * hsum(corr[r]);
}
#endif

#if OC_AVX2
// --- int8 activations per super-block (llama.cpp's Q8_K blocks), integer sub-block scales ----------------
// Per row and super-block of 256 values: x8 = round(x / dx), dx = |x| max / 127, and the integer sums of each
// group of 16 of x8 (bs: Q4_K's min term and Q6_K's -32 offset, from the rounded values as the products are:
// the error of a product is then the centred weights' (d sc q - dmin m) times the rounding, not d sc q's).
// The products of a super-block then add up in int32 with the sub-blocks' integer scales applied by
// _mm256_madd_epi16, and turn to fp32 once a super-block (d dx): a quarter of the int16 path's float work
// and half its integer multiplies. The rounding is a step of |x| max / 127 per 256 values (llama.cpp's).
struct Q8K {
    std::vector<int8_t> x8;
    std::vector<float> dx;
    std::vector<int16_t> bs;
    void quantize(const float* x, int64_t T, int64_t K) {
        const int64_t ns = K / 256;
        x8.resize(T * K);
        dx.resize(T * ns);
        bs.resize(T * K / 16);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t s = 0; s < ns; ++s) {
                const int64_t o = t * K + s * 256;
                const float* xs = x + o;
                __m256 mx = _mm256_setzero_ps();
                for (int i = 0; i < 32; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + 8 * i)));
                alignas(32) float m8[8];
                _mm256_store_ps(m8, mx);
                float amax = 0.f;
                for (int i = 0; i < 8; ++i) amax = std::max(amax, m8[i]);
                dx[t * ns + s] = amax / 127.f;
                const __m256 inv = _mm256_set1_ps(amax > kTinyGroup ? 127.f / amax : 0.f);
                for (int b = 0; b < 8; ++b) {
                    const float* xb = xs + 32 * b;
                    __m256i q[4];
                    for (int i = 0; i < 4; ++i) {
                        const __m256 v = _mm256_loadu_ps(xb + 8 * i);
                        q[i] = _mm256_cvtps_epi32(
                            _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                    }
                    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
                    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
                    _mm256_storeu_si256((__m256i*)(x8.data() + o + 32 * b), p);
                    for (int g = 0; g < 2; ++g) {
                        int32_t acc = 0;
                        for (int j = 0; j < 16; ++j) acc += x8[o + 32 * b + 16 * g + j];
                        bs[(o >> 4) + 2 * b + g] = (int16_t)acc;
                    }
                }
            }
    }
};

// One Q4_K weight row against R rows of Q8K activations: out[r] = sum_s dx_rs (d_s sum_j sc_j <q_j, x8_j> -
// dmin_s sum_j m_j sum(x8_j)). A chunk of 64 values is 32 bytes: byte i holds value i of sub-block 2c (low nibble)
// and of 2c + 1 (high); maddubs multiplies the unsigned nibbles by x8 and pairs them (|pair| <= 2 x 15 x
// 127), madd by the sub-block's scale (<= 63) sums the pairs into 8 int32 lanes (|lane| < 2^22 a super-block).
template <int R>
inline void q4k_row_q8(const Q8K& a, int64_t t, int64_t K, const uint8_t* wrow, float* out) {
    const int64_t ns = K / 256, ng = K / 16;
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* blk = wrow + s * 144;
        const __m128i sm = k4_scales_v(blk + 4);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // the 8 scales as int16, twice
        const __m128i mins = _mm_srli_si128(sm, 8);
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));  // m_j for groups 2j, 2j + 1
        const float d = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
        __m256i isum[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {  // the min term first (its registers free for the products)
            isum[r] = _mm256_setzero_si256();
            const __m256 msum = _mm256_cvtepi32_ps(
                _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i*)(a.bs.data() + (t + r) * ng + s * 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * a.dx[(t + r) * ns + s]), msum, acc[r]);
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + c * 32));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            // scale 2c / 2c + 1 in every 16-bit lane (bytes 4c, 4c + 1 / 4c + 2, 4c + 3 of sc16)
            const __m256i slo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((int16_t)((4 * c + 1) << 8 | 4 * c)));
            const __m256i shi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((int16_t)((4 * c + 3) << 8 | (4 * c + 2))));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int8_t* xb = a.x8.data() + (t + r) * K + s * 256 + c * 64;
                const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xb));
                const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xb + 32)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pl, slo), _mm256_madd_epi16(ph, shi)));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.dx[(t + r) * ns + s]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// One Q6_K weight row against R rows of Q8K activations: q6k_runs' four runs of 32 unsigned values (0..63) a
// half super-block, each one block of x8 whose two groups of 16 have their own int8 scale: maddubs pairs the
// products (|pair| <= 2 x 63 x 127), madd by the group's scale (the low 128 bits hold group 2c, the high
// 2c + 1) sums them in int32; the -32 offset is 32 sum_g sc_g bs_g, one madd a super-block.
template <int R>
inline void q6k_row_q8(const Q8K& a, int64_t t, int64_t K, const uint8_t* wrow, float* out) {
    const int64_t ns = K / 256, ng = K / 16;
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* blk = wrow + s * 210;
        const float d = half_to_float(load_u16(blk + 208));
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));  // 16 scales
        __m256i isum[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)  // -32 sum_g sc_g bs_g
            isum[r] = _mm256_slli_epi32(
                _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i*)(a.bs.data() + (t + r) * ng + s * 16))), 5);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[r]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            __m256i runs[4];
            q6k_runs(blk, h, runs);
            // the half's 8 scales in both 128-bit lanes
            const __m256i sch = _mm256_permute4x64_epi64(sc, h == 0 ? 0x44 : 0xEE);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                // group 2c's scale in the low 128 bits, 2c + 1's in the high
                const __m256i sel = _mm256_setr_epi8(
                    4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c,
                    4 * c + 1, 4 * c, 4 * c + 1, 4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2,
                    4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3, 4 * c + 2, 4 * c + 3,
                    4 * c + 2, 4 * c + 3);
                const __m256i scv = _mm256_shuffle_epi8(sch, sel);
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int8_t* xb = a.x8.data() + (t + r) * K + s * 256 + h * 128 + c * 32;
                    const __m256i p = _mm256_maddubs_epi16(runs[c], _mm256_loadu_si256((const __m256i*)xb));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scv));
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.dx[(t + r) * ns + s]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}
#endif

#if OC_AVX2
// One Q4_K / Q6_K row of K values as fp32 (the panels of a prefill chunk): the values gguf_decode_row
// gives, each within an FMA's rounding of them (panels need no bit-equality with gguf-py).
inline void kquant_decode_row(int type, const uint8_t* row, int64_t K, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    auto store32 = [&](float* o, __m256i bytes, __m256 scale, __m256 offset) {  // 32 u8 values * scale + offset
        const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), scale,
                                                        offset));
    };
    for (int64_t s = 0; s < K / 256; ++s) {
        float* o = out + s * 256;
        if (type == kGgmlQ4_K) {
            const uint8_t* blk = row + s * 144;
            const __m128i sm = k4_scales_v(blk + 4);
            alignas(32) float dl[8], ml[8];
            _mm256_store_ps(dl, _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(blk))),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
            _mm256_store_ps(ml, _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(blk + 2))),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)))));
            for (int c = 0; c < 4; ++c) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
                store32(o + 64 * c, _mm256_and_si256(v, m4), _mm256_set1_ps(dl[2 * c]), _mm256_set1_ps(ml[2 * c]));
                store32(o + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_set1_ps(dl[2 * c + 1]),
                        _mm256_set1_ps(ml[2 * c + 1]));
            }
        } else {
            const uint8_t* blk = row + s * 210;
            const float d = half_to_float(load_u16(blk + 208));
            const int8_t* sc = (const int8_t*)(blk + 192);
            for (int h = 0; h < 2; ++h) {
                __m256i runs[4];
                q6k_runs(blk, h, runs);
                for (int c = 0; c < 4; ++c) {
                    float* oc = o + h * 128 + c * 32;
                    const float s0 = d * (float)sc[h * 8 + 2 * c], s1 = d * (float)sc[h * 8 + 2 * c + 1];
                    const __m128i lo = _mm256_castsi256_si128(runs[c]), hi = _mm256_extracti128_si256(runs[c], 1);
                    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    for (int i = 0; i < 4; ++i) {  // (q - 32) * s: values 0-15 take s0, 16-31 s1
                        const __m256 sv = _mm256_set1_ps(i < 2 ? s0 : s1);
                        _mm256_storeu_ps(oc + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), sv,
                                                                     _mm256_mul_ps(sv, _mm256_set1_ps(-32.f))));
                    }
                }
            }
        }
    }
}
#endif

// Whether the k-quant projections read blocks of this ggml type.
inline bool ggml_kernel_type(int type) { return type == kGgmlQ4_K || type == kGgmlQ6_K; }

// y [T, N] (row stride ldy) = x [T, K] @ W.T (+ bias), W n rows of ggml type ``type`` (Q4_K / Q6_K)
// as the file stores them. By default (AVX2) every row count takes int8 activations per super-block (Q8K,
// kI8MaxRowsK); with that path off (oc_kquant_i8_rows(0)): fp32 panels from kGemmMinRowsQ4 rows (each row
// decoded as gguf_decode_row does), the int16 row kernels below; without AVX2 each weight row decoded then
// dotted in fp32.
void ggml_matmul(const float* x, int64_t T, int64_t K, int type, const uint8_t* w, int64_t N, const float* bias,
                 float* y, int nt) {
    const int64_t row_bytes = K / 256 * (type == kGgmlQ4_K ? 144 : 210), nb = K / 32;
#if OC_AVX2
    if (T <= kI8MaxRowsK) {
        Q8K a;
        a.quantize(x, T, K);
        matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
            float out[kRows];
            const uint8_t* wrow = w + n * row_bytes;
            rows_421(rows, [&](auto R, int64_t r) {
                constexpr int Rc = decltype(R)::value;
                if (type == kGgmlQ4_K) q4k_row_q8<Rc>(a, t0 + r, K, wrow, out + r);
                else q6k_row_q8<Rc>(a, t0 + r, K, wrow, out + r);
            });
            store_rows(y, N, t0, rows, n, out, bias);
        }, w, row_bytes);
        return;
    }
#endif
    if (T >= kGemmMinRowsQ4) {
        gemm_panels(x, T, K, N, bias, y, nt, [&](int64_t n, float* row) {
#if OC_AVX2
            kquant_decode_row(type, w + n * row_bytes, K, row);
#else
            gguf_decode_row(type, w + n * row_bytes, K, row);
#endif
        });
        return;
    }
#if OC_AVX2
    if (T <= kI16MaxRows && nb <= 512) {
        std::vector<int16_t> x16;
        std::vector<float> dx, sx(type == kGgmlQ4_K ? T * nb : T * K / 16);
        quantize_i16(x, T, K, x16, dx);
        if (type == kGgmlQ4_K) {
            for (int64_t b = 0; b < T * nb; ++b) {  // the exact fp32 sums of each block of 32 (rows contiguous)
                float s = 0.f;
                for (int j = 0; j < 32; ++j) s += x[b * 32 + j];
                sx[b] = s;
            }
        } else {
            for (int64_t g = 0; g < T * K / 16; ++g) {  // the int16 sums of each group of 16 (exact)
                int32_t s = 0;
                for (int j = 0; j < 16; ++j) s += x16[g * 16 + j];
                sx[g] = (float)s;
            }
        }
        permute_even_odd(x16.data(), T * K);
        matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
            float out[kRows];
            const uint8_t* wrow = w + n * row_bytes;
            rows_421(rows, [&](auto R, int64_t r) {
                constexpr int Rc = decltype(R)::value;
                const int64_t t = t0 + r;
                if (type == kGgmlQ4_K)
                    q4k_row_i16<Rc>(x16.data() + t * K, dx.data() + t * nb, K, wrow, sx.data() + t * nb, out + r);
                else
                    q6k_row_i16<Rc>(x16.data() + t * K, dx.data() + t * nb, sx.data() + t * K / 16, K, wrow, out + r);
            });
            store_rows(y, N, t0, rows, n, out, bias);
        }, w, row_bytes);
        return;
    }
#endif
    std::vector<float> rows_f(nt * K);
    matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
        float* wf = rows_f.data() + omp_get_thread_num() * K;
        gguf_decode_row(type, w + n * row_bytes, K, wf);
        float out[kRows];
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + (t0 + r) * K;
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += wf[k] * xr[k];
            out[r] = s;
        }
        store_rows(y, N, t0, rows, n, out, bias);
    }, w, row_bytes);
}

// A projection of row segments, each of one ggml type: seg[i] = {type, rows, k} (a fused q/k/v whose
// v is Q6_K and q, k Q4_K, as Q4_K_M files have in some layers). One segment writes y directly; more
// each compute their columns apart and are copied into place (a decode step's few rows).
void ggml_segments_matmul(const float* x, int64_t T, int64_t K, const int64_t* seg, int64_t nseg, const uint8_t* w,
                          int64_t N, const float* bias, float* y, int nt) {
    if (nseg == 1) {
        ggml_matmul(x, T, K, (int)seg[0], w, N, bias, y, nt);
        return;
    }
    std::vector<float> part;
    int64_t n0 = 0;
    for (int64_t i = 0; i < nseg; ++i) {
        const int type = (int)seg[3 * i];
        const int64_t rows = seg[3 * i + 1];
        part.resize(T * rows);
        ggml_matmul(x, T, K, type, w, rows, bias ? bias + n0 : nullptr, part.data(), nt);
        for (int64_t t = 0; t < T; ++t) std::memcpy(y + t * N + n0, part.data() + t * rows, rows * sizeof(float));
        w += rows * (K / 256) * (type == kGgmlQ4_K ? 144 : 210);
        n0 += rows;
    }
}
}  // namespace

extern "C" {

int oc_abi_version() { return 12; }

// The row counts from which the int4 / int8 projections fill fp32 panels (values < 1: unchanged);
// the ones before the call go to *old_q4, *old_q8 when given.
void oc_gemm_min_rows(int64_t q4, int64_t q8, int64_t* old_q4, int64_t* old_q8) {
    if (old_q4) *old_q4 = kGemmMinRowsQ4;
    if (old_q8) *old_q8 = kGemmMinRowsQ8;
    if (q4 >= 1) kGemmMinRowsQ4 = q4;
    if (q8 >= 1) kGemmMinRowsQ8 = q8;
}
int oc_simd() { return OC_AVX2; }

// The largest row counts of the int8-activation row paths of int4 / int8 weights (values < 0:
// unchanged; 0: off); the ones before the call go to *old_q4, *old_q8 when given.
void oc_act_rows(int64_t q4, int64_t q8, int64_t* old_q4, int64_t* old_q8) {
    if (old_q4) *old_q4 = kI8MaxRowsQ4;
    if (old_q8) *old_q8 = kI8MaxRowsQ8;
    if (q4 >= 0) kI8MaxRowsQ4 = q4;
    if (q8 >= 0) kI8MaxRowsQ8 = q8;
}

// The largest row count of the k-quant projections' int8-activation path (values < 0: unchanged; 0: off);
// the one before the call goes to *old when given.
void oc_kquant_i8_rows(int64_t rows, int64_t* old) {
    if (old) *old = kI8MaxRowsK;
    if (rows >= 0) kI8MaxRowsK = rows;
}

// The largest row count of the int16 row paths (values < 1: unchanged); the one before the call
// goes to *old when given.
void oc_i16_rows(int64_t rows, int64_t* old) {
    if (old) *old = kI16MaxRows;
    if (rows >= 1) kI16MaxRows = rows;
}

// y [T, N] = x [T, K] @ W.T (+ bias), W int4 blocks as above. K % 32 == 0.
void oc_q4_matmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
                  int nt) {
    const int64_t nb = K / 32;
    std::vector<float> sx(T * nb);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            float s = 0.f;
            for (int j = 0; j < 32; ++j) s += x[t * K + b * 32 + j];
            sx[t * nb + b] = s;
        }
    const int64_t row_bytes = nb * kQ4Block;
    if (T >= kGemmMinRowsQ4) {
        gemm_panels(x, T, K, N, bias, y, nt, [&](int64_t n, float* row) {
            const uint8_t* wrow = w + n * row_bytes;
            uint16_t dh, mh;
            for (int64_t b = 0; b < nb; ++b) {
                std::memcpy(&dh, wrow + nb * 16 + b * 2, 2);
                std::memcpy(&mh, wrow + nb * 18 + b * 2, 2);
                const float d = half_to_float(dh), m = half_to_float(mh);
                const uint8_t* qs = wrow + b * 16;
#if OC_AVX2
                const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
                const __m128i raw = _mm_loadu_si128((const __m128i*)qs), low4 = _mm_set1_epi8(0x0F);
                const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int i = 0; i < 4; ++i)
                    _mm256_storeu_ps(row + b * 32 + i * 8,
                                     _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), mv));
                continue;
#endif
                for (int j = 0; j < 16; ++j) {
                    row[b * 32 + j] = d * (qs[j] & 0x0F) + m;
                    row[b * 32 + j + 16] = d * (qs[j] >> 4) + m;
                }
            }
        });
        return;
    }
#if OC_AVX2
    if (T <= kI8MaxRowsQ4 && nb <= 512) {
        std::vector<int8_t> x8;
        std::vector<float> dx;
        quantize_i8(x, T, K, x8, dx);
        matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
            float out[kRows];
            const uint8_t* wrow = w + n * row_bytes;
            with_rows(rows, [&](auto R) {
                q4_row_i8<decltype(R)::value>(x8.data() + t0 * K, dx.data() + t0 * nb, K, wrow, sx.data() + t0 * nb,
                                              nb, out);
            });
            store_rows(y, N, t0, rows, n, out, bias);
        }, w, row_bytes);
        return;
    }
    if (T <= kI16MaxRows && nb <= 512) {
        std::vector<int16_t> x16;
        std::vector<float> dx;
        quantize_i16(x, T, K, x16, dx);
        matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
            float out[kRows];
            const uint8_t* wrow = w + n * row_bytes;
            rows_421(rows, [&](auto R, int64_t r) {
                const int64_t t = t0 + r;
                q4_row_i16<decltype(R)::value>(x16.data() + t * K, dx.data() + t * nb, K, wrow, sx.data() + t * nb, nb,
                                               out + r);
            });
            store_rows(y, N, t0, rows, n, out, bias);
        }, w, row_bytes);
        return;
    }
#endif
    matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
        float out[kRows];
        const float* xs = x + t0 * K;
        const float* ss = sx.data() + t0 * nb;
        const uint8_t* wrow = w + n * row_bytes;
        with_rows(rows, [&](auto R) { q4_row<decltype(R)::value>(xs, K, wrow, ss, nb, out); });
        store_rows(y, N, t0, rows, n, out, bias);
    }, w, row_bytes);
}

// y [T, N] = x [T, K] @ (q * scale[:, None]).T (+ bias), q int8 [N, K].
void oc_q8_matmul(const float* x, int64_t T, int64_t K, const int8_t* q, const float* scale, int64_t N,
                  const float* bias, float* y, int nt) {
    if (T >= kGemmMinRowsQ8) {
        gemm_panels(x, T, K, N, bias, y, nt, [&](int64_t n, float* row) {
            const int8_t* wrow = q + n * K;
            for (int64_t k = 0; k < K; ++k) row[k] = wrow[k] * scale[n];
        });
        return;
    }
#if OC_AVX2
    if (T <= kI8MaxRowsQ8 && K % 32 == 0) {
        const int64_t nb = K / 32;
        std::vector<int8_t> x8;
        std::vector<float> dx;
        quantize_i8(x, T, K, x8, dx);
        matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
            float out[kRows];
            const int8_t* wrow = q + n * K;
            with_rows(rows, [&](auto R) {
                q8_row_i8<decltype(R)::value>(x8.data() + t0 * K, dx.data() + t0 * nb, K, wrow, scale[n], nb, out);
            });
            store_rows(y, N, t0, rows, n, out, bias);
        }, q, K);
        return;
    }
    if (T <= kI16MaxRows && K % 32 == 0) {
        // activation groups of 64 values where K allows (groups of 128 measured no faster), else 32
        const int64_t nb = K / 32, S = nb % 2 == 0 ? 2 : 1, ng = nb / S;
        std::vector<int16_t> x16;
        std::vector<float> dx;
        quantize_i16(x, T, K, x16, dx, S);
        auto rows_of = [&](auto s) {
            constexpr int Sc = decltype(s)::value;
            matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
                float out[kRows];
                const int8_t* wrow = q + n * K;
                rows_421(rows, [&](auto R, int64_t r) {
                    const int64_t t = t0 + r;
                    q8_row_i16<decltype(R)::value, Sc>(x16.data() + t * K, dx.data() + t * ng, K, wrow, scale[n], ng,
                                                       out + r);
                });
                store_rows(y, N, t0, rows, n, out, bias);
            }, q, K);
        };
        if (S == 2) rows_of(std::integral_constant<int, 2>{});
        else rows_of(std::integral_constant<int, 1>{});
        return;
    }
#endif
    matmul_driver(T, N, nt, [&](int64_t t0, int64_t rows, int64_t n) {
        float out[kRows];
        const float* xs = x + t0 * K;
        const int8_t* wrow = q + n * K;
        with_rows(rows, [&](auto R) { q8_row<decltype(R)::value>(xs, K, wrow, scale[n], out); });
        store_rows(y, N, t0, rows, n, out, bias);
    }, q, K);
}

// rows vectors of D fp32 values rounded (q8: quantized) into KV cache elements of kv_type, as the fused
// decode layer writes them.
void oc_kv_store(int kv_type, void* dst, const float* src, int64_t rows, int64_t D) {
    store_kv(kv_type, dst, src, rows, D);
}

// rows q8 vectors of D values (D + 4 bytes each, contiguous) as fp32 [rows, D]: q * s, one rounding, as
// engine/kv/q8.py computes it (the torch attention path reads q8 pages through this).
void oc_q8_dequant(const int8_t* src, int64_t rows, int64_t D, float* dst, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * D >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t* v = src + r * (D + kQ8Scale);
        float s;
        std::memcpy(&s, v + D, sizeof(float));
        float* o = dst + r * D;
        int64_t i = 0;
#if OC_AVX2
        const __m256 sv = _mm256_set1_ps(s);
        for (; i + 8 <= D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(load8(v + i), sv));
#endif
        for (; i < D; ++i) o[i] = (float)v[i] * s;
    }
}

// y [T, N] = x [T, K] @ W.T (+ bias), W the rows of nseg segments (seg: nseg x {ggml type, rows, k}; Q4_K
// or Q6_K, K a multiple of 256), each as the GGUF stores it, one after the other at w.
void oc_ggml_matmul(const float* x, int64_t T, int64_t K, const int64_t* seg, int64_t nseg, const uint8_t* w,
                    int64_t N, const float* bias, float* y, int nt) {
    ggml_segments_matmul(x, T, K, seg, nseg, w, N, bias, y, nt);
}

// Bytes of one GGUF row of k values of ggml type ``type``; -1 when these kernels do not decode the type
// or k is not a whole number of its blocks.
int64_t oc_gguf_row_bytes(int type, int64_t k) {
    int64_t values, bytes;
    if (!ggml_block(type, &values, &bytes) || k <= 0 || k % values) return -1;
    return k / values * bytes;
}

// n GGUF rows of k values of Q4_0 (2), Q4_1 (3) or Q4_K (12) (oc_gguf_row_bytes each, contiguous) into
// the int4 layout, uint8 [n, k/32 * 20], as qformats.gguf_to_q4_blocks moves them: Q4_0 / Q4_1 byte
// for byte (Q4_0's offset -8 d computed in fp32, rounded to fp16), Q4_K's sub-block scale d * sc and
// offset -(dmin * m) computed in fp32 and rounded to fp16. Returns how many Q4_K scales or offsets
// overflow fp16 (inf: the caller refuses the tensor); -1 for another type.
int64_t oc_gguf_q4_blocks(const uint8_t* raw, int type, int64_t n, int64_t k, uint8_t* out, int nt) {
    if (type != kGgmlQ4_0 && type != kGgmlQ4_1 && type != kGgmlQ4_K) return -1;
    const int64_t rb = oc_gguf_row_bytes(type, k), nb = k / 32;
    int64_t bad = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : bad) if (n * k >= (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t* src = raw + r * rb;
        uint8_t* nib = out + r * nb * 20;
        uint8_t* dp = nib + nb * 16;
        uint8_t* mp = nib + nb * 18;
        if (type != kGgmlQ4_K) {
            const int64_t bs = type == kGgmlQ4_0 ? 18 : 20;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = src + b * bs;
                std::memcpy(nib + b * 16, blk + bs - 16, 16);
                std::memcpy(dp + b * 2, blk, 2);
                if (type == kGgmlQ4_0) store_u16(mp + b * 2, float_to_half(-8.f * half_to_float(load_u16(blk))));
                else std::memcpy(mp + b * 2, blk + 2, 2);
            }
            continue;
        }
        for (int64_t s = 0; s < k / 256; ++s) {
            const uint8_t* blk = src + s * 144;
            const float d = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
            for (int j = 0; j < 8; ++j) {
                uint8_t sc, mn;
                scale_min_k4(j, blk + 4, &sc, &mn);
                const uint16_t dh = float_to_half(d * (float)sc), mh = float_to_half(-(dmin * (float)mn));
                bad += (dh & 0x7C00) == 0x7C00;
                bad += (mh & 0x7C00) == 0x7C00;
                store_u16(dp + (s * 8 + j) * 2, dh);
                store_u16(mp + (s * 8 + j) * 2, mh);
            }
            // 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones; the layout's
            // byte i of a sub-block holds its value i (low) and i + 16 (high)
            const uint8_t* qs = blk + 16;
            uint8_t* o = nib + s * 8 * 16;
            for (int c = 0; c < 4; ++c) {
                const uint8_t* lo = qs + c * 32;
                const uint8_t* hi = lo + 16;
                for (int i = 0; i < 16; ++i) {
                    o[(2 * c) * 16 + i] = (uint8_t)((lo[i] & 0x0F) | ((hi[i] & 0x0F) << 4));
                    o[(2 * c + 1) * 16 + i] = (uint8_t)((lo[i] >> 4) | (hi[i] & 0xF0));
                }
            }
        }
    }
    return bad;
}

// n GGUF rows of k values of ``type`` (oc_gguf_row_bytes each, contiguous) decoded to fp32 as gguf-py's
// dequantize computes them, then per row int8 q [n, k] and fp32 scale [n] as qformats.quantize_int8
// computes them. Returns 0, or -1 for a type it does not decode.
int oc_gguf_to_q8_rows(const uint8_t* raw, int type, int64_t n, int64_t k, int8_t* q, float* scale, int nt) {
    const int64_t rb = oc_gguf_row_bytes(type, k);
    if (rb < 0) return -1;
#pragma omp parallel num_threads(nt) if (n * k >= (1 << 16))
    {
        std::vector<float> w(k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            gguf_decode_row(type, raw + r * rb, k, w.data());
            quantize_row_int8(w.data(), k, q + r * k, scale + r);
        }
    }
    return 0;
}

// kv_type: the cache's element type (0 fp32, 1 fp16, 2 bf16, 3 q8).
void oc_paged_decode(const float* q, const int64_t* q_rows, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     const void* k_cache, const void* v_cache, const int64_t* page_idx, int64_t max_pages,
                     const int64_t* kv_lens, int64_t page_size, float scale, float* out, float* lse, int kv_type,
                     int nt) {
    paged_decode_kv(kv_type, q, q_rows, B, H, Hkv, D, k_cache, v_cache, page_idx, max_pages, kv_lens, page_size, scale,
                    out, lse, nt);
}

// Shared-prefix (cascade) attention, the shared part, merged into out / lse in place (see
// cascade_groups): q [*, H, D] fp32; out [*, H, D] fp32 and lse [*, H] hold each row's partial over its
// other keys (-inf: none yet). kv_type as oc_paged_decode.
void oc_cascade_groups(const float* q, int64_t H, int64_t Hkv, int64_t D, const void* k_cache, const void* v_cache,
                       int64_t page_size, int64_t n_groups, const int64_t* group_page_ptr, const int64_t* group_pages,
                       const int64_t* group_row_ptr, const int64_t* group_rows, float scale, float* out, float* lse,
                       int kv_type, int nt) {
    cascade_groups_kv(kv_type, q, H, Hkv, D, k_cache, v_cache, page_size, n_groups, group_page_ptr, group_pages,
                      group_row_ptr, group_rows, scale, out, lse, nt);
}

// One decoder layer for T decode rows (one new token per sequence), in place on the residual stream
// x [T, hidden]: RMSNorm, fused q/k/v projection, RoPE (HF halves convention: x * cos + roll(x, D/2) *
// sin_signed), K/V written to their cache slots, paged attention, output projection + residual,
// RMSNorm, fused gate/up, SiLU(gate) * up, down projection + residual. ``proj``: qkv, o, gate_up, down.
// oc_decode_layer_cascade: the same layer with shared-prefix (cascade) attention: page_idx / kv_lens hold
// each row's own (private) pages, and the n_groups groups (as oc_cascade_groups) the shared page runs,
// merged in through the log-sum-exp. n_groups 0: plain paged attention (oc_decode_layer).
void oc_decode_layer_cascade(float* x, int64_t T, int64_t hidden, const float* in_norm, const float* post_norm,
                             float eps, const OcProj* proj, const float* cos, const float* sin_signed,
                             const int64_t* slots, void* k_cache, void* v_cache, const int64_t* q_rows,
                             const int64_t* page_idx, int64_t max_pages, const int64_t* kv_lens, int64_t page_size,
                             int64_t H, int64_t Hkv, int64_t D, float scale, int kv_type, int nt, int64_t n_groups,
                             const int64_t* group_page_ptr, const int64_t* group_pages, const int64_t* group_row_ptr,
                             const int64_t* group_rows) {
    const int64_t qn = H * D, kvn = Hkv * D, qkv_n = qn + 2 * kvn, inter = proj[2].n / 2;
    std::vector<float> hs(T * std::max(hidden, inter)), qkv(T * qkv_n), attn(T * qn), big(T * proj[2].n);
    rms_norm(x, in_norm, T, hidden, eps, hs.data());
    project(proj[0], hs.data(), T, qkv.data(), nt);
    const int64_t half = D / 2;
    std::vector<float> tmp(D);
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + t * D;
        const float* sn = sin_signed + t * D;
        for (int64_t j = 0; j < H + Hkv; ++j) {
            float* v = qkv.data() + t * qkv_n + j * D;
            for (int64_t i = 0; i < D; ++i) tmp[i] = v[i] * c[i] + v[(i + half) % D] * sn[i];
            std::memcpy(v, tmp.data(), D * sizeof(float));
        }
        const int64_t at = slots[t] * Hkv * kv_row_bytes(kv_type, D);  // bytes
        store_kv(kv_type, (char*)k_cache + at, qkv.data() + t * qkv_n + qn, Hkv, D);
        store_kv(kv_type, (char*)v_cache + at, qkv.data() + t * qkv_n + qn + kvn, Hkv, D);
    }
    // q rows live inside qkv (row stride qkv_n): copy them dense for the attention kernel
    std::vector<float> q(T * qn);
    for (int64_t t = 0; t < T; ++t) std::memcpy(q.data() + t * qn, qkv.data() + t * qkv_n, qn * sizeof(float));
    std::vector<float> lse(n_groups > 0 ? T * H : 0);
    paged_decode_kv(kv_type, q.data(), q_rows, T, H, Hkv, D, k_cache, v_cache, page_idx, max_pages, kv_lens, page_size,
                    scale, attn.data(), n_groups > 0 ? lse.data() : nullptr, nt);
    if (n_groups > 0)
        cascade_groups_kv(kv_type, q.data(), H, Hkv, D, k_cache, v_cache, page_size, n_groups, group_page_ptr,
                          group_pages, group_row_ptr, group_rows, scale, attn.data(), lse.data(), nt);
    project(proj[1], attn.data(), T, hs.data(), nt);
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += hs[i];
    rms_norm(x, post_norm, T, hidden, eps, hs.data());
    project(proj[2], hs.data(), T, big.data(), nt);
    for (int64_t t = 0; t < T; ++t) {
        const float* g = big.data() + t * 2 * inter;
        float* a = hs.data() + t * inter;
        for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
    }
    project(proj[3], hs.data(), T, attn.data(), nt);
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += attn[i];
}

void oc_decode_layer(float* x, int64_t T, int64_t hidden, const float* in_norm, const float* post_norm, float eps,
                     const OcProj* proj, const float* cos, const float* sin_signed, const int64_t* slots,
                     void* k_cache, void* v_cache, const int64_t* q_rows, const int64_t* page_idx,
                     int64_t max_pages, const int64_t* kv_lens, int64_t page_size, int64_t H, int64_t Hkv,
                     int64_t D, float scale, int kv_type, int nt) {
    oc_decode_layer_cascade(x, T, hidden, in_norm, post_norm, eps, proj, cos, sin_signed, slots, k_cache, v_cache,
                            q_rows, page_idx, max_pages, kv_lens, page_size, H, Hkv, D, scale, kv_type, nt, 0, nullptr,
                            nullptr, nullptr, nullptr);
}

}  // extern "C"

namespace {
void project(const OcProj& p, const float* x, int64_t T, float* y, int nt) {
    if (p.kind == 4) oc_q4_matmul(x, T, p.k, (const uint8_t*)p.w, p.n, p.bias, y, nt);
    else if (p.kind == 1) ggml_segments_matmul(x, T, p.k, p.seg, p.nseg, (const uint8_t*)p.w, p.n, p.bias, y, nt);
    else oc_q8_matmul(x, T, p.k, (const int8_t*)p.w, p.scale, p.n, p.bias, y, nt);
}
}  // namespace
