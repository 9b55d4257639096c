/* The indexer's reader of L1 stream payloads in msgpack (infra/event_codec.py, decode_packed): the value
 * msgpack.unpackb(data, raw=False, strict_map_key=False) gives, except that an array under a "hashes" key
 * whose items are all integers in 0..2^64-1 comes as an array('Q') (what indexer/l1_state.checked_events
 * makes of each event's hashes anyway) instead of a list of ints: one object per event instead of one per
 * hash, and no conversion after.
 *
 * It reads the network's bytes (whatever the stream holds), so it takes only what it reads plainly: a map
 * key other than a str, an ext type, a str that is not UTF-8, nesting deeper than MAX_DEPTH, a length past
 * the end, or bytes left over give None, and the caller unpacks the payload with msgpack, which decides
 * (and names the error). Every length is checked against the bytes left before anything is read or made
 * of that size. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "msgpack_read.h"

/* the L1 messages nest 4 deep (message, events, event, hashes); deeper is unusual, msgpack decides */
#define MAX_DEPTH 32

static PyObject *array_type; /* array.array */
static PyObject *hashes_key; /* "hashes" */

static PyObject *value(Rd *r, int depth);

/* n items of an array whose header was read, as an array('Q') where all are integers in 0..2^64-1;
 * NULL with no error set where one is not (r is left where it was: the caller reads them as a list) */
static PyObject *u64_array(Rd *r, int64_t n) {
    const unsigned char *start = r->p;
    if ((uint64_t)n > (uint64_t)(PY_SSIZE_T_MAX / 8)) return NULL; /* (32-bit builds) a list, msgpack decides */
    PyObject *raw = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 8);
    if (raw == NULL) return NULL;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(raw);
    for (int64_t i = 0; i < n; i++) {
        uint64_t u;
        int neg;
        if (rd_int(r, &u, &neg) || neg) {
            Py_DECREF(raw);
            r->p = start;
            return NULL;
        }
        memcpy(out + i, &u, 8);
    }
    PyObject *a = PyObject_CallFunction(array_type, "sO", "Q", raw);
    Py_DECREF(raw);
    return a;
}

/* a str (rd_str), decoded; NULL with no error set: not a str, cut short, or not UTF-8 (msgpack decides) */
static PyObject *str_at(Rd *r) {
    const char *s;
    Py_ssize_t n;
    if (rd_str(r, &s, &n)) return NULL;
    PyObject *u = PyUnicode_DecodeUTF8(s, n, NULL);
    if (u == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return u;
}

static PyObject *list_of(Rd *r, int64_t n, int depth) {
    if (n < 0 || (uint64_t)n > (uint64_t)(r->end - r->p)) return NULL; /* every item takes a byte */
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *v = value(r, depth + 1);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

static PyObject *map_of(Rd *r, int64_t n, int depth) {
    if (n < 0 || (uint64_t)n > (uint64_t)(r->end - r->p) / 2) return NULL; /* a key and a value: 2 bytes */
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *k = str_at(r); /* a key other than a str: msgpack decides */
        if (k == NULL) goto fail;
        PyObject *v = NULL;
        if (PyUnicode_GET_LENGTH(k) == 6 && PyUnicode_Compare(k, hashes_key) == 0) {
            const unsigned char *at = r->p;
            int64_t items = rd_array(r);
            if (items >= 0 && (uint64_t)items <= (uint64_t)(r->end - r->p)) {
                v = u64_array(r, items);
                if (v == NULL && PyErr_Occurred()) {
                    Py_DECREF(k);
                    goto fail;
                }
            }
            if (v == NULL) r->p = at; /* not all uint64s: a list, as any array */
        }
        if (v == NULL) v = value(r, depth + 1);
        if (v == NULL) {
            Py_DECREF(k);
            goto fail;
        }
        int rc = PyDict_SetItem(d, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc) goto fail;
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* one value: a new reference; NULL: an error set, or (none set) not read plainly */
static PyObject *value(Rd *r, int depth) {
    if (depth > MAX_DEPTH || need(r, 1)) return NULL;
    unsigned c = *r->p;
    if (c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3)) {
        uint64_t u;
        int neg;
        if (rd_int(r, &u, &neg)) return NULL;
        return neg ? PyLong_FromLongLong((int64_t)u) : PyLong_FromUnsignedLongLong(u);
    }
    if ((c & 0xe0) == 0xa0 || (c >= 0xd9 && c <= 0xdb)) return str_at(r);
    if (c == 0xca || c == 0xcb) {
        double d;
        return rd_float(r, &d) ? NULL : PyFloat_FromDouble(d);
    }
    r->p++;
    if ((c & 0xf0) == 0x80) return map_of(r, c & 0x0f, depth);
    if ((c & 0xf0) == 0x90) return list_of(r, c & 0x0f, depth);
    switch (c) {
    case 0xc0: Py_RETURN_NONE;
    case 0xc2: Py_RETURN_FALSE;
    case 0xc3: Py_RETURN_TRUE;
    case 0xc4: case 0xc5: case 0xc6: {
        int64_t n = rd_len(r, c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4);
        if (n < 0 || need(r, (size_t)n)) return NULL;
        PyObject *b = PyBytes_FromStringAndSize((const char *)r->p, (Py_ssize_t)n);
        if (b != NULL) r->p += n;
        return b;
    }
    case 0xdc: return list_of(r, rd_len(r, 2), depth);
    case 0xdd: return list_of(r, rd_len(r, 4), depth);
    case 0xde: return map_of(r, rd_len(r, 2), depth);
    case 0xdf: return map_of(r, rd_len(r, 4), depth);
    default: return NULL; /* ext types and 0xc1: msgpack decides */
    }
}

static PyObject *unpack(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    Rd r = {(const unsigned char *)buf.buf, (const unsigned char *)buf.buf + buf.len};
    PyObject *v = value(&r, 0);
    PyBuffer_Release(&buf);
    if (v == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (r.p != r.end) { /* bytes left over: msgpack refuses them */
        Py_DECREF(v);
        Py_RETURN_NONE;
    }
    return v;
}

static PyMethodDef methods[] = {
    {"unpack", unpack, METH_O,
     "msgpack.unpackb(data, raw=False, strict_map_key=False), with each all-uint64 array under a \"hashes\" "
     "key as an array('Q'); None where msgpack is to decide."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_event_unpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__event_unpack(void) {
    PyObject *arr = PyImport_ImportModule("array");
    if (arr == NULL) return NULL;
    array_type = PyObject_GetAttrString(arr, "array");
    Py_DECREF(arr);
    if (array_type == NULL) return NULL;
    hashes_key = PyUnicode_InternFromString("hashes");
    if (hashes_key == NULL) return NULL;
    return PyModule_Create(&module);
}
