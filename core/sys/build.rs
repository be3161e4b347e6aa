//! Compiles the c10d shim against the headers of the PyTorch wheel that
//! torch-sys links (LIBTORCH_USE_PYTORCH=1, the venv's python first on PATH).
//! Gloo's headers are not in the wheel: they come from Debian's libgloo-dev
//! (installed by scripts/setup.sh); NCCL's and CUDA's come from the wheel's
//! own nvidia-* dependencies plus nvidia-cuda-crt / nvidia-cuda-cccl.

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

    cc::Build::new()
        .cpp(true)
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
        .file("shim/c10d.cpp")
        .compile("ft_shim");

    let torch_lib = torch.join("lib");
    println!("cargo:rustc-link-search=native={}", torch_lib.display());
    for lib in ["torch_cuda", "c10_cuda", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // Read by dependents' build scripts as DEP_FT_SHIM_TORCH_LIB.
    println!("cargo:torch_lib={}", torch_lib.display());
}
