//! What every command sets up the same way: one vocabulary for devices and
//! dtypes (parsed once, the same spellings everywhere), this rank's device
//! and communicator from `train.device` and `dist.*`, and the host's cores
//! shared among its ranks.

use crate::comm::{Backend, CommOptions, Communicator};
use crate::config::Config;
use crate::env::DistEnv;
use crate::registry::Registry;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tch::{Device, Kind};

/// A floating-point dtype as users spell it: `auto` (bf16 on a GPU, f32 on
/// a CPU), `f32`/`fp32`/`float32`, `bf16`/`bfloat16`, `f16`/`fp16`/`float16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    #[default]
    Auto,
    #[serde(alias = "fp32", alias = "float32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "fp16", alias = "float16")]
    F16,
}

impl DType {
    /// The tensor kind on `device` (`auto` picks bf16 on a GPU).
    pub fn kind(self, device: Device) -> Kind {
        match (self, device) {
            (DType::Auto, Device::Cpu) | (DType::F32, _) => Kind::Float,
            (DType::Auto, _) | (DType::Bf16, _) => Kind::BFloat16,
            (DType::F16, _) => Kind::Half,
        }
    }

    /// The kind of a file's or a buffer's elements, where `auto` means f32.
    pub fn storage_kind(self) -> Kind {
        self.kind(Device::Cpu)
    }
}

/// Parses a flag with the configuration's own spellings (serde's), so a
/// value accepted in one place is accepted everywhere.
fn parse_as_config<T: serde::de::DeserializeOwned>(text: &str, what: &str, expected: &str) -> Result<T> {
    serde_json::from_value(serde_json::Value::from(text)).map_err(|_| anyhow::anyhow!("unknown {what} {text:?}: expected {expected}"))
}

impl std::str::FromStr for DType {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> Result<DType> {
        parse_as_config(text, "dtype", "auto, f32 (fp32, float32), bf16 (bfloat16) or f16 (fp16, float16)")
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::Auto => "auto",
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// Where a rank computes: `auto` (its GPU when there is one), `cpu`,
/// `cuda` (the GPU of its local rank) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda,
    CudaIndex(usize),
}

impl DeviceSpec {
    /// The device of the worker with local rank `local_rank`.
    pub fn for_rank(self, local_rank: usize) -> Device {
        match self {
            DeviceSpec::Auto if tch::Cuda::is_available() => Device::Cuda(local_rank),
            DeviceSpec::Auto | DeviceSpec::Cpu => Device::Cpu,
            DeviceSpec::Cuda => Device::Cuda(local_rank),
            DeviceSpec::CudaIndex(index) => Device::Cuda(index),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> Result<DeviceSpec> {
        Ok(match text {
            "auto" => DeviceSpec::Auto,
            "cpu" => DeviceSpec::Cpu,
            "cuda" => DeviceSpec::Cuda,
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(index)) => DeviceSpec::CudaIndex(index),
                _ => bail!("unknown device {other:?}: expected auto, cpu, cuda or cuda:N"),
            },
        })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Auto => f.write_str("auto"),
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda => f.write_str("cuda"),
            DeviceSpec::CudaIndex(index) => write!(f, "cuda:{index}"),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<DeviceSpec, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Splits this host's cores among its `local_ranks` workers (as torchrun
/// does) instead of oversubscribing them: ATen's threads when computing on
/// the CPU, the CPU optimizer's when state is offloaded to the host.
pub fn share_host_cores(local_ranks: usize, device: Device, offload_to_host: bool) {
    let share = (std::thread::available_parallelism().map_or(1, |n| n.get()) / local_ranks.max(1)).max(1);
    if device == Device::Cpu {
        tch::set_num_threads(share as i32);
    }
    if offload_to_host {
        crate::set_cpu_threads(share);
    }
}

/// The c10d backend for `device`: `auto` is NCCL on a GPU and Gloo on a CPU;
/// an explicit choice that cannot drive the device is refused.
pub fn backend_for(configured: Backend, device: Device) -> Result<Backend> {
    Ok(match (configured, device) {
        (Backend::Auto, Device::Cpu) => Backend::Gloo,
        (Backend::Auto, _) => Backend::Nccl,
        (Backend::Nccl, Device::Cpu) => bail!("dist.backend nccl needs a GPU, but this rank computes on the CPU (train.device)"),
        (Backend::Gloo, Device::Cuda(_)) => bail!("dist.backend gloo cannot reduce this rank's GPU tensors: use nccl or auto"),
        (backend, _) => backend,
    })
}

/// Refuses a configuration a run cannot start with, naming the key; the
/// names it holds (strategy, offload, sinks, task) are looked up in `registry`.
pub fn validate(config: &Config, registry: &Registry) -> Result<()> {
    let t = &config.train;
    if t.epochs == 0 || t.batch_size == 0 || t.grad_accum == 0 {
        bail!("train.epochs, train.batch_size and train.grad_accum must be at least 1");
    }
    // Written to refuse NaN too.
    if t.lr.is_nan() || t.lr <= 0.0 {
        bail!("train.lr must be positive (got {})", t.lr);
    }
    if config.data.max_seq_len < 8 {
        bail!("data.max_seq_len must be at least 8 (got {})", config.data.max_seq_len);
    }
    if !config.uses_preset() && config.data.train.is_none() {
        bail!("set data.train (--train-file) to train {}; only a preset (`ft list`) brings its own data", config.model.source);
    }
    if t.initial_loss_scale.is_nan() || t.initial_loss_scale < 1.0 {
        bail!("train.initial_loss_scale must be at least 1 (got {})", t.initial_loss_scale);
    }
    if let Some(peak) = t.peak_tflops.filter(|p| p.is_nan() || *p <= 0.0) {
        bail!("train.peak_tflops must be positive (got {peak})");
    }
    for sink in &config.output.sinks {
        registry.sink(sink)?;
    }
    let strategy = registry.strategy(&t.strategy)?;
    (strategy.create)().policy().validate(&strategy.name)?;
    registry.offload(&t.offload)?;
    if let Some(name) = &config.task.name {
        let task = registry.task(Some(name), "")?;
        (task.check_options)(&serde_json::Value::Object(config.task.options.clone()))?;
    }
    if let Some([first, last]) = t.profile_steps {
        if first == 0 || first > last {
            bail!("train.profile_steps [{first}, {last}]: steps count from 1 and the first comes before or is the last, e.g. [10, 12]");
        }
    }
    Ok(())
}

/// One worker process of a job: who it is, where it computes, in which
/// dtype, and its communicator.
pub struct Rank {
    pub comm: Communicator,
    pub device: Device,
    pub dtype: Kind,
}

impl Rank {
    /// Joins the job described by the launcher's environment, with the
    /// device, dtype and `dist.*` settings of `config`; `offload_to_host`
    /// gives the CPU optimizer its share of the cores.
    pub fn start(config: &Config, offload_to_host: bool) -> Result<Rank> {
        let env = DistEnv::from_env()?;
        let device = config.train.device.for_rank(env.local_rank);
        share_host_cores(env.local_world_size, device, offload_to_host);
        let options = CommOptions {
            backend: backend_for(config.dist.backend, device)?,
            timeout: Duration::from_secs(config.dist.timeout_secs),
        };
        let comm = Communicator::init(env, &options)?;
        Ok(Rank { comm, device, dtype: config.train.dtype.kind(device) })
    }

    pub fn rank(&self) -> usize {
        self.comm.env().rank
    }

    pub fn world_size(&self) -> usize {
        self.comm.env().world_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_a_dtype_parses_the_same() {
        for (spellings, dtype) in
            [(&["f32", "fp32", "float32"][..], DType::F32), (&["bf16", "bfloat16"], DType::Bf16), (&["f16", "fp16", "float16"], DType::F16)]
        {
            for text in spellings {
                assert_eq!(text.parse::<DType>().unwrap(), dtype);
                let from_config: DType = serde_json::from_value(serde_json::Value::from(*text)).unwrap();
                assert_eq!(from_config, dtype);
            }
        }
        let err = "fp8".parse::<DType>().unwrap_err().to_string();
        assert!(err.contains("unknown dtype \"fp8\": expected auto, f32"), "{err}");
        assert_eq!((DType::Auto.kind(Device::Cpu), DType::Auto.kind(Device::Cuda(0))), (Kind::Float, Kind::BFloat16));
    }

    #[test]
    fn devices_parse_and_print_the_same_way() {
        for text in ["auto", "cpu", "cuda", "cuda:3"] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap().to_string(), text);
        }
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap().for_rank(0), Device::Cuda(1));
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap().for_rank(2), Device::Cuda(2));
        assert!("gpu".parse::<DeviceSpec>().unwrap_err().to_string().contains("expected auto, cpu, cuda or cuda:N"));
    }

    #[test]
    fn backends_follow_the_device() {
        assert_eq!(backend_for(Backend::Auto, Device::Cpu).unwrap(), Backend::Gloo);
        assert_eq!(backend_for(Backend::Auto, Device::Cuda(0)).unwrap(), Backend::Nccl);
        assert!(backend_for(Backend::Nccl, Device::Cpu).unwrap_err().to_string().contains("needs a GPU"));
    }
}
