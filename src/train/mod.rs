//! Fine-tuning: data into training rows ([`data`]), their order ([`Loader`]), the learning
//! rate's schedule ([`Schedule`]), and the loop with its checkpoints ([`Trainer`]). Above
//! [`crate::model`], which records the steps; below the `hesper` command.
//!
//! ```no_run
//! use std::path::Path;
//! use std::sync::atomic::AtomicBool;
//! use hesper::io::{GgufFile, Tokenizer, load_model, save_peft_adapter};
//! use hesper::model::config::LoraConfig;
//! use hesper::model::reference::Adapters;
//! use hesper::model::{GpuAdapters, GpuModel, Optimizer};
//! use hesper::train::data::{DataConfig, load_data};
//! use hesper::train::{Decay, Event, Schedule, TrainConfig, Trainer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = hesper::exec::Gpu::new()?;
//! let file = GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let (config, weights) = load_model(&file)?;
//! let tokenizer = Tokenizer::from_gguf(&file)?;
//! let data_config = DataConfig { seq_len: 256, pack: false, eval_fraction: 0.05, seed: 0 };
//! let data = load_data(Path::new("train.jsonl"), &tokenizer, &data_config, config.max_seq)?;
//!
//! let lora = LoraConfig::default(); // q_proj, v_proj; r = 8, α = 16
//! let model = GpuModel::upload(&gpu, &config, &weights)?;
//! let adapters = GpuAdapters::upload(&gpu, &config, &lora, &Adapters::init_peft(&config, &lora, 0))?;
//! let run = TrainConfig {
//!     lora: lora.clone(),
//!     optimizer: Optimizer::default(),
//!     schedule: Schedule { lr: 2e-4, warmup_steps: 10, total_steps: 200, decay: Decay::Cosine },
//!     batch: 8,
//!     accumulation: 1,
//!     seq_len: 256,
//!     recompute: false,
//!     eval_every: 50,
//!     save_every: 100,
//!     max_bad_steps: 5,
//!     seed: 0,
//! };
//! let mut trainer = Trainer::new(&gpu, &model, adapters, (data.train, data.eval), run)?;
//! let stop = AtomicBool::new(false); // raise it (from a Ctrl-C handler) to stop and save
//! trainer.run(Some(Path::new("runs/mine")), &stop, |event| {
//!     if let Event::Step(r) = event {
//!         println!("step {}: loss {}", r.step, r.loss);
//!     }
//! })?;
//! let trained = trainer.adapters().download(&gpu)?;
//! save_peft_adapter(Path::new("runs/mine"), &config, &lora, &trained, None)?;
//! # Ok(())
//! # }
//! ```

#[cfg(not(target_arch = "wasm32"))]
mod checkpoint;
#[cfg(not(target_arch = "wasm32"))]
pub mod data;
mod loader;
mod schedule;
#[cfg(not(target_arch = "wasm32"))]
mod trainer;

pub use loader::{Loader, Position, Row, batch_of};
pub use schedule::{Decay, Schedule};
#[cfg(not(target_arch = "wasm32"))]
pub use trainer::{Event, Outcome, StepRecord, TrainConfig, TrainState, Trainer};

use crate::model::config::ModelError;

/// Why a run could not start, go on, or be saved: each names the file, the row or the field.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(Box<ModelError>),
    #[cfg(not(target_arch = "wasm32"))]
    #[error(transparent)]
    Peft(Box<crate::io::PeftError>),
    #[error(transparent)]
    Gpu(Box<hesper_exec::ExecError>),
    /// Reading or writing `file` failed.
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    /// A checkpoint that is damaged or of another run.
    #[error("{file}: {message}")]
    Checkpoint { file: String, message: String },
    /// A data file's line (1-based; 0: the file as a whole) that is not training data.
    #[error("{file}{}: {message}", at_line(*line))]
    Data {
        file: String,
        line: usize,
        message: String,
    },
    /// A run that cannot be: no rows, rows longer than the sequence length, adapters of
    /// another config.
    #[error("{0}")]
    Config(String),
    /// Too many steps in a row whose gradient was not finite.
    #[error(
        "stopped at step {step}: {steps} steps in a row had a gradient that is not finite \
         (each was skipped, the adapters kept; the last checkpoint is the last good state)"
    )]
    Diverged { step: usize, steps: usize },
}

// Boxed: the errors of the layers below are large, and a run's `Result`s are passed up often.
impl From<ModelError> for TrainError {
    fn from(e: ModelError) -> Self {
        TrainError::Model(Box::new(e))
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl From<crate::io::PeftError> for TrainError {
    fn from(e: crate::io::PeftError) -> Self {
        TrainError::Peft(Box::new(e))
    }
}

impl From<hesper_exec::ExecError> for TrainError {
    fn from(e: hesper_exec::ExecError) -> Self {
        TrainError::Gpu(Box::new(e))
    }
}

/// `:N` after a data file's name, nothing for the file as a whole (line 0).
fn at_line(line: usize) -> String {
    match line {
        0 => String::new(),
        n => format!(":{n}"),
    }
}
