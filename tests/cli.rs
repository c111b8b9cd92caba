//! The `hesper` command as a user runs it, on a tiny Llama GGUF written here (one block, a
//! tokenizer of one token per character): a short fine-tune, then `eval` and `generate` with
//! its adapter, exit 0; and bad input — a missing, truncated or unsupported GGUF, empty or
//! corrupt data, a sequence longer than the context, an adapter that does not fit — each one
//! error line that names the file and the problem, a non-zero exit, and the output directory's
//! files as they were.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh directory under the system's temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hesper-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `common::char_tokenizer_meta`'s tokenizer, and a Llama of one block over its 32
/// tokens (`d = 8`, two heads of 4, one KV head, context 64), weights from a fixed sine.
fn tiny_gguf(arch: &str) -> Vec<u8> {
    let (vocab, d, i, hd) = (32, 8, 12, 4);
    let mut meta = common::char_tokenizer_meta();
    meta.string("general.architecture", arch)
        .u32(&format!("{arch}.embedding_length"), d as u32)
        .u32(&format!("{arch}.feed_forward_length"), i as u32)
        .u32(&format!("{arch}.block_count"), 1)
        .u32(&format!("{arch}.attention.head_count"), 2)
        .u32(&format!("{arch}.attention.head_count_kv"), 1)
        .f32(&format!("{arch}.rope.freq_base"), 10000.0)
        .f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6)
        .u32(&format!("{arch}.context_length"), 64);
    let mut seed = 0.0f32;
    let mut tensor = |name: &str, shape: Vec<usize>| {
        let values = (0..shape.iter().product())
            .map(|_| {
                seed += 1.0;
                0.5 * (seed * 0.37).sin()
            })
            .collect();
        (name.to_string(), shape, values)
    };
    let tensors = vec![
        tensor("token_embd.weight", vec![vocab, d]),
        tensor("blk.0.attn_norm.weight", vec![d]),
        tensor("blk.0.attn_q.weight", vec![2 * hd, d]),
        tensor("blk.0.attn_k.weight", vec![hd, d]),
        tensor("blk.0.attn_v.weight", vec![hd, d]),
        tensor("blk.0.attn_output.weight", vec![d, 2 * hd]),
        tensor("blk.0.ffn_norm.weight", vec![d]),
        tensor("blk.0.ffn_gate.weight", vec![i, d]),
        tensor("blk.0.ffn_up.weight", vec![i, d]),
        tensor("blk.0.ffn_down.weight", vec![d, i]),
        tensor("output_norm.weight", vec![d]),
    ];
    meta.bytes(&tensors)
}

/// The cache directory the tests' `hesper` runs share (not the user's).
fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("hesper-cli-cache-{}", std::process::id()))
}

/// `hesper ARGS…`: (exit success, stdout, stderr).
fn hesper(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hesper"))
        .args(args)
        .env("HESPER_CACHE_DIR", cache_dir())
        .output()
        .expect("the hesper binary runs");
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.success(), text(out.stdout), text(out.stderr))
}

/// `hesper ARGS…` fails with one error line on stderr (beside its `device:` and `model:`
/// lines), and it contains each of `parts`.
fn fails(args: &[&str], parts: &[&str]) -> String {
    let (ok, _, stderr) = hesper(args);
    assert!(!ok, "hesper {args:?} succeeded");
    let info = |l: &&str| l.starts_with("device: ") || l.starts_with("model: ");
    let lines: Vec<&str> = stderr.lines().filter(|l| !info(l)).collect();
    assert_eq!(
        lines.len(),
        1,
        "hesper {args:?}: one error line, got:\n{stderr}"
    );
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for part in parts {
        assert!(
            lines[0].contains(part),
            "hesper {args:?}: {:?} lacks {part:?}",
            lines[0]
        );
    }
    eprintln!("{}", lines[0]);
    lines[0].to_string()
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) -> String {
    std::fs::write(path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

const DATA: &str = "{\"text\": \"the cat sat on the mat\"}\n{\"text\": \"a dog ran in the fog\"}\n";

#[test]
fn a_tiny_model_fine_tunes_evaluates_and_generates() {
    let dir = temp_dir("run");
    let model = write(&dir.join("tiny.gguf"), tiny_gguf("llama"));
    let data = write(&dir.join("data.jsonl"), DATA);
    let out = dir.join("out");
    let out_s = out.to_str().unwrap();
    let common = ["--model", &model, "--data", &data, "--seq-len", "32"];
    let (ok, stdout, stderr) = hesper(
        &[
            &["finetune"][..],
            &common,
            &[
                "--batch", "2", "--steps", "3", "--rank", "2", "--out", out_s,
            ],
        ]
        .concat(),
    );
    assert!(ok, "finetune failed:\n{stdout}\n{stderr}");
    for file in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "loss.csv",
    ] {
        assert!(out.join(file).is_file(), "{file} not written:\n{stdout}");
    }
    let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "a header and three steps:\n{csv}");
    // The tuned tiles are kept for the next run, tied to this device.
    let tuned = std::fs::read_to_string(cache_dir().join("tune.txt")).unwrap();
    assert!(tuned.starts_with("hesper tune cache"), "{tuned}");
    let (ok, stdout, stderr) = hesper(&[&["eval"][..], &common, &["--adapter", out_s]].concat());
    assert!(ok, "eval failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("perplexity"), "{stdout}");
    let generate = [
        "generate",
        "--model",
        &model,
        "--adapter",
        out_s,
        "--prompt",
        "the",
    ];
    let (ok, stdout, stderr) = hesper(&[&generate[..], &["--max-new", "5"]].concat());
    assert!(ok, "generate failed:\n{stdout}\n{stderr}");
}

/// `--precision f16` trains the same curve as `--precision f32` to within f16's rounding (this
/// tiny model's losses move by 1.4e-6 of themselves on lavapipe, where only the weights are
/// rounded; tensor cores round the GEMMs' inputs too), and says which it ran.
#[test]
fn mixed_precision_fine_tuning_follows_the_f32_curve() {
    let dir = temp_dir("precision");
    let model = write(&dir.join("tiny.gguf"), tiny_gguf("llama"));
    let data = write(&dir.join("data.jsonl"), DATA);
    let losses = |precision: &str| -> Vec<f64> {
        let out = dir.join(precision);
        let args = [
            "finetune",
            "--model",
            &model,
            "--data",
            &data,
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--steps",
            "4",
            "--rank",
            "2",
            "--precision",
            precision,
            "--out",
            out.to_str().unwrap(),
        ];
        let (ok, stdout, stderr) = hesper(&args);
        assert!(
            ok,
            "finetune --precision {precision} failed:\n{stdout}\n{stderr}"
        );
        let said = format!("({})", precision.to_uppercase());
        assert!(stderr.contains(&said), "no `{said}` in:\n{stderr}");
        let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
        (csv.lines().skip(1))
            .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
            .collect()
    };
    let (half, full) = (losses("f16"), losses("f32"));
    assert_eq!(half.len(), 4);
    for (step, (h, f)) in half.iter().zip(&full).enumerate() {
        assert!(
            (h - f).abs() <= 1e-3 * f.abs() && h != f,
            "step {}: loss {h} in f16, {f} in f32",
            step + 1
        );
    }
}

#[test]
fn bad_model_files_are_one_line_naming_the_file() {
    let dir = temp_dir("models");
    let data = write(&dir.join("data.jsonl"), DATA);
    let missing = dir.join("missing.gguf");
    let missing = missing.to_str().unwrap();
    fails(
        &["eval", "--model", missing, "--data", &data],
        &["missing.gguf"],
    );
    let bytes = tiny_gguf("llama");
    let cut = write(&dir.join("cut.gguf"), &bytes[..bytes.len() - 100]);
    fails(&["eval", "--model", &cut, "--data", &data], &["cut.gguf"]);
    let header = write(&dir.join("header.gguf"), &bytes[..40]);
    fails(
        &["eval", "--model", &header, "--data", &data],
        &["header.gguf"],
    );
    let mamba = write(&dir.join("mamba.gguf"), tiny_gguf("mamba"));
    fails(
        &["eval", "--model", &mamba, "--data", &data],
        &["mamba.gguf", "\"mamba\""],
    );
}

#[test]
fn bad_data_and_lengths_are_one_line_and_leave_the_output_as_it_was() {
    let dir = temp_dir("data");
    let model = write(&dir.join("tiny.gguf"), tiny_gguf("llama"));
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let kept = write(
        &out.join("adapter_model.safetensors"),
        "an earlier run's adapter",
    );
    let out_s = out.to_str().unwrap();
    let finetune = |data: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![
            "finetune", "--model", &model, "--data", data, "--out", out_s,
        ];
        args.extend(extra);
        args.into_iter().map(String::from).collect()
    };
    let run = |args: Vec<String>, parts: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, parts)
    };
    let empty = write(&dir.join("empty.jsonl"), "");
    run(finetune(&empty, &["--seq-len", "32"]), &["empty.jsonl"]);
    let corrupt = write(
        &dir.join("corrupt.jsonl"),
        "{\"text\": \"ab\"}\n{\"text\": \n",
    );
    run(
        finetune(&corrupt, &["--seq-len", "32"]),
        &["corrupt.jsonl:2: not JSON"],
    );
    let data = write(&dir.join("data.jsonl"), DATA);
    run(finetune(&data, &["--seq-len", "65"]), &["65", "64"]);
    let missing = dir.join("none.jsonl");
    run(finetune(missing.to_str().unwrap(), &[]), &["none.jsonl"]);
    assert_eq!(
        std::fs::read_to_string(&kept).unwrap(),
        "an earlier run's adapter"
    );
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        1,
        "nothing else written"
    );
}

#[test]
fn an_adapter_that_does_not_fit_the_model_is_one_line() {
    let dir = temp_dir("adapter");
    let model = write(&dir.join("tiny.gguf"), tiny_gguf("llama"));
    let data = write(&dir.join("data.jsonl"), DATA);
    let out = dir.join("out");
    let out_s = out.to_str().unwrap();
    let args = [
        "finetune",
        "--model",
        &model,
        "--data",
        &data,
        "--seq-len",
        "32",
    ];
    let (ok, _, stderr) =
        hesper(&[&args[..], &["--steps", "1", "--rank", "2", "--out", out_s]].concat());
    assert!(ok, "{stderr}");
    // The config now claims a rank the tensors do not have.
    let config = out.join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let changed = text.replace("\"r\": 2", "\"r\": 4");
    assert_ne!(changed, text, "the config holds \"r\": 2:\n{text}");
    std::fs::write(&config, changed).unwrap();
    fails(
        &[
            "eval",
            "--model",
            &model,
            "--data",
            &data,
            "--seq-len",
            "32",
            "--adapter",
            out_s,
        ],
        &["adapter_model.safetensors"],
    );
}
