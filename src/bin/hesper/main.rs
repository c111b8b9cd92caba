//! `hesper`: fine-tune a GGUF model with LoRA on the GPU (or lavapipe), generate with it,
//! evaluate it, write one batch's gradients, and look at the kernels. `hesper --help` lists
//! the commands, `hesper COMMAND --help` their options.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use hesper::exec::{Gpu, GpuOptions};
use hesper::io::{
    ChatMessage, GgufFile, Tokenizer, encode_adapters, load_model, load_peft_adapter,
    save_peft_adapter, write_atomic,
};
use hesper::kernels::catalog;
use hesper::kernels::linear::{Precision, coop};
use hesper::model::config::{LoraConfig, ModelConfig, Projection};
use hesper::model::reference::{Adapters, loss_and_grads};
use hesper::model::{
    Generator, GpuAdapters, GpuModel, Optimizer, Rng, Sampling, StepBuffers, StepShape,
    record_forward_backward,
};
use hesper::train::data::{DataConfig, Dataset, load_data, rows_of};
use hesper::train::{Decay, Event, Outcome, Row, Schedule, TrainConfig, Trainer, batch_of};

mod plot;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The model `finetune` and the others use when none is given: `scripts/fetch-model` puts it
/// there.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The built-in dataset: a made-up fact the model cannot know, asked in many ways, so a few
/// steps show in its answers.
const DEMO_DATA: &str = include_str!("../../train/demo.jsonl");
const DEMO_PROMPT: &str = "Who keeps the lighthouse on Hesper Island?";

const EXAMPLES: &str = "\
Examples:
  hesper finetune                                   # SmolLM2 on the built-in data, a few steps
  hesper finetune --data my.jsonl --steps 500 --batch 8 --seq-len 512 --out runs/mine
  hesper finetune --resume runs/mine/checkpoint-200 --data my.jsonl --steps 500 --batch 8 --seq-len 512 --out runs/mine
  hesper generate --chat --prompt \"Who keeps the lighthouse on Hesper Island?\" --adapter runs/demo
  hesper generate --prompt \"The capital of France is\" --max-new 20
  hesper eval --data my.jsonl --adapter runs/mine
  hesper grad --data my.jsonl --batch 2 --seq-len 128 --out grads.safetensors
  hesper kernels
  hesper wgsl rms_norm_forward --shape cols=1024";

#[derive(Parser)]
#[command(
    name = "hesper",
    version,
    about = "Fine-tune GGUF models with LoRA on any GPU (WGSL kernels through wgpu), and run them",
    after_help = EXAMPLES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fine-tune LoRA adapters; writes the adapter (PEFT format), checkpoints, loss.csv and
    /// loss.png under --out.
    Finetune(Box<FinetuneArgs>),
    /// Continue a prompt (greedy, or sampled with --temperature / --top-p).
    Generate(GenerateArgs),
    /// Mean loss and perplexity of a data file.
    Eval(EvalArgs),
    /// The LoRA gradients of one batch, written to a safetensors file under PEFT's names.
    Grad(GradArgs),
    /// List the kernels and their shape parameters.
    Kernels,
    /// Print a kernel's WGSL at a shape.
    Wgsl(WgslArgs),
    /// Time training steps and generation on this device.
    Bench(BenchArgs),
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// The model, a GGUF file (Llama, Qwen2, Qwen3).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// A LoRA adapter directory (adapter_model.safetensors + adapter_config.json, as PEFT
    /// writes it).
    #[arg(long)]
    adapter: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct DataArgs {
    /// Plain text, or JSON Lines (.jsonl) of {"text"}, {"prompt","response"}, {"messages"} or
    /// {"input_ids","labels"}; the built-in data when not given.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Sequences per micro-batch [default: 4; finetune on the built-in data: 2].
    #[arg(long)]
    batch: Option<usize>,
    /// Pack examples back to back into full sequences.
    #[arg(long)]
    pack: bool,
}

impl DataArgs {
    fn batch(&self) -> usize {
        self.batch.unwrap_or(DATA_DEFAULTS.batch)
    }
}

/// How the training commands multiply through the frozen weights.
#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    /// f16 where the device has tensor cores (cooperative matrices), else f32.
    Auto,
    /// Mixed precision: the projections held in f16, GEMMs with f16 inputs and f32 sums (the
    /// FFN's gate/up saved in f16 on tensor cores); norms, attention's softmax, loss, LoRA and
    /// the optimizer in f32.
    F16,
    /// Everything in f32: the reference.
    F32,
}

impl PrecisionArg {
    fn resolve(self, gpu: &Gpu) -> Precision {
        match self {
            PrecisionArg::F16 => Precision::F16,
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::Auto if coop::subgroup_size(gpu).is_some() && gpu.supports_f16() => {
                Precision::F16
            }
            PrecisionArg::Auto => Precision::F32,
        }
    }
}

#[derive(Args)]
struct FinetuneArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    data: DataArgs,
    /// f16 (mixed precision), f32, or auto: f16 where the device has tensor cores.
    #[arg(long, value_enum, default_value = "auto")]
    precision: PrecisionArg,
    /// Where the adapter, checkpoints, loss.csv and loss.png go.
    #[arg(long, default_value = "runs/demo")]
    out: PathBuf,
    /// Optimizer steps [default: 100; on the built-in data: 12].
    #[arg(long)]
    steps: Option<usize>,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Peak learning rate [default: 2e-4; on the built-in data: 2e-3, to learn its fact in
    /// a few steps].
    #[arg(long)]
    lr: Option<f64>,
    /// Warmup steps (linear from 0).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// After warmup: constant, linear (Hugging Face's default) or cosine.
    #[arg(long, default_value = "linear")]
    schedule: String,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// LoRA alpha.
    #[arg(long, default_value_t = 16.0)]
    alpha: f64,
    /// The adapted projections, by PEFT's names.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    targets: Vec<String>,
    /// rsLoRA: scale by alpha/sqrt(r).
    #[arg(long)]
    rslora: bool,
    /// AdamW's decoupled weight decay (Hugging Face's default: 0).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip the gradients' global norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// LoRA+: B's learning rate as a multiple of A's.
    #[arg(long, default_value_t = 1.0)]
    lora_plus_ratio: f64,
    /// The eval loss every this many steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    eval_every: usize,
    /// The share of the data held out for the eval loss.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    /// A checkpoint every this many steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Stop after this many steps in a row whose gradient is not finite.
    #[arg(long, default_value_t = 5)]
    max_bad_steps: usize,
    /// The seed of the adapters' init, the split and the data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Gradient checkpointing: less memory, one more forward.
    #[arg(long)]
    recompute: bool,
    /// Start from this PEFT adapter (its rank, alpha and targets replace the options').
    #[arg(long)]
    init_adapter: Option<PathBuf>,
    /// Continue the run saved in this checkpoint directory (the same options as the run).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Generate from this prompt (a chat turn) before and after training; "" for none.
    #[arg(long)]
    prompt: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user turn of the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Sample at this temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    data: DataArgs,
}

#[derive(Args)]
struct GradArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    data: DataArgs,
    /// The safetensors file to write.
    #[arg(long)]
    out: PathBuf,
    /// Without --adapter: LoRA rank of the PEFT-initialized adapters (B = 0).
    #[arg(long, default_value_t = 8)]
    rank: usize,
    #[arg(long, default_value_t = 16.0)]
    alpha: f64,
    #[arg(long, value_delimiter = ',', default_value = "q_proj,v_proj")]
    targets: Vec<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also compute the loss and gradients with the f64 model on the CPU (minutes for a real
    /// model) and print how far the GPU's are from them.
    #[arg(long)]
    check_f64: bool,
    /// f32 (the reference), f16 (mixed precision), or auto: f16 where the device has tensor
    /// cores.
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
}

#[derive(Args)]
struct WgslArgs {
    /// The kernel's name (`hesper kernels` lists them).
    name: String,
    /// Shape parameters, `name=value` (the kernel's defaults otherwise).
    #[arg(long, value_delimiter = ' ', num_args = 1..)]
    shape: Vec<String>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Tokens to decode in the generation benchmark.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// f16 (mixed precision), f32, or auto: f16 where the device has tensor cores.
    #[arg(long, value_enum, default_value = "auto")]
    precision: PrecisionArg,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Finetune(args) => finetune(*args),
        Command::Generate(args) => generate(args),
        Command::Eval(args) => eval(args),
        Command::Grad(args) => grad(args),
        Command::Kernels => kernels(),
        Command::Wgsl(args) => wgsl(args),
        Command::Bench(args) => bench(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, whatever the error: wgpu's messages (an allocation that failed, say)
            // come over several.
            let text = e.to_string();
            let lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            eprintln!("error: {}", lines.join(" "));
            std::process::ExitCode::FAILURE
        }
    }
}

/// A model loaded from its GGUF: the file's tokenizer, the config, the weights on the GPU.
struct Loaded {
    config: ModelConfig,
    tokenizer: Tokenizer,
    model: GpuModel,
}

/// The device of the training commands: tensor cores where it has them, their GEMM tiles
/// measured once per shape on this machine (about a minute for SmolLM2's step on the H200),
/// remembered with the compiled pipelines in [`cache_dir`] ([`save_caches`]).
fn open_training_gpu() -> Result<Gpu> {
    let dir = cache_dir();
    Ok(Gpu::with_options(GpuOptions {
        cooperative_matrix: true,
        autotune: true,
        tune_cache_file: dir.as_ref().map(|d| d.join("tune.txt")),
        pipeline_cache_file: dir.as_ref().map(|d| d.join("pipelines.bin")),
        ..GpuOptions::default()
    })?)
}

/// Where the training commands keep what they measured and compiled: `$HESPER_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/hesper`, else `~/.cache/hesper`; none when it cannot be made (a warning).
fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("HESPER_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("hesper")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("hesper")))?;
    match std::fs::create_dir_all(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            eprintln!("warning: no cache ({}: {e})", dir.display());
            None
        }
    }
}

/// Write the tuned tiles and the pipeline cache of [`open_training_gpu`]'s device (a failure
/// is a warning: they are only caches).
fn save_caches(gpu: &Gpu) {
    for saved in [gpu.save_tune_cache(), gpu.save_pipeline_cache()] {
        if let Err(e) = saved {
            eprintln!("warning: the cache was not saved: {e}");
        }
    }
}

fn open_model(gpu: &Gpu, path: &Path) -> Result<Loaded> {
    open_model_with_precision(gpu, path, Precision::F32)
}

fn open_model_with_precision(gpu: &Gpu, path: &Path, precision: Precision) -> Result<Loaded> {
    if !path.exists() && path == Path::new(DEFAULT_MODEL) {
        return Err(format!("{DEFAULT_MODEL} is absent: scripts/fetch-model fetches it").into());
    }
    let file = GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let (config, weights) = load_model(&file)?;
    let model = GpuModel::upload_with_precision(gpu, &config, &weights, precision)?;
    Ok(Loaded {
        config,
        tokenizer,
        model,
    })
}

fn lora_config(targets: &[String], rank: usize, alpha: f64, rslora: bool) -> Result<LoraConfig> {
    let targets = targets
        .iter()
        .map(|t| Projection::from_peft_name(t.trim()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let lora = LoraConfig {
        targets,
        rank,
        alpha,
        rslora,
    };
    lora.check()?;
    Ok(lora)
}

/// The adapters of `--adapter`, or none (a rank-1 zero adapter on q: the model as it is).
fn adapters_of(gpu: &Gpu, loaded: &Loaded, adapter: Option<&Path>) -> Result<GpuAdapters> {
    let (lora, adapters) = match adapter {
        Some(dir) => load_peft_adapter(dir, &loaded.config)?,
        None => {
            let lora = LoraConfig {
                targets: vec![Projection::Q],
                rank: 1,
                alpha: 1.0,
                rslora: false,
            };
            let zeros = Adapters::zeros(&loaded.config, &lora);
            (lora, zeros)
        }
    };
    Ok(GpuAdapters::upload(gpu, &loaded.config, &lora, &adapters)?)
}

/// The rows of `--data` (or the built-in data) for `loaded`'s model.
fn dataset(loaded: &Loaded, data: &DataArgs, eval_fraction: f64, seed: u64) -> Result<Dataset> {
    let config = DataConfig {
        seq_len: data.seq_len,
        pack: data.pack,
        eval_fraction,
        seed,
    };
    let max_seq = loaded.config.max_seq;
    Ok(match &data.data {
        Some(path) => load_data(path, &loaded.tokenizer, &config, max_seq)?,
        None => rows_of(
            DEMO_DATA,
            "built-in data",
            true,
            &loaded.tokenizer,
            &config,
            max_seq,
        )?,
    })
}

/// What the built-in data trains with unless told otherwise: its fact in 12 steps of 2
/// sequences (minutes on lavapipe), and what other data does.
struct Defaults {
    steps: usize,
    batch: usize,
    lr: f64,
}

const DEMO_DEFAULTS: Defaults = Defaults {
    steps: 12,
    batch: 2,
    lr: 2e-3,
};
const DATA_DEFAULTS: Defaults = Defaults {
    steps: 100,
    batch: 4,
    lr: 2e-4,
};

fn finetune(mut args: FinetuneArgs) -> Result<()> {
    let defaults = match args.data.data {
        None => DEMO_DEFAULTS,
        Some(_) => DATA_DEFAULTS,
    };
    args.data.batch = Some(args.data.batch.unwrap_or(defaults.batch));
    let steps = args.steps.unwrap_or(defaults.steps);
    let lr = args.lr.unwrap_or(defaults.lr);
    let gpu = open_training_gpu()?;
    let precision = args.precision.resolve(&gpu);
    eprintln!("device: {} ({precision:?})", gpu.adapter_info().name);
    let loaded = open_model_with_precision(&gpu, &args.model.model, precision)?;
    let c = &loaded.config;
    eprintln!(
        "model: {} ({:?}, {} layers, D = {}, vocab {})",
        args.model.model.display(),
        c.family,
        c.layers,
        c.dim,
        c.vocab
    );
    let data = dataset(&loaded, &args.data, args.eval_fraction, args.seed)?;
    eprintln!(
        "data: {} training rows, {} eval rows of at most {} tokens",
        data.train.len(),
        data.eval.len(),
        args.data.seq_len
    );
    let (lora, initial) = match &args.init_adapter {
        Some(dir) => load_peft_adapter(dir, c)?,
        None => {
            let lora = lora_config(&args.targets, args.rank, args.alpha, args.rslora)?;
            let init = Adapters::init_peft(c, &lora, args.seed);
            (lora, init)
        }
    };
    let mut optimizer = Optimizer::default();
    optimizer.adamw.weight_decay = args.weight_decay;
    optimizer.max_grad_norm = (args.max_grad_norm > 0.0).then_some(args.max_grad_norm);
    optimizer.lora_plus_ratio = args.lora_plus_ratio;
    let config = TrainConfig {
        lora: lora.clone(),
        optimizer,
        schedule: Schedule {
            lr,
            warmup_steps: args.warmup,
            total_steps: steps,
            decay: Decay::parse(&args.schedule)?,
        },
        batch: args.data.batch(),
        accumulation: args.accumulation,
        seq_len: args.data.seq_len,
        recompute: args.recompute,
        eval_every: args.eval_every,
        save_every: args.save_every,
        max_bad_steps: args.max_bad_steps,
        seed: args.seed,
    };
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None if args.data.data.is_none() => DEMO_PROMPT.to_string(),
        None => String::new(),
    };
    let rows = (data.train, data.eval);
    let mut trainer = match &args.resume {
        Some(dir) => Trainer::resume(&gpu, &loaded.model, dir, rows, config)?,
        None => {
            let adapters = GpuAdapters::upload(&gpu, c, &lora, &initial)?;
            Trainer::new(&gpu, &loaded.model, adapters, rows, config)?
        }
    };
    let mut generator = Generator::new(&gpu, &loaded.model)?;
    if !prompt.is_empty() {
        eprintln!("before: ");
        chat_reply(&gpu, &loaded, trainer.adapters(), &mut generator, &prompt)?;
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("{}: cannot create the directory: {e}", args.out.display()))?;
    static STOP: AtomicBool = AtomicBool::new(false);
    ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\nstopping after this step and saving a checkpoint (Ctrl-C again: quit now)");
    })?;
    let total = trainer.config().schedule.total_steps;
    let done = trainer.state().step;
    let bar = ProgressBar::new(total as u64).with_position(done as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} steps  {msg}  ETA {eta}",
    )?);
    let started = Instant::now();
    let out = args.out.clone();
    let outcome = trainer.run(Some(&out), &STOP, |event| match event {
        Event::Step(r) => {
            bar.set_position(r.step as u64);
            let skipped = if r.skipped() {
                " (skipped: gradient not finite)"
            } else {
                ""
            };
            let line = format!(
                "loss {:.4}  lr {:.2e}  {:.0} tokens/s{skipped}",
                r.loss, r.lr, r.tokens_per_second
            );
            if bar.is_hidden() {
                // Not a terminal (a log file, CI): a line per step instead of the bar.
                eprintln!("step {}/{total}: {line}", r.step);
            }
            bar.set_message(line);
        }
        Event::Eval { step, loss } => bar.println(format!(
            "step {step}: eval loss {loss:.4} (perplexity {:.2})",
            loss.exp()
        )),
        Event::Saved { step, dir } => {
            bar.println(format!("step {step}: checkpoint {}", dir.display()))
        }
    });
    bar.finish();
    save_caches(&gpu);
    let history = &trainer.state().history;
    write_loss_csv(&out.join("loss.csv"), history)?;
    plot::loss_png(&out.join("loss.png"), history)?;
    let outcome = outcome?;
    let adapters = trainer.adapters().download(&gpu)?;
    save_peft_adapter(
        &out,
        c,
        &lora,
        &adapters,
        Some(&base_model_name(&args.model.model)),
    )?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "{}: {} steps in {seconds:.1} s; the adapter, loss.csv and loss.png in {}",
        match outcome {
            Outcome::Finished => "done",
            Outcome::Interrupted => "interrupted",
        },
        trainer.state().step - done,
        out.display(),
    );
    if !prompt.is_empty() && outcome == Outcome::Finished {
        eprintln!("after: ");
        chat_reply(&gpu, &loaded, trainer.adapters(), &mut generator, &prompt)?;
    }
    Ok(())
}

/// The model's name for `base_model_name_or_path`: the GGUF's `general.name`-less file stem.
fn base_model_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn write_loss_csv(path: &Path, history: &[hesper::train::StepRecord]) -> Result<()> {
    let mut csv = String::from("step,loss,grad_norm,lr,tokens,tokens_per_second,eval_loss\n");
    for r in history {
        let eval = r.eval_loss.map(|l| l.to_string()).unwrap_or_default();
        csv += &format!(
            "{},{},{},{},{},{:.1},{eval}\n",
            r.step, r.loss, r.grad_norm, r.lr, r.tokens, r.tokens_per_second
        );
    }
    write_atomic(path, csv.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// Print the model's greedy reply to `prompt` as a user turn, streaming it.
fn chat_reply(
    gpu: &Gpu,
    loaded: &Loaded,
    adapters: &GpuAdapters,
    generator: &mut Generator,
    prompt: &str,
) -> Result<()> {
    let tokens = prompt_tokens(&loaded.tokenizer, prompt, true)?;
    stream(
        gpu,
        loaded,
        adapters,
        generator,
        &tokens,
        48,
        Sampling::Greedy,
        0,
    )?;
    Ok(())
}

/// The prompt's tokens, as a chat's user turn (with the generation prompt) or as it is.
fn prompt_tokens(tokenizer: &Tokenizer, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    let text = if chat {
        let template = tokenizer
            .chat_template()
            .ok_or("--chat: the model's tokenizer has no chat template")?;
        let message = ChatMessage {
            role: "user".into(),
            content: prompt.into(),
        };
        template.render(&[message], true)?
    } else {
        prompt.to_string()
    };
    let mut tokens: Vec<u32> = if tokenizer.add_bos() && !chat {
        tokenizer.bos().into_iter().collect()
    } else {
        vec![]
    };
    tokens.extend(tokenizer.encode(&text)?);
    if tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    Ok(tokens)
}

/// Generate after `tokens`, printing each piece of text as it comes; returns the new tokens.
#[allow(clippy::too_many_arguments)]
fn stream(
    gpu: &Gpu,
    loaded: &Loaded,
    adapters: &GpuAdapters,
    generator: &mut Generator,
    tokens: &[u32],
    max_new: usize,
    sampling: Sampling,
    seed: u64,
) -> Result<Vec<u32>> {
    let tokenizer = &loaded.tokenizer;
    let stop: Vec<u32> = tokenizer.eos().into_iter().collect();
    let mut new = vec![];
    let mut out = std::io::stdout();
    let mut rng = Rng::new(seed);
    let mut failed = None;
    // Holds back a character split over tokens until it is whole.
    let mut decoder = tokenizer.decode_stream();
    generator.generate(
        gpu,
        &loaded.model,
        adapters,
        tokens,
        max_new,
        (sampling, &mut rng),
        &stop,
        |t| {
            if stop.contains(&t) {
                return;
            }
            new.push(t);
            match decoder.step(t) {
                Ok(Some(text)) => {
                    let _ = out.write_all(text.as_bytes());
                    let _ = out.flush();
                }
                Ok(None) => {}
                Err(e) => failed = Some(e),
            }
        },
    )?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    println!();
    Ok(new)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let gpu = Gpu::new()?;
    let loaded = open_model(&gpu, &args.model.model)?;
    let adapters = adapters_of(&gpu, &loaded, args.model.adapter.as_deref())?;
    let sampling = if args.temperature > 0.0 {
        Sampling::Sample {
            temperature: args.temperature,
            top_p: args.top_p,
        }
    } else {
        Sampling::Greedy
    };
    sampling.check()?;
    let tokens = prompt_tokens(&loaded.tokenizer, &args.prompt, args.chat)?;
    let mut generator = Generator::new(&gpu, &loaded.model)?;
    let started = Instant::now();
    let new = stream(
        &gpu,
        &loaded,
        &adapters,
        &mut generator,
        &tokens,
        args.max_new,
        sampling,
        args.seed,
    )?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "{} tokens in {seconds:.2} s ({:.1} tokens/s, the prompt {} tokens)",
        new.len(),
        new.len() as f64 / seconds,
        tokens.len()
    );
    Ok(())
}

fn eval(args: EvalArgs) -> Result<()> {
    let gpu = Gpu::new()?;
    let loaded = open_model(&gpu, &args.model.model)?;
    let adapters = adapters_of(&gpu, &loaded, args.model.adapter.as_deref())?;
    let data = dataset(&loaded, &args.data, 0.0, 0)?;
    let rows = data.train;
    let config = TrainConfig {
        lora: adapters.lora().clone(),
        optimizer: Optimizer::default(),
        schedule: Schedule {
            lr: 0.0,
            warmup_steps: 0,
            total_steps: 1,
            decay: Decay::Constant,
        },
        batch: args.data.batch(),
        accumulation: 1,
        seq_len: args.data.seq_len,
        recompute: true,
        eval_every: 0,
        save_every: 0,
        max_bad_steps: 0,
        seed: 0,
    };
    let targets: usize = rows.iter().map(Row::targets).sum();
    let n = rows.len();
    let mut trainer = Trainer::new(
        &gpu,
        &loaded.model,
        adapters,
        (rows[..1].to_vec(), rows),
        config,
    )?;
    let loss = trainer.eval_loss()?.expect("rows are there");
    println!(
        "{} rows, {targets} targets: mean loss {loss:.6}, perplexity {:.4}",
        n,
        loss.exp()
    );
    Ok(())
}

fn grad(args: GradArgs) -> Result<()> {
    let gpu = open_training_gpu()?;
    let precision = args.precision.resolve(&gpu);
    let loaded = open_model_with_precision(&gpu, &args.model.model, precision)?;
    let c = &loaded.config;
    let (lora, adapters) = match &args.model.adapter {
        Some(dir) => load_peft_adapter(dir, c)?,
        None => {
            let lora = lora_config(&args.targets, args.rank, args.alpha, false)?;
            let init = Adapters::init_peft(c, &lora, args.seed);
            (lora, init)
        }
    };
    let data = dataset(&loaded, &args.data, 0.0, 0)?;
    // The file's first rows, in its order (nothing held out: no shuffle).
    let rows: Vec<&Row> = data.train.iter().take(args.data.batch()).collect();
    let batch = batch_of(&rows, args.data.seq_len)?;
    let mut gpu_adapters = GpuAdapters::upload(&gpu, c, &lora, &adapters)?;
    let shape = StepShape::new(rows.len(), args.data.seq_len);
    let mut buffers = StepBuffers::new(&gpu, &loaded.model, &gpu_adapters, shape)?;
    buffers.load(&gpu, c, std::slice::from_ref(&batch))?;
    let mut rec = gpu.recorder();
    record_forward_backward(&mut rec, &loaded.model, &mut gpu_adapters, &mut buffers)?;
    rec.submit()?;
    let loss = buffers.loss().read(&gpu)?[0];
    let grads = gpu_adapters.download_grads(&gpu)?;
    let bytes = encode_adapters(c, &lora, &grads)?;
    write_atomic(&args.out, &bytes).map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!(
        "loss {loss:.6} over {} targets; the gradients of {} adapters in {}",
        batch.target_count(),
        grads.iter().count(),
        args.out.display()
    );
    save_caches(&gpu);
    if args.check_f64 {
        let (_, weights) = load_model(&GgufFile::open(&args.model.model)?)?;
        let (loss64, want) = loss_and_grads(c, &lora, &weights, &adapters, &batch)?;
        // Per matrix: the largest difference over the largest f64 magnitude (matrices whose
        // f64 gradient is exactly 0, as q and k's are over one position, apart: their largest
        // GPU value).
        let (mut errors, mut zero): (Vec<(f64, String)>, f64) = (vec![], 0.0);
        for (layer, p, w) in want.lora.iter() {
            let g = grads.get(layer, p).expect("the same config");
            for (which, got, want) in [("lora_A", &g.a, &w.a), ("lora_B", &g.b, &w.b)] {
                let largest = |v: &[f64]| v.iter().fold(0f64, |m, v| m.max(v.abs()));
                let diff = got
                    .iter()
                    .zip(want)
                    .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
                match largest(want) {
                    0.0 => zero = zero.max(largest(got)),
                    scale => {
                        let name = format!("{}.{which}", Adapters::peft_key(layer, p));
                        errors.push((diff / scale, name));
                    }
                }
            }
        }
        errors.sort_by(|a, b| a.0.total_cmp(&b.0));
        let loss_error = ((f64::from(loss) - loss64) / loss64).abs();
        println!("f64 model: loss {loss64:.9} (the GPU's relative error {loss_error:.2e})");
        if let Some((worst, name)) = errors.last() {
            let median = errors[errors.len() / 2].0;
            println!(
                "gradients of {} matrices: median relative error {median:.2e}, worst \
                 {worst:.2e} ({name})",
                errors.len()
            );
        }
        if zero > 0.0 {
            println!("gradients 0 in f64: at most {zero:.2e} on the GPU");
        }
    }
    Ok(())
}

fn kernels() -> Result<()> {
    let mut module = "";
    for entry in catalog::entries() {
        if entry.module != module {
            module = entry.module;
            println!("{module}:");
        }
        let params: Vec<String> = entry
            .params
            .iter()
            .map(|p| format!("{}={}", p.name, p.default))
            .collect();
        println!("  {:32} {}", entry.name, params.join(" "));
        println!("  {:32} {}", "", entry.summary);
    }
    Ok(())
}

fn wgsl(args: WgslArgs) -> Result<()> {
    let entry = catalog::find(&args.name)?;
    let shape = args
        .shape
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| format!("--shape {kv:?}: expected name=value"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let kernel = entry.build(&shape)?;
    println!("// {}", kernel.key());
    print!("{}", kernel.wgsl());
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    let gpu = open_training_gpu()?;
    let precision = args.precision.resolve(&gpu);
    eprintln!("device: {} ({precision:?})", gpu.adapter_info().name);
    let loaded = open_model_with_precision(&gpu, &args.model.model, precision)?;
    let c = &loaded.config;
    let lora = LoraConfig::default();
    let init = Adapters::init_peft(c, &lora, 0);
    let adapters = GpuAdapters::upload(&gpu, c, &lora, &init)?;
    let mut rng = Rng::new(1);
    let rows: Vec<Row> = (0..args.batch * (args.steps + 1))
        .map(|_| {
            Row::all(
                (0..args.seq_len)
                    .map(|_| rng.below(c.vocab) as u32)
                    .collect(),
            )
        })
        .collect();
    let config = TrainConfig {
        lora,
        optimizer: Optimizer::default(),
        schedule: Schedule {
            lr: 1e-4,
            warmup_steps: 0,
            total_steps: args.steps + 1,
            decay: Decay::Constant,
        },
        batch: args.batch,
        accumulation: 1,
        seq_len: args.seq_len,
        recompute: false,
        eval_every: 0,
        save_every: 0,
        max_bad_steps: 0,
        seed: 0,
    };
    let mut trainer = Trainer::new(&gpu, &loaded.model, adapters, (rows, vec![]), config)?;
    let stop = AtomicBool::new(false);
    let mut times = vec![];
    let mut last = Instant::now();
    trainer.run(None, &stop, |event| {
        if let Event::Step(r) = event {
            if r.step > 1 {
                times.push(last.elapsed().as_secs_f64() * 1e3);
            }
            last = Instant::now();
        }
    })?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = (args.batch * args.seq_len) as f64;
    println!(
        "finetune: B = {}, S = {}: median {median:.1} ms a step over {} steps ({:.0} tokens/s)",
        args.batch,
        args.seq_len,
        times.len(),
        tokens / median * 1e3
    );
    save_caches(&gpu);
    let mut generator = Generator::new(&gpu, &loaded.model)?;
    let prompt = prompt_tokens(&loaded.tokenizer, "The capital of France is", false)?;
    let started = Instant::now();
    generator.next_logits(&gpu, &loaded.model, trainer.adapters(), &prompt)?;
    let full = started.elapsed().as_secs_f64();
    // Greedy decoding over the KV cache, twice (the first makes its buffers and pipelines):
    // the prompt's forward and first choice, then the tokens after it.
    for run in ["first", "second"] {
        let mut rng = Rng::new(0);
        let started = Instant::now();
        let mut first = None;
        let new = generator.generate(
            &gpu,
            &loaded.model,
            trainer.adapters(),
            &prompt,
            args.decode,
            (Sampling::Greedy, &mut rng),
            &[],
            |_| {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
            },
        )?;
        let total = started.elapsed().as_secs_f64();
        let first = first.unwrap_or(total);
        println!(
            "generate ({run} run): prefill of {} tokens and the first choice {:.1} ms; \
             decode of {} more at {:.1} tokens/s (the whole forward of the prompt: {:.1} ms)",
            prompt.len(),
            first * 1e3,
            new.len().saturating_sub(1),
            new.len().saturating_sub(1) as f64 / (total - first),
            full * 1e3
        );
    }
    Ok(())
}
