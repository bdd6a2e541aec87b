/* pulsectl/_speedups.c, part: finding changed words and listing their moves (diff).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

/* ---------------------------------------------------------------- changed words */

typedef uint16_t __attribute__((may_alias, aligned(1))) u16a;
typedef uint32_t __attribute__((may_alias, aligned(1))) u32a;
typedef uint64_t __attribute__((may_alias, aligned(1))) u64a;

typedef uint8_t v16 __attribute__((vector_size(16))); /* SSE2 on x86-64, NEON on arm64 */

/* One bit per byte of the 64 bytes at x and y, set where they differ (bit k: byte k). */
static inline uint64_t span_mask(const uint8_t *x, const uint8_t *y) {
    uint64_t mask = 0;
    for (int j = 0; j < 4; j++) {
        v16 p, q;
        memcpy(&p, x + 16 * j, 16);
        memcpy(&q, y + 16 * j, 16);
#if defined(__SSE2__)
        uint64_t eq = (uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8((__m128i)p, (__m128i)q));
        mask |= (~eq & 0xFFFFu) << (16 * j);
#else
        v16 ne = (v16)(p != q); /* 0xFF where the bytes differ */
        uint64_t lanes[2];
        memcpy(lanes, &ne, 16);
        for (int h = 0; h < 2; h++) { /* each byte's top bit, gathered into 8 bits */
            uint64_t top = ((lanes[h] & 0x8080808080808080ull) * 0x0002040810204081ull) >> 56;
            mask |= top << (16 * j + 8 * h);
        }
#endif
    }
    return mask;
}

/* The byte mask of span_mask folded to one bit per word of `size` bytes: the word's lowest
 * bit, set where any of its bytes differs. */
static inline uint64_t word_mask(uint64_t mask, size_t size) {
    if (size >= 2) mask |= mask >> 1;
    if (size >= 4) mask |= mask >> 2;
    if (size >= 8) mask |= mask >> 4;
    return size == 1   ? mask
           : size == 2 ? mask & 0x5555555555555555ull
           : size == 4 ? mask & 0x1111111111111111ull
                       : mask & 0x0101010101010101ull;
}

/* The set bits of x (a plain x86-64 build has no popcnt instruction: GCC would call libgcc). */
static inline size_t bit_count(uint64_t x) {
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (size_t)((x * 0x0101010101010101ull) >> 56);
}

/* List the words that differ in one pass into `out` (room for nwords + 1 indices; only the
 * first count + 1 are touched), 64 bytes at a time: a span that is equal is skipped; in one
 * with a few changes (a quarter of its words at most) the changes are visited alone, from the
 * span's mask; in the others every index is stored and the count moves on only where the
 * words differ (no branch to mispredict when a third of the words change). With `planes`, the
 * zigzag move of each word also goes into `word` planes (plane p at planes + p * stride), the
 * value planes of codecs 3-7 (before pairing), while both words are in registers. One function per word type. */
#define PREFETCH_AHEAD 2048

#define CHANGES_OF(NAME, T)                                                                   \
    static inline __attribute__((always_inline)) size_t NAME##_body(                          \
        const uint8_t *restrict a, const uint8_t *restrict b, size_t nwords,                  \
        int64_t *restrict out, uint8_t *restrict planes, size_t stride, const int with_planes) { \
        const T *x = (const T *)a, *y = (const T *)b;                                         \
        const size_t per_span = 64 / sizeof(T);                                               \
        const int top = 8 * (int)sizeof(T) - 1;                                               \
        size_t count = 0, i = 0;                                                              \
        for (; i < nwords; i += per_span) {                                                   \
            size_t end = i + per_span <= nwords ? i + per_span : nwords;                      \
            /* Inputs are often memory maps: ask for the bytes ahead (prefetchers stop at     \
             * page edges). Prefetching never faults, past the end neither. */                 \
            __builtin_prefetch(a + i * sizeof(T) + PREFETCH_AHEAD);                           \
            __builtin_prefetch(b + i * sizeof(T) + PREFETCH_AHEAD);                           \
            if (end - i == per_span) {                                                        \
                uint64_t m = word_mask(span_mask(a + i * sizeof(T), b + i * sizeof(T)),       \
                                       sizeof(T));                                            \
                if (!m) continue;                                                             \
                if (bit_count(m) <= per_span / 4) {                                           \
                    /* A few changes: visit them alone, from the mask. */                     \
                    do {                                                                      \
                        size_t j = i + (size_t)__builtin_ctzll(m) / sizeof(T);                \
                        m &= m - 1;                                                           \
                        T u = x[j], v = y[j];                                                 \
                        out[count] = (int64_t)j;                                              \
                        if (with_planes) {                                                    \
                            T d = (T)(v - u);                                                 \
                            T z = (T)((T)(d << 1) ^ (T)((T)0 - (T)(d >> top)));               \
                            for (size_t p = 0; p < sizeof(T); p++)                            \
                                planes[p * stride + count] = (uint8_t)((uint64_t)z >> (8 * p)); \
                        }                                                                     \
                        count++;                                                              \
                    } while (m);                                                              \
                    continue;                                                                 \
                }                                                                             \
            }                                                                                 \
            for (size_t j = i; j < end; j++) {                                                \
                T u = x[j], v = y[j];                                                         \
                out[count] = (int64_t)j;                                                      \
                if (with_planes) { /* a constant in each of the two functions below */         \
                    T d = (T)(v - u);                                                         \
                    T z = (T)((T)(d << 1) ^ (T)((T)0 - (T)(d >> top)));                       \
                    for (size_t p = 0; p < sizeof(T); p++)                                    \
                        planes[p * stride + count] = (uint8_t)((uint64_t)z >> (8 * p));       \
                }                                                                             \
                count += u != v;                                                              \
            }                                                                                 \
        }                                                                                     \
        return count;                                                                         \
    }                                                                                         \
    static size_t NAME##_list(const uint8_t *a, const uint8_t *b, size_t nwords, int64_t *out, \
                              uint8_t *planes, size_t stride) {                               \
        return planes ? NAME##_body(a, b, nwords, out, planes, stride, 1)                     \
                      : NAME##_body(a, b, nwords, out, NULL, stride, 0);                      \
    }

CHANGES_OF(w1, uint8_t)
CHANGES_OF(w2, u16a)
CHANGES_OF(w4, u32a)
CHANGES_OF(w8, u64a)

#if HAVE_AVX512_LOOPS
/* w2_list with planes, on AVX-512: per 32 words, one compare gives the mask of the changed
 * ones; their zigzag moves are compressed to the front of a register and split into the two
 * planes, and so are their indices. Every store is a whole register at or after `count`, which
 * is never past the first word of the span, and ends inside the span's own room: the buffers
 * need no more than the portable loop's. */
static AVX512_TARGET size_t w2_list_avx512(const uint8_t *a, const uint8_t *b, size_t nwords,
                                           int64_t *restrict out, uint8_t *restrict planes,
                                           size_t stride) {
    size_t count = 0, i = 0;
    const __m512i iota16 = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19,
                                            18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                            4, 3, 2, 1, 0);
    for (; i + 32 <= nwords; i += 32) {
        __builtin_prefetch(a + 2 * i + PREFETCH_AHEAD);
        __builtin_prefetch(b + 2 * i + PREFETCH_AHEAD);
        __m512i u = _mm512_loadu_si512((const void *)(a + 2 * i));
        __m512i v = _mm512_loadu_si512((const void *)(b + 2 * i));
        __mmask32 m = _mm512_cmpneq_epi16_mask(u, v);
        if (!m) continue;
        __m512i d = _mm512_sub_epi16(v, u);
        __m512i z = _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
        __m512i packed = _mm512_maskz_compress_epi16(m, z);
        _mm256_storeu_si256((__m256i *)(planes + count), _mm512_cvtepi16_epi8(packed));
        _mm256_storeu_si256((__m256i *)(planes + stride + count),
                            _mm512_cvtepi16_epi8(_mm512_srli_epi16(packed, 8)));
        /* The indices within the span, compressed as 16-bit lanes, then widened 8 at a time
         * and offset by i: one store where the span has at most 8 changes (nearly every one
         * when few words change), four otherwise. */
        __m512i lanes = _mm512_maskz_compress_epi16(m, iota16);
        __m512i base = _mm512_set1_epi64((long long)i);
        _mm512_storeu_si512((void *)(out + count),
                            _mm512_add_epi64(base, _mm512_cvtepu16_epi64(
                                                       _mm512_castsi512_si128(lanes))));
        size_t found = (size_t)__builtin_popcount(m);
        if (found > 8) {
            _mm512_storeu_si512((void *)(out + count + 8),
                                _mm512_add_epi64(base, _mm512_cvtepu16_epi64(
                                                           _mm512_extracti32x4_epi32(lanes, 1))));
            _mm512_storeu_si512((void *)(out + count + 16),
                                _mm512_add_epi64(base, _mm512_cvtepu16_epi64(
                                                           _mm512_extracti32x4_epi32(lanes, 2))));
            _mm512_storeu_si512((void *)(out + count + 24),
                                _mm512_add_epi64(base, _mm512_cvtepu16_epi64(
                                                           _mm512_extracti32x4_epi32(lanes, 3))));
        }
        count += found;
    }
    for (; i < nwords; i++) { /* the last words, fewer than 32 */
        uint16_t x, y;
        memcpy(&x, a + 2 * i, 2);
        memcpy(&y, b + 2 * i, 2);
        uint16_t dd = (uint16_t)(y - x);
        uint16_t zz = (uint16_t)((uint16_t)(dd << 1) ^ (uint16_t)(0 - (dd >> 15)));
        out[count] = (int64_t)i;
        planes[count] = (uint8_t)zz;
        planes[stride + count] = (uint8_t)(zz >> 8);
        count += x != y;
    }
    return count;
}
#endif

#if HAVE_AVX2_LOOPS
/* For w2_list_avx2, per mask m of 8 words (bit j: word j changed): the shuffle that moves the
 * low bytes of the changed words' 16-bit lanes to the front of a register and their high
 * bytes to its second half, and the changed words' lane numbers, in order. Filled at import. */
static uint8_t avx2_split[256][16], avx2_lanes[256][8];

static void fill_avx2_tables(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        memset(avx2_split[m], 0x80, 16); /* a shuffle index with the top bit set gives zero */
        for (int j = 0; j < 8; j++) {
            if (!(m >> j & 1)) continue;
            avx2_split[m][k] = (uint8_t)(2 * j);
            avx2_split[m][8 + k] = (uint8_t)(2 * j + 1);
            avx2_lanes[m][k++] = (uint8_t)j;
        }
    }
}

/* The changes of 8 words at `at`, with z their zigzag moves and m the mask of the changed
 * ones: plane bytes and indices compressed to `count` by the tables. Like w2_list_avx512, the
 * stores are whole registers from `count` on (8 plane bytes, 8 indices), which the caller's
 * room covers: count is at most `at`. */
static inline __attribute__((always_inline)) AVX2_TARGET size_t
w2_put_8(__m128i z, unsigned m, size_t at, size_t count, int64_t *restrict out,
         uint8_t *restrict planes, size_t stride) {
    __m128i split = _mm_shuffle_epi8(z, _mm_loadu_si128((const __m128i *)avx2_split[m]));
    _mm_storel_epi64((__m128i *)(planes + count), split);
    _mm_storel_epi64((__m128i *)(planes + stride + count), _mm_srli_si128(split, 8));
    __m128i lanes = _mm_loadl_epi64((const __m128i *)avx2_lanes[m]);
    __m256i base = _mm256_set1_epi64x((long long)at);
    _mm256_storeu_si256((__m256i *)(out + count),
                        _mm256_add_epi64(base, _mm256_cvtepu8_epi64(lanes)));
    _mm256_storeu_si256((__m256i *)(out + count + 4),
                        _mm256_add_epi64(base, _mm256_cvtepu8_epi64(_mm_srli_si128(lanes, 4))));
    return count + (size_t)__builtin_popcount(m);
}

/* w2_list_avx2 over the 16-word spans of words [i, end), end - i a multiple of 16: one compare
 * per span; where any words differ (in every span unless `skip`), each half of 8 is compressed
 * by table (AVX2 has no compress instruction). */
static inline __attribute__((always_inline)) AVX2_TARGET size_t
w2_spans_avx2(const uint8_t *a, const uint8_t *b, size_t i, size_t end, size_t count,
              int64_t *restrict out, uint8_t *restrict planes, size_t stride, const int skip) {
    for (; i < end; i += 16) {
        __builtin_prefetch(a + 2 * i + PREFETCH_AHEAD);
        __builtin_prefetch(b + 2 * i + PREFETCH_AHEAD);
        __m256i u = _mm256_loadu_si256((const __m256i *)(a + 2 * i));
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2 * i));
        __m256i same = _mm256_cmpeq_epi16(u, v);
        if (skip && _mm256_movemask_epi8(same) == -1) continue;
        /* One byte per word: words 0-7 in bits 0-7, words 8-15 in bits 16-23 (packs works
         * within each 128-bit half). */
        unsigned bits = ~(unsigned)_mm256_movemask_epi8(_mm256_packs_epi16(same, same));
        __m256i d = _mm256_sub_epi16(v, u);
        __m256i z = _mm256_xor_si256(_mm256_slli_epi16(d, 1), _mm256_srai_epi16(d, 15));
        count = w2_put_8(_mm256_castsi256_si128(z), bits & 0xFF, i, count, out, planes, stride);
        count = w2_put_8(_mm256_extracti128_si256(z, 1), (bits >> 16) & 0xFF, i + 8, count, out,
                         planes, stride);
    }
    return count;
}

/* w2_list with planes, on AVX2, in stretches of W2_STRETCH words. Skipping a span where no word
 * differs saves its compression but costs a mispredicted branch whenever the guess is wrong;
 * once more than 1 word in 40 changes (a span of 16 then differs a third of the time) that
 * costs more than it saves, so a stretch skips only where the one before had fewer changes. */
#define W2_STRETCH 4096
static AVX2_TARGET size_t w2_list_avx2(const uint8_t *a, const uint8_t *b, size_t nwords,
                                       int64_t *restrict out, uint8_t *restrict planes,
                                       size_t stride) {
    size_t count = 0, i = 0, spans = nwords & ~(size_t)15, before = 0;
    while (i < spans) {
        size_t end = spans - i > W2_STRETCH ? i + W2_STRETCH : spans;
        size_t changed = count - before;
        before = count;
        if (changed * 40 > W2_STRETCH)
            count = w2_spans_avx2(a, b, i, end, count, out, planes, stride, 0);
        else
            count = w2_spans_avx2(a, b, i, end, count, out, planes, stride, 1);
        i = end;
    }
    for (; i < nwords; i++) { /* the last words, fewer than 16 */
        uint16_t x, y;
        memcpy(&x, a + 2 * i, 2);
        memcpy(&y, b + 2 * i, 2);
        uint16_t dd = (uint16_t)(y - x);
        uint16_t zz = (uint16_t)((uint16_t)(dd << 1) ^ (uint16_t)(0 - (dd >> 15)));
        out[count] = (int64_t)i;
        planes[count] = (uint8_t)zz;
        planes[stride + count] = (uint8_t)(zz >> 8);
        count += x != y;
    }
    return count;
}
#endif

/* Buffers of each thread, kept from call to call (a fresh allocation of a few MB costs its
 * page faults again at every block):
 * - changes() lists into `scratch` (room for every word of the largest block seen: only the
 *   pages a listing reaches are ever touched), and returns a copy of what was found;
 * - context_encode keeps each change's rank, gap, key and move in `ctx_scratch`, and the
 *   select walk's bitmaps in `encode_maps`; context_scatter's select walk, its scratch in
 *   `select_scratch`.
 * They are freed when their thread ends (a program that applies patches step after step makes
 * new worker threads each time: it used to keep every dead thread's buffers, ~16 MB each). */
static __thread int64_t *scratch = NULL;
static __thread size_t scratch_cap = 0;
static __thread uint8_t *ctx_scratch = NULL;
static __thread size_t ctx_scratch_cap = 0;
static __thread uint64_t *encode_maps = NULL;
static __thread size_t encode_maps_cap = 0;
static __thread void *select_scratch = NULL;
static __thread size_t select_scratch_cap = 0;

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
static pthread_key_t buffers_key;
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;
static __thread int buffers_watched = 0;

static void free_thread_buffers(void *unused) {
    free(scratch);
    free(ctx_scratch);
    free(encode_maps);
    free(select_scratch);
    scratch = NULL, ctx_scratch = NULL, encode_maps = NULL, select_scratch = NULL;
    scratch_cap = ctx_scratch_cap = encode_maps_cap = select_scratch_cap = 0;
    buffers_watched = 0;
}

static void make_buffers_key(void) { pthread_key_create(&buffers_key, free_thread_buffers); }

/* The thread's buffers are freed when it ends (the key's value must not be NULL for that). */
static void watch_thread_buffers(void) {
    if (buffers_watched) return;
    pthread_once(&buffers_once, make_buffers_key);
    buffers_watched = pthread_setspecific(buffers_key, &buffers_once) == 0;
}
#else
static void watch_thread_buffers(void) {}
#endif

/* At least `size` bytes in one of the thread's buffers (*buf, its capacity in *cap): -1 where
 * malloc fails, without an exception (reserve_quiet, which needs no GIL) or with MemoryError
 * set (reserve). */
static int reserve_quiet(void **buf, size_t *cap, size_t size) {
    if (*cap >= size) return 0;
    watch_thread_buffers();
    free(*buf);
    *cap = 0;
    if (!(*buf = malloc(size))) return -1;
    *cap = size;
    return 0;
}

static int reserve(void **buf, size_t *cap, size_t size) {
    if (reserve_quiet(buf, cap, size) == 0) return 0;
    PyErr_NoMemory();
    return -1;
}

/* The listing of changes(): the number of changed words, or -1 with an exception set. */
static Py_ssize_t list_changes(Py_buffer *a, Py_buffer *b, int word) {
    if (a->len != b->len || !(word == 1 || word == 2 || word == 4 || word == 8) ||
        a->len % word) {
        PyErr_SetString(PyExc_ValueError, "changes: blocks of different sizes or a bad word");
        return -1;
    }
    size_t nwords = (size_t)a->len / (size_t)word, stride = nwords + 1, count;
    if (reserve((void **)&scratch, &scratch_cap, stride * sizeof(int64_t)) < 0) return -1;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: count = w1_list(a->buf, b->buf, nwords, scratch, NULL, stride); break;
    case 2: count = w2_list(a->buf, b->buf, nwords, scratch, NULL, stride); break;
    case 4: count = w4_list(a->buf, b->buf, nwords, scratch, NULL, stride); break;
    default: count = w8_list(a->buf, b->buf, nwords, scratch, NULL, stride);
    }
    Py_END_ALLOW_THREADS
    return (Py_ssize_t)count;
}

/* changes(old, new, word) -> bytearray of the int64 indices of the words that differ. */
static PyObject *changes(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    int word;
    if (!PyArg_ParseTuple(args, "y*y*i", &a, &b, &word)) return NULL;
    Py_ssize_t count = list_changes(&a, &b, word);
    PyObject *result =
        count < 0 ? NULL : PyByteArray_FromStringAndSize((const char *)scratch, count * 8);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

/* changes_into(old, new, word, positions, planes) -> count: the indices of the words that
 * differ, and the zigzag planes of their moves, into the caller's buffers. `positions`
 * (writable, int64, 8-byte aligned) has room for cap >= nwords + 1 indices; `planes` (writable)
 * holds `word` planes of cap bytes each, plane p at p * cap. The first count entries of each
 * are the results; the rest of the buffers is scratch. Worker threads keep such buffers between
 * blocks, so no fresh pages are touched for each block. */
static PyObject *changes_into(PyObject *self, PyObject *args) {
    Py_buffer a, b, p, q;
    int word;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*", &a, &b, &word, &p, &q)) return NULL;
    PyObject *result = NULL;
    if (a.len != b.len || !(word == 1 || word == 2 || word == 4 || word == 8) || a.len % word) {
        PyErr_SetString(PyExc_ValueError, "changes_into: blocks of different sizes or a bad word");
        goto done;
    }
    size_t nwords = (size_t)a.len / (size_t)word, cap = (size_t)p.len / 8, count;
    if (cap < nwords + 1 || (size_t)q.len < cap * (size_t)word ||
        ((uintptr_t)p.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "changes_into: output buffers too small or unaligned");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: count = w1_list(a.buf, b.buf, nwords, p.buf, q.buf, cap); break;
    case 2:
#if HAVE_AVX512_LOOPS
        if (use_avx512) {
            count = w2_list_avx512(a.buf, b.buf, nwords, p.buf, q.buf, cap);
            break;
        }
#endif
#if HAVE_AVX2_LOOPS
        if (use_avx2) {
            count = w2_list_avx2(a.buf, b.buf, nwords, p.buf, q.buf, cap);
            break;
        }
#endif
        count = w2_list(a.buf, b.buf, nwords, p.buf, q.buf, cap);
        break;
    case 4: count = w4_list(a.buf, b.buf, nwords, p.buf, q.buf, cap); break;
    default: count = w8_list(a.buf, b.buf, nwords, p.buf, q.buf, cap);
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSize_t(count);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    return result;
}

/* The zigzag moves of the words at pos, byte j of each into plane j (planes n bytes apart). */
#define ZIGZAG(T, S, A, B, POS, N, OUT)                                                       \
    do {                                                                                      \
        const T *x = (const T *)(A), *y = (const T *)(B);                                     \
        for (size_t i = 0; i < (N); i++) {                                                    \
            uint64_t d = (uint64_t)(T)(y[(POS)[i]] - x[(POS)[i]]);                            \
            S sd = (S)d; /* two's complement: the move as a signed integer */                 \
            uint64_t z = ((uint64_t)d << 1) ^ (uint64_t)(int64_t)(sd < 0 ? -1 : 0);           \
            for (size_t j = 0; j < sizeof(T); j++) (OUT)[j * (N) + i] = (uint8_t)(z >> (8 * j)); \
        }                                                                                     \
    } while (0)

/* zigzag_planes(old, new, positions, word) -> bytes: the value planes of codecs 3-7 before
 * compression, plane 0 first, each len(positions) bytes: byte p of zigzag(new - old) of each
 * changed word. */
static PyObject *zigzag_planes(PyObject *self, PyObject *args) {
    Py_buffer a, b, p;
    int word;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &a, &b, &p, &word)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)p.len / 8;
    if (a.len != b.len || !(word == 1 || word == 2 || word == 4 || word == 8) || a.len % word ||
        p.len % 8) {
        PyErr_SetString(PyExc_ValueError, "zigzag_planes: mismatched arguments");
        goto done;
    }
    const int64_t *pos = p.buf;
    size_t nwords = (size_t)a.len / (size_t)word;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (size_t)word));
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) bad |= pos[i] < 0 || (size_t)pos[i] >= nwords;
    if (!bad) switch (word) {
    case 1: ZIGZAG(uint8_t, int8_t, a.buf, b.buf, pos, n, out); break;
    case 2: ZIGZAG(u16a, int16_t, a.buf, b.buf, pos, n, out); break;
    case 4: ZIGZAG(u32a, int32_t, a.buf, b.buf, pos, n, out); break;
    default: ZIGZAG(u64a, int64_t, a.buf, b.buf, pos, n, out);
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "zigzag_planes: position out of range");
        Py_CLEAR(result);
    }
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&p);
    return result;
}

