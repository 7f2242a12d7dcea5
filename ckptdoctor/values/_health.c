/* ckptdoctor.values._health: the per-element loop of `check --health` for float32, bfloat16 and float16 (see
 * values/slab_stats.py, which computes the same numbers in numpy where this module was not built).
 *
 * floats(data, columns, exponent_bits, fraction_bits, out, row_step[, portable]) -> (zeros, nan, inf, low, high,
 *                                                                       positive, negative, squares, rows)
 *   data: the elements, whole rows of `columns`, 4 bytes (exponent_bits 8, fraction_bits 23) or 2; at most
 *   2^22 of them (slab_stats.SLAB_ELEMENTS), so every sum per exponent fits in 64 bits.
 *   out[r] (uint64 per row): the sum over the row's elements j of c^j h(bits_j) mod 2^64 (c = GOLDEN; h as
 *   slab_stats._value_hashes: splitmix64 of a 2-byte pattern, a 32-bit multiply-xorshift of a 4-byte one).
 *   positive, negative, squares: the exact sums of the positive and of the negative finite elements' magnitudes
 *   and of all their squares, as little-endian unsigned integers (bytes) in units of the smallest subnormal
 *   (squared for squares): moments.Moments.total and total_sq. They are summed per sign and biased exponent E
 *   first: for 2 bytes the significands m and m^2; for float32 binned by the upper 13 bits as
 *   slab_stats._by_upper_bits (upper significand a = implicit bit and 4 fraction bits, low 19 bits l): sums of a,
 *   a^2, l, a l and l^2, the significand being a 2^19 + l; then shifted by max(E, 1) - 1 and added.
 *   low, high: the bits of the smallest and largest finite element (-1 without one); zeros counts ±0.
 *   rows: the sum over rows r of row_step^r out[r] mod 2^64 (with row_step c^columns-of-the-slice, a 2-d slab's
 *   fingerprint up to one factor).
 *   portable: run float32 through the portable pass even where the vectorised one could run (for the tests).
 * The GIL is released for the loop. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MAX_ELEMENTS (1 << 22)
#define LOW_BITS 19 /* float32: bits below the bin (slab_stats._LOW_BITS); 2^13 bins of sign, exponent, 4 fraction bits */
#define TOTAL_LIMBS 10  /* 32-bit digits of a sum: below 2^(48 + 253 + 8) */
#define SQUARE_LIMBS 19 /* of a sum of squares: below 2^(73 + 506 + 8) */

/* float32 has a second pass written for the auto-vectoriser, built for AVX2 (and AVX-512 from GCC 11) where GCC
 * can (x86-64 with glibc: target_clones needs its ifunc) and run where the processor has AVX2; elsewhere, and with
 * floats(..., portable=True), the portable pass runs. Either gives the same integers. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 6 && defined(__x86_64__) && defined(__GLIBC__)
#define VECTOR_BLOCKS 1
#if __GNUC__ >= 11
#define VECTOR_CLONES __attribute__((target_clones("default", "avx2", "arch=x86-64-v4")))
#else
#define VECTOR_CLONES __attribute__((target_clones("default", "avx2")))
#endif
#else
#define VECTOR_BLOCKS 0
#define VECTOR_CLONES
#endif

typedef uint64_t Pair __attribute__((vector_size(16))); /* a float32 bin's two sums, added in one instruction */

static uint64_t pattern_hash[1 << 16]; /* splitmix64 of each 2-byte pattern (slab_stats._hash_table) */

static uint64_t inverse4, inverse64; /* (c^4)^-1 and (c^64)^-1 mod 2^64: c is odd */

static uint64_t inverse(uint64_t odd) { /* Newton's iteration: each step doubles the bits right */
    uint64_t x = odd;
    for (int i = 0; i < 6; i++)
        x *= 2 - odd * x;
    return x;
}

static uint64_t power(uint64_t base, uint64_t exponent) {
    uint64_t result = 1;
    for (; exponent; exponent >>= 1, base *= base)
        result *= exponent & 1 ? base : 1;
    return result;
}

/* The loop over the rows of `v` (n elements, `columns` a row), setting each row's fingerprint (*row++), front to
 * back (the order the hardware prefetches best). Horner's way in 4 interleaved sums held in registers, with
 * the inverse base: lane k holds the T_k elements j = k + 4 t as s_k = sum over t of c^(-4 (T_k - 1 - t)) h_j,
 * so sum over t of c^(4 t) h_j = c^(4 (T_k - 1)) s_k, and the row's sum is sum over k of c^k of that:
 * one multiplication per element, four independent chains. ELEMENT(j, s) does the element's own work and sets
 * s = s c^-4 + h_j. */
#define ROWS4(ELEMENT)                                                                                          \
    uint64_t factor[4];                                                                                         \
    for (int k = 0; k < 4; k++) { /* every row has `columns` elements: T_k the same in each */                  \
        Py_ssize_t count = columns / 4 + (k < columns % 4);                                                     \
        factor[k] = count ? power(GOLDEN, k + (uint64_t)4 * (count - 1)) : 0;                                   \
    }                                                                                                           \
    for (Py_ssize_t first = 0; first < n; first += columns, row++) {                                            \
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                                \
        Py_ssize_t j = 0, whole = columns - columns % 4;                                                        \
        for (; j < whole; j += 4) {                                                                             \
            ELEMENT(first + j, s0);                                                                             \
            ELEMENT(first + j + 1, s1);                                                                         \
            ELEMENT(first + j + 2, s2);                                                                         \
            ELEMENT(first + j + 3, s3);                                                                         \
        }                                                                                                       \
        if (j < columns) /* the last columns % 4 elements, each the last of its lane */                         \
            ELEMENT(first + j, s0);                                                                             \
        if (j + 1 < columns)                                                                                    \
            ELEMENT(first + j + 1, s1);                                                                         \
        if (j + 2 < columns)                                                                                    \
            ELEMENT(first + j + 2, s2);                                                                         \
        *row = factor[0] * s0 + factor[1] * s1 + factor[2] * s2 + factor[3] * s3;                               \
    }

/* The walk over the rows of `v` (n elements, `columns` a row), setting each row's fingerprint (*row++), front to
 * back, a block of up to LANES elements at a time. Horner's way in LANES interleaved sums with the inverse base:
 * lane k holds the T_k elements j = k + LANES t as s_k = sum over t of c^(-LANES (T_k - 1 - t)) h_j, so sum over t
 * of c^(LANES t) h_j = c^(LANES (T_k - 1)) s_k, and the row's sum is sum over k of c^k of that: one multiplication
 * per element, LANES independent chains. BLOCK(at, m) does the work of elements at..at+m-1 and sets
 * s[k] = s[k] c^-LANES + h for each. */
#define ROWS(LANES, INVERSE, BLOCK)                                                                             \
    uint64_t factor[LANES], s[LANES];                                                                           \
    const uint64_t inverse = INVERSE;                                                                           \
    int used = columns < LANES ? (int)columns : LANES;                                                          \
    uint64_t longer = power(GOLDEN, LANES * (uint64_t)(columns / LANES)), shorter = longer * inverse, ck = 1;   \
    for (int k = 0; k < used; k++, ck *= GOLDEN) /* c^(k + LANES (T_k - 1)), T_k the same in every row */       \
        factor[k] = ck * (k < columns % LANES ? longer : shorter);                                              \
    for (Py_ssize_t first = 0; first < n; first += columns, row++) {                                            \
        for (int k = 0; k < used; k++)                                                                          \
            s[k] = 0;                                                                                           \
        Py_ssize_t j = 0;                                                                                       \
        for (; j + LANES <= columns; j += LANES)                                                                \
            BLOCK(first + j, LANES);                                                                            \
        if (j < columns)                                                                                        \
            BLOCK(first + j, (int)(columns - j));                                                               \
        uint64_t sum = 0;                                                                                       \
        for (int k = 0; k < used; k++)                                                                          \
            sum += factor[k] * s[k];                                                                            \
        *row = sum;                                                                                             \
    }

typedef struct {
    uint64_t zeros, nan, inf;
    int found;              /* a finite element was seen: low and high hold the bits of the extremes */
    uint32_t low, high;
} Counts;

/* The exponents a slab holds: *first the smallest of a nonzero element (0 where all are ±0), *last the largest.
 * Only the histogram entries and bins of exponent 0 (the zeros) and of first..last are cleared and read, so a slab
 * of a few hundred elements costs about as little as its elements (a slab of WHOLE_TABLE_FROM elements and more
 * uses all of them, without this pass). */
#define EXPONENTS(name, type, magnitude_mask)                                                                   \
    VECTOR_CLONES static void name(const type *v, Py_ssize_t n, int fraction_bits, int *first, int *last) {     \
        uint32_t largest = 0, smallest = UINT32_MAX; /* magnitude - 1 wraps for ±0: never the smallest */       \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                    \
            uint32_t magnitude = v[i] & (magnitude_mask);                                                       \
            largest = magnitude > largest ? magnitude : largest;                                                \
            smallest = magnitude - 1 < smallest ? magnitude - 1 : smallest;                                     \
        }                                                                                                       \
        *first = (int)((smallest + 1) >> fraction_bits), *last = (int)(largest >> fraction_bits);               \
    }
EXPONENTS(exponents16, uint16_t, 0x7FFFu)
EXPONENTS(exponents32, uint32_t, 0x7FFFFFFFu)
#define WHOLE_TABLE_FROM (1 << 18) /* elements from which clearing and reading every entry costs less than the pass */
#define EACH_USED(e, first, last) for (int e = 0; e <= (last); e = e < (first) ? (first) : e + 1)

/* 2-byte floats: a histogram of the patterns, reduced per (sign, exponent) at the end. */
static int measure16(const uint16_t *v, Py_ssize_t n, Py_ssize_t columns, int eb, int fb, int64_t *parts,
                     uint64_t *row, Counts *c) {
    uint32_t *count = malloc((1 << 16) * sizeof *count), fractions = 1u << fb, top = (1u << eb) - 1;
    int first, last;
    if (count == NULL)
        return -1;
    if (n < WHOLE_TABLE_FROM)
        exponents16(v, n, fb, &first, &last);
    else
        first = 0, last = (int)top;
    EACH_USED(e, first, last) {
        memset(count + (e << fb), 0, fractions * sizeof *count);
        memset(count + (1 << 15) + (e << fb), 0, fractions * sizeof *count);
    }
#define ELEMENT(at, lane)                                                                                       \
    do {                                                                                                        \
        uint16_t bits = v[at];                                                                                  \
        count[bits]++;                                                                                          \
        lane = lane * inverse4 + pattern_hash[bits];                                                            \
    } while (0)
    ROWS4(ELEMENT);
#undef ELEMENT
    uint64_t rows[2][256] = {{0}}; /* elements per sign and exponent: 0 for those not cleared (none) */
    for (uint32_t sign = 0; sign < 2; sign++)
        EACH_USED(e, first, last) {
            uint32_t at = sign * 256 + e;
            const uint32_t *k = count + (sign << 15) + (e << fb);
            uint32_t implicit = e != 0 ? fractions : 0;
            uint64_t total = 0, sum = 0, square = 0;
            for (uint32_t f = 0; f < fractions; f++)
                total += k[f];
            for (uint32_t f = 0; total && f < fractions; f++) /* widening 32-bit products: vectorized */
                sum += (uint64_t)k[f] * (f | implicit), square += (uint64_t)k[f] * ((f | implicit) * (f | implicit));
            rows[sign][e] = total;
            if (e < (int)top)
                parts[at] += (int64_t)sum, parts[512 + at] += (int64_t)square;
            else
                c->inf += k[0], c->nan += total - k[0];
        }
    c->zeros += count[0] + count[1u << 15];
    /* the smallest: in the negative row of the largest exponent the largest fraction, else in the positive row of
     * the smallest exponent the smallest fraction (-1: none); the largest likewise, signs swapped */
    int64_t low = -1, high = -1;
    for (int i = 0; i < 2 * (int)top && (low < 0 || high < 0); i++) {
        int down = i < (int)top, e_low = down ? (int)top - 1 - i : i - (int)top, e_high = e_low;
        const uint32_t *k_low = count + (down << 15) + (e_low << fb), *k_high = count + (!down << 15) + (e_high << fb);
        for (int f = 0; low < 0 && rows[down][e_low] && f < (int)fractions; f++)
            if (k_low[down ? (int)fractions - 1 - f : f])
                low = ((int64_t)down << 15) + (e_low << fb) + (down ? (int)fractions - 1 - f : f);
        for (int f = 0; high < 0 && rows[!down][e_high] && f < (int)fractions; f++)
            if (k_high[down ? (int)fractions - 1 - f : f])
                high = ((int64_t)!down << 15) + (e_high << fb) + (down ? (int)fractions - 1 - f : f);
    }
    c->found = low >= 0, c->low = (uint32_t)low, c->high = (uint32_t)high;
    free(count);
    return 0;
}

/* float32: per element two sums into 2^13 bins of 16 bytes: count and l packed in one (l sums below 2^41, the
 * count from 2^42 up, moved to counts every 2^20 elements) beside the sum of l^2, reduced per (sign, exponent) at
 * the end (only the bins of the exponents used: see EXPONENTS). No branch per element: ±0 are the elements of the
 * two zero bins when those hold no low bits, and NaN and Inf fill only the bins of exponent 255; where either is
 * not so (rare), one more pass counts them and finds the finite extremes. */
enum { BINS = 1 << (32 - LOW_BITS), NEGATIVE = BINS / 2, TOP = 255 << (23 - LOW_BITS) };
#define COUNT_SHIFT 42

static inline Pair addends(uint32_t bits) { /* one element's (count and l, l^2) */
    uint64_t l = bits & ((1u << LOW_BITS) - 1);
    return (Pair){((uint64_t)1 << COUNT_SHIFT) + l, l * l};
}

typedef struct {
    Pair *bins;       /* (count 2^42 + sum of l, sum of l^2) */
    uint64_t *counts; /* the counts moved out of bins */
    int first, last;  /* the bins used: those of exponent 0 (the zeros) and of the exponents first..last */
} Bins32;

#define USED_BINS(b, u)                                                                                         \
    EACH_USED(e, (b)->first, (b)->last)                                                                         \
        for (int sign = 0; sign < 2; sign++)                                                                    \
            for (int u = sign * NEGATIVE + (e << 4), end = u + 16; u < end; u++)

static void move_counts(Bins32 *b) {
    USED_BINS(b, u) {
        b->counts[u] += b->bins[u][0] >> COUNT_SHIFT;
        b->bins[u][0] &= ((uint64_t)1 << COUNT_SHIFT) - 1;
    }
}

/* The portable pass: an element at a time, the fingerprint in four lanes held in registers. */
static void pass32(const uint32_t *v, Py_ssize_t n, Py_ssize_t columns, Bins32 *b, uint64_t *row, float *low,
                   float *high) {
    Py_ssize_t until_move = 1 << 20;
    Pair *bins = b->bins;
    float value, smallest = *low, largest = *high;
#define ELEMENT(at, lane)                                                                                       \
    do {                                                                                                        \
        uint32_t bits = v[at], hash = bits * 0x9E3779B1u;                                                       \
        lane = lane * inverse4 + (hash ^ (hash >> 16));                                                         \
        bins[bits >> LOW_BITS] += addends(bits);                                                                \
        memcpy(&value, &bits, sizeof value);                                                                    \
        smallest = value < smallest ? value : smallest; /* minss, maxss: no branch */                           \
        largest = value > largest ? value : largest;                                                            \
        if (--until_move == 0)                                                                                  \
            move_counts(b), until_move = 1 << 20;                                                               \
    } while (0)
    ROWS4(ELEMENT);
#undef ELEMENT
    *low = smallest, *high = largest;
}

#if VECTOR_BLOCKS
/* The pass for AVX2 and AVX-512 (the compiler's vectors): per block of 64 elements of a row, the vectorisable work
 * first (the fingerprint in 64 lanes, min and max per lane, each element's addends), then one 16-byte addition per
 * element to its bin. */
VECTOR_CLONES
static void pass32_blocks(const uint32_t *v, Py_ssize_t n, Py_ssize_t columns, Bins32 *b, uint64_t *row,
                          float *low, float *high) {
    float lows[64], highs[64], value; /* NaN never compares below or above */
    for (int k = 0; k < 64; k++)
        lows[k] = INFINITY, highs[k] = -INFINITY;
    Py_ssize_t until_move = 1 << 20;
    Pair *bins = b->bins;
#define BLOCK(at, m)                                                                                            \
    do {                                                                                                        \
        const uint32_t *block = v + (at);                                                                       \
        uint64_t pairs[2 * 64] __attribute__((aligned(16))); /* addends(), but not Pairs: those keep it scalar */ \
        uint32_t at_byte[64]; /* the element's bin as a byte offset: no shift in the scatter below */          \
        for (int k = 0; k < (m); k++) {                                                                         \
            uint32_t bits = block[k], hash = bits * 0x9E3779B1u;                                                \
            uint64_t l = bits & ((1u << LOW_BITS) - 1);                                                         \
            s[k] = s[k] * inverse + (hash ^ (hash >> 16));                                                      \
            pairs[2 * k] = ((uint64_t)1 << COUNT_SHIFT) + l, pairs[2 * k + 1] = l * l;                          \
            at_byte[k] = (bits >> LOW_BITS) * (uint32_t)sizeof(Pair);                                           \
            memcpy(&value, &bits, sizeof value);                                                                \
            lows[k] = value < lows[k] ? value : lows[k]; /* minps, maxps */                                     \
            highs[k] = value > highs[k] ? value : highs[k];                                                     \
        }                                                                                                       \
        _Pragma("GCC unroll 4") for (int k = 0; k < (m); k++)                                                   \
            *(Pair *)((char *)bins + at_byte[k]) += *(Pair *)(pairs + 2 * k);                                   \
        if ((until_move -= (m)) <= 0)                                                                           \
            move_counts(b), until_move = 1 << 20;                                                               \
    } while (0)
    ROWS(64, inverse64, BLOCK);
#undef BLOCK
    for (int k = 0; k < 64; k++) {
        *low = lows[k] < *low ? lows[k] : *low;
        *high = highs[k] > *high ? highs[k] : *high;
    }
}
#endif

static int measure32(const uint32_t *v, Py_ssize_t n, Py_ssize_t columns, int portable, int64_t *parts,
                     uint64_t *row, Counts *c) {
    Bins32 b = {malloc(BINS * (sizeof(Pair) + sizeof(uint64_t))), NULL, 0, 0};
    if (b.bins == NULL)
        return -1;
    b.counts = (uint64_t *)(b.bins + BINS);
    if (n < WHOLE_TABLE_FROM)
        exponents32(v, n, 23, &b.first, &b.last);
    else
        b.first = 0, b.last = 255;
    USED_BINS(&b, u) {
        b.bins[u] = (Pair){0, 0}, b.counts[u] = 0;
    }
    float low = INFINITY, high = -INFINITY, value;
#if VECTOR_BLOCKS
    if (!portable && __builtin_cpu_supports("avx2"))
        pass32_blocks(v, n, columns, &b, row, &low, &high);
    else
#endif
        pass32(v, n, columns, &b, row, &low, &high);
    move_counts(&b);
    uint64_t special = (b.bins[0][0] | b.bins[NEGATIVE][0]); /* low bits in a zero bin: not all ±0 */
    for (int sign = 0; b.last == 255 && sign < 2; sign++) /* NaN or Inf */
        for (int f = 0; f < 16; f++)
            special |= b.counts[sign * NEGATIVE + TOP + f];
    if (special) {
        low = INFINITY, high = -INFINITY;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t bits = v[i];
            if ((bits & 0x7F800000) == 0x7F800000) {
                *(bits & 0x7FFFFF ? &c->nan : &c->inf) += 1;
                continue;
            }
            c->zeros += (bits << 1) == 0;
            memcpy(&value, &bits, sizeof value);
            low = value < low ? value : low;
            high = value > high ? value : high;
        }
    } else
        c->zeros += b.counts[0] + b.counts[NEGATIVE];
    c->found = low <= high;
    memcpy(&c->low, &low, sizeof low);
    memcpy(&c->high, &high, sizeof high);
    EACH_USED(e, b.first, b.last)
        for (int at = e; at < 512 && e < 255; at += 256) { /* either sign; exponent 255 (NaN, Inf) not summed */
            int64_t sums[5] = {0}, implicit = e != 0 ? 16 : 0;
            for (int u = at << 4, f = 0; f < 16; u++, f++) {
                int64_t k = (int64_t)b.counts[u], a = f | implicit, l = (int64_t)b.bins[u][0];
                sums[0] += k * a, sums[1] += k * a * a, sums[2] += l, sums[3] += l * a;
                sums[4] += (int64_t)b.bins[u][1];
            }
            for (int i = 0; i < 5; i++)
                parts[512 * i + at] += sums[i];
        }
    free(b.bins);
    return 0;
}

/* limbs += value 2^shift, in 32-bit digits held in 64 bits (room for the carries of every addition) */
static void add_shifted(uint64_t *limbs, unsigned __int128 value, int shift) {
    value <<= shift % 32; /* below 2^73 before: no bit lost */
    for (int w = shift / 32; value; w++, value >>= 32)
        limbs[w] += (uint32_t)value;
}

/* The limbs as a little-endian unsigned integer (bytes), the carries propagated. */
static PyObject *integer(uint64_t *limbs, int count) {
    unsigned char bytes[4 * SQUARE_LIMBS];
    for (int w = 0; w < count; w++) {
        if (w + 1 < count)
            limbs[w + 1] += limbs[w] >> 32;
        for (int b = 0; b < 4; b++)
            bytes[4 * w + b] = (unsigned char)(limbs[w] >> (8 * b));
    }
    return PyBytes_FromStringAndSize((const char *)bytes, 4 * count);
}

static PyObject *floats(PyObject *self, PyObject *args) {
    PyObject *data_o, *out_o, *result = NULL;
    Py_ssize_t columns;
    int eb, fb, failed, portable = 0;
    Py_buffer data, out;
    unsigned long long row_step;
    if (!PyArg_ParseTuple(args, "OniiOK|p", &data_o, &columns, &eb, &fb, &out_o, &row_step, &portable))
        return NULL;
    int width = eb == 8 && fb == 23 ? 4 : 2;
    if ((width == 2 && (eb < 1 || eb > 8 || eb + fb != 15)) || columns <= 0) { /* parts hold 256 exponents */
        PyErr_SetString(PyExc_ValueError, "not a float32, bfloat16 or float16 layout");
        return NULL;
    }
    if (PyObject_GetBuffer(data_o, &data, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto release_data;
    Py_ssize_t n = data.len / width;
    if (data.len % width || n % columns || n > MAX_ELEMENTS || out.len < (Py_ssize_t)sizeof(uint64_t) * (n / columns)) {
        PyErr_SetString(PyExc_ValueError, "data or out does not have the sizes floats() needs");
        goto release_out;
    }
    Counts c = {0};
    int64_t parts[5 * 512] = {0};
    uint64_t limbs[2][TOTAL_LIMBS] = {{0}}, squares[SQUARE_LIMBS] = {0}, rows = 0, step;
    Py_BEGIN_ALLOW_THREADS
    failed = width == 4 ? measure32(data.buf, n, columns, portable, parts, out.buf, &c)
                        : measure16(data.buf, n, columns, eb, fb, parts, out.buf, &c);
    for (int at = 0; !failed && at < 512; at++) { /* every part below 2^62: see measure16 and measure32 */
        int sign = at >> 8, shift = (at & 255) > 1 ? (at & 255) - 1 : 0;
        if (!(parts[at] | parts[512 + at] | parts[1024 + at] | parts[1536 + at] | parts[2048 + at]))
            continue; /* an exponent the slab does not hold (most of them): nothing to add */
        unsigned __int128 total = (uint64_t)parts[at], square = (uint64_t)parts[512 + at];
        if (width == 4) { /* the significand a 2^19 + l */
            total = (total << LOW_BITS) + (uint64_t)parts[1024 + at];
            square = (square << (2 * LOW_BITS)) + ((unsigned __int128)(uint64_t)parts[1536 + at] << (LOW_BITS + 1)) +
                     (uint64_t)parts[2048 + at];
        }
        add_shifted(limbs[sign], total, shift);
        add_shifted(squares, square, 2 * shift);
    }
    step = 1; /* sum over rows r of row_step^r out[r] */
    for (Py_ssize_t r = 0; r < n / columns; r++, step *= row_step)
        rows += step * ((uint64_t *)out.buf)[r];
    Py_END_ALLOW_THREADS
    if (failed)
        PyErr_NoMemory();
    else
        result = Py_BuildValue("KKKLLNNNK", c.zeros, c.nan, c.inf, c.found ? (long long)c.low : -1LL,
                               c.found ? (long long)c.high : -1LL, integer(limbs[0], TOTAL_LIMBS),
                               integer(limbs[1], TOTAL_LIMBS), integer(squares, SQUARE_LIMBS), rows);
release_out:
    PyBuffer_Release(&out);
release_data:
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"floats", floats, METH_VARARGS,
     "floats(data, columns, exponent_bits, fraction_bits, out, row_step[, portable]) -> (zeros, nan, inf, low, "
     "high, positive, negative, squares, rows): one slab of float32, bfloat16 or float16 elements (see _health.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor.values._health", "check --health's per-element loop (see _health.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__health(void) {
    inverse4 = inverse(power(GOLDEN, 4)), inverse64 = inverse(power(GOLDEN, 64));
    for (uint64_t bits = 0; bits < 1 << 16; bits++) { /* splitmix64, as slab_stats._splitmix */
        uint64_t x = bits + GOLDEN;
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
        pattern_hash[bits] = x ^ (x >> 31);
    }
    return PyModule_Create(&module_def);
}
