//! A monitored evaluation score (`train.monitor`, e.g. `eval_f1` or
//! `eval_loss`), what early stopping and keeping the best checkpoints
//! judge epochs by: `train.monitor_mode` says whether higher or lower is
//! better (`auto`: lower for a loss, higher otherwise).

use super::summary::EpochResult;
use crate::config::{MonitorMode, TrainConfig};
use anyhow::{bail, Result};

#[derive(Debug, Clone)]
pub(crate) struct Monitor {
    /// The score's name as the sinks record it (`eval_loss`, `eval_f1`, …).
    pub name: String,
    higher_is_better: bool,
}

impl Monitor {
    /// The configured monitor; None when `train.monitor` is unset.
    pub fn from_config(config: &TrainConfig) -> Option<Monitor> {
        let name = config.monitor.as_deref()?;
        let name = if name.starts_with("eval_") { name.to_string() } else { format!("eval_{name}") };
        let higher_is_better = match config.monitor_mode {
            MonitorMode::Max => true,
            MonitorMode::Min => false,
            MonitorMode::Auto => !name.ends_with("loss"),
        };
        Some(Monitor { name, higher_is_better })
    }

    /// The monitored value of an epoch; an error naming what there is when
    /// the epoch's evaluation has no such score.
    pub fn value(&self, epoch: &EpochResult) -> Result<f64> {
        let found = match self.name.strip_prefix("eval_") {
            Some("loss") => epoch.eval_loss,
            Some(score) => epoch.scores.get(score).copied(),
            None => None,
        };
        match found {
            Some(value) if value.is_finite() => Ok(value),
            Some(value) => bail!("train.monitor `{}` is {value} after epoch {}", self.name, epoch.epoch),
            None => {
                let mut known: Vec<String> = epoch.scores.keys().map(|k| format!("eval_{k}")).collect();
                known.extend(epoch.eval_loss.map(|_| "eval_loss".to_string()));
                bail!("train.monitor `{}` is not among this task's evaluation scores ({})", self.name, known.join(", "))
            }
        }
    }

    /// Whether `candidate` beats `best` by more than `min_delta`.
    pub fn improves(&self, candidate: f64, best: f64, min_delta: f64) -> bool {
        if self.higher_is_better {
            candidate > best + min_delta
        } else {
            candidate < best - min_delta
        }
    }
}

/// Lightning's EarlyStopping: stop when the monitored score has not
/// improved by more than `min_delta` for `patience` evaluations.
pub(crate) struct EarlyStopping {
    monitor: Monitor,
    patience: usize,
    min_delta: f64,
    best: Option<f64>,
    evaluations_without_improvement: usize,
}

impl EarlyStopping {
    /// None when `train.early_stopping_patience` is 0 (off).
    pub fn from_config(config: &TrainConfig, monitor: Option<&Monitor>) -> Result<Option<EarlyStopping>> {
        if config.early_stopping_patience == 0 {
            return Ok(None);
        }
        let Some(monitor) = monitor else {
            bail!("train.early_stopping_patience needs train.monitor (the score to watch, e.g. eval_f1 or eval_loss)");
        };
        Ok(Some(EarlyStopping {
            monitor: monitor.clone(),
            patience: config.early_stopping_patience,
            min_delta: config.early_stopping_min_delta,
            best: None,
            evaluations_without_improvement: 0,
        }))
    }

    /// Whether training should stop after `epoch`.
    pub fn should_stop(&mut self, epoch: &EpochResult) -> Result<bool> {
        let value = self.monitor.value(epoch)?;
        match self.best {
            Some(best) if !self.monitor.improves(value, best, self.min_delta) => self.evaluations_without_improvement += 1,
            _ => {
                self.best = Some(value);
                self.evaluations_without_improvement = 0;
            }
        }
        Ok(self.evaluations_without_improvement >= self.patience)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(epoch: usize, f1: f64) -> EpochResult {
        EpochResult { epoch, train_loss: None, eval_loss: Some(1.0 / f1), scores: [("f1".to_string(), f1)].into() }
    }

    #[test]
    fn patience_counts_evaluations_without_enough_improvement() {
        let config = TrainConfig { monitor: Some("f1".into()), early_stopping_patience: 2, early_stopping_min_delta: 0.5, ..TrainConfig::default() };
        let monitor = Monitor::from_config(&config).unwrap();
        let mut stopping = EarlyStopping::from_config(&config, Some(&monitor)).unwrap().unwrap();
        let decisions: Vec<bool> = [10.0, 12.0, 12.4, 12.3, 20.0].iter().enumerate().map(|(i, f1)| stopping.should_stop(&epoch(i + 1, *f1)).unwrap()).collect();
        assert_eq!(decisions, [false, false, false, true, false]);
        // A loss improves downwards.
        let loss = Monitor::from_config(&TrainConfig { monitor: Some("eval_loss".into()), ..TrainConfig::default() }).unwrap();
        assert!(loss.improves(0.9, 1.0, 0.0) && !loss.improves(1.1, 1.0, 0.0));
        let err = Monitor::from_config(&TrainConfig { monitor: Some("eval_em".into()), ..TrainConfig::default() }).unwrap().value(&epoch(1, 3.0));
        assert!(err.unwrap_err().to_string().contains("not among this task's evaluation scores (eval_f1, eval_loss)"));
        let unmonitored = TrainConfig { early_stopping_patience: 1, ..TrainConfig::default() };
        assert!(EarlyStopping::from_config(&unmonitored, None).err().unwrap().to_string().contains("needs train.monitor"));
    }
}
