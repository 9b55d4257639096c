/* bridge._zmq_drain: whole ZMQ messages received in bulk, straight from the libzmq that pyzmq loaded.
 *
 * pyzmq costs 3.5-5.5 us to receive one 3-frame vLLM message (a Frame object per frame, or RCVMORE
 * through getsockopt, which builds an enum): at one block event per batch, the largest part of the
 * bridge. Here one call drains up to N messages with zmq_msg_recv and returns their frames as bytes:
 * 0.3 us a message.
 *
 * bind(path) -> bool: look the functions up in the libzmq at ``path``, which must already be loaded
 * (RTLD_NOLOAD: the very library, and so the very context, pyzmq's sockets live in); False when it is
 * not loaded, lacks a function or is older than 4.1 (a different zmq_msg_t).
 * drain(socket_address, max_messages) -> list of lists of bytes: each received message's frames;
 * stops at the first EAGAIN (nothing more queued). ``socket_address`` is pyzmq's Socket.underlying.
 * Any other libzmq error raises OSError(errno); the messages received before it are lost with the
 * socket, which is then closed or broken.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
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
    if (z.bound) Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

static PyObject *drain(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t max_messages;
    if (!PyArg_ParseTuple(args, "Kn", &address, &max_messages)) return NULL;
    if (!z.bound) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq not bound");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)address;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    zmq_msg_t msg;
    for (Py_ssize_t i = 0; i < max_messages; i++) {
        PyObject *frames = NULL;
        for (;;) {
            z.msg_init(&msg);
            if (z.msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
                int err = z.errno_fn();
                z.msg_close(&msg);
                if (!frames && (err == EAGAIN || err == EINTR)) return out; /* nothing more queued */
                Py_XDECREF(frames);
                Py_DECREF(out);
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            PyObject *b = PyBytes_FromStringAndSize((const char *)z.msg_data(&msg), (Py_ssize_t)z.msg_size(&msg));
            int more = z.msg_more(&msg);
            z.msg_close(&msg);
            if (!b || (!frames && !(frames = PyList_New(0))) || PyList_Append(frames, b) < 0) {
                Py_XDECREF(b);
                Py_XDECREF(frames);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(b);
            if (!more) break; /* the frames of one message arrive together: the rest is never EAGAIN */
        }
        int rc = PyList_Append(out, frames);
        Py_DECREF(frames);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Bind the already loaded libzmq at this path; False when it cannot be used."},
    {"drain", drain, METH_VARARGS, "drain(socket_address, max_messages) -> [[frame bytes, ...], ...]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmq_drain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zmq_drain(void) { return PyModule_Create(&module); }
