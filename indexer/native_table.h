/*
 * The native block table and the hit-rate query over it, in plain C (no Python): included by
 * indexer/_native_index.c, which adds the Python type and the locking (the ThreadSanitizer job of
 * .ci/native runs its tests with threads).
 *
 * A chunk maps a block hash to the mask of the 64 workers (ids 64c .. 64c+63) holding it. A chunk is
 * NT_SEGS segments, the hash's mixed top bits choosing one: each an open-addressing table (linear
 * probing over 16-byte slots, an empty slot has key 0, the hash 0 held aside by the chunk; deletion
 * shifts the following entries back, no tombstones). A segment grows on its own, so growing costs what
 * one segment holds, not the chunk: one table of 1.6M hashes (64 workers x 25k blocks) took 35 ms to
 * grow, on the event loop, in the middle of a store. The capacity is any size (a slot is found by
 * multiplying, not masking), so it grows by half, not double: the load stays within 7/12 .. 7/8 (1/32
 * after removals, when it shrinks), about 22 bytes a distinct hash.
 */
#ifndef CACHE_INDEXER_NATIVE_TABLE_H
#define CACHE_INDEXER_NATIVE_TABLE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../schemas/_blockhash_core.h"

#define NT_MAX_WORKERS (1 << 16)
#define NT_MIN_CAP 16
#define NT_SEG_BITS 8
#define NT_SEGS (1 << NT_SEG_BITS)
#define NT_MIX 0x9E3779B97F4A7C15ULL
#define NT_PF_AHEAD 8 /* keys: how far ahead a store, removal or clear asks for the slots it will probe */

/* NT_DEBUG (the sanitizer builds of .ci/native): the table's invariants checked at every access. */
#ifdef NT_DEBUG
#include <stdio.h>
#define NT_ASSERT(cond)                                                                  \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "native_table.h:%d: invariant failed: %s\n", __LINE__, #cond); \
            abort();                                                                     \
        }                                                                                \
    } while (0)
#else
#define NT_ASSERT(cond) ((void)0)
#endif

/* The allocations of the table's writer (the event loop: never a query thread), which a test can make
 * fail after a number of them (nt_fail_after >= 0) to check that a failed store changes nothing. */
static long long nt_fail_after = -1;

static inline int nt_alloc_fails(void) {
    if (nt_fail_after < 0) return 0;
    if (nt_fail_after == 0) return 1;
    nt_fail_after--;
    return 0;
}

static void *nt_calloc(size_t n, size_t size) { return nt_alloc_fails() ? NULL : calloc(n, size); }

static void *nt_realloc(void *p, size_t size) { return nt_alloc_fails() ? NULL : realloc(p, size); }

typedef struct {
    uint64_t key, mask;
} nt_slot;

typedef struct {
    nt_slot *slots;
    size_t cap; /* slots, or 0 */
    size_t used; /* slots with a key */
} nt_seg;

typedef struct {
    nt_seg *segs; /* NT_SEGS of them, or NULL before the first key */
    size_t used; /* keys in the segments */
    size_t slots; /* slots in the segments */
    int has_zero;
    uint64_t zero_mask;
} nt_chunk;

typedef struct {
    uint64_t *hashes; /* what the worker stored; may still list hashes removed since (see nt_compact) */
    size_t len, cap;
    uint64_t count; /* blocks held */
    uint64_t epoch; /* clears so far */
} nt_worker;

typedef struct {
    nt_chunk *chunks;
    size_t nchunks;
    nt_worker *workers;
    size_t nworkers;
    uint64_t entries; /* (block, worker) pairs */
    uint64_t clear_visits; /* hashes looked at by clears so far: what a clear costs (tests check its shape) */
    uint64_t distinct_scans; /* nt_distinct calls so far: each walks the table (tests keep gauges off it) */
    uint64_t grown_slots; /* slots moved by growing segments so far: what stores paused for (tests check it) */
} nt_table;

/* The segment of a key: the top bits of its mixed bits (the rest place it within the segment). */
static inline size_t nt_seg_index(uint64_t key) { return (size_t)((key * NT_MIX) >> (64 - NT_SEG_BITS)); }

static inline nt_seg *nt_seg_of(const nt_chunk *ch, uint64_t key) {
    return ch->segs ? &ch->segs[nt_seg_index(key)] : NULL;
}

/* The first slot probed for key: the mixed bits below the segment's, scaled to the capacity (Lemire's
 * reduction). */
static inline size_t nt_home(const nt_seg *sg, uint64_t key) {
    return (size_t)(((unsigned __int128)((key * NT_MIX) << NT_SEG_BITS) * sg->cap) >> 64);
}

static inline size_t nt_next(const nt_seg *sg, size_t i) { return i + 1 == sg->cap ? 0 : i + 1; }

/* Slots from a forward to b, around the end. */
static inline size_t nt_dist(const nt_seg *sg, size_t a, size_t b) { return b >= a ? b - a : b + sg->cap - a; }

static nt_slot *nt_find(const nt_seg *sg, uint64_t key) { /* key != 0 */
    if (!sg || !sg->cap) return NULL;
    size_t i = nt_home(sg, key);
    for (;;) {
        nt_slot *s = &sg->slots[i];
        if (s->key == key) return s;
        if (!s->key) return NULL;
        i = nt_next(sg, i);
    }
}

static int nt_rehash(nt_chunk *ch, nt_seg *sg, size_t cap) {
    nt_slot *slots = nt_calloc(cap, sizeof(nt_slot));
    if (!slots) return -1;
    nt_seg next = {.slots = slots, .cap = cap, .used = sg->used};
    for (size_t i = 0; i < sg->cap; i++) {
        if (!sg->slots[i].key) continue;
        size_t j = nt_home(&next, sg->slots[i].key);
        while (slots[j].key) j = nt_next(&next, j);
        slots[j] = sg->slots[i];
    }
    free(sg->slots);
    ch->slots += cap - sg->cap;
    *sg = next;
    return 0;
}

/* The capacity segment g takes to hold `want` keys: the smallest of NT_MIN_CAP * 1.5^(k + g / NT_SEGS)
 * (k = 0, 1, ...) at load 7/8 or less. The hash spreads keys evenly over the segments, so segments of
 * one size would all fill up, and grow, within the same few stores: a whole chunk moved at once (48 ms at
 * 1.6M hashes, worse than one table). Sizes a fraction of a step apart spread the growths evenly. */
static size_t nt_cap_for(size_t g, size_t want) {
    double cap = NT_MIN_CAP;
    for (size_t i = 0; i < g; i++) cap *= 1.0015851; /* 1.5^(1/256) */
    while (cap * 7 < (double)want * 8) cap *= 1.5;
    return (size_t)cap + 1;
}

/* Room for `want` keys in the segment without growing (a load or a store grows it first, in one step). */
static int nt_room(nt_table *t, nt_chunk *ch, nt_seg *sg, size_t want) {
    if (want * 8 <= sg->cap * 7) return 0;
    t->grown_slots += sg->cap;
    return nt_rehash(ch, sg, nt_cap_for((size_t)(sg - ch->segs), want));
}

static int nt_segs_alloc(nt_chunk *ch) {
    if (!ch->segs) ch->segs = nt_calloc(NT_SEGS, sizeof(nt_seg));
    return ch->segs ? 0 : -1;
}

static nt_slot *nt_insert(nt_table *t, nt_chunk *ch, uint64_t key) { /* key != 0; NULL: out of memory */
    if (nt_segs_alloc(ch) < 0) return NULL;
    nt_seg *sg = nt_seg_of(ch, key);
    if (nt_room(t, ch, sg, sg->used + 1) < 0) return NULL;
    size_t i = nt_home(sg, key);
    for (;;) {
        nt_slot *s = &sg->slots[i];
        if (s->key == key) return s;
        if (!s->key) {
            s->key = key;
            s->mask = 0;
            sg->used++;
            ch->used++;
            return s;
        }
        i = nt_next(sg, i);
    }
}

static void nt_delete(nt_chunk *ch, nt_seg *sg, nt_slot *s) {
    size_t i = (size_t)(s - sg->slots), j = i;
    for (;;) {
        j = nt_next(sg, j);
        if (!sg->slots[j].key) break;
        size_t k = nt_home(sg, sg->slots[j].key);
        if (nt_dist(sg, k, j) >= nt_dist(sg, i, j)) { /* the hole lies on j's probe path: move it back */
            sg->slots[i] = sg->slots[j];
            i = j;
        }
    }
    sg->slots[i].key = sg->slots[i].mask = 0;
    sg->used--;
    ch->used--;
    if (!sg->used) { /* an empty segment holds nothing, an empty chunk no segments */
        free(sg->slots);
        ch->slots -= sg->cap;
        sg->slots = NULL;
        sg->cap = 0;
        if (!ch->used) {
            free(ch->segs);
            ch->segs = NULL;
        }
    } else if (sg->cap > NT_MIN_CAP && sg->used * 32 < sg->cap) { /* fails: stays larger */
        nt_rehash(ch, sg, nt_cap_for((size_t)(sg - ch->segs), sg->used * 7));
    }
}

static inline uint64_t nt_chunk_get(const nt_chunk *ch, uint64_t key) {
    if (!key) return ch->has_zero ? ch->zero_mask : 0;
    const nt_slot *s = nt_find(nt_seg_of(ch, key), key);
    return s ? s->mask : 0;
}

/* mask |= bits; the mask before in *prev. -1: out of memory. */
static int nt_chunk_or(nt_table *t, nt_chunk *ch, uint64_t key, uint64_t bits, uint64_t *prev) {
    if (!key) {
        *prev = ch->has_zero ? ch->zero_mask : 0;
        ch->has_zero = 1;
        ch->zero_mask |= bits;
        return 0;
    }
    nt_slot *s = nt_insert(t, ch, key);
    if (!s) return -1;
    *prev = s->mask;
    s->mask |= bits;
    return 0;
}

/* mask &= ~bits, the entry going when nobody is left; returns the mask before. */
static uint64_t nt_chunk_andnot(nt_chunk *ch, uint64_t key, uint64_t bits) {
    if (!key) {
        uint64_t prev = ch->has_zero ? ch->zero_mask : 0;
        ch->zero_mask &= ~bits;
        ch->has_zero = ch->zero_mask != 0;
        return prev;
    }
    nt_seg *sg = nt_seg_of(ch, key);
    nt_slot *s = nt_find(sg, key);
    if (!s) return 0;
    uint64_t prev = s->mask;
    s->mask &= ~bits;
    if (!s->mask) nt_delete(ch, sg, s);
    return prev;
}

/* Asks for the slot a key starts its probe at (a walk over many keys fetches some ahead). */
static inline void nt_prefetch_key(const nt_chunk *ch, uint64_t key) {
    const nt_seg *sg = nt_seg_of(ch, key);
    if (sg && sg->cap) __builtin_prefetch(&sg->slots[nt_home(sg, key)]);
}

static inline size_t nt_chunk_size(const nt_chunk *ch) { return ch->used + (ch->has_zero != 0); }

/* A walk over a chunk's entries: start with {0}, call nt_chunk_next until it returns 0. */
typedef struct {
    size_t seg, i;
} nt_iter;

static inline int nt_chunk_next(const nt_chunk *ch, nt_iter *it, uint64_t *key, uint64_t *mask) {
    for (; ch->segs && it->seg < NT_SEGS; it->seg++, it->i = 0) {
        const nt_seg *sg = &ch->segs[it->seg];
        while (it->i < sg->cap) {
            const nt_slot *s = &sg->slots[it->i++];
            if (s->key) {
                *key = s->key;
                *mask = s->mask;
                return 1;
            }
        }
    }
    if (it->seg <= NT_SEGS && ch->has_zero) { /* the hash 0 last */
        it->seg = NT_SEGS + 1;
        *key = 0;
        *mask = ch->zero_mask;
        return 1;
    }
    it->seg = NT_SEGS + 1;
    return 0;
}

static void nt_init(nt_table *t) { memset(t, 0, sizeof *t); }

static void nt_free(nt_table *t) {
    for (size_t c = 0; c < t->nchunks; c++) {
        nt_chunk *ch = &t->chunks[c];
        for (size_t g = 0; ch->segs && g < NT_SEGS; g++) free(ch->segs[g].slots);
        free(ch->segs);
    }
    for (size_t w = 0; w < t->nworkers; w++) free(t->workers[w].hashes);
    free(t->chunks);
    free(t->workers);
    nt_init(t);
}

/* Whether wid names a worker slot of the table. The one growth path below keeps nworkers a whole number
 * of chunks (nworkers == 64 * nchunks), so a worker id within nworkers always has its chunk: a removal,
 * a clear or a lookup for a worker that never stored in this table (interned through another tier, or
 * whose first event is a removal) is bounded by the same test as a store. */
static inline int nt_has_worker(const nt_table *t, uint64_t wid) {
    NT_ASSERT(t->nworkers == 64 * t->nchunks);
    return wid < t->nworkers;
}

static inline nt_chunk *nt_chunk_of(const nt_table *t, uint32_t wid) {
    NT_ASSERT(wid < t->nworkers && (wid >> 6) < t->nchunks);
    return &t->chunks[wid >> 6];
}

/* Room for worker wid: workers and chunks grow together, by doubling, in whole chunks. 0, or -1 (out of
 * memory, or wid >= NT_MAX_WORKERS, which the callers refuse first): the table is as it was. */
static int nt_ensure_worker(nt_table *t, uint32_t wid) {
    if (wid < t->nworkers) return 0;
    if (wid >= NT_MAX_WORKERS) return -1;
    size_t n = (size_t)wid + 1;
    if (n < t->nworkers * 2) n = t->nworkers * 2;
    n = (n + 63) & ~(size_t)63;
    if (n > NT_MAX_WORKERS) n = NT_MAX_WORKERS;
    nt_chunk *c = nt_realloc(t->chunks, n / 64 * sizeof(nt_chunk));
    if (!c) return -1;
    t->chunks = c; /* (room for n / 64 chunks, of which nchunks are in use until the workers grow too) */
    nt_worker *w = nt_realloc(t->workers, n * sizeof(nt_worker));
    if (!w) return -1;
    memset(c + t->nchunks, 0, (n / 64 - t->nchunks) * sizeof(nt_chunk));
    memset(w + t->nworkers, 0, (n - t->nworkers) * sizeof(nt_worker));
    t->workers = w;
    t->nchunks = n / 64;
    t->nworkers = n;
    NT_ASSERT(t->nworkers == 64 * t->nchunks);
    return 0;
}

static int nt_reserve(nt_worker *w, size_t extra) { /* grows by half: 8 bytes an entry, about 10 with slack */
    if (w->len + extra <= w->cap) return 0;
    size_t cap = w->cap ? w->cap : 16;
    while (cap < w->len + extra) cap += cap / 2;
    uint64_t *h = nt_realloc(w->hashes, cap * 8);
    if (!h) return -1;
    w->hashes = h;
    w->cap = cap;
    return 0;
}

/* Stores hashes for worker wid; flags[i] = 1 where it held hashes[i] already. The number added, or -1:
 * out of memory, and then nothing of it stays applied (what it had added is taken out again: removing
 * never needs memory), so the caller can refuse the whole message. */
static long long nt_store(nt_table *t, uint32_t wid, const uint64_t *hs, size_t n, unsigned char *flags) {
    if (nt_ensure_worker(t, wid) < 0) return -1;
    nt_worker *w = &t->workers[wid];
    uint64_t bit = 1ULL << (wid & 63);
    nt_chunk *ch = nt_chunk_of(t, wid);
    long long added = 0;
    if (nt_reserve(w, n) < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        uint64_t prev;
        if (i + NT_PF_AHEAD < n) nt_prefetch_key(ch, hs[i + NT_PF_AHEAD]);
        if (nt_chunk_or(t, ch, hs[i], bit, &prev) < 0) {
            for (size_t j = 0; j < i; j++) /* the hashes this call added, in the order they were appended */
                if (!flags[j]) nt_chunk_andnot(ch, hs[j], bit);
            w->len -= (size_t)added;
            w->count -= (uint64_t)added;
            return -1;
        }
        flags[i] = (prev & bit) != 0;
        if (!flags[i]) {
            w->hashes[w->len++] = hs[i];
            w->count++;
            added++;
        }
    }
    t->entries += (uint64_t)added;
    return added;
}

/* Drops what the worker's array lists but no longer holds, and repeats: each hash held stays once. The
 * bit of each hash kept goes off at its first sight (so a repeat is dropped) and back on after: through
 * the slots found the first time (nothing moves meanwhile), not a second lookup of each key, where the
 * memory for their addresses can be had. */
static void nt_compact(nt_table *t, uint32_t wid) {
    nt_worker *w = &t->workers[wid];
    nt_chunk *ch = nt_chunk_of(t, wid);
    uint64_t bit = 1ULL << (wid & 63);
    nt_slot **found = malloc((w->len ? w->len : 1) * sizeof *found); /* NULL: looked up again */
    int zero = 0;
    size_t j = 0;
    for (size_t i = 0; i < w->len; i++) { /* the bit goes off at its first sight, so a repeat is dropped */
        if (i + NT_PF_AHEAD < w->len) nt_prefetch_key(ch, w->hashes[i + NT_PF_AHEAD]);
        uint64_t h = w->hashes[i];
        if (!h) {
            if (ch->has_zero && ch->zero_mask & bit) { w->hashes[j++] = h; ch->zero_mask &= ~bit; zero = 1; }
            continue;
        }
        nt_slot *s = nt_find(nt_seg_of(ch, h), h);
        if (s && s->mask & bit) {
            if (found) found[j] = s;
            w->hashes[j++] = h;
            s->mask &= ~bit; /* the slot stays while its key does */
        }
    }
    if (zero) ch->zero_mask |= bit; /* and back on */
    for (size_t i = 0; i < j; i++) {
        uint64_t h = w->hashes[i];
        if (!h) continue;
        if (found) found[i]->mask |= bit;
        else nt_find(nt_seg_of(ch, h), h)->mask |= bit;
    }
    free(found);
    w->len = j;
    if (w->cap > 64 && w->cap > 4 * j) {
        size_t cap = j * 2 > 16 ? j * 2 : 16;
        uint64_t *h = nt_realloc(w->hashes, cap * 8);
        if (h) { w->hashes = h; w->cap = cap; }
    }
}

static long long nt_remove(nt_table *t, uint32_t wid, const uint64_t *hs, size_t n) {
    if (!nt_has_worker(t, wid)) return 0;
    nt_worker *w = &t->workers[wid];
    uint64_t bit = 1ULL << (wid & 63);
    nt_chunk *ch = nt_chunk_of(t, wid);
    long long removed = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + NT_PF_AHEAD < n) nt_prefetch_key(ch, hs[i + NT_PF_AHEAD]);
        if (nt_chunk_andnot(ch, hs[i], bit) & bit) removed++;
    }
    w->count -= (uint64_t)removed;
    t->entries -= (uint64_t)removed;
    if (w->len > 2 * w->count + 64) nt_compact(t, wid);
    return removed;
}

static inline int nt_holds(const nt_table *t, uint32_t wid, uint64_t h) {
    return nt_has_worker(t, wid) && (nt_chunk_get(nt_chunk_of(t, wid), h) >> (wid & 63) & 1);
}

/* Every block of the worker goes; its epoch moves on, also for a worker that never stored here (its slot
 * is made for it), so that a query prepared before the clear never counts what a worker that reuses the
 * id stores after it. Returns how many it held. */
static uint64_t nt_clear(nt_table *t, uint32_t wid) {
    if (nt_ensure_worker(t, wid) < 0) return 0; /* out of memory: no slot, so no epoch to move */
    nt_worker *w = &t->workers[wid];
    nt_chunk *ch = nt_chunk_of(t, wid);
    uint64_t bit = 1ULL << (wid & 63), held = w->count;
    for (size_t i = 0; i < w->len; i++) {
        if (i + NT_PF_AHEAD < w->len) nt_prefetch_key(ch, w->hashes[i + NT_PF_AHEAD]);
        nt_chunk_andnot(ch, w->hashes[i], bit);
    }
    t->clear_visits += w->len;
    free(w->hashes);
    w->hashes = NULL;
    w->len = w->cap = 0;
    w->count = 0;
    w->epoch++;
    t->entries -= held;
    return held;
}

/* Adds a chunk's (key, mask) pairs (snapshots); 0, or -1 out of memory. */
static int nt_load(nt_table *t, size_t c, const uint64_t *keys, const uint64_t *masks, size_t n) {
    if (nt_ensure_worker(t, (uint32_t)(c * 64)) < 0) return -1;
    /* Room for all of them first, per segment: the keys come in the order of another table's slots, i.e.
     * sorted by home, and a segment that grows while such a run is inserted piles them into one cluster,
     * each probe longer than the last (2M entries over 1,000 workers: 22 s before, 0.07 s with the room
     * made). */
    nt_chunk *ch = &t->chunks[c];
    if (nt_segs_alloc(ch) < 0) return -1;
    size_t *count = nt_calloc(NT_SEGS, sizeof *count);
    if (!count) return -1;
    NT_ASSERT(c < t->nchunks);
    for (size_t i = 0; i < n; i++) count[nt_seg_index(keys[i])] += keys[i] && masks[i];
    int room = 0;
    for (size_t g = 0; g < NT_SEGS && !room; g++)
        if (count[g]) room = nt_room(t, ch, &ch->segs[g], ch->segs[g].used + count[g]);
    free(count);
    if (room < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        uint64_t prev, fresh;
        if (!masks[i]) continue;
        if (nt_chunk_or(t, ch, keys[i], masks[i], &prev) < 0) return -1;
        for (fresh = masks[i] & ~prev; fresh; fresh &= fresh - 1) {
            uint32_t wid = (uint32_t)(c * 64 + (unsigned)__builtin_ctzll(fresh));
            if (nt_ensure_worker(t, wid) < 0 || nt_reserve(&t->workers[wid], 1) < 0) return -1;
            nt_worker *w = &t->workers[wid];
            w->hashes[w->len++] = keys[i];
            w->count++;
            t->entries++;
        }
    }
    return 0;
}

/* Hashes held, counted once per chunk holding them: the distinct count itself up to 64 workers, at the
 * cost of one add per chunk. */
static uint64_t nt_per_chunk(const nt_table *t) {
    uint64_t n = 0;
    for (size_t c = 0; c < t->nchunks; c++) n += nt_chunk_size(&t->chunks[c]);
    return n;
}

/* Distinct hashes over all chunks (a hash held in two chunks counts once). Past one chunk this walks the
 * table and probes the chunks before each entry's own: 0.25 s at 2M entries over 1,000 workers, so
 * nothing periodic may call it. */
static uint64_t nt_distinct(nt_table *t) {
    t->distinct_scans++;
    uint64_t n = t->nchunks ? nt_chunk_size(&t->chunks[0]) : 0;
    for (size_t c = 1; c < t->nchunks; c++) {
        const nt_chunk *ch = &t->chunks[c];
        nt_iter it = {0};
        uint64_t key, mask;
        while (nt_chunk_next(ch, &it, &key, &mask)) {
            size_t d = 0;
            while (d < c && !nt_chunk_get(&t->chunks[d], key)) d++;
            n += d == c;
        }
    }
    return n;
}

static uint64_t nt_bytes(const nt_table *t) {
    uint64_t n = t->nchunks * sizeof(nt_chunk) + t->nworkers * sizeof(nt_worker);
    for (size_t c = 0; c < t->nchunks; c++) {
        const nt_chunk *ch = &t->chunks[c];
        if (ch->segs) n += NT_SEGS * sizeof(nt_seg) + ch->slots * sizeof(nt_slot);
    }
    for (size_t w = 0; w < t->nworkers; w++) n += t->workers[w].cap * 8;
    return n;
}

/* -- the query --------------------------------------------------------------------------------------- */
#define NT_MAX_TIERS 4

typedef struct {
    const uint64_t *tokens;
    size_t n_tokens, bs;
    int cbor;
    const unsigned char *pre; /* the parent of block 0, then digests of blocks given: 32 bytes each */
    size_t npre; /* digests in pre, the parent included */
    int ntiers;
    const nt_table *tables[NT_MAX_TIERS]; /* NULL: a tier without a table */
    const uint64_t *pairs[NT_MAX_TIERS]; /* (wid, epoch) of each candidate worker */
    size_t npairs[NT_MAX_TIERS];
    const bh_libcrypto *crypto;
    bh_memo *memo; /* the calling thread's memo of digests, or NULL */
} nt_query_in;

typedef struct {
    size_t hashed;
} nt_query_out;

/* A candidate worker the query can count: known to the table, not cleared since the caller looked. */
static inline int nt_candidate(const nt_table *tb, uint64_t wid, uint64_t epoch) {
    return tb && nt_has_worker(tb, wid) && tb->workers[wid].epoch == epoch;
}

#define NT_AHEAD 6 /* blocks: how far ahead the query fetches (memo slots twice as far) */
#define NT_RING 16 /* > 2 * NT_AHEAD, a power of two */

/* A block's key: the last 8 bytes of its digest, big-endian (vLLM's int.from_bytes of the digest,
 * reduced to 64 bits). */
static inline uint64_t nt_digest_key(const unsigned char *digest) {
    uint64_t key = 0;
    for (int b = 24; b < 32; b++) key = key << 8 | digest[b];
    return key;
}

/* Asks for what the walk will read for a block whose memo slot is s: the message there, and the index's
 * home slots of the digest there in every chunk still alive (wrong guesses cost only the fetch). */
static inline void nt_prefetch(const nt_query_in *in, uint64_t *const *alive, const bh_memo_slot *s) {
    if (!s->msg) return;
    __builtin_prefetch(s->msg);
    __builtin_prefetch(s->msg + 64);
    uint64_t key = nt_digest_key(s->digest);
    for (int t = 0; t < in->ntiers; t++) {
        const nt_table *tb = in->tables[t];
        size_t nch = tb ? tb->nchunks : 0;
        for (size_t c = 0; c < nch; c++) {
            if (alive[t][c]) nt_prefetch_key(&tb->chunks[c], key);
        }
    }
}

/* lengths[t][i]: consecutive blocks from 0 that candidate i of tier t holds. 0, or -1 out of memory,
 * -2 a block the encoder leaves to Python, -3 sha256 failed. The caller holds the tables' read locks. */
static int nt_query(const nt_query_in *in, uint64_t **lengths, nt_query_out *out) {
    int rc = 0, any = 0;
    uint64_t *alive[NT_MAX_TIERS] = {0}, *rec[NT_MAX_TIERS] = {0};
    unsigned char *buf = NULL;
    void *ctx = NULL;
    size_t n_blocks = in->n_tokens / in->bs, hashed = 0;
    for (int t = 0; t < in->ntiers; t++) {
        const nt_table *tb = in->tables[t];
        size_t nch = tb ? tb->nchunks : 0;
        alive[t] = calloc(nch ? nch : 1, 8);
        rec[t] = calloc(nch ? nch * 64 : 1, 8);
        if (!alive[t] || !rec[t]) { rc = -1; goto done; }
        for (size_t i = 0; i < in->npairs[t]; i++) {
            uint64_t wid = in->pairs[t][2 * i], epoch = in->pairs[t][2 * i + 1];
            if (nt_candidate(tb, wid, epoch)) {
                alive[t][wid >> 6] |= 1ULL << (wid & 63);
                any = 1;
            } else if (tb && wid >= tb->nworkers && !epoch) {
                any = 1; /* a worker the table has no slot for yet (never stored here, or a snapshot loaded without
                          * it): it holds nothing, but is asked, so block 0 is hashed, as the reference does */
            }
        }
    }
    if (!any || !n_blocks) goto finish;
    size_t cap = bh_block_capacity(32, in->bs);
    if (!cap) { rc = -2; goto done; }
    buf = malloc(cap);
    ctx = in->crypto->ctx_new();
    if (!buf || !ctx) { rc = -1; goto done; }
    unsigned char digest[32];
    const unsigned char *parent = in->pre;
    bh_memo *memo = in->memo;
    uint64_t ahead_keys[NT_RING], prefix = 0;
    for (size_t b = 0; b < 32 * in->npre; b++) prefix = (prefix ^ in->pre[b]) * 0x100000001B3ULL; /* salt too */
    size_t placed = 0; /* blocks whose memo slots were asked for */
    for (size_t i = 0; i < n_blocks; i++) {
        if (memo) {
            /* the memo slots of the blocks up to 2 * NT_AHEAD on; for the block NT_AHEAD on, its message
             * and (for the digest its slot holds) the index's slots */
            for (; placed < n_blocks && placed <= i + 2 * NT_AHEAD; placed++) {
                prefix = bh_prefix_key(prefix, in->tokens + placed * in->bs, in->bs);
                ahead_keys[placed % NT_RING] = prefix;
                const bh_memo_slot *pair = bh_memo_slot_of(memo, prefix);
                __builtin_prefetch(pair);
                __builtin_prefetch(pair + 1);
            }
            if (i + NT_AHEAD < placed)
                nt_prefetch(in, alive, bh_memo_slot_of(memo, ahead_keys[(i + NT_AHEAD) % NT_RING]));
        }
        if (i + 1 < in->npre) {
            parent = in->pre + 32 * (i + 1);
        } else {
            size_t len = bh_encode_block(buf, parent, 32, in->tokens + i * in->bs, in->bs, in->cbor);
            if (!len) { rc = -2; goto done; }
            bh_memo_slot *slot = memo ? bh_memo_slot_of(memo, ahead_keys[i % NT_RING]) : NULL;
            if (!bh_memo_sha256(memo, slot, in->crypto, ctx, buf, len, digest)) { rc = -3; goto done; }
            parent = digest;
        }
        uint64_t key = nt_digest_key(parent);
        any = 0;
        for (int t = 0; t < in->ntiers; t++) {
            const nt_table *tb = in->tables[t];
            size_t nch = tb ? tb->nchunks : 0;
            for (size_t c = 0; c < nch; c++) {
                uint64_t a = alive[t][c];
                if (!a) continue;
                uint64_t m = nt_chunk_get(&tb->chunks[c], key) & a;
                for (uint64_t dead = a & ~m; dead; dead &= dead - 1) rec[t][c * 64 + __builtin_ctzll(dead)] = i;
                alive[t][c] = m;
                any |= m != 0;
            }
        }
        hashed = i + 1; /* (the next block's encoding copies its parent before digest is written again) */
        if (!any) goto finish;
    }
    for (int t = 0; t < in->ntiers; t++) {
        size_t nch = in->tables[t] ? in->tables[t]->nchunks : 0;
        for (size_t c = 0; c < nch; c++)
            for (uint64_t a = alive[t][c]; a; a &= a - 1) rec[t][c * 64 + __builtin_ctzll(a)] = n_blocks;
    }
finish:
    for (int t = 0; t < in->ntiers; t++) {
        const nt_table *tb = in->tables[t];
        for (size_t i = 0; i < in->npairs[t]; i++) {
            uint64_t wid = in->pairs[t][2 * i], epoch = in->pairs[t][2 * i + 1];
            lengths[t][i] = nt_candidate(tb, wid, epoch) ? rec[t][wid] : 0;
        }
    }
    out->hashed = hashed;
done:
    if (ctx) in->crypto->ctx_free(ctx);
    free(buf);
    for (int t = 0; t < NT_MAX_TIERS; t++) { free(alive[t]); free(rec[t]); }
    return rc;
}

#endif
