/*
 * The GIL-free core of vLLM's block hashing, shared by the C accelerators (schemas/_blockhash.c, the
 * chain for Python callers; indexer/_native_index.c, the whole query off the GIL): no Python object is
 * touched here, so a caller may run it with the GIL released.
 *
 * - encode_block(): the exact bytes cbor2 (canonical) or pickle protocol 5 produce for vLLM's block
 *   tuple (parent_digest, tuple(tokens), None), for uint64 tokens;
 * - the sha256 digest straight from the libcrypto hashlib uses (dlopen'ed: no OpenSSL headers needed
 *   to build), with a context per caller, so threads can hash at once;
 * - parse_u64_array(): a JSON array of non-negative integers into uint64s, without Python ints.
 * The pure-Python hasher (schemas/block_hash.py) stays the reference; tests hold these equal to it.
 */
#ifndef CACHE_INDEXER_BLOCKHASH_CORE_H
#define CACHE_INDEXER_BLOCKHASH_CORE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <dlfcn.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* -- encoders ---------------------------------------------------------------------------------------- */
static inline uint64_t bh_to_big_endian(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return v;
#else
    return __builtin_bswap64(v);
#endif
}

static inline uint64_t bh_to_little_endian(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(v);
#else
    return v;
#endif
}

/* CBOR head: major type (0..7 << 5) with argument v, minimal length (canonical); returns the new end. */
static inline unsigned char *bh_cbor_head(unsigned char *w, unsigned char major, uint64_t v) {
    if (v < 24) { *w++ = major | (unsigned char)v; }
    else if (v < 0x100) { *w++ = major | 24; *w++ = (unsigned char)v; }
    else if (v < 0x10000) { *w++ = major | 25; *w++ = (unsigned char)(v >> 8); *w++ = (unsigned char)v; }
    else if (v < 0x100000000ULL) {
        *w++ = major | 26;
        for (int s = 24; s >= 0; s -= 8) *w++ = (unsigned char)(v >> s);
    } else {
        *w++ = major | 27;
        for (int s = 56; s >= 0; s -= 8) *w++ = (unsigned char)(v >> s);
    }
    return w;
}

/* Branch-free encoders for one non-negative token: token ids are random enough that the length
 * branches of the plain encoders mispredict about every other token, which cost more than the hash.
 * Each writes up to 9 bytes past w (the callers reserve 10 per token) and returns the new end. */
static inline unsigned char *bh_cbor_uint(unsigned char *w, uint64_t v) {
    static const unsigned char nbytes[5] = {0, 1, 2, 4, 8};
    unsigned c = (v >= 24) + (v >= 0x100) + (v >= 0x10000) + (v >= 0x100000000ULL);
    unsigned n = nbytes[c];
    w[0] = c ? (unsigned char)(23 + c) : (unsigned char)v; /* 24..27 = 1, 2, 4, 8 bytes follow */
    uint64_t be = bh_to_big_endian(n ? v << (64 - 8 * n) : 0);
    memcpy(w + 1, &be, 8);
    return w + 1 + n;
}

/* pickle BININT1 'K' / BININT2 'M' / BININT 'J' for 0 <= v <= 2**31-1 (the caller checks the bound). */
static inline unsigned char *bh_pickle_uint31(unsigned char *w, uint64_t v) {
    static const unsigned char op[3] = {'K', 'M', 'J'}, nbytes[3] = {1, 2, 4};
    unsigned c = (v >= 0x100) + (v >= 0x10000);
    w[0] = op[c];
    uint64_t le = bh_to_little_endian(v);
    memcpy(w + 1, &le, 8);
    return w + 1 + nbytes[c];
}

/* Bytes encode_block() may write for a block of bs tokens under a parent of plen bytes (0: too large). */
static inline size_t bh_block_capacity(size_t plen, size_t bs) {
    if (bs > (SIZE_MAX - 64 - plen) / 10) return 0;
    return 64 + plen + 10 * bs;
}

/* The serialised block tuple (parent, tuple(tokens), None) into out (bh_block_capacity bytes); its
 * length, or 0 where a pickle token needs LONG1 (> 2**31-1: left to the Python path). */
static inline size_t bh_encode_block(unsigned char *out, const unsigned char *parent, size_t plen,
                                     const uint64_t *tok, size_t bs, int cbor) {
    unsigned char *w = out;
    if (cbor) {
        *w++ = 0x83;
        w = bh_cbor_head(w, 0x40, (uint64_t)plen);
        memcpy(w, parent, plen);
        w += plen;
        w = bh_cbor_head(w, 0x80, (uint64_t)bs);
        for (size_t i = 0; i < bs; i++) w = bh_cbor_uint(w, tok[i]);
        *w++ = 0xf6;
        return (size_t)(w - out);
    }
    /* \x80\x05 \x95 <u64 frame len> | C <len> parent \x94 | tuple \x94 | N \x87 \x94 . */
    *w++ = 0x80; *w++ = 0x05; *w++ = 0x95;
    unsigned char *frame = w;
    w += 8;
    if (plen < 256) { *w++ = 'C'; *w++ = (unsigned char)plen; }
    else { *w++ = 'B'; for (int s = 0; s < 32; s += 8) *w++ = (unsigned char)(plen >> s); }
    memcpy(w, parent, plen);
    w += plen;
    *w++ = 0x94;
    if (bs > 3) *w++ = '(';
    for (size_t i = 0; i < bs; i++) {
        if (tok[i] > 2147483647ULL) return 0;
        w = bh_pickle_uint31(w, tok[i]);
    }
    if (bs > 3) *w++ = 't';
    else *w++ = (unsigned char)(0x84 + bs); /* TUPLE1..3 = 0x85..0x87 */
    *w++ = 0x94;
    *w++ = 'N'; *w++ = 0x87; *w++ = 0x94; *w++ = '.';
    uint64_t flen = (uint64_t)(w - frame - 8); /* everything after the length, STOP included */
    for (int s = 0; s < 8; s++) frame[s] = (unsigned char)(flen >> (8 * s));
    return (size_t)(w - out);
}

/* -- sha256 straight from libcrypto ------------------------------------------------------------------ */
typedef int (*bh_digest_init_fn)(void *ctx, const void *md, void *engine);
typedef int (*bh_digest_update_fn)(void *ctx, const void *data, size_t n);
typedef int (*bh_digest_final_fn)(void *ctx, unsigned char *out, unsigned int *n);
typedef void *(*bh_ctx_new_fn)(void);
typedef void (*bh_ctx_free_fn)(void *);

typedef struct {
    const void *md;
    bh_digest_init_fn init;
    bh_digest_update_fn update;
    bh_digest_final_fn final;
    bh_ctx_new_fn ctx_new;
    bh_ctx_free_fn ctx_free;
    int loaded; /* the functions resolved and "abc" hashed right */
} bh_libcrypto;

/* sha256 of data (ctx: a context of the caller's, from lc->ctx_new). libcrypto uses the CPU's SHA
 * extensions where there are any; what it costs beyond them is its set-up per message, small. */
static inline int bh_sha256(const bh_libcrypto *lc, void *ctx, const unsigned char *data, size_t n,
                            unsigned char out[32]) {
    unsigned int len = 0;
    return lc->init(ctx, lc->md, NULL) == 1 && lc->update(ctx, data, n) == 1 && lc->final(ctx, out, &len) == 1 &&
           len == 32;
}

/* Resolves sha256 in the libcrypto hashlib uses; lc->loaded says whether it works. */
static void bh_load_libcrypto(bh_libcrypto *lc) {
    memset(lc, 0, sizeof *lc);
#if defined(__linux__)
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so", NULL};
    void *h = NULL;
    for (int i = 0; names[i] && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    typedef void *(*fetch_fn)(void *, const char *, const char *);
    typedef const void *(*legacy_md_fn)(void);
    fetch_fn fetch = (fetch_fn)dlsym(h, "EVP_MD_fetch");     /* OpenSSL 3: fetched once, not per init */
    legacy_md_fn sha256 = (legacy_md_fn)dlsym(h, "EVP_sha256"); /* OpenSSL 1.1 */
    lc->ctx_new = (bh_ctx_new_fn)dlsym(h, "EVP_MD_CTX_new");
    lc->ctx_free = (bh_ctx_free_fn)dlsym(h, "EVP_MD_CTX_free");
    lc->init = (bh_digest_init_fn)dlsym(h, "EVP_DigestInit_ex");
    lc->update = (bh_digest_update_fn)dlsym(h, "EVP_DigestUpdate");
    lc->final = (bh_digest_final_fn)dlsym(h, "EVP_DigestFinal_ex");
    lc->md = fetch ? fetch(NULL, "SHA256", NULL) : NULL;
    if (!lc->md && sha256) lc->md = sha256();
    if (!lc->md || !lc->ctx_new || !lc->ctx_free || !lc->init || !lc->update || !lc->final) return;
    void *ctx = lc->ctx_new();
    if (!ctx) return;
    static const unsigned char abc[32] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
        0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    unsigned char out[32];
    lc->loaded = bh_sha256(lc, ctx, (const unsigned char *)"abc", 3, out) && memcmp(out, abc, 32) == 0;
    lc->ctx_free(ctx);
#endif
}

/* -- a memo of digests --------------------------------------------------------------------------------- */
/* Routers ask about the same prefixes again and again (a system prompt, a conversation's earlier turns):
 * a two-way memo of sha256(message), where a hit is the message itself (compared whole, so it is
 * exact), saves the hash where a block was asked about before. A pair of slots keeps the last two
 * messages that fell on it; messages are kept up to max_bytes in all, beyond which new ones are hashed
 * but not kept. One memo per thread: no locking.
 *
 * A block's pair is placed by a key of the request's tokens up to and including the block
 * (bh_prefix_key), not by its message: the message holds the parent's digest, known only once the
 * block before is done, while the tokens are known at once; so the query fetches the pairs of the
 * blocks ahead (and through them the messages and the index's slots) while it works on this one, and
 * the walk waits on memory once per window instead of three times a block. */
typedef struct {
    unsigned char *msg;
    uint32_t len, cap;
    unsigned char digest[32];
    unsigned char pad[16]; /* one cache line a slot */
} bh_memo_slot;

typedef struct {
    bh_memo_slot *slots; /* on cache lines, within raw */
    void *raw;
    size_t n; /* a power of two */
    size_t bytes, max_bytes;
    uint64_t hits, misses;
} bh_memo;

/* The placement key of a block from the key of the prefix before it (the first block's from its
 * parent's digest) and the block's tokens. Four independent lanes over the tokens, then one mix. */
static inline uint64_t bh_prefix_key(uint64_t prev, const uint64_t *tok, size_t n) {
    uint64_t a = 0x9E3779B97F4A7C15ULL, b = 0xC2B2AE3D27D4EB4FULL, c = 0x165667B19E3779F9ULL, d = n;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        a = (a ^ tok[i]) * 0xff51afd7ed558ccdULL;
        b = (b ^ tok[i + 1]) * 0xc4ceb9fe1a85ec53ULL;
        c = (c ^ tok[i + 2]) * 0xff51afd7ed558ccdULL;
        d = (d ^ tok[i + 3]) * 0xc4ceb9fe1a85ec53ULL;
    }
    for (; i < n; i++) a = (a ^ tok[i]) * 0xff51afd7ed558ccdULL;
    uint64_t h = prev ^ (a ^ (a >> 31)) ^ ((b ^ (b >> 29)) << 1) ^ ((c ^ (c >> 33)) << 2) ^ ((d ^ (d >> 30)) << 3);
    h = (h ^ (h >> 32)) * 0xd6e8feb86659fd93ULL;
    return h ^ (h >> 32);
}

/* Two slots a key (the newest first): two blocks of a request falling on one place both stay. */
static inline bh_memo_slot *bh_memo_slot_of(const bh_memo *memo, uint64_t prefix_key) {
    return &memo->slots[prefix_key & (memo->n - 2)];
}

/* sha256 of msg, from the pair of slots at s where it holds msg (s NULL: no memo); 0 where the hash
 * failed. A hit in the second slot moves it first; a miss takes the second slot's place (and buffer). */
static inline int bh_memo_sha256(bh_memo *memo, bh_memo_slot *s, const bh_libcrypto *lc, void *ctx,
                                 const unsigned char *msg, size_t len, unsigned char out[32]) {
    if (!s) return bh_sha256(lc, ctx, msg, len, out);
    for (int w = 0; w < 2; w++) {
        if (s[w].len == len && s[w].msg && !memcmp(s[w].msg, msg, len)) {
            memcpy(out, s[w].digest, 32);
            memo->hits++;
            if (w) {
                bh_memo_slot hit = s[1];
                s[1] = s[0];
                s[0] = hit;
            }
            return 1;
        }
    }
    memo->misses++;
    if (!bh_sha256(lc, ctx, msg, len, out)) return 0;
    bh_memo_slot fresh = s[1];
    s[1] = s[0];
    s[0] = fresh;
    if (len > UINT32_MAX) return 1;
    if (len > s->cap) {
        if (memo->bytes + (len - s->cap) > memo->max_bytes) { s->len = 0; return 1; } /* full: hashed, not kept */
        unsigned char *m = realloc(s->msg, len);
        if (!m) { s->len = 0; return 1; }
        memo->bytes += len - s->cap;
        s->msg = m;
        s->cap = (uint32_t)len;
    }
    memcpy(s->msg, msg, len);
    s->len = (uint32_t)len;
    memcpy(s->digest, out, 32);
    return 1;
}

/* A memo of n slots (a power of two, 2 at least) keeping up to max_bytes of messages; NULL where memory ran out. */
static inline bh_memo *bh_memo_new(size_t n, size_t max_bytes) {
    bh_memo *memo = calloc(1, sizeof *memo);
    if (!memo) return NULL;
    /* calloc, not aligned_alloc and memset: the pages stay untouched (not resident) until used */
    memo->raw = calloc(n + 1, sizeof(bh_memo_slot));
    if (!memo->raw) { free(memo); return NULL; }
    memo->slots = (bh_memo_slot *)(((uintptr_t)memo->raw + 63) & ~(uintptr_t)63);
    memo->n = n;
    memo->max_bytes = max_bytes;
    return memo;
}

static inline void bh_memo_free(bh_memo *memo) {
    if (!memo) return;
    for (size_t i = 0; i < memo->n; i++) free(memo->slots[i].msg);
    free(memo->raw);
    free(memo);
}

/* -- JSON token arrays ------------------------------------------------------------------------------- */
/* Up to 7 leading ASCII digits of the 8 bytes at p (SWAR): how many (8: all eight are digits, left to
 * the scalar loop) and, for 1..7, their value. A byte is a digit where neither byte + 0x46 nor byte -
 * 0x30 sets its top bit; carries and borrows only travel to later bytes, past the first non-digit. */
static inline unsigned bh_swar_digits(const unsigned char *p, uint64_t *value) {
    uint64_t v;
    memcpy(&v, p, 8);
    v = bh_to_little_endian(v);
    uint64_t nondigit = ((v + 0x4646464646464646ULL) | (v - 0x3030303030303030ULL)) & 0x8080808080808080ULL;
    if (!nondigit) return 8;
    unsigned n = (unsigned)__builtin_ctzll(nondigit) >> 3;
    if (!n) return 0;
    uint64_t d = (v - 0x3030303030303030ULL) << (8 * (8 - n)); /* the digits, as leading zeros pad them */
    d = d * 10 + (d >> 8);                                     /* pairs */
    d = (((d & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
         (((d >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
    *value = d;
    return n;
}

/* JSON's whitespace. */
static inline int bh_is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The digits at p (one at least) as a uint64 in *value: past them, or NULL where it is 2**64 or more. */
static inline const unsigned char *bh_long_digits(const unsigned char *p, const unsigned char *end, uint64_t *value) {
    uint64_t v = 0;
    const unsigned char *digits = p;
    while (p < end && *p >= '0' && *p <= '9' && p - digits < 19) v = v * 10 + (unsigned)(*p++ - '0');
    if (p < end && *p >= '0' && *p <= '9') { /* a 20th digit: the only place uint64 can overflow */
        unsigned d = *p - '0';
        if (v > (UINT64_MAX - d) / 10 || (p + 1 < end && p[1] >= '0' && p[1] <= '9')) return NULL;
        v = v * 10 + d;
        p++;
    }
    *value = v;
    return p;
}

/* Up to 7 leading digits of the bytes [p, end) (the bytes past end read as non-digits). */
static inline unsigned bh_swar_digits_near_end(const unsigned char *p, const unsigned char *end, uint64_t *value) {
    if (end - p >= 8) return bh_swar_digits(p, value);
    unsigned char tail[8] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' '};
    memcpy(tail, p, (size_t)(end - p));
    return bh_swar_digits(tail, value);
}

#if defined(__SSE2__)
/* 64 bytes at p as bit masks (bit i: byte i): digits, commas, JSON whitespace. */
static inline void bh_classify64(const unsigned char *p, uint64_t *digits, uint64_t *commas, uint64_t *ws) {
    uint64_t d = 0, c = 0, w = 0;
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(p + 16 * k));
        __m128i t = _mm_sub_epi8(x, _mm_set1_epi8('0'));
        __m128i isd = _mm_cmpeq_epi8(_mm_min_epu8(t, _mm_set1_epi8(9)), t); /* (byte - '0') <= 9, unsigned */
        __m128i isc = _mm_cmpeq_epi8(x, _mm_set1_epi8(','));
        __m128i isw = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\n'))),
                                   _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('\t')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\r'))));
        d |= (uint64_t)(uint16_t)_mm_movemask_epi8(isd) << (16 * k);
        c |= (uint64_t)(uint16_t)_mm_movemask_epi8(isc) << (16 * k);
        w |= (uint64_t)(uint16_t)_mm_movemask_epi8(isw) << (16 * k);
    }
    *digits = d;
    *commas = c;
    *ws = w;
}

static inline uint64_t bh_prefix_xor(uint64_t x) {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    x ^= x << 32;
    return x;
}

/* The usual token array, p at its '[': every byte inside is a digit, a comma or whitespace. The bytes
 * are classified 64 at a time into bit masks, so the numbers' places are known before any is read,
 * and each number is read from its place, independent of the one before (the scalar parser finds
 * where a number starts only once the one before it is read). The grammar is checked on the masks:
 * numbers and commas alternate, from a number to a number (a running parity of the two), no leading
 * zero. 1: parsed (*out, *count); 0: not the usual array, or not valid: the scalar parser decides and
 * says what is wrong; -1: out of memory. */
static int bh_parse_u64_fast(const unsigned char *p, const unsigned char *end, uint64_t **out, size_t *count) {
    const unsigned char *r = end;
    while (r > p && bh_is_ws(r[-1])) r--;
    if (r - p < 2 || r[-1] != ']') return 0;
    const unsigned char *in = p + 1, *stop = r - 1; /* the bytes between the brackets */
    size_t len = (size_t)(stop - in), n = 0;
    uint64_t *buf = len / 2 + 1 <= SIZE_MAX / 8 ? malloc((len / 2 + 1) * 8) : NULL; /* a number and its comma take two bytes at least */
    if (!buf) return -1;
    uint64_t prev_digit = 0, parity = 0; /* the last byte before this block a digit; events so far odd */
    for (size_t base = 0; base < len; base += 64) {
        uint64_t d, c, w;
        if (len - base >= 64) {
            bh_classify64(in + base, &d, &c, &w);
        } else {
            unsigned char last[64];
            memset(last, ' ', 64);
            memcpy(last, in + base, len - base);
            bh_classify64(last, &d, &c, &w);
        }
        uint64_t starts = d & ~(d << 1 | prev_digit);
        prev_digit = d >> 63;
        uint64_t events = starts | c, odd = bh_prefix_xor(events) ^ (0 - parity);
        if (~(d | c | w) || (starts & ~odd) || (c & odd)) goto slow; /* another byte; out of turn */
        parity = odd >> 63;
        for (; starts; starts &= starts - 1) {
            const unsigned char *q = in + base + (size_t)__builtin_ctzll(starts);
            uint64_t v = 0;
            unsigned k = bh_swar_digits_near_end(q, end, &v);
            if (k > 1 && *q == '0') goto slow; /* a leading zero */
            if (k == 8 && !bh_long_digits(q, end, &v)) goto slow; /* out of range */
            buf[n++] = v;
        }
    }
    if (n && !parity) goto slow; /* a comma last */
    *out = buf;
    *count = n;
    return 1;
slow:
    free(buf);
    return 0;
}
#endif

/* A JSON array of non-negative integers (no sign but -0, no fraction, exponent or other type) into a
 * malloc'ed uint64 array (*out, *count; free() it). NULL on success, else what is wrong, with *at the
 * byte offset; NULL with *out NULL and *count nonzero when memory ran out. */
static const char *bh_parse_u64_array(const unsigned char *p, size_t len, uint64_t **out, size_t *count,
                                      size_t *at) {
    const unsigned char *start = p, *end = p + len;
    uint64_t *buf = NULL;
    size_t n = 0, cap = 0;
    const char *err = NULL;
    *out = NULL;
    *count = 0;
#define BH_WS() while (p < end && bh_is_ws(*p)) p++
    BH_WS();
    if (p >= end || *p != '[') { err = "token_ids must be an array"; goto done; }
#if defined(__SSE2__)
    int fast = bh_parse_u64_fast(p, end, out, count);
    if (fast) {
        if (fast < 0) *count = 1;
        *at = len;
        return NULL;
    }
#endif
    p++;
    BH_WS();
    if (p < end && *p == ']') { p++; goto tail; }
    for (;;) {
        BH_WS();
        if (p >= end) { err = "unterminated token_ids array"; goto done; }
        if (*p == '-') { /* -0 is JSON's zero (json.loads and the contract take it); any other sign is not */
            if (p + 1 < end && p[1] == '0' && !(p + 2 < end && p[2] >= '0' && p[2] <= '9')) p++;
            else { err = "token_ids must be non-negative integers"; goto done; }
        }
        if (*p < '0' || *p > '9') { err = "token_ids must be integers"; goto done; }
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') { err = "invalid number in token_ids"; goto done; }
        uint64_t v = 0;
        const unsigned char *digits_at = p;
        unsigned short_digits = bh_swar_digits_near_end(p, end, &v);
        if (short_digits < 8) { /* the usual token: up to 7 digits, in a few instructions */
            p += short_digits;
            goto number_done;
        }
        p = bh_long_digits(p, end, &v);
        if (!p) { p = digits_at; err = "token id out of range"; goto done; }
    number_done:
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) { err = "token_ids must be integers"; goto done; }
        if (n == cap) {
            /* at most one token per two bytes of what is left, so one reservation usually does */
            size_t want = cap ? cap * 2 : (size_t)(end - p) / 2 + 1;
            uint64_t *nb = want <= SIZE_MAX / 8 ? realloc(buf, want * 8) : NULL;
            if (!nb) { free(buf); *count = 1; return NULL; }
            buf = nb;
            cap = want;
        }
        buf[n++] = v;
        BH_WS();
        if (p < end && *p == ',') { p++; continue; }
        if (p < end && *p == ']') { p++; break; }
        err = "invalid token_ids array";
        goto done;
    }
tail:
    BH_WS();
    if (p != end) err = "trailing data after token_ids";
done:
#undef BH_WS
    *at = (size_t)(p - start);
    if (err) { free(buf); return err; }
    *out = buf;
    *count = n;
    return NULL;
}

/* -- the request's token array within its body --------------------------------------------------------- */
#define BH_MAX_DEPTH 64

static const unsigned char *bh_ws(const unsigned char *p, const unsigned char *end) {
    while (p < end && bh_is_ws(*p)) p++;
    return p;
}

/* Past one JSON string starting at p ('"'); NULL where it does not end. *escaped: it holds a backslash. */
static const unsigned char *bh_skip_string(const unsigned char *p, const unsigned char *end, int *escaped) {
    for (p++; p < end; p++) {
        if (*p == '"') return p + 1;
        if (*p == '\\') {
            *escaped = 1;
            if (++p == end) return NULL; /* not one past the end: a backslash last */
        }
    }
    return NULL;
}

/* Past one JSON value (its syntax only loosely checked: the caller's decoder checks what is kept); NULL
 * where it is cut short or nested deeper than BH_MAX_DEPTH. */
static const unsigned char *bh_skip_value(const unsigned char *p, const unsigned char *end, int depth) {
    int escaped = 0;
    if (p >= end || depth > BH_MAX_DEPTH) return NULL;
    if (*p == '"') return bh_skip_string(p, end, &escaped);
    if (*p == '{' || *p == '[') {
        unsigned char close = *p == '{' ? '}' : ']';
        p = bh_ws(p + 1, end);
        if (p < end && *p == close) return p + 1;
        for (;;) {
            if (close == '}') {
                if (p >= end || *p != '"' || !(p = bh_skip_string(p, end, &escaped))) return NULL;
                p = bh_ws(p, end);
                if (p >= end || *p != ':') return NULL;
                p = bh_ws(p + 1, end);
            }
            if (!(p = bh_skip_value(p, end, depth + 1))) return NULL;
            p = bh_ws(p, end);
            if (p < end && *p == ',') { p = bh_ws(p + 1, end); continue; }
            if (p < end && *p == close) return p + 1;
            return NULL;
        }
    }
    const unsigned char *start = p; /* a number or literal: up to the next delimiter */
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') p++;
    return p > start ? p : NULL;
}

/* Past a member's key (p at its '"') and ':' to its value; NULL where the key is escaped or it is not a
 * member. */
static inline const unsigned char *bh_member(const unsigned char *p, const unsigned char *end,
                                             const unsigned char **key, size_t *klen) {
    int escaped = 0;
    const unsigned char *after = bh_skip_string(p, end, &escaped);
    if (!after || escaped) return NULL;
    *key = p + 1;
    *klen = (size_t)(after - 1 - *key);
    p = bh_ws(after, end);
    return p < end && *p == ':' ? bh_ws(p + 1, end) : NULL;
}

/* Where the token array is: under "body" (the seed's hit-rate request) or at the top (the ecosystem's
 * /query). */
#define BH_TOKENS_IN_BODY 1
#define BH_TOKENS_AT_TOP 2

/* The members of an object, p just past its '{', up to and past its '}' (NULL where it is not the plain
 * shape): where `mode` is BH_TOKENS_IN_BODY the "body" member is scanned as an object of depth 2 with the
 * token array among its members (mode 0); otherwise the array is a member of this object. The span of
 * the array goes to [*start, *stop), once: a second one is not the plain shape. */
static const unsigned char *bh_token_members(const unsigned char *p, const unsigned char *end,
                                             const unsigned char *begin, int mode, int depth, size_t *start,
                                             size_t *stop, int *found) {
    const unsigned char *key;
    size_t klen;
    int body_seen = 0;
    p = bh_ws(p, end);
    while (p < end && *p == '"') {
        if (!(p = bh_member(p, end, &key, &klen))) return NULL;
        if (mode == BH_TOKENS_IN_BODY && klen == 4 && !memcmp(key, "body", 4)) {
            if (body_seen++ || p >= end || *p != '{') return NULL;
            if (!(p = bh_token_members(p + 1, end, begin, 0, depth + 1, start, stop, found))) return NULL;
        } else if (mode != BH_TOKENS_IN_BODY && klen == 9 && !memcmp(key, "token_ids", 9)) {
            /* A flat array of numbers ends at its first ']'; one that is not flat fails the parse of
             * [start, stop), as the whole decode refuses it. A second token_ids, whatever its value, is not
             * the plain shape: the whole decode takes the last one (a fuzz run: an array, then a number). */
            if (p >= end || *p != '[') return NULL;
            const unsigned char *close = memchr(p, ']', (size_t)(end - p));
            if ((*found)++ || !close) return NULL;
            *start = (size_t)(p - begin);
            *stop = (size_t)(close + 1 - begin);
            p = close + 1;
        } else if (!(p = bh_skip_value(p, end, depth))) {
            return NULL;
        }
        p = bh_ws(p, end);
        if (p < end && *p == ',') { p = bh_ws(p + 1, end); continue; }
        break;
    }
    return p < end && *p == '}' ? p + 1 : NULL;
}

/* The span [*start, *stop) of the token array of a request (`mode`: BH_TOKENS_IN_BODY for the seed's
 * body.token_ids, BH_TOKENS_AT_TOP for /query's token_ids), found by one scan of its structure. 0 where
 * the request has the plain shape (each key once, none escaped, token_ids an array), else -1: the caller
 * decodes the request whole, and its decoder says what is wrong. */
static inline int bh_find_token_ids(const unsigned char *p, size_t len, int mode, size_t *start, size_t *stop) {
    const unsigned char *begin = p, *end = p + len;
    int found = 0;
    p = bh_ws(p, end);
    if (p >= end || *p != '{') return -1;
    if (!(p = bh_token_members(p + 1, end, begin, mode, 1, start, stop, &found))) return -1;
    p = bh_ws(p, end);
    return p == end && found ? 0 : -1;
}

#endif
