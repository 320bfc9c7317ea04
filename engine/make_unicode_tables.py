"""Writes unicode_tables.c (beside this file): the code point classes that
transformers' tokenizers' split patterns see, and what an NFC check needs.

- Classes: \\p{L}, \\p{N} and \\s as tokenizers (its regex engine, over every
  code point) matches them, and the letters that (?i:...) folds onto the
  contractions' s, t, r, e, v, m, l, d; probed, not taken from a Unicode
  database, so that they are tokenizers' own.
- NFC: the code points after which NFC may change a text (quick check not
  Yes: those NFC maps elsewhere, the second halves of canonical
  compositions, Hangul vowels and trailing consonants) or that this
  database does not know, and every combining mark's canonical class, for
  the ordering check; from Python's unicodedata.

Needs the tokenizers package: python3 make_unicode_tables.py (in engine)."""
import unicodedata
from tokenizers import pre_tokenizers, Regex

CODE_POINTS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]


def matched(pattern):
    """The code points the pattern matches, one at a time."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="removed")
    out = []
    for s in range(0, len(CODE_POINTS), 50000):
        part = CODE_POINTS[s:s + 50000]
        kept = bytearray(len(part))
        for _, (a, b) in split.pre_tokenize_str("".join(map(chr, part))):
            kept[a:b] = b"\1" * (b - a)
        out += [part[i] for i in range(len(part)) if not kept[i]]
    return out


def ranges(values):
    """{code point: value} as [first, last, value] runs."""
    out = []
    for c in sorted(values):
        if out and out[-1][1] == c - 1 and out[-1][2] == values[c]:
            out[-1][1] = c
        else:
            out.append([c, c, values[c]])
    return out


classes = {}
for name, pattern in [("MOE_UNICODE_LETTER", r"\p{L}"), ("MOE_UNICODE_NUMBER", r"\p{N}"),
                      ("MOE_UNICODE_SPACE", r"\s")]:
    for c in matched(pattern):
        assert c not in classes, (hex(c), name, classes[c])
        classes[c] = name
folds = {ch: [c for c in matched(f"(?i:{ch})") if c >= 0x80] for ch in "strevmld"}

unsure = {}
for c in CODE_POINTS:
    ch = chr(c)
    if unicodedata.category(ch) == "Cn" or unicodedata.normalize("NFC", ch) != ch:
        unsure[c] = 1
    decomposition = unicodedata.decomposition(ch).split()
    if len(decomposition) == 2 and not decomposition[0].startswith("<"):
        first, second = (int(x, 16) for x in decomposition)
        if unicodedata.normalize("NFC", chr(first) + chr(second)) == ch:
            unsure[second] = 1
for c in list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3)):
    unsure[c] = 1
combining = {c: unicodedata.combining(chr(c)) for c in CODE_POINTS if unicodedata.combining(chr(c))}

with open("unicode_tables.c", "w") as f:
    f.write("/* unicode_tables.c: written by make_unicode_tables.py (tokenizers %s, Unicode %s); do not edit. */\n"
            % (__import__("tokenizers").__version__, unicodedata.unidata_version))
    f.write('#include "engine/unicode.h"\n\n')
    f.write("const moe_unicode_range moe_unicode_classes[] = {\n")
    for a, b, v in ranges(classes):
        f.write(f"    {{0x{a:X}, 0x{b:X}, {v}}},\n")
    f.write("};\nconst size_t moe_unicode_class_count = sizeof moe_unicode_classes / sizeof *moe_unicode_classes;\n\n")
    f.write("const moe_unicode_range moe_unicode_nfc_unsure[] = {\n")
    for a, b, v in ranges(unsure):
        f.write(f"    {{0x{a:X}, 0x{b:X}, {v}}},\n")
    f.write("};\nconst size_t moe_unicode_nfc_unsure_count = sizeof moe_unicode_nfc_unsure / sizeof *moe_unicode_nfc_unsure;\n\n")
    f.write("const moe_unicode_range moe_unicode_combining[] = {\n")
    for a, b, v in ranges(combining):
        f.write(f"    {{0x{a:X}, 0x{b:X}, {v}}},\n")
    f.write("};\nconst size_t moe_unicode_combining_count = sizeof moe_unicode_combining / sizeof *moe_unicode_combining;\n\n")
    f.write("/* Beyond ASCII, the letters (?i:...) folds onto each contraction letter. */\n")
    f.write("const moe_unicode_fold moe_unicode_folds[] = {\n")
    for ch, cps in folds.items():
        for c in cps:
            f.write(f"    {{0x{c:X}, '{ch}'}},\n")
    f.write("};\nconst size_t moe_unicode_fold_count = sizeof moe_unicode_folds / sizeof *moe_unicode_folds;\n")
