//! ft's own CUDA kernels (`ft_sys::kernels`, whose functions this module
//! re-exports) and [`Kernels`], which of them a step runs: whether they load
//! on a device decides it. It sits below the models, which ask it before each
//! fused op (`model::rotary`, `model::swiglu`, `Params::linear`,
//! `Params::layer_norm`), and below the engine, which asks it for the loss
//! and AdamW.

pub use ft_sys::kernels::*;

/// Which kernels the step runs where ATen and ft's own CUDA kernels
/// (`ft_sys::kernels`) both could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// ATen's ops: any device and dtype.
    Aten,
    /// On a GPU: ft's fused cross-entropy for bf16 logits (two reads of the
    /// logits, the gradient written over them; ATen's ops otherwise), ft's
    /// one-pass AdamW, and the blocks' fused ops (`model::rotary`,
    /// `model::swiglu`, `Params::linear`'s bias gradient, `Params::layer_norm`).
    Ft,
}

impl Kernels {
    /// ft's kernels on a GPU where they compile and load (once per process),
    /// ATen elsewhere or when the environment sets `FT_KERNELS=aten`.
    pub fn select(device: tch::Device) -> Kernels {
        if Self::aten_asked() {
            return Kernels::Aten;
        }
        match ft_sys::kernels::available(device) {
            Ok(()) => {
                if let Some(note) = ft_sys::kernels::cache_note(device) {
                    tracing::warn!("{note}");
                }
                Kernels::Ft
            }
            Err(why) => {
                if device.is_cuda() {
                    tracing::warn!("{why}; using ATen's cross-entropy and AdamW instead (slower, more memory)");
                }
                Kernels::Aten
            }
        }
    }

    /// Whether `select` picks ft's kernels on `device`, without its warning:
    /// what a model's block asks before a fused op (cached after the first load).
    pub fn loaded(device: tch::Device) -> bool {
        device.is_cuda() && !Self::aten_asked() && ft_sys::kernels::available(device).is_ok()
    }

    fn aten_asked() -> bool {
        std::env::var("FT_KERNELS").is_ok_and(|v| v == "aten")
    }
}
