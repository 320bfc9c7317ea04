#include "engine/unicode.h"

#include <stdlib.h>
#include <string.h>

static int compare_code_point(uint32_t a, uint32_t b) { return (a > b) - (a < b); }

static int compare_to_range(const void *key, const void *range) {
    const uint32_t c = *(const uint32_t *)key;
    const moe_unicode_range *r = range;
    return c < r->first ? -1 : c > r->last;
}

/* The value of the range holding c; fallback when none does. */
static int lookup(const moe_unicode_range *r, size_t n, uint32_t c, int fallback) {
    const moe_unicode_range *hit = bsearch(&c, r, n, sizeof *r, compare_to_range);
    return hit ? hit->value : fallback;
}

moe_unicode_class moe_unicode_class_of(uint32_t c) {
    return (moe_unicode_class)lookup(moe_unicode_classes, moe_unicode_class_count, c, MOE_UNICODE_OTHER);
}

int moe_unicode_combining_class(uint32_t c) {
    return lookup(moe_unicode_combining, moe_unicode_combining_count, c, 0);
}

char moe_unicode_fold_letter(uint32_t c) {
    if (c >= 'A' && c <= 'Z') c += 'a' - 'A';
    if (c < 0x80) return c >= 'a' && c <= 'z' ? (char)c : 0;
    for (size_t i = 0; i < moe_unicode_fold_count; i++)
        if (moe_unicode_folds[i].code_point == c) return moe_unicode_folds[i].letter;
    return 0;
}

int32_t moe_utf8_decode(const unsigned char *s, size_t n, size_t *len) {
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000}; /* the smallest each length may spell */
    const unsigned char b = s[0];
    const size_t k = b < 0x80 ? 1 : b >= 0xC2 && b < 0xE0 ? 2 : b >= 0xE0 && b < 0xF0 ? 3 : b >= 0xF0 && b < 0xF5 ? 4 : 0;
    if (k == 0 || k > n) return -1;
    uint32_t c = k == 1 ? b : (uint32_t)(b & (0x7F >> k));
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        c = c << 6 | (s[i] & 0x3F);
    }
    if (c < least[k] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return -1;
    *len = k;
    return (int32_t)c;
}

size_t moe_utf8_encode(uint32_t c, unsigned char *out) {
    if (c < 0x80) {
        out[0] = (unsigned char)c;
        return 1;
    }
    static const unsigned char lead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
    const size_t k = c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
    for (size_t i = k - 1; i > 0; i--, c >>= 6) out[i] = (unsigned char)(0x80 | (c & 0x3F));
    out[0] = (unsigned char)(lead[k] | c);
    return k;
}

/* Hangul syllables: 19 leading consonants x 21 vowels x 28 trailing
 * (none first), from U+AC00 (UAX #15, 3.12). */
enum { S_BASE = 0xAC00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11A7, L_COUNT = 19, V_COUNT = 21, T_COUNT = 28 };
enum { N_COUNT = V_COUNT * T_COUNT, S_COUNT = L_COUNT * N_COUNT };

static int compare_decompositions(const void *a, const void *b) {
    return compare_code_point(((const moe_unicode_decomposition *)a)->code_point,
                              ((const moe_unicode_decomposition *)b)->code_point);
}

/* c's full canonical decomposition into out; returns its length. */
static size_t decompose(uint32_t c, uint32_t *out) {
    if (c >= S_BASE && c < S_BASE + S_COUNT) {
        const uint32_t s = c - S_BASE, t = s % T_COUNT;
        out[0] = L_BASE + s / N_COUNT;
        out[1] = V_BASE + (s % N_COUNT) / T_COUNT;
        if (t) out[2] = T_BASE + t;
        return t ? 3 : 2;
    }
    const moe_unicode_decomposition key = {.code_point = c};
    const moe_unicode_decomposition *d = bsearch(&key, moe_unicode_decompositions, moe_unicode_decomposition_count,
                                                 sizeof key, compare_decompositions);
    if (!d) {
        out[0] = c;
        return 1;
    }
    for (size_t i = 0; i < d->length; i++) out[i] = moe_unicode_decomposed[d->at + i];
    return d->length;
}

static int compare_compositions(const void *a, const void *b) {
    const moe_unicode_composition *x = a, *y = b;
    const int by_first = compare_code_point(x->first, y->first);
    return by_first ? by_first : compare_code_point(x->second, y->second);
}

/* What first and second compose into; 0: nothing. */
static uint32_t compose(uint32_t first, uint32_t second) {
    if (first >= L_BASE && first < L_BASE + L_COUNT && second >= V_BASE && second < V_BASE + V_COUNT)
        return S_BASE + ((first - L_BASE) * V_COUNT + (second - V_BASE)) * T_COUNT;
    if (first >= S_BASE && first < S_BASE + S_COUNT && (first - S_BASE) % T_COUNT == 0 && second > T_BASE &&
        second < T_BASE + T_COUNT)
        return first + (second - T_BASE);
    const moe_unicode_composition key = {.first = first, .second = second};
    const moe_unicode_composition *p =
        bsearch(&key, moe_unicode_compositions, moe_unicode_composition_count, sizeof key, compare_compositions);
    return p ? p->composite : 0;
}

/* Marks v [n] in ascending combining class, stably: by insertion when
 * few, else counted by class into scratch, so that a long run of marks
 * costs linear time. */
static void sort_marks(uint32_t *v, size_t n, uint32_t *scratch) {
    if (n <= 16) {
        for (size_t i = 1; i < n; i++) {
            const uint32_t c = v[i];
            const int cc = moe_unicode_combining_class(c);
            size_t j = i;
            while (j > 0 && moe_unicode_combining_class(v[j - 1]) > cc) v[j] = v[j - 1], j--;
            v[j] = c;
        }
        return;
    }
    size_t at[257] = {0};
    for (size_t i = 0; i < n; i++) at[moe_unicode_combining_class(v[i]) + 1]++;
    for (int k = 1; k <= 256; k++) at[k] += at[k - 1];
    for (size_t i = 0; i < n; i++) scratch[at[moe_unicode_combining_class(v[i])]++] = v[i];
    memcpy(v, scratch, n * sizeof *v);
}

size_t moe_unicode_nfc(const uint32_t *in, size_t n, uint32_t *out, uint32_t *scratch) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++) m += decompose(in[i], out + m);
    for (size_t i = 0; i < m;) { /* each run of marks */
        size_t end = i;
        while (end < m && moe_unicode_combining_class(out[end])) end++;
        sort_marks(out + i, end - i, scratch);
        i = end > i ? end : i + 1;
    }
    if (m == 0) return 0;
    /* A mark composes with the last starter unless something between has
     * class 0 or one at least its own; a starter, only right after it. */
    size_t starter = 0, kept = 1;
    int last = moe_unicode_combining_class(out[0]) ? 256 : 0;
    for (size_t i = 1; i < m; i++) {
        const uint32_t c = out[i];
        const int cc = moe_unicode_combining_class(c);
        const uint32_t composite = last == 256 ? 0 : compose(out[starter], c);
        if (composite && (last < cc || last == 0)) {
            out[starter] = composite;
            continue;
        }
        if (cc == 0) starter = kept;
        last = cc;
        out[kept++] = c;
    }
    return kept;
}
