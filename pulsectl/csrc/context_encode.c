/* pulsectl/_speedups.c, part: the context codec's ranks, positions and encoder (codec 4, diff).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

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

