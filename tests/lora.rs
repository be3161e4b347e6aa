//! LoRA against Hugging Face peft (tests/python/peft_reference.py): ft's
//! adapters, written as peft writes them, load with `PeftModel` onto the
//! transformers model and give ft's logits, loss and adapter gradients
//! (fp32, CPU; BLOOM, OPT, Llama, GQA-Llama, Llama 3, Qwen2, Mistral, Qwen3,
//! Gemma 2 and 3, Phi-3 and Phi-4-mini); `all-linear` adapts the layers
//! peft's `all-linear` does; fresh adapters start as peft's do; merged
//! weights, and the folded copies rollouts sample from, are the adapted model; the demo and tiny Qwen3, Gemma 3 and Phi-3
//! models train adapters on two ranks whose exports load; bad settings are
//! refused by key.
//! Every strategy against the single-process LoRA run is in
//! tests/strategies.rs.

use ft_core::config::LoraConfig;
use ft_core::lora::{LoraModel, ALL_LINEAR};
use ft_core::model::{forward, lm_outputs, Inputs, Model};
use ft_core::train::loss::{lm_loss, logits, softcapped};
use ft_models::{hf, peft};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

use crate::common;
use common::{ft, losses, shared, small_bert, text};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Runs tests/python/peft_reference.py with `args`, in the binary's one process of it.
fn reference_script(args: &[&Path]) {
    common::reference_job("peft_reference.py", &args.iter().map(|arg| arg.as_os_str()).collect::<Vec<_>>());
}

fn read(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

fn relative(actual: &Tensor, expected: &Tensor, floor: f64) -> f64 {
    let error = (actual.to_kind(Kind::Double) - expected.to_kind(Kind::Double)).abs().max().double_value(&[]);
    error / expected.abs().max().double_value(&[]).max(floor).max(1e-30)
}

fn lora_config(r: usize, alpha: f64, targets: &[&str]) -> LoraConfig {
    LoraConfig { r, alpha: Some(alpha), dropout: 0.0, targets: targets.iter().map(|t| t.to_string()).collect() }
}

/// ft's logits and loss (labels = ids) on the fixture's rows, in eval mode.
fn logits_and_loss(model: &dyn Model, params: &[Vec<Tensor>], ids: &Tensor) -> (Tensor, Tensor) {
    let inputs = Inputs::ids(ids);
    let ctx = model.context(&inputs, 0, Kind::Float, false).unwrap();
    let (hidden, weight) = lm_outputs(forward(model, params, &inputs, &ctx, None)).unwrap();
    let softcap = model.logit_softcap();
    (softcapped(logits(&hidden, &weight), softcap), lm_loss(&hidden, &weight, ids, 7, softcap).unwrap())
}

fn fixture_ids(name: &str) -> Tensor {
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("ids.json")).unwrap()).unwrap();
    Tensor::from_slice2(&rows)
}

/// A fixture wrapped in adapters on `targets`, its base weights loaded and
/// the adapters drawn fresh, then B set to noise so A's gradients are not zero.
fn adapted(name: &str, targets: &[&str]) -> (LoraModel, Vec<Vec<Tensor>>) {
    let base = hf::load_model(&fixture(name)).unwrap();
    let base_params = hf::load_params(base.as_ref(), &fixture(name), Kind::Float, Device::Cpu).unwrap();
    let lora = LoraModel::new(base, &lora_config(4, 8.0, targets)).unwrap();
    let mut params = base_params;
    params.extend(lora.initial_adapters(5, Device::Cpu));
    for (unit, tensors) in lora.units().iter().zip(&mut params).skip(lora.base_units()) {
        for (spec, tensor) in unit.params.iter().zip(tensors) {
            if spec.name.ends_with("lora_B.weight") {
                *tensor = Tensor::randn(tensor.size(), (Kind::Float, Device::Cpu)) * 0.1;
            }
            let _ = tensor.set_requires_grad(true);
        }
    }
    (lora, params)
}

#[test]
fn adapters_load_in_peft_and_match_its_logits_loss_and_gradients() {
    let cases: [(&str, &[&str]); 13] = [
        ("llama", &["q", "k", "v", "o", "gate", "up", "down"]),
        // The same short names on Llama 3's tied head, Qwen2's biased q/k/v and Mistral's window.
        ("llama3", &["q", "k", "v", "o", "gate", "up", "down"]),
        ("qwen2", &["q", "k", "v", "o", "gate", "up", "down"]),
        ("mistral", &["q", "k", "v", "o", "gate", "up", "down"]),
        // peft's own module names, on grouped-query attention.
        ("llama-gqa", &["q_proj", "v_proj"]),
        ("opt", &["q", "k", "v", "o", "up", "down"]),
        // q, k and v are BLOOM's one fused layer.
        ("bloom", &["q", "v", "o", "up", "down"]),
        ("bloom", &["query_key_value"]),
        // Qwen3's q/k norms, Gemma's soft-capping and alternating layers, Phi-3's fused layers.
        ("qwen3", &[ALL_LINEAR]),
        ("gemma2", &[ALL_LINEAR]),
        ("gemma3", &["q", "k", "v", "o", "gate", "up", "down"]),
        ("phi3", &[ALL_LINEAR]),
        ("phi4-mini", &["qkv", "o", "gate_up", "down"]),
    ];
    // ft's side of every case, then peft's in one process.
    let scratch = tempfile::tempdir().unwrap();
    let mut jobs: Vec<PathBuf> = vec![];
    let ours: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, (name, targets))| {
            let (lora, params) = adapted(name, targets);
            let (ft_logits, loss) = logits_and_loss(&lora, &params, &fixture_ids(name));
            loss.backward();
            let (adapter, out) = (scratch.path().join(format!("adapter-{i}")), scratch.path().join(format!("out-{i}")));
            let detached: Vec<Vec<Tensor>> = params.iter().enumerate().map(|(u, t)| if lora.frozen(u) { vec![] } else { t.iter().map(Tensor::detach).collect() }).collect();
            peft::save_adapter(&lora, &detached, &adapter, Some(&fixture(name))).unwrap();
            jobs.extend(["--reference".into(), fixture(name), adapter, fixture(name).join("ids.json"), out.clone()]);
            (lora, params, ft_logits, loss, out)
        })
        .collect();
    reference_script(&jobs.iter().map(PathBuf::as_path).collect::<Vec<_>>());
    for ((name, targets), (lora, params, ft_logits, loss, out)) in cases.iter().zip(ours) {
        let case = format!("{name} {targets:?}");
        let reference = read(&out);

        let error = relative(&ft_logits, &reference["logits"], 0.0);
        assert!(error <= 1e-4, "{case}: logits differ by {error:e}");
        let error = relative(&loss, &reference["loss"], 0.0);
        assert!(error <= 1e-5, "{case}: loss {} vs peft's {}", loss.double_value(&[]), reference["loss"].double_value(&[]));
        let grads: Vec<&String> = reference.keys().filter(|k| k.starts_with("grad.")).collect();
        let floor = 1e-3 * grads.iter().map(|k| reference[*k].abs().max().double_value(&[])).fold(0.0, f64::max);
        let mut compared = 0;
        for (unit, tensors) in lora.units().iter().zip(&params).skip(lora.base_units()) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                let expected = reference.get(&format!("grad.{}", spec.hf_name)).unwrap_or_else(|| panic!("{case}: peft has no {}", spec.hf_name));
                let error = relative(&tensor.grad(), expected, floor);
                assert!(error <= 1e-4, "{case}: gradient of {} differs by {error:e}", spec.hf_name);
                compared += 1;
            }
        }
        assert_eq!(compared, grads.len(), "{case}: peft trains exactly ft's adapters");
        assert_eq!(compared, 2 * lora.targets().len(), "{case}: an A and a B per adapted layer");
    }
}

/// `all-linear` adapts every linear layer of the blocks, exactly the
/// modules peft's `target_modules="all-linear"` adapts on the same
/// transformers model (every linear layer but the LM head) — but OPT's
/// `project_in` and `project_out` around its blocks, which ft's adapters
/// (one unit per block) do not reach.
#[test]
fn all_linear_adapts_what_peft_adapts() {
    let names = ["llama-gqa", "qwen3", "gemma2", "gemma3", "phi3", "opt", "bloom"];
    let dirs: Vec<PathBuf> = names.iter().map(|name| fixture(name)).collect();
    let job: Vec<&std::ffi::OsStr> = dirs.iter().flat_map(|dir| ["--all-linear".as_ref(), dir.as_os_str()]).collect();
    let stdout = common::reference_job("peft_reference.py", &job);
    let peft_modules: Vec<&str> = stdout.lines().collect();
    assert_eq!(peft_modules.len(), names.len(), "{stdout}");
    for (name, expected) in names.iter().zip(peft_modules) {
        let outside_blocks = ["model.decoder.project_in", "model.decoder.project_out"];
        let expected = expected.split(' ').filter(|m| *name != "opt" || !outside_blocks.contains(m)).collect::<Vec<_>>().join(" ");
        let lora = LoraModel::new(hf::load_model(&fixture(name)).unwrap(), &lora_config(4, 8.0, &[ALL_LINEAR])).unwrap();
        let mut ours: Vec<&str> = lora.targets().iter().map(|t| t.hf_module.as_str()).collect();
        ours.sort();
        assert_eq!(ours.join(" "), expected, "{name}");
    }
}

/// A tiny Qwen3, Gemma 3 and Phi-3 (the fixtures' configs sized to the demo
/// tokenizer, random weights) train `all-linear` adapters on two CPU ranks
/// over Gloo: the loss falls, final/'s adapter loads in peft on the base
/// model the run wrote, and the merged export gives peft's logits in
/// transformers.
#[test]
fn qwen3_gemma3_and_phi3_train_adapters_on_two_ranks() {
    let scratch = tempfile::tempdir().unwrap();
    let demo = ft_data::demo::write(&scratch.path().join("demo"), 64, 8, 0).unwrap();
    let mut demo_config = ft_core::Config::default();
    let vocab = ft_data::demo::configure(&mut demo_config, &scratch.path().join("demo")).unwrap()["vocab_size"].clone();
    for name in ["qwen3", "gemma3", "phi3"] {
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        config["vocab_size"] = vocab.clone();
        let config_file = scratch.path().join(format!("{name}.json"));
        std::fs::write(&config_file, config.to_string()).unwrap();
        let out = scratch.path().join(name);
        let run = ft()
            .args(["train", "--model", config_file.to_str().unwrap(), "--train-file", demo.train.to_str().unwrap()])
            .args(["--tokenizer", demo.tokenizer.to_str().unwrap(), "--max-seq-len", "96", "--epochs", "3", "--batch-size", "4"])
            .args(["--lora-r", "4", "--lora-targets", ALL_LINEAR, "--lr", "1e-2", "--nproc-per-node", "2", "--device", "cpu"])
            .args(["--report-to", "jsonl", "--save-every", "1000", "--set", "train.log_every=1", "--output-dir", out.to_str().unwrap()])
            .output()
            .unwrap();
        let log = text(&run);
        assert!(run.status.success(), "{name}: {log}");
        assert!(log.contains("LoRA r=4"), "{name}: {log}");
        let losses = losses(&out);
        let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
        let (first, last) = (mean(&losses[..4]), mean(&losses[losses.len() - 4..]));
        assert!(last < first, "{name}: the adapters learn: loss {first:.3} over the first 4 steps, {last:.3} over the last 4");

        let merged = scratch.path().join(format!("{name}-merged"));
        let export = ft()
            .args(["export", "--checkpoint", "latest", "--output-dir", out.to_str().unwrap(), "--out", merged.to_str().unwrap(), "--merge"])
            .output()
            .unwrap();
        assert!(export.status.success(), "{name}: {}", text(&export));
        let ids = scratch.path().join("ids.json");
        std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2], [4, 4, 6, 20, 7, 19, 11, 30]]").unwrap();
        let (with_peft, with_merged) = (scratch.path().join(format!("{name}-peft")), scratch.path().join(format!("{name}-transformers")));
        reference_script(&[Path::new("--reference"), &out.join("base-model"), &out.join("final"), &ids, &with_peft, Path::new("--logits"), &merged, &ids, &with_merged]);
        let error = relative(&read(&with_merged)["logits"], &read(&with_peft)["logits"], 0.0);
        assert!(error <= 1e-4, "{name}: the merged export's logits differ from peft's by {error:e}");
    }
}

/// Extractive QA: adapters on BERT's query and value, and the span head
/// trained whole (peft's `modules_to_save` for QUESTION_ANS).
#[test]
fn bert_question_answering_adapters_load_in_peft_with_their_trained_head() {
    if shared::skipped_without(&[shared::SQUAD]) {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let dir = small_bert(scratch.path(), true);
    let base = hf::load_model(&dir).unwrap();
    let mut params = hf::load_params(base.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let lora = LoraModel::new(base, &lora_config(4, 8.0, &["q", "v"])).unwrap();
    assert_eq!(lora.trained_base_units().len(), 1, "the span head trains");
    assert_eq!(lora.peft_target_modules(), ["query", "value"]);
    params.extend(lora.initial_adapters(5, Device::Cpu));
    for (unit, tensors) in params.iter_mut().enumerate().filter(|(u, _)| !lora.frozen(*u)) {
        for tensor in tensors.iter_mut() {
            *tensor = Tensor::randn(tensor.size(), (Kind::Float, Device::Cpu)) * if unit < lora.base_units() { 1.0 } else { 0.1 };
        }
    }
    let ids = Tensor::from_slice2(&[[2i64, 17, 45, 9, 300, 12, 3, 88], [2, 5, 6, 700, 41, 3, 90, 14]]);
    let inputs = Inputs::ids(&ids);
    let ctx = lora.context(&inputs, 0, Kind::Float, false).unwrap();
    let outputs = forward(&lora, &params, &inputs, &ctx, None);
    let trained: Vec<Vec<Tensor>> = params.iter().enumerate().map(|(u, t)| if lora.frozen(u) { vec![] } else { t.iter().map(Tensor::shallow_clone).collect() }).collect();
    let adapter = scratch.path().join("adapter");
    peft::save_adapter(&lora, &trained, &adapter, Some(&dir)).unwrap();
    let config: Value = serde_json::from_str(&std::fs::read_to_string(adapter.join(peft::CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((config["task_type"].as_str(), config["modules_to_save"].clone()), (Some("QUESTION_ANS"), serde_json::json!(["qa_outputs"])));
    let ids_file = scratch.path().join("ids.json");
    std::fs::write(&ids_file, "[[2, 17, 45, 9, 300, 12, 3, 88], [2, 5, 6, 700, 41, 3, 90, 14]]").unwrap();
    let out = scratch.path().join("out");
    reference_script(&[Path::new("--qa-logits"), &dir, &adapter, &ids_file, &out]);
    let reference = read(&out);
    for (name, ours) in ["start_logits", "end_logits"].iter().zip(&outputs) {
        let error = relative(ours, &reference[*name], 0.0);
        assert!(error <= 1e-4, "{name} differ from peft's by {error:e}");
    }
}

#[test]
fn fresh_adapters_start_as_peft_does_and_change_nothing() {
    let base = hf::load_model(&fixture("llama")).unwrap();
    let base_params = hf::load_params(base.as_ref(), &fixture("llama"), Kind::Float, Device::Cpu).unwrap();
    let ids = fixture_ids("llama");
    let (base_logits, _) = logits_and_loss(base.as_ref(), &base_params, &ids);
    let lora = LoraModel::new(base, &lora_config(8, 16.0, &["q", "k", "v", "o", "gate", "up", "down"])).unwrap();
    let adapters = lora.initial_adapters(11, Device::Cpu);
    let mut a_values = vec![];
    for (unit, tensors) in lora.units()[lora.base_units()..].iter().zip(&adapters) {
        for (spec, tensor) in unit.params.iter().zip(tensors) {
            if spec.name.ends_with("lora_B.weight") {
                assert_eq!(tensor.abs().max().double_value(&[]), 0.0, "{}: B starts at zero", spec.name);
            } else {
                // kaiming_uniform_(a=√5) over [r, in]: U(−1/√in, 1/√in).
                let bound = 1.0 / (spec.shape[1] as f64).sqrt();
                assert!(tensor.abs().max().double_value(&[]) <= bound, "{}: A within ±1/√in", spec.name);
                a_values.push(tensor.reshape([-1]) / bound);
            }
        }
    }
    // Scaled to U(−1, 1): standard deviation 1/√3.
    let std = Tensor::cat(&a_values, 0).std(true).double_value(&[]);
    assert!((std - 1.0 / 3f64.sqrt()).abs() < 0.02, "A's spread {std} is not uniform's");
    let mut params = base_params;
    params.extend(adapters);
    let (adapted_logits, _) = logits_and_loss(&lora, &params, &ids);
    assert_eq!(relative(&adapted_logits, &base_logits, 0.0), 0.0, "zero B leaves the model as it was");
}

#[test]
fn merged_weights_are_the_adapted_model() {
    let (lora, params) = adapted("opt", &["q", "k", "v", "o", "up", "down"]);
    let ids = fixture_ids("opt");
    let (adapted_logits, _) = logits_and_loss(&lora, &params, &ids);
    let mut merged: Vec<Vec<Tensor>> = params.iter().map(|u| u.iter().map(Tensor::detach).collect()).collect();
    lora.merge(&mut merged);
    merged.truncate(lora.base_units());
    let (merged_logits, _) = logits_and_loss(lora.base(), &merged, &ids);
    let error = relative(&merged_logits, &adapted_logits, 0.0);
    assert!(error <= 1e-5, "merged logits differ by {error:e}");
}

/// What online RL samples from: the base units with the adapters folded
/// into copies laid out as the flat buffers are — the adapted model's
/// logits, a block's q/k/v still one GEMM (with Qwen2's biases too) — and
/// the trained units untouched.
#[test]
fn folded_base_units_are_the_adapted_model_with_joined_projections() {
    for fixture in ["llama", "qwen2"] {
        let (lora, params) = adapted(fixture, &[ALL_LINEAR]);
        let params: Vec<Vec<Tensor>> = params.iter().map(|u| u.iter().map(Tensor::detach).collect()).collect();
        let before: Vec<Tensor> = params.iter().flatten().map(Tensor::copy).collect();
        let ids = fixture_ids(fixture);
        let (adapted_logits, _) = logits_and_loss(&lora, &params, &ids);
        let folded = lora.merged_base(&params);
        assert_eq!(folded.len(), lora.base_units());
        // What `ft plan` counts as copied, from the layout alone, is the units the targets adapt.
        let targeted: std::collections::BTreeSet<usize> = lora.targets().iter().map(|target| target.base_unit).collect();
        assert_eq!(ft_core::lora::adapted_units(&lora), targeted, "{fixture}");
        let (folded_logits, _) = logits_and_loss(lora.base(), &folded, &ids);
        let error = relative(&folded_logits, &adapted_logits, 0.0);
        assert!(error <= 1e-5, "{fixture}: folded logits differ by {error:e}");
        assert!(params.iter().flatten().zip(&before).all(|(now, was)| now.equal(was)), "{fixture}: folding changed the policy's own tensors");
        let _no_grad = tch::no_grad_guard();
        let block = lora.base().layout().stages.iter().find(|stage| stage.kind == ft_core::model::StageKind::Block).unwrap().unit;
        let unit = ft_core::model::Params::new(&lora.base().units()[block], &folded[block]);
        let x = Tensor::randn([1, 2, lora.dims().hidden], (Kind::Float, Device::Cpu));
        let joined = unit.joined_linear(&x, &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]).unwrap_or_else(|| panic!("{fixture}: q/k/v lie one after another"));
        let q = x.linear(unit.get("self_attn.q_proj.weight"), unit.maybe("self_attn.q_proj.bias"));
        assert!(joined.narrow(-1, 0, q.size()[2]).allclose(&q, 1e-6, 1e-6, false), "{fixture}");
    }
}

fn tensors(file: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(file).unwrap().into_iter().collect()
}

#[test]
fn the_demo_trains_adapters_whose_exports_load_in_peft_and_transformers() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("run");
    let run = ft()
        .args(["train", "--lora-r", "8", "--lora-targets", "q,k,v,o,up,down", "--epochs", "2", "--train-samples", "400"])
        .args(["--eval-samples", "8", "--save-every", "100", "--output-dir", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", text(&run));
    let log = text(&run);
    assert!(log.contains("LoRA r=8 alpha=16"), "{log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let (trained, frozen) = (summary["trainable_params"].as_i64().unwrap(), summary["frozen_params"].as_i64().unwrap());
    assert!(trained > 0 && trained * 10 < frozen, "adapters are a small part: {trained} trained, {frozen} frozen");
    let state = &summary["state_per_rank"][0];
    assert!(state["frozen"].as_f64().unwrap() > 0.0 && state["optimizer_state"].as_f64().unwrap() == 8.0 * trained as f64, "{state}");
    let losses = losses(&out);
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
    assert!(last < first - 0.3, "the adapters learn: loss {first:.3} over the first 10 steps, {last:.3} over the last 10");

    let final_dir = out.join("final");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(final_dir.join(peft::CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((config["peft_type"].as_str(), config["r"].as_u64(), config["task_type"].as_str()), (Some("LORA"), Some(8), Some("CAUSAL_LM")));
    let base = out.join("base-model");
    assert_eq!(config["base_model_name_or_path"].as_str(), Some(base.to_str().unwrap()));

    // The last checkpoint is the final state: its adapter export is final/'s.
    let export = |extra: &[&str], dir: &Path| {
        let output = ft()
            .args(["export", "--checkpoint", "latest", "--output-dir", out.to_str().unwrap(), "--out", dir.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
    };
    let (adapter, merged) = (scratch.path().join("adapter"), scratch.path().join("merged"));
    export(&[], &adapter);
    let (exported, last) = (tensors(&adapter.join(peft::WEIGHTS_FILE)), tensors(&final_dir.join(peft::WEIGHTS_FILE)));
    assert_eq!(exported.len(), last.len());
    for (key, tensor) in &last {
        assert!(exported[key].equal(tensor), "{key}: the export differs from final/");
    }
    export(&["--merge"], &merged);

    // `ft eval` runs final/'s adapter on its base: the run's last evaluation again.
    let eval = ft()
        .args(["eval", "--model", final_dir.to_str().unwrap(), "--eval-samples", "8", "--nproc-per-node", "1"])
        .args(["--eval-file", out.join("demo-data/demo-eval.json").to_str().unwrap(), "--output-dir", scratch.path().join("eval").to_str().unwrap()])
        .args(["--max-seq-len", "96"])
        .output()
        .unwrap();
    let eval_log = text(&eval);
    assert!(eval.status.success(), "{eval_log}");
    let last_eval = summary["epochs"][1]["eval_loss"].as_f64().unwrap();
    assert!(eval_log.contains(&format!("eval loss {last_eval:.4} over 8 examples")), "expected eval loss {last_eval:.4}: {eval_log}");

    // peft on the base with the adapter, and transformers on the merged model, agree.
    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2], [4, 4, 6, 120, 7, 19, 11, 30]]").unwrap();
    let (with_peft, with_merged) = (scratch.path().join("peft"), scratch.path().join("transformers"));
    reference_script(&[Path::new("--reference"), &base, &final_dir, &ids, &with_peft, Path::new("--logits"), &merged, &ids, &with_merged]);
    let error = relative(&read(&with_merged)["logits"], &read(&with_peft)["logits"], 0.0);
    assert!(error <= 1e-4, "the merged export's logits differ from peft's by {error:e}");
}

#[test]
fn bad_lora_settings_are_refused_by_key() {
    let scratch = tempfile::tempdir().unwrap();
    let refusal = |flags: &[&str]| {
        let output = ft()
            .args(["train", "--epochs", "1", "--train-samples", "8", "--output-dir", scratch.path().join("run").to_str().unwrap()])
            .args(flags)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{flags:?} must be refused");
        let log = text(&output);
        assert!(!log.contains("panicked"), "{flags:?}: {log}");
        log
    };
    let log = refusal(&["--lora-r", "4", "--lora-targets", "q,gate"]);
    assert!(log.contains("train.lora.targets: \"gate\" names no linear layer of bloom's blocks") && log.contains("query_key_value"), "{log}");
    let log = refusal(&["--lora-r", "4", "--lora-alpha", "0"]);
    assert!(log.contains("train.lora.alpha must be positive"), "{log}");
    let log = refusal(&["--lora-r", "4", "--lora-dropout", "1"]);
    assert!(log.contains("train.lora.dropout must be in [0, 1)"), "{log}");
    let log = refusal(&["--set", "train.lora.rank=4"]);
    assert!(log.contains("rank"), "{log}");
    // QLoRA's keys (tests/qlora.rs trains it).
    let log = refusal(&["--quantize", "nf4"]);
    assert!(log.contains("model.quantize (--quantize) holds a LoRA run's frozen base in 4 bits: set train.lora.r (--lora-r)"), "{log}");
    let log = refusal(&["--lora-r", "4", "--quantize", "nf4", "--set", "model.quant_blocksize=48"]);
    assert!(log.contains("model.quant_blocksize is 48: bitsandbytes' 4-bit blocks hold one of [32, 64"), "{log}");
    let log = refusal(&["--lora-r", "4", "--set", "model.double_quant=false"]);
    assert!(log.contains("model.double_quant is given, but model.quantize is none"), "{log}");
    let log = refusal(&["--lora-r", "4", "--quantize", "int4"]);
    assert!(log.contains("invalid value 'int4' for '--quantize <nf4|fp4>'"), "{log}");
}

/// `--merge` works from final/ as from the run's last checkpoint (the same
/// weights; without it final/'s adapter is copied whole), from another
/// working directory than the run's relative
/// `--output-dir` (the base path is resolved against the run); its errors
/// name the flags given; `ft generate` and `ft forward` run final/'s
/// adapter on its base as the merged model runs.
#[test]
fn merge_from_final_equals_merge_from_the_checkpoint_from_any_directory() {
    let (run_cwd, other_cwd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let train = ft()
        .current_dir(run_cwd.path())
        .args(["train", "--lora-r", "4", "--epochs", "1", "--train-samples", "32", "--eval-samples", "4", "--nproc-per-node", "1"])
        .args(["--batch-size", "8", "--lr", "1e-2", "--save-every", "100", "--output-dir", "run"])
        .output()
        .unwrap();
    assert!(train.status.success(), "{}", text(&train));
    let run = run_cwd.path().join("run");
    let export = |args: &[&str]| ft().current_dir(other_cwd.path()).arg("export").args(args).output().unwrap();
    let checkpoint = ft_core::checkpoint::list(&run).unwrap().pop().expect("the run's last step is saved");
    let (from_checkpoint, from_final) = (other_cwd.path().join("merged-checkpoint"), other_cwd.path().join("merged-final"));
    for (source, out) in [(&checkpoint, &from_checkpoint), (&run.join("final"), &from_final)] {
        let output = export(&["--checkpoint", source.to_str().unwrap(), "--merge", "--out", out.to_str().unwrap()]);
        assert!(output.status.success(), "{}", text(&output));
        assert!(out.join("tokenizer.json").is_file() && out.join("generation_config.json").is_file());
    }
    let (a, b) = (tensors(&from_checkpoint.join("model.safetensors")), tensors(&from_final.join("model.safetensors")));
    assert_eq!(a.len(), b.len());
    for (name, tensor) in &a {
        assert!(b[name].equal(tensor), "{name}: merged from final/ differs from merged from the checkpoint");
    }

    // Without --merge, final/'s adapter as it is, with the tokenizer files.
    let adapter = other_cwd.path().join("adapter");
    let output = export(&["--checkpoint", run.join("final").to_str().unwrap(), "--out", adapter.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output));
    for file in [peft::CONFIG_FILE, peft::WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(adapter.join(file).is_file(), "the exported adapter has no {file}");
    }

    // Errors name the flags the user gave.
    let output = export(&["--checkpoint", "latest", "--output-dir", "nowhere", "--out", "x"]);
    assert!(!output.status.success() && text(&output).contains("--checkpoint latest") && !text(&output).contains("--resume"), "{}", text(&output));
    let output = export(&["--checkpoint", checkpoint.to_str().unwrap(), "--merge", "--base-model", "no-such-base", "--out", "x"]);
    assert!(!output.status.success() && text(&output).contains("--base-model no-such-base"), "{}", text(&output));

    // final/'s adapter runs on its base as the merged model does.
    let run_model = |command: &str, model: &Path, args: &[&str]| {
        let output = ft().current_dir(other_cwd.path()).args([command, "--model", model.to_str().unwrap()]).args(args).output().unwrap();
        assert!(output.status.success(), "ft {command} --model {}: {}", model.display(), text(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let generate = ["--ids", "1,5,9,14", "--max-new-tokens", "6"];
    assert_eq!(run_model("generate", &run.join("final"), &generate), run_model("generate", &from_final, &generate));
    let ids = other_cwd.path().join("ids.json");
    std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2]]").unwrap();
    let logits = |model: &Path| -> Tensor {
        let out = other_cwd.path().join("forward.safetensors");
        run_model("forward", model, &["--ids", ids.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        tensors(&out).remove("logits").unwrap()
    };
    let (adapted, merged, base) = (logits(&run.join("final")), logits(&from_final), logits(&run.join("base-model")));
    let largest_gap = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(largest_gap(&adapted, &merged) <= 1e-5, "adapter on its base vs merged: logits differ by {}", largest_gap(&adapted, &merged));
    assert!(largest_gap(&base, &merged) > 1e-3, "the adapters must matter to this check: they move the logits by {}", largest_gap(&base, &merged));
}
