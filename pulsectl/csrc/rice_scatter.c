/* pulsectl/_speedups.c, part: Rice blocks applied in place, and moves scattered (apply).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

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

