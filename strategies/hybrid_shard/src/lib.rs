//! `hybrid_shard` (FSDP's HYBRID_SHARD): full_shard inside a shard group —
//! by default the ranks of one node, so parameter gathers stay on NVLink —
//! and replicas across shard groups: each gradient shard, once reduce-
//! scattered inside the group, is all-reduced with the same shard of the
//! other groups. `--shard-group-size` sets the group.

use ft_core::distributed::strategy::{FixedPolicy, ShardGroup, ShardingPolicy, StrategyRegistration};

const NAME: &str = "hybrid_shard";

const POLICY: ShardingPolicy = ShardingPolicy::sharded(true, ShardGroup::Node);

inventory::submit! {
    StrategyRegistration {
        name: NAME,
        aliases: &[],
        summary: "full_shard inside each node (or --shard-group-size ranks), gradient shards all-reduced across nodes",
        create: || Box::new(FixedPolicy { name: NAME, policy: POLICY }),
    }
}
