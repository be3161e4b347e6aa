//! Float8 linear layers (`--fp8`, `ft_sys::float8`) against torchao 0.18's
//! own functions (tests/python/float8_reference.py), emulated on CPU as
//! `Float8LinearConfig(emulate=True)` runs them: ft's scales and casts equal
//! torchao's bit for bit; a float8 linear layer's output and gradients
//! equal an emulated `Float8Linear`'s (tensorwise and rowwise), and
//! `_scaled_mm`'s own GEMMs (on CPU: tensorwise) their emulation's; a tiny
//! Llama's training step under float8 equals torchao's converted
//! transformers model's step (and, with activation checkpointing, ft's own
//! step exactly); and the runs float8 cannot serve are refused.

use ft_core::dataset::Batch;
use ft_core::model::{Init, Inputs, ParamSpec, Params, UnitSpec};
use ft_core::train::{Kernels, TrainOptions, TrainerBuilder};
use ft_core::AdamW;
use ft_models::hf;
use ft_sys::float8::{self, Float8, Recipe};
use ft_tasks::causal_lm::CausalLmLoss;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Device, Kind, Tensor};

mod common;
use common::{ft, text};

const RECIPES: [(&str, Recipe); 2] = [("tensorwise", Recipe::Tensorwise), ("rowwise", Recipe::Rowwise)];

fn emulated(recipe: Recipe) -> Float8 {
    Float8 { recipe, emulate: true }
}

/// Runs tests/python/float8_reference.py with `args`; returns the tensors of each OUT it wrote.
fn reference(args: &[&str], outs: &[&Path]) -> HashMap<String, Tensor> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/float8_reference.py");
    let output = Command::new("python").arg(&script).args(args).output().unwrap_or_else(|error| {
        panic!("cannot run `python` ({error}): these tests compare with torchao; `source scripts/env.sh` first, which puts the venv's python on PATH")
    });
    assert!(output.status.success(), "{}", text(&output));
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
        let out = Params::new(&spec, &tensors).with_float8(Some(emulated(recipe))).linear(&x, "fc");
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
        let out = float8::linear(&x, &w, Float8 { recipe: Recipe::Tensorwise, emulate }).unwrap();
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
    let loss = trainer.forward_backward(&batch, &objective, count, true).unwrap().double_value(&[]);
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
