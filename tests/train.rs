//! The trainer on a tiny model (lavapipe here): a run stopped (Ctrl-C's flag) and resumed
//! from its checkpoint gives the same losses and adapters to the bit as one that never
//! stopped; the eval loss equals the f64 model's over the eval rows; steps whose gradient is
//! not finite are skipped and, K in a row, stop the run with the last good checkpoint intact;
//! a checkpoint of another run is refused. And every form of data into training rows.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

mod common;

use hesper::exec::{Gpu, GpuOptions};
use hesper::io::Tokenizer;
use hesper::kernels::testing::Rng;
use hesper::model::config::{Family, LoraConfig, ModelConfig, Projection};
use hesper::model::reference::{self, Adapters, Weights};
use hesper::model::{GpuAdapters, GpuModel, Optimizer};
use hesper::train::data::{DataConfig, load_data, rows_of};
use hesper::train::{
    Decay, Event, Outcome, Row, Schedule, StepRecord, TrainConfig, TrainError, Trainer, batch_of,
};

/// A GPU without the debug build's check of every pipeline-cache hit (a rebuild of each
/// kernel at each launch); the kernel and model tests check the same kernels.
fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let options = GpuOptions {
            verify_cache_hits: false,
            ..GpuOptions::default()
        };
        Gpu::with_options(options).expect("the GPU tests need an adapter")
    })
}

fn model_config() -> ModelConfig {
    ModelConfig {
        max_seq: 16,
        ..ModelConfig::tiny(Family::Llama)
    }
}

fn lora() -> LoraConfig {
    LoraConfig {
        targets: vec![Projection::Q, Projection::V, Projection::Down],
        rank: 4,
        alpha: 8.0,
        rslora: false,
    }
}

/// Rows of random tokens, of lengths 5 to 12, some with masked labels.
fn rows(count: usize, seed: u64) -> Vec<Row> {
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|i| {
            let n = 5 + (rng.next_u32() % 8) as usize;
            let tokens: Vec<u32> = (0..n).map(|_| rng.next_u32() % 97).collect();
            let mut row = Row::all(tokens);
            if i % 3 == 0 {
                row.labels[1] = -100;
                row.labels[2] = -100;
            }
            row
        })
        .collect()
}

fn train_config(steps: usize) -> TrainConfig {
    TrainConfig {
        lora: lora(),
        optimizer: Optimizer::default(),
        schedule: Schedule {
            lr: 1e-2,
            warmup_steps: 2,
            total_steps: steps,
            decay: Decay::Cosine,
        },
        batch: 2,
        accumulation: 2,
        seq_len: 12,
        recompute: false,
        eval_every: 3,
        save_every: 0,
        max_bad_steps: 3,
        seed: 5,
    }
}

struct Setup {
    config: ModelConfig,
    weights: Weights,
    model: GpuModel,
}

fn setup() -> Setup {
    let config = model_config();
    let weights = Weights::random(&config, 1);
    let model = GpuModel::upload(gpu(), &config, &weights).unwrap();
    Setup {
        config,
        weights,
        model,
    }
}

fn initial(s: &Setup) -> GpuAdapters {
    let adapters = Adapters::init_peft(&s.config, &lora(), 2);
    GpuAdapters::upload(gpu(), &s.config, &lora(), &adapters).unwrap()
}

/// A fresh directory under the system's temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hesper-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run `trainer` to the end (or until `stop_after` steps, raising the stop flag there).
fn run(
    trainer: &mut Trainer<'_>,
    out: &Path,
    stop_after: Option<usize>,
) -> Result<Outcome, TrainError> {
    let stop = AtomicBool::new(false);
    trainer.run(Some(out), &stop, |event| {
        if let (Event::Step(r), Some(n)) = (event, stop_after)
            && r.step == n
        {
            stop.store(true, Ordering::Relaxed);
        }
    })
}

fn losses(history: &[StepRecord]) -> Vec<(usize, u32, Option<u64>)> {
    history
        .iter()
        .map(|r| (r.step, r.loss.to_bits(), r.eval_loss.map(f64::to_bits)))
        .collect()
}

#[test]
fn a_resumed_run_continues_the_same_loss_curve_to_the_bit() {
    let s = setup();
    let data = (rows(9, 3), rows(3, 4));
    let out = temp_dir("straight");
    let mut straight =
        Trainer::new(gpu(), &s.model, initial(&s), data.clone(), train_config(8)).unwrap();
    assert_eq!(run(&mut straight, &out, None).unwrap(), Outcome::Finished);
    let want = losses(&straight.state().history);
    assert_eq!(want.len(), 8);
    // The loss goes down: the run trains (steps 1–2 warm up from lr 0).
    let (first, last) = (
        straight.state().history[0].loss,
        straight.state().history[7].loss,
    );
    assert!(last < first, "loss {first} → {last}");
    assert!(out.join("checkpoint-8/adapter_model.safetensors").exists());

    let out = temp_dir("stopped");
    let mut stopped =
        Trainer::new(gpu(), &s.model, initial(&s), data.clone(), train_config(8)).unwrap();
    assert_eq!(
        run(&mut stopped, &out, Some(4)).unwrap(),
        Outcome::Interrupted
    );
    // Step 5 was already running when step 4's report raised the flag: it is finished and
    // saved with the rest.
    assert_eq!(stopped.state().step, 5);
    let dir = out.join("checkpoint-5");
    let mut resumed =
        Trainer::resume(gpu(), &s.model, &dir, data.clone(), train_config(8)).unwrap();
    assert_eq!(resumed.state().step, 5);
    assert_eq!(run(&mut resumed, &out, None).unwrap(), Outcome::Finished);
    assert_eq!(losses(&resumed.state().history), want);
    let got = resumed.adapters().download(gpu()).unwrap();
    assert_eq!(got, straight.adapters().download(gpu()).unwrap());
    assert_eq!(
        resumed.adapters().download_moments(gpu()).unwrap(),
        straight.adapters().download_moments(gpu()).unwrap()
    );

    // Another run's options are refused, naming what differs.
    let mut other = train_config(8);
    other.schedule.lr = 2e-2;
    let refused = Trainer::resume(gpu(), &s.model, &dir, data, other)
        .err()
        .unwrap();
    let message = refused.to_string();
    assert!(
        message.contains("trainer_state.json") && message.contains("another run"),
        "{message}"
    );
}

/// The eval loss is the f64 model's mean cross-entropy over every target of the eval rows
/// (in batches padded with empty rows).
#[test]
fn the_eval_loss_is_the_f64_models() {
    let s = setup();
    let eval = rows(5, 7);
    let mut trainer = Trainer::new(
        gpu(),
        &s.model,
        initial(&s),
        (rows(4, 6), eval.clone()),
        train_config(1),
    )
    .unwrap();
    // Adapters that change the output, so the eval runs through them.
    let adapters = Adapters::random(&s.config, &lora(), 9);
    trainer.adapters().write(gpu(), &adapters).unwrap();
    let got = trainer.eval_loss().unwrap().unwrap();
    let refs: Vec<&Row> = eval.iter().collect();
    let batch = batch_of(&refs, 12).unwrap();
    let want = reference::loss(&s.config, &lora(), &s.weights, &adapters, &batch).unwrap();
    assert!(
        (got - want).abs() < 1e-5 * want,
        "eval loss {got}, f64 {want}"
    );
}

/// Adapters poisoned mid-run (as a diverging run would have them) make every step's gradient
/// non-finite: each is skipped, and the third in a row stops the run; no checkpoint is
/// written after the last good one.
#[test]
fn steps_whose_gradient_is_not_finite_are_skipped_then_stop_the_run() {
    let s = setup();
    let out = temp_dir("diverged");
    let mut config = train_config(10);
    config.save_every = 1;
    let mut trainer =
        Trainer::new(gpu(), &s.model, initial(&s), (rows(6, 3), vec![]), config).unwrap();
    assert_eq!(
        run(&mut trainer, &out, Some(2)).unwrap(),
        Outcome::Interrupted
    );
    let good = std::fs::read(out.join("checkpoint-2/adapter_model.safetensors")).unwrap();
    let mut poisoned = trainer.adapters().download(gpu()).unwrap();
    for layer in 0..s.config.layers {
        for &p in &lora().targets {
            let adapter = poisoned.get_mut(layer, p).unwrap();
            adapter.a.iter_mut().for_each(|a| *a = 3e38);
            adapter.b.iter_mut().for_each(|b| *b = 3e38);
        }
    }
    trainer.adapters().write(gpu(), &poisoned).unwrap();
    let error = run(&mut trainer, &out, None).unwrap_err();
    assert!(
        matches!(error, TrainError::Diverged { step: 5, steps: 3 }),
        "{error}"
    );
    let history = &trainer.state().history;
    assert!(history[2..].iter().all(StepRecord::skipped), "{history:?}");
    assert!(!history[1].skipped());
    assert_eq!(
        std::fs::read(out.join("checkpoint-2/adapter_model.safetensors")).unwrap(),
        good
    );
    assert!(!out.join("checkpoint-3").exists());
}

#[test]
fn bad_runs_are_refused_before_they_start() {
    let s = setup();
    let long = vec![Row::all(vec![1; 13])];
    let message = Trainer::new(
        gpu(),
        &s.model,
        initial(&s),
        (long, vec![]),
        train_config(1),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        message.contains("training row 0 has 13 tokens"),
        "{message}"
    );
    let message = Trainer::new(
        gpu(),
        &s.model,
        initial(&s),
        (vec![], vec![]),
        train_config(1),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(message.contains("no training rows"), "{message}");
    let missing = temp_dir("missing").join("checkpoint-1");
    let message = Trainer::resume(
        gpu(),
        &s.model,
        &missing,
        (rows(2, 1), vec![]),
        train_config(1),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        message.contains("checkpoint-1/trainer_state.json"),
        "{message}"
    );
}

// --- Data: every form into rows ---------------------------------------------------------------

/// `common::char_tokenizer_meta`'s tokenizer: one token per character.
fn char_tokenizer() -> Tokenizer {
    common::char_tokenizer_meta().tokenizer().unwrap()
}

/// The ids of `text` in [`char_tokenizer`]'s vocabulary, worked out by hand.
fn ids(text: &str) -> Vec<u32> {
    text.chars()
        .map(|c| match c {
            'a'..='z' => 3 + (c as u32 - 'a' as u32),
            ' ' => 29,
            '\n' => 30,
            _ => panic!("{c:?}"),
        })
        .collect()
}

fn data(seq_len: usize, pack: bool) -> DataConfig {
    DataConfig {
        seq_len,
        pack,
        eval_fraction: 0.0,
        seed: 1,
    }
}

fn jsonl_rows(text: &str, config: &DataConfig) -> Result<Vec<Row>, TrainError> {
    rows_of(text, "data.jsonl", true, &char_tokenizer(), config, 64).map(|d| d.train)
}

#[test]
fn plain_text_is_cut_into_blocks_of_the_sequence_length() {
    let d = rows_of(
        "ab cd\nefg",
        "data.txt",
        false,
        &char_tokenizer(),
        &data(4, false),
        64,
    )
    .unwrap();
    let mut rows = d.train;
    rows.sort_by_key(|r| r.tokens[0]);
    let want: Vec<Row> = ["ab c", "d\nef", "g"]
        .iter()
        .filter(|b| b.len() >= 2)
        .map(|b| Row::all(ids(b)))
        .collect();
    let mut want = want;
    want.sort_by_key(|r| r.tokens[0]);
    assert_eq!(
        rows, want,
        "a one-token last block trains nothing and is dropped"
    );
}

#[test]
fn every_jsonl_form_gives_its_tokens_and_labels() {
    let text = r#"{"text": "ab"}
{"prompt": "ab", "response": "cd"}

{"prompt": "x", "completion": "y"}
{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
{"input_ids": [8, 9]}"#;
    let rows = jsonl_rows(text, &data(64, false)).unwrap();
    let m = -100;
    let chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n";
    let chat_tokens: Vec<u32> = [
        vec![1],
        ids("user\nhi"),
        vec![2],
        ids("\n"),
        vec![1],
        ids("assistant\nyo"),
        vec![2],
        ids("\n"),
    ]
    .concat();
    // Trained on: the assistant's "yo", its <|im_end|> and newline (the last four tokens).
    let n = chat_tokens.len();
    let chat_labels: Vec<i64> = (0..n)
        .map(|i| if i >= n - 4 { chat_tokens[i] as i64 } else { m })
        .collect();
    assert_eq!(char_tokenizer().encode(chat).unwrap(), chat_tokens);
    let want = [
        Row::all(vec![3, 4, 0]),
        Row {
            tokens: vec![3, 4, 5, 6, 0],
            labels: vec![m, m, 5, 6, 0],
        },
        Row {
            tokens: vec![26, 27, 0],
            labels: vec![m, 27, 0],
        },
        Row {
            tokens: chat_tokens,
            labels: chat_labels,
        },
        Row {
            tokens: vec![5, 6, 7],
            labels: vec![m, 6, 7],
        },
        Row::all(vec![8, 9]),
    ];
    assert_eq!(rows.len(), want.len());
    for row in &want {
        assert!(rows.contains(row), "{row:?} is not among {rows:?}");
    }
}

#[test]
fn packing_puts_examples_back_to_back_in_full_rows() {
    let text = "{\"text\": \"abc\"}\n{\"text\": \"defgh\"}\n";
    let long = jsonl_rows(text, &data(4, false)).unwrap_err().to_string();
    assert!(
        long.contains("data.jsonl:2: 6 tokens, longer than the sequence length 4"),
        "{long}"
    );
    let mut rows = jsonl_rows(text, &data(4, true)).unwrap();
    rows.sort_by_key(|r| r.tokens.len());
    let all = [ids("abc"), vec![0], ids("defgh"), vec![0]].concat();
    let want: Vec<Row> = vec![
        Row::all(all[8..].to_vec()),
        Row::all(all[..4].to_vec()),
        Row::all(all[4..8].to_vec()),
    ];
    let mut sorted = want;
    sorted.sort_by_key(|r| r.tokens.len());
    assert_eq!(
        rows.iter().map(|r| r.tokens.len()).collect::<Vec<_>>(),
        [2, 4, 4]
    );
    for row in &sorted {
        assert!(rows.contains(row), "{row:?} not in {rows:?}");
    }
}

#[test]
fn bad_data_is_an_error_naming_the_file_and_line() {
    let cases = [
        ("{\"text\": \"ab\"}\n{bad", "data.jsonl:2: not JSON"),
        (
            "{\"foo\": 1}",
            "data.jsonl:1: expected an object with \"text\"",
        ),
        ("[1, 2]", "data.jsonl:1: expected an object"),
        (
            "{\"text\": 5}",
            "data.jsonl:1: \"text\" must be a string, but is a number",
        ),
        (
            "{\"input_ids\": [1, 99]}",
            "\"input_ids\"[1] must be a token id below 32, but is 99",
        ),
        (
            "{\"input_ids\": [1, 2], \"labels\": [1]}",
            "\"labels\" must have one label per input id (2), but has 1",
        ),
        (
            "{\"input_ids\": [1, 2], \"labels\": [1, 40]}",
            "\"labels\"[1] must be a token id below 32 or -100",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
            "data.jsonl:1: \"messages\" has no \"assistant\" message",
        ),
        (
            "{\"messages\": [{\"role\": \"user\"}]}",
            "\"messages\"[0] must be an object",
        ),
        ("", "data.jsonl: no example with a token to train on"),
        (
            "{\"input_ids\": [4]}",
            "no example with a token to train on",
        ),
    ];
    for (text, want) in cases {
        let message = jsonl_rows(text, &data(8, false)).unwrap_err().to_string();
        assert!(message.contains(want), "{text:?}: {message}");
    }
    let message = rows_of(
        "{\"text\": \"abcdefghij\"}",
        "data.jsonl",
        true,
        &char_tokenizer(),
        &data(16, true),
        8,
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("longer than the model's context (8 tokens)"),
        "{message}"
    );
    let missing = load_data(
        Path::new("/nonexistent/data.jsonl"),
        &char_tokenizer(),
        &data(8, false),
        64,
    );
    let message = missing.unwrap_err().to_string();
    assert!(
        message.starts_with("/nonexistent/data.jsonl: "),
        "{message}"
    );
}

#[test]
fn the_eval_split_is_seeded() {
    let text: String = (0..10)
        .map(|i| format!("{{\"input_ids\": [{}, 3]}}\n", i + 4))
        .collect();
    let split = |seed| {
        let config = DataConfig {
            eval_fraction: 0.2,
            seed,
            ..data(8, false)
        };
        rows_of(&text, "data.jsonl", true, &char_tokenizer(), &config, 64).unwrap()
    };
    let a = split(1);
    assert_eq!((a.train.len(), a.eval.len()), (8, 2));
    assert_eq!(a, split(1));
    assert_ne!(a.eval, split(3).eval);
    let mut all: Vec<u32> = a.train.iter().chain(&a.eval).map(|r| r.tokens[0]).collect();
    all.sort();
    assert_eq!(all, (4..14).collect::<Vec<_>>());
    // Nothing held out: the file's order.
    let whole = rows_of(
        &text,
        "data.jsonl",
        true,
        &char_tokenizer(),
        &data(8, false),
        64,
    )
    .unwrap();
    let order: Vec<u32> = whole.train.iter().map(|r| r.tokens[0]).collect();
    assert_eq!(order, (4..14).collect::<Vec<_>>());
}
