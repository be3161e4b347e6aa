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
//! through an fp16 or int path. The quantization itself is ft-core's
//! (`ft_core::quantize`: fused kernels on a GPU); this crate decides what
//! is quantized and how it travels.

use anyhow::{bail, Result};
use ft_core::comm_hook::{option, Builtin, Collective, CollectiveBytes, CommHook, CommOption, CommPlan, GradReduce, ParamGather, Pending, ReduceStage, UnitInfo, Wire, WireRequest};
use ft_core::plugin::PluginRegistrar;
use ft_core::quantize::{quantize, Quantized};
use serde_json::{Map, Value};
use tch::{Kind, Tensor};

const NAME: &str = "int8";

const OPTIONS: &[CommOption] = &[
    CommOption { key: "block_size", default: "4096", help: "elements per quantization block (one fp32 scale each)" },
    CommOption { key: "grads", default: "false", help: "also reduce-scatter gradients as int8 blocks by all-to-all (summed in fp32)" },
];

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
    fn tolerance(&self, _step: usize) -> f64 {
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
        let block = self.block_for(shard.size()[0]);
        let mine = quantize(&shard, 1, block)?;
        let ranks = group.size() as i64;
        let mut all_q = Tensor::empty([ranks * mine.q.size()[0]], (Kind::Int8, shard.device()));
        let mut all_scales = Tensor::empty([ranks * mine.scales.size()[0]], (Kind::Float, shard.device()));
        let pending = Pending::of(group.all_gather_into_tensor(&mut all_q, &mine.q)?).and(group.all_gather_into_tensor(&mut all_scales, &mine.scales)?);
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // Every rank's blocks, each cut back to its shard's length, in rank order.
            let all = Quantized { rows: ranks, ..mine.with(all_q, all_scales) };
            all.dequantize_into(&output)
        }))
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        if !self.grads || request.stage != ReduceStage::Shard {
            return Builtin.reduce(request);
        }
        let GradReduce { group, input, output, .. } = request;
        let ranks = group.size() as i64;
        let block = self.block_for(output.size()[0]);
        // Chunk j of the gradient is rank j's to sum: each chunk a row of its own blocks.
        let mine = quantize(&input, ranks, block)?;
        let mut received_q = mine.q.empty_like();
        let mut received_scales = mine.scales.empty_like();
        let pending = Pending::of(group.all_to_all(&mut received_q, &mine.q)?).and(group.all_to_all(&mut received_scales, &mine.scales)?);
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // Row r is now rank r's share of this rank's chunk: summed in fp32.
            mine.with(received_q, received_scales).sum_rows_into(&output)
        }))
    }

    /// Two collectives where it quantizes (all-gathers for a gather,
    /// all-to-alls for a gradient's reduce-scatter): one byte an element,
    /// padded to whole blocks per row (one row, or each rank's chunk), and
    /// a 4-byte scale a block.
    fn wire_bytes(&self, _unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        let (rows, collective) = match request.wire {
            Wire::Gather => (1, Collective::AllGather),
            Wire::Reduce(ReduceStage::Shard) if self.grads => (request.group_size as i64, Collective::AllToAll),
            _ => return vec![request.builtin()],
        };
        let row = request.elements / rows;
        let block = self.block_for(row);
        let blocks = rows * ((row + block - 1) / block);
        vec![CollectiveBytes { collective, bytes: (blocks * block) as f64 }, CollectiveBytes { collective, bytes: (blocks * 4) as f64 }]
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
    fn options_are_checked() {
        let mut options = Map::new();
        options.insert("block_size".into(), 0.into());
        assert!(read(&options).err().unwrap().to_string().contains("block_size must be at least 1"));
    }
}
