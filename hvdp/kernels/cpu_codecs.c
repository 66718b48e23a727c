/* Fused CPU kernels of hvdp's int8, int4, bf16 and fp16 codecs: one pass over memory per phase.
 *
 * Each function reproduces the array-op reference in hvdp/codecs (numpy) bit for bit, so it is
 * compiled without -ffast-math and with -ffp-contract=off: float division, rintf (round half to
 * even) and one rounding per operation, as the reference does.
 *
 * int8 payload of an n-element chunk (n a multiple of the block size B): n int8 codes, then n/B
 * float32 scales. A non-finite value is code -128 and flags its block with a negative scale.
 * Codes are the rounded quotient clipped to [-127, 127] (the clip matters only in a block whose
 * scale is a subnormal float, where the quotient can round to 128). Decoding: a chunk with a
 * negative scale turns code -128 into NaN.
 *
 * int4 payload (n a multiple of 2B): n/2 bytes, byte j holding code j + 8 in its low nibble and
 * code j + n/2 + 8 in its high one, then n/B float32 scales; codes in [-7, 7], -8 (nibble 0) for
 * a non-finite value. Block b is encoded together with block b + n/(2B), whose codes share its
 * bytes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TINY 1e-38f

static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float finite_or_zero(float r) { return (fbits(r) & 0x7fffffffu) < 0x7f800000u ? r : 0.0f; }

/* One block of y = x (+ prev) quantised to codes in [-qmax, qmax] (int8: 127, int4: 7; a
 * non-finite element gets nfcode): codes q and, when res is not NULL, the residual
 * y - decode(q) (non-finite -> 0); returns the stored scale (negative: a flagged block). Two
 * passes over the block (in L1): absmax, then codes and residual; y is computed again rather
 * than stored. Inlined with constant qmax and nfcode. */
#define INLINE static inline __attribute__((always_inline))
#define Y(i) (prev ? x[i] + prev[i] : x[i])

INLINE float quant_block(const float *restrict x, const float *restrict prev, int64_t B,
                         float qmax, int32_t nfcode, int8_t *restrict q, float *restrict res)
{
    /* two integer max reductions over |y|'s bits (ordered like the floats): all values, and the
     * finite ones; the compiler vectorises this form */
    int32_t m = 0, mall = 0;
    const int32_t qi = (int32_t)qmax;
    for (int64_t i = 0; i < B; i++) {
        int32_t a = (int32_t)(fbits(Y(i)) & 0x7fffffffu);
        int32_t v = a < 0x7f800000 ? a : 0;
        m = v > m ? v : m;
        mall = a > mall ? a : mall;
    }
    int nf = mall >= 0x7f800000;
    float scale = bitsf((uint32_t)m) / qmax;
    float safe = scale > 0.0f ? scale : 1.0f;
    if (!nf) {
#define CODES(RES)                                                                    \
        for (int64_t i = 0; i < B; i++) {                                             \
            float y = Y(i);                                                           \
            int32_t k = (int32_t)rintf(y / safe); /* |k| < 256: exact */              \
            k = k < -qi ? -qi : (k > qi ? qi : k);                                    \
            int8_t c = (int8_t)k;                                                     \
            q[i] = c;                                                                 \
            if (RES) res[i] = finite_or_zero(y - (float)c * scale);                   \
        }
        if (res) { CODES(1) } else { CODES(0) }
#undef CODES
        return scale;
    }
    float mag = scale > 0.0f ? scale : TINY;  /* the codes' scale; TINY only flags a zero one */
    for (int64_t i = 0; i < B; i++) {
        float y = Y(i);
        uint32_t fin = (fbits(y) & 0x7fffffffu) < 0x7f800000u;
        int32_t k = (int32_t)rintf(y / safe);  /* any value where y is not finite: replaced */
        k = k < -qi ? -qi : (k > qi ? qi : k);
        int8_t c = fin ? (int8_t)k : (int8_t)nfcode;
        q[i] = c;
        if (res) res[i] = fin ? finite_or_zero(y - (float)c * mag) : 0.0f;
    }
    return -mag;
}

/* Inlined with a constant B for the usual block sizes (and prev, res known to be NULL or not):
 * the compiler then vectorises each loop without per-block set-up, which dominates otherwise. */
INLINE void int8_encode(const float *x, const float *prev, float *res, uint8_t *out, int64_t n, int64_t B)
{
    int64_t nblocks = n / B;
    for (int64_t b = 0; b < nblocks; b++) {
        float s = quant_block(x + b * B, prev ? prev + b * B : NULL, B, 127.0f, -128, (int8_t *)out + b * B,
                              res ? res + b * B : NULL);
        memcpy(out + n + 4 * b, &s, 4);
    }
}

#define BLOCK_CASES(CALL) \
    switch (B) {          \
    case 64: CALL(64);    \
    case 128: CALL(128);  \
    case 256: CALL(256);  \
    case 512: CALL(512);  \
    case 1024: CALL(1024); \
    case 2048: CALL(2048); \
    case 4096: CALL(4096); \
    default: CALL(B);     \
    }

/* x (+ prev) -> payload (n + 4 n/B bytes) and, when res is not NULL, the new residual.
 * res must not overlap x or prev. Returns 0. */
int hvdp_int8_encode(const float *x, const float *prev, float *res, uint8_t *out, int64_t n, int64_t B)
{
#define ENC(K) int8_encode(x, prev, res, out, n, K); return 0
#define VARIANTS(K)                                                      \
    if (prev && res) { int8_encode(x, prev, res, out, n, K); return 0; } \
    if (res) { int8_encode(x, NULL, res, out, n, K); return 0; }         \
    if (prev) { int8_encode(x, prev, NULL, out, n, K); return 0; }       \
    int8_encode(x, NULL, NULL, out, n, K); return 0
    BLOCK_CASES(VARIANTS)
#undef VARIANTS
#undef ENC
}

static int all_nonnegative(const uint8_t *scales, int64_t nblocks)
{
    int ok = 1;
    for (int64_t b = 0; b < nblocks; b++) {
        float s;
        memcpy(&s, scales + 4 * b, 4);
        ok &= s >= 0.0f;
    }
    return ok;
}

INLINE void int8_decode_sum(const uint8_t *pl, int64_t p, int64_t n, int64_t B, float scale, int do_scale, float *out)
{
    int64_t nblocks = n / B, nb = n + 4 * nblocks;
    const float qnan = bitsf(0x7fc00000u);
    unsigned char gen[64];
    unsigned char *general = p <= 64 ? gen : (unsigned char *)malloc((size_t)p);
    for (int64_t j = 0; j < p; j++) general[j] = !all_nonnegative(pl + j * nb + n, nblocks);
    for (int64_t b = 0; b < nblocks; b++) {
        float *o = out + b * B;
        for (int64_t j = 0; j < p; j++) {
            const int8_t *q = (const int8_t *)(pl + j * nb) + b * B;
            float s;
            memcpy(&s, pl + j * nb + n + 4 * b, 4);
            if (general[j]) {
                float a = fabsf(s);
                if (j == 0)
                    for (int64_t i = 0; i < B; i++) o[i] = q[i] == -128 ? qnan : (float)q[i] * a;
                else
                    for (int64_t i = 0; i < B; i++) o[i] = o[i] + (q[i] == -128 ? qnan : (float)q[i] * a);
            } else if (j == 0) {
                for (int64_t i = 0; i < B; i++) o[i] = (float)q[i] * s;
            } else {
                for (int64_t i = 0; i < B; i++) o[i] = o[i] + (float)q[i] * s;
            }
        }
        if (do_scale)
            for (int64_t i = 0; i < B; i++) o[i] = o[i] * scale;
    }
    if (general != gen) free(general);
}

/* out = (decode(payload_0) + ... + decode(payload_{p-1})) * scale (no multiplication when
 * do_scale is 0), summed in that order in float32; payloads back to back. p = 1: a decode. */
void hvdp_int8_decode_sum(const uint8_t *pl, int64_t p, int64_t n, int64_t B, float scale, int do_scale, float *out)
{
#define DEC(K) int8_decode_sum(pl, p, n, K, scale, do_scale, out); return
    BLOCK_CASES(DEC)
#undef DEC
}

/* --- int4 ---------------------------------------------------------------------------------- */

INLINE int int4_encode(const float *x, const float *prev, float *res, uint8_t *out, int64_t n, int64_t B)
{
    int64_t half = n / 2, hb = n / B / 2;
    int8_t qa_s[4096], qc_s[4096];
    int8_t *qa = qa_s, *qc = qc_s;
    if (B > 4096) {
        qa = (int8_t *)malloc((size_t)B);
        qc = (int8_t *)malloc((size_t)B);
        if (!qa || !qc) { free(qa); free(qc); return -1; }
    }
    for (int64_t b = 0; b < hb; b++) {
        int64_t a = b * B, c = half + b * B;
        float sa = quant_block(x + a, prev ? prev + a : NULL, B, 7.0f, -8, qa, res ? res + a : NULL);
        float sc = quant_block(x + c, prev ? prev + c : NULL, B, 7.0f, -8, qc, res ? res + c : NULL);
        uint8_t *o = out + a;
        for (int64_t i = 0; i < B; i++)
            o[i] = (uint8_t)((uint32_t)(qa[i] + 8) | ((uint32_t)(qc[i] + 8) << 4));
        memcpy(out + half + 4 * b, &sa, 4);
        memcpy(out + half + 4 * (b + hb), &sc, 4);
    }
    if (qa != qa_s) { free(qa); free(qc); }
    return 0;
}

/* x (+ prev) -> payload (n/2 + 4 n/B bytes) and, when res is not NULL, the new residual.
 * res must not overlap x or prev. Returns 0, or -1 when a block larger than 4096 found no memory. */
int hvdp_int4_encode(const float *x, const float *prev, float *res, uint8_t *out, int64_t n, int64_t B)
{
#define VARIANTS(K)                                                          \
    if (prev && res) return int4_encode(x, prev, res, out, n, K);           \
    if (res) return int4_encode(x, NULL, res, out, n, K);                   \
    if (prev) return int4_encode(x, prev, NULL, out, n, K);                 \
    return int4_encode(x, NULL, NULL, out, n, K)
    BLOCK_CASES(VARIANTS)
#undef VARIANTS
}

INLINE void int4_decode_sum(const uint8_t *pl, int64_t p, int64_t n, int64_t B, float scale, int do_scale, float *out)
{
    int64_t nblocks = n / B, half = n / 2, hb = nblocks / 2, nb = half + 4 * nblocks;
    const float qnan = bitsf(0x7fc00000u);
    unsigned char gen[64];
    unsigned char *general = p <= 64 ? gen : (unsigned char *)malloc((size_t)p);
    for (int64_t j = 0; j < p; j++) general[j] = !all_nonnegative(pl + j * nb + half, nblocks);
    for (int64_t b = 0; b < hb; b++) {
        float *oa = out + b * B, *oc = out + half + b * B;
        for (int64_t j = 0; j < p; j++) {
            const uint8_t *q = pl + j * nb + b * B;
            float sa, sc;
            memcpy(&sa, pl + j * nb + half + 4 * b, 4);
            memcpy(&sc, pl + j * nb + half + 4 * (b + hb), 4);
            if (general[j]) {
                float aa = fabsf(sa), ac = fabsf(sc);
                for (int64_t i = 0; i < B; i++) {
                    int32_t lo = (int32_t)(q[i] & 15u) - 8, hi = (int32_t)(q[i] >> 4) - 8;
                    float va = lo == -8 ? qnan : (float)lo * aa, vc = hi == -8 ? qnan : (float)hi * ac;
                    oa[i] = j == 0 ? va : oa[i] + va;
                    oc[i] = j == 0 ? vc : oc[i] + vc;
                }
            } else if (j == 0) {
                for (int64_t i = 0; i < B; i++) {
                    oa[i] = (float)((int32_t)(q[i] & 15u) - 8) * sa;
                    oc[i] = (float)((int32_t)(q[i] >> 4) - 8) * sc;
                }
            } else {
                for (int64_t i = 0; i < B; i++) {
                    oa[i] = oa[i] + (float)((int32_t)(q[i] & 15u) - 8) * sa;
                    oc[i] = oc[i] + (float)((int32_t)(q[i] >> 4) - 8) * sc;
                }
            }
        }
        if (do_scale)
            for (int64_t i = 0; i < B; i++) { oa[i] = oa[i] * scale; oc[i] = oc[i] * scale; }
    }
    if (general != gen) free(general);
}

/* int4's decode-sum: as int8's (order of the sum, scale at the end, p = 1 a decode). */
void hvdp_int4_decode_sum(const uint8_t *pl, int64_t p, int64_t n, int64_t B, float scale, int do_scale, float *out)
{
#define DEC(K) int4_decode_sum(pl, p, n, K, scale, do_scale, out); return
    BLOCK_CASES(DEC)
#undef DEC
}

/* --- 16-bit casts -------------------------------------------------------------------------- */

static inline uint16_t to_bf16(float y)
{
    uint32_t u = fbits(y);
    uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7fffu) >> 16;
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;  /* keep a NaN a (quiet) NaN */
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : rounded);
}

static inline float from_bf16(uint16_t h) { return bitsf((uint32_t)h << 16); }

/* float32 -> IEEE half, round to nearest even; a NaN keeps its sign and top payload bits (numpy) */
static inline uint16_t to_fp16(float y)
{
    /* the three cases computed for every value and selected: branch-free, so it vectorises */
    uint32_t u = fbits(y), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    uint32_t nan = 0x7c00u + ((a & 0x007fffffu) >> 13);
    nan += nan == 0x7c00u;
    uint32_t big = a > 0x7f800000u ? nan : 0x7c00u;                    /* >= 65536, inf, NaN */
    uint32_t sub = fbits(bitsf(a) + 0.5f) - 0x3f000000u;                 /* half subnormal: the FPU rounds */
    uint32_t norm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;          /* a carry may round up to inf */
    uint32_t o = a >= 0x47800000u ? big : (a < 0x38800000u ? sub : norm);
    return (uint16_t)(o | sign);
}

static inline float from_fp16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, a = h & 0x7fffu;
    float sub = (float)(a & 0x3ffu) * 5.9604644775390625e-8f;   /* a * 2^-24, exact */
    uint32_t v = a >= 0x7c00u ? (0x7f800000u | ((a & 0x3ffu) << 13)) :
                 a >= 0x0400u ? ((a << 13) + 0x38000000u) : fbits(sub);
    return bitsf(v | sign);
}

#define CAST_KERNELS(NAME, TO, FROM)                                                               \
void hvdp_##NAME##_encode(const float *x, const float *prev, float *res, uint16_t *out, int64_t n) \
{                                                                                                  \
    if (prev && res) {                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                          \
            float y = x[i] + prev[i];                                                              \
            uint16_t h = TO(y);                                                                    \
            out[i] = h;                                                                            \
            res[i] = finite_or_zero(y - FROM(h));                                                  \
        }                                                                                          \
    } else if (res) {                                                                              \
        for (int64_t i = 0; i < n; i++) {                                                          \
            uint16_t h = TO(x[i]);                                                                 \
            out[i] = h;                                                                            \
            res[i] = finite_or_zero(x[i] - FROM(h));                                               \
        }                                                                                          \
    } else if (prev) {                                                                             \
        for (int64_t i = 0; i < n; i++) out[i] = TO(x[i] + prev[i]);                               \
    } else {                                                                                       \
        for (int64_t i = 0; i < n; i++) out[i] = TO(x[i]);                                         \
    }                                                                                              \
}                                                                                                  \
void hvdp_##NAME##_decode_sum(const uint16_t *pl, int64_t p, int64_t n, float scale, int do_scale, float *out) \
{                                                                                                  \
    const int64_t T = 4096;                                                                        \
    for (int64_t t = 0; t < n; t += T) {                                                           \
        int64_t e = t + T < n ? t + T : n;                                                         \
        for (int64_t i = t; i < e; i++) out[i] = FROM(pl[i]);                                      \
        for (int64_t j = 1; j < p; j++)                                                            \
            for (int64_t i = t; i < e; i++) out[i] = out[i] + FROM(pl[j * n + i]);                 \
        if (do_scale)                                                                              \
            for (int64_t i = t; i < e; i++) out[i] = out[i] * scale;                               \
    }                                                                                              \
}

CAST_KERNELS(bf16, to_bf16, from_bf16)
CAST_KERNELS(fp16, to_fp16, from_fp16)
