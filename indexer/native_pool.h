/*
 * Query threads that never touch Python: native threads take jobs from a queue, run them and put them
 * on a done list, and wake the event loop through a pipe it watches (loop.add_reader).
 *
 * Why not Python threads (a ThreadPoolExecutor) running a call that releases the GIL: each job then
 * takes the GIL to start, to return and to post its result, while the event loop holds it for the HTTP
 * work and drops it on every socket call. Measured on 2 cores (32k-token requests under 16
 * connections), the GIL changing hands that often cost 0.3-0.4 ms of CPU a request, as much as the
 * query itself. These threads run C only: the loop prepares a job (with the GIL), a thread runs it
 * (without), the loop collects it (with), and the only cross-thread step is this queue.
 *
 * Pure C (no Python header): the job is a struct that embeds np_job first; run() is the caller's.
 */
#ifndef CACHE_INDEXER_NATIVE_POOL_H
#define CACHE_INDEXER_NATIVE_POOL_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct np_job {
    struct np_job *next;
} np_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    np_job *pending, *pending_tail; /* FIFO */
    np_job *done;                   /* any order: the caller matches jobs by their own key */
    int wake[2];                    /* a byte written when done turns non-empty */
    pthread_t *threads;
    size_t nthreads;
    int stopping;
    void (*run)(np_job *);
} np_pool;

static void *np_thread(void *arg) {
    np_pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->pending && !p->stopping) pthread_cond_wait(&p->cv, &p->mu);
        np_job *j = p->pending;
        if (p->stopping) { /* what is still queued goes back to the caller (np_stop) */
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        p->pending = j->next;
        if (!p->pending) p->pending_tail = NULL;
        pthread_mutex_unlock(&p->mu);

        p->run(j);

        pthread_mutex_lock(&p->mu);
        int was_empty = p->done == NULL;
        j->next = p->done;
        p->done = j;
        pthread_mutex_unlock(&p->mu);
        if (was_empty) {
            /* the loop drains the pipe before it takes the list, so a job put on a list it took after
             * this write is found by this byte, and one put on a list not yet taken by the byte before */
            ssize_t w;
            do w = write(p->wake[1], "", 1);
            while (w < 0 && errno == EINTR); /* EAGAIN: the pipe is full of wake-ups already */
        }
    }
}

static int np_pipe(int fds[2]) {
    if (pipe(fds) < 0) return -1;
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(fds[i], F_GETFL);
        if (fl < 0 || fcntl(fds[i], F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fds[i], F_SETFD, FD_CLOEXEC) < 0) {
            close(fds[0]);
            close(fds[1]);
            return -1;
        }
    }
    return 0;
}

static void np_join(np_pool *p) {
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (size_t i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    p->nthreads = 0;
}

static void np_submit(np_pool *p, np_job *j) {
    j->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->pending_tail) p->pending_tail->next = j;
    else p->pending = j;
    p->pending_tail = j;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* The jobs done so far (a list through next), the wake-up bytes read first. */
static np_job *np_take_done(np_pool *p) {
    char buf[256];
    while (read(p->wake[0], buf, sizeof buf) > 0) {
    }
    pthread_mutex_lock(&p->mu);
    np_job *d = p->done;
    p->done = NULL;
    pthread_mutex_unlock(&p->mu);
    return d;
}

/* Stops the threads (a job running is finished first, none is started), closes the pipe; returns every
 * job not yet taken, run or not (a list through next), for the caller to free. */
static np_job *np_stop(np_pool *p) {
    if (p->wake[0] < 0) return NULL;
    np_join(p);
    np_job *left = p->done;
    for (np_job *j = p->pending, *next; j; j = next) {
        next = j->next;
        j->next = left;
        left = j;
    }
    p->pending = p->pending_tail = p->done = NULL;
    free(p->threads);
    p->threads = NULL;
    close(p->wake[0]);
    close(p->wake[1]);
    p->wake[0] = p->wake[1] = -1;
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    return left;
}

/* 0, or -1 with errno: nothing is left to stop. */
static int np_start(np_pool *p, size_t threads, void (*run)(np_job *)) {
    memset(p, 0, sizeof *p);
    p->run = run;
    p->wake[0] = p->wake[1] = -1;
    if (np_pipe(p->wake) < 0) return -1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc(threads ? threads : 1, sizeof(pthread_t));
    int err = p->threads ? 0 : ENOMEM;
    for (size_t i = 0; !err && i < threads; i++) {
        err = pthread_create(&p->threads[i], NULL, np_thread, p);
        if (!err) p->nthreads++;
    }
    if (!err) return 0;
    np_stop(p); /* the threads started, stopped: no job was submitted */
    errno = err;
    return -1;
}

#endif
