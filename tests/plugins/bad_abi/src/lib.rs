//! Test fixture: exports `ft_plugin_declaration` laid out as ft-core's
//! `PluginDeclaration` (whose leading fields are plain C data) but wrong in
//! the way `PLUGIN_FIXTURE_FAULT` says: `abi` (the default: an ABI version
//! no ft has), `core_version` (another ft-core), or `null` (no declaration
//! at all). The loader must refuse each before calling anything.

use std::ffi::c_char;

#[repr(C)]
pub struct Declaration {
    abi_version: u32,
    core_version: *const c_char,
    rustc_version: *const c_char,
    register: fn(),
}

unsafe impl Sync for Declaration {}

fn never_called() {
    panic!("the loader called a plug-in it should have refused");
}

const fn declaration(abi_version: u32, core_version: &'static std::ffi::CStr, rustc_version: &'static std::ffi::CStr) -> Declaration {
    Declaration { abi_version, core_version: core_version.as_ptr(), rustc_version: rustc_version.as_ptr(), register: never_called }
}

static WRONG_ABI: Declaration = declaration(999, c"0.0.0", c"rustc 0.0.0");
// The ABI version this ft loads (ft_core::plugin::ABI_VERSION), so the ft-core version is what is wrong.
static WRONG_CORE: Declaration = declaration(2, c"0.0.0-other", c"rustc 0.0.0");

#[no_mangle]
pub extern "C" fn ft_plugin_declaration() -> *const Declaration {
    match std::env::var("PLUGIN_FIXTURE_FAULT").as_deref() {
        Ok("core_version") => &WRONG_CORE,
        Ok("null") => std::ptr::null(),
        _ => &WRONG_ABI,
    }
}
