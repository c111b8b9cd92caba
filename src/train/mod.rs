//! Fine-tuning: data into training rows ([`data`]), their order ([`Loader`]), the learning
//! rate's schedule ([`Schedule`]), and the loop with its checkpoints ([`Trainer`]). Above
//! [`crate::model`], which records the steps; below the `hesper` command.

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
    #[error("{file}:{line}: {message}")]
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
