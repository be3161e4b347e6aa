//! What ft reads about a GPU through NVML: utilisation, sampled in a
//! background thread while the run trains, and the dense peak FLOP/s MFU
//! divides by. Where NVML is absent (no driver, a CPU machine) both are n/a.

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

/// Dense peak FLOP/s of one GPU (no structured sparsity), from NVIDIA's data
/// sheets: (a fragment of the name NVML reports, bf16/fp16 tensor cores,
/// fp32 without tensor cores — PyTorch's default for fp32 matmuls). The
/// more specific names come first ("GH200" before "H200", "A100" before "A10").
const PEAK_TFLOPS: [(&str, f64, f64); 10] = [
    ("GH200", 989.4, 67.0),
    ("H200 NVL", 835.5, 60.0),
    ("H200", 989.4, 67.0),
    ("H100 NVL", 835.5, 60.0),
    ("H100 PCIe", 756.5, 51.0),
    ("H100", 989.4, 67.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L4", 121.0, 30.3),
    ("A10", 125.0, 31.2),
];

/// The dense peak FLOP/s of a GPU named `name` (as NVML names it) computing in `dtype`.
pub fn peak_flops_of(name: &str, dtype: Kind) -> Option<f64> {
    let (_, half, single) = PEAK_TFLOPS.iter().find(|(fragment, _, _)| name.contains(fragment))?;
    match dtype {
        Kind::BFloat16 | Kind::Half => Some(half * 1e12),
        Kind::Float => Some(single * 1e12),
        _ => None,
    }
}

/// The dense peak FLOP/s of GPU `index` in `dtype`; None without NVML or
/// for a GPU not in the table (MFU is then n/a unless `train.peak_tflops` says).
pub fn peak_flops(index: usize, dtype: Kind) -> Option<f64> {
    let name = Nvml::init().ok()?.device_by_index(index as u32).ok()?.name().ok()?;
    peak_flops_of(&name, dtype)
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
    }
}
