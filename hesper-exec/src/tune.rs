//! Autotuning: a kernel's variants (tiles) measured on this device the first time a shape class
//! asks for one, the fastest remembered, in memory and in a file beside the pipeline cache
//! ([`GpuOptions::tune_cache_file`]), keyed by the adapter, its driver and the kernel's version.
//!
//! The file is text, one choice a line with its own checksum: a line that is damaged, or that
//! names a variant the kernel no longer has, is ignored (and measured again); a file written for
//! another adapter or driver is ignored whole. It is written atomically by
//! [`Gpu::save_tune_cache`].
//!
//! [`GpuOptions::tune_cache_file`]: crate::GpuOptions::tune_cache_file

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::ExecError;
use crate::gpu::Gpu;

const MAGIC: &str = "hesper tune cache v1";

/// The tuned choices of one device.
#[derive(Default)]
pub(crate) struct TuneCache {
    /// Key → the chosen variant's name.
    choices: Mutex<BTreeMap<String, String>>,
    /// Times a key was measured (not found, or found stale).
    runs: AtomicU64,
    /// Lines of the file that were ignored when it was read.
    ignored: AtomicU64,
    /// What each measurement found, in order.
    reports: Mutex<Vec<TuneReport>>,
}

/// One key's measurement: each candidate's time in nanoseconds, or why it failed, and the
/// choice.
#[derive(Clone, Debug)]
pub struct TuneReport {
    pub key: String,
    pub measured: Vec<(String, Result<f64, String>)>,
    pub chosen: Option<String>,
}

/// What the tune cache file held when the `Gpu` opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TuneFileStatus {
    /// No file was asked for.
    Off,
    /// No file yet, or it held no choice.
    Empty,
    /// Choices read from the file, and lines ignored (damaged).
    Loaded { choices: usize, ignored: usize },
    /// The whole file was not used; why.
    Ignored(String),
}

/// FNV-1a, 64-bit, of a line's key and value: enough to notice a damaged line.
fn checksum(key: &str, value: &str) -> u64 {
    key.bytes()
        .chain([b'\t'])
        .chain(value.bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        })
}

impl TuneCache {
    /// Read `text` written for `header`: its choices, and how many lines were ignored.
    pub(crate) fn parse(
        text: &str,
        header: &str,
    ) -> Result<(BTreeMap<String, String>, usize), String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err("not a hesper tune cache file".into());
        }
        if lines.next() != Some(header) {
            return Err("written for another adapter or driver".into());
        }
        let mut choices = BTreeMap::new();
        let mut ignored = 0;
        for line in lines {
            let mut parts = line.split('\t');
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some(key), Some(value), Some(sum), None)
                    if u64::from_str_radix(sum, 16) == Ok(checksum(key, value)) =>
                {
                    choices.insert(key.to_string(), value.to_string());
                }
                _ => ignored += 1,
            }
        }
        Ok((choices, ignored))
    }

    pub(crate) fn load(&self, path: &Path, header: &str) -> TuneFileStatus {
        let text = match std::fs::read(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return TuneFileStatus::Empty,
            Err(e) => {
                return TuneFileStatus::Ignored(format!("cannot read {}: {e}", path.display()));
            }
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => text,
                Err(_) => {
                    return TuneFileStatus::Ignored(format!("{}: not text", path.display()));
                }
            },
        };
        match TuneCache::parse(&text, header) {
            Err(why) => TuneFileStatus::Ignored(format!("{}: {why}", path.display())),
            Ok((choices, ignored)) => {
                self.ignored.store(ignored as u64, Ordering::Relaxed);
                let n = choices.len();
                *self.lock() = choices;
                match (n, ignored) {
                    (0, 0) => TuneFileStatus::Empty,
                    _ => TuneFileStatus::Loaded {
                        choices: n,
                        ignored,
                    },
                }
            }
        }
    }

    fn reports(&self) -> std::sync::MutexGuard<'_, Vec<TuneReport>> {
        self.reports.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.choices.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn text(&self, header: &str) -> String {
        let mut out = format!("{MAGIC}\n{header}\n");
        for (key, value) in self.lock().iter() {
            out.push_str(&format!("{key}\t{value}\t{:016x}\n", checksum(key, value)));
        }
        out
    }
}

impl Gpu {
    /// The variant of `candidates` tuned for `key` on this device: remembered (this process or
    /// the tune cache file), or measured now — `measure` gives each candidate's time, the
    /// fastest is kept (a candidate whose measurement fails is skipped). `name` identifies a
    /// candidate in the file; put the kernel's version in `key`, so that a changed kernel is
    /// measured again. An error only when every candidate fails.
    pub fn tuned<T: Copy>(
        &self,
        key: &str,
        candidates: &[T],
        name: impl Fn(&T) -> String,
        mut measure: impl FnMut(&T) -> Result<f64, ExecError>,
    ) -> Result<T, ExecError> {
        // Keys and names are one line of the file each, tab-free.
        let clean = |s: String| s.replace(['\t', '\n', '\r'], " ");
        let key = clean(key.to_string());
        let known = self.tune.lock().get(&key).cloned();
        if let Some(found) = known.and_then(|v| candidates.iter().find(|c| clean(name(c)) == v)) {
            return Ok(*found);
        }
        self.tune.runs.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(f64, T)> = None;
        let mut last_error = None;
        let mut measured = vec![];
        for c in candidates {
            let result = measure(c);
            let shown = result.as_ref().map(|t| *t).map_err(|e| e.to_string());
            measured.push((clean(name(c)), shown));
            match result {
                Ok(t) if best.is_none_or(|(b, _)| t < b) => best = Some((t, *c)),
                Ok(_) => {}
                Err(e) => {
                    log::warn!("autotune `{key}`: `{}` failed: {e}", name(c));
                    last_error = Some(e);
                }
            }
        }
        let chosen = best.map(|(_, c)| clean(name(&c)));
        let report = TuneReport {
            key: key.clone(),
            measured,
            chosen: chosen.clone(),
        };
        self.tune.reports().push(report);
        match (best, chosen) {
            (Some((_, c)), Some(chosen)) => {
                self.tune.lock().insert(key, chosen);
                Ok(c)
            }
            _ => Err(last_error
                .unwrap_or_else(|| ExecError::Device(format!("autotune `{key}`: no candidates")))),
        }
    }

    /// Every measurement made since this `Gpu` opened, in order: what autotuning found.
    pub fn autotune_reports(&self) -> Vec<TuneReport> {
        self.tune.reports().clone()
    }

    /// How many times a key was measured since this `Gpu` opened (not found in memory or the
    /// file, or naming a variant no longer offered).
    pub fn autotune_runs(&self) -> u64 {
        self.tune.runs.load(Ordering::Relaxed)
    }

    /// What the tune cache file held when this `Gpu` opened.
    pub fn tune_file_status(&self) -> &TuneFileStatus {
        &self.tune_status
    }

    /// Write every tuned choice to [`GpuOptions::tune_cache_file`](crate::GpuOptions::tune_cache_file)
    /// (atomically: a crash mid-write leaves the old file). Does nothing when no file was asked
    /// for.
    pub fn save_tune_cache(&self) -> Result<(), ExecError> {
        let Some(path) = self.options.tune_cache_file.as_ref() else {
            return Ok(());
        };
        crate::gpu::write_atomically(path, self.tune.text(&self.tune_header()).as_bytes())
    }

    /// The line that ties a tune cache file to this adapter and driver.
    pub(crate) fn tune_header(&self) -> String {
        let info = self.adapter_info();
        let line = format!(
            "{} | {} | {} | {:?} | {:04x}:{:04x}",
            info.name, info.driver, info.driver_info, info.backend, info.vendor, info.device
        );
        line.replace(['\n', '\r'], " ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_lines_are_ignored_and_other_devices_files_whole() {
        let cache = TuneCache::default();
        cache.lock().insert("gemm a".into(), "128x128".into());
        cache.lock().insert("gemm b".into(), "64x64".into());
        let text = cache.text("dev 1");
        let (choices, ignored) = TuneCache::parse(&text, "dev 1").unwrap();
        assert_eq!((choices.len(), ignored), (2, 0));
        // One value altered: that line alone is dropped.
        let damaged = text.replacen("128x128", "128x129", 1);
        let (choices, ignored) = TuneCache::parse(&damaged, "dev 1").unwrap();
        assert_eq!((choices.len(), ignored), (1, 1));
        assert_eq!(choices["gemm b"], "64x64");
        // A truncated last line, and stray text.
        let cut = &text[..text.len() - 5];
        assert_eq!(TuneCache::parse(cut, "dev 1").unwrap().1, 1);
        assert_eq!(
            TuneCache::parse(&format!("{text}junk\n"), "dev 1")
                .unwrap()
                .1,
            1
        );
        assert!(TuneCache::parse(&text, "dev 2").is_err());
        assert!(TuneCache::parse("something else", "dev 1").is_err());
    }
}
