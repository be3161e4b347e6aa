//! `bf16`: gradients travel in bf16 — each reduction's input is cast to
//! bf16 for the wire and the sum cast back into the fp32 result (PyTorch
//! DDP's `bf16_compress_hook`). Half the bytes of an fp32 reduction; the
//! sum is rounded to bf16's 8 significant bits, so it is lossy even in fp32
//! runs. A gradient core already reduces in bf16 (`--reduce-dtype compute`
//! under bf16) goes as it is. Gathers are untouched.
//!
//! The crate also registers the strategy `ddp_bf16_grads`: ddp that brings
//! this hook as its own communication — a strategy that holds behaviour.
//! Loaded with `ft --plugin libbf16.so …`; README.md beside this file.

use anyhow::Result;
use ft_core::comm_hook::{Builtin, CollectiveBytes, CommHook, GradReduce, Pending, ReduceStage, UnitInfo, Wire, WireRequest};
use ft_core::plugin::PluginRegistrar;
use ft_core::strategy::{ShardingPolicy, ShardingStrategy};
use ft_core::Reduction;
use tch::{Kind, Tensor};

const NAME: &str = "bf16";

struct Bf16;

impl CommHook for Bf16 {
    fn name(&self) -> &str {
        NAME
    }

    /// bf16 keeps about 3 significant digits of each summed gradient.
    fn tolerance(&self, _step: usize) -> f64 {
        1e-2
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        if request.input.kind() == Kind::BFloat16 {
            return Builtin.reduce(request);
        }
        let wire = request.input.to_kind(Kind::BFloat16);
        let mut sum = match request.stage {
            ReduceStage::World | ReduceStage::Replica => wire.shallow_clone(),
            ReduceStage::Shard => Tensor::empty(request.output.size(), (Kind::BFloat16, wire.device())),
        };
        let work = match request.stage {
            ReduceStage::World | ReduceStage::Replica => request.group.all_reduce(&mut sum, Reduction::Sum)?,
            ReduceStage::Shard => request.group.reduce_scatter_tensor(&mut sum, &wire, Reduction::Sum)?,
        };
        let mut output = request.output;
        Ok(Pending::of(work).then(move || {
            output.copy_(&sum);
            Ok(())
        }))
    }

    /// The built-in's collective, on at most 2 bytes an element.
    fn wire_bytes(&self, _unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        let builtin = request.builtin();
        match request.wire {
            Wire::Reduce(_) => vec![CollectiveBytes { bytes: request.elements as f64 * request.dtype.elt_size_in_bytes().min(2) as f64, ..builtin }],
            Wire::Gather => vec![builtin],
        }
    }
}

/// ddp, communicating through the bf16 hook.
struct DdpBf16Grads;

impl ShardingStrategy for DdpBf16Grads {
    fn name(&self) -> &str {
        "ddp_bf16_grads"
    }

    fn policy(&self) -> ShardingPolicy {
        ShardingPolicy::replicated(false)
    }

    fn comm_hook(&self) -> Option<Box<dyn CommHook>> {
        Some(Box::new(Bf16))
    }
}

fn register(registrar: &mut PluginRegistrar) {
    registrar.add_comm(NAME, "gradients reduced in bf16 on the wire, summed back into fp32 (half the bytes, lossy)", &[], |_| Ok(Box::new(Bf16)));
    registrar.add_strategy("ddp_bf16_grads", &[], "ddp whose gradients travel in bf16 (its own comm: bf16)", || Box::new(DdpBf16Grads));
}

ft_core::export_plugin!(register);
