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
#if defined(__linux__)
#include <dlfcn.h>
#endif

/* -- sha256 straight from libcrypto -------------------------------------------------------------- */
typedef int (*digest_init_fn)(void *ctx, const void *md, void *engine);
typedef int (*digest_update_fn)(void *ctx, const void *data, size_t n);
typedef int (*digest_final_fn)(void *ctx, unsigned char *out, unsigned int *n);
static struct {
    const void *md;
    void *ctx; /* one context, reused: chain() holds the GIL throughout */
    digest_init_fn init;
    digest_update_fn update;
    digest_final_fn final;
    int enabled;
} ossl;

static int native_sha256(const unsigned char *data, size_t n, unsigned char out[32]) {
    unsigned int len = 0;
    return ossl.init(ossl.ctx, ossl.md, NULL) == 1 && ossl.update(ossl.ctx, data, n) == 1 &&
           ossl.final(ossl.ctx, out, &len) == 1 && len == 32;
}

static void load_libcrypto(void) {
#if defined(__linux__)
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so", NULL};
    void *h = NULL;
    for (int i = 0; names[i] && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    typedef void *(*fetch_fn)(void *, const char *, const char *);
    typedef const void *(*legacy_md_fn)(void);
    typedef void *(*ctx_new_fn)(void);
    fetch_fn fetch = (fetch_fn)dlsym(h, "EVP_MD_fetch");     /* OpenSSL 3: fetched once, not per init */
    legacy_md_fn sha256 = (legacy_md_fn)dlsym(h, "EVP_sha256"); /* OpenSSL 1.1 */
    ctx_new_fn ctx_new = (ctx_new_fn)dlsym(h, "EVP_MD_CTX_new");
    ossl.init = (digest_init_fn)dlsym(h, "EVP_DigestInit_ex");
    ossl.update = (digest_update_fn)dlsym(h, "EVP_DigestUpdate");
    ossl.final = (digest_final_fn)dlsym(h, "EVP_DigestFinal_ex");
    ossl.md = fetch ? fetch(NULL, "SHA256", NULL) : NULL;
    if (!ossl.md && sha256) ossl.md = sha256();
    if (!ossl.md || !ctx_new || !ossl.init || !ossl.update || !ossl.final) return;
    ossl.ctx = ctx_new();
    if (!ossl.ctx) return;
    static const unsigned char abc[32] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
        0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    unsigned char out[32];
    ossl.enabled = native_sha256((const unsigned char *)"abc", 3, out) && memcmp(out, abc, 32) == 0;
#endif
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

/* Branch-free encoders for one non-negative token: token ids are random enough that the length
 * branches of the plain encoders mispredict about every other token, which cost more than the hash.
 * Each writes up to 9 bytes past w (the callers reserve 10 per token) and returns the new end. */
static inline uint64_t to_big_endian(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return v;
#else
    return __builtin_bswap64(v);
#endif
}

static inline uint64_t to_little_endian(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(v);
#else
    return v;
#endif
}

static inline unsigned char *cbor_uint(unsigned char *w, uint64_t v) {
    static const unsigned char nbytes[5] = {0, 1, 2, 4, 8};
    unsigned c = (v >= 24) + (v >= 0x100) + (v >= 0x10000) + (v >= 0x100000000ULL);
    unsigned n = nbytes[c];
    w[0] = c ? (unsigned char)(23 + c) : (unsigned char)v; /* 24..27 = 1, 2, 4, 8 bytes follow */
    uint64_t be = to_big_endian(n ? v << (64 - 8 * n) : 0);
    memcpy(w + 1, &be, 8);
    return w + 1 + n;
}

/* pickle BININT1 'K' / BININT2 'M' / BININT 'J' for 0 <= v <= 2**31-1 (the caller checks the bound). */
static inline unsigned char *pickle_uint31(unsigned char *w, uint64_t v) {
    static const unsigned char op[3] = {'K', 'M', 'J'}, nbytes[3] = {1, 2, 4};
    unsigned c = (v >= 0x100) + (v >= 0x10000);
    w[0] = op[c];
    uint64_t le = to_little_endian(v);
    memcpy(w + 1, &le, 8);
    return w + 1 + nbytes[c];
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
        if (cbor && utok) {
            put1(&b, 0x83);
            cbor_head(&b, 0x40, (uint64_t)plen);
            put(&b, PyBytes_AS_STRING(parent), plen);
            cbor_head(&b, 0x80, (uint64_t)bs);
            unsigned char *w = b.buf + b.len; /* a local cursor: the compiler keeps it in a register */
            for (Py_ssize_t i = 0; i < bs; i++) w = cbor_uint(w, utok[i]);
            b.len = w - b.buf;
            put1(&b, 0xf6);
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
                if (utok) {
                    if (utok[i] > 2147483647ULL) {
                        PyErr_SetString(PyExc_OverflowError, "token id needs LONG1; left to the Python path");
                        goto fail;
                    }
                    b.len = pickle_uint31(b.buf + b.len, utok[i]) - b.buf;
                } else if (pickle_int(&b, tok[i]) < 0) goto fail;
            }
            if (bs > 3) put1(&b, 't');
            else put1(&b, (unsigned char)(0x84 + bs)); /* TUPLE1..3 = 0x85..0x87 */
            put1(&b, 0x94);
            put1(&b, 'N'); put1(&b, 0x87); put1(&b, 0x94); put1(&b, '.');
            uint64_t flen = (uint64_t)(b.len - frame_at - 8); /* everything after the length, STOP included */
            for (int s = 0; s < 8; s++) b.buf[frame_at + s] = (unsigned char)(flen >> (8 * s));
        }
        PyObject *digest;
        if (sha_mode && ossl.enabled) {
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
    const unsigned char *p = in.buf, *end = p + in.len, *start = p;
    Buf b = {0};
    const char *err = NULL;
#define WS() while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++
    WS();
    if (p >= end || *p != '[') { err = "token_ids must be an array"; goto done; }
    p++;
    WS();
    if (p < end && *p == ']') { p++; goto tail; }
    for (;;) {
        WS();
        if (p >= end) { err = "unterminated token_ids array"; goto done; }
        if (*p == '-') { /* -0 is JSON's zero (json.loads and the contract take it); any other sign is not */
            if (p + 1 < end && p[1] == '0' && !(p + 2 < end && p[2] >= '0' && p[2] <= '9')) p++;
            else { err = "token_ids must be non-negative integers"; goto done; }
        }
        if (*p < '0' || *p > '9') { err = "token_ids must be integers"; goto done; }
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') { err = "invalid number in token_ids"; goto done; }
        uint64_t v = 0;
        const unsigned char *digits = p;
        while (p < end && *p >= '0' && *p <= '9' && p - digits < 19) v = v * 10 + (unsigned)(*p++ - '0');
        if (p < end && *p >= '0' && *p <= '9') { /* a 20th digit: the only place uint64 can overflow */
            unsigned d = *p - '0';
            if (v > (UINT64_MAX - d) / 10 || (p + 1 < end && p[1] >= '0' && p[1] <= '9')) {
                err = "token id out of range";
                goto done;
            }
            v = v * 10 + d;
            p++;
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) { err = "token_ids must be integers"; goto done; }
        if (b.len + 8 > b.cap && buf_reserve(&b, 8 + (end - p) * 4) < 0) {
            PyBuffer_Release(&in);
            PyMem_Free(b.buf);
            return NULL;
        }
        memcpy(b.buf + b.len, &v, 8);
        b.len += 8;
        WS();
        if (p < end && *p == ',') { p++; continue; }
        if (p < end && *p == ']') { p++; break; }
        err = "invalid token_ids array";
        goto done;
    }
tail:
    WS();
    if (p != end) err = "trailing data after token_ids";
done:
#undef WS
    {
        PyObject *res = NULL;
        if (err) PyErr_Format(PyExc_ValueError, "%s (at byte %zd of the array)", err, (Py_ssize_t)(p - start));
        else res = PyBytes_FromStringAndSize((const char *)b.buf, b.len);
        PyBuffer_Release(&in);
        PyMem_Free(b.buf);
        return res;
    }
}

/* native_sha256([enable]) -> whether sha256 runs in libcrypto directly; enable=False turns it off
 * (for comparisons), True back on where it loaded. */
static PyObject *native_sha256_switch(PyObject *self, PyObject *args) {
    int enable = -1;
    if (!PyArg_ParseTuple(args, "|p", &enable)) return NULL;
    if (enable == 0) ossl.enabled = 0;
    else if (enable == 1 && ossl.ctx) {
        unsigned char out[32];
        ossl.enabled = native_sha256((const unsigned char *)"", 0, out);
    }
    return PyBool_FromLong(ossl.enabled);
}

static PyMethodDef methods[] = {
    {"native_sha256", native_sha256_switch, METH_VARARGS, "Whether sha256 runs in libcrypto directly; can switch it."},
    {"chain", chain, METH_VARARGS, "Digests of consecutive blocks without extra keys."},
    {"parse_token_array", parse_token_array, METH_O, "JSON array of non-negative ints -> native uint64 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) {
    load_libcrypto();
    return PyModule_Create(&module);
}
