/*
 * Optional accelerator for indexer/hit_rate.py: the hit-rate walk's fast path, over the blocks where
 * every alive worker stays alive. Without it (no C compiler) the pure-Python walk, which stays the
 * reference, does all of it; tests/test_hit_rate_walk.py holds the two equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* walk(digests, start, blocks, alive) -> the index of the first block, from ``start``, at which some
 * alive worker of some tier is not held: blocks[ti].get(key, 0) & alive[ti] != alive[ti], with key the
 * digest's last 8 bytes big-endian; len(digests) when there is none. The hit-rate walk's fast path:
 * the blocks where nothing changes are passed over here, the few where a worker drops out are
 * handled in Python (indexer/hit_rate.py), which stays the reference. */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *digests, *blocks, *alive;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!nO!O!", &PyList_Type, &digests, &start, &PyList_Type, &blocks,
                          &PyList_Type, &alive))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(digests), tiers = PyList_GET_SIZE(blocks);
    if (PyList_GET_SIZE(alive) != tiers) {
        PyErr_SetString(PyExc_ValueError, "blocks and alive differ in length");
        return NULL;
    }
    for (Py_ssize_t t = 0; t < tiers; t++) {
        if (!PyDict_Check(PyList_GET_ITEM(blocks, t)) || !PyLong_Check(PyList_GET_ITEM(alive, t))) {
            PyErr_SetString(PyExc_TypeError, "blocks must be dicts and alive ints");
            return NULL;
        }
    }
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(digests, i);
        if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) < 8) {
            PyErr_SetString(PyExc_TypeError, "digests must be bytes of 8 or more");
            return NULL;
        }
        const unsigned char *tail = (const unsigned char *)PyBytes_AS_STRING(d) + PyBytes_GET_SIZE(d) - 8;
        unsigned long long k = 0;
        for (int j = 0; j < 8; j++) k = (k << 8) | tail[j];
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (!key) return NULL;
        for (Py_ssize_t t = 0; t < tiers; t++) {
            PyObject *a = PyList_GET_ITEM(alive, t);
            int live = PyObject_IsTrue(a);
            if (live <= 0) {
                if (live < 0) { Py_DECREF(key); return NULL; }
                continue;
            }
            PyObject *v = PyDict_GetItemWithError(PyList_GET_ITEM(blocks, t), key);
            if (!v) {
                Py_DECREF(key);
                if (PyErr_Occurred()) return NULL;
                return PyLong_FromSsize_t(i);  /* not held at all: every alive worker drops out */
            }
            PyObject *m = PyNumber_And(v, a);
            if (!m) { Py_DECREF(key); return NULL; }
            int same = PyObject_RichCompareBool(m, a, Py_EQ);
            Py_DECREF(m);
            if (same != 1) {
                Py_DECREF(key);
                return same < 0 ? NULL : PyLong_FromSsize_t(i);
            }
        }
        Py_DECREF(key);
    }
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "First block from start at which some alive worker is not held (hit-rate walk)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_walk", NULL, -1, methods};

PyMODINIT_FUNC PyInit__prefix_walk(void) {
    return PyModule_Create(&module);
}
