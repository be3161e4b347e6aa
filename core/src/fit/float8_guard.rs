//! The float8 numerics guard (`--fp8`): every float8 cast of a step records
//! its tensor's amax (`ft_sys::float8::record_amaxes`); at each logged step
//! the guard reads those of the steps since the last one in one copy to the
//! host, fails the run on the first NaN or infinite one, naming the layer,
//! the tensor and the step, and gives the sinks each unit's largest amax
//! and the smallest scale it made, per tensor role.
//!
//! Failing, not skipping: float8 scales are recomputed from each tensor's
//! amax at every cast, so there is no stale scale to lower and retry with; a
//! NaN or an infinity in a layer's input, weight or output gradient is the
//! run diverging, which bf16 would share, and skipping such steps would hide
//! it. The run stops before the step is saved, so the last checkpoint is the
//! last good one.

use anyhow::Result;
use ft_sys::float8::{self, max_value, Float8, Role};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// The guard's verdict, which every rank reaches at the same step (the
/// ranks sum their findings first): the loop finishes the checkpoint in
/// flight, the last good one, before failing with it.
#[derive(Debug)]
pub struct Diverged(pub String);

impl std::fmt::Display for Diverged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Diverged {}

pub(crate) struct Float8Guard {
    float8: Float8,
    /// Each step since the last check: its number, its casts' (layer, role)
    /// in the order they ran, and their amaxes, stacked on the device.
    pending: Vec<(usize, Vec<(u32, Role)>, Tensor)>,
}

impl Float8Guard {
    pub fn start(float8: Float8) -> Float8Guard {
        float8::record_amaxes();
        Float8Guard { float8, pending: vec![] }
    }

    /// Before optimizer step `step`: what other forwards (evaluation) recorded is not the step's.
    pub fn before_step(&mut self) {
        float8::take_amaxes();
    }

    /// After optimizer step `step`: keeps its amaxes on the device, for the next `check`.
    pub fn after_step(&mut self, step: usize) {
        let amaxes = float8::take_amaxes();
        if amaxes.is_empty() {
            return;
        }
        let casts = amaxes.iter().map(|a| (a.layer, a.role)).collect();
        let values: Vec<Tensor> = amaxes.into_iter().map(|a| a.value.to_kind(Kind::Float)).collect();
        self.pending.push((step, casts, Tensor::stack(&values, 0)));
    }

    /// Reads the amaxes kept since the last check: the first NaN or infinite
    /// one, described, and the last step's statistics by unit.
    pub fn check(&mut self) -> Result<(Option<String>, BTreeMap<String, f64>)> {
        let pending = std::mem::take(&mut self.pending);
        let mut last = vec![];
        for (step, casts, values) in pending {
            let values = Vec::<f32>::try_from(values.to_device(tch::Device::Cpu))?;
            if let Some((&(layer, role), value)) = casts.iter().zip(&values).find(|(_, v)| !v.is_finite()) {
                let (unit, name) = float8::layer_name(layer);
                let problem = format!(
                    "float8 numerics guard: at step {step} the amax of {name}'s {} in {unit} was {value}: a NaN or infinity reached its float8 cast, so the run diverged there. \
                     The run stops before saving this step (its last checkpoint, finished first, is the last good one); lower train.lr (--lr) or train without --fp8 to see whether bf16 diverges too",
                    role.name()
                );
                return Ok((Some(problem), BTreeMap::new()));
            }
            last = casts.into_iter().zip(values).collect();
        }
        Ok((None, self.statistics(&last)))
    }

    /// `fp8/{unit}/amax_{role}` (spaces in the unit's name as `_`): the largest amax among the unit's layers;
    /// `fp8/{unit}/scale_{role}`: the smallest scale it gave (the float8
    /// kind's largest value over that amax).
    fn statistics(&self, casts: &[((u32, Role), f32)]) -> BTreeMap<String, f64> {
        let mut amax: BTreeMap<(String, &str), (f64, Role)> = BTreeMap::new();
        for &((layer, role), value) in casts {
            let unit = float8::layer_name(layer).0.replace(' ', "_");
            let entry = amax.entry((unit, role.name())).or_insert((0.0, role));
            entry.0 = entry.0.max(value as f64);
        }
        let mut values = BTreeMap::new();
        for ((unit, role_name), (largest, role)) in amax {
            values.insert(format!("fp8/{unit}/amax_{role_name}"), largest);
            values.insert(format!("fp8/{unit}/scale_{role_name}"), max_value(self.float8.kind(role)) / largest.max(float8::EPS));
        }
        values
    }
}
