"""Writes unicode_tables.c (beside this file): the code point classes that
transformers' tokenizers' split patterns see, and what an NFC check needs.

- Classes: \\p{L}, \\p{N} and \\s as tokenizers (its regex engine, over every
  code point) matches them, and the letters that (?i:...) folds onto the
  contractions' s, t, r, e, v, m, l, d; probed, not taken from a Unicode
  database, so that they are tokenizers' own.
- NFC: each code point's full canonical decomposition, the canonical
  compositions NFC makes (primary composites, the exclusions left out) and
  every combining mark's canonical class, from Python's unicodedata, less
  what tokenizers' NFC does not know: its Unicode version is older, and
  it takes the marks added since for starters that nothing decomposes
  into or composes with (probed, and checked against its NFC on every
  code point). Hangul is algorithmic and in none of them.

Needs the tokenizers package: python3 make_unicode_tables.py (in engine)."""
import unicodedata
from tokenizers import normalizers, pre_tokenizers, Regex

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

HANGUL = range(0xAC00, 0xD7A4)
PROBED = [c for c in CODE_POINTS if c != 0x0A]  # one text per line


def normalized(form, texts):
    """tokenizers' NFD or NFC of each text."""
    out = getattr(normalizers, form)().normalize_str("\n".join(texts)).split("\n")
    assert len(out) == len(texts)
    return out


def disagree(form, texts):
    return {i for i, (a, b) in enumerate(zip(normalized(form, texts), texts))
            if a != unicodedata.normalize(form, b)}


# A mark after a starter, then one of class 1 (which it goes after if its
# class is above 1), or after one of class 230 (which it goes before if
# its class is below): where tokenizers orders a code point other than
# Python does, or decomposes it otherwise, its database lacks the point,
# which it then leaves in place.
unknown = {PROBED[i] for form, make in [("NFD", lambda c: "a" + chr(c) + "\u0334"),
                                        ("NFD", lambda c: "a\u0301" + chr(c)),
                                        ("NFD", chr), ("NFC", chr)]
           for i in disagree(form, [make(c) for c in PROBED])}
for c in unknown:
    ch = chr(c)
    assert normalized("NFD", ["a" + ch + "\u0334", "a\u0301" + ch, ch]) == ["a" + ch + "\u0334", "a\u0301" + ch, ch], hex(c)

combining = {c: unicodedata.combining(chr(c)) for c in CODE_POINTS
             if unicodedata.combining(chr(c)) and c not in unknown}
decompositions, compositions = [], []
for c in CODE_POINTS:
    if c in HANGUL or c in unknown:
        continue
    ch = chr(c)
    full = unicodedata.normalize("NFD", ch)
    if full != ch:
        decompositions.append((c, [ord(x) for x in full]))
    parts = unicodedata.decomposition(ch).split()
    if len(parts) == 2 and not parts[0].startswith("<"):
        first, second = (int(x, 16) for x in parts)
        if unicodedata.normalize("NFC", chr(first) + chr(second)) == ch:
            compositions.append((first, second, c))
compositions.sort()
assert normalized("NFC", [chr(a) + chr(b) for a, b, _ in compositions]) == [chr(c) for _, _, c in compositions]
assert sum(len(parts) for _, parts in decompositions) < 1 << 16 and max(len(p) for _, p in decompositions) <= 4

with open("unicode_tables.c", "w") as f:
    f.write("/* unicode_tables.c: written by make_unicode_tables.py (tokenizers %s, Unicode %s); do not edit. */\n"
            % (__import__("tokenizers").__version__, unicodedata.unidata_version))
    f.write('#include "engine/unicode.h"\n\n')
    f.write("const moe_unicode_range moe_unicode_classes[] = {\n")
    for a, b, v in ranges(classes):
        f.write(f"    {{0x{a:X}, 0x{b:X}, {v}}},\n")
    f.write("};\nconst size_t moe_unicode_class_count = sizeof moe_unicode_classes / sizeof *moe_unicode_classes;\n\n")
    f.write("const uint32_t moe_unicode_decomposed[] = {\n")
    offset = 0
    for c, parts in decompositions:
        f.write("    " + ", ".join(f"0x{x:X}" for x in parts) + ",\n")
    f.write("};\n\nconst moe_unicode_decomposition moe_unicode_decompositions[] = {\n")
    for c, parts in decompositions:
        f.write(f"    {{0x{c:X}, {offset}, {len(parts)}}},\n")
        offset += len(parts)
    f.write("};\nconst size_t moe_unicode_decomposition_count =\n"
            "    sizeof moe_unicode_decompositions / sizeof *moe_unicode_decompositions;\n\n")
    f.write("const moe_unicode_composition moe_unicode_compositions[] = {\n")
    for a, b, c in compositions:
        f.write(f"    {{0x{a:X}, 0x{b:X}, 0x{c:X}}},\n")
    f.write("};\nconst size_t moe_unicode_composition_count =\n"
            "    sizeof moe_unicode_compositions / sizeof *moe_unicode_compositions;\n\n")
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
