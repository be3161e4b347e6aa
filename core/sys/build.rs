//! Compiles the shim against the headers of the PyTorch wheel that torch-sys
//! links (LIBTORCH_USE_PYTORCH=1, the venv's python first on PATH): c10d.cpp
//! into the archive ft links, cuda.cpp into libft_cuda.so, which
//! `ft_sys::cuda` carries and opens on hosts with GPUs. Gloo's headers are
//! not in the wheel: they come from Debian's libgloo-dev (installed by
//! scripts/setup.sh); NCCL's and CUDA's come from the wheel's own nvidia-*
//! dependencies plus nvidia-cuda-crt / nvidia-cuda-cccl.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
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
    println!("cargo:rerun-if-changed=shim");
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

    let mut cxx = cc::Build::new();
    cxx.cpp(true)
        .pic(true)
        .warnings(false)
        .cargo_metadata(false)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"));
    let torch_lib = torch.join("lib");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));

    let shim = cxx.clone().file("shim/c10d.cpp").clone();
    made_once(&shim, &out.join("libft_shim.a"), || shim.compile("ft_shim"));
    println!("cargo:rustc-link-lib=static=ft_shim");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=stdc++");
    println!("cargo:rustc-link-search=native={}", torch_lib.display());
    for lib in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }

    // The CUDA half: a shared library that `ft_sys::cuda` carries (include_bytes!) and opens where there are GPUs.
    let cuda = cxx
        .include(nvidia.join("cu13/include"))
        .include(nvidia.join("cu13/include/cccl"))
        .include(nvidia.join("nccl/include"))
        .file("shim/cuda.cpp")
        .clone();
    let library = out.join("libft_cuda.so");
    made_once(&cuda, &library, || {
        let objects = cuda.compile_intermediates();
        let status = cuda
            .get_compiler()
            .to_command()
            .args(["-shared", "-Wl,-soname,libft_cuda.so", "-o"])
            .arg(&library)
            .args(&objects)
            .arg(format!("-L{}", torch_lib.display()))
            .args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
            .status()
            .expect("cannot run the C++ compiler to link libft_cuda.so");
        assert!(status.success(), "linking libft_cuda.so failed");
    });
    // Read by dependents' build scripts as DEP_FT_SHIM_TORCH_LIB.
    println!("cargo:torch_lib={}", torch_lib.display());
}

/// Makes `artifact` with `make`, or copies the one a build in this target
/// directory made from the same preprocessed source (the shim with every
/// header it includes) and the same compiler command. A plug-in built
/// outside ft's workspace into ft's target directory (the template) has an
/// ft-sys of its own, under another hash, whose C++ was 17 of its 22 s; the
/// preprocessing costs about 1 s.
fn made_once(build: &cc::Build, artifact: &Path, make: impl FnOnce()) {
    let compiler = build.get_compiler();
    let mut key = std::hash::DefaultHasher::new();
    build.expand().hash(&mut key);
    compiler.path().hash(&mut key);
    compiler.args().hash(&mut key);
    Command::new(compiler.path()).arg("--version").output().map(|o| o.stdout).unwrap_or_default().hash(&mut key);
    let name = artifact.file_name().expect("an artifact's file name").to_string_lossy();
    // The artifact is in <target>/<profile>/build/<crate>-<hash>/out: the copies are kept beside the crates' build directories.
    let kept = artifact.with_file_name(format!("../../{name}-compiled/{:016x}", key.finish()));
    if std::fs::copy(&kept, artifact).is_ok() {
        return;
    }
    make();
    // Written under a name of its own, then renamed: a build beside this one reads all of it or nothing.
    let partial = kept.with_extension(format!("{}.partial", std::process::id()));
    let kept_ok = std::fs::create_dir_all(kept.parent().unwrap())
        .and_then(|()| std::fs::copy(artifact, &partial))
        .and_then(|_| std::fs::rename(&partial, &kept));
    if let Err(error) = kept_ok {
        println!("cargo:warning={name} is not kept for other builds in this target directory ({}): {error}", kept.display());
    }
}
