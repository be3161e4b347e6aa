//! Float8 linear layers (`--fp8`, `ft_sys::float8`) against torchao 0.18's
//! own functions (tests/python/float8_reference.py), emulated on CPU as
//! `Float8LinearConfig(emulate=True)` runs them: ft's scales and casts equal
//! torchao's bit for bit; a float8 linear layer's output and gradients
//! equal an emulated `Float8Linear`'s (tensorwise and rowwise), and
//! `_scaled_mm`'s own GEMMs (on CPU: tensorwise) their emulation's; a tiny
//! Llama's training step under float8 equals torchao's converted
//! transformers model's step (and, with activation checkpointing, ft's own
//! step exactly); and the runs float8 cannot serve are refused.

use ft_core::AdamW;
use ft_core::dataset::Batch;
use ft_core::model::{Float8Layers, Init, Inputs, ParamSpec, Params, UnitSpec};
use ft_core::train::{Kernels, MicroBatch, TrainOptions, TrainerBuilder};
use ft_models::hf;
use ft_sys::float8::{self, Float8, Recipe};
use ft_tasks::causal_lm::CausalLmLoss;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

use crate::common;
use common::{ft, text};

const RECIPES: [(&str, Recipe); 2] = [("tensorwise", Recipe::Tensorwise), ("rowwise", Recipe::Rowwise)];

fn emulated(recipe: Recipe) -> Float8 {
    Float8 { recipe, emulate: true }
}

/// Runs tests/python/float8_reference.py with `args`, in the binary's one process of it; returns the tensors of each OUT it wrote.
fn reference(args: &[&str], outs: &[&Path]) -> HashMap<String, Tensor> {
    common::reference_job("float8_reference.py", &args.iter().map(std::ffi::OsStr::new).collect::<Vec<_>>());
    outs.iter().flat_map(|out| Tensor::read_safetensors(out.join("reference.safetensors")).unwrap()).collect()
}

fn save(tensors: &[(&str, &Tensor)], dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    Tensor::write_safetensors(tensors, dir.join("inputs.safetensors")).unwrap();
}

/// Equal bits (fp32 or bf16), NaN and signed zeros included.
fn same_bits(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_eq!(actual.size(), expected.size(), "{what}: shapes");
    assert_eq!(actual.kind(), expected.kind(), "{what}: kinds");
    let bits = |t: &Tensor| match t.kind() {
        Kind::BFloat16 => t.contiguous().view_dtype(Kind::Int16).to_kind(Kind::Int),
        _ => t.contiguous().view_dtype(Kind::Int),
    };
    let differ = bits(actual).ne_tensor(&bits(expected)).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(differ, 0, "{what}: {differ} of {} elements differ from torchao's, e.g. {actual} vs {expected}", actual.numel());
}

/// Rows of very different magnitudes, one of zeros (its amax takes EPS).
fn spread_rows(rows: i64, cols: i64) -> Tensor {
    let magnitudes = Tensor::logspace(-3.0, 3.0, rows, 10.0, (Kind::Float, Device::Cpu)).unsqueeze(1);
    let x = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * magnitudes;
    let _ = x.get(1).zero_();
    x
}

#[test]
fn casts_scales_and_linear_layers_equal_torchaos_bit_for_bit() {
    tch::manual_seed(7);
    let scratch = tempfile::tempdir().unwrap();
    let (casts_in, linear_in) = (scratch.path().join("casts"), scratch.path().join("linear"));
    let (casts_out, linear_out) = (casts_in.join("out"), linear_in.join("out"));
    let x = spread_rows(12, 40);
    save(&[("x", &x)], &casts_in);
    // bf16, as training computes: the GEMM in fp32, its output rounded to bf16, the bias added in bf16.
    let bf16 = |t: Tensor| t.to_kind(Kind::BFloat16);
    let input = bf16(Tensor::randn([3, 5, 32], (Kind::Float, Device::Cpu)) * 4.0);
    let weight = bf16(Tensor::randn([48, 32], (Kind::Float, Device::Cpu)) * 0.05);
    let bias = bf16(Tensor::randn([48], (Kind::Float, Device::Cpu)));
    let grad = bf16(Tensor::randn([3, 5, 48], (Kind::Float, Device::Cpu)) * 1e-3);
    save(&[("x", &input), ("weight", &weight), ("bias", &bias), ("grad", &grad)], &linear_in);
    let arg = |p: &Path| p.to_str().unwrap().to_string();
    let args = ["--casts".into(), arg(&casts_in), arg(&casts_out), "--linear".into(), arg(&linear_in), arg(&linear_out)];
    let torchao = reference(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[&casts_out, &linear_out]);

    let mut compared = 0;
    for (name, kind) in [("e4m3", Kind::Float8e4m3fn), ("e5m2", Kind::Float8e5m2)] {
        for (dim_name, dim) in [("none", None), ("-1", Some(-1)), ("0", Some(0))] {
            for power_of_2 in [false, true] {
                let key = format!("{name}.{dim_name}.{power_of_2}");
                let scale = float8::scale(&x, kind, dim, power_of_2);
                same_bits(&scale, &torchao[&format!("{key}.scale")], &format!("{key} scale"));
                let data = float8::cast(&x, &scale, kind);
                assert_eq!(data.kind(), kind);
                same_bits(&data.to_kind(Kind::Float), &torchao[&format!("{key}.data")], &format!("{key} cast"));
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 12);

    let spec = UnitSpec { name: "layer".into(), params: vec![ParamSpec::new("", "fc.weight", &[48, 32], Init::Zeros), ParamSpec::new("", "fc.bias", &[48], Init::Zeros)] };
    for (recipe_name, recipe) in RECIPES {
        let x = input.detach().set_requires_grad(true);
        let tensors = [weight.detach().set_requires_grad(true), bias.detach().set_requires_grad(true)];
        let layers = Float8Layers::all(emulated(recipe));
        let out = Params::new(&spec, &tensors).with_float8(Some(&layers)).linear(&x, "fc");
        // d(Σ out·grad)/d out is `grad` exactly.
        (&out * &grad).sum(Kind::BFloat16).backward();
        let expected = |what: &str| &torchao[&format!("{recipe_name}.{what}")];
        same_bits(&out, expected("out"), &format!("{recipe_name} output"));
        same_bits(&x.grad(), expected("grad_x"), &format!("{recipe_name} input gradient"));
        same_bits(&tensors[0].grad(), expected("grad_weight"), &format!("{recipe_name} weight gradient"));
        same_bits(&tensors[1].grad(), expected("grad_bias"), &format!("{recipe_name} bias gradient"));
    }
    // The float8 GEMMs themselves (`_scaled_mm`, tensorwise: what ATen serves
    // on a CPU) give what their emulation gives, to the bf16 output's rounding;
    // the weight gradient's inner dimension, 15 tokens, is padded to 16.
    let gemms = |emulate: bool| {
        let (x, w) = (input.detach().set_requires_grad(true), weight.detach().set_requires_grad(true));
        let out = float8::linear(&x, &w, Float8 { recipe: Recipe::Tensorwise, emulate }, false, 0).unwrap();
        (&out * &grad).sum(Kind::BFloat16).backward();
        [out, x.grad(), w.grad()].map(|t| t.to_kind(Kind::Float))
    };
    for ((scaled_mm, emulated), what) in gemms(false).iter().zip(gemms(true)).zip(["output", "input gradient", "weight gradient"]) {
        let error = max_relative(scaled_mm, &emulated);
        assert!(error <= 1e-2, "_scaled_mm's {what} differs from the emulation's by {error:e}");
    }
    // The recipes differ, so the comparison above tells them apart.
    assert!(torchao["tensorwise.grad_weight"].ne_tensor(&torchao["rowwise.grad_weight"]).any().int64_value(&[]) == 1);
}

/// A LoRA layer in float8 as one node (`float8::lora_linear`: the adapter's
/// product accumulated into the float8 GEMM's output, its input gradient
/// into the base's) equals the float8 layer plus the adapter's share as
/// separate autograd nodes: output and the gradients of x, A and B, for
/// both recipes (emulated, f32), the base frozen as LoRA leaves it.
#[test]
fn a_float8_lora_layer_as_one_node_equals_the_layer_plus_the_adapter() {
    tch::manual_seed(3);
    let options = (Kind::Float, Device::Cpu);
    let (input, weight) = (Tensor::randn([2, 7, 32], options), Tensor::randn([48, 32], options) * 0.1);
    let (a, b, grad) = (Tensor::randn([4, 32], options) * 0.1, Tensor::randn([48, 4], options) * 0.1, Tensor::randn([2, 7, 48], options));
    let scale = 2.0;
    for (name, recipe) in RECIPES {
        let run = |one_node: bool| {
            let (x, a, b) = (input.detach().set_requires_grad(true), a.detach().set_requires_grad(true), b.detach().set_requires_grad(true));
            let out = match one_node {
                true => float8::lora_linear(&x, &weight, &a, &b, scale, emulated(recipe), false, 0).unwrap(),
                false => float8::linear(&x, &weight, emulated(recipe), false, 0).unwrap() + (x.linear::<&Tensor>(&a, None) * scale).linear::<&Tensor>(&b, None),
            };
            (&out * &grad).sum(Kind::Float).backward();
            [out.detach(), x.grad(), a.grad(), b.grad()]
        };
        for ((ours, theirs), what) in run(true).iter().zip(run(false)).zip(["output", "x's gradient", "A's gradient", "B's gradient"]) {
            let error = max_relative(ours, &theirs);
            assert!(error < 1e-6, "{name}: {what} differs by {error:e}");
        }
    }
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama")
}

fn max_relative(actual: &Tensor, expected: &Tensor) -> f64 {
    (actual - expected).abs().max().double_value(&[]) / expected.abs().max().double_value(&[]).max(1e-12)
}

/// One ft training step on the fixture's rows: its loss, every
/// parameter's gradient and every parameter after AdamW, by Hugging Face name.
fn ft_step(float8: Option<Float8>, activation_checkpointing: bool) -> (f64, HashMap<String, (Tensor, Tensor)>) {
    let dir = fixture();
    let model = hf::load_model(&dir).unwrap();
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
    let ids = Tensor::from_slice2(&rows);
    let adamw = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, eps: 1e-8 };
    let options = TrainOptions { adamw, max_grad_norm: None, float8, activation_checkpointing, ..Default::default() };
    let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
    let objective = CausalLmLoss { chunk_tokens: 1024, kernels: Kernels::Aten, softcap: None };
    let batch = Batch { inputs: Inputs::ids(&ids), targets: vec![ids.shallow_clone()] };
    let count = (ids.size()[0] * (ids.size()[1] - 1)) as f64;
    let loss = trainer.forward_backward(&batch, &objective, count, MicroBatch::ONLY).unwrap().double_value(&[]);
    let grads: Vec<Vec<Tensor>> = trainer.units().iter().map(|u| u.grad_views().iter().map(Tensor::copy).collect()).collect();
    let _norm = trainer.step(adamw.lr).unwrap();
    let mut named = HashMap::new();
    for ((unit, grads), after) in model.units().iter().zip(grads).zip(trainer.params().unwrap()) {
        for ((spec, grad), after) in unit.params.iter().zip(grads).zip(after) {
            named.insert(spec.hf_name.clone(), (grad, after));
        }
    }
    (loss, named)
}

/// The worst gradient and updated parameter of `step` against torchao's, relative to each tensor's largest value.
fn worst_error(step: &HashMap<String, (Tensor, Tensor)>, torchao: &HashMap<String, Tensor>) -> (f64, f64) {
    let (mut grads, mut params) = (0f64, 0f64);
    for (name, (grad, after)) in step {
        grads = grads.max(max_relative(grad, &torchao[&format!("grad.{name}")]));
        params = params.max(max_relative(after, &torchao[&format!("after.{name}")]));
    }
    (grads, params)
}

#[test]
fn a_tiny_llamas_float8_step_equals_torchaos_emulated_step() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("out");
    let (model, ids) = (fixture(), fixture().join("ids.json"));
    let torchao = reference(&["--llama-step", model.to_str().unwrap(), ids.to_str().unwrap(), "tensorwise", out.to_str().unwrap()], &[&out]);
    let (loss, step) = ft_step(Some(emulated(Recipe::Tensorwise)), false);
    assert_eq!(step.len(), torchao.keys().filter(|k| k.starts_with("grad.")).count(), "the same parameters");
    let torchao_loss = torchao["loss"].double_value(&[]);
    assert!((loss - torchao_loss).abs() <= 1e-5 * torchao_loss, "loss {loss} vs torchao's {torchao_loss}");
    let (grads, params) = worst_error(&step, &torchao);
    assert!(grads <= 1e-5 && params <= 1e-6, "float8 step vs torchao's: gradients within {grads:e}, parameters within {params:e}");
    // Without float8 the same step is measurably farther from torchao's float8 step.
    let (_, fp32_step) = ft_step(None, false);
    let (fp32_grads, _) = worst_error(&fp32_step, &torchao);
    assert!(fp32_grads > 100.0 * grads.max(1e-7), "fp32 step's gradients differ by only {fp32_grads:e} from torchao's float8 step");
    // Recomputed blocks (activation checkpointing) cast and multiply the same values again.
    let (checkpointed_loss, checkpointed) = ft_step(Some(emulated(Recipe::Tensorwise)), true);
    assert_eq!(checkpointed_loss, loss);
    for (name, (grad, after)) in &checkpointed {
        assert!(grad.equal(&step[name].0) && after.equal(&step[name].1), "{name} under activation checkpointing");
    }
}

#[test]
fn float8_is_refused_where_it_cannot_run_and_emulates_on_cpu() {
    let scratch = tempfile::tempdir().unwrap();
    let runs = std::cell::Cell::new(0);
    let run = |args: &[&str]| {
        runs.set(runs.get() + 1);
        let dir = scratch.path().join(format!("run{}", runs.get()));
        let output = ft()
            .args(["train", "--output-dir", dir.to_str().unwrap(), "--max-steps", "2", "--train-samples", "16", "--eval-samples", "4"])
            .args(["--batch-size", "8", "--nproc-per-node", "1", "--device", "cpu"])
            .args(args)
            .output()
            .unwrap();
        (output.status.success(), text(&output))
    };
    let (ok, message) = run(&["--fp8", "tensorwise", "--dtype", "fp16"]);
    assert!(!ok && message.contains("train.fp8 (--fp8) with train.dtype fp16 (--dtype fp16)") && message.contains("use --dtype bf16"), "{message}");
    let (ok, message) = run(&["--fp8", "rowwise"]);
    assert!(!ok && message.contains("needs a CUDA GPU of compute capability 8.9 or newer") && message.contains("train.fp8_emulate=true"), "{message}");
    assert!(!message.contains("panicked"), "{message}");
    let (ok, message) = run(&["--set", "train.fp8_emulate=true"]);
    assert!(!ok && message.contains("train.fp8_emulate is given, but float8 is off"), "{message}");
    let (ok, message) = run(&["--fp8", "fastest"]);
    assert!(!ok && message.contains("train.fp8") && message.contains("tensorwise"), "{message}");
    // Emulated, the demo trains on CPU: all its parameters, or LoRA's adapters over a float8 base.
    let (ok, message) = run(&["--fp8", "tensorwise", "--set", "train.fp8_emulate=true", "--seed", "1"]);
    assert!(ok, "{message}");
    let (ok, message) = run(&["--fp8", "rowwise", "--set", "train.fp8_emulate=true", "--lora-r", "4"]);
    assert!(ok, "{message}");
}

/// The float8 numerics guard: each logged step gives the sinks every
/// block's largest amax and smallest scale per tensor role — at step 1 the
/// weights' are the starting weights' own largest |w| — and a run that
/// diverges stops at the step whose cast met a NaN or an infinity, naming
/// the layer, after finishing the last good step's checkpoint. And which
/// layers cast: those an `ft calibrate --fp8` file measured faster.
#[test]
fn the_numerics_guard_reports_amaxes_stops_a_diverging_run_naming_the_layer_and_calibration_picks_the_layers() {
    let scratch = tempfile::tempdir().unwrap();
    let [config, train, tokenizer] = common::demo_files(scratch.path());
    let model = scratch.path().join("model");
    let output = ft().args(["init-model", "--config", config.to_str().unwrap(), "--out", model.to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let run = |name: &str, args: &[&str]| {
        let dir = scratch.path().join(name);
        let output = ft()
            .args(["train", "--model", model.to_str().unwrap(), "--train-file", train.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()])
            .args(["--output-dir", dir.to_str().unwrap(), "--train-samples", "48", "--eval-samples", "4", "--batch-size", "8", "--device", "cpu"])
            .args(["--dtype", "f32", "--fp8", "tensorwise", "--set", "train.fp8_emulate=true", "--report-to", "jsonl", "--save-every", "1"])
            .args(args)
            .output()
            .unwrap();
        (dir, output.status.success(), text(&output))
    };
    let (dir, ok, message) = run("steady", &["--max-steps", "2"]);
    assert!(ok, "{message}");
    let first: serde_json::Value = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).find(|r: &serde_json::Value| r["step"] == 1).unwrap();
    let weights = Tensor::read_safetensors(model.join("model.safetensors")).unwrap();
    let blocks = weights.iter().filter(|(name, _)| name.ends_with("query_key_value.weight")).count();
    assert!(blocks >= 2, "{blocks} blocks");
    for block in 0..blocks {
        let value = |what: &str| first[format!("fp8/block_{block}/{what}")].as_f64().unwrap_or_else(|| panic!("no fp8/block_{block}/{what} in {first}"));
        // The block's linear layers are its 2-D weights.
        let largest = weights
            .iter()
            .filter(|(name, w)| name.contains(&format!("h.{block}.")) && w.dim() == 2)
            .map(|(_, w)| w.abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        // Equal but for serde_json's parsing of the JSON numbers (within an ulp).
        let same = |a: f64, b: f64, what: &str| assert!((a - b).abs() <= 1e-15 * b.abs(), "block {block}: {what}: {a} vs {b}");
        same(value("amax_weight"), largest, "its weights' largest |w| at the first step");
        same(value("scale_weight"), 448.0 / largest, "e4m3's largest value over the amax");
        for role in ["input", "grad_output"] {
            let amax = value(&format!("amax_{role}"));
            assert!(amax.is_finite() && amax > 0.0, "block {block} {role}: {amax}");
        }
        same(value("scale_grad_output"), 57344.0 / value("amax_grad_output"), "output gradients are e5m2");
    }
    // A calibration that measured float8 faster for the MLP's first layer alone: the others stay in f32 and cast nothing.
    let mlp_in = weights.iter().find(|(name, _)| name.ends_with("h.0.mlp.dense_h_to_4h.weight")).map(|(_, w)| w.size()).unwrap();
    let gemms: Vec<serde_json::Value> = weights
        .iter()
        .filter(|(name, w)| name.contains("h.0.") && w.dim() == 2)
        .map(|(_, w)| {
            let (n, k) = (w.size()[0], w.size()[1]);
            let float8 = if w.size() == mlp_in { 2e12 } else { 5e11 };
            serde_json::json!({"m": 1, "n": n, "k": k, "flops_per_second": 1e12, "float8_flops_per_second": float8})
        })
        .collect();
    let calibration = scratch.path().join("calibration.json");
    let file = serde_json::json!({"version": 1, "device": "test", "dtype": "Float", "host_optimizer_elements_per_second": {}, "gemms": gemms});
    std::fs::write(&calibration, file.to_string()).unwrap();
    let calibrated = format!("train.fp8_calibration={}", calibration.display());
    let (dir, ok, message) = run("calibrated", &["--max-steps", "1", "--set", &calibrated]);
    assert!(ok && message.contains("stay in the compute dtype: train.fp8_calibration measured float8 slower there"), "{message}");
    let first: serde_json::Value = serde_json::from_str(std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().next().unwrap()).unwrap();
    let mlp_in_amax = weights.iter().find(|(name, _)| name.ends_with("h.0.mlp.dense_h_to_4h.weight")).unwrap().1.abs().max().double_value(&[]);
    let amax = first["fp8/block_0/amax_weight"].as_f64().unwrap();
    assert!((amax - mlp_in_amax).abs() <= 1e-15 * mlp_in_amax, "only the MLP's first layer casts: {amax} vs {mlp_in_amax}");
    // What the calibration lacks, or a run it cannot choose for, is named.
    let (_, ok, message) = run("calibrated-all", &["--max-steps", "1", "--set", &calibrated, "--set", "train.fp8_layers=all"]);
    assert!(!ok && message.contains("train.fp8_calibration") && message.contains("train.fp8_layers=all casts every layer"), "{message}");
    std::fs::write(&calibration, serde_json::json!({"version": 1, "device": "test", "dtype": "Float", "host_optimizer_elements_per_second": {}, "gemms": []}).to_string()).unwrap();
    let (_, ok, message) = run("uncalibrated", &["--max-steps", "1", "--set", &calibrated]);
    assert!(!ok && message.contains("has no float8 rate for the") && message.contains("ft calibrate --fp8"), "{message}");

    // A learning rate of 1e30 makes the weights overflow their products at the second step.
    let (dir, ok, message) = run("diverging", &["--max-steps", "4", "--lr", "1e30"]);
    assert!(!ok && !message.contains("panicked"), "{message}");
    let stopped = guarded_step(&message);
    let named = ["input", "weight", "grad_output"].iter().any(|role| message.contains(&format!("'s {role} in block ")));
    assert!(message.contains("float8 numerics guard: at step") && named && message.contains("a NaN or infinity reached its float8 cast"), "{message}");
    assert!(dir.join(format!("checkpoints/step-{:08}", stopped - 1)).exists() && !dir.join(format!("checkpoints/step-{stopped:08}")).exists(), "the steps before {stopped} are saved, not it: {:?}\n{message}", std::fs::read_dir(dir.join("checkpoints")).map(|d| d.map(|e| e.unwrap().file_name()).collect::<Vec<_>>()));
}

/// The step a guard's message names ("at step N").
fn guarded_step(message: &str) -> usize {
    let after = &message[message.find("at step ").expect("a step") + 8..];
    after[..after.find(' ').unwrap()].parse().unwrap()
}

/// Float8 gathers (`train.fp8_gathers`, on by default under `--fp8
/// tensorwise` with sharding): full_shard at 2 and 3 ranks gives the losses
/// of full_shard gathering the f32 weights (`train.fp8_gathers=false`) bit
/// for bit — each weight gathered as the cast of the whole tensor, the bytes
/// a rank holding it casts (a shard's own amax would give other bytes) — as
/// do LoRA, `--offload cpu`, shard_grad_op and hybrid_shard; in bf16, with blocks the share of the
/// model they have in a 7B (the embedding and head gather in bf16), the
/// gathers carry at most 0.55× bf16 gathers' bytes; every block's amaxes
/// are reduced in one all-reduce a step, on every rank (the first step's
/// and a resumed run's too); a killed rank resumes to the uninterrupted losses.
#[test]
fn float8_gathers_equal_full_precision_gathers_at_half_bf16s_bytes_and_resume() {
    let scratch = tempfile::tempdir().unwrap();
    let [config, train, tokenizer] = common::demo_files(scratch.path());
    let init = |name: &str, settings: &[&str]| {
        let model = scratch.path().join(name);
        let output = ft().args(["init-model", "--config", config.to_str().unwrap(), "--out", model.to_str().unwrap()]).args(settings).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        model
    };
    let model = init("model", &[]);
    // Blocks 96% of the weights, as in Llama-7B (the demo's 128 wide: 92%).
    let wide = init("wide", &["--set", "hidden_size=256"]);
    let run = |name: &str, ranks: usize, args: &[&str], fault: Option<&str>| {
        let dir = scratch.path().join(name);
        let (model, precision): (&Path, &[&str]) = match args.contains(&"bf16") {
            true => (&wide, &[]),
            false => (&model, &["--dtype", "f32", "--max-steps", "4"]),
        };
        let recipe: &[&str] = if args.contains(&"--fp8") { &[] } else { &["--fp8", "tensorwise"] };
        let strategy: &[&str] = if args.contains(&"--strategy") { &[] } else { &["--strategy", "full_shard"] };
        let mut command = ft();
        command
            .args(["train", "--model", model.to_str().unwrap(), "--train-file", train.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()])
            .args(["--output-dir", dir.to_str().unwrap(), "--train-samples", "48", "--eval-samples", "4", "--batch-size", "4", "--device", "cpu"])
            .args(recipe)
            .args(["--set", "train.fp8_emulate=true", "--report-to", "jsonl"])
            .args(strategy)
            .args(precision)
            .args(["--nproc-per-node", &ranks.to_string()])
            .args(args);
        if let Some(fault) = fault {
            command.env("FT_FAULT_INJECT", fault);
        }
        // The amax reductions' debug lines, which `amax_reductions` counts.
        let output = command.env("RUST_LOG", "info,ft_core::distributed::float8_gather=debug").output().unwrap();
        (dir, output.status.success(), text(&output))
    };
    // Each rank's amax all-reduces, by the line each logs.
    let amax_reductions = |message: &str, ranks: usize| -> Vec<usize> {
        let reductions = |rank: usize| message.lines().filter(|l| l.starts_with(&format!("[rank {rank}]")) && l.contains("in one all-reduce")).count();
        (0..ranks).map(reductions).collect()
    };
    let gathered = |dir: &Path| common::summary(dir)["comm_bytes_per_step"]["all_gather"].as_f64().unwrap();
    let off = ["--set", "train.fp8_gathers=false"];
    for ranks in [2, 3] {
        let (float8_gathers, ok, message) = run(&format!("float8-gathers-{ranks}"), ranks, &[], None);
        assert!(ok && message.contains("sharded blocks gathered as float8"), "{message}");
        assert_eq!(amax_reductions(&message, ranks), vec![4; ranks], "one amax reduction a step\n{message}");
        let (f32_gathers, ok, message) = run(&format!("f32-gathers-{ranks}"), ranks, &off, None);
        assert!(ok && !message.contains("gathered as float8"), "{message}");
        assert_eq!(common::losses(&float8_gathers).len(), 4);
        assert_eq!(common::losses(&float8_gathers), common::losses(&f32_gathers), "{ranks} ranks");
    }
    // LoRA's frozen base blocks are gathered in float8 too, their adapters (units of their own) as before; so are
    // blocks whose optimizer runs on the host (`--offload cpu`); and under the other strategies that gather shards.
    let variants: [(&str, &[&str]); 4] = [
        ("lora", &["--lora-r", "4"]),
        ("offload", &["--offload", "cpu"]),
        ("shard_grad_op", &["--strategy", "shard_grad_op"]),
        ("hybrid_shard", &["--strategy", "hybrid_shard", "--shard-group-size", "2"]),
    ];
    for (name, extra) in variants {
        let ranks = if name == "hybrid_shard" { 4 } else { 2 };
        let (float8, ok, message) = run(&format!("{name}-float8-gathers"), ranks, extra, None);
        assert!(ok && message.contains("sharded blocks gathered as float8"), "{message}");
        let (f32, ok, message) = run(&format!("{name}-f32-gathers"), ranks, &[extra, &off[..]].concat(), None);
        assert!(ok, "{message}");
        assert_eq!(common::losses(&float8), common::losses(&f32), "{name} at {ranks} ranks");
    }
    let bf16 = ["--dtype", "bf16", "--max-steps", "1"];
    let (float8_gathers, ok, message) = run("bf16-float8-gathers", 2, &bf16, None);
    assert!(ok, "{message}");
    let (bf16_gathers, ok, message) = run("bf16-gathers", 2, &[&bf16[..], &off].concat(), None);
    assert!(ok, "{message}");
    let ratio = gathered(&float8_gathers) / gathered(&bf16_gathers);
    assert!(ratio <= 0.55, "float8 gathers carry {ratio:.3} of bf16 gathers' bytes");
    // Killed after step 3, resumed from step 2's checkpoint.
    let saving = ["--save-every", "2"];
    let (_, ok, message) = run("killed", 2, &saving, Some("after-step:3@1"));
    assert!(!ok && message.contains("FT_FAULT_INJECT: aborting"), "{message}");
    let (killed, ok, message) = run("killed", 2, &[&saving[..], &["--resume", "latest"]].concat(), None);
    assert!(ok, "{message}");
    assert_eq!(amax_reductions(&message, 2), vec![2; 2], "steps 3 and 4, from the restored shards\n{message}");
    let resumed = common::losses(&killed);
    let uninterrupted = common::losses(&scratch.path().join("float8-gathers-2"));
    assert_eq!(&resumed[resumed.len() - 2..], &uninterrupted[2..], "resumed vs uninterrupted");
    // Where nothing is gathered (one rank) the setting does nothing: asked for, the log says so; by default it is quiet.
    let (_, ok, message) = run("one-rank", 1, &["--set", "train.fp8_gathers=true"], None);
    assert!(ok && message.contains("train.fp8_gathers: no block is gathered in float8"), "{message}");
    let (_, ok, message) = run("one-rank-default", 1, &[], None);
    assert!(ok && !message.contains("train.fp8_gathers"), "{message}");
    // Gathers in float8 cast each weight with one scale: the rowwise recipe is refused them by name.
    let (_, ok, message) = run("rowwise", 2, &["--fp8", "rowwise", "--set", "train.fp8_gathers=true", "--dry-run"], None);
    assert!(!ok && message.contains("train.fp8_gathers") && message.contains("tensorwise"), "{message}");
}
