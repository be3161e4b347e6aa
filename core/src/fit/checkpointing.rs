//! Checkpoints as the loop sees them: resume from `train.resume`, and save
//! every `train.save_every` steps with the data cursor that continues the
//! run exactly. The file format and the atomic save are checkpoint.rs.

use crate::checkpoint::{self, Manifest, State, UnitLayout};
use crate::comm::Communicator;
use crate::config::TrainConfig;
use crate::train::Trainer;
use anyhow::Result;
use std::path::Path;

/// Where checkpoints go and what they describe.
#[derive(Clone, Copy)]
pub struct CheckpointPlan<'a> {
    pub output: &'a Path,
    pub model_config: &'a serde_json::Value,
    pub tokenizer: Option<&'a Path>,
}

/// Where the run is: the next global batch to train, and steps taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub epoch: usize,
    pub epoch_step: usize,
    pub step: usize,
}

pub(crate) struct Checkpointer<'a> {
    plan: CheckpointPlan<'a>,
    config: &'a TrainConfig,
    strategy: &'a str,
    world: usize,
}

impl<'a> Checkpointer<'a> {
    pub fn new(plan: CheckpointPlan<'a>, config: &'a TrainConfig, strategy: &'a str, world: usize) -> Checkpointer<'a> {
        Checkpointer { plan, config, strategy, world }
    }

    /// Restores `trainer` from `train.resume` when set; where the run continues.
    pub fn resume(&self, trainer: &mut Trainer, rank: usize) -> Result<Cursor> {
        let Some(spec) = &self.config.resume else { return Ok(Cursor::default()) };
        let dir = checkpoint::resolve(spec, self.plan.output)?;
        let (manifest, state) = checkpoint::read_state(&dir, trainer.model())?;
        trainer.restore(&state.units, &state.adamw_step, manifest.micro_steps)?;
        let cursor = Cursor { epoch: manifest.epoch, epoch_step: manifest.epoch_step, step: manifest.step };
        if rank == 0 {
            tracing::info!("resumed from {} at step {} (epoch {}, batch {})", dir.display(), cursor.step, cursor.epoch + 1, cursor.epoch_step);
        }
        Ok(cursor)
    }

    /// Saves when `next.step` is due (collective: every rank helps gather
    /// the whole state; rank 0 writes it, the others wait).
    pub fn after_step(&mut self, trainer: &Trainer, next: Cursor, comm: &Communicator) -> Result<()> {
        let every = self.config.save_every;
        if every == 0 || next.step % every != 0 {
            return Ok(());
        }
        let manifest = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            ft_version: env!("CARGO_PKG_VERSION").into(),
            step: next.step,
            epoch: next.epoch,
            epoch_step: next.epoch_step,
            micro_steps: trainer.micro_steps(),
            world_size: self.world,
            strategy: self.strategy.into(),
            units: UnitLayout::of(trainer.model()),
            model_config: self.plan.model_config.clone(),
        };
        let units = trainer.whole_state()?;
        if comm.env().rank == 0 {
            let state = State { units: &units, adamw_step: trainer.adamw_step() };
            checkpoint::save(self.plan.output, &state, &manifest, self.plan.tokenizer, self.config.save_total_limit)?;
        }
        drop(units);
        comm.world().barrier()?.wait()?;
        Ok(())
    }
}
