//! The learning rate of each optimizer step: linear warmup from 0, then constant, linear decay
//! to 0 or a cosine to 0 — Hugging Face's `get_{constant,linear,cosine}_schedule_with_warmup`,
//! step for step (their step `k` is the `k`-th optimizer step, counted from 0).

use crate::model::config::ModelError;

/// The shape of the learning rate after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    Constant,
    Linear,
    Cosine,
}

impl Decay {
    /// `constant`, `linear` or `cosine`.
    pub fn parse(name: &str) -> Result<Decay, ModelError> {
        match name {
            "constant" => Ok(Decay::Constant),
            "linear" => Ok(Decay::Linear),
            "cosine" => Ok(Decay::Cosine),
            _ => Err(ModelError::invalid(
                "schedule",
                "decay",
                "constant, linear or cosine",
                format!("{name:?}"),
            )),
        }
    }
}

/// The learning rate over a run of `total_steps` optimizer steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    /// The peak learning rate, reached at the end of warmup.
    pub lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub decay: Decay,
}

impl Schedule {
    /// The learning rate of optimizer step `k` (0-based). Like Hugging Face's, the first
    /// step of a warmup runs at 0.
    pub fn lr_at(&self, k: usize) -> f64 {
        if k < self.warmup_steps {
            return self.lr * k as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = (k - self.warmup_steps) as f64 / span;
        let factor = match self.decay {
            Decay::Constant => 1.0,
            Decay::Linear => (1.0 - progress).max(0.0),
            Decay::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
        };
        self.lr * factor
    }

    /// `Ok` when the peak rate is finite and non-negative and there is at least one step.
    pub fn check(&self) -> Result<(), ModelError> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            let given = self.lr.to_string();
            return Err(ModelError::invalid("schedule", "lr", "finite, ≥ 0", given));
        }
        if self.total_steps == 0 {
            return Err(ModelError::invalid("schedule", "steps", "positive", 0));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of Hugging Face's schedules (transformers' `optimization.py` formulas, worked
    /// out by hand) at lr 1, 2 warmup steps of 10.
    #[test]
    fn schedules_match_hugging_face() {
        let at = |decay, k| {
            let s = Schedule {
                lr: 1.0,
                warmup_steps: 2,
                total_steps: 10,
                decay,
            };
            s.lr_at(k)
        };
        assert_eq!(at(Decay::Linear, 0), 0.0);
        assert_eq!(at(Decay::Linear, 1), 0.5);
        assert_eq!(at(Decay::Linear, 2), 1.0);
        assert_eq!(at(Decay::Linear, 6), 0.5);
        assert_eq!(at(Decay::Linear, 10), 0.0);
        assert_eq!(at(Decay::Constant, 9), 1.0);
        assert!(
            (at(Decay::Cosine, 4) - 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos())).abs() < 1e-15
        );
        assert!((at(Decay::Cosine, 6) - 0.5).abs() < 1e-15);
        assert!(at(Decay::Cosine, 10).abs() < 1e-15);
        assert!(
            Decay::parse("exp")
                .unwrap_err()
                .to_string()
                .contains("cosine")
        );
    }
}
