//! Test fixture: exports `ft_plugin_declaration` with an ABI version no ft
//! has, laid out as ft-core's `PluginDeclaration` (whose leading fields are
//! plain C data). The loader must refuse it before calling anything else.

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
    panic!("the loader called a plug-in whose ABI version it does not know");
}

static DECLARATION: Declaration =
    Declaration { abi_version: 999, core_version: c"0.0.0".as_ptr(), rustc_version: c"rustc 0.0.0".as_ptr(), register: never_called };

#[no_mangle]
pub extern "C" fn ft_plugin_declaration() -> *const Declaration {
    &DECLARATION
}
