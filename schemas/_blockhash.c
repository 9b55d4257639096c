/*
 * Optional accelerator for schemas/block_hash.py: serialises vLLM's block tuple
 * (parent_digest, tuple(tokens), None) exactly as cbor2 (canonical) or pickle protocol 5 does and
 * feeds it to the digest function, for a run of consecutive blocks in one call.
 *
 * The digest is Python's (hashlib.sha256 or xxhash.xxh3_128_digest), except that on Linux sha256 is
 * computed with the libcrypto that hashlib itself uses, resolved with dlopen (no OpenSSL headers
 * needed to build) and checked against a known digest at import: per block that saves a bytes
 * object, a hashlib object, a method call and OpenSSL's per-context set-up, which at block size 128
 * cost more than the hash. block_hash.py falls back to the pure Python path when this module is not
 * built; tests check every path produces identical bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_blockhash_core.h"

/* -- sha256 straight from libcrypto (the shared core), one context reused: chain() holds the GIL -- */
static bh_libcrypto ossl;
static void *ossl_ctx;
static int ossl_enabled;

static int native_sha256(const unsigned char *data, size_t n, unsigned char out[32]) {
    return bh_sha256(&ossl, ossl_ctx, data, n, out);
}

static void load_libcrypto(void) {
    bh_load_libcrypto(&ossl);
    if (ossl.loaded) ossl_ctx = ossl.ctx_new();
    ossl_enabled = ossl_ctx != NULL;
}

typedef struct {
    unsigned char *buf;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (extra < 0 || extra > PY_SSIZE_T_MAX - b->len) { PyErr_NoMemory(); return -1; }
    Py_ssize_t need = b->len + extra;
    if (need <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap = cap > PY_SSIZE_T_MAX / 2 ? need : cap * 2;
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

static void cbor_head(Buf *b, unsigned char major, uint64_t v) {
    b->len = bh_cbor_head(b->buf + b->len, major, v) - b->buf;
}

#define cbor_uint bh_cbor_uint
#define pickle_uint31 bh_pickle_uint31

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
    if (v >= 0 && v <= 2147483647LL) b->len = pickle_uint31(b->buf + b->len, (uint64_t)v) - b->buf;
    else if (v >= -2147483648LL && v < 0) {
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
    /* tokens: a list/tuple of ints, or a buffer of native uint64 (array('Q'), see parse_token_array) */
    Py_buffer view;
    const uint64_t *u64 = NULL;
    PyObject *seq = NULL;
    PyObject **items = NULL;
    Py_ssize_t total;
    if (PyObject_CheckBuffer(tokens) && !PyBytes_Check(tokens)) {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (view.itemsize != 8 || !view.format || (strcmp(view.format, "Q") != 0 && strcmp(view.format, "L") != 0)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "token buffer must hold unsigned 64-bit integers");
            return NULL;
        }
        u64 = (const uint64_t *)view.buf;
        total = view.len / 8;
    } else {
        total = PySequence_Size(tokens);
        if (total < 0) return NULL;
    }
    /* (first + n) * bs <= total, without overflow (bs = 2**61 once wrapped to 0 and looped for ever) */
    if (bs <= 0 || first < 0 || n < 0 || first > PY_SSIZE_T_MAX - n || first + n > total / bs) {
        if (u64) PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "block range outside the token list");
        return NULL;
    }
    if (!u64) {
        /* A private copy of the blocks' tokens (a slice: a new list or tuple that no Python code holds):
         * the caller's list's item array would be borrowed while Python runs (the digest function, an
         * int subclass's __index__) and may be resized meanwhile (a use-after-free). */
        PyObject *part = PySequence_GetSlice(tokens, first * bs, (first + n) * bs);
        if (!part) return NULL;
        seq = PySequence_Fast(part, "tokens must be a sequence");
        Py_DECREF(part);
        if (!seq) return NULL;
        if (PySequence_Fast_GET_SIZE(seq) != n * bs) { /* a sequence whose slice is not what it says */
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "block range outside the token list");
            return NULL;
        }
        items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n * bs; i++) {
            if (!PyLong_CheckExact(items[i])) { /* bool or another int subclass: encoded otherwise by cbor2 */
                Py_DECREF(seq);
                PyErr_SetString(PyExc_TypeError, "token ids must be plain ints; left to the Python path");
                return NULL;
            }
        }
    }
    if (n > 0 && bs > (PY_SSIZE_T_MAX - 64 - PyBytes_GET_SIZE(parent)) / 10) {
        if (seq) Py_DECREF(seq); else PyBuffer_Release(&view);
        PyErr_SetString(PyExc_OverflowError, "block size too large");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (!out) { if (seq) Py_DECREF(seq); else PyBuffer_Release(&view); return NULL; }
    Buf b = {0};
    Py_INCREF(parent);
    PyObject *digest_name = PyUnicode_InternFromString("digest");
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t plen = PyBytes_GET_SIZE(parent);
        if (buf_reserve(&b, 64 + plen + 10 * bs) < 0) goto fail;
        b.len = 0;
        PyObject **tok = items ? items + k * bs : NULL; /* the tuple holds blocks first .. first+n-1 */
        const uint64_t *utok = u64 ? u64 + (first + k) * bs : NULL;
        if (utok) {
            size_t len = bh_encode_block(b.buf, (const unsigned char *)PyBytes_AS_STRING(parent), (size_t)plen,
                                         utok, (size_t)bs, cbor);
            if (!len) {
                PyErr_SetString(PyExc_OverflowError, "token id needs LONG1; left to the Python path");
                goto fail;
            }
            b.len = (Py_ssize_t)len;
        } else if (cbor) {
            put1(&b, 0x83);
            cbor_head(&b, 0x40, (uint64_t)plen);
            put(&b, PyBytes_AS_STRING(parent), plen);
            cbor_head(&b, 0x80, (uint64_t)bs);
            unsigned char *w = b.buf + b.len;
            for (Py_ssize_t i = 0; i < bs; i++) {
                int overflow = 0;
                long long v;
                if (!small_long(tok[i], &v)) v = PyLong_AsLongLongAndOverflow(tok[i], &overflow);
                if (v >= 0 && !overflow) { w = cbor_uint(w, (uint64_t)v); continue; }
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
            for (Py_ssize_t i = 0; i < bs; i++) {
                if (pickle_int(&b, tok[i]) < 0) goto fail;
            }
            if (bs > 3) put1(&b, 't');
            else put1(&b, (unsigned char)(0x84 + bs)); /* TUPLE1..3 = 0x85..0x87 */
            put1(&b, 0x94);
            put1(&b, 'N'); put1(&b, 0x87); put1(&b, 0x94); put1(&b, '.');
            uint64_t flen = (uint64_t)(b.len - frame_at - 8); /* everything after the length, STOP included */
            for (int s = 0; s < 8; s++) b.buf[frame_at + s] = (unsigned char)(flen >> (8 * s));
        }
        PyObject *digest;
        if (sha_mode && ossl_enabled) {
            unsigned char out[32];
            if (!native_sha256(b.buf, (size_t)b.len, out)) {
                PyErr_SetString(PyExc_RuntimeError, "libcrypto sha256 failed");
                goto fail;
            }
            digest = PyBytes_FromStringAndSize((const char *)out, 32);
            if (!digest) goto fail;
            goto have_digest;
        }
        PyObject *data = PyBytes_FromStringAndSize((const char *)b.buf, b.len);
        if (!data) goto fail;
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
    have_digest:
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
    if (seq) Py_DECREF(seq); else PyBuffer_Release(&view);
    return out;
fail:
    Py_DECREF(parent);
    Py_XDECREF(digest_name);
    PyMem_Free(b.buf);
    if (seq) Py_DECREF(seq); else PyBuffer_Release(&view);
    Py_DECREF(out);
    return NULL;
}

/* parse_token_array(json_array_bytes) -> bytes of native uint64: a JSON array of non-negative
 * integers (no sign, fraction, exponent, or other types), parsed without creating Python ints. */
static PyObject *parse_token_array(PyObject *self, PyObject *arg) {
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t *tokens;
    size_t n, at;
    const char *err = bh_parse_u64_array(in.buf, (size_t)in.len, &tokens, &n, &at);
    PyBuffer_Release(&in);
    if (err) return PyErr_Format(PyExc_ValueError, "%s (at byte %zd of the array)", err, (Py_ssize_t)at);
    if (!tokens && n) return PyErr_NoMemory();
    PyObject *res = PyBytes_FromStringAndSize((const char *)tokens, (Py_ssize_t)(n * 8));
    free(tokens);
    return res;
}

/* find_token_ids(body, top_level=False) -> (start, stop) or None: the span of body.token_ids in a hit-rate
 * request (top_level: of token_ids in a /query request), found by one structural scan (memchr over the
 * array) and not parsed: the native query parses it off the GIL. None where the request is not in the
 * plain shape. */
static PyObject *find_token_ids(PyObject *self, PyObject *args) {
    Py_buffer in;
    int top = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &in, &top)) return NULL;
    size_t start = 0, stop = 0;
    int found = bh_find_token_ids(in.buf, (size_t)in.len, top ? BH_TOKENS_AT_TOP : BH_TOKENS_IN_BODY, &start,
                                  &stop) == 0;
    PyBuffer_Release(&in);
    if (!found) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", (Py_ssize_t)start, (Py_ssize_t)stop);
}

/* native_sha256([enable]) -> whether sha256 runs in libcrypto directly; enable=False turns it off
 * (for comparisons), True back on where it loaded. */
static PyObject *native_sha256_switch(PyObject *self, PyObject *args) {
    int enable = -1;
    if (!PyArg_ParseTuple(args, "|p", &enable)) return NULL;
    if (enable == 0) ossl_enabled = 0;
    else if (enable == 1 && ossl_ctx) {
        unsigned char out[32];
        ossl_enabled = native_sha256((const unsigned char *)"", 0, out);
    }
    return PyBool_FromLong(ossl_enabled);
}

static PyMethodDef methods[] = {
    {"native_sha256", native_sha256_switch, METH_VARARGS, "Whether sha256 runs in libcrypto directly; can switch it."},
    {"chain", chain, METH_VARARGS, "Digests of consecutive blocks without extra keys."},
    {"find_token_ids", find_token_ids, METH_VARARGS,
     "(start, stop) of body.token_ids in a plain hit-rate request (top_level: of a /query's token_ids), or None."},
    {"parse_token_array", parse_token_array, METH_O, "JSON array of non-negative ints -> native uint64 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) {
    load_libcrypto();
    return PyModule_Create(&module);
}
