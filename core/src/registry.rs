//! What `ft` can be composed from, looked up by name. Each kind's
//! registration struct lives beside its trait (`StrategyRegistration` in
//! strategy.rs, …); built-in crates submit theirs with `inventory::submit!`,
//! and plug-ins loaded at run time add entries to the same registry.

use crate::abi::{table_factory, TableFactory, TableHook};
use crate::config::{CommConfig, PresetRegistration};
use crate::distributed::comm_hook::{check_options, resolved_options, CommHook, CommOption, CommRegistration, BUILTIN};
use crate::distributed::strategy::{ShardingStrategy, StrategyRegistration};
use crate::metrics::{MetricsSink, SinkRegistration};
use crate::model::ModelRegistration;
use crate::names::{unknown, unknown_without_guess};
use crate::offload::OffloadRegistration;
use crate::task::{Task, TaskInputs, TaskRegistration};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    BuiltIn,
    Plugin(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::BuiltIn => f.write_str("built-in"),
            Origin::Plugin(path) => write!(f, "plug-in {}", path.display()),
        }
    }
}

pub struct StrategyEntry {
    pub name: String,
    pub aliases: Vec<String>,
    pub summary: String,
    pub origin: Origin,
    pub create: Box<dyn Fn() -> Box<dyn ShardingStrategy> + Send + Sync>,
}

pub struct SinkEntry {
    pub name: String,
    pub summary: String,
    pub origin: Origin,
    pub create: SinkFactory,
}

/// A communication plug-in (`--comm NAME`).
pub struct CommEntry {
    pub name: String,
    pub summary: String,
    pub options: Vec<CommOption>,
    pub origin: Origin,
    pub create: TableFactory,
}

/// The communication a run uses, as its checkpoints record it: a resume
/// with another hook or other options starts the hook's state afresh. The
/// options are recorded resolved (every declared option, defaults filled
/// in), so a default written out is the same options.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommRecord {
    pub name: String,
    pub options: serde_json::Value,
}

/// Makes a sink under the run's output directory; the step a resumed run continues from (`SinkRegistration::create`).
pub type SinkFactory = Box<dyn Fn(&Path, Option<u64>) -> Result<Box<dyn MetricsSink>> + Send + Sync>;

#[derive(Default)]
pub struct Registry {
    strategies: Vec<StrategyEntry>,
    comms: Vec<CommEntry>,
    sinks: Vec<SinkEntry>,
    models: Vec<&'static ModelRegistration>,
    offloads: Vec<&'static OffloadRegistration>,
    tasks: Vec<&'static TaskRegistration>,
    presets: Vec<&'static PresetRegistration>,
}

impl Registry {
    /// Everything linked into this binary.
    pub fn builtin() -> Registry {
        let mut registry = Registry::default();
        for r in inventory::iter::<StrategyRegistration> {
            let create = r.create;
            registry.strategies.push(StrategyEntry {
                name: r.name.into(),
                aliases: r.aliases.iter().map(|a| a.to_string()).collect(),
                summary: r.summary.into(),
                origin: Origin::BuiltIn,
                create: Box::new(create),
            });
        }
        for r in inventory::iter::<CommRegistration> {
            registry.comms.push(CommEntry {
                name: r.name.into(),
                summary: r.summary.into(),
                options: r.options.to_vec(),
                origin: Origin::BuiltIn,
                create: table_factory(r.create),
            });
        }
        for r in inventory::iter::<SinkRegistration> {
            let create = r.create;
            registry.sinks.push(SinkEntry {
                name: r.name.into(),
                summary: r.summary.into(),
                origin: Origin::BuiltIn,
                create: Box::new(create),
            });
        }
        registry.models = inventory::iter::<ModelRegistration>.into_iter().collect();
        registry.models.sort_by_key(|m| m.model_type);
        registry.offloads = inventory::iter::<OffloadRegistration>.into_iter().collect();
        registry.offloads.sort_by_key(|o| o.name);
        registry.tasks = inventory::iter::<TaskRegistration>.into_iter().collect();
        registry.tasks.sort_by_key(|t| t.name);
        registry.presets = inventory::iter::<PresetRegistration>.into_iter().collect();
        registry.presets.sort_by_key(|p| p.name);
        registry.strategies.sort_by(|a, b| a.name.cmp(&b.name));
        registry.sinks.sort_by(|a, b| a.name.cmp(&b.name));
        registry.comms.sort_by(|a, b| a.name.cmp(&b.name));
        registry
    }

    pub fn comms(&self) -> &[CommEntry] {
        &self.comms
    }

    /// Adds a communication plug-in; a name already taken is an error naming both origins.
    pub fn add_comm(&mut self, entry: CommEntry) -> Result<()> {
        if let Some(existing) = self.comms.iter().find(|c| c.name == entry.name) {
            bail!("comm plug-in name `{}` from {} is already registered by {}", entry.name, entry.origin, existing.origin);
        }
        self.comms.push(entry);
        Ok(())
    }

    pub fn comm(&self, name: &str) -> Result<&CommEntry> {
        self.comms.iter().find(|c| c.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.comms.iter().map(|c| c.name.as_str()).collect();
            unknown("comm plug-in", name, &names)
        })
    }

    /// Checks `comm.*`: the name is registered, and every `comm.NAME.KEY`
    /// names a registered plug-in and one of its declared options.
    pub fn check_comm(&self, config: &CommConfig) -> Result<()> {
        if let Some(name) = &config.name {
            self.comm(name)?;
        }
        for (name, options) in &config.options {
            let entry = self.comm(name).with_context(|| format!("comm.{name}.* sets options"))?;
            let Some(options) = options.as_object() else {
                bail!("comm.{name} must be a table of options (comm.{name}.KEY = VALUE), not {options}");
            };
            check_options(name, &entry.options, options)?;
        }
        Ok(())
    }

    /// The hook a run uses: `comm.name`'s, made with its options; else the
    /// strategy's own, else the built-in collectives. Also what
    /// checkpoints record of it.
    pub fn comm_hook(&self, config: &CommConfig, strategy: &dyn crate::distributed::strategy::ShardingStrategy) -> Result<(Box<dyn CommHook>, CommRecord)> {
        self.check_comm(config)?;
        let own = match &config.name {
            None => strategy.comm_hook(),
            Some(_) => None,
        };
        if let Some(hook) = own {
            let record = CommRecord { name: hook.name().to_string(), options: serde_json::json!({}) };
            return Ok((hook, record));
        }
        self.named_comm_hook(config, config.name.as_deref().unwrap_or(BUILTIN))
    }

    /// The hook registered as `name`, made with its options in `config`, and what checkpoints record of it.
    pub fn named_comm_hook(&self, config: &CommConfig, name: &str) -> Result<(Box<dyn CommHook>, CommRecord)> {
        let entry = self.comm(name)?;
        let options = config.options.get(name).and_then(|o| o.as_object()).cloned().unwrap_or_default();
        let table = (entry.create)(&options).with_context(|| format!("comm plug-in `{name}` ({})", entry.origin))?;
        let record = CommRecord { name: name.to_string(), options: serde_json::Value::Object(resolved_options(&entry.options, &options)) };
        Ok((Box::new(TableHook::new(table)), record))
    }

    pub fn strategies(&self) -> &[StrategyEntry] {
        &self.strategies
    }

    pub fn sinks(&self) -> &[SinkEntry] {
        &self.sinks
    }

    /// Adds a strategy; a name or alias already taken is an error naming both origins.
    pub fn add_strategy(&mut self, entry: StrategyEntry) -> Result<()> {
        for name in std::iter::once(&entry.name).chain(&entry.aliases) {
            if let Some(existing) = self.find_strategy(name) {
                bail!("strategy name `{name}` from {} is already registered by {}", entry.origin, existing.origin);
            }
        }
        self.strategies.push(entry);
        Ok(())
    }

    fn find_strategy(&self, name: &str) -> Option<&StrategyEntry> {
        self.strategies.iter().find(|s| s.name == name || s.aliases.iter().any(|a| a == name))
    }

    pub fn strategy(&self, name: &str) -> Result<&StrategyEntry> {
        self.find_strategy(name).ok_or_else(|| {
            let names: Vec<&str> = self
                .strategies
                .iter()
                .flat_map(|s| std::iter::once(s.name.as_str()).chain(s.aliases.iter().map(String::as_str)))
                .collect();
            unknown("strategy", name, &names)
        })
    }

    /// The built-in strategy that is DeepSpeed's ZeRO stage `stage`.
    pub fn strategy_for_zero_stage(&self, stage: u8) -> Result<&StrategyEntry> {
        self.strategies
            .iter()
            .filter(|s| s.origin == Origin::BuiltIn)
            .find(|s| (s.create)().policy().zero_stage() == Some(stage))
            .with_context(|| format!("no registered strategy is ZeRO stage {stage} (`ft list` shows the strategies)"))
    }

    pub fn models(&self) -> &[&'static ModelRegistration] {
        &self.models
    }

    pub fn model(&self, model_type: &str) -> Result<&'static ModelRegistration> {
        self.models.iter().copied().find(|m| m.model_type == model_type).ok_or_else(|| {
            let names: Vec<&str> = self.models.iter().map(|m| m.model_type).collect();
            unknown_without_guess("model_type", model_type, &names)
        })
    }

    pub fn offloads(&self) -> &[&'static OffloadRegistration] {
        &self.offloads
    }

    pub fn offload(&self, name: &str) -> Result<&'static OffloadRegistration> {
        self.offloads.iter().copied().find(|o| o.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.offloads.iter().map(|o| o.name).collect();
            unknown("offload", name, &names)
        })
    }

    /// What it holds, as `ft list` prints it: models, tasks, strategies,
    /// communication hooks and their options, offloads, sinks, presets.
    pub fn describe(&self) -> String {
        let mut lines = vec![];
        lines.push("models (config.json model_type):".to_string());
        for m in self.models() {
            lines.push(format!("  {:<16} {}", m.model_type, m.summary));
        }
        lines.push("tasks (--task; the default is the one for the model's head):".to_string());
        for t in self.tasks() {
            lines.push(format!("  {:<16} {} [head: {}]", t.name, t.summary, t.head_kind));
        }
        lines.push("strategies:".to_string());
        if self.strategies().is_empty() {
            lines.push("  (none registered)".to_string());
        }
        for s in self.strategies() {
            let aliases = if s.aliases.is_empty() { String::new() } else { format!(" (alias {})", s.aliases.join(", ")) };
            lines.push(format!("  {:<16} {}{aliases} [{}]", s.name, s.summary, s.origin));
        }
        lines.push("communication (--comm; options as --set comm.NAME.KEY=VALUE):".to_string());
        for c in self.comms() {
            lines.push(format!("  {:<16} {} [{}]", c.name, c.summary, c.origin));
            for option in &c.options {
                lines.push(format!("  {:<18} {} = {:<8} {}", "", option.key, option.default, option.help));
            }
        }
        lines.push("offload (--offload):".to_string());
        for o in self.offloads() {
            lines.push(format!("  {:<16} {} [built-in]", o.name, o.summary));
        }
        lines.push("metrics sinks:".to_string());
        for s in self.sinks() {
            lines.push(format!("  {:<16} {} [{}]", s.name, s.summary, s.origin));
        }
        lines.push("presets (--model NAME):".to_string());
        for p in self.presets() {
            lines.push(format!("  {:<16} {}{}", p.name, p.summary, if p.default { " [default]" } else { "" }));
        }
        lines.join("\n") + "\n"
    }

    pub fn presets(&self) -> &[&'static PresetRegistration] {
        &self.presets
    }

    pub fn tasks(&self) -> &[&'static TaskRegistration] {
        &self.tasks
    }

    /// The task named `name`, or (None) the one registered for `head_kind`.
    pub fn task(&self, name: Option<&str>, head_kind: &str) -> Result<&'static TaskRegistration> {
        let names: Vec<&str> = self.tasks.iter().map(|t| t.name).collect();
        match name {
            Some(name) => self.tasks.iter().copied().find(|t| t.name == name).ok_or_else(|| unknown("task", name, &names)),
            None => self.tasks.iter().copied().find(|t| t.head_kind == head_kind).with_context(|| {
                format!("no registered task trains a {head_kind} head (registered: {}); choose one with --task", names.join(", "))
            }),
        }
    }

    /// The task `name` names (None: the one for the model's head), built from `inputs`.
    pub fn build_task(&self, name: Option<&str>, inputs: &TaskInputs) -> Result<Box<dyn Task>> {
        (self.task(name, inputs.model.head_kind())?.build)(inputs)
    }

    /// What `ft tokenize --task NAME` writes the rows with: task `name`'s
    /// (default: the causal LM head's task); a task without rows to write
    /// is refused naming those with.
    pub fn tokenize(&self, name: Option<&str>) -> Result<fn(&crate::task::Tokenize) -> Result<String>> {
        let task = self.task(name, crate::model::head::CAUSAL_LM)?;
        task.tokenize.with_context(|| {
            let writers: Vec<&str> = self.tasks.iter().filter(|t| t.tokenize.is_some()).map(|t| t.name).collect();
            format!("task `{}` has no rows `ft tokenize` writes (--task {})", task.name, writers.join(" or --task "))
        })
    }

    pub fn sink(&self, name: &str) -> Result<&SinkEntry> {
        self.sinks.iter().find(|s| s.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.sinks.iter().map(|s| s.name.as_str()).collect();
            unknown("metrics sink", name, &names)
        })
    }

    /// The sinks `names` (`output.report_to`) of a run writing to `output`,
    /// its metrics continuing from `resumed_step` (None: a fresh run).
    pub fn create_sinks(&self, names: &[String], output: &Path, resumed_step: Option<u64>) -> Result<Vec<Box<dyn MetricsSink>>> {
        names.iter().map(|name| (self.sink(name)?.create)(output, resumed_step)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::strategy::*;

    fn entry(name: &str, aliases: &[&str], origin: Origin) -> StrategyEntry {
        StrategyEntry {
            name: name.into(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            summary: String::new(),
            origin,
            create: Box::new(|| {
                Box::new(FixedPolicy { name: "test_replicated", policy: ShardingPolicy::replicated(false) })
            }),
        }
    }

    #[test]
    fn builtin_offloads_are_registered_and_misspellings_suggested() {
        let registry = Registry::builtin();
        assert!(!(registry.offload("none").unwrap().create)().to_host());
        let err = registry.offload("nonee").err().unwrap().to_string();
        assert!(err.contains("did you mean `none`?"), "{err}");
    }

    #[test]
    fn lookup_by_alias_and_duplicate_refused() {
        let mut registry = Registry::default();
        registry.add_strategy(entry("full_shard_test", &["zero3_test"], Origin::BuiltIn)).unwrap();
        assert_eq!(registry.strategy("zero3_test").unwrap().name, "full_shard_test");
        let plugin = Origin::Plugin(PathBuf::from("/tmp/libx.so"));
        let err = registry.add_strategy(entry("other", &["zero3_test"], plugin)).unwrap_err().to_string();
        assert!(err.contains("`zero3_test` from plug-in /tmp/libx.so is already registered by built-in"), "{err}");
        let err = registry.strategy("full_shard_tst").err().unwrap().to_string();
        assert!(err.contains("did you mean `full_shard_test`?"), "{err}");
        assert_eq!((registry.strategy("zero3_test").unwrap().create)().policy().grads, GradReduction::AllReduce);
    }
}
