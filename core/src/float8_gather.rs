//! Float8 parameter gathers (`train.fp8_gathers=true` under `--fp8
//! tensorwise` with a strategy that gathers sharded parameters), as
//! torchtitan's FSDP2 recipe gathers with torchao: a block whose weight
//! matrices all run in float8 is gathered as float8 bytes, half a bf16
//! gather, and its vectors (norms, biases) in the compute dtype.
//!
//! Each weight is cast with the scale of its whole tensor's amax — the
//! largest of the ranks' shards', one max all-reduce per unit and step (a
//! backward re-gather reuses it) — so the gathered bytes are the cast a
//! rank holding the whole weight would make, whatever the world size. On a
//! GPU the layer's GEMMs read the gathered bytes themselves
//! (`ft_sys::float8::note_gathered`) and the weights' part of the
//! compute-dtype buffer is left unwritten (float8 layers read nothing
//! else); elsewhere the dequantised values land in that buffer and the
//! layer casts them back with the gathered amax, which gives the gathered
//! bytes again. Either way the GEMMs see exactly them.
//!
//! Mechanism around the run's hook (the built-in or a plug-in): this takes
//! the gathers of float8 blocks and hands everything else — reductions,
//! other units' gathers, state — to the hook it wraps.

use crate::comm::{ProcessGroup, Reduction};
use crate::comm_hook::{
    Collective, CollectiveBytes, CommHook, CommPlan, GradReduce, ParamGather, Pending, Restored, UnitInfo, Wire, WireRequest, WorldChange,
};
use anyhow::Result;
use std::collections::HashMap;
use std::hash::Hasher;
use tch::{Kind, Tensor};

/// A unit gathered in float8: its weight matrices, which come first in its
/// flat buffer (`flat::param_offsets`), and the rest after them.
struct Float8Unit {
    /// (offset, elements) of each weight, in buffer order.
    weights: Vec<(i64, i64)>,
    /// Where the vectors start: the weights end.
    rest: i64,
    /// `ft_sys::float8::note_gathered`'s owner.
    owner: u64,
}

pub struct Float8Gathers {
    inner: Box<dyn CommHook>,
    units: HashMap<String, Float8Unit>,
    /// Each unit's weights' amaxes, and the step they are of.
    amaxes: HashMap<String, (usize, Tensor)>,
}

const E4M3: Kind = Kind::Float8e4m3fn;

impl Float8Gathers {
    /// Gathers `units` (each a unit whose matrices all run in float8; the
    /// matrices come first) in float8 and everything else through `inner`.
    pub fn new(inner: Box<dyn CommHook>, units: &[&UnitInfo]) -> Float8Gathers {
        let units = units
            .iter()
            .map(|unit| {
                let weights: Vec<(i64, i64)> = unit.params.iter().filter(|p| p.shape.len() == 2).map(|p| (p.offset, p.numel())).collect();
                let rest = weights.iter().map(|(offset, numel)| offset + numel).max().unwrap_or(0);
                let mut hasher = fnv::FnvHasher::default();
                hasher.write(unit.id.as_bytes());
                (unit.id.clone(), Float8Unit { weights, rest, owner: hasher.finish() })
            })
            .collect();
        Float8Gathers { inner, units, amaxes: HashMap::new() }
    }
}

/// The weights' amaxes over the whole unit at `step`: each rank's shard's,
/// then their max over the group — or `cache`'s, on a re-gather in the same step.
fn amaxes(cache: &mut HashMap<String, (usize, Tensor)>, unit: &UnitInfo, weights: &[(i64, i64)], group: &ProcessGroup, shard: &Tensor, step: usize) -> Result<Tensor> {
    if let Some((at, amaxes)) = cache.get(&unit.id) {
        if *at == step {
            return Ok(amaxes.shallow_clone());
        }
    }
    let (len, start) = (shard.size()[0], group.rank() as i64 * shard.size()[0]);
    let local: Vec<Tensor> = weights
        .iter()
        .map(|&(offset, numel)| match overlap(start, len, offset, numel) {
            Some((from, n)) => shard.narrow(0, from - start, n).abs().max().to_kind(Kind::Float),
            None => Tensor::zeros([], (Kind::Float, shard.device())),
        })
        .collect();
    let mut amaxes = Tensor::stack(&local, 0);
    group.all_reduce(&mut amaxes, Reduction::Max)?.wait()?;
    cache.insert(unit.id.clone(), (step, amaxes.shallow_clone()));
    Ok(amaxes)
}

/// `part` (a 1-D slice of one weight) cast to e4m3 with `scale`, which its
/// whole weight's `amax` gives: by ft's kernel on a GPU where a row width
/// divides it (the same bits as ATen's cast), else by ATen's ops.
fn cast(part: &Tensor, amax: &Tensor, scale: &Tensor, fused: bool) -> Result<Tensor> {
    let n = part.size()[0];
    if let Some(cols) = [4096, 1024, 256, 64, 16, 2].into_iter().find(|cols| fused && n % cols == 0) {
        let max = ft_sys::float8::max_value(E4M3) as f32;
        let cast = ft_sys::kernels::cast_float8(&part.view([n / cols, cols]), amax, E4M3, max, true, false)?;
        return Ok(cast.data.expect("asked for").view([n]));
    }
    Ok(ft_sys::float8::cast(part, scale, E4M3))
}

/// The part of [offset, offset + numel) inside [start, start + len), as (its start, its length).
fn overlap(start: i64, len: i64, offset: i64, numel: i64) -> Option<(i64, i64)> {
    let (from, to) = (start.max(offset), (start + len).min(offset + numel));
    (from < to).then_some((from, to - from))
}

impl CommHook for Float8Gathers {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn tolerance(&self, step: usize) -> f64 {
        self.inner.tolerance(step)
    }

    fn check(&self, plan: &CommPlan) -> Result<()> {
        self.inner.check(plan)
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        self.inner.reduce(request)
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        let _no_grad = tch::no_grad_guard();
        // Whatever notes pointed into this buffer are of an earlier gather.
        ft_sys::float8::forget_gathered_in(&request.output);
        let Some(layout) = self.units.get(&request.unit.id) else {
            return self.inner.gather(request);
        };
        let (owner, weights, rest) = (layout.owner, layout.weights.clone(), layout.rest);
        ft_sys::float8::forget_gathered_by(owner);
        let ParamGather { unit, group, shard, output, step, .. } = request;
        let amaxes = amaxes(&mut self.amaxes, unit, &weights, group, &shard, step)?;
        let scales = ft_sys::float8::scale_from(&amaxes, E4M3, false);
        let (len, ranks, device) = (shard.size()[0], group.size() as i64, shard.device());
        let start = group.rank() as i64 * len;
        // This rank's shard: its weights' elements as float8 bytes, the rest (vectors, padding) in the compute dtype.
        let bytes = Tensor::zeros([len], (Kind::Uint8, device));
        let fused = crate::kernels::Kernels::loaded(device);
        for (i, &(offset, numel)) in weights.iter().enumerate() {
            if let Some((from, n)) = overlap(start, len, offset, numel) {
                let part = shard.narrow(0, from - start, n);
                let cast = cast(&part, &amaxes.get(i as i64), &scales.get(i as i64), fused)?;
                bytes.narrow(0, from - start, n).copy_(&cast.view_dtype(Kind::Uint8));
            }
        }
        let padded = unit.padded;
        let mut vectors = Tensor::zeros([padded - rest], (shard.kind(), device));
        if let Some((from, n)) = overlap(start, len, rest, padded - rest) {
            vectors.narrow(0, from - rest, n).copy_(&shard.narrow(0, from - start, n));
        }
        let mut all_bytes = Tensor::empty([ranks * len], (Kind::Uint8, device));
        // Each rank's vectors are zero outside its shard: their sum is the whole.
        let mut pending = Pending::of(group.all_gather_into_tensor(&mut all_bytes, &bytes)?);
        if padded > rest {
            pending = pending.and(group.all_reduce(&mut vectors, Reduction::Sum)?);
        }
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            let values = all_bytes.view_dtype(E4M3);
            for (i, &(offset, numel)) in weights.iter().enumerate() {
                let mut weight = output.narrow(0, offset, numel);
                let bytes = values.narrow(0, offset, numel);
                // On a GPU the layer's GEMMs read the bytes; elsewhere they are dequantised for the layer to cast back
                // (float8 values are exact in bf16: one rounding, of the product by 1/scale).
                let kept = match fused {
                    true => Some(&bytes),
                    false => {
                        weight.copy_(&bytes);
                        let _ = weight.g_mul_(&scales.get(i as i64).reciprocal());
                        None
                    }
                };
                ft_sys::float8::note_gathered(owner, &weight, &amaxes.get(i as i64), kept);
            }
            output.narrow(0, rest, padded - rest).copy_(&vectors);
            Ok(())
        }))
    }

    fn after_step(&mut self, step: usize) -> Result<()> {
        self.inner.after_step(step)
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        self.inner.state()
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<Restored> {
        self.inner.load_state(state)
    }

    fn state_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> f64 {
        self.inner.state_bytes(unit, request)
    }

    /// A float8 block's gather: one byte per element, the vectors all-reduced in
    /// the compute dtype, and one fp32 amax per weight.
    fn wire_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        match (request.wire, self.units.get(&unit.id)) {
            (Wire::Gather, Some(layout)) => vec![
                CollectiveBytes { collective: Collective::AllReduce, bytes: 4.0 * layout.weights.len() as f64 },
                CollectiveBytes { collective: Collective::AllGather, bytes: request.elements as f64 },
                CollectiveBytes { collective: Collective::AllReduce, bytes: ((unit.padded - layout.rest) * request.dtype.elt_size_in_bytes() as i64) as f64 },
            ],
            _ => self.inner.wire_bytes(unit, request),
        }
    }

    fn reshard_state(&mut self, change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Restored> {
        self.inner.reshard_state(change, state)
    }

    fn workspace_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> i64 {
        self.inner.workspace_bytes(unit, request)
    }
}
