//! A run's checkpoint: a directory `checkpoint-{step}` holding
//! - `adapter_model.safetensors` + `adapter_config.json`: the adapters as PEFT writes them
//!   (`PeftModel.from_pretrained` loads a checkpoint as it is);
//! - `optimizer_m.safetensors`, `optimizer_v.safetensors`: AdamW's moments under the same keys;
//! - `trainer_state.json`: the step, the data position, the count of bad steps in a row, the
//!   run's config (a resume checks it) and every step's log.
//!
//! The directory is written whole as `checkpoint-{step}.partial`, every file flushed to the
//! disk, then renamed into place: a crash or a full disk leaves the previous checkpoint as it
//! was, never a half-written one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::TrainError;
use super::loader::Position;
use super::trainer::{StepRecord, TrainConfig, TrainState};
use crate::io::{
    decode_adapters, encode_adapters, load_peft_adapter, save_peft_adapter, write_atomic,
};
use crate::model::config::ModelConfig;
use crate::model::reference::Adapters;

const STATE_FILE: &str = "trainer_state.json";
const MOMENTS: [&str; 2] = ["optimizer_m.safetensors", "optimizer_v.safetensors"];
const FORMAT: &str = "hesper-checkpoint-1";

/// What a checkpoint holds.
pub(crate) struct Checkpoint {
    pub(crate) adapters: Adapters,
    pub(crate) m: Adapters,
    pub(crate) v: Adapters,
    pub(crate) state: TrainState,
}

/// `trainer_state.json`.
#[derive(Serialize, Deserialize)]
struct StateFile {
    format: String,
    step: usize,
    epoch: u64,
    next_row: usize,
    bad_in_a_row: usize,
    /// What shapes the run's numbers: a resume must be given the same.
    run: RunFields,
    history: Vec<HistoryLine>,
}

#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct RunFields {
    batch: usize,
    accumulation: usize,
    seq_len: usize,
    seed: u64,
    steps: usize,
    lr: f64,
    warmup_steps: usize,
    decay: String,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    max_grad_norm: Option<f64>,
    lora_plus_ratio: f64,
}

impl RunFields {
    fn of(config: &TrainConfig) -> RunFields {
        let (s, o) = (&config.schedule, &config.optimizer);
        RunFields {
            batch: config.batch,
            accumulation: config.accumulation,
            seq_len: config.seq_len,
            seed: config.seed,
            steps: s.total_steps,
            lr: s.lr,
            warmup_steps: s.warmup_steps,
            decay: format!("{:?}", s.decay).to_lowercase(),
            beta1: o.adamw.beta1,
            beta2: o.adamw.beta2,
            eps: o.adamw.eps,
            weight_decay: o.adamw.weight_decay,
            max_grad_norm: o.max_grad_norm,
            lora_plus_ratio: o.lora_plus_ratio,
        }
    }
}

/// One step of the log; a norm that is not finite is `null` (JSON has no NaN).
#[derive(Serialize, Deserialize)]
struct HistoryLine {
    step: usize,
    loss: Option<f32>,
    grad_norm: Option<f32>,
    lr: f64,
    tokens: usize,
    tokens_per_second: f64,
    eval_loss: Option<f64>,
}

fn finite(x: f32) -> Option<f32> {
    x.is_finite().then_some(x)
}

/// Write `checkpoint` of a run of `train` on `model` into `dir`, replacing what is there only
/// once every file is on the disk.
pub(crate) fn save(
    dir: &Path,
    model: &ModelConfig,
    train: &TrainConfig,
    checkpoint: &Checkpoint,
) -> Result<(), TrainError> {
    let partial = with_suffix(dir, ".partial");
    let io = |path: &Path| {
        let file = path.display().to_string();
        move |source| TrainError::Io { file, source }
    };
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io(&partial))?;
    save_peft_adapter(&partial, model, &train.lora, &checkpoint.adapters, None)?;
    for (name, moments) in MOMENTS.iter().zip([&checkpoint.m, &checkpoint.v]) {
        let path = partial.join(name);
        let bytes = encode_adapters(model, &train.lora, moments)?;
        write_atomic(&path, &bytes).map_err(io(&path))?;
    }
    let state = &checkpoint.state;
    let file = StateFile {
        format: FORMAT.into(),
        step: state.step,
        epoch: state.position.epoch,
        next_row: state.position.next,
        bad_in_a_row: state.bad_in_a_row,
        run: RunFields::of(train),
        history: state
            .history
            .iter()
            .map(|r| HistoryLine {
                step: r.step,
                loss: finite(r.loss),
                grad_norm: finite(r.grad_norm),
                lr: r.lr,
                tokens: r.tokens,
                tokens_per_second: r.tokens_per_second,
                eval_loss: r.eval_loss,
            })
            .collect(),
    };
    let json = serde_json::to_string_pretty(&file).expect("plain values serialize");
    let path = partial.join(STATE_FILE);
    write_atomic(&path, json.as_bytes()).map_err(io(&path))?;
    // Swap the directories: the old one aside, the new one in, the old one gone.
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        std::fs::rename(dir, &old).map_err(io(dir))?;
    }
    std::fs::rename(&partial, dir).map_err(io(dir))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    Ok(())
}

/// The checkpoint in `dir`, of a run of `train` on `model`: an error naming the file and the
/// field when it is not (another batch, learning rate, seed…), or when a file is missing or
/// damaged.
pub(crate) fn load(
    dir: &Path,
    model: &ModelConfig,
    train: &TrainConfig,
) -> Result<Checkpoint, TrainError> {
    let path = dir.join(STATE_FILE);
    let name = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| TrainError::Io {
        file: name.clone(),
        source,
    })?;
    let bad = |message: String| TrainError::Checkpoint {
        file: name.clone(),
        message,
    };
    let file: StateFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if file.format != FORMAT {
        return Err(bad(format!(
            "format must be {FORMAT:?}, but is {:?}",
            file.format
        )));
    }
    let run = RunFields::of(train);
    if file.run != run {
        return Err(bad(format!(
            "the checkpoint is of another run: it was {:?}, this run is {:?}",
            file.run, run
        )));
    }
    if file.history.len() != file.step {
        return Err(bad(format!(
            "history must have one line per step ({}), but has {}",
            file.step,
            file.history.len()
        )));
    }
    let (lora, adapters) = load_peft_adapter(dir, model)?;
    if lora != train.lora {
        return Err(bad(format!(
            "the adapter's LoRA config {lora:?} is not the run's {:?}",
            train.lora
        )));
    }
    let mut moments = vec![];
    for name in MOMENTS {
        let path = dir.join(name);
        let file = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|source| TrainError::Io {
            file: file.clone(),
            source,
        })?;
        moments.push(decode_adapters(&bytes, &file, model, &lora)?);
    }
    let v = moments.pop().expect("two");
    let m = moments.pop().expect("two");
    let history = file
        .history
        .into_iter()
        .map(|h| StepRecord {
            step: h.step,
            loss: h.loss.unwrap_or(f32::NAN),
            grad_norm: h.grad_norm.unwrap_or(f32::NAN),
            lr: h.lr,
            tokens: h.tokens,
            tokens_per_second: h.tokens_per_second,
            eval_loss: h.eval_loss,
        })
        .collect();
    Ok(Checkpoint {
        adapters,
        m,
        v,
        state: TrainState {
            step: file.step,
            position: Position {
                epoch: file.epoch,
                next: file.next_row,
            },
            bad_in_a_row: file.bad_in_a_row,
            history,
        },
    })
}

/// `dir` with `suffix` appended to its last component.
fn with_suffix(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}
