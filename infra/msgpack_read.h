/* Bounded readers of msgpack headers over a byte range, shared by the C decoders of network bytes
 * (bridge/_vllm_decode.c, infra/_event_unpack.c). Each checks the bytes left before it reads; each that
 * fails (-1) may have moved past the header byte it looked at, so a caller that reads the value another
 * way after a failure puts the position back itself. Include after Python.h (Py_ssize_t). */
#ifndef CACHE_INDEXER_MSGPACK_READ_H
#define CACHE_INDEXER_MSGPACK_READ_H

#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p, *end;
} Rd;

/* 0 where n more bytes are there, else -1 */
static inline int need(const Rd *r, size_t n) { return (size_t)(r->end - r->p) >= n ? 0 : -1; }

/* n bytes big-endian (8: a hash, most of a batch's bytes, in one load) */
static inline uint64_t be(const unsigned char *p, int n) {
    if (n == 8) {
        uint64_t v;
        memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap64(v);
#endif
        return v;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* a length of n bytes, big-endian; -1: truncated */
static inline int64_t rd_len(Rd *r, int n) {
    if (need(r, (size_t)n)) return -1;
    int64_t v = (int64_t)be(r->p, n);
    r->p += n;
    return v;
}

/* an array's item count; -1: not an array, or truncated */
static inline int64_t rd_array(Rd *r) {
    if (need(r, 1)) return -1;
    unsigned c = *r->p++;
    if ((c & 0xf0) == 0x90) return c & 0x0f;
    if (c == 0xdc) return rd_len(r, 2);
    if (c == 0xdd) return rd_len(r, 4);
    return -1;
}

/* a map's pair count; -1: not a map, or truncated */
static inline int64_t rd_map(Rd *r) {
    if (need(r, 1)) return -1;
    unsigned c = *r->p++;
    if ((c & 0xf0) == 0x80) return c & 0x0f;
    if (c == 0xde) return rd_len(r, 2);
    if (c == 0xdf) return rd_len(r, 4);
    return -1;
}

/* a str's bytes (not validated); -1: not a str, or truncated */
static inline int rd_str(Rd *r, const char **s, Py_ssize_t *n) {
    if (need(r, 1)) return -1;
    unsigned c = *r->p++;
    int64_t len;
    if ((c & 0xe0) == 0xa0) len = c & 0x1f;
    else if (c == 0xd9) len = rd_len(r, 1);
    else if (c == 0xda) len = rd_len(r, 2);
    else if (c == 0xdb) len = rd_len(r, 4);
    else return -1;
    if (len < 0 || need(r, (size_t)len)) return -1;
    *s = (const char *)r->p;
    *n = (Py_ssize_t)len;
    r->p += len;
    return 0;
}

/* a float32 or float64, as a double; -1: not a float, or truncated (nothing read) */
static inline int rd_float(Rd *r, double *out) {
    if (need(r, 1)) return -1;
    int n = *r->p == 0xcb ? 8 : *r->p == 0xca ? 4 : 0;
    if (n == 0 || need(r, 1 + (size_t)n)) return -1;
    uint64_t bits = be(r->p + 1, n);
    r->p += 1 + n;
    if (n == 8) {
        memcpy(out, &bits, 8);
    } else {
        uint32_t bits32 = (uint32_t)bits;
        float f;
        memcpy(&f, &bits32, 4);
        *out = (double)f;
    }
    return 0;
}

/* 1 (and past it) where a nil is next, else 0 */
static inline int take_nil(Rd *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* an integer of any width as its 64-bit pattern, and whether it is negative; -1: not an integer, or
 * truncated */
static inline int rd_int(Rd *r, uint64_t *u, int *neg) {
    if (need(r, 1)) return -1;
    unsigned c = *r->p++;
    *neg = 0;
    if (c <= 0x7f) { *u = c; return 0; }
    if (c >= 0xe0) { *u = (uint64_t)(int64_t)(int8_t)c; *neg = 1; return 0; }
    int n;
    int sign;
    switch (c) {
    case 0xcc: n = 1; sign = 0; break;
    case 0xcd: n = 2; sign = 0; break;
    case 0xce: n = 4; sign = 0; break;
    case 0xcf: n = 8; sign = 0; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: return -1;
    }
    if (need(r, (size_t)n)) return -1;
    uint64_t v = be(r->p, n);
    r->p += n;
    if (sign && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~(uint64_t)0 << (8 * n);  /* sign-extend */
    *u = v;
    *neg = sign && (int64_t)v < 0;
    return 0;
}

#endif
