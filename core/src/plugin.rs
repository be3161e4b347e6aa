//! Third-party strategies and communication hooks loaded at run time
//! (docs/PLUGINS.md).
//!
//! A plug-in is a `cdylib` depending on `ft-core`. It exports one C symbol,
//! `ft_plugin_declaration`, returning a [`PluginDeclaration`]: the plug-in
//! ABI version, the ft-core version and the rustc version it was built
//! with, and a registration function. Plug-ins share Rust types (trait
//! objects) with ft, which is only sound when all three match, so the
//! loader compares them — reading nothing else from the library first —
//! and refuses a mismatch naming the field. [`export_plugin!`] writes the
//! symbol; `plugins/ddp_bf16_grads` is a complete example.

use crate::comm_hook::{guard, guarded_factory, CommFactory, CommHook, CommOption};
use crate::strategy::ShardingPolicy;
use crate::registry::{CommEntry, Origin, Registry, StrategyEntry};
use crate::strategy::ShardingStrategy;
use anyhow::{anyhow, bail, Context, Result};
use std::ffi::{c_char, CStr};
use std::path::{Path, PathBuf};

/// Bumped whenever `PluginDeclaration`, `PluginRegistrar` or the traits a
/// plug-in implements change shape (2: communication hooks).
pub const ABI_VERSION: u32 = 2;
/// NUL-terminated, for the declaration.
#[doc(hidden)]
pub const CORE_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
#[doc(hidden)]
pub const RUSTC_VERSION: &str = concat!(env!("FT_RUSTC_VERSION"), "\0");
/// The symbol every plug-in exports.
pub const ENTRY_POINT: &str = "ft_plugin_declaration";

/// What a plug-in declares. The three version fields come first and are
/// plain C data, so any library's declaration can be checked safely.
#[repr(C)]
pub struct PluginDeclaration {
    pub abi_version: u32,
    /// NUL-terminated ft-core version the plug-in was built against.
    pub core_version: *const c_char,
    /// NUL-terminated `rustc --version` of the plug-in's build.
    pub rustc_version: *const c_char,
    /// Called once, after the checks, to add the plug-in's strategies and communication hooks.
    pub register: fn(&mut PluginRegistrar),
}

// SAFETY: the pointers are to 'static string literals, never written.
unsafe impl Sync for PluginDeclaration {}

/// Collects what a plug-in registers.
pub struct PluginRegistrar {
    origin: Origin,
    strategies: Vec<StrategyEntry>,
    comms: Vec<CommEntry>,
}

impl PluginRegistrar {
    /// Adds a strategy (`create` makes a fresh instance per run).
    pub fn add_strategy(
        &mut self,
        name: &str,
        aliases: &[&str],
        summary: &str,
        create: fn() -> Box<dyn ShardingStrategy>,
    ) {
        self.strategies.push(StrategyEntry {
            name: name.into(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            summary: summary.into(),
            origin: self.origin.clone(),
            // Made here, in the plug-in's copy of ft-core: see `comm_hook::guard`.
            create: Box::new(move || Box::new(GuardedStrategy(create()))),
        });
    }

    /// Adds a communication plug-in (`--comm NAME`): the options it takes
    /// (`comm.NAME.KEY`, checked before `create` sees them) and how to make
    /// a fresh hook per run from them.
    pub fn add_comm(&mut self, name: &str, summary: &str, options: &[CommOption], create: CommFactory) {
        self.comms.push(CommEntry {
            name: name.into(),
            summary: summary.into(),
            options: options.to_vec(),
            origin: self.origin.clone(),
            // Made here, in the plug-in's copy of ft-core: see `comm_hook::guard`.
            create: guarded_factory(create),
        });
    }
}

/// A plug-in's strategy whose own hook's panics come back as errors.
struct GuardedStrategy(Box<dyn ShardingStrategy>);

impl ShardingStrategy for GuardedStrategy {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn policy(&self) -> ShardingPolicy {
        self.0.policy()
    }

    fn comm_hook(&self) -> Option<Box<dyn CommHook>> {
        self.0.comm_hook().map(guard)
    }
}

/// Exports `ft_plugin_declaration` for a plug-in whose registration
/// function is `$register: fn(&mut PluginRegistrar)`.
#[macro_export]
macro_rules! export_plugin {
    ($register:path) => {
        #[no_mangle]
        pub extern "C" fn ft_plugin_declaration() -> *const $crate::plugin::PluginDeclaration {
            static DECLARATION: $crate::plugin::PluginDeclaration = $crate::plugin::PluginDeclaration {
                abi_version: $crate::plugin::ABI_VERSION,
                core_version: $crate::plugin::CORE_VERSION.as_ptr() as *const ::std::ffi::c_char,
                rustc_version: $crate::plugin::RUSTC_VERSION.as_ptr() as *const ::std::ffi::c_char,
                register: $register,
            };
            &DECLARATION
        }
    };
}

fn field(value: *const c_char, name: &str, path: &Path) -> Result<String> {
    if value.is_null() {
        bail!("plug-in {}: its declaration has no {name}", path.display());
    }
    // SAFETY: non-null and, by the declaration's contract, NUL-terminated static data.
    Ok(unsafe { CStr::from_ptr(value) }.to_string_lossy().into_owned())
}

impl Registry {
    /// The built-in registry plus what the plug-ins at `paths` register.
    pub fn with_plugins(paths: &[PathBuf]) -> Result<Registry> {
        let mut registry = Registry::builtin();
        for path in paths {
            load(path, &mut registry)?;
        }
        Ok(registry)
    }
}

/// Loads the plug-in at `path` and adds its strategies to `registry`.
/// The library stays loaded for the life of the process (its code backs
/// the strategies it registered).
pub fn load(path: &Path, registry: &mut Registry) -> Result<()> {
    if !path.is_file() {
        bail!("plug-in {} does not exist (build it with `cargo build --release -p <crate>`; the file is lib<crate>.so)", path.display());
    }
    let canonical = path.canonicalize().unwrap_or_else(|_| PathBuf::from(path));
    // SAFETY: loading runs the library's initialisers; a Rust cdylib has none beyond std's.
    let library = unsafe { libloading::Library::new(&canonical) }
        .map_err(|e| anyhow!("cannot load plug-in {}: not a loadable shared library ({e})", path.display()))?;
    // SAFETY: the signature is the one `export_plugin!` defines; a library
    // without the symbol is refused before anything is called.
    let entry: libloading::Symbol<extern "C" fn() -> *const PluginDeclaration> =
        unsafe { library.get(ENTRY_POINT.as_bytes()) }.map_err(|_| {
            anyhow!("{} is not an ft plug-in: it exports no `{ENTRY_POINT}` (use ft_core::export_plugin!)", path.display())
        })?;
    let declaration = entry();
    if declaration.is_null() {
        bail!("plug-in {}: `{ENTRY_POINT}` returned no declaration", path.display());
    }
    // SAFETY: non-null, and the first fields are repr(C) plain data in every ABI version.
    let declaration = unsafe { &*declaration };
    if declaration.abi_version != ABI_VERSION {
        bail!(
            "plug-in {}: abi_version is {}, this ft loads {ABI_VERSION} — rebuild the plug-in against this ft-core",
            path.display(),
            declaration.abi_version
        );
    }
    let expected = [
        ("ft-core version", field(declaration.core_version, "ft-core version", path)?, CORE_VERSION.trim_end_matches('\0')),
        ("rustc version", field(declaration.rustc_version, "rustc version", path)?, RUSTC_VERSION.trim_end_matches('\0')),
    ];
    for (name, theirs, ours) in expected {
        if theirs != ours {
            bail!("plug-in {}: built with {name} `{theirs}`, this ft has `{ours}` — rebuild the plug-in with the same", path.display());
        }
    }
    let mut registrar = PluginRegistrar { origin: Origin::Plugin(canonical), strategies: vec![], comms: vec![] };
    let register = declaration.register;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| register(&mut registrar)))
        .map_err(|_| anyhow!("plug-in {} panicked while registering", path.display()))?;
    if registrar.strategies.is_empty() && registrar.comms.is_empty() {
        bail!("plug-in {} registered nothing", path.display());
    }
    for strategy in registrar.strategies {
        registry.add_strategy(strategy).with_context(|| format!("loading plug-in {}", path.display()))?;
    }
    for comm in registrar.comms {
        registry.add_comm(comm).with_context(|| format!("loading plug-in {}", path.display()))?;
    }
    std::mem::forget(library);
    Ok(())
}
