//! Compiles the c10d shim against the headers of the PyTorch wheel that
//! torch-sys links (LIBTORCH_USE_PYTORCH=1, the venv's python first on PATH).
//! Gloo's headers are not in the wheel: they come from Debian's libgloo-dev
//! (installed by scripts/setup.sh); NCCL's and CUDA's come from the wheel's
//! own nvidia-* dependencies plus nvidia-cuda-crt / nvidia-cuda-cccl.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::Command;

const FIND_TORCH: &str = "import os, sys, torch; \
print(os.path.dirname(torch.__file__)); print(torch.__version__); \
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))";

fn python() -> PathBuf {
    match std::env::var_os("VIRTUAL_ENV") {
        Some(venv) => PathBuf::from(venv).join("bin").join("python"),
        None => PathBuf::from("python3"),
    }
}

fn main() {
    println!("cargo:rerun-if-changed=shim/c10d.cpp");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let python = python();
    let output = Command::new(&python)
        .args(["-c", FIND_TORCH])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}; run scripts/setup.sh first", python.display()));
    if !output.status.success() {
        panic!(
            "{} cannot import torch: {}\nrun scripts/setup.sh, then build through `make` or with `source scripts/env.sh`",
            python.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8(output.stdout).expect("python printed non-UTF-8");
    let mut lines = stdout.lines();
    let torch = PathBuf::from(lines.next().expect("torch dir"));
    let _version = lines.next().expect("torch version");
    let cxx11_abi = lines.next().expect("cxx11 abi flag");
    let site_packages = torch.parent().expect("site-packages").to_path_buf();
    let nvidia = site_packages.join("nvidia");
    for required in ["cu13/include/cccl", "cu13/include/crt", "nccl/include"] {
        if !nvidia.join(required).exists() {
            panic!(
                "{} is missing: the NCCL/CUDA headers come from PyPI's nvidia-cuda-cccl, nvidia-cuda-crt \
                 and nvidia-nccl wheels; run scripts/setup.sh",
                nvidia.join(required).display()
            );
        }
    }
    if !PathBuf::from("/usr/include/gloo/config.h").exists() {
        panic!("gloo headers missing (/usr/include/gloo): run scripts/setup.sh (it installs Debian's libgloo-dev)");
    }

    let mut shim = cc::Build::new();
    shim.cpp(true)
        .pic(true)
        .warnings(false)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .include(nvidia.join("cu13/include"))
        .include(nvidia.join("cu13/include/cccl"))
        .include(nvidia.join("nccl/include"))
        .file("shim/c10d.cpp");
    compile_once(&shim, "ft_shim");

    let torch_lib = torch.join("lib");
    println!("cargo:rustc-link-search=native={}", torch_lib.display());
    for lib in ["torch_cuda", "c10_cuda", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // Read by dependents' build scripts as DEP_FT_SHIM_TORCH_LIB.
    println!("cargo:torch_lib={}", torch_lib.display());
}

/// Compiles `build` into OUT_DIR's lib`name`.a, or copies the archive a
/// build in this target directory made from the same preprocessed source
/// (the shim with every header it includes) and the same compiler command.
/// A plug-in built outside ft's workspace into ft's target directory (the
/// template) has an ft-sys of its own, under another hash, whose C++ was 17
/// of its 22 s; the preprocessing costs about 1 s.
fn compile_once(build: &cc::Build, name: &str) {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let compiler = build.get_compiler();
    let mut key = std::hash::DefaultHasher::new();
    build.expand().hash(&mut key);
    compiler.path().hash(&mut key);
    compiler.args().hash(&mut key);
    Command::new(compiler.path()).arg("--version").output().map(|o| o.stdout).unwrap_or_default().hash(&mut key);
    // OUT_DIR is <target>/<profile>/build/<crate>-<hash>/out: the archives are kept beside the crates' build directories.
    let kept = out.join(format!("../../{name}-compiled/{:016x}.a", key.finish()));
    let archive = out.join(format!("lib{name}.a"));
    if std::fs::copy(&kept, &archive).is_ok() {
        // What cc::Build::compile tells cargo.
        println!("cargo:rustc-link-lib=static={name}");
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=stdc++");
        return;
    }
    build.compile(name);
    // Written under a name of its own, then renamed: a build beside this one reads all of it or nothing.
    let partial = kept.with_extension(format!("{}.partial", std::process::id()));
    let kept_ok = std::fs::create_dir_all(kept.parent().unwrap())
        .and_then(|()| std::fs::copy(&archive, &partial))
        .and_then(|_| std::fs::rename(&partial, &kept));
    if let Err(error) = kept_ok {
        println!("cargo:warning={name} is not kept for other builds in this target directory ({}): {error}", kept.display());
    }
}
