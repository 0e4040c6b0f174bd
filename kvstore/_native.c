/* kvstore's two hot loops in C; each has a Python twin that the tests compare it against.
 *
 * chain(): chained block keys, key_i = xxh3_128(key_{i-1} || tokens of block i). A 128k-token
 *   prompt at 16-token blocks is 8192 hash calls: ~0.2 ms here instead of ~1.7 ms of Python loop.
 *   Digests are XXH3-128's canonical (big-endian) form, the bytes python-xxhash's digest() gives.
 * KeyIndex: the store's index, 16-byte key -> int32 handle, in one flat open-addressing table
 *   (linear probing, backward-shift deletion, no tombstones) sized once for the store's pages:
 *   20 bytes per entry at a load of at most 0.8, against ~120 for a dict of bytes keys to ints.
 *   Positions come from a seeded hash of the key, so clients that choose their keys cannot
 *   choose collisions. Memory comes from PyMem_Raw*, which tracemalloc sees.
 *
 * copy_hash(): a page copied and its XXH3-64 checksum taken in one pass over memory
 *   (_copy_hash.h; SSE2, AVX2 or AVX-512 picked at run time).
 *
 * xxhash.h is compiled in (XXH_INLINE_ALL): nothing to link at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define COPY_HASH_ISA base
#include "_copy_hash.h"

#define KEY_BYTES 16

/* chain(data, step, parent) -> list[bytes]: one key per whole `step`-byte block of `data`. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer data, parent;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*ny*", &data, &step, &parent)) return NULL;
    PyObject *out = NULL;
    unsigned char *buf = NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "step must be positive");
        goto done;
    }
    if (parent.len != KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "parent must be a 16-byte key");
        goto done;
    }
    Py_ssize_t n = data.len / step;
    out = PyList_New(n);
    if (out == NULL) goto done;
    buf = PyMem_Malloc(KEY_BYTES + step);  /* parent key || block tokens, hashed as one input */
    if (buf == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, parent.buf, KEY_BYTES);
    const unsigned char *src = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + KEY_BYTES, src + i * step, step);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, KEY_BYTES + step));
        memcpy(buf, c.digest, KEY_BYTES);
        PyObject *key = PyBytes_FromStringAndSize((const char *)c.digest, KEY_BYTES);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, key);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return out;
}

/* split(data, size) -> list[bytes]: data cut into size-byte pieces (packed keys off the wire). */
static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*n", &data, &size)) return NULL;
    PyObject *out = NULL;
    if (size <= 0 || data.len % size) {
        PyErr_SetString(PyExc_ValueError, "split: data is not whole pieces of a positive size");
        goto done;
    }
    Py_ssize_t n = data.len / size;
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *piece = PyBytes_FromStringAndSize((const char *)data.buf + i * size, size);
        if (piece == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, piece);
    }
done:
    PyBuffer_Release(&data);
    return out;
}

/* scope(keys, prefix) -> list[bytes]: xxh3_128(prefix || key) of each 16-byte key (a tenant's
 * keys as stored, kvstore.keys.scope_keys). */
static PyObject *scope(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_buffer prefix;
    if (!PyArg_ParseTuple(args, "Oy*", &keys, &prefix)) return NULL;
    PyObject *out = NULL, *seq = PySequence_Fast(keys, "keys must be a sequence");
    unsigned char *buf = NULL;
    if (seq == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    buf = PyMem_Malloc(prefix.len + KEY_BYTES);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, prefix.buf, prefix.len);
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "key #%zd must be %d bytes", i, KEY_BYTES);
            Py_CLEAR(out);
            goto done;
        }
        memcpy(buf + prefix.len, PyBytes_AS_STRING(k), KEY_BYTES);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, prefix.len + KEY_BYTES));
        PyObject *key = PyBytes_FromStringAndSize((const char *)c.digest, KEY_BYTES);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, key);
    }
done:
    PyMem_Free(buf);
    Py_XDECREF(seq);
    PyBuffer_Release(&prefix);
    return out;
}

/* ---- KeyIndex ----------------------------------------------------------------------------- */

typedef struct __attribute__((packed)) {
    uint64_t k0, k1;
    int32_t v; /* < 0: empty */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *tab;
    Py_ssize_t size;     /* entries in the table; > capacity, so a probe always ends */
    Py_ssize_t capacity; /* most keys it holds */
    Py_ssize_t len;
    uint64_t seed;
} KeyIndex;

static inline Py_ssize_t home(const KeyIndex *s, uint64_t k0, uint64_t k1) {
    uint64_t k[2] = {k0, k1};
    uint64_t h = XXH3_64bits_withSeed(k, KEY_BYTES, s->seed);
    return (Py_ssize_t)(((__uint128_t)h * (uint64_t)s->size) >> 64); /* h mod size, no divide */
}

static inline Py_ssize_t next_pos(const KeyIndex *s, Py_ssize_t i) {
    return i + 1 == s->size ? 0 : i + 1;
}

/* A key as two words; 0 on success, -1 with an exception set. */
static inline int key_words(PyObject *o, uint64_t *k0, uint64_t *k1) {
    if (PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) == KEY_BYTES) {
        const char *p = PyBytes_AS_STRING(o);
        memcpy(k0, p, 8);
        memcpy(k1, p + 8, 8);
        return 0;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(o, &b, PyBUF_SIMPLE) < 0) return -1;
    if (b.len != KEY_BYTES) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "a key is %d bytes, got %zd", KEY_BYTES, b.len);
        return -1;
    }
    memcpy(k0, b.buf, 8);
    memcpy(k1, (const char *)b.buf + 8, 8);
    PyBuffer_Release(&b);
    return 0;
}

static inline Py_ssize_t find(const KeyIndex *s, uint64_t k0, uint64_t k1) {
    for (Py_ssize_t i = home(s, k0, k1);; i = next_pos(s, i)) {
        const Entry *e = &s->tab[i];
        if (e->v < 0) return -1;
        if (e->k0 == k0 && e->k1 == k1) return i;
    }
}

static int KeyIndex_init(KeyIndex *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", "seed", NULL};
    Py_ssize_t capacity;
    unsigned long long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nK", names, &capacity, &seed)) return -1;
    if (capacity < 0 || capacity > ((Py_ssize_t)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "capacity must be within [0, 2**40]");
        return -1;
    }
    if (self->tab != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex is already initialised");
        return -1;
    }
    Py_ssize_t size = capacity + capacity / 4 + 1; /* load <= 0.8 */
    self->tab = PyMem_RawMalloc((size_t)size * sizeof(Entry));
    if (self->tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) self->tab[i].v = -1;
    self->size = size;
    self->capacity = capacity;
    self->len = 0;
    self->seed = seed;
    return 0;
}

static void KeyIndex_dealloc(KeyIndex *self) {
    PyMem_RawFree(self->tab);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *KeyIndex_get(KeyIndex *self, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=-1)");
        return NULL;
    }
    uint64_t k0, k1;
    if (key_words(args[0], &k0, &k1) < 0) return NULL;
    Py_ssize_t i = find(self, k0, k1);
    if (i >= 0) return PyLong_FromLong(self->tab[i].v);
    if (n == 2) return Py_NewRef(args[1]);
    return PyLong_FromLong(-1);
}

static PyObject *KeyIndex_put(KeyIndex *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "put(key, value)");
        return NULL;
    }
    uint64_t k0, k1;
    if (key_words(args[0], &k0, &k1) < 0) return NULL;
    long v = PyLong_AsLong(args[1]);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 0 || v > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a value must be within [0, 2**31)");
        return NULL;
    }
    Py_ssize_t i = home(self, k0, k1);
    for (;; i = next_pos(self, i)) {
        Entry *e = &self->tab[i];
        if (e->v < 0) break;
        if (e->k0 == k0 && e->k1 == k1) {
            e->v = (int32_t)v;
            Py_RETURN_NONE;
        }
    }
    if (self->len >= self->capacity) {
        PyErr_Format(PyExc_OverflowError, "KeyIndex is full (%zd keys)", self->capacity);
        return NULL;
    }
    self->tab[i].k0 = k0;
    self->tab[i].k1 = k1;
    self->tab[i].v = (int32_t)v;
    self->len++;
    Py_RETURN_NONE;
}

/* Remove the entry at i; later entries of its probe run shift back (no tombstones). */
static void remove_at(KeyIndex *s, Py_ssize_t i) {
    Py_ssize_t j = i;
    for (;;) {
        j = next_pos(s, j);
        Entry *e = &s->tab[j];
        if (e->v < 0) break;
        Py_ssize_t h = home(s, e->k0, e->k1);
        /* e may stay where it is when its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        s->tab[i] = *e;
        i = j;
    }
    s->tab[i].v = -1;
    s->len--;
}

static PyObject *KeyIndex_pop(KeyIndex *self, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key, default=-1)");
        return NULL;
    }
    uint64_t k0, k1;
    if (key_words(args[0], &k0, &k1) < 0) return NULL;
    Py_ssize_t i = find(self, k0, k1);
    if (i < 0) return n == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(-1);
    long v = self->tab[i].v;
    remove_at(self, i);
    return PyLong_FromLong(v);
}

/* get_many(keys, stop_at_miss=False) -> list of values, -1 where missing (or, stopping at the
 * first miss, only the leading hits). */
static PyObject *KeyIndex_get_many(KeyIndex *self, PyObject *args) {
    PyObject *keys;
    int stop = 0;
    if (!PyArg_ParseTuple(args, "O|p", &keys, &stop)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (out == NULL) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t k0, k1;
        if (key_words(items[k], &k0, &k1) < 0) goto fail;
        Py_ssize_t i = find(self, k0, k1);
        if (i < 0 && stop) break;
        PyObject *v = PyLong_FromLong(i < 0 ? -1 : self->tab[i].v);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* find_prefix(keys) -> bytes: the values of the leading keys found, as packed int32 (native
 * order), stopping at the first miss. The store's Lookup: no Python int per block. */
static PyObject *KeyIndex_find_prefix(KeyIndex *self, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    int32_t *vals = (int32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        uint64_t k0, k1;
        if (key_words(items[k], &k0, &k1) < 0) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t i = find(self, k0, k1);
        if (i < 0) break;
        vals[k] = self->tab[i].v;
    }
    Py_DECREF(seq);
    if (k < n && _PyBytes_Resize(&out, k * (Py_ssize_t)sizeof(int32_t)) < 0) return NULL;
    return out;
}

static PyObject *KeyIndex_items(KeyIndex *self, PyObject *unused) {
    PyObject *out = PyList_New(self->len);
    if (out == NULL) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < self->size && k < self->len; i++) {
        const Entry *e = &self->tab[i];
        if (e->v < 0) continue;
        char key[KEY_BYTES];
        memcpy(key, &e->k0, 8);
        memcpy(key + 8, &e->k1, 8);
        PyObject *item = Py_BuildValue("(y#l)", key, (Py_ssize_t)KEY_BYTES, (long)e->v);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, item);
    }
    return out;
}

static PyObject *KeyIndex_clear(KeyIndex *self, PyObject *unused) {
    for (Py_ssize_t i = 0; i < self->size; i++) self->tab[i].v = -1;
    self->len = 0;
    Py_RETURN_NONE;
}

static Py_ssize_t KeyIndex_len(KeyIndex *self) { return self->len; }

static int KeyIndex_contains(KeyIndex *self, PyObject *key) {
    uint64_t k0, k1;
    if (key_words(key, &k0, &k1) < 0) return -1;
    return find(self, k0, k1) >= 0;
}

static PyObject *KeyIndex_nbytes(KeyIndex *self, void *unused) {
    return PyLong_FromSsize_t(self->size * (Py_ssize_t)sizeof(Entry));
}

static PyObject *KeyIndex_capacity(KeyIndex *self, void *unused) {
    return PyLong_FromSsize_t(self->capacity);
}

static PyMethodDef KeyIndex_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyIndex_get, METH_FASTCALL,
     "get(key, default=-1): the key's value"},
    {"put", (PyCFunction)(void (*)(void))KeyIndex_put, METH_FASTCALL,
     "put(key, value): insert or overwrite; OverflowError when full"},
    {"pop", (PyCFunction)(void (*)(void))KeyIndex_pop, METH_FASTCALL,
     "pop(key, default=-1): remove the key, return its value"},
    {"get_many", (PyCFunction)KeyIndex_get_many, METH_VARARGS,
     "get_many(keys, stop_at_miss=False): values, -1 where missing"},
    {"find_prefix", (PyCFunction)KeyIndex_find_prefix, METH_O,
     "find_prefix(keys) -> packed int32 values of the leading keys found"},
    {"items", (PyCFunction)KeyIndex_items, METH_NOARGS, "[(key, value), ...] in table order"},
    {"clear", (PyCFunction)KeyIndex_clear, METH_NOARGS, "remove every key"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyIndex_getset[] = {
    {"nbytes", (getter)KeyIndex_nbytes, NULL, "bytes of the table", NULL},
    {"capacity", (getter)KeyIndex_capacity, NULL, "most keys it holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyIndex_as_sequence = {
    .sq_length = (lenfunc)KeyIndex_len,
    .sq_contains = (objobjproc)KeyIndex_contains,
};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore._native.KeyIndex",
    .tp_doc = "KeyIndex(capacity, seed): 16-byte keys -> int32 values, fixed capacity",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyIndex_init,
    .tp_dealloc = (destructor)KeyIndex_dealloc,
    .tp_methods = KeyIndex_methods,
    .tp_getset = KeyIndex_getset,
    .tp_as_sequence = &KeyIndex_as_sequence,
};

/* ---- LRU lists ---------------------------------------------------------------------------- */

/* lru_touch(prev, next, head, slots): move each linked slot of `slots` (int32 buffer) to the tail
 * of the doubly linked list with sentinel `head`, in order; unlinked slots (prev == -1: pinned)
 * and slots already at the tail stay. prev / next: writable int32 buffers (kvstore.policy's
 * arrays). The LRU policy's touch_many, one C loop instead of ten array operations per slot. */
static PyObject *lru_touch(PyObject *self, PyObject *args) {
    Py_buffer pb, nb, sb;
    Py_ssize_t head;
    if (!PyArg_ParseTuple(args, "w*w*ny*", &pb, &nb, &head, &sb)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t size = pb.len / (Py_ssize_t)sizeof(int32_t);
    if (nb.len != pb.len || sb.len % (Py_ssize_t)sizeof(int32_t) || head < 0 || head >= size) {
        PyErr_SetString(PyExc_ValueError, "lru_touch: bad list buffers, head or slots");
        goto done;
    }
    int32_t *prev = pb.buf, *next = nb.buf;
    const int32_t *slots = sb.buf;
    Py_ssize_t n = sb.len / (Py_ssize_t)sizeof(int32_t);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (s < 0 || s >= head) {
            PyErr_Format(PyExc_ValueError, "lru_touch: slot %d out of range", (int)s);
            goto done;
        }
        int32_t p = prev[s];
        if (p == -1) continue;
        int32_t nx = next[s];
        if (nx == head) continue;
        next[p] = nx;
        prev[nx] = p;
        int32_t tail = prev[head];
        prev[s] = tail;
        next[s] = (int32_t)head;
        next[tail] = s;
        prev[head] = s;
    }
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&sb);
    return ret;
}

/* ---- pages: copy and checksum in one pass ------------------------------------------------ */

typedef unsigned long long (*copy_hash_fn)(void *, const void *, size_t);
typedef void (*hash_update_fn)(XXH3_state_t *, const void *, size_t);
typedef void (*copy_update_fn)(XXH3_state_t *, void *, const void *, size_t);
static copy_hash_fn copy_hash_impl = kv_copy_hash_base;
static hash_update_fn hash_update_impl = kv_hash_update_base;
static copy_update_fn copy_update_impl = kv_copy_update_base;
static const char *copy_hash_isa = "baseline";

/* The widest the CPU runs; KVSTORE_COPY_HASH_ISA=sse2|avx2 caps it (the tests run each). */
static void pick_copy_hash(void) {
#if COPY_HASH_X86
    const char *cap = getenv("KVSTORE_COPY_HASH_ISA");
    int most = cap == NULL ? 3 : strcmp(cap, "sse2") == 0 ? 1 : strcmp(cap, "avx2") == 0 ? 2 : 3;
    __builtin_cpu_init();
    if (most >= 3 && __builtin_cpu_supports("avx512f")) {
        copy_hash_impl = kv_copy_hash_avx512;
        hash_update_impl = kv_hash_update_avx512;
        copy_update_impl = kv_copy_update_avx512;
        copy_hash_isa = "avx512";
    } else if (most >= 2 && __builtin_cpu_supports("avx2")) {
        copy_hash_impl = kv_copy_hash_avx2;
        hash_update_impl = kv_hash_update_avx2;
        copy_update_impl = kv_copy_update_avx2;
        copy_hash_isa = "avx2";
    } else {
        copy_hash_isa = "sse2";
    }
#endif
}

/* copy_hash(dst, src) -> int: copy `src` into `dst` (C-contiguous buffers of one length) and
 * return XXH3-64 of the bytes, the value python-xxhash's xxh3_64_intdigest gives; the GIL is
 * released meanwhile. */
static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer db, sb;
    if (!PyArg_ParseTuple(args, "w*y*", &db, &sb)) return NULL;
    PyObject *ret = NULL;
    const char *d = db.buf, *s = sb.buf;
    if (db.len != sb.len) {
        PyErr_Format(PyExc_ValueError, "copy_hash: %zd bytes into a buffer of %zd", sb.len,
                     db.len);
    } else if (db.len && d < s + sb.len && s < d + db.len) {
        PyErr_SetString(PyExc_ValueError, "copy_hash: the buffers overlap");
    } else {
        unsigned long long h;
        Py_BEGIN_ALLOW_THREADS;
        h = copy_hash_impl(db.buf, sb.buf, (size_t)db.len);
        Py_END_ALLOW_THREADS;
        ret = PyLong_FromUnsignedLongLong(h);
    }
    PyBuffer_Release(&db);
    PyBuffer_Release(&sb);
    return ret;
}

/* PageHasher(n): n streaming XXH3-64 states, one per page of a layer-wise write. A writer that
 * fills pages a layer at a time (layer-major pages: layer l is bytes [l*size, (l+1)*size)) feeds
 * each layer's slices right after copying them, from cache, and commits the digests: the node
 * does not read the pages back to hash them. Slices must come in page order. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    XXH3_state_t *states; /* 64-byte aligned: XXH3's accumulators are loaded aligned */
    int busy;             /* an update runs without the GIL: a second thread is refused */
} PageHasher;

static int PageHasher_idle(PageHasher *self) {
    if (!self->busy) return 1;
    PyErr_SetString(PyExc_RuntimeError, "PageHasher: in use by another thread (one at a time)");
    return 0;
}

static int PageHasher_init(PageHasher *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"n", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n", names, &n) || !PageHasher_idle(self))
        return -1;
    if (n < 0 || n > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "PageHasher: n must be in [0, 2**24]");
        return -1;
    }
    free(self->states);
    self->states = aligned_alloc(64, (size_t)(n ? n : 1) * sizeof(XXH3_state_t));
    if (self->states == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->n = n;
    for (Py_ssize_t i = 0; i < n; i++) XXH3_64bits_reset(&self->states[i]);
    return 0;
}

static void PageHasher_dealloc(PageHasher *self) {
    free(self->states);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* update(pages, offset, size): feed bytes [offset, offset + size) of each page in `pages` (a
 * sequence of n buffers, page i to state i). The GIL is released while hashing. */
static PyObject *PageHasher_update(PageHasher *self, PyObject *args) {
    PyObject *pages;
    Py_ssize_t offset, size;
    if (!PyArg_ParseTuple(args, "Onn", &pages, &offset, &size) || !PageHasher_idle(self))
        return NULL;
    PyObject *seq = PySequence_Fast(pages, "PageHasher.update: pages must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *ret = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t got = 0;
    if (n != self->n || offset < 0 || size < 0) {
        PyErr_Format(PyExc_ValueError,
                     "PageHasher.update: %zd pages for %zd states, offset %zd, size %zd", n,
                     self->n, offset, size);
        goto done;
    }
    views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (offset > views[got].len || size > views[got].len - offset) {
            PyErr_Format(PyExc_ValueError,
                         "PageHasher.update: page #%zd has %zd bytes, not %zd + %zd", got,
                         views[got].len, offset, size);
            got++;
            goto done;
        }
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++)
        hash_update_impl(&self->states[i], (const char *)views[i].buf + offset, (size_t)size);
    Py_END_ALLOW_THREADS;
    self->busy = 0;
    ret = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return ret;
}

/* The bytes of one row of an n-D buffer whose rows (index 0) are each C-contiguous, or -1. */
static Py_ssize_t row_bytes(const Py_buffer *b) {
    if (b->ndim < 1 || b->strides == NULL) return -1;
    Py_ssize_t expect = b->itemsize;
    for (int d = b->ndim - 1; d >= 1; d--) {
        if (b->shape[d] > 1 && b->strides[d] != expect) return -1;
        expect *= b->shape[d];
    }
    return expect;
}

/* The byte span [lo, hi) a buffer's rows cover (the row stride may be negative). */
static void row_span(const Py_buffer *b, Py_ssize_t row, const char **lo, const char **hi) {
    const char *first = b->buf;
    Py_ssize_t reach = (b->shape[0] - 1) * b->strides[0];
    *lo = reach < 0 ? first + reach : first;
    *hi = (reach < 0 ? first : first + reach) + row;
}

/* copy_update(first, dst, src): copy row i of `src` into row i of `dst` and feed those bytes
 * to state first + i, each chunk hashed from L1 right after its copy: a layer-wise writer's
 * slices of n pages in one pass over memory (update after a copy reads them back). `dst` and
 * `src`: arrays of n rows (their first index) of one byte size, each row C-contiguous, any
 * row stride (pages of a run; blocks of a KV tensor). The GIL is released meanwhile. */
static PyObject *PageHasher_copy_update(PageHasher *self, PyObject *args) {
    Py_ssize_t first;
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "nOO", &first, &dst_obj, &src_obj) || !PageHasher_idle(self))
        return NULL;
    Py_buffer db, sb;
    if (PyObject_GetBuffer(dst_obj, &db, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &sb, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&db);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t size = row_bytes(&db);
    if (size < 0 || row_bytes(&sb) != size || db.shape[0] != sb.shape[0]) {
        PyErr_SetString(PyExc_ValueError,
                         "PageHasher.copy_update: dst and src must have as many rows, of one "
                         "byte size, each contiguous");
        goto done;
    }
    Py_ssize_t n = db.shape[0];
    if (first < 0 || n > self->n - first) {
        PyErr_Format(PyExc_ValueError,
                     "PageHasher.copy_update: rows [%zd, %zd + %zd) of %zd states", first, first,
                     n, self->n);
        goto done;
    }
    if (n && size) {
        const char *dlo, *dhi, *slo, *shi;
        row_span(&db, size, &dlo, &dhi);
        row_span(&sb, size, &slo, &shi);
        if (dlo < shi && slo < dhi) {
            PyErr_SetString(PyExc_ValueError, "PageHasher.copy_update: the buffers overlap");
            goto done;
        }
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++)
        copy_update_impl(&self->states[first + i], (char *)db.buf + i * db.strides[0],
                         (const char *)sb.buf + i * sb.strides[0], (size_t)size);
    Py_END_ALLOW_THREADS;
    self->busy = 0;
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&db);
    PyBuffer_Release(&sb);
    return ret;
}

/* digests() -> list[int]: each page's XXH3-64 of what was fed (its checksum, when whole). */
static PyObject *PageHasher_digests(PageHasher *self, PyObject *unused) {
    if (!PageHasher_idle(self)) return NULL;
    PyObject *out = PyList_New(self->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(XXH3_64bits_digest(&self->states[i]));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyMethodDef PageHasher_methods[] = {
    {"update", (PyCFunction)PageHasher_update, METH_VARARGS,
     "update(pages, offset, size): feed bytes [offset, offset+size) of page i to state i"},
    {"copy_update", (PyCFunction)PageHasher_copy_update, METH_VARARGS,
     "copy_update(first, dst, src): copy row i of src into row i of dst, feeding state first+i"},
    {"digests", (PyCFunction)PageHasher_digests, METH_NOARGS,
     "digests() -> list of each page's xxh3_64 of what was fed"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PageHasherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore._native.PageHasher",
    .tp_basicsize = sizeof(PageHasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "n streaming xxh3_64 states, one per page of a layer-wise write",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PageHasher_init,
    .tp_dealloc = (destructor)PageHasher_dealloc,
    .tp_methods = PageHasher_methods,
};

/* ---- module ------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"lru_touch", lru_touch, METH_VARARGS,
     "lru_touch(prev, next, head, slots): move linked slots to the list's tail, in order"},
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src) -> xxh3_64 of src, copied into dst in the same pass"},
    {"split", split, METH_VARARGS, "split(data, size) -> list of size-byte pieces"},
    {"scope", scope, METH_VARARGS, "scope(keys, prefix) -> xxh3_128(prefix || key) of each key"},
    {"chain", chain, METH_VARARGS,
     "chain(data, step, parent) -> list of 16-byte keys, one per whole step-byte block"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&KeyIndexType) < 0 || PyType_Ready(&PageHasherType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    pick_copy_hash();
    if (PyModule_AddStringConstant(m, "COPY_HASH_ISA", copy_hash_isa) < 0 ||
        PyModule_AddObjectRef(m, "KeyIndex", (PyObject *)&KeyIndexType) < 0 ||
        PyModule_AddObjectRef(m, "PageHasher", (PyObject *)&PageHasherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
