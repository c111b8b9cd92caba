//! GPU timing: per-launch times from timestamp queries ([`crate::Gpu::timed_recorder`]), and
//! [`bench()`], which warms the GPU up (the H200's clock falls within a second of idling and takes
//! over a second to climb), repeats, and reports the median against the bytes or flops moved.

use std::time::{Duration, Instant};

use crate::error::ExecError;
use crate::gpu::Gpu;
use crate::launch::Recorder;

/// How to measure.
#[derive(Clone, Copy, Debug)]
pub struct BenchConfig {
    /// Keep the GPU busy with the measured work this long before timing.
    pub warmup: Duration,
    /// Timed repetitions; the median is reported.
    pub reps: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            warmup: Duration::from_secs(2),
            reps: 30,
        }
    }
}

/// GPU times of the repetitions of one piece of work.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub label: String,
    /// One sample per repetition: the sum of its launches' GPU times, in nanoseconds.
    pub samples_ns: Vec<f64>,
    /// Launches per repetition.
    pub launches: usize,
    /// Each launch of a repetition: its kernel and median GPU time in nanoseconds.
    pub per_launch: Vec<(String, f64)>,
}

impl Measurement {
    pub fn median_ns(&self) -> f64 {
        let mut s = self.samples_ns.clone();
        s.sort_by(f64::total_cmp);
        match s.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => s[n / 2],
            n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
        }
    }
    pub fn min_ns(&self) -> f64 {
        self.samples_ns
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
    }
    /// Bandwidth at the median, for `bytes` moved per repetition.
    pub fn gb_per_s(&self, bytes: f64) -> f64 {
        bytes / self.median_ns()
    }
    /// Throughput at the median, for `flops` per repetition.
    pub fn tflop_per_s(&self, flops: f64) -> f64 {
        flops / self.median_ns() / 1e3
    }
}

/// Measure the launches `record` makes: warm up for `config.warmup`, then time `config.reps`
/// repetitions with timestamp queries. `record` must record the same launches every call.
pub fn bench(
    gpu: &Gpu,
    label: &str,
    config: BenchConfig,
    mut record: impl FnMut(&mut Recorder<'_>) -> Result<(), ExecError>,
) -> Result<Measurement, ExecError> {
    let start = Instant::now();
    let mut batch = 1usize;
    let mut launches = 0;
    loop {
        let round = Instant::now();
        let mut rec = gpu.recorder();
        for _ in 0..batch {
            record(&mut rec)?;
        }
        launches = launches.max(rec.len() / batch);
        rec.submit()?;
        gpu.wait()?;
        if start.elapsed() >= config.warmup {
            break;
        }
        if round.elapsed() < Duration::from_millis(100) && batch < 4096 {
            batch *= 2;
        }
    }
    if launches == 0 {
        return Err(ExecError::Device(format!(
            "bench `{label}` recorded no launch"
        )));
    }
    // As many repetitions as asked for that fit one timed recorder.
    let max = crate::launch::MAX_TIMED_LAUNCHES as usize;
    if launches > max {
        return Err(ExecError::Device(format!(
            "bench `{label}` records {launches} launches per repetition; at most {max} can be timed"
        )));
    }
    let reps = config.reps.clamp(1, max / launches);
    let mut rec = gpu.timed_recorder((launches * reps) as u32)?;
    for _ in 0..reps {
        record(&mut rec)?;
    }
    let times = rec.submit_timed()?;
    let samples_ns = times
        .chunks(launches)
        .map(|rep| rep.iter().map(|t| t.gpu_ns).sum())
        .collect();
    let per_launch = (0..launches)
        .map(|i| {
            let mut ns: Vec<f64> = times
                .iter()
                .skip(i)
                .step_by(launches)
                .map(|t| t.gpu_ns)
                .collect();
            ns.sort_by(f64::total_cmp);
            (times[i].kernel.clone(), ns[ns.len() / 2])
        })
        .collect();
    Ok(Measurement {
        label: label.into(),
        samples_ns,
        launches,
        per_launch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_rates() {
        let m = Measurement {
            label: "x".into(),
            samples_ns: vec![4.0, 1.0, 3.0, 2.0],
            launches: 1,
            per_launch: vec![],
        };
        assert_eq!(m.median_ns(), 2.5);
        assert_eq!(m.min_ns(), 1.0);
        assert_eq!(m.gb_per_s(5.0), 2.0);
        assert_eq!(m.tflop_per_s(5000.0), 2.0);
    }
}
