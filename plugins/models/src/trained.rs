//! What a run leaves and what reads it back: final/ (the whole model, or
//! a LoRA run's peft adapter), `ft export` of a checkpoint or of final/
//! (either, or the adapters merged), each with the tokenizer files and
//! generation defaults transformers needs (`write_model_files`), and the
//! loading of a trained directory (`ft eval`, `ft forward`, `ft generate`). It sits
//! above `hf` (Hugging Face model files) and `peft` (adapter files), which
//! never import it, so the dependencies run one way.

use crate::{hf, peft};
use anyhow::{bail, Context as _, Result};
use ft_core::generate::{greedy_batch, sample_batch, Decoding, Sampling};
use ft_core::lora::RunModel;
use ft_core::model::Model;
use ft_core::setup::Rank;
use ft_core::task::{Start, Task, WholeModel};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// How `export` writes a model.
pub struct Export<'a> {
    /// Weight dtype on disk.
    pub dtype: Kind,
    pub max_shard_bytes: u64,
    /// A LoRA run's: fold the adapters into the base weights and write the
    /// whole model, instead of the adapter files.
    pub merge: bool,
    /// The base weights to merge into (default: the directory the run read).
    pub base_model: Option<&'a Path>,
}

impl Export<'_> {
    /// `--base-model`, which must be a directory.
    fn given_base(&self) -> Result<Option<PathBuf>> {
        match self.base_model {
            Some(dir) if !dir.is_dir() => bail!("--base-model {}: not a directory", dir.display()),
            dir => Ok(dir.map(Path::to_path_buf)),
        }
    }
}

/// What `ft export --checkpoint SPEC` reads: "latest" (the checkpoint saved
/// last under `output`, as `--resume latest` takes it), a checkpoint directory, or a trained model directory (a
/// run's final/). Errors name `--checkpoint`, the flag the user gave.
pub fn export_source(spec: &str, output: &Path) -> Result<PathBuf> {
    if spec == "latest" {
        return ft_core::checkpoint::latest(output)?.with_context(|| {
            format!("--checkpoint latest: no complete checkpoint under {} (give the run's --output-dir, or a checkpoint or final/ directory)", ft_core::checkpoint::checkpoints_dir(output).display())
        });
    }
    let path = PathBuf::from(spec);
    if path.join("manifest.json").is_file() || peft::is_adapter(&path) || path.join("config.json").is_file() {
        return Ok(path);
    }
    bail!("--checkpoint {spec}: {} is neither a checkpoint (manifest.json) nor a trained model directory such as a run's final/ (config.json or adapter_config.json)", path.display())
}

/// Writes `source` (a checkpoint, or a trained model directory as a run's
/// final/) into `out` as a Hugging Face directory, whole
/// (`write_model_files`): the model, or a LoRA run's adapter files (or,
/// merged, the whole model). Returns what it wrote, e.g. "step 40 of …".
pub fn export(source: &Path, out: &Path, export: &Export) -> Result<String> {
    if std::fs::canonicalize(out).ok() == Some(std::fs::canonicalize(source)?) {
        bail!("--out {} is the directory being exported: write the export elsewhere", out.display());
    }
    if source.join("manifest.json").is_file() {
        let (step, model_config) = export_checkpoint(source, out, export)?;
        write_model_files(out, &files_in(source), &model_config)?;
        return Ok(format!("step {step} of {}", source.display()));
    }
    let model_config = if peft::is_adapter(source) {
        let base_dir = export.given_base()?.map_or_else(|| peft::base_model_dir(source), Ok)?;
        if export.merge {
            let (lora, mut params) = peft::load_adapted_on(source, &base_dir, Kind::Float, Device::Cpu)
                .with_context(|| format!("--merge: cannot load adapter {} onto its base model (another base: --base-model DIR)", source.display()))?;
            lora.merge(&mut params);
            hf::write_model(lora.base(), out, export.dtype, export.max_shard_bytes, |unit| Ok(params[unit].iter().map(Tensor::shallow_clone).collect()))?;
            lora.base().hf_config().clone()
        } else {
            // The adapter files as they are; the base's config names its special tokens.
            std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
            for name in [peft::CONFIG_FILE, peft::WEIGHTS_FILE] {
                std::fs::copy(source.join(name), out.join(name)).with_context(|| format!("cannot copy {} to {}", source.join(name).display(), out.display()))?;
            }
            peft::write_quantization(out, peft::read_quantization(source)?)?;
            hf::read_config(&base_dir).with_context(|| format!("the base model of adapter {}", source.display()))?
        }
    } else {
        if export.merge {
            bail!("--merge: {} holds a whole model, not a LoRA adapter; export it without --merge", source.display());
        }
        let model = hf::load_model(source)?;
        let params = hf::load_params(model.as_ref(), source, Kind::Float, Device::Cpu)?;
        hf::write_model(model.as_ref(), out, export.dtype, export.max_shard_bytes, |unit| Ok(params[unit].iter().map(Tensor::shallow_clone).collect()))?;
        model.hf_config().clone()
    };
    write_model_files(out, &files_in(source), &model_config)?;
    Ok(source.display().to_string())
}

/// Writes ft checkpoint `checkpoint`'s weights into `out`: a Hugging Face
/// model, or for a LoRA run its adapter files (or, merged, the whole
/// model); returns the step it holds and its model config.
fn export_checkpoint(checkpoint: &Path, out: &Path, export: &Export) -> Result<(usize, serde_json::Value)> {
    let manifest = ft_core::checkpoint::read_manifest(checkpoint)?;
    let model = hf::build_model(manifest.model_config.clone(), &checkpoint.join("manifest.json"))?;
    match &manifest.lora {
        None if export.merge => bail!("--merge: checkpoint {} holds a full fine-tune, not LoRA adapters; export it without --merge", checkpoint.display()),
        None => {
            let mut reader = ft_core::checkpoint::Reader::open(checkpoint, model.as_ref())?;
            hf::write_model(model.as_ref(), out, export.dtype, export.max_shard_bytes, |unit| reader.unit_params(model.as_ref(), unit))?;
        }
        Some(config) => {
            let lora = ft_core::lora::LoraModel::new(model, config)?.with_quantized_base(manifest.quantized_base);
            let mut reader = ft_core::checkpoint::Reader::open(checkpoint, &lora)?;
            let trained = (0..lora.units().len())
                .map(|unit| if lora.frozen(unit) { Ok(vec![]) } else { reader.unit_params(&lora, unit) })
                .collect::<Result<Vec<_>>>()?;
            let base_dir = export.given_base()?.or_else(|| ft_core::checkpoint::base_model_dir(&manifest, checkpoint));
            if !export.merge {
                peft::save_adapter(&lora, &trained, out, base_dir.as_deref())?;
            } else {
                let base_dir = base_dir.with_context(|| format!("--merge: checkpoint {} does not name its base model; give --base-model DIR", checkpoint.display()))?;
                if !base_dir.is_dir() {
                    bail!(
                        "--merge: the base model {} that checkpoint {} was trained on is not there (recorded as {:?}, relative to the run directory); give its directory with --base-model DIR",
                        base_dir.display(),
                        checkpoint.display(),
                        manifest.base_model.as_deref().unwrap_or(&base_dir)
                    );
                }
                let mut params = hf::load_params(lora.base(), &base_dir, Kind::Float, Device::Cpu)
                    .with_context(|| format!("--merge: cannot read the base model in {}", base_dir.display()))?;
                lora.round_base_to_4bit(&mut params)?;
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
    Ok((manifest.step, manifest.model_config))
}

/// The files besides the weights that make a model directory usable as it
/// was trained, by their names there.
pub const TOKENIZER: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// A run's files besides the weights, by name, where they are (those that
/// exist): its tokenizer; tokenizer_config.json beside it; the chat template
/// it used (`chat_template`, else chat_template.jinja beside the tokenizer);
/// the model directory's generation_config.json.
pub fn model_files(tokenizer: &Path, chat_template: Option<&Path>, model_dir: Option<&Path>) -> Vec<(String, PathBuf)> {
    let template = chat_template.map_or_else(|| tokenizer.with_file_name(CHAT_TEMPLATE), Path::to_path_buf);
    let candidates = [
        (TOKENIZER, Some(tokenizer.to_path_buf())),
        (TOKENIZER_CONFIG, Some(tokenizer.with_file_name(TOKENIZER_CONFIG))),
        (CHAT_TEMPLATE, Some(template)),
        (GENERATION_CONFIG, model_dir.map(|dir| dir.join(GENERATION_CONFIG))),
    ];
    candidates.into_iter().filter_map(|(name, path)| Some((name.to_string(), path.filter(|p| p.is_file())?))).collect()
}

/// The model files `dir` holds (a checkpoint's, or a trained directory's).
fn files_in(dir: &Path) -> Vec<(String, PathBuf)> {
    [TOKENIZER, TOKENIZER_CONFIG, CHAT_TEMPLATE, GENERATION_CONFIG]
        .into_iter()
        .map(|name| (name.to_string(), dir.join(name)))
        .filter(|(_, path)| path.is_file())
        .collect()
}

/// Writes into `out` what besides the weights makes it usable as trained,
/// as transformers' `save_pretrained` leaves it: each of `files` (name,
/// where it is), then what they lack, from `model_config`: a
/// tokenizer_config.json with its special tokens (bos, eos, pad from the
/// config's ids, unk from the tokenizer), and generation_config.json with
/// the config's token ids (eos as it has them: one id or a list).
pub fn write_model_files(out: &Path, files: &[(String, PathBuf)], model_config: &serde_json::Value) -> Result<()> {
    for (name, from) in files {
        let to = out.join(name);
        // A run that started from its own final/ has its files there already (copying a file onto itself empties it).
        if std::fs::canonicalize(&to).ok() != Some(std::fs::canonicalize(from)?) {
            std::fs::copy(from, &to).with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
        }
    }
    let has = |name: &str| files.iter().any(|(n, _)| n == name);
    let ids = ["bos_token_id", "eos_token_id", "pad_token_id"].map(|key| (key, model_config.get(key).filter(|v| !v.is_null())));
    if has(TOKENIZER) && !has(TOKENIZER_CONFIG) {
        let json = derived_tokenizer_config(&out.join(TOKENIZER), &ids)?;
        write_json(&out.join(TOKENIZER_CONFIG), &json)?;
    }
    if !has(GENERATION_CONFIG) {
        let json: serde_json::Map<String, serde_json::Value> = ids.iter().filter_map(|(key, id)| Some((key.to_string(), (*id)?.clone()))).collect();
        if !json.is_empty() {
            write_json(&out.join(GENERATION_CONFIG), &serde_json::Value::Object(json))?;
        }
    }
    Ok(())
}

/// tokenizer_config.json for a tokenizer.json that came without one:
/// transformers' fast tokenizer over it, with the special tokens the model
/// config's ids name and the unknown token of the tokenizer's model.
fn derived_tokenizer_config(tokenizer_path: &Path, ids: &[(&str, Option<&serde_json::Value>)]) -> Result<serde_json::Value> {
    let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_path).map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tokenizer_path.display()))?;
    let mut config = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": false});
    for (key, id) in ids {
        // eos_token_id may be a list (Llama 3's): the tokenizer's eos_token is its first.
        let id = id.and_then(|id| id.as_u64().or_else(|| id.as_array()?.first()?.as_u64()));
        if let Some(token) = id.and_then(|id| tokenizer.id_to_token(id as u32)) {
            config[key.trim_end_matches("_id")] = token.into();
        }
    }
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tokenizer_path)?).with_context(|| format!("{} is not JSON", tokenizer_path.display()))?;
    if let Some(unk) = json["model"]["unk_token"].as_str() {
        config["unk_token"] = unk.into();
    }
    Ok(config)
}

fn write_json(path: &Path, json: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(json)? + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// Writes a finished run's OUTPUT/final: its parameters ([`save_trained`])
/// and what transformers needs besides them ([`write_model_files`]: the
/// tokenizer, its special tokens and the chat template it was trained
/// with, generation defaults). Returns what it wrote, for the log.
pub fn write_final(output: &Path, run: &RunModel, params: &[Vec<Tensor>], base_model: Option<&Path>, files: &[(String, PathBuf)], model_config: &serde_json::Value) -> Result<String> {
    let dir = output.join("final");
    let what = save_trained(run, params, &dir, base_model)?;
    write_model_files(&dir, files, model_config)?;
    Ok(format!("final/ ({what} + tokenizer)"))
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

/// A model and its parameters, per unit: the whole model, or a LoRA run's adapters on their base.
pub type LoadedModel = (RunModel, Vec<Vec<Tensor>>);

/// A trained model directory's model and parameters in `dtype` on
/// `device`: its own weights, or (a LoRA run's final/) its adapter on the
/// base model it names.
pub fn load_trained(dir: &Path, dtype: Kind, device: Device) -> Result<LoadedModel> {
    if peft::is_adapter(dir) {
        let (lora, params) = peft::load_adapted(dir, dtype, device)?;
        return Ok((RunModel::Lora(Box::new(lora)), params));
    }
    let model = hf::load_model(dir)?;
    let params = hf::load_params(model.as_ref(), dir, dtype, device)?;
    Ok((RunModel::Full(model), params))
}

/// The reference model `ft eval --ref-model DIR` names (loaded as
/// [`load_trained`] loads) for a model whose base is `policy` and whose
/// data `tokenizer` encodes: refused unless it is the same architecture
/// (model type, every parameter's name and shape) and, where `dir` has a
/// tokenizer.json, the same vocabulary — the reference scores the policy's token ids.
pub fn load_reference(dir: &Path, policy: &dyn Model, tokenizer: &Path, dtype: Kind, device: Device) -> Result<LoadedModel> {
    let (reference, params) = load_trained(dir, dtype, device)?;
    let shapes = |model: &dyn Model| -> Vec<(String, Vec<i64>)> {
        model.units().iter().flat_map(|unit| unit.params.iter().map(|p| (p.name.clone(), p.shape.clone()))).collect()
    };
    let describe = |model: &dyn Model| {
        let dims = model.dims();
        format!("{} of {} layers, hidden size {}, vocabulary {}", model.model_type(), dims.layers, dims.hidden, dims.vocab)
    };
    if reference.base().model_type() != policy.model_type() || shapes(reference.base()) != shapes(policy) {
        bail!(
            "--ref-model {}: a {}, not the evaluated model's architecture ({}); the reference is the model its training started from",
            dir.display(),
            describe(reference.base()),
            describe(policy)
        );
    }
    let their_tokenizer = dir.join("tokenizer.json");
    if their_tokenizer.is_file() {
        let vocabulary = |path: &Path| -> Result<std::collections::HashMap<String, u32>> {
            let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))?;
            Ok(tokenizer.get_vocab(true))
        };
        if vocabulary(&their_tokenizer)? != vocabulary(tokenizer)? {
            bail!(
                "--ref-model {}: its tokenizer ({}) has another vocabulary than the one the pairs are encoded with ({}); the reference is the model its training started from",
                dir.display(),
                their_tokenizer.display(),
                tokenizer.display()
            );
        }
    }
    Ok((reference, params))
}

/// Gives a task that compares the model with a reference (DPO) its
/// reference, as training's `Task::before_training` takes it: the model
/// `ref_model` (`ft eval --ref-model`) names, else a LoRA run's base (the
/// adapters off). `name`: the evaluated model, for the message.
#[allow(clippy::too_many_arguments)]
pub fn give_reference(task: &mut dyn Task, ref_model: Option<&str>, name: &str, model: &RunModel, params: &[Vec<Tensor>], tokenizer: &Path, rank: &Rank) -> Result<()> {
    if !task.compares_with_reference() {
        if let Some(dir) = ref_model {
            bail!("--ref-model {dir}: this evaluation of task `{}` compares with no reference model (leave --ref-model out)", task.name());
        }
        return Ok(());
    }
    let given = ref_model.map(|spec| load_reference(&hf::resolve(spec)?, model.base(), tokenizer, rank.dtype, rank.device)).transpose()?;
    let (reference, reference_params) = match (&given, model.lora()) {
        (Some((reference, reference_params)), _) => (reference.model(), &reference_params[..]),
        (None, Some(lora)) => (lora.base(), &params[..lora.base_units()]),
        (None, None) => bail!(
            "task `{}` compares {name} with its reference model, and it has no LoRA adapters whose base would be one: \
             name the model its training started from with --ref-model DIR, or evaluate reference-free (task.reference_free=true)",
            task.name()
        ),
    };
    let mut reference = WholeModel { model: reference, params: reference_params, dtype: rank.dtype };
    task.before_training(&mut Start { model: &mut reference, comm: &rank.comm, output: None, resuming: false })
}

/// What `ft generate` continues: text (through the model's tokenizer.json) or token ids.
pub enum Prompt<'a> {
    Text(&'a str),
    Ids(&'a [i64]),
}

/// How `ft generate` samples: `samples` continuations of the prompt, the
/// `i`-th drawn with seed `seed + i` (so one alone is drawn again by its seed).
pub struct Sampled {
    pub sampling: Sampling,
    pub seed: u64,
    pub samples: usize,
}

/// How `ft generate` is asked to sample, every option optional: the
/// `Sampling` options left out take its defaults, and with none of them
/// decoding is greedy.
#[derive(Default)]
pub struct SamplingRequest {
    pub temperature: Option<f64>,
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Default 0.
    pub seed: Option<u64>,
    /// Default 1.
    pub num_samples: Option<usize>,
}

impl SamplingRequest {
    /// The sampling asked for, checked (`option` names a field as the user
    /// gave it: `top_p` → `--top-p`), or None for greedy decoding, when a
    /// seed or a number of samples is refused rather than ignored.
    pub fn sampled(&self, option: impl Fn(&str) -> String) -> Result<Option<Sampled>> {
        let sampling_given = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some() || self.repetition_penalty.is_some();
        if !sampling_given {
            for (given, name) in [(self.seed.is_some(), "seed"), (self.num_samples.is_some(), "num_samples")] {
                if given {
                    let [temperature, top_k, top_p, min_p, penalty] = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"].map(&option);
                    bail!("{} is for sampling, and decoding is greedy without a sampling option: add {temperature} 1.0 (or {top_k}, {top_p}, {min_p}, {penalty})", option(name));
                }
            }
            return Ok(None);
        }
        let defaults = Sampling::default();
        let sampling = Sampling {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        };
        sampling.check(&option)?;
        if self.num_samples == Some(0) {
            bail!("{} must be at least 1", option("num_samples"));
        }
        Ok(Some(Sampled { sampling, seed: self.seed.unwrap_or(0), samples: self.num_samples.unwrap_or(1) }))
    }
}

/// `ft generate`: the trained model in `dir` continues `prompt` greedily,
/// or as `sampled` says, up to `max_new_tokens` or `eos` (default:
/// config.json's eos_token_id); each continuation as text, or for ids as
/// their JSON list.
pub fn generate(dir: &Path, prompt: Prompt, max_new_tokens: usize, eos: Option<i64>, sampled: Option<&Sampled>, dtype: Kind, device: Device) -> Result<Vec<String>> {
    let (ids, tokenizer): (Vec<i64>, _) = match prompt {
        Prompt::Text(text) => {
            let tokenizer = hf::load_tokenizer(dir)?;
            let encoding = tokenizer.encode(text, false).map_err(anyhow::Error::msg)?;
            (encoding.get_ids().iter().map(|&id| id as i64).collect(), Some(tokenizer))
        }
        Prompt::Ids(ids) => (ids.to_vec(), None),
    };
    let (model, params) = load_trained(dir, dtype, device)?;
    let eos = eos.or_else(|| model.model().hf_config()["eos_token_id"].as_i64());
    let decoding = Decoding::greedy(max_new_tokens, eos, dtype);
    let continuations = match sampled {
        None => greedy_batch(model.model(), &params, &[ids], &decoding)?,
        Some(Sampled { sampling, seed, samples }) => {
            let seeds: Vec<u64> = (0..*samples as u64).map(|i| seed.wrapping_add(i)).collect();
            sample_batch(model.model(), &params, &vec![ids; *samples], &seeds, sampling, &decoding)?
        }
    };
    continuations
        .iter()
        .map(|tokens| match &tokenizer {
            Some(tokenizer) => tokenizer.decode(&tokens.iter().map(|&t| t as u32).collect::<Vec<_>>(), true).map_err(anyhow::Error::msg),
            None => Ok(serde_json::to_string(tokens)?),
        })
        .collect()
}

/// `ft forward`: the trained model in `dir` on the token id rows in the
/// JSON file `ids` (`[[id, ...], ...]`); its logits and LM loss (labels =
/// ids), and with `grads` every parameter's gradient, written to the
/// safetensors file `out`. Returns the loss.
pub fn forward(dir: &Path, ids: &Path, out: &Path, grads: bool, dtype: Kind, device: Device) -> Result<f64> {
    let text = std::fs::read_to_string(ids).with_context(|| format!("cannot read {}", ids.display()))?;
    let rows: Vec<Vec<i64>> = serde_json::from_str(&text).with_context(|| format!("{} must hold [[id, ...], ...]", ids.display()))?;
    let (model, params) = load_trained(dir, dtype, device)?;
    let tensors = ft_core::train::loss::lm_inspection(model.model(), &params, &rows, dtype, grads)?;
    Tensor::write_safetensors(&tensors, out).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(tensors.iter().find(|(name, _)| name == "loss").map_or(f64::NAN, |(_, t)| t.double_value(&[])))
}
