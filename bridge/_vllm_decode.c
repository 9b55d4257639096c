/* The bridge's decoder of vLLM's current KVEventBatch shape, in C (bridge/vllm_events.py: decode_current).
 *
 * decode(payload) -> (ts, events, dp_rank) | None. It walks the msgpack bytes once and builds the
 * normalised event dicts directly: no struct per event (vLLM publishes one BlockRemoved per evicted block,
 * hundreds a batch on a real trace), consecutive removals of one medium and group merged as they are read,
 * token ids and every other field the index does not use skipped without an object. It takes only the
 * plain current shape: a batch [ts(float|nil), events, dp_rank(int|nil)?] of maps whose first key is
 * "type", every field of the type it should be, nothing odd anywhere it looks. On anything else it returns
 * None and the caller decodes as before (msgspec, then the tolerant reference), which has the last word:
 * what this returns equals what that path returns (tests/test_vllm_events.py holds them equal).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../infra/msgpack_read.h"

#define MAX_BLOCK_SIZE (1 << 16)
#define MAX_GROUP_IDX 63
#define MEDIUM_MAX 64

static PyObject *k_kind, *k_medium, *k_hashes, *k_parent, *k_block_size, *k_lora_name, *k_group_idx;
static PyObject *v_stored, *v_removed, *v_cleared;

/* a block hash, normalised as schemas.block_hash does: an int's uint64 form, or the last 8 bytes of a
 * digest big-endian; NULL with no error set: not one */
static PyObject *rd_hash(Rd *r) {
    if (need(r, 1)) return NULL;
    unsigned c = *r->p;
    if (c == 0xc4 || c == 0xc5 || c == 0xc6) {
        r->p++;
        int64_t len = rd_len(r, c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4);
        if (len < 0 || need(r, (size_t)len)) return NULL;
        int take = len < 8 ? (int)len : 8;
        uint64_t v = be(r->p + len - take, take);
        r->p += len;
        return PyLong_FromUnsignedLongLong(v);
    }
    uint64_t u;
    int neg;
    if (rd_int(r, &u, &neg)) return NULL;
    return PyLong_FromUnsignedLongLong(u);
}

/* appends a hash array's hashes to list; -1: not one (or an error, set) */
static int rd_hashes(Rd *r, PyObject *list) {
    int64_t n = rd_array(r);
    if (n < 0 || (uint64_t)n > (uint64_t)(r->end - r->p)) return -1;
    for (int64_t i = 0; i < n; i++) {
        PyObject *h = rd_hash(r);
        if (h == NULL) return -1;
        int rc = PyList_Append(list, h);
        Py_DECREF(h);
        if (rc) return -1;
    }
    return 0;
}

/* Containers nested deeper than this inside a skipped value make the batch not plainly the shape: msgspec
 * skips by recursion and raises RecursionError at a depth that depends on the caller's stack, so a batch
 * taken here must stay far below any depth it refuses (vLLM's own fields nest 3 deep at most). */
#define MAX_SKIP_DEPTH 32

/* The whole size of a fixed-size scalar by its first byte (ints of every width, nil, bools, floats);
 * 0: any other value. A batch's token ids are most of its bytes, ints of 1, 3 and 5 bytes mixed: passed
 * by this table with no branch per width, they took a third of the time they took through the switch. */
static unsigned char SCALAR_LEN[256];

static void scalar_lens(void) {
    for (int c = 0; c <= 0x7f; c++) SCALAR_LEN[c] = 1;
    for (int c = 0xe0; c <= 0xff; c++) SCALAR_LEN[c] = 1;
    SCALAR_LEN[0xc0] = SCALAR_LEN[0xc2] = SCALAR_LEN[0xc3] = 1;
    SCALAR_LEN[0xcc] = SCALAR_LEN[0xd0] = 2;
    SCALAR_LEN[0xcd] = SCALAR_LEN[0xd1] = 3;
    SCALAR_LEN[0xca] = SCALAR_LEN[0xce] = SCALAR_LEN[0xd2] = 5;
    SCALAR_LEN[0xcb] = SCALAR_LEN[0xcf] = SCALAR_LEN[0xd3] = 9;
}

/* past one msgpack value of any kind, nested ones included, without objects; -1: malformed or nested
 * deeper than MAX_SKIP_DEPTH */
static int skip(Rd *r) {
    uint64_t left[MAX_SKIP_DEPTH + 1];  /* values still to pass at each open level */
    int depth = 0;
    left[0] = 1;
    for (;;) {
        while (left[depth] == 0) {
            if (depth == 0) return 0;
            depth--;
        }
        {   /* a run of scalars (an array of token ids): each passed by its size alone */
            const unsigned char *p = r->p, *end = r->end;
            uint64_t n = left[depth];
            while (n && p < end) {
                unsigned len = SCALAR_LEN[*p];
                if (len == 0 || (size_t)(end - p) < len) break;  /* a container, or cut short: below */
                p += len;
                n--;
            }
            r->p = p;
            left[depth] = n;
            if (n == 0) continue;
        }
        if (need(r, 1)) return -1;
        unsigned c = *r->p++;
        left[depth]--;
        int64_t len = 0;
        uint64_t more = 0;
        if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) continue;
        if ((c & 0xf0) == 0x80) more = 2 * (uint64_t)(c & 0x0f);
        else if ((c & 0xf0) == 0x90) more = c & 0x0f;
        else if ((c & 0xe0) == 0xa0) len = c & 0x1f;
        else {
            switch (c) {
            case 0xc4: case 0xd9: len = rd_len(r, 1); break;
            case 0xc5: case 0xda: len = rd_len(r, 2); break;
            case 0xc6: case 0xdb: len = rd_len(r, 4); break;
            case 0xc7: len = rd_len(r, 1); len = len < 0 ? -1 : len + 1; break;  /* ext: its type byte too */
            case 0xc8: len = rd_len(r, 2); len = len < 0 ? -1 : len + 1; break;
            case 0xc9: len = rd_len(r, 4); len = len < 0 ? -1 : len + 1; break;
            case 0xca: len = 4; break;
            case 0xcb: len = 8; break;
            case 0xcc: case 0xd0: len = 1; break;
            case 0xcd: case 0xd1: len = 2; break;
            case 0xce: case 0xd2: len = 4; break;
            case 0xcf: case 0xd3: len = 8; break;
            case 0xd4: len = 2; break;
            case 0xd5: len = 3; break;
            case 0xd6: len = 5; break;
            case 0xd7: len = 9; break;
            case 0xd8: len = 17; break;
            case 0xdc: { int64_t n = rd_len(r, 2); if (n < 0) return -1; more = (uint64_t)n; break; }
            case 0xdd: { int64_t n = rd_len(r, 4); if (n < 0) return -1; more = (uint64_t)n; break; }
            case 0xde: { int64_t n = rd_len(r, 2); if (n < 0) return -1; more = 2 * (uint64_t)n; break; }
            case 0xdf: { int64_t n = rd_len(r, 4); if (n < 0) return -1; more = 2 * (uint64_t)n; break; }
            default: return -1;  /* 0xc1: never used */
            }
        }
        if (len < 0 || need(r, (size_t)len)) return -1;
        r->p += len;
        if (more == 0) continue;
        if (more > (uint64_t)(r->end - r->p)) return -1;  /* every value takes a byte at least */
        if (depth == MAX_SKIP_DEPTH) return -1;
        left[++depth] = more;
    }
}

/* the medium upper-cased, as str.upper() does; a new reference, or NULL (an error set, or none: not one) */
static PyObject *medium_of(const char *s, Py_ssize_t n) {
    char buf[MEDIUM_MAX];
    if (n <= MEDIUM_MAX) {
        int ascii = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned char ch = (unsigned char)s[i];
            if (ch >= 0x80) { ascii = 0; break; }
            buf[i] = (ch >= 'a' && ch <= 'z') ? (char)(ch - 32) : (char)ch;
        }
        if (ascii) return PyUnicode_FromStringAndSize(buf, n);
    }
    PyObject *raw = PyUnicode_DecodeUTF8(s, n, NULL);
    if (raw == NULL) return NULL;
    PyObject *up = PyObject_CallMethod(raw, "upper", NULL);
    Py_DECREF(raw);
    return up;
}

typedef struct {
    const char *raw;  /* the medium's bytes as sent, NULL: nil */
    Py_ssize_t raw_n;
    PyObject *upper;  /* borrowed from the cache below */
} Medium;

/* the batch's mediums: a few at most, upper-cased once each */
typedef struct {
    Medium m[8];
    int n;
} Mediums;

/* borrowed; NULL: an error, or not a medium (a punt: no error set) */
static PyObject *rd_medium(Rd *r, Mediums *cache) {
    if (take_nil(r)) return Py_None;
    const char *s;
    Py_ssize_t n;
    if (rd_str(r, &s, &n)) return NULL;
    for (int i = 0; i < cache->n; i++)
        if (cache->m[i].raw_n == n && memcmp(cache->m[i].raw, s, (size_t)n) == 0) return cache->m[i].upper;
    if (cache->n == 8) return NULL;
    PyObject *up = medium_of(s, n);
    if (up == NULL) return NULL;
    cache->m[cache->n].raw = s;
    cache->m[cache->n].raw_n = n;
    cache->m[cache->n].upper = up;
    cache->n++;
    return up;
}

static int key_is(const char *s, Py_ssize_t n, const char *name) {
    return (size_t)n == strlen(name) && memcmp(s, name, (size_t)n) == 0;
}

/* an optional int within [low, high]: *out -1 for nil, a value outside: -2 (the slow path decides) */
static int rd_opt_small(Rd *r, int64_t *out) {
    if (take_nil(r)) { *out = -1; return 0; }
    uint64_t u;
    int neg;
    if (rd_int(r, &u, &neg)) return -1;
    *out = neg ? -2 : (u > (uint64_t)1 << 40 ? -3 : (int64_t)u);
    return 0;
}

enum { ST = 1, RM = 2, CL = 3 };
enum { F_HASHES = 1, F_PARENT = 2, F_SIZE = 4, F_MEDIUM = 8, F_LORA = 16, F_GROUP = 32 };

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    Rd rd = {(const unsigned char *)buf.buf, (const unsigned char *)buf.buf + buf.len};
    Rd *r = &rd;
    Mediums mediums = {.n = 0};
    PyObject *events = NULL, *ts = NULL, *dp = NULL, *result = NULL;
    PyObject *run = NULL;  /* the hashes list of the removal run being read, borrowed from its dict */
    PyObject *run_medium = NULL;
    int64_t run_group = -1;

    int64_t top = rd_array(r);
    if (top != 2 && top != 3) goto punt;
    if (take_nil(r)) ts = Py_NewRef(Py_None);
    else {
        double d;
        if (rd_float(r, &d)) goto punt;
        if ((ts = PyFloat_FromDouble(d)) == NULL) goto fail;
    }

    int64_t n_events = rd_array(r);
    if (n_events < 0 || (uint64_t)n_events > (uint64_t)(r->end - r->p)) goto punt;
    events = PyList_New(0);
    if (events == NULL) goto fail;
    for (int64_t e = 0; e < n_events; e++) {
        int64_t n_keys = rd_map(r);
        if (n_keys < 1) goto punt;
        const char *s;
        Py_ssize_t n;
        if (rd_str(r, &s, &n) || !key_is(s, n, "type")) goto punt;
        if (rd_str(r, &s, &n)) goto punt;
        int kind = key_is(s, n, "BlockStored") ? ST : key_is(s, n, "BlockRemoved") ? RM
                   : key_is(s, n, "AllBlocksCleared") ? CL : 0;
        if (!kind) goto punt;
        unsigned seen = 0;
        PyObject *medium = Py_None, *parent = NULL, *lora = NULL;
        int64_t size = -1, group = -1;
        const unsigned char *hashes_at = NULL;
        for (int64_t k = 1; k < n_keys; k++) {
            if (rd_str(r, &s, &n)) goto punt_event;
            unsigned f = key_is(s, n, "medium") ? F_MEDIUM
                         : kind == CL ? 0
                         : key_is(s, n, "block_hashes") ? F_HASHES
                         : key_is(s, n, "group_idx") ? F_GROUP
                         : kind == RM ? 0
                         : key_is(s, n, "parent_block_hash") ? F_PARENT
                         : key_is(s, n, "block_size") ? F_SIZE
                         : key_is(s, n, "lora_name") ? F_LORA : 0;
            if (f == 0) {  /* a field the index does not use: skipped (an odd key: the slow path decides) */
                if (key_is(s, n, "type")) goto punt_event;
                for (Py_ssize_t i = 0; i < n; i++)
                    if ((unsigned char)s[i] >= 0x80) goto punt_event;
                if (skip(r)) goto punt_event;
                continue;
            }
            if (seen & f) goto punt_event;  /* a field twice */
            seen |= f;
            switch (f) {
            case F_MEDIUM:
                medium = rd_medium(r, &mediums);
                if (medium == NULL) goto punt_event;
                break;
            case F_HASHES:  /* read once the event's key is known: a removal may join the run */
                hashes_at = r->p;
                if (skip(r)) goto punt_event;
                break;
            case F_GROUP:
                if (rd_opt_small(r, &group) || group < -1 || group > MAX_GROUP_IDX) goto punt_event;
                break;
            case F_PARENT:
                if (!take_nil(r) && (parent = rd_hash(r)) == NULL) goto punt_event;
                break;
            case F_SIZE:
                if (rd_opt_small(r, &size) || size > MAX_BLOCK_SIZE || size == -3) goto punt_event;
                break;
            case F_LORA:
                if (take_nil(r)) break;
                if (rd_str(r, &s, &n)) goto punt_event;
                if ((lora = PyUnicode_DecodeUTF8(s, n, NULL)) == NULL) goto punt_event;
                break;
            }
        }
        if (kind != CL && hashes_at == NULL) goto punt_event;  /* block_hashes is required */
        if (kind == RM && run != NULL && run_group == group
            && (run_medium == medium || PyObject_RichCompareBool(run_medium, medium, Py_EQ) == 1)) {
            Rd h = {hashes_at, r->end};
            if (rd_hashes(&h, run)) goto punt_event;
            continue;
        }
        run = NULL;
        PyObject *d = PyDict_New();
        if (d == NULL) goto fail_event;
        int rc = PyList_Append(events, d);
        Py_DECREF(d);  /* held by events */
        if (rc || PyDict_SetItem(d, k_kind, kind == ST ? v_stored : kind == RM ? v_removed : v_cleared)
            || PyDict_SetItem(d, k_medium, medium))
            goto fail_event;
        if (kind == CL) continue;
        PyObject *hashes = PyList_New(0);
        if (hashes == NULL) goto fail_event;
        rc = PyDict_SetItem(d, k_hashes, hashes);
        Py_DECREF(hashes);  /* held by d */
        if (rc) goto fail_event;
        Rd h = {hashes_at, r->end};
        if (rd_hashes(&h, hashes)) goto punt_event;
        if (kind == ST) {
            if (PyDict_SetItem(d, k_parent, parent ? parent : Py_None)) goto fail_event;
            if (size > 0) {
                PyObject *v = PyLong_FromLongLong(size);
                if (v == NULL) goto fail_event;
                rc = PyDict_SetItem(d, k_block_size, v);
                Py_DECREF(v);
                if (rc) goto fail_event;
            }
            if (lora && PyDict_SetItem(d, k_lora_name, lora)) goto fail_event;
        } else {
            run = hashes;
            run_medium = medium;
            run_group = group;
        }
        if (group >= 0) {
            PyObject *v = PyLong_FromLongLong(group);
            if (v == NULL) goto fail_event;
            rc = PyDict_SetItem(d, k_group_idx, v);
            Py_DECREF(v);
            if (rc) goto fail_event;
        }
        Py_XDECREF(parent);
        Py_XDECREF(lora);
        continue;
    punt_event:
        Py_XDECREF(parent);
        Py_XDECREF(lora);
        goto punt;
    fail_event:
        Py_XDECREF(parent);
        Py_XDECREF(lora);
        goto fail;
    }
    if (top == 3) {
        if (take_nil(r)) dp = Py_NewRef(Py_None);
        else {
            uint64_t u;
            int neg;
            if (rd_int(r, &u, &neg)) goto punt;
            dp = neg ? PyLong_FromLongLong((long long)(int64_t)u) : PyLong_FromUnsignedLongLong(u);
            if (dp == NULL) goto fail;
        }
    } else dp = Py_NewRef(Py_None);
    if (r->p != r->end) goto punt;  /* trailing bytes */
    result = PyTuple_Pack(3, ts, events, dp);
    goto done;
punt:
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError) && !PyErr_ExceptionMatches(PyExc_ValueError))
            goto fail;
        PyErr_Clear();
    }
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    for (int i = 0; i < mediums.n; i++) Py_DECREF(mediums.m[i].upper);
    Py_XDECREF(ts);
    Py_XDECREF(events);
    Py_XDECREF(dp);
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(payload) -> (ts, events, dp_rank), or None where the payload is not vLLM's plain current shape."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_vllm_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__vllm_decode(void) {
    if (!(k_kind = PyUnicode_InternFromString("kind")) || !(k_medium = PyUnicode_InternFromString("medium"))
        || !(k_hashes = PyUnicode_InternFromString("hashes")) || !(k_parent = PyUnicode_InternFromString("parent"))
        || !(k_block_size = PyUnicode_InternFromString("block_size"))
        || !(k_lora_name = PyUnicode_InternFromString("lora_name"))
        || !(k_group_idx = PyUnicode_InternFromString("group_idx"))
        || !(v_stored = PyUnicode_InternFromString("stored")) || !(v_removed = PyUnicode_InternFromString("removed"))
        || !(v_cleared = PyUnicode_InternFromString("cleared")))
        return NULL;
    scalar_lens();
    return PyModule_Create(&module);
}
