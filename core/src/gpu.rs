//! GPU utilisation through NVML, sampled in a background thread while the
//! run trains. Where NVML is absent (no driver, a CPU machine) there is no
//! sampler and the figure is reported as n/a.

use nvml_wrapper::Nvml;
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
