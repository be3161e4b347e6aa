//! Learning-rate schedules, as Hugging Face's Trainer computes them: a linear
//! warm-up from 0, then constant, linear decay to 0, or cosine decay to 0.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    #[default]
    Linear,
    Cosine,
}

/// The learning rate of optimizer step `step` (0-based) of `total`.
pub fn lr_at(schedule: Schedule, peak: f64, step: usize, total: usize, warmup: usize) -> f64 {
    if step < warmup {
        return peak * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match schedule {
        Schedule::Constant => peak,
        Schedule::Linear => peak * (1.0 - progress).max(0.0),
        Schedule::Cosine => peak * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        assert_eq!(lr_at(Schedule::Linear, 1.0, 0, 10, 2), 0.0);
        assert_eq!(lr_at(Schedule::Linear, 1.0, 1, 10, 2), 0.5);
        assert_eq!(lr_at(Schedule::Linear, 1.0, 2, 10, 2), 1.0);
        assert_eq!(lr_at(Schedule::Linear, 1.0, 6, 10, 2), 0.5);
        assert!((lr_at(Schedule::Cosine, 1.0, 6, 10, 2) - 0.5).abs() < 1e-12);
        assert_eq!(lr_at(Schedule::Constant, 1.0, 9, 10, 2), 1.0);
        assert_eq!(lr_at(Schedule::Linear, 1.0, 0, 10, 0), 1.0);
    }
}
