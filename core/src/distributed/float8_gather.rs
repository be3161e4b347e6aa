//! Float8 parameter gathers (under `--fp8 tensorwise` with a strategy that
//! gathers sharded parameters, unless `train.fp8_gathers=false`), as
//! torchtitan's FSDP2 recipe gathers with torchao: a block whose weight
//! matrices all run in float8 is gathered as float8 bytes, half a bf16
//! gather, and its vectors (norms, biases) in the compute dtype.
//!
//! Each weight is cast with the scale of its whole tensor's amax, so the
//! gathered bytes are the cast a rank holding the whole weight would make,
//! whatever the world size. Those amaxes are [`Float8Amaxes`]: every
//! gathered weight's at once, as torchao's
//! `precompute_float8_dynamic_scale_for_fsdp` computes them — each rank's
//! shard's, then one max all-reduce over the shard group — whenever the
//! shards have changed (an optimizer step, a restore), before the next
//! step's first gather; the trainer refreshes them, and every gather of
//! that step (forward, backward re-gathers, each micro-batch) reads them.
//! One small collective a step, issued while nothing else is in flight: a
//! gather never waits on an amax reduction queued behind reduce-scatters.
//! The bytes are gathered into the unit's own compute-dtype buffer, where
//! its weights' values would be. On a GPU the layer's GEMMs read them
//! there (`ft_sys::float8::note_gathered`; float8 layers read nothing
//! else of the buffer), so a float8 gather needs no memory beside the
//! buffer; elsewhere they are dequantised into the weights' values and the
//! layer casts them back with the gathered amax, which gives the gathered
//! bytes again. Either way the GEMMs see exactly them.
//!
//! Mechanism around the run's hook (the built-in or a plug-in): this takes
//! the gathers of float8 blocks and hands everything else — reductions,
//! other units' gathers, state — to the hook it wraps.

use crate::distributed::comm::{ProcessGroup, Reduction};
use crate::distributed::comm_hook::{
    Collective, CollectiveBytes, CommHook, CommPlan, GradReduce, ParamGather, Pending, Restored, UnitInfo, Wire, WireRequest, WorldChange,
};
use anyhow::Result;
use std::collections::HashMap;
use std::hash::Hasher;
use tch::{Device, Kind, Tensor};

/// A unit gathered in float8: its weight matrices, which come first in its
/// flat buffer (`flat::param_offsets`), and the rest after them.
struct Float8Unit {
    /// (offset, elements) of each weight, in buffer order.
    weights: Vec<(i64, i64)>,
    /// Where its weights' amaxes start in [`Float8Amaxes`]' table.
    first_amax: i64,
    /// Where the vectors start: the weights end.
    rest: i64,
    /// `ft_sys::float8::note_gathered`'s owner.
    owner: u64,
}

pub struct Float8Gathers {
    inner: Box<dyn CommHook>,
    units: HashMap<String, Float8Unit>,
    /// [`Float8Amaxes`]' table, which the trainer refreshes in place.
    amaxes: Tensor,
}

/// The amax of every weight gathered in float8, over its whole tensor:
/// computed for all of them at once, when the shards have changed, before
/// the next gather ([`Float8Amaxes::refresh`]).
pub struct Float8Amaxes {
    /// Each gathered unit (the trainer's index of it) and its weights'
    /// (offset, elements), whose amaxes follow one another in `table`.
    units: Vec<(usize, Vec<(i64, i64)>)>,
    /// fp32, on the device; the gathers read it (`Float8Gathers::amaxes`).
    table: Tensor,
    /// The compute dtype: what the gathers cast from.
    dtype: Kind,
    /// Whether the shards changed since `table` was computed.
    stale: bool,
}

const E4M3: Kind = Kind::Float8e4m3fn;

/// Gathers `units` (the trainer's index of each and what a hook is told of
/// it: units whose matrices all run in float8, the matrices first) in
/// float8 and everything else through `inner`; and the amaxes those
/// gathers cast with, kept on `device`, which the trainer refreshes. The
/// gathers send the shards in `dtype`, the compute dtype.
pub fn float8_gathers(inner: Box<dyn CommHook>, units: &[(usize, &UnitInfo)], dtype: Kind, device: Device) -> (Float8Gathers, Float8Amaxes) {
    let mut first_amax = 0;
    let mut gathered = HashMap::new();
    let mut weights_of = vec![];
    for &(index, unit) in units {
        let weights: Vec<(i64, i64)> = unit.params.iter().filter(|p| p.shape.len() == 2).map(|p| (p.offset, p.numel())).collect();
        let rest = weights_end(unit);
        let mut hasher = fnv::FnvHasher::default();
        hasher.write(unit.id.as_bytes());
        weights_of.push((index, weights.clone()));
        let count = weights.len() as i64;
        gathered.insert(unit.id.clone(), Float8Unit { weights, first_amax, rest, owner: hasher.finish() });
        first_amax += count;
    }
    let table = Tensor::zeros([first_amax], (Kind::Float, device));
    let amaxes = Float8Amaxes { units: weights_of, table: table.shallow_clone(), dtype, stale: true };
    (Float8Gathers { inner, units: gathered, amaxes: table }, amaxes)
}

impl Float8Amaxes {
    /// The shards changed (an optimizer step, a restore): the next
    /// `refresh` computes the amaxes again.
    pub fn shards_changed(&mut self) {
        self.stale = true;
    }

    /// Computes every gathered weight's amax if the shards changed since it
    /// last did: the largest magnitude in this rank's part of each weight
    /// (`shard(unit)`: this rank's shard of the unit's flat buffer as a
    /// gather casts it to the compute dtype, fp32 or already in it), then
    /// their max over `group`, the shard group, in one all-reduce.
    /// Collective: every rank of the group calls it at the same point.
    pub fn refresh(&mut self, shard: impl Fn(usize) -> Tensor, group: &ProcessGroup) -> Result<()> {
        if !self.stale {
            return Ok(());
        }
        let _no_grad = tch::no_grad_guard();
        let device = self.table.device();
        let fused = crate::kernels::Kernels::loaded(device);
        let mut local = vec![];
        for (unit, weights) in &self.units {
            let shard = shard(*unit);
            let (len, start) = (shard.size()[0], group.rank() as i64 * shard.size()[0]);
            for &(offset, numel) in weights {
                local.push(match overlap(start, len, offset, numel) {
                    Some((from, n)) => amax(&shard.narrow(0, from - start, n), fused)?,
                    None => Tensor::zeros([], (Kind::Float, device)),
                });
            }
        }
        // Rounding to the compute dtype keeps order, so the largest magnitude
        // rounded is the largest of the rounded values: those the gathers cast.
        let mut table = self.table.shallow_clone();
        table.copy_(&Tensor::stack(&local, 0).to_kind(self.dtype));
        group.all_reduce(&mut table, Reduction::Max)?.wait()?;
        tracing::debug!("train.fp8_gathers: the amaxes of {} weights of {} blocks, in one all-reduce", local.len(), self.units.len());
        self.stale = false;
        Ok(())
    }
}

/// Where a unit's vectors start: its weight matrices, which come first, end.
fn weights_end(unit: &UnitInfo) -> i64 {
    unit.params.iter().filter(|p| p.shape.len() == 2).map(|p| p.offset + p.numel()).max().unwrap_or(0)
}

/// What a float8 block's gather (`request`) moves: one byte per element
/// and the vectors all-reduced in the compute dtype (its amaxes are
/// reduced once a step for every block, `Float8Amaxes`). `ft plan` plans
/// float8 gathers with it.
pub fn float8_gather_bytes(unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
    vec![
        CollectiveBytes { collective: Collective::AllGather, bytes: request.elements as f64 },
        CollectiveBytes { collective: Collective::AllReduce, bytes: ((unit.padded - weights_end(unit)) * request.dtype.elt_size_in_bytes() as i64) as f64 },
    ]
}

/// max |x| as one fp32: by ft's kernel on a GPU where it loads (`fused`), else by ATen's ops.
fn amax(x: &Tensor, fused: bool) -> Result<Tensor> {
    match fused {
        true => Ok(ft_sys::kernels::amax(x)?),
        false => Ok(x.abs().max().to_kind(Kind::Float)),
    }
}

/// `part` (a 1-D slice of one weight) cast to e4m3 with `scale`, which its
/// whole weight's `amax` gives, into `out` (as many bytes): by ft's kernel
/// on a GPU where a row width divides it (the same bits as ATen's cast),
/// else by ATen's ops.
fn cast_into(part: &Tensor, amax: &Tensor, scale: &Tensor, fused: bool, out: &Tensor) -> Result<()> {
    let n = part.size()[0];
    let out = out.view_dtype(E4M3);
    if let Some(cols) = [4096, 1024, 256, 64, 16, 2].into_iter().find(|cols| fused && n % cols == 0) {
        let max = ft_sys::float8::max_value(E4M3) as f32;
        return Ok(ft_sys::kernels::cast_float8_into(&part.view([n / cols, cols]), amax, E4M3, max, &out.view([n / cols, cols]))?);
    }
    out.shallow_clone().copy_(&ft_sys::float8::cast(part, scale, E4M3));
    Ok(())
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
        let ParamGather { unit, group, shard, output, .. } = request;
        let amaxes = self.amaxes.narrow(0, layout.first_amax, weights.len() as i64);
        let scales = ft_sys::float8::scale_from(&amaxes, E4M3, false);
        let (len, ranks, device) = (shard.size()[0], group.size() as i64, shard.device());
        let start = group.rank() as i64 * len;
        // This rank's shard: its weights' elements as float8 bytes; the rest is sent unread (the vectors go apart).
        let bytes = Tensor::empty([len], (Kind::Uint8, device));
        let fused = crate::kernels::Kernels::loaded(device);
        for (i, &(offset, numel)) in weights.iter().enumerate() {
            if let Some((from, n)) = overlap(start, len, offset, numel) {
                cast_into(&shard.narrow(0, from - start, n), &amaxes.get(i as i64), &scales.get(i as i64), fused, &bytes.narrow(0, from - start, n))?;
            }
        }
        let padded = unit.padded;
        let mut vectors = Tensor::zeros([padded - rest], (shard.kind(), device));
        if let Some((from, n)) = overlap(start, len, rest, padded - rest) {
            vectors.narrow(0, from - rest, n).copy_(&shard.narrow(0, from - start, n));
        }
        // The gathered bytes land at the start of the unit's own buffer, which holds no other float8 bytes: its weights'
        // bytes, [0, rest), end below where its vectors' values start (byte rest × the dtype's width), which are copied
        // in after the gather; float8 layers read these bytes, never the buffer's weights.
        let mut all_bytes = output.view_dtype(Kind::Uint8).narrow(0, 0, ranks * len);
        // Each rank's vectors are zero outside its shard: their sum is the whole.
        let mut pending = Pending::of(group.all_gather_into_tensor(&mut all_bytes, &bytes)?);
        if padded > rest {
            pending = pending.and(group.all_reduce(&mut vectors, Reduction::Sum)?);
        }
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // Dequantising writes over the bytes (on the CPU): it reads a copy of them.
            let values = match fused {
                true => all_bytes.view_dtype(E4M3),
                false => all_bytes.narrow(0, 0, rest).copy().view_dtype(E4M3),
            };
            // A row of 16 bytes a weight: cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) a scale that does not start on 16 bytes.
            let [scales, inverses] = [&scales, &scales.reciprocal()].map(|values| values.unsqueeze(1).repeat([1, 4]));
            for (i, &(offset, numel)) in weights.iter().enumerate() {
                let mut weight = output.narrow(0, offset, numel);
                let bytes = values.narrow(0, offset, numel);
                let (scale, inverse) = (scales.get(i as i64).get(0), inverses.get(i as i64).get(0));
                // On a GPU the layer's GEMMs read the bytes; elsewhere they are dequantised for the layer to cast back
                // (float8 values are exact in bf16: one rounding, of the product by 1/scale).
                let kept = match fused {
                    true => Some(ft_sys::float8::GatheredBytes { data: bytes, scale, inverse }),
                    false => {
                        weight.copy_(&bytes);
                        let _ = weight.g_mul_(&inverse);
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

    fn wire_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        match (request.wire, self.units.contains_key(&unit.id)) {
            (Wire::Gather, true) => float8_gather_bytes(unit, request),
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
