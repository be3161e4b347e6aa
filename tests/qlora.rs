//! QLoRA's 4-bit base weights (`ft_core::nf4`) against bitsandbytes 0.50.2
//! on CPU (tests/python/bnb_reference.py): NF4 and FP4, with and without
//! double quantization, from fp32, bf16 and fp16, at sizes that are not a
//! multiple of the block: ft's packed bytes and statistics equal
//! bitsandbytes' bit for bit, its dequantization equals bitsandbytes', it
//! reads the state dicts bitsandbytes writes (as transformers saves them,
//! the packed bytes in uint8 or bf16 storage; and a tiny Llama that
//! transformers quantized and saved) and bitsandbytes reads ft's; a malformed state is an error naming the
//! tensor at fault.

use ft_core::nf4::{self, QuantType, Quantized4bit};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use tch::{Device, Kind, Tensor};

mod common;
use common::text;

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

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/bnb_reference.py");
    let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    let output = Command::new("python").arg(&script).arg(&inputs_dir).arg(&out).arg(&llama).output().unwrap_or_else(|error| {
        panic!("cannot run `python` ({error}): these tests compare with bitsandbytes; `source scripts/env.sh` first, which puts the venv's python on PATH")
    });
    assert!(output.status.success(), "{}", text(&output));
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
