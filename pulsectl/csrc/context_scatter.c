/* pulsectl/_speedups.c, part: the context codec applied in place (codecs 4 and 7, apply).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

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

