//! `int8`: ZeRO++'s quantized weight gather (qwZ) and, with
//! `comm.int8.grads=true`, its quantized gradient reduction (qgZ), as an ft
//! communication plug-in.
//!
//! - **Gathers** of sharded parameters (full_shard, shard_grad_op,
//!   hybrid_shard): each rank quantizes its shard in blocks of `block_size`
//!   elements to int8, with one fp32 scale per block (its largest magnitude
//!   / 127). It all-gathers the int8 blocks and the scales, and every rank
//!   dequantizes all of them into the compute-dtype buffer the model reads.
//!   That is about half the bytes of a bf16 gather, and a quarter of an
//!   fp32 one.
//! - **Gradients** (`grads`): a reduce-scatter becomes an all-to-all. Each
//!   rank quantizes the chunk of its gradient that every other rank owns,
//!   sends it, dequantizes what it receives, and sums it in fp32.
//!
//! What is lossy, exactly: the parameters forward and backward compute
//! with (each element within half a quantization step, `scale / 2`, of the
//! exact value), and, with `grads`, each rank's contribution to a gradient
//! sum. What is exact: the fp32 master weights and AdamW's state, which
//! never pass through int8, so quantization errors do not accumulate from
//! step to step. The all-reduce stages (ddp, zero1, hybrid's replica stage)
//! are passed to the built-in collectives.
//!
//! Quantization is computed in fp32 whatever the weights' dtype (bf16,
//! fp16 or fp32), so a bf16 weight's exponent range is never squeezed
//! through an fp16 or int path.

use anyhow::{bail, Result};
use ft_core::comm_hook::{option, Builtin, CommHook, CommOption, CommPlan, GradReduce, ParamGather, Pending, ReduceStage, UnitInfo, Wire};
use ft_core::plugin::PluginRegistrar;
use serde_json::{Map, Value};
use tch::{Kind, Tensor};

const NAME: &str = "int8";

const OPTIONS: &[CommOption] = &[
    CommOption { key: "block_size", default: "4096", help: "elements per quantization block (one fp32 scale each)" },
    CommOption { key: "grads", default: "false", help: "also reduce-scatter gradients as int8 blocks by all-to-all (summed in fp32)" },
];

/// `x` (1-D, length a multiple of `block`) as int8 blocks and their fp32
/// scales. Written as few passes over the tensor as ATen allows (in place
/// where it can): this runs on every gathered parameter.
fn quantize(x: &Tensor, block: i64) -> (Tensor, Tensor) {
    let blocks = x.to_kind(Kind::Float).view([-1, block]);
    let (low, high) = blocks.aminmax(Some(1), true);
    // A floor far below any weight, so a block of zeros never divides by zero.
    let scale = low.abs().maximum(&high).clamp_min(1e-30) / 127.0;
    let mut scaled = blocks.divide(&scale);
    let q = scaled.round_().clamp_(-127.0, 127.0).to_kind(Kind::Int8);
    (q.view([-1]), scale.view([-1]))
}

/// The fp32 values of int8 blocks `q` with their `scales`.
fn dequantize(q: &Tensor, scales: &Tensor, block: i64) -> Tensor {
    q.view([-1, block]).to_kind(Kind::Float).multiply(&scales.view([-1, 1])).view([-1])
}

/// `x` padded with zeros to a multiple of `block`.
fn padded(x: &Tensor, block: i64) -> Tensor {
    let len = x.size()[0];
    let extra = (block - len % block) % block;
    if extra == 0 {
        x.shallow_clone()
    } else {
        Tensor::cat(&[x.to_kind(Kind::Float), Tensor::zeros([extra], (Kind::Float, x.device()))], 0)
    }
}

struct Int8 {
    block: i64,
    grads: bool,
}

impl Int8 {
    /// The quantization block for a tensor of `len` elements: `block_size`, or the tensor when it is smaller.
    fn block_for(&self, len: i64) -> i64 {
        self.block.min(len.max(1))
    }
}

impl CommHook for Int8 {
    fn name(&self) -> &str {
        NAME
    }

    /// Weights within half a quantization step keep the loss within about a percent.
    fn tolerance(&self) -> f64 {
        0.01
    }

    fn check(&self, plan: &CommPlan) -> Result<()> {
        let reduces_shards = self.grads && plan.stages.contains(&ReduceStage::Shard);
        if !plan.gathers && !reduces_shards {
            bail!(
                "int8 quantizes the gathers of sharded parameters (and, with comm.int8.grads=true, reduce-scatters), and strategy `{}` has neither: use full_shard, shard_grad_op or hybrid_shard",
                plan.strategy
            );
        }
        Ok(())
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        let ParamGather { group, shard, output, .. } = request;
        let len = shard.size()[0];
        let block = self.block_for(len);
        let (q, scales) = quantize(&padded(&shard, block), block);
        let ranks = group.size() as i64;
        let mut all_q = Tensor::empty([ranks * q.size()[0]], (Kind::Int8, q.device()));
        let mut all_scales = Tensor::empty([ranks * scales.size()[0]], (Kind::Float, q.device()));
        let pending = Pending::of(group.all_gather_into_tensor(&mut all_q, &q)?).and(group.all_gather_into_tensor(&mut all_scales, &scales)?);
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // Each rank's blocks, cut back to its shard's length, in rank order.
            let values = dequantize(&all_q, &all_scales, block).view([ranks, -1]);
            output.view([ranks, len]).copy_(&values.narrow(1, 0, len));
            Ok(())
        }))
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        if !self.grads || request.stage != ReduceStage::Shard {
            return Builtin.reduce(request);
        }
        let GradReduce { group, input, output, .. } = request;
        let ranks = group.size() as i64;
        let chunk = output.size()[0];
        let block = self.block_for(chunk);
        // Chunk j of the gradient is rank j's to sum: quantize each chunk on its own.
        let chunks = input.view([ranks, chunk]);
        let (q, scales): (Vec<Tensor>, Vec<Tensor>) = (0..ranks).map(|j| quantize(&padded(&chunks.get(j), block), block)).unzip();
        let (q, scales) = (Tensor::cat(&q, 0), Tensor::cat(&scales, 0));
        let mut received_q = q.empty_like();
        let mut received_scales = scales.empty_like();
        let pending = Pending::of(group.all_to_all(&mut received_q, &q)?).and(group.all_to_all(&mut received_scales, &scales)?);
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            let sum = dequantize(&received_q, &received_scales, block).view([ranks, -1]).sum_dim_intlist([0].as_slice(), false, Kind::Float);
            output.shallow_clone().copy_(&sum.narrow(0, 0, chunk));
            Ok(())
        }))
    }

    /// One byte an element, padded to whole blocks, and a 4-byte scale a block.
    fn wire_bytes(&self, _unit: &UnitInfo, wire: Wire, elements: f64, element_bytes: f64) -> f64 {
        let quantized = matches!(wire, Wire::Gather) || (self.grads && wire == Wire::Reduce(ReduceStage::Shard));
        if !quantized {
            return elements * element_bytes;
        }
        let block = self.block_for(elements as i64) as f64;
        let blocks = (elements / block).ceil();
        blocks * (block + 4.0)
    }
}

fn read(options: &Map<String, Value>) -> Result<Int8> {
    let block: i64 = option(NAME, options, "block_size", 4096)?;
    if block < 1 {
        bail!("comm.int8.block_size must be at least 1 (got {block})");
    }
    Ok(Int8 { block, grads: option(NAME, options, "grads", false)? })
}

fn register(registrar: &mut PluginRegistrar) {
    registrar.add_comm(
        NAME,
        "ZeRO++ qwZ: sharded parameters gathered as int8 blocks with fp32 scales (about half a bf16 gather's bytes; lossy); grads=true: qgZ reduce-scatter by all-to-all",
        OPTIONS,
        |options| Ok(Box::new(read(options)?)),
    );
}

ft_core::export_plugin!(register);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_weight_dtype_comes_back_within_half_a_step_of_its_block_scale() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            // Magnitudes over several orders, and a block of zeros.
            let x = (Tensor::randn([1000], (Kind::Float, tch::Device::Cpu)) * Tensor::logspace(-3.0, 2.0, 1000, 10.0, (Kind::Float, tch::Device::Cpu))).to_kind(kind);
            let x = Tensor::cat(&[x, Tensor::zeros([24], (kind, tch::Device::Cpu))], 0);
            let block = 64;
            let (q, scales) = quantize(&padded(&x, block), block);
            assert_eq!(q.kind(), Kind::Int8);
            let back = dequantize(&q, &scales, block).narrow(0, 0, 1024);
            let exact = x.to_kind(Kind::Float);
            let step = scales.view([-1, 1]).expand([-1, block], false).reshape([-1]).narrow(0, 0, 1024);
            let excess = ((&back - &exact).abs() - &step * 0.5001).max().double_value(&[]);
            assert!(excess <= 0.0, "{kind:?}: an element is {excess:e} past half its block's step");
            assert!(back.narrow(0, 1000, 24).abs().max().double_value(&[]) == 0.0, "zeros stay zeros");
            assert!(back.isfinite().all().int64_value(&[]) == 1, "{kind:?}: no NaN or inf");
        }
    }

    #[test]
    fn options_are_checked() {
        let mut options = Map::new();
        options.insert("block_size".into(), 0.into());
        assert!(read(&options).err().unwrap().to_string().contains("block_size must be at least 1"));
    }
}
