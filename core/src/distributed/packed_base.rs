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
/// everywhere, and reading it from the device would wait on the device).
struct Nested {
    absmax: i64,
    offset: f32,
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
        let mut bytes = 0;
        let mut take = |len: i64| {
            let at = bytes;
            bytes += aligned(len);
            at
        };
        let pieces = offsets
            .iter()
            .map(|&(param, flat_offset)| {
                let shape = spec.params[param].shape.clone();
                let numel: i64 = shape.iter().product();
                let storage = if held_in_4bit(&spec.params[param]) {
                    let count = blocks(numel, quantization.blocksize);
                    let packed = take((numel + 1) / 2);
                    if quantization.double_quant {
                        let absmax = take(count);
                        let nested = take(4 * blocks(count, nf4::NESTED_BLOCKSIZE));
                        Storage::Quantized { packed, absmax, nested: Some(Nested { absmax: nested, offset: 0.0 }) }
                    } else {
                        Storage::Quantized { packed, absmax: take(4 * count), nested: None }
                    }
                } else {
                    Storage::Kept { at: take(numel * dtype.elt_size_in_bytes() as i64) }
                };
                Piece { flat_offset, numel, shape, storage }
            })
            .collect();
        PackedLayout { pieces, bytes, dtype, quantization, nested_code: None }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> i64 {
        self.bytes
    }

    /// The unit's parameters (`tensors`, by parameter index) in a buffer of
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
                Storage::Kept { at } => write(*at, &tensor.to_kind(self.dtype)),
                Storage::Quantized { packed, absmax, nested } => {
                    let Quantization { quant_type, blocksize, double_quant } = self.quantization;
                    let quantized = nf4::quantize(tensor, quant_type, blocksize, double_quant)
                        .with_context(|| format!("quantizing {} of unit {}", spec.params[param].hf_name, spec.name))?;
                    write(*packed, &quantized.packed);
                    match (quantized.state.absmax, nested) {
                        (Absmax::Plain(values), None) => write(*absmax, &values),
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
                            absmax: read(nested.absmax, blocks(count, nf4::NESTED_BLOCKSIZE), Kind::Float),
                            code: self.nested_code.as_ref().expect("made with double quantization").shallow_clone(),
                            blocksize: nf4::NESTED_BLOCKSIZE,
                            offset: nested.offset,
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
