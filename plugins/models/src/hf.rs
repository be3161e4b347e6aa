//! Hugging Face model directories: `config.json`, `model.safetensors` or a
//! sharded `model.safetensors.index.json`, `tokenizer.json`; hub ids resolve
//! through the local cache only (ft never downloads).

use crate::check;
use anyhow::{bail, Context as _, Result};
use ft_core::config::{Config, ModelInit};
use ft_core::lora::RunModel;
use ft_core::model::Model;
use ft_core::train::InitialParams;
use ft_core::nf4;
use ft_core::Communicator;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A directory, or a hub id (`org/name`) found in the local Hugging Face
/// cache; a model's config.json stands for the directory it lies in.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    let path = PathBuf::from(spec);
    if path.is_dir() {
        return Ok(path);
    }
    if path.is_file() && path.file_name().is_some_and(|name| name == "config.json") {
        return Ok(directory_of(&path));
    }
    if path.exists() {
        bail!("{spec} is a file; give the model's directory (with config.json and *.safetensors)");
    }
    let cache = match (std::env::var_os("HF_HUB_CACHE"), std::env::var_os("HF_HOME"), std::env::var_os("HOME")) {
        (Some(hub), _, _) => PathBuf::from(hub),
        (None, Some(home), _) => PathBuf::from(home).join("hub"),
        (None, None, Some(home)) => PathBuf::from(home).join(".cache/huggingface/hub"),
        _ => PathBuf::from(".cache/huggingface/hub"),
    };
    let entry = cache.join(format!("models--{}", spec.replace('/', "--")));
    let snapshot = std::fs::read_to_string(entry.join("refs/main"))
        .map(|hash| entry.join("snapshots").join(hash.trim()))
        .ok()
        .filter(|dir| dir.is_dir())
        .or_else(|| {
            let mut dirs: Vec<PathBuf> =
                std::fs::read_dir(entry.join("snapshots")).ok()?.flatten().map(|e| e.path()).collect();
            dirs.sort();
            dirs.pop()
        });
    snapshot.with_context(|| {
        format!(
            "model {spec:?} not found locally: it is not a directory and the Hugging Face cache has no {} \
             (ft never downloads: fetch it where there is network, or pass a directory)",
            entry.display()
        )
    })
}

/// The directory `file` lies in (`.` for a bare file name).
fn directory_of(file: &Path) -> PathBuf {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
    read_json_object(&dir.join("config.json"))
}

fn read_json_object(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    if !config.is_object() {
        bail!("{} must hold a JSON object", path.display());
    }
    Ok(config)
}

/// Builds the architecture named by config.json's `model_type`.
pub fn model_from_config(config: serde_json::Value) -> Result<Box<dyn Model>> {
    build_model(config, Path::new("config.json"))
}

/// [`model_from_config`] for a config read from `origin`: a refusal is one
/// line naming the file, the key and the rule, e.g. `…/config.json (bloom):
/// hidden_size (64) must be a multiple of n_head (3)`.
pub(crate) fn build_model(config: serde_json::Value, origin: &Path) -> Result<Box<dyn Model>> {
    let origin = origin.display();
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .with_context(|| format!("{origin} has no \"model_type\""))?
        .to_string();
    let registry = ft_core::Registry::builtin();
    let registration = registry.model(&model_type).map_err(|unknown| match multimodal_text_model(&config, &registry) {
        // Gemma 3 from 4B up, Mistral 3, LLaVA: a text model ft knows under a
        // vision tower, whose weights are named for the whole model.
        Some(text_type) => unknown.context(format!(
            "{origin}: `{model_type}` is a multimodal model whose text_config is `{text_type}`, which ft trains, \
             but ft reads only text models' checkpoints (a `{text_type}` config.json and its weights)"
        )),
        None => unknown.context(origin.to_string()),
    })?;
    let build = registration.build;
    let model = build(config).with_context(|| format!("{origin} ({model_type})"))?;
    check::parameters(model.units()).with_context(|| format!("{origin} ({model_type})"))?;
    Ok(model)
}

/// The registered `model_type` of `config`'s `text_config`, where it has one.
fn multimodal_text_model(config: &serde_json::Value, registry: &ft_core::Registry) -> Option<String> {
    let text_type = config.get("text_config")?.get("model_type")?.as_str()?;
    registry.model(text_type).ok().map(|_| text_type.to_string())
}

/// A model to start from: a config.json alone (random weights), or a
/// directory (its weights, when it has them).
pub struct ModelSource {
    pub config: serde_json::Value,
    pub dir: Option<PathBuf>,
    /// The file `config` was read from (None: made in memory, as the demo's).
    pub config_file: Option<PathBuf>,
}

impl ModelSource {
    /// A config.json file, a model directory, or a hub id in the local cache.
    pub fn resolve(spec: &str) -> Result<ModelSource> {
        let path = Path::new(spec);
        if path.is_file() {
            return Ok(ModelSource { config: read_json_object(path)?, dir: None, config_file: Some(path.into()) });
        }
        let dir = resolve(spec)?;
        Ok(ModelSource { config: read_config(&dir)?, config_file: Some(dir.join("config.json")), dir: Some(dir) })
    }

    /// Applies `KEY=VALUE` assignments to the config (VALUE as JSON, else as
    /// a string): `--set num_hidden_layers=2`. Each must change a key the
    /// config holds: any other (a misspelling, a run's `train.*` key) would
    /// change nothing, and is refused by name with the closest key.
    pub fn set_keys(mut self, assignments: &[String]) -> Result<ModelSource> {
        let origin = self.config_file.as_ref().map_or("the model's config".to_string(), |file| file.display().to_string());
        for assignment in assignments {
            let (key, value) = assignment.split_once('=').with_context(|| format!("--set {assignment:?} is not KEY=VALUE"))?;
            let config = self.config.as_object_mut().context("a model config is a JSON object")?;
            if !config.contains_key(key) {
                let section = key.split_once('.').map(|(section, _)| section);
                let hint = match section.filter(|s| ft_core::config::SECTIONS.contains(s)) {
                    Some(_) => format!(" (`{key}` is a key of `ft train`'s configuration, which this command does not read)"),
                    None => {
                        let known: Vec<&str> = config.keys().map(String::as_str).collect();
                        ft_core::names::did_you_mean(key, &known)
                    }
                };
                bail!(
                    "--set {assignment}: {origin} has no key `{key}`{hint}; this command's --set changes the keys of the model's config.json \
                     (to add one it lacks, write it into a copy of the file)"
                );
            }
            config.insert(key.to_string(), serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::from(value)));
        }
        Ok(self)
    }

    /// The directory its files lie in (tokenizer.json, the weights): the
    /// model directory, or the one its config.json is in (None: a config
    /// made in memory, as the demo's).
    pub fn files_dir(&self) -> Option<PathBuf> {
        self.dir.clone().or_else(|| self.config_file.as_deref().map(directory_of))
    }

    /// The tokenizer.json a command reads: `given` (data.tokenizer,
    /// --tokenizer), else the one in the model's directory.
    pub fn tokenizer(&self, given: Option<&Path>) -> Result<PathBuf> {
        match (given, self.files_dir()) {
            (Some(path), _) => Ok(path.to_path_buf()),
            (None, Some(dir)) => Ok(dir.join("tokenizer.json")),
            (None, None) => bail!("set data.tokenizer (--tokenizer): this model's config is made in memory, with no directory to find tokenizer.json in"),
        }
    }

    /// The model its config describes; a refusal names the file.
    pub fn model(&self) -> Result<Box<dyn Model>> {
        build_model(self.config.clone(), self.config_file.as_deref().unwrap_or(Path::new("config.json")))
    }
}

/// What a run's parameters start from.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// The weights in this directory.
    Weights(PathBuf),
    /// A random initialisation; why, for the log.
    Random(String),
}

impl Start {
    pub fn weights_dir(&self) -> Option<&Path> {
        match self {
            Start::Weights(dir) => Some(dir),
            Start::Random(_) => None,
        }
    }
}

impl ModelSource {
    /// What a run starts from under `init` (`model.init`): a directory's
    /// weights, which it must hold (never random weights in their place);
    /// random for a config.json alone, a preset's model, or `random`.
    pub fn start(&self, init: ModelInit) -> Result<Start> {
        // A config.json given alone: the weights in its directory, if any.
        let weights_beside = self.files_dir().filter(|dir| self.dir.is_none() && weight_files(dir).is_ok());
        let weightless = match (&self.config_file, &weights_beside) {
            (Some(file), Some(_)) => format!("--model {} is a config.json (--init pretrained reads the weights beside it)", file.display()),
            (Some(file), None) => format!("--model {} is a config.json alone, without weights", file.display()),
            (None, _) => "the preset's model comes without weights".to_string(),
        };
        match (init, &self.dir) {
            (ModelInit::Random, Some(dir)) => Ok(Start::Random(format!("model.init is random (--init random): the weights in {} are not read", dir.display()))),
            (ModelInit::Random, None) => Ok(Start::Random("model.init is random (--init random)".into())),
            (_, Some(dir)) => {
                weight_files(dir).map_err(|e| {
                    anyhow::anyhow!("{e:#}\n(to train from random weights instead, give its config.json as --model, or --init random)")
                })?;
                Ok(Start::Weights(dir.clone()))
            }
            (ModelInit::Pretrained, None) => match weights_beside {
                Some(dir) => Ok(Start::Weights(dir)),
                None => bail!("model.init is pretrained (--init pretrained), but {weightless}: give the model directory that holds them"),
            },
            (ModelInit::Auto, None) => Ok(Start::Random(weightless)),
        }
    }
}

impl ModelSource {
    /// The model a run trains (`model.source`): a preset's, once its files
    /// are ready (`setup::prepare_preset`, which points `config` at them;
    /// collective), else the directory, config.json or hub id it names.
    pub fn of_run(config: &mut Config, comm: &Communicator) -> Result<ModelSource> {
        Ok(match ft_core::setup::prepare_preset(config, comm)? {
            Some(model_config) => ModelSource { config: model_config, dir: None, config_file: None },
            None => ModelSource::resolve(&config.model.source)?,
        })
    }
}

/// What `ft train` refuses of a run's model before any rank starts, so it
/// is said once: a model directory without its weights, and an expert
/// parallelism its experts cannot be split by (over `world` ranks). A
/// preset's model is made, and checked, by the ranks.
pub fn check_before_ranks(config: &Config, world: usize) -> Result<()> {
    if config.uses_preset() {
        return Ok(());
    }
    let source = ModelSource::resolve(&config.model.source)?;
    source.start(config.model.init)?;
    if config.train.expert_parallel > 1 {
        let run_model = RunModel::new(source.model()?, &config.train.lora, config.model.quantization())?;
        ft_core::setup::check_expert_parallel(config.train.expert_parallel, world, run_model.model())?;
    }
    Ok(())
}

/// The parameters a run starts from, a unit at a time (the trainer places
/// each before asking for the next), fp32 on `device`: the base's — the
/// weights `start` names, read from their files as each unit is asked for,
/// or a random initialisation from `seed`, drawn in unit order — then a
/// LoRA run's fresh adapters, drawn from `seed + 1`.
pub struct StartingParams<'a> {
    run: &'a RunModel,
    weights: Option<WeightReader>,
    seed: i64,
    device: Device,
    adapters: Vec<Vec<Tensor>>,
}

impl<'a> StartingParams<'a> {
    /// Checks the weights `start` names against the model (every name and shape) before anything is read.
    pub fn new(run: &'a RunModel, start: &Start, seed: i64, device: Device) -> Result<StartingParams<'a>> {
        let weights = start.weights_dir().map(|dir| WeightReader::open(run.base(), dir)).transpose()?;
        Ok(StartingParams { run, weights, seed, device, adapters: vec![] })
    }
}

impl InitialParams for StartingParams<'_> {
    fn unit(&mut self, unit: usize) -> Result<Vec<Tensor>> {
        let base = self.run.base();
        let base_units = base.units().len();
        if unit >= base_units {
            let lora = self.run.lora().context("a model without adapters has only its own units")?;
            if unit == base_units {
                self.adapters = lora.initial_adapters(self.seed.wrapping_add(1), self.device);
            }
            return Ok(std::mem::take(&mut self.adapters[unit - base_units]));
        }
        match &self.weights {
            Some(reader) => reader.unit(base, unit, Kind::Float, self.device),
            None => {
                // Seeded at the first unit, so the draws are those of `init_params`.
                if unit == 0 {
                    tch::manual_seed(self.seed);
                }
                Ok(base.units()[unit].params.iter().map(|spec| spec.initial(Kind::Float, self.device)).collect())
            }
        }
    }
}

/// Where a run's base weights are, for its checkpoints and adapter to
/// name: the directory `start` read; for a LoRA run on a randomly
/// initialised base (a config.json alone, the demo, `--init random`), that
/// base — drawn from `seed` on `device` exactly as the run's
/// `StartingParams` draw it (a GPU's generator is not the CPU's), written
/// by rank 0 in `dtype` to `output`/base-model a file at a time, so its
/// adapters have the weights they adapt; else none. Every rank calls it.
pub fn base_weights_dir(run: &RunModel, start: &Start, seed: i64, device: Device, output: &Path, dtype: Kind, comm: &Communicator) -> Result<Option<PathBuf>> {
    if let Some(dir) = start.weights_dir() {
        return Ok(Some(dir.to_path_buf()));
    }
    if run.lora().is_none() {
        return Ok(None);
    }
    let dir = output.join("base-model");
    if comm.env().rank == 0 {
        let mut params = StartingParams::new(run, start, seed, device)?;
        write_model(run.base(), &dir, dtype, DEFAULT_MAX_SHARD_BYTES, |unit| params.unit(unit))?;
    }
    comm.world().barrier()?.wait()?;
    Ok(Some(dir))
}

pub fn load_model(dir: &Path) -> Result<Box<dyn Model>> {
    build_model(read_config(dir)?, &dir.join("config.json"))
}

/// The safetensors files that hold `dir`'s weights: `model.safetensors`,
/// or every shard its `model.safetensors.index.json` names. A directory
/// without them is refused, with the command that converts PyTorch `.bin`
/// weights when it holds those: what every command that reads weights checks.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return Ok(vec![single]);
    }
    if index.is_file() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json["weight_map"].as_object().with_context(|| format!("{} has no weight_map", index.display()))?;
        let names: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        let missing: Vec<&str> = names.iter().copied().filter(|name| !dir.join(name).is_file()).collect();
        if !missing.is_empty() {
            bail!("{} names weight files that are not in {}: {}", index.display(), dir.display(), missing.join(", "));
        }
        return Ok(names.into_iter().map(|name| dir.join(name)).collect());
    }
    let mut pytorch: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| entries.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|name| name.starts_with("pytorch_model") && name.ends_with(".bin")).collect())
        .unwrap_or_default();
    pytorch.sort();
    if pytorch.is_empty() {
        bail!("{} has no model.safetensors or model.safetensors.index.json: it holds no weights", dir.display());
    }
    // The architecture's own class keeps its head (AutoModel would save the base model alone).
    let class = read_config(dir)
        .ok()
        .and_then(|config| config["architectures"][0].as_str().map(String::from))
        .filter(|name| name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or_else(|| "AutoModelForCausalLM".into());
    let quoted = format!("{:?}", dir.display().to_string()).replace('"', "'");
    bail!(
        "{} holds PyTorch weights ({}), which ft does not read (pickle files can run code); convert them to safetensors once, in place:\n  \
         python -c \"from transformers import {class}; {class}.from_pretrained({quoted}).save_pretrained({quoted}, safe_serialization=True)\"",
        dir.display(),
        pytorch.join(", ")
    )
}

/// The safetensors files of a directory, memory-mapped.
struct WeightFiles {
    files: Vec<(PathBuf, Mmap)>,
}

impl WeightFiles {
    fn open(dir: &Path) -> Result<WeightFiles> {
        let paths = weight_files(dir)?;
        let mut files = vec![];
        for path in paths {
            let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the file is only read; a concurrent writer would be a user error caught by the header check.
            let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
            SafeTensors::deserialize(&map)
                .map_err(|e| anyhow::anyhow!("{} is not a valid safetensors file (truncated or corrupt?): {}", path.display(), describe(&e)))?;
            files.push((path, map));
        }
        Ok(WeightFiles { files })
    }

    /// Drops this process's mappings of the pages read so far: a copied
    /// tensor's pages would otherwise stay in its resident memory until the
    /// files close, so reading unit by unit would end with the whole
    /// checkpoint resident. The page cache keeps them; a later read maps
    /// them again.
    fn forget_read_pages(&self) {
        for (path, map) in &self.files {
            // SAFETY: the mapping is shared and read-only, so dropping its
            // pages loses nothing: the next read faults them in from the file.
            if let Err(error) = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) } {
                tracing::debug!("madvise(DONTNEED) on {}: {error}", path.display());
            }
        }
    }

    fn tensors(&self) -> Vec<(&Path, SafeTensors<'_>)> {
        self.files
            .iter()
            .map(|(path, map)| (path.as_path(), SafeTensors::deserialize(map).expect("validated in open")))
            .collect()
    }
}

/// What is wrong with a safetensors file, in words (the crate's own
/// message is its variant's name).
fn describe(error: &SafeTensorError) -> String {
    match error {
        SafeTensorError::HeaderTooSmall => "shorter than the 8 bytes that give its header's length".into(),
        SafeTensorError::HeaderTooLarge => "its header length (the first 8 bytes) is over 100 MB".into(),
        SafeTensorError::InvalidHeaderLength => "its header length (the first 8 bytes) runs past the end of the file".into(),
        SafeTensorError::InvalidHeader => "its header is not UTF-8 text".into(),
        SafeTensorError::InvalidHeaderStart | SafeTensorError::InvalidHeaderDeserialization => {
            "its header is not JSON mapping each tensor to a known dtype, a shape and data_offsets".into()
        }
        SafeTensorError::InvalidOffset(name) => format!("the data_offsets of {name} do not start where the previous tensor ends"),
        SafeTensorError::TensorInvalidInfo => "a tensor's data_offsets span a different number of bytes than its shape and dtype need".into(),
        SafeTensorError::MetadataIncompleteBuffer => "the tensors' data_offsets do not end at the end of the file".into(),
        SafeTensorError::ValidationOverflow => "a tensor's shape has more elements than memory can address".into(),
        other => format!("{other:?}"),
    }
}

/// A tensor of the file as stored: weights, or a 4-bit weight's packed bytes and statistics (uint8).
fn stored_tensor(view: &safetensors::tensor::TensorView<'_>) -> Result<Tensor> {
    let kind = match view.dtype() {
        Dtype::U8 => Kind::Uint8,
        other => kind_of(other)?,
    };
    let shape: Vec<i64> = view.shape().iter().map(|d| *d as i64).collect();
    Ok(Tensor::f_from_data_size(view.data(), &shape, kind)?)
}

fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        other => bail!("tensor dtype {other:?} is not a floating-point weight type"),
    })
}

/// Names a checkpoint may hold that no model parameter reads.
fn ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq") || name.ends_with(".attn.masked_bias") || name.ends_with(".attn.bias")
}

/// What loading did besides reading the model's tensors: how a base
/// model's checkpoint was fitted to a model with a task head.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters the checkpoint lacks, initialised from their `Init`
    /// (`Model::initialised_if_missing`), by Hugging Face name.
    pub initialised: Vec<String>,
    /// Checkpoint tensors no parameter reads, skipped
    /// (`Model::ignored_if_unexpected`), by their name in the file.
    pub ignored: Vec<String>,
    /// Weights stored as bitsandbytes' 4-bit blocks (a checkpoint
    /// transformers saved quantized), read dequantized as bitsandbytes
    /// dequantizes them, by name.
    pub dequantized: Vec<String>,
}

/// Seed of the parameters a checkpoint lacks: every rank, and every run,
/// starts from the same head.
const MISSING_PARAMS_SEED: i64 = 0;

/// The names a parameter may have in a checkpoint, in the order tried: its
/// own; transformers 5's for Mixtral's sparse block; without the base model's prefix (BloomModel, OPTModel, BertModel …
/// drop "transformer." / "model." / "bert."); and either of those with the
/// TF-era `LayerNorm.gamma` / `LayerNorm.beta` for `.weight` / `.bias`,
/// which bert-base-uncased's hub weights still use (transformers renames
/// them on load: the "legacy" renamings of its conversion_mapping.py).
fn checkpoint_names(hf_name: &str) -> Vec<String> {
    let mut names = vec![hf_name.to_string()];
    // transformers 5 names Mixtral's sparse block `mlp` (its fused experts, saved from memory).
    names.extend(hf_name.contains(".block_sparse_moe.").then(|| hf_name.replace(".block_sparse_moe.", ".mlp.")));
    names.extend(hf_name.split_once('.').map(|(_, rest)| rest.to_string()));
    let legacy: Vec<String> = names
        .iter()
        .filter_map(|name| {
            let weight = name.strip_suffix("LayerNorm.weight").map(|stem| format!("{stem}LayerNorm.gamma"));
            weight.or_else(|| name.strip_suffix("LayerNorm.bias").map(|stem| format!("{stem}LayerNorm.beta")))
        })
        .collect();
    names.extend(legacy);
    names
}

/// Reads every parameter of `model` from `dir`, as `dtype` on `device`, in
/// unit order. All problems (missing, unexpected, mis-shaped tensors) are
/// reported together, by name and shape.
pub fn load_params(model: &dyn Model, dir: &Path, dtype: Kind, device: Device) -> Result<Vec<Vec<Tensor>>> {
    load_params_with_report(model, dir, dtype, device).map(|(params, _)| params)
}

/// [`load_params`], which also initialises the parameters the model allows a
/// checkpoint to lack (re-seeding tch's global generator) and skips the
/// tensors it allows a checkpoint to have extra: a task head over a base
/// model's checkpoint. Both are logged in one warning and returned.
pub fn load_params_with_report(
    model: &dyn Model,
    dir: &Path,
    dtype: Kind,
    device: Device,
) -> Result<(Vec<Vec<Tensor>>, LoadReport)> {
    let reader = WeightReader::open(model, dir)?;
    let params = (0..model.units().len()).map(|unit| reader.unit(model, unit, dtype, device)).collect::<Result<_>>()?;
    Ok((params, reader.report))
}

/// Where one parameter's starting values come from.
enum ParamSource {
    /// A tensor of the checkpoint, by its name there.
    Stored(String),
    /// A weight stored as bitsandbytes' 4-bit blocks, by the packed tensor's name.
    Quantized(String),
    /// A fused experts' tensor stored per expert (the Hub's layout,
    /// `moe::hub_parts`): per expert, the tensors concatenated along the rows.
    Parts(Vec<Vec<String>>),
    /// Not in the checkpoint, and the model allows that: its `Init`.
    Initialised,
}

/// A model directory's weights, checked whole against the model from the
/// files' headers (every name and shape: all problems reported together,
/// before anything is read), then read a unit at a time, so a caller that
/// places each unit before asking for the next (`train::InitialParams`)
/// never holds the whole model.
pub struct WeightReader {
    dir: PathBuf,
    files: WeightFiles,
    /// Per unit, per parameter.
    sources: Vec<Vec<ParamSource>>,
    pub report: LoadReport,
    /// Whether the generator has been seeded for the first initialised parameter.
    seeded: std::cell::Cell<bool>,
}

impl WeightReader {
    pub fn open(model: &dyn Model, dir: &Path) -> Result<WeightReader> {
        let files = WeightFiles::open(dir)?;
        let tensors = files.tensors();
        let mut available: BTreeMap<String, (&Path, safetensors::tensor::TensorView<'_>)> = BTreeMap::new();
        for (path, file) in &tensors {
            for (name, view) in file.tensors() {
                if let Some((first, _)) = available.insert(name.clone(), (*path, view)) {
                    bail!("tensor {name} is in both {} and {}: a checkpoint holds each tensor once", first.display(), path.display());
                }
            }
        }
        let mut used = BTreeSet::new();
        let (mut missing, mut misshapen) = (vec![], vec![]);
        let mut report = LoadReport::default();
        let mut sources = vec![];
        for unit in model.units() {
            let mut unit_sources = vec![];
            for spec in &unit.params {
                let name = checkpoint_names(&spec.hf_name).into_iter().find(|n| available.contains_key(n));
                let parts = spec.shape.first().and_then(|&experts| crate::moe::hub_parts(&spec.hf_name, experts));
                if let (None, Some(parts)) = (&name, parts) {
                    // The Hub's per-expert tensors: each [rows / parts, columns] of the fused [experts, rows, columns].
                    let shape = [spec.shape[1] / parts[0].len() as i64, spec.shape[2]];
                    let absent: Vec<&String> = parts.iter().flatten().filter(|part| !available.contains_key(*part)).collect();
                    if absent.len() == parts.iter().flatten().count() {
                        missing.push(format!("{} {:?} (or per expert: {} … {}, each {shape:?})", spec.hf_name, spec.shape, absent[0], absent[absent.len() - 1]));
                        continue;
                    }
                    let mut found = absent.is_empty();
                    missing.extend(absent.iter().map(|part| format!("{part} {shape:?}")));
                    for part in parts.iter().flatten() {
                        let Some((path, view)) = available.get(part) else { continue };
                        let stored: Vec<i64> = view.shape().iter().map(|d| *d as i64).collect();
                        if stored != shape {
                            misshapen.push(format!("{part}: {stored:?} in {}, expected {shape:?}", path.display()));
                            found = false;
                        }
                        kind_of(view.dtype()).with_context(|| format!("{part} in {}", path.display()))?;
                        used.insert(part.clone());
                    }
                    if found {
                        unit_sources.push(ParamSource::Parts(parts));
                    }
                    continue;
                }
                let Some(name) = name else {
                    if model.initialised_if_missing(&spec.hf_name) {
                        unit_sources.push(ParamSource::Initialised);
                        report.initialised.push(spec.hf_name.clone());
                    } else {
                        missing.push(format!("{} {:?}", spec.hf_name, spec.shape));
                    }
                    continue;
                };
                let (path, view) = &available[&name];
                if [nf4::QuantType::Nf4, nf4::QuantType::Fp4].iter().any(|&t| available.contains_key(&nf4::state_key(&name, t))) {
                    // The packed bytes and their statistics, as transformers saves a bitsandbytes 4-bit weight (its shape is checked as it is read).
                    let prefix = format!("{name}.");
                    used.extend(available.keys().filter(|key| **key == name || key.starts_with(&prefix)).cloned());
                    report.dequantized.push(name.clone());
                    unit_sources.push(ParamSource::Quantized(name));
                    continue;
                }
                let shape: Vec<i64> = view.shape().iter().map(|d| *d as i64).collect();
                if shape != spec.shape {
                    misshapen.push(format!("{name}: {:?} in {}, expected {:?}", shape, path.display(), spec.shape));
                    continue;
                }
                kind_of(view.dtype()).with_context(|| format!("{name} in {}", path.display()))?;
                used.insert(name.clone());
                unit_sources.push(ParamSource::Stored(name));
            }
            sources.push(unit_sources);
        }
        let tied_head_copy = |name: &str| name == "lm_head.weight" && !model.units().iter().flat_map(|u| &u.params).any(|p| p.hf_name == name);
        let mut unexpected = vec![];
        for (name, (_, view)) in &available {
            if used.contains(name) || ignorable(name) || tied_head_copy(name) {
                continue;
            }
            if model.ignored_if_unexpected(name) {
                report.ignored.push(name.clone());
            } else {
                unexpected.push(format!("{name} {:?}", view.shape()));
            }
        }
        if !missing.is_empty() || !misshapen.is_empty() || !unexpected.is_empty() {
            let mut message = format!("the weights in {} do not fit the {} model its config.json describes:", dir.display(), model.model_type());
            for (what, list) in [("missing", &missing), ("wrong shape", &misshapen), ("unexpected", &unexpected)] {
                if !list.is_empty() {
                    message += &format!("\n  {what} ({}): {}", list.len(), list.join(", "));
                }
            }
            bail!(message);
        }
        if let Some(first) = report.dequantized.first() {
            tracing::info!(
                "{}: {} weights are bitsandbytes 4-bit blocks (the first: {first}), read dequantized as bitsandbytes dequantizes them; \
                 --quantize (with --lora-r) holds a LoRA run's base in 4 bits again, quantized anew from these values",
                dir.display(),
                report.dequantized.len()
            );
        }
        if !report.initialised.is_empty() || !report.ignored.is_empty() {
            tracing::warn!(
                "loading {} into a {} model: initialised {} (not in the checkpoint: random until trained); \
                 ignored {} (other heads' weights)",
                dir.display(),
                model.model_type(),
                list_or_none(&report.initialised),
                list_or_none(&report.ignored),
            );
        }
        drop(tensors);
        Ok(WeightReader { dir: dir.to_path_buf(), files, sources, report, seeded: std::cell::Cell::new(false) })
    }

    /// Unit `unit`'s parameters of `model` (the model `open` checked), as `dtype` on `device`.
    pub fn unit(&self, model: &dyn Model, unit: usize, dtype: Kind, device: Device) -> Result<Vec<Tensor>> {
        let params = self.read_unit(model, unit, dtype, device);
        self.files.forget_read_pages();
        params
    }

    fn read_unit(&self, model: &dyn Model, unit: usize, dtype: Kind, device: Device) -> Result<Vec<Tensor>> {
        let tensors = self.files.tensors();
        let find = |name: &str| tensors.iter().find_map(|(path, file)| file.tensor(name).ok().map(|view| (*path, view)));
        model.units()[unit]
            .params
            .iter()
            .zip(&self.sources[unit])
            .map(|(spec, source)| match source {
                ParamSource::Initialised => {
                    if !self.seeded.replace(true) {
                        tch::manual_seed(MISSING_PARAMS_SEED);
                    }
                    Ok(spec.initial(dtype, device))
                }
                ParamSource::Quantized(name) => {
                    let part = |key: &str| find(key).and_then(|(_, view)| stored_tensor(&view).ok());
                    let context = || format!("{name} in {}", self.dir.display());
                    let quantized = nf4::Quantized4bit::from_state_dict(name, part).with_context(context)?;
                    if quantized.state.shape != spec.shape {
                        bail!("the weights in {} do not fit the {} model: {name} is {:?} (4-bit), expected {:?}", self.dir.display(), model.model_type(), quantized.state.shape, spec.shape);
                    }
                    Ok(quantized.dequantize().to_kind(dtype).to_device(device))
                }
                ParamSource::Parts(parts) => {
                    let read = |name: &String| -> Result<Tensor> {
                        let (path, view) = find(name).with_context(|| format!("{name} is no longer in {}", self.dir.display()))?;
                        stored_tensor(&view).and_then(|t| Ok(t.f_to_kind(dtype)?)).with_context(|| format!("{name} in {}", path.display()))
                    };
                    let experts = parts.iter().map(|expert| Ok(Tensor::cat(&expert.iter().map(read).collect::<Result<Vec<_>>>()?, 0))).collect::<Result<Vec<_>>>()?;
                    Ok(Tensor::stack(&experts, 0).f_to_device(device)?)
                }
                ParamSource::Stored(name) => {
                    let (path, view) = find(name).with_context(|| format!("{name} is no longer in {}", self.dir.display()))?;
                    // The fallible calls: libtorch's refusal (an allocation, a device) becomes an error naming the tensor.
                    stored_tensor(&view)
                        .and_then(|t| Ok(t.f_to_kind(dtype)?.f_to_device(device)?))
                        .with_context(|| format!("{name} in {}", path.display()))
                }
            })
            .collect()
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Writes config.json and model.safetensors (HF names) in `dtype`. Each file
/// is written beside its final name and renamed, so a crash never leaves a
/// half-written file under the real name.
pub fn save(model: &dyn Model, params: &[Vec<Tensor>], dir: &Path, dtype: Kind) -> Result<()> {
    write_model(model, dir, dtype, DEFAULT_MAX_SHARD_BYTES, |unit| Ok(params[unit].iter().map(Tensor::shallow_clone).collect()))
}

/// `ft init-model`: `source`'s model with random weights drawn from
/// `seed`, written to `dir` (config.json, the weights in `dtype`); with a
/// `vocabulary` trained for it (`--train-tokenizer`: a BERT WordPiece
/// one), its tokenizer.json too, the model's vocab_size made its size.
pub fn write_random(mut source: ModelSource, seed: i64, dir: &Path, dtype: Kind, vocabulary: Option<tokenizers::Tokenizer>) -> Result<Box<dyn Model>> {
    if let Some(tokenizer) = &vocabulary {
        if source.config["model_type"] != "bert" {
            bail!("--train-tokenizer makes a BERT WordPiece vocabulary, and this config's model_type is {}", source.config["model_type"]);
        }
        source.config["vocab_size"] = tokenizer.get_vocab_size(true).into();
    }
    let model = source.model()?;
    let params = ft_core::model::init_params(model.as_ref(), seed, Kind::Float, Device::Cpu)?;
    save(model.as_ref(), &params, dir, dtype)?;
    if let Some(tokenizer) = vocabulary {
        tokenizer.save(dir.join("tokenizer.json"), true).map_err(anyhow::Error::msg)?;
    }
    Ok(model)
}

/// The tokenizer.json a command reads without building the model (`ft
/// tokenize`): data.tokenizer, else the one of the model `model.source`
/// names (no config.json is read); a preset's demo has none until a run writes it.
pub fn tokenizer_of(config: &Config) -> Result<PathBuf> {
    match &config.data.tokenizer {
        Some(path) => Ok(path.clone()),
        None if config.uses_preset() => bail!("give the model whose tokenizer to use: --model DIR (or --tokenizer FILE)"),
        None => Ok(resolve(&config.model.source)?.join("tokenizer.json")),
    }
}

/// Writes `tensors` as safetensors file `file`: beside it, fsynced, then
/// renamed, so a crash never leaves a half-written file under its name.
pub(crate) fn write_weights(tensors: &[(String, Tensor)], file: &Path) -> Result<()> {
    let partial = file.with_extension("safetensors.partial");
    Tensor::write_safetensors(tensors, &partial).with_context(|| format!("cannot write {}", partial.display()))?;
    File::open(&partial).and_then(|f| f.sync_all()).with_context(|| format!("cannot sync {}", partial.display()))?;
    std::fs::rename(&partial, file).with_context(|| format!("cannot write {}", file.display()))
}

/// The largest weights file `save` and `ft export` write: a bound on the
/// host memory an export holds (one file's tensors at a time).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Writes `model`'s config.json and weights in `dtype` into `dir`, asking
/// `unit_params` for one unit's parameters at a time: consecutive units fill
/// a file up to `max_shard_bytes` (a unit is never split, so a larger one is
/// a file alone), and only that file's tensors are in memory. One file is
/// `model.safetensors`; several are `model-0000k-of-0000n.safetensors` with
/// `model.safetensors.index.json`, as `save_pretrained` writes them.
pub fn write_model(
    model: &dyn Model,
    dir: &Path,
    dtype: Kind,
    max_shard_bytes: u64,
    mut unit_params: impl FnMut(usize) -> Result<Vec<Tensor>>,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut config = model.hf_config().clone();
    let dtype_name = serde_json::Value::from(match dtype {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    });
    // transformers 5 writes and reads "dtype"; older versions read only "torch_dtype".
    config["dtype"] = dtype_name.clone();
    config["torch_dtype"] = dtype_name;
    let units = model.units();
    let unit_bytes: Vec<u64> = units.iter().map(|u| u.numel() as u64 * dtype.elt_size_in_bytes() as u64).collect();
    let mut shards: Vec<std::ops::Range<usize>> = vec![];
    let mut shard_bytes = 0;
    for (unit, &bytes) in unit_bytes.iter().enumerate() {
        match shards.last_mut() {
            Some(last) if shard_bytes + bytes <= max_shard_bytes => last.end = unit + 1,
            _ => {
                shards.push(unit..unit + 1);
                shard_bytes = 0;
            }
        }
        shard_bytes += bytes;
    }
    let file_name = |k: usize| match shards.len() {
        1 => "model.safetensors".to_string(),
        n => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
    };
    let mut weight_map = serde_json::Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let mut named = vec![];
        for unit in shard.clone() {
            for (spec, tensor) in units[unit].params.iter().zip(unit_params(unit)?) {
                let tensor = tensor.to_kind(dtype).to_device(Device::Cpu);
                // Fused experts go out per expert, as save_pretrained writes them.
                let parts = spec.shape.first().and_then(|&experts| crate::moe::hub_parts(&spec.hf_name, experts));
                let pieces = match parts {
                    Some(parts) => parts
                        .iter()
                        .enumerate()
                        .flat_map(|(expert, names)| names.iter().cloned().zip(tensor.get(expert as i64).chunk(names.len() as i64, 0)))
                        .collect(),
                    None => vec![(spec.hf_name.clone(), tensor)],
                };
                for (name, piece) in pieces {
                    weight_map.insert(name.clone(), file_name(k).into());
                    named.push((name, piece.contiguous()));
                }
            }
        }
        write_weights(&named, &dir.join(file_name(k)))?;
    }
    // A loader takes model.safetensors before an index: neither may be left from an earlier save.
    let index = dir.join("model.safetensors.index.json");
    let stale = if shards.len() == 1 { index.clone() } else { dir.join("model.safetensors") };
    if stale.exists() {
        std::fs::remove_file(&stale).with_context(|| format!("cannot remove {}", stale.display()))?;
    }
    if shards.len() > 1 {
        let total: u64 = unit_bytes.iter().sum();
        let json = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(&index, serde_json::to_string_pretty(&json)? + "\n").with_context(|| format!("cannot write {}", index.display()))?;
    }
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    Ok(())
}

pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))
}
