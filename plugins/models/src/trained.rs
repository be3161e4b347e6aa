//! What a run leaves and what reads it back: final/ (the whole model, or
//! a LoRA run's peft adapter), `ft export` of a checkpoint (either, or the
//! adapters merged), and `ft eval`'s loading of a trained directory. It sits
//! above `hf` (Hugging Face model files) and `peft` (adapter files), which
//! never import it, so the dependencies run one way.

use crate::{hf, peft};
use anyhow::{bail, Context as _, Result};
use ft_core::lora::RunModel;
use ft_core::model::Model;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// How `export_checkpoint` writes a checkpoint.
pub struct Export<'a> {
    /// Weight dtype on disk.
    pub dtype: Kind,
    pub max_shard_bytes: u64,
    /// A LoRA checkpoint: fold the adapters into the base weights and write
    /// the whole model, instead of the adapter files.
    pub merge: bool,
    /// The base weights to merge into (default: the directory the run read).
    pub base_model: Option<&'a Path>,
}

/// Writes ft checkpoint `checkpoint` into `out` with its tokenizer: a
/// Hugging Face model directory, or for a LoRA run its adapter files (or,
/// merged, the whole model); returns the step it holds.
pub fn export_checkpoint(checkpoint: &Path, out: &Path, export: &Export) -> Result<usize> {
    let manifest = ft_core::checkpoint::read_manifest(checkpoint)?;
    let model = hf::build_model(manifest.model_config.clone(), &checkpoint.join("manifest.json"))?;
    match &manifest.lora {
        None if export.merge => bail!("--merge: checkpoint {} holds a full fine-tune, not LoRA adapters; export it without --merge", checkpoint.display()),
        None => {
            let mut reader = ft_core::checkpoint::Reader::open(checkpoint, model.as_ref())?;
            hf::write_model(model.as_ref(), out, export.dtype, export.max_shard_bytes, |unit| reader.unit_params(model.as_ref(), unit))?;
        }
        Some(config) => {
            let lora = ft_core::lora::LoraModel::new(model, config)?;
            let mut reader = ft_core::checkpoint::Reader::open(checkpoint, &lora)?;
            let trained = (0..lora.units().len())
                .map(|unit| if lora.frozen(unit) { Ok(vec![]) } else { reader.unit_params(&lora, unit) })
                .collect::<Result<Vec<_>>>()?;
            let base_dir = export.base_model.or(manifest.base_model.as_deref());
            if !export.merge {
                peft::save_adapter(&lora, &trained, out, base_dir)?;
            } else {
                let base_dir = base_dir.with_context(|| format!("--merge: checkpoint {} does not name its base model; give --base-model DIR", checkpoint.display()))?;
                let mut params = hf::load_params(lora.base(), base_dir, Kind::Float, Device::Cpu)
                    .with_context(|| format!("--merge: cannot read the base model in {}", base_dir.display()))?;
                let mut trained = trained;
                params.extend(trained.split_off(lora.base_units()));
                // A base unit trained whole (a question-answering head) replaces the base's.
                for (base, trained) in params.iter_mut().zip(trained).filter(|(_, t)| !t.is_empty()) {
                    *base = trained;
                }
                lora.merge(&mut params);
                hf::write_model(lora.base(), out, export.dtype, export.max_shard_bytes, |unit| Ok(params[unit].iter().map(Tensor::shallow_clone).collect()))?;
            }
        }
    }
    let tokenizer = checkpoint.join("tokenizer.json");
    if tokenizer.exists() {
        std::fs::copy(&tokenizer, out.join("tokenizer.json")).with_context(|| format!("cannot copy {}", tokenizer.display()))?;
    }
    Ok(manifest.step)
}

/// Writes a run's final parameters (`Trainer::params`) into `dir`: the
/// whole model in fp32, or a LoRA run's adapter files naming `base_model`.
/// Returns what it wrote.
pub fn save_trained(run: &RunModel, params: &[Vec<Tensor>], dir: &Path, base_model: Option<&Path>) -> Result<&'static str> {
    match run.lora() {
        Some(lora) => {
            peft::save_adapter(lora, params, dir, base_model)?;
            Ok("peft LoRA adapter")
        }
        None => {
            hf::save(run.model(), params, dir, Kind::Float)?;
            Ok("Hugging Face model")
        }
    }
}

/// A model and its parameters, per unit.
pub type LoadedModel = (Box<dyn Model>, Vec<Vec<Tensor>>);

/// A trained model directory's model and parameters in `dtype` on
/// `device`: its own weights, or (a LoRA run's final/) its adapter on the
/// base model it names.
pub fn load_trained(dir: &Path, dtype: Kind, device: Device) -> Result<LoadedModel> {
    if peft::is_adapter(dir) {
        let (lora, params) = peft::load_adapted(dir, dtype, device)?;
        return Ok((Box::new(lora), params));
    }
    let model = hf::load_model(dir)?;
    let params = hf::load_params(model.as_ref(), dir, dtype, device)?;
    Ok((model, params))
}
