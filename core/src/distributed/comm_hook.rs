//! The communication seam (docs/PLUGINS.md is its contract). Core decides
//! *what* is communicated and *when* — which unit, which stage of its
//! gradient's reduction over which group, which buffer the result lands in,
//! how reductions overlap backward — from the strategy's policy; a
//! [`CommHook`] decides *how*. [`Builtin`] issues the plain collectives
//! (all-reduce, reduce-scatter, all-gather in the dtype core chose), and
//! every method of the trait defaults to it, so a plug-in overrides only
//! what it changes: compress a gradient for the wire (`bf16`, `powersgd`),
//! quantize a parameter gather (`int8`), keep per-unit state of its own.
//!
//! Rules core relies on (and `ft plugin check` tests): every rank issues
//! the same collectives, in the same order, with the same sizes — so a
//! hook's decisions may depend only on its options, the request (unit,
//! stage, step, shapes) and `seed`, never on a rank's data; a hook that
//! takes a request owns it entirely (core issues nothing beside it); the
//! result is the *sum* over the group, in the output's dtype.

pub use crate::distributed::comm::Collective;
use crate::distributed::comm::{ProcessGroup, Reduction, Work};
use crate::model::UnitSpec;
use anyhow::{bail, Result};
use serde_json::{Map, Value};
use std::cell::Cell;
use std::hash::Hasher;
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

/// One parameter of a unit and where it sits in the unit's flat buffer.
#[derive(Debug, Clone)]
pub struct ParamInfo {
    /// Its name in the model's Hugging Face files.
    pub name: String,
    pub shape: Vec<i64>,
    /// Where it starts in the flat buffer.
    pub offset: i64,
}

impl ParamInfo {
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// What a hook knows of the unit a request is for.
#[derive(Debug, Clone)]
pub struct UnitInfo {
    /// Stable across runs, world sizes and strategies: derived from the
    /// parameters' names and shapes (never the unit's position), so state
    /// keyed by it survives a resume. Letters, digits and `-` only.
    pub id: String,
    /// The model's name for it (`block 3`), for messages.
    pub name: String,
    /// In flat-buffer order (matrices first, then vectors).
    pub params: Vec<ParamInfo>,
    /// Elements of the parameters; the flat buffer has `padded` (a multiple of the shard group).
    pub numel: i64,
    pub padded: i64,
}

impl UnitInfo {
    /// The unit of `spec`, whose parameters start at `offsets` (parameter
    /// index, offset; in flat-buffer order) in a flat buffer of `padded` elements.
    pub fn new(spec: &UnitSpec, offsets: Vec<(usize, i64)>, padded: i64) -> UnitInfo {
        let mut hasher = fnv::FnvHasher::default();
        for param in &spec.params {
            hasher.write(param.hf_name.as_bytes());
            for dim in &param.shape {
                hasher.write_i64(*dim);
            }
        }
        let params = offsets
            .into_iter()
            .map(|(i, offset)| ParamInfo { name: spec.params[i].hf_name.clone(), shape: spec.params[i].shape.clone(), offset })
            .collect();
        UnitInfo { id: format!("u{:016x}", hasher.finish()), name: spec.name.clone(), params, numel: spec.numel(), padded }
    }
}

/// A stage of a unit's gradient reduction; the policy says which a run has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceStage {
    /// The whole (padded) gradient all-reduced over every data-parallel
    /// rank, in place (ddp, zero1; an offloaded replicated unit).
    World,
    /// The whole gradient reduce-scattered over the shard group into this
    /// rank's shard (shard_grad_op, full_shard, hybrid_shard's first stage).
    Shard,
    /// This rank's reduced shard all-reduced, in place, across the replica
    /// groups holding the same shard (hybrid_shard's second stage).
    Replica,
}

impl ReduceStage {
    pub fn name(self) -> &'static str {
        match self {
            ReduceStage::World => "world all-reduce",
            ReduceStage::Shard => "shard reduce-scatter",
            ReduceStage::Replica => "replica all-reduce",
        }
    }
}

/// One reduction a hook is asked for.
pub struct GradReduce<'a> {
    pub unit: &'a UnitInfo,
    pub stage: ReduceStage,
    pub group: &'a ProcessGroup,
    /// The gradient: the whole padded unit (`World`, `Shard`) or this
    /// rank's shard (`Replica`), in the dtype core chose for the wire
    /// (`train.reduce_dtype`). A hook may overwrite it.
    pub input: Tensor,
    /// Where `input` starts in the unit's flat buffer (this rank's shard's
    /// start for `Replica`, else 0): with `unit.params`, which elements are
    /// which parameter's.
    pub offset: i64,
    /// Where the sum over `group` goes: `input` itself for the all-reduce
    /// stages, this rank's shard (`padded / group size` elements) for `Shard`.
    pub output: Tensor,
    /// Whether `input` is a whole step's gradient (summed over its
    /// micro-batches) rather than one micro-batch's.
    pub accumulated: bool,
    /// Optimizer steps taken before this one (0 on the first step).
    pub step: usize,
    /// The same on every rank (`train.seed`): for random choices all ranks must make alike.
    pub seed: u64,
    /// The scratch bytes the hook asked for (`CommHook::workspace_bytes`),
    /// on the input's device, alive until the returned work is done; empty
    /// when it asked for none.
    pub workspace: Tensor,
}

/// Why a unit is gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherPhase {
    Forward,
    /// Again for backward (full_shard freed it after forward).
    Backward,
}

/// One gather of a sharded unit's parameters a hook is asked for.
pub struct ParamGather<'a> {
    pub unit: &'a UnitInfo,
    pub phase: GatherPhase,
    pub group: &'a ProcessGroup,
    /// This rank's shard in the compute dtype (`padded / group size` elements).
    pub shard: Tensor,
    /// The whole padded unit in the compute dtype: fill every element.
    pub output: Tensor,
    pub step: usize,
    pub seed: u64,
    /// As `GradReduce::workspace`.
    pub workspace: Tensor,
}

/// One all-to-all of rows in variable numbers a hook is asked for: the
/// tokens of an expert-parallel layer dispatched to the ranks holding their
/// experts, the experts' outputs combined back, and each one's reverse in
/// backward. Each rank's splits are its own (the counts were exchanged
/// before), so unlike every other request the sizes differ across ranks;
/// the row width and the dtype do not.
pub struct TokenExchange<'a> {
    pub group: &'a ProcessGroup,
    /// `input_splits[i]` rows go to group rank i, in rank order.
    pub input: Tensor,
    /// `output_splits[j]` rows come from group rank j, in rank order: fill every row.
    pub output: Tensor,
    pub input_splits: Vec<i64>,
    pub output_splits: Vec<i64>,
}

/// Work a hook started: collectives in flight, and what to do once they
/// are done (decompress, a further collective). Core waits for it only
/// when it needs the result, so reductions overlap backward.
#[must_use = "a hook's result is only valid after wait()"]
pub struct Pending {
    works: Vec<Work>,
    then: Option<Box<dyn FnOnce() -> Result<()>>>,
}

impl Pending {
    /// Nothing in flight: the result is already there.
    pub fn done() -> Pending {
        Pending { works: vec![], then: None }
    }

    /// One collective in flight.
    pub fn of(work: Work) -> Pending {
        Pending { works: vec![work], then: None }
    }

    /// Another collective to wait for.
    pub fn and(mut self, work: Work) -> Pending {
        self.works.push(work);
        self
    }

    /// `finish` runs after every collective so far is done (after any
    /// earlier `then`). It owns what it uses: shallow clones of tensors, a
    /// clone of the group.
    pub fn then(self, finish: impl FnOnce() -> Result<()> + 'static) -> Pending {
        let Pending { works, then } = self;
        let then: Box<dyn FnOnce() -> Result<()>> = match then {
            None => Box::new(finish),
            Some(first) => Box::new(move || {
                first()?;
                finish()
            }),
        };
        Pending { works, then: Some(then) }
    }

    /// Waits for the collectives, then runs what follows them.
    pub fn wait(self) -> Result<()> {
        for work in self.works {
            work.wait()?;
        }
        match self.then {
            Some(finish) => finish(),
            None => Ok(()),
        }
    }

    /// The same work, with a panic in what follows the collectives turned into an error.
    pub(crate) fn guarded(self) -> Pending {
        match self.then {
            None => self,
            Some(finish) => Pending { works: self.works, then: Some(Box::new(move || guarded("the work it left to finish", finish))) },
        }
    }
}

/// Runs a hook's code, turning a panic into an error naming `what`.
pub(crate) fn guarded<T>(what: &str, call: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("no message");
            bail!("{what} panicked: {message}")
        }
    }
}

/// The scratch memory core hands a hook (`CommHook::workspace_bytes`):
/// allocated per request and counted from then until its work is done.
#[derive(Default)]
pub struct Workspace {
    in_flight: Rc<Cell<i64>>,
    peak: Cell<i64>,
}

impl Workspace {
    /// Issues a request through `issue`, handing it the workspace `hook`
    /// asks for `request` on `unit` (on `device`).
    pub fn issue(
        &self,
        hook: &mut dyn CommHook,
        unit: &UnitInfo,
        request: &WireRequest,
        device: Device,
        issue: impl FnOnce(&mut dyn CommHook, Tensor) -> Result<Pending>,
    ) -> Result<Pending> {
        let bytes = hook.workspace_bytes(unit, request).max(0);
        let workspace = Tensor::empty([bytes], (Kind::Uint8, device));
        let work = issue(hook, workspace)?;
        if bytes == 0 {
            return Ok(work);
        }
        self.in_flight.set(self.in_flight.get() + bytes);
        self.peak.set(self.peak.get().max(self.in_flight.get()));
        let in_flight = self.in_flight.clone();
        Ok(work.then(move || {
            in_flight.set(in_flight.get() - bytes);
            Ok(())
        }))
    }

    /// The most bytes of workspace in flight at once so far.
    pub fn peak(&self) -> i64 {
        self.peak.get()
    }
}

/// What a run will ask of a hook, so that it can refuse up front.
#[derive(Debug, Clone)]
pub struct CommPlan {
    pub strategy: String,
    /// The reduction stages the policy uses (empty on one rank).
    pub stages: Vec<ReduceStage>,
    /// Whether sharded parameters are gathered before use.
    pub gathers: bool,
    pub world_size: usize,
    pub offload: bool,
}

/// Asks `hook` whether it serves `plan`: its refusal as a run reports it.
pub fn check_serves(hook: &dyn CommHook, plan: &CommPlan) -> Result<()> {
    hook.check(plan).map_err(|e| anyhow::anyhow!("comm `{}` cannot serve this run: {e:#}", hook.name()))
}

/// How a communication plug-in reduces gradients and gathers parameters.
/// Every method has a default: the built-in behaviour, or nothing.
pub trait CommHook {
    /// The name it is registered under (`--comm NAME`).
    fn name(&self) -> &str;

    /// The relative difference in the training loss it stays within at
    /// optimizer step `step` (1 for the first) against the built-in's run:
    /// 0 for a hook whose results equal the built-in's bit for bit. A lossy
    /// compressor's gap may grow with steps, so this is a curve, not one
    /// number (`Tolerance` makes the common one). `ft plugin check` holds
    /// the plug-in to it.
    fn tolerance(&self, _step: usize) -> f64 {
        0.0
    }

    /// Refuses a run it cannot serve, saying why (e.g. a compression of
    /// all-reduces under a strategy that only reduce-scatters).
    fn check(&self, _plan: &CommPlan) -> Result<()> {
        Ok(())
    }

    /// Reduces one stage of a unit's gradient: leaves the sum over
    /// `request.group` in `request.output` once the returned work is done.
    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        Builtin.reduce(request)
    }

    /// Gathers a sharded unit's parameters into `request.output`.
    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        Builtin.gather(request)
    }

    /// Exchanges rows between the ranks of `request.group` (expert
    /// parallelism's dispatch and combine): `request.output` holds every
    /// rank's rows for this one, in rank order, once the work is done.
    /// Since ABI 4.1; by default `Builtin`'s.
    fn all_to_all(&mut self, request: TokenExchange) -> Result<Pending> {
        Builtin.all_to_all(request)
    }

    /// After each optimizer step (`step` steps taken): refresh a cache, advance a counter.
    fn after_step(&mut self, _step: usize) -> Result<()> {
        Ok(())
    }

    /// This rank's state to checkpoint, by name (letters, digits, `.`, `_`
    /// and `-`; key it by `UnitInfo::id`). Saved in the rank's checkpoint
    /// file beside its optimizer state.
    fn state(&self) -> Vec<(String, Tensor)> {
        vec![]
    }

    /// Puts back what `state` returned, on resume at the same world size
    /// with the same hook and options (on a change the state starts
    /// afresh); says what it kept, which the log repeats. Called only with
    /// state to put back.
    fn load_state(&mut self, _state: Vec<(String, Tensor)>) -> Result<Restored> {
        Ok(Restored::Afresh)
    }

    /// Bytes of state it keeps for `request` on `unit` (`request.elements`:
    /// the whole unit, or this rank's shard): what `ft plan` adds to a
    /// rank's memory. A run counts the tensors `state` returns instead.
    fn state_bytes(&self, _unit: &UnitInfo, _request: &WireRequest) -> f64 {
        0.0
    }

    /// The collectives it issues for `request` on `unit`, each with the
    /// bytes of this rank's input to it (an all-gather's: what this rank
    /// contributes, not the gathered whole): what `ft plan` times, at the
    /// group size of the run it plans, with each collective's algorithm
    /// factor. Declared, not measured: a run's `comm_bytes_per_step` is the
    /// measurement to compare it with. Default: the built-in's collective.
    fn wire_bytes(&self, _unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        vec![request.builtin()]
    }

    /// On a resume at another world size: `state` is what rank
    /// `change.saved_rank` saved (this rank's number modulo the old world
    /// size). Keep what still holds (e.g. factors every rank shares) with
    /// `load_state` and say what in `Kept`, or start afresh; the log says which.
    fn reshard_state(&mut self, _change: WorldChange, _state: Vec<(String, Tensor)>) -> Result<Restored> {
        Ok(Restored::Afresh)
    }

    /// Scratch bytes it wants for `request` on `unit`. Core allocates them
    /// per request on the request's device (`GradReduce::workspace`),
    /// counts them in the run's memory (the peak in flight) and in `ft
    /// plan`, and frees them when the work is done — so a hook need not
    /// hide allocations of its own.
    fn workspace_bytes(&self, _unit: &UnitInfo, _request: &WireRequest) -> i64 {
        0
    }
}

/// A tolerance that grows linearly with steps: `base` at the first step,
/// `per_step` more each step after (error feedback keeps a lossy
/// compressor's gap bounded, but two runs' trajectories still drift apart).
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub base: f64,
    pub per_step: f64,
}

impl Tolerance {
    /// The relative loss difference allowed at `step` (1 for the first).
    pub fn at(self, step: usize) -> f64 {
        self.base + self.per_step * step.saturating_sub(1) as f64
    }
}

/// A resume at another world size than the checkpoint's.
#[derive(Debug, Clone, Copy)]
pub struct WorldChange {
    pub saved_world: usize,
    pub world: usize,
    pub rank: usize,
    /// Whose saved state the hook is given: `rank % saved_world`.
    pub saved_rank: usize,
}

/// What a hook kept of the state it was handed on resume (`load_state`,
/// `reshard_state`); the log says which.
#[derive(Debug)]
pub enum Restored {
    Afresh,
    /// It kept what the text says (for the log).
    Kept(String),
}

/// What a collective carries, for the sizes a hook declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Reduce(ReduceStage),
    Gather,
}

/// One request as the built-in would carry it, for the sizes a hook
/// declares (`wire_bytes`, `workspace_bytes`, `state_bytes`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireRequest {
    pub wire: Wire,
    /// Elements of this rank's input: the whole padded unit (`World`,
    /// `Shard`), or this rank's shard (`Replica`, `Gather`).
    pub elements: i64,
    /// Their dtype: `train.reduce_dtype`'s for a reduction (fp32 for a
    /// replica stage outside offload), the compute dtype for a gather.
    pub dtype: Kind,
    /// Ranks in the request's group.
    pub group_size: usize,
}

impl WireRequest {
    /// The collective the built-in issues for it, with its input's bytes.
    pub fn builtin(&self) -> CollectiveBytes {
        let collective = match self.wire {
            Wire::Reduce(ReduceStage::World | ReduceStage::Replica) => Collective::AllReduce,
            Wire::Reduce(ReduceStage::Shard) => Collective::ReduceScatter,
            Wire::Gather => Collective::AllGather,
        };
        CollectiveBytes { collective, bytes: (self.elements * self.dtype.elt_size_in_bytes() as i64) as f64 }
    }
}

/// One collective a hook issues for a request, and the bytes of this
/// rank's input to it (`CommHook::wire_bytes`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveBytes {
    pub collective: Collective,
    pub bytes: f64,
}

/// The built-in behaviour: plain collectives, the sum in the output.
pub struct Builtin;

/// The name of the built-in hook (`--comm builtin`, the default).
pub const BUILTIN: &str = "builtin";

impl CommHook for Builtin {
    fn name(&self) -> &str {
        BUILTIN
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        let GradReduce { stage, group, mut input, mut output, .. } = request;
        Ok(Pending::of(match stage {
            ReduceStage::World | ReduceStage::Replica => group.all_reduce(&mut input, Reduction::Sum)?,
            ReduceStage::Shard => group.reduce_scatter_tensor(&mut output, &input, Reduction::Sum)?,
        }))
    }

    fn gather(&mut self, request: ParamGather) -> Result<Pending> {
        let ParamGather { group, shard, mut output, .. } = request;
        Ok(Pending::of(group.all_gather_into_tensor(&mut output, &shard)?))
    }

    fn all_to_all(&mut self, request: TokenExchange) -> Result<Pending> {
        let TokenExchange { group, input, mut output, input_splits, output_splits } = request;
        Ok(Pending::of(group.all_to_all_rows(&mut output, &input, &output_splits, &input_splits)?))
    }
}

/// One option a communication plug-in takes (`comm.NAME.KEY`).
#[derive(Debug, Clone, Copy)]
pub struct CommOption {
    pub key: &'static str,
    /// Its default, as `ft list` shows it.
    pub default: &'static str,
    pub help: &'static str,
}

impl CommOption {
    /// Its default as `--set` would give it: the text as JSON (`4`, `true`,
    /// `"none"`), or as a string where it is not JSON (`none`).
    pub fn default_value(&self) -> Value {
        serde_json::from_str(self.default).unwrap_or_else(|_| Value::String(self.default.into()))
    }
}

/// The options a hook runs with: `given`, and every other declared option
/// at its default; numbers as floats, so `2` and `2.0` are one value. What
/// checkpoints record, so that writing out a default changes nothing.
pub fn resolved_options(declared: &[CommOption], given: &Map<String, Value>) -> Map<String, Value> {
    let number_as_float = |value: Value| match value.as_f64() {
        Some(x) if value.is_number() => Value::from(x),
        _ => value,
    };
    declared
        .iter()
        .map(|o| (o.key.to_string(), number_as_float(given.get(o.key).cloned().unwrap_or_else(|| o.default_value()))))
        .collect()
}

/// Makes a hook from its options (`comm.NAME.*`, already checked to be among its declared keys).
/// Registered hooks cross into ft as tables (`abi::table_factory`).
pub type CommFactory = fn(&Map<String, Value>) -> Result<Box<dyn CommHook>>;

/// A communication plug-in's registration (`--comm NAME`), beside its
/// implementation; plug-ins loaded at run time add theirs through
/// `PluginRegistrar::add_comm`.
pub struct CommRegistration {
    pub name: &'static str,
    pub summary: &'static str,
    pub options: &'static [CommOption],
    pub create: CommFactory,
}
inventory::collect!(CommRegistration);

inventory::submit! {
    CommRegistration {
        name: BUILTIN,
        summary: "the strategy's own collectives: all-reduce, reduce-scatter and all-gather in train.reduce_dtype",
        options: &[],
        create: |_| Ok(Box::new(Builtin)),
    }
}

/// Refuses keys `options` does not declare, naming the valid ones.
pub fn check_options(name: &str, declared: &[CommOption], given: &Map<String, Value>) -> Result<()> {
    for key in given.keys() {
        if !declared.iter().any(|o| o.key == key) {
            let keys: Vec<&str> = declared.iter().map(|o| o.key).collect();
            let valid = if keys.is_empty() { "it takes none".to_string() } else { format!("valid: {}", keys.join(", ")) };
            bail!("unknown option comm.{name}.{key}{} ({valid})", crate::names::did_you_mean(key, &keys));
        }
    }
    Ok(())
}

/// Reads option `key` of `options` as a `T`, or `default` when absent; a
/// value of the wrong type is an error naming the key.
pub fn option<T: serde::de::DeserializeOwned>(name: &str, options: &Map<String, Value>, key: &str, default: T) -> Result<T> {
    match options.get(key) {
        None => Ok(default),
        Some(value) => serde_json::from_value(value.clone())
            .map_err(|e| anyhow::anyhow!("comm.{name}.{key} = {value}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_resolved_with_their_defaults_so_a_default_written_out_is_the_same() {
        const OPTIONS: &[CommOption] = &[
            CommOption { key: "ratio", default: "0.01", help: "" },
            CommOption { key: "rank", default: "4", help: "" },
            CommOption { key: "mode", default: "none", help: "" },
            CommOption { key: "warm", default: "true", help: "" },
        ];
        let given = |pairs: &[(&str, Value)]| pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<Map<String, Value>>();
        let typed = resolved_options(OPTIONS, &Map::new());
        assert_eq!(typed, resolved_options(OPTIONS, &given(&[("ratio", 0.01.into()), ("mode", "none".into())])));
        assert_eq!(typed, resolved_options(OPTIONS, &given(&[("rank", 4.into()), ("warm", true.into())])));
        assert_eq!(typed, resolved_options(OPTIONS, &given(&[("rank", 4.0.into())])), "4 and 4.0 are one value");
        assert_ne!(typed, resolved_options(OPTIONS, &given(&[("rank", 3.into())])));
        assert_eq!(typed.len(), 4);
    }
}
