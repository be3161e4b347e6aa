//! QLoRA's frozen base (`model.quantize`): a frozen block's weight
//! matrices and fused experts held as 4-bit blocks (`nf4.rs`, bitsandbytes'
//! NF4 and FP4; a 3-D expert tensor blocked flat, as `quantize_4bit` blocks
//! any tensor) and the rest (norms, biases, a router) in the compute dtype,
//! all in one byte buffer — what a strategy shards and gathers, as bytes that are never cast, and
//! what is dequantized into the unit's compute buffer before each use
//! (docs/ARCHITECTURE.md, "LoRA").

use crate::distributed::comm::ProcessGroup;
use crate::distributed::comm_hook::Pending;
use crate::model::{ParamSpec, UnitSpec};
use crate::nf4::{self, blocks, Absmax, QuantState, Quantization, Quantized4bit};
use anyhow::{Context, Result};
use std::ops::Range;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// Every piece starts at a multiple of this many bytes, so each reads as
/// its own dtype in place (a float view of the bytes needs its alignment).
const ALIGN: i64 = 16;

fn aligned(bytes: i64) -> i64 {
    (bytes + ALIGN - 1) / ALIGN * ALIGN
}

/// Where one parameter's values go in the compute buffer and come from in the bytes.
struct Piece {
    /// Its first element in the unit's flat compute buffer, its elements and shape.
    flat_offset: i64,
    numel: i64,
    shape: Vec<i64>,
    /// The rows of the whole parameter it holds (an expert-parallel rank's
    /// experts); None: all of them.
    rows: Option<Range<i64>>,
    storage: Storage,
}

enum Storage {
    /// In the compute dtype, from this byte.
    Kept { at: i64 },
    /// 4-bit: the packed indices from `packed`, the fp32 absmaxes (or,
    /// double quantized, their 8-bit indices) from `absmax`.
    Quantized { packed: i64, absmax: i64, nested: Option<Nested> },
}

/// Double quantization's statistics of one weight: their fp32 absmaxes
/// (one per 256 absmaxes) from byte `absmax`, and the mean subtracted,
/// kept on the host (every rank packs the same weights, so it is the same
/// everywhere, and reading it from the device would wait on the device);
/// `first`: where a part's first absmax sits in its first nested block
/// (`Absmax::Nested`).
struct Nested {
    absmax: i64,
    offset: f32,
    first: i64,
}

/// A unit's pieces in its byte buffer: laid out from the unit's parameter
/// shapes alone, so every rank (and `ft plan`) knows the size before any
/// weight is read.
pub struct PackedLayout {
    pieces: Vec<Piece>,
    bytes: i64,
    /// The dtype of kept pieces and of the dequantized values.
    dtype: Kind,
    quantization: Quantization,
    /// Double quantization's 8-bit code, on the training device (made by `pack`).
    nested_code: Option<Tensor>,
}

impl PackedLayout {
    /// The layout of `spec`'s parameters, each at `offsets` (by parameter
    /// index: `flat::param_offsets`) in the flat compute buffer: those
    /// `held_in_4bit` picks (`Model::held_in_4bit`: the linear layers'
    /// matrices, a mixture of experts' fused experts) quantized, the rest
    /// kept in `dtype`. The pieces' values are written by [`PackedLayout::pack`].
    pub fn new(spec: &UnitSpec, offsets: &[(usize, i64)], dtype: Kind, quantization: Quantization, held_in_4bit: impl Fn(&ParamSpec) -> bool) -> PackedLayout {
        Self::of_rows(spec, offsets, dtype, quantization, held_in_4bit, |_| None)
    }

    /// The layout of an expert-parallel rank's part of an experts unit
    /// `spec` (as the model declares it): rank `rank` of `degree` holds
    /// rows `rank·E/degree..` of each parameter — of a quantized one, that
    /// part of the whole tensor's quantization (`Quantized4bit::rows`),
    /// so that it holds what bitsandbytes makes of those experts, with
    /// the whole tensor's offset and nested blocks. Each part must hold
    /// whole 4-bit blocks (`nf4::rows_hold_whole_blocks`, which
    /// `setup::check_expert_parallel` checks). [`PackedLayout::pack`] takes
    /// the whole parameters, and the compute buffer is the part's
    /// (`flat::param_offsets` of `spec` with its rows cut so).
    pub fn expert_part(spec: &UnitSpec, dtype: Kind, quantization: Quantization, held_in_4bit: impl Fn(&ParamSpec) -> bool, (degree, rank): (usize, usize)) -> PackedLayout {
        let rows = |param: &ParamSpec| {
            let per_rank = param.shape[0] / degree as i64;
            Some(per_rank * rank as i64..per_rank * (rank + 1) as i64)
        };
        let mut local = spec.clone();
        for param in &mut local.params {
            param.shape[0] /= degree as i64;
        }
        Self::of_rows(spec, &crate::distributed::flat::param_offsets(&local), dtype, quantization, held_in_4bit, rows)
    }

    /// The layout of the rows `rows` says of each of `spec`'s parameters.
    fn of_rows(
        spec: &UnitSpec,
        offsets: &[(usize, i64)],
        dtype: Kind,
        quantization: Quantization,
        held_in_4bit: impl Fn(&ParamSpec) -> bool,
        rows: impl Fn(&ParamSpec) -> Option<Range<i64>>,
    ) -> PackedLayout {
        let mut bytes = 0;
        let mut take = |len: i64| {
            let at = bytes;
            bytes += aligned(len);
            at
        };
        let pieces = offsets
            .iter()
            .map(|&(param, flat_offset)| {
                let whole = &spec.params[param];
                let rows = rows(whole);
                let mut shape = whole.shape.clone();
                if let Some(rows) = &rows {
                    shape[0] = rows.end - rows.start;
                }
                let numel: i64 = shape.iter().product();
                let storage = if held_in_4bit(whole) {
                    let count = blocks(numel, quantization.blocksize);
                    let packed = take((numel + 1) / 2);
                    if quantization.double_quant {
                        // Where the part's first block falls among the whole tensor's nested blocks.
                        let first_value = rows.as_ref().map_or(0, |rows| rows.start * (whole.numel() / whole.shape[0]));
                        let first = first_value / quantization.blocksize % nf4::NESTED_BLOCKSIZE;
                        let absmax = take(count);
                        let nested = take(4 * blocks(first + count, nf4::NESTED_BLOCKSIZE));
                        Storage::Quantized { packed, absmax, nested: Some(Nested { absmax: nested, offset: 0.0, first }) }
                    } else {
                        Storage::Quantized { packed, absmax: take(4 * count), nested: None }
                    }
                } else {
                    Storage::Kept { at: take(numel * dtype.elt_size_in_bytes() as i64) }
                };
                Piece { flat_offset, numel, shape, rows, storage }
            })
            .collect();
        PackedLayout { pieces, bytes, dtype, quantization, nested_code: None }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> i64 {
        self.bytes
    }

    /// The unit's parameters (`tensors`, by parameter index, whole even
    /// where the layout holds some of their rows) in a buffer of
    /// `padded` ≥ [`PackedLayout::bytes`] bytes; the double-quantized
    /// weights' offsets are recorded in the layout.
    pub fn pack(&mut self, spec: &UnitSpec, offsets: &[(usize, i64)], tensors: &[Tensor], padded: i64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let device = tensors[0].device();
        self.nested_code = self.quantization.double_quant.then(|| nf4::dynamic_code(device));
        let buffer = Tensor::zeros([padded], (Kind::Uint8, device));
        let write = |at: i64, values: &Tensor| {
            let bytes = values.contiguous().reshape([-1]).view_dtype(Kind::Uint8);
            buffer.narrow(0, at, bytes.numel() as i64).copy_(&bytes);
        };
        for (piece, &(param, _)) in self.pieces.iter_mut().zip(offsets) {
            let tensor = &tensors[param];
            match &mut piece.storage {
                Storage::Kept { at } => {
                    let held = piece.rows.as_ref().map_or_else(|| tensor.shallow_clone(), |rows| tensor.narrow(0, rows.start, rows.end - rows.start));
                    write(*at, &held.to_kind(self.dtype))
                }
                Storage::Quantized { packed, absmax, nested } => {
                    let Quantization { quant_type, blocksize, double_quant } = self.quantization;
                    let context = || format!("quantizing {} of unit {}", spec.params[param].hf_name, spec.name);
                    // The whole tensor, quantized as bitsandbytes quantizes it, then the part held.
                    let whole = nf4::quantize(tensor, quant_type, blocksize, double_quant).with_context(context)?;
                    let quantized = match &piece.rows {
                        Some(rows) => whole.rows(rows.clone()).with_context(context)?,
                        None => whole,
                    };
                    write(*packed, &quantized.packed);
                    match (quantized.state.absmax, nested) {
                        (Absmax::Plain(values), None) => write(*absmax, &values),
                        // `first` is the layout's: `Quantized4bit::rows` cuts the part where the layout placed it.
                        (Absmax::Nested { indices, absmax: nested_absmax, offset, .. }, Some(nested)) => {
                            write(*absmax, &indices);
                            write(nested.absmax, &nested_absmax);
                            nested.offset = offset;
                        }
                        _ => unreachable!("nf4::quantize nests the absmaxes exactly when asked"),
                    }
                }
            }
        }
        Ok(buffer)
    }

    /// Writes the values `bytes` (the whole buffer) holds into `out`, the
    /// unit's flat compute buffer: each weight dequantized as
    /// bitsandbytes dequantizes it, each vector copied.
    pub fn unpack_into(&self, bytes: &Tensor, out: &Tensor) {
        let _no_grad = tch::no_grad_guard();
        let read = |at: i64, len: i64, kind: Kind| bytes.narrow(0, at, len * kind.elt_size_in_bytes() as i64).view_dtype(kind);
        for piece in &self.pieces {
            let target = out.narrow(0, piece.flat_offset, piece.numel);
            match &piece.storage {
                Storage::Kept { at } => {
                    target.shallow_clone().copy_(&read(*at, piece.numel, self.dtype));
                }
                Storage::Quantized { packed, absmax, nested } => {
                    let count = blocks(piece.numel, self.quantization.blocksize);
                    let absmax = match nested {
                        None => Absmax::Plain(read(*absmax, count, Kind::Float)),
                        Some(nested) => Absmax::Nested {
                            indices: read(*absmax, count, Kind::Uint8),
                            absmax: read(nested.absmax, blocks(nested.first + count, nf4::NESTED_BLOCKSIZE), Kind::Float),
                            code: self.nested_code.as_ref().expect("made with double quantization").shallow_clone(),
                            blocksize: nf4::NESTED_BLOCKSIZE,
                            offset: nested.offset,
                            first: nested.first,
                        },
                    };
                    let state = QuantState {
                        quant_type: self.quantization.quant_type,
                        blocksize: self.quantization.blocksize,
                        shape: piece.shape.clone(),
                        dtype: self.dtype,
                        absmax,
                    };
                    Quantized4bit { packed: read(*packed, (piece.numel + 1) / 2, Kind::Uint8), state }.dequantize_into(&target);
                }
            }
        }
    }
}

/// A packed unit's bytes as a rank holds them: the whole buffer, or (its
/// parameters sharded) this rank's slice of it.
pub struct PackedBase {
    layout: Arc<PackedLayout>,
    bytes: Tensor,
    /// The whole buffer's bytes (padded to a multiple of the shard group).
    padded: i64,
}

impl PackedBase {
    pub fn new(layout: PackedLayout, bytes: Tensor, padded: i64) -> PackedBase {
        PackedBase { layout: Arc::new(layout), bytes, padded }
    }

    /// Bytes this rank holds.
    pub fn held_bytes(&self) -> i64 {
        self.bytes.numel() as i64
    }

    /// Starts filling `output` (the unit's compute buffer) with the values:
    /// from this rank's bytes, or once `group` has gathered everyone's
    /// slice — as bytes, not through the run's communication hook, whose
    /// transforms (casts, compression) are for values, not packed indices.
    pub fn start_unpack(&self, group: Option<&ProcessGroup>, output: Tensor) -> Result<Pending> {
        let layout = Arc::clone(&self.layout);
        match group {
            None => {
                let bytes = self.bytes.shallow_clone();
                Ok(Pending::done().then(move || Ok(layout.unpack_into(&bytes, &output))))
            }
            Some(group) => {
                let mut whole = Tensor::empty([self.padded], (Kind::Uint8, self.bytes.device()));
                let work = group.all_gather_into_tensor(&mut whole, &self.bytes)?;
                Ok(Pending::of(work).then(move || Ok(layout.unpack_into(&whole, &output))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Init;
    use crate::nf4::QuantType;
    use tch::Device;

    /// An expert-parallel rank's part of a fused expert tensor ([8, 96,
    /// 32]: 48 blocks of 64 an expert, 384 in all, so the parts of 8, 4
    /// and 2 ranks start inside a nested block of 256, some ending in the
    /// next) holds exactly the whole tensor's quantization over its experts — its
    /// packed bytes, absmaxes (double quantized: their 8-bit indices, the
    /// nested absmaxes of the nested blocks they fall in, the whole
    /// tensor's offset) — and unpacks to the whole tensor's dequantized
    /// experts bit for bit; a part that would cut a block is refused.
    #[test]
    fn an_expert_parallel_rank_holds_its_part_of_the_whole_tensors_blocks() {
        tch::manual_seed(0);
        let shape = [8i64, 96, 32];
        let spec = UnitSpec { name: "experts".into(), params: vec![ParamSpec::new("model.layers.0.", "mlp.experts.down_proj", &shape, Init::Zeros)] };
        // Each expert at its own scale, so the absmaxes (and their mean) differ from part to part.
        let scales = Tensor::logspace(-2.0, 1.0, shape[0], 10.0, (Kind::Float, Device::Cpu)).view([-1, 1, 1]);
        let whole = Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scales;
        let part_numel = |degree: i64| shape.iter().product::<i64>() / degree;
        for (quant_type, double_quant) in [(QuantType::Nf4, true), (QuantType::Nf4, false), (QuantType::Fp4, true)] {
            let quantization = Quantization { quant_type, blocksize: 64, double_quant };
            let q = nf4::quantize(&whole, quant_type, 64, double_quant).unwrap();
            let dequantized = q.dequantize();
            for degree in [1usize, 2, 4, 8] {
                for rank in 0..degree {
                    let case = format!("{quant_type:?}, double {double_quant}, rank {rank} of {degree}");
                    let mut layout = PackedLayout::expert_part(&spec, Kind::Float, quantization, |_| true, (degree, rank));
                    let mut local = spec.clone();
                    local.params[0].shape[0] /= degree as i64;
                    let offsets = crate::distributed::flat::param_offsets(&local);
                    let bytes = layout.pack(&spec, &offsets, &[whole.shallow_clone()], layout.bytes()).unwrap();
                    let (len, per_rank) = (part_numel(degree as i64), shape[0] / degree as i64);
                    let start = len * rank as i64;
                    let out = Tensor::zeros([len], (Kind::Float, Device::Cpu));
                    layout.unpack_into(&bytes, &out);
                    let expected = dequantized.narrow(0, per_rank * rank as i64, per_rank).reshape([-1]);
                    assert!(out.view_dtype(Kind::Int).equal(&expected.view_dtype(Kind::Int)), "{case}: dequantized");

                    let Storage::Quantized { packed, absmax, nested } = &layout.pieces[0].storage else { panic!("{case}: held in 4 bits") };
                    let read = |at: i64, count: i64, kind: Kind| bytes.narrow(0, at, count * kind.elt_size_in_bytes() as i64).view_dtype(kind);
                    assert!(read(*packed, len / 2, Kind::Uint8).equal(&q.packed.reshape([-1]).narrow(0, start / 2, len / 2)), "{case}: packed bytes");
                    let (first_block, count) = (start / 64, len / 64);
                    match (&q.state.absmax, nested) {
                        (Absmax::Plain(whole_absmax), None) => assert!(read(*absmax, count, Kind::Float).equal(&whole_absmax.narrow(0, first_block, count)), "{case}: absmax"),
                        (Absmax::Nested { indices, absmax: nested_absmax, offset, .. }, Some(held)) => {
                            assert!(read(*absmax, count, Kind::Uint8).equal(&indices.narrow(0, first_block, count)), "{case}: absmax indices");
                            let (first_nested, last_nested) = (first_block / 256, (first_block + count - 1) / 256);
                            let held_nested = read(held.absmax, last_nested - first_nested + 1, Kind::Float);
                            assert!(held_nested.equal(&nested_absmax.narrow(0, first_nested, last_nested - first_nested + 1)), "{case}: nested absmax");
                            assert_eq!((held.offset, held.first), (*offset, first_block % 256), "{case}: the whole tensor's offset");
                        }
                        _ => panic!("{case}: double quantized as asked"),
                    }
                }
            }
        }
        // [4, 3, 8]: two ranks' 48 values each would cut a block of 32 in two.
        assert!(!nf4::rows_hold_whole_blocks(&[4, 3, 8], 2, 32) && nf4::rows_hold_whole_blocks(&[4, 4, 8], 2, 32));
        let q = nf4::quantize(&Tensor::randn([4, 3, 8], (Kind::Float, Device::Cpu)), QuantType::Nf4, 32, true).unwrap();
        assert_eq!(q.rows(2..4).err().unwrap().to_string(), "rows 2..4 of a 4-bit tensor of shape [4, 3, 8] do not hold whole blocks of 32 values");
    }
}
