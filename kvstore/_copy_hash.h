/* The loops of kvstore._native's copy_hash and PageHasher, built once per instruction set:
 * _native.c builds them with the compiler's baseline (SSE2 on x86-64), _native_avx2.c and
 * _native_avx512.c with theirs, and _native.c picks the widest the CPU runs. A file that
 * includes this names its instruction set (COPY_HASH_ISA, the functions' suffix) and sets
 * xxhash's vector code (XXH_VECTOR) and the compiler's target first.
 *
 * Each 16 KiB chunk is hashed from the destination right after it is copied, while it is in L1:
 * one pass over memory. Measured here on 1 MiB pages (vs memcpy): copy then hash 0.75-0.80x;
 * in chunks of 4 / 16 / 64 KiB, SSE2 0.71-0.83 / 0.80-0.84 / 0.73-0.76x, AVX2 0.87-0.92x and
 * AVX-512 0.90-0.99x at 16 KiB. */
#ifndef KVSTORE_COPY_HASH_H
#define KVSTORE_COPY_HASH_H

#include <stddef.h>
#include <string.h>
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

/* x86-64 with GCC: the SIMD variants are built (#pragma GCC target). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COPY_HASH_X86 1
#else
#define COPY_HASH_X86 0
#endif

#define COPY_HASH_CHUNK ((size_t)16 * 1024)

unsigned long long kv_copy_hash_base(void *dst, const void *src, size_t n);
void kv_hash_update_base(XXH3_state_t *state, const void *data, size_t n);
void kv_copy_update_base(XXH3_state_t *state, void *dst, const void *src, size_t n);
#if COPY_HASH_X86
unsigned long long kv_copy_hash_avx2(void *dst, const void *src, size_t n);
void kv_hash_update_avx2(XXH3_state_t *state, const void *data, size_t n);
void kv_copy_update_avx2(XXH3_state_t *state, void *dst, const void *src, size_t n);
unsigned long long kv_copy_hash_avx512(void *dst, const void *src, size_t n);
void kv_hash_update_avx512(XXH3_state_t *state, const void *data, size_t n);
void kv_copy_update_avx512(XXH3_state_t *state, void *dst, const void *src, size_t n);
#endif

#endif /* KVSTORE_COPY_HASH_H */

#ifdef COPY_HASH_ISA
#define COPY_HASH_CAT_(a, b) a##b
#define COPY_HASH_CAT(a, b) COPY_HASH_CAT_(a, b)

/* Feed n bytes to a streaming XXH3-64 (the same state layout whatever the instruction set). */
void COPY_HASH_CAT(kv_hash_update_, COPY_HASH_ISA)(XXH3_state_t *state, const void *data,
                                                   size_t n) {
    XXH3_64bits_update(state, data, n);
}

/* Copy n bytes and feed them to a streaming XXH3-64, each chunk from L1 right after its copy
 * (a layer-wise writer's slice of a page: PageHasher.copy_update). */
void COPY_HASH_CAT(kv_copy_update_, COPY_HASH_ISA)(XXH3_state_t *state, void *dst,
                                                   const void *src, size_t n) {
    char *d = dst;
    const char *s = src;
    for (size_t off = 0; off < n; off += COPY_HASH_CHUNK) {
        size_t k = n - off < COPY_HASH_CHUNK ? n - off : COPY_HASH_CHUNK;
        memcpy(d + off, s + off, k);
        XXH3_64bits_update(state, d + off, k);
    }
}

/* Copy n bytes and return their XXH3-64 (seed 0), python-xxhash's xxh3_64_intdigest. */
unsigned long long COPY_HASH_CAT(kv_copy_hash_, COPY_HASH_ISA)(void *dst, const void *src,
                                                               size_t n) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    char *d = dst;
    const char *s = src;
    for (size_t off = 0; off < n; off += COPY_HASH_CHUNK) {
        size_t k = n - off < COPY_HASH_CHUNK ? n - off : COPY_HASH_CHUNK;
        memcpy(d + off, s + off, k);
        XXH3_64bits_update(&state, d + off, k);
    }
    return XXH3_64bits_digest(&state);
}
#endif
