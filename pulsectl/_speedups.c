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

/* The loops, in parts of a size to read (pulsectl/csrc); one translation unit still, so
 * that the compiler sees every static function where it is called. */
#include "csrc/changes.c"
#include "csrc/rice_encode.c"
#include "csrc/rice_decode.c"
#include "csrc/rice_scatter.c"
#include "csrc/paired.c"
#include "csrc/context_encode.c"
#include "csrc/context_scatter.c"
#include "csrc/mapped.c"

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
