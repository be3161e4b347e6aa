//! QLoRA's 4-bit base weights (`ft_core::nf4`) against bitsandbytes 0.50.2
//! on CPU (tests/python/bnb_reference.py): NF4 and FP4, with and without
//! double quantization, from fp32, bf16 and fp16, at sizes that are not a
//! multiple of the block: ft's packed bytes and statistics equal
//! bitsandbytes' bit for bit, its dequantization equals bitsandbytes', it
//! reads the state dicts bitsandbytes writes (as transformers saves them,
//! the packed bytes in uint8 or bf16 storage; and a tiny Llama that
//! transformers quantized and saved) and bitsandbytes reads ft's; a malformed state is an error naming the
//! tensor at fault. Then QLoRA's training: a tiny Llama's loss and adapter
//! gradients over its 4-bit base equal peft's over bitsandbytes' (through
//! transformers, on CPU), float8 layers run over the 4-bit base, and every
//! strategy trains it as one rank does.

use ft_core::config::LoraConfig;
use ft_core::dataset::Batch;
use ft_core::kernels::Kernels;
use ft_core::lora::{LoraModel, ALL_LINEAR};
use ft_core::model::{Inputs, Model};
use ft_core::nf4::{self, QuantType, Quantization, Quantized4bit};
use ft_core::train::{MicroBatch, TrainOptions, TrainerBuilder};
use ft_models::{hf, peft};
use ft_sys::float8::{Float8, Recipe};
use ft_tasks::causal_lm::CausalLmLoss;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

use crate::common;
use common::{ft, losses, text};

/// Equal bits, NaN and signed zeros included.
fn same_bits(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_eq!((actual.kind(), actual.size()), (expected.kind(), expected.size()), "{what}: kind and shape");
    let bytes = |t: &Tensor| t.contiguous().view([-1]).view_dtype(Kind::Uint8);
    let differ = bytes(actual).ne_tensor(&bytes(expected)).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(differ, 0, "{what}: {differ} bytes differ from bitsandbytes', e.g. {actual} vs {expected}");
}

/// Values over six orders of magnitude by row, with what tells rounding
/// rules apart: a block of zeros, and exact zeros and tiny values of both
/// signs (FP4 has +0 and -0).
fn weights(rows: i64, cols: i64, kind: Kind) -> Tensor {
    let magnitudes = Tensor::logspace(-3.0, 3.0, rows, 10.0, (Kind::Float, Device::Cpu)).unsqueeze(1);
    let x = (Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * magnitudes).reshape([-1]);
    let _ = x.narrow(0, 64, 64.min(x.numel() as i64 - 64)).zero_();
    let _ = x.narrow(0, 3, 1).fill_(0.0);
    let _ = x.narrow(0, 5, 1).fill_(1e-9);
    let _ = x.narrow(0, 7, 1).fill_(-1e-9);
    x.view([rows, cols]).to_kind(kind)
}

fn tensors_of(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

#[test]
fn four_bit_quantization_and_state_dicts_equal_bitsandbytes_bit_for_bit() {
    if common::bitsandbytes_runs_kernels_of_its_own() {
        return;
    }
    tch::manual_seed(3);
    let scratch = tempfile::tempdir().unwrap();
    let (inputs_dir, out) = (scratch.path().join("in"), scratch.path().join("out"));
    std::fs::create_dir_all(&inputs_dir).unwrap();
    // 328 blocks of 64 (two blocks of 256 absmaxes, the last short) ending
    // in 2 values; 52.5 blocks, also in blocks of 128; 65 values, an odd
    // count with an odd last dimension.
    let inputs = [
        ("fp32", weights(161, 130, Kind::Float)),
        ("bf16", weights(48, 70, Kind::BFloat16)),
        ("fp16", weights(5, 13, Kind::Half)),
        // Over 2^20 values: ft quantizes it in two chunks.
        ("large", weights(1024, 1100, Kind::BFloat16)),
    ];
    let mut cases = Vec::new();
    let mut ft_states = Vec::new();
    let mut ours = HashMap::new();
    for (input, x) in &inputs {
        for quant_type in [QuantType::Nf4, QuantType::Fp4] {
            for double_quant in [false, true] {
                if *input == "large" && (quant_type, double_quant) != (QuantType::Nf4, true) {
                    continue;
                }
                for blocksize in if *input == "bf16" { vec![64, 128] } else { vec![64] } {
                    let name = format!("{input}.{}.{}.{blocksize}", quant_type.name(), if double_quant { "nested" } else { "plain" });
                    let quantized = nf4::quantize(x, quant_type, blocksize, double_quant).unwrap();
                    ft_states.extend(quantized.state_dict(&format!("{name}.weight")));
                    cases.push(serde_json::json!({"name": name, "input": input, "quant_type": quant_type.name(), "double_quant": double_quant, "blocksize": blocksize}));
                    ours.insert(name, quantized);
                }
            }
        }
    }
    let named = |tensors: &[(String, Tensor)]| tensors.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect::<Vec<_>>();
    Tensor::write_safetensors(&named(&inputs.iter().map(|(k, v)| (k.to_string(), v.shallow_clone())).collect::<Vec<_>>()), inputs_dir.join("inputs.safetensors")).unwrap();
    Tensor::write_safetensors(&named(&ft_states), inputs_dir.join("ft.safetensors")).unwrap();
    std::fs::write(inputs_dir.join("cases.json"), serde_json::Value::from(cases).to_string()).unwrap();

    let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    common::reference_job("bnb_reference.py", &[inputs_dir.as_os_str(), out.as_os_str(), llama.as_os_str()]);
    let bnb = tensors_of(&out.join("bnb.safetensors"));
    let reference = tensors_of(&out.join("reference.safetensors"));

    let ft_states: HashMap<String, Tensor> = ft_states.into_iter().collect();
    let mut keys: Vec<&String> = ft_states.keys().collect();
    keys.sort();
    let mut bnb_keys: Vec<&String> = bnb.keys().collect();
    bnb_keys.sort();
    assert_eq!(keys, bnb_keys, "ft's state dicts hold the tensors bitsandbytes' do");
    // The same JSON (Python's spacing and number format aside).
    let parse = |t: &Tensor| serde_json::from_slice::<serde_json::Value>(&Vec::<u8>::try_from(t).unwrap()).unwrap();
    for (key, tensor) in &ft_states {
        if key.contains(".quant_state.") {
            assert_eq!(parse(tensor), parse(&bnb[key]), "{key}");
        } else {
            same_bits(tensor, &bnb[key], key);
        }
    }
    for (name, quantized) in &ours {
        let expected = &reference[&format!("{name}.dequantized")];
        same_bits(&reference[&format!("{name}.ft_dequantized")], expected, &format!("{name}: bitsandbytes' reading of ft's state dict"));
        // bitsandbytes' kernels read FP4's index 8 as -0, as ft does, but
        // its CPU fallback for an odd last dimension as +0: there zeros
        // compare by value.
        let zeros_by_value = quantized.state.quant_type == QuantType::Fp4 && quantized.state.shape.last().unwrap() % 2 == 1;
        let comparable = |t: Tensor| if zeros_by_value { t + 0.0 } else { t };
        let expected = comparable(expected.shallow_clone());
        same_bits(&comparable(quantized.dequantize()), &expected, &format!("{name}: ft's dequantization"));
        let read = Quantized4bit::from_state_dict(&format!("{name}.weight"), |key| bnb.get(key).map(Tensor::shallow_clone)).unwrap();
        same_bits(&comparable(read.dequantize()), &expected, &format!("{name}: ft's reading of bitsandbytes' state dict"));
    }
    assert_eq!(ours.len(), 17);
    // Packed bytes stored as bf16 (bitsandbytes' `quant_storage`) read as the same bytes.
    let storage = tensors_of(&out.join("storage.safetensors"));
    assert_eq!(storage["storage.weight"].kind(), Kind::BFloat16);
    let read = Quantized4bit::from_state_dict("storage.weight", |key| storage.get(key).map(Tensor::shallow_clone)).unwrap();
    same_bits(&read.dequantize(), &storage["storage.dequantized"], "a state dict in bf16 storage");

    // A checkpoint transformers saved: each linear layer of the blocks holds
    // what ft makes of the original weight, and reads back as ft's.
    let saved = tensors_of(&out.join("transformers/model.safetensors"));
    let original = tensors_of(&llama.join("model.safetensors"));
    let mut weights = 0;
    for weight in saved.keys().filter_map(|key| key.strip_suffix(".quant_state.bitsandbytes__nf4")) {
        let ours = nf4::quantize(&original[weight], QuantType::Nf4, nf4::DEFAULT_BLOCKSIZE, true).unwrap();
        for (key, tensor) in ours.state_dict(weight) {
            if key.contains(".quant_state.") {
                assert_eq!(parse(&tensor), parse(&saved[&key]), "{key}");
            } else {
                same_bits(&tensor, &saved[&key], &key);
            }
        }
        let read = Quantized4bit::from_state_dict(weight, |key| saved.get(key).map(Tensor::shallow_clone)).unwrap();
        same_bits(&read.dequantize(), &ours.dequantize(), &format!("{weight} as transformers saved it"));
        weights += 1;
    }
    assert_eq!(weights, 2 * 7, "the 7 linear layers of each of the fixture's 2 blocks");
    // ft runs that checkpoint as transformers + bitsandbytes run it.
    let forward = out.join("ft_logits.safetensors");
    let model = out.join("transformers");
    let ids = llama.join("ids.json");
    let output = common::ft().args(["forward", "--model", model.to_str().unwrap(), "--ids", ids.to_str().unwrap(), "--out", forward.to_str().unwrap()]).output().unwrap();
    let log = text(&output);
    assert!(output.status.success() && log.contains("14 weights are bitsandbytes 4-bit blocks"), "{log}");
    let error = relative(&tensors_of(&forward)["logits"], &tensors_of(&out.join("transformers_logits.safetensors"))["logits"]);
    assert!(error <= 1e-5, "ft's logits on the checkpoint transformers saved in 4 bits differ from transformers + bitsandbytes' by {error:e}");
    // The cases differ: 4 bits lose most of fp32's, and the rules differ.
    let dequantized = |name: &str| reference[&format!("{name}.dequantized")].shallow_clone();
    assert!(!dequantized("fp32.nf4.plain.64").equal(&inputs[0].1), "quantization changes the values");
    assert!(!dequantized("fp32.nf4.plain.64").equal(&dequantized("fp32.fp4.plain.64")));
    assert!(!dequantized("fp32.nf4.plain.64").equal(&dequantized("fp32.nf4.nested.64")));
}

/// A change made to a state dict.
type Change = Box<dyn FnOnce(&mut HashMap<String, Tensor>)>;

/// A state dict of `w.weight` with `change` applied, read back: the error's text.
fn error_after(change: Change) -> String {
    tch::manual_seed(5);
    let quantized = nf4::quantize(&Tensor::randn([8, 40], (Kind::BFloat16, Device::Cpu)), QuantType::Nf4, 64, true).unwrap();
    let mut tensors: HashMap<String, Tensor> = quantized.state_dict("w.weight").into_iter().collect();
    change(&mut tensors);
    match Quantized4bit::from_state_dict("w.weight", |key| tensors.get(key).map(Tensor::shallow_clone)) {
        Ok(_) => panic!("a malformed state dict was read"),
        Err(error) => format!("{error:#}"),
    }
}

#[test]
fn a_malformed_quant_state_is_an_error_naming_the_tensor() {
    let blob = "w.weight.quant_state.bitsandbytes__nf4";
    let json = |text: &str| Tensor::from_slice(text.as_bytes());
    let cases: Vec<(Change, &str, &str)> = vec![
        (Box::new(|t| drop(t.remove("w.weight.absmax"))), "w.weight.absmax is missing", "missing"),
        (Box::new(|t| drop(t.remove("w.weight.nested_absmax"))), "w.weight.nested_absmax is missing", "missing"),
        (Box::new(|t| drop(t.remove("w.weight"))), "w.weight is missing", "missing"),
        (Box::new(|t| drop(t.remove(blob))), "expected a tensor w.weight.quant_state.bitsandbytes__nf4", "no state"),
        (Box::new(|t| drop(t.insert("w.weight.absmax".into(), t["w.weight.absmax"].to_kind(Kind::Float)))), "w.weight.absmax: expected uint8 indices of shape [5]", "dtype"),
        (Box::new(|t| drop(t.insert("w.weight.nested_absmax".into(), Tensor::ones([2], (Kind::Float, Device::Cpu))))), "w.weight.nested_absmax: expected fp32 values of shape [1]", "shape"),
        (Box::new(|t| drop(t.insert("w.weight".into(), t["w.weight"].narrow(0, 0, 10)))), "w.weight: 10 packed bytes", "shape"),
        (Box::new(|t| drop(t.insert("w.weight.quant_map".into(), nf4::QuantType::Fp4.code(Device::Cpu)))), "w.weight.quant_map differs", "table"),
        (Box::new(move |t| drop(t.insert(blob.into(), json("{\"quant_type\": \"nf4\", ")))), "w.weight.quant_state.bitsandbytes__nf4 does not hold valid JSON", "JSON"),
        (
            Box::new(move |t| drop(t.insert(blob.into(), json(r#"{"quant_type": "int4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 40]}"#)))),
            "unknown quant_type \"int4\"",
            "quant_type",
        ),
        (
            Box::new(move |t| drop(t.insert(blob.into(), json(r#"{"quant_type": "nf4", "blocksize": 48, "dtype": "bfloat16", "shape": [8, 40]}"#)))),
            "w.weight.quant_state.bitsandbytes__nf4: blocksize 48",
            "blocksize",
        ),
        (
            Box::new(move |t| drop(t.insert(blob.into(), json(r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 40]}"#)))),
            "w.weight.quant_state.bitsandbytes__nf4: its JSON has no \"nested_blocksize\"",
            "nested parts without their JSON",
        ),
    ];
    for (change, expected, what) in cases {
        let error = error_after(change);
        assert!(error.contains(expected), "{what}: expected an error containing {expected:?}, got: {error}");
    }
}

fn llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama")
}

/// Worst difference of `actual` from `expected`, relative to `expected`'s largest magnitude.
fn relative(actual: &Tensor, expected: &Tensor) -> f64 {
    (actual.to_kind(Kind::Double) - expected.to_kind(Kind::Double)).abs().max().double_value(&[]) / expected.abs().max().double_value(&[]).max(1e-12)
}

/// What [`qlora_step`] measured.
struct Step {
    loss: f64,
    /// Each adapter's gradient, by peft's name.
    grads: HashMap<String, Tensor>,
    /// Bytes of frozen parameters the trainer holds.
    frozen_bytes: f64,
    /// Elements of the blocks' weight matrices (what 4 bits hold).
    block_matrices: i64,
}

/// How [`qlora_step`] holds the base and computes.
#[derive(Clone, Copy)]
struct Setting {
    /// The base's blocks in 4 bits (None: in fp32).
    quantization: Option<Quantization>,
    /// The values the 4 bits hold, unpacked: the blocks' weights quantized
    /// and dequantized once, then held in fp32 as a LoRA base is.
    unpacked: bool,
    /// The blocks' linear layers in float8.
    float8: Option<Float8>,
}

fn quantized(quantization: Option<Quantization>) -> Setting {
    Setting { quantization, unpacked: false, float8: None }
}

/// The fixture's Llama in adapters on every linear layer, its base held as
/// `setting` says: one micro-batch, and the adapter written for peft to `adapter`.
fn qlora_step(setting: Setting, adapter: &Path) -> Step {
    let base = hf::load_model(&llama()).unwrap();
    let mut params = hf::load_params(base.as_ref(), &llama(), Kind::Float, Device::Cpu).unwrap();
    let lora = LoraModel::new(base, &LoraConfig { r: 4, alpha: Some(8.0), dropout: 0.0, targets: vec![ALL_LINEAR.into()] }).unwrap().with_quantized_base(setting.quantization);
    let lora = match setting.unpacked {
        true => {
            lora.round_base_to_4bit(&mut params).unwrap();
            lora.with_quantized_base(None)
        }
        false => lora,
    };
    params.extend(lora.initial_adapters(5, Device::Cpu));
    // B starts at zero, which would leave A without a gradient.
    for (unit, tensors) in lora.units().iter().zip(&mut params).skip(lora.base_units()) {
        for (spec, tensor) in unit.params.iter().zip(tensors) {
            if spec.name.ends_with("lora_B.weight") {
                *tensor = Tensor::randn(tensor.size(), (Kind::Float, Device::Cpu)) * 0.1;
            }
        }
    }
    let adapters: Vec<Vec<Tensor>> = params.iter().enumerate().map(|(u, t)| if lora.frozen(u) { vec![] } else { t.iter().map(Tensor::copy).collect() }).collect();
    peft::save_adapter(&lora, &adapters, adapter, Some(&llama())).unwrap();
    let options = TrainOptions { max_grad_norm: None, float8: setting.float8, ..Default::default() };
    let mut trainer = TrainerBuilder::new(&lora, options).build(&params).unwrap();
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(llama().join("ids.json")).unwrap()).unwrap();
    let ids = Tensor::from_slice2(&rows);
    let batch = Batch { inputs: Inputs::ids(&ids), targets: vec![ids.shallow_clone()] };
    let objective = CausalLmLoss { chunk_tokens: 1024, kernels: Kernels::Aten, softcap: None };
    let tokens = (ids.size()[0] * (ids.size()[1] - 1)) as f64;
    let loss = trainer.forward_backward(&batch, &objective, tokens, MicroBatch::ONLY).unwrap().double_value(&[]);
    let mut grads = HashMap::new();
    for (unit, flat) in lora.units().iter().zip(trainer.units()).skip(lora.base_units()) {
        for (spec, grad) in unit.params.iter().zip(flat.grad_views()) {
            grads.insert(spec.hf_name.clone(), grad.copy());
        }
    }
    let units = lora.units();
    let block_matrices = ft_core::model::block_units(&lora).flat_map(|u| &units[u].params).filter(|p| p.shape.len() == 2).map(|p| p.numel()).sum();
    Step { loss, grads, frozen_bytes: trainer.memory().frozen, block_matrices }
}

/// QLoRA's loss and adapter gradients on a tiny Llama (fp32 compute) equal
/// peft's on transformers' model with bitsandbytes' 4-bit linear layers,
/// NF4 with double quantization and FP4 without; a base held in bf16
/// instead gives measurably other gradients (so the comparison sees the
/// quantization).
#[test]
fn qlora_loss_and_adapter_gradients_equal_peft_over_bitsandbytes() {
    if common::bitsandbytes_runs_kernels_of_its_own() {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let cases = [(QuantType::Nf4, true), (QuantType::Fp4, false)];
    let mut jobs: Vec<String> = vec![];
    let ours: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, &(quant_type, double_quant))| {
            let (adapter, out) = (scratch.path().join(format!("adapter-{i}")), scratch.path().join(format!("out-{i}")));
            let step = qlora_step(quantized(Some(Quantization { quant_type, blocksize: nf4::DEFAULT_BLOCKSIZE, double_quant })), &adapter);
            let ids = llama().join("ids.json");
            let paths = [llama(), adapter, ids, out.clone()].map(|p| p.to_str().unwrap().to_string());
            jobs.extend(["--qlora".to_string()].into_iter().chain(paths).chain([quant_type.name().to_string(), double_quant.to_string()]));
            (step, out)
        })
        .collect();
    common::reference_job("peft_reference.py", &jobs.iter().map(std::ffi::OsStr::new).collect::<Vec<_>>());
    let worst = |step: &Step, reference: &HashMap<String, Tensor>| step.grads.iter().map(|(name, grad)| relative(grad, &reference[&format!("grad.{name}")])).fold(0.0, f64::max);
    for (&(quant_type, double_quant), (step, out)) in cases.iter().zip(&ours) {
        let case = format!("{} double_quant={double_quant}", quant_type.name());
        let reference = tensors_of(&out.join("reference.safetensors"));
        let expected = reference["loss"].double_value(&[]);
        assert!((step.loss - expected).abs() <= 1e-4 * expected, "{case}: loss {} vs peft's {expected}", step.loss);
        assert_eq!(step.grads.len(), reference.keys().filter(|k| k.starts_with("grad.")).count(), "{case}: peft trains exactly ft's adapters");
        let error = worst(step, &reference);
        assert!(error <= 1e-4, "{case}: an adapter's gradient differs from peft's by {error:e}");
    }
    // The base in fp32: the gradients move well past the tolerance, and the frozen blocks' 4 bytes a weight become about half a byte.
    let full = qlora_step(quantized(None), &scratch.path().join("adapter-fp32"));
    let error = worst(&full, &tensors_of(&ours[0].1.join("reference.safetensors")));
    assert!(error > 1e-2, "an unquantized base's gradients differ from QLoRA's by only {error:e}");
    let saved = full.frozen_bytes - ours[0].0.frozen_bytes;
    let matrices = full.block_matrices as f64;
    assert!(saved >= 3.4 * matrices && saved <= 3.5 * matrices, "{saved} bytes saved on {matrices} weights held in 4 bits instead of fp32");
}

/// Every strategy trains QLoRA as one rank does — full_shard,
/// shard_grad_op and hybrid_shard (two groups of two) gather the 4-bit
/// bytes, zero1 and ddp keep them whole,
/// full_shard offloaded keeps the adapters' state on the host — and a rank
/// killed after step 3 resumes from step 2 to the uninterrupted losses.
/// The run's adapter, loaded by peft onto its base quantized by
/// bitsandbytes through transformers, gives the logits `ft forward` gives
/// on final/ (which reads the adapter back onto the same 4-bit base).
/// Float8 layers compose with the 4-bit base: with every block linear layer
/// in float8 (torchao's tensorwise recipe, emulated), a QLoRA step equals,
/// bit for bit, the float8 step of LoRA over an fp32 base holding the values
/// the 4 bits hold — the float8 casts read the dequantized weights — and
/// differs from the same QLoRA step without float8.
#[test]
fn float8_layers_run_over_the_4_bit_base() {
    let scratch = tempfile::tempdir().unwrap();
    let quantization = Some(Quantization { quant_type: QuantType::Nf4, blocksize: nf4::DEFAULT_BLOCKSIZE, double_quant: true });
    let float8 = Some(Float8 { recipe: Recipe::Tensorwise, emulate: true });
    let packed = qlora_step(Setting { quantization, unpacked: false, float8 }, &scratch.path().join("packed"));
    let unpacked = qlora_step(Setting { quantization, unpacked: true, float8 }, &scratch.path().join("unpacked"));
    assert_eq!(packed.loss.to_bits(), unpacked.loss.to_bits(), "loss {} vs {}", packed.loss, unpacked.loss);
    for (name, grad) in &packed.grads {
        same_bits(grad, &unpacked.grads[name], name);
    }
    let without = qlora_step(quantized(quantization), &scratch.path().join("without-float8"));
    let moved = packed.grads.iter().map(|(name, grad)| relative(grad, &without.grads[name])).fold(0.0, f64::max);
    assert!(moved > 1e-4, "float8 changed the adapters' gradients by only {moved:e}");
}

#[test]
fn qlora_trains_alike_under_every_strategy_and_a_killed_run_resumes() {
    let scratch = tempfile::tempdir().unwrap();
    let run = |name: &str, ranks: usize, extra: &[&str], fault: Option<&str>| {
        let out = scratch.path().join(name);
        // A global batch of 12: 12 × 1, 6 × 2, 4 × 3, 3 × 4.
        let (ranks, batch) = (ranks.to_string(), (12 / ranks).to_string());
        let flags = ["--lora-r", "4", "--lora-targets", "all-linear", "--quantize", "nf4", "--max-steps", "4", "--nproc-per-node", &ranks, "--batch-size", &batch];
        let mut command = ft();
        command.args(["train", "--output-dir", out.to_str().unwrap(), "--eval-samples", "8", "--lr", "1e-2", "--report-to", "jsonl", "--device", "cpu"]).args(flags).args(extra);
        if let Some(fault) = fault {
            command.env("FT_FAULT_INJECT", fault);
        }
        let output = command.output().unwrap();
        (output.status.success(), out, text(&output))
    };
    let (succeeded, one, log) = run("one", 1, &[], None);
    assert!(succeeded, "{log}");
    // The log says what the 4-bit base holds: the weight matrices of base-model/'s blocks (a
    // BLOOM block's four, 12·hidden² parameters), as bitsandbytes' nf4 holds them (a byte per two
    // weights, an 8-bit absmax per 64, an fp32 absmax per 256 of those), against fp32.
    let base = tensors_of(&one.join("base-model/model.safetensors"));
    let matrices: Vec<i64> = base.iter().filter(|(name, t)| name.contains(".h.") && t.dim() == 2).map(|(_, t)| t.numel() as i64).collect();
    let params: i64 = matrices.iter().sum();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(one.join("base-model/config.json")).unwrap()).unwrap();
    let (hidden, layers) = (config["hidden_size"].as_i64().unwrap(), config["n_layer"].as_i64().unwrap());
    assert_eq!((matrices.len() as i64, params), (4 * layers, 12 * hidden * hidden * layers));
    let blocks = |values: i64, size: i64| (values + size - 1) / size;
    let held: i64 = matrices.iter().map(|&n| n / 2 + blocks(n, 64) + 4 * blocks(blocks(n, 64), 256)).sum();
    let megabytes = |bytes: i64| format!("{:.2} MB", bytes as f64 / 1e6);
    let said = format!(
        "QLoRA: {} weight matrices of the base's blocks ({params} parameters) held in nf4, blocks of 64 values, double quantized: {} instead of {} in f32, {} saved",
        matrices.len(),
        megabytes(held),
        megabytes(4 * params),
        megabytes(4 * params - held)
    );
    assert!(log.contains(&said), "expected {said:?}: {log}");
    let expected = losses(&one);
    assert_eq!(expected.len(), 4);
    let close = |ours: &[f64], theirs: &[f64], what: &str| {
        assert_eq!(ours.len(), theirs.len(), "{what}: {ours:?} vs {theirs:?}");
        for (a, b) in ours.iter().zip(theirs) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: losses {ours:?} vs one rank's {theirs:?}");
        }
    };
    let cases: [(usize, &[&str]); 5] = [
        (2, &["--strategy", "ddp"]),
        (2, &["--strategy", "full_shard", "--offload", "cpu"]),
        (3, &["--strategy", "shard_grad_op"]),
        (3, &["--strategy", "zero1"]),
        (4, &["--strategy", "hybrid_shard", "--shard-group-size", "2"]),
    ];
    for (ranks, flags) in cases {
        let name = format!("{}-{ranks}", flags[1]);
        let (succeeded, out, log) = run(&name, ranks, flags, None);
        assert!(succeeded, "{name}: {log}");
        close(&losses(&out), &expected, &name);
    }
    let saving = ["--strategy", "full_shard", "--save-every", "2"];
    let (succeeded, _, log) = run("killed", 2, &saving, Some("after-step:3@1"));
    assert!(!succeeded && log.contains("FT_FAULT_INJECT: aborting"), "{log}");
    let (succeeded, resumed, log) = run("killed", 2, &[&saving[..], &["--resume", "latest"]].concat(), None);
    assert!(succeeded, "{log}");
    let resumed = losses(&resumed);
    close(&resumed[resumed.len() - 2..], &expected[2..], "resumed after a killed rank");
    // Another quantization of the base is refused on resume, by key.
    let (succeeded, _, log) = run("killed", 2, &[&saving[..], &["--resume", "latest", "--set", "model.double_quant=false"]].concat(), None);
    assert!(!succeeded && log.contains("resume with the same model.quantize (--quantize), model.quant_blocksize and model.double_quant"), "{log}");
    // A checkpoint's exported adapter says how its base was quantized.
    let exported = scratch.path().join("exported");
    let output = ft().args(["export", "--checkpoint", "latest", "--output-dir", scratch.path().join("killed").to_str().unwrap(), "--out", exported.to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let recorded: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(exported.join("base_quantization.json")).unwrap()).unwrap();
    assert_eq!(recorded, serde_json::json!({"quant_type": "nf4", "blocksize": 64, "double_quant": true}));

    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 5, 9, 14, 27, 3, 8, 2, 40, 11]]").unwrap();
    let logits = |adapter: &Path| {
        let forward = scratch.path().join("forward.safetensors");
        let output = ft().args(["forward", "--model", adapter.to_str().unwrap(), "--ids", ids.to_str().unwrap(), "--out", forward.to_str().unwrap()]).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        tensors_of(&forward).remove("logits").unwrap()
    };
    let ours = logits(&one.join("final"));
    // The same adapter without its base's quantization runs on the full-precision base.
    let unquantized = scratch.path().join("unquantized-adapter");
    std::fs::create_dir_all(&unquantized).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(one.join("final").join(file), unquantized.join(file)).unwrap();
    }
    let full_precision = logits(&unquantized);
    // Merged, the adapters fold into the base as its 4 bits hold it.
    let merged = scratch.path().join("merged");
    let output = ft().args(["export", "--checkpoint", one.join("final").to_str().unwrap(), "--out", merged.to_str().unwrap(), "--merge"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let error = relative(&logits(&merged), &ours);
    assert!(error <= 1e-5, "the merged export's logits differ from the adapter's on its 4-bit base by {error:e}");
    let out = scratch.path().join("peft");
    let [base, adapter] = [one.join("base-model"), one.join("final")];
    common::reference_job("peft_reference.py", &["--qlora".as_ref(), base.as_os_str(), adapter.as_os_str(), ids.as_os_str(), out.as_os_str(), "nf4".as_ref(), "true".as_ref()]);
    let theirs = &tensors_of(&out.join("reference.safetensors"))["logits"];
    let error = relative(&ours, theirs);
    assert!(error <= 1e-4, "ft forward on final/ vs peft over bitsandbytes: logits differ by {error:e}");
    let error = relative(&full_precision, theirs);
    assert!(error > 1e-3, "the full-precision base's logits differ from the 4-bit base's by only {error:e}");
}
