/*
 * Optional accelerator for indexer/block_hash.py: serialises vLLM's block tuple
 * (parent_digest, tuple(tokens), None) exactly as cbor2 (canonical) or pickle protocol 5 does and
 * feeds it to the digest function, for a run of consecutive blocks in one call.
 *
 * The digest itself is Python's (hashlib.sha256 or xxhash.xxh3_128_digest), so this module only
 * removes the per-token cost of the Python-level encoders. block_hash.py falls back to the pure
 * Python path when this module is not built; tests check both produce identical bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    unsigned char *buf;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    unsigned char *nb = PyMem_Realloc(b->buf, cap);
    if (!nb) { PyErr_NoMemory(); return -1; }
    b->buf = nb; b->cap = cap;
    return 0;
}

static inline void put(Buf *b, const void *src, Py_ssize_t n) { memcpy(b->buf + b->len, src, n); b->len += n; }
static inline void put1(Buf *b, unsigned char c) { b->buf[b->len++] = c; }

/* Value of an int object without the overflow-checking call when it is small (one 30-bit digit). */
static inline int small_long(PyObject *o, long long *out) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!_PyLong_IsCompact((PyLongObject *)o)) return 0;
    *out = (long long)_PyLong_CompactValue((PyLongObject *)o);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) { *out = 0; return 1; }
    if (size == 1) { *out = (long long)((PyLongObject *)o)->ob_digit[0]; return 1; }
    if (size == -1) { *out = -(long long)((PyLongObject *)o)->ob_digit[0]; return 1; }
    return 0;
#endif
}

/* CBOR head: major type (0..7 << 5) with argument v, minimal length (canonical). */
static void cbor_head(Buf *b, unsigned char major, uint64_t v) {
    if (v < 24) { put1(b, major | (unsigned char)v); }
    else if (v < 0x100) { put1(b, major | 24); put1(b, (unsigned char)v); }
    else if (v < 0x10000) { put1(b, major | 25); put1(b, (unsigned char)(v >> 8)); put1(b, (unsigned char)v); }
    else if (v < 0x100000000ULL) {
        put1(b, major | 26);
        for (int s = 24; s >= 0; s -= 8) put1(b, (unsigned char)(v >> s));
    } else {
        put1(b, major | 27);
        for (int s = 56; s >= 0; s -= 8) put1(b, (unsigned char)(v >> s));
    }
}

/* One token as CBOR; -1 with an exception for values outside 64-bit (left to the Python path). */
static int cbor_int(Buf *b, PyObject *o) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "token id out of range");
        return -1;
    }
    if (v >= 0) cbor_head(b, 0x00, (uint64_t)v);
    else cbor_head(b, 0x20, (uint64_t)(-(v + 1)));
    return 0;
}

/* One token as pickle (protocol >= 2 integer opcodes, as _pickle.c save_long). */
static int pickle_int(Buf *b, PyObject *o) {
    int overflow = 0;
    long long v;
    if (!small_long(o, &v)) v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "token id out of range");
        return -1;
    }
    if (v >= 0 && v < 0x100) { put1(b, 'K'); put1(b, (unsigned char)v); }
    else if (v >= 0 && v < 0x10000) { put1(b, 'M'); put1(b, (unsigned char)v); put1(b, (unsigned char)(v >> 8)); }
    else if (v >= -2147483648LL && v <= 2147483647LL) {
        uint32_t u = (uint32_t)(int32_t)v;
        put1(b, 'J');
        for (int s = 0; s < 32; s += 8) put1(b, (unsigned char)(u >> s));
    } else {
        PyErr_SetString(PyExc_OverflowError, "token id needs LONG1; left to the Python path");
        return -1;
    }
    return 0;
}

/* chain(parent, tokens, block_size, first_block, n_blocks, cbor, digest_fn, sha256_mode)
 *   -> list of digests for blocks first_block .. first_block+n_blocks-1 (no extra keys).
 * sha256_mode: digest_fn is hashlib.sha256 (call, then .digest()); otherwise digest_fn(data) -> bytes. */
static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *parent, *tokens, *digest_fn;
    Py_ssize_t bs, first, n;
    int cbor, sha_mode;
    if (!PyArg_ParseTuple(args, "SOnnnpOp", &parent, &tokens, &bs, &first, &n, &cbor, &digest_fn, &sha_mode))
        return NULL;
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq);
    if (bs <= 0 || first < 0 || n < 0 || (first + n) * bs > total) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "block range outside the token list");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (!out) { Py_DECREF(seq); return NULL; }
    Buf b = {0};
    Py_INCREF(parent);
    PyObject *digest_name = PyUnicode_InternFromString("digest");
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t plen = PyBytes_GET_SIZE(parent);
        if (buf_reserve(&b, 64 + plen + 10 * bs) < 0) goto fail;
        b.len = 0;
        PyObject **tok = items + (first + k) * bs;
        if (cbor) {
            put1(&b, 0x83);
            cbor_head(&b, 0x40, (uint64_t)plen);
            put(&b, PyBytes_AS_STRING(parent), plen);
            cbor_head(&b, 0x80, (uint64_t)bs);
            unsigned char *w = b.buf + b.len;
            for (Py_ssize_t i = 0; i < bs; i++) {
                int overflow = 0;
                long long v;
                if (!small_long(tok[i], &v)) v = PyLong_AsLongLongAndOverflow(tok[i], &overflow);
                if (v >= 0 && v < 24 && !overflow) { *w++ = (unsigned char)v; continue; }
                if (v >= 24 && v < 0x10000) {
                    if (v < 0x100) { *w++ = 24; *w++ = (unsigned char)v; }
                    else { *w++ = 25; *w++ = (unsigned char)(v >> 8); *w++ = (unsigned char)v; }
                    continue;
                }
                if (v >= 0x10000 && v < 0x100000000LL) {
                    *w++ = 26; *w++ = (unsigned char)(v >> 24); *w++ = (unsigned char)(v >> 16);
                    *w++ = (unsigned char)(v >> 8); *w++ = (unsigned char)v;
                    continue;
                }
                if (overflow || (v == -1 && PyErr_Occurred())) {
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "token id out of range");
                    goto fail;
                }
                b.len = w - b.buf;
                if (cbor_int(&b, tok[i]) < 0) goto fail;
                w = b.buf + b.len;
            }
            b.len = w - b.buf;
            put1(&b, 0xf6);
        } else {
            /* \x80\x05 \x95 <u64 frame len> | C <len> parent \x94 | tuple \x94 | N \x87 \x94 . */
            put1(&b, 0x80); put1(&b, 0x05); put1(&b, 0x95);
            Py_ssize_t frame_at = b.len;
            b.len += 8;
            if (plen < 256) { put1(&b, 'C'); put1(&b, (unsigned char)plen); }
            else { put1(&b, 'B'); for (int s = 0; s < 32; s += 8) put1(&b, (unsigned char)(plen >> s)); }
            put(&b, PyBytes_AS_STRING(parent), plen);
            put1(&b, 0x94);
            if (bs > 3) put1(&b, '(');
            for (Py_ssize_t i = 0; i < bs; i++)
                if (pickle_int(&b, tok[i]) < 0) goto fail;
            if (bs > 3) put1(&b, 't');
            else put1(&b, (unsigned char)(0x84 + bs)); /* TUPLE1..3 = 0x85..0x87 */
            put1(&b, 0x94);
            put1(&b, 'N'); put1(&b, 0x87); put1(&b, 0x94); put1(&b, '.');
            uint64_t flen = (uint64_t)(b.len - frame_at - 8); /* everything after the length, STOP included */
            for (int s = 0; s < 8; s++) b.buf[frame_at + s] = (unsigned char)(flen >> (8 * s));
        }
        PyObject *data = PyBytes_FromStringAndSize((const char *)b.buf, b.len);
        if (!data) goto fail;
        PyObject *digest;
        if (sha_mode) {
            PyObject *h = PyObject_CallOneArg(digest_fn, data);
            Py_DECREF(data);
            if (!h) goto fail;
            digest = PyObject_CallMethodNoArgs(h, digest_name);
            Py_DECREF(h);
        } else {
            digest = PyObject_CallOneArg(digest_fn, data);
            Py_DECREF(data);
        }
        if (!digest) goto fail;
        if (!PyBytes_Check(digest)) {
            Py_DECREF(digest);
            PyErr_SetString(PyExc_TypeError, "digest function must return bytes");
            goto fail;
        }
        Py_DECREF(parent);
        parent = digest;
        Py_INCREF(digest);
        PyList_SET_ITEM(out, k, digest);
    }
    Py_DECREF(parent);
    Py_DECREF(digest_name);
    PyMem_Free(b.buf);
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(parent);
    Py_XDECREF(digest_name);
    PyMem_Free(b.buf);
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Digests of consecutive blocks without extra keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
