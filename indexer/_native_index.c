/*
 * The block index of a tier in native memory, and the hit-rate query as one call that runs without the
 * GIL (indexer/block_index.py's NativeBlockIndex wraps it; the pure-Python BlockIndex stays the
 * reference and the fallback, and tests/test_native_index.py holds the two equal).
 *
 * Layout: worker ids are grouped by 64 ("chunks"); per chunk, 256 open-addressing tables (segments,
 * chosen by the hash; linear probing, backward-shift deletion, load <= 7/8; each grows on its own, so a
 * store never moves more than one segment) map a block hash to the 64-bit mask of the chunk's workers
 * holding it: 16 bytes a slot, shared by every worker of the chunk holding the block. Per worker, the
 * hashes it stored, in an array that may keep hashes removed since (compacted when it reaches twice
 * what the worker holds): clearing a worker (pod removal, AllBlocksCleared) costs its own blocks, not
 * the table's. A worker's epoch grows with each clear, so a query prepared before a clear (and a
 * worker id reused since) cannot count another worker's blocks.
 *
 * Concurrency: one writer (the event loop, with the GIL) and any number of query threads (QueryPool's
 * native threads, native_pool.h, or a caller of query() without the GIL) share a table through a
 * writer-preferring readers-writer lock. The table as a context manager (NativeBlockIndex.batch) holds
 * the write lock across calls, so a query sees a stream message applied wholly or not at all. A thread
 * never waits for the lock while holding the GIL, and never takes the GIL while holding the lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../schemas/_blockhash_core.h"
#include "native_table.h"
#include "native_pool.h"

static bh_libcrypto crypto;

/* The digest memo of each query thread (schemas/_blockhash_core.h): MEMO_SLOTS slots and up to
 * memo_max_bytes of messages a thread (set_memo_bytes, from http.digestMemoBytes; 0: none), freed when
 * the thread ends. */
#define MEMO_SLOTS 32768 /* 2 MB a thread */
static size_t memo_max_bytes = 8u << 20; /* read by query threads: __atomic */
/* A thread's memo, freed when the thread ends. A key, not a __thread variable: a dlopen'ed module's
 * __thread lives in dynamic TLS, which glibc frees when it reuses a finished thread's stack, out of
 * ThreadSanitizer's sight (a false race report about one run in six). */
static pthread_key_t memo_key;

static void memo_free(void *p) { bh_memo_free(p); }

static bh_memo *query_memo(void) {
    size_t max_bytes = __atomic_load_n(&memo_max_bytes, __ATOMIC_RELAXED);
    if (!max_bytes) return NULL;
    bh_memo *memo = pthread_getspecific(memo_key);
    if (!memo) {
        memo = bh_memo_new(MEMO_SLOTS, max_bytes);
        pthread_setspecific(memo_key, memo);
    }
    return memo;
}

/* -- exiting ----------------------------------------------------------------------------------------- */
/* A process that exits while a query hashes would run EVP_Digest* after libcrypto's own exit handler
 * freed the digest (registered when libcrypto initialised, before ours: handlers run in reverse). Ours
 * (exit_handler) runs first: it stops new queries, joins every open pool's threads (a running query
 * finishes) and waits, bounded, for queries running on other threads (query() without the GIL). */
static pthread_mutex_t exit_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t exit_cv = PTHREAD_COND_INITIALIZER;
static int exiting;
static size_t running_jobs;
/* The native query threads (the Python type QueryPool). */
typedef struct QueryPool {
    PyObject_HEAD
    np_pool pool;
    int open;
    struct QueryPool *next_open; /* the open pools (open_pools), for the exit handler */
} QueryPool;
static QueryPool *open_pools;
#define EXIT_WAIT_SECONDS 10

static int job_enter(void) {
    pthread_mutex_lock(&exit_mu);
    int ok = !exiting;
    if (ok) running_jobs++;
    pthread_mutex_unlock(&exit_mu);
    return ok;
}

static void job_leave(void) {
    pthread_mutex_lock(&exit_mu);
    if (--running_jobs == 0) pthread_cond_broadcast(&exit_cv);
    pthread_mutex_unlock(&exit_mu);
}

static np_job *pool_stop(QueryPool *p);

static void exit_handler(void) {
    pthread_mutex_lock(&exit_mu);
    exiting = 1;
    QueryPool *pools = open_pools;
    open_pools = NULL;
    pthread_mutex_unlock(&exit_mu);
    for (QueryPool *p = pools, *next; p; p = next) {
        next = p->next_open;
        pool_stop(p); /* the jobs left are not freed: they hold Python objects, and Python is gone */
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += EXIT_WAIT_SECONDS;
    pthread_mutex_lock(&exit_mu);
    while (running_jobs && pthread_cond_timedwait(&exit_cv, &exit_mu, &until) != ETIMEDOUT) {
    }
    pthread_mutex_unlock(&exit_mu);
}

/* -- the Python type --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    nt_table t;
    pthread_rwlock_t lock;
    int batch_depth; /* > 0: batch() holds the write lock, for batch_owner */
    pthread_t batch_owner; /* the thread that holds it then (read and written with the GIL held) */
} Table;

/* Whether the calling thread holds the table's batch (with the GIL held). */
static int in_own_batch(const Table *self) {
    return self->batch_depth > 0 && pthread_equal(self->batch_owner, pthread_self());
}

/* A lock call's failure as an exception (EDEADLK, EAGAIN...: never expected, never ignored). */
static int lock_failed(int rc, const char *what) {
    PyErr_Format(PyExc_RuntimeError, "native table: %s failed: %s", what, strerror(rc));
    return -1;
}

/* The write lock for one call, unless this thread's batch holds it already; another thread's batch is
 * waited for like any writer (without the GIL). 0, or -1 with an exception. */
static int write_lock(Table *self) {
    if (in_own_batch(self)) return 0;
    int rc = pthread_rwlock_trywrlock(&self->lock);
    if (rc == EBUSY) {
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_rwlock_wrlock(&self->lock);
        Py_END_ALLOW_THREADS
    }
    return rc ? lock_failed(rc, "taking the write lock") : 0;
}

static int write_unlock(Table *self) {
    if (in_own_batch(self)) return 0;
    int rc = pthread_rwlock_unlock(&self->lock);
    return rc ? lock_failed(rc, "releasing the write lock") : 0;
}

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Table *self = (Table *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    nt_init(&self->t);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#if defined(__GLIBC__)
    /* glibc prefers readers by default: a steady query load would starve the event stream */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&self->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    return (PyObject *)self;
}

static void Table_dealloc(Table *self) {
    if (in_own_batch(self)) pthread_rwlock_unlock(&self->lock); /* a batch never exited: a lock is never destroyed held */
    nt_free(&self->t);
    pthread_rwlock_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A buffer of native uint64 (array('Q'), bytes of a multiple of 8) or any iterable of ints, as uint64s. */
typedef struct {
    Py_buffer view;
    int has_view; /* view holds a buffer to release */
    uint64_t *owned;
    const uint64_t *data;
    size_t n;
} U64s;

static void u64s_release(U64s *u);

static int u64s_get(PyObject *o, U64s *out) {
    memset(out, 0, sizeof *out);
    if (!PyObject_CheckBuffer(o)) {
        PyObject *seq = PySequence_Fast(o, "hashes must be an iterable of ints");
        if (!seq) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        out->owned = malloc((size_t)(n ? n : 1) * 8);
        if (!out->owned) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyLong_Check(item)) { /* (a bool is the int it stands for, as array('Q') takes it) */
                Py_DECREF(seq); free(out->owned); out->owned = NULL;
                PyErr_SetString(PyExc_TypeError, "block hashes must be ints");
                return -1;
            }
            uint64_t v = PyLong_AsUnsignedLongLong(item);
            if (v == (uint64_t)-1 && PyErr_Occurred()) {
                Py_DECREF(seq); free(out->owned); out->owned = NULL;
                PyErr_SetString(PyExc_ValueError, "block hashes must be uint64");
                return -1;
            }
            out->owned[i] = v;
        }
        Py_DECREF(seq);
        out->data = out->owned;
        out->n = (size_t)n;
        return 0;
    }
    if (PyObject_GetBuffer(o, &out->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    out->has_view = 1;
    const char *f = out->view.format ? out->view.format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN)) f++;
    int bytes = out->view.itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "b") || !strcmp(f, "c"));
    int words = out->view.itemsize == 8 && (!strcmp(f, "Q") || !strcmp(f, "L"));
    if (!bytes && !words) {
        u64s_release(out);
        PyErr_Format(PyExc_TypeError, "a hash buffer holds native uint64s (format 'Q', or bytes), not format '%s'",
                     out->view.format ? out->view.format : "B");
        return -1;
    }
    if (out->view.len % 8) {
        u64s_release(out);
        PyErr_SetString(PyExc_ValueError, "a hash buffer holds whole uint64s");
        return -1;
    }
    out->n = (size_t)out->view.len / 8;
    if ((uintptr_t)out->view.buf % 8) { /* bytes at any offset (a slice of a message): copied, aligned */
        out->owned = malloc(out->n ? out->n * 8 : 1);
        if (!out->owned) { u64s_release(out); PyErr_NoMemory(); return -1; }
        memcpy(out->owned, out->view.buf, out->n * 8);
        out->data = out->owned;
    } else {
        out->data = (const uint64_t *)out->view.buf;
    }
    return 0;
}

static void u64s_release(U64s *u) {
    free(u->owned);
    if (u->has_view) PyBuffer_Release(&u->view);
    memset(u, 0, sizeof *u);
}

static int wid_arg(PyObject *o, uint32_t *wid) {
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a worker id is an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > NT_MAX_WORKERS - 1) {
        PyErr_Format(PyExc_ValueError, "worker id %lld outside 0..%d", v, NT_MAX_WORKERS - 1);
        return -1;
    }
    *wid = (uint32_t)v;
    return 0;
}

/* The (wid, hashes) arguments of store, remove and holds; -1 with an exception. */
static int wid_hashes_args(PyObject *args, uint32_t *wid, U64s *hs) {
    PyObject *w, *h;
    if (!PyArg_ParseTuple(args, "OO", &w, &h) || wid_arg(w, wid) < 0) return -1;
    return u64s_get(h, hs);
}

/* store(wid, hashes) -> (added, flags): flags[i] is 1 where the worker held hashes[i] already (another
 * physical copy, or a second KV-cache group: the caller's bookkeeping), else 0. */
static PyObject *Table_store(Table *self, PyObject *args) {
    uint32_t wid;
    U64s hs;
    if (wid_hashes_args(args, &wid, &hs) < 0) return NULL;
    PyObject *flags = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hs.n);
    if (!flags) { u64s_release(&hs); return NULL; }
    if (write_lock(self) < 0) { u64s_release(&hs); Py_DECREF(flags); return NULL; }
    long long added = nt_store(&self->t, wid, hs.data, hs.n, (unsigned char *)PyBytes_AS_STRING(flags));
    int unlocked = write_unlock(self);
    u64s_release(&hs);
    if (added < 0 || unlocked < 0) { Py_DECREF(flags); return unlocked < 0 ? NULL : PyErr_NoMemory(); }
    return Py_BuildValue("(LN)", added, flags);
}

/* remove(wid, hashes) -> how many of them the worker held (and no longer does). */
static PyObject *Table_remove(Table *self, PyObject *args) {
    uint32_t wid;
    U64s hs;
    if (wid_hashes_args(args, &wid, &hs) < 0) return NULL;
    if (write_lock(self) < 0) { u64s_release(&hs); return NULL; }
    long long removed = nt_remove(&self->t, wid, hs.data, hs.n);
    int unlocked = write_unlock(self);
    u64s_release(&hs);
    if (unlocked < 0) return NULL;
    return PyLong_FromLongLong(removed);
}

/* holds(wid, hashes) -> bytes: 1 where the worker holds the hash. */
static PyObject *Table_holds(Table *self, PyObject *args) {
    uint32_t wid;
    U64s hs;
    if (wid_hashes_args(args, &wid, &hs) < 0) return NULL;
    PyObject *flags = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hs.n);
    if (flags) {
        unsigned char *f = (unsigned char *)PyBytes_AS_STRING(flags);
        for (size_t i = 0; i < hs.n; i++) f[i] = nt_holds(&self->t, wid, hs.data[i]);
    }
    u64s_release(&hs);
    return flags;
}

static PyObject *Table_clear(Table *self, PyObject *arg) {
    uint32_t wid;
    if (wid_arg(arg, &wid) < 0) return NULL;
    if (write_lock(self) < 0) return NULL;
    uint64_t held = nt_clear(&self->t, wid);
    if (write_unlock(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(held);
}

/* The mask of every worker holding h (a Python int: bit w for worker w, any number of chunks). */
static PyObject *mask_of(Table *self, uint64_t h) {
    PyObject *mask = PyLong_FromLong(0);
    for (size_t c = self->t.nchunks; c-- > 0 && mask;) {
        uint64_t m = nt_chunk_get(&self->t.chunks[c], h);
        PyObject *shift = PyLong_FromLong(64), *part = PyLong_FromUnsignedLongLong(m), *next = NULL;
        if (shift && part) {
            PyObject *shifted = PyNumber_Lshift(mask, shift);
            if (shifted) { next = PyNumber_Or(shifted, part); Py_DECREF(shifted); }
        }
        Py_XDECREF(shift); Py_XDECREF(part); Py_DECREF(mask);
        mask = next;
    }
    return mask;
}

/* get(h, default=None): the mask of h's workers, or default where nobody holds it (dict-like, for the
 * pure-Python walk where the native query cannot run). */
static PyObject *Table_get(Table *self, PyObject *args) {
    PyObject *key, *dflt = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &key, &dflt)) return NULL;
    uint64_t h = PyLong_AsUnsignedLongLong(key);
    if (h == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); Py_INCREF(dflt); return dflt; }
    int held = 0;
    for (size_t c = 0; c < self->t.nchunks && !held; c++) held = nt_chunk_get(&self->t.chunks[c], h) != 0;
    if (!held) { Py_INCREF(dflt); return dflt; }
    return mask_of(self, h);
}

/* as_dict() -> {hash: mask}: the whole table as the pure-Python index holds it (tests, tools). */
static PyObject *Table_as_dict(Table *self, PyObject *unused) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (size_t c = 0; c < self->t.nchunks; c++) {
        nt_chunk *ch = &self->t.chunks[c];
        nt_iter it = {0};
        uint64_t key, m;
        while (nt_chunk_next(ch, &it, &key, &m)) {
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            PyObject *v = k ? mask_of(self, key) : NULL;
            if (!v || PyDict_SetItem(d, k, v) < 0) { Py_XDECREF(k); Py_XDECREF(v); Py_DECREF(d); return NULL; }
            Py_DECREF(k); Py_DECREF(v);
        }
    }
    return d;
}

/* export_chunks() -> [(chunk, keys, masks)]: each chunk's entries as native uint64 arrays, as snapshots
 * (format 2) store them and load() takes them back: no distinct walk, no probing of other chunks. The
 * copy runs under the read lock with the GIL released, so a caller on another thread leaves the event
 * loop free (whose writers wait on the lock: the indexer holds its ingest back meanwhile). */
static PyObject *Table_export_chunks(Table *self, PyObject *unused) {
    if (in_own_batch(self)) {
        PyErr_SetString(PyExc_RuntimeError, "export_chunks inside this thread's batch(): it holds the write lock");
        return NULL;
    }
    nt_table *t = &self->t;
    int lrc;
    Py_BEGIN_ALLOW_THREADS
    lrc = pthread_rwlock_rdlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (lrc) return (void)lock_failed(lrc, "taking the read lock"), NULL;
    size_t n = t->nchunks;
    PyObject *out = PyList_New(0);
    uint64_t **dst = calloc(n ? n * 2 : 1, sizeof *dst);
    if (!out || !dst) goto fail;
    for (size_t c = 0; c < n; c++) {
        const nt_chunk *ch = &t->chunks[c];
        size_t count = nt_chunk_size(ch);
        if (!count) continue;
        PyObject *keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 8));
        PyObject *masks = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 8));
        PyObject *row = keys && masks ? Py_BuildValue("(nOO)", (Py_ssize_t)c, keys, masks) : NULL;
        if (row) {
            dst[2 * c] = (uint64_t *)PyBytes_AS_STRING(keys);
            dst[2 * c + 1] = (uint64_t *)PyBytes_AS_STRING(masks);
        }
        Py_XDECREF(keys);
        Py_XDECREF(masks);
        if (!row || PyList_Append(out, row) < 0) { Py_XDECREF(row); goto fail; }
        Py_DECREF(row);
    }
    Py_BEGIN_ALLOW_THREADS
    for (size_t c = 0; c < n; c++) {
        if (!dst[2 * c]) continue;
        const nt_chunk *ch = &t->chunks[c];
        size_t j = 0;
        nt_iter it = {0};
        uint64_t key, mask;
        while (nt_chunk_next(ch, &it, &key, &mask)) {
            dst[2 * c][j] = key;
            dst[2 * c + 1][j++] = mask;
        }
    }
    Py_END_ALLOW_THREADS
    pthread_rwlock_unlock(&self->lock);
    free(dst);
    return out;
fail:
    pthread_rwlock_unlock(&self->lock);
    free(dst);
    Py_XDECREF(out);
    return NULL;
}

/* load(chunk, keys, masks): adds a chunk's entries (snapshot loading; OR-ed into what is there). */
static PyObject *Table_load(Table *self, PyObject *args) {
    Py_ssize_t c;
    PyObject *k, *m;
    U64s keys, masks;
    if (!PyArg_ParseTuple(args, "nOO", &c, &k, &m)) return NULL;
    if (c < 0 || c >= NT_MAX_WORKERS / 64) return PyErr_Format(PyExc_ValueError, "chunk %zd out of range", c);
    if (u64s_get(k, &keys) < 0) return NULL;
    if (u64s_get(m, &masks) < 0) { u64s_release(&keys); return NULL; }
    int rc = -2;
    if (keys.n == masks.n) {
        if (write_lock(self) < 0) rc = -3;
        else {
            rc = nt_load(&self->t, (size_t)c, keys.data, masks.data, keys.n);
            if (write_unlock(self) < 0) rc = -3;
        }
    }
    u64s_release(&keys);
    u64s_release(&masks);
    if (rc == -3) return NULL;
    if (rc == -2) return PyErr_Format(PyExc_ValueError, "keys and masks differ in length");
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* worker_counts() -> {wid: blocks held} for workers holding any. */
static PyObject *Table_worker_counts(Table *self, PyObject *unused) {
    PyObject *d = PyDict_New();
    for (size_t w = 0; d && w < self->t.nworkers; w++) {
        if (!self->t.workers[w].count) continue;
        PyObject *k = PyLong_FromSize_t(w), *v = PyLong_FromUnsignedLongLong(self->t.workers[w].count);
        if (!k || !v || PyDict_SetItem(d, k, v) < 0) { Py_XDECREF(k); Py_XDECREF(v); Py_DECREF(d); return NULL; }
        Py_DECREF(k); Py_DECREF(v);
    }
    return d;
}

/* candidates(wids) -> bytes of (wid, epoch) uint64 pairs: the query's view of these workers. */
static PyObject *Table_candidates(Table *self, PyObject *arg) {
    U64s wids;
    if (u64s_get(arg, &wids) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(wids.n * 16));
    if (out) {
        uint64_t *p = (uint64_t *)PyBytes_AS_STRING(out);
        for (size_t i = 0; i < wids.n; i++) {
            uint64_t w = wids.data[i];
            p[2 * i] = w;
            p[2 * i + 1] = w < self->t.nworkers ? self->t.workers[w].epoch : 0;
        }
    }
    u64s_release(&wids);
    return out;
}

/* counts() -> ((block, worker) entries, bytes allocated, hashes held counted once per chunk holding them,
 * hashes looked at by clears so far, distinct scans so far, slots moved by growth so far): a pass
 * over the chunk and worker headers, never a walk of the table (len() is the distinct count, and walks it
 * past 64 workers). */
static PyObject *Table_counts(Table *self, PyObject *unused) {
    return Py_BuildValue("(KKKKKK)", (unsigned long long)self->t.entries, (unsigned long long)nt_bytes(&self->t),
                         (unsigned long long)nt_per_chunk(&self->t), (unsigned long long)self->t.clear_visits,
                         (unsigned long long)self->t.distinct_scans, (unsigned long long)self->t.grown_slots);
}

/* with table: the write lock held until the with-block ends, on this thread (nested: counted). Another
 * thread's batch is waited for; a thread's query or snapshot inside its own batch is refused. */
static PyObject *Table_batch_begin(Table *self, PyObject *unused) {
    if (in_own_batch(self)) {
        self->batch_depth++;
    } else {
        if (write_lock(self) < 0) return NULL;
        self->batch_owner = pthread_self();
        self->batch_depth = 1;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Table_exit(Table *self, PyObject *args) {
    if (!in_own_batch(self))
        return PyErr_Format(PyExc_RuntimeError, "__exit__ by a thread that did not enter this table's batch");
    if (--self->batch_depth == 0) {
        int rc = pthread_rwlock_unlock(&self->lock);
        if (rc) return (void)lock_failed(rc, "releasing the batch's write lock"), NULL;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t Table_len(Table *self) { return (Py_ssize_t)nt_distinct(&self->t); }

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyMethodDef Table_methods[] = {
    {"store", (PyCFunction)Table_store, METH_VARARGS, "store(wid, hashes) -> (added, flags of those held already)"},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS, "remove(wid, hashes) -> how many were held"},
    {"holds", (PyCFunction)Table_holds, METH_VARARGS, "holds(wid, hashes) -> bytes of 0/1"},
    {"clear", (PyCFunction)Table_clear, METH_O, "clear(wid) -> blocks the worker held"},
    {"get", (PyCFunction)Table_get, METH_VARARGS, "get(hash, default=None) -> mask of the workers holding it"},
    {"as_dict", (PyCFunction)Table_as_dict, METH_NOARGS, "{hash: mask} of the whole table"},
    {"load", (PyCFunction)Table_load, METH_VARARGS, "load(chunk, keys, masks): add a chunk's entries"},
    {"export_chunks", (PyCFunction)Table_export_chunks, METH_NOARGS,
     "[(chunk, keys, masks)]: per chunk, native uint64 arrays (read lock held, GIL released while copying)"},
    {"worker_counts", (PyCFunction)Table_worker_counts, METH_NOARGS, "{wid: blocks held}"},
    {"candidates", (PyCFunction)Table_candidates, METH_O, "(wid, epoch) pairs of these workers, as uint64 bytes"},
    {"counts", (PyCFunction)Table_counts, METH_NOARGS,
     "(entries, bytes allocated, hashes per chunk, clear visits, distinct scans), without walking the table"},
    {"__enter__", (PyCFunction)Table_batch_begin, METH_NOARGS, "with table: ... holds the write lock throughout"},
    {"__exit__", (PyCFunction)Table_exit, METH_VARARGS, "releases what __enter__ took"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cache_indexer.indexer._native_index.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A tier's block hash -> worker mask table in native memory.",
    .tp_new = Table_new,
    .tp_methods = Table_methods,
    .tp_as_sequence = &Table_as_sequence,
};

/* -- the query --------------------------------------------------------------------------------------- */

/* A query, from its arguments (with the GIL) through its run (without) to its answer (with): query()
 * runs one on the calling thread, QueryPool on its native threads. It holds what it reads (the tokens'
 * and candidates' buffers, the tables) until it is freed. */
typedef struct {
    np_job link; /* first: the pool's queue */
    PyObject *key; /* the caller's, handed back with the answer (QueryPool) */
    Py_buffer tokbuf, pre;
    int have_tokbuf, have_pre, raw_json, ntiers;
    Table *tables[NT_MAX_TIERS]; /* references */
    U64s pairs[NT_MAX_TIERS];
    uint64_t *lengths[NT_MAX_TIERS];
    nt_query_in in;
    /* the outcome */
    int rc; /* nt_query's, -1 out of memory, -4 a lock call failed (lock_err), -5 the process is exiting */
    int lock_err;
    const char *err; /* a malformed token array: what is wrong, at byte err_at */
    size_t err_at, n_tokens;
    nt_query_out res;
} QueryJob;

static void job_free(QueryJob *j) {
    if (!j) return;
    for (int t = 0; t < NT_MAX_TIERS; t++) {
        u64s_release(&j->pairs[t]);
        Py_XDECREF(j->tables[t]);
        free(j->lengths[t]);
    }
    if (j->have_tokbuf) PyBuffer_Release(&j->tokbuf);
    if (j->have_pre) PyBuffer_Release(&j->pre);
    Py_XDECREF(j->key);
    PyMem_RawFree(j);
}

/* A job from query()'s arguments (see there); NULL with an exception. */
static QueryJob *job_new(PyObject *args) {
    PyObject *tokens_obj, *tiers_obj, *tiers = NULL;
    Py_ssize_t bs;
    int cbor;
    QueryJob *j = PyMem_RawCalloc(1, sizeof *j);
    if (!j) return (QueryJob *)PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "Opny*pO", &tokens_obj, &j->raw_json, &bs, &j->pre, &cbor, &tiers_obj)) goto fail;
    j->have_pre = 1;
    if (!crypto.loaded) { PyErr_SetString(PyExc_NotImplementedError, "no libcrypto sha256"); goto fail; }
    if (bs <= 0) { PyErr_SetString(PyExc_ValueError, "block_size must be positive"); goto fail; }
    if (j->pre.len < 32 || j->pre.len % 32) { PyErr_SetString(PyExc_ValueError, "pre: whole 32-byte digests"); goto fail; }
    tiers = PySequence_Fast(tiers_obj, "tiers must be a sequence");
    if (!tiers) goto fail;
    if (PySequence_Fast_GET_SIZE(tiers) > NT_MAX_TIERS) { PyErr_SetString(PyExc_ValueError, "too many tiers"); goto fail; }
    for (Py_ssize_t t = 0; t < PySequence_Fast_GET_SIZE(tiers); t++) {
        PyObject *row = PySequence_Fast_GET_ITEM(tiers, t), *table, *wids;
        if (!PyArg_ParseTuple(row, "OO", &table, &wids)) goto fail;
        if (table != Py_None && !PyObject_TypeCheck(table, &TableType)) {
            PyErr_SetString(PyExc_TypeError, "tiers: (Table or None, wid/epoch pairs)");
            goto fail;
        }
        if (table != Py_None) {
            Py_INCREF(table);
            j->tables[t] = (Table *)table;
        }
        if (u64s_get(wids, &j->pairs[t]) < 0) goto fail;
        j->ntiers = (int)t + 1;
        if (j->pairs[t].n % 2) { PyErr_SetString(PyExc_ValueError, "tiers: wid/epoch pairs"); goto fail; }
        j->lengths[t] = calloc(j->pairs[t].n ? j->pairs[t].n / 2 : 1, 8);
        if (!j->lengths[t]) { PyErr_NoMemory(); goto fail; }
    }
    Py_CLEAR(tiers);
    if (PyObject_GetBuffer(tokens_obj, &j->tokbuf, PyBUF_SIMPLE) < 0) goto fail;
    j->have_tokbuf = 1;
    if (!j->raw_json && j->tokbuf.len % 8) { PyErr_SetString(PyExc_ValueError, "tokens: whole uint64s"); goto fail; }
    nt_query_in in = {.bs = (size_t)bs, .cbor = cbor, .pre = j->pre.buf, .npre = (size_t)j->pre.len / 32,
                      .ntiers = j->ntiers, .crypto = &crypto};
    for (int t = 0; t < j->ntiers; t++) {
        in.tables[t] = j->tables[t] ? &j->tables[t]->t : NULL;
        in.pairs[t] = j->pairs[t].data;
        in.npairs[t] = j->pairs[t].n / 2;
    }
    j->in = in;
    return j;
fail:
    Py_XDECREF(tiers);
    job_free(j);
    return NULL;
}

/* The walk (and the token array's parse): any thread, no Python object touched, so without the GIL.
 * The tables' read locks are taken here; a thread holding one never waits for the GIL. */
static void job_run(np_job *link) {
    QueryJob *j = (QueryJob *)link;
    uint64_t *parsed = NULL;
    if (!job_enter()) { /* the process is exiting: libcrypto's clean-up may come next */
        j->rc = -5;
        return;
    }
    if (j->raw_json) {
        j->err = bh_parse_u64_array(j->tokbuf.buf, (size_t)j->tokbuf.len, &parsed, &j->n_tokens, &j->err_at);
        if (!j->err && !parsed && j->n_tokens) j->rc = -1;
        j->in.tokens = parsed;
    } else {
        j->in.tokens = j->tokbuf.buf;
        j->n_tokens = (size_t)j->tokbuf.len / 8;
    }
    j->in.n_tokens = j->n_tokens;
    j->in.memo = query_memo();
    if (j->rc == 0 && !j->err) {
        int locked = 0;
        for (; locked < j->ntiers; locked++) {
            if (!j->tables[locked]) continue;
            int rc = pthread_rwlock_rdlock(&j->tables[locked]->lock);
            if (rc) { j->rc = -4; j->lock_err = rc; break; }
        }
        if (j->rc == 0) j->rc = nt_query(&j->in, j->lengths, &j->res);
        while (locked-- > 0) if (j->tables[locked]) pthread_rwlock_unlock(&j->tables[locked]->lock);
    }
    free(parsed);
    j->in.tokens = NULL;
    job_leave();
}

/* The job's answer, (n_tokens, hashed, [lengths per tier]); NULL with its exception. */
static PyObject *job_result(const QueryJob *j) {
    if (j->err) return PyErr_Format(PyExc_ValueError, "%s (at byte %zd of the array)", j->err, (Py_ssize_t)j->err_at);
    if (j->rc == -1) return PyErr_NoMemory();
    if (j->rc == -2) {
        PyErr_SetString(PyExc_NotImplementedError, "a pickle token over 2**31-1 or a huge block");
        return NULL;
    }
    if (j->rc == -3) {
        PyErr_SetString(PyExc_RuntimeError, "libcrypto sha256 failed");
        return NULL;
    }
    if (j->rc == -4) return PyErr_Format(PyExc_RuntimeError, "the query's read lock failed: %s", strerror(j->lock_err));
    if (j->rc == -5) return PyErr_Format(PyExc_RuntimeError, "the process is exiting: no query runs now");
    PyObject *per_tier = PyList_New(j->ntiers);
    for (int t = 0; per_tier && t < j->ntiers; t++) {
        size_t n = j->pairs[t].n / 2;
        PyObject *l = PyList_New((Py_ssize_t)n);
        for (size_t i = 0; l && i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(j->lengths[t][i]);
            if (!v) Py_CLEAR(l);
            else PyList_SET_ITEM(l, (Py_ssize_t)i, v);
        }
        if (!l) Py_CLEAR(per_tier);
        else PyList_SET_ITEM(per_tier, t, l);
    }
    return per_tier ? Py_BuildValue("(nnN)", (Py_ssize_t)j->n_tokens, (Py_ssize_t)j->res.hashed, per_tier) : NULL;
}

/* query(tokens, raw_json, block_size, pre, cbor, tiers) -> (n_tokens, hashed, [lengths per tier])
 *   tokens: the request's token ids, as JSON array text (raw_json) or native uint64s;
 *   pre: the digests (32 bytes each) of the first blocks, computed by the caller (a salted block 0),
 *        the chain going on from the last of them (NONE_HASH: the first 32 bytes when none is given);
 *   tiers: a sequence of (Table or None, uint64 buffer of wid, epoch pairs): the candidates' workers.
 * lengths[t][i]: blocks from block 0 worker i of tier t holds consecutively, as the pure-Python walk
 * counts them (hashed: the blocks whose digest was computed or given). Everything after the argument
 * checks runs without the GIL. ValueError: the token array is malformed (the message says where);
 * NotImplementedError: what only the Python path encodes (a pickle token over 2**31-1, no libcrypto). */
static PyObject *query(PyObject *self, PyObject *args) {
    QueryJob *j = job_new(args);
    if (!j) return NULL;
    for (int t = 0; t < j->ntiers; t++) {
        if (j->tables[t] && in_own_batch(j->tables[t])) { /* its read lock would deadlock (EDEADLK) */
            job_free(j);
            return PyErr_Format(PyExc_RuntimeError, "query() inside this thread's batch of a table it reads");
        }
    }
    Py_BEGIN_ALLOW_THREADS
    job_run(&j->link);
    Py_END_ALLOW_THREADS
    PyObject *result = job_result(j);
    job_free(j);
    return result;
}

/* -- the query threads ------------------------------------------------------------------------------- */

static PyObject *QueryPool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "n", &threads)) return NULL;
    if (threads < 1 || threads > 1024) return PyErr_Format(PyExc_ValueError, "threads must be 1..1024");
    QueryPool *self = (QueryPool *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    if (np_start(&self->pool, (size_t)threads, job_run) < 0) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_lock(&exit_mu);
    self->open = !exiting;
    if (self->open) {
        self->next_open = open_pools;
        open_pools = self;
    }
    pthread_mutex_unlock(&exit_mu);
    if (!self->open) {
        Py_BEGIN_ALLOW_THREADS
        np_stop(&self->pool);
        Py_END_ALLOW_THREADS
        Py_DECREF(self);
        return PyErr_Format(PyExc_RuntimeError, "the process is exiting");
    }
    return (PyObject *)self;
}

static void free_jobs(np_job *j) {
    for (np_job *next; j; j = next) {
        next = j->next;
        job_free((QueryJob *)j);
    }
}

/* Takes the pool off the open list and stops its threads (without the GIL: a running job never needs
 * it); the jobs not collected, for the caller. NULL where the exit handler stopped it already. */
static np_job *pool_stop(QueryPool *self) {
    int mine = 0;
    pthread_mutex_lock(&exit_mu);
    if (self->open) {
        self->open = 0;
        mine = 1;
        for (QueryPool **p = &open_pools; *p; p = &(*p)->next_open) {
            if (*p == self) { *p = self->next_open; break; }
        }
    }
    pthread_mutex_unlock(&exit_mu);
    return mine ? np_stop(&self->pool) : NULL;
}

static PyObject *QueryPool_close(QueryPool *self, PyObject *unused) {
    np_job *left;
    Py_BEGIN_ALLOW_THREADS
    left = pool_stop(self); /* a running job finishes first: it never needs the GIL */
    Py_END_ALLOW_THREADS
    free_jobs(left);
    Py_RETURN_NONE;
}

static void QueryPool_dealloc(QueryPool *self) {
    PyObject *r = QueryPool_close(self, NULL);
    Py_XDECREF(r);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* submit(key, tokens, raw_json, block_size, pre, cbor, tiers): query()'s arguments after the key; the
 * answer comes back from done(). */
static PyObject *QueryPool_submit(QueryPool *self, PyObject *args) {
    if (!self->open) return PyErr_Format(PyExc_RuntimeError, "the query threads are closed");
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) return PyErr_Format(PyExc_TypeError, "submit(key, tokens, raw_json, block_size, pre, cbor, tiers)");
    PyObject *rest = PyTuple_GetSlice(args, 1, n);
    if (!rest) return NULL;
    QueryJob *j = job_new(rest);
    Py_DECREF(rest);
    if (!j) return NULL;
    j->key = PyTuple_GET_ITEM(args, 0);
    Py_INCREF(j->key);
    np_submit(&self->pool, &j->link);
    Py_RETURN_NONE;
}

/* done() -> [(key, answer, None) or (key, None, exception)]: the jobs finished since the last call. */
static PyObject *QueryPool_done(QueryPool *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (!out || !self->open) return out;
    np_job *d = np_take_done(&self->pool);
    for (np_job *next; d; d = next) {
        next = d->next;
        QueryJob *j = (QueryJob *)d;
        PyObject *item = NULL, *answer = job_result(j);
        if (answer) {
            item = PyTuple_Pack(3, j->key, answer, Py_None);
            Py_DECREF(answer);
        } else {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb) PyException_SetTraceback(value, tb);
            item = value ? PyTuple_Pack(3, j->key, Py_None, value) : NULL;
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        job_free(j);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            free_jobs(next); /* their callers' futures are failed by the caller's own error path */
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *QueryPool_fileno(QueryPool *self, PyObject *unused) {
    if (!self->open) return PyErr_Format(PyExc_ValueError, "the query threads are closed");
    return PyLong_FromLong(self->pool.wake[0]);
}

static PyMethodDef QueryPool_methods[] = {
    {"submit", (PyCFunction)QueryPool_submit, METH_VARARGS, "Queue a query (key, then query()'s arguments)."},
    {"done", (PyCFunction)QueryPool_done, METH_NOARGS, "[(key, answer, exception)] of the queries finished."},
    {"fileno", (PyCFunction)QueryPool_fileno, METH_NOARGS, "A descriptor readable when queries have finished."},
    {"close", (PyCFunction)QueryPool_close, METH_NOARGS, "Stop the threads; queries not collected are dropped."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QueryPoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cache_indexer.indexer._native_index.QueryPool",
    .tp_basicsize = sizeof(QueryPool),
    .tp_dealloc = (destructor)QueryPool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Native threads running queries without the GIL; done() collects them (fileno(): when).",
    .tp_new = QueryPool_new,
    .tp_methods = QueryPool_methods,
};

static PyObject *sha256_available(PyObject *self, PyObject *unused) { return PyBool_FromLong(crypto.loaded); }

/* _fail_allocs_after(n): the tables' n+1-th allocation from now on fails, as out of memory would (tests;
 * -1: none fails). */
static PyObject *fail_allocs_after(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    nt_fail_after = n < 0 ? -1 : n;
    Py_RETURN_NONE;
}

/* set_memo_bytes(n): the bound of the memos made from now on; the calling thread's own memo starts again. */
static PyObject *set_memo_bytes(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "memo bytes must be >= 0");
    __atomic_store_n(&memo_max_bytes, (size_t)n, __ATOMIC_RELAXED);
    memo_free(pthread_getspecific(memo_key));
    pthread_setspecific(memo_key, NULL);
    Py_RETURN_NONE;
}

/* memo_stats() -> (hits, misses, bytes kept) of the calling thread's digest memo. */
static PyObject *memo_stats(PyObject *self, PyObject *unused) {
    bh_memo *m = pthread_getspecific(memo_key);
    return Py_BuildValue("(KKK)", m ? (unsigned long long)m->hits : 0ULL, m ? (unsigned long long)m->misses : 0ULL,
                         m ? (unsigned long long)m->bytes : 0ULL);
}

static PyMethodDef methods[] = {
    {"query", query, METH_VARARGS, "The hit-rate walk of a request over the tiers, hashing included, without the GIL."},
    {"sha256_available", sha256_available, METH_NOARGS, "Whether the query can hash (libcrypto's sha256 loaded)."},
    {"memo_stats", memo_stats, METH_NOARGS, "(hits, misses, bytes kept) of this thread's digest memo."},
    {"set_memo_bytes", set_memo_bytes, METH_O, "Bound of the digest memos made from now on (0: none)."},
    {"_fail_allocs_after", fail_allocs_after, METH_O, "Tests: the tables' allocations fail after n more (-1: never)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native_index(void) {
    bh_load_libcrypto(&crypto); /* libcrypto initialised (a digest made): its exit handler is in before ours */
    if (pthread_key_create(&memo_key, memo_free) != 0) return PyErr_NoMemory();
    static int exit_registered;
    if (!exit_registered && atexit(exit_handler) != 0) return PyErr_NoMemory();
    exit_registered = 1;
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&QueryPoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) { Py_DECREF(&TableType); Py_DECREF(m); return NULL; }
    Py_INCREF(&QueryPoolType);
    if (PyModule_AddObject(m, "QueryPool", (PyObject *)&QueryPoolType) < 0) {
        Py_DECREF(&QueryPoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
