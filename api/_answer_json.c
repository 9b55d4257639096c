/*
 * Optional accelerator for the API: the seed API's answer (``POST /kv-cache/hit-rate``, api/app.py) and
 * /query's (api/tiered_query.py) as JSON, from the native query's lengths, in one pass over the pods. At
 * 1,000 candidates the seed API's answer built in Python (a score, then a dict, per candidate, and their
 * encoding) took 0.9 ms of a 1.2 ms query on the event loop, /query's 1.0 ms; the native call itself 0.06
 * ms. Without it (no C compiler) the Python paths, which stay the reference, answer;
 * tests/test_answer_json.py holds each pair equal (the JSON's values: a float is written as Python's
 * repr, which reads back as the same double).
 *
 * The candidates' names are the router's request's strings: escaped as JSON requires (quote, backslash,
 * controls), the rest written as UTF-8.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static int buf_grow(Buf *b, size_t more) {
    if (more <= b->cap - b->len) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len < more) {
        if (cap > ((size_t)PY_SSIZE_T_MAX) / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, size_t n) {
    if (!n) return 0;  /* (s may be an empty buffer's NULL) */
    if (buf_grow(b, n)) return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

#define PUT_LITERAL(b, s) buf_put((b), (s), sizeof(s) - 1)

/* A str as a JSON string: quote, backslash and the controls below 0x20 escaped, the rest as UTF-8 (a
 * str that has none, a lone surrogate, raises UnicodeEncodeError). */
static int put_string(Buf *b, PyObject *s) {
    if (!PyUnicode_Check(s)) {
        PyErr_SetString(PyExc_TypeError, "a candidate is not a str");
        return -1;
    }
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (!u) return -1;
    if (buf_grow(b, (size_t)n * 6 + 2)) return -1;  /* the most an escape takes: \u00XX */
    char *o = b->p + b->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
        } else if (c < 0x20) {
            static const char hex[] = "0123456789abcdef";
            switch (c) {
            case '\n': *o++ = '\\'; *o++ = 'n'; break;
            case '\r': *o++ = '\\'; *o++ = 'r'; break;
            case '\t': *o++ = '\\'; *o++ = 't'; break;
            case '\b': *o++ = '\\'; *o++ = 'b'; break;
            case '\f': *o++ = '\\'; *o++ = 'f'; break;
            default:
                memcpy(o, "\\u00", 4);
                o += 4;
                *o++ = hex[c >> 4];
                *o++ = hex[c & 15];
            }
        } else {
            *o++ = (char)c;
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->p);
    return 0;
}

/* The ratios' texts of one answer by the blocks held (over one n_blocks): a few hundred ns each to
 * write, and the candidates of a fleet mostly hold a handful of distinct prefix lengths. */
#define RATIO_SLOTS 64
typedef struct {
    unsigned long long held;
    int len; /* 0: empty */
    char text[32];
} RatioText;

/* held / n_blocks as Python's repr writes it (the shortest text that reads back as the same double);
 * 0.0 without blocks. */
static int put_ratio(Buf *b, RatioText *cache, unsigned long long held, long long n_blocks) {
    if (held == 0 || n_blocks <= 0) return PUT_LITERAL(b, "0.0");
    RatioText *slot = &cache[(held * 0x9E3779B97F4A7C15ull) >> 58];  /* 6 bits: RATIO_SLOTS */
    if (slot->len && slot->held == held) return buf_put(b, slot->text, (size_t)slot->len);
    char *s = PyOS_double_to_string((double)held / (double)n_blocks, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!s) return -1;
    size_t n = strlen(s);
    int rc = buf_put(b, s, n);
    if (n < sizeof slot->text) {
        memcpy(slot->text, s, n);
        slot->len = (int)n;
        slot->held = held;
    }
    PyMem_Free(s);
    return rc;
}

/* The pair (a, b) of a pod's slice of a tier's workers, checked against the tier's lengths. */
static int slice_of(PyObject *pair, Py_ssize_t nlen, Py_ssize_t *a, Py_ssize_t *b) {
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "a slot is not an (a, b) tuple");
        return -1;
    }
    *a = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
    if (*a == -1 && PyErr_Occurred()) return -1;
    *b = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
    if (*b == -1 && PyErr_Occurred()) return -1;
    if (*a < 0 || *b > nlen) {
        PyErr_SetString(PyExc_ValueError, "a slot lies outside its tier's lengths");
        return -1;
    }
    return 0;
}

/* What both answers read: tuples of their own of the pods, their slots and the two tiers' lengths (a
 * callback runs Python between pods, which must not change what is read). */
typedef struct {
    PyObject *pods, *slots, *tiers[2];
} Inputs;

static void inputs_drop(Inputs *in) {
    Py_CLEAR(in->pods);
    Py_CLEAR(in->slots);
    Py_CLEAR(in->tiers[0]);
    Py_CLEAR(in->tiers[1]);
}

static int inputs_take(Inputs *in, PyObject *pods, PyObject *slots, PyObject *lengths) {
    PyObject *both = NULL;
    memset(in, 0, sizeof *in);
    if (!(in->pods = PySequence_Tuple(pods)) || !(in->slots = PySequence_Tuple(slots)) ||
        !(both = PySequence_Tuple(lengths)))
        goto fail;
    if (PyTuple_GET_SIZE(in->slots) != PyTuple_GET_SIZE(in->pods) || PyTuple_GET_SIZE(both) != 2) {
        PyErr_SetString(PyExc_ValueError, "one slot list a pod and two tiers' lengths expected");
        goto fail;
    }
    for (int t = 0; t < 2; t++) {
        if (!(in->tiers[t] = PySequence_Tuple(PyTuple_GET_ITEM(both, t)))) goto fail;
    }
    Py_DECREF(both);
    return 0;
fail:
    Py_XDECREF(both);
    inputs_drop(in);
    return -1;
}

/* Pod i's slots, one a tier (a list or tuple of two): borrowed from in->slots. */
static PyObject *pod_slots_of(Inputs *in, Py_ssize_t i) {
    PyObject *pod_slots = PyTuple_GET_ITEM(in->slots, i);
    if ((!PyList_Check(pod_slots) && !PyTuple_Check(pod_slots)) || PySequence_Fast_GET_SIZE(pod_slots) != 2) {
        PyErr_SetString(PyExc_ValueError, "a pod's slots are not one a tier");
        return NULL;
    }
    return pod_slots;
}

static int length_at(PyObject *tier, Py_ssize_t k, unsigned long long *v) {
    *v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tier, k));
    return *v == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* The most blocks a worker of tier t in pod_slots[t]'s slice holds (0 for none): *most; *has (where not
 * NULL), whether the slice holds any worker. */
static int slice_most(Inputs *in, PyObject *pod_slots, int t, unsigned long long *most, int *has) {
    Py_ssize_t a, e;
    if (slice_of(PySequence_Fast_GET_ITEM(pod_slots, t), PyTuple_GET_SIZE(in->tiers[t]), &a, &e)) return -1;
    *most = 0;
    if (has) *has = e > a;
    for (Py_ssize_t k = a; k < e; k++) {
        unsigned long long v;
        if (length_at(in->tiers[t], k, &v)) return -1;
        if (v > *most) *most = v;
    }
    return 0;
}

/* callable(arg) as a truth value: 1, 0, or -1 with its exception */
static int call_bool(PyObject *callable, PyObject *arg) {
    PyObject *r = PyObject_CallOneArg(callable, arg);
    if (!r) return -1;
    int ok = PyObject_IsTrue(r);
    Py_DECREF(r);
    return ok;
}

/* seed_answer(pods, slots, lengths, n_blocks, knows, unknown_message) ->
 *     (body, best L1 ratio, best L3 ratio, candidates unknown)
 *
 * pods: the candidates, in the request's order; slots[i]: per tier (L1, L3) the (a, b) slice of
 * lengths[tier] that pod i's workers hold (a tier's lengths: blocks from block 0 each worker holds, the
 * native query's answer); n_blocks: the request's full blocks; knows(pod): whether a pod with no worker
 * in either tier was seen (called for those only); unknown_message: the message of a pod not seen.
 * Each tier's ratio: the longest run a worker of the pod holds over n_blocks (0.0 without blocks). The
 * body is the seed API's answer, as api/app.py writes it. */
static PyObject *seed_answer(PyObject *self, PyObject *args) {
    PyObject *pods_in, *slots_in, *lengths_in, *knows, *message;
    long long n_blocks;
    if (!PyArg_ParseTuple(args, "OOOLOU", &pods_in, &slots_in, &lengths_in, &n_blocks, &knows, &message))
        return NULL;
    if (!PyCallable_Check(knows)) {
        PyErr_SetString(PyExc_TypeError, "knows must be callable");
        return NULL;
    }
    Inputs in;
    if (inputs_take(&in, pods_in, slots_in, lengths_in)) return NULL;
    PyObject *result = NULL;
    Buf b = {NULL, 0, 0};
    double best[2] = {0.0, 0.0};
    Py_ssize_t unknown = 0, n = PyTuple_GET_SIZE(in.pods);
    RatioText cache[RATIO_SLOTS];
    memset(cache, 0, sizeof cache);
    if (PUT_LITERAL(&b, "{\"status\":0,\"message\":\"\",\"server_score_list\":[")) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pod = PyTuple_GET_ITEM(in.pods, i), *pod_slots = pod_slots_of(&in, i);
        if (!pod_slots) goto done;
        unsigned long long most[2];
        int known = 0;
        for (int t = 0; t < 2; t++) {
            int has;
            if (slice_most(&in, pod_slots, t, &most[t], &has)) goto done;
            known |= has;
            double ratio = has && n_blocks > 0 ? (double)most[t] / (double)n_blocks : 0.0;
            if (ratio > best[t]) best[t] = ratio;
        }
        if (!known && (known = call_bool(knows, pod)) < 0) goto done;
        unknown += !known;
        if (i && PUT_LITERAL(&b, ",")) goto done;
        if (PUT_LITERAL(&b, "{\"server_ip\":") || put_string(&b, pod)) goto done;
        if (PUT_LITERAL(&b, ",\"l1_hit_ratio\":") || put_ratio(&b, cache, most[0], n_blocks)) goto done;
        if (PUT_LITERAL(&b, ",\"l3_hit_ratio\":") || put_ratio(&b, cache, most[1], n_blocks)) goto done;
        if (PUT_LITERAL(&b, ",\"message\":") || (known ? PUT_LITERAL(&b, "\"\"") : put_string(&b, message))) goto done;
        if (PUT_LITERAL(&b, ",\"status\":0}")) goto done;
    }
    if (PUT_LITERAL(&b, "]}")) goto done;
    PyObject *body = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.len);
    if (body) result = Py_BuildValue("(Nddn)", body, best[0], best[1], unknown);
done:
    free(b.p);
    inputs_drop(&in);
    return result;
}

/* v in decimal at the end of tmp[24]: its first digit (snprintf takes 100-200 ns a number: most of an
 * answer of 1,000 pods) */
static char *u64_digits(char tmp[24], unsigned long long v) {
    char *p = tmp + 24;
    do {
        *--p = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return p;
}

static int put_u64(Buf *b, unsigned long long v) {
    char tmp[24], *p = u64_digits(tmp, v);
    return buf_put(b, p, (size_t)(tmp + 24 - p));
}

/* blocks * block_size, refused where it would not fit 64 bits (the Python path then answers) */
static int tokens_of(unsigned long long blocks, unsigned long long block_size, unsigned long long *out) {
    if (block_size && blocks > ULLONG_MAX / block_size) {
        PyErr_SetString(PyExc_OverflowError, "tokens past 64 bits");
        return -1;
    }
    *out = blocks * block_size;
    return 0;
}

/* An instance's entry, "pod":{...}, of a pod whose best rank holds ``best`` blocks and whose Mooncake
 * segment ``l3``; its ranks' "dp" from ``dp`` (written already, without its braces). */
static int put_instance(Buf *b, PyObject *pod, unsigned long long best, const char *dp, size_t dp_len,
                        unsigned long long l3, unsigned long long block_size) {
    unsigned long long t, l;
    if (tokens_of(best, block_size, &t) || tokens_of(l3, block_size, &l)) return -1;
    if (put_string(b, pod) || PUT_LITERAL(b, ":{\"longest_matched\":") || put_u64(b, t)) return -1;
    if (PUT_LITERAL(b, ",\"gpu\":") || put_u64(b, t) || PUT_LITERAL(b, ",\"dp\":{")) return -1;
    if (buf_put(b, dp, dp_len) || PUT_LITERAL(b, "},\"cpu\":") || put_u64(b, t)) return -1;
    if (PUT_LITERAL(b, ",\"disk\":") || put_u64(b, t) || PUT_LITERAL(b, ",\"l3\":") || put_u64(b, l)) return -1;
    return PUT_LITERAL(b, "}");
}

/* tiered_answer(pods, slots, ranks, lengths, block_size, allowed) -> body
 *
 * /query's answer (api/tiered_query.py ``answer``, Dynamo's response) from the native query's lengths
 * over every pod: pods, slots[i] (per tier, L1 and L3, the (a, b) slice of lengths[tier] of pod i's
 * workers) and ranks[i] (per tier, those workers' ranks, or masters) as ``CandidateWorkers`` holds them;
 * allowed: None, or a callable that says whether a pod with blocks may answer (``TierMatch.only``). The
 * L1 tier's media are one (no offload: the native query's condition), so a rank's gpu, cpu and disk
 * lengths are the same. Instances: the pods with L1 blocks in order, then those with only L3 blocks.
 * The pods are distinct, and so are each pod's ranks (``CandidateWorkers``: dict keys), as the Python
 * path's dicts make them; ``allowed`` is asked once for each pod with blocks. */
static PyObject *tiered_answer(PyObject *self, PyObject *args) {
    PyObject *pods_in, *slots_in, *ranks_in, *lengths_in, *allowed;
    long long signed_block_size;
    if (!PyArg_ParseTuple(args, "OOOOLO", &pods_in, &slots_in, &ranks_in, &lengths_in, &signed_block_size, &allowed))
        return NULL;
    if (signed_block_size < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative block size");
        return NULL;
    }
    unsigned long long block_size = (unsigned long long)signed_block_size;
    if (allowed != Py_None && !PyCallable_Check(allowed)) {
        PyErr_SetString(PyExc_TypeError, "allowed must be None or callable");
        return NULL;
    }
    Inputs in;
    if (inputs_take(&in, pods_in, slots_in, lengths_in)) return NULL;
    PyObject *ranks = NULL, *result = NULL;
    Buf scores = {NULL, 0, 0}, inst = {NULL, 0, 0}, dp = {NULL, 0, 0};
    unsigned long long *l3_of = NULL; /* per pod: its L3 blocks where it has no L1 blocks and may answer */
    Py_ssize_t n = PyTuple_GET_SIZE(in.pods);
    if (!(ranks = PySequence_Tuple(ranks_in))) goto done;
    if (PyTuple_GET_SIZE(ranks) != n) {
        PyErr_SetString(PyExc_ValueError, "one rank list a pod expected");
        goto done;
    }
    if (!(l3_of = calloc(n ? (size_t)n : 1, sizeof *l3_of))) {
        PyErr_NoMemory();
        goto done;
    }
    int first_score = 1, first_inst = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pod = PyTuple_GET_ITEM(in.pods, i), *pod_slots = pod_slots_of(&in, i);
        PyObject *pod_ranks = PyTuple_GET_ITEM(ranks, i);
        if (!pod_slots) goto done;
        if ((!PyList_Check(pod_ranks) && !PyTuple_Check(pod_ranks)) || PySequence_Fast_GET_SIZE(pod_ranks) != 2) {
            PyErr_SetString(PyExc_ValueError, "a pod's ranks are not one a tier");
            goto done;
        }
        /* its L1 ranks: read before ``allowed`` (Python) runs for this pod, not after */
        PyObject *l1_ranks = PySequence_Fast_GET_ITEM(pod_ranks, 0);
        if (!PyList_Check(l1_ranks) && !PyTuple_Check(l1_ranks)) {
            PyErr_SetString(PyExc_TypeError, "a pod's ranks are not a list");
            goto done;
        }
        Py_ssize_t a, e;
        if (slice_of(PySequence_Fast_GET_ITEM(pod_slots, 0), PyTuple_GET_SIZE(in.tiers[0]), &a, &e)) goto done;
        unsigned long long best = 0, l3, v;
        dp.len = 0;
        for (Py_ssize_t k = 0; k < e - a && k < PySequence_Fast_GET_SIZE(l1_ranks); k++) {
            if (length_at(in.tiers[0], a + k, &v)) goto done;
            if (!v) continue;
            PyObject *r = PySequence_Fast_GET_ITEM(l1_ranks, k);
            if (!PyLong_CheckExact(r)) {  /* (an __index__ would run Python here; a bool reads "True") */
                PyErr_SetString(PyExc_TypeError, "a rank is not an int");
                goto done;
            }
            long long rank = PyLong_AsLongLong(r);
            if (rank == -1 && PyErr_Occurred()) goto done;
            char tmp[24], *digits = u64_digits(tmp, rank < 0 ? 0ull - (unsigned long long)rank : (unsigned long long)rank);
            unsigned long long t;
            if (tokens_of(v, block_size, &t)) goto done;
            if ((dp.len && PUT_LITERAL(&dp, ",")) || PUT_LITERAL(&dp, "\"") || (rank < 0 && PUT_LITERAL(&dp, "-")) ||
                buf_put(&dp, digits, (size_t)(tmp + 24 - digits)) || PUT_LITERAL(&dp, "\":") || put_u64(&dp, t))
                goto done;
            if (v > best) best = v;
        }
        if (slice_most(&in, pod_slots, 1, &l3, NULL)) goto done;
        if (!best && !l3) continue;
        if (allowed != Py_None) {
            int ok = call_bool(allowed, pod);
            if (ok < 0) goto done;
            if (!ok) continue;
        }
        if (!best) {  /* only L3 blocks: after the pods with L1 blocks */
            l3_of[i] = l3;
            continue;
        }
        if (block_size) {  /* (its ranks' tokens, where not 0) */
            if ((!first_score && PUT_LITERAL(&scores, ",")) || put_string(&scores, pod) || PUT_LITERAL(&scores, ":{") ||
                buf_put(&scores, dp.p, dp.len) || PUT_LITERAL(&scores, "}"))
                goto done;
            first_score = 0;
        }
        if ((!first_inst && PUT_LITERAL(&inst, ",")) || put_instance(&inst, pod, best, dp.p, dp.len, l3, block_size))
            goto done;
        first_inst = 0;
    }
    for (Py_ssize_t i = 0; i < n && block_size; i++) {  /* (no tokens, no dp: no entry) */
        if (!l3_of[i]) continue;
        if ((!first_inst && PUT_LITERAL(&inst, ",")) ||
            put_instance(&inst, PyTuple_GET_ITEM(in.pods, i), 0, "", 0, l3_of[i], block_size))
            goto done;
        first_inst = 0;
    }
    Buf out = {NULL, 0, 0};
    if (PUT_LITERAL(&out, "{\"scores\":{") || buf_put(&out, scores.p, scores.len) ||
        PUT_LITERAL(&out, "},\"frequencies\":[],\"instances\":{") || buf_put(&out, inst.p, inst.len) ||
        PUT_LITERAL(&out, "}}")) {
        free(out.p);
        goto done;
    }
    result = PyBytes_FromStringAndSize(out.p, (Py_ssize_t)out.len);
    free(out.p);
done:
    free(l3_of);
    free(scores.p);
    free(inst.p);
    free(dp.p);
    Py_XDECREF(ranks);
    inputs_drop(&in);
    return result;
}

static PyMethodDef methods[] = {
    {"tiered_answer", tiered_answer, METH_VARARGS,
     "tiered_answer(pods, slots, ranks, lengths, block_size, allowed) -> /query's answer"},
    {"seed_answer", seed_answer, METH_VARARGS,
     "seed_answer(pods, slots, lengths, n_blocks, knows, unknown_message) -> (body, best l1, best l3, unknown)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_answer_json", NULL, -1, methods};

PyMODINIT_FUNC PyInit__answer_json(void) { return PyModule_Create(&module); }
