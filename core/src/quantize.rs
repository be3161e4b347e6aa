//! Blockwise int8 quantization, the mechanism compressed collectives share
//! (`plugins/comm/int8` is its user; the policy — what to quantize, when —
//! stays there). Values are cut into rows, each row into blocks of `block`
//! elements (the last padded with zeros), and each block stored as int8
//! with one fp32 scale, its largest magnitude · (1/127). On a GPU, with fp32
//! or bf16 values, one fused kernel each way (core/sys/src/kernels.rs); else
//! the ATen ops below, which compute the same bits (a sum over rows: the
//! kernel adds rows in order, which ATen's sum of more than two need not).

use anyhow::Result;
use tch::{Device, Kind, Tensor};

/// Int8 blocks and their fp32 scales, as `quantize` makes them.
pub struct Quantized {
    /// rows · blocks_per_row · block elements.
    pub q: Tensor,
    /// One per block.
    pub scales: Tensor,
    pub rows: i64,
    pub row_len: i64,
    pub block: i64,
}

/// Whether ft's fused kernels quantize `kind` values on `device`.
pub fn kernels_serve(device: Device, kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::BFloat16) && ft_sys::kernels::available(device).is_ok()
}

/// `x` (1-D, `rows` rows of equal length) as int8 blocks of `block` elements.
pub fn quantize(x: &Tensor, rows: i64, block: i64) -> Result<Quantized> {
    quantize_with(x, rows, block, kernels_serve(x.device(), x.kind()))
}

/// `quantize` by ft's kernels (`fused`) or by ATen's ops.
pub(crate) fn quantize_with(x: &Tensor, rows: i64, block: i64, fused: bool) -> Result<Quantized> {
    let row_len = x.numel() as i64 / rows.max(1);
    let blocks_per_row = (row_len + block - 1) / block;
    let device = x.device();
    let mut q = Tensor::empty([rows * blocks_per_row * block], (Kind::Int8, device));
    let mut scales = Tensor::empty([rows * blocks_per_row], (Kind::Float, device));
    let x = x.contiguous();
    if fused {
        ft_sys::kernels::quantize_int8(&x, rows, block, &mut q, &mut scales)?;
    } else {
        let padding = blocks_per_row * block - row_len;
        let rows_of = x.to_kind(Kind::Float).view([rows, row_len]);
        let blocks = rows_of.constant_pad_nd([0, padding]).view([-1, block]);
        let (low, high) = blocks.aminmax(Some(1), true);
        // A floor far below any weight, so a block of zeros never divides by
        // zero; times the reciprocal (ATen divides by a scalar so on a GPU
        // but not on a CPU), as the kernel does.
        let scale = low.abs().maximum(&high).clamp_min(1e-30) * (1.0 / 127.0);
        let mut scaled = blocks.divide(&scale);
        q.copy_(&scaled.round_().clamp_(-127.0, 127.0).to_kind(Kind::Int8).view([-1]));
        scales.copy_(&scale.view([-1]));
    }
    Ok(Quantized { q, scales, rows, row_len, block })
}

impl Quantized {
    /// Blocks quantized elsewhere (received from other ranks) with this layout.
    pub fn with(&self, q: Tensor, scales: Tensor) -> Quantized {
        Quantized { q, scales, ..*self }
    }

    /// The values into `out` (rows · row_len elements, any float dtype).
    pub fn dequantize_into(&self, out: &Tensor) -> Result<()> {
        self.dequantize_with(out, false, out.is_contiguous() && kernels_serve(out.device(), out.kind()))
    }

    /// The sum over rows, in fp32, into `out` (row_len elements).
    pub fn sum_rows_into(&self, out: &Tensor) -> Result<()> {
        self.dequantize_with(out, true, out.is_contiguous() && kernels_serve(out.device(), out.kind()))
    }

    /// By ft's kernels (`fused`) or by ATen's ops.
    pub(crate) fn dequantize_with(&self, out: &Tensor, sum_rows: bool, fused: bool) -> Result<()> {
        if fused {
            let mut out = out.shallow_clone();
            return Ok(ft_sys::kernels::dequantize_int8(&self.q, &self.scales, self.rows, self.row_len, self.block, sum_rows, &mut out)?);
        }
        let values = self.q.view([-1, self.block]).to_kind(Kind::Float).multiply(&self.scales.view([-1, 1]));
        let values = values.view([self.rows, -1]).narrow(1, 0, self.row_len);
        let values = if sum_rows { values.sum_dim_intlist([0].as_slice(), false, Kind::Float) } else { values.reshape([-1]) };
        out.shallow_clone().copy_(&values);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_comes_back_within_half_a_step_of_its_block_scale() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            // Magnitudes over several orders, and a block of zeros.
            let x = (Tensor::randn([1000], (Kind::Float, Device::Cpu)) * Tensor::logspace(-3.0, 2.0, 1000, 10.0, (Kind::Float, Device::Cpu))).to_kind(kind);
            let x = Tensor::cat(&[x, Tensor::zeros([24], (kind, Device::Cpu))], 0);
            let block = 64;
            let quantized = quantize(&x, 1, block).unwrap();
            assert_eq!(quantized.q.kind(), Kind::Int8);
            let back = Tensor::empty([1024], (Kind::Float, Device::Cpu));
            quantized.dequantize_into(&back).unwrap();
            let exact = x.to_kind(Kind::Float);
            let step = quantized.scales.view([-1, 1]).expand([-1, block], false).reshape([-1]).narrow(0, 0, 1024);
            let excess = ((&back - &exact).abs() - &step * 0.5001).max().double_value(&[]);
            assert!(excess <= 0.0, "{kind:?}: an element is {excess:e} past half its block's step");
            assert!(back.narrow(0, 1000, 24).abs().max().double_value(&[]) == 0.0, "zeros stay zeros");
            assert!(back.isfinite().all().int64_value(&[]) == 1, "{kind:?}: no NaN or inf");
        }
    }

    #[test]
    fn rows_are_padded_apart_and_summed_in_fp32() {
        // Two rows of 5 in blocks of 4: each row is two blocks, the second padded with 3 zeros.
        let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, 4.0, 0.5, 10.0, 20.0, 30.0, 40.0, -50.0]);
        let quantized = quantize(&x, 2, 4).unwrap();
        assert_eq!((quantized.q.size(), quantized.scales.size()), (vec![16], vec![4]));
        let scales = Vec::<f32>::try_from(&quantized.scales).unwrap();
        let step = 1.0f32 / 127.0;
        assert_eq!(scales, vec![4.0 * step, 0.5 * step, 40.0 * step, 50.0 * step], "one absmax a block, rows apart");
        let back = Tensor::empty([10], (Kind::Float, Device::Cpu));
        quantized.dequantize_into(&back).unwrap();
        assert!(back.allclose(&x, 0.02, 0.0, false), "{back:?}");
        let sum = Tensor::empty([5], (Kind::Float, Device::Cpu));
        quantized.sum_rows_into(&sum).unwrap();
        assert!(sum.allclose(&Tensor::from_slice(&[11.0f32, 18.0, 33.0, 44.0, -49.5]), 0.02, 0.2, false), "{sum:?}");
    }
}
