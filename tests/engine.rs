//! The unit-by-unit training step against plain autograd and the AdamW formula.

use ft_core::dataset::Batch;
use ft_core::model::{forward, lm_outputs, Inputs, Model};
use ft_core::train::loss::{lm_head_loss_and_grads, lm_loss};
use ft_core::train::{Kernels, MicroBatch, TrainOptions, TrainerBuilder};
use ft_tasks::causal_lm::CausalLmLoss;
use ft_models::hf;
use ft_core::AdamW;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The causal-LM objective over labels equal to the inputs (ATen's kernels, any device).
const LM_LOSS: CausalLmLoss = CausalLmLoss { chunk_tokens: 1024, kernels: Kernels::Aten, softcap: None };

fn lm_batch(ids: &Tensor) -> Batch {
    Batch { inputs: Inputs::ids(ids), targets: vec![ids.shallow_clone()] }
}

fn fixture(name: &str) -> (Box<dyn Model>, Vec<Vec<Tensor>>, Tensor) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let model = hf::load_model(&dir).unwrap();
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
    (model, params, Tensor::from_slice2(&rows))
}

fn max_relative(a: &Tensor, b: &Tensor) -> f64 {
    let error = (a - b).abs().max().double_value(&[]);
    error / b.abs().max().double_value(&[]).max(1e-12)
}

/// With and without soft-capped logits (Gemma 2's `c · tanh(z / c)`, whose
/// derivative the chunked gradients fold in by hand).
#[test]
fn fused_head_loss_equals_autograd_cross_entropy() {
    for softcap in [None, Some(2.0)] {
        tch::manual_seed(0);
        let hidden = Tensor::randn([2, 9, 8], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let weight = Tensor::randn([11, 8], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let labels = Tensor::randint(11, [2, 9], (Kind::Int64, Device::Cpu));
        let _ = labels.get(0).narrow(0, 0, 4).fill_(-100); // a prompt without loss
        let reference = lm_loss(&hidden, &weight, &labels, 5, softcap).unwrap();
        reference.backward();
        let count = labels.narrow(1, 1, 8).ne(-100).sum(Kind::Float).double_value(&[]);
        for chunk in [3, 100] {
            let (loss, grad_hidden, grad_weight) =
                lm_head_loss_and_grads(&hidden.detach(), &weight.detach(), &labels, count, chunk, None, Kernels::Aten, true, softcap).unwrap();
            assert!(max_relative(&loss.to_kind(Kind::Double), &reference.detach()) < 1e-6, "{softcap:?}");
            assert!(max_relative(&grad_hidden, &hidden.grad()) < 1e-6, "hidden grad, chunk {chunk}, {softcap:?}");
            assert!(max_relative(&grad_weight, &weight.grad()) < 1e-6, "weight grad, chunk {chunk}, {softcap:?}");
        }
    }
}

/// One whole-graph autograd pass over the same parameters.
fn reference_grads(model: &dyn Model, params: &[Vec<Tensor>], ids: &Tensor) -> (f64, Vec<Vec<Tensor>>) {
    let leaves: Vec<Vec<Tensor>> =
        params.iter().map(|u| u.iter().map(|t| t.detach().copy().set_requires_grad(true)).collect()).collect();
    let inputs = Inputs::ids(ids);
    let ctx = model.context(&inputs, 0, Kind::Float, true).unwrap();
    let (hidden, weight) = lm_outputs(forward(model, &leaves, &inputs, &ctx, None)).unwrap();
    let loss = lm_loss(&hidden, &weight, ids, 1024, None).unwrap();
    loss.backward();
    (loss.double_value(&[]), leaves.iter().map(|u| u.iter().map(Tensor::grad).collect()).collect())
}

#[test]
fn unit_by_unit_backward_equals_one_autograd_pass() {
    // (OPT trains with dropout, so its masks, not its math, would differ.)
    for name in ["bloom", "llama-gqa"] {
        let (model, params, ids) = fixture(name);
        let (expected_loss, expected) = reference_grads(model.as_ref(), &params, &ids);
        // None, all, and the first block alone recomputed (train.checkpoint_layers).
        for (checkpointing, checkpoint_layers) in [(false, None), (true, None), (true, Some(1))] {
            let options = TrainOptions { activation_checkpointing: checkpointing, checkpoint_layers, max_grad_norm: None, ..Default::default() };
            let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
            let count = ids.narrow(1, 1, ids.size()[1] - 1).numel() as f64;
            let loss = trainer.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap();
            assert!((loss.double_value(&[]) - expected_loss).abs() < 1e-5 * expected_loss, "{name}");
            // The accumulated flat gradient, viewed per parameter, equals autograd's.
            for (unit, expected_unit) in trainer.units().iter().zip(&expected) {
                for (grad, want) in unit.grad_views().iter().zip(expected_unit) {
                    assert!(max_relative(grad, want) < 1e-5, "{name} checkpointing={checkpointing} layers={checkpoint_layers:?}");
                }
            }
        }
    }
    // More blocks than the model has is refused.
    let (model, params, _) = fixture("llama");
    let options = TrainOptions { activation_checkpointing: true, checkpoint_layers: Some(99), ..Default::default() };
    let error = TrainerBuilder::new(model.as_ref(), options).build(&params).err().expect("99 blocks refused");
    assert!(error.to_string().contains("train.checkpoint_layers (--checkpoint-layers) 99 is more than the model's"), "{error}");
}

#[test]
fn adamw_step_follows_the_reference_formula() {
    let (model, params, ids) = fixture("llama");
    let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.1, eps: 1e-8 };
    let options = TrainOptions { adamw: hyper, max_grad_norm: None, ..Default::default() };
    let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
    let count = (ids.size()[0] * (ids.size()[1] - 1)) as f64;
    let _loss = trainer.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap();
    let grads: Vec<Vec<Tensor>> = trainer.units().iter().map(|u| u.grad_views().iter().map(Tensor::copy).collect()).collect();
    let _norm = trainer.step(hyper.lr).unwrap();
    for ((unit, before), (grads, after)) in model.units().iter().zip(&params).zip(grads.iter().zip(trainer.params().unwrap())) {
        for (((spec, p), g), new) in unit.params.iter().zip(before).zip(grads).zip(after) {
            // Step 1: m = (1-b1) g, v = (1-b2) g², bias-corrected m̂ = g, v̂ = g².
            let decay = if spec.shape.len() >= 2 { hyper.weight_decay } else { 0.0 };
            let update = g / (g.abs() + hyper.eps);
            let expected = p * (1.0 - hyper.lr * decay) - update * hyper.lr;
            assert!(max_relative(&new, &expected) < 1e-5, "{}", spec.hf_name);
        }
    }
}

#[test]
fn clipping_by_global_norm_scales_the_gradients_adamw_sees() {
    let (model, params, ids) = fixture("bloom");
    // A large eps makes Adam's first step depend on the gradient's scale: g / (|g| + eps).
    let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, eps: 1e-3 };
    let max_norm = 0.05;
    let options = TrainOptions { adamw: hyper, max_grad_norm: Some(max_norm), ..Default::default() };
    let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
    let count = (ids.size()[0] * (ids.size()[1] - 1)) as f64;
    let _loss = trainer.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap();
    let grads: Vec<Vec<Tensor>> = trainer.units().iter().map(|u| u.grad_views().iter().map(Tensor::copy).collect()).collect();
    let norm = trainer.step(hyper.lr).unwrap().double_value(&[]);
    let expected_norm = grads.iter().flatten().map(|g| g.square().sum(Kind::Double).double_value(&[])).sum::<f64>().sqrt();
    assert!((norm - expected_norm).abs() < 1e-6 * expected_norm);
    assert!(norm > max_norm, "the test needs a gradient above the clip ({norm})");
    let clip = max_norm / norm;
    for ((before, grads), after) in params.iter().zip(&grads).zip(trainer.params().unwrap()) {
        for ((p, g), new) in before.iter().zip(grads).zip(after) {
            let g = g * clip;
            let expected = p - (&g / (g.abs() + hyper.eps)) * hyper.lr;
            assert!(max_relative(&new, &expected) < 1e-5);
        }
    }
}

#[test]
fn fp16_with_loss_scaling_tracks_fp32_and_skips_overflowing_steps() {
    let (model, params, ids) = fixture("bloom");
    let count = (ids.size()[0] * (ids.size()[1] - 1)) as f64;
    let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
    let run = |dtype: Kind, initial_loss_scale: f64, steps: usize| {
        let options = TrainOptions { dtype, adamw: hyper, initial_loss_scale, ..Default::default() };
        let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
        let mut losses = vec![];
        for _ in 0..steps {
            losses.push(trainer.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap().double_value(&[]));
            let _norm = trainer.step(hyper.lr).unwrap();
        }
        (losses, trainer.loss_scale(), trainer.params().unwrap())
    };
    let (fp32, no_scale, _) = run(Kind::Float, 1.0, 5);
    assert_eq!(no_scale, None);
    let (fp16, scale, _) = run(Kind::Half, 1024.0, 5);
    assert_eq!(scale, Some(1024.0), "no overflow, no growth before 2000 clean steps");
    for (a, b) in fp16.iter().zip(&fp32) {
        assert!((a - b).abs() < 1e-2 * b, "fp16 {a} vs fp32 {b}");
    }
    assert!(fp16[4] < fp16[0], "fp16 training lowers the loss: {fp16:?}");

    // A scale that overflows fp16 gradients: the step is skipped and the scale halves.
    let huge = 2f64.powi(100);
    let (_, scale, after) = run(Kind::Half, huge, 1);
    assert_eq!(scale, Some(huge / 2.0));
    for (a, b) in after.iter().flatten().zip(params.iter().flatten()) {
        assert!(a.equal(b), "a skipped step leaves the weights alone");
    }

    // The scaler is checkpointed state: a trainer restored from one whose
    // scale halved continues at the halved scale, not its initial one.
    let options = |initial_loss_scale| TrainOptions { dtype: Kind::Half, adamw: hyper, initial_loss_scale, ..Default::default() };
    let mut overflowed = TrainerBuilder::new(model.as_ref(), options(huge)).build(&params).unwrap();
    let _loss = overflowed.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap();
    let _norm = overflowed.step(hyper.lr).unwrap();
    let part = overflowed.checkpoint_part();
    let mut restored = TrainerBuilder::new(model.as_ref(), options(1024.0)).build(&params).unwrap();
    let read = |unit: usize, start: i64, len: i64| {
        let (from, state) = &part[unit];
        assert_eq!((*from, start), (0, 0), "one process owns every unit whole");
        // Past the parameters: the flat buffer's zero padding.
        Ok(state.each_ref().map(|t| Tensor::cat(&[t.shallow_clone(), Tensor::zeros([len - t.size()[0]], (Kind::Float, Device::Cpu))], 0)))
    };
    restored.restore(read, overflowed.adamw_step(), overflowed.steps(), overflowed.micro_steps(), overflowed.loss_scaler_state().as_ref()).unwrap();
    assert_eq!(restored.loss_scale(), Some(huge / 2.0));
}

#[test]
fn unit_by_unit_backward_equals_one_autograd_pass_for_a_span_head() {
    use ft_tasks::extractive_qa::SpanLoss;
    let config = serde_json::json!({
        "model_type": "bert", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0
    });
    let model = hf::model_from_config(config).unwrap();
    let params = ft_core::model::init_params(model.as_ref(), 0, Kind::Float, Device::Cpu).unwrap();
    tch::manual_seed(1);
    let ids = Tensor::randint(97, [3, 16], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([3, 16], (Kind::Int64, Device::Cpu));
    let _ = mask.get(1).narrow(0, 10, 6).fill_(0);
    let types = Tensor::cat(&[Tensor::zeros([3, 6], (Kind::Int64, Device::Cpu)), Tensor::ones([3, 10], (Kind::Int64, Device::Cpu))], 1);
    let batch = Batch {
        inputs: Inputs { input_ids: ids, attention_mask: Some(mask), token_type_ids: Some(types), documents: None, branches: None, token_mask: None },
        targets: vec![Tensor::from_slice(&[0i64, 7, 12]), Tensor::from_slice(&[0i64, 9, 13])],
    };
    // One autograd pass: (CE(start) + CE(end)) / 2, the mean over the batch.
    let leaves: Vec<Vec<Tensor>> = params.iter().map(|u| u.iter().map(|t| t.detach().copy().set_requires_grad(true)).collect()).collect();
    let ctx = model.context(&batch.inputs, 0, Kind::Float, true).unwrap();
    let outputs = forward(model.as_ref(), &leaves, &batch.inputs, &ctx, None);
    let loss = (outputs[0].cross_entropy_for_logits(&batch.targets[0]) + outputs[1].cross_entropy_for_logits(&batch.targets[1])) / 2.0;
    loss.backward();
    let options = TrainOptions { max_grad_norm: None, ..Default::default() };
    let mut trainer = TrainerBuilder::new(model.as_ref(), options).build(&params).unwrap();
    let ours = trainer.forward_backward(&batch, &SpanLoss, 3.0, MicroBatch::ONLY).unwrap();
    assert!((ours.double_value(&[]) - loss.double_value(&[])).abs() < 1e-5, "{ours} vs {loss}");
    for (unit, expected) in trainer.units().iter().zip(&leaves) {
        for (grad, want) in unit.grad_views().iter().zip(expected) {
            assert!(max_relative(grad, &want.grad()) < 1e-5, "{}", unit.name());
        }
    }
}
