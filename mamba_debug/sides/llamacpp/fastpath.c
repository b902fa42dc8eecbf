/* The eval callback's fast path in C (fastpath.py builds and loads it; observe.py's Tracer fills it).

   llama.cpp asks about every node of every graph. A graph of a kind already seen takes a path of its Tracer's trie
   node by node, each step one comparison of the node's struct bytes; the asks and the copies of that path are
   answered here, without entering Python, and so is every ask of an untraced decode (no). Anything else (the
   first node of a graph, a node that leaves the path, a step not mirrored yet, a fault hook, --local) is handed
   to the Python callback `py`, which maps the node and tells this code where the path stands (`cur`).

   A step is mirrored with the first child the Tracer followed (`next`): most graphs of a kind take one path, and
   a graph that leaves it goes to Python for that node, which may move `cur` to another child. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*get_fn)(const void *tensor, void *data, size_t offset, size_t size);   /* ggml_backend_tensor_get */
typedef bool (*eval_fn)(void *tensor, bool ask, void *user_data);

typedef struct md_leaf {        /* a tensor read that is no node and may be renamed: its address and name */
    uintptr_t addr;
    char name[64];
} md_leaf;

typedef struct md_step {
    const unsigned char *raw;   /* the node's struct bytes, up to the backend's `extra` */
    const md_leaf *leaves;
    int32_t n_leaves;
    int32_t id;                 /* the Python step's index in Tracer.mirrored */
    int32_t read;               /* a site needs its values: answer yes, copy nbytes into dst at the observe */
    int32_t pad;
    void *dst;
    size_t nbytes;
    struct md_step *next;       /* the first child; NULL: the fast path ends here */
} md_step;

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
} md_state;

static bool same_leaves(const md_state *s, const md_step *n) {
    for (int32_t i = 0; i < n->n_leaves; i++) {
        const char *name = (const char *)(n->leaves[i].addr + s->name_off);
        if (strncmp(name, n->leaves[i].name, 64) != 0)
            return false;
    }
    return true;
}

bool md_eval(void *t, bool ask, void *user_data) {
    md_state *s = (md_state *)user_data;
    if (s->off)
        return !ask;
    if (ask) {
        s->due = NULL;
        md_step *c = s->cur;
        if (c != NULL) {
            md_step *n = c->next;
            if (n != NULL && memcmp(t, n->raw, s->raw_len) == 0 && (n->n_leaves == 0 || same_leaves(s, n))) {
                s->cur = n;
                s->fast_asks++;
                if (!n->read)
                    return false;
                if (s->n_observed >= s->max_observed) {     /* no room to say what was observed: Python's turn */
                    s->cur = c;
                } else {
                    s->due = n;
                    s->due_tensor = t;
                    return true;
                }
            }
        }
        s->py_calls++;
        return s->py(t, true, NULL);
    }
    md_step *d = s->due;
    if (d != NULL && t == s->due_tensor) {
        s->due = NULL;
        if (d->nbytes)
            s->get(t, d->dst, 0, d->nbytes);
        s->observed[s->n_observed++] = d->id;
        s->fast_observes++;
        return true;
    }
    s->py_calls++;
    return s->py(t, false, NULL);
}

/* The layout this file was compiled with, checked by fastpath.py against its own before any call. */
void md_layout(size_t *out) {
    out[0] = sizeof(md_step);
    out[1] = offsetof(md_step, id);
    out[2] = offsetof(md_step, next);
    out[3] = sizeof(md_state);
    out[4] = offsetof(md_state, off);
}
