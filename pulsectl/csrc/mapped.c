/* pulsectl/_speedups.c, part: read-only maps guarded against SIGBUS, and the temp files removed on one.
 * One translation unit: _speedups.c includes the parts in order, each using what the
 * ones before it define; a part is not compiled on its own. */

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

