//! LoRA adapters in the files Hugging Face peft writes and reads
//! (`PeftModel.from_pretrained`): `adapter_config.json`, and
//! `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight`
//! [r, in] and `.lora_B.weight` [out, r] in fp32 (on a mixture of experts'
//! fused experts, `target_parameters`: `base_model.model.<block>.mlp.experts`
//! `.base_layer.lora_A.weight` for `gate_up_proj`, which peft wraps first,
//! and `….mlp.experts.lora_A.weight` for `down_proj`, A [r·E, in] and B
//! [out, r·E] as `lora::expert_factors` reads them), plus a head trained whole
//! (a question-answering head, peft's `modules_to_save`) under
//! `base_model.model.<name>`. An adapter trained over a 4-bit base (QLoRA)
//! says how that base was quantized in `base_quantization.json` (peft's files
//! have no place for it; transformers' `BitsAndBytesConfig` is where peft's
//! users give it), and ft reads it back onto the same 4-bit values.

use anyhow::{bail, Context, Result};
use ft_core::config::LoraConfig;
use ft_core::lora::LoraModel;
use ft_core::model::{head, Model};
use ft_core::nf4::Quantization;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// How the base an adapter was trained over is quantized (`nf4::Quantization` as JSON).
pub const QUANTIZATION_FILE: &str = "base_quantization.json";

/// The task peft records for a head kind.
fn task_type(head_kind: &str) -> &'static str {
    match head_kind {
        head::QUESTION_ANSWERING => "QUESTION_ANS",
        _ => "CAUSAL_LM",
    }
}

/// Writes `lora`'s trained units from `params` (one entry per unit of
/// `lora`, as `Trainer::params` returns them: empty for frozen units) into
/// `dir` as peft saves an adapter; `base_model` is the directory of the
/// weights it adapts. Each file is written beside its name and renamed.
pub fn save_adapter(lora: &LoraModel, params: &[Vec<Tensor>], dir: &Path, base_model: Option<&Path>) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let units = lora.units();
    let mut tensors = vec![];
    let mut modules_to_save = vec![];
    for unit in lora.trained_base_units() {
        for (spec, tensor) in units[*unit].params.iter().zip(&params[*unit]) {
            tensors.push((format!("base_model.model.{}", spec.hf_name), tensor.shallow_clone()));
            let module = spec.hf_name.rsplit_once('.').map_or(spec.hf_name.as_str(), |(module, _)| module);
            if !modules_to_save.contains(&module) {
                modules_to_save.push(module);
            }
        }
    }
    for unit in lora.base_units()..units.len() {
        tensors.extend(units[unit].params.iter().zip(&params[unit]).map(|(spec, tensor)| (spec.hf_name.clone(), tensor.shallow_clone())));
    }
    let tensors: Vec<(String, Tensor)> =
        tensors.into_iter().map(|(name, t)| (name, t.detach().to_kind(Kind::Float).to_device(Device::Cpu).contiguous())).collect();
    let config = lora.config();
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": task_type(lora.head_kind()),
        "r": config.r,
        "lora_alpha": config.alpha(),
        "lora_dropout": config.dropout,
        "target_modules": lora.peft_target_modules(),
        "target_parameters": Some(lora.peft_target_parameters()).filter(|names| !names.is_empty()),
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "modules_to_save": (!modules_to_save.is_empty()).then_some(modules_to_save),
        // Absolute, so the adapter loads from any working directory.
        "base_model_name_or_path": base_model.map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string()),
        "inference_mode": true,
    });
    crate::hf::write_weights(&tensors, &dir.join(WEIGHTS_FILE))?;
    write_quantization(dir, lora.quantized_base())?;
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, serde_json::to_string_pretty(&json)? + "\n").with_context(|| format!("cannot write {}", config_path.display()))
}

/// Whether `dir` holds a peft adapter (as `ft train --lora-r` writes to final/).
pub fn is_adapter(dir: &Path) -> bool {
    dir.join(CONFIG_FILE).is_file()
}

/// An adapter directory as a model to run: the base model its
/// `adapter_config.json` names (`base_model_name_or_path`) wrapped in its
/// adapters, and every unit's parameters in `dtype` on `device`.
pub fn load_adapted(dir: &Path, dtype: Kind, device: Device) -> Result<(LoraModel, Vec<Vec<Tensor>>)> {
    load_adapted_on(dir, &base_model_dir(dir)?, dtype, device)
}

/// Records in `dir` how the base of its adapter is quantized; without a
/// quantization, removes an earlier adapter's record (in a directory
/// written over, it would describe another base).
pub fn write_quantization(dir: &Path, quantization: Option<Quantization>) -> Result<()> {
    let path = dir.join(QUANTIZATION_FILE);
    match quantization {
        Some(quantization) => std::fs::write(&path, serde_json::to_string_pretty(&quantization)? + "\n").with_context(|| format!("cannot write {}", path.display())),
        None if path.exists() => std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display())),
        None => Ok(()),
    }
}

/// How the base of the adapter in `dir` is quantized, if it is.
pub fn read_quantization(dir: &Path) -> Result<Option<Quantization>> {
    let path = dir.join(QUANTIZATION_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let quantization: Quantization = serde_json::from_str(&text).with_context(|| format!("{} does not describe a 4-bit quantization", path.display()))?;
    if !ft_core::nf4::BLOCKSIZES.contains(&quantization.blocksize) {
        bail!("{}: blocksize {} is not one of bitsandbytes' {:?}", path.display(), quantization.blocksize, ft_core::nf4::BLOCKSIZES);
    }
    Ok(Some(quantization))
}

/// The base model directory adapter `dir` names (`base_model_name_or_path`).
pub fn base_model_dir(dir: &Path) -> Result<PathBuf> {
    let (config, config_path) = read_config(dir)?;
    config
        .get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .map(PathBuf::from)
        .with_context(|| format!("{}: base_model_name_or_path names no base model directory", config_path.display()))
}

fn read_config(dir: &Path) -> Result<(serde_json::Value, PathBuf)> {
    let config_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", config_path.display()))?;
    Ok((config, config_path))
}

/// [`load_adapted`] onto the base model in `base_dir`.
pub fn load_adapted_on(dir: &Path, base_dir: &Path, dtype: Kind, device: Device) -> Result<(LoraModel, Vec<Vec<Tensor>>)> {
    let (config, config_path) = read_config(dir)?;
    let field = |key: &str| config.get(key).filter(|v| !v.is_null());
    if field("peft_type").and_then(|v| v.as_str()) != Some("LORA") {
        bail!("{}: peft_type is {:?}; ft runs LORA adapters", config_path.display(), field("peft_type"));
    }
    for unsupported in ["use_dora", "use_rslora"] {
        if field(unsupported).and_then(|v| v.as_bool()) == Some(true) {
            bail!("{}: {unsupported} is set; ft runs plain LoRA", config_path.display());
        }
    }
    for per_module in ["rank_pattern", "alpha_pattern"] {
        if field(per_module).and_then(|v| v.as_object()).is_some_and(|patterns| !patterns.is_empty()) {
            bail!("{}: {per_module} is set; ft runs one rank and alpha for every adapted layer", config_path.display());
        }
    }
    let names = |key: &str| -> Result<Vec<String>> {
        match field(key) {
            None => Ok(vec![]),
            Some(serde_json::Value::Array(names)) => Ok(names.iter().filter_map(|n| n.as_str().map(String::from)).collect()),
            Some(other) => bail!("{}: {key} must be a list of names (got {other})", config_path.display()),
        }
    };
    let mut targets = names("target_modules")?;
    if !base_dir.is_dir() {
        bail!("the base model {} of adapter {} is not a directory", base_dir.display(), dir.display());
    }
    let base = crate::hf::load_model(base_dir).with_context(|| format!("the base model of adapter {}", dir.display()))?;
    // ft adapts a block's fused experts together (its `experts` target).
    let (mut parameters, mut experts) = (names("target_parameters")?, base.expert_parameters().to_vec());
    if !parameters.is_empty() {
        parameters.sort();
        experts.sort();
        if parameters != experts {
            bail!(
                "{}: target_parameters {parameters:?}: ft adapts {} fused expert parameters together ({experts:?}, its {} target), and no other parameter",
                config_path.display(),
                base.model_type(),
                ft_core::lora::EXPERTS
            );
        }
        targets.push(ft_core::lora::EXPERTS.to_string());
    }
    let number = |key: &str| field(key).and_then(|v| v.as_f64()).with_context(|| format!("{}: {key} is missing", config_path.display()));
    let lora_config = LoraConfig { r: number("r")? as usize, alpha: Some(number("lora_alpha")?), dropout: number("lora_dropout").unwrap_or(0.0), targets };
    let quantization = read_quantization(dir)?;
    let lora = LoraModel::new(base, &lora_config).with_context(|| format!("adapter {}", dir.display()))?.with_quantized_base(quantization);
    let mut params = match quantization {
        None => crate::hf::load_params(lora.base(), base_dir, dtype, device)?,
        Some(_) => {
            // Quantized from fp32, as training quantized them.
            let mut params = crate::hf::load_params(lora.base(), base_dir, Kind::Float, device)?;
            lora.round_base_to_4bit(&mut params)?;
            params.into_iter().map(|unit| unit.into_iter().map(|t| t.to_kind(dtype)).collect()).collect()
        }
    };
    let weights_path = dir.join(WEIGHTS_FILE);
    let weights: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&weights_path)
        .with_context(|| format!("cannot read {}", weights_path.display()))?
        .into_iter()
        .collect();
    let take = |name: &str, shape: &[i64]| -> Result<Tensor> {
        let tensor = weights.get(name).with_context(|| format!("{} has no tensor {name}", weights_path.display()))?;
        if tensor.size() != shape {
            bail!("{}: {name} is {:?}, the model needs {shape:?}", weights_path.display(), tensor.size());
        }
        Ok(tensor.to_kind(dtype).to_device(device))
    };
    let units = lora.units();
    for &unit in lora.trained_base_units() {
        params[unit] = units[unit].params.iter().map(|p| take(&format!("base_model.model.{}", p.hf_name), &p.shape)).collect::<Result<_>>()?;
    }
    for unit in &units[lora.base_units()..] {
        params.push(unit.params.iter().map(|p| take(&p.hf_name, &p.shape)).collect::<Result<_>>()?);
    }
    Ok((lora, params))
}
