/* unicode.h: what encoding text as transformers' tokenizers does needs to
 * know of code points: the classes its split patterns tell apart, the
 * letters its case-insensitive contractions fold, and NFC. The tables
 * (unicode_tables.c) are written by make_unicode_tables.py. */
#ifndef MOE_ENGINE_UNICODE_H
#define MOE_ENGINE_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* \p{L}, \p{N}, \s, or none of them. */
typedef enum moe_unicode_class {
    MOE_UNICODE_OTHER = 0,
    MOE_UNICODE_LETTER,
    MOE_UNICODE_NUMBER,
    MOE_UNICODE_SPACE
} moe_unicode_class;

/* Code points first .. last, each with value. */
typedef struct moe_unicode_range {
    uint32_t first, last;
    int value;
} moe_unicode_range;

typedef struct moe_unicode_fold {
    uint32_t code_point;
    char letter; /* the ASCII lowercase letter it folds onto */
} moe_unicode_fold;

/* code_point's full canonical decomposition: moe_unicode_decomposed [at,
 * at + length). */
typedef struct moe_unicode_decomposition {
    uint32_t code_point;
    uint16_t at;
    uint8_t length;
} moe_unicode_decomposition;

/* first followed by second composes into composite under NFC. */
typedef struct moe_unicode_composition {
    uint32_t first, second, composite;
} moe_unicode_composition;

/* Sorted, disjoint. Classes: the class of each code point not OTHER.
 * Combining: each code point's canonical combining class, where not 0.
 * Decompositions by code point, compositions by (first, second). The NFC
 * tables are those of the Unicode version tokenizers' NFC knows. */
extern const moe_unicode_range moe_unicode_classes[];
extern const size_t moe_unicode_class_count;
extern const moe_unicode_range moe_unicode_combining[];
extern const size_t moe_unicode_combining_count;
extern const uint32_t moe_unicode_decomposed[];
extern const moe_unicode_decomposition moe_unicode_decompositions[];
extern const size_t moe_unicode_decomposition_count;
extern const moe_unicode_composition moe_unicode_compositions[];
extern const size_t moe_unicode_composition_count;
extern const moe_unicode_fold moe_unicode_folds[];
extern const size_t moe_unicode_fold_count;

moe_unicode_class moe_unicode_class_of(uint32_t c);

int moe_unicode_combining_class(uint32_t c);

/* The NFC of in [n] (code points) into out, which has room for 4 n (a
 * code point decomposes into 4 at most), as scratch does; returns how
 * many. Canonical decomposition, canonical ordering, then canonical
 * composition, as Unicode's UAX #15 (Hangul by its formulas). */
size_t moe_unicode_nfc(const uint32_t *in, size_t n, uint32_t *out, uint32_t *scratch);

/* The ASCII lowercase letter c is or folds onto under (?i:...) among the
 * contractions' letters; 0 for any other. */
char moe_unicode_fold_letter(uint32_t c);

/* The code point of the UTF-8 sequence s [n] (n > 0) starts with, its
 * length in *len; -1 when it starts with none (a stray or missing
 * continuation byte, an overlong form, a surrogate, past U+10FFFF). */
int32_t moe_utf8_decode(const unsigned char *s, size_t n, size_t *len);

/* c (at most U+10FFFF) as UTF-8 into out [4]; returns its length. */
size_t moe_utf8_encode(uint32_t c, unsigned char *out);

#endif /* MOE_ENGINE_UNICODE_H */
