/* Chained block keys in one C loop: key_i = xxh3_128(key_{i-1} || tokens of block i).
 *
 * kvstore.keys.block_keys calls this when it is built (a 128k-token prompt at 16-token blocks is
 * 8192 hash calls: ~0.2 ms here instead of ~1.7 ms of Python loop); the pure-Python loop beside
 * it computes the same keys and is the reference the tests compare against.
 *
 * Digests are XXH3-128's canonical (big-endian) form, the bytes python-xxhash's digest() gives.
 * xxhash.h is compiled in (XXH_INLINE_ALL): nothing to link at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

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

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(data, step, parent) -> list of 16-byte keys, one per whole step-byte block"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
