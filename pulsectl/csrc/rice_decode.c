/* pulsectl/_speedups.c, part: Rice decoding: the walks over the two streams (apply).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

/* Eight bytes from p, most significant first; bytes at or past `end` read as `fill`. */
static inline uint64_t load_be64(const uint8_t *p, const uint8_t *end, uint8_t fill) {
    uint64_t v;
    if (p + 8 <= end) {
        memcpy(&v, p, 8);
#if LITTLE_ENDIAN_HOST
        v = __builtin_bswap64(v);
#endif
        return v;
    }
    v = 0;
    for (int j = 0; j < 8; j++) v = (v << 8) | (p + j < end ? p[j] : fill);
    return v;
}

/* The body of a walk over the changes of a Rice-coded run, in order: change `found`'s position
 * `at` comes from its unary code (the quotient: the 1-bits before its ending 0-bit) and its
 * k-bit remainder; each is checked to lie inside the block's `nwords` words before EMIT runs.
 * The run's codes start at bit UBIT0 of the unary stream and bit RBIT0 of the remainder stream
 * (0 and 0 for a codec 5 block, where the compiler drops them; codec 4 codes one run per
 * context, one after the other); PAST is the error for a position past the end, and DONE
 * runs once all `count` codes are read, with `end_before` the bit of the last one's 0-bit.
 * The walk may start part way, at code FOUND0 whose code before ended at bit UBIT0 - 1 and
 * gave position AT0 (0 and -1 from the start), its remainder at bit RBIT0 + FOUND0 k.
 * Returns the error (a static string) or NULL. Used by rice_decode, rice_scatter and
 * context_scatter. */
#define RICE_WALK(UBIT0, RBIT0, FOUND0, AT0, PAST, EMIT, DONE)                                \
    const uint8_t *uend = ub + ulen;                                                          \
    uint64_t limit = (uint64_t)nwords >> k;                                                   \
    int64_t at = (AT0), end_before = (int64_t)(UBIT0) - 1;                                    \
    size_t found = (FOUND0);                                                                  \
    for (size_t w = (UBIT0) / 64; w * 8 < ulen && found < count; w++) {                       \
        uint64_t zeros = ~load_be64(ub + 8 * w, uend, 0xFF); /* past the end: no zeros */     \
        if (w == (UBIT0) / 64) zeros &= ~0ull >> ((UBIT0) % 64); /* codes before the run */  \
        while (zeros && found < count) {                                                      \
            int lead = __builtin_clzll(zeros);                                                \
            zeros ^= 1ull << (63 - lead);                                                     \
            int64_t end = (int64_t)(64 * w + (size_t)lead);                                   \
            uint64_t q = (uint64_t)(end - end_before - 1), r = 0;                             \
            end_before = end;                                                                 \
            if (k) {                                                                          \
                uint64_t bit = (RBIT0) + (uint64_t)found * (uint64_t)k;                       \
                r = (load_be64(rb + (bit >> 3), rend, 0) << (bit & 7)) >> (64 - k);           \
            }                                                                                 \
            if (q > limit) return PAST;                                                       \
            at += (int64_t)((q << k) + r + 1);                                                \
            if (at >= (int64_t)nwords) return PAST;                                           \
            EMIT;                                                                             \
            found++;                                                                          \
        }                                                                                     \
    }                                                                                         \
    if (found < count) return "unary stream is too short";                                    \
    DONE;                                                                                     \
    return NULL;

#define RICE_PAST "rice block points past the end of its block"

/* ---- Rice codes decoded 16 at a time (AVX-512) or 8 (AVX2)
 *
 * The scalar walk finds each code's end with a count of leading zeros that waits for the one
 * before (about 4.4 ns a change on a 42%-changed BF16 block here). With AVX-512 the walk goes
 * in two steps instead, with no chain from change to change but an addition:
 * - the ends of 64 bits of unary codes at once: the stream's 0-bits, compressed out of a byte
 *   table by their mask (VPCOMPRESSB), into a small buffer of 32-bit bit indices;
 * - 16 positions at once from 16 ends: position i = (q[0] + ... + q[i] << k) + r[0] + ... +
 *   r[i] + i, where q[0] + ... + q[i] = end[i] - i; the 16 k-bit remainders come out of one
 *   64-byte load by one byte permutation (VPERMB) and a shift per lane, and their running sum
 *   is a scan of 4 steps.
 * The vector walk takes groups of 16 whole codes whose positions all lie in the block; it
 * stops at the first group that does not, or where whole 64-bit words of the unary stream run
 * out, and the scalar walk goes on from there (and finds the error, if there is one, as it
 * would have from the start). With 32-bit lanes it needs fewer than 2^27 words in the block
 * and a unary stream under 2^28 bytes (its positions, unary bits and sums of remainders stay
 * below 2^32), and k <= 24. A walk may start part way into both streams (codec 4's runs, one
 * per context, follow each other), at unary bit ubit0 and remainder bit rbit0: then
 * q[0] + ... + q[i] = end[i] - ubit0 - i, with i counted from the walk's first code.
 * Without AVX-512 an AVX2 walk does the same 8 codes at a time (rice_vec_positions_avx2), for
 * k <= 14; measured on real 8 MiB blocks here it applies a codec 5/6 block in 1.4-1.9 ns a
 * change where the scalar walk took 4-6.5. */
#if HAVE_AVX512_LOOPS
#define RICE_VEC_WORDS ((size_t)1 << 27)
#define RICE_VEC_UNARY ((size_t)1 << 28)
#define RICE_VEC_MAX_K 24
#define RICE_VEC2_MAX_K 14 /* the AVX2 walk: 4 remainders and a byte's offset fit in 63 bits */
#define RICE_VEC_FILL 192  /* the ends buffer is refilled up to this many */

typedef struct {
    const uint8_t *ub, *rb;
    size_t uwords, rlen, count, nwords, ubit0, rbit0;
    int k, stopped;
    size_t found;      /* codes turned into positions */
    size_t next;       /* the next 64-bit word of the unary stream to read */
    size_t head, tail; /* ends[head:tail]: ends found, not yet used */
    uint32_t rsum;     /* r[0] + ... + r[found - 1] */
    int64_t at, end_before; /* the last position handed out and its code's end (-1: none) */
    uint8_t take[64];  /* remainder j's four bytes (most significant first), for VPERMB */
    uint32_t shift[16];
    uint32_t ends[RICE_VEC_FILL + 64 + 16];
} RiceVec;

static int rice_vec_fits(size_t nwords, size_t ulen, size_t count, int k) {
    return (use_avx512 ? k <= RICE_VEC_MAX_K : use_avx2 && k <= RICE_VEC2_MAX_K) &&
           nwords < RICE_VEC_WORDS && ulen < RICE_VEC_UNARY && count >= 16;
}

static void rice_vec_init(RiceVec *v, const uint8_t *ub, size_t ulen, const uint8_t *rb,
                          const uint8_t *rend, size_t count, int k, size_t nwords,
                          uint64_t ubit0, uint64_t rbit0) {
    v->ub = ub;
    v->rb = rb;
    v->ubit0 = (size_t)ubit0;
    v->rbit0 = (size_t)rbit0;
    v->uwords = ulen / 8;
    v->rlen = (size_t)(rend - rb);
    v->count = count;
    v->nwords = nwords;
    v->k = k;
    v->stopped = 0;
    v->found = v->head = v->tail = 0;
    v->next = (size_t)(ubit0 / 64);
    v->rsum = 0;
    v->at = -1;
    v->end_before = (int64_t)ubit0 - 1;
    /* Groups start 16 k bits apart, a whole number of bytes: remainder j of a group starts at
     * bit rbit0 % 8 + j k of the 64 bytes loaded at its first remainder's byte. */
    for (int j = 0; j < 16; j++) {
        int bit = (int)(rbit0 & 7) + j * k;
        for (int b = 0; b < 4; b++) v->take[4 * j + b] = (uint8_t)((bit >> 3) + 3 - b);
        v->shift[j] = (uint32_t)(bit & 7);
    }
}

/* The ends of the next 64-bit word of the unary stream appended to v->ends. */
static inline __attribute__((always_inline)) AVX512_TARGET void rice_vec_read(RiceVec *v,
                                                                             __m512i iota8,
                                                                             __m512i down8) {
    uint64_t raw;
    memcpy(&raw, v->ub + 8 * v->next, 8);
    /* Bit j of the stream (most significant first) is bit 63 - j of z; down8's byte m is
     * 63 - m, so the compressed bytes are the ends, last first: reversed by the permutation. */
    uint64_t z = ~__builtin_bswap64(raw);
    if (v->next == v->ubit0 / 64) z &= ~0ull >> (v->ubit0 % 64); /* codes before the walk's */
    int c = __builtin_popcountll(z);
    __m512i e = _mm512_maskz_compress_epi8(z, down8);
    e = _mm512_permutexvar_epi8(_mm512_sub_epi8(_mm512_set1_epi8((char)(c - 1)), iota8), e);
    __m512i base = _mm512_set1_epi32((int)(64 * v->next));
    uint32_t *dst = v->ends + v->tail;
    _mm512_storeu_si512(dst,
                        _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(e)), base));
    if (c > 16) {
        _mm512_storeu_si512(dst + 16, _mm512_add_epi32(
            _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(e, 1)), base));
        if (c > 32) {
            _mm512_storeu_si512(dst + 32, _mm512_add_epi32(
                _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(e, 2)), base));
            _mm512_storeu_si512(dst + 48, _mm512_add_epi32(
                _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(e, 3)), base));
        }
    }
    v->tail += (size_t)c;
    v->next++;
}

/* The AVX-512 walk: up to RICE_VEC_BATCH more positions (a multiple of 16) into out; 0 once
 * the vector walk is done, at v->found codes. */
static AVX512_TARGET __attribute__((noinline)) size_t rice_vec_positions_avx512(RiceVec *v,
                                                                               uint32_t *out) {
    if (v->stopped) return 0;
    const __m512i iota8 = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
        41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i down8 = _mm512_sub_epi8(_mm512_set1_epi8(63), iota8);
    const __m512i zero = _mm512_setzero_si512(), last = _mm512_set1_epi32(15);
    const int k = v->k;
    const __m128i up = _mm_cvtsi32_si128(k), down = _mm_cvtsi32_si128(32 - k);
    const __m512i limit = _mm512_set1_epi32((int)(v->nwords >> k));
    const __m512i nwords = _mm512_set1_epi32((int)v->nwords);
    const __m512i take = _mm512_loadu_si512(v->take), shift = _mm512_loadu_si512(v->shift);
    __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32((int)v->found),
                                     _mm512_cvtepu8_epi32(_mm512_castsi512_si128(iota8)));
    /* The walk's first bit, so that end - it - index is q[0] + ... + q[index]. */
    const __m512i ubit0 = _mm512_set1_epi32((int)v->ubit0);
    __m512i rsum = _mm512_set1_epi32((int)v->rsum);
    __m512i pos = zero, ends = zero;
    size_t n = 0;
    while (n < RICE_VEC_BATCH) {
        if (v->found + 16 > v->count) {
            v->stopped = 1;
            break;
        }
        if (v->tail - v->head < 16) {
            /* Move the few ends left to the front (one vector: the buffer has room past
             * tail), then read words of the stream until the buffer is nearly full. */
            _mm512_storeu_si512(v->ends, _mm512_loadu_si512(v->ends + v->head));
            v->tail -= v->head;
            v->head = 0;
            while (v->tail < RICE_VEC_FILL && v->next < v->uwords) rice_vec_read(v, iota8, down8);
            if (v->tail < 16) {
                v->stopped = 1;
                break;
            }
        }
        __m512i e = _mm512_loadu_si512(v->ends + v->head);
        __m512i q = _mm512_sub_epi32(_mm512_sub_epi32(e, ubit0), lanes); /* q[0] + ... + q[i] */
        if (_mm512_cmpgt_epu32_mask(q, limit)) {
            v->stopped = 1;
            break;
        }
        __m512i p = _mm512_add_epi32(q, lanes), sum = rsum;
        if (k) {
            size_t byte = (v->rbit0 + v->found * (size_t)k) >> 3, left = v->rlen - byte;
            __m512i w = left >= 64 ? _mm512_loadu_si512(v->rb + byte)
                                   : _mm512_maskz_loadu_epi8((1ull << left) - 1, v->rb + byte);
            __m512i r = _mm512_srl_epi32(
                _mm512_sllv_epi32(_mm512_permutexvar_epi8(take, w), shift), down);
            r = _mm512_add_epi32(r, _mm512_alignr_epi32(r, zero, 15));
            r = _mm512_add_epi32(r, _mm512_alignr_epi32(r, zero, 14));
            r = _mm512_add_epi32(r, _mm512_alignr_epi32(r, zero, 12));
            r = _mm512_add_epi32(r, _mm512_alignr_epi32(r, zero, 8));
            r = _mm512_add_epi32(r, rsum);
            sum = _mm512_permutexvar_epi32(last, r);
            p = _mm512_add_epi32(_mm512_add_epi32(_mm512_sll_epi32(q, up), r), lanes);
        }
        if (_mm512_cmpge_epu32_mask(p, nwords)) {
            v->stopped = 1;
            break;
        }
        _mm512_storeu_si512(out + n, p);
        pos = p;
        ends = e;
        rsum = sum;
        lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
        v->found += 16;
        v->head += 16;
        n += 16;
    }
    if (n) {
        v->at = (int64_t)(uint32_t)_mm512_cvtsi512_si32(_mm512_permutexvar_epi32(last, pos));
        v->end_before =
            (int64_t)(uint32_t)_mm512_cvtsi512_si32(_mm512_permutexvar_epi32(last, ends));
        v->rsum = (uint32_t)_mm512_cvtsi512_si32(rsum);
    }
    return n;
}

/* The AVX2 walk, where AVX-512 is missing: the same two steps, 8 codes at a time.
 * - Ends: each byte of the unary stream looks up the offsets of its 0-bits in a table (ends_in)
 *   and stores all 8 of them, widened to 32 bits, where the buffer's next end goes; the count
 *   of its 0-bits moves that place on, so the offsets past it are written over by the next.
 * - Positions: the 8 k-bit remainders come out of two 64-bit loads of the remainder stream (4
 *   each, k <= 14), by a shift per 64-bit lane; their running sum is a scan of 3 steps. */
static uint8_t ends_in[256][8]; /* byte b: the offsets (0: its first, top bit) of its 0-bits */

static void fill_ends_in(void) {
    for (int b = 0; b < 256; b++) {
        int c = 0;
        for (int j = 0; j < 8; j++)
            if (!(b & (0x80 >> j))) ends_in[b][c++] = (uint8_t)j;
    }
}

static inline __attribute__((always_inline)) AVX2_TARGET void rice_vec_read_avx2(RiceVec *v) {
    uint64_t raw;
    memcpy(&raw, v->ub + 8 * v->next, 8);
    uint64_t ones = __builtin_bswap64(raw); /* stream bit j is bit 63 - j */
    if (v->next == v->ubit0 / 64 && v->ubit0 % 64)
        ones |= ~0ull << (64 - v->ubit0 % 64); /* the codes before the walk's */
    uint32_t *dst = v->ends + v->tail;
    const __m256i base = _mm256_set1_epi32((int)(64 * v->next));
    size_t c = 0;
    for (int b = 0; b < 8; b++) {
        unsigned byte = (unsigned)(ones >> (56 - 8 * b)) & 0xFF;
        __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ends_in[byte]));
        e = _mm256_add_epi32(e, _mm256_add_epi32(base, _mm256_set1_epi32(8 * b)));
        _mm256_storeu_si256((__m256i *)(dst + c), e);
        c += 8 - (size_t)__builtin_popcount(byte);
    }
    v->tail += c;
    v->next++;
}

/* Four k-bit remainders from bit `bit` of the remainder stream, in the 64-bit lanes. */
static inline __attribute__((always_inline)) AVX2_TARGET __m256i
rice_vec_four_avx2(const RiceVec *v, size_t bit, __m256i shifts, __m256i low) {
    uint64_t w = load_be64(v->rb + (bit >> 3), v->rb + v->rlen, 0) << (bit & 7);
    return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)w), shifts), low);
}

/* Lanes of x outside [0, most]: unsigned x > most, as AVX2 has only signed compares. The lanes
 * stay below 2^31 (rice_vec_fits), so none is negative where the streams make sense; checked
 * anyway, so that no mistake here can write outside the block. */
static inline __attribute__((always_inline)) AVX2_TARGET __m256i outside_avx2(__m256i x,
                                                                           __m256i most) {
    return _mm256_or_si256(_mm256_cmpgt_epi32(x, most),
                           _mm256_cmpgt_epi32(_mm256_setzero_si256(), x));
}

static AVX2_TARGET __attribute__((noinline)) size_t rice_vec_positions_avx2(RiceVec *v,
                                                                          uint32_t *out) {
    if (v->stopped) return 0;
    const int k = v->k;
    const __m128i up = _mm_cvtsi32_si128(k);
    const __m256i limit = _mm256_set1_epi32((int)(v->nwords >> k));
    const __m256i most = _mm256_set1_epi32((int)v->nwords - 1);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i last = _mm256_set1_epi32(7), zero = _mm256_setzero_si256();
    /* Remainder j of four at the top of a 64-bit word: shifted down by 64 - k (j + 1). */
    const long long kk = k;
    const __m256i shifts = _mm256_setr_epi64x(64 - kk, 64 - 2 * kk, 64 - 3 * kk, 64 - 4 * kk);
    const __m256i low = _mm256_set1_epi64x((long long)((1ull << k) - 1));
    const __m256i evens_then_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32((int)v->found), iota);
    const __m256i ubit0 = _mm256_set1_epi32((int)v->ubit0);
    __m256i rsum = _mm256_set1_epi32((int)v->rsum);
    __m256i pos = zero, ends = zero;
    size_t n = 0;
    while (n < RICE_VEC_BATCH) {
        if (v->found + 8 > v->count) {
            v->stopped = 1;
            break;
        }
        if (v->tail - v->head < 8) {
            /* Move the few ends left to the front (one vector: the buffer has room past
             * tail), then read words of the stream until the buffer is nearly full. */
            _mm256_storeu_si256((__m256i *)v->ends,
                                _mm256_loadu_si256((const __m256i *)(v->ends + v->head)));
            v->tail -= v->head;
            v->head = 0;
            while (v->tail < RICE_VEC_FILL && v->next < v->uwords) rice_vec_read_avx2(v);
            if (v->tail < 8) {
                v->stopped = 1;
                break;
            }
        }
        __m256i e = _mm256_loadu_si256((const __m256i *)(v->ends + v->head));
        __m256i q = _mm256_sub_epi32(_mm256_sub_epi32(e, ubit0), lanes); /* q[0] + ... + q[i] */
        if (_mm256_movemask_epi8(outside_avx2(q, limit))) {
            v->stopped = 1;
            break;
        }
        __m256i p = _mm256_add_epi32(q, lanes), sum = rsum;
        if (k) {
            size_t bit = v->rbit0 + v->found * (size_t)k;
            __m256i a = rice_vec_four_avx2(v, bit, shifts, low);
            __m256i b = rice_vec_four_avx2(v, bit + 4 * (size_t)k, shifts, low);
            __m256i r = _mm256_permutevar8x32_epi32(_mm256_or_si256(a, _mm256_slli_epi64(b, 32)),
                                                    evens_then_odds);
            r = _mm256_add_epi32(r, _mm256_slli_si256(r, 4));
            r = _mm256_add_epi32(r, _mm256_slli_si256(r, 8));
            r = _mm256_add_epi32(r, _mm256_permute2x128_si256(
                                        _mm256_shuffle_epi32(r, 0xFF), r, 0x08));
            r = _mm256_add_epi32(r, rsum);
            sum = _mm256_permutevar8x32_epi32(r, last);
            p = _mm256_add_epi32(_mm256_add_epi32(_mm256_sll_epi32(q, up), r), lanes);
        }
        if (_mm256_movemask_epi8(outside_avx2(p, most))) {
            v->stopped = 1;
            break;
        }
        _mm256_storeu_si256((__m256i *)(out + n), p);
        pos = p;
        ends = e;
        rsum = sum;
        lanes = _mm256_add_epi32(lanes, _mm256_set1_epi32(8));
        v->found += 8;
        v->head += 8;
        n += 8;
    }
    if (n) {
        v->at = (int64_t)(uint32_t)_mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(pos, last));
        v->end_before =
            (int64_t)(uint32_t)_mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(ends, last));
        v->rsum = (uint32_t)_mm256_cvtsi256_si32(rsum);
    }
    return n;
}

/* Up to RICE_VEC_BATCH more positions into out (a multiple of 16 with AVX-512, of 8 with
 * AVX2); 0 once the vector walk is done, at v->found codes. */
static size_t rice_vec_positions(RiceVec *v, uint32_t *out) {
    return use_avx512 ? rice_vec_positions_avx512(v, out) : rice_vec_positions_avx2(v, out);
}

/* The first codes of a walk by the vector walk, where it can take them (rice_vec_fits): from
 * unary bit UBIT0 and remainder bit RBIT0, a batch of n positions at a time (batch[0..n), codes
 * found .. found + n - 1), each batch handed to BATCH, after which found moves on by n. Leaves
 * at and end_before for the scalar walk, which goes on from code found. Expects ub, ulen, rb,
 * rend, count, k and nwords, and found = 0, at = -1 and end_before = UBIT0 - 1, in scope. */
#define RICE_VEC_FIRST(UBIT0, RBIT0, BATCH)                                                   \
    if (rice_vec_fits(nwords, ulen, count, k)) {                                              \
        RiceVec v;                                                                            \
        uint32_t batch[RICE_VEC_BATCH];                                                       \
        rice_vec_init(&v, ub, ulen, rb, rend, count, k, nwords, UBIT0, RBIT0);                \
        for (size_t n; (n = rice_vec_positions(&v, batch)); found += n) {                     \
            BATCH;                                                                            \
        }                                                                                     \
        at = v.at;                                                                            \
        end_before = v.end_before;                                                            \
    }
#else
#define RICE_VEC_FIRST(UBIT0, RBIT0, BATCH)
#endif

static const char *rice_walk_positions(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                       const uint8_t *rend, size_t count, int k, size_t nwords,
                                       int64_t *out, uint64_t ubit0, size_t found0, int64_t at0) {
    RICE_WALK(ubit0, 0, found0, at0, RICE_PAST, out[found] = at, (void)0)
}

static const char *rice_positions(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                  const uint8_t *rend, size_t count, int k, size_t nwords,
                                  int64_t *out) {
    size_t found = 0;
    int64_t at = -1, end_before = -1;
    RICE_VEC_FIRST(0, 0, for (size_t j = 0; j < n; j++) out[found + j] = batch[j])
    return rice_walk_positions(ub, ulen, rb, rend, count, k, nwords, out,
                               (uint64_t)(end_before + 1), found, at);
}

/* One context's run of a codec 4 block: each change's rank among the words of its key (the
 * ranks count words, not changes, but are Rice-coded as codec 5 codes positions), read from
 * bit ubit0 of the unary stream and bit rbit0 of the remainder stream; *next is the unary bit
 * where the next context's run starts. */
static const char *context_walk(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                const uint8_t *rend, size_t count, int k, size_t nwords,
                                uint64_t ubit0, uint64_t rbit0, int64_t *out, uint64_t *next,
                                size_t found0, int64_t at0) {
    RICE_WALK(ubit0, rbit0, found0, at0, "context block points past the end of a context",
              out[found] = at, *next = (uint64_t)(end_before + 1))
}

static const char *context_run(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                               const uint8_t *rend, size_t count, int k, size_t nwords,
                               uint64_t ubit0, uint64_t rbit0, int64_t *out, uint64_t *next) {
    size_t found = 0;
    int64_t at = -1, end_before = (int64_t)ubit0 - 1;
    RICE_VEC_FIRST(ubit0, rbit0, for (size_t j = 0; j < n; j++) out[found + j] = batch[j])
    return context_walk(ub, ulen, rb, rend, count, k, nwords, (uint64_t)(end_before + 1), rbit0,
                        out, next, found, at);
}

/* rice_decode(unary, remainder, count, k, nwords) -> positions (int64, as a bytearray).
 *
 * The walk of RICE_WALK, 16 codes at a time with AVX-512 where it can (rice_vec_positions). */
static PyObject *rice_decode(PyObject *self, PyObject *args) {
    Py_buffer u, rem;
    Py_ssize_t count, nwords;
    int k;
    if (!PyArg_ParseTuple(args, "y*y*nin", &u, &rem, &count, &k, &nwords)) return NULL;
    PyObject *result = NULL;
    if (count <= 0 || count > nwords || k < 0 || k > MAX_RICE_K) {
        PyErr_SetString(PyExc_ValueError, "rice_decode: bad count or k");
        goto done;
    }
    if ((uint64_t)rem.len != ((uint64_t)count * (uint64_t)k + 7) / 8) {
        corrupt("remainder stream has the wrong length");
        goto done;
    }
    result = PyByteArray_FromStringAndSize(NULL, count * 8);
    if (!result) goto done;
    int64_t *out = (int64_t *)PyByteArray_AS_STRING(result);
    /* Quotients are at most the gaps, which add up to less than nwords: read no further. */
    size_t ulen = (size_t)u.len, bound = ((size_t)count + (size_t)nwords + 7) / 8;
    if (ulen > bound) ulen = bound;
    const char *error;
    Py_BEGIN_ALLOW_THREADS
    error = rice_positions(u.buf, ulen, rem.buf, (const uint8_t *)rem.buf + rem.len,
                           (size_t)count, k, (size_t)nwords, out);
    Py_END_ALLOW_THREADS
    if (error) {
        Py_CLEAR(result);
        corrupt(error);
    }
done:
    PyBuffer_Release(&u);
    PyBuffer_Release(&rem);
    return result;
}

