/* pulsectl/_speedups.c, part: Rice coding: choosing k and writing the two streams (diff).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

/* ---------------------------------------------------------------- Rice coding */

/* out[j] = sum over the gaps g of g >> (from + j), for j < count <= 5; returns whether the
 * positions increase (the sums are meaningless where they do not). */
static inline __attribute__((always_inline)) int quotient_sums_body(const void *positions,
                                                                   size_t n, int from,
                                                                   int count, uint64_t *out) {
    const int64_t *pos = positions;
    uint64_t g = (uint64_t)pos[0]; /* the first gap counts from -1 */
    uint64_t s0 = g >> from, s1 = g >> (from + 1), s2 = g >> (from + 2), s3 = g >> (from + 3),
             s4 = g >> (from + 4);
    /* The order check rides along as two OR reductions, so the loop still vectorises (a
     * separate compare loop did not, and took 14% of the encoder's time): with every position
     * non-negative, each step is below 2^63 either way, so a gap that is not a step up wraps
     * to 2^63 or more. */
    uint64_t signs = g;
    for (size_t i = 1; i < n; i++) {
        g = (uint64_t)pos[i] - (uint64_t)pos[i - 1] - 1;
        signs |= (uint64_t)pos[i] | g;
        s0 += g >> from;
        s1 += g >> (from + 1);
        s2 += g >> (from + 2);
        s3 += g >> (from + 3);
        s4 += g >> (from + 4);
    }
    uint64_t part[5] = {s0, s1, s2, s3, s4};
    for (int j = 0; j < count; j++) out[j] = part[j];
    return !(signs >> 63);
}

/* The loop above vectorises: compiled for AVX-512 too, it sums 8 gaps at a time; for AVX2, 4. */
static int quotient_sums_portable(const void *positions, size_t n, int from, int count,
                                  uint64_t *out) {
    return quotient_sums_body(positions, n, from, count, out);
}
#if HAVE_AVX512_LOOPS
static AVX512_TARGET int quotient_sums_avx512(const void *positions, size_t n, int from,
                                              int count, uint64_t *out) {
    return quotient_sums_body(positions, n, from, count, out);
}
#endif
#if HAVE_AVX2_LOOPS
static AVX2_TARGET int quotient_sums_avx2(const void *positions, size_t n, int from, int count,
                                          uint64_t *out) {
    return quotient_sums_body(positions, n, from, count, out);
}
#endif
static int quotient_sums(const void *positions, size_t n, int from, int count, uint64_t *out) {
#if HAVE_AVX512_LOOPS
    if (use_avx512) return quotient_sums_avx512(positions, n, from, count, out);
#endif
#if HAVE_AVX2_LOOPS
    if (use_avx2) return quotient_sums_avx2(positions, n, from, count, out);
#endif
    return quotient_sums_portable(positions, n, from, count, out);
}

static int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* sums(data, n, from, count, out): out[j] = the sum of the quotients g >> (from + j) of the n
 * gaps in data, for j < count <= 5; 0 where data is not valid (then nothing is coded). */
typedef int (*QuotientSums)(const void *data, size_t n, int from, int count, uint64_t *out);

/* The Rice parameter k with the fewest bits for n > 0 gaps averaging `mean` (the smallest k on
 * a tie), and in *quotients the sum of their quotients at that k; -1 where `sums` refuses the
 * data. The bits of Rice coding with parameter k, sum(g >> k) + n (k + 1), are convex in k:
 * their step from k to k + 1 is n - sum(ceil((g >> k) / 2)), which never decreases. So the
 * first minimum of a window is the first minimum overall unless it sits on an edge that can
 * still move. The window starts around log2 of the mean gap. Above the bit length of the
 * largest gap the cost only grows, so searching up to MAX_RICE_K finds what numpy's argmin
 * over 0..min(bit length, MAX_RICE_K) finds (codecs/_bits.best_rice). */
static int rice_search(QuotientSums sums, const void *data, size_t n, uint64_t mean,
                       uint64_t *quotients) {
    int guess = bit_length(mean);
    int lo = guess - 2 < 0 ? 0 : guess - 2, hi = guess + 2 > MAX_RICE_K ? MAX_RICE_K : guess + 2;
    if (lo > hi) lo = hi;
    uint64_t quot[MAX_RICE_K + 1];
    int have_lo = lo, have_hi = hi, k;
    if (!sums(data, n, lo, hi - lo + 1, quot + lo)) return -1;
    for (;;) {
        if (lo < have_lo) sums(data, n, lo, 1, quot + lo), have_lo = lo;
        if (hi > have_hi) sums(data, n, hi, 1, quot + hi), have_hi = hi;
        k = lo;
        for (int kk = lo + 1; kk <= hi; kk++) {
            if (quot[kk] + (uint64_t)n * (kk + 1) < quot[k] + (uint64_t)n * (k + 1)) k = kk;
        }
        if (k == lo && lo > 0) lo--; /* the first minimum may lie lower */
        else if (k == hi && hi < MAX_RICE_K) hi++; /* or higher */
        else break;
    }
    *quotients = quot[k];
    return k;
}

/* The Rice parameter k of the sorted int64 positions in p (the fewest bits, the smallest on a
 * tie), their count n and the sum of their gaps' quotients at k: 0, or -1 with ValueError set
 * (`who` names the caller). The gaps add up to the last position + 1 - n: their mean is known
 * without a pass. */
static int rice_plan(Py_buffer *p, const char *who, size_t *n, int *k, uint64_t *quotients) {
    *n = (size_t)p->len / 8;
    if (p->len % 8 || *n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: positions must be non-empty int64", who);
        return -1;
    }
    const int64_t *pos = p->buf;
    size_t count = *n;
    Py_BEGIN_ALLOW_THREADS
    *k = rice_search(quotient_sums, pos, count, ((uint64_t)pos[count - 1] + 1 - count) / count,
                     quotients);
    Py_END_ALLOW_THREADS
    if (*k < 0) {
        PyErr_Format(PyExc_ValueError, "%s: positions must increase", who);
        return -1;
    }
    return 0;
}

/* rice_size(positions) -> (k, unary_bytes, remainder_bytes): what rice_encode would choose and
 * the sizes of its two streams, without writing them. */
static PyObject *rice_size(PyObject *self, PyObject *args) {
    Py_buffer p;
    if (!PyArg_ParseTuple(args, "y*", &p)) return NULL;
    PyObject *result = NULL;
    size_t n;
    int k;
    uint64_t best_quot = 0;
    if (rice_plan(&p, "rice_size", &n, &k, &best_quot) == 0)
        result = Py_BuildValue("iKK", k, (unsigned long long)((best_quot + n + 7) / 8),
                               (unsigned long long)(((uint64_t)n * k + 7) / 8));
    PyBuffer_Release(&p);
    return result;
}

#if HAVE_AVX512_LOOPS
/* The gaps (position - previous - 1) of the 8 increasing positions at pos; lane 7 of *before
 * is the position before them (-1 first), and *before becomes these 8. */
static inline __attribute__((always_inline)) AVX512_TARGET __m512i gaps_of_8(const int64_t *pos,
                                                                             __m512i *before) {
    __m512i p = _mm512_loadu_si512((const void *)pos);
    __m512i prev = _mm512_alignr_epi64(p, *before, 7); /* each lane's previous position */
    *before = p;
    return _mm512_sub_epi64(_mm512_sub_epi64(p, prev), _mm512_set1_epi64(1));
}

#endif

/* A bit writer without branches, for rice_encode: each put stores 8 bytes (its buffer has 8
 * bytes of room past the stream), of which the whole ones written count; the bits of a byte not
 * yet whole wait at the top of acc. */
typedef struct {
    uint8_t *out;
    size_t at;
    uint64_t acc; /* bits not yet in whole bytes, from bit 63 down */
    unsigned bits; /* how many (< 8) */
} TopWriter;

/* Append the top `count` (1..56) bits of `top` (its other bits zero), most significant first. */
static inline void tw_put(TopWriter *w, uint64_t top, unsigned count) {
    w->acc |= top >> w->bits;
    w->bits += count;
    uint64_t be = w->acc;
#if LITTLE_ENDIAN_HOST
    be = __builtin_bswap64(be);
#endif
    memcpy(w->out + w->at, &be, 8);
    w->at += w->bits >> 3;
    w->acc <<= w->bits & ~7u;
    w->bits &= 7;
}

/* The low `count` (1..56) bits of `value`. */
static inline void tw_put_low(TopWriter *w, uint64_t value, unsigned count) {
    tw_put(w, value << (64 - count), count);
}

/* A unary code: q one-bits, then a zero. */
static inline void tw_put_unary(TopWriter *w, uint64_t q) {
    for (; q >= 56; q -= 56) tw_put(w, ~0ull << 8, 56);
    tw_put(w, q ? ~0ull << (64 - q) : 0, (unsigned)q + 1);
}

/* The bytes written, the last one zero-padded. */
static inline size_t tw_size(const TopWriter *w) { return w->at + (w->bits != 0); }

/* The Rice codes of 8 gaps with parameter k, for the portable loops: what 8 pairs of
 * tw_put_unary and tw_put_low write, in as few puts as fit (each put waits for the one before
 * it). The 8 unary codes are one string of ones with a zero at the end of each code (the
 * running sum of q + 1, less one), one put where it has at most 56 bits; the remainders go 8
 * to a put where k <= 7 and 4 to a put where k <= 14. */
static inline void rice_put_8(TopWriter *u, TopWriter *r, const uint64_t *g, int k) {
    uint64_t end[8], length = 0;
    for (int j = 0; j < 8; j++) end[j] = length += (g[j] >> k) + 1;
    if (length <= 56) {
        uint64_t zeros = 0; /* code j's zero at bit end[j] - 1 of the string, from bit 63 down */
        for (int j = 0; j < 8; j++) zeros |= 1ull << (64 - end[j]);
        tw_put(u, ~zeros & (~0ull << (64 - length)), (unsigned)length);
    } else {
        for (int j = 0; j < 8; j++) tw_put_unary(u, g[j] >> k);
    }
    if (k == 0) return;
    const uint64_t low = (1ull << k) - 1;
    if (k <= 14) {
        const int per = k <= 7 ? 8 : 4;
        for (int from = 0; from < 8; from += per) {
            uint64_t top = 0;
            for (int j = 0; j < per; j++) top |= (g[from + j] & low) << (64 - k * (j + 1));
            tw_put(r, top, (unsigned)(per * k));
        }
    } else {
        for (int j = 0; j < 8; j++) tw_put_low(r, g[j] & low, (unsigned)k);
    }
}

#if HAVE_AVX512_LOOPS
#define TW_MAX 56 /* the most bits one put takes */

/* Rice codes with parameter k, 16 at a time: their unary bits as one string of ones with a
 * zero at the end of each code (the running sum of q + 1, less one), where it has at most 56
 * bits; their remainders as one string of 16 k bits (k <= 3), two of 8 k (k <= 7) or four of
 * 4 k (k <= 14). A string's bits are gathered by an OR across a register. Longer unary strings,
 * and remainders where k > 14, go code by code. */
typedef struct {
    __m512i at8, at4, low;
    __m128i shift;
    int k;
} RiceCodes;

static inline __attribute__((always_inline)) AVX512_TARGET RiceCodes rice_codes(int k) {
    const long long kk = k;
    /* Shifts that put remainder j of a string at its place from bit 63 down: lane j's k bits
     * end at bit 64 - k (j + 1) of the string's word (of its half's, for at4). */
    RiceCodes c = {
        _mm512_set_epi64(64 - 8 * kk, 64 - 7 * kk, 64 - 6 * kk, 64 - 5 * kk, 64 - 4 * kk,
                         64 - 3 * kk, 64 - 2 * kk, 64 - kk),
        _mm512_set_epi64(64 - 4 * kk, 64 - 3 * kk, 64 - 2 * kk, 64 - kk, 64 - 4 * kk,
                         64 - 3 * kk, 64 - 2 * kk, 64 - kk),
        _mm512_set1_epi64((long long)((1ull << k) - 1)), _mm_cvtsi32_si128(k), k};
    return c;
}

/* The 16 codes of the gaps in ga (first 8) and gb. */
static inline __attribute__((always_inline)) AVX512_TARGET void rice_put_16(
    TopWriter *u, TopWriter *r, const RiceCodes *c, __m512i ga, __m512i gb) {
    const __m512i one = _mm512_set1_epi64(1), sixty_four = _mm512_set1_epi64(64);
    const __m512i zero = _mm512_setzero_si512();
    const int k = c->k;
    __m512i sa = _mm512_add_epi64(_mm512_srl_epi64(ga, c->shift), one);
    __m512i sb = _mm512_add_epi64(_mm512_srl_epi64(gb, c->shift), one);
    sa = _mm512_add_epi64(sa, _mm512_alignr_epi64(sa, zero, 7));
    sb = _mm512_add_epi64(sb, _mm512_alignr_epi64(sb, zero, 7));
    sa = _mm512_add_epi64(sa, _mm512_alignr_epi64(sa, zero, 6));
    sb = _mm512_add_epi64(sb, _mm512_alignr_epi64(sb, zero, 6));
    sa = _mm512_add_epi64(sa, _mm512_alignr_epi64(sa, zero, 4));
    sb = _mm512_add_epi64(sb, _mm512_alignr_epi64(sb, zero, 4));
    sb = _mm512_add_epi64(sb, _mm512_permutexvar_epi64(_mm512_set1_epi64(7), sa)); /* after a's */
    uint64_t length = (uint64_t)_mm_extract_epi64(_mm512_extracti32x4_epi32(sb, 3), 1);
    if (length <= TW_MAX) {
        /* Code j's zero at bit s[j] - 1 of the string: bit 64 - s[j] of a top-aligned word. */
        __m512i za = _mm512_sllv_epi64(one, _mm512_sub_epi64(sixty_four, sa));
        __m512i zb = _mm512_sllv_epi64(one, _mm512_sub_epi64(sixty_four, sb));
        uint64_t zeros = (uint64_t)_mm512_reduce_or_epi64(_mm512_or_si512(za, zb));
        tw_put(u, ~zeros & (~0ull << (64 - length)), (unsigned)length);
    } else {
        uint64_t g[16];
        _mm512_storeu_si512((void *)g, ga);
        _mm512_storeu_si512((void *)(g + 8), gb);
        for (int j = 0; j < 16; j++) tw_put_unary(u, g[j] >> k);
    }
    if (k == 0) return;
    __m512i ra = _mm512_and_si512(ga, c->low), rb = _mm512_and_si512(gb, c->low);
    if (k <= 3) {
        /* a's remainders in the top 8 k bits, b's in the next 8 k */
        __m512i wa = _mm512_sllv_epi64(ra, c->at8);
        __m512i wb = _mm512_srl_epi64(_mm512_sllv_epi64(rb, c->at8), _mm_cvtsi32_si128(8 * k));
        tw_put(r, (uint64_t)_mm512_reduce_or_epi64(_mm512_or_si512(wa, wb)), 16u * (unsigned)k);
    } else if (k <= 7) {
        unsigned bits = 8u * (unsigned)k;
        tw_put(r, (uint64_t)_mm512_reduce_or_epi64(_mm512_sllv_epi64(ra, c->at8)), bits);
        tw_put(r, (uint64_t)_mm512_reduce_or_epi64(_mm512_sllv_epi64(rb, c->at8)), bits);
    } else if (k <= 14) {
        __m512i wa = _mm512_sllv_epi64(ra, c->at4), wb = _mm512_sllv_epi64(rb, c->at4);
        tw_put(r, (uint64_t)_mm512_mask_reduce_or_epi64(0x0F, wa), 4u * (unsigned)k);
        tw_put(r, (uint64_t)_mm512_mask_reduce_or_epi64(0xF0, wa), 4u * (unsigned)k);
        tw_put(r, (uint64_t)_mm512_mask_reduce_or_epi64(0x0F, wb), 4u * (unsigned)k);
        tw_put(r, (uint64_t)_mm512_mask_reduce_or_epi64(0xF0, wb), 4u * (unsigned)k);
    } else {
        uint64_t g[16];
        _mm512_storeu_si512((void *)g, ra);
        _mm512_storeu_si512((void *)(g + 8), rb);
        for (int j = 0; j < 16; j++) tw_put_low(r, g[j], (unsigned)k);
    }
}

/* Both Rice streams of the first codes of the increasing positions pos (n >= 16), 16 at a time
 * (rice_put_16). Returns how many codes are done. */
static AVX512_TARGET size_t rice_streams_avx512(TopWriter *u, TopWriter *r, const int64_t *pos,
                                               size_t n, int k) {
    const RiceCodes c = rice_codes(k);
    __m512i before = _mm512_set1_epi64(-1);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i ga = gaps_of_8(pos + i, &before);
        rice_put_16(u, r, &c, ga, gaps_of_8(pos + i + 8, &before));
    }
    return i;
}

/* The same from the gaps themselves (codec 4's runs, one per context). */
static AVX512_TARGET size_t rice_gaps_avx512(TopWriter *u, TopWriter *r, const uint64_t *gaps,
                                            size_t n, int k) {
    const RiceCodes c = rice_codes(k);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        rice_put_16(u, r, &c, _mm512_loadu_si512((const void *)(gaps + i)),
                    _mm512_loadu_si512((const void *)(gaps + i + 8)));
    return i;
}
#endif

#if HAVE_AVX2_LOOPS
/* ---- Rice codes encoded 8 at a time (AVX2): rice_put_8's puts, with the gaps' running sums,
 * the unary codes' 0-bits and the remainders' places worked out in 4 lanes of 64 bits at a
 * time (the AVX-512 loops above do 16). Measured in a C harness on geometric gaps, 0.6-0.9 ns
 * a change for k <= 7 where rice_put_8 took 1.4-2.1, the same bytes. */
typedef struct {
    __m256i at_a, at_b, low;
    __m128i shift;
    int k;
} RiceCodes2;

static inline __attribute__((always_inline)) AVX2_TARGET RiceCodes2 rice_codes_avx2(int k) {
    const long long kk = k;
    RiceCodes2 c = {_mm256_setr_epi64x(64 - kk, 64 - 2 * kk, 64 - 3 * kk, 64 - 4 * kk),
                    _mm256_setr_epi64x(64 - 5 * kk, 64 - 6 * kk, 64 - 7 * kk, 64 - 8 * kk),
                    _mm256_set1_epi64x((long long)((1ull << k) - 1)), _mm_cvtsi32_si128(k), k};
    return c;
}

/* The OR of the 4 lanes. */
static inline __attribute__((always_inline)) AVX2_TARGET uint64_t or_lanes_avx2(__m256i x) {
    x = _mm256_or_si256(x, _mm256_permute2x128_si256(x, x, 0x01));
    x = _mm256_or_si256(x, _mm256_shuffle_epi32(x, 0x4E));
    return (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(x));
}

/* Running sums of the 4 lanes. */
static inline __attribute__((always_inline)) AVX2_TARGET __m256i scan4_avx2(__m256i x) {
    const __m256i zero = _mm256_setzero_si256();
    x = _mm256_add_epi64(x, _mm256_blend_epi32(_mm256_permute4x64_epi64(x, 0x90), zero, 0x03));
    return _mm256_add_epi64(x, _mm256_permute2x128_si256(x, x, 0x08));
}

/* The codes of the 8 gaps in ga (first 4) and gb. */
static inline __attribute__((always_inline)) AVX2_TARGET void rice_put_8_avx2(
    TopWriter *u, TopWriter *r, const RiceCodes2 *c, __m256i ga, __m256i gb) {
    const __m256i one = _mm256_set1_epi64x(1), sixty_four = _mm256_set1_epi64x(64);
    const int k = c->k;
    __m256i sa = scan4_avx2(_mm256_add_epi64(_mm256_srl_epi64(ga, c->shift), one));
    __m256i sb = scan4_avx2(_mm256_add_epi64(_mm256_srl_epi64(gb, c->shift), one));
    sb = _mm256_add_epi64(sb, _mm256_permute4x64_epi64(sa, 0xFF)); /* after a's */
    uint64_t length = (uint64_t)_mm256_extract_epi64(sb, 3);
    if (length <= 56) {
        __m256i za = _mm256_sllv_epi64(one, _mm256_sub_epi64(sixty_four, sa));
        __m256i zb = _mm256_sllv_epi64(one, _mm256_sub_epi64(sixty_four, sb));
        uint64_t zeros = or_lanes_avx2(_mm256_or_si256(za, zb));
        tw_put(u, ~zeros & (~0ull << (64 - length)), (unsigned)length);
    } else {
        uint64_t g[8];
        _mm256_storeu_si256((__m256i *)g, ga);
        _mm256_storeu_si256((__m256i *)(g + 4), gb);
        for (int j = 0; j < 8; j++) tw_put_unary(u, g[j] >> k);
    }
    if (k == 0) return;
    __m256i ra = _mm256_and_si256(ga, c->low), rb = _mm256_and_si256(gb, c->low);
    if (k <= 7) {
        tw_put(r, or_lanes_avx2(_mm256_or_si256(_mm256_sllv_epi64(ra, c->at_a),
                                                _mm256_sllv_epi64(rb, c->at_b))),
               8u * (unsigned)k);
    } else if (k <= 14) {
        tw_put(r, or_lanes_avx2(_mm256_sllv_epi64(ra, c->at_a)), 4u * (unsigned)k);
        tw_put(r, or_lanes_avx2(_mm256_sllv_epi64(rb, c->at_a)), 4u * (unsigned)k);
    } else {
        uint64_t g[8];
        _mm256_storeu_si256((__m256i *)g, ra);
        _mm256_storeu_si256((__m256i *)(g + 4), rb);
        for (int j = 0; j < 8; j++) tw_put_low(r, g[j], (unsigned)k);
    }
}

/* The gaps (position - previous - 1) of the 4 increasing positions at pos; lane 3 of *before
 * is the position before them (-1 first), and *before becomes these 4 (gaps_of_8, 4 lanes). */
static inline __attribute__((always_inline)) AVX2_TARGET __m256i gaps_of_4(const int64_t *pos,
                                                                          __m256i *before) {
    __m256i p = _mm256_loadu_si256((const __m256i *)pos);
    __m256i prev = _mm256_blend_epi32(_mm256_permute4x64_epi64(p, 0x90),
                                      _mm256_permute4x64_epi64(*before, 0xFF), 0x03);
    *before = p;
    return _mm256_sub_epi64(_mm256_sub_epi64(p, prev), _mm256_set1_epi64x(1));
}

/* Both Rice streams of the first codes of the increasing positions pos, 8 at a time
 * (rice_put_8_avx2). Returns how many codes are done. The first 8 gaps take the position
 * before them from a register (gaps_of_4); the rest load it, which measured 8-30% faster than
 * shuffling it in for every 4 (0.62-0.85 against 0.81-0.93 ns a change, k = 0..6). */
static AVX2_TARGET size_t rice_streams_avx2(TopWriter *u, TopWriter *r, const int64_t *pos,
                                           size_t n, int k) {
    if (n < 8) return 0;
    const RiceCodes2 c = rice_codes_avx2(k);
    const __m256i one = _mm256_set1_epi64x(1);
    __m256i before = _mm256_set1_epi64x(-1);
    __m256i first = gaps_of_4(pos, &before);
    rice_put_8_avx2(u, r, &c, first, gaps_of_4(pos + 4, &before));
    size_t i = 8;
    for (; i + 8 <= n; i += 8) {
        __m256i pa = _mm256_loadu_si256((const __m256i *)(pos + i));
        __m256i pb = _mm256_loadu_si256((const __m256i *)(pos + i + 4));
        __m256i qa = _mm256_loadu_si256((const __m256i *)(pos + i - 1));
        __m256i qb = _mm256_loadu_si256((const __m256i *)(pos + i + 3));
        rice_put_8_avx2(u, r, &c, _mm256_sub_epi64(_mm256_sub_epi64(pa, qa), one),
                        _mm256_sub_epi64(_mm256_sub_epi64(pb, qb), one));
    }
    return i;
}

/* The same from the gaps themselves (codec 4's runs, one per context). */
static AVX2_TARGET size_t rice_gaps_avx2(TopWriter *u, TopWriter *r, const uint64_t *gaps,
                                        size_t n, int k) {
    const RiceCodes2 c = rice_codes_avx2(k);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        rice_put_8_avx2(u, r, &c, _mm256_loadu_si256((const __m256i *)(gaps + i)),
                        _mm256_loadu_si256((const __m256i *)(gaps + i + 4)));
    return i;
}
#endif

/* rice_encode(positions) -> (k, unary, remainder): the Rice parameter with the fewest bits
 * (the smallest on a tie), the unary stream of the quotients and the k-bit remainders of the
 * gaps between the sorted positions (int64, the first gap counted from -1). */
static PyObject *rice_encode(PyObject *self, PyObject *args) {
    Py_buffer p;
    if (!PyArg_ParseTuple(args, "y*", &p)) return NULL;
    PyObject *result = NULL, *unary = NULL, *remainder = NULL;
    size_t n;
    int k;
    uint64_t best_quot = 0;
    if (rice_plan(&p, "rice_encode", &n, &k, &best_quot) < 0) goto done;
    const int64_t *pos = p.buf;
    /* Each put of the bit writers stores 8 bytes: room for them past the streams, cut off
     * after. */
    size_t ubytes = (size_t)((best_quot + n + 7) / 8), padded = ubytes + 8;
    unary = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)padded);
    size_t rbytes = (size_t)(((uint64_t)n * k + 7) / 8), rpadded = rbytes + 8;
    remainder = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rpadded);
    if (!unary || !remainder) goto done;
    uint8_t *ubuf = (uint8_t *)PyBytes_AS_STRING(unary);
    uint8_t *rbuf = (uint8_t *)PyBytes_AS_STRING(remainder);
    TopWriter u = {ubuf, 0, 0, 0}, r = {rbuf, 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    size_t i = 0;
#if HAVE_AVX512_LOOPS
    if (use_avx512 && n >= 16) i = rice_streams_avx512(&u, &r, pos, n, k);
#endif
#if HAVE_AVX2_LOOPS
    if (!use_avx512 && use_avx2) i = rice_streams_avx2(&u, &r, pos, n, k);
#endif
    uint64_t low = (1ull << k) - 1, before = UINT64_MAX; /* the first gap counts from -1 */
    for (; i + 8 <= n; i += 8) {
        uint64_t g[8];
        for (int j = 0; j < 8; j++) {
            g[j] = (uint64_t)pos[i + j] - (i + j ? (uint64_t)pos[i + j - 1] : before) - 1;
        }
        rice_put_8(&u, &r, g, k);
    }
    for (; i < n; i++) {
        uint64_t gap = (uint64_t)pos[i] - (i ? (uint64_t)pos[i - 1] : before) - 1;
        tw_put_unary(&u, gap >> k);
        if (k) tw_put_low(&r, gap & low, (unsigned)k);
    }
    Py_END_ALLOW_THREADS
    if (tw_size(&u) != ubytes || tw_size(&r) != rbytes) {
        PyErr_SetString(PyExc_SystemError, "rice_encode: stream sizes disagree with the plan");
        goto done;
    }
    if (padded != ubytes && _PyBytes_Resize(&unary, (Py_ssize_t)ubytes) < 0) goto done;
    if (rpadded != rbytes && _PyBytes_Resize(&remainder, (Py_ssize_t)rbytes) < 0) goto done;
    result = Py_BuildValue("iOO", k, unary, remainder);
done:
    Py_XDECREF(unary);
    Py_XDECREF(remainder);
    PyBuffer_Release(&p);
    return result;
}

