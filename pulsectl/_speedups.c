/* Compiled inner loops of the codecs: finding changed words, Rice coding, the context codec
 * of `--level max` and scattering moves.
 *
 * Optional: pulsectl/codecs/_fast.py falls back to numpy when this module is not built, and
 * every function here gives exactly the bytes (or values) of its numpy counterpart; the tests
 * cross-check the two. The loops run without the GIL, so the worker threads run them in
 * parallel. They read the little-endian words of safetensors as native integers, so _fast.py
 * loads this module on little-endian machines only (x86-64 and arm64 are).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Where the compiler can target AVX-512 in one function (GCC and Clang on x86-64), the hottest
 * loops get such versions, used when the CPU has AVX-512 (with VBMI and VBMI2, for permuting
 * and compressing bytes and 16-bit lanes) and the OS saves its registers; other machines run the portable loops, which
 * give the same results. Older compilers (GCC or Clang before 9) build only the portable ones. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) ||                 \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 9))
#define HAVE_AVX512_LOOPS 1
#include <cpuid.h>
#include <immintrin.h>
#define AVX512_TARGET                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,popcnt")))
/* A few loops also have an AVX2 version, for the CPUs without AVX-512 (AMD before Zen 4, and
 * virtual machines that hide it), chosen the same way. */
#define HAVE_AVX2_LOOPS 1
#define AVX2_TARGET __attribute__((target("avx2,popcnt")))
#else
#define HAVE_AVX512_LOOPS 0
#define HAVE_AVX2_LOOPS 0
#endif
/* Set at import where the CPU has them (use_avx2 too where use_avx512 is); simd() switches
 * them, for the tests and PULSECTL_SIMD. */
static int use_avx512 = 0, use_avx2 = 0, use_select = 0;

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define LITTLE_ENDIAN_HOST 1
#else
#define LITTLE_ENDIAN_HOST 0
#endif

#define MAX_RICE_K 31
#define RICE_VEC_BATCH 256 /* positions the AVX-512 Rice walk hands out per call */

static PyObject *CorruptError; /* set by the Python side: pulsectl.errors.CorruptPatchError */

static PyObject *corrupt(const char *message) {
    PyErr_SetString(CorruptError ? CorruptError : PyExc_ValueError, message);
    return NULL;
}

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

/* ---------------------------------------------------------------- Rice blocks in place */

/* The loop of rice_scatter for one word type: the walk of rice_decode, each word moved at
 * once by the zigzag value its planes hold (unzigzag, then scatter_add). */
#define SCATTER_AHEAD 4096
#if HAVE_AVX512_LOOPS
/* Moves of a batch of the vector walk's positions: unzigzagged first (a loop the compiler
 * vectorises), then added. */
#define RICE_ADD_BATCH_OF(NAME, T)                                                            \
    static inline void NAME##_add_batch(uint8_t *restrict words, const uint32_t *at,          \
                                        size_t n, const uint8_t *const *src, size_t from) {   \
        T moves[RICE_VEC_BATCH];                                                              \
        for (size_t i = 0; i < n; i++) {                                                      \
            T z = 0;                                                                          \
            for (size_t j = 0; j < sizeof(T); j++) z |= (T)((T)src[j][from + i] << (8 * j));   \
            moves[i] = (T)((T)(z >> 1) ^ (T)((T)0 - (T)(z & 1)));                             \
        }                                                                                     \
        for (size_t i = 0; i < n; i++) {                                                      \
            T x;                                                                              \
            memcpy(&x, words + sizeof(T) * (size_t)at[i], sizeof(T));                         \
            x = (T)(x + moves[i]);                                                            \
            memcpy(words + sizeof(T) * (size_t)at[i], &x, sizeof(T));                         \
        }                                                                                     \
    }
#else
#define RICE_ADD_BATCH_OF(NAME, T)
#endif
#define RICE_SCATTER_OF(NAME, T)                                                              \
    static inline void NAME##_add(uint8_t *words, int64_t at, const uint8_t *const *src,      \
                                  size_t i) {                                                 \
        T z = 0, x;                                                                           \
        /* Positions only grow: ask for the words ahead (prefetchers lose an irregular     \
         * stride); prefetching never faults, past the end neither. */                      \
        __builtin_prefetch(words + sizeof(T) * (size_t)at + SCATTER_AHEAD, 1);                \
        for (size_t j = 0; j < sizeof(T); j++) z |= (T)((T)src[j][i] << (8 * j));             \
        memcpy(&x, words + sizeof(T) * (size_t)at, sizeof(T));                                \
        x = (T)(x + (T)((T)(z >> 1) ^ (T)((T)0 - (T)(z & 1))));                               \
        memcpy(words + sizeof(T) * (size_t)at, &x, sizeof(T));                                \
    }                                                                                         \
    RICE_ADD_BATCH_OF(NAME, T)                                                                \
    /* Not inlined: inside rice_scatter the compiler kept the walk's state on the stack. */   \
    static __attribute__((noinline)) const char *NAME##_rice_walk(                            \
        uint8_t *restrict words, size_t nwords, const uint8_t *ub, size_t ulen,               \
        const uint8_t *rb, const uint8_t *rend, size_t count, int k,                          \
        const uint8_t *const *src, uint64_t ubit0, size_t found0, int64_t at0) {              \
        RICE_WALK(ubit0, 0, found0, at0, RICE_PAST, NAME##_add(words, at, src, found),        \
                  (void)0)                                                                    \
    }                                                                                         \
    static const char *NAME##_rice_scatter(uint8_t *restrict words, size_t nwords,            \
                                           const uint8_t *ub, size_t ulen, const uint8_t *rb, \
                                           const uint8_t *rend, size_t count, int k,          \
                                           const uint8_t *const *src) {                       \
        size_t found = 0;                                                                     \
        int64_t at = -1, end_before = -1;                                                     \
        RICE_VEC_FIRST(0, 0, NAME##_add_batch(words, batch, n, src, found))                   \
        return NAME##_rice_walk(words, nwords, ub, ulen, rb, rend, count, k, src,             \
                                (uint64_t)(end_before + 1), found, at);                       \
    }

RICE_SCATTER_OF(r1, uint8_t)
RICE_SCATTER_OF(r2, uint16_t)
RICE_SCATTER_OF(r4, uint32_t)
RICE_SCATTER_OF(r8, uint64_t)

/* The `word` value planes of `count` zigzag bytes in the tuple `planes` (None: a plane of
 * zeros) as pointers in src: buffers held in views (bit j of *held), planes of zeros at
 * *zero (allocated here; release_planes frees both). 0, or -1 with an exception set. */
static int take_planes(PyObject *planes, Py_ssize_t count, int word, const char *who,
                       Py_buffer *views, const uint8_t **src, int *held, uint8_t **zero) {
    if (!PyTuple_Check(planes) || PyTuple_GET_SIZE(planes) != word) {
        PyErr_Format(PyExc_ValueError, "%s: want a tuple of word planes", who);
        return -1;
    }
    for (int j = 0; j < word; j++) {
        PyObject *plane = PyTuple_GET_ITEM(planes, j);
        if (plane == Py_None) {
            if (!*zero && !(*zero = calloc((size_t)count + 1, 1))) {
                PyErr_NoMemory();
                return -1;
            }
            src[j] = *zero;
            continue;
        }
        if (PyObject_GetBuffer(plane, &views[j], PyBUF_SIMPLE) < 0) return -1;
        *held |= 1 << j;
        if (views[j].len != count) {
            PyErr_Format(PyExc_ValueError, "%s: a plane of the wrong size", who);
            return -1;
        }
        src[j] = views[j].buf;
    }
    return 0;
}

static void release_planes(Py_buffer *views, int held, uint8_t *zero) {
    for (int j = 0; j < 8; j++)
        if (held & (1 << j)) PyBuffer_Release(&views[j]);
    free(zero);
}

/* rice_scatter(words, unary, remainder, count, k, planes, word): a Rice block applied to
 * `words` (writable) in place: what scatter_add(words, rice_decode(...), unzigzag(planes, ...))
 * does, in one pass and without the arrays between. Damaged streams raise as in rice_decode,
 * and leave `words` partly patched. */
static PyObject *rice_scatter(PyObject *self, PyObject *args) {
    Py_buffer w, u, rem;
    Py_ssize_t count;
    int k, word;
    PyObject *planes;
    if (!PyArg_ParseTuple(args, "w*y*y*niOi", &w, &u, &rem, &count, &k, &planes, &word))
        return NULL;
    PyObject *result = NULL;
    Py_buffer views[8];
    const uint8_t *src[8];
    uint8_t *zero = NULL;
    int held = 0;
    if (!(word == 1 || word == 2 || word == 4 || word == 8) || w.len % word) {
        PyErr_SetString(PyExc_ValueError, "rice_scatter: mismatched arguments");
        goto done;
    }
    size_t nwords = (size_t)w.len / (size_t)word;
    if (count <= 0 || (size_t)count > nwords || k < 0 || k > MAX_RICE_K) {
        PyErr_SetString(PyExc_ValueError, "rice_scatter: bad count or k");
        goto done;
    }
    if ((uint64_t)rem.len != ((uint64_t)count * (uint64_t)k + 7) / 8) {
        corrupt("remainder stream has the wrong length");
        goto done;
    }
    if (take_planes(planes, count, word, "rice_scatter", views, src, &held, &zero) < 0) goto done;
    /* Quotients are at most the gaps, which add up to less than nwords: read no further. */
    size_t ulen = (size_t)u.len, bound = ((size_t)count + nwords + 7) / 8;
    if (ulen > bound) ulen = bound;
    const uint8_t *rb = rem.buf, *rend = rb + rem.len;
    const char *error;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: error = r1_rice_scatter(w.buf, nwords, u.buf, ulen, rb, rend, (size_t)count, k, src); break;
    case 2: error = r2_rice_scatter(w.buf, nwords, u.buf, ulen, rb, rend, (size_t)count, k, src); break;
    case 4: error = r4_rice_scatter(w.buf, nwords, u.buf, ulen, rb, rend, (size_t)count, k, src); break;
    default: error = r8_rice_scatter(w.buf, nwords, u.buf, ulen, rb, rend, (size_t)count, k, src);
    }
    Py_END_ALLOW_THREADS
    if (error) corrupt(error);
    else result = Py_NewRef(Py_None);
done:
    release_planes(views, held, zero);
    PyBuffer_Release(&w);
    PyBuffer_Release(&u);
    PyBuffer_Release(&rem);
    return result;
}

/* ---------------------------------------------------------------- applying moves */

/* scatter_add(words, positions, moves, word): words[p] += move, modulo 2**(8*word), in place. */
static PyObject *scatter_add(PyObject *self, PyObject *args) {
    Py_buffer w, p, m;
    int word;
    if (!PyArg_ParseTuple(args, "w*y*y*i", &w, &p, &m, &word)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)p.len / 8, nwords = (size_t)w.len / (size_t)(word > 0 ? word : 1);
    if (!(word == 1 || word == 2 || word == 4 || word == 8) || p.len % 8 ||
        (size_t)m.len != n * (size_t)word || w.len % word) {
        PyErr_SetString(PyExc_ValueError, "scatter_add: mismatched arguments");
        goto done;
    }
    const int64_t *pos = p.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) {
        if (pos[i] < 0 || (size_t)pos[i] >= nwords) {
            bad = 1;
            break;
        }
    }
    if (!bad) {
        uint8_t *base = w.buf;
        const uint8_t *mv = m.buf;
        switch (word) {
        case 1:
            for (size_t i = 0; i < n; i++) base[pos[i]] += mv[i];
            break;
        case 2:
            for (size_t i = 0; i < n; i++) {
                uint16_t x, d;
                memcpy(&x, base + 2 * pos[i], 2);
                memcpy(&d, mv + 2 * i, 2);
                x = (uint16_t)(x + d);
                memcpy(base + 2 * pos[i], &x, 2);
            }
            break;
        case 4:
            for (size_t i = 0; i < n; i++) {
                uint32_t x, d;
                memcpy(&x, base + 4 * pos[i], 4);
                memcpy(&d, mv + 4 * i, 4);
                x += d;
                memcpy(base + 4 * pos[i], &x, 4);
            }
            break;
        default:
            for (size_t i = 0; i < n; i++) {
                uint64_t x, d;
                memcpy(&x, base + 8 * pos[i], 8);
                memcpy(&d, mv + 8 * i, 8);
                x += d;
                memcpy(base + 8 * pos[i], &x, 8);
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "scatter_add: position out of range");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&p);
    PyBuffer_Release(&m);
    return result;
}

/* unzigzag(planes, count, word) -> bytearray: the moves (new - old, unsigned little-endian
 * words) from their zigzag byte planes; a plane given as None is all zero. */
static PyObject *unzigzag(PyObject *self, PyObject *args) {
    PyObject *planes;
    Py_ssize_t count;
    int word;
    if (!PyArg_ParseTuple(args, "Oni", &planes, &count, &word)) return NULL;
    if (!(word == 1 || word == 2 || word == 4 || word == 8) || count < 0) {
        PyErr_SetString(PyExc_ValueError, "unzigzag: want a tuple of word planes");
        return NULL;
    }
    Py_buffer views[8];
    const uint8_t *src[8];
    uint8_t *zero = NULL;
    int held = 0;
    PyObject *result = NULL;
    if (take_planes(planes, count, word, "unzigzag", views, src, &held, &zero) < 0) goto done;
    result = PyByteArray_FromStringAndSize(NULL, count * word);
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1:
        for (Py_ssize_t i = 0; i < count; i++) {
            uint8_t z = src[0][i];
            out[i] = (uint8_t)((z >> 1) ^ (uint8_t)(0 - (z & 1)));
        }
        break;
    case 2: {
        u16a *o = (u16a *)out;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t z = (uint16_t)(src[0][i] | (src[1][i] << 8));
            o[i] = (uint16_t)((z >> 1) ^ (uint16_t)(0 - (z & 1)));
        }
        break;
    }
    default:
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t z = 0;
            for (int j = 0; j < word; j++) z |= (uint64_t)src[j][i] << (8 * j);
            uint64_t d = (z >> 1) ^ (0 - (z & 1));
            for (int j = 0; j < word; j++) out[i * word + j] = (uint8_t)(d >> (8 * j));
        }
    }
    Py_END_ALLOW_THREADS
done:
    release_planes(views, held, zero);
    return result;
}

/* ---------------------------------------------------------------- paired low planes */

/* Codecs 6 and 7 store value plane 0 in pairs: bytes a, b (a zero pads an odd plane) become one
 * symbol, PAIR_SMALL * a + b when both are below PAIR_SMALL, else PAIR_ESCAPE with a and b in
 * an escape stream of their own. An Adam step's low zigzag bytes are mostly 1 and 2 (one unit
 * down or up): two of them per symbol let zstd's Huffman code, whose lengths are whole bits, come
 * close to their entropy. */
#define PAIR_SMALL 15
#define PAIR_ESCAPE (PAIR_SMALL * PAIR_SMALL)

#define BYTES_1 0x0101010101010101ull
#define BYTES_80 0x8080808080808080ull

/* Pairs [from, m) of the plane (n bytes) into symbols; escapes go to esc + e. Returns the new e.
 * esc needs room for two more bytes than it keeps. Eight whole pairs at a time: every symbol as
 * if both bytes were small, then the pairs with a byte of PAIR_SMALL or more (told by adding
 * 128 - PAIR_SMALL to each byte's low seven bits), one set bit each, become escapes. */
static size_t pair_scalar(const uint8_t *src, size_t n, size_t from, size_t m, uint8_t *sym,
                          uint8_t *esc, size_t e) {
    size_t i = from;
    for (; i + 8 <= n / 2; i += 8) {
        uint64_t x[2];
        memcpy(x, src + 2 * i, 16);
        for (size_t j = 0; j < 8; j++)
            sym[i + j] = (uint8_t)(PAIR_SMALL * src[2 * (i + j)] + src[2 * (i + j) + 1]);
        for (size_t h = 0; h < 2; h++) {
            uint64_t big = (((x[h] & ~BYTES_80) + (128 - PAIR_SMALL) * BYTES_1) | x[h]) & BYTES_80;
            /* pair p of the four is bytes 2p (a) and 2p + 1 (b): b's flag joins a's at 16p + 7 */
            for (uint64_t left = (big | big >> 8) & 0x0080008000800080ull; left; left &= left - 1) {
                size_t j = 4 * h + ((size_t)__builtin_ctzll(left) >> 4);
                sym[i + j] = PAIR_ESCAPE;
                memcpy(esc + e, src + 2 * (i + j), 2);
                e += 2;
            }
        }
    }
    for (; i < m; i++) { /* the rest, and the padded last pair of an odd plane */
        unsigned a = src[2 * i], b = 2 * i + 1 < n ? src[2 * i + 1] : 0;
        unsigned small = (a < PAIR_SMALL) & (b < PAIR_SMALL);
        sym[i] = (uint8_t)(small ? PAIR_SMALL * a + b : PAIR_ESCAPE);
        esc[e] = (uint8_t)a;
        esc[e + 1] = (uint8_t)b;
        e += 2 * (1 - small);
    }
    return e;
}

/* Unpairs symbols [from, m) into out (2 bytes each), escapes from esc[*e..nesc) (esc has two
 * zero bytes past nesc; the caller checks that the escapes end at nesc, exactly). Returns
 * nonzero on an invalid symbol. Eight symbols at a time: all from the table, then the escapes
 * among them (bytes of PAIR_ESCAPE = 128 + 97 or more, told by adding 128 - 97 to each byte's
 * low seven bits where its top bit is set; one more, and it is invalid) from the escape stream,
 * one set bit each. */
static unsigned unpair_scalar(const uint8_t *sym, size_t from, size_t m, const uint8_t *esc,
                              size_t nesc, size_t *e_io, uint8_t *out) {
    uint16_t pairs[256] = {0}; /* 0 for the escape and the invalid symbols above it */
    for (unsigned v = 0; v < PAIR_ESCAPE; v++)
        pairs[v] = (uint16_t)(v / PAIR_SMALL | (v % PAIR_SMALL) << 8);
    size_t e = *e_io, i = from;
    unsigned bad = 0;
    for (; i + 8 <= m && !bad; i += 8) {
        uint64_t x;
        memcpy(&x, sym + i, 8);
        for (size_t j = 0; j < 8; j++) memcpy(out + 2 * (i + j), &pairs[sym[i + j]], 2);
        uint64_t low7 = x & ~BYTES_80, top = x & BYTES_80;
        uint64_t escapes = (low7 + (128 - (PAIR_ESCAPE - 128)) * BYTES_1) & top;
        if (!escapes) continue;
        bad |= ((low7 + (128 - (PAIR_ESCAPE + 1 - 128)) * BYTES_1) & top) != 0;
        for (uint64_t left = escapes; left && !bad; left &= left - 1) {
            size_t j = (size_t)__builtin_ctzll(left) >> 3; /* past nesc: the zero padding */
            memcpy(out + 2 * (i + j), esc + (e < nesc ? e : nesc), 2);
            e += 2;
        }
    }
    for (; i < m && !bad; i++) { /* the last few */
        unsigned v = sym[i], is_escape = v == PAIR_ESCAPE;
        size_t at = e < nesc ? e : nesc;
        uint16_t escaped = (uint16_t)(esc[at] | esc[at + 1] << 8);
        uint16_t ab = is_escape ? escaped : pairs[v];
        bad |= v > PAIR_ESCAPE;
        e += 2 * is_escape;
        memcpy(out + 2 * i, &ab, 2);
    }
    *e_io = e;
    return bad;
}

#if HAVE_AVX512_LOOPS
/* 32 pairs at a time: each pair is one 16-bit lane (a low, b high). A pair's symbol is 15 a + b;
 * the escaped pairs leave as they are, compressed together (VPCOMPRESSW) into esc + e. Returns
 * the pairs done (a multiple of 32) and the new e in *e_io; esc needs 64 bytes of room. */
static AVX512_TARGET size_t pair_avx512(const uint8_t *src, size_t m, uint8_t *sym, uint8_t *esc,
                                        size_t *e_io) {
    const __m512i low = _mm512_set1_epi16(0xFF), small = _mm512_set1_epi16(PAIR_SMALL),
                  escape = _mm512_set1_epi16(PAIR_ESCAPE);
    size_t e = *e_io, i = 0;
    for (; i + 32 <= m; i += 32) {
        __m512i w = _mm512_loadu_si512(src + 2 * i);
        __m512i a = _mm512_and_si512(w, low), b = _mm512_srli_epi16(w, 8);
        __mmask32 ok = _mm512_cmplt_epu16_mask(a, small) & _mm512_cmplt_epu16_mask(b, small);
        __m512i v = _mm512_add_epi16(_mm512_sub_epi16(_mm512_slli_epi16(a, 4), a), b);
        v = _mm512_mask_blend_epi16(ok, escape, v);
        _mm256_storeu_si256((__m256i *)(sym + i), _mm512_cvtepi16_epi8(v));
        _mm512_storeu_si512(esc + e, _mm512_maskz_compress_epi16((__mmask32)~ok, w));
        e += 2 * (size_t)__builtin_popcount((uint32_t)~ok);
    }
    *e_io = e;
    return i;
}

#endif

#if HAVE_AVX2_LOOPS
/* pair_avx512 on AVX2, 32 pairs at a time: the symbols alike; the escaped pairs (few, where
 * pairing pays) copied one by one from the mask, as AVX2 has no compress. */
static AVX2_TARGET size_t pair_avx2(const uint8_t *src, size_t m, uint8_t *sym, uint8_t *esc,
                                    size_t *e_io) {
    const __m256i low = _mm256_set1_epi16(0xFF), most = _mm256_set1_epi16(PAIR_SMALL - 1),
                  escape = _mm256_set1_epi16(PAIR_ESCAPE);
    size_t e = *e_io, i = 0;
    for (; i + 32 <= m; i += 32) {
        __m256i v[2], big[2];
        for (int h = 0; h < 2; h++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(src + 2 * i + 32 * h));
            __m256i a = _mm256_and_si256(w, low), b = _mm256_srli_epi16(w, 8);
            big[h] = _mm256_cmpgt_epi16(_mm256_max_epi16(a, b), most);
            v[h] = _mm256_add_epi16(_mm256_sub_epi16(_mm256_slli_epi16(a, 4), a), b);
            v[h] = _mm256_blendv_epi8(v[h], escape, big[h]);
        }
        /* packus interleaves the two registers' 128-bit halves; the permute puts the pairs
         * back in order */
        __m256i symbols = _mm256_permute4x64_epi64(_mm256_packus_epi16(v[0], v[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(sym + i), symbols);
        unsigned escaped = (unsigned)_mm256_movemask_epi8(
            _mm256_permute4x64_epi64(_mm256_packs_epi16(big[0], big[1]), 0xD8));
        for (; escaped; escaped &= escaped - 1) {
            memcpy(esc + e, src + 2 * (i + (size_t)__builtin_ctz(escaped)), 2);
            e += 2;
        }
    }
    *e_io = e;
    return i;
}
#endif

#if HAVE_AVX512_LOOPS
/* The inverse, 32 symbols at a time: a = s / 15 as (137 s) >> 11 (exact for s < 256), b = s -
 * 15 a, and the escapes expanded into the escape lanes (VPEXPANDW). Stops before a group whose
 * escapes run past nesc, or that holds a symbol above PAIR_ESCAPE: the scalar loop goes on from
 * there and finds what is wrong. Returns the symbols done and the new e in *e_io. */
static AVX512_TARGET size_t unpair_avx512(const uint8_t *sym, size_t m, const uint8_t *esc,
                                          size_t nesc, size_t *e_io, uint8_t *out) {
    const __m512i mul = _mm512_set1_epi16(137), escape = _mm512_set1_epi16(PAIR_ESCAPE);
    size_t e = *e_io, i = 0;
    for (; i + 32 <= m; i += 32) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sym + i)));
        __mmask32 is_escape = _mm512_cmpeq_epi16_mask(v, escape);
        size_t take = 2 * (size_t)__builtin_popcount(is_escape);
        if (_mm512_cmpgt_epu16_mask(v, escape) || e + take > nesc) break;
        __m512i a = _mm512_srli_epi16(_mm512_mullo_epi16(v, mul), 11);
        __m512i b = _mm512_sub_epi16(v, _mm512_sub_epi16(_mm512_slli_epi16(a, 4), a));
        __m512i ab = _mm512_or_si512(a, _mm512_slli_epi16(b, 8));
        ab = _mm512_mask_expandloadu_epi16(ab, is_escape, esc + e);
        _mm512_storeu_si512(out + 2 * i, ab);
        e += take;
    }
    *e_io = e;
    return i;
}
#endif

/* pair_plane(plane) -> (symbols, escapes). */
static PyObject *pair_plane(PyObject *self, PyObject *args) {
    Py_buffer p;
    if (!PyArg_ParseTuple(args, "y*", &p)) return NULL;
    PyObject *result = NULL, *symbols = NULL;
    size_t n = (size_t)p.len, m = (n + 1) / 2, e = 0;
    uint8_t *esc = malloc(2 * m + 64); /* room for the vector loop's and the scalar's stores */
    if (!esc) {
        PyErr_NoMemory();
        goto done;
    }
    symbols = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)m);
    if (!symbols) goto done;
    uint8_t *sym = (uint8_t *)PyBytes_AS_STRING(symbols);
    const uint8_t *src = p.buf;
    Py_BEGIN_ALLOW_THREADS
    size_t done = 0;
#if HAVE_AVX512_LOOPS
    /* whole pairs only: the last, padded one of an odd plane is the scalar loop's */
    if (use_avx512) done = pair_avx512(src, n / 2, sym, esc, &e);
#endif
#if HAVE_AVX2_LOOPS
    if (!done && use_avx2) done = pair_avx2(src, n / 2, sym, esc, &e);
#endif
    e = pair_scalar(src, n, done, m, sym, esc, e);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(Oy#)", symbols, (const char *)esc, (Py_ssize_t)e);
done:
    Py_XDECREF(symbols);
    free(esc);
    PyBuffer_Release(&p);
    return result;
}

/* unpair_plane(symbols, escapes, count) -> bytes: the `count` bytes of a paired plane. Raises
 * the corrupt error on a symbol above PAIR_ESCAPE, escapes that are not exactly those of the
 * escape symbols, or a nonzero pad byte. */
static PyObject *unpair_plane(PyObject *self, PyObject *args) {
    Py_buffer s, x;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*y*n", &s, &x, &count)) return NULL;
    PyObject *result = NULL;
    uint8_t *esc = NULL;
    if (count < 0 || s.len != (count + 1) / 2) {
        corrupt("paired plane has the wrong number of symbols");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, 2 * s.len); /* shortened to count below */
    if (!result) goto done;
    esc = calloc((size_t)x.len + 2, 1); /* room to read past the last escape */
    if (!esc) {
        PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    memcpy(esc, x.buf, (size_t)x.len);
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    size_t m = (size_t)s.len, nesc = (size_t)x.len, e = 0, done = 0;
    unsigned bad;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX512_LOOPS
    if (use_avx512) done = unpair_avx512(s.buf, m, esc, nesc, &e, out);
#endif
    bad = unpair_scalar(s.buf, done, m, esc, nesc, &e, out);
    bad |= e != nesc;
    if (!bad && (count & 1) && out[count]) bad = 1;
    Py_END_ALLOW_THREADS
    if (bad) {
        Py_CLEAR(result);
        corrupt("paired plane is damaged");
        goto done;
    }
    if (_PyBytes_Resize(&result, count) < 0) result = NULL;
done:
    free(esc);
    PyBuffer_Release(&s);
    PyBuffer_Release(&x);
    return result;
}

/* ---------------------------------------------------------------- context codec (codec 4) */

/* The loops of the context codec, one per word type. A word's key is bits [shift, shift +
 * bits) of the word read as a native (little-endian) integer. Counting keys is a chain of
 * increments of one counter when neighbouring words share a key, as they mostly do in real
 * weights: encoding counts into four tables (word i into table i % 4) and adds them where it
 * needs a rank. */
/* Tables of per-key counts (or states) side by side lie STRIDE(nkeys) entries apart: not a
 * multiple of 4 KiB, at which a load waits for an unrelated store to the same offset within
 * another page (4K aliasing; 256 keys of 8 bytes put tables 0 and 2 8 KiB apart). */
#define STRIDE(nkeys) ((nkeys) + 24)
#define CONTEXT_KEY(w, i) ((uint32_t)((uint64_t)(w)[i] >> shift) & mask)
/* Count the keys of words [I, STOP) of W into tables h0..h3 (four words at a time, one in
 * each table), leaving I at STOP. */
#define COUNT_KEYS(W, I, STOP)                                                                \
    do {                                                                                      \
        for (; (I) + 4 <= (STOP); (I) += 4) {                                                 \
            h0[CONTEXT_KEY(W, I)]++;                                                          \
            h1[CONTEXT_KEY(W, (I) + 1)]++;                                                    \
            h2[CONTEXT_KEY(W, (I) + 2)]++;                                                    \
            h3[CONTEXT_KEY(W, (I) + 3)]++;                                                    \
        }                                                                                     \
        for (; (I) < (STOP); (I)++) h0[CONTEXT_KEY(W, I)]++;                                  \
    } while (0)
#define CONTEXT_OF(NAME, T)                                                                   \
    static inline __attribute__((always_inline)) void NAME##_ranks(                          \
        const uint8_t *block, size_t nwords, int shift, uint32_t mask, const int64_t *pos,    \
        size_t n, int64_t *rank, int64_t *h, size_t nkeys) {                                  \
        const T *w = (const T *)block;                                                        \
        int64_t *h0 = h, *h1 = h + STRIDE(nkeys), *h2 = h1 + STRIDE(nkeys),                  \
                *h3 = h2 + STRIDE(nkeys);                                                     \
        size_t i = 0, next = 0;                                                               \
        for (;;) {                                                                            \
            size_t stop = next < n ? (size_t)pos[next] : nwords;                              \
            COUNT_KEYS(w, i, stop);                                                           \
            if (next == n) break;                                                             \
            uint32_t e = CONTEXT_KEY(w, i);                                                   \
            rank[next++] = h0[e] + h1[e] + h2[e] + h3[e];                                     \
            h0[e]++;                                                                          \
            i++;                                                                              \
        }                                                                                     \
        for (size_t e = 0; e < nkeys; e++) h0[e] += h1[e] + h2[e] + h3[e];                    \
    }                                                                                         \
    static void NAME##_positions(const uint8_t *block, size_t nwords, int shift,             \
                                 uint32_t mask, const int64_t *rank, int64_t *cursor,         \
                                 const int64_t *stop, int64_t *want, int64_t *seen,           \
                                 int64_t *out) {                                              \
        const T *w = (const T *)block;                                                        \
        for (size_t i = 0; i < nwords; i++) {                                                 \
            uint32_t e = CONTEXT_KEY(w, i);                                                   \
            int64_t r = seen[e];                                                              \
            seen[e] = r + 1;                                                                  \
            if (r == want[e]) {                                                               \
                int64_t c = cursor[e]++;                                                      \
                out[c] = (int64_t)i;                                                          \
                want[e] = c + 1 < stop[e] ? rank[c + 1] : -1;                                 \
            }                                                                                 \
        }                                                                                     \
    }

CONTEXT_OF(c1, uint8_t)
CONTEXT_OF(c2, u16a)
CONTEXT_OF(c4, u32a)
CONTEXT_OF(c8, u64a)

/* BF16 (key: the exponent, shift 7, 8 bits) with its shift and mask known to the compiler. */
static void c2_ranks_bf16(const uint8_t *block, size_t nwords, const int64_t *pos, size_t n,
                          int64_t *rank, int64_t *h) {
    c2_ranks(block, nwords, 7, 0xFF, pos, n, rank, h, 256);
}

/* One word of DENSE_WALK_OF, counted in table H. */
#define DENSE_STEP(T, I, H)                                                                   \
    do {                                                                                      \
        T a_ = w[I], b_ = t[I];                                                               \
        uint32_t e_ = (uint32_t)((uint64_t)a_ >> shift) & mask;                               \
        T d_ = (T)(b_ - a_);                                                                  \
        rank[m] = h[e_] + h[S_ + e_] + h[2 * S_ + e_] + h[3 * S_ + e_];                       \
        h[(H) * S_ + e_]++;                                                                   \
        keyof[m] = (uint16_t)e_;                                                              \
        z[m] = (T)((T)(d_ << 1) ^ (T)((T)0 - (T)(d_ >> (8 * sizeof(T) - 1))));                \
        m += a_ != b_;                                                                        \
    } while (0)

/* context_encode's pass over a block with many changes, where a branch per change (most of
 * them mispredicted: the words between two changes are a random count) costs more than doing
 * the same work at every word. Each word's rank, key and zigzag move are stored at slot m,
 * and m moves on only where the words differ, so slot m ends up holding the m-th change.
 * The caller gave n positions and room for n + 1 + DENSE_CHUNK slots: the walk goes a chunk
 * at a time and stops once it has found more than n changes, so that positions that are not
 * the changes (too few) cannot make it write past that room. Returns the changes found (over
 * n: more than there are positions). */
#define DENSE_CHUNK 1024
#define DENSE_WALK_OF(NAME, T)                                                                \
    static inline __attribute__((always_inline)) size_t NAME##_dense_walk(                    \
        const uint8_t *block, const uint8_t *target,                                          \
                                    size_t nwords, int shift, uint32_t mask, int64_t *rank,   \
                                    uint16_t *keyof, uint8_t *moves, int64_t *h,              \
                                    size_t nkeys, size_t n) {                                 \
        const T *w = (const T *)block, *t = (const T *)target;                                \
        T *z = (T *)moves;                                                                    \
        const size_t S_ = STRIDE(nkeys); /* the four tables, one register apart */            \
        size_t m = 0, i = 0;                                                                  \
        while (i < nwords && m <= n) {                                                        \
            size_t stop = nwords - i > DENSE_CHUNK ? i + DENSE_CHUNK : nwords;                \
            for (; i + 4 <= stop; i += 4) {                                                   \
                DENSE_STEP(T, i, 0);                                                          \
                DENSE_STEP(T, i + 1, 1);                                                      \
                DENSE_STEP(T, i + 2, 2);                                                      \
                DENSE_STEP(T, i + 3, 3);                                                      \
            }                                                                                 \
            for (; i < stop; i++) DENSE_STEP(T, i, 0);                                        \
        }                                                                                     \
        return m;                                                                             \
    }

DENSE_WALK_OF(c1, uint8_t)
DENSE_WALK_OF(c2, u16a)
DENSE_WALK_OF(c4, u32a)
DENSE_WALK_OF(c8, u64a)

/* BF16 (key: the exponent, shift 7, 8 bits) with its shift and mask known to the compiler. */
/* Not inlined: inside context_encode the compiler kept the walk's pointers on the stack. */
static __attribute__((noinline)) size_t c2_dense_walk_bf16(const uint8_t *block,
                                                           const uint8_t *target, size_t nwords,
                                 int64_t *rank, uint16_t *keyof, uint8_t *moves, int64_t *h,
                                 size_t n) {
    return c2_dense_walk(block, target, nwords, 7, 0xFF, rank, keyof, moves, h, 256, n);
}

static int context_args(Py_buffer *old, int word, int shift, int bits) {
    if (!(word == 1 || word == 2 || word == 4 || word == 8) || old->len % word || bits < 1 ||
        bits > 16 || shift < 0 || shift + bits > 8 * word) {
        PyErr_SetString(PyExc_ValueError, "context: bad word, shift or bits");
        return -1;
    }
    return 0;
}

/* context_ranks(old, word, shift, bits, positions) -> (ranks, sizes): for each changed word
 * (sorted positions), how many words before it in the block share its key; and how many words
 * have each key (2**bits counts). Both int64 bytearrays. */
static PyObject *context_ranks(PyObject *self, PyObject *args) {
    Py_buffer old, p;
    int word, shift, bits;
    if (!PyArg_ParseTuple(args, "y*iiiy*", &old, &word, &shift, &bits, &p)) return NULL;
    PyObject *ranks = NULL, *sizes = NULL, *result = NULL;
    if (context_args(&old, word, shift, bits) < 0) goto done;
    size_t nwords = (size_t)old.len / (size_t)word, n = (size_t)p.len / 8;
    const int64_t *pos = p.buf;
    ranks = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    sizes = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(((size_t)1 << bits) * 8));
    if (!ranks || !sizes) goto done;
    int64_t *rank = (int64_t *)PyByteArray_AS_STRING(ranks);
    int64_t *seen = (int64_t *)PyByteArray_AS_STRING(sizes);
    memset(seen, 0, ((size_t)1 << bits) * 8);
    uint32_t mask = (uint32_t)((1u << bits) - 1);
    int bad = 0;
    int64_t *tables = calloc(4 * STRIDE((size_t)1 << bits), 8);
    if (!tables) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t before = -1;
    for (size_t j = 0; j < n; j++) {
        bad |= pos[j] <= before || (size_t)pos[j] >= nwords;
        before = pos[j];
    }
    if (!bad) {
        size_t nkeys = (size_t)1 << bits;
        switch (word) {
        case 1: c1_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys); break;
        case 2:
            if (shift == 7 && bits == 8) c2_ranks_bf16(old.buf, nwords, pos, n, rank, tables);
            else c2_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys);
            break;
        case 4: c4_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys); break;
        default: c8_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys);
        }
        memcpy(seen, tables, nkeys * 8);
    }
    Py_END_ALLOW_THREADS
    free(tables);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "context_ranks: positions must increase within the block");
        goto done;
    }
    result = PyTuple_Pack(2, ranks, sizes);
done:
    Py_XDECREF(ranks);
    Py_XDECREF(sizes);
    PyBuffer_Release(&old);
    PyBuffer_Release(&p);
    return result;
}

/* context_positions(old, word, shift, bits, keys, ranks) -> positions: the inverse, for the
 * changes grouped by key (keys ascending, each key's ranks increasing): the position of the
 * ranks[j]-th word with key keys[j], in that same order. Ranks past the end of a key's words,
 * or out of order, raise CorruptPatchError. */
static PyObject *context_positions(PyObject *self, PyObject *args) {
    Py_buffer old, k, r;
    int word, shift, bits;
    if (!PyArg_ParseTuple(args, "y*iiiy*y*", &old, &word, &shift, &bits, &k, &r)) return NULL;
    PyObject *result = NULL;
    int64_t *cursor = NULL, *stop = NULL, *seen = NULL, *want = NULL;
    if (context_args(&old, word, shift, bits) < 0) goto done;
    size_t nwords = (size_t)old.len / (size_t)word, n = (size_t)r.len / 8, nkeys = (size_t)1 << bits;
    if (k.len != r.len || r.len % 8) {
        PyErr_SetString(PyExc_ValueError, "context_positions: keys and ranks differ in length");
        goto done;
    }
    const int64_t *key = k.buf, *rank = r.buf;
    cursor = malloc(nkeys * 8);
    stop = malloc(nkeys * 8);
    seen = calloc(nkeys, 8);
    want = malloc(nkeys * 8);
    result = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (!cursor || !stop || !seen || !want || !result) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    int64_t *out = (int64_t *)PyByteArray_AS_STRING(result);
    uint32_t mask = (uint32_t)((1u << bits) - 1);
    const char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (size_t e = 0; e < nkeys; e++) cursor[e] = stop[e] = 0;
    /* Each key's changes are one run of the list: find the runs. */
    for (size_t j = 0; j < n && !error; j++) {
        if (key[j] < 0 || (size_t)key[j] >= nkeys || (j && key[j] < key[j - 1]) || rank[j] < 0 ||
            (j && key[j] == key[j - 1] && rank[j] <= rank[j - 1])) {
            error = "context block table is damaged";
            break;
        }
        if (!j || key[j] != key[j - 1]) cursor[key[j]] = (int64_t)j;
        stop[key[j]] = (int64_t)j + 1;
    }
    if (!error) {
        for (size_t e = 0; e < nkeys; e++) want[e] = cursor[e] < stop[e] ? rank[cursor[e]] : -1;
        switch (word) {
        case 1: c1_positions(old.buf, nwords, shift, mask, rank, cursor, stop, want, seen, out); break;
        case 2: c2_positions(old.buf, nwords, shift, mask, rank, cursor, stop, want, seen, out); break;
        case 4: c4_positions(old.buf, nwords, shift, mask, rank, cursor, stop, want, seen, out); break;
        default: c8_positions(old.buf, nwords, shift, mask, rank, cursor, stop, want, seen, out);
        }
    }
    for (size_t e = 0; e < nkeys && !error; e++) {
        if (cursor[e] < stop[e]) error = "context block points past the end of a context";
    }
    Py_END_ALLOW_THREADS
    if (error) {
        Py_CLEAR(result);
        corrupt(error);
    }
done:
    free(cursor);
    free(stop);
    free(seen);
    free(want);
    PyBuffer_Release(&old);
    PyBuffer_Release(&k);
    PyBuffer_Release(&r);
    return result;
}

/* A word of `word` bytes at index i of a block, as an unsigned integer (little-endian host). */
static inline uint64_t load_word(const uint8_t *block, size_t i, int word) {
    switch (word) {
    case 1: return block[i];
    case 2: { uint16_t v; memcpy(&v, block + 2 * i, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, block + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, block + 8 * i, 8); return v; }
    }
}

/* QuotientSums over an array of gaps (uint64). */
static int gap_quotient_sums(const void *gaps, size_t n, int from, int count, uint64_t *out) {
    const uint64_t *g = gaps;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = g[i] >> from;
        s0 += x;
        s1 += x >> 1;
        s2 += x >> 2;
        s3 += x >> 3;
        s4 += x >> 4;
    }
    uint64_t part[5] = {s0, s1, s2, s3, s4};
    for (int j = 0; j < count; j++) out[j] = part[j];
    return 1;
}


/* From this share of changed words (1 in DENSE_FROM) context_encode walks the block with
 * DENSE_WALK_OF's branch-free loop. */
#define DENSE_FROM 12

#if HAVE_AVX2_LOOPS
#define SELECT_CHUNK 4096 /* words: their exponent bytes and change masks stay in L1 */
#define SELECT_TARGET __attribute__((target("avx2,popcnt,bmi,bmi2,lzcnt")))

/* The 64-bit mask of 64 bytes' comparisons (0 or 0xFF each): bytes 0-31 in `lo`, 32-63 in
 * `hi`; bit i for byte i. */
static inline SELECT_TARGET uint64_t byte_mask64(__m256i lo, __m256i hi) {
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(hi) << 32 |
           (uint32_t)_mm256_movemask_epi8(lo);
}

#define SELECT_RARE_COST 38 /* cycles for a word met on its own (measured) */
#define SELECT_KEY_COST 5   /* for a context's key on 64 words in the vector pass */

/* The contexts [*lo, *hi] (indices into ctx, the contexts' keys ascending) whose keys the
 * vector pass of the select walk takes: the range that costs least by the counts of the keys
 * in a sample of the block, the other keys' words being met one at a time. */
static void select_range(const u16a *w, size_t nwords, const uint8_t *ctx, size_t nctx,
                         size_t *lo, size_t *hi) {
    uint32_t h[4][256] = {{0}}; /* four tables: neighbours share keys (see COUNT_KEYS) */
    size_t step = nwords >= 256 * 1024 ? 64 * 64 : 64; /* 64 words in 64, or all */
    for (size_t i = 0; i + 64 <= nwords; i += step)
        for (size_t j = i; j < i + 64; j += 4)
            for (size_t q = 0; q < 4; q++) h[q][(w[j + q] >> 7) & 0xFF]++;
    uint64_t below[257]; /* sampled words with keys below e */
    below[0] = 0;
    for (size_t e = 0; e < 256; e++) below[e + 1] = below[e] + h[0][e] + h[1][e] + h[2][e] + h[3][e];
    double scale = (double)nwords / (double)(below[256] ? below[256] : 1);
    double best = -1;
    *lo = *hi = 0;
    for (size_t a = 0; a < nctx; a++)
        for (size_t b = a; b < nctx; b++) {
            double outside = (double)(below[256] - below[ctx[b] + 1] + below[ctx[a]]) * scale;
            double cost = (double)(b - a + 1) * (double)(nwords / 64) * SELECT_KEY_COST +
                          outside * SELECT_RARE_COST;
            if (best < 0 || cost < best) best = cost, *lo = a, *hi = b;
        }
}

/* The select walk run the other way, for context_encode of a BF16 block (where the select walk
 * runs): PEXT of the words that changed, out of the mask of a key's words among 64 (as in
 * s2_select_bf16), gives the next bits of the key's ranks, set where that rank is a change,
 * appended to the key's bitmap; a pass over each bitmap's set bits then gives the context's
 * gaps, in the context's order, with no sort. The keys outside the range [lo, hi] are met a
 * word at a time and give their gaps as they go. The moves come from the positions. Checked:
 * the positions increase, lie in the block and are words that changed, and as many words
 * changed as there are positions; so they are the changed words. */
typedef struct {
    uint64_t acc, fill, at; /* bits not yet stored whole, how many, the word they go to */
} BitAppender;

/* n bits (the low n of v, n <= 64, v below 2^n) after the ones before: the word is stored at
 * every append, and moves on once full. */
static inline void append_bits(BitAppender *b, uint64_t *out, uint64_t v, unsigned n) {
    uint64_t fill = b->fill, acc = b->acc | v << fill;
    out[b->at] = acc;
    uint64_t over = (fill + n) >> 6; /* 1: the word is full */
    uint64_t rest = (v >> 1) >> (63 - fill); /* v's bits past the word (none for fill 0) */
    b->acc = over ? rest : acc;
    b->at += over;
    b->fill = (fill + n) & 63;
}

typedef struct {
    uint32_t seen[256];       /* words of each key met so far */
    int64_t last[256];        /* the last changed rank of each key met one word at a time */
    uint64_t fill[256];       /* where each such key's next gap goes */
    BitAppender bits[256];    /* the keys of the vector pass */
    uint64_t *map[256];       /* and their bitmaps */
} EncodeKeys;

static SELECT_TARGET __attribute__((noinline)) const char *e2_select_bf16(
    const u16a *w, const u16a *t, size_t nwords, EncodeKeys *k, const uint64_t *start,
    uint64_t *gaps, const uint8_t *keys, size_t nsel, int lo, int hi, size_t *changed) {
    const char *wrong = "positions are not the changed words";
    uint8_t exps[SELECT_CHUNK];
    uint64_t diff[SELECT_CHUNK / 64];
    const __m256i low = _mm256_set1_epi16(0xFF);
    const __m256i lo8 = _mm256_set1_epi8((char)lo), span = _mm256_set1_epi8((char)(hi - lo));
    const __m256i zero = _mm256_setzero_si256();
    size_t full = nwords / 64 * 64, found = 0;
    for (size_t s = 0; s < full; s += SELECT_CHUNK) {
        size_t n = full - s < SELECT_CHUNK ? full - s : SELECT_CHUNK, ng = n / 64;
        for (size_t g = 0; g < 2 * ng; g++) {
            const u16a *a = w + s + 32 * g, *b = t + s + 32 * g;
            __m256i a0 = _mm256_loadu_si256((const __m256i *)a);
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(a + 16));
            __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 16));
            /* packs and packus interleave the lanes: quarters 0, 2, 1, 3 put back in order */
            __m256i same = _mm256_packs_epi16(_mm256_cmpeq_epi16(a0, b0),
                                              _mm256_cmpeq_epi16(a1, b1));
            uint64_t moved = ~(uint32_t)_mm256_movemask_epi8(
                _mm256_permute4x64_epi64(same, 0xD8));
            __m256i e = _mm256_packus_epi16(_mm256_and_si256(_mm256_srli_epi16(a0, 7), low),
                                            _mm256_and_si256(_mm256_srli_epi16(a1, 7), low));
            _mm256_storeu_si256((__m256i *)(exps + 32 * g), _mm256_permute4x64_epi64(e, 0xD8));
            if (g % 2) diff[g / 2] |= (moved & 0xFFFFFFFFu) << 32;
            else diff[g / 2] = moved & 0xFFFFFFFFu;
        }
        for (size_t g = 0; g < ng; g++) found += (size_t)__builtin_popcountll(diff[g]);
        for (size_t c = 0; c < nsel; c += 2) {
            uint8_t k0 = keys[c], k1 = c + 1 < nsel ? keys[c + 1] : keys[c];
            const __m256i v0 = _mm256_set1_epi8((char)k0), v1 = _mm256_set1_epi8((char)k1);
            uint64_t both = c + 1 < nsel ? ~0ull : 0; /* a lone last key: its twin adds none */
            uint64_t sink[2]; /* where the twin of a lone last key writes */
            BitAppender b0 = k->bits[k0], b1 = both ? k->bits[k1] : (BitAppender){0, 0, 0};
            uint64_t *o0 = k->map[k0], *o1 = both ? k->map[k1] : sink;
            for (size_t g = 0; g < ng; g++) {
                __m256i e0 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g));
                __m256i e1 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g + 32));
                uint64_t m0 = byte_mask64(_mm256_cmpeq_epi8(e0, v0), _mm256_cmpeq_epi8(e1, v0));
                uint64_t m1 =
                    byte_mask64(_mm256_cmpeq_epi8(e0, v1), _mm256_cmpeq_epi8(e1, v1)) & both;
                append_bits(&b0, o0, _pext_u64(diff[g], m0),
                            (unsigned)__builtin_popcountll(m0));
                append_bits(&b1, o1, _pext_u64(diff[g], m1),
                            (unsigned)__builtin_popcountll(m1));
            }
            k->bits[k0] = b0;
            if (both) k->bits[k1] = b1;
        }
        for (size_t g = 0; g < ng; g++) {
            __m256i e0 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g));
            __m256i e1 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g + 32));
            e0 = _mm256_cmpeq_epi8(_mm256_subs_epu8(_mm256_sub_epi8(e0, lo8), span), zero);
            e1 = _mm256_cmpeq_epi8(_mm256_subs_epu8(_mm256_sub_epi8(e1, lo8), span), zero);
            uint64_t rare = ~byte_mask64(e0, e1);
            while (rare) {
                int i = __builtin_ctzll(rare); /* word i of the 64, in order */
                rare &= rare - 1;
                uint8_t key = exps[64 * g + (size_t)i];
                uint32_t r = k->seen[key]++;
                if (diff[g] >> i & 1) {
                    if (k->fill[key] >= start[key + 1]) return wrong;
                    gaps[k->fill[key]++] = (uint64_t)((int64_t)r - k->last[key] - 1);
                    k->last[key] = r;
                }
            }
        }
    }
    for (size_t i = full; i < nwords; i++) { /* the last words, fewer than 64 */
        uint8_t key = (uint8_t)(w[i] >> 7);
        uint64_t moved = w[i] != t[i];
        found += moved;
        if (key >= lo && key <= hi) {
            if (k->map[key]) append_bits(&k->bits[key], k->map[key], moved, 1);
        } else {
            uint32_t r = k->seen[key]++;
            if (moved) {
                if (k->fill[key] >= start[key + 1]) return wrong;
                gaps[k->fill[key]++] = (uint64_t)((int64_t)r - k->last[key] - 1);
                k->last[key] = r;
            }
        }
    }
    *changed = found;
    return NULL;
}

/* The gaps between the set bits of a bitmap of `words` words (bit i of word j: rank 64 j + i)
 * into gaps[from, to), and the last set rank (-1: none); the error if there are more. */
static SELECT_TARGET const char *bitmap_gaps(const uint64_t *map, size_t words, uint64_t *gaps,
                                             uint64_t from, uint64_t to, int64_t *last) {
    int64_t before = -1;
    uint64_t f = from;
    for (size_t j = 0; j < words; j++) {
        uint64_t v = map[j];
        if (f + (uint64_t)__builtin_popcountll(v) > to) return "positions are not the changed words";
        while (v) {
            int64_t r = (int64_t)(64 * j) + __builtin_ctzll(v);
            v &= v - 1;
            gaps[f++] = (uint64_t)(r - before - 1);
            before = r;
        }
    }
    *last = before;
    return f == to ? NULL : "positions are not the changed words";
}
#define SELECT_ENCODE_FROM 28
static const char ENCODE_NO_MEMORY[] = "no memory";

/* context_encode of a BF16 block by the select walk: the positions checked and each one's key
 * and zigzag move (kz, room for n), the contexts' offsets (start, counts before: zeroed, 257
 * entries), last ranks and gaps, and the value planes in context order. The error or NULL
 * (ENCODE_NO_MEMORY: malloc failed). */
static const char *encode_select(const uint8_t *old, const uint8_t *target, size_t nwords,
                                 const int64_t *pos, size_t n, uint32_t *kz, uint64_t *start,
                                 int64_t *last, uint64_t *gaps, uint8_t *pl, size_t *contexts) {
    const char *wrong = "positions are not the changed words";
    const u16a *w = (const u16a *)old, *t = (const u16a *)target;
    int64_t before = -1;
    for (size_t j = 0; j < n; j++) {
        int64_t p = pos[j];
        if (p <= before || (uint64_t)p >= nwords) return "positions must increase within the block";
        before = p;
        uint16_t a = w[p], d = (uint16_t)(t[p] - a);
        if (!d) return wrong;
        uint16_t z = (uint16_t)((uint16_t)(d << 1) ^ (uint16_t)(0u - (d >> 15)));
        uint32_t e = (uint32_t)(a >> 7) & 0xFF;
        start[e + 1]++;
        kz[j] = e | (uint32_t)z << 8;
    }
    uint8_t ctx[256];
    size_t nctx = 0;
    for (size_t e = 0; e < 256; e++) {
        last[e] = -1;
        if (start[e + 1]) ctx[nctx++] = (uint8_t)e;
        start[e + 1] += start[e];
    }
    *contexts = nctx;
    uint64_t fill[256];
    memcpy(fill, start, sizeof fill);
    for (size_t j = 0; j < n; j++) { /* the value planes, in context order */
        uint32_t v = kz[j];
        uint64_t s = fill[v & 0xFF]++;
        pl[s] = (uint8_t)(v >> 8);
        pl[n + s] = (uint8_t)(v >> 16);
    }
    size_t lo, hi;
    select_range(w, nwords, ctx, nctx, &lo, &hi);
    size_t span = nwords / 64 + 2; /* a key's bitmap: a bit for each of its words, and room */
    EncodeKeys *k = calloc(1, sizeof *k);
    if (!k || reserve_quiet((void **)&encode_maps, &encode_maps_cap, (hi - lo + 1) * span * 8)) {
        free(k);
        return ENCODE_NO_MEMORY;
    }
    uint64_t *arena = encode_maps;
    for (size_t e = 0; e < 256; e++) k->fill[e] = start[e], k->last[e] = -1;
    for (size_t c = lo; c <= hi; c++) k->map[ctx[c]] = arena + (c - lo) * span;
    size_t changed = 0;
    const char *error = e2_select_bf16(w, t, nwords, k, start, gaps, ctx + lo, hi - lo + 1,
                                       ctx[lo], ctx[hi], &changed);
    if (!error && changed != n) error = wrong;
    for (size_t c = 0; c < nctx && !error; c++) {
        size_t e = ctx[c];
        if (c >= lo && c <= hi) {
            BitAppender *b = &k->bits[e];
            k->map[e][b->at] = b->acc;
            error = bitmap_gaps(k->map[e], b->at + 1, gaps, start[e], start[e + 1], &last[e]);
        } else {
            if (k->fill[e] != start[e + 1]) error = wrong;
            last[e] = k->last[e];
        }
    }
    free(k);
    return error;
}
#endif

/* context_encode(old, new, word, shift, bits, positions) -> (table, unary, remainder, planes):
 * the streams of a context block (codec 4) for the changed words at `positions` (sorted
 * int64, all the words where old and new differ): the context table before compression
 * (contexts x 7 bytes: u16 keys ascending, u8 rice_k, u32 changes), the unary and remainder
 * streams of the gaps, and the zigzag value planes of the moves in context order (plane 0
 * first, `count` bytes each). The bytes of context.encode's numpy path. */
static PyObject *context_encode(PyObject *self, PyObject *args) {
    Py_buffer old, nw, p;
    int word, shift, bits;
    if (!PyArg_ParseTuple(args, "y*y*iiiy*", &old, &nw, &word, &shift, &bits, &p)) return NULL;
    PyObject *result = NULL, *table = NULL, *unary = NULL, *remainder = NULL, *planes = NULL;
    int64_t *rank = NULL, *tables = NULL, *last = NULL;
    uint16_t *keyof = NULL;
    uint8_t *moves = NULL, *ks = NULL;
    uint64_t *gaps = NULL, *start = NULL, *fill = NULL, *total = NULL, *quots = NULL;
    if (context_args(&old, word, shift, bits) < 0) goto done;
    size_t nwords = (size_t)old.len / (size_t)word, n = (size_t)p.len / 8, nkeys = (size_t)1 << bits;
    if (nw.len != old.len || p.len % 8 || n == 0 || n > nwords) {
        PyErr_SetString(PyExc_ValueError, "context_encode: mismatched blocks or positions");
        goto done;
    }
    const int64_t *pos = p.buf;
    /* The dense walk stores every word at slot m before it knows whether m moves on, and
     * finds the changes itself: room for a chunk of slots past the changes given. */
    size_t slots = n + 1 + DENSE_CHUNK;
    if (reserve((void **)&ctx_scratch, &ctx_scratch_cap, slots * (18 + (size_t)word)) < 0)
        goto done;
    rank = (int64_t *)ctx_scratch;
    gaps = (uint64_t *)(ctx_scratch + slots * 8);
    keyof = (uint16_t *)(ctx_scratch + slots * 16);
    moves = ctx_scratch + slots * 18;
    tables = calloc(4 * STRIDE(nkeys), 8);
    last = malloc(nkeys * 8);
    start = calloc(nkeys + 1, 8);
    fill = malloc(nkeys * 8);
    total = calloc(nkeys, 8);
    quots = calloc(nkeys, 8);
    ks = calloc(nkeys, 1);
    planes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (size_t)word));
    if (!tables || !last || !start || !fill || !total ||
        !quots || !ks || !planes) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    uint8_t *pl = (uint8_t *)PyBytes_AS_STRING(planes);
    uint32_t mask = (uint32_t)((1u << bits) - 1);
    const char *bad = NULL;
    size_t contexts = 0;
#if HAVE_AVX2_LOOPS
    /* The select walk pays from about 1 change in 28 words: below, counting every word's key
     * (the sparse path) takes less than the pass over each context's key. */
    int select = use_select && word == 2 && shift == 7 && bits == 8 &&
                 n * SELECT_ENCODE_FROM >= nwords;
#endif
    uint64_t unary_bits = 0, remainder_bits = 0;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX2_LOOPS
    if (select) {
        bad = encode_select(old.buf, nw.buf, nwords, pos, n, (uint32_t *)rank, start, last, gaps,
                            pl, &contexts);
        goto planned;
    }
#endif
    int dense = n * DENSE_FROM >= nwords;
    int64_t before = -1;
    /* The dense walk finds the changes itself and only needs their count. */
    for (size_t j = 0; j < n && !dense; j++) {
        if (pos[j] <= before || (size_t)pos[j] >= nwords) bad = "positions must increase within the block";
        before = pos[j];
    }
    if (!bad && dense) {
        size_t found;
        switch (word) {
        case 1: found = c1_dense_walk(old.buf, nw.buf, nwords, shift, mask, rank, keyof, moves, tables, nkeys, n); break;
        case 2:
            if (shift == 7 && bits == 8) found = c2_dense_walk_bf16(old.buf, nw.buf, nwords, rank, keyof, moves, tables, n);
            else found = c2_dense_walk(old.buf, nw.buf, nwords, shift, mask, rank, keyof, moves, tables, nkeys, n);
            break;
        case 4: found = c4_dense_walk(old.buf, nw.buf, nwords, shift, mask, rank, keyof, moves, tables, nkeys, n); break;
        default: found = c8_dense_walk(old.buf, nw.buf, nwords, shift, mask, rank, keyof, moves, tables, nkeys, n);
        }
        /* The walk codes the words that differ: they must be the positions given. */
        if (found != n) bad = "positions are not the changed words";
    } else if (!bad) {
        switch (word) {
        case 1: c1_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys); break;
        case 2:
            if (shift == 7 && bits == 8) c2_ranks_bf16(old.buf, nwords, pos, n, rank, tables);
            else c2_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys);
            break;
        case 4: c4_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys); break;
        default: c8_ranks(old.buf, nwords, shift, mask, pos, n, rank, tables, nkeys);
        }
        uint64_t wmask = word == 8 ? ~0ull : (1ull << (8 * word)) - 1;
        int top = 8 * word;
        for (size_t j = 0; j < n; j++) {
            uint64_t a = load_word(old.buf, (size_t)pos[j], word);
            uint64_t d = (load_word(nw.buf, (size_t)pos[j], word) - a) & wmask;
            int64_t sd = (int64_t)(d << (64 - top)) >> (64 - top);
            uint64_t z = (((uint64_t)sd << 1) ^ (uint64_t)(sd >> 63)) & wmask;
            keyof[j] = (uint16_t)((uint32_t)(a >> shift) & mask);
            memcpy(moves + (size_t)word * j, &z, (size_t)word); /* little-endian host */
        }
    }
    if (!bad) {
        for (size_t j = 0; j < n; j++) start[keyof[j] + 1]++;
        for (size_t e = 0; e < nkeys; e++) {
            contexts += start[e + 1] != 0;
            start[e + 1] += start[e];
            fill[e] = start[e];
            last[e] = -1;
        }
        /* Changes in context order (a stable counting sort): each one's gap to the previous
         * change of its context, counted in that context's words, and its zigzag bytes. */
        for (size_t j = 0; j < n; j++) {
            uint32_t e = keyof[j];
            uint64_t s = fill[e]++;
            gaps[s] = (uint64_t)(rank[j] - last[e] - 1);
            last[e] = rank[j];
            if (word == 2) {
                pl[s] = moves[2 * j];
                pl[n + s] = moves[2 * j + 1];
            } else {
                for (int b = 0; b < word; b++) pl[(size_t)b * n + s] = moves[(size_t)word * j + b];
            }
        }
    }
#if HAVE_AVX2_LOOPS
planned:
#endif
    if (!bad) {
        for (size_t e = 0; e < nkeys; e++) {
            size_t m = start[e + 1] - start[e];
            if (!m) continue;
            total[e] = (uint64_t)(last[e] + 1) - m; /* the gaps add up to the last rank + 1 - m */
            ks[e] = (uint8_t)rice_search(gap_quotient_sums, gaps + start[e], m, total[e] / m,
                                         &quots[e]);
            unary_bits += quots[e] + m;
            remainder_bits += (uint64_t)m * ks[e];
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
#if HAVE_AVX2_LOOPS
        if (bad == ENCODE_NO_MEMORY) PyErr_NoMemory();
        else
#endif
        PyErr_Format(PyExc_ValueError, "context_encode: %s", bad);
        goto done;
    }
    table = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(contexts * 7));
    /* The streams as in rice_encode, with its bit writers (8 bytes of room past each). */
    size_t ubytes = (size_t)((unary_bits + 7) / 8), rbytes = (size_t)((remainder_bits + 7) / 8);
    unary = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(ubytes + 8));
    remainder = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(rbytes + 8));
    if (!table || !unary || !remainder) goto done;
    uint8_t *tb = (uint8_t *)PyBytes_AS_STRING(table);
    TopWriter u = {(uint8_t *)PyBytes_AS_STRING(unary), 0, 0, 0};
    TopWriter r = {(uint8_t *)PyBytes_AS_STRING(remainder), 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    size_t c = 0;
    for (size_t e = 0; e < nkeys; e++) {
        size_t lo = start[e], hi = start[e + 1];
        if (lo == hi) continue;
        uint32_t m = (uint32_t)(hi - lo);
        tb[2 * c] = (uint8_t)e;
        tb[2 * c + 1] = (uint8_t)(e >> 8);
        tb[2 * contexts + c] = ks[e];
        for (int b = 0; b < 4; b++) tb[3 * contexts + 4 * c + b] = (uint8_t)(m >> (8 * b));
        c++;
        int k = ks[e];
        uint64_t low = k ? (1ull << k) - 1 : 0;
        size_t s = lo;
#if HAVE_AVX512_LOOPS
        if (use_avx512 && hi - lo >= 16) s += rice_gaps_avx512(&u, &r, gaps + lo, hi - lo, k);
#endif
#if HAVE_AVX2_LOOPS
        if (!use_avx512 && use_avx2) s += rice_gaps_avx2(&u, &r, gaps + lo, hi - lo, k);
#endif
        for (; s + 8 <= hi; s += 8) rice_put_8(&u, &r, gaps + s, k);
        for (; s < hi; s++) {
            tw_put_unary(&u, gaps[s] >> k);
            if (k) tw_put_low(&r, gaps[s] & low, (unsigned)k);
        }
    }
    Py_END_ALLOW_THREADS
    if (tw_size(&u) != ubytes || tw_size(&r) != rbytes) {
        PyErr_SetString(PyExc_SystemError, "context_encode: stream sizes disagree with the plan");
        goto done;
    }
    if (_PyBytes_Resize(&unary, (Py_ssize_t)ubytes) < 0 ||
        _PyBytes_Resize(&remainder, (Py_ssize_t)rbytes) < 0)
        goto done;
    result = PyTuple_Pack(4, table, unary, remainder, planes);
done:
    Py_XDECREF(table);
    Py_XDECREF(unary);
    Py_XDECREF(remainder);
    Py_XDECREF(planes);
    free(tables);
    free(last);
    free(start);
    free(fill);
    free(total);
    free(quots);
    free(ks);
    PyBuffer_Release(&old);
    PyBuffer_Release(&nw);
    PyBuffer_Release(&p);
    return result;
}

/* The walks of context_scatter. A sparse block's changes are met by counting down: a key's
 * state holds, in its high 32 bits, the index j of the key's next change (in `rank` order) and,
 * in its low 32 bits, how many more words of the key come before it; a word whose key's count
 * is at 0 is that change, and its key's state becomes next[j], the state after it (j + 1 and
 * the gap to the key's following change, or NEVER past the key's last). One load and one store
 * per word, and a branch that is rarely taken, so rarely mispredicted. Counts and indices fit
 * in 32 bits: a block holds at most 2**28 words. */
#define NEVER 0x7FFFFFFFu
/* From 1 change in this many words, context_scatter takes the dense walk below (measured on
 * real blocks: the sparse walk is the faster up to about 1 in 5 or 6). */
#define SCATTER_DENSE_FROM 6
#define SCATTER_SPARSE_OF(NAME, T)                                                            \
    static inline __attribute__((always_inline)) void NAME##_sparse_steps(                    \
        uint8_t *block, size_t nwords, int shift, uint32_t mask, const uint64_t *next,        \
        uint64_t *state, const uint8_t *const *src) {                                         \
        T *w = (T *)block;                                                                    \
        for (size_t i = 0; i < nwords; i++) {                                                 \
            T v = w[i];                                                                       \
            uint32_t e = (uint32_t)((uint64_t)v >> shift) & mask;                             \
            uint64_t s = state[e];                                                            \
            state[e] = s - 1;                                                                 \
            if (__builtin_expect((uint32_t)s == 0, 0)) {                                      \
                size_t j = (size_t)(s >> 32);                                                 \
                state[e] = next[j];                                                           \
                T z = 0;                                                                      \
                for (size_t b = 0; b < sizeof(T); b++) z |= (T)((T)src[b][j] << (8 * b));     \
                w[i] = (T)(v + (T)((T)(z >> 1) ^ (T)((T)0 - (T)(z & 1))));                    \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    static __attribute__((noinline)) void NAME##_sparse(                                      \
        uint8_t *block, size_t nwords, int shift, uint32_t mask, const uint64_t *next,        \
        uint64_t *state, const uint8_t *const *src) {                                         \
        NAME##_sparse_steps(block, nwords, shift, mask, next, state, src);                    \
    }

/* From 1 change in SCATTER_DENSE_FROM words that branch is mispredicted often, and a
 * branch-free step does the same work at every word: the key's count (CN) is the bit of `bits`
 * for the word's rank among its key's words (the key's ranks start at its own offset), set
 * where that rank is a change, and the word moves by the key's next move (an index per key,
 * JC, into `delta`, the block's moves as words in rank order), masked to zero where the bit is
 * clear. Neither count waits for the bit's load. A count is still one that the next word of
 * its key (in real weights, often the next word) loads again after this one stores it, a chain
 * of store-to-load latencies; so two walkers take the two halves of the block in step, each
 * with its own counts, the second starting from the key counts of the first half. The four
 * count tables lie STRIDE(nkeys) apart in one array (`tab`: CN, JC of the first walker, then
 * of the second), so that with nkeys known to the compiler one register addresses them all. */
#define SCATTER_DENSE(T, I, CN, JC)                                                           \
    do {                                                                                      \
        T v_ = w[I];                                                                          \
        uint32_t e_ = (uint32_t)((uint64_t)v_ >> shift) & mask;                               \
        uint32_t g_ = tab[(CN) + e_];                                                         \
        tab[(CN) + e_] = g_ + 1;                                                              \
        uint32_t hit_ = (uint32_t)((bits[g_ >> 6] << (g_ & 63)) >> 63);                       \
        uint32_t j_ = tab[(JC) + e_];                                                         \
        tab[(JC) + e_] = j_ + hit_;                                                           \
        w[I] = (T)(v_ + (T)(delta[j_] & (T)((T)0 - (T)hit_)));                                \
    } while (0)
/* Where the second walker starts: about half way, at a distance from the first that is not a
 * multiple of 4 KiB. Were it one, each word one walker loads would share its address's low 12
 * bits with the word the other has just stored, and the CPU holds a load behind such a store
 * until it sees that the two differ ("4K aliasing"). */
static inline size_t walk_split(size_t nwords, size_t word) {
    size_t page = 4096 / word;
    if (nwords < 2 * page) return nwords / 2;
    return nwords / 2 / page * page + page / 2;
}
#define SCATTER_DENSE_OF(NAME, T)                                                             \
    static inline __attribute__((always_inline)) void NAME##_dense_steps(                     \
        uint8_t *block, size_t nwords, int shift, uint32_t mask, const uint64_t *bits,        \
        uint32_t *tab, size_t nkeys, const T *delta) {                                        \
        T *w = (T *)block;                                                                    \
        size_t half = walk_split(nwords, sizeof(T)), s = STRIDE(nkeys);                       \
        size_t both = half < nwords - half ? half : nwords - half, i = 0;                      \
        for (; i < both; i++) {                                                               \
            SCATTER_DENSE(T, i, 0, s);                                                        \
            SCATTER_DENSE(T, half + i, 2 * s, 3 * s);                                         \
        }                                                                                     \
        for (size_t j = i; j < half; j++) SCATTER_DENSE(T, j, 0, s);                          \
        for (size_t j = half + i; j < nwords; j++) SCATTER_DENSE(T, j, 2 * s, 3 * s);         \
    }                                                                                         \
    static __attribute__((noinline)) void NAME##_dense(                                       \
        uint8_t *block, size_t nwords, int shift, uint32_t mask, const uint64_t *bits,        \
        uint32_t *tab, size_t nkeys, const T *delta) {                                        \
        NAME##_dense_steps(block, nwords, shift, mask, bits, tab, nkeys, delta);              \
    }                                                                                         \
    /* Each key's words before walk_split (half[e]) and in all of the block (all[e]). */     \
    static inline __attribute__((always_inline)) void NAME##_halves(                          \
        const uint8_t *block, size_t nwords, int shift, uint32_t mask, int64_t *h,            \
        size_t nkeys, int64_t *half, int64_t *all) {                                          \
        const T *w = (const T *)block;                                                        \
        int64_t *h0 = h, *h1 = h + STRIDE(nkeys), *h2 = h1 + STRIDE(nkeys),                  \
                *h3 = h2 + STRIDE(nkeys);                                                     \
        size_t i = 0;                                                                         \
        COUNT_KEYS(w, i, walk_split(nwords, sizeof(T)));                                      \
        for (size_t e = 0; e < nkeys; e++) half[e] = h0[e] + h1[e] + h2[e] + h3[e];           \
        COUNT_KEYS(w, i, nwords);                                                             \
        for (size_t e = 0; e < nkeys; e++) all[e] = h0[e] + h1[e] + h2[e] + h3[e];            \
    }

#define CONTEXT_SCATTER_OF(NAME, T) SCATTER_SPARSE_OF(NAME, T) SCATTER_DENSE_OF(NAME, T)
CONTEXT_SCATTER_OF(s1, uint8_t)
CONTEXT_SCATTER_OF(s2, u16a)
CONTEXT_SCATTER_OF(s4, u32a)
CONTEXT_SCATTER_OF(s8, u64a)

/* BF16 (key: the exponent, shift 7, 8 bits) with its shift and mask known to the compiler. */
/* Not inlined: inside context_scatter the compiler kept the walk's pointers on the stack. */
static __attribute__((noinline)) void s2_sparse_bf16(uint8_t *block, size_t nwords,
                                                     const uint64_t *next, uint64_t *state,
                                                     const uint8_t *const *src) {
    s2_sparse_steps(block, nwords, 7, 0xFF, next, state, src);
}
static void s2_halves_bf16(const uint8_t *block, size_t nwords, int64_t *h, int64_t *half,
                           int64_t *all) {
    s2_halves(block, nwords, 7, 0xFF, h, 256, half, all);
}
/* Not inlined: inside scatter_dense the compiler kept the walk's pointers on the stack. */
static __attribute__((noinline)) void s2_dense_bf16(uint8_t *block, size_t nwords,
                                                    const uint64_t *bits, uint32_t *tab,
                                                    const uint16_t *delta) {
    s2_dense_steps(block, nwords, 7, 0xFF, bits, tab, 256, delta);
}
#if HAVE_AVX512_LOOPS
/* The same with BMI2's shift by a register (one micro-op; the legacy one takes three). */
static __attribute__((noinline, target("bmi2"))) void s2_dense_bf16_bmi2(
    uint8_t *block, size_t nwords, const uint64_t *bits, uint32_t *tab, const uint16_t *delta) {
    s2_dense_steps(block, nwords, 7, 0xFF, bits, tab, 256, delta);
}
#endif

/* The moves of `count` changes as words (unzigzag of the planes' bytes), and one of 0 after. */
#define UNZIGZAG_OF(NAME, T)                                                                  \
    static void NAME##_moves(const uint8_t *const *src, size_t count, T *delta) {             \
        for (size_t j = 0; j < count; j++) {                                                  \
            T z = 0;                                                                          \
            for (size_t b = 0; b < sizeof(T); b++) z |= (T)((T)src[b][j] << (8 * b));         \
            delta[j] = (T)((T)(z >> 1) ^ (T)((T)0 - (T)(z & 1)));                             \
        }                                                                                     \
        delta[count] = 0;                                                                     \
    }
UNZIGZAG_OF(s1, uint8_t)
UNZIGZAG_OF(s2, uint16_t)
UNZIGZAG_OF(s4, uint32_t)
UNZIGZAG_OF(s8, uint64_t)

/* The dense walk's bitmap numbers its bits as the Rice streams do, most significant first:
 * bit g is bit 63 - g % 64 of word g / 64. */
#define BIT_OF(g) (1ull << (63 - ((g) & 63)))

/* Bits set one after another at increasing indices, a 64-bit word at a time. */
typedef struct {
    uint64_t *bitmap, word, acc;
} BitSetter;
static inline void set_next_bit(BitSetter *b, uint64_t g) {
    if (g >> 6 != b->word) {
        b->bitmap[b->word] |= b->acc;
        b->word = g >> 6;
        b->acc = 0;
    }
    b->acc |= BIT_OF(g);
}

/* One context's run of a dense codec 4 block (see context_run), each rank set as bit `off` +
 * rank of `bitmap` instead of stored; `nwords` is the count of the key's words, past which no
 * rank may point. */
static const char *context_bits_walk(
    const uint8_t *ub, size_t ulen, const uint8_t *rb, const uint8_t *rend, size_t count, int k,
    size_t nwords, uint64_t ubit0, uint64_t rbit0, BitSetter b, uint64_t off, uint64_t *next,
    int64_t *last, size_t found0, int64_t at0) {
    RICE_WALK(ubit0, rbit0, found0, at0, "context block points past the end of a context",
              set_next_bit(&b, off + (uint64_t)at),
              (b.bitmap[b.word] |= b.acc, *next = (uint64_t)(end_before + 1), *last = at))
}

static const char *context_bits(
    const uint8_t *ub, size_t ulen, const uint8_t *rb, const uint8_t *rend, size_t count, int k,
    size_t nwords, uint64_t ubit0, uint64_t rbit0, uint64_t *bitmap, uint64_t off,
    uint64_t *next, int64_t *last) {
    BitSetter b = {bitmap, off >> 6, 0};
    size_t found = 0;
    int64_t at = -1, end_before = (int64_t)ubit0 - 1;
    RICE_VEC_FIRST(ubit0, rbit0,
                   for (size_t j = 0; j < n; j++) set_next_bit(&b, off + batch[j]))
    return context_bits_walk(ub, ulen, rb, rend, count, k, nwords, (uint64_t)(end_before + 1),
                             rbit0, b, off, next, last, found, at);
}

/* Sixty-four bits of a stream (most significant first) from bit `at`; bytes at or past `end`
 * read as 0xFF. */
static inline uint64_t bits_at(const uint8_t *p, const uint8_t *end, uint64_t at) {
    const uint8_t *q = p + (at >> 3);
    uint64_t v = load_be64(q, end, 0xFF);
    int s = (int)(at & 7);
    if (s) v = (v << s) | ((uint64_t)(q + 8 < end ? q[8] : 0xFF) >> (8 - s));
    return v;
}

/* context_bits for a run with k = 0. Its unary codes are then the bitmap of its ranks,
 * inverted: the i-th 0-bit of the run lies at bit ubit0 + rank i. So the run's end is found by
 * counting 0-bits, and the bits are copied 64 at a time. Errors as context_bits gives them. */
static const char *context_bits_k0(const uint8_t *ub, size_t ulen, size_t count, size_t nwords,
                                   uint64_t ubit0, uint64_t *bitmap, uint64_t off,
                                   uint64_t *next, int64_t *final) {
    const char *past = "context block points past the end of a context";
    const uint8_t *uend = ub + ulen;
    uint64_t w = ubit0 / 64, last = 0; /* last: a bit just past the last 0-bit seen */
    uint64_t zeros = 0;
    size_t left = count;
    for (; w * 8 < ulen; w++) {
        zeros = ~load_be64(ub + 8 * w, uend, 0xFF);
        if (w == ubit0 / 64) zeros &= ~0ull >> (ubit0 % 64);
        size_t n = (size_t)__builtin_popcountll(zeros);
        if (n >= left) break;
        left -= n;
        if (zeros) last = 64 * w + 64 - (uint64_t)__builtin_ctzll(zeros);
    }
    if (w * 8 >= ulen) return last > ubit0 + nwords ? past : "unary stream is too short";
    for (size_t i = 1; i < left; i++) zeros &= ~(1ull << (63 - __builtin_clzll(zeros)));
    uint64_t end = 64 * w + (uint64_t)__builtin_clzll(zeros), top = end - ubit0;
    if (top >= nwords) return past;
    *next = end + 1;
    *final = (int64_t)top;
    uint64_t d0 = off / 64, d1 = (off + top) / 64;
    for (uint64_t d = d0; d <= d1; d++) {
        uint64_t v = d == d0 ? ~bits_at(ub, uend, ubit0) >> (off % 64)
                             : ~bits_at(ub, uend, ubit0 + 64 * d - off);
        if (d == d1) v &= ~0ull << (63 - (off + top) % 64);
        bitmap[d] |= v;
    }
    return NULL;
}

/* The set bits of `bitmap` in [from, to). */
static int64_t bits_between(const uint64_t *bitmap, uint64_t from, uint64_t to) {
    if (from >= to) return 0;
    uint64_t a = from >> 6, z = (to - 1) >> 6;
    uint64_t head = ~0ull >> (from & 63), tail = ~0ull << (63 - ((to - 1) & 63));
    if (a == z) return __builtin_popcountll(bitmap[a] & head & tail);
    int64_t n = __builtin_popcountll(bitmap[a] & head) + __builtin_popcountll(bitmap[z] & tail);
    for (uint64_t i = a + 1; i < z; i++) n += __builtin_popcountll(bitmap[i]);
    return n;
}

/* The dense walk of context_scatter: each context's ranks decoded from the streams and set as
 * bits of a bitmap (a key's ranks from the count of words of the keys before it), then walked.
 * The error (a static string) or NULL. */
static const char *scatter_dense(uint8_t *block, size_t nwords, int word, int shift, int bits,
                                 const int64_t *key, const int64_t *kof, const int64_t *cnt,
                                 size_t nctx, const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                 const uint8_t *rend, size_t count, const uint8_t *const *src,
                                 void *scratch) {
    size_t nkeys = (size_t)1 << bits, s = STRIDE(nkeys);
    uint32_t mask = (uint32_t)(nkeys - 1);
    /* scratch: int64 tables (4 x STRIDE), half, all; uint32 off, the walk's tab (4 x STRIDE);
     * the bitmap; the moves */
    int64_t *tables = scratch, *half = tables + 4 * s, *all = half + nkeys;
    uint32_t *off = (uint32_t *)(all + nkeys), *tab = off + nkeys;
    uint64_t *bitmap = (uint64_t *)(tab + 4 * s); /* 8-aligned: nkeys is even */
    void *delta = bitmap + nwords / 64 + 1;
    switch (word) {
    case 1: s1_halves(block, nwords, shift, mask, tables, nkeys, half, all); break;
    case 2:
        if (shift == 7 && bits == 8) s2_halves_bf16(block, nwords, tables, half, all);
        else s2_halves(block, nwords, shift, mask, tables, nkeys, half, all);
        break;
    case 4: s4_halves(block, nwords, shift, mask, tables, nkeys, half, all); break;
    default: s8_halves(block, nwords, shift, mask, tables, nkeys, half, all);
    }
    uint32_t at = 0; /* key e's ranks at bits [off[e], off[e] + all[e]) */
    for (size_t e = 0; e < nkeys; e++) {
        off[e] = at;
        tab[e] = at;                             /* the first walker's bit: the key's rank 0 */
        tab[2 * s + e] = at + (uint32_t)half[e]; /* the second's: its first rank past the split */
        tab[s + e] = tab[3 * s + e] = 0;         /* keys without changes: never used */
        at += (uint32_t)all[e];
    }
    uint64_t ubit = 0, rbit = 0;
    int64_t first = 0;
    for (size_t c = 0; c < nctx; c++) {
        size_t e = (size_t)key[c];
        int64_t last;
        const char *error =
            kof[c] ? context_bits(ub, ulen, rb, rend, (size_t)cnt[c], (int)kof[c],
                                  (size_t)all[e], ubit, rbit, bitmap, off[e], &ubit, &last)
                   : context_bits_k0(ub, ulen, (size_t)cnt[c], (size_t)all[e], ubit, bitmap,
                                     off[e], &ubit, &last);
        if (error) return error;
        int64_t below = bits_between(bitmap, off[e], off[e] + (uint64_t)half[e]);
        rbit += (uint64_t)cnt[c] * (uint64_t)kof[c];
        tab[s + e] = (uint32_t)first;
        tab[3 * s + e] = (uint32_t)(first + below);
        half[e] = first + below; /* where the first walker must stop */
        first += cnt[c];
    }
    switch (word) {
    case 1:
        s1_moves(src, count, delta);
        s1_dense(block, nwords, shift, mask, bitmap, tab, nkeys, delta);
        break;
    case 2:
        s2_moves(src, count, delta);
#if HAVE_AVX512_LOOPS
        if (shift == 7 && bits == 8 && use_avx512)
            s2_dense_bf16_bmi2(block, nwords, bitmap, tab, delta);
        else
#endif
        if (shift == 7 && bits == 8) s2_dense_bf16(block, nwords, bitmap, tab, delta);
        else s2_dense(block, nwords, shift, mask, bitmap, tab, nkeys, delta);
        break;
    case 4:
        s4_moves(src, count, delta);
        s4_dense(block, nwords, shift, mask, bitmap, tab, nkeys, delta);
        break;
    default:
        s8_moves(src, count, delta);
        s8_dense(block, nwords, shift, mask, bitmap, tab, nkeys, delta);
    }
    /* Every set bit is met by the walker of its half: a check of the bookkeeping. */
    first = 0;
    for (size_t c = 0; c < nctx; c++) {
        size_t e = (size_t)key[c];
        first += cnt[c];
        if (tab[s + e] != (uint64_t)half[e] || tab[3 * s + e] != (uint64_t)first)
            return "context block points past the end of a context";
    }
    return NULL;
}

static size_t scatter_dense_scratch(size_t nwords, int word, int bits, size_t count) {
    size_t nkeys = (size_t)1 << bits;
    return (4 * STRIDE(nkeys) + 2 * nkeys) * 8 + (nkeys + 4 * STRIDE(nkeys)) * 4 +
           (nwords / 64 + 1) * 8 + (count + 1) * (size_t)word;
}

/* The sparse walk: each context's ranks turned into the states after each change, in place
 * (`rank` becomes next[]), then walked. */
static const char *scatter_sparse(uint8_t *block, size_t nwords, int word, int shift, int bits,
                                  const int64_t *key, const int64_t *cnt, size_t nctx,
                                  int64_t *rank, const uint8_t *const *src, uint64_t *state) {
    size_t nkeys = (size_t)1 << bits;
    uint32_t mask = (uint32_t)(nkeys - 1);
    for (size_t e = 0; e < nkeys; e++) state[e] = NEVER;
    int64_t first = 0;
    for (size_t c = 0; c < nctx; c++) {
        int64_t end = first + cnt[c];
        state[key[c]] = ((uint64_t)first << 32) | (uint64_t)rank[first];
        for (int64_t j = first; j < end; j++)
            rank[j] = (int64_t)(((uint64_t)(j + 1) << 32) |
                                (j + 1 < end ? (uint64_t)(rank[j + 1] - rank[j] - 1) : NEVER));
        first = end;
    }
    const uint64_t *next = (const uint64_t *)rank;
    switch (word) {
    case 1: s1_sparse(block, nwords, shift, mask, next, state, src); break;
    case 2:
        if (shift == 7 && bits == 8) s2_sparse_bf16(block, nwords, next, state, src);
        else s2_sparse(block, nwords, shift, mask, next, state, src);
        break;
    case 4: s4_sparse(block, nwords, shift, mask, next, state, src); break;
    default: s8_sparse(block, nwords, shift, mask, next, state, src);
    }
    /* A key whose changes were not all met had ranks past its words. */
    first = 0;
    for (size_t c = 0; c < nctx; c++) {
        first += cnt[c];
        if (state[key[c]] >> 32 != (uint64_t)first)
            return "context block points past the end of a context";
    }
    return NULL;
}

#if HAVE_AVX2_LOOPS
/* The select walk of a BF16 context block (the key: the exponent), for CPUs with AVX2 and a
 * fast PDEP (BMI2). The walks above go word by word, a load and a store at each word and, in
 * the sparse one, a branch taken at each change and mostly mispredicted there: 1.1 ns a word
 * with 1 change in 100, 3 ns with 1 in 6, on this project's benchmark chains. This one finds
 * a block's changes 64 words at a time, key by key, with no branch on the data:
 * - each context's ranks are decoded into a bitmap, each context in its own region
 *   [off, off + lim) (lim: its last rank + 1) with SELECT_PAD clear bits after it, so that
 *   regions follow from the streams alone (no count of the keys' words first);
 * - the 64 words' exponent bytes are compared with each context's key (VPCMPEQB and
 *   VPMOVMSKB; with AVX-512BW, one VPCMPEQB into a mask register, select_keys_avx512):
 *   a mask of the key's words among them, whose count n takes the next n bits of the key's
 *   region, and PDEP deposits these into the mask: the key's changed words among the 64;
 * - the moves are added over the set bits alone, each from its key's next move.
 * The 64 words are laid out backwards (word 0 at bit 63), so that the region's bits, read most
 * significant first, land in order: PDEP puts a source's low bit at the mask's lowest set bit,
 * the key's last word of the 64, and the n bits shifted down to the bottom hold the key's last
 * rank among them at bit 0. A key is dropped from the pass at the first chunk that starts past
 * its last change; within a chunk its reads run on into the clear bits after its region.
 * Contexts whose keys have few words would cost a pass over every group for little: the keys
 * outside one range [lo, hi] of exponents, chosen from a sample of the block, are met a word
 * at a time instead, through a mask of the words outside the range. The same checks as
 * scatter_dense; the same bytes. */
typedef struct {
    uint32_t off[256], lim[256], seen[256], jk[256];
} SelectKeys;

/* Bit `at` of the bitmap read as a stream of bytes. */
static inline uint32_t bitmap_bit(const uint8_t *bytes, uint64_t at) {
    return (uint32_t)(bytes[at >> 3] >> (7 - (at & 7))) & 1;
}

/* The n bits (n <= 64) of the bitmap, read as a stream of bytes (each most significant bit
 * first) from bit `at`, as the low n bits of the result; 0 for n = 0. */
static inline SELECT_TARGET uint64_t select_bits(const uint8_t *bytes, uint64_t at,
                                                  unsigned n) {
    uint64_t r;
    memcpy(&r, bytes + (at >> 3), 8);
    r = __builtin_bswap64(r) << (at & 7);
    if (__builtin_expect(n > 57, 0)) /* past the 57 bits the load surely holds */
        r |= (uint64_t)bytes[(at >> 3) + 8] >> (8 - (at & 7));
    return r >> ((64 - n) & 63); /* for n = 0 any bits do: they go into an empty mask */
}

/* A word met on its own: its key's next rank, and whether that rank is a change. */
static inline uint32_t select_one(const uint8_t *bytes, SelectKeys *t, uint8_t key) {
    uint32_t r = t->seen[key]++;
    return bitmap_bit(bytes, (uint64_t)t->off[key] + (r < t->lim[key] ? r : t->lim[key]));
}

/* The vector pass of s2_select_bf16 over one chunk's `ng` groups of 64 words (`exps`, laid out
 * backwards): the changed words of the `live` keys, two keys at a time, into `hits`. KEYS
 * declares what MASKS needs of the two keys k0 and k1; MASKS sets m0 and m1, their words'
 * masks among group g's 64 (bit i for byte i). */
#define SELECT_KEYS(KEYS, MASKS)                                                              \
    for (size_t c = 0; c < nlive; c += 2) {                                                   \
        uint8_t k0 = live[c], k1 = c + 1 < nlive ? live[c + 1] : live[c];                     \
        KEYS;                                                                                 \
        uint64_t at0 = (uint64_t)t->off[k0] + t->seen[k0];                                    \
        uint64_t at1 = (uint64_t)t->off[k1] + t->seen[k1];                                    \
        uint64_t both = c + 1 < nlive ? ~0ull : 0; /* a lone last key: its twin adds 0 */     \
        for (size_t g = 0; g < ng; g++) {                                                     \
            uint64_t m0, m1;                                                                  \
            MASKS;                                                                            \
            m1 &= both;                                                                       \
            unsigned n0 = (unsigned)__builtin_popcountll(m0);                                 \
            unsigned n1 = (unsigned)__builtin_popcountll(m1);                                 \
            hits[g] |= _pdep_u64(select_bits(bytes, at0, n0), m0) |                           \
                       _pdep_u64(select_bits(bytes, at1, n1), m1);                            \
            at0 += n0;                                                                        \
            at1 += n1;                                                                        \
        }                                                                                     \
        t->seen[k0] = (uint32_t)(at0 - t->off[k0]);                                           \
        if (both) t->seen[k1] = (uint32_t)(at1 - t->off[k1]);                                 \
    }

static SELECT_TARGET __attribute__((noinline)) void select_keys_avx2(
    const uint8_t *exps, size_t ng, uint64_t *hits, const uint8_t *bytes, SelectKeys *t,
    const uint8_t *live, size_t nlive) {
    SELECT_KEYS(const __m256i v0 = _mm256_set1_epi8((char)k0);
                const __m256i v1 = _mm256_set1_epi8((char)k1), {
                    __m256i e0 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g));
                    __m256i e1 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g + 32));
                    m0 = byte_mask64(_mm256_cmpeq_epi8(e0, v0), _mm256_cmpeq_epi8(e1, v0));
                    m1 = byte_mask64(_mm256_cmpeq_epi8(e0, v1), _mm256_cmpeq_epi8(e1, v1));
                })
}

#if HAVE_AVX512_LOOPS
#define SELECT512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx2,popcnt,bmi,bmi2,lzcnt")))

/* select_keys_avx2 with AVX-512BW: one compare gives a key's mask of the 64 words (AVX2 takes
 * two compares, two byte masks and a shift), and each group's exponents are loaded once for
 * the two keys. */
static SELECT512_TARGET __attribute__((noinline)) void select_keys_avx512(
    const uint8_t *exps, size_t ng, uint64_t *hits, const uint8_t *bytes, SelectKeys *t,
    const uint8_t *live, size_t nlive) {
    SELECT_KEYS(const __m512i v0 = _mm512_set1_epi8((char)k0);
                const __m512i v1 = _mm512_set1_epi8((char)k1), {
                    __m512i e = _mm512_loadu_si512((const void *)(exps + 64 * g));
                    m0 = _mm512_cmpeq_epi8_mask(e, v0);
                    m1 = _mm512_cmpeq_epi8_mask(e, v1);
                })
}
#endif

static SELECT_TARGET __attribute__((noinline)) void s2_select_bf16(
    u16a *w, size_t nwords, const uint8_t *bytes, SelectKeys *t, const uint16_t *delta,
    const uint8_t *keys, size_t nsel, int lo, int hi) {
    uint8_t exps[SELECT_CHUNK];
    uint64_t hits[SELECT_CHUNK / 64];
    const __m256i reverse = _mm256_setr_epi8(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1,
                                             0, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                             2, 1, 0);
    const __m256i low = _mm256_set1_epi16(0xFF);
    /* Outside [lo, hi]: the byte e - lo (mod 256) above hi - lo. */
    const __m256i lo8 = _mm256_set1_epi8((char)lo), span = _mm256_set1_epi8((char)(hi - lo));
    const __m256i zero = _mm256_setzero_si256();
    size_t full = nwords / 64 * 64;
    for (size_t s = 0; s < full; s += SELECT_CHUNK) {
        size_t n = full - s < SELECT_CHUNK ? full - s : SELECT_CHUNK, ng = n / 64;
        u16a *v = w + s;
        for (size_t g = 0; g < 2 * ng; g++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(v + 32 * g));
            __m256i b = _mm256_loadu_si256((const __m256i *)(v + 32 * g + 16));
            a = _mm256_and_si256(_mm256_srli_epi16(a, 7), low);
            b = _mm256_and_si256(_mm256_srli_epi16(b, 7), low);
            /* packus interleaves the lanes (words 0-7, 16-23 | 8-15, 24-31); each lane
             * reversed, the quarters (23-16, 7-0, 31-24, 15-8) are put as 31-24 ... 7-0,
             * and the two halves of the 64 words swapped: byte i holds word 63 - i */
            __m256i e = _mm256_shuffle_epi8(_mm256_packus_epi16(a, b), reverse);
            _mm256_storeu_si256((__m256i *)(exps + 32 * (g ^ 1)),
                                _mm256_permute4x64_epi64(e, 0x72));
        }
        for (size_t g = 0; g < ng; g++) hits[g] = 0;
        /* the keys with changes left: a key's reads past its last change, within this
         * chunk, find the clear bits after its region */
        uint8_t live[256];
        size_t nlive = 0;
        for (size_t c = 0; c < nsel; c++)
            if (t->seen[keys[c]] < t->lim[keys[c]]) live[nlive++] = keys[c];
#if HAVE_AVX512_LOOPS
        if (use_avx512)
            select_keys_avx512(exps, ng, hits, bytes, t, live, nlive);
        else
#endif
            select_keys_avx2(exps, ng, hits, bytes, t, live, nlive);
        for (size_t g = 0; g < ng; g++) {
            __m256i e0 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g));
            __m256i e1 = _mm256_loadu_si256((const __m256i *)(exps + 64 * g + 32));
            /* > 0: outside */
            e0 = _mm256_cmpeq_epi8(_mm256_subs_epu8(_mm256_sub_epi8(e0, lo8), span), zero);
            e1 = _mm256_cmpeq_epi8(_mm256_subs_epu8(_mm256_sub_epi8(e1, lo8), span), zero);
            uint64_t rare = ~byte_mask64(e0, e1);
            while (rare) {
                int bit = 63 - __builtin_clzll(rare); /* the first word left: 63 - bit */
                rare ^= 1ull << bit;
                hits[g] |= (uint64_t)select_one(bytes, t, exps[64 * g + (size_t)bit]) << bit;
            }
        }
        for (size_t g = 0; g < ng; g++) {
            uint64_t h = hits[g];
            u16a *x = v + 64 * g;
            const uint8_t *e = exps + 64 * g;
            while (h) {
                int p = __builtin_clzll(h); /* bit 63 - p: word p of the 64 */
                h ^= 0x8000000000000000ull >> p;
                uint8_t key = e[63 - p];
                x[p] = (uint16_t)(x[p] + delta[t->jk[key]++]);
            }
        }
    }
    for (size_t i = full; i < nwords; i++) { /* the last words, fewer than 64 */
        uint8_t key = (uint8_t)(w[i] >> 7);
        if (select_one(bytes, t, key)) w[i] = (uint16_t)(w[i] + delta[t->jk[key]++]);
    }
}

/* The moves of `count` BF16 changes as words (unzigzag of the two planes), and one of 0 after. */
static SELECT_TARGET void s2_moves_avx2(const uint8_t *const *src, size_t count,
                                        uint16_t *delta) {
    size_t j = 0;
    const __m256i one = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    for (; j + 32 <= count; j += 32) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(src[0] + j));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(src[1] + j));
        /* the lanes of the unpacks: moves 0-7 | 16-23, and 8-15 | 24-31 */
        __m256i z0 = _mm256_unpacklo_epi8(lo, hi), z1 = _mm256_unpackhi_epi8(lo, hi);
        __m256i a = _mm256_permute2x128_si256(z0, z1, 0x20);
        __m256i b = _mm256_permute2x128_si256(z0, z1, 0x31);
        a = _mm256_xor_si256(_mm256_srli_epi16(a, 1),
                             _mm256_sub_epi16(zero, _mm256_and_si256(a, one)));
        b = _mm256_xor_si256(_mm256_srli_epi16(b, 1),
                             _mm256_sub_epi16(zero, _mm256_and_si256(b, one)));
        _mm256_storeu_si256((__m256i *)(delta + j), a);
        _mm256_storeu_si256((__m256i *)(delta + j + 16), b);
    }
    for (; j < count; j++) {
        uint16_t z = (uint16_t)(src[0][j] | src[1][j] << 8);
        delta[j] = (uint16_t)((z >> 1) ^ (0u - (z & 1)));
    }
    delta[count] = 0;
}

/* A bitmap's bits set one after another, at increasing indices, by storing the word they are
 * in whole each time (the word is the caller's alone: nothing else is in it) instead of at a
 * branch on a new word, which mispredicts wherever changes are dense. */
static inline void store_next_bit(uint64_t *bitmap, uint64_t *word, uint64_t *acc, uint64_t g) {
    uint64_t w = g >> 6;
    *acc = (w == *word ? *acc : 0) | BIT_OF(g);
    *word = w;
    bitmap[w] = *acc;
}

/* The scalar walk of context_bits_select, from code found0 (see RICE_WALK). */
static const char *context_bits_select_walk(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                            const uint8_t *rend, size_t count, int k,
                                            size_t nwords, uint64_t ubit0, uint64_t rbit0,
                                            uint64_t *bitmap, uint64_t off, uint64_t *next,
                                            int64_t *final, uint64_t word, uint64_t acc,
                                            size_t found0, int64_t at0) {
    RICE_WALK(ubit0, rbit0, found0, at0, "context block points past the end of a context",
              store_next_bit(bitmap, &word, &acc, off + (uint64_t)at),
              (*next = (uint64_t)(end_before + 1), *final = at))
}

/* context_bits for scatter_select without AVX-512, k >= 1, its bits set by store_next_bit
 * (regions lie SELECT_PAD clear bits apart); also gives the run's last rank (`final`). The
 * AVX2 vector walk takes the codes it can, the scalar walk the rest. */
static const char *context_bits_select(const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                       const uint8_t *rend, size_t count, int k, size_t nwords,
                                       uint64_t ubit0, uint64_t rbit0, uint64_t *bitmap,
                                       uint64_t off, uint64_t *next, int64_t *final) {
    uint64_t word = off >> 6, acc = 0;
    size_t found = 0;
    int64_t at = -1, end_before = (int64_t)ubit0 - 1;
    RICE_VEC_FIRST(ubit0, rbit0,
                   for (size_t j = 0; j < n; j++)
                       store_next_bit(bitmap, &word, &acc, off + batch[j]))
    return context_bits_select_walk(ub, ulen, rb, rend, count, k, nwords,
                                    (uint64_t)(end_before + 1), rbit0, bitmap, off, next, final,
                                    word, acc, found, at);
}

/* The clear bits after each region: a key still reads its region through the chunk in which
 * it meets its last change (at most a chunk's words, and a read takes up to 64 bits). */
#define SELECT_PAD (SELECT_CHUNK + 128)
static size_t select_bitmap_words(size_t nwords, size_t nctx) {
    return (2 * nwords + SELECT_PAD * (nctx + 1)) / 64 + 3;
}

static size_t scatter_select_scratch(size_t nwords, size_t nctx, size_t count) {
    return sizeof(SelectKeys) + select_bitmap_words(nwords, nctx) * 8 + (count + 1) * 2;
}

/* context_scatter's select walk (see s2_select_bf16) of a BF16 block keyed by its exponents.
 * The error (a static string) or NULL. */
static const char *scatter_select(uint8_t *block, size_t nwords, const int64_t *key,
                                  const int64_t *kof, const int64_t *cnt, size_t nctx,
                                  const uint8_t *ub, size_t ulen, const uint8_t *rb,
                                  const uint8_t *rend, size_t count, const uint8_t *const *src,
                                  void *scratch) {
    const char *past = "context block points past the end of a context";
    SelectKeys *t = scratch; /* zeroed: keys without a context read bit 0, always clear */
    uint64_t *bitmap = (uint64_t *)(t + 1);
    size_t nbitmap = select_bitmap_words(nwords, nctx);
    memset(scratch, 0, sizeof *t + nbitmap * 8);
    uint16_t *delta = (uint16_t *)(bitmap + nbitmap);
    /* Region c at [off, off + lim) after SELECT_PAD clear bits; a valid block's regions add up
     * to at most nwords bits (lim is at most the count of the key's words), so a decode, whose
     * ranks are below nwords, writes inside 2 nwords + SELECT_PAD (nctx + 1) bits. */
    uint64_t ubit = 0, rbit = 0, at = SELECT_PAD, used = 0;
    int64_t first = 0;
    for (size_t c = 0; c < nctx; c++) {
        size_t e = (size_t)key[c];
        int64_t last = -1;
        const char *error =
            !kof[c]      ? context_bits_k0(ub, ulen, (size_t)cnt[c], nwords, ubit, bitmap, at,
                                           &ubit, &last)
            : use_avx512 ? context_bits(ub, ulen, rb, rend, (size_t)cnt[c], (int)kof[c], nwords,
                                        ubit, rbit, bitmap, at, &ubit, &last)
                         : context_bits_select(ub, ulen, rb, rend, (size_t)cnt[c], (int)kof[c],
                                               nwords, ubit, rbit, bitmap, at, &ubit, &last);
        if (error) return error;
        rbit += (uint64_t)cnt[c] * (uint64_t)kof[c];
        used += (uint64_t)last + 1;
        if (used > nwords) return past;
        t->off[e] = (uint32_t)at;
        t->lim[e] = (uint32_t)(last + 1);
        t->jk[e] = (uint32_t)first;
        at += (uint64_t)last + 1 + SELECT_PAD;
        first += cnt[c];
    }
    uint8_t keys[256];
    for (size_t c = 0; c < nctx; c++) keys[c] = (uint8_t)key[c];
    size_t blo, bhi;
    select_range((const u16a *)block, nwords, keys, nctx, &blo, &bhi);
    s2_moves_avx2(src, count, delta);
    /* The walk reads the bitmap as a stream of bytes, most significant bit first. */
    for (size_t i = 0; i < nbitmap; i++) bitmap[i] = __builtin_bswap64(bitmap[i]);
    s2_select_bf16((u16a *)block, nwords, (const uint8_t *)bitmap, t, delta, keys + blo,
                   bhi - blo + 1, (int)key[blo], (int)key[bhi]);
    /* Every change is met: each key took as many moves as its context has. */
    first = 0;
    for (size_t c = 0; c < nctx; c++) {
        first += cnt[c];
        if (t->jk[key[c]] != (uint64_t)first) return past;
    }
    return NULL;
}
#endif

/* context_scatter(words, word, shift, bits, keys, ks, counts, unary, remainder, planes): a
 * context block applied to `words` (writable, the base block) in place: what
 * scatter_add(words, context_positions(...), unzigzag(planes, ...)) does, without the arrays
 * between. keys, ks and counts are the checked context table (int64 each); damaged streams
 * raise CorruptPatchError as context.decode_moves does, and leave `words` partly patched. */
static PyObject *context_scatter(PyObject *self, PyObject *args) {
    Py_buffer w, kb, kk, cb, u, rem;
    int word, shift, bits;
    PyObject *planes;
    if (!PyArg_ParseTuple(args, "w*iiiy*y*y*y*y*O", &w, &word, &shift, &bits, &kb, &kk, &cb, &u,
                          &rem, &planes))
        return NULL;
    PyObject *result = NULL;
    Py_buffer views[8];
    const uint8_t *src[8];
    uint8_t *zero = NULL;
    int held = 0;
    int64_t *rank = NULL;
    void *scratch = NULL;
    if (context_args(&w, word, shift, bits) < 0) goto done;
    size_t nwords = (size_t)w.len / (size_t)word, nctx = (size_t)kb.len / 8,
           nkeys = (size_t)1 << bits;
    const int64_t *key = kb.buf, *kof = kk.buf, *cnt = cb.buf;
    if (kb.len % 8 || kk.len != kb.len || cb.len != kb.len || nctx == 0) {
        PyErr_SetString(PyExc_ValueError, "context_scatter: mismatched context table");
        goto done;
    }
    uint64_t count = 0, rbits = 0;
    for (size_t c = 0; c < nctx; c++) {
        if (key[c] < 0 || (size_t)key[c] >= nkeys || (c && key[c] <= key[c - 1]) || cnt[c] <= 0 ||
            kof[c] < 0 || kof[c] > MAX_RICE_K) {
            corrupt("context block table is damaged");
            goto done;
        }
        count += (uint64_t)cnt[c];
        rbits += (uint64_t)cnt[c] * (uint64_t)kof[c];
    }
    if (count > nwords) {
        corrupt("context block table is damaged");
        goto done;
    }
    if ((uint64_t)rem.len != (rbits + 7) / 8) {
        corrupt("remainder stream has the wrong length");
        goto done;
    }
    if (take_planes(planes, (Py_ssize_t)count, word, "context_scatter", views, src, &held, &zero) < 0)
        goto done;
#if HAVE_AVX2_LOOPS
    int select = use_select && word == 2 && shift == 7 && bits == 8;
    if (select && reserve(&select_scratch, &select_scratch_cap,
                          scatter_select_scratch(nwords, nctx, (size_t)count)) < 0)
        goto done;
#else
    int select = 0;
#endif
    int dense = count * SCATTER_DENSE_FROM >= nwords;
    if (!select) {
        if (!dense) rank = malloc(count * 8);
        scratch = dense ? calloc(1, scatter_dense_scratch(nwords, word, bits, count))
                        : malloc(nkeys * 8);
        if ((!dense && !rank) || !scratch) {
            PyErr_NoMemory();
            goto done;
        }
    }
    /* Quotients are at most the gaps, which add up to less than nwords: read no further. */
    size_t ulen = (size_t)u.len, bound = ((size_t)count + nwords + 7) / 8;
    if (ulen > bound) ulen = bound;
    const uint8_t *ub = u.buf, *rb = rem.buf, *rend = rb + rem.len;
    const char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX2_LOOPS
    if (select) {
        error = scatter_select(w.buf, nwords, key, kof, cnt, nctx, ub, ulen, rb, rend,
                               (size_t)count, src, select_scratch);
    } else
#endif
    if (dense) {
        error = scatter_dense(w.buf, nwords, word, shift, bits, key, kof, cnt, nctx, ub, ulen,
                              rb, rend, (size_t)count, src, scratch);
    } else {
        /* Each change's rank among its context's words, from the unary and remainder streams. */
        uint64_t ubit = 0, rbit = 0;
        int64_t first = 0;
        for (size_t c = 0; c < nctx && !error; c++) {
            error = context_run(ub, ulen, rb, rend, (size_t)cnt[c], (int)kof[c], nwords, ubit,
                                rbit, rank + first, &ubit);
            rbit += (uint64_t)cnt[c] * (uint64_t)kof[c];
            first += cnt[c];
        }
        if (!error)
            error = scatter_sparse(w.buf, nwords, word, shift, bits, key, cnt, nctx, rank, src,
                                   scratch);
    }
    Py_END_ALLOW_THREADS
    if (error) corrupt(error);
    else result = Py_NewRef(Py_None);
done:
    release_planes(views, held, zero);
    free(rank);
    free(scratch);
    PyBuffer_Release(&w);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&kk);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&u);
    PyBuffer_Release(&rem);
    return result;
}

/* ---------------------------------------------------------------- mapped reads */

/* diff reads its inputs through read-only memory maps: a block is compared and hashed where
 * it lies in the page cache, instead of being copied into a buffer first (pread's copy was a
 * quarter of the CPU time of a sparse diff). A file that gets shorter while it is mapped makes
 * the next access to a page past its end raise SIGBUS, which no Python code can catch; so every
 * mapping is registered here with the path it reads, and a SIGBUS inside one ends the process
 * the way the pread path would fail: the registered temp outputs are removed and one
 * "pulsectl: error:" line names the file (exit status 1). A SIGBUS anywhere else is passed on
 * to the handler that was there before. */
#if defined(__unix__) || defined(__APPLE__)
#include <errno.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define HAVE_GUARDED_MAPS 1
#else
#define HAVE_GUARDED_MAPS 0
#endif

#if HAVE_GUARDED_MAPS
#define GUARD_SLOTS 1024
#define HUGE_SPAN (2LL << 20)
#define LABEL_BYTES 1024
#define CLEANUP_SLOTS 64
#define CLEANUP_BYTES 4096

/* A slot is taken (under the GIL) before its mapping exists; `start` is published last and
 * cleared once the mapping is gone, so the handler only ever sees whole entries. */
static struct {
    uintptr_t start, end;
    char label[LABEL_BYTES];
} guards[GUARD_SLOTS];
static char guard_taken[GUARD_SLOTS];
static char cleanup_paths[CLEANUP_SLOTS][CLEANUP_BYTES];
static int cleanup_used[CLEANUP_SLOTS];
static struct sigaction previous_bus;
static int handler_installed = 0;

static void write_all(const char *s, size_t n) {
    while (n) {
        ssize_t w = write(2, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    uintptr_t at = (uintptr_t)info->si_addr;
    for (int i = 0; i < GUARD_SLOTS; i++) {
        uintptr_t start = __atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE);
        if (!start || at < start || at >= guards[i].end) continue;
        for (int c = 0; c < CLEANUP_SLOTS; c++) {
            if (__atomic_load_n(&cleanup_used[c], __ATOMIC_ACQUIRE)) unlink(cleanup_paths[c]);
        }
        /* The words of pulsectl._io.pread_into's error for the same event. */
        static const char head[] = "pulsectl: error: ";
        static const char tail[] = ": file is shorter than its header says (changed while "
                                   "reading?)\n";
        write_all(head, sizeof head - 1);
        write_all(guards[i].label, strnlen(guards[i].label, LABEL_BYTES));
        write_all(tail, sizeof tail - 1);
        _exit(1);
    }
    /* Not one of ours: put the previous action back; the access faults again and gets it. */
    sigaction(SIGBUS, &previous_bus, NULL);
}

static int install_handler(void) {
    if (handler_installed) return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_bus) != 0) return -1;
    handler_installed = 1;
    return 0;
}

typedef struct {
    PyObject_HEAD
    void *map;
    size_t map_len;
    char *data;
    Py_ssize_t len;
    int slot;
} Mapped;

static void mapped_dealloc(Mapped *m) {
    if (m->map) munmap(m->map, m->map_len);
    if (m->slot >= 0) {
        __atomic_store_n(&guards[m->slot].start, 0, __ATOMIC_RELEASE);
        guard_taken[m->slot] = 0;
    }
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static int mapped_getbuffer(Mapped *m, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)m, m->data, m->len, 1, flags);
}

static PyBufferProcs mapped_as_buffer = {(getbufferproc)mapped_getbuffer, NULL};

static PyTypeObject MappedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pulsectl._speedups.Mapped",
    .tp_basicsize = sizeof(Mapped),
    .tp_dealloc = (destructor)mapped_dealloc,
    .tp_as_buffer = &mapped_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A read-only memory map of part of a file, guarded against SIGBUS.",
};

static PyObject *map_file(PyObject *self, PyObject *args) {
    int fd;
    long long offset;
    Py_ssize_t length;
    const char *label;
    if (!PyArg_ParseTuple(args, "iLns:map_file", &fd, &offset, &length, &label)) return NULL;
    if (offset < 0 || length <= 0) {
        PyErr_SetString(PyExc_ValueError, "map_file: a negative offset or an empty range");
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (offset + (long long)length > (long long)st.st_size) {
        PyErr_SetString(PyExc_EOFError, "map_file: the range ends past the end of the file");
        return NULL;
    }
    int slot = -1;
    for (int i = 0; i < GUARD_SLOTS; i++) {
        if (!guard_taken[i]) {
            slot = i;
            break;
        }
    }
    if (slot < 0 || install_handler() != 0) Py_RETURN_NONE; /* the caller reads instead */
    long page = sysconf(_SC_PAGESIZE);
    long long aligned = offset - offset % (page > 0 ? page : 4096);
    long long map_end = offset + (long long)length;
    if (length >= HUGE_SPAN) {
        /* Ranges of 2 MiB and more are widened to 2 MiB boundaries of the file (within it):
         * the kernel then places the map so that the page cache's 2 MiB folios are mapped
         * whole, one fault each instead of one per 64 KiB. */
        aligned = offset - offset % HUGE_SPAN;
        long long end = map_end + (HUGE_SPAN - map_end % HUGE_SPAN) % HUGE_SPAN;
        map_end = end < (long long)st.st_size ? end : (long long)st.st_size;
    }
    size_t map_len = (size_t)(map_end - aligned);
    guard_taken[slot] = 1;
    void *map;
    Py_BEGIN_ALLOW_THREADS
    map = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, (off_t)aligned);
    Py_END_ALLOW_THREADS
    if (map == MAP_FAILED) { /* a file system without mmap: the caller reads instead */
        guard_taken[slot] = 0;
        Py_RETURN_NONE;
    }
    Mapped *m = PyObject_New(Mapped, &MappedType);
    if (!m) {
        munmap(map, map_len);
        guard_taken[slot] = 0;
        return NULL;
    }
    m->map = map;
    m->map_len = map_len;
    m->data = (char *)map + (offset - aligned);
    m->len = length;
    m->slot = slot;
    strncpy(guards[slot].label, label, LABEL_BYTES - 1);
    guards[slot].label[LABEL_BYTES - 1] = 0;
    guards[slot].end = (uintptr_t)map + map_len;
    __atomic_store_n(&guards[slot].start, (uintptr_t)map, __ATOMIC_RELEASE);
    return (PyObject *)m;
}

static PyObject *add_cleanup(PyObject *self, PyObject *args) {
    const char *path;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#:add_cleanup", &path, &n)) return NULL;
    if (n <= 0 || n >= CLEANUP_BYTES || memchr(path, 0, (size_t)n)) return PyLong_FromLong(-1);
    for (int c = 0; c < CLEANUP_SLOTS; c++) {
        if (__atomic_load_n(&cleanup_used[c], __ATOMIC_ACQUIRE)) continue;
        memcpy(cleanup_paths[c], path, (size_t)n);
        cleanup_paths[c][n] = 0;
        __atomic_store_n(&cleanup_used[c], 1, __ATOMIC_RELEASE);
        return PyLong_FromLong(c);
    }
    return PyLong_FromLong(-1);
}

static PyObject *remove_cleanup(PyObject *self, PyObject *args) {
    int c;
    if (!PyArg_ParseTuple(args, "i:remove_cleanup", &c)) return NULL;
    if (c >= 0 && c < CLEANUP_SLOTS) __atomic_store_n(&cleanup_used[c], 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}
#else
static PyObject *map_file(PyObject *self, PyObject *args) { Py_RETURN_NONE; }
static PyObject *add_cleanup(PyObject *self, PyObject *args) { return PyLong_FromLong(-1); }
static PyObject *remove_cleanup(PyObject *self, PyObject *args) { Py_RETURN_NONE; }
#endif

static int avx512_available(void) {
#if HAVE_AVX512_LOOPS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("avx512vbmi2") &&
           __builtin_cpu_supports("bmi2");
#else
    return 0;
#endif
}

/* The select walk's PDEP: BMI2, and not on AMD before Zen 3 (family 0x19), whose PDEP is
 * microcoded: tens to hundreds of cycles where it is one elsewhere. */
static int select_available(void) {
#if HAVE_AVX2_LOOPS
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("popcnt") ||
        !__builtin_cpu_supports("bmi") || !__builtin_cpu_supports("bmi2"))
        return 0;
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    /* "Auth" of "AuthenticAMD", "Hygo" of "HygonGenuine" (Hygon's are Zen 1) */
    int amd = b == 0x68747541u || b == 0x6f677948u;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned family = (a >> 8) & 0xF;
    if (family == 0xF) family += (a >> 20) & 0xFF;
    return !amd || family >= 0x19;
#else
    return 0;
#endif
}

static int avx2_available(void) {
#if HAVE_AVX2_LOOPS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
#else
    return 0;
#endif
}

/* simd(level) -> str: use at most these loops: "avx512", "avx2" or "portable" (True: the best
 * the CPU has, False: "portable"), each only where the CPU has it; None leaves the choice.
 * Returns the loops now in use: "avx512" (with the AVX2 ones where a loop has no AVX-512
 * version), "avx2" or "portable". */
static PyObject *simd(PyObject *self, PyObject *level) {
    if (level != Py_None) {
        int top; /* 2: avx512, 1: avx2, 0: portable */
        if (PyUnicode_Check(level)) {
            top = PyUnicode_CompareWithASCIIString(level, "avx512") == 0   ? 2
                  : PyUnicode_CompareWithASCIIString(level, "avx2") == 0   ? 1
                  : PyUnicode_CompareWithASCIIString(level, "portable") == 0 ? 0
                                                                              : -1;
            if (top < 0) {
                PyErr_Format(PyExc_ValueError,
                             "simd: %R is not one of 'avx512', 'avx2', 'portable'", level);
                return NULL;
            }
        } else {
            int want = PyObject_IsTrue(level);
            if (want < 0) return NULL;
            top = want ? 2 : 0;
        }
        use_avx512 = top >= 2 && avx512_available();
        use_avx2 = top >= 1 && avx2_available();
        use_select = use_avx2 && select_available();
    }
    return PyUnicode_FromString(use_avx512 ? "avx512" : use_avx2 ? "avx2" : "portable");
}

/* select_walk() -> bool: whether BF16 context blocks are applied (and, from 1 change in 28
 * words, encoded) by the select walk: AVX2 loops in use, and a fast PDEP. */
static PyObject *select_walk(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(use_select);
}

static PyObject *set_corrupt_error(PyObject *self, PyObject *cls) {
    Py_XINCREF(cls);
    Py_XSETREF(CorruptError, cls);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"changes", changes, METH_VARARGS,
     "changes(old, new, word) -> bytearray of int64: the indices of the words that differ."},
    {"changes_into", changes_into, METH_VARARGS,
     "changes_into(old, new, word, positions, planes) -> count: the changed words and the "
     "zigzag planes of their moves, into the caller's buffers (room for len(old) // word + 1 entries; planes len(positions) // 8 "
     "apart)."},
    {"zigzag_planes", zigzag_planes, METH_VARARGS,
     "zigzag_planes(old, new, positions, word) -> bytes: the raw value planes, plane 0 first."},
    {"rice_size", rice_size, METH_VARARGS,
     "rice_size(positions) -> (k, unary_bytes, remainder_bytes) that rice_encode would give."},
    {"rice_encode", rice_encode, METH_VARARGS,
     "rice_encode(positions) -> (k, unary, remainder) of the gaps of sorted int64 positions."},
    {"rice_decode", rice_decode, METH_VARARGS,
     "rice_decode(unary, remainder, count, k, nwords) -> bytearray of int64 positions."},
    {"rice_scatter", rice_scatter, METH_VARARGS,
     "rice_scatter(words, unary, remainder, count, k, planes, word): a Rice block applied to "
     "words in place (rice_decode, unzigzag and scatter_add in one pass)."},
    {"scatter_add", scatter_add, METH_VARARGS,
     "scatter_add(words, positions, moves, word): words[p] += move in place (wrapping)."},
    {"unzigzag", unzigzag, METH_VARARGS,
     "unzigzag(planes, count, word) -> bytearray: moves from their zigzag planes (None = zero)."},
    {"pair_plane", pair_plane, METH_VARARGS,
     "pair_plane(plane) -> (symbols, escapes): value plane 0 in the paired form of codecs 6, 7."},
    {"unpair_plane", unpair_plane, METH_VARARGS,
     "unpair_plane(symbols, escapes, count) -> bytes: the plane pair_plane was given."},
    {"context_ranks", context_ranks, METH_VARARGS,
     "context_ranks(old, word, shift, bits, positions) -> (ranks, sizes) for codec 4."},
    {"context_positions", context_positions, METH_VARARGS,
     "context_positions(old, word, shift, bits, keys, ranks) -> positions for codec 4."},
    {"context_encode", context_encode, METH_VARARGS,
     "context_encode(old, new, word, shift, bits, positions) -> (table, unary, remainder, "
     "planes): the raw streams of a codec 4 block."},
    {"context_scatter", context_scatter, METH_VARARGS,
     "context_scatter(words, word, shift, bits, keys, ks, counts, unary, remainder, planes): a "
     "codec 4 block applied to words in place."},
    {"map_file", map_file, METH_VARARGS,
     "map_file(fd, offset, length, label) -> a read-only buffer over that range of the file, "
     "or None where it cannot be mapped; a SIGBUS in it ends the process naming `label`."},
    {"add_cleanup", add_cleanup, METH_VARARGS,
     "add_cleanup(path) -> token (-1: not kept): a file to remove if a mapped read fails."},
    {"remove_cleanup", remove_cleanup, METH_VARARGS,
     "remove_cleanup(token): forget a path given to add_cleanup."},
    {"select_walk", select_walk, METH_NOARGS,
     "select_walk() -> bool: whether BF16 context blocks are applied (and, from 1 change in 28 "
     "words, encoded) by the select walk: with the AVX2 loops in use, where PDEP is fast "
     "(Intel, AMD from Zen 3)."},
    {"simd", simd, METH_O,
     "simd(level) -> 'avx512', 'avx2' or 'portable': the loops in use after allowing at most "
     "`level` ('avx512', 'avx2', 'portable'; True: the best, False: portable), each where the "
     "CPU has it; None only asks."},
    {"set_corrupt_error", set_corrupt_error, METH_O,
     "set_corrupt_error(cls): the exception raised for damaged streams."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pulsectl._speedups",
    "Compiled inner loops of the pulsectl codecs (optional; numpy is the fallback).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
#if HAVE_GUARDED_MAPS
    if (PyType_Ready(&MappedType) < 0) return NULL;
#endif
#if HAVE_AVX512_LOOPS
    fill_ends_in();
#endif
    use_avx512 = avx512_available();
    use_avx2 = avx2_available();
    use_select = use_avx2 && select_available();
#if HAVE_AVX2_LOOPS
    fill_avx2_tables();
#endif
    return PyModule_Create(&module);
}
