//! Training data into [`Row`]s, in the forms Hugging Face users have it:
//! - plain text (any file not ending in `.jsonl`): tokenized whole and cut into blocks of the
//!   sequence length (`run_clm.py`'s `group_texts`), trained on every token;
//! - JSON Lines, one example per line, each one of
//!   - `{"text": …}`: trained on every token, an end-of-sequence token appended;
//!   - `{"prompt": …, "response": …}` (or `"completion"`): the loss on the response only;
//!   - `{"messages": [{"role": …, "content": …}, …]}`: rendered with the model's chat
//!     template, the loss on the assistant turns only (their content and end-of-turn marks);
//!   - `{"input_ids": […], "labels": […]}`: pre-tokenized, `labels` optional (−100: not
//!     trained on), as Hugging Face datasets hold them.
//!
//! Examples longer than the sequence length are an error unless packed ([`DataConfig::pack`]:
//! examples back to back, cut into full blocks, as TRL's `packing=True` without per-example
//! attention masks). A seeded shuffle splits off the eval rows.

use std::ops::Range;
use std::path::Path;

use serde_json::Value;

use super::TrainError;
use super::loader::Row;
use crate::io::{ChatMessage, Tokenizer};
use crate::model::Rng;
use crate::model::reference::IGNORE_INDEX;

/// How a data file becomes rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DataConfig {
    /// The tokens of a row.
    pub seq_len: usize,
    /// Pack examples back to back into full rows (else each example is a row, padded).
    pub pack: bool,
    /// The share of rows held out for the eval loss (at least one row when positive and
    /// there are two or more).
    pub eval_fraction: f64,
    /// The split's seed.
    pub seed: u64,
}

/// Rows to train on and rows to evaluate on.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    pub train: Vec<Row>,
    pub eval: Vec<Row>,
}

/// The rows of the data file at `path`, tokenized by `tokenizer` for a model of context
/// `max_seq`. Errors name the file and line.
pub fn load_data(
    path: &Path,
    tokenizer: &Tokenizer,
    config: &DataConfig,
    max_seq: usize,
) -> Result<Dataset, TrainError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
        file: file.clone(),
        source,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| TrainError::Data {
        file: file.clone(),
        line: 0,
        message: format!("not UTF-8 text ({e})"),
    })?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    rows_of(&text, &file, jsonl, tokenizer, config, max_seq)
}

/// [`load_data`] of text already read: `jsonl` says whether it is JSON Lines; `file` names it
/// in errors.
pub fn rows_of(
    text: &str,
    file: &str,
    jsonl: bool,
    tokenizer: &Tokenizer,
    config: &DataConfig,
    max_seq: usize,
) -> Result<Dataset, TrainError> {
    let err = |line: usize, message: String| TrainError::Data {
        file: file.to_string(),
        line,
        message,
    };
    if config.seq_len < 2 {
        return Err(TrainError::Config(format!(
            "the sequence length must be at least 2 tokens, but is {}",
            config.seq_len
        )));
    }
    if config.seq_len > max_seq {
        return Err(TrainError::Config(format!(
            "the sequence length {} is longer than the model's context ({max_seq} tokens)",
            config.seq_len
        )));
    }
    let rows = if jsonl {
        let examples = jsonl_examples(text, file, tokenizer)?;
        for (line, row) in &examples {
            let n = row.tokens.len();
            if n > max_seq {
                let message =
                    format!("{n} tokens, longer than the model's context ({max_seq} tokens)");
                return Err(err(*line, message));
            }
            if n > config.seq_len && !config.pack {
                let message = format!(
                    "{n} tokens, longer than the sequence length {} (give a longer one, or pack)",
                    config.seq_len
                );
                return Err(err(*line, message));
            }
        }
        let rows: Vec<Row> = examples.into_iter().map(|(_, row)| row).collect();
        if config.pack {
            pack(rows, config.seq_len)
        } else {
            rows
        }
    } else {
        let mut tokens: Vec<u32> = tokenizer
            .bos()
            .filter(|_| tokenizer.add_bos())
            .into_iter()
            .collect();
        tokens.extend(tokenizer.encode(text).map_err(|e| err(0, e.to_string()))?);
        tokens
            .chunks(config.seq_len)
            .filter(|block| block.len() >= 2)
            .map(|block| Row::all(block.to_vec()))
            .collect()
    };
    let rows: Vec<Row> = rows.into_iter().filter(|r| r.targets() > 0).collect();
    if rows.is_empty() {
        return Err(err(0, "no example with a token to train on".into()));
    }
    Ok(split(rows, config.eval_fraction, config.seed))
}

/// Each line's example (blank lines skipped), with its 1-based line number.
fn jsonl_examples(
    text: &str,
    file: &str,
    tokenizer: &Tokenizer,
) -> Result<Vec<(usize, Row)>, TrainError> {
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| TrainError::Data {
            file: file.to_string(),
            line: i + 1,
            message,
        };
        let value: Value = serde_json::from_str(line).map_err(|e| err(format!("not JSON: {e}")))?;
        let row = example(&value, tokenizer).map_err(err)?;
        out.push((i + 1, row));
    }
    Ok(out)
}

const FORMS: &str = "an object with \"text\", \"prompt\" and \"response\" (or \"completion\"), \
                     \"messages\", or \"input_ids\" (and \"labels\")";

/// One JSON Lines example as a row.
fn example(value: &Value, tokenizer: &Tokenizer) -> Result<Row, String> {
    let Some(object) = value.as_object() else {
        return Err(format!("expected {FORMS}, given {}", kind(value)));
    };
    let string = |key: &str| -> Result<Option<&str>, String> {
        match object.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!(
                "\"{key}\" must be a string, but is {}",
                kind(other)
            )),
        }
    };
    let encode = |text: &str| tokenizer.encode(text).map_err(|e| e.to_string());
    let bos: Vec<u32> = tokenizer
        .bos()
        .filter(|_| tokenizer.add_bos())
        .into_iter()
        .collect();
    let eos: Vec<u32> = tokenizer.eos().into_iter().collect();
    if let Some(ids) = object.get("input_ids") {
        return pretokenized(ids, object.get("labels"), tokenizer.vocab_size());
    }
    if let Some(messages) = object.get("messages") {
        return chat(messages, tokenizer);
    }
    if let Some(text) = string("text")? {
        return Ok(Row::all([bos, encode(text)?, eos].concat()));
    }
    let response = match string("response")? {
        Some(r) => Some(r),
        None => string("completion")?,
    };
    if let (Some(prompt), Some(response)) = (string("prompt")?, response) {
        let prompt = [bos, encode(prompt)?].concat();
        let response = [encode(response)?, eos].concat();
        let mut labels = vec![IGNORE_INDEX; prompt.len()];
        labels.extend(response.iter().map(|&t| t as i64));
        return Ok(Row {
            tokens: [prompt, response].concat(),
            labels,
        });
    }
    let keys: Vec<&String> = object.keys().collect();
    Err(format!(
        "expected {FORMS}, given an object with keys {keys:?}"
    ))
}

/// `input_ids` and optional `labels`, checked against the vocabulary.
fn pretokenized(ids: &Value, labels: Option<&Value>, vocab: usize) -> Result<Row, String> {
    let numbers = |key: &str, value: &Value| -> Result<Vec<i64>, String> {
        let list = value.as_array().ok_or_else(|| {
            format!(
                "\"{key}\" must be a list of integers, but is {}",
                kind(value)
            )
        })?;
        list.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i64()
                    .ok_or_else(|| format!("\"{key}\"[{i}] must be an integer, but is {v}"))
            })
            .collect()
    };
    let ids = numbers("input_ids", ids)?;
    let tokens = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    format!("\"input_ids\"[{i}] must be a token id below {vocab}, but is {id}")
                })
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let Some(labels) = labels else {
        return Ok(Row::all(tokens));
    };
    let labels = numbers("labels", labels)?;
    if labels.len() != tokens.len() {
        return Err(format!(
            "\"labels\" must have one label per input id ({}), but has {}",
            tokens.len(),
            labels.len()
        ));
    }
    if let Some((i, &l)) = labels
        .iter()
        .enumerate()
        .find(|(_, l)| **l != IGNORE_INDEX && !(0..vocab as i64).contains(*l))
    {
        return Err(format!(
            "\"labels\"[{i}] must be a token id below {vocab} or -100, but is {l}"
        ));
    }
    Ok(Row { tokens, labels })
}

/// A conversation rendered with the chat template, trained on the assistant turns: the
/// characters from the end of the generation prompt before each assistant message to the end
/// of the conversation rendered through it.
fn chat(messages: &Value, tokenizer: &Tokenizer) -> Result<Row, String> {
    let template = tokenizer
        .chat_template()
        .ok_or("\"messages\" needs a chat template, and the model's tokenizer has none")?;
    let list = messages
        .as_array()
        .ok_or_else(|| format!("\"messages\" must be a list, but is {}", kind(messages)))?;
    let mut parsed = vec![];
    for (i, m) in list.iter().enumerate() {
        let field =
            |key: &str| {
                m.get(key).and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
                format!("\"messages\"[{i}] must be an object with string \"role\" and \"content\"")
            })
            };
        parsed.push(ChatMessage {
            role: field("role")?,
            content: field("content")?,
        });
    }
    if !parsed.iter().any(|m| m.role == "assistant") {
        return Err("\"messages\" has no \"assistant\" message to train on".into());
    }
    let render = |messages: &[ChatMessage], prompt: bool| {
        template.render(messages, prompt).map_err(|e| e.to_string())
    };
    let full = render(&parsed, false)?;
    let mut spans: Vec<Range<usize>> = vec![];
    for (i, m) in parsed.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = render(&parsed[..i], true)?;
        let through = render(&parsed[..=i], false)?;
        if !full.starts_with(&through) || !through.starts_with(&before) {
            return Err(format!(
                "the chat template does not render the conversation through message {i} as a \
                 beginning of the whole one, so its assistant turns cannot be found"
            ));
        }
        spans.push(before.len()..through.len());
    }
    let encoded = tokenizer
        .encode_with_offsets(&full)
        .map_err(|e| e.to_string())?;
    let (tokens, labels) = encoded
        .into_iter()
        .map(|(id, range)| {
            let trained = spans.iter().any(|s| s.contains(&range.start));
            (id, if trained { id as i64 } else { IGNORE_INDEX })
        })
        .unzip();
    Ok(Row { tokens, labels })
}

/// Examples back to back, cut into rows of `seq_len` (the last may be shorter).
pub fn pack(examples: Vec<Row>, seq_len: usize) -> Vec<Row> {
    let (mut tokens, mut labels) = (vec![], vec![]);
    for row in examples {
        tokens.extend(row.tokens);
        labels.extend(row.labels);
    }
    tokens
        .chunks(seq_len)
        .zip(labels.chunks(seq_len))
        .map(|(t, l)| Row {
            tokens: t.to_vec(),
            labels: l.to_vec(),
        })
        .collect()
}

/// A seeded shuffle, then the last `fraction` of the rows (at least one when positive and
/// there are two or more) for eval. With nothing held out the rows keep the file's order (the
/// trainer shuffles its own; `hesper grad` takes the first rows).
pub fn split(mut rows: Vec<Row>, fraction: f64, seed: u64) -> Dataset {
    if fraction <= 0.0 || rows.len() < 2 {
        return Dataset {
            train: rows,
            eval: vec![],
        };
    }
    let mut rng = Rng::new(seed);
    for i in (1..rows.len()).rev() {
        rows.swap(i, rng.below(i + 1));
    }
    let n = rows.len();
    let held = ((n as f64 * fraction).ceil() as usize).clamp(1, n - 1);
    let eval = rows.split_off(n - held);
    Dataset { train: rows, eval }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
