//! The tokenizer and chat template read from a GGUF's metadata: on small files written below
//! (merges by rank, special tokens, the digit split, every metadata error), on chat templates
//! alone, and on the real SmolLM2-135M-Instruct when present (`scripts/fetch-model`, or
//! `HESPER_SMOLLM2=path`) against Hugging Face transformers' tokenizer of the same file
//! (`scripts/hf-reference-tokens.py`, whose output the constants below are).

mod common;

use common::Meta;
use hesper::io::{ChatMessage, ChatTemplate, GgufFile, PRE_TOKENIZERS, Tokenizer, TokenizerError};

/// The tiny vocabulary: three control tokens, a user-defined one, single bytes in GPT-2's
/// alphabet (`Ġ` is a space, `Ċ` a newline, `Ã` and `©` the two bytes of "é") and merges.
const TOKENS: [&str; 24] = [
    "<|endoftext|>", // 0, control
    "<|im_start|>",  // 1, control
    "<|im_end|>",    // 2, control
    "<think>",       // 3, user-defined
    "a",             // 4
    "b",             // 5
    "c",             // 6
    "d",             // 7
    "h",             // 8
    "i",             // 9
    "1",             // 10
    "2",             // 11
    "Ġ",             // 12
    "Ċ",             // 13
    "ab",            // 14
    "bc",            // 15
    "abc",           // 16
    "cd",            // 17
    "abcd",          // 18
    "ĠĠ",            // 19
    "Ġab",           // 20
    "Ã",             // 21
    "©",             // 22
    "Ã©",            // 23
];
const TYPES: [i32; 24] = [
    3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
];
/// Rank order: `b c` before `a b`, so "abc" is `a`,`bc` (with `a b` first it would be `abc`).
const MERGES: [&str; 8] = ["Ġ Ġ", "b c", "a b", "ab c", "c d", "ab cd", "Ġ ab", "Ã ©"];
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn tiny() -> Meta {
    let mut m = Meta::default();
    m.string("general.architecture", "llama")
        .string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "smollm")
        .strings("tokenizer.ggml.tokens", &TOKENS)
        .i32s("tokenizer.ggml.token_type", &TYPES)
        .strings("tokenizer.ggml.merges", &MERGES)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.padding_token_id", 0)
        .bool("tokenizer.ggml.add_bos_token", true)
        .string("tokenizer.chat_template", TEMPLATE);
    m
}

/// The error's message, which must start with the file's name and contain each of `parts`.
#[track_caller]
fn expect_err<T: std::fmt::Debug>(result: Result<T, TokenizerError>, parts: &[&str]) {
    let message = result.expect_err("an error").to_string();
    assert!(message.starts_with("test.gguf: "), "{message}");
    for part in parts {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
}

// --- The tiny tokenizer ---------------------------------------------------------------------

#[test]
fn merges_apply_in_rank_order() {
    let t = tiny().tokenizer().unwrap();
    // a b c: `b c` (rank 1) beats `a b` (rank 2); then no merge joins `a` and `bc`.
    assert_eq!(t.encode("abc").unwrap(), [4, 15]);
    // a b c d: `b c` first again, and `bc d` is no merge.
    assert_eq!(t.encode("abcd").unwrap(), [4, 15, 7]);
    // " ab": Ġ a b -> Ġ ab (rank 2) -> Ġab (rank 6).
    assert_eq!(t.encode(" ab").unwrap(), [20]);
    // "é" is the bytes C3 A9, spelled Ã©, merged by rank 7.
    assert_eq!(t.encode("é").unwrap(), [23]);

    // The same merges with `a b` ranked before `b c`: "abc" is ab c -> abc.
    let mut swapped = MERGES;
    swapped.swap(1, 2);
    let mut m = tiny();
    m.strings("tokenizer.ggml.merges", &swapped);
    let t = m.tokenizer().unwrap();
    assert_eq!(t.encode("abc").unwrap(), [16]);
    // ab c d -> abc d (rank 3 before `c d`'s 4); `abc d` is no merge.
    assert_eq!(t.encode("abcd").unwrap(), [16, 7]);
}

#[test]
fn special_tokens_in_text_are_single_tokens() {
    let t = tiny().tokenizer().unwrap();
    assert_eq!(t.encode("<|im_start|>hi<|im_end|>").unwrap(), [1, 8, 9, 2]);
    assert_eq!(t.encode("hi\n<|endoftext|>").unwrap(), [8, 9, 13, 0]);
    // User-defined: whole, though not special.
    assert_eq!(t.encode("<think>ab").unwrap(), [3, 14]);
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<think>"), Some(3));
    assert_eq!(t.token_id("Ġab"), Some(20));
    assert_eq!(t.token_id("zz"), None);
    assert_eq!(
        t.decode(&[1, 8, 9, 2, 3]).unwrap(),
        "<|im_start|>hi<|im_end|><think>"
    );
    assert_eq!(t.encode("").unwrap(), Vec::<u32>::new());
}

#[test]
fn smollm_splits_digits_and_gpt2_does_not() {
    // "  12": Digits splits off "  ", "1", "2"; the byte-level regex then keeps "  " whole: ĠĠ.
    let t = tiny().tokenizer().unwrap();
    assert_eq!(t.encode("  12").unwrap(), [19, 10, 11]);
    assert_eq!(t.encode("  ab").unwrap(), [12, 20]);
    let mut m = tiny();
    m.string("tokenizer.ggml.pre", "gpt2");
    let t = m.tokenizer().unwrap();
    // GPT-2's regex alone: " " (\s+(?!\S) stops before the last space), then " 12", whose
    // Ġ 1 2 have no merges.
    assert_eq!(t.encode("  12").unwrap(), [12, 12, 10, 11]);
    assert_eq!(t.encode("  ab").unwrap(), [12, 20]);
    assert_eq!(PRE_TOKENIZERS, ["smollm", "starcoder", "gpt2"]);
}

#[test]
fn offsets_are_byte_ranges_of_the_text() {
    let t = tiny().tokenizer().unwrap();
    let got = t.encode_with_offsets("<|im_start|>hi abc").unwrap();
    // " abc": Ġ a b c -> Ġ a bc (`b c` first; `a bc` and `Ġ a` are no merges).
    let want = [
        (1, 0..12),
        (8, 12..13),
        (9, 13..14),
        (12, 14..15),
        (4, 15..16),
        (15, 16..18),
    ];
    assert_eq!(got, want);
    assert_eq!(t.encode_with_offsets("é").unwrap(), [(23, 0..2)]);
    assert_eq!(t.encode_with_offsets("").unwrap(), []);
}

#[test]
fn decode_round_trips_and_streams_whole_characters() {
    let t = tiny().tokenizer().unwrap();
    for s in ["abcd", " ab  12\n", "<|im_start|>é<|im_end|>", ""] {
        assert_eq!(t.decode(&t.encode(s).unwrap()).unwrap(), s);
    }
    // Half a character decodes to U+FFFD; the stream holds it back until the rest comes.
    assert_eq!(t.decode(&[21]).unwrap(), "\u{FFFD}");
    let mut stream = t.decode_stream();
    let pieces: Vec<Option<String>> = [4, 21, 22, 12, 1]
        .iter()
        .map(|&id| stream.step(id).unwrap())
        .collect();
    let want = [Some("a"), None, Some("é"), Some(" "), Some("<|im_start|>")];
    assert_eq!(pieces, want.map(|p| p.map(String::from)));
    expect_err(
        t.decode_stream().step(24),
        &["decode_stream", "below the vocabulary's 24", "24"],
    );
}

#[test]
fn metadata_values_are_read() {
    // One tokenizer can serve every thread of a data loader.
    fn shared<T: Send + Sync>(_: &T) {}
    let t = tiny().tokenizer().unwrap();
    shared(&t);
    assert_eq!(t.vocab_size(), 24);
    assert_eq!((t.bos(), t.eos(), t.pad()), (Some(1), Some(2), Some(0)));
    assert!(t.add_bos());
    assert_eq!(t.file(), "test.gguf");
    let chat = t.chat_template().unwrap();
    let messages = [ChatMessage::new("user", "hi")];
    assert_eq!(
        chat.render(&messages, true).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Optional keys absent: no special ids, no BOS, no template, every token normal (so
    // `<|im_start|>` is cut up, its `<`, `|` and `_` having no token).
    let mut m = tiny();
    for key in [
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ] {
        m.remove(key);
    }
    let t = m.tokenizer().unwrap();
    assert_eq!(
        (t.bos(), t.eos(), t.pad(), t.add_bos()),
        (None, None, None, false)
    );
    assert!(t.chat_template().is_none());
    assert_eq!(t.encode("hi<|im_end|>").unwrap(), [8, 9, 9, 7]);
}

#[test]
fn decoding_an_id_outside_the_vocabulary_is_an_error() {
    let t = tiny().tokenizer().unwrap();
    expect_err(
        t.decode(&[4, 24]),
        &["decode token 1", "an id below the vocabulary's 24", "is 24"],
    );
    expect_err(t.decode(&[u32::MAX]), &["decode token 0", "4294967295"]);
}

#[test]
fn tokenizers_we_do_not_build_are_errors_naming_the_key() {
    let mut m = tiny();
    m.string("tokenizer.ggml.model", "llama");
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.model\"", "\"gpt2\"", "is \"llama\""],
    );
    let mut m = tiny();
    m.string("tokenizer.ggml.pre", "qwen2");
    expect_err(
        m.tokenizer(),
        &[
            "\"tokenizer.ggml.pre\"",
            "\"smollm\", \"starcoder\", \"gpt2\"",
            "is \"qwen2\"",
        ],
    );
    let mut m = tiny();
    m.u32("tokenizer.ggml.pre", 7);
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.pre\"", "a string", "U32"],
    );
}

#[test]
fn missing_keys_are_errors_naming_them() {
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
    ] {
        let mut m = tiny();
        m.remove(key);
        expect_err(m.tokenizer(), &[&format!("{key:?}"), "present", "absent"]);
    }
}

#[test]
fn malformed_merges_are_errors_naming_the_item() {
    let bad = |merge: &str| {
        let mut merges = MERGES.to_vec();
        merges[3] = merge;
        let mut m = tiny();
        m.strings("tokenizer.ggml.merges", &merges);
        m.tokenizer()
    };
    let item = "metadata key \"tokenizer.ggml.merges\" item 3";
    let two = "two tokens separated by one space";
    expect_err(bad("abc"), &[item, two, "\"abc\""]);
    expect_err(bad("a  b"), &[item, two, "\"a  b\""]);
    expect_err(bad("a b c"), &[item, two]);
    expect_err(bad(" a"), &[item, two]);
    expect_err(bad("a z"), &[item, "(\"z\" is none)", "\"a z\""]);
    // Both tokens exist, but their concatenation does not.
    expect_err(bad("a d"), &[item, "(\"ad\" is none)"]);
    let mut m = tiny();
    m.u32s("tokenizer.ggml.merges", &[1, 2]);
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.merges\" item 0", "a string", "U32"],
    );
}

#[test]
fn inconsistent_vocabularies_are_errors() {
    let mut m = tiny();
    m.u32("tokenizer.ggml.bos_token_id", 24);
    expect_err(
        m.tokenizer(),
        &[
            "\"tokenizer.ggml.bos_token_id\"",
            "below the vocabulary's 24",
            "is 24",
        ],
    );
    let mut m = tiny();
    m.u32("tokenizer.ggml.padding_token_id", 99);
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.padding_token_id\"", "is 99"],
    );
    let mut m = tiny();
    m.string("tokenizer.ggml.eos_token_id", "2");
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.eos_token_id\"", "a token id"],
    );
    let mut m = tiny();
    m.i32s("tokenizer.ggml.token_type", &TYPES[..20]);
    expect_err(
        m.tokenizer(),
        &[
            "\"tokenizer.ggml.token_type\"",
            "one type per token (24)",
            "20 types",
        ],
    );
    let mut tokens = TOKENS;
    tokens[7] = "a";
    let mut m = tiny();
    m.strings("tokenizer.ggml.tokens", &tokens);
    expect_err(
        m.tokenizer(),
        &[
            "\"tokenizer.ggml.tokens\" item 7",
            "(\"a\" is token 4)",
            "a second one",
        ],
    );
    let mut m = tiny();
    m.strings("tokenizer.ggml.tokens", &[]);
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.tokens\"", "1 to", "is 0"],
    );
    let mut m = tiny();
    m.u32("tokenizer.ggml.add_bos_token", 1);
    expect_err(
        m.tokenizer(),
        &["\"tokenizer.ggml.add_bos_token\"", "a bool"],
    );
}

#[test]
fn a_template_with_a_syntax_error_is_an_error_naming_it() {
    let mut m = tiny();
    m.string(
        "tokenizer.chat_template",
        "{% for m in messages %}{{ m.content }}",
    );
    expect_err(
        m.tokenizer(),
        &[
            "test.gguf: metadata key \"tokenizer.chat_template\": ",
            "syntax error",
        ],
    );
    let e = ChatTemplate::new("{{ messages[0] ")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("chat template: syntax error"), "{e}");
    let e = ChatTemplate::named("mine", "{% if %}")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("mine: syntax error"), "{e}");
}

// --- Chat templates alone -------------------------------------------------------------------

fn render(source: &str, messages: &[(&str, &str)], generation: bool) -> Result<String, String> {
    let messages: Vec<_> = messages
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect();
    ChatTemplate::new(source)
        .and_then(|t| {
            t.with_variable("bos_token", "<s>")
                .render(&messages, generation)
        })
        .map_err(|e| e.to_string())
}

#[test]
fn templates_render_as_jinja2_with_transformers_settings() {
    let chat = [("system", "Be brief."), ("user", "  hi  ")];
    // Loops, indexing, `loop.first`, `+` on strings, `bos_token`, the generation prompt.
    let t = "{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] == 'system' %}[S]{% endif %}{{ '<' + m.role + '>' + m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    assert_eq!(
        render(t, &chat, true).unwrap(),
        "<s>[S]<system>Be brief.<user>  hi  <assistant>"
    );
    assert_eq!(
        render(t, &chat, false).unwrap(),
        "<s>[S]<system>Be brief.<user>  hi  "
    );
    // trim_blocks drops the newline after a block tag, lstrip_blocks the indent before one.
    let t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content.strip() }}\n    {% endif %}\n{% endfor %}";
    assert_eq!(render(t, &chat, false).unwrap(), "hi\n");
    // Python's string methods, `{% break %}`, `loop.last`.
    let t = "{% for m in messages %}{% if m.content.startswith('Be') %}{{ m.content.upper() }}|{% endif %}{% if loop.last %}{% break %}{% endif %}{% endfor %}end";
    assert_eq!(render(t, &chat, false).unwrap(), "BE BRIEF.|end");
    let t = "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}{% endfor %}";
    assert_eq!(
        render(t, &chat[..1], false).unwrap(),
        "role=system;content=Be brief.;"
    );
}

#[test]
fn raise_exception_and_runaway_templates_are_errors() {
    let t = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}ok";
    let e = render(t, &[("system", "x")], false).unwrap_err();
    assert!(e.starts_with("chat template: "), "{e}");
    assert!(e.contains("Conversations must start with the user"), "{e}");
    assert_eq!(render(t, &[("user", "x")], false).unwrap(), "ok");
    // 10^8 loop iterations: stopped by the fuel limit instead of running for minutes.
    let t = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}";
    let e = render(t, &[], false).unwrap_err();
    assert!(e.contains("fuel"), "{e}");
}

// --- The real SmolLM2 against Hugging Face --------------------------------------------------
// The constants are scripts/hf-reference-tokens.py's output (transformers 5.24.0, tokenizers
// 0.23.3; 2026-12-01): transformers' GGUF tokenizer of the same file, with SmolLM2's digit split
// (see `PRE_TOKENIZERS`); every string also matched the script's from-scratch tokenizer.
// transformers' own GGUF load, without the digit split, differs on three of them: "  12" is
// [216, 216, 33, 34] there, "x =  7\n\n3\t\t5" [104, 446, 216, 216, 39, 198, 198, 35, 197, 197,
// 37] and the JSON [107, 3805, 476, 81, 1799, 933, 472, 216, 33, 32, 28, 472, 216, 34, 32, 3805,
// 6329, 198, 109].

#[rustfmt::skip]
const REFERENCE: [(&str, &[u32]); 30] = [
    ("", &[]),
    ("Hello, world!", &[19556, 28, 905, 17]),
    ("The capital of France is Paris.", &[504, 3575, 282, 4649, 314, 7042, 30]),
    ("café naïve résumé Ångström façade", &[83, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 5549, 223, 863, 1321, 45682, 40852]),
    ("日本語のテキストと中文字符", &[23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 7365, 118, 28589, 29184, 36518, 40562, 116]),
    ("emoji: 😀👍🏽🚀 and 👨\u{200d}👩\u{200d}👧", &[391, 33777, 42, 40303, 218, 10813, 235, 231, 10813, 233, 138, 10813, 244, 218, 284, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117]),
    ("Привет мир مرحبا שלום 안녕하세요 สวัสดี", &[155, 249, 46879, 16464, 32547, 41337, 7872, 9175, 36395, 20602, 44626, 31462, 10805, 12960, 119, 31838, 23970, 162, 247, 18601, 239, 226, 182, 223, 239, 33085, 242, 183, 222, 133, 183, 244, 238, 216, 10283, 120, 10283, 117, 10283, 126, 10283, 120, 10283, 238, 10283, 130]),
    (" ", &[216]),
    ("\n", &[198]),
    ("  leading and trailing spaces   ", &[216, 2899, 284, 35079, 5600, 333]),
    ("tabs\tand\t\ttabs\t", &[100, 7366, 197, 397, 197, 197, 100, 7366, 197]),
    ("line one\nline two\n\n\nline five\r\n", &[1311, 582, 198, 1311, 827, 1116, 198, 1311, 2531, 2738]),
    ("a    b     c", &[81, 333, 278, 289, 265]),
    ("\t\t\n  \n", &[1656, 11181, 198]),
    ("numbers: 1 12 123 1234 3.14159 -42 1,000,000 2024-12-01", &[28707, 42, 216, 33, 216, 33, 34, 216, 33, 34, 35, 216, 33, 34, 35, 36, 216, 35, 30, 33, 36, 33, 37, 41, 731, 36, 34, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32, 216, 34, 32, 34, 36, 29, 33, 34, 29, 32, 33]),
    ("  12", &[256, 33, 34]),
    ("x =  7\n\n3\t\t5", &[104, 446, 256, 39, 1116, 35, 1656, 37]),
    ("don't I'm we'll they've she'd it's DON'T I'M", &[12420, 982, 339, 5248, 392, 3060, 502, 3543, 1041, 6737, 357, 506, 422, 2154, 23, 68, 339, 23, 61]),
    ("fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n", &[7853, 1085, 1000, 1662, 472, 1303, 1792, 42, 717, 1159, 44, 101, 35, 34, 46, 446, 37024, 21653, 33, 28, 216, 34, 28, 216, 35, 26695, 472, 1628, 34115, 17, 45257, 104, 42, 47, 15201, 43, 198, 109, 198]),
    ("def f(a, b):\n\treturn a ** 2 + b  # comment\n", &[1604, 275, 24, 81, 28, 278, 727, 198, 197, 5406, 253, 1903, 216, 34, 1232, 278, 216, 907, 5189, 198]),
    ("{\n  \"a\": [\n    10,\n    20\n  ]\n}", &[107, 3805, 476, 81, 1799, 933, 2367, 33, 32, 28, 2367, 34, 32, 3805, 6329, 198, 109]),
    ("!!! ??? ... --- *** ### @@ $$ %% ^^ && || ~~ ``", &[29646, 9148, 16693, 4563, 21749, 33117, 20749, 3394, 48, 17410, 46686, 13481, 78, 1456, 22, 14669, 216, 9493, 10120]),
    ("Über 9000 — “quotes” ‘single’ … «guillemets»", &[142, 246, 593, 216, 41, 32, 32, 32, 1841, 619, 385, 2346, 573, 1551, 18536, 417, 5548, 23708, 6058, 3285, 93, 1175, 20306]),
    ("supercalifragilisticexpialidocious antidisestablishmentarianism", &[14174, 5020, 342, 1808, 301, 40482, 104, 96, 409, 311, 42288, 1598, 17889, 30834, 358, 35050]),
    ("<|im_start|>user\nhi<|im_end|>", &[1, 4093, 198, 6004, 2]),
    ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n", &[1, 9690, 198, 2683, 359, 5356, 30, 2, 198, 1, 520, 9531, 198]),
    ("text<|endoftext|>more<|endoftext|>", &[2692, 0, 3143, 0]),
    ("<|im_start <|im_start| im_start|> <|im_end|><|im_end|>", &[44, 108, 306, 79, 3738, 2067, 108, 306, 79, 3738, 108, 444, 79, 3738, 108, 46, 216, 2, 2]),
    ("<repo_name>hesper<file_sep>src/lib.rs<gh_stars>10", &[3, 852, 456, 5, 10920, 31, 5474, 30, 2833, 7, 33, 32]),
    ("ctrl\u{4}char and \u{50000} plane-5", &[39673, 9061, 284, 216, 234, 218, 218, 8303, 29, 37]),
];

/// `(id, start byte, end byte)` of each token.
type TokenSpans = &'static [(u32, usize, usize)];

/// Each token's spans in a string, from transformers' character offsets.
#[rustfmt::skip]
const OFFSETS: [(&str, TokenSpans); 6] = [
    ("Hello, world!", &[(19556, 0, 5), (28, 5, 6), (905, 6, 12), (17, 12, 13)]),
    ("café naïve résumé Ångström façade", &[(83, 0, 1), (1939, 1, 3), (2756, 3, 5), (15486, 5, 8), (46494, 8, 12), (412, 12, 14), (2756, 14, 16), (5422, 16, 19), (2756, 19, 21), (5549, 21, 24), (223, 22, 24), (863, 24, 26), (1321, 26, 29), (45682, 29, 32), (40852, 32, 40)]),
    ("emoji: 😀👍🏽🚀 and 👨\u{200d}👩\u{200d}👧", &[(391, 0, 2), (33777, 2, 5), (42, 5, 6), (40303, 6, 11), (218, 7, 11), (10813, 11, 15), (235, 11, 15), (231, 11, 15), (10813, 15, 19), (233, 15, 19), (138, 15, 19), (10813, 19, 23), (244, 19, 23), (218, 19, 23), (284, 23, 27), (15107, 27, 32), (235, 28, 32), (118, 28, 32), (321, 32, 35), (231, 32, 35), (10813, 35, 39), (235, 35, 39), (119, 35, 39), (321, 39, 42), (231, 39, 42), (10813, 42, 46), (235, 42, 46), (117, 42, 46)]),
    ("  leading and trailing spaces   ", &[(216, 0, 1), (2899, 1, 9), (284, 9, 13), (35079, 13, 22), (5600, 22, 29), (333, 29, 32)]),
    ("<|im_start|>user\nhi<|im_end|>", &[(1, 0, 12), (4093, 12, 16), (198, 16, 17), (6004, 17, 19), (2, 19, 29)]),
    ("  12", &[(256, 0, 2), (33, 2, 3), (34, 3, 4)]),
];

/// `(role, content)` of each message.
type Conversation = &'static [(&'static str, &'static str)];

/// transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` on
/// the same file: `(messages, add_generation_prompt, text)`. Without a system message SmolLM2's
/// template writes its own.
const CHATS: [(Conversation, bool, &str); 4] = [
    (
        &[
            ("system", "You are a pirate."),
            ("user", "Hi!"),
            ("assistant", "Arr, hello."),
        ],
        false,
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nArr, hello.<|im_end|>\n",
    ),
    (
        &[("user", "What is 2+2?")],
        false,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    ),
    (
        &[("user", "What is 2+2?")],
        true,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        &[
            ("user", "Name a colour."),
            ("assistant", "Blue."),
            ("user", "Another?"),
        ],
        true,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n",
    ),
];

fn smollm2() -> Option<Tokenizer> {
    let path = common::smollm2_path()?;
    let file = GgufFile::open(&path).unwrap();
    Some(Tokenizer::from_gguf(&file).unwrap())
}

#[test]
fn smollm2_token_ids_equal_hugging_face() {
    let Some(t) = smollm2() else {
        return;
    };
    let wrong: Vec<String> = REFERENCE
        .iter()
        .filter_map(|&(s, want)| {
            let got = t.encode(s).unwrap();
            (got != want).then(|| format!("{s:?}: {got:?} here, {want:?} in the reference"))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {}:\n{}",
        wrong.len(),
        REFERENCE.len(),
        wrong.join("\n")
    );
}

#[test]
fn smollm2_offsets_equal_hugging_face() {
    let Some(t) = smollm2() else {
        return;
    };
    for (s, want) in OFFSETS {
        let got: Vec<_> = t
            .encode_with_offsets(s)
            .unwrap()
            .into_iter()
            .map(|(id, r)| (id, r.start, r.end))
            .collect();
        assert_eq!(got, want, "{s:?}");
    }
}

#[test]
fn smollm2_decode_round_trips() {
    let Some(t) = smollm2() else {
        return;
    };
    for (s, ids) in REFERENCE {
        let text = t.decode(ids).unwrap();
        if s.contains('\u{4}') {
            // The vocabulary has no token for 0x04 or 0xF1 (the first byte of U+50000): both
            // dropped, the character's three other bytes left as U+FFFD each (transformers
            // decodes the same ids to the same text).
            assert_eq!(text, "ctrlchar and \u{FFFD}\u{FFFD}\u{FFFD} plane-5");
        } else {
            assert_eq!(text, s);
        }
    }
    // Streaming: " 😀" is two tokens, the first ending inside the emoji.
    let mut stream = t.decode_stream();
    assert_eq!(stream.step(40303).unwrap(), None);
    assert_eq!(stream.step(218).unwrap().as_deref(), Some(" 😀"));
    let (s, ids) = REFERENCE[5];
    let mut stream = t.decode_stream();
    let pieces: String = ids
        .iter()
        .filter_map(|&id| stream.step(id).unwrap())
        .collect();
    assert_eq!(pieces, s);
}

#[test]
fn smollm2_metadata_and_chat_template_equal_transformers() {
    let Some(t) = smollm2() else {
        return;
    };
    assert_eq!(t.vocab_size(), 49152);
    // transformers: bos '<|im_start|>' 1, eos '<|im_end|>' 2, pad '<|im_end|>' 2.
    assert_eq!((t.bos(), t.eos(), t.pad()), (Some(1), Some(2), Some(2)));
    assert!(!t.add_bos());
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("ĠParis"), Some(7042));
    let chat = t.chat_template().unwrap();
    for (messages, generation, want) in CHATS {
        let messages: Vec<_> = messages
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect();
        assert_eq!(chat.render(&messages, generation).unwrap(), want);
    }
    // The rendered chat tokenizes with its special tokens whole.
    let (messages, generation, text) = CHATS[2];
    let messages: Vec<_> = messages
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect();
    let ids = t
        .encode(&chat.render(&messages, generation).unwrap())
        .unwrap();
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
}
