//! `train.profile_steps`: rank 0 records optimizer steps FIRST..=LAST with
//! PyTorch's profiler (`profile.rs`) and logs the top kernels.

use anyhow::Result;
use std::path::PathBuf;
use tch::Device;

pub(crate) struct ProfileWindow {
    /// [first, last] optimizer steps, counted from 1; None on ranks that do not record.
    steps: Option<[usize; 2]>,
    dir: PathBuf,
    cuda: bool,
    /// The first step of the recording under way.
    recording_since: Option<usize>,
}

impl ProfileWindow {
    pub fn new(steps: Option<[usize; 2]>, dir: PathBuf, device: Device, rank: usize) -> ProfileWindow {
        ProfileWindow { steps: steps.filter(|_| rank == 0), dir, cuda: device.is_cuda(), recording_since: None }
    }

    /// Starts recording if `step` is the window's first.
    pub fn before_step(&mut self, step: usize) -> Result<()> {
        if self.steps.is_some_and(|[first, _]| first == step) {
            crate::profile::start(self.cuda)?;
            self.recording_since = Some(step);
        }
        Ok(())
    }

    /// Stops recording if `step` (just done) is the window's last.
    pub fn after_step(&mut self, step: usize) -> Result<()> {
        if self.steps.is_some_and(|[_, last]| last == step) {
            self.stop(step)?;
        }
        Ok(())
    }

    /// Ends a recording under way with `last` as its last step (an epoch
    /// may end inside the window: evaluation is not profiled).
    pub fn stop(&mut self, last: usize) -> Result<()> {
        if let Some(first) = self.recording_since.take() {
            let report = crate::profile::stop(&self.dir, &format!("steps-{first}-{last}"), self.cuda, last + 1 - first)?;
            tracing::info!("profile of steps {first}-{last}: {}", report.top(15));
        }
        Ok(())
    }
}
