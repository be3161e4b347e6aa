//! The optimizer step: the global gradient norm (one reduction over the
//! shard group), clipping and fp16's loss scale folded into AdamW's kernel
//! (ft's on a GPU, ATen's fused one elsewhere, ft's CPU AdamW for offloaded
//! state), then the compute copies refreshed for the next forward.

use super::{Kernels, Trainer};
use crate::distributed::comm::Reduction;
use crate::distributed::flat::FlatUnit;
use anyhow::{bail, Result};
use ft_sys::AdamW;
use tch::{Kind, Tensor};

/// fp16's dynamic loss scale, on the device (no host synchronisation).
pub(super) struct LossScaler {
    pub(super) scale: Tensor,
    growth_tracker: Tensor,
}

impl LossScaler {
    pub(super) fn new(initial_scale: f64, device: tch::Device) -> LossScaler {
        LossScaler {
            scale: Tensor::from_slice(&[initial_scale as f32]).to_device(device),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
        }
    }

    /// [scale, clean steps since the last change] as fp32 on the host.
    pub(super) fn state(&self) -> Tensor {
        Tensor::cat(&[self.scale.to_kind(Kind::Float), self.growth_tracker.to_kind(Kind::Float)], 0).to_device(tch::Device::Cpu)
    }

    pub(super) fn restore(&self, state: &Tensor) {
        let device = self.scale.device();
        let _no_grad = tch::no_grad_guard();
        self.scale.shallow_clone().copy_(&state.narrow(0, 0, 1).to_device(device));
        self.growth_tracker.shallow_clone().copy_(&state.narrow(0, 1, 1).to_kind(Kind::Int).to_device(device));
    }
}

fn refs(list: &[Tensor]) -> Vec<&Tensor> {
    list.iter().collect()
}

impl Trainer<'_> {
    /// The offload that stores and steps this trainer's offloaded state.
    fn offloaded_state(&self) -> Result<&dyn crate::offload::Offload> {
        self.offload.ok_or_else(|| anyhow::anyhow!("a unit's state is in host memory, but the trainer has no offload to step it"))
    }

    /// Clips by the global gradient norm (if configured), takes one AdamW step
    /// at `lr`, refreshes the compute copies and clears the gradients.
    /// Returns the gradient norm before clipping, on the device.
    pub fn step(&mut self, lr: f64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        if self.pending_micro_batches == 0 {
            bail!("step() without a forward_backward() since the last step");
        }
        let device = self.units[0].device();
        let offloaded = self.units.iter().any(FlatUnit::offloaded_to_host);
        let mut host_started = std::time::Instant::now();
        if offloaded {
            // The host pieces were queued behind the reductions on this stream.
            if let tch::Device::Cuda(index) = device {
                ft_sys::cuda_stream_synchronize(index)?;
            }
            self.offload_stats.wait_seconds += host_started.elapsed().as_secs_f64();
            host_started = std::time::Instant::now();
            for unit in self.units.iter_mut().filter(|u| u.offloaded_to_host()) {
                unit.collect_host_grad();
            }
        }
        // Each rank's optimizer covers its owned gradient; when that is a
        // shard, the squares are summed over the shard group (replica
        // groups hold the same shards after their all-reduce).
        // Frozen units have no gradient or optimizer state.
        let trained: Vec<&FlatUnit> = self.units.iter().filter(|u| u.trainable()).collect();
        let owned: Vec<Tensor> = trained.iter().map(|u| u.owned_grad()).collect();
        let squares = owned
            .iter()
            .map(|g| match g.device() {
                tch::Device::Cpu if offloaded => Ok(Tensor::from(self.offloaded_state()?.sum_of_squares(g)? as f32).to_device(device)),
                // One reduction reading the gradient once, in fp32 whatever the
                // gradient's dtype (square().sum() writes an fp32 copy first).
                _ => Ok(g.norm_scalaropt_dtype(2.0, Kind::Float).square()),
            })
            .collect::<Result<Vec<Tensor>>>()?;
        // An expert-parallel rank's experts are its own: summed over its expert group.
        let of_experts = |experts: bool| {
            let parts: Vec<&Tensor> = squares.iter().zip(&trained).filter(|(_, u)| u.placement().expert_rows.is_some() == experts).map(|(s, _)| s).collect();
            if parts.is_empty() { Tensor::zeros([], (Kind::Float, device)) } else { Tensor::stack(&parts, 0).sum(Kind::Float) }
        };
        let sharded = |experts: bool| trained.iter().find(|u| u.placement().expert_rows.is_some() == experts).is_some_and(|u| u.placement().optimizer_sharded);
        let mut sum_of_squares = of_experts(false);
        if let Some(group) = self.parallel.and_then(|p| p.groups(false).shard).filter(|_| sharded(false)) {
            group.all_reduce(&mut sum_of_squares, Reduction::Sum)?.wait()?;
        }
        if let (Some(experts), Some(parallel)) = (self.experts(), self.parallel) {
            let mut of_experts = of_experts(true);
            if let Some(shard) = parallel.groups(true).shard.filter(|_| sharded(true)) {
                shard.all_reduce(&mut of_experts, Reduction::Sum)?.wait()?;
            }
            experts.group.all_reduce(&mut of_experts, Reduction::Sum)?.wait()?;
            sum_of_squares += of_experts;
        }
        let mut total_norm = sum_of_squares.sqrt();
        // fp16: gradients carry the loss scale; an overflow skips the step.
        let found_inf = self.scaler.is_some().then(|| total_norm.isfinite().logical_not().to_kind(Kind::Float).reshape([1]));
        if let Some(scaler) = &self.scaler {
            total_norm = &total_norm / scaler.scale.squeeze();
        }
        // Clipping divides every gradient by max(1, norm / max_norm), inside AdamW's kernel.
        let clip = self.options.max_grad_norm.map(|max_norm| (&total_norm / max_norm).clamp_min(1.0));
        let grad_scale = match (&self.scaler, clip) {
            (Some(scaler), Some(clip)) => Some(scaler.scale.squeeze() * clip),
            (Some(scaler), None) => Some(scaler.scale.squeeze()),
            (None, clip) => clip,
        };
        let _ = self.step.g_add_scalar_(1.0);
        let hyper = AdamW { lr, ..self.options.adamw };
        // ft's kernel writes the bf16 compute copies of whole masters as it steps them
        // (unless a step may be skipped, which leaves the copy to the refresh).
        let copies_written = self.kernels == Kernels::Ft && found_inf.is_none();
        for (decayed, hyper) in [(true, hyper), (false, AdamW { weight_decay: 0.0, ..hyper })] {
            let (mut params, mut grads, mut m, mut v, mut copies) = (vec![], vec![], vec![], vec![], vec![]);
            let mut host = vec![];
            for (unit, grad) in trained.iter().zip(&owned) {
                let (split, len) = (unit.decayed_in_master(), unit.master.size()[0]);
                let (start, count) = if decayed { (0, split) } else { (split, len - split) };
                if count == 0 {
                    continue;
                }
                let part = [&unit.master, grad, &unit.exp_avg, &unit.exp_avg_sq].map(|t| t.narrow(0, start, count));
                if unit.offloaded_to_host() {
                    host.push(part);
                } else {
                    let [p, g, mm, vv] = part;
                    params.push(p);
                    grads.push(g);
                    m.push(mm);
                    v.push(vv);
                    copies.push(unit.compute_copy_of_master().filter(|_| copies_written).map(|c| c.narrow(0, start, count)));
                }
            }
            if !params.is_empty() && self.kernels == Kernels::Ft {
                for ((((p, g), mm), vv), copy) in params.iter().zip(&grads).zip(&m).zip(&v).zip(&copies) {
                    ft_sys::kernels::adamw_(p, g, mm, vv, hyper, &self.step, grad_scale.as_ref(), found_inf.as_ref(), copy.as_ref())?;
                }
            } else if !params.is_empty() {
                let steps: Vec<&Tensor> = params.iter().map(|_| &self.step).collect();
                ft_sys::fused_adamw(&refs(&params), &refs(&grads), &refs(&m), &refs(&v), &steps, hyper, grad_scale.as_ref(), found_inf.as_ref())
                    .map_err(anyhow::Error::msg)?;
            }
            if !host.is_empty() && !found_inf.as_ref().is_some_and(|inf| inf.double_value(&[0]) != 0.0) {
                let scale = grad_scale.as_ref().map_or(1.0, |s| s.double_value(&[]));
                let step = self.step.double_value(&[]);
                self.offloaded_state()?.adamw(&host, hyper, step, scale)?;
            }
        }
        if let (Some(scaler), Some(found_inf)) = (&mut self.scaler, &found_inf) {
            // A skipped step does not count (as torch.optim's fused AdamW does).
            let _ = self.step.g_sub_(&found_inf.squeeze());
            let _ = scaler.scale.internal_amp_update_scale_(&scaler.growth_tracker, found_inf, 2.0, 0.5, 2000);
        }
        if offloaded {
            self.offload_stats.cpu_step_seconds += host_started.elapsed().as_secs_f64();
        }
        let mut gathers = vec![];
        for u in 0..self.units.len() {
            let shard_group = self.groups_of(u).shard;
            let unit = &mut self.units[u];
            unit.release_grad();
            if unit.offloaded_to_host() {
                self.offload_stats.host_to_device_bytes += (unit.master.numel() * 4) as f64;
            }
            let wrote = copies_written && unit.compute_copy_of_master().is_some();
            gathers.extend(unit.refresh_compute(shard_group, wrote)?);
        }
        for work in gathers {
            work.wait()?;
        }
        if let Some(amaxes) = &mut self.float8_amaxes {
            amaxes.shards_changed();
        }
        self.pending_micro_batches = 0;
        self.steps += 1;
        let mut hook = self.hook.borrow_mut();
        let name = hook.name().to_string();
        hook.after_step(self.steps).map_err(|e| e.context(format!("comm `{name}`")))?;
        Ok(total_norm)
    }

}
