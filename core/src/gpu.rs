//! What ft reads about a GPU through NVML — utilisation, sampled in a
//! background thread while the run trains; its name and memory — and what
//! it knows of GPU models from their data sheets: the dense peak FLOP/s MFU
//! divides by, memory sizes and bandwidths `ft plan` predicts with. Where
//! NVML is absent (no driver, a CPU machine) what it would read is n/a.

use nvml_wrapper::Nvml;
use tch::Kind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct UtilizationSampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<u32>>,
}

impl UtilizationSampler {
    /// Starts sampling GPU `index` every 100 ms; None without NVML or that GPU.
    pub fn start(index: usize) -> Option<UtilizationSampler> {
        let nvml = Nvml::init().ok()?;
        nvml.device_by_index(index as u32).ok()?.utilization_rates().ok()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut samples = vec![];
            if let Ok(device) = nvml.device_by_index(index as u32) {
                while !flag.load(Ordering::Relaxed) {
                    if let Ok(rates) = device.utilization_rates() {
                        samples.push(rates.gpu);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            samples
        });
        Some(UtilizationSampler { stop, thread })
    }

    /// Stops sampling; the mean utilisation in percent.
    pub fn finish(self) -> Option<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.join().ok()?;
        (!samples.is_empty()).then(|| samples.iter().map(|&s| s as f64).sum::<f64>() / samples.len() as f64)
    }
}

/// One GPU model: data-sheet figures (dense, no structured sparsity) and
/// what `ft plan` assumes of the node it sits in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    /// What `ft plan --gpu` calls it.
    pub key: &'static str,
    /// A fragment of the name NVML reports.
    pub nvml_fragment: &'static str,
    /// Memory as the driver reports it (bytes).
    pub memory_bytes: f64,
    /// Dense peak TFLOP/s with bf16/fp16 tensor cores.
    pub half_tflops: f64,
    /// Dense peak TFLOP/s in fp32 without tensor cores (PyTorch's default for fp32 matmuls).
    pub single_tflops: f64,
    /// Memory bandwidth (bytes/s): AdamW's pass over the optimizer state is bound by it.
    pub memory_bandwidth: f64,
    /// NCCL bus bandwidth between the GPUs of one node (bytes/s, nccl-tests'
    /// busbw) at the sizes of a unit's collectives (tens to hundreds of MB).
    pub node_bus_bandwidth: f64,
    /// The host link one way (bytes/s): offloaded gradients and masters cross it.
    pub host_link_bandwidth: f64,
}

const MIB: f64 = 1024.0 * 1024.0;

/// GPU models by data sheet. Memory is what NVML reports as the total;
/// bus bandwidth is NVLink's as NCCL reaches it at unit sizes (2-4 H200s:
/// 210-300 GB/s at 64-256 MiB, bench/results/2026-11-22-h200x2-comm.md and
/// h200x4-scaling.md), PCIe's where the GPUs have no NVLink; the host link
/// is PCIe (gen5 x16: ~55 GB/s measured in bench/results/2026-11-22-h200x2-offload.md)
/// or GH200's NVLink-C2C. The more specific names come first ("GH200"
/// before "H200", "A100" before "A10"); NVML names match the first fragment they contain.
pub const GPUS: [GpuSpec; 11] = [
    gpu("gh200", "GH200", 97_871.0, 989.4, 67.0, 4.0e12, 250e9, 450e9),
    gpu("h200-nvl", "H200 NVL", 143_771.0, 835.5, 60.0, 4.8e12, 250e9, 55e9),
    gpu("h200", "H200", 143_771.0, 989.4, 67.0, 4.8e12, 250e9, 55e9),
    gpu("h100-nvl", "H100 NVL", 95_830.0, 835.5, 60.0, 3.9e12, 250e9, 55e9),
    gpu("h100-pcie", "H100 PCIe", 81_559.0, 756.5, 51.0, 2.0e12, 25e9, 55e9),
    gpu("h100", "H100", 81_559.0, 989.4, 67.0, 3.35e12, 250e9, 55e9),
    gpu("a100-80gb", "A100", 81_920.0, 312.0, 19.5, 2.0e12, 200e9, 25e9),
    gpu("a100-40gb", "A100", 40_960.0, 312.0, 19.5, 1.555e12, 200e9, 25e9),
    gpu("l40s", "L40S", 46_068.0, 362.1, 91.6, 0.864e12, 20e9, 25e9),
    gpu("l4", "L4", 23_034.0, 121.0, 30.3, 0.3e12, 10e9, 25e9),
    gpu("a10", "A10", 23_028.0, 125.0, 31.2, 0.6e12, 10e9, 25e9),
];

/// What `ft plan` predicts with when it knows no better (no GPU on this
/// machine, or one not in the table): an H100.
pub const FALLBACK: &GpuSpec = &GPUS[5];

#[allow(clippy::too_many_arguments)]
const fn gpu(
    key: &'static str,
    nvml_fragment: &'static str,
    memory_mib: f64,
    half_tflops: f64,
    single_tflops: f64,
    memory_bandwidth: f64,
    node_bus_bandwidth: f64,
    host_link_bandwidth: f64,
) -> GpuSpec {
    GpuSpec {
        key,
        nvml_fragment,
        memory_bytes: memory_mib * MIB,
        half_tflops,
        single_tflops,
        memory_bandwidth,
        node_bus_bandwidth,
        host_link_bandwidth,
    }
}

impl GpuSpec {
    /// The GPU `name` names: a `--gpu` key (any case), or a name as NVML
    /// reports it (the first entry whose fragment it contains).
    pub fn find(name: &str) -> Option<&'static GpuSpec> {
        GPUS.iter()
            .find(|g| g.key.eq_ignore_ascii_case(name))
            .or_else(|| GPUS.iter().find(|g| name.contains(g.nvml_fragment)))
    }

    /// The dense peak FLOP/s computing in `dtype` (None for a dtype without one here).
    pub fn peak_flops(&self, dtype: Kind) -> Option<f64> {
        match dtype {
            Kind::BFloat16 | Kind::Half => Some(self.half_tflops * 1e12),
            Kind::Float => Some(self.single_tflops * 1e12),
            _ => None,
        }
    }

    /// Every `--gpu` key, for messages.
    pub fn keys() -> String {
        GPUS.iter().map(|g| g.key).collect::<Vec<_>>().join(", ")
    }
}

/// The dense peak FLOP/s of a GPU named `name` (as NVML names it) computing in `dtype`.
pub fn peak_flops_of(name: &str, dtype: Kind) -> Option<f64> {
    GpuSpec::find(name)?.peak_flops(dtype)
}

/// The name NVML reports for GPU `index` and its total memory in bytes;
/// None without NVML or that GPU.
pub fn local_gpu(index: usize) -> Option<(String, f64)> {
    let nvml = Nvml::init().ok()?;
    let device = nvml.device_by_index(index as u32).ok()?;
    Some((device.name().ok()?, device.memory_info().ok()?.total as f64))
}

/// The dense peak FLOP/s of GPU `index` in `dtype`; None without NVML or
/// for a GPU not in the table (MFU is then n/a unless `train.peak_tflops` says).
pub fn peak_flops(index: usize, dtype: Kind) -> Option<f64> {
    peak_flops_of(&local_gpu(index)?.0, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_are_found_by_the_most_specific_name() {
        assert_eq!(peak_flops_of("NVIDIA H100 80GB HBM3", Kind::BFloat16), Some(989.4e12));
        assert_eq!(peak_flops_of("NVIDIA H100 PCIe", Kind::Half), Some(756.5e12));
        assert_eq!(peak_flops_of("NVIDIA GH200 480GB", Kind::BFloat16), Some(989.4e12));
        assert_eq!(peak_flops_of("NVIDIA A100-SXM4-80GB", Kind::Float), Some(19.5e12));
        assert_eq!(peak_flops_of("NVIDIA A10G", Kind::BFloat16), Some(125e12));
        assert_eq!(peak_flops_of("NVIDIA L40S", Kind::BFloat16), Some(362.1e12));
        assert_eq!(peak_flops_of("Some Future GPU", Kind::BFloat16), None);
        assert_eq!(GpuSpec::find("A100-40GB").unwrap().memory_bytes, 40.0 * 1024.0 * MIB);
        assert_eq!(GpuSpec::find("NVIDIA H200").unwrap().key, "h200");
        assert_eq!(FALLBACK.key, "h100");
    }
}
