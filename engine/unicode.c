#include "engine/unicode.h"

/* The value of the range holding c; fallback when none does. */
static int lookup(const moe_unicode_range *r, size_t n, uint32_t c, int fallback) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (r[mid].last < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && r[lo].first <= c ? r[lo].value : fallback;
}

moe_unicode_class moe_unicode_class_of(uint32_t c) {
    return (moe_unicode_class)lookup(moe_unicode_classes, moe_unicode_class_count, c, MOE_UNICODE_OTHER);
}

bool moe_unicode_nfc_sure(uint32_t c) { return !lookup(moe_unicode_nfc_unsure, moe_unicode_nfc_unsure_count, c, 0); }

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
