/* kvstore._native's copy_hash and PageHasher loops for CPUs with AVX2 (_copy_hash.h); picked at run time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#include <immintrin.h>
#define XXH_VECTOR 2 /* xxhash's XXH_AVX2 */
#define COPY_HASH_ISA avx2
#include "_copy_hash.h"
#else
typedef int kvstore_native_avx2_unused; /* ISO C: a translation unit is not empty */
#endif
