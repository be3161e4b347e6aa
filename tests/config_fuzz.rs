//! A property test over every architecture: tiny models whose config.json
//! fields or safetensors headers are mutated (deterministically, from a
//! seed) go through loading and one forward pass. Nothing may panic, and
//! every refusal must be a short message that names the file or the key.

use ft_core::model::{forward, init_params, Inputs};
use ft_models::hf;
use serde_json::{json, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

const SEED: u64 = 0x0f7c_0ffe;
/// Mutations of 1-3 random keys to random values, per architecture, besides
/// every key set to every value of `replacements`.
const RANDOM_CONFIG_CASES: usize = 150;
/// Mutated weight files per architecture.
const WEIGHT_CASES: usize = 150;
const MIN_CASES: usize = 2000;
/// The longest refusal: a header line and the weights' three lists
/// (missing, wrong shape, unexpected).
const MAX_LINES: usize = 4;

/// Tiny valid configs, every key the architecture reads spelled out so that
/// each one is mutated (and removed).
fn tiny_configs() -> Vec<Value> {
    vec![
        json!({
            "model_type": "bloom", "hidden_size": 16, "n_layer": 2, "n_head": 4, "vocab_size": 64,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "apply_residual_connection_post_layernorm": false
        }),
        json!({
            "model_type": "opt", "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 64, "max_position_embeddings": 32, "word_embed_proj_dim": 8, "do_layer_norm_before": true,
            "_remove_final_layer_norm": false, "enable_bias": true, "layer_norm_elementwise_affine": true,
            "activation_function": "relu", "dropout": 0.1, "init_std": 0.02
        }),
        json!({
            "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "tie_word_embeddings": false,
            "attention_bias": false, "mlp_bias": false, "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // Llama 3.2's form: llama3 RoPE scaling (and its fallback length), tied head.
        json!({
            "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 64, "tie_word_embeddings": true,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            "attention_bias": false, "mlp_bias": false, "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // As transformers 5 writes it: rope_parameters, layer_types.
        json!({
            "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": true,
            "use_sliding_window": false, "layer_types": ["full_attention", "full_attention"], "hidden_act": "silu",
            "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // A window of 2, shorter than the forward pass's 4 tokens.
        json!({
            "model_type": "mistral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "sliding_window": 2, "tie_word_embeddings": false, "hidden_act": "silu",
            "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // Per-head q/k norms, head_dim apart from hidden / heads.
        json!({
            "model_type": "qwen3", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false,
            "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // Soft-capping, a window of 2 on layer 0.
        json!({
            "model_type": "gemma2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 8, "sliding_window": 2,
            "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "tie_word_embeddings": true, "attention_bias": false,
            "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // Local and global RoPE, the global one scaled.
        json!({
            "model_type": "gemma3_text", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 8, "sliding_window": 2,
            "sliding_window_pattern": 3, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "attn_logit_softcapping": null,
            "final_logit_softcapping": null, "use_bidirectional_attention": false, "tie_word_embeddings": true,
            "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        // LongRoPE on 6 of 8 features (Phi-4-mini's form), fused projections, a window.
        json!({
            "model_type": "phi3", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "max_position_embeddings": 64,
            "original_max_position_embeddings": 2, "sliding_window": 3,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0]},
            "tie_word_embeddings": true, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "hidden_act": "silu",
            "initializer_range": 0.02, "attention_dropout": 0.0
        }),
        json!({
            "model_type": "qwen3_moe", "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
            "output_router_logits": true, "router_aux_loss_coef": 0.01, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0,
            "attention_bias": false, "use_sliding_window": false
        }),
        json!({
            "model_type": "qwen2_moe", "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": false, "decoder_sparse_step": 2,
            "mlp_only_layers": [], "output_router_logits": true, "router_aux_loss_coef": 0.01, "qkv_bias": true,
            "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu", "use_sliding_window": false
        }),
        json!({
            "model_type": "olmoe", "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": false,
            "output_router_logits": true, "router_aux_loss_coef": 0.01, "clip_qkv": null, "attention_bias": false,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"
        }),
        json!({
            "model_type": "mixtral", "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 3,
            "output_router_logits": true, "router_aux_loss_coef": 0.01, "router_jitter_noise": 0.0, "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0, "tie_word_embeddings": false, "hidden_act": "silu"
        }),
        json!({
            "model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 32, "vocab_size": 64, "max_position_embeddings": 32, "type_vocab_size": 2,
            "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
            "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0, "is_decoder": false
        }),
    ]
}

/// Values a key is set to (None: the key is removed): zero, negative, huge,
/// not dividing 16, floats where ints go, wrong types.
fn replacements() -> Vec<Option<Value>> {
    let values = [
        json!(0),
        json!(-1),
        json!(-16),
        json!(1),
        json!(2),
        json!(3),
        json!(5),
        json!(7),
        json!(17),
        json!(1i64 << 40),
        json!(i64::MAX),
        json!(u64::MAX),
        json!(16.5),
        json!(2.0),
        json!(1e300),
        json!(-1e-9),
        json!("16"),
        json!(""),
        json!("linear"),
        Value::Null,
        json!(true),
        json!([]),
        json!({}),
    ];
    values.into_iter().map(Some).chain([None]).collect()
}

/// splitmix64: a few lines, and the same cases on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// The keys a mutation may touch: each top-level key, and each key of a
/// nested object as `outer.inner`.
fn mutable_keys(config: &Value) -> Vec<String> {
    let mut keys = vec![];
    for (key, value) in config.as_object().unwrap() {
        keys.push(key.clone());
        if let Some(inner) = value.as_object() {
            keys.extend(inner.keys().map(|k| format!("{key}.{k}")));
        }
    }
    keys
}

fn mutate(config: &mut Value, key: &str, value: &Option<Value>) {
    let (object, key) = match key.split_once('.') {
        Some((outer, inner)) => match config[outer].as_object_mut() {
            Some(object) => (object, inner),
            None => return, // an earlier mutation replaced the nested object
        },
        None => (config.as_object_mut().unwrap(), key),
    };
    match value {
        Some(value) => drop(object.insert(key.to_string(), value.clone())),
        None => drop(object.remove(key)),
    }
}

/// A safetensors file split into its header JSON and its data.
struct Weights {
    header: serde_json::Map<String, Value>,
    data: Vec<u8>,
}

impl Weights {
    fn parse(bytes: &[u8]) -> Weights {
        let length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = serde_json::from_slice(&bytes[8..8 + length]).unwrap();
        Weights { header, data: bytes[8 + length..].to_vec() }
    }

    /// The file with `header_text` as its header.
    fn with_header(&self, header_text: &str) -> Vec<u8> {
        let mut bytes = (header_text.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header_text.as_bytes());
        bytes.extend(&self.data);
        bytes
    }

    fn tensor_names(&self) -> Vec<String> {
        self.header.keys().filter(|k| *k != "__metadata__").cloned().collect()
    }
}

/// One mutated weights file: its bytes and what was done.
fn mutate_weights(original: &[u8], rng: &mut Rng) -> (Vec<u8>, String) {
    let weights = Weights::parse(original);
    let names = weights.tensor_names();
    let name = rng.pick(&names).clone();
    let header_length = original.len() - weights.data.len();
    let edit_entry = |field: &str, value: Value| {
        let mut header = weights.header.clone();
        header[&name][field] = value;
        weights.with_header(&Value::Object(header).to_string())
    };
    let info = &weights.header[&name];
    let (start, end) = (info["data_offsets"][0].as_u64().unwrap(), info["data_offsets"][1].as_u64().unwrap());
    match rng.below(9) {
        0 => {
            let at = rng.below(original.len());
            (original[..at].to_vec(), format!("truncated to {at} bytes"))
        }
        1 => {
            let (at, mask) = (rng.below(header_length), 1 + rng.below(255) as u8);
            let mut bytes = original.to_vec();
            bytes[at] ^= mask;
            (bytes, format!("header byte {at} xor {mask}"))
        }
        2 => {
            let (at, mask) = (header_length + rng.below(weights.data.len()), 1 + rng.below(255) as u8);
            let mut bytes = original.to_vec();
            bytes[at] ^= mask;
            (bytes, format!("data byte {at} xor {mask}"))
        }
        3 => {
            let mut shape: Vec<Value> = info["shape"].as_array().unwrap().clone();
            let dims = [json!(0), json!(1), json!(3), json!(1u64 << 62), json!(-1), json!("2")];
            match rng.below(3) {
                0 if !shape.is_empty() => {
                    let at = rng.below(shape.len());
                    shape[at] = rng.pick(&dims).clone();
                }
                1 => shape.push(json!(1)),
                _ => drop(shape.pop()),
            }
            let description = format!("{name} shape {shape:?}");
            (edit_entry("shape", Value::Array(shape)), description)
        }
        4 => {
            let dtypes = [json!("F16"), json!("BF16"), json!("F64"), json!("I64"), json!("I32"), json!("U8"), json!("BOOL"), json!("F8_E4M3"), json!("F17"), json!(3)];
            let dtype = rng.pick(&dtypes).clone();
            (edit_entry("dtype", dtype.clone()), format!("{name} dtype {dtype}"))
        }
        5 => {
            let offsets = [json!([start, end + 4]), json!([start + 1, end]), json!([end, start]), json!([0, 1u64 << 62]), json!([start]), Value::Null];
            let offsets = rng.pick(&offsets).clone();
            (edit_entry("data_offsets", offsets.clone()), format!("{name} data_offsets {offsets}"))
        }
        6 => {
            // A second entry under another tensor's name: JSON allows the text, a map keeps one.
            let other = rng.pick(&names).clone();
            let text = Value::Object(weights.header.clone()).to_string();
            let duplicate = format!("{},{:?}:{}}}", &text[..text.len() - 1], other, weights.header[&name]);
            (weights.with_header(&duplicate), format!("{name}'s entry repeated as {other}"))
        }
        7 => {
            let mut header = weights.header.clone();
            let entry = header.remove(&name).unwrap();
            if rng.below(2) == 0 {
                header.insert(format!("{name}.renamed"), entry);
            }
            (weights.with_header(&Value::Object(header).to_string()), format!("{name} renamed or removed"))
        }
        _ => {
            let lengths = [header_length as u64 - 7, header_length as u64 - 9, 0, u64::MAX, 200_000_000];
            let length = *rng.pick(&lengths);
            let mut bytes = original.to_vec();
            bytes[..8].copy_from_slice(&length.to_le_bytes());
            (bytes, format!("header length {length}"))
        }
    }
}

/// What the loader's users do: the model, its weights, one forward pass.
fn load_and_forward(dir: &Path) -> anyhow::Result<()> {
    let model = hf::load_model(dir)?;
    let params = hf::load_params(model.as_ref(), dir, Kind::Float, Device::Cpu)?;
    let inputs = Inputs::ids(&Tensor::from_slice2(&[[1i64, 5, 9, 63], [0, 2, 4, 6]]));
    let ctx = model.context(&inputs, 0, Kind::Float, true)?;
    forward(model.as_ref(), &params, &inputs, &ctx, None);
    Ok(())
}

/// One case's outcome: Ok, or what is wrong with it.
fn judge(dir: &Path, what: &str, keys: &[&str]) -> Result<bool, String> {
    match catch_unwind(AssertUnwindSafe(|| load_and_forward(dir))) {
        Err(payload) => {
            let message = payload.downcast_ref::<String>().cloned().or(payload.downcast_ref::<&str>().map(|s| s.to_string()));
            // The first line: libtorch's errors carry a C++ backtrace, its newlines escaped in unwrap's Debug text.
            let message = message.unwrap_or_default();
            let first_line = message.lines().next().unwrap_or_default().split("\\n").next().unwrap_or_default();
            Err(format!("{what}: panicked: {first_line}"))
        }
        Ok(Ok(())) => Ok(true),
        Ok(Err(error)) => {
            let message = format!("{error:#}");
            let names_file = message.contains("config.json") || message.contains("safetensors");
            // A config refusal names a mutated key; a weights refusal lists the tensors that do not fit.
            let names_cause = keys.is_empty() || message.contains("do not fit") || keys.iter().any(|key| message.contains(key));
            let clean = message.lines().count() <= MAX_LINES && !message.contains("Exception raised from") && !message.contains("frame #");
            if names_file && names_cause && clean {
                Ok(false)
            } else {
                Err(format!("{what}: unclear refusal: {message}"))
            }
        }
    }
}

#[test]
fn mutated_configs_and_weights_are_refused_clearly_and_never_panic() {
    tch::set_num_threads(1);
    let started = Instant::now();
    let mut rng = Rng(SEED);
    let (mut cases, mut loaded, mut failures) = (0, 0, vec![]);
    let mut record = |outcome: Result<bool, String>| {
        cases += 1;
        match outcome {
            Ok(ran) => loaded += usize::from(ran),
            Err(failure) => failures.push(failure),
        }
    };
    for config in tiny_configs() {
        let model_type = config["model_type"].as_str().unwrap().to_string();
        let dir = tempfile::tempdir().unwrap();
        let model = hf::model_from_config(config.clone()).unwrap();
        hf::save(model.as_ref(), &init_params(model.as_ref(), 0, Kind::Float, Device::Cpu).unwrap(), dir.path(), Kind::Float).unwrap();
        let config_path = dir.path().join("config.json");
        let weights_path = dir.path().join("model.safetensors");
        let (config_text, weights) = (std::fs::read_to_string(&config_path).unwrap(), std::fs::read(&weights_path).unwrap());
        assert_eq!(judge(dir.path(), &model_type, &[]), Ok(true), "the tiny {model_type} must load and run");

        let keys = mutable_keys(&config);
        let values = replacements();
        let mut config_cases: Vec<Vec<(&str, &Option<Value>)>> =
            keys.iter().flat_map(|key| values.iter().map(move |value| vec![(key.as_str(), value)])).collect();
        for _ in 0..RANDOM_CONFIG_CASES {
            let changes = 1 + rng.below(3);
            config_cases.push((0..changes).map(|_| (rng.pick(&keys).as_str(), rng.pick(&values))).collect());
        }
        for changes in config_cases {
            let mut mutated: Value = serde_json::from_str(&config_text).unwrap();
            for (key, value) in &changes {
                mutate(&mut mutated, key, value);
            }
            std::fs::write(&config_path, mutated.to_string()).unwrap();
            // A nested key is named by its outer key when the outer value is refused whole.
            let named: Vec<&str> = changes.iter().flat_map(|(key, _)| [*key, key.split('.').next().unwrap()]).collect();
            record(judge(dir.path(), &format!("{model_type} {changes:?}"), &named));
        }
        std::fs::write(&config_path, &config_text).unwrap();

        for _ in 0..WEIGHT_CASES {
            let (bytes, what) = mutate_weights(&weights, &mut rng);
            std::fs::write(&weights_path, bytes).unwrap();
            record(judge(dir.path(), &format!("{model_type} weights: {what}"), &[]));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("{cases} cases in {seconds:.1} s: {loaded} loaded and ran, {} refused", cases - loaded - failures.len());
    assert!(cases >= MIN_CASES, "only {cases} cases");
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures[..failures.len().min(30)].join("\n"));
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    let config = &tiny_configs()[0];
    let model = hf::model_from_config(config.clone()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    hf::save(model.as_ref(), &init_params(model.as_ref(), 0, Kind::Float, Device::Cpu).unwrap(), dir.path(), Kind::Float).unwrap();
    let tensors = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let mut weight_map = serde_json::Map::new();
    // Both shards hold the second tensor.
    for (file, part) in [("model-00001-of-00002.safetensors", &tensors[..2]), ("model-00002-of-00002.safetensors", &tensors[1..])] {
        Tensor::write_safetensors(part, dir.path().join(file)).unwrap();
        for (name, _) in part {
            weight_map.insert(name.clone(), file.into());
        }
    }
    let index = json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let message = format!("{:#}", hf::load_params(model.as_ref(), dir.path(), Kind::Float, Device::Cpu).unwrap_err());
    assert!(message.contains(&format!("tensor {} is in both", tensors[1].0)), "{message}");
    assert!(message.contains("model-00001-of-00002.safetensors and") && message.contains("model-00002-of-00002.safetensors"), "{message}");
}
