//! BERT for question answering against transformers, whose side
//! tests/python/bert_reference.py runs (random weights, reference outputs):
//! start/end logits, the span loss and every gradient for a small config and
//! bert-base's shape; base checkpoints (BertModel, BertForMaskedLM) loading
//! with a fresh `qa_outputs`; `ft init-model`'s output loading in
//! transformers; bad configs refused by key.

use ft_core::model::{forward, head, Inputs, Model};
use ft_models::hf;
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Reduction, Tensor};

use crate::common;
use common::{ft, shared, text};

const SMALL_CONFIG: &str = r#"{
  "model_type": "bert", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64, "type_vocab_size": 2
}"#;

fn write_small_config(dir: &Path) -> PathBuf {
    let path = dir.join("small.json");
    std::fs::write(&path, SMALL_CONFIG).unwrap();
    path
}

/// Runs tests/python/bert_reference.py with `args`, in the binary's one process of it.
fn reference_script(args: &[&Path]) {
    common::reference_job("bert_reference.py", &args.iter().map(|arg| arg.as_os_str()).collect::<Vec<_>>());
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Right-padded sequences of the given lengths: a question (segment 0) then a
/// context (segment 1), with an answer span inside the context.
#[derive(Default)]
struct Batch {
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
    token_type_ids: Vec<Vec<i64>>,
    start_positions: Vec<i64>,
    end_positions: Vec<i64>,
}

impl Batch {
    fn new(vocab: i64, lengths: &[i64]) -> Batch {
        let seq = *lengths.iter().max().unwrap();
        let mut state = 12345u64;
        let mut next_token = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            1 + (state >> 33) as i64 % (vocab - 1)
        };
        let mut batch = Batch::default();
        for &len in lengths {
            let question = len / 3;
            batch.input_ids.push((0..seq).map(|i| if i < len { next_token() } else { 0 }).collect());
            batch.attention_mask.push((0..seq).map(|i| i64::from(i < len)).collect());
            batch.token_type_ids.push((0..seq).map(|i| i64::from(i >= question && i < len)).collect());
            batch.start_positions.push(question + 1);
            batch.end_positions.push(len - 2);
        }
        batch
    }

    fn write(&self, path: &Path) {
        let json = serde_json::json!({
            "input_ids": self.input_ids, "attention_mask": self.attention_mask, "token_type_ids": self.token_type_ids,
            "start_positions": self.start_positions, "end_positions": self.end_positions,
        });
        std::fs::write(path, json.to_string()).unwrap();
    }

    fn inputs(&self) -> Inputs {
        Inputs {
            input_ids: Tensor::from_slice2(&self.input_ids),
            attention_mask: Some(Tensor::from_slice2(&self.attention_mask)),
            token_type_ids: Some(Tensor::from_slice2(&self.token_type_ids)),
            documents: None,
            branches: None,
            token_mask: None,
        }
    }

    fn real_tokens(&self) -> Tensor {
        Tensor::from_slice2(&self.attention_mask).to_kind(Kind::Bool)
    }
}

/// ft's start and end logits for `batch`, in eval mode.
fn start_end_logits(model: &dyn Model, params: &[Vec<Tensor>], batch: &Batch) -> (Tensor, Tensor) {
    assert_eq!(model.head_kind(), head::QUESTION_ANSWERING);
    let inputs = batch.inputs();
    let ctx = model.context(&inputs, 0, Kind::Float, false).unwrap();
    match <[Tensor; 2]>::try_from(forward(model, params, &inputs, &ctx, None)) {
        Ok([start, end]) => (start, end),
        Err(outputs) => panic!("a question-answering head returns 2 tensors, not {}", outputs.len()),
    }
}

/// (CE(start) + CE(end)) / 2 in fp32, as BertForQuestionAnswering's loss.
fn span_loss(start: &Tensor, end: &Tensor, batch: &Batch) -> Tensor {
    let ce = |logits: &Tensor, targets: &[i64]| {
        logits.to_kind(Kind::Float).cross_entropy_loss::<Tensor>(&Tensor::from_slice(targets), None, Reduction::Mean, -100, 0.0)
    };
    (ce(start, &batch.start_positions) + ce(end, &batch.end_positions)) / 2.0
}

/// Max abs difference over max abs reference (at least `floor`).
fn relative(actual: &Tensor, expected: &Tensor, floor: f64) -> f64 {
    let error = (actual.to_kind(Kind::Double) - expected.to_kind(Kind::Double)).abs().max().double_value(&[]);
    error / expected.abs().max().double_value(&[]).max(floor).max(1e-30)
}

fn read_reference(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

/// Worst relative error of ft's start and end logits against the reference's, over the real tokens and over all.
fn logit_errors(start: &Tensor, end: &Tensor, reference: &HashMap<String, Tensor>, batch: &Batch) -> (f64, f64) {
    let real = batch.real_tokens();
    let (mut over_real, mut over_all) = (0f64, 0f64);
    for (actual, name) in [(start, "start_logits"), (end, "end_logits")] {
        let expected = &reference[name];
        over_real = over_real.max(relative(&actual.masked_select(&real), &expected.masked_select(&real), 0.0));
        over_all = over_all.max(relative(actual, expected, 0.0));
    }
    (over_real, over_all)
}

/// Random BertForQuestionAnswering weights from transformers against ft:
/// logits, loss and every parameter's gradient.
fn check_parity(config: &Path, lengths: &[i64]) {
    let dir = tempfile::tempdir().unwrap();
    let (weights, batch_path, out) = (dir.path().join("model"), dir.path().join("batch.json"), dir.path().join("reference"));
    let vocab = hf::model_from_config(read_json(config)).unwrap().dims().vocab;
    let batch = Batch::new(vocab, lengths);
    batch.write(&batch_path);
    let question_answering = Path::new("question_answering");
    let (create, run_reference) = (Path::new("--create"), Path::new("--reference"));
    reference_script(&[create, config, question_answering, &weights, run_reference, &weights, &batch_path, &out]);
    let reference = read_reference(&out);

    let model = hf::load_model(&weights).unwrap();
    let (params, report) = hf::load_params_with_report(model.as_ref(), &weights, Kind::Float, Device::Cpu).unwrap();
    assert_eq!(report, hf::LoadReport::default(), "a BertForQuestionAnswering checkpoint loads as it is");
    for tensor in params.iter().flatten() {
        let _ = tensor.set_requires_grad(true);
    }
    let (start, end) = start_end_logits(model.as_ref(), &params, &batch);
    let (over_real, over_all) = logit_errors(&start, &end, &reference, &batch);
    let loss = span_loss(&start, &end, &batch);
    let loss_error = relative(&loss, &reference["loss"], 0.0);
    eprintln!("{}: logits {over_real:.2e} over real tokens, {over_all:.2e} over all; loss {loss_error:.2e}", config.display());
    assert!(over_real <= 1e-4, "start/end logits over the real tokens differ by {over_real:e}");
    assert!(over_all <= 1e-4, "start/end logits over all positions (padding too) differ by {over_all:e}");
    assert!(loss_error <= 1e-5, "loss {} vs transformers' {}", loss.double_value(&[]), reference["loss"].double_value(&[]));

    loss.backward();
    let gradients: Vec<&Tensor> = reference.iter().filter(|(name, _)| name.starts_with("grad.")).map(|(_, g)| g).collect();
    let floor = 1e-3 * gradients.iter().map(|g| g.abs().max().double_value(&[])).fold(0.0, f64::max);
    let (mut worst, mut compared) = ((0f64, String::new()), 0);
    for (unit, tensors) in model.units().iter().zip(&params) {
        for (spec, tensor) in unit.params.iter().zip(tensors) {
            let expected = &reference[&format!("grad.{}", spec.hf_name)];
            let error = relative(&tensor.grad(), expected, floor);
            assert!(error <= 1e-3, "gradient of {} differs by {error:e}", spec.hf_name);
            if error >= worst.0 {
                worst = (error, spec.hf_name.clone());
            }
            compared += 1;
        }
    }
    assert_eq!(compared, gradients.len(), "every transformers parameter is an ft parameter");
    eprintln!("{}: {compared} gradients, worst {:.2e} ({})", config.display(), worst.0, worst.1);
}

#[test]
fn small_bert_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    check_parity(&write_small_config(dir.path()), &[13, 7, 10]);
}

#[test]
fn bert_base_shape_matches_transformers() {
    let bert_base = shared::config("bert-base-uncased");
    if shared::skipped_without(&[&bert_base]) {
        return;
    }
    check_parity(&shared::path(&bert_base), &[48, 31]);
}

#[test]
fn absent_mask_and_segments_mean_all_tokens_in_segment_zero_and_dropout_acts_only_in_training() {
    let model = hf::model_from_config(serde_json::from_str(SMALL_CONFIG).unwrap()).unwrap();
    let params = ft_core::model::init_params(model.as_ref(), 0, Kind::Float, Device::Cpu).unwrap();
    let ids = Tensor::from_slice2(&Batch::new(300, &[9, 9]).input_ids);
    let run = |inputs: &Inputs, train: bool| {
        let ctx = model.context(inputs, 0, Kind::Float, train).unwrap();
        Tensor::stack(&forward(model.as_ref(), &params, inputs, &ctx, None), 0)
    };
    let bare = run(&Inputs::ids(&ids), false);
    let explicit =
        Inputs { input_ids: ids.shallow_clone(), attention_mask: Some(ids.ones_like()), token_type_ids: Some(ids.zeros_like()), documents: None, branches: None, token_mask: None };
    assert!(relative(&bare, &run(&explicit, false), 0.0) < 1e-6, "no mask and no segments: every token attends, segment 0");
    let trained = run(&Inputs::ids(&ids), true);
    assert!(bool::try_from(trained.isfinite().all()).unwrap() && relative(&trained, &bare, 0.0) > 1e-3, "dropout while training");
}

/// A `Write` into a shared buffer, for capturing the loader's log.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().write(bytes)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn base_checkpoints_load_with_a_fresh_question_answering_head() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_small_config(dir.path());
    let (base, masked_lm) = (dir.path().join("base"), dir.path().join("masked_lm"));
    let create = Path::new("--create");
    reference_script(&[create, &config, Path::new("base"), &base, create, &config, Path::new("masked_lm"), &masked_lm]);
    let added = vec!["qa_outputs.weight".to_string(), "qa_outputs.bias".to_string()];

    for (source, other_heads) in [(&base, "pooler."), (&masked_lm, "cls.")] {
        let model = hf::load_model(source).unwrap();
        let log = Captured::default();
        let subscriber = tracing_subscriber::fmt().with_writer({
            let log = log.clone();
            move || log.clone()
        });
        let (params, report) = tracing::subscriber::with_default(subscriber.with_ansi(false).finish(), || {
            hf::load_params_with_report(model.as_ref(), source, Kind::Float, Device::Cpu).unwrap()
        });

        let stored: HashMap<String, Tensor> = Tensor::read_safetensors(source.join("model.safetensors")).unwrap().into_iter().collect();
        let unprefixed = |name: &str| name.trim_start_matches("bert.").to_string();
        let ignored: Vec<String> = stored.keys().filter(|name| unprefixed(name).starts_with(other_heads)).cloned().collect();
        assert!(!ignored.is_empty(), "{} has {other_heads}* tensors", source.display());
        assert_eq!(report.initialised, added, "{}", source.display());
        assert_eq!(report.ignored.iter().collect::<BTreeSet<_>>(), ignored.iter().collect(), "{}", source.display());

        let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert_eq!(log.matches("WARN").count(), 1, "one warning:\n{log}");
        for name in added.iter().chain(&ignored) {
            assert!(log.contains(name.as_str()), "the warning names {name}:\n{log}");
        }

        for (unit, tensors) in model.units().iter().zip(&params) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                if added.contains(&spec.hf_name) {
                    continue;
                }
                let source_tensor = stored.get(&spec.hf_name).or_else(|| stored.get(&unprefixed(&spec.hf_name))).unwrap();
                assert!(tensor.equal(source_tensor), "{} is {}'s", spec.hf_name, source.display());
            }
        }
        let head = params.last().unwrap();
        let (weight, bias) = (&head[0], &head[1]);
        assert_eq!(weight.size(), [2, 64]);
        let std = weight.std(true).double_value(&[]);
        assert!((0.015..0.025).contains(&std), "qa_outputs.weight ~ N(0, 0.02), std {std}");
        assert!(bias.equal(&Tensor::zeros([2], (Kind::Float, Device::Cpu))));
        let (again, _) = hf::load_params_with_report(model.as_ref(), source, Kind::Float, Device::Cpu).unwrap();
        assert!(again.last().unwrap()[0].equal(weight), "the initialised head is the same on every load");
    }

    // bert-base-uncased's hub weights name LayerNorm parameters TF-style, gamma and beta.
    let model = hf::load_model(&masked_lm).unwrap();
    let expected = hf::load_params(model.as_ref(), &masked_lm, Kind::Float, Device::Cpu).unwrap();
    let path = masked_lm.join("model.safetensors");
    let legacy: Vec<(String, Tensor)> = Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(name, tensor)| {
            (name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"), tensor)
        })
        .collect();
    assert!(legacy.iter().any(|(name, _)| name == "bert.embeddings.LayerNorm.gamma"));
    Tensor::write_safetensors(&legacy, &path).unwrap();
    let loaded = hf::load_params(model.as_ref(), &masked_lm, Kind::Float, Device::Cpu).unwrap();
    for (a, b) in loaded.iter().flatten().zip(expected.iter().flatten()) {
        assert!(a.equal(b), "LayerNorm.gamma/beta load as LayerNorm.weight/bias");
    }
}

/// `ft init-model --config CONFIG --out OUT` with `extra` flags.
fn init_model(config: &Path, out: &Path, extra: &[&str]) {
    let output = ft().arg("init-model").arg("--config").arg(config).arg("--out").arg(out).args(extra).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
}

#[test]
fn init_model_writes_what_transformers_loads_as_question_answering() {
    let dir = tempfile::tempdir().unwrap();
    let (weights, batch_path, out) = (dir.path().join("model"), dir.path().join("batch.json"), dir.path().join("reference"));
    init_model(&write_small_config(dir.path()), &weights, &[]);
    assert_eq!(read_json(&weights.join("config.json"))["architectures"], serde_json::json!(["BertForQuestionAnswering"]));

    let batch = Batch::new(300, &[11, 6]);
    batch.write(&batch_path);
    reference_script(&[Path::new("--reference"), &weights, &batch_path, &out]);
    let loading_info = read_json(&out.join("loading_info.json"));
    let nothing = serde_json::json!([]);
    for key in ["missing_keys", "unexpected_keys", "mismatched_keys"] {
        assert_eq!(loading_info[key], nothing, "transformers' {key} loading ft's checkpoint");
    }

    let model = hf::load_model(&weights).unwrap();
    let params = hf::load_params(model.as_ref(), &weights, Kind::Float, Device::Cpu).unwrap();
    let (start, end) = start_end_logits(model.as_ref(), &params, &batch);
    let (over_real, over_all) = logit_errors(&start, &end, &read_reference(&out), &batch);
    eprintln!("init-model: logits {over_real:.2e} over real tokens, {over_all:.2e} over all");
    assert!(over_all <= 1e-4, "start/end logits differ by {over_all:e}");

    // A transformers 5 config names the dtype "dtype", which it reads before "torch_dtype".
    let mut config: serde_json::Value = serde_json::from_str(SMALL_CONFIG).unwrap();
    config["dtype"] = "float32".into();
    let config_path = dir.path().join("with_dtype.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let bf16 = dir.path().join("bf16");
    init_model(&config_path, &bf16, &["--dtype", "bf16"]);
    let written = read_json(&bf16.join("config.json"));
    assert_eq!((&written["dtype"], &written["torch_dtype"]), (&"bfloat16".into(), &"bfloat16".into()));
}

#[test]
fn bad_configs_are_refused_by_key() {
    let small: serde_json::Value = serde_json::from_str(SMALL_CONFIG).unwrap();
    // `value` None: the key is left out.
    let error = |key: &str, value: Option<serde_json::Value>| {
        let mut config = small.clone();
        match &value {
            Some(value) => config[key] = value.clone(),
            None => drop(config.as_object_mut().unwrap().remove(key)),
        }
        match hf::model_from_config(config) {
            Ok(_) => panic!("{key} = {value:?} must be refused"),
            Err(error) => format!("{error:#}"),
        }
    };
    let message = error("num_attention_heads", Some(5.into()));
    assert!(message.contains("hidden_size (64) must be a multiple of num_attention_heads (5)"), "{message}");
    let message = error("hidden_act", Some("relu".into()));
    assert!(message.contains("BERT hidden_act \"relu\" is not supported"), "{message}");
    let message = error("type_vocab_size", Some(0.into()));
    assert!(message.contains("config.json (bert): type_vocab_size must be at least 1, not 0"), "{message}");
    let message = error("hidden_size", None);
    assert!(message.contains("missing field `hidden_size`"), "{message}");
}
