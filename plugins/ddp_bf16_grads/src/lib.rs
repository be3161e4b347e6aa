//! An ft strategy plug-in, loaded at run time with `ft --plugin`:
//! `ddp_bf16_grads` is ddp whose gradients are all-reduced in the compute
//! dtype — under `--dtype bf16`, half the bytes of ddp's fp32 reduction, at
//! the cost of rounding each summed gradient to bf16 (fp32 runs are exact).
//! The README next to this file is the guide to writing one.

use ft_core::plugin::PluginRegistrar;
use ft_core::strategy::{FixedPolicy, ReduceDtype, ShardingPolicy};

const NAME: &str = "ddp_bf16_grads";

const POLICY: ShardingPolicy = ShardingPolicy { reduce_dtype: Some(ReduceDtype::Compute), ..ShardingPolicy::replicated(false) };

fn register(registrar: &mut PluginRegistrar) {
    registrar.add_strategy(
        NAME,
        &[],
        "ddp with gradients all-reduced in the compute dtype (bf16: half the bytes)",
        || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    );
}

ft_core::export_plugin!(register);
