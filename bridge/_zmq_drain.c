/* bridge._zmq_drain: whole ZMQ messages received in bulk, straight from the libzmq that pyzmq loaded.
 *
 * pyzmq costs 3.5-5.5 us to receive one 3-frame vLLM message (a Frame object per frame, or RCVMORE
 * through getsockopt, which builds an enum): at one block event per batch, the largest part of the
 * bridge. Here one call drains up to N messages with zmq_msg_recv and returns their frames as bytes:
 * 0.3 us a message.
 *
 * bind(path) -> bool: look the functions up through pyzmq's own extension module at ``path``, which
 * must already be loaded (RTLD_NOLOAD): the very library, and so the very context, pyzmq's sockets
 * live in; False when it is not loaded, lacks a function or is older than 4.1 (a different zmq_msg_t).
 * drain(socket_address, max_messages[, fail_at[, fail_append_at]]) -> (messages, error): each received message's frames
 * as bytes, up to the first EAGAIN (nothing more queued), and None; or, where something failed, the
 * whole messages received before it and the exception (OSError(errno) from libzmq: the socket is
 * closed or broken; MemoryError: that message is lost whole, its remaining frames read and dropped so
 * that the next call starts at a message boundary). ``socket_address`` is pyzmq's Socket.underlying;
 * ``fail_at`` (tests) fails that frame of the call as an allocation would, ``fail_append_at`` the adding of
 * that message of the call to the list. Whatever fails, the messages received before it come back:
 * they are off the socket, and nothing else holds them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>
#if defined(__linux__)
#include <dlfcn.h>
#endif

typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmq_msg_t; /* libzmq >= 4.1 */

#define ZMQ_DONTWAIT 1

static struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*errno_fn)(void);
    int bound;
} z;

static PyObject *bind(PyObject *self, PyObject *arg) {
#if defined(__linux__)
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    /* pyzmq's own extension, already loaded: dlsym through its handle searches it and then the
     * libraries it needs, so the functions found are the libzmq its sockets live in (its bundled one,
     * the system's it links, or its own static copy when it exports them), never another one that
     * some other library brought into the process. */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) Py_RETURN_FALSE;
    void (*version)(int *, int *, int *) = (void (*)(int *, int *, int *))dlsym(h, "zmq_version");
    z.msg_init = (int (*)(zmq_msg_t *))dlsym(h, "zmq_msg_init");
    z.msg_recv = (int (*)(zmq_msg_t *, void *, int))dlsym(h, "zmq_msg_recv");
    z.msg_close = (int (*)(zmq_msg_t *))dlsym(h, "zmq_msg_close");
    z.msg_data = (void *(*)(zmq_msg_t *))dlsym(h, "zmq_msg_data");
    z.msg_size = (size_t (*)(const zmq_msg_t *))dlsym(h, "zmq_msg_size");
    z.msg_more = (int (*)(const zmq_msg_t *))dlsym(h, "zmq_msg_more");
    z.errno_fn = (int (*)(void))dlsym(h, "zmq_errno");
    int major = 0, minor = 0, patch = 0;
    if (version) version(&major, &minor, &patch);
    z.bound = version && z.msg_init && z.msg_recv && z.msg_close && z.msg_data && z.msg_size && z.msg_more &&
              z.errno_fn && (major > 4 || (major == 4 && minor >= 1));
    dlclose(h); /* RTLD_NOLOAD took a reference; pyzmq's own keeps the library loaded */
    if (z.bound) Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

/* bound_library() -> the file the bound zmq_msg_recv lives in (None: not bound). */
static PyObject *bound_library(PyObject *self, PyObject *noargs) {
#if defined(__linux__)
    Dl_info info;
    if (z.bound && dladdr((void *)z.msg_recv, &info) && info.dli_fname) return PyUnicode_DecodeFSDefault(info.dli_fname);
#endif
    Py_RETURN_NONE;
}

/* The exception set now (taken: none is set after), or MemoryError where none is. */
static PyObject *taken_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value ? value : Py_NewRef(PyExc_MemoryError);
}

static PyObject *drain(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t max_messages, fail_at = -1, fail_append_at = -1;
    if (!PyArg_ParseTuple(args, "Kn|nn", &address, &max_messages, &fail_at, &fail_append_at)) return NULL;
    if (!z.bound) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq not bound");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)address;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    PyObject *error = NULL; /* what stopped the burst, returned beside what was received before it */
    Py_ssize_t frame_no = 0;
    zmq_msg_t msg;
    for (Py_ssize_t i = 0; i < max_messages && !error; i++) {
        PyObject *frames = NULL;
        int failed = 0, started = 0;
        for (;;) {
            z.msg_init(&msg);
            if (z.msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
                int err = z.errno_fn();
                z.msg_close(&msg);
                Py_CLEAR(frames);
                if (!started && (err == EAGAIN || err == EINTR)) goto done; /* nothing more queued */
                if (failed) PyErr_Clear(); /* the socket's own error is the one that counts */
                error = PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err));
                if (!error) error = taken_error();
                break;
            }
            started = 1;
            if (!failed) { /* after a failure the message's remaining frames are still read, and dropped */
                PyObject *b = frame_no++ == fail_at ? PyErr_NoMemory()
                              : PyBytes_FromStringAndSize((const char *)z.msg_data(&msg), (Py_ssize_t)z.msg_size(&msg));
                if (!b || (!frames && !(frames = PyList_New(0))) || PyList_Append(frames, b) < 0) {
                    Py_XDECREF(b);
                    Py_CLEAR(frames);
                    failed = 1;
                }
                else Py_DECREF(b);
            }
            int more = z.msg_more(&msg);
            z.msg_close(&msg);
            if (!more) break; /* the frames of one message arrive together: the rest is never EAGAIN */
        }
        if (failed && !error) error = taken_error(); /* the message is lost whole; the socket stays at a message boundary */
        if (frames) {
            int rc = i == fail_append_at ? (PyErr_NoMemory(), -1) : PyList_Append(out, frames);
            Py_DECREF(frames);
            if (rc < 0) {
                Py_XDECREF(error); /* (none: a message with an error is not appended) */
                error = taken_error(); /* this message is lost; the ones before it come back */
            }
        }
    }
done:;
    PyObject *result = PyTuple_New(2); /* where even this fails, the messages are lost with it */
    if (!result) { Py_DECREF(out); Py_XDECREF(error); return NULL; }
    PyTuple_SET_ITEM(result, 0, out);
    PyTuple_SET_ITEM(result, 1, error ? error : Py_NewRef(Py_None));
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Bind the libzmq that pyzmq's extension at this path uses; False when it cannot be used."},
    {"bound_library", bound_library, METH_NOARGS, "The file the bound libzmq functions live in (None: not bound)."},
    {"drain", drain, METH_VARARGS, "drain(socket_address, max_messages[, fail_at]) -> ([[frame bytes, ...], ...], error or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmq_drain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zmq_drain(void) { return PyModule_Create(&module); }
