//! Models against transformers' outputs stored by bench/parity/make_fixtures.sh
//! (tiny BLOOM, OPT, Llama, GQA-Llama, Llama 3 with llama3 RoPE scaling,
//! Qwen2, Mistral with a sliding window, Qwen3, Gemma 2 and Gemma 3 with
//! sliding and global layers, Phi-3 with LongRoPE and Phi-4-mini's partial
//! rotary), their exports loading in transformers, and every loading error's
//! message; and the mixture-of-experts families (Qwen3-MoE, OLMoE, Qwen2-MoE,
//! Mixtral) made at test time by transformers (tests/python/moe_reference.py):
//! equality, both weight layouts, export, decoding, `ft train`, LoRA on
//! the experts against peft (tests/python/peft_reference.py), and QLoRA's
//! 4-bit experts against bitsandbytes.

use crate::common;
use common::shared;

use ft_core::generate::{greedy, greedy_batch, Decoding};
use ft_core::model::{forward, lm_outputs, Inputs, Model};
use ft_core::train::loss::{lm_loss, logits, softcapped};
use ft_models::hf;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

const FIXTURES: [&str; 12] = ["bloom", "opt", "llama", "llama-gqa", "llama3", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "phi4-mini"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn relative(actual: &Tensor, expected: &Tensor, floor: f64) -> f64 {
    let error = (actual.to_kind(Kind::Double) - expected.to_kind(Kind::Double)).abs().max().double_value(&[]);
    error / expected.abs().max().double_value(&[]).max(floor).max(1e-30)
}

#[test]
fn logits_loss_gradients_and_greedy_tokens_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let reference: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect();
        let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
        let ids = Tensor::from_slice2(&rows);
        let model = hf::load_model(&dir).unwrap();
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        for t in params.iter().flatten() {
            let _ = t.set_requires_grad(true);
        }
        let inputs = Inputs::ids(&ids);
        let ctx = model.context(&inputs, 0, Kind::Float, false).unwrap();
        let (hidden, weight) = lm_outputs(forward(model.as_ref(), &params, &inputs, &ctx, None)).unwrap();
        let loss = lm_loss(&hidden, &weight, &ids, 7, model.logit_softcap()).unwrap();
        let error = relative(&softcapped(logits(&hidden, &weight), model.logit_softcap()), &reference["logits"], 0.0);
        assert!(error <= 1e-4, "{name}: logits differ by {error:e}");
        let error = relative(&loss, &reference["loss"], 0.0);
        assert!(error <= 1e-5, "{name}: loss {} vs {}", loss.double_value(&[]), reference["loss"].double_value(&[]));

        loss.backward();
        let grads: Vec<(&String, &Tensor)> = reference.iter().filter(|(k, _)| k.starts_with("grad.")).collect();
        let floor = 1e-3 * grads.iter().map(|(_, g)| g.abs().max().double_value(&[])).fold(0.0, f64::max);
        let mut compared = 0;
        for (unit, tensors) in model.units().iter().zip(&params) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                let expected = &reference[&format!("grad.{}", spec.hf_name)];
                let error = relative(&tensor.grad(), expected, floor);
                assert!(error <= 1e-3, "{name}: gradient of {} differs by {error:e}", spec.hf_name);
                compared += 1;
            }
        }
        assert_eq!(compared, grads.len(), "{name}: every reference gradient has a parameter");

        let _ = tch::no_grad_guard();
        let frozen: Vec<Vec<Tensor>> = params.iter().map(|u| u.iter().map(Tensor::detach).collect()).collect();
        let tokens = greedy(model.as_ref(), &frozen, &rows[0][..8], 32, None, Kind::Float).unwrap();
        assert_eq!(tokens, Vec::<i64>::try_from(&reference["generated"]).unwrap(), "{name}: greedy tokens");
    }
}

/// Packing (`data.packing`): a row holding several examples, told apart by
/// `Inputs::documents`, gives each example's tokens the logits and the
/// per-token losses it gets alone — positions restart (learned, RoPE and
/// ALiBi alike), attention stays inside the example, and the sliding
/// windows (Mistral's 5, Gemma's 4) still apply within the 7-token one.
#[test]
fn a_packed_row_computes_what_its_examples_compute_alone() {
    let lengths = [7, 3, 6];
    for name in FIXTURES {
        let dir = fixture(name);
        let model = hf::load_model(&dir).unwrap();
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        let _no_grad = tch::no_grad_guard();
        let row = &rows(name)[0];
        assert_eq!(row.len(), lengths.iter().sum::<usize>());
        let per_token = |inputs: &Inputs| {
            let ctx = model.context(inputs, 0, Kind::Float, false).unwrap();
            let (hidden, weight) = lm_outputs(forward(model.as_ref(), &params, inputs, &ctx, None)).unwrap();
            let logits = logits(&hidden, &weight).squeeze_dim(0);
            // Each position's loss on the next token of the row.
            let seq = logits.size()[0];
            let targets = inputs.input_ids.squeeze_dim(0).narrow(0, 1, seq - 1);
            let losses = -logits.narrow(0, 0, seq - 1).log_softmax(-1, Kind::Float).gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
            (logits, losses)
        };
        let documents: Vec<i64> = lengths.iter().enumerate().flat_map(|(i, &len)| std::iter::repeat_n(i as i64, len)).collect();
        let ids = Tensor::from_slice(row).unsqueeze(0);
        let packed = Inputs { documents: Some(Tensor::from_slice(&documents).unsqueeze(0)), ..Inputs::ids(&ids) };
        let (packed_logits, packed_losses) = per_token(&packed);
        let mut at = 0;
        for len in lengths {
            let (logits, losses) = per_token(&Inputs::ids(&ids.narrow(1, at as i64, len as i64)));
            let error = relative(&packed_logits.narrow(0, at as i64, len as i64), &logits, 0.0);
            assert!(error <= 1e-5, "{name}: the example at {at} differs packed by {error:e} in its logits");
            // Its losses inside it (the packed row's loss at its last token is on the next example: a seam).
            let error = relative(&packed_losses.narrow(0, at as i64, len as i64 - 1), &losses, 0.0);
            assert!(error <= 1e-5, "{name}: the example at {at} differs packed by {error:e} in its per-token losses");
            at += len;
        }
        // Without the documents the same row is one sequence, and its later examples see the earlier ones.
        let (whole, _) = per_token(&Inputs::ids(&ids));
        assert!(relative(&whole, &packed_logits, 0.0) > 1e-3, "{name}: packing must change what the row computes");
    }
}

/// Shared prefixes (`Inputs::branches`, the DPO task's shared prompt): a
/// row of one example whose 4-token prefix both continuations (5 and 4
/// tokens) branch from, then an example of 3 tokens, gives each
/// continuation the logits of prefix + continuation alone — its positions
/// follow the prefix's (learned, RoPE and ALiBi alike), it sees neither the
/// other continuation nor the other example, and the sliding windows apply.
#[test]
fn a_branched_row_computes_what_prefix_and_each_continuation_compute_alone() {
    for name in FIXTURES {
        let dir = fixture(name);
        let model = hf::load_model(&dir).unwrap();
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        let _no_grad = tch::no_grad_guard();
        let logits_of = |inputs: &Inputs| {
            let ctx = model.context(inputs, 0, Kind::Float, false).unwrap();
            let (hidden, weight) = lm_outputs(forward(model.as_ref(), &params, inputs, &ctx, None)).unwrap();
            logits(&hidden, &weight).squeeze_dim(0)
        };
        let row = &rows(name)[0];
        let (prefix, first, second, other) = (&row[..4], &row[4..9], &row[9..13], &row[13..16]);
        let tagged = |values: [i64; 4]| -> Tensor {
            let parts = [prefix.len(), first.len(), second.len(), other.len()];
            let tags: Vec<i64> = parts.iter().zip(values).flat_map(|(&len, value)| std::iter::repeat_n(value, len)).collect();
            Tensor::from_slice(&tags).unsqueeze(0)
        };
        let ids = Tensor::from_slice(row).unsqueeze(0);
        let branched = Inputs { documents: Some(tagged([0, 0, 0, 1])), branches: Some(tagged([0, 1, 2, 0])), ..Inputs::ids(&ids) };
        let packed = logits_of(&branched);
        let alone = |parts: &[&[i64]]| logits_of(&Inputs::ids(&Tensor::from_slice(&parts.concat()).unsqueeze(0)));
        for (what, expected, at) in [
            ("the prefix and the first continuation", alone(&[prefix, first]), vec![0, 1, 2, 3, 4, 5, 6, 7, 8]),
            ("the second continuation", alone(&[prefix, second]).narrow(0, 4, 4), vec![9, 10, 11, 12]),
            ("the other example", alone(&[other]), vec![13, 14, 15]),
        ] {
            let error = relative(&packed.index_select(0, &Tensor::from_slice(&at)), &expected, 0.0);
            assert!(error <= 1e-5, "{name}: {what} differs in the branched row by {error:e}");
        }
        // Without the branches the second continuation sees the first.
        let unbranched = logits_of(&Inputs { branches: None, ..branched });
        assert!(relative(&unbranched.narrow(0, 9, 4), &packed.narrow(0, 9, 4), 0.0) > 1e-3, "{name}: branches must change what the row computes");
    }
}

/// A fixture's token rows (ids.json).
fn rows(name: &str) -> Vec<Vec<i64>> {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("ids.json")).unwrap()).unwrap()
}

/// ft's logits on `rows` and its 32 greedy tokens after the first row's first 8, for the model in `dir`.
fn logits_and_tokens(dir: &Path, rows: &[Vec<i64>]) -> (Tensor, Vec<i64>) {
    let model = hf::load_model(dir).unwrap();
    let params = hf::load_params(model.as_ref(), dir, Kind::Float, Device::Cpu).unwrap();
    let _no_grad = tch::no_grad_guard();
    let ids = Tensor::from_slice2(rows);
    let inputs = Inputs::ids(&ids);
    let ctx = model.context(&inputs, 0, Kind::Float, false).unwrap();
    let (hidden, weight) = lm_outputs(forward(model.as_ref(), &params, &inputs, &ctx, None)).unwrap();
    let logits = softcapped(logits(&hidden, &weight), model.logit_softcap());
    (logits, greedy(model.as_ref(), &params, &rows[0][..8], 32, None, Kind::Float).unwrap())
}

/// The parity above would pass vacuously if what sets a family apart
/// changed nothing on the fixtures' sequences: the RoPE scalings (Llama 3's,
/// Phi-3's LongRoPE, Gemma 3's global linear one), the sliding windows
/// (Mistral's, Gemma 2's and Gemma 3's local layers', Phi-3's), the
/// soft-capping (Gemma 2), query_pre_attn_scalar (Gemma): without each, ft's logits leave
/// transformers' by far more than the bound, and without the window so do
/// Mistral's greedy tokens (the KV-cache path; the tied Llama 3 fixture
/// repeats one token either way).
#[test]
fn the_fixtures_exercise_the_rope_scaling_and_the_window() {
    let changes: [(&str, &str, serde_json::Value); 10] = [
        ("llama3", "rope_scaling", serde_json::Value::Null),
        ("mistral", "sliding_window", serde_json::Value::Null),
        ("phi3", "rope_scaling", serde_json::Value::Null),
        ("phi3", "sliding_window", serde_json::Value::Null),
        ("gemma2", "sliding_window", 64.into()),
        ("gemma2", "attn_logit_softcapping", serde_json::Value::Null),
        ("gemma2", "final_logit_softcapping", serde_json::Value::Null),
        ("gemma3", "sliding_window", 64.into()),
        ("gemma3", "rope_scaling", serde_json::Value::Null),
        ("gemma3", "query_pre_attn_scalar", 16.into()),
    ];
    for (name, key, value) in changes {
        let reference: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(fixture(name).join("reference.safetensors")).unwrap().into_iter().collect();
        let (logits, tokens) = logits_and_tokens(&fixture(name), &rows(name));
        assert!(relative(&logits, &reference["logits"], 0.0) <= 1e-4, "{name}: with {key}");
        let dir = copy_of(name);
        edit_config(dir.path(), key, value);
        let (logits, tokens_without) = logits_and_tokens(dir.path(), &rows(name));
        let error = relative(&logits, &reference["logits"], 0.0);
        assert!(error > 1e-2, "{name}: without {key} the logits differ by only {error:e}");
        if name == "mistral" {
            assert_ne!(tokens_without, tokens, "{name}: without {key} greedy decoding gives the same tokens");
        }
    }
}

/// A copy of a fixture model in a temporary directory, to break.
fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(file), dir.path().join(file)).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    let result = hf::load_model(dir).and_then(|m| hf::load_params(m.as_ref(), dir, Kind::Float, Device::Cpu));
    match result {
        Ok(_) => panic!("loading must fail"),
        Err(error) => format!("{error:#}"),
    }
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config[key] = value;
    std::fs::write(path, config.to_string()).unwrap();
}

#[test]
fn missing_weights_file_is_named() {
    let dir = copy_of("bloom");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let message = load_error(dir.path());
    assert!(message.contains("has no model.safetensors or model.safetensors.index.json"), "{message}");
}

#[test]
fn wrong_shapes_missing_and_unexpected_tensors_are_listed_by_name() {
    let dir = copy_of("bloom");
    edit_config(dir.path(), "vocab_size", 100.into());
    let message = load_error(dir.path());
    assert!(
        message.contains("wrong shape (1): transformer.word_embeddings.weight: [128, 32]") && message.contains("expected [100, 32]"),
        "{message}"
    );

    // One tensor removed and one foreign tensor added.
    let dir = copy_of("llama");
    let path = dir.path().join("model.safetensors");
    let mut tensors = Tensor::read_safetensors(&path).unwrap();
    tensors.retain(|(name, _)| name != "model.layers.1.mlp.up_proj.weight");
    tensors.push(("model.layers.9.extra.weight".into(), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu))));
    Tensor::write_safetensors(&tensors, &path).unwrap();
    let message = load_error(dir.path());
    assert!(message.contains("missing (1): model.layers.1.mlp.up_proj.weight [64, 32]"), "{message}");
    assert!(message.contains("unexpected (1): model.layers.9.extra.weight [2, 2]"), "{message}");
}

#[test]
fn truncated_safetensors_is_rejected() {
    let dir = copy_of("opt");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let message = load_error(dir.path());
    assert!(message.contains("is not a valid safetensors file (truncated or corrupt?)"), "{message}");
}

#[test]
fn unknown_model_type_and_bad_config_are_rejected() {
    let dir = copy_of("bloom");
    // No guess, even a letter away: another model_type is another architecture.
    for (model_type, near) in [("blom", "bloom"), ("qwen4", "qwen3"), ("gemma3", "gemma3_text")] {
        edit_config(dir.path(), "model_type", model_type.into());
        let message = load_error(dir.path());
        assert!(message.contains(&format!("unknown model_type `{model_type}` (registered: ")) && !message.contains("did you mean"), "{message}");
        for supported in ["bloom", "gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3"] {
            assert!(message.contains(supported), "{near}: {message}");
        }
    }
    // Gemma 3 from 4B up: a vision tower over a text model ft knows.
    edit_config(dir.path(), "text_config", serde_json::json!({"model_type": "gemma3_text"}));
    let message = load_error(dir.path());
    assert!(message.contains("`gemma3` is a multimodal model whose text_config is `gemma3_text`, which ft trains"), "{message}");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    assert!(load_error(dir.path()).contains("config.json is not valid JSON"));
    let dir = copy_of("llama");
    edit_config(dir.path(), "num_key_value_heads", 3.into());
    let message = load_error(dir.path());
    assert!(message.contains("must be a multiple of num_key_value_heads (3)"), "{message}");
}

/// What Qwen2, Mistral and Llama 3 configs may ask that ft does not compute
/// is refused in one line naming the file, the architecture and the key.
#[test]
fn configs_asking_what_ft_does_not_compute_are_refused() {
    let cases: [(&str, &str, serde_json::Value, &str); 13] = [
        (
            "llama3",
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            "(llama): rope_scaling.rope_type \"yarn\" is not supported (supported: default, linear, llama3, longrope)",
        ),
        ("llama3", "partial_rotary_factor", 0.5.into(), "(llama): partial_rotary_factor is not supported for Llama"),
        ("qwen3", "use_sliding_window", true.into(), "(qwen3): use_sliding_window: true is not supported: ft runs every Qwen3 layer"),
        ("gemma3", "attn_logit_softcapping", 50.0.into(), "(gemma3_text): attn_logit_softcapping is not supported for Gemma3"),
        ("gemma3", "layer_types", serde_json::json!(["sliding_attention", "full_attention"]), "(gemma3_text): layer_types has 2 entries: it needs one per layer, 3"),
        ("gemma2", "hidden_activation", "gelu".into(), "(gemma2): Gemma2 hidden_activation \"gelu\" is not supported"),
        ("gemma2", "use_bidirectional_attention", true.into(), "(gemma2): use_bidirectional_attention: true is not supported"),
        ("phi3", "resid_pdrop", 0.1.into(), "(phi3): resid_pdrop 0.1 is not supported"),
        (
            "phi3",
            "rope_scaling",
            serde_json::json!({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0, 3.0, 4.0]}),
            "(phi3): rope_scaling.short_factor has 1 factors: it needs one per rotated pair of a head's features, 4 (8 of 8 rotate",
        ),
        ("llama3", "attention_dropout", 0.1.into(), "(llama): attention_dropout 0.1 is not supported"),
        ("qwen2", "use_sliding_window", true.into(), "(qwen2): use_sliding_window: true is not supported"),
        ("qwen2", "layer_types", serde_json::json!(["full_attention", "sliding_attention"]), "(qwen2): layer_types[1] is \"sliding_attention\""),
        ("mistral", "sliding_window", 0.into(), "(mistral): sliding_window must be at least 1, not 0"),
    ];
    for (name, key, value, expected) in cases {
        let dir = copy_of(name);
        edit_config(dir.path(), key, value);
        let message = load_error(dir.path());
        assert!(message.contains("config.json") && message.contains(expected) && message.lines().count() == 1, "{name} {key}: {message}");
    }
}

#[test]
fn hub_ids_resolve_only_through_the_local_cache() {
    // `ft forward` with the cache in its environment: the tests share one process, whose environment they leave alone.
    let cache = tempfile::tempdir().unwrap();
    let ids = cache.path().join("ids.json");
    std::fs::write(&ids, "[[1, 2, 3]]").unwrap();
    let forward = |model: &str| {
        let out = cache.path().join("out.safetensors");
        let output = common::ft().args(["forward", "--model", model, "--ids", ids.to_str().unwrap(), "--out", out.to_str().unwrap()]).env("HF_HUB_CACHE", cache.path()).output().unwrap();
        (output.status.success(), common::text(&output))
    };
    let (found, message) = forward("nobody/absent-model");
    assert!(!found && message.contains("model \"nobody/absent-model\" not found locally"), "{message}");
    // The snapshot refs/main names is the model, not the last one by name.
    let snapshot = cache.path().join("models--org--tiny/snapshots/abc123");
    std::fs::create_dir_all(cache.path().join("models--org--tiny/snapshots/zzz-empty")).unwrap();
    std::fs::create_dir_all(cache.path().join("models--org--tiny/refs")).unwrap();
    std::fs::write(cache.path().join("models--org--tiny/refs/main"), "abc123\n").unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("opt").join(file), snapshot.join(file)).unwrap();
    }
    let (found, message) = forward("org/tiny");
    assert!(found && message.contains("loss "), "{message}");
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let dir = copy_of("opt");
    let single = hf::load_model(dir.path()).unwrap();
    let expected = hf::load_params(single.as_ref(), dir.path(), Kind::Float, Device::Cpu).unwrap();
    let tensors = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)] {
        Tensor::write_safetensors(part, dir.path().join(file)).unwrap();
        for (name, _) in part {
            weight_map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let loaded = hf::load_params(single.as_ref(), dir.path(), Kind::Float, Device::Cpu).unwrap();
    for (a, b) in loaded.iter().flatten().zip(expected.iter().flatten()) {
        assert!(a.equal(b));
    }
}

#[test]
fn saved_models_load_back_identically_in_each_dtype() {
    let dir = fixture("llama-gqa");
    let model: Box<dyn Model> = hf::load_model(&dir).unwrap();
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    for dtype in [Kind::Float, Kind::BFloat16] {
        let out = tempfile::tempdir().unwrap();
        hf::save(model.as_ref(), &params, out.path(), dtype).unwrap();
        let back = hf::load_params(model.as_ref(), out.path(), Kind::Float, Device::Cpu).unwrap();
        for (a, b) in back.iter().flatten().zip(params.iter().flatten()) {
            assert!(a.equal(&b.to_kind(dtype).to_kind(Kind::Float)));
        }
    }
}

/// Weights over the shard size go to `model-0000k-of-0000n.safetensors` and an
/// index, units whole, as `save_pretrained` writes them; transformers loads
/// each architecture's export with no key missing, unexpected or mis-shaped,
/// the weights ft read, and the fixture's reference logits.
#[test]
fn saved_models_split_into_shards_that_transformers_loads() {
    let scratch = tempfile::tempdir().unwrap();
    let mut pairs = vec![];
    for name in ["llama-gqa", "llama3", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "phi4-mini"] {
        let dir = fixture(name);
        let model: Box<dyn Model> = hf::load_model(&dir).unwrap();
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        let out = scratch.path().join(name);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("model.safetensors"), b"stale").unwrap();
        let largest_unit = model.units().iter().map(|u| u.numel() as u64 * 4).max().unwrap();
        hf::write_model(model.as_ref(), &out, Kind::Float, largest_unit, |unit| Ok(params[unit].iter().map(Tensor::shallow_clone).collect())).unwrap();
        let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
        let files: std::collections::BTreeSet<&str> = index["weight_map"].as_object().unwrap().values().map(|f| f.as_str().unwrap()).collect();
        let shards = files.len();
        assert!(shards > 1 && !out.join("model.safetensors").exists(), "{name}: {files:?}");
        assert!(files.iter().enumerate().all(|(k, f)| *f == format!("model-{:05}-of-{shards:05}.safetensors", k + 1)), "{name}: {files:?}");
        let total: i64 = model.units().iter().map(|u| u.numel() * 4).sum();
        assert_eq!(index["metadata"]["total_size"], total, "{name}");
        let back = hf::load_params(model.as_ref(), &out, Kind::Float, Device::Cpu).unwrap();
        for (a, b) in back.iter().flatten().zip(params.iter().flatten()) {
            assert!(a.equal(b), "{name}");
        }
        pairs.extend([out.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string()]);
    }
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    // Pairs of (export, fixture): one process, since importing transformers is most of the time.
    let script = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file
args = sys.argv[1:]
for out, fixture in zip(args[::2], args[1::2]):
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    problems = {key: info[key] for key in ('missing_keys', 'unexpected_keys', 'mismatched_keys') if info[key]}
    assert not problems, f'{out}: {problems}'
    ours = load_file(fixture + '/model.safetensors')
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in ours.items()), f'{out}: weights differ'
    ids = torch.tensor(json.load(open(fixture + '/ids.json')))
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    expected = load_file(fixture + '/reference.safetensors')['logits']
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-5, f'{out}: logits differ by {error}'
    print(out, len(ours), 'tensors, logits within', error)
"#;
    let output = std::process::Command::new(python).args(["-c", script]).args(&pairs).output().unwrap();
    assert!(output.status.success(), "{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
}

#[test]
fn gpt2_tokenizer_loads_and_round_trips() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let gpt2 = shared::path(shared::GPT2_TOKENIZER);
    let tokenizer = hf::load_tokenizer(gpt2.parent().unwrap()).unwrap();
    let encoding = tokenizer.encode("Hello world", false).unwrap();
    assert_eq!(encoding.get_ids(), &[15496, 995]); // GPT-2's ids for "Hello" and " world"
    assert_eq!(tokenizer.decode(encoding.get_ids(), true).unwrap(), "Hello world");
}

#[test]
fn a_missing_tokenizer_is_named() {
    let message = format!("{:#}", hf::load_tokenizer(Path::new("/nonexistent")).unwrap_err());
    assert!(message.contains("cannot load /nonexistent/tokenizer.json"), "{message}");
}

#[test]
fn batched_greedy_decoding_equals_one_prompt_at_a_time() {
    for name in FIXTURES {
        let dir = fixture(name);
        let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
        let model = hf::load_model(&dir).unwrap();
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        // Prompts of different lengths, so the batch is left-padded.
        let prompts: Vec<Vec<i64>> = (0..6).map(|i| rows[i % rows.len()][..3 + 2 * i].to_vec()).collect();
        let one_at_a_time: Vec<Vec<i64>> = prompts.iter().map(|p| greedy(model.as_ref(), &params, p, 12, None, Kind::Float).unwrap()).collect();
        let batched = greedy_batch(model.as_ref(), &params, &prompts, &Decoding::greedy(12, None, Kind::Float)).unwrap();
        assert_eq!(batched, one_at_a_time, "{name}");
        // A row that stops at its end token while the others go on.
        let eos = Some(one_at_a_time[2][4]);
        let stopping = greedy_batch(model.as_ref(), &params, &prompts, &Decoding::greedy(12, eos, Kind::Float)).unwrap();
        for (row, alone) in stopping.iter().zip(&prompts) {
            assert_eq!(row, &greedy(model.as_ref(), &params, alone, 12, eos, Kind::Float).unwrap(), "{name} with an end token");
        }
    }
}

/// What `ft plan` reads of the new families: a sliding layer attends to at
/// most its window, so past it a token's FLOPs grow only by the global
/// layers' attention (Gemma 3: 1 of 3 layers; Phi-3: none), and Gemma 2's
/// soft-capped attention, computed outside SDPA, keeps its scores and
/// probabilities per position pair; `ft plan` runs on each.
#[test]
fn plans_count_sliding_windows_and_soft_capped_attention() {
    let models: Vec<(&str, Box<dyn Model>)> = ["qwen3", "gemma2", "gemma3", "phi3", "phi4-mini"].iter().map(|name| (*name, hf::load_model(&fixture(name)).unwrap())).collect();
    let model = |wanted: &str| models.iter().find(|(name, _)| *name == wanted).map(|(_, model)| model.as_ref()).unwrap();
    let per_key = |name: &str, seq: i64| model(name).train_flops_per_token(seq + 1) - model(name).train_flops_per_token(seq);
    // 12 FLOPs per query feature (heads × head_dim) and attended key, per layer that still attends to one more.
    assert_eq!((per_key("gemma3", 2), per_key("gemma3", 10)), (12.0 * 64.0 * 3.0, 12.0 * 64.0));
    assert_eq!((per_key("phi3", 5), per_key("phi3", 20)), (12.0 * 32.0 * 2.0, 0.0));
    assert_eq!(per_key("qwen3", 10), 12.0 * 64.0 * 2.0, "Qwen3's query is heads × head_dim wide, not hidden_size");
    assert_eq!(model("gemma2").activations().block_per_position_pair, 2 * 4);
    assert_eq!(model("gemma3").activations().block_per_position_pair, 0);
    for (name, _) in &models {
        let output = common::ft()
            .args(["plan", "--model", fixture(name).join("config.json").to_str().unwrap(), "--gpus", "2", "--gpu", "h100", "--seq", "64"])
            .output()
            .unwrap();
        assert!(output.status.success() && common::text(&output).contains("full_shard"), "{name}: {}", common::text(&output));
    }
}

/// The mixture-of-experts families' tiny models: 2 layers (the Qwen
/// families' layer 1 dense, by `mlp_only_layers`), 8 experts of which each token takes 2, with the
/// load-balancing loss on (a coefficient large enough that its gradient
/// shows): each made once per test binary by transformers
/// (tests/python/moe_reference.py), with its outputs on a right-padded batch.
fn moe_models(dir: &Path) -> Vec<&'static str> {
    // What the training test trains: Qwen3-MoE sized to the demo's tokenizer, which its directory holds.
    let tokenizer = tempfile::tempdir().unwrap();
    let tokenizer_file = ft_data::demo::write(tokenizer.path(), 4, 1, 0).unwrap().tokenizer;
    let vocab = hf::load_tokenizer(tokenizer_file.parent().unwrap()).unwrap().get_vocab_size(true);
    let cases = serde_json::json!({
        "qwen3_moe_train": {"seed": 15, "config": {
            "model_type": "qwen3_moe", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [1], "output_router_logits": true,
            "router_aux_loss_coef": 0.1, "initializer_range": 0.1, "tie_word_embeddings": false}},
        "qwen3_moe": {"seed": 11, "config": {
            "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [1], "output_router_logits": true,
            "router_aux_loss_coef": 0.1, "initializer_range": 0.1, "tie_word_embeddings": false}},
        "olmoe": {"seed": 12, "config": {
            "model_type": "olmoe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "output_router_logits": true, "router_aux_loss_coef": 0.1, "initializer_range": 0.1, "pad_token_id": null,
            "eos_token_id": null}},
        "qwen2_moe": {"seed": 13, "config": {
            "model_type": "qwen2_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1], "output_router_logits": true,
            "router_aux_loss_coef": 0.1, "initializer_range": 0.1}},
        "mixtral": {"seed": 14, "config": {
            "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
            "output_router_logits": true, "router_aux_loss_coef": 0.1, "initializer_range": 0.1, "bos_token_id": null,
            "eos_token_id": null}},
    });
    static MADE: std::sync::OnceLock<Vec<(PathBuf, Vec<u8>)>> = std::sync::OnceLock::new();
    common::made_once(&MADE, dir, |made| {
        moe_reference(&["make".as_ref(), made.as_os_str(), cases.to_string().as_ref()]);
        std::fs::copy(&tokenizer_file, made.join("qwen3_moe_train/hub/tokenizer.json")).unwrap();
    });
    vec!["qwen3_moe", "olmoe", "qwen2_moe", "mixtral"]
}

/// Runs a job of tests/python/moe_reference.py, in the binary's one process of it; returns what it printed.
fn moe_reference(args: &[&std::ffi::OsStr]) -> String {
    common::reference_job("moe_reference.py", args)
}

fn tensors(path: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

/// Each family's logits (at the real tokens), loss with the load-balancing
/// loss, that loss alone and every parameter's gradient equal
/// transformers' on a right-padded batch, whose padding the router's
/// statistics skip as transformers' attention mask makes them.
#[test]
fn moe_logits_loss_aux_loss_and_gradients_match_transformers() {
    let scratch = tempfile::tempdir().unwrap();
    for name in moe_models(scratch.path()) {
        let dir = scratch.path().join(name);
        let reference = tensors(&dir.join("reference.safetensors"));
        let model = hf::load_model(&dir.join("hub")).unwrap();
        let params = hf::load_params(model.as_ref(), &dir.join("hub"), Kind::Float, Device::Cpu).unwrap();
        for t in params.iter().flatten() {
            let _ = t.set_requires_grad(true);
        }
        let (ids, mask) = (&reference["ids"], &reference["mask"]);
        let inputs = Inputs { attention_mask: Some(mask.shallow_clone()), ..Inputs::ids(ids) };
        let ctx = model.context(&inputs, 0, Kind::Float, true).unwrap();
        let (outputs, aux) = ft_core::model::forward_with_auxiliary(model.as_ref(), &params, &inputs, &ctx, None);
        let (hidden, weight) = lm_outputs(outputs).unwrap();
        let real = mask.unsqueeze(-1).to_kind(Kind::Float);
        let error = relative(&(logits(&hidden, &weight) * &real), &(&reference["logits"] * &real), 0.0);
        assert!(error <= 1e-5, "{name}: logits differ by {error:e}");
        let labels = ids.masked_fill(&mask.eq(0), -100);
        let aux = aux.expect("output_router_logits adds the load-balancing loss");
        let coefficient = model.auxiliary_loss().unwrap().coefficient();
        let error = relative(&aux, &reference["aux_loss"], 0.0);
        assert!(error <= 1e-5, "{name}: aux loss {} vs {}", aux.double_value(&[]), reference["aux_loss"].double_value(&[]));
        let loss = lm_loss(&hidden, &weight, &labels, 7, None).unwrap() + aux * coefficient;
        let error = relative(&loss, &reference["loss"], 0.0);
        assert!(error <= 1e-5, "{name}: loss {} vs {}", loss.double_value(&[]), reference["loss"].double_value(&[]));
        loss.backward();
        let mut compared = 0;
        for (unit, tensors) in model.units().iter().zip(&params) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                // transformers 5 calls Mixtral's block_sparse_moe `mlp`.
                let expected = &reference[&format!("grad.{}", spec.hf_name.replace(".block_sparse_moe.", ".mlp."))];
                let error = relative(&tensor.grad(), expected, 0.0);
                assert!(error <= 1e-5, "{name}: gradient of {} differs by {error:e}", spec.hf_name);
                compared += 1;
            }
        }
        assert_eq!(compared, reference.keys().filter(|k| k.starts_with("grad.")).count(), "{name}: every reference gradient has a parameter");
    }
}

/// The Hub's per-expert files and transformers 5's fused experts load to
/// the same parameters; ft's export writes the per-expert names
/// save_pretrained writes, and transformers loads it at the reference's
/// logits.
#[test]
fn moe_weights_load_from_either_layout_and_export_in_the_hubs() {
    let scratch = tempfile::tempdir().unwrap();
    let mut pairs = vec![];
    for name in moe_models(scratch.path()) {
        let dir = scratch.path().join(name);
        let model = hf::load_model(&dir.join("hub")).unwrap();
        let hub = hf::load_params(model.as_ref(), &dir.join("hub"), Kind::Float, Device::Cpu).unwrap();
        let fused = hf::load_params(model.as_ref(), &dir.join("fused"), Kind::Float, Device::Cpu).unwrap();
        assert!(hub.iter().flatten().zip(fused.iter().flatten()).all(|(a, b)| a.equal(b)), "{name}: the layouts load alike");
        let out = scratch.path().join(format!("{name}-export"));
        hf::save(model.as_ref(), &hub, &out, Kind::Float).unwrap();
        let mut written: Vec<String> = tensors(&out.join("model.safetensors")).into_keys().collect();
        let mut hubs: Vec<String> = tensors(&dir.join("hub/model.safetensors")).into_keys().collect();
        written.sort();
        hubs.sort();
        assert_eq!(written, hubs, "{name}: the export names what save_pretrained names");
        pairs.push([out.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string()]);
    }
    moe_reference(&["check".as_ref(), serde_json::json!(pairs).to_string().as_ref()]);
}

/// `ft train` of a tiny Qwen3-MoE with the load-balancing loss: its first
/// step's loss and aux_loss equal transformers' on the same right-padded
/// batch (`ft tokenize`'s examples), accumulating two micro-batches its
/// aux_loss is the mean of theirs, and two ranks under full_shard, and
/// one rank recomputing its blocks (activation checkpointing), train to
/// one rank's losses at every step: the router's statistics are summed
/// over the ranks before they weigh any block's gradient.
/// The tiny Qwen3-MoE that trains (`moe_models`' `qwen3_moe_train`) made
/// in `scratch` with 8 prompt/completion rows; returns a function that
/// trains it for 2 steps of 4 examples into `scratch/NAME` with `flags`.
fn moe_trainer(scratch: &Path) -> (PathBuf, PathBuf, impl Fn(&str, &[&str]) -> PathBuf + '_) {
    moe_models(scratch);
    let model = scratch.join("qwen3_moe_train/hub");
    let data = scratch.join("train.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| serde_json::json!({"prompt": format!("Where does the {} live? ", ["lynx", "heron", "otter", "ibex"][i % 4]), "completion": "In the hills of Kalora".repeat(1 + i % 3)}).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let (model_arg, data_arg) = (model.clone(), data.clone());
    let run = move |name: &str, flags: &[&str]| {
        let dir = scratch.join(name);
        let output = common::ft()
            .args(["train", "--model", model_arg.to_str().unwrap(), "--train-file", data_arg.to_str().unwrap(), "--output-dir", dir.to_str().unwrap()])
            .args(["--task", "causal_lm", "--max-steps", "2", "--dtype", "f32", "--lr", "1e-3", "--seed", "3", "--set", "data.shuffle=false"])
            .args(flags)
            .output()
            .unwrap();
        assert!(output.status.success(), "{name}: {}", common::text(&output));
        // What the run printed, for the tests that read its log.
        std::fs::write(dir.join("output.txt"), common::text(&output)).unwrap();
        dir
    };
    (model, data, run)
}

#[test]
fn moe_training_matches_transformers_and_two_ranks_train_as_one() {
    let scratch = tempfile::tempdir().unwrap();
    let (model, data, run) = moe_trainer(scratch.path());
    let one = run("one-rank", &["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp", "--eval-file", data.to_str().unwrap()]);
    let records: Vec<serde_json::Value> = std::fs::read_to_string(one.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let first = records.iter().find(|r| r.get("loss").is_some()).unwrap();

    let tokenized = scratch.path().join("tokenized.jsonl");
    let output = common::ft()
        .args(["tokenize", "--model", model.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--out", tokenized.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", common::text(&output));
    // The whole first batch, and its halves (the micro-batches of a run accumulating two).
    let slices = serde_json::json!([[0, 4], [0, 2], [2, 2]]).to_string();
    let printed = moe_reference(&["loss".as_ref(), model.as_os_str(), tokenized.as_os_str(), slices.as_ref()]);
    let expected: serde_json::Value = serde_json::from_str(printed.lines().last().unwrap()).unwrap();
    for key in ["loss", "aux_loss"] {
        let (ours, theirs) = (first[key].as_f64().unwrap(), expected[0][key].as_f64().unwrap());
        assert!((ours - theirs).abs() <= 1e-5 * theirs.abs(), "step 1's {key}: {ours} vs transformers' {theirs}");
    }
    // The evaluation after the last step (the 8 examples, one batch): transformers' loss with the trained weights, aux included.
    let evaluated = records.iter().find(|r| r.get("eval_loss").is_some()).unwrap();
    let printed = moe_reference(&["loss".as_ref(), one.join("final").as_os_str(), tokenized.as_os_str(), "[[0, 8]]".as_ref()]);
    let theirs: serde_json::Value = serde_json::from_str(printed.lines().last().unwrap()).unwrap();
    for (key, their_key) in [("eval_loss", "loss"), ("eval_aux_loss", "aux_loss")] {
        let (ours, theirs) = (evaluated[key].as_f64().unwrap(), theirs[0][their_key].as_f64().unwrap());
        assert!((ours - theirs).abs() <= 1e-5 * theirs.abs(), "{key}: {ours} vs transformers' {theirs} after training");
    }
    // Accumulating two micro-batches, a step's auxiliary loss is the mean of theirs.
    let accumulated = run("accumulated", &["--nproc-per-node", "1", "--batch-size", "2", "--grad-accum", "2", "--strategy", "ddp"]);
    let record: serde_json::Value = std::fs::read_to_string(accumulated.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).find(|r: &serde_json::Value| r.get("loss").is_some()).unwrap();
    let (ours, theirs) = (record["aux_loss"].as_f64().unwrap(), (expected[1]["aux_loss"].as_f64().unwrap() + expected[2]["aux_loss"].as_f64().unwrap()) / 2.0);
    assert!((ours - theirs).abs() <= 1e-5 * theirs, "accumulated step 1's aux_loss: {ours} vs the mean of transformers' over its micro-batches {theirs}");

    // The sparse layer's load (layer 1 is dense), and no assignment dropped.
    let (least, most, variation) = (first["moe/layer_0/load_min"].as_f64().unwrap(), first["moe/layer_0/load_max"].as_f64().unwrap(), first["moe/layer_0/load_cv"].as_f64().unwrap());
    assert!(least <= 1.0 / 8.0 && most >= 1.0 / 8.0 && most <= 1.0 && (variation > 0.0) == (most > least), "{first}");
    assert!(first.get("moe/layer_1/load_min").is_none() && first["moe/dropped_assignments"] == 0.0, "{first}");

    let baseline = common::losses(&one);
    assert_eq!(baseline.len(), 2, "{baseline:?}");
    for (name, flags) in [
        ("two-ranks-full-shard", &["--nproc-per-node", "2", "--batch-size", "2", "--strategy", "full_shard"][..]),
        ("recomputed", &["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp", "--activation-checkpointing"][..]),
    ] {
        let dir = run(name, flags);
        let losses = common::losses(&dir);
        assert_eq!(losses.len(), baseline.len(), "{name}");
        for (step, (x, y)) in losses.iter().zip(&baseline).enumerate() {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{name} step {}: loss {x} vs one rank's {y}", step + 1);
        }
        // The load is counted over every rank's tokens: the whole batch's.
        let record: serde_json::Value = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).find(|r: &serde_json::Value| r.get("loss").is_some()).unwrap();
        for key in ["aux_loss", "moe/layer_0/load_min", "moe/layer_0/load_max", "moe/layer_0/load_cv"] {
            let (x, y) = (record[key].as_f64().unwrap(), first[key].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{name}: {key} {x} vs one rank's {y}");
        }
    }
}

/// What each rank of the run in `dir` (of `model`, named `name`, on
/// `ranks` ranks at expert-parallel degree 2 under `strategy` and
/// `offload`, with `flags`) holds, on the device and offloaded, is what
/// `ft plan` predicts for its row.
fn holds_what_ft_plan_predicts(model: &Path, dir: &Path, name: &str, ranks: &str, (strategy, offload): (&str, &str), flags: &[&str]) {
    let json = dir.join("plan.json");
    let plan = common::ft().args(["plan", "--model", model.to_str().unwrap(), "--gpus", ranks, "--gpu", "h100", "--dtype", "f32", "--json", json.to_str().unwrap()]).args(flags).output().unwrap();
    assert!(plan.status.success(), "{}", common::text(&plan));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let row = plan["rows"].as_array().unwrap().iter().find(|r| r["strategy"] == strategy && r["offload"] == offload && r["expert_parallel"] == 2 && r["comm"].is_null());
    let row = row.unwrap_or_else(|| panic!("{name}: no plan row"));
    for held in common::summary(dir)["state_per_rank"].as_array().unwrap() {
        for what in ["params", "grads", "optimizer_state", "host", "gathered_peak", "frozen"] {
            assert_eq!(row["state"][what], held[what], "{name}: {what}");
        }
    }
}

/// Expert parallelism: two ranks each holding 4 of the 8 experts of the
/// sparse layer, tokens exchanged by all-to-all, train to one rank's
/// losses at every step (ddp, shard_grad_op and full_shard placing the
/// rest; ddp and full_shard with the optimizer state on the host), each
/// rank holding what `ft plan` predicts, LoRA's adapters on the attention
/// and the split frozen experts too; on four ranks under zero1,
/// shard_grad_op and full_shard the two holders of each expert split its
/// state as each strategy splits a unit's (and under hybrid_shard on
/// eight, in groups of four). A checkpoint saved by the four resumes on
/// one rank holding every expert, and one saved by two on the four, to the
/// uninterrupted run's last loss.
#[test]
fn moe_expert_parallel_ranks_train_as_one_and_resume_at_another_degree() {
    let scratch = tempfile::tempdir().unwrap();
    let (model, _, run) = moe_trainer(scratch.path());
    let one = run("one-rank", &["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp"]);
    let baseline = common::losses(&one);
    assert_eq!(baseline.len(), 2, "{baseline:?}");
    let mut dirs = vec![];
    let holds_what_ft_plan_predicts = |dir: &Path, name: &str, ranks: &str, strategy: &str, offload: &str, extra: &[&str]| holds_what_ft_plan_predicts(&model, dir, name, ranks, (strategy, offload), extra);
    let runs = [
        ("ep2-ddp", "2", "ddp", "none"),
        ("ep2-full-shard", "2", "full_shard", "none"),
        ("ep2-shard-grad-op", "2", "shard_grad_op", "none"),
        ("ep2-full-shard-offload", "2", "full_shard", "cpu"),
        ("ep2-ddp-offload", "2", "ddp", "cpu"),
        ("ep2-zero1-4-ranks", "4", "zero1", "none"),
        ("ep2-shard-grad-op-4-ranks", "4", "shard_grad_op", "none"),
        ("ep2-full-shard-4-ranks", "4", "full_shard", "none"),
    ];
    for (name, ranks, strategy, offload) in runs {
        let batch = (4 / ranks.parse::<usize>().unwrap()).to_string();
        let dir = run(name, &["--nproc-per-node", ranks, "--batch-size", &batch, "--strategy", strategy, "--offload", offload, "--expert-parallel", "2", "--save-every", "1"]);
        let losses = common::losses(&dir);
        assert_eq!(losses.len(), baseline.len(), "{name}");
        for (step, (x, y)) in losses.iter().zip(&baseline).enumerate() {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{name} step {}: loss {x} vs one rank's {y}", step + 1);
        }
        // final/ holds every expert, gathered from the ranks: one rank's weights.
        let (ours, theirs) = (tensors(&dir.join("final/model.safetensors")), tensors(&one.join("final/model.safetensors")));
        assert_eq!(ours.len(), theirs.len(), "{name}");
        for (key, x) in &ours {
            assert!(relative(x, &theirs[key], 1e-6) <= 1e-4, "{name}: {key} differs from one rank's by {}", relative(x, &theirs[key], 1e-6));
        }
        holds_what_ft_plan_predicts(&dir, name, ranks, strategy, offload, &[]);
        dirs.push(dir);
    }
    // Under ddp each rank holds half the experts (8 of [2·32, 64] and [64, 32]) and the rest whole; tokens crossed by all-to-all.
    let summary = common::summary(&dirs[0]);
    let (trained, experts) = (summary["trainable_params"].as_f64().unwrap(), 8.0 * (2.0 * 32.0 * 64.0 + 64.0 * 32.0));
    for held in summary["state_per_rank"].as_array().unwrap() {
        assert_eq!(held["params"].as_f64().unwrap(), 4.0 * (trained - experts / 2.0), "{summary}");
    }
    assert!(summary["comm_bytes_per_step"]["all_to_all"].as_f64().unwrap() > 0.0, "{summary}");
    // Sharded over four ranks, each holds a quarter of the rest and half of its half of the experts (the padding apart).
    let holds_a_quarter = |dir: &Path| {
        let summary = common::summary(dir);
        for held in summary["state_per_rank"].as_array().unwrap() {
            let (params, expected) = (held["params"].as_f64().unwrap(), 4.0 * ((trained - experts) / 4.0 + experts / 4.0));
            assert!((params - expected).abs() <= 4.0 * 64.0, "{params} bytes of parameters, not about {expected}: {summary}");
        }
    };
    holds_a_quarter(dirs.last().unwrap());
    // hybrid_shard over two groups of four ranks: each expert's two holders in a group split its state, and the groups sum their shards.
    let eight = common::losses(&run("one-rank-batch-8", &["--nproc-per-node", "1", "--batch-size", "8", "--strategy", "ddp"]));
    let hybrid_run = run("ep2-hybrid-8-ranks", &["--nproc-per-node", "8", "--batch-size", "1", "--strategy", "hybrid_shard", "--shard-group-size", "4", "--expert-parallel", "2"]);
    holds_a_quarter(&hybrid_run);
    let hybrid = common::losses(&hybrid_run);
    assert_eq!(hybrid.len(), eight.len());
    for (step, (x, y)) in hybrid.iter().zip(&eight).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "hybrid_shard on eight ranks, step {}: loss {x} vs one rank's {y}", step + 1);
    }
    // The four's checkpoint (each expert's state split between its holders) resumes on one rank, and two ranks' (whole) on the four.
    let resumes = [(dirs.last().unwrap(), "resumed-ep1", ["1", "4", "ddp"]), (&dirs[0], "resumed-4-ranks", ["4", "1", "full_shard"])];
    for (saved, name, [ranks, batch, strategy]) in resumes {
        let checkpoint = saved.join("checkpoints/step-00000001");
        let resumed = run(name, &["--nproc-per-node", ranks, "--batch-size", batch, "--strategy", strategy, "--expert-parallel", if ranks == "1" { "1" } else { "2" }, "--resume", checkpoint.to_str().unwrap()]);
        let losses = common::losses(&resumed);
        let (x, y) = (*losses.last().unwrap(), baseline[1]);
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{name}, step 2: loss {x} vs the uninterrupted {y} ({losses:?})");
    }

    // LoRA on attention and on the split, frozen experts (each rank's rows of their adapters): one rank's losses.
    let lora = ["--lora-r", "4", "--lora-targets", "q,experts"];
    let one = common::losses(&run("lora-one-rank", &[&["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp"][..], &lora].concat()));
    let split_run = run("lora-ep2", &[&["--nproc-per-node", "2", "--batch-size", "2", "--strategy", "full_shard", "--expert-parallel", "2"][..], &lora].concat());
    holds_what_ft_plan_predicts(&split_run, "lora-ep2", "2", "full_shard", "none", &lora);
    let split = common::losses(&split_run);
    assert_eq!(split.len(), one.len());
    for (step, (x, y)) in split.iter().zip(&one).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "LoRA at degree 2, step {}: loss {x} vs one rank's {y}", step + 1);
    }
}

/// QLoRA under expert parallelism: two ranks each holding their 4 experts'
/// part of the whole fused expert tensors' 4-bit blocks (the whole
/// tensors' quantization, as bitsandbytes makes it: see
/// `moe_4bit_experts_equal_bitsandbytes_bit_for_bit`) train LoRA on the
/// attention and the experts to one rank's losses at every step, each rank
/// holding what `ft plan` predicts; the adapters they save and their
/// merged export equal one rank's, and their checkpoint resumes on one
/// rank to the uninterrupted run's last loss.
#[test]
fn moe_qlora_expert_parallel_ranks_train_save_and_merge_as_one() {
    let scratch = tempfile::tempdir().unwrap();
    let (model, _, run) = moe_trainer(scratch.path());
    let qlora = ["--lora-r", "4", "--lora-targets", "q,experts", "--quantize", "nf4", "--save-every", "1"];
    let one = run("one-rank", &[&["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp"][..], &qlora].concat());
    let split = run("ep2", &[&["--nproc-per-node", "2", "--batch-size", "2", "--strategy", "full_shard", "--expert-parallel", "2"][..], &qlora].concat());
    let (baseline, losses) = (common::losses(&one), common::losses(&split));
    assert_eq!((baseline.len(), losses.len()), (2, 2), "{baseline:?} {losses:?}");
    for (step, (x, y)) in losses.iter().zip(&baseline).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "QLoRA at degree 2, step {}: loss {x} vs one rank's {y}", step + 1);
    }
    holds_what_ft_plan_predicts(&model, &split, "qlora-ep2", "2", ("full_shard", "none"), &qlora[..6]);
    let log = std::fs::read_to_string(split.join("output.txt")).unwrap();
    assert!(log.contains("and 2 fused expert tensors (a rank's 1/2 of the experts, --expert-parallel 2) of the base's blocks"), "{log}");
    let same = |ours: &Path, theirs: &Path, what: &str| {
        let (ours, theirs) = (tensors(ours), tensors(theirs));
        assert!(!ours.is_empty() && ours.len() == theirs.len(), "{what}");
        for (key, x) in &ours {
            assert!(relative(x, &theirs[key], 1e-6) <= 1e-4, "{what}: {key} differs from one rank's by {}", relative(x, &theirs[key], 1e-6));
        }
    };
    same(&split.join("final/adapter_model.safetensors"), &one.join("final/adapter_model.safetensors"), "the adapters");
    let merged = |dir: &Path| {
        let out = dir.join("merged");
        let export = common::ft().args(["export", "--checkpoint", dir.join("final").to_str().unwrap(), "--out", out.to_str().unwrap(), "--merge"]).output().unwrap();
        assert!(export.status.success(), "{}", common::text(&export));
        out.join("model.safetensors")
    };
    same(&merged(&split), &merged(&one), "the merged export");
    let checkpoint = split.join("checkpoints/step-00000001");
    let resumed = run("resumed-ep1", &[&["--nproc-per-node", "1", "--batch-size", "4", "--strategy", "ddp", "--resume", checkpoint.to_str().unwrap()][..], &qlora[..6]].concat());
    let (x, y) = (*common::losses(&resumed).last().unwrap(), baseline[1]);
    assert!((x - y).abs() <= 1e-5 * y.abs(), "QLoRA resumed at degree 1, step 2: loss {x} vs the uninterrupted {y}");
}

/// `--expert-parallel N` is checked before any rank starts, each bad degree
/// refused in one line naming what it must divide: the world size, the
/// experts; a dense model has none to split; over QLoRA's 4-bit base, a
/// degree whose ranks' experts would cut a 4-bit block of the whole tensor.
#[test]
fn expert_parallel_degrees_are_checked_in_one_line() {
    let scratch = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [1]});
    std::fs::write(scratch.path().join("config.json"), config.to_string()).unwrap();
    let data = scratch.path().join("train.jsonl");
    std::fs::write(&data, "{\"text\": \"In the hills of Kalora\"}\n").unwrap();
    let refused = |model: &Path, flags: &[&str]| {
        let output = common::ft()
            .args(["train", "--model", model.to_str().unwrap(), "--init", "random", "--train-file", data.to_str().unwrap()])
            .args(["--output-dir", scratch.path().join("out").to_str().unwrap()])
            .args(flags)
            .output()
            .unwrap();
        let text = common::text(&output);
        assert!(!output.status.success() && text.trim().lines().count() == 1, "{flags:?}: {text}");
        text.trim().to_string()
    };
    let flag = "error: train.expert_parallel (--expert-parallel)";
    assert_eq!(refused(scratch.path(), &["--expert-parallel", "3", "--nproc-per-node", "2"]), format!("{flag} 3 must divide the world size (2 ranks) into groups that each hold every expert once"));
    assert_eq!(refused(scratch.path(), &["--expert-parallel", "3", "--nproc-per-node", "3"]), format!("{flag} 3 must divide the model's 8 experts, so that each rank of a group holds as many"));
    assert_eq!(refused(&fixture("llama"), &["--expert-parallel", "2", "--nproc-per-node", "2"]), format!("{flag} 2: model_type llama is not a mixture of experts, so it has no experts to split over ranks (leave it at 1)"));
    assert!(refused(scratch.path(), &["--expert-parallel", "0"]).starts_with(&format!("{flag} must be at least 1")));
    let hybrid = ["--expert-parallel", "2", "--nproc-per-node", "6", "--strategy", "hybrid_shard", "--shard-group-size", "3"];
    assert_eq!(
        refused(scratch.path(), &hybrid),
        format!("{flag} 2 with a shard group of 3 ranks: one must divide the other, so that the ranks of a shard group holding the same experts split their state evenly (choose the degree or --shard-group-size so)")
    );
    let qlora = ["--expert-parallel", "8", "--nproc-per-node", "8", "--lora-r", "4", "--quantize", "nf4", "--set", "model.quant_blocksize=4096"];
    assert_eq!(
        refused(scratch.path(), &qlora),
        format!("{flag} 8 with model.quantize (--quantize) nf4: a rank's share of model.layers.0.mlp.experts.down_proj [8, 64, 32] (1 of its 8 experts) is 2048 values, not a whole number of 4-bit blocks of 4096 (model.quant_blocksize), so a block of the whole tensor would straddle two ranks; choose a degree or block size that divides it")
    );
}

/// Generation runs the experts through the KV cache as a forward does:
/// left-padded prompts decoded together give each prompt's tokens alone.
#[test]
fn moe_batched_greedy_decoding_equals_one_prompt_at_a_time() {
    let scratch = tempfile::tempdir().unwrap();
    for name in moe_models(scratch.path()) {
        let dir = scratch.path().join(name).join("hub");
        let model = hf::load_model(&dir).unwrap();
        assert!(!model.graph_capturable(Device::Cpu, Kind::Float), "{name}: the experts read their sizes on the host");
        let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
        let prompts: Vec<Vec<i64>> = (0..3).map(|i| (0..3 + 2 * i).map(|t| (7 * t + 3 * i + 1) % 100).collect()).collect();
        let one_at_a_time: Vec<Vec<i64>> = prompts.iter().map(|p| greedy(model.as_ref(), &params, p, 6, None, Kind::Float).unwrap()).collect();
        let batched = greedy_batch(model.as_ref(), &params, &prompts, &Decoding::greedy(6, None, Kind::Float)).unwrap();
        assert_eq!(batched, one_at_a_time, "{name}");
    }
}

/// Runs tests/python/peft_reference.py with `args`, in the binary's one process of it.
fn peft_reference(args: &[&Path]) {
    common::reference_job("peft_reference.py", &args.iter().map(|arg| arg.as_os_str()).collect::<Vec<_>>());
}

/// LoRA on the experts (`experts`, beside attention's q on Qwen3-MoE) as
/// peft 0.21's `target_parameters` adds it: ft's adapters, their B drawn
/// so that every factor has a gradient, written as peft writes them, load
/// with `PeftModel.from_pretrained` on transformers' Qwen3-MoE and Mixtral
/// at ft's logits, loss (the load-balancing loss included) and adapter
/// gradients, and read back in ft at the same logits; merged into the
/// experts, they load in transformers at the adapted logits.
#[test]
fn moe_lora_on_experts_loads_in_peft_and_merges_in_transformers() {
    use ft_core::lora::{LoraModel, EXPERTS};
    let scratch = tempfile::tempdir().unwrap();
    moe_models(scratch.path());
    let ids_file = scratch.path().join("ids.json");
    let rows = [[1i64, 5, 9, 14, 27, 3, 8, 2, 40, 77], [4, 4, 6, 20, 7, 19, 11, 30, 101, 64]];
    std::fs::write(&ids_file, serde_json::json!(rows).to_string()).unwrap();
    let ids = Tensor::from_slice2(&rows);
    let cases: [(&str, &[&str]); 2] = [("qwen3_moe", &["q", EXPERTS]), ("mixtral", &[EXPERTS])];
    let mut jobs: Vec<PathBuf> = vec![];
    let ours: Vec<_> = cases
        .iter()
        .map(|(name, targets)| {
            let dir = scratch.path().join(name).join("hub");
            let base = hf::load_model(&dir).unwrap();
            let mut params = hf::load_params(base.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
            let config = ft_core::config::LoraConfig { r: 4, alpha: Some(8.0), dropout: 0.0, targets: targets.iter().map(|t| t.to_string()).collect() };
            let lora = LoraModel::new(base, &config).unwrap();
            assert_eq!(lora.peft_target_parameters(), ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], "{name}");
            params.extend(lora.initial_adapters(5, Device::Cpu));
            for (unit, tensors) in lora.units().iter().zip(&mut params).skip(lora.base_units()) {
                for (spec, tensor) in unit.params.iter().zip(tensors) {
                    if spec.name.ends_with("lora_B.weight") {
                        *tensor = Tensor::randn(tensor.size(), (Kind::Float, Device::Cpu)) * 0.3;
                    }
                    let _ = tensor.set_requires_grad(true);
                }
            }
            let logits_and_loss = |lora: &LoraModel, params: &[Vec<Tensor>]| {
                let inputs = Inputs::ids(&ids);
                let ctx = lora.context(&inputs, 0, Kind::Float, false).unwrap();
                let (outputs, aux) = ft_core::model::forward_with_auxiliary(lora, params, &inputs, &ctx, None);
                let (hidden, weight) = lm_outputs(outputs).unwrap();
                let coefficient = lora.auxiliary_loss().unwrap().coefficient();
                let loss = lm_loss(&hidden, &weight, &ids, 7, None).unwrap() + aux.expect("output_router_logits adds the load-balancing loss") * coefficient;
                (logits(&hidden, &weight), loss)
            };
            let (ft_logits, loss) = logits_and_loss(&lora, &params);
            loss.backward();
            let trained: Vec<Vec<Tensor>> = params.iter().enumerate().map(|(u, t)| if lora.frozen(u) { vec![] } else { t.iter().map(Tensor::detach).collect() }).collect();
            let adapter = scratch.path().join(format!("{name}-adapter"));
            ft_models::peft::save_adapter(&lora, &trained, &adapter, Some(&dir)).unwrap();
            let (read_back, read_params) = ft_models::peft::load_adapted(&adapter, Kind::Float, Device::Cpu).unwrap();
            let error = relative(&logits_and_loss(&read_back, &read_params).0, &ft_logits, 0.0);
            assert!(error <= 1e-6, "{name}: the adapter read back gives logits {error:e} off");
            // What ft cannot run as peft would is refused by name: one fused parameter alone, a rank per module.
            let config_file = adapter.join(ft_models::peft::CONFIG_FILE);
            let written = std::fs::read_to_string(&config_file).unwrap();
            for (key, value, refusal) in [
                ("target_parameters", serde_json::json!(["mlp.experts.down_proj"]), "target_parameters [\"mlp.experts.down_proj\"]: ft adapts"),
                ("rank_pattern", serde_json::json!({".*\\.gate_up_proj": 8}), "rank_pattern is set; ft runs one rank and alpha for every adapted layer"),
            ] {
                let mut edited: serde_json::Value = serde_json::from_str(&written).unwrap();
                edited[key] = value;
                std::fs::write(&config_file, edited.to_string()).unwrap();
                let message = format!("{:#}", ft_models::peft::load_adapted(&adapter, Kind::Float, Device::Cpu).err().expect("refused"));
                assert!(message.contains(refusal), "{name}: {message}");
            }
            std::fs::write(&config_file, written).unwrap();

            let mut merged: Vec<Vec<Tensor>> = params.iter().map(|unit| unit.iter().map(Tensor::detach).collect()).collect();
            lora.merge(&mut merged);
            merged.truncate(lora.base_units());
            let merged_dir = scratch.path().join(format!("{name}-merged"));
            hf::save(lora.base(), &merged, &merged_dir, Kind::Float).unwrap();
            let (with_peft, with_merged) = (scratch.path().join(format!("{name}-peft")), scratch.path().join(format!("{name}-transformers")));
            jobs.extend(["--reference".into(), dir, adapter, ids_file.clone(), with_peft.clone(), "--logits".into(), merged_dir, ids_file.clone(), with_merged.clone()]);
            (lora, params, ft_logits, loss, with_peft, with_merged)
        })
        .collect();
    peft_reference(&jobs.iter().map(PathBuf::as_path).collect::<Vec<_>>());
    for ((name, _), (lora, params, ft_logits, loss, with_peft, with_merged)) in cases.iter().zip(ours) {
        let reference = tensors(&with_peft.join("reference.safetensors"));
        let error = relative(&ft_logits, &reference["logits"], 0.0);
        assert!(error <= 1e-5, "{name}: logits differ from peft's by {error:e}");
        let error = relative(&loss, &reference["loss"], 0.0);
        assert!(error <= 1e-5, "{name}: loss {} vs peft's {}", loss.double_value(&[]), reference["loss"].double_value(&[]));
        let mut compared = 0;
        for (unit, tensors) in lora.units().iter().zip(&params).skip(lora.base_units()) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                let expected = reference.get(&format!("grad.{}", spec.hf_name)).unwrap_or_else(|| panic!("{name}: peft has no {}", spec.hf_name));
                let error = relative(&tensor.grad(), expected, 0.0);
                assert!(error <= 1e-5, "{name}: gradient of {} differs from peft's by {error:e}", spec.hf_name);
                compared += 1;
            }
        }
        assert_eq!(compared, reference.keys().filter(|k| k.starts_with("grad.")).count(), "{name}: peft trains exactly ft's adapters");
        let error = relative(&tensors(&with_merged.join("reference.safetensors"))["logits"], &ft_logits, 0.0);
        assert!(error <= 1e-5, "{name}: the merged model's logits in transformers differ by {error:e}");
    }
}

/// The tiny Qwen3-MoE the training tests start from, and four
/// prompt/completion rows to train it on.
fn moe_training_files(scratch: &Path) -> (PathBuf, PathBuf) {
    moe_models(scratch);
    let data = scratch.join("train.jsonl");
    let rows: Vec<String> = (0..4).map(|i| serde_json::json!({"prompt": format!("Where does the {} live? ", ["lynx", "heron"][i % 2]), "completion": "In the hills of Kalora"}).to_string()).collect();
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    (scratch.join("qwen3_moe_train/hub"), data)
}

/// `ft train --lora-targets experts` on a tiny Qwen3-MoE: the adapters on
/// the experts learn (the loss falls), two ranks under full_shard train as
/// one, final/ loads in peft at the logits `ft forward` reads from it, and
/// `ft export --merge` folds them into the experts, which transformers
/// loads at those logits.
#[test]
fn moe_lora_training_on_experts_exports_for_peft_and_transformers() {
    let scratch = tempfile::tempdir().unwrap();
    let (model, data) = moe_training_files(scratch.path());
    let train = |name: &str, flags: &[&str]| {
        let out = scratch.path().join(name);
        let output = common::ft()
            .args(["train", "--model", model.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()])
            .args(["--task", "causal_lm", "--max-steps", "4", "--dtype", "f32", "--lr", "2e-2", "--device", "cpu", "--set", "data.shuffle=false"])
            .args(["--lora-r", "4", "--lora-targets", "experts"])
            .args(flags)
            .output()
            .unwrap();
        let log = common::text(&output);
        assert!(output.status.success() && log.contains("mlp.experts.down_proj, mlp.experts.gate_up_proj"), "{name}: {log}");
        out
    };
    let out = train("run", &["--nproc-per-node", "1", "--batch-size", "4"]);
    let losses = common::losses(&out);
    assert!(losses.len() == 4 && losses[3] < losses[0], "the experts' adapters learn: {losses:?}");
    let sharded = common::losses(&train("two-ranks", &["--nproc-per-node", "2", "--batch-size", "2", "--strategy", "full_shard"]));
    assert!(sharded.len() == 4 && sharded.iter().zip(&losses).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs()), "two ranks {sharded:?} vs one {losses:?}");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("final/adapter_config.json")).unwrap()).unwrap();
    assert_eq!((&config["target_modules"], &config["target_parameters"]), (&serde_json::json!([]), &serde_json::json!(["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])));

    let merged = scratch.path().join("merged");
    let export = common::ft()
        .args(["export", "--checkpoint", "latest", "--output-dir", out.to_str().unwrap(), "--out", merged.to_str().unwrap(), "--merge"])
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", common::text(&export));
    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2], [4, 4, 6, 20, 7, 19, 11, 30]]").unwrap();
    let ours = scratch.path().join("ours.safetensors");
    let forward = common::ft().args(["forward", "--model", out.join("final").to_str().unwrap(), "--ids", ids.to_str().unwrap(), "--out", ours.to_str().unwrap()]).output().unwrap();
    assert!(forward.status.success(), "{}", common::text(&forward));
    let (with_peft, with_merged) = (scratch.path().join("peft"), scratch.path().join("transformers"));
    peft_reference(&[Path::new("--reference"), &model, &out.join("final"), &ids, &with_peft, Path::new("--logits"), &merged, &ids, &with_merged]);
    let ours = &tensors(&ours)["logits"];
    for (name, reference) in [("peft", with_peft), ("the merged export in transformers", with_merged)] {
        let error = relative(ours, &tensors(&reference.join("reference.safetensors"))["logits"], 0.0);
        assert!(error <= 1e-5, "ft forward on final/ and {name} differ by {error:e}");
    }
}

/// QLoRA's 4-bit base on a mixture of experts (Qwen3-MoE): each frozen
/// block packed as the trainer packs it (`PackedLayout`, what
/// `Model::held_in_4bit` picks) and dequantized, and the base as `ft
/// forward` rounds it (`LoraModel::round_base_to_4bit`), equal bit for bit
/// the 4 bits bitsandbytes' `quantize_4bit` makes of each linear layer and
/// of each fused expert tensor [E, N, K] whole (its packed bytes and quant
/// state, dequantized by `nf4.rs`, which tests/qlora.rs checks against
/// bitsandbytes' own dequantization) — and, where bitsandbytes runs its
/// generic CPU path, its own `dequantize_4bit` of them (NF4 bit for bit,
/// FP4 but for the sign of zero; on an AVX512 processor that comparison is
/// skipped and listed: its kernel dequantizes otherwise there,
/// `common::bitsandbytes_runs_kernels_of_its_own`).
/// The router and norms, which bitsandbytes leaves, stay as they are; an
/// expert-parallel rank's part of each fused expert tensor
/// (`PackedLayout::expert_part`) dequantizes to bitsandbytes' experts of
/// its rows. NF4 double quantized and FP4.
#[test]
fn moe_4bit_experts_equal_bitsandbytes_bit_for_bit() {
    use ft_core::lora::RunModel;
    use ft_core::nf4::{QuantType, Quantization, Quantized4bit};
    use ft_core::distributed::packed_base::PackedLayout;
    let same_bits = |ours: &Tensor, theirs: &Tensor, what: &str| {
        assert_eq!(ours.size(), theirs.size(), "{what}");
        let differ = ours.contiguous().view_dtype(Kind::Int).ne_tensor(&theirs.contiguous().view_dtype(Kind::Int)).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(differ, 0, "{what}: {differ} values differ");
    };
    let scratch = tempfile::tempdir().unwrap();
    moe_models(scratch.path());
    let dir = scratch.path().join("qwen3_moe/hub");
    let params = hf::load_params(hf::load_model(&dir).unwrap().as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let lora = ft_core::config::LoraConfig { r: 4, alpha: None, dropout: 0.0, targets: vec!["q".into(), "v".into(), "experts".into()] };
    let generic_bitsandbytes = !common::bitsandbytes_runs_kernels_of_its_own();
    for (quant_type, double_quant) in [(QuantType::Nf4, true), (QuantType::Fp4, false)] {
        let quantization = Quantization { quant_type, blocksize: 64, double_quant };
        let rounded = scratch.path().join(format!("rounded-{}", quant_type.name()));
        peft_reference(&[Path::new("--round"), &dir, Path::new(quant_type.name()), Path::new(&double_quant.to_string()), &rounded]);
        let states = tensors(&rounded.with_extension("states.safetensors"));
        let dequantized_by_bitsandbytes = generic_bitsandbytes.then(|| hf::load_params(hf::load_model(&dir).unwrap().as_ref(), &rounded, Kind::Float, Device::Cpu).unwrap());
        let run = RunModel::new(hf::load_model(&dir).unwrap(), &lora, Some(quantization)).unwrap();
        let qlora = run.lora().unwrap();
        let mut by_forward: Vec<Vec<Tensor>> = params.iter().map(|unit| unit.iter().map(Tensor::shallow_clone).collect()).collect();
        qlora.round_base_to_4bit(&mut by_forward).unwrap();
        let mut experts_held = 0;
        for unit in ft_core::model::block_units(qlora) {
            let spec = &qlora.units()[unit];
            let offsets = ft_core::distributed::flat::param_offsets(spec);
            let mut layout = PackedLayout::new(spec, &offsets, Kind::Float, quantization, |param| qlora.held_in_4bit(param));
            let bytes = layout.pack(spec, &offsets, &params[unit], layout.bytes()).unwrap();
            let unpacked = Tensor::zeros([spec.numel()], (Kind::Float, Device::Cpu));
            layout.unpack_into(&bytes, &unpacked);
            for &(param, offset) in &offsets {
                let (name, original) = (&spec.params[param].hf_name, &params[unit][param]);
                let held = qlora.held_in_4bit(&spec.params[param]);
                assert_eq!(held, states.contains_key(name.as_str()), "{quant_type:?}: {name} is held in 4 bits exactly where bitsandbytes quantizes it");
                let expected = match held {
                    true => Quantized4bit::from_state_dict(name, |key| states.get(key).map(Tensor::shallow_clone)).unwrap().dequantize(),
                    false => original.shallow_clone(),
                };
                let by_trainer = unpacked.narrow(0, offset, original.numel() as i64).view(original.size().as_slice());
                same_bits(&by_trainer, &expected, &format!("{quant_type:?}: {name} packed by the trainer"));
                same_bits(&by_forward[unit][param], &expected, &format!("{quant_type:?}: {name} rounded for ft forward"));
                if let Some(theirs) = &dequantized_by_bitsandbytes {
                    let what = format!("{quant_type:?}: {name} against bitsandbytes' dequantize_4bit");
                    match quant_type {
                        QuantType::Nf4 => same_bits(&by_trainer, &theirs[unit][param], &what),
                        // FP4's index 8 is -0 to ft as to bitsandbytes' native kernels, +0 to its generic path (`nf4.rs`).
                        QuantType::Fp4 => assert!(by_trainer.eq_tensor(&theirs[unit][param]).all().int64_value(&[]) == 1, "{what}"),
                    }
                }
                if held && original.dim() == 3 {
                    experts_held += 1;
                    // Under expert parallelism, each rank's part of the whole tensor's blocks: bitsandbytes' experts of its rows.
                    for degree in [2, 8] {
                        let mut local = spec.clone();
                        local.params[0].shape[0] /= degree as i64;
                        let local_offsets = ft_core::distributed::flat::param_offsets(&local);
                        let rows = local.params[0].shape[0];
                        for rank in 0..degree {
                            let mut part = PackedLayout::expert_part(spec, Kind::Float, quantization, |param| qlora.held_in_4bit(param), (degree, rank));
                            let bytes = part.pack(spec, &local_offsets, &params[unit], part.bytes()).unwrap();
                            let unpacked = Tensor::zeros([local.numel()], (Kind::Float, Device::Cpu));
                            part.unpack_into(&bytes, &unpacked);
                            let theirs = expected.narrow(0, rows * rank as i64, rows);
                            same_bits(&unpacked.view(theirs.size().as_slice()), &theirs, &format!("{quant_type:?}: {name}, rank {rank} of {degree}'s experts"));
                        }
                    }
                }
            }
        }
        assert_eq!(experts_held, 2, "layer 0's gate_up_proj and down_proj");
    }
}

/// `ft train --quantize nf4 --lora-targets q,v,experts` on a tiny
/// Qwen3-MoE: the log says the experts are held in 4 bits, the adapters
/// learn over them, a run resumed from the step-2 checkpoint takes the
/// uninterrupted run's steps, the merged export folds the adapters into
/// the 4-bit base at `ft forward`'s logits on final/, and those equal
/// peft's over the base passed through bitsandbytes' NF4, experts included
/// (where bitsandbytes dequantizes as its generic CPU path does: see
/// `moe_4bit_experts_equal_bitsandbytes_bit_for_bit`); a 4-bit base without
/// adapters is refused.
#[test]
fn moe_qlora_on_4bit_experts_trains_resumes_and_runs_as_peft_over_bitsandbytes() {
    let scratch = tempfile::tempdir().unwrap();
    let (model, data) = moe_training_files(scratch.path());
    let train = |name: &str, extra: &[&str]| {
        let out = scratch.path().join(name);
        let output = common::ft()
            .args(["train", "--model", model.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()])
            .args(["--task", "causal_lm", "--max-steps", "4", "--batch-size", "4", "--dtype", "f32", "--lr", "2e-2", "--nproc-per-node", "1", "--device", "cpu"])
            .args(extra)
            .output()
            .unwrap();
        (output.status.success(), out, common::text(&output))
    };
    let qlora = ["--lora-r", "4", "--lora-targets", "q,v,experts", "--quantize", "nf4"];
    let (succeeded, out, log) = train("one", &[&qlora[..], &["--save-every", "2", "--save-total-limit", "0"]].concat());
    // Layer 0 (sparse): attention's four and the two expert tensors; layer 1 (dense): attention's four and the MLP's three.
    assert!(succeeded && log.contains("QLoRA: 11 weight matrices and 2 fused expert tensors (every expert) of the base's blocks"), "{log}");
    let losses = common::losses(&out);
    assert!(losses.len() == 4 && losses[3] < losses[0], "the adapters learn over the 4-bit experts: {losses:?}");
    let (succeeded, resumed, log) = train("resumed", &[&qlora[..], &["--resume", out.join("checkpoints/step-00000002").to_str().unwrap()]].concat());
    assert!(succeeded, "{log}");
    let resumed = common::losses(&resumed);
    assert!(resumed.len() >= 2, "{resumed:?}");
    for (a, b) in resumed[resumed.len() - 2..].iter().zip(&losses[2..]) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "resumed at step 2: {resumed:?} vs {losses:?}");
    }
    let (succeeded, _, log) = train("refused", &qlora[4..]);
    assert!(!succeeded && log.contains("set train.lora.r (--lora-r) to train adapters on it"), "{log}");

    let merged = scratch.path().join("merged");
    let export = common::ft().args(["export", "--checkpoint", out.join("final").to_str().unwrap(), "--out", merged.to_str().unwrap(), "--merge"]).output().unwrap();
    assert!(export.status.success(), "{}", common::text(&export));
    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2], [4, 4, 6, 20, 7, 19, 11, 30]]").unwrap();
    let forward = |model: &Path, name: &str| {
        let logits = scratch.path().join(name);
        let output = common::ft().args(["forward", "--model", model.to_str().unwrap(), "--ids", ids.to_str().unwrap(), "--out", logits.to_str().unwrap()]).output().unwrap();
        assert!(output.status.success(), "{}", common::text(&output));
        tensors(&logits).remove("logits").unwrap()
    };
    let ours = forward(&out.join("final"), "ours.safetensors");
    let error = relative(&forward(&merged, "merged.safetensors"), &ours, 0.0);
    assert!(error <= 1e-5, "the merged export and final/ on its 4-bit base differ by {error:e}");
    if common::bitsandbytes_runs_kernels_of_its_own() {
        return;
    }
    let (rounded, with_peft) = (scratch.path().join("rounded"), scratch.path().join("peft"));
    peft_reference(&[Path::new("--round"), &model, Path::new("nf4"), Path::new("true"), &rounded, Path::new("--reference"), &rounded, &out.join("final"), &ids, &with_peft]);
    let error = relative(&ours, &tensors(&with_peft.join("reference.safetensors"))["logits"], 0.0);
    assert!(error <= 1e-5, "ft forward on final/ and peft over bitsandbytes' 4-bit base differ by {error:e}");
}
