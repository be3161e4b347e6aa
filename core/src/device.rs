//! One vocabulary for devices and dtypes, parsed once with serde: the
//! configuration and every command's flags accept the same spellings.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
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

/// Waits for `device`'s queued work (what timing it needs); nothing on a CPU.
pub fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
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
    /// The device of the worker with local rank `local_rank`, refused
    /// (before libtorch fails on it with its C++ stack) where this machine
    /// has no such GPU.
    pub fn device(self, local_rank: usize) -> Result<Device> {
        let device = self.for_rank(local_rank);
        if let Device::Cuda(index) = device {
            let visible = tch::Cuda::device_count().max(0) as usize;
            if index >= visible {
                if let Err(why) = ft_sys::cuda::init() {
                    bail!("device {self} is CUDA GPU {index}, but {why}: use --device cpu");
                }
                bail!("device {self} is CUDA GPU {index}, but libtorch sees {visible} GPU(s) here (a driver missing, or CUDA_VISIBLE_DEVICES hiding them?): use a GPU it sees, or --device cpu");
            }
        }
        Ok(device)
    }

    /// The device the worker with local rank `local_rank` asks for.
    fn for_rank(self, local_rank: usize) -> Device {
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
}
