/* unicode.h: what encoding text as transformers' tokenizers does needs to
 * know of code points: the classes its split patterns tell apart, the
 * letters its case-insensitive contractions fold, and NFC's quick check.
 * The tables (unicode_tables.c) are written by make_unicode_tables.py. */
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

/* Sorted, disjoint. Classes: the class of each code point not OTHER.
 * NFC unsure: the code points whose text NFC may change (quick check not
 * Yes, or unknown to the database). Combining: each code point's
 * canonical combining class, where not 0. */
extern const moe_unicode_range moe_unicode_classes[];
extern const size_t moe_unicode_class_count;
extern const moe_unicode_range moe_unicode_nfc_unsure[];
extern const size_t moe_unicode_nfc_unsure_count;
extern const moe_unicode_range moe_unicode_combining[];
extern const size_t moe_unicode_combining_count;
extern const moe_unicode_fold moe_unicode_folds[];
extern const size_t moe_unicode_fold_count;

moe_unicode_class moe_unicode_class_of(uint32_t c);

/* Whether NFC leaves every text of code points like c as it is, as far as
 * c goes (its canonical order aside: moe_unicode_combining_class). */
bool moe_unicode_nfc_sure(uint32_t c);

int moe_unicode_combining_class(uint32_t c);

/* The ASCII lowercase letter c is or folds onto under (?i:...) among the
 * contractions' letters; 0 for any other. */
char moe_unicode_fold_letter(uint32_t c);

/* The code point of the UTF-8 sequence s [n] (n > 0) starts with, its
 * length in *len; -1 when it starts with none (a stray or missing
 * continuation byte, an overlong form, a surrogate, past U+10FFFF). */
int32_t moe_utf8_decode(const unsigned char *s, size_t n, size_t *len);

#endif /* MOE_ENGINE_UNICODE_H */
