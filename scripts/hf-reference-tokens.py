#!/usr/bin/env python3
# The independent reference of tests/tokenizer.rs: Hugging Face transformers reads the tokenizer
# and the chat template out of the same GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`),
# and this prints, as Rust, the token ids (and byte offsets) of the test's strings and the
# rendered chat templates, for pasting into the test.
#
# One correction is applied, and checked: transformers (5.24) maps `tokenizer.ggml.pre` values to
# pre-tokenizers only for the Llama 3 / Qwen / GPT-4o families; SmolLM2's value, "smollm", gets
# GPT2Tokenizer's plain ByteLevel split, while SmolLM2's own tokenizer.json (and llama.cpp's
# "smollm" case, which llama.cpp's test-tokenizer-0 checked against Hugging Face's tokenizer when
# it was added) first isolates every digit: Sequence[Digits(individual_digits=true),
# ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=true)]. The two differ only where
# a run of whitespace precedes a digit ("  1": [ĠĠ, 1] vs [Ġ, Ġ, 1]). The reference is therefore
# transformers' GGUF tokenizer with that pre-tokenizer set; the script prints the strings where
# transformers' uncorrected load differs, and also checks every string against a small
# tokenizer written here from scratch (llama.cpp's two-stage regex split, rank-ordered BPE,
# special tokens matched first) that shares no code with the `tokenizers` library.
#
# Needs transformers, tokenizers, gguf, regex and jinja2 — and torch: transformers' GGUF reader
# imports it, though reading a tokenizer uses none of it (a CPU-only install suffices).
# Run 2026-12-01: transformers 5.24.0, tokenizers 0.23.3, torch 2.15.0, gguf 0.19.0, jinja2 3.1.6.
# Usage: scripts/hf-reference-tokens.py models/SmolLM2-135M-Instruct.Q4_1.gguf
import os
import sys

import regex
import transformers
import tokenizers
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
plain = tok.backend_tokenizer
ref = tokenizers.Tokenizer.from_str(plain.to_str())
ref.pre_tokenizer = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]
)

# The strings of tests/tokenizer.rs, in its order.
STRINGS = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "café naïve résumé Ångström façade",
    "日本語のテキストと中文字符",
    "emoji: 😀👍🏽🚀 and 👨\u200d👩\u200d👧",
    "Привет мир مرحبا שלום 안녕하세요 สวัสดี",
    " ",
    "\n",
    "  leading and trailing spaces   ",
    "tabs\tand\t\ttabs\t",
    "line one\nline two\n\n\nline five\r\n",
    "a    b     c",
    "\t\t\n  \n",
    "numbers: 1 12 123 1234 3.14159 -42 1,000,000 2024-12-01",
    "  12",
    "x =  7\n\n3\t\t5",
    "don't I'm we'll they've she'd it's DON'T I'M",
    "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
    "def f(a, b):\n\treturn a ** 2 + b  # comment\n",
    '{\n  "a": [\n    10,\n    20\n  ]\n}',
    "!!! ??? ... --- *** ### @@ $$ %% ^^ && || ~~ ``",
    "Über 9000 — “quotes” ‘single’ … «guillemets»",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|endoftext|>",
    "<|im_start <|im_start| im_start|> <|im_end|><|im_end|>",
    "<repo_name>hesper<file_sep>src/lib.rs<gh_stars>10",
    "ctrl\x04char and \U00050000 plane-5",
]

# The strings whose byte offsets the test also compares.
OFFSETS = [
    "Hello, world!",
    "café naïve résumé Ångström façade",
    "emoji: 😀👍🏽🚀 and 👨\u200d👩\u200d👧",
    "  leading and trailing spaces   ",
    "<|im_start|>user\nhi<|im_end|>",
    "  12",
]

# Conversations for the chat template: (name, messages, add_generation_prompt).
CHATS = [
    (
        "system_user_assistant",
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Arr, hello."},
        ],
        False,
    ),
    ("user_only", [{"role": "user", "content": "What is 2+2?"}], False),
    ("user_only_generation_prompt", [{"role": "user", "content": "What is 2+2?"}], True),
    (
        "no_system_two_turns",
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
        True,
    ),
]


def rust_str(s):
    out = []
    for c in s:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        elif ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u200d\ufeff" or ord(c) >= 0x40000:
            out.append("\\u{%x}" % ord(c))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


# --- an independent tokenizer: llama.cpp's "smollm" split, BPE by rank, specials first ---------
GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
BYTE_CHAR = dict(zip(bs, map(chr, cs)))
vocab = plain.get_vocab(with_added_tokens=False)
import json

merges = json.loads(plain.to_str())["model"]["merges"]
ranks = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")): i for i, m in enumerate(merges)}
specials = sorted((t.content for t in plain.get_added_tokens_decoder().values()), key=len, reverse=True)


def bpe(word):
    parts = list(word)
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get((parts[i], parts[i + 1]), 1 << 60))
        if (parts[best], parts[best + 1]) not in ranks:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def scratch_encode(text):
    ids = []
    i = 0
    piece = ""
    pieces = []
    while i < len(text):
        for s in specials:
            if text.startswith(s, i):
                pieces.append(piece)
                pieces.append((s,))
                piece = ""
                i += len(s)
                break
        else:
            piece += text[i]
            i += 1
    pieces.append(piece)
    for p in pieces:
        if isinstance(p, tuple):
            ids.append(vocab.get(p[0]) if p[0] in vocab else plain.token_to_id(p[0]))
            continue
        # llama.cpp: first \p{N} (each digit alone, the rest kept between), then the GPT-2 regex.
        chunks = [c for c in regex.split(r"(\p{N})", p) if c]
        for chunk in chunks:
            for word in GPT2_SPLIT.findall(chunk):
                spelled = "".join(BYTE_CHAR[b] for b in word.encode("utf-8"))
                for sym in bpe(spelled):
                    if sym in vocab:
                        ids.append(vocab[sym])
                    else:  # no merge and no token: split to bytes, drop those missing
                        ids.extend(vocab[c] for c in sym if c in vocab)
    return ids


print(f"// transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
print(f"// tokenizer.ggml.pre pre-tokenizer from transformers: {json.loads(plain.to_str())['pre_tokenizer']}")
failures = 0
print("const REFERENCE: [(&str, &[u32]); %d] = [" % len(STRINGS))
for s in STRINGS:
    ids = ref.encode(s, add_special_tokens=False).ids
    scratch = scratch_encode(s)
    if scratch != ids:
        failures += 1
        print(f"// MISMATCH with the scratch tokenizer: {scratch}", file=sys.stderr)
    print(f"    ({rust_str(s)}, &{ids}),")
print("];")
for s in STRINGS:
    got = plain.encode(s, add_special_tokens=False).ids
    want = ref.encode(s, add_special_tokens=False).ids
    if got != want:
        print(f"// transformers' uncorrected GGUF load differs on {rust_str(s)}: {got}")
print()
print("const OFFSETS: [(&str, &[(u32, usize, usize)]); %d] = [" % len(OFFSETS))
for s in OFFSETS:
    enc = ref.encode(s, add_special_tokens=False)
    # Python gives character offsets: turn them into byte offsets.
    byte = lambda c: len(s[:c].encode("utf-8"))
    rows = [(i, byte(a), byte(b)) for i, (a, b) in zip(enc.ids, enc.offsets)]
    print(f"    ({rust_str(s)}, &[{', '.join('(%d, %d, %d)' % r for r in rows)}]),")
print("];")
print()
print("// decode(encode(s)) where it is not s:")
for s in STRINGS:
    d = ref.decode(ref.encode(s, add_special_tokens=False).ids, skip_special_tokens=False)
    if d != s:
        print(f"//   {rust_str(s)} -> {rust_str(d)}")
print()
for name, messages, gen in CHATS:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    print(f"// {name}: add_generation_prompt={gen}")
    print(f"{rust_str(text)}")
print()
print(f"// bos {tok.bos_token!r} {tok.bos_token_id}, eos {tok.eos_token!r} {tok.eos_token_id}, "
      f"pad {tok.pad_token!r} {tok.pad_token_id}, vocab {len(tok)}")
print(f"// scratch tokenizer mismatches: {failures}")
sys.exit(1 if failures else 0)
