"""Writes the tokenizer.json fixtures of test_tokenizer.c and, beside each,
NAME.ids: one line per id, "ID HEX" with the bytes transformers' tokenizers
spell for it (empty HEX: no token has the id). Needs the tokenizers and
transformers packages: python3 make_tokenizers.py (in tests/data)."""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken
from transformers.convert_slow_tokenizer import bytes_to_unicode

TEXT = ["moe trains Mixture-of-Experts transformers from C: routers, experts, all-to-all.",
        "Ünïcödé täkes twö bytes, 漢字 three, and 🙂 four.\nTabs\tand new lines too.",
        "def f(x):\n    return x * 2  # a comment\n"] * 40
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      special_tokens=SPECIALS))
    tok.add_special_tokens([AddedToken("<|pad|>", special=True)])
    # Added tokens outside the byte alphabet, in it, and mixing both.
    tok.add_tokens(["漢字", "\u0120x", "é中", "\u0120日本", "café "])
    decode = {c: b for b, c in bytes_to_unicode().items()}
    ids = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        # A token with a character outside the alphabet stays as it is.
        ids[i] = bytes(decode[c] for c in token) if all(c in decode for c in token) else token.encode()
        try:  # where the bytes are text, the decoder's own reading agrees
            assert decoders.ByteLevel().decode([token]) == ids[i].decode(), token
        except UnicodeDecodeError:
            pass
    return tok, ids


def metaspace():
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"] + alphabet))
    ids = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if token in alphabet:  # ByteFallback's bytes, which a lone one cannot show as text
            ids[i] = bytes([int(token[3:5], 16)])
        else:  # the decoder without its Strip, one token at a time
            ids[i] = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse()]).decode([token]).encode()
    return tok, ids


for name, make in [("tokenizer_byte_level", byte_level), ("tokenizer_metaspace", metaspace)]:
    tok, ids = make()
    tok.save(f"{name}.json")
    with open(f"{name}.ids", "w") as f:
        for i in range(max(ids) + 1):
            f.write(f"{i} {ids.get(i, b'').hex()}\n")


# Encoding: Llama 3's and Qwen2's split patterns (with Llama 3's
# begin-of-text template and Qwen's NFC), beside GPT-2's byte-level one;
# NAME.enc holds texts (hex) and the ids transformers' tokenizers gives them.
from tokenizers import normalizers, processors, Regex

LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
ASCII = [t for t in TEXT[:3]] + [
    "Hello world!  It's 2026; they'll say \"42,195 km\" -- isn't it?\n\n\tdone...",
    "def f(x):\n    return x * 2  # a comment\n\n\n   ",
    "<|im_end|>mixed<|endoftext|> text, THEY'RE SHOUTING'LL  \r\n\r\n end",
    "1234567 + 89 = 1234656;;; ~~~ @@@@ ####\t\t\t x",
    "   leading spaces and trailing   ",
]
# And 200 random strings over the classes the patterns tell apart.
_rng = __import__("random").Random(7)
_ALPHABET = "aAzZ09 \t\n\r\x0b\x0c'sStTrRvVmMlLdD.,;!?-_#@~\"(){}<>|"
ASCII += ["".join(_rng.choice(_ALPHABET) for _ in range(_rng.randint(1, 60))) for _ in range(200)]
# Beyond ASCII: letters, numbers and spaces of other scripts and planes (a
# long s, which (?i:'s) takes), symbols, emoji, a byte order mark; all of
# them NFC's own (UNICODE_NFC_CHANGES is what NFC changes).
_UNICODE = ("éÉßſ\u00c6øŁ漢字かなカナ한국어\u03a9ωжщ\u05d0\u05d1\u0627\u0628\u0e01\u0905\U0001d400\U00020000"
            "٣۴५৬໗①½Ⅻ²\U0001d7ce\u00a0\u2003\u3000\u2028\u0085\u1680"
            "\u2019\u201c\u201d\u2014\u2026€£¥©®™°±§¶•\U0001f642\U0001f680\u200d\ufeff")
# Marks NFC composes (acute, dot below, Tamil aa, kana voicing) or reorders
# (Hebrew hiriq before sheva), and Kelvin's K, which NFC maps to K.
UNICODE_NFC_CHANGES = "\u0301\u0323\u0bbe\u3099\u05b4\u05b0\u212a"
TEXTS = ASCII + ["Ünïcödé it\u2019s \u201cquoted\u201d \u2014 \u017fo '\u017f 'S '\uff33 \uff15 apples ½ Ⅻ², 漢字かな 한국어 "
                 "\U0001f600\u00a0ok\u3000done",
                 "Tab\u2003and\u2028line\u0085next  \u00a0 \u00a0x\n\u2029end",
                 "١٢٣٤٥٦٧ ۱۲۳ 12345 Ⅳ ⅷ ① 𝟎𝟏𝟐"]
TEXTS += ["".join(_rng.choice(_ALPHABET + _UNICODE) for _ in range(_rng.randint(1, 60))) for _ in range(200)]


def split_tokenizer(pattern, nfc, bos):
    tok = Tokenizer(models.BPE(ignore_merges=bos))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      special_tokens=SPECIALS + ["<|begin_of_text|>"]))
    if nfc:  # normalized added tokens, which match as their NFC: "K9" and "\u00e9x"
        tok.add_tokens(["\u212a9", "e\u0301x"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 2)])
    return tok


def byte_level_of(tok):
    decode = {c: b for b, c in bytes_to_unicode().items()}
    ids = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        ids[i] = bytes(decode[c] for c in token) if all(c in decode for c in token) else token.encode()
    return ids


for name, tok in [("tokenizer_llama3", split_tokenizer(LLAMA3, False, True)),
                  ("tokenizer_qwen2", split_tokenizer(QWEN2, True, False))]:
    tok.save(f"{name}.json")
    ids = byte_level_of(tok)
    with open(f"{name}.ids", "w") as f:
        for i in range(max(ids) + 1):
            f.write(f"{i} {ids.get(i, b'').hex()}\n")
# Texts with the marks NFC composes or reorders, and Kelvin's K, and
# some that NFC takes apart and puts together again otherwise: Hangul
# jamo into a syllable, a mark tokenizers' Unicode version does not know
# (U+089F, which it leaves before a mark of class 9), a composite that
# keeps a mark of a lower class after it, a singleton (Ohm's sign); and
# Qwen2's normalized added tokens, as written and in other forms.
_MARKED = ["".join(_rng.choice(_ALPHABET + _UNICODE + UNICODE_NFC_CHANGES) for _ in range(_rng.randint(1, 40)))
           for _ in range(100)]
_MARKED += ["\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af", "\u089f\u0b4d x\u0b4d\u089f",
            "a\u0323\u0302 \u1ea5\u0323 e\u0301\u0301 \u2126 \u0958 \u00c5\u030a", "\u212aelvin \u212b \u1e0a\u0323",
            "K9 \u212a9 \u00e9x e\u0301x e\u0301\u0301x"]
# Added tokens' contents as the JSON spells them, not as the decoder does:
# GPT-2's "\u0120x" matches U+0120 x, not " x" (which BPE takes).
_MARKED += ["a\u0120x b \u0120\u65e5\u672c \u65e5\u672c x", "\u0120\u0120x"]
for name in ["tokenizer_byte_level", "tokenizer_llama3", "tokenizer_qwen2"]:
    tok = Tokenizer.from_file(f"{name}.json")
    with open(f"{name}.enc", "w") as f:
        for text in TEXTS + _MARKED:
            f.write(f"{text.encode().hex()} {','.join(map(str, tok.encode(text).ids))}\n")


# SentencePiece-style encoding, as Mistral's, Mixtral's and Llama 2's
# tokenizer.json files hold it: spaces spelled U+2581 by a Prepend and a
# Replace normalizer (Mixtral's, its text between added tokens one word)
# or a Metaspace pre-tokenizer (scheme always and split, or first and
# whole); characters outside the vocabulary as ByteFallback's <0xNN>
# tokens, or (where a byte has none) as the unknown token, fused or not.
MARK = "\u2581"


def sentencepiece(name, byte_tokens, fuse_unk, template):
    alphabet = [f"<0x{b:02X}>" for b in byte_tokens]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=fuse_unk))
    # Mixtral's pieces stop at spaces; the other's merges cross them ("▁▁", "e▁t").
    mixtral = name == "tokenizer_mixtral"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=mixtral)
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=len(alphabet) + 240, limit_alphabet=40,
                                                      special_tokens=["<unk>", "<s>", "</s>"] + alphabet))
    if mixtral:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(MARK), normalizers.Replace(" ", MARK)])
        tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    # Special tokens matched as written, and normalized ones by their
    # normalized content (with a space, and one that begins a word).
    tok.add_special_tokens(["[INST]", "[/INST]"])
    tok.add_tokens([AddedToken("moe trains", normalized=True), AddedToken(MARK + "all", normalized=True)])
    return tok


SPACED = ["", " ", "  ", "a", " a", "a ", "  two  spaces  ", "\u2581x \u2581 y\u2581", "<s>start", "</s> end",
          "[INST] What is moe? [/INST] moe trains experts.[INST]again[/INST]", "moe trains moe trainsmoe trains",
          "all of them, all\u2581all", "x [INST]", "\u2581\u2581lead", "\t tab\n\nnew  line "]
for name, bytes_, fuse, template in [("tokenizer_mixtral", range(256), True, "<s> $A"),
                                     ("tokenizer_llama_first", list(range(128)) + [0xC3, 0xE6, 0xBC, 0xA2], True,
                                      "<s> $A </s>")]:
    tok = sentencepiece(name, bytes_, fuse, template)
    tok.save(f"{name}.json")
with_texts = [("tokenizer_metaspace", TEXTS + _MARKED + SPACED), ("tokenizer_mixtral", TEXTS + _MARKED + SPACED),
              ("tokenizer_llama_first", TEXTS + _MARKED + SPACED)]
for name, texts in with_texts:
    tok = Tokenizer.from_file(f"{name}.json")
    with open(f"{name}.enc", "w") as f:
        for text in texts:
            f.write(f"{text.encode().hex()} {','.join(map(str, tok.encode(text).ids))}\n")
