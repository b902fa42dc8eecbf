/* The eval callback's fast path in C (fastpath.py builds and loads it; observe.py's Tracer fills it).

   llama.cpp asks about every node of every graph. A graph of a kind already seen takes a path of its Tracer's trie
   node by node, each step one comparison of the node's struct bytes; the asks and the copies of that path are
   answered here, without entering Python, and so is every ask of an untraced decode (no). Anything else (the
   first node of a graph, a node that leaves the path, a step not mirrored yet, a fault hook, --local) is handed
   to the Python callback `py`, which maps the node and tells this code where the path stands (`cur`).

   A step is mirrored with the first child the Tracer followed (`next`): most graphs of a kind take one path, and
   a graph that leaves it goes to Python for that node, which may move `cur` to another child.

   Deferred copies (defer.py plans them): every yes to an ask ends one of llama.cpp's graph splits and costs a
   synchronization, so a read step planned DEFER is answered no and kept pending; its values stay where they are
   until the next FLUSH step, planned before any node that could overwrite them, where llama.cpp stops once and
   every pending value is copied. A pending node is flagged GGML_TENSOR_FLAG_OUTPUT until then, so that no backend
   fuses it into the node after it (a fused node's output is never written); the flag is put back at the copy.
   Copies of device memory go through `get_async` on a backend of the tracer's own, one wait per flush. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void (*get_fn)(const void *tensor, void *data, size_t offset, size_t size);   /* ggml_backend_tensor_get */
typedef void (*get_async_fn)(void *backend, const void *tensor, void *data, size_t offset, size_t size);
typedef void (*sync_fn)(void *backend);                                                /* ggml_backend_synchronize */
typedef size_t (*nbytes_fn)(const void *tensor);                                       /* ggml_nbytes */
typedef bool (*is_host_fn)(void *buffer);                                              /* ggml_backend_buffer_is_host */
typedef bool (*eval_fn)(void *tensor, bool ask, void *user_data);

enum { NONE = 0, FLUSH = 1, DEFER = 2 };
#define MAX_PENDING 32
#define MAX_BACKENDS 8
#define FLAG_OUTPUT 2                                                              /* GGML_TENSOR_FLAG_OUTPUT */
#define TYPE_I8 24                                                                 /* GGML_TYPE_I8 */
#define MERGE_GAP 32768         /* device values this close in one buffer are copied as one range (one call) */

typedef struct md_leaf {        /* a tensor read that is no node and may be renamed: its address and name */
    uintptr_t addr;
    char name[64];
} md_leaf;

typedef struct md_step {
    const unsigned char *raw;   /* the node's struct bytes, up to the backend's `extra` */
    const md_leaf *leaves;
    int32_t n_leaves;
    int32_t id;                 /* the Python step's index in Tracer.mirrored */
    int32_t read;               /* a site needs its values: NONE, FLUSH (answer yes, copy it and all pending at the
                                   observe) or DEFER (answer no, copy it at the next FLUSH) */
    int32_t host;               /* its values live in host memory: 1, device memory: 0, no buffer: -1 */
    void *dst;
    size_t nbytes;
    void *backend;              /* the backend its device memory is copied through asynchronously; NULL: `get` */
    struct md_step *next;       /* the first child; NULL: the fast path ends here */
} md_step;

typedef struct md_pending {
    void *tensor;
    md_step *step;
    int32_t flags;              /* the node's flags before it was marked an output */
    int32_t pad;
} md_pending;

typedef struct md_state {
    md_step *cur;               /* the last step of the path taken; NULL: Python's turn */
    md_step *due;               /* asked yes on the fast path: its observe comes next */
    void *due_tensor;
    eval_fn py;
    get_fn get;
    size_t raw_len, name_off;
    int32_t *observed;          /* ids of the steps observed on the fast path, in order */
    int32_t n_observed, max_observed;
    int32_t off, pad;           /* not tracing: every ask answered no here (as the Python callback would) */
    int64_t fast_asks, fast_observes, py_calls;
    /* deferred copies */
    get_async_fn get_async;
    sync_fn sync;
    nbytes_fn nbytes;
    is_host_fn is_host;
    const unsigned char *writes;    /* per ggml op value: 1 if the op writes its output (views write nothing) */
    size_t flags_off, op_off, buffer_off, data_off;
    void *forced;               /* a node Python was asked about while copies were pending: yes to flush them */
    int32_t forced_py, n_pending;
    md_pending pending[MAX_PENDING];
    int32_t *lost;              /* ids of deferred steps whose memory a node off the path may have overwritten */
    int32_t n_lost, max_lost;
    int64_t flushes, deferred, forced_flushes;
    /* a stop's device values that lie close together in one buffer are copied as one range into `scratch` (pinned),
       through a tensor struct made here over that range, then into their own buffers */
    unsigned char *scratch;
    size_t scratch_size, tensor_size, type_off, ne_off, nb_off;
    int64_t copies, merged_copies, copy_ns;
} md_state;

static bool same_leaves(const md_state *s, const md_step *n) {
    for (int32_t i = 0; i < n->n_leaves; i++) {
        const char *name = (const char *)(n->leaves[i].addr + s->name_off);
        if (strncmp(name, n->leaves[i].name, 64) != 0)
            return false;
    }
    return true;
}

static int32_t *flags_of(const md_state *s, void *t) { return (int32_t *)((char *)t + s->flags_off); }

static void *buffer_of(const md_state *s, void *t) { return *(void **)((char *)t + s->buffer_off); }

static uintptr_t data_of(const md_state *s, void *t) { return *(uintptr_t *)((char *)t + s->data_off); }

static void note_backend(md_state *s, void *b, void **used, int32_t *n_used) {
    for (int32_t i = 0; i < *n_used; i++)
        if (used[i] == b)
            return;
    if (*n_used < MAX_BACKENDS)
        used[(*n_used)++] = b;
    else
        s->sync(b);
}

typedef struct md_copy {        /* one value a stop copies */
    void *tensor;
    const md_step *step;
    uintptr_t p0;
    void *buffer;
} md_copy;

/* Copy values [i, j) of `c` (sorted by backend, buffer, address; device memory, one backend and buffer, each
   within MERGE_GAP of the range so far) as one range into scratch at `*at`; the values go to their own buffers
   after the wait (`spread`). A range that does not fit in the scratch is copied value by value. */
static int32_t copy_range(md_state *s, md_copy *c, int32_t i, int32_t j, size_t *at, void **used, int32_t *n_used) {
    uintptr_t r0 = c[i].p0, r1 = c[i].p0 + c[i].step->nbytes;
    for (int32_t k = i + 1; k < j; k++)
        if (c[k].p0 + c[k].step->nbytes > r1)
            r1 = c[k].p0 + c[k].step->nbytes;
    size_t n = (size_t)(r1 - r0);
    if (j - i == 1 || s->scratch == NULL || c[i].buffer == NULL || *at + n > s->scratch_size ||
        s->tensor_size > 512) {
        for (int32_t k = i; k < j; k++) {
            s->get_async(c[k].step->backend, c[k].tensor, c[k].step->dst, 0, c[k].step->nbytes);
            s->copies++;
        }
        note_backend(s, c[i].step->backend, used, n_used);
        return 0;
    }
    unsigned char range[512];   /* a 1-D int8 tensor over [r0, r1) in that buffer */
    memset(range, 0, sizeof range);
    *(int32_t *)(range + s->type_off) = TYPE_I8;
    *(void **)(range + s->buffer_off) = c[i].buffer;
    int64_t *ne = (int64_t *)(range + s->ne_off);
    size_t *nb = (size_t *)(range + s->nb_off);
    ne[0] = (int64_t)n, ne[1] = ne[2] = ne[3] = 1;
    nb[0] = 1, nb[1] = nb[2] = nb[3] = n;
    *(uintptr_t *)(range + s->data_off) = r0;
    s->get_async(c[i].step->backend, range, s->scratch + *at, 0, n);
    s->copies++;
    s->merged_copies += j - i;
    for (int32_t k = i; k < j; k++)   /* where each value lands in the scratch, for spread() */
        c[k].p0 = (uintptr_t)(s->scratch + *at + (c[k].p0 - r0));
    *at += (n + 63) & ~(size_t)63;
    note_backend(s, c[i].step->backend, used, n_used);
    return 1;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Copy every pending value (the scheduler has computed and synchronized them), then `due` (may be NULL), and wait
   for the asynchronous copies: the scheduler may overwrite their memory once this observe returns. */
static void flush(md_state *s, void *due_tensor, md_step *due) {
    int64_t t0 = now_ns();
    void *used[MAX_BACKENDS];
    int32_t n_used = 0, n = 0, merged[MAX_PENDING + 1];
    md_copy c[MAX_PENDING + 1];
    for (int32_t i = 0; i < s->n_pending; i++) {
        md_pending *p = &s->pending[i];
        *flags_of(s, p->tensor) = p->flags;
        c[n++] = (md_copy){p->tensor, p->step, data_of(s, p->tensor), buffer_of(s, p->tensor)};
        s->observed[s->n_observed++] = p->step->id;
    }
    if (due != NULL) {
        c[n++] = (md_copy){due_tensor, due, data_of(s, due_tensor), buffer_of(s, due_tensor)};
        s->observed[s->n_observed++] = due->id;
    }
    int32_t m = 0;              /* host memory (or no asynchronous copies): copied here, in order */
    for (int32_t i = 0; i < n; i++) {
        if (!c[i].step->nbytes)
            continue;
        if (c[i].step->backend == NULL || s->get_async == NULL) {
            s->get(c[i].tensor, c[i].step->dst, 0, c[i].step->nbytes);
            s->copies++;
        } else {
            c[m++] = c[i];
        }
    }
    for (int32_t i = 1; i < m; i++) {       /* device values by backend, buffer, address (insertion sort: m <= 33) */
        md_copy x = c[i];
        int32_t k = i - 1;
        while (k >= 0 && (c[k].step->backend > x.step->backend || (c[k].step->backend == x.step->backend &&
               (c[k].buffer > x.buffer || (c[k].buffer == x.buffer && c[k].p0 > x.p0))))) {
            c[k + 1] = c[k];
            k--;
        }
        c[k + 1] = x;
    }
    size_t at = 0;
    for (int32_t i = 0; i < m;) {
        int32_t j = i + 1;
        uintptr_t end = c[i].p0 + c[i].step->nbytes;
        while (j < m && c[j].step->backend == c[i].step->backend && c[j].buffer == c[i].buffer &&
               c[j].p0 <= end + MERGE_GAP) {
            if (c[j].p0 + c[j].step->nbytes > end)
                end = c[j].p0 + c[j].step->nbytes;
            j++;
        }
        int32_t in_scratch = copy_range(s, c, i, j, &at, used, &n_used);
        for (int32_t k = i; k < j; k++)
            merged[k] = in_scratch;
        i = j;
    }
    for (int32_t i = 0; i < n_used; i++)
        s->sync(used[i]);
    for (int32_t k = 0; k < m; k++)         /* values copied as part of a range: to their own buffers */
        if (merged[k])
            memcpy(c[k].step->dst, (const void *)c[k].p0, c[k].step->nbytes);
    s->n_pending = 0;
    s->flushes++;
    s->copy_ns += now_ns() - t0;
}

/* A node off the planned path arrives while copies are pending: llama.cpp computes it together with them, since
   they are still in the same split. A pending value it may overwrite (its output overlaps, or it lives on the other
   side of host and device, another split) is given up (`lost`): its site is not observed in this graph. */
static void give_up_overlapped(md_state *s, void *t) {
    size_t n = s->nbytes(t);
    uintptr_t w0 = data_of(s, t), w1 = w0 + n;
    int32_t op = *(int32_t *)((char *)t + s->op_off);
    bool writes = n > 0 && (op < 0 || op > 255 || s->writes[op]);
    void *buf = buffer_of(s, t);
    int32_t host = buf != NULL && s->is_host(buf);
    int32_t kept = 0;
    for (int32_t i = 0; i < s->n_pending; i++) {
        md_pending p = s->pending[i];
        uintptr_t p0 = data_of(s, p.tensor), p1 = p0 + p.step->nbytes;
        if ((writes && w0 < p1 && p0 < w1) || (buf != NULL && p.step->host >= 0 && host != p.step->host)) {
            *flags_of(s, p.tensor) = p.flags;
            if (s->n_lost < s->max_lost)
                s->lost[s->n_lost++] = p.step->id;
        } else {
            s->pending[kept++] = p;
        }
    }
    s->n_pending = kept;
}

/* Python's turn for node t (a node off the path, or no room): with copies pending, the answer is yes whatever
   Python says, and they are copied at t's observe. */
static bool to_python(md_state *s, void *t) {
    s->py_calls++;
    if (s->n_pending == 0)
        return s->py(t, true, NULL);
    give_up_overlapped(s, t);
    s->forced_py = s->py(t, true, NULL);
    if (s->n_pending == 0)
        return s->forced_py;
    s->forced = t;
    s->forced_flushes++;
    return true;
}

bool md_eval(void *t, bool ask, void *user_data) {
    md_state *s = (md_state *)user_data;
    if (s->off)
        return !ask;
    if (ask) {
        s->due = NULL;
        s->forced = NULL;
        md_step *c = s->cur;
        if (c != NULL) {
            md_step *n = c->next;
            if (n != NULL && memcmp(t, n->raw, s->raw_len) == 0 && (n->n_leaves == 0 || same_leaves(s, n))) {
                s->cur = n;
                s->fast_asks++;
                if (!n->read)
                    return false;
                /* room for every pending id, this one and a flush's: else Python's turn */
                if (s->n_observed + s->n_pending + 2 > s->max_observed || s->n_pending >= MAX_PENDING) {
                    s->cur = c;
                } else if (n->read == DEFER) {
                    md_pending *p = &s->pending[s->n_pending++];
                    p->tensor = t;
                    p->step = n;
                    p->flags = *flags_of(s, t);
                    *flags_of(s, t) = p->flags | FLAG_OUTPUT;
                    s->deferred++;
                    return false;
                } else {
                    s->due = n;
                    s->due_tensor = t;
                    return true;
                }
            }
        }
        return to_python(s, t);
    }
    md_step *d = s->due;
    if (d != NULL && t == s->due_tensor) {
        s->due = NULL;
        flush(s, t, d);
        s->fast_observes++;
        return true;
    }
    if (s->forced != NULL && t == s->forced) {
        s->forced = NULL;
        flush(s, NULL, NULL);
        if (!s->forced_py)
            return true;
    }
    s->py_calls++;
    return s->py(t, false, NULL);
}

/* The decode is over (llama.cpp computed and synchronized every split): what is still pending is copied. Only a
   graph that ended before its planned flush leaves any. */
void md_finish(md_state *s) {
    if (s->n_pending)
        flush(s, NULL, NULL);
}

/* Tracing stopped inside a decode (an error): the pending nodes get their flags back, nothing is copied. */
void md_drop(md_state *s) {
    for (int32_t i = 0; i < s->n_pending; i++)
        *flags_of(s, s->pending[i].tensor) = s->pending[i].flags;
    s->n_pending = 0;
    s->due = NULL;
    s->forced = NULL;
}

/* The layout this file was compiled with, checked by fastpath.py against its own before any call. */
void md_layout(size_t *out) {
    out[0] = sizeof(md_step);
    out[1] = offsetof(md_step, id);
    out[2] = offsetof(md_step, next);
    out[3] = sizeof(md_state);
    out[4] = offsetof(md_state, off);
    out[5] = offsetof(md_state, get_async);
    out[6] = offsetof(md_state, lost);
    out[7] = MAX_PENDING;
    out[8] = offsetof(md_state, scratch);
}
