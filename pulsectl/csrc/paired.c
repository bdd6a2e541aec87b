/* pulsectl/_speedups.c, part: value plane 0 in pairs (codecs 6 and 7).
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

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

