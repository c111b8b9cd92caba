//! The training loop: batches from the [`Loader`], one recorded and submitted step each (the
//! forward, backward and AdamW of [`crate::model`]), the loss of step `n` read while step
//! `n + 1` runs, an eval loss every so many steps, checkpoints, and the guard against steps
//! whose gradient is not finite.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hesper_exec::{Gpu, PendingRead};

use super::TrainError;
use super::checkpoint;
use super::loader::{Loader, Position, Row, batch_of};
use super::schedule::Schedule;
use crate::model::config::LoraConfig;
use crate::model::reference::Batch;
use crate::model::{
    GpuAdapters, GpuModel, Optimizer, StepBuffers, StepShape, record_forward_backward,
    record_forward_loss, record_optimizer_step,
};

/// What a run is: the adapters' config, the optimizer and its schedule, the batch, and when to
/// evaluate and save.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub lora: LoraConfig,
    pub optimizer: Optimizer,
    /// The learning rate of every step; its `total_steps` is the run's length.
    pub schedule: Schedule,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accumulation: usize,
    /// The positions of every sequence (shorter rows are padded).
    pub seq_len: usize,
    /// Gradient checkpointing: less memory, one more forward.
    pub recompute: bool,
    /// The eval loss every this many steps (and after the last); 0: never.
    pub eval_every: usize,
    /// A checkpoint every this many steps (and after the last); 0: only after the last.
    pub save_every: usize,
    /// Stop after this many steps in a row whose gradient was not finite (each skipped).
    pub max_bad_steps: usize,
    /// The data order's seed.
    pub seed: u64,
}

/// One finished step, as logged.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// 1-based: the number of optimizer steps taken so far.
    pub step: usize,
    pub loss: f32,
    /// The gradients' global norm before clipping (not finite: the step was skipped).
    pub grad_norm: f32,
    pub lr: f64,
    /// The tokens of its sequences (padding not counted).
    pub tokens: usize,
    /// Tokens per second of training so far in this run (every step's tokens over the time
    /// since the run started, evals and saves not counted): a step's own time is not
    /// measurable on the host while the next step runs beside it.
    pub tokens_per_second: f64,
    /// The eval loss after this step, where one was computed.
    pub eval_loss: Option<f64>,
}

impl StepRecord {
    /// Whether the optimizer skipped the step (its gradient was not finite).
    pub fn skipped(&self) -> bool {
        !self.grad_norm.is_finite()
    }
}

/// Where a run stands: what a checkpoint saves besides the adapters and the optimizer.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: usize,
    /// The data position after the last step taken.
    pub position: Position,
    /// Steps in a row, up to the last, whose gradient was not finite.
    pub bad_in_a_row: usize,
    /// Every step so far.
    pub history: Vec<StepRecord>,
}

/// What [`Trainer::run`] reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    Step(&'a StepRecord),
    Eval { step: usize, loss: f64 },
    Saved { step: usize, dir: &'a Path },
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every step of the schedule was taken.
    Finished,
    /// The stop flag was raised (Ctrl-C): stopped after the last step in flight, saved.
    Interrupted,
}

/// The run's training time and tokens so far (for tokens per second).
#[derive(Default)]
struct Throughput {
    seconds: f64,
    tokens: usize,
}

/// A training run of LoRA adapters on a frozen model.
pub struct Trainer<'a> {
    gpu: &'a Gpu,
    model: &'a GpuModel,
    adapters: GpuAdapters,
    buffers: StepBuffers,
    train: Vec<Row>,
    eval: Vec<Row>,
    loader: Loader,
    config: TrainConfig,
    state: TrainState,
}

/// A submitted step whose loss and norm are being read back.
struct InFlight {
    step: usize,
    lr: f64,
    tokens: usize,
    loss: PendingRead<f32>,
    norm: PendingRead<f32>,
}

impl<'a> Trainer<'a> {
    /// A run from step 0 of `adapters` (the adapters' LoRA config must be `config.lora`) over
    /// `train` rows, evaluated on `eval` (may be empty). Allocates every buffer of the step.
    pub fn new(
        gpu: &'a Gpu,
        model: &'a GpuModel,
        adapters: GpuAdapters,
        (train, eval): (Vec<Row>, Vec<Row>),
        config: TrainConfig,
    ) -> Result<Trainer<'a>, TrainError> {
        config.schedule.check()?;
        config.optimizer.check((config.schedule.lr, 1))?;
        if adapters.lora() != &config.lora {
            return Err(TrainError::Config(format!(
                "the adapters' LoRA config {:?} is not the run's {:?}",
                adapters.lora(),
                config.lora
            )));
        }
        if train.is_empty() {
            return Err(TrainError::Config("no training rows".into()));
        }
        for (what, rows) in [("training", &train), ("eval", &eval)] {
            if let Some((i, row)) = rows
                .iter()
                .enumerate()
                .find(|(_, r)| r.tokens.len() > config.seq_len)
            {
                return Err(TrainError::Config(format!(
                    "{what} row {i} has {} tokens, more than the sequence length {}",
                    row.tokens.len(),
                    config.seq_len
                )));
            }
        }
        let shape = StepShape {
            micro_batches: config.accumulation,
            recompute: config.recompute,
            ..StepShape::new(config.batch, config.seq_len)
        };
        let buffers = StepBuffers::new(gpu, model, &adapters, shape)?;
        let start = Position { epoch: 0, next: 0 };
        Ok(Trainer {
            gpu,
            model,
            adapters,
            buffers,
            loader: Loader::new(train.len(), config.seed, start),
            train,
            eval,
            config,
            state: TrainState {
                step: 0,
                position: start,
                bad_in_a_row: 0,
                history: vec![],
            },
        })
    }

    /// A run continued from the checkpoint in `dir`: its adapters, AdamW's moments, the step,
    /// the data position and the history, so the run goes on exactly as if it had not stopped.
    /// The checkpoint must be of this config (every field that shapes the run).
    pub fn resume(
        gpu: &'a Gpu,
        model: &'a GpuModel,
        dir: &Path,
        (train, eval): (Vec<Row>, Vec<Row>),
        config: TrainConfig,
    ) -> Result<Trainer<'a>, TrainError> {
        let saved = checkpoint::load(dir, model.config(), &config)?;
        let adapters = GpuAdapters::upload(gpu, model.config(), &config.lora, &saved.adapters)?;
        adapters.write_moments(gpu, &saved.m, &saved.v)?;
        let mut trainer = Trainer::new(gpu, model, adapters, (train, eval), config)?;
        trainer.loader = Loader::new(
            trainer.train.len(),
            trainer.config.seed,
            saved.state.position,
        );
        trainer.state = saved.state;
        Ok(trainer)
    }

    pub fn adapters(&self) -> &GpuAdapters {
        &self.adapters
    }

    pub fn state(&self) -> &TrainState {
        &self.state
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Train until the schedule's last step or until `stop` is raised, saving checkpoints
    /// under `out` (`checkpoint-{step}`) where one is given; `on_event` sees every step, eval
    /// and save. A run of [`TrainConfig::max_bad_steps`] steps in a row whose gradient was
    /// not finite ends with [`TrainError::Diverged`] (no checkpoint is written after the last
    /// good one).
    pub fn run(
        &mut self,
        out: Option<&Path>,
        stop: &AtomicBool,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Outcome, TrainError> {
        let total = self.config.schedule.total_steps;
        let mut in_flight: Option<InFlight> = None;
        let mut clock = Instant::now();
        let mut throughput = Throughput::default();
        while self.state.step < total {
            if stop.load(Ordering::Relaxed) {
                if let Some(flight) = in_flight.take() {
                    self.finish(flight, (&mut clock, &mut throughput), &mut on_event)?;
                }
                if let Some(out) = out {
                    self.save_into(out, &mut on_event)?;
                }
                return Ok(Outcome::Interrupted);
            }
            let flight = self.submit_step()?;
            if let Some(previous) = in_flight.take() {
                self.finish(previous, (&mut clock, &mut throughput), &mut on_event)?;
            }
            let step = flight.step;
            let every = |n: usize| n > 0 && step % n == 0;
            let last = step == total;
            let eval_due = !self.eval.is_empty() && (every(self.config.eval_every) || last);
            let save_due = out.is_some() && (every(self.config.save_every) || last);
            if !(eval_due || save_due) {
                in_flight = Some(flight);
                continue;
            }
            self.finish(flight, (&mut clock, &mut throughput), &mut on_event)?;
            if eval_due {
                let loss = self.eval_loss()?.expect("eval rows are there");
                if let Some(record) = self.state.history.last_mut() {
                    record.eval_loss = Some(loss);
                }
                on_event(Event::Eval { step, loss });
            }
            // A step skipped for a gradient that is not finite saves nothing: the last
            // checkpoint stays the last good state.
            if let (true, Some(out), 0) = (save_due, out, self.state.bad_in_a_row) {
                self.save_into(out, &mut on_event)?;
            }
            // Evals and saves are not training time.
            clock = Instant::now();
        }
        Ok(Outcome::Finished)
    }

    /// The mean loss over every target of the eval rows (`None` without eval rows).
    pub fn eval_loss(&mut self) -> Result<Option<f64>, TrainError> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let (b, m, s) = (
            self.config.batch,
            self.config.accumulation,
            self.config.seq_len,
        );
        let empty = Row::all(vec![]);
        let (mut sum, mut count) = (0.0, 0usize);
        for rows in self.eval.chunks(b * m) {
            let rows: Vec<&Row> = (0..b * m).map(|i| rows.get(i).unwrap_or(&empty)).collect();
            let batches: Vec<Batch> = rows
                .chunks(b)
                .map(|micro| batch_of(micro, s))
                .collect::<Result<_, _>>()?;
            let n: usize = batches.iter().map(Batch::target_count).sum();
            if n == 0 {
                continue;
            }
            self.buffers.load(self.gpu, self.model.config(), &batches)?;
            let mut rec = self.gpu.recorder();
            record_forward_loss(&mut rec, self.model, &self.adapters, &mut self.buffers)?;
            rec.submit()?;
            let loss = self.buffers.loss().read(self.gpu)?[0] as f64;
            sum += loss * n as f64;
            count += n;
        }
        Ok(Some(sum / count.max(1) as f64))
    }

    /// Save a checkpoint of the run as it is into `dir` (replaced whole, atomically).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<(), TrainError> {
        let (m, v) = self.adapters.download_moments(self.gpu)?;
        let adapters = self.adapters.download(self.gpu)?;
        let saved = checkpoint::Checkpoint {
            adapters,
            m,
            v,
            state: self.state.clone(),
        };
        checkpoint::save(dir, self.model.config(), &self.config, &saved)
    }

    fn save_into(
        &mut self,
        out: &Path,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(), TrainError> {
        let dir: PathBuf = out.join(format!("checkpoint-{}", self.state.step));
        self.save_checkpoint(&dir)?;
        on_event(Event::Saved {
            step: self.state.step,
            dir: &dir,
        });
        Ok(())
    }

    /// Load the next rows, record the step and submit it; start reading its loss and norm.
    fn submit_step(&mut self) -> Result<InFlight, TrainError> {
        let (b, m, s) = (
            self.config.batch,
            self.config.accumulation,
            self.config.seq_len,
        );
        let picked = self.loader.take(b * m);
        let rows: Vec<&Row> = picked.iter().map(|&i| &self.train[i]).collect();
        let batches: Vec<Batch> = rows
            .chunks(b)
            .map(|micro| batch_of(micro, s))
            .collect::<Result<_, _>>()?;
        let tokens = rows.iter().map(|r| r.tokens.len()).sum();
        let k = self.state.step;
        let lr = self.config.schedule.lr_at(k);
        self.buffers.load(self.gpu, self.model.config(), &batches)?;
        let mut rec = self.gpu.recorder();
        record_forward_backward(&mut rec, self.model, &mut self.adapters, &mut self.buffers)?;
        let optimizer_step = (lr, (k + 1) as u32);
        record_optimizer_step(
            &mut rec,
            &self.config.optimizer,
            optimizer_step,
            &mut self.adapters,
            &mut self.buffers,
        )?;
        rec.submit()?;
        self.state.step = k + 1;
        self.state.position = self.loader.position();
        Ok(InFlight {
            step: k + 1,
            lr,
            tokens,
            loss: self.buffers.loss().read_start(self.gpu)?,
            norm: self.buffers.grad_norm().read_start(self.gpu)?,
        })
    }

    /// Wait for a submitted step's loss and norm; log it, count it if it was skipped.
    fn finish(
        &mut self,
        flight: InFlight,
        (clock, throughput): (&mut Instant, &mut Throughput),
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(), TrainError> {
        let loss = flight.loss.wait(self.gpu)?[0];
        let grad_norm = flight.norm.wait(self.gpu)?[0];
        throughput.seconds += clock.elapsed().as_secs_f64();
        throughput.tokens += flight.tokens;
        *clock = Instant::now();
        let record = StepRecord {
            step: flight.step,
            loss,
            grad_norm,
            lr: flight.lr,
            tokens: flight.tokens,
            tokens_per_second: throughput.tokens as f64 / throughput.seconds.max(1e-9),
            eval_loss: None,
        };
        if record.skipped() {
            self.state.bad_in_a_row += 1;
        } else {
            self.state.bad_in_a_row = 0;
        }
        self.state.history.push(record);
        on_event(Event::Step(self.state.history.last().expect("pushed")));
        let limit = self.config.max_bad_steps;
        if limit > 0 && self.state.bad_in_a_row >= limit {
            return Err(TrainError::Diverged {
                step: flight.step,
                steps: self.state.bad_in_a_row,
            });
        }
        Ok(())
    }
}
