/* kvstore._native's copy_hash and PageHasher loops for CPUs with AVX512F (_copy_hash.h); picked at run time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f")
#include <immintrin.h>
#define XXH_VECTOR 3 /* xxhash's XXH_AVX512 */
#define COPY_HASH_ISA avx512
#include "_copy_hash.h"
#else
typedef int kvstore_native_avx512_unused; /* ISO C: a translation unit is not empty */
#endif
