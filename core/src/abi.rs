//! What crosses between ft and a plug-in, and its version (docs/PLUGINS.md,
//! "The ABI").
//!
//! A plug-in's hooks and strategies are Rust values made by the plug-in's
//! own copy of ft-core. Handing them over as trait objects would tie the
//! plug-in to this ft's exact traits: a vtable's layout is the compiler's
//! business, so adding a method to `CommHook` could move every slot under
//! an older plug-in. Instead each crosses as a table of entry points
//! ([`HookTable`], [`StrategyTable`]) laid out in C order and made on the
//! plug-in's side, whose first field is the table's size as the plug-in
//! built it. ft calls only the entries a table has and takes the trait's
//! default for the rest.
//!
//! So the version has two parts. [`ABI_MAJOR`] must match: it changes when
//! an entry or a type passed through one changes shape. [`ABI_MINOR`] only
//! ever appends entries with defaults: a plug-in built against an older
//! minor loads, and one built against a newer minor than this ft is refused
//! (its newest methods would be ignored).
//!
//! Beside the version, the boundary itself must match: [`BOUNDARY`]
//! fingerprints the passed types' shapes (so a change that forgot the bump
//! is still refused), and [`SHARED_CRATES`] names the versions of the
//! crates those types and their allocations come from (tch, anyhow,
//! serde_json), so a plug-in built with another of them is refused by name.

use crate::distributed::comm::Collective;
use crate::distributed::comm::{ProcessGroup, Work};
use crate::distributed::comm_hook::{
    guarded, Builtin, CollectiveBytes, CommFactory, CommHook, CommOption, CommPlan, GatherPhase, GradReduce, ParamGather, ParamInfo, Pending, ReduceStage, Restored, TokenExchange, UnitInfo,
    Wire, WireRequest, WorldChange,
};
use crate::distributed::strategy::{ShardingPolicy, ShardingStrategy};
use anyhow::Result;
use serde_json::{Map, Value};
use std::mem::{align_of, offset_of, size_of};
use tch::{Kind, Tensor};

/// Changes when anything passed between ft and a plug-in changes shape
/// (3: tables of entry points instead of trait objects; 4: `wire_bytes`
/// names its collectives, the sizes a hook declares get the request's
/// group size and dtype, `load_state` says what it kept, `tolerance` is a
/// curve over steps; 5: a `ProcessGroup` carries its shared-memory
/// transport, which a plug-in's copy of ft-core runs too).
pub const ABI_MAJOR: u32 = 5;
/// Counts the defaulted entries appended since the major changed.
pub const ABI_MINOR: u32 = 0;

/// The crates whose types or allocations cross the boundary, at the
/// versions this ft-core is built with: "tch 0.24.0, anyhow 1.0.104, …".
/// The workspace pins them exactly (`=` in its Cargo.toml, which build.rs
/// reads), so every plug-in built against this ft-core resolves the same.
pub const SHARED_CRATES: &str = env!("FT_SHARED_CRATES");

/// A fingerprint of the size and alignment of every type passed through a
/// table or the registrar: equal majors with different fingerprints mean a
/// boundary type changed without a major bump.
pub const BOUNDARY: u64 = {
    let layouts = [
        (size_of::<GradReduce>(), align_of::<GradReduce>()),
        (size_of::<ParamGather>(), align_of::<ParamGather>()),
        (size_of::<Pending>(), align_of::<Pending>()),
        (size_of::<CommPlan>(), align_of::<CommPlan>()),
        (size_of::<UnitInfo>(), align_of::<UnitInfo>()),
        (size_of::<ParamInfo>(), align_of::<ParamInfo>()),
        (size_of::<Wire>(), align_of::<Wire>()),
        (size_of::<WireRequest>(), align_of::<WireRequest>()),
        (size_of::<CollectiveBytes>(), align_of::<CollectiveBytes>()),
        (size_of::<Collective>(), align_of::<Collective>()),
        (size_of::<Kind>(), align_of::<Kind>()),
        (size_of::<ReduceStage>(), align_of::<ReduceStage>()),
        (size_of::<GatherPhase>(), align_of::<GatherPhase>()),
        (size_of::<WorldChange>(), align_of::<WorldChange>()),
        (size_of::<Restored>(), align_of::<Restored>()),
        (size_of::<CommOption>(), align_of::<CommOption>()),
        (size_of::<ShardingPolicy>(), align_of::<ShardingPolicy>()),
        (size_of::<ProcessGroup>(), align_of::<ProcessGroup>()),
        (size_of::<Work>(), align_of::<Work>()),
        (size_of::<Tensor>(), align_of::<Tensor>()),
        (size_of::<anyhow::Error>(), align_of::<anyhow::Error>()),
        (size_of::<Map<String, Value>>(), align_of::<Map<String, Value>>()),
        (size_of::<CommDeclaration>(), align_of::<CommDeclaration>()),
        (size_of::<StrategyDeclaration>(), align_of::<StrategyDeclaration>()),
        // The tables as this major's first minor has them (later minors append, changing no offset here;
        // what their entries pass, `TokenExchange`, is made of the types above and std's, whose shapes rustc's version fixes).
        (offset_of!(HookTable, all_to_all), 0),
        (offset_of!(StrategyTable, comm_hook), 0),
    ];
    // FNV-1a over the numbers.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < layouts.len() {
        hash = (hash ^ layouts[i].0 as u64).wrapping_mul(0x0100_0000_01b3);
        hash = (hash ^ layouts[i].1 as u64).wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
};

type Hook = Box<dyn CommHook>;
/// A hook's named state tensors (`CommHook::state`).
type State = Vec<(String, Tensor)>;

/// A communication hook as entry points, made where the hook was made.
/// Entries are only ever appended (with a minor bump); the first
/// `size` bytes are what the maker had.
#[repr(C)]
pub struct HookTable {
    size: usize,
    hook: *mut Hook,
    drop: unsafe fn(*mut Hook),
    name: unsafe fn(*const Hook) -> String,
    tolerance: unsafe fn(*const Hook, usize) -> f64,
    check: unsafe fn(*const Hook, &CommPlan) -> Result<()>,
    reduce: unsafe fn(*mut Hook, GradReduce) -> Result<Pending>,
    gather: unsafe fn(*mut Hook, ParamGather) -> Result<Pending>,
    after_step: unsafe fn(*mut Hook, usize) -> Result<()>,
    state: unsafe fn(*const Hook) -> State,
    load_state: unsafe fn(*mut Hook, State) -> Result<Restored>,
    state_bytes: unsafe fn(*const Hook, &UnitInfo, &WireRequest) -> f64,
    wire_bytes: unsafe fn(*const Hook, &UnitInfo, &WireRequest) -> Vec<CollectiveBytes>,
    reshard_state: unsafe fn(*mut Hook, WorldChange, State) -> Result<Restored>,
    workspace_bytes: unsafe fn(*const Hook, &UnitInfo, &WireRequest) -> i64,
    all_to_all: unsafe fn(*mut Hook, TokenExchange) -> Result<Pending>,
}

// SAFETY (every entry below): `hook` is the pointer `HookTable::new` made
// from a Box, alive until `drop`; the table's owner (`TableHook`) calls
// one entry at a time, with `&self`/`&mut self` as the trait would.
impl HookTable {
    /// `hook` as a table, its panics turned into errors: the entries run
    /// in the copy of ft-core that made the table, which is the only one
    /// that can catch a panic of the plug-in's.
    pub fn new(hook: Hook) -> HookTable {
        unsafe fn drop(hook: *mut Hook) {
            std::mem::drop(unsafe { Box::from_raw(hook) })
        }
        unsafe fn name(hook: *const Hook) -> String {
            unsafe { &*hook }.name().to_string()
        }
        unsafe fn tolerance(hook: *const Hook, step: usize) -> f64 {
            unsafe { &*hook }.tolerance(step)
        }
        unsafe fn check(hook: *const Hook, plan: &CommPlan) -> Result<()> {
            guarded("check", || unsafe { &*hook }.check(plan))
        }
        unsafe fn reduce(hook: *mut Hook, request: GradReduce) -> Result<Pending> {
            guarded("the reduction", || unsafe { &mut *hook }.reduce(request)).map(Pending::guarded)
        }
        unsafe fn gather(hook: *mut Hook, request: ParamGather) -> Result<Pending> {
            guarded("the gather", || unsafe { &mut *hook }.gather(request)).map(Pending::guarded)
        }
        unsafe fn after_step(hook: *mut Hook, step: usize) -> Result<()> {
            guarded("after_step", || unsafe { &mut *hook }.after_step(step))
        }
        unsafe fn state(hook: *const Hook) -> Vec<(String, Tensor)> {
            unsafe { &*hook }.state()
        }
        unsafe fn load_state(hook: *mut Hook, state: Vec<(String, Tensor)>) -> Result<Restored> {
            guarded("load_state", || unsafe { &mut *hook }.load_state(state))
        }
        unsafe fn state_bytes(hook: *const Hook, unit: &UnitInfo, request: &WireRequest) -> f64 {
            unsafe { &*hook }.state_bytes(unit, request)
        }
        unsafe fn wire_bytes(hook: *const Hook, unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
            unsafe { &*hook }.wire_bytes(unit, request)
        }
        unsafe fn reshard_state(hook: *mut Hook, change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Restored> {
            guarded("reshard_state", || unsafe { &mut *hook }.reshard_state(change, state))
        }
        unsafe fn workspace_bytes(hook: *const Hook, unit: &UnitInfo, request: &WireRequest) -> i64 {
            unsafe { &*hook }.workspace_bytes(unit, request)
        }
        unsafe fn all_to_all(hook: *mut Hook, request: TokenExchange) -> Result<Pending> {
            guarded("the all-to-all", || unsafe { &mut *hook }.all_to_all(request)).map(Pending::guarded)
        }
        HookTable {
            size: size_of::<HookTable>(),
            hook: Box::into_raw(Box::new(hook)),
            drop,
            name,
            tolerance,
            check,
            reduce,
            gather,
            after_step,
            state,
            load_state,
            state_bytes,
            wire_bytes,
            reshard_state,
            workspace_bytes,
            all_to_all,
        }
    }

    /// Whether the maker's table reaches the entry at `offset`.
    fn has(&self, offset: usize) -> bool {
        offset < self.size
    }
}

/// A hook behind its table: what ft calls. Entries the table lacks (a
/// plug-in built against an older minor) are the trait's defaults.
pub struct TableHook {
    table: HookTable,
    name: String,
}

impl TableHook {
    /// The loader admits only plug-ins of this major, whose tables hold `name`.
    pub fn new(table: HookTable) -> TableHook {
        // SAFETY: a table of this major has `name`.
        let name = unsafe { (table.name)(table.hook) };
        TableHook { table, name }
    }
}

impl Drop for HookTable {
    fn drop(&mut self) {
        // SAFETY: the table's hook, dropped once, with the table.
        unsafe { (self.drop)(self.hook) }
    }
}

/// Calls the table's `$entry` with `$args` where the maker's table has it,
/// else `Builtin`'s (the trait's default): a plug-in built against an older
/// minor lacks the entries appended since.
macro_rules! call {
    ($hook:expr, $entry:ident($($arg:expr),*)) => {
        if $hook.table.has(offset_of!(HookTable, $entry)) {
            // SAFETY: the table has the entry; see `HookTable::new` for the pointer.
            unsafe { ($hook.table.$entry)($hook.table.hook, $($arg),*) }
        } else {
            Builtin.$entry($($arg),*)
        }
    };
}

impl CommHook for TableHook {
    fn name(&self) -> &str {
        &self.name
    }

    fn tolerance(&self, step: usize) -> f64 {
        call!(self, tolerance(step))
    }

    fn check(&self, plan: &CommPlan) -> Result<()> {
        call!(self, check(plan))
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        call!(self, reduce(request))
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        call!(self, gather(request))
    }

    fn after_step(&mut self, step: usize) -> Result<()> {
        call!(self, after_step(step))
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        call!(self, state())
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<Restored> {
        call!(self, load_state(state))
    }

    fn state_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> f64 {
        call!(self, state_bytes(unit, request))
    }

    fn wire_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        call!(self, wire_bytes(unit, request))
    }

    fn reshard_state(&mut self, change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Restored> {
        call!(self, reshard_state(change, state))
    }

    fn workspace_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> i64 {
        call!(self, workspace_bytes(unit, request))
    }

    fn all_to_all(&mut self, request: TokenExchange) -> Result<Pending> {
        call!(self, all_to_all(request))
    }
}

type Strategy = Box<dyn ShardingStrategy>;

/// A sharding strategy as entry points, made where the strategy was made.
#[repr(C)]
pub struct StrategyTable {
    size: usize,
    strategy: *mut Strategy,
    drop: unsafe fn(*mut Strategy),
    name: unsafe fn(*const Strategy) -> String,
    policy: unsafe fn(*const Strategy) -> ShardingPolicy,
    comm_hook: unsafe fn(*const Strategy) -> Option<HookTable>,
}

// SAFETY: as `HookTable`'s, for `strategy`.
impl StrategyTable {
    pub fn new(strategy: Strategy) -> StrategyTable {
        unsafe fn drop(strategy: *mut Strategy) {
            std::mem::drop(unsafe { Box::from_raw(strategy) })
        }
        unsafe fn name(strategy: *const Strategy) -> String {
            unsafe { &*strategy }.name().to_string()
        }
        unsafe fn policy(strategy: *const Strategy) -> ShardingPolicy {
            unsafe { &*strategy }.policy()
        }
        unsafe fn comm_hook(strategy: *const Strategy) -> Option<HookTable> {
            unsafe { &*strategy }.comm_hook().map(HookTable::new)
        }
        StrategyTable { size: size_of::<StrategyTable>(), strategy: Box::into_raw(Box::new(strategy)), drop, name, policy, comm_hook }
    }
}

/// A strategy behind its table: what ft calls.
pub struct TableStrategy {
    table: StrategyTable,
    name: String,
}

// SAFETY: the table's strategy is a `ShardingStrategy`, which is Send + Sync.
unsafe impl Send for TableStrategy {}
unsafe impl Sync for TableStrategy {}

impl TableStrategy {
    /// As `TableHook::new`: every table of this major has every entry so far.
    pub fn new(table: StrategyTable) -> TableStrategy {
        // SAFETY: a table of this major has `name`.
        let name = unsafe { (table.name)(table.strategy) };
        TableStrategy { table, name }
    }
}

impl Drop for StrategyTable {
    fn drop(&mut self) {
        // SAFETY: the table's strategy, dropped once, with the table.
        unsafe { (self.drop)(self.strategy) }
    }
}

// SAFETY: every entry is of this major, in every table of this major.
impl ShardingStrategy for TableStrategy {
    fn name(&self) -> &str {
        &self.name
    }

    fn policy(&self) -> ShardingPolicy {
        unsafe { (self.table.policy)(self.table.strategy) }
    }

    fn comm_hook(&self) -> Option<Hook> {
        let table = unsafe { (self.table.comm_hook)(self.table.strategy) }?;
        Some(Box::new(TableHook::new(table)))
    }
}

/// Makes a hook's table from checked options (`comm.NAME.*`).
pub type TableFactory = Box<dyn Fn(&Map<String, Value>) -> Result<HookTable> + Send + Sync>;

/// `create` as a table factory, made where it is called from (the binary,
/// or a plug-in's own copy of ft-core) so that its panics and those of the
/// hooks it makes come back as errors.
pub fn table_factory(create: CommFactory) -> TableFactory {
    Box::new(move |options| guarded("creating the hook", || create(options)).map(HookTable::new))
}

/// A communication plug-in as a plug-in hands it to ft's registrar.
pub struct CommDeclaration {
    pub name: String,
    pub summary: String,
    pub options: Vec<CommOption>,
    pub create: TableFactory,
}

/// A strategy as a plug-in hands it to ft's registrar.
pub struct StrategyDeclaration {
    pub name: String,
    pub aliases: Vec<String>,
    pub summary: String,
    pub create: Box<dyn Fn() -> StrategyTable + Send + Sync>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::comm_hook::{Builtin, CommHook};

    /// Overrides entries on both sides of where the test cuts the table.
    struct Marked;

    impl CommHook for Marked {
        fn name(&self) -> &str {
            "marked"
        }
        fn tolerance(&self, step: usize) -> f64 {
            0.25 * step as f64
        }
        fn workspace_bytes(&self, _unit: &UnitInfo, request: &WireRequest) -> i64 {
            request.elements * 3
        }
        fn reshard_state(&mut self, _change: WorldChange, _state: Vec<(String, Tensor)>) -> Result<Restored> {
            Ok(Restored::Kept("everything".into()))
        }
    }

    fn change() -> WorldChange {
        WorldChange { saved_world: 2, world: 3, rank: 0, saved_rank: 0 }
    }

    fn unit() -> UnitInfo {
        UnitInfo { id: "u0".into(), name: "block 0".into(), params: vec![], numel: 10, padded: 10 }
    }

    fn gather() -> WireRequest {
        WireRequest { wire: Wire::Gather, elements: 7, dtype: Kind::Float, group_size: 2 }
    }

    #[test]
    fn a_table_reaches_every_entry_the_hook_overrides() {
        let mut hook = TableHook::new(HookTable::new(Box::new(Marked)));
        assert_eq!((hook.name(), hook.tolerance(2)), ("marked", 0.5));
        assert_eq!(hook.workspace_bytes(&unit(), &gather()), 21);
        assert!(matches!(hook.reshard_state(change(), vec![]).unwrap(), Restored::Kept(_)));
    }

    #[test]
    fn entries_an_older_minor_lacks_are_the_defaults_and_the_rest_still_work() {
        // A table as a plug-in of an older minor would make it, had the
        // last two entries been appended since: everything up to `reshard_state`.
        let mut table = HookTable::new(Box::new(Marked));
        table.size = offset_of!(HookTable, reshard_state);
        let mut hook = TableHook::new(table);
        assert_eq!((hook.name(), hook.tolerance(2)), ("marked", 0.5), "the older entries are called");
        assert_eq!(hook.workspace_bytes(&unit(), &gather()), Builtin.workspace_bytes(&unit(), &gather()));
        assert!(matches!(hook.reshard_state(change(), vec![]).unwrap(), Restored::Afresh));
    }
}
