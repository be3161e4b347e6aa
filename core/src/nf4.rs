//! Blockwise 4-bit quantization, NF4 and FP4, bit for bit as bitsandbytes
//! 0.50.2 makes it (`bitsandbytes.functional.quantize_4bit` and
//! `dequantize_4bit` on a CPU): the base weights of QLoRA, and the files
//! transformers writes for a bitsandbytes-quantized model.
//!
//! A tensor of `n` values (bf16, fp16 or fp32, any shape) is read flat and
//! cut into blocks of `blocksize` (64 by default; the last block may be
//! shorter). Each block keeps its largest magnitude (`absmax`, fp32); each
//! value, divided by it, becomes the 4-bit index of the nearest entry of a
//! 16-value table ([`QuantType::code`]: NF4's normal quantiles or FP4's
//! e2m1 values), ties to the lower value. Two indices share a byte, the
//! first in the high nibble; an odd count ends with the index of 0.
//! Dequantized, a value is `code[index] · absmax` in fp32, rounded to the
//! input's dtype.
//!
//! Double quantization (`compress_statistics=True`) stores the absmaxes
//! minus their mean (`offset`) as 8-bit indices into bitsandbytes' dynamic
//! map ([`dynamic_code`]), in blocks of 256 with an fp32 absmax each.
//!
//! Every step is an ATen op, so it runs on any device; each mirrors the op
//! bitsandbytes runs on a CPU (its reciprocal-then-multiply for whole
//! blocks but a division for the short last one; its CPU kernel's
//! 65536-entry lookup table and fused multiply-add for the 8-bit
//! statistics), since a mathematically equal formula can round
//! differently. tests/qlora.rs checks the bits on a CPU; on a GPU the same
//! ops may round the mean of the absmaxes otherwise, and bitsandbytes' own
//! CUDA kernels are other code, not compared. On a GPU where ft's kernels
//! load, dequantization is one kernel (`kernels/nf4.cu`) that writes the
//! ATen ops' bits (this module's GPU test checks, bench/gpu/nf4_kernel.sh
//! runs it). (The int8 blocks in `quantize.rs` are ft's own format,
//! rounded their own way, so nothing but the idea is shared.)
//!
//! [`Quantized4bit::state_dict`] and [`Quantized4bit::from_state_dict`]
//! write and read a weight as transformers saves it (bitsandbytes'
//! `QuantState.as_dict(packed=True)`): for `x.weight`, the packed bytes
//! `x.weight`, `x.weight.absmax`, `x.weight.quant_map`, with double
//! quantization `x.weight.nested_absmax` and `x.weight.nested_quant_map`,
//! and `x.weight.quant_state.bitsandbytes__nf4` (or `__fp4`): a uint8
//! tensor holding the rest as JSON.

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};
use ft_sys::kernels::Absmax4bit;
use std::sync::LazyLock;
use tch::{Device, Kind, Tensor};

/// The block sizes bitsandbytes accepts.
pub const BLOCKSIZES: [i64; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];
/// bitsandbytes' default block.
pub const DEFAULT_BLOCKSIZE: i64 = 64;
/// The block of double quantization's 8-bit statistics.
pub const NESTED_BLOCKSIZE: i64 = 256;

/// Which 16 values the 4-bit indices stand for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantType {
    /// NormalFloat: quantiles of a normal distribution (QLoRA's).
    Nf4,
    /// A 4-bit float: sign, two exponent bits, one mantissa bit.
    Fp4,
}

impl QuantType {
    /// bitsandbytes' name: `nf4`, `fp4`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }

    pub fn from_name(name: &str) -> Option<QuantType> {
        [QuantType::Nf4, QuantType::Fp4].into_iter().find(|t| t.name() == name)
    }

    /// The value of each index, in [-1, 1], fp32: bitsandbytes'
    /// `get_4bit_type` (its literals, then divided by the largest magnitude).
    pub fn code(self, device: Device) -> Tensor {
        // bitsandbytes' literals are Python floats, rounded to fp32 by `torch.tensor`.
        let values: [f64; 16] = match self {
            QuantType::Nf4 => [
                -1.0,
                -0.6961928009986877,
                -0.5250730514526367,
                -0.39491748809814453,
                -0.28444138169288635,
                -0.18477343022823334,
                -0.09105003625154495,
                0.0,
                0.07958029955625534,
                0.16093020141124725,
                0.24611230194568634,
                0.33791524171829224,
                0.44070982933044434,
                0.5626170039176941,
                0.7229568362236023,
                1.0,
            ],
            // In bit order: sign, then the magnitudes of 0b000..0b111 (both
            // zeros +0: bitsandbytes writes the second as the integer -0).
            QuantType::Fp4 => [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0],
        };
        let code = Tensor::from_slice(&values.map(|v| v as f32)).to_device(device);
        let largest = code.abs().max();
        code / largest
    }

    /// The value of each index as bitsandbytes' native kernels (CPU and
    /// CUDA) dequantize it: the table, but FP4's index 8 (sign bit and zero)
    /// is -0. (Its Python fallback, which a CPU runs for tensors whose last
    /// dimension is odd, reads the table's +0: the same numbers.)
    fn dequantization_code(self, device: Device) -> Tensor {
        let code = self.code(device);
        if self == QuantType::Fp4 {
            let _ = code.narrow(0, 8, 1).fill_(-0.0);
        }
        code
    }

    /// `dequantization_code`'s values on the host, made once: what ft's
    /// kernel takes.
    fn dequantization_values(self) -> &'static [f32; 16] {
        // In the enum's order, which `self as usize` indexes.
        static VALUES: LazyLock<[[f32; 16]; 2]> = LazyLock::new(|| {
            [QuantType::Nf4, QuantType::Fp4].map(|t| {
                let values = Vec::<f32>::try_from(t.dequantization_code(Device::Cpu)).unwrap_or_default();
                values.try_into().unwrap_or([f32::NAN; 16])
            })
        });
        &VALUES[self as usize]
    }

    /// The midpoints between the sorted values and, for each interval, its
    /// index (bitsandbytes' `_get_4bit_quantize_bounds`; FP4's two zeros,
    /// indices 0 and 8, stay in table order: 0 takes index 0, and tiny
    /// positive values index 8).
    fn bounds(self, device: Device) -> (Tensor, Tensor) {
        let code = self.code(device);
        let order = code.argsort_stable(true, 0, false);
        let sorted = code.index_select(0, &order);
        let midpoints = (sorted.narrow(0, 0, 15) + sorted.narrow(0, 1, 15)) / 2.0;
        (midpoints, order)
    }
}

/// How a model's weights are quantized (QLoRA's base: `model.quantize`,
/// `model.quant_blocksize`, `model.double_quant`; bitsandbytes'
/// `bnb_4bit_quant_type`, `blocksize` and `bnb_4bit_use_double_quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quantization {
    pub quant_type: QuantType,
    pub blocksize: i64,
    pub double_quant: bool,
}

/// Whether each of `parts` equal slices of a tensor of `shape` along its
/// first dimension starts and ends on a block of `blocksize` values, so
/// that a rank holding one slice holds whole blocks of the whole tensor's
/// quantization ([`Quantized4bit::rows`]).
pub fn rows_hold_whole_blocks(shape: &[i64], parts: i64, blocksize: i64) -> bool {
    parts == 1 || (shape[0] % parts == 0 && (shape.iter().product::<i64>() / parts) % blocksize == 0)
}

/// How many blocks of `blocksize` values hold `numel` values.
pub fn blocks(numel: i64, blocksize: i64) -> i64 {
    (numel + blocksize - 1) / blocksize
}

impl Quantization {
    /// Bytes a weight of `numel` values takes quantized: its packed 4-bit
    /// indices and its blocks' absmaxes (fp32; double quantized, a byte
    /// each and an fp32 absmax per `NESTED_BLOCKSIZE` of them).
    pub fn bytes(&self, numel: i64) -> i64 {
        let count = blocks(numel, self.blocksize);
        let absmaxes = match self.double_quant {
            true => count + 4 * blocks(count, NESTED_BLOCKSIZE),
            false => 4 * count,
        };
        (numel + 1) / 2 + absmaxes
    }

    /// `x`'s values as this quantization holds them (dequantized, in `x`'s dtype).
    pub fn round_trip(&self, x: &Tensor) -> Result<Tensor> {
        Ok(quantize(x, self.quant_type, self.blocksize, self.double_quant)?.dequantize())
    }
}

/// The absmax of each 4-bit block, as stored.
pub enum Absmax {
    /// fp32, one per block.
    Plain(Tensor),
    /// Double quantization: 8-bit indices into `code`, one per block, with
    /// an fp32 absmax per `blocksize` of them; the value is
    /// `code[index] · absmax + offset`. `first`: where the first index
    /// sits in the first nested block — 0 for a whole tensor's state, the
    /// place a slice of it starts at ([`Quantized4bit::rows`]).
    Nested { indices: Tensor, absmax: Tensor, code: Tensor, blocksize: i64, offset: f32, first: i64 },
}

/// How to read a packed tensor back: bitsandbytes' `QuantState`.
pub struct QuantState {
    pub quant_type: QuantType,
    pub blocksize: i64,
    /// The original tensor's shape and dtype.
    pub shape: Vec<i64>,
    pub dtype: Kind,
    pub absmax: Absmax,
}

impl QuantState {
    /// Values of the original tensor.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// A quantized tensor: its packed indices (uint8, `[(n + 1) / 2, 1]`, as
/// bitsandbytes shapes them) and its state.
pub struct Quantized4bit {
    pub packed: Tensor,
    pub state: QuantState,
}

/// Values quantized or dequantized at a time (whole blocks of every size in
/// `BLOCKSIZES`, an even count): one chunk's fp32 copies and indices are
/// what a weight's (de)quantization holds beside its input and output
/// (~20 MB, however large the weight).
const CHUNK_VALUES: i64 = 1 << 20;

/// `x` (bf16, fp16 or fp32) in blocks of `blocksize`, its absmaxes
/// quantized again when `double_quant` (bitsandbytes' `compress_statistics`).
pub fn quantize(x: &Tensor, quant_type: QuantType, blocksize: i64, double_quant: bool) -> Result<Quantized4bit> {
    ensure!(BLOCKSIZES.contains(&blocksize), "a 4-bit block of {blocksize} values: bitsandbytes takes {BLOCKSIZES:?}");
    let dtype = x.kind();
    ensure!(matches!(dtype, Kind::Float | Kind::BFloat16 | Kind::Half), "only bf16, fp16 and fp32 tensors quantize to 4 bits, not {dtype:?}");
    let flat = x.reshape([-1]);
    let n = flat.numel() as i64;
    let bounds = quant_type.bounds(x.device());
    // Each block is quantized on its own, so chunks give the same bits.
    let (mut packed, mut absmax) = (Vec::new(), Vec::new());
    let mut start = 0;
    loop {
        let len = (n - start).min(CHUNK_VALUES);
        let (chunk_packed, chunk_absmax) = quantize_chunk(&flat.narrow(0, start, len), quant_type, blocksize, &bounds);
        packed.push(chunk_packed);
        absmax.push(chunk_absmax);
        start += len;
        if start == n {
            break;
        }
    }
    let (packed, absmax) = (Tensor::cat(&packed, 0).unsqueeze(1), Tensor::cat(&absmax, 0));
    let absmax = if double_quant { nested(&absmax) } else { Absmax::Plain(absmax) };
    Ok(Quantized4bit { packed, state: QuantState { quant_type, blocksize, shape: x.size(), dtype, absmax } })
}

/// `values` (flat; all whole blocks but perhaps the last) as packed bytes
/// and one absmax per block, with `bounds` from [`QuantType::bounds`]:
/// bitsandbytes' `quantize_4bit` (its default, Python kernel).
fn quantize_chunk(values: &Tensor, quant_type: QuantType, blocksize: i64, (midpoints, order): &(Tensor, Tensor)) -> (Tensor, Tensor) {
    let values = values.to_kind(Kind::Float);
    let n = values.numel() as i64;
    let (blocks, rest) = (n / blocksize, n % blocksize);
    let whole = values.narrow(0, 0, blocks * blocksize).view([blocks, blocksize]);
    // The floor keeps a block of zeros from dividing by zero; bitsandbytes
    // stores it only for the short last block.
    let mut absmax = whole.abs().amax([1i64].as_slice(), false);
    let mut scaled = (&whole * absmax.clamp_min(1e-38).reciprocal().view([-1, 1])).clamp(-1.0, 1.0).reshape([-1]);
    if rest > 0 {
        let tail = values.narrow(0, blocks * blocksize, rest);
        let tail_absmax = tail.abs().max().clamp_min(1e-38);
        scaled = Tensor::cat(&[scaled, (&tail / &tail_absmax).clamp(-1.0, 1.0)], 0);
        absmax = Tensor::cat(&[absmax, tail_absmax.unsqueeze(0)], 0);
    }
    if n % 2 == 1 {
        scaled = scaled.constant_pad_nd([0, 1]);
    }
    let sorted_indices = scaled.bucketize(midpoints, true, false);
    // NF4's table is sorted; bitsandbytes maps FP4's only.
    let indices = match quant_type {
        QuantType::Nf4 => sorted_indices,
        QuantType::Fp4 => order.index_select(0, &sorted_indices),
    }
    .to_kind(Kind::Uint8);
    let pairs = indices.view([-1, 2]);
    let packed = pairs.select(1, 0).bitwise_left_shift_tensor_scalar(4).bitwise_or_tensor(&pairs.select(1, 1));
    (packed, absmax)
}

/// The absmaxes minus their mean in 8-bit blocks of 256 (bitsandbytes'
/// `quantize_blockwise` on a CPU: the mean, then its native kernel).
fn nested(absmax: &Tensor) -> Absmax {
    let offset = absmax.mean(None::<Kind>);
    let code = dynamic_code(absmax.device());
    let (indices, nested_absmax) = quantize_8bit(&(absmax - &offset), &code, NESTED_BLOCKSIZE);
    Absmax::Nested { indices, absmax: nested_absmax, code, blocksize: NESTED_BLOCKSIZE, offset: offset.double_value(&[]) as f32, first: 0 }
}

/// bitsandbytes' signed dynamic map (`create_dynamic_map()`): 256 sorted
/// fp32 values in [-1, 1] with a dynamic exponent — for each of 7
/// decades, the midpoints of 2^i + 1 steps from 0.1 to 1, scaled by the
/// decade, with both signs; then 0 and 1. Built with the ops it is built
/// with, since each rounds.
pub fn dynamic_code(device: Device) -> Tensor {
    let mut parts = Vec::new();
    for i in 0..7usize {
        let boundaries = Tensor::linspace(0.1, 1.0, (1i64 << i) + 1, (Kind::Float, Device::Cpu));
        let count = boundaries.size()[0];
        let means = (boundaries.narrow(0, 0, count - 1) + boundaries.narrow(0, 1, count - 1)) / 2.0;
        let decade = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0][i];
        parts.push(&means * decade);
        parts.push(&means * -decade);
    }
    parts.push(Tensor::from_slice(&[0.0f32, 1.0]));
    let (sorted, _) = Tensor::cat(&parts, 0).sort(0, false);
    sorted.to_device(device)
}

/// `values` (fp32, 1-D) as 8-bit indices into `code` (sorted) in blocks of
/// `blocksize`, as bitsandbytes' CPU kernel (`quantize_cpu_impl`) makes
/// them: each block's absmax, each value times its reciprocal, clamped to
/// [-1, 1], mapped to one of 65536 evenly spaced points
/// (`trunc((v + 1) · 0.5 · 65535 + 0.5)`, a fused multiply-add) and the
/// nearest code entry of that point taken from a table; a block of zeros
/// is all index 0.
fn quantize_8bit(values: &Tensor, code: &Tensor, blocksize: i64) -> (Tensor, Tensor) {
    let n = values.numel() as i64;
    let blocks = (n + blocksize - 1) / blocksize;
    // Zeros do not change an absmax (the kernel's starts at 0).
    let padded = values.constant_pad_nd([0, blocks * blocksize - n]).view([blocks, blocksize]);
    let absmax = padded.abs().amax([1i64].as_slice(), false);
    let nonzero = absmax.ne(0.0).view([-1, 1]);
    let scaled = (&padded * absmax.reciprocal().view([-1, 1])).clamp(-1.0, 1.0);
    // A block of zeros (0 · inf) takes point 0, whose entry is index 0.
    let halfway = (scaled.where_scalarother(&nonzero, -1.0) + 1.0) * 0.5;
    // fp32's fused multiply-add, exactly: the fp64 product is exact, and so
    // is the fp64 sum wherever its rounding to fp32 could tell them apart.
    let point = (halfway.to_kind(Kind::Double) * 65535.0 + 0.5).to_kind(Kind::Float).to_kind(Kind::Int64);
    let indices = lookup_table(code).index_select(0, &point.reshape([-1]));
    (indices.narrow(0, 0, n), absmax)
}

/// The kernel's table: for each of the 65536 points `-1 + 2i / 65535`
/// (fp32), the index of the first code midpoint not below it.
fn lookup_table(code: &Tensor) -> Tensor {
    let entries = code.size()[0];
    let midpoints = (code.narrow(0, 0, entries - 1) + code.narrow(0, 1, entries - 1)) * 0.5;
    let steps = Tensor::arange(65536, (Kind::Float, code.device())) * 2.0;
    // Divided by a full tensor: ATen may multiply by the reciprocal of a scalar.
    let points = steps.divide(&Tensor::full([65536], 65535.0, (Kind::Float, code.device()))) - 1.0;
    points.bucketize(&midpoints, false, false).to_kind(Kind::Uint8)
}

impl Absmax {
    /// One fp32 absmax per 4-bit block.
    pub fn values(&self) -> Tensor {
        match self {
            Absmax::Plain(absmax) => absmax.shallow_clone(),
            Absmax::Nested { indices, absmax, code, blocksize, offset, first } => {
                let n = indices.numel() as i64;
                let blocks = absmax.numel() as i64;
                let values = code.index_select(0, &indices.to_kind(Kind::Int64)).constant_pad_nd([*first, blocks * blocksize - n - first]);
                let values = (values.view([blocks, *blocksize]) * absmax.view([-1, 1])).reshape([-1]).narrow(0, *first, n);
                // A scalar, not a tensor made on the host: no copy to the device to wait for.
                values + *offset as f64
            }
        }
    }
}

impl Quantized4bit {
    /// The values, in the original shape and dtype, a chunk at a time (so
    /// that beside the result, one chunk's indices and fp32 values are held).
    pub fn dequantize(&self) -> Tensor {
        let state = &self.state;
        let out = Tensor::empty([state.numel()], (state.dtype, self.packed.device()));
        self.dequantize_into(&out);
        out.view(state.shape.as_slice())
    }

    /// The values written into `out` (1-D, contiguous, as many elements,
    /// any floating dtype): rounded to the original dtype as
    /// [`Quantized4bit::dequantize`] rounds them, then to `out`'s, as
    /// bitsandbytes' `matmul_4bit` casts its dequantized weight to the
    /// input's dtype. On a GPU where ft's kernels load, one kernel
    /// (`kernels::dequantize_4bit`) writes them, the same bits, into fp32,
    /// bf16 or fp16; ATen's ops elsewhere, into other dtypes (fp64), when
    /// `out` is on another device than the packed bytes, and, with a
    /// warning, if the launch fails.
    pub fn dequantize_into(&self, out: &Tensor) {
        let device = out.device();
        let fused = device == self.packed.device()
            && matches!(out.kind(), Kind::Float | Kind::BFloat16 | Kind::Half)
            && crate::kernels::Kernels::loaded(device);
        self.dequantize_with(out, fused)
    }

    /// `dequantize_into` by ft's kernel (`fused`) or by ATen's ops.
    pub(crate) fn dequantize_with(&self, out: &Tensor, fused: bool) {
        if fused {
            match self.dequantize_by_kernel(out) {
                Ok(()) => return,
                Err(why) => tracing::warn!("{why}; dequantizing the 4-bit weight with ATen's ops instead"),
            }
        }
        let state = &self.state;
        let n = state.numel();
        let device = self.packed.device();
        let bytes = self.packed.reshape([-1]);
        // Each byte's two values: row b is (code[b >> 4], code[b & 15]).
        let code = state.quant_type.dequantization_code(device);
        let byte_values = Tensor::stack(&[code.repeat_interleave_self_int(16, 0, None), code.repeat([16])], 1);
        let absmax = state.absmax.values();
        let mut start = 0;
        while start < n {
            let len = (n - start).min(CHUNK_VALUES);
            let chunk = bytes.narrow(0, start / 2, (len + 1) / 2);
            let values = byte_values.index_select(0, &chunk.to_kind(Kind::Int)).reshape([-1]).narrow(0, 0, len);
            let blocks = (len + state.blocksize - 1) / state.blocksize;
            let values = values.constant_pad_nd([0, blocks * state.blocksize - len]);
            let scales = absmax.narrow(0, start / state.blocksize, blocks).view([-1, 1]);
            let values = (values.view([blocks, state.blocksize]) * scales).reshape([-1]).narrow(0, 0, len);
            out.narrow(0, start, len).copy_(&values.to_kind(state.dtype));
            start += len;
        }
    }

    /// `dequantize_into` by ft's CUDA kernel, the double quantization's
    /// absmaxes computed in it too.
    fn dequantize_by_kernel(&self, out: &Tensor) -> Result<()> {
        let state = &self.state;
        ensure!(out.numel() as i64 == state.numel(), "{} values do not fit a buffer of {}", state.numel(), out.numel());
        let packed = self.packed.contiguous().view([-1]);
        let code = state.quant_type.dequantization_values();
        let launch = |absmax: Absmax4bit<'_>| ft_sys::kernels::dequantize_4bit(&packed, absmax, code, state.blocksize, state.dtype, &mut out.shallow_clone());
        match &state.absmax {
            Absmax::Plain(absmax) => launch(Absmax4bit::Plain(&absmax.contiguous())),
            // The kernel reads whole nested blocks: a slice's absmaxes starting inside one are computed first.
            nested @ Absmax::Nested { first, .. } if *first != 0 => launch(Absmax4bit::Plain(&nested.values())),
            Absmax::Nested { indices, absmax, code, blocksize, offset, .. } => launch(Absmax4bit::Nested {
                indices: &indices.contiguous(),
                absmax: &absmax.contiguous(),
                code: &code.contiguous(),
                blocksize: *blocksize,
                offset: *offset,
            }),
        }?;
        Ok(())
    }

    /// The part of this quantization that holds rows `rows` of the
    /// tensor's first dimension, as a rank holding only those rows keeps
    /// it (an expert-parallel rank's experts of a fused expert tensor):
    /// their packed bytes and their blocks' absmaxes — double quantized,
    /// their 8-bit indices, the nested absmaxes of the nested blocks those
    /// fall in (shared with a neighbouring slice where one straddles) and
    /// the whole tensor's offset. The rows must start on a block
    /// ([`rows_hold_whole_blocks`]); dequantized, the part gives the whole
    /// tensor's dequantized rows bit for bit.
    pub fn rows(&self, rows: std::ops::Range<i64>) -> Result<Quantized4bit> {
        let state = &self.state;
        let row: i64 = state.shape[1..].iter().product();
        let (start, len) = (rows.start * row, (rows.end - rows.start) * row);
        ensure!(
            start % state.blocksize == 0 && (len % state.blocksize == 0 || rows.end == state.shape[0]) && len > 0 && rows.end <= state.shape[0],
            "rows {rows:?} of a 4-bit tensor of shape {:?} do not hold whole blocks of {} values",
            state.shape,
            state.blocksize
        );
        let (first_block, count) = (start / state.blocksize, blocks(len, state.blocksize));
        let absmax = match &state.absmax {
            Absmax::Plain(absmax) => Absmax::Plain(absmax.narrow(0, first_block, count)),
            Absmax::Nested { indices, absmax, code, blocksize, offset, first } => {
                let at = first + first_block;
                let first = at % blocksize;
                let absmax = absmax.narrow(0, at / blocksize, blocks(first + count, *blocksize));
                Absmax::Nested { indices: indices.narrow(0, first_block, count), absmax, code: code.shallow_clone(), blocksize: *blocksize, offset: *offset, first }
            }
        };
        let mut shape = state.shape.clone();
        shape[0] = rows.end - rows.start;
        // A block holds an even number of values, so the slice starts on a byte.
        let packed = self.packed.narrow(0, start / 2, (len + 1) / 2);
        Ok(Quantized4bit { packed, state: QuantState { quant_type: state.quant_type, blocksize: state.blocksize, shape, dtype: state.dtype, absmax } })
    }

    /// The tensors bitsandbytes' `QuantState.as_dict(packed=True)` and
    /// transformers save for a weight named `weight`, by name (a whole
    /// tensor's state: a part of one, [`Quantized4bit::rows`], is none).
    pub fn state_dict(&self, weight: &str) -> Vec<(String, Tensor)> {
        let state = &self.state;
        let mut blob = json!({
            "quant_type": state.quant_type.name(),
            "blocksize": state.blocksize,
            "dtype": dtype_name(state.dtype),
            "shape": state.shape,
        });
        let device = self.packed.device();
        let mut tensors = vec![(weight.to_string(), self.packed.shallow_clone())];
        match &state.absmax {
            Absmax::Plain(absmax) => tensors.push((format!("{weight}.absmax"), absmax.shallow_clone())),
            Absmax::Nested { indices, absmax, code, blocksize, offset, .. } => {
                tensors.push((format!("{weight}.absmax"), indices.shallow_clone()));
                tensors.push((format!("{weight}.nested_absmax"), absmax.shallow_clone()));
                tensors.push((format!("{weight}.nested_quant_map"), code.shallow_clone()));
                let fields = blob.as_object_mut().expect("a JSON object");
                fields.insert("nested_blocksize".into(), json!(blocksize));
                fields.insert("nested_dtype".into(), json!("float32"));
                fields.insert("nested_offset".into(), json!(offset));
            }
        }
        tensors.push((format!("{weight}.quant_map"), state.quant_type.code(device)));
        let text = blob.to_string();
        tensors.push((state_key(weight, state.quant_type), Tensor::from_slice(text.as_bytes()).to_device(device)));
        tensors
    }

    /// A weight saved as [`Quantized4bit::state_dict`] writes it (and
    /// transformers with bitsandbytes do), its tensors found by name with
    /// `tensor`. A missing or malformed part is an error that names it.
    pub fn from_state_dict(weight: &str, tensor: impl Fn(&str) -> Option<Tensor>) -> Result<Quantized4bit> {
        let [nf4_key, fp4_key] = [QuantType::Nf4, QuantType::Fp4].map(|t| state_key(weight, t));
        let (key_type, key, blob) = match (tensor(&nf4_key), tensor(&fp4_key)) {
            (Some(blob), None) => (QuantType::Nf4, nf4_key, blob),
            (None, Some(blob)) => (QuantType::Fp4, fp4_key, blob),
            (None, None) => bail!("{weight} has no 4-bit quant state: expected a tensor {nf4_key} (or {fp4_key})"),
            (Some(_), Some(_)) => bail!("{weight} has two 4-bit quant states, {nf4_key} and {fp4_key}: keep one"),
        };
        let blob = read_blob(&key, &blob)?;
        let field = |name: &str| blob.get(name).ok_or_else(|| anyhow!("{key}: its JSON has no \"{name}\""));
        let known = ["quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"];
        if let Some(unknown) = blob.keys().find(|k| !known.contains(&k.as_str())) {
            bail!("{key}: unknown entry \"{unknown}\" in its JSON (bitsandbytes writes {known:?})");
        }
        let type_name = field("quant_type")?.as_str().ok_or_else(|| anyhow!("{key}: \"quant_type\" is not a string"))?;
        let quant_type = QuantType::from_name(type_name).ok_or_else(|| anyhow!("{key}: unknown quant_type \"{type_name}\" (bitsandbytes writes nf4 or fp4)"))?;
        ensure!(quant_type == key_type, "{key}: its JSON says quant_type \"{type_name}\", its name {}", key_type.name());
        let blocksize = field("blocksize")?.as_i64().filter(|b| BLOCKSIZES.contains(b));
        let blocksize = blocksize.ok_or_else(|| anyhow!("{key}: blocksize {} is not one of {BLOCKSIZES:?}", blob["blocksize"]))?;
        let dtype_text = field("dtype")?.as_str().unwrap_or_default();
        let dtype = dtype_from_name(dtype_text).ok_or_else(|| anyhow!("{key}: dtype {} is not float32, float16 or bfloat16", blob["dtype"]))?;
        let shape: Option<Vec<i64>> = field("shape")?.as_array().and_then(|dims| dims.iter().map(|d| d.as_i64().filter(|d| *d >= 0)).collect());
        let shape = shape.ok_or_else(|| anyhow!("{key}: shape {} is not a list of sizes", blob["shape"]))?;
        let n: i64 = shape.iter().product();
        let blocks = (n + blocksize - 1) / blocksize;

        let packed = required(&tensor, weight)?;
        // A `quant_storage` other than uint8 holds the same bytes.
        let packed = if packed.kind() == Kind::Uint8 { packed } else { packed.contiguous().view_dtype(Kind::Uint8) };
        ensure!(packed.numel() as i64 == (n + 1) / 2, "{weight}: {} packed bytes, but shape {shape:?} ({n} values) takes {}", packed.numel(), (n + 1) / 2);
        let packed = packed.reshape([-1, 1]);

        let quant_map = format!("{weight}.quant_map");
        let code = float_tensor(&tensor, &quant_map, 16)?;
        ensure!(
            code.equal(&quant_type.code(code.device())),
            "{quant_map} differs from bitsandbytes' {} table, the one bitsandbytes (and ft) dequantize with",
            quant_type.name()
        );

        let absmax_name = format!("{weight}.absmax");
        let nested_parts = ["nested_blocksize", "nested_dtype", "nested_offset"].map(|k| blob.contains_key(k));
        let nested_tensors = ["nested_absmax", "nested_quant_map"].map(|k| tensor(&format!("{weight}.{k}")).is_some());
        let absmax = if nested_parts.iter().chain(&nested_tensors).any(|p| *p) {
            let nested_blocksize = field("nested_blocksize")?.as_i64().filter(|b| *b > 0);
            let nested_blocksize = nested_blocksize.ok_or_else(|| anyhow!("{key}: nested_blocksize {} is not a block size", blob["nested_blocksize"]))?;
            ensure!(field("nested_dtype")?.as_str() == Some("float32"), "{key}: nested_dtype {} is not float32", blob["nested_dtype"]);
            let offset = field("nested_offset")?.as_f64().ok_or_else(|| anyhow!("{key}: nested_offset {} is not a number", blob["nested_offset"]))?;
            let indices = required(&tensor, &absmax_name)?;
            ensure!(
                indices.kind() == Kind::Uint8 && indices.size() == [blocks],
                "{absmax_name}: expected uint8 indices of shape [{blocks}] (double quantization; {n} values in blocks of {blocksize}), found {:?} of shape {:?}",
                indices.kind(),
                indices.size()
            );
            let nested_blocks = (blocks + nested_blocksize - 1) / nested_blocksize;
            let absmax = float_tensor(&tensor, &format!("{weight}.nested_absmax"), nested_blocks)?;
            let code = float_tensor(&tensor, &format!("{weight}.nested_quant_map"), 256)?;
            Absmax::Nested { indices, absmax, code, blocksize: nested_blocksize, offset: offset as f32, first: 0 }
        } else {
            Absmax::Plain(float_tensor(&tensor, &absmax_name, blocks)?)
        };
        Ok(Quantized4bit { packed, state: QuantState { quant_type, blocksize, shape, dtype, absmax } })
    }
}

/// The name of the JSON blob's tensor: `{weight}.quant_state.bitsandbytes__nf4`.
pub fn state_key(weight: &str, quant_type: QuantType) -> String {
    format!("{weight}.quant_state.bitsandbytes__{}", quant_type.name())
}

fn required(tensor: &impl Fn(&str) -> Option<Tensor>, name: &str) -> Result<Tensor> {
    tensor(name).ok_or_else(|| anyhow!("{name} is missing: a 4-bit weight's quant state needs it"))
}

/// `name`: fp32, 1-D, `len` values.
fn float_tensor(tensor: &impl Fn(&str) -> Option<Tensor>, name: &str, len: i64) -> Result<Tensor> {
    let t = required(tensor, name)?;
    ensure!(t.kind() == Kind::Float && t.size() == [len], "{name}: expected fp32 values of shape [{len}], found {:?} of shape {:?}", t.kind(), t.size());
    Ok(t)
}

/// The JSON object a uint8 tensor holds.
fn read_blob(key: &str, blob: &Tensor) -> Result<serde_json::Map<String, Value>> {
    ensure!(blob.kind() == Kind::Uint8 && blob.dim() == 1, "{key}: expected uint8 bytes of JSON, found {:?} of shape {:?}", blob.kind(), blob.size());
    let bytes = Vec::<u8>::try_from(&blob.to_device(Device::Cpu))?;
    let value: Value = serde_json::from_slice(&bytes).with_context(|| format!("{key} does not hold valid JSON"))?;
    match value {
        Value::Object(fields) => Ok(fields),
        other => bail!("{key}: its JSON is {other}, not an object"),
    }
}

/// bitsandbytes' dtype names (`str(dtype)` without `torch.`).
fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

fn dtype_from_name(name: &str) -> Option<Kind> {
    [Kind::Float, Kind::Half, Kind::BFloat16].into_iter().find(|k| dtype_name(*k) == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// `q` on `device`, its packed bytes `offset` bytes into a bigger buffer.
    fn moved(q: &Quantized4bit, device: Device, offset: i64) -> Quantized4bit {
        let len = q.packed.numel() as i64;
        let mut packed = Tensor::zeros([len + offset], (Kind::Uint8, device)).narrow(0, offset, len);
        packed.copy_(&q.packed.reshape([-1]));
        let absmax = match &q.state.absmax {
            Absmax::Plain(absmax) => Absmax::Plain(absmax.to_device(device)),
            Absmax::Nested { indices, absmax, code, blocksize, offset, first } => Absmax::Nested {
                indices: indices.to_device(device),
                absmax: absmax.to_device(device),
                code: code.to_device(device),
                blocksize: *blocksize,
                offset: *offset,
                first: *first,
            },
        };
        let QuantState { quant_type, blocksize, ref shape, dtype, .. } = q.state;
        Quantized4bit { packed, state: QuantState { quant_type, blocksize, shape: shape.clone(), dtype, absmax } }
    }

    fn assert_same_bits(actual: &Tensor, expected: &Tensor, what: &str) {
        assert_eq!((actual.kind(), actual.size()), (expected.kind(), expected.size()), "{what}");
        let bytes = |t: &Tensor| t.to_device(Device::Cpu).contiguous().view_dtype(Kind::Uint8);
        let differ = bytes(actual).ne_tensor(&bytes(expected)).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(differ, 0, "{what}: {differ} bytes differ between ft's kernel and ATen's ops");
    }

    #[test]
    #[ignore = "needs a CUDA GPU (bench/gpu/nf4_kernel.sh runs it)"]
    fn kernel_dequantizes_as_atens_ops_bit_for_bit_on_a_gpu() {
        // Before any libtorch call: its CUDA ops register as CUDA opens.
        ft_sys::cuda::init().expect("CUDA opens on a host with a GPU");
        assert!(tch::Cuda::is_available(), "libtorch was asked about CUDA before it opened (another test ran first): run GPU tests with --test-threads 1");
        let gpu = Device::Cuda(0);
        ft_sys::kernels::available(gpu).expect("ft's kernels load");
        tch::manual_seed(5);
        // 20930 values (327 blocks of 64 and 2 values), 65 (odd), and over
        // 2^20 (two of ATen's chunks); magnitudes over six orders, a block
        // of zeros, and zeros and tiny values of both signs.
        let cases = [(161, 130, 64), (5, 13, 64), (1024, 1100, 64), (161, 130, 32), (161, 130, 128), (1024, 1100, 4096)];
        for (rows, cols, blocksize) in cases {
            let magnitudes = Tensor::logspace(-3.0, 3.0, rows, 10.0, (Kind::Float, Device::Cpu)).unsqueeze(1);
            let x = (Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * magnitudes).reshape([-1]);
            let _ = x.narrow(0, 64, 64.min(x.numel() as i64 - 64)).zero_();
            for (i, v) in [(3, 0.0), (5, 1e-9), (7, -1e-9), (9, -0.0)] {
                let _ = x.narrow(0, i, 1).fill_(v);
            }
            let n = x.numel() as i64;
            for dtype in [Kind::Float, Kind::BFloat16, Kind::Half] {
                for quant_type in [QuantType::Nf4, QuantType::Fp4] {
                    for double_quant in [false, true] {
                        // Quantized on the CPU, as bitsandbytes quantizes (tests/qlora.rs).
                        let q = quantize(&x.to_kind(dtype), quant_type, blocksize, double_quant).unwrap();
                        for out_kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
                            let what = format!("{n} values in blocks of {blocksize}, {quant_type:?}, double {double_quant}, {dtype:?} into {out_kind:?}");
                            let expected = Tensor::empty([n], (out_kind, Device::Cpu));
                            q.dequantize_with(&expected, false);
                            // Packed bytes aligned or not; out aligned, or 3 values into a buffer (guards before and after stay).
                            for (packed_offset, out_offset) in [(0, 0), (1, 3)] {
                                let on_gpu = moved(&q, gpu, packed_offset);
                                let [by_kernel, by_aten] = [(); 2].map(|_| Tensor::full([n + 2 * out_offset], 7.0, (out_kind, gpu)));
                                on_gpu.dequantize_by_kernel(&by_kernel.narrow(0, out_offset, n)).unwrap();
                                on_gpu.dequantize_with(&by_aten.narrow(0, out_offset, n), false);
                                let what = format!("{what}, packed at {packed_offset}, out at {out_offset}");
                                assert_same_bits(&by_kernel, &by_aten, &format!("{what}: against ATen on the GPU"));
                                assert_same_bits(&by_kernel.narrow(0, out_offset, n), &expected, &format!("{what}: against ATen on the CPU"));
                            }
                        }
                    }
                }
            }
        }

        // An expert-parallel rank's part of a fused expert tensor ([8, 96, 32]:
        // 384 blocks, the parts of 4 ranks 96 each, some entering a nested
        // block mid-way): the kernel gives the whole tensor's experts.
        let scales = Tensor::logspace(-2.0, 1.0, 8, 10.0, (Kind::Float, Device::Cpu)).view([-1, 1, 1]);
        let experts = Tensor::randn([8, 96, 32], (Kind::Float, Device::Cpu)) * scales;
        for quant_type in [QuantType::Nf4, QuantType::Fp4] {
            let q = quantize(&experts, quant_type, DEFAULT_BLOCKSIZE, true).unwrap();
            let whole = q.dequantize();
            for rank in 0..4 {
                let part = moved(&q.rows(2 * rank..2 * rank + 2).unwrap(), gpu, 0);
                let by_kernel = Tensor::empty([2 * 96 * 32], (Kind::Float, gpu));
                part.dequantize_by_kernel(&by_kernel).unwrap();
                assert_same_bits(&by_kernel, &whole.narrow(0, 2 * rank, 2).reshape([-1]), &format!("{quant_type:?}: rank {rank} of 4's experts"));
            }
        }

        // Bandwidth on Llama-7B's MLP weight and the 70B's largest: bytes
        // read (packed, absmaxes) and written, per second of each path.
        for (rows, cols) in [(4096, 11008), (8192, 28672)] {
            let x = Tensor::randn([rows, cols], (Kind::BFloat16, gpu)) * 0.02;
            for double_quant in [false, true] {
                let q = quantize(&x, QuantType::Nf4, DEFAULT_BLOCKSIZE, double_quant).unwrap();
                let n = rows * cols;
                let [by_kernel, by_aten] = [(); 2].map(|_| Tensor::empty([n], (Kind::BFloat16, gpu)));
                let absmax_bytes = match &q.state.absmax {
                    Absmax::Plain(absmax) => 4 * absmax.numel(),
                    Absmax::Nested { indices, absmax, .. } => indices.numel() + 4 * absmax.numel(),
                };
                let bytes = (q.packed.numel() + absmax_bytes + 2 * n as usize) as f64;
                let timed = |fused: bool, out: &Tensor| {
                    q.dequantize_with(out, fused);
                    tch::Cuda::synchronize(0);
                    let (repeats, start) = (20, Instant::now());
                    for _ in 0..repeats {
                        q.dequantize_with(out, fused);
                    }
                    tch::Cuda::synchronize(0);
                    start.elapsed().as_secs_f64() / repeats as f64
                };
                let (kernel_s, aten_s) = (timed(true, &by_kernel), timed(false, &by_aten));
                assert_same_bits(&by_kernel, &by_aten, &format!("{rows}×{cols} bf16, double {double_quant}"));
                // What this GPU moves in a plain copy of the bf16 values, for scale.
                let copy_s = {
                    let (mut copy, repeats) = (by_aten.empty_like(), 20);
                    tch::Cuda::synchronize(0);
                    let start = Instant::now();
                    for _ in 0..repeats {
                        copy.copy_(&by_aten);
                    }
                    tch::Cuda::synchronize(0);
                    start.elapsed().as_secs_f64() / repeats as f64
                };
                println!(
                    "NF4 {rows}×{cols} bf16, double quantization {double_quant}: ft's kernel {:.1} µs ({:.0} GB/s), ATen's ops {:.1} µs ({:.0} GB/s); a bf16 copy {:.0} GB/s",
                    kernel_s * 1e6,
                    bytes / kernel_s / 1e9,
                    aten_s * 1e6,
                    bytes / aten_s / 1e9,
                    4.0 * n as f64 / copy_s / 1e9
                );
            }
        }
    }
}
