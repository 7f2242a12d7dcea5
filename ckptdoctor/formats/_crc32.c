/* ckptdoctor.formats._crc32: the CRC-32 of zip records (zlib's crc32: reflected polynomial 0xEDB88320), folded
 * with carry-less multiplication where the processor has it (see formats/crc.py, which uses zlib.crc32 where this
 * module was not built or cannot fold here).
 *
 * crc32(data, value=0, widest=2) -> int: as zlib.crc32(data, value). widest: the widest fold it may use (0 the
 *   byte table, 1 128-bit registers, 2 512-bit ones; the tests run each).
 * folds() -> int: the widest fold this build and processor run: 0 (a byte table), 1 (PCLMULQDQ), 2 (VPCLMULQDQ with
 *   AVX-512).
 *
 * The fold: the message, its first 4 bytes xored with the running state, is a polynomial over GF(2); eight 128-bit
 * accumulators each move 128 bytes on per step (multiplied by x^(1024±32) mod P, the two halves apart), are then
 * folded into one (x^(128±32) mod P), which is congruent to the whole message mod P at the place of its last 16
 * bytes. The CRC of those 16 bytes from a zero state is the CRC of the message; the bytes after them go through the
 * table. The constants are the reflected ones of Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ" for this polynomial. The GIL is released for large buffers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define CAN_FOLD 1
#include <immintrin.h>
#if defined(__clang__) || __GNUC__ >= 10 /* the 512-bit intrinsics used below */
#define CAN_FOLD_WIDE 1
#else
#define CAN_FOLD_WIDE 0
#endif
#else
#define CAN_FOLD 0
#define CAN_FOLD_WIDE 0
#endif

#define RELEASE_GIL_FROM 65536

static uint32_t table[256];
static int folds_here;

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
}

/* state: the register (not inverted) */
static uint32_t bytewise(uint32_t state, const unsigned char *p, size_t n) {
    while (n--)
        state = table[(state ^ *p++) & 0xFF] ^ (state >> 8);
    return state;
}

#if CAN_FOLD
__attribute__((target("pclmul,sse4.1"))) static inline __m128i fold(__m128i x, __m128i k, __m128i next) {
    /* x moved on by the distance k stands for: its low half times k's low, its high half times k's high */
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

/* acc: the message so far folded into 16 bytes; n (a multiple of 16) bytes at p still to fold in. The register
 * after all of them. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t finished(__m128i acc, const unsigned char *p, size_t n) {
    const __m128i by1 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL); /* x^(128-32), x^(128+32) */
    for (; n >= 16; p += 16, n -= 16)
        acc = fold(acc, by1, _mm_loadu_si128((const __m128i *)p));
    unsigned char last[16];
    _mm_storeu_si128((__m128i *)last, acc);
    return bytewise(0, last, 16);
}

/* n >= 128; returns the register after the first n - n % 16 bytes. Eight accumulators: a carry-less multiply
 * takes several cycles before its result can be used, so eight independent ones keep the unit busy. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t folded(uint32_t state, const unsigned char *p, size_t n) {
    const __m128i by8 = _mm_set_epi64x(0x000000014a7fe880LL, 0x00000001e88ef372LL); /* x^(1024-32), x^(1024+32) */
    const __m128i by1 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL); /* x^(128-32), x^(128+32) */
    __m128i x[8];
    for (int i = 0; i < 8; i++)
        x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)state));
    p += 128;
    n -= 128;
    while (n >= 128) {
        for (int i = 0; i < 8; i++)
            x[i] = fold(x[i], by8, _mm_loadu_si128((const __m128i *)(p + 16 * i)));
        p += 128;
        n -= 128;
    }
    __m128i acc = x[0];
    for (int i = 1; i < 8; i++)
        acc = fold(acc, by1, x[i]);
    return finished(acc, p, n);
}
#endif

#if CAN_FOLD_WIDE
/* The same with 512-bit registers (VPCLMULQDQ, AVX-512): four of them, 16 lanes, 256 bytes a step (x^(2048±32));
 * then each register into the next (64 bytes apart: x^(512±32)) and the last one's four lanes into one. */
__attribute__((target("pclmul,sse4.1,avx512f,avx512vl,vpclmulqdq"))) static inline __m512i
fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), next,
                                     0x96); /* a ^ b ^ c */
}

__attribute__((target("pclmul,sse4.1,avx512f,avx512vl,vpclmulqdq"))) static uint32_t
folded512(uint32_t state, const unsigned char *p, size_t n) { /* n >= 256 */
    const __m512i by64 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x00000001322d1430LL, 0x000000011542778aLL));
    const __m512i by16 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL));
    const __m128i by1 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
    __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128)), x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)state)));
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold512(x0, by64, _mm512_loadu_si512((const void *)p));
        x1 = fold512(x1, by64, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = fold512(x2, by64, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = fold512(x3, by64, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        n -= 256;
    }
    x0 = fold512(x0, by16, x1);
    x0 = fold512(x0, by16, x2);
    x0 = fold512(x0, by16, x3);
    __m128i acc = _mm512_extracti32x4_epi32(x0, 0);
    acc = fold(acc, by1, _mm512_extracti32x4_epi32(x0, 1));
    acc = fold(acc, by1, _mm512_extracti32x4_epi32(x0, 2));
    acc = fold(acc, by1, _mm512_extracti32x4_epi32(x0, 3));
    return finished(acc, p, n);
}
#endif

/* widest: 0 the table, 1 the 128-bit fold, 2 the 512-bit one (each where this build and processor have it) */
static uint32_t crc_of(uint32_t value, const unsigned char *p, size_t n, int widest) {
    uint32_t state = ~value;
    int level = widest < folds_here ? widest : folds_here;
    size_t whole = n - n % 16;
#if CAN_FOLD_WIDE
    if (level == 2 && n >= 256) {
        state = folded512(state, p, whole);
        p += whole;
        n -= whole;
    }
#endif
#if CAN_FOLD
    if (level >= 1 && n >= 128) {
        state = folded(state, p, whole);
        p += whole;
        n -= whole;
    }
#endif
    return ~bytewise(state, p, n);
}

static PyObject *crc32(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int value = 0;
    int widest = 2;
    if (!PyArg_ParseTuple(args, "y*|Ii:crc32", &view, &value, &widest))
        return NULL;
    uint32_t out;
    if (view.len >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        out = crc_of(value, view.buf, (size_t)view.len, widest);
        Py_END_ALLOW_THREADS
    } else {
        out = crc_of(value, view.buf, (size_t)view.len, widest);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

static PyObject *folds(PyObject *self, PyObject *unused) { return PyLong_FromLong(folds_here); }

static PyMethodDef methods[] = {
    {"crc32", crc32, METH_VARARGS, "crc32(data, value=0, widest=2) -> int: zlib.crc32's result."},
    {"folds", folds, METH_NOARGS, "The widest fold that runs here: 0 none, 1 128-bit, 2 512-bit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crc32(void) {
    make_table();
#if CAN_FOLD
    __builtin_cpu_init();
    folds_here = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    if (CAN_FOLD_WIDE && folds_here && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("vpclmulqdq"))
        folds_here = 2;
#endif
    return PyModule_Create(&module);
}
