//! Third-party strategies and communication hooks loaded at run time
//! (docs/PLUGINS.md).
//!
//! A plug-in is a `cdylib` depending on `ft-core`. It exports one C symbol,
//! `ft_plugin_declaration`, returning a [`PluginDeclaration`]: the ABI
//! version it was built against (`abi.rs`: a major that must match, a
//! minor no newer than this ft's), the rustc version (Rust types cross, so
//! the compiler must match), the boundary — the versions of the crates
//! whose types cross and the fingerprint of the types' shapes — and a
//! registration function. The loader checks them in that order — reading
//! nothing else from the library first — and refuses a mismatch naming the
//! field. [`export_plugin!`] writes the symbol; `plugins/comm/bf16` is a
//! complete example.

use crate::abi::{table_factory, CommDeclaration, StrategyDeclaration, StrategyTable, TableStrategy, ABI_MAJOR, ABI_MINOR, BOUNDARY, SHARED_CRATES};
use crate::distributed::comm_hook::{CommFactory, CommOption};
use crate::distributed::strategy::ShardingStrategy;
use crate::registry::{CommEntry, Origin, Registry, StrategyEntry};
use anyhow::{anyhow, bail, Context, Result};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};

/// NUL-terminated, for the declaration.
#[doc(hidden)]
pub const CORE_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
#[doc(hidden)]
pub const RUSTC_VERSION: &str = concat!(env!("FT_RUSTC_VERSION"), "\0");
#[doc(hidden)]
pub const SHARED_CRATES_C: &str = concat!(env!("FT_SHARED_CRATES"), "\0");
/// The symbol every plug-in exports.
pub const ENTRY_POINT: &str = "ft_plugin_declaration";

/// What a plug-in declares. Plain C data, `abi_major` first in every ABI
/// so far, so any library's declaration can be checked safely.
#[repr(C)]
pub struct PluginDeclaration {
    pub abi_major: u32,
    pub abi_minor: u32,
    /// `abi::BOUNDARY` of the plug-in's ft-core.
    pub boundary: u64,
    /// NUL-terminated ft-core version the plug-in was built against (for messages).
    pub core_version: *const c_char,
    /// NUL-terminated `rustc --version` of the plug-in's build.
    pub rustc_version: *const c_char,
    /// NUL-terminated `abi::SHARED_CRATES` of the plug-in's build: "tch 0.24.0, anyhow …".
    pub shared_crates: *const c_char,
    /// Called once, after the checks, to add the plug-in's strategies and communication hooks.
    pub register: fn(&mut PluginRegistrar),
}

// SAFETY: the pointers are to 'static string literals, never written.
unsafe impl Sync for PluginDeclaration {}

/// What a plug-in registers through: entry points into ft, appended to
/// (never changed) within a major, as `abi`'s tables are. The methods run
/// in the plug-in's copy of ft-core and turn what it made into tables.
#[repr(C)]
pub struct PluginRegistrar {
    registered: *mut c_void,
    add_strategy: fn(*mut c_void, StrategyDeclaration),
    add_comm: fn(*mut c_void, CommDeclaration),
}

impl PluginRegistrar {
    /// Adds a strategy (`create` makes a fresh instance per run).
    pub fn add_strategy(&mut self, name: &str, aliases: &[&str], summary: &str, create: fn() -> Box<dyn ShardingStrategy>) {
        let declaration = StrategyDeclaration {
            name: name.into(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            summary: summary.into(),
            create: Box::new(move || StrategyTable::new(create())),
        };
        (self.add_strategy)(self.registered, declaration)
    }

    /// Adds a communication plug-in (`--comm NAME`): the options it takes
    /// (`comm.NAME.KEY`, checked before `create` sees them) and how to make
    /// a fresh hook per run from them.
    pub fn add_comm(&mut self, name: &str, summary: &str, options: &[CommOption], create: CommFactory) {
        let declaration = CommDeclaration { name: name.into(), summary: summary.into(), options: options.to_vec(), create: table_factory(create) };
        (self.add_comm)(self.registered, declaration)
    }
}

/// What one plug-in registered, on ft's side of the registrar.
struct Registered {
    origin: Origin,
    strategies: Vec<StrategyEntry>,
    comms: Vec<CommEntry>,
}

fn add_strategy(registered: *mut c_void, declaration: StrategyDeclaration) {
    // SAFETY: the pointer `load` gave the registrar, alive while `register` runs.
    let registered = unsafe { &mut *(registered as *mut Registered) };
    let create = declaration.create;
    registered.strategies.push(StrategyEntry {
        name: declaration.name,
        aliases: declaration.aliases,
        summary: declaration.summary,
        origin: registered.origin.clone(),
        create: Box::new(move || Box::new(TableStrategy::new(create()))),
    });
}

fn add_comm(registered: *mut c_void, declaration: CommDeclaration) {
    // SAFETY: as in `add_strategy`.
    let registered = unsafe { &mut *(registered as *mut Registered) };
    registered.comms.push(CommEntry {
        name: declaration.name,
        summary: declaration.summary,
        options: declaration.options,
        origin: registered.origin.clone(),
        create: declaration.create,
    });
}

/// Exports `ft_plugin_declaration` for a plug-in whose registration
/// function is `$register: fn(&mut PluginRegistrar)`.
#[macro_export]
macro_rules! export_plugin {
    ($register:path) => {
        #[no_mangle]
        pub extern "C" fn ft_plugin_declaration() -> *const $crate::plugin::PluginDeclaration {
            static DECLARATION: $crate::plugin::PluginDeclaration = $crate::plugin::PluginDeclaration {
                abi_major: $crate::abi::ABI_MAJOR,
                abi_minor: $crate::abi::ABI_MINOR,
                boundary: $crate::abi::BOUNDARY,
                core_version: $crate::plugin::CORE_VERSION.as_ptr() as *const ::std::ffi::c_char,
                rustc_version: $crate::plugin::RUSTC_VERSION.as_ptr() as *const ::std::ffi::c_char,
                shared_crates: $crate::plugin::SHARED_CRATES_C.as_ptr() as *const ::std::ffi::c_char,
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

/// The crates of `theirs` ("name version, …", a plug-in's) at another
/// version than in `ours`, or in only one of the lists, each as "anyhow
/// 1.0.80 (this ft: 1.0.104)".
fn differing_crates(theirs: &str, ours: &str) -> Vec<String> {
    let parse = |list: &str| -> std::collections::BTreeMap<String, String> {
        list.split(", ").filter_map(|c| c.split_once(' ')).map(|(name, version)| (name.to_string(), version.to_string())).collect()
    };
    let (theirs, ours) = (parse(theirs), parse(ours));
    let names: std::collections::BTreeSet<&String> = theirs.keys().chain(ours.keys()).collect();
    names
        .into_iter()
        .filter_map(|name| match (theirs.get(name), ours.get(name)) {
            (Some(a), Some(b)) if a == b => None,
            (Some(a), Some(b)) => Some(format!("{name} {a} (this ft: {b})")),
            (None, Some(b)) => Some(format!("{name} of another version (this ft: {b})")),
            (Some(a), None) => Some(format!("{name} {a} (this ft shares none)")),
            (None, None) => None,
        })
        .collect()
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
    // SAFETY: non-null, and `abi_major` comes first, a u32, in every ABI so far.
    let major = unsafe { *(declaration as *const u32) };
    if major != ABI_MAJOR {
        bail!("plug-in {}: ABI major {major}, this ft loads {ABI_MAJOR} — rebuild the plug-in against this ft-core", path.display());
    }
    // SAFETY: the major matches, so the rest is laid out as ours.
    let declaration = unsafe { &*declaration };
    let core_version = field(declaration.core_version, "ft-core version", path)?;
    if declaration.abi_minor > ABI_MINOR {
        bail!(
            "plug-in {}: built against ABI {major}.{} (ft-core {core_version}), newer than this ft's {ABI_MAJOR}.{ABI_MINOR} — update ft, or rebuild the plug-in against this ft-core",
            path.display(),
            declaration.abi_minor
        );
    }
    let rustc = field(declaration.rustc_version, "rustc version", path)?;
    if rustc != RUSTC_VERSION.trim_end_matches('\0') {
        bail!("plug-in {}: built with `{rustc}`, this ft with `{}` — rebuild the plug-in with the same", path.display(), RUSTC_VERSION.trim_end_matches('\0'));
    }
    let shared = field(declaration.shared_crates, "shared crates' versions", path)?;
    let differing = differing_crates(&shared, SHARED_CRATES);
    if !differing.is_empty() {
        bail!(
            "plug-in {}: built with {}, whose types cross into ft — rebuild it with the versions this ft pins ({SHARED_CRATES}; the Cargo.lock of examples/comm-plugin-template has them)",
            path.display(),
            differing.join(", ")
        );
    }
    if declaration.boundary != BOUNDARY {
        bail!(
            "plug-in {}: its ft-core ({core_version}) passes types of another shape than this ft's although both say ABI {ABI_MAJOR} — rebuild the plug-in against this ft-core",
            path.display()
        );
    }
    let mut registered = Registered { origin: Origin::Plugin(canonical), strategies: vec![], comms: vec![] };
    let mut registrar = PluginRegistrar { registered: &mut registered as *mut Registered as *mut c_void, add_strategy, add_comm };
    let register = declaration.register;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| register(&mut registrar)))
        .map_err(|_| anyhow!("plug-in {} panicked while registering", path.display()))?;
    if registered.strategies.is_empty() && registered.comms.is_empty() {
        bail!("plug-in {} registered nothing", path.display());
    }
    for strategy in registered.strategies {
        registry.add_strategy(strategy).with_context(|| format!("loading plug-in {}", path.display()))?;
    }
    for comm in registered.comms {
        registry.add_comm(comm).with_context(|| format!("loading plug-in {}", path.display()))?;
    }
    std::mem::forget(library);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_crates_of_other_versions_are_named() {
        let ours = "tch 0.24.0, anyhow 1.0.104, serde_json 1.0.154";
        assert!(differing_crates(ours, ours).is_empty());
        let theirs = "tch 0.24.0, anyhow 1.0.80, serde_json 1.0.154";
        assert_eq!(differing_crates(theirs, ours), vec!["anyhow 1.0.80 (this ft: 1.0.104)"]);
        assert_eq!(differing_crates("tch 0.24.0, anyhow 1.0.104", ours), vec!["serde_json of another version (this ft: 1.0.154)"]);
    }

    /// What build.rs recorded is what the workspace resolved: one entry per
    /// shared crate, at the version Cargo.lock holds.
    #[test]
    fn the_recorded_versions_are_the_resolved_ones() {
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock")).unwrap();
        for entry in SHARED_CRATES.split(", ") {
            let (name, version) = entry.split_once(' ').unwrap();
            assert!(lock.contains(&format!("name = \"{name}\"\nversion = \"{version}\"\n")), "{entry} is not in Cargo.lock");
        }
        assert_eq!(SHARED_CRATES.split(", ").count(), 3, "{SHARED_CRATES}");
    }
}
