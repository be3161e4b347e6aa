//! `ft bench`: training-step throughput and memory of a model shape with
//! random weights (one process; the sharded matrix builds on the same step).

use crate::model_commands::{parse_device, read_config_arg};
use anyhow::Result;
use clap::Args;
use ft_core::train::{TrainOptions, Trainer};
use ft_core::AdamW;
use ft_models::{hf, init};
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Dense bf16 peak of an H100/H200 SXM, the denominator of MFU.
const PEAK_FLOPS: f64 = 989e12;

#[derive(Args)]
pub struct BenchArgs {
    /// config.json, a model directory, or a hub id in the local cache.
    #[arg(long)]
    config: String,
    /// Override config keys, e.g. --set num_hidden_layers=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    #[arg(long, default_value_t = 8)]
    batch: i64,
    #[arg(long, default_value_t = 512)]
    seq: i64,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Compute dtype (masters stay fp32).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long)]
    activation_checkpointing: bool,
    #[arg(long, default_value_t = 1024)]
    loss_chunk_tokens: i64,
    /// Also time the phases apart (synchronising between them): forward+backward,
    /// the LM head's loss alone, the optimizer step.
    #[arg(long)]
    breakdown: bool,
    /// Also write the result as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: BenchArgs) -> Result<i32> {
    let config = crate::model_commands::apply_overrides(read_config_arg(&args.config)?, &args.overrides)?;
    let model = hf::model_from_config(config)?;
    let device = parse_device(&args.device)?;
    let dtype = ft_core::comm_test::parse_dtype(&args.dtype)?;
    let params = init::init_params(model.as_ref(), 0, Kind::Float, device);
    let options = TrainOptions {
        dtype,
        adamw: AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: args.loss_chunk_tokens,
        activation_checkpointing: args.activation_checkpointing,
        seed: 0,
        ..TrainOptions::default()
    };
    let mut trainer = Trainer::new(model.as_ref(), &params, options)?;
    drop(params);
    let vocab = model.dims().vocab;
    let batches: Vec<Tensor> =
        (0..4).map(|_| Tensor::randint(vocab, [args.batch, args.seq], (Kind::Int64, device))).collect();
    let normalizer = (args.batch * (args.seq - 1)) as f64;
    let synchronize = || {
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
    };
    let mut run_steps = |count: usize| -> Result<f64> {
        let mut last = None;
        for step in 0..count {
            let ids = &batches[step % batches.len()];
            let loss = trainer.forward_backward(ids, ids, normalizer, true)?;
            let _grad_norm = trainer.step(1e-5)?;
            last = Some(loss);
        }
        Ok(last.map_or(f64::NAN, |l| l.double_value(&[])))
    };
    run_steps(args.warmup)?;
    synchronize();
    let start = Instant::now();
    let loss = run_steps(args.steps)?;
    synchronize();
    let seconds = start.elapsed().as_secs_f64();
    let tokens_per_s = (args.batch * args.seq) as f64 * args.steps as f64 / seconds;
    let mfu = model.train_flops_per_token(args.seq) * tokens_per_s / PEAK_FLOPS;
    let memory = match device {
        Device::Cuda(index) => Some(ft_core::cuda_memory(index, false).map_err(anyhow::Error::msg)?),
        _ => None,
    };
    let gb = |bytes: i64| bytes as f64 / 1e9;
    println!(
        "{} {:.0}M params, batch {}x{}, {}: {:.0} tokens/s, {:.1} ms/step, MFU {:.1}%, peak allocated {}, peak reserved {}, last loss {:.4}",
        model.model_type(),
        model.numel() as f64 / 1e6,
        args.batch,
        args.seq,
        args.dtype,
        tokens_per_s,
        seconds / args.steps as f64 * 1e3,
        mfu * 100.0,
        memory.map_or("n/a".into(), |m| format!("{:.1} GB", gb(m.peak_allocated))),
        memory.map_or("n/a".into(), |m| format!("{:.1} GB", gb(m.peak_reserved))),
        loss
    );
    let breakdown = if args.breakdown { Some(time_phases(&mut trainer, &batches[0], normalizer, &synchronize)?) } else { None };
    if let Some((forward_backward, head, step)) = breakdown {
        println!(
            "breakdown (ms per step): forward+backward {forward_backward:.1} (LM head loss and grads {head:.1}), optimizer step {step:.1}"
        );
    }
    if let Some(path) = &args.json {
        let report = serde_json::json!({
            "tool": "ft", "model_type": model.model_type(), "params": model.numel(),
            "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "steps": args.steps,
            "activation_checkpointing": args.activation_checkpointing,
            "tokens_per_s": tokens_per_s, "step_ms": seconds / args.steps as f64 * 1e3, "mfu": mfu,
            "peak_allocated_gb": memory.map(|m| gb(m.peak_allocated)),
            "peak_reserved_gb": memory.map(|m| gb(m.peak_reserved)), "loss": loss,
            "breakdown_ms": breakdown.map(|(fb, head, step)| serde_json::json!({"forward_backward": fb, "lm_head": head, "step": step})),
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(0)
}

/// Milliseconds per call of forward+backward, of the LM head's fused loss on
/// the same shapes, and of the optimizer step, each timed between synchronisations.
fn time_phases(trainer: &mut Trainer, ids: &Tensor, normalizer: f64, synchronize: &dyn Fn()) -> Result<(f64, f64, f64)> {
    const REPEATS: usize = 5;
    let (mut forward_backward, mut step) = (0.0, 0.0);
    for _ in 0..REPEATS {
        synchronize();
        let start = Instant::now();
        let _loss = trainer.forward_backward(ids, ids, normalizer, true)?;
        synchronize();
        forward_backward += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let _grad_norm = trainer.step(1e-5)?;
        synchronize();
        step += start.elapsed().as_secs_f64();
    }
    let dims = trainer.model().dims();
    let (batch, seq) = (ids.size()[0], ids.size()[1]);
    let dtype = trainer.units()[0].compute_kind();
    let hidden = Tensor::randn([batch, seq, dims.hidden], (dtype, ids.device()));
    let weight = Tensor::randn([dims.vocab, dims.hidden], (dtype, ids.device())) * 0.02;
    synchronize();
    let start = Instant::now();
    for _ in 0..REPEATS {
        let _outputs = ft_core::train::lm_head_loss_and_grads(&hidden, &weight, ids, normalizer, trainer.loss_chunk_tokens(), None)?;
    }
    synchronize();
    let head = start.elapsed().as_secs_f64();
    let ms = |seconds: f64| seconds / REPEATS as f64 * 1e3;
    Ok((ms(forward_backward), ms(head), ms(step)))
}
