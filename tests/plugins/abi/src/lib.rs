//! Test fixture: exports `ft_plugin_declaration` with the versions
//! `PLUGIN_FIXTURE_ABI` names, to test the loader's rules (core/src/abi.rs):
//! - `major` (the default): an ABI major no ft has — refused;
//! - `newer_minor`: this major, a minor newer than this ft's — refused;
//! - `boundary`: this major and minor, boundary types of another shape — refused;
//! - `anyhow`: this major and minor, built with another anyhow (as a fresh
//!   resolve outside ft's pins would take) — refused, naming anyhow;
//! - `null`: no declaration at all — refused;
//! - `older_minor`: this major, an older minor (at minor 0, minor 0) — loads, and registers comm `older`.
//!
//! Every refusal must come before anything in the library is called.

use ft_core::abi::{ABI_MAJOR, ABI_MINOR, BOUNDARY, SHARED_CRATES};
use ft_core::comm_hook::CommHook;
use ft_core::plugin::{PluginDeclaration, PluginRegistrar, CORE_VERSION, RUSTC_VERSION, SHARED_CRATES_C};
use std::ffi::c_char;

/// Overrides nothing: every entry is the default, as from a plug-in that predates them.
struct Older;

impl CommHook for Older {
    fn name(&self) -> &str {
        "older"
    }
}

fn register(registrar: &mut PluginRegistrar) {
    registrar.add_comm("older", "the built-in collectives, declared at an older ABI minor (a test fixture)", &[], |_| Ok(Box::new(Older)));
}

const fn declaration(abi_major: u32, abi_minor: u32, boundary: u64, shared_crates: &'static str) -> PluginDeclaration {
    PluginDeclaration {
        abi_major,
        abi_minor,
        boundary,
        core_version: CORE_VERSION.as_ptr() as *const c_char,
        rustc_version: RUSTC_VERSION.as_ptr() as *const c_char,
        shared_crates: shared_crates.as_ptr() as *const c_char,
        register,
    }
}

static OTHER_MAJOR: PluginDeclaration = declaration(999, 0, 0, SHARED_CRATES_C);
static NEWER_MINOR: PluginDeclaration = declaration(ABI_MAJOR, ABI_MINOR + 1, BOUNDARY, SHARED_CRATES_C);
static OTHER_BOUNDARY: PluginDeclaration = declaration(ABI_MAJOR, ABI_MINOR, BOUNDARY ^ 1, SHARED_CRATES_C);
static OLDER_MINOR: PluginDeclaration = declaration(ABI_MAJOR, ABI_MINOR.saturating_sub(1), BOUNDARY, SHARED_CRATES_C);

/// This ft's shared crates with anyhow at 1.0.80, as the declaration of a
/// plug-in whose build resolved that anyhow would say (made once per load:
/// leaked, as a static would be).
fn other_anyhow() -> &'static PluginDeclaration {
    let crates: Vec<String> = SHARED_CRATES.split(", ").map(|c| if c.starts_with("anyhow ") { "anyhow 1.0.80".into() } else { c.to_string() }).collect();
    let text: &'static str = Box::leak(format!("{}\0", crates.join(", ")).into_boxed_str());
    Box::leak(Box::new(declaration(ABI_MAJOR, ABI_MINOR, BOUNDARY, text)))
}

#[no_mangle]
pub extern "C" fn ft_plugin_declaration() -> *const PluginDeclaration {
    match std::env::var("PLUGIN_FIXTURE_ABI").as_deref() {
        Ok("newer_minor") => &NEWER_MINOR,
        Ok("boundary") => &OTHER_BOUNDARY,
        Ok("older_minor") => &OLDER_MINOR,
        Ok("anyhow") => other_anyhow(),
        Ok("null") => std::ptr::null(),
        _ => &OTHER_MAJOR,
    }
}
