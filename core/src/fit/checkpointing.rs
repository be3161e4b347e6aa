//! Checkpoints as the loop sees them: resume from `train.resume`, save
//! every `train.save_every` steps and at the run's end with the data cursor
//! that continues the run exactly, and keep the best `train.save_best`
//! epochs by the monitored score besides the newest `train.save_total_limit`.
//! The file format and the atomic save are checkpoint.rs.
//!
//! A checkpoint records the `data.range` it trained on. Resuming with the
//! same range continues mid-epoch where it stopped; with another (the next
//! slice of a file) the weights, optimizer state, step count and schedule
//! continue and the new slice starts at its first example.
//!
//! A periodic save blocks training only while it copies the rank's state
//! into host buffers kept for the run (pinned on a GPU); a thread writes the
//! files, and the save is finished — manifest, rename, pruning — at the first
//! step after every rank's file is written, or when the next save or the
//! run's end waits for it. Offloaded state is written in the foreground from
//! where it lives: a snapshot would double the host memory it fills.

use super::monitor::Monitor;
use super::summary::EpochResult;
use crate::checkpoint::{self, BestCheckpoint, Manifest, PendingSave, RankPart, Reader, UnitLayout};
use crate::comm::Communicator;
use crate::config::{DataRange, TrainConfig};
use crate::comm_hook::{Restored, WorldChange};
use crate::registry::CommRecord;
use crate::train::Trainer;
use anyhow::Result;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// Where checkpoints go and what they describe.
#[derive(Clone, Copy)]
pub struct CheckpointPlan<'a> {
    pub output: &'a Path,
    pub model_config: &'a serde_json::Value,
    pub tokenizer: Option<&'a Path>,
    /// The directory the base weights come from (a LoRA checkpoint holds only what trains).
    pub base_model: Option<&'a Path>,
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
    /// The training file's examples this run trains on (`data.range`; None: all).
    data_range: Option<DataRange>,
    strategy: &'a str,
    world: usize,
    /// The communication hook, as checkpoints record it.
    comm: CommRecord,
    monitor: Option<Monitor>,
    /// The best checkpoints so far, best first (the same on every rank).
    best: Vec<BestCheckpoint>,
    /// The step of the last save, so an epoch's end does not save it twice.
    last_saved: Option<usize>,
    /// A save whose files are being written.
    pending: Option<PendingSave>,
    /// Host copies of this rank's part of the state, reused by every save.
    snapshot: Vec<[Tensor; 3]>,
}

impl<'a> Checkpointer<'a> {
    pub fn new(
        plan: CheckpointPlan<'a>,
        config: &'a TrainConfig,
        data_range: Option<DataRange>,
        strategy: &'a str,
        world: usize,
        comm: CommRecord,
        monitor: Option<Monitor>,
    ) -> Result<Checkpointer<'a>> {
        // A resumed run goes on ranking against the checkpoints it kept.
        let best = if config.save_best > 0 && config.resume.is_some() { checkpoint::read_best(plan.output)? } else { vec![] };
        Ok(Checkpointer { plan, config, data_range, strategy, world, comm, monitor, best, last_saved: None, pending: None, snapshot: vec![] })
    }

    /// The best checkpoint kept so far.
    pub fn best(&self) -> Option<&BestCheckpoint> {
        self.best.first()
    }

    /// Restores `trainer` from `train.resume` when set; where the run
    /// continues: the checkpoint's data cursor when it trained the same
    /// `data.range`, else the first example of this run's range.
    pub fn resume(&self, trainer: &mut Trainer, rank: usize) -> Result<Cursor> {
        let Some(spec) = &self.config.resume else { return Ok(Cursor::default()) };
        // `auto` (a requeued job's habit): the latest checkpoint if there is one.
        if spec == "auto" && checkpoint::list(self.plan.output)?.is_empty() {
            return Ok(Cursor::default());
        }
        let spec = if spec == "auto" { "latest" } else { spec.as_str() };
        let dir = checkpoint::resolve(spec, self.plan.output)?;
        let started = std::time::Instant::now();
        let mut reader = Reader::open(&dir, trainer.model())?;
        let (adamw_step, micro_steps, loss_scale) = (reader.adamw_step()?, reader.manifest().micro_steps, reader.loss_scale()?);
        let steps = reader.manifest().step;
        trainer.restore(|unit, start, len| reader.unit_state(unit, start, len), &adamw_step, steps, micro_steps, loss_scale.as_ref())?;
        self.resume_comm_state(&mut reader, trainer, rank)?;
        let manifest = reader.manifest();
        let same_slice = manifest.data_range == self.data_range;
        let cursor = match same_slice {
            true => Cursor { epoch: manifest.epoch, epoch_step: manifest.epoch_step, step: manifest.step },
            false => Cursor { epoch: 0, epoch_step: 0, step: manifest.step },
        };
        if rank == 0 {
            let (gb, seconds) = (reader.read_bytes() as f64 / 1e9, started.elapsed().as_secs_f64());
            tracing::info!(
                "resumed from {} at step {} (epoch {}, batch {}); rank 0 read {gb:.3} GB from {} state file(s) in {seconds:.2} s ({:.2} GB/s)",
                dir.display(),
                manifest.step,
                manifest.epoch + 1,
                manifest.epoch_step,
                manifest.files.len(),
                gb / seconds.max(1e-9)
            );
            if !same_slice {
                let range = |range: Option<DataRange>| range.map_or("the whole file".to_string(), |r| r.to_string());
                tracing::info!(
                    "this run trains another slice than the checkpoint (data.range {} after {}): it starts at the slice's first example, \
                     epoch 1, and continues the weights, optimizer state, step count and learning-rate schedule from step {}",
                    range(self.data_range),
                    range(manifest.data_range),
                    manifest.step
                );
            }
        }
        Ok(cursor)
    }

    /// Gives the communication hook the state this rank saved, when the
    /// checkpoint was written by the same hook with the same (resolved)
    /// options; at another world size the hook decides what of it still
    /// holds (`CommHook::reshard_state`); with another hook or options it
    /// starts afresh. Rank 0 says which, as the hook reported it.
    fn resume_comm_state(&self, reader: &mut Reader, trainer: &mut Trainer, rank: usize) -> Result<()> {
        let (saved, saved_world) = (reader.manifest().comm.clone(), reader.manifest().world_size);
        let Some(saved) = saved else { return Ok(()) };
        if saved != self.comm {
            if rank == 0 && !reader.comm_state(0)?.is_empty() {
                tracing::warn!(
                    "the checkpoint holds the state of comm `{}` (options {}); this run uses comm `{}` with options {}: that state starts afresh",
                    saved.name,
                    saved.options,
                    self.comm.name,
                    self.comm.options
                );
            }
            return Ok(());
        }
        let change = WorldChange { saved_world, world: self.world, rank, saved_rank: rank % saved_world };
        let state = reader.comm_state(change.saved_rank)?;
        if state.is_empty() {
            return Ok(());
        }
        let tensors = state.len();
        let (restored, how) = match saved_world == self.world {
            true => (trainer.restore_comm_state(state)?, format!("the checkpoint holds {tensors} state tensors on rank 0")),
            false => (trainer.reshard_comm_state(change, state)?, format!("its state was saved at {saved_world} ranks, this run has {}", self.world)),
        };
        if rank == 0 {
            match restored {
                Restored::Afresh => tracing::warn!("comm `{}`: {how}: its hook kept none of it, so it starts afresh", saved.name),
                Restored::Kept(what) if saved_world == self.world => tracing::info!("comm `{}`: restored its state: {what}", saved.name),
                Restored::Kept(what) => tracing::info!("comm `{}`: {how}: re-sharded, kept {what}", saved.name),
            }
        }
        Ok(())
    }

    /// Saves the run's last step (`end`) when checkpoints are on and it is
    /// not saved yet, as Hugging Face's Trainer does, so that the next run
    /// (more epochs, the next slice of the file) resumes where this one
    /// ended; then finishes every save (collective).
    pub fn after_run(&mut self, trainer: &Trainer, end: Cursor, comm: &Communicator) -> Result<()> {
        if self.config.save_every > 0 {
            self.save(trainer, end, comm, true)?;
        }
        self.finish(comm)
    }

    /// Finishes a save every rank has written; saves when `next.step` is due.
    pub fn after_step(&mut self, trainer: &Trainer, next: Cursor, comm: &Communicator) -> Result<()> {
        if let Some(pending) = &self.pending {
            // Every rank decides alike: one small reduction while a save is in flight.
            let unwritten = comm.sum_over_ranks(&[if pending.written() { 0.0 } else { 1.0 }])?[0];
            if unwritten == 0.0 {
                self.finish(comm)?;
            }
        }
        let every = self.config.save_every;
        if every == 0 || next.step % every != 0 {
            return Ok(());
        }
        self.save(trainer, next, comm, false).map(|_| ())
    }

    /// Waits for the save in flight, if any, and finishes it (collective).
    pub fn finish(&mut self, comm: &Communicator) -> Result<()> {
        if let Some(pending) = self.pending.take() {
            pending.finish(self.plan.tokenizer, comm)?;
            self.prune(comm)?;
        }
        Ok(())
    }

    /// Keeps the epoch's checkpoint when its monitored score is among the
    /// best `train.save_best` (every rank decides the same: the scores are).
    pub fn after_epoch(&mut self, trainer: &Trainer, next: Cursor, epoch: &EpochResult, comm: &Communicator) -> Result<()> {
        let (Some(monitor), keep) = (self.monitor.clone(), self.config.save_best) else { return Ok(()) };
        if keep == 0 {
            return Ok(());
        }
        let score = monitor.value(epoch)?;
        let qualifies = self.best.len() < keep || self.best.last().is_some_and(|worst| monitor.improves(score, worst.score, 0.0));
        if !qualifies {
            return Ok(());
        }
        let dir = self.save(trainer, next, comm, true)?;
        let entry = BestCheckpoint { step: next.step, epoch: epoch.epoch, monitor: monitor.name.clone(), score, dir };
        self.best.retain(|b| b.step != entry.step);
        let position = self.best.iter().position(|b| monitor.improves(score, b.score, 0.0)).unwrap_or(self.best.len());
        self.best.insert(position, entry);
        self.best.truncate(keep);
        if comm.env().rank == 0 {
            checkpoint::write_best(self.plan.output, &self.best)?;
            tracing::info!("epoch {}: {} {score:.4} is among the best {keep}; kept {}", epoch.epoch, monitor.name, self.best[position.min(keep - 1)].dir.display());
        }
        self.prune(comm)
    }

    /// Deletes checkpoints neither among the newest `save_total_limit` nor the best (rank 0).
    fn prune(&self, comm: &Communicator) -> Result<()> {
        if comm.env().rank == 0 {
            let best: Vec<usize> = self.best.iter().map(|b| b.step).collect();
            checkpoint::prune(self.plan.output, self.config.save_total_limit, &best)?;
        }
        Ok(())
    }

    /// Saves checkpoint `next.step` unless it exists (collective: every
    /// rank writes the state it owns; rank 0 the manifest), after the save
    /// in flight; in the background unless `wait` or offloaded.
    fn save(&mut self, trainer: &Trainer, next: Cursor, comm: &Communicator, wait: bool) -> Result<std::path::PathBuf> {
        let dir = checkpoint::checkpoints_dir(self.plan.output).join(checkpoint::name_of(next.step));
        self.finish(comm)?;
        if self.last_saved == Some(next.step) {
            return Ok(dir);
        }
        let blocked = std::time::Instant::now();
        let manifest = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            ft_version: env!("CARGO_PKG_VERSION").into(),
            step: next.step,
            epoch: next.epoch,
            epoch_step: next.epoch_step,
            micro_steps: trainer.micro_steps(),
            data_range: self.data_range,
            world_size: self.world,
            strategy: self.strategy.into(),
            shard_group_size: trainer.shard_group_size(),
            files: vec![],
            units: UnitLayout::of(trainer.model()),
            model_config: self.plan.model_config.clone(),
            lora: self.config.lora.enabled().then(|| self.config.lora.clone()),
            base_model: self.plan.base_model.map(Path::to_path_buf),
            comm: Some(self.comm.clone()),
        };
        let background = !wait && !trainer.offloaded();
        let views = trainer.checkpoint_part();
        let units = if background { self.snapshot(views)? } else { views };
        let adamw_step = trainer.adamw_step().to_device(Device::Cpu);
        // Owned host copies: the writer thread reads them while training goes
        // on (converting a host fp32 tensor would hand it the live one).
        let owned = |t: Tensor| match (t.device(), t.kind()) {
            (Device::Cpu, Kind::Float) => t.copy(),
            _ => t.to_kind(Kind::Float).to_device(Device::Cpu),
        };
        let comm_state = trainer.comm_hook().state().into_iter().map(|(name, t)| (name, owned(t))).collect();
        let part = RankPart { units, adamw_step, loss_scale: trainer.loss_scaler_state(), comm_state };
        let mut pending = checkpoint::start_save(self.plan.output, part, manifest, comm)?;
        self.last_saved = Some(next.step);
        if background {
            pending.blocked_seconds = Some(blocked.elapsed().as_secs_f64());
        }
        self.pending = Some(pending);
        if !background {
            self.finish(comm)?;
        }
        Ok(dir)
    }

    /// Copies `views` of the rank's state into the host buffers kept for
    /// every save (allocated by the first, pinned on a GPU so the copies
    /// run at full speed), and returns them.
    fn snapshot(&mut self, views: Vec<(i64, [Tensor; 3])>) -> Result<Vec<(i64, [Tensor; 3])>> {
        let device = views.iter().map(|(_, v)| v[0].device()).find(|d| d.is_cuda()).unwrap_or(Device::Cpu);
        if self.snapshot.is_empty() {
            let buffer = |view: &Tensor| {
                let host = Tensor::zeros(view.size(), (Kind::Float, Device::Cpu));
                if device.is_cuda() { ft_sys::pin_memory_exact(&host) } else { Ok(host) }
            };
            self.snapshot = views.iter().map(|(_, v)| Ok([buffer(&v[0])?, buffer(&v[1])?, buffer(&v[2])?])).collect::<Result<_>>()?;
        }
        for ((_, view), buffers) in views.iter().zip(&self.snapshot) {
            for (from, to) in view.iter().zip(buffers) {
                ft_sys::copy_async(to, from)?;
            }
        }
        if let Device::Cuda(index) = device {
            ft_sys::cuda_stream_synchronize(index)?;
        }
        Ok(views.iter().zip(&self.snapshot).map(|((start, _), buffers)| (*start, buffers.each_ref().map(Tensor::shallow_clone))).collect())
    }
}
