//! Float8 linear layers as torchao 0.18's `Float8Linear` computes them
//! (`torchao/float8/`: `float8_linear.py`, `float8_utils.py`,
//! `float8_training_tensor.py`, `float8_ops.py`): in each of a linear
//! layer's three GEMMs — forward x·Wᵀ, backward's input gradient dy·W and
//! weight gradient dyᵀ·x — both operands are cast to float8, each scaled
//! from its own amax at the moment it is cast, and multiplied by ATen's
//! `_scaled_mm` (cuBLASLt); or, emulated, cast to float8 and back and
//! multiplied in fp32 (torchao's `Float8LinearConfig(emulate=True)`), which
//! runs anywhere and gives torchao's emulation's bits.

use crate::{Result, ShimError};
use tch::{Kind, Tensor};

/// How a recipe casts a linear layer's operands: torchao's
/// `Float8LinearRecipeName` of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// One scale per tensor; inputs and weights in e4m3, output gradients
    /// in e5m2 (torchao's default `Float8LinearConfig`).
    Tensorwise,
    /// One scale per row of each operand along the GEMM's reduction
    /// dimension, every operand in e4m3, scales rounded down to powers of 2.
    Rowwise,
}

/// A run's float8 linear layers: the recipe, and whether the GEMMs are
/// emulated in fp32 (anywhere) instead of run in float8 (a GPU of compute
/// capability 8.9 or newer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Float8 {
    pub recipe: Recipe,
    pub emulate: bool,
}

/// The least amax a scale divides by (torchao's `EPS`).
pub const EPS: f64 = 1e-12;

/// The largest finite value of a float8 kind (`torch.finfo(kind).max`).
pub fn max_value(kind: Kind) -> f64 {
    match kind {
        Kind::Float8e4m3fn => 448.0,
        Kind::Float8e5m2 => 57344.0,
        other => panic!("{other:?} is not a float8 kind ft casts to"),
    }
}

/// torchao's `tensor_to_scale`: max / amax, computed in fp64 (amax at least
/// `EPS`; as Python's `max / tensor`, the reciprocal times max) and stored
/// as fp32 — over the whole tensor (`dim` None: a scalar) or along `dim`
/// (kept, of size 1: one scale per row of the other dimension); with
/// `power_of_2`, rounded down to a power of two.
pub fn scale(x: &Tensor, kind: Kind, dim: Option<i64>, power_of_2: bool) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    let amax = match dim {
        None => x.abs().max(),
        Some(dim) => x.abs().amax([dim], true),
    };
    let scale = (amax.to_kind(Kind::Double).clamp_min(EPS).reciprocal() * max_value(kind)).to_kind(Kind::Float);
    if power_of_2 {
        scale.log2().floor().exp2()
    } else {
        scale
    }
}

/// torchao's cast (`_ToFloat8ConstrFunc`, `to_fp8_saturated`): x in fp32
/// times `scale`, clamped to ±max, rounded to `kind`.
pub fn cast(x: &Tensor, scale: &Tensor, kind: Kind) -> Tensor {
    let max = max_value(kind);
    (x.to_kind(Kind::Float) * scale).clamp(-max, max).to_kind(kind)
}

/// One GEMM operand in float8: its data and the scale it was cast with
/// (x ≈ data / scale).
struct Operand {
    data: Tensor,
    scale: Tensor,
}

impl Operand {
    fn transposed(&self) -> Operand {
        let scale = if self.scale.dim() > 1 { self.scale.tr() } else { self.scale.shallow_clone() };
        Operand { data: self.data.tr(), scale }
    }
}

/// What an operand is to the layer, which picks its float8 kind.
#[derive(Clone, Copy)]
enum Role {
    Input,
    Weight,
    GradOutput,
}

impl Float8 {
    fn kind(self, role: Role) -> Kind {
        match (self.recipe, role) {
            (Recipe::Tensorwise, Role::GradOutput) => Kind::Float8e5m2,
            _ => Kind::Float8e4m3fn,
        }
    }

    /// `x` (2-D) cast for `role`: tensorwise, or rowwise with one scale per
    /// slice along `dim`.
    fn cast(self, x: &Tensor, role: Role, dim: i64) -> Operand {
        let kind = self.kind(role);
        let scale = match self.recipe {
            Recipe::Tensorwise => scale(x, kind, None, false),
            Recipe::Rowwise => scale(x, kind, Some(dim), true),
        };
        Operand { data: cast(x, &scale, kind), scale }
    }

    /// a·b in `out_kind` (torchao's `float8_mm`): emulated, or `_scaled_mm`
    /// with fast accumulation where the recipe uses it (the forward GEMM).
    fn gemm(self, a: &Operand, b: &Operand, out_kind: Kind, fast_accum: bool) -> Result<Tensor> {
        if self.emulate {
            let (a, b) = (a.data.to_kind(Kind::Float) / &a.scale, b.data.to_kind(Kind::Float) / &b.scale);
            return Ok(a.mm(&b).to_kind(out_kind));
        }
        scaled_mm(a, b, out_kind, fast_accum)
    }

    /// Forward: x·Wᵀ, x [.., in] and W [out, in]. Rowwise: a scale per token
    /// and one per output feature.
    pub(crate) fn forward(self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let features = x.size()[x.dim() - 1];
        let input = self.cast(&x.reshape([-1, features]), Role::Input, -1);
        let weight_t = self.cast(weight, Role::Weight, -1).transposed();
        let out = self.gemm(&input, &weight_t, x.kind(), true)?;
        let mut shape = x.size();
        *shape.last_mut().expect("x has a feature dimension") = weight.size()[0];
        Ok(out.reshape(shape))
    }

    /// Backward from the output's gradient `grad`: the input's gradient
    /// dy·W (rowwise: a scale per token of dy, per input feature of W) and
    /// the weight's dyᵀ·x (per output feature of dy, per input feature of
    /// x), each only when asked for.
    pub(crate) fn backward(self, x: &Tensor, weight: &Tensor, grad: &Tensor, wanted: [bool; 2]) -> Result<[Option<Tensor>; 2]> {
        let (features, outputs) = (x.size()[x.dim() - 1], weight.size()[0]);
        let grad = grad.reshape([-1, outputs]);
        let grad_input = match wanted[0] {
            false => None,
            true => {
                let dy = self.cast(&grad, Role::GradOutput, -1);
                let w = self.cast(weight, Role::Weight, 0);
                Some(self.gemm(&dy, &w, grad.kind(), false)?.reshape(x.size()))
            }
        };
        let grad_weight = match wanted[1] {
            false => None,
            true => {
                let dy_t = self.cast(&grad, Role::GradOutput, 0).transposed();
                let rows = self.cast(&x.reshape([-1, features]), Role::Input, 0);
                Some(self.gemm(&dy_t, &rows, grad.kind(), false)?)
            }
        };
        Ok([grad_input, grad_weight])
    }

    /// The code the shim's node carries (`Float8::from_code` reads it back).
    pub(crate) fn code(self) -> i32 {
        (self.recipe == Recipe::Rowwise) as i32 | (self.emulate as i32) << 1
    }

    pub(crate) fn from_code(code: i32) -> Float8 {
        Float8 { recipe: if code & 1 == 1 { Recipe::Rowwise } else { Recipe::Tensorwise }, emulate: code & 2 == 2 }
    }
}

/// torchao's `addmm_float8_unwrapped` over `preprocess_addmm`'s layouts: a
/// row-major, b column-major, the scales inverted. Rowwise without fast
/// accumulation runs the tensorwise kernel and scales after (CUTLASS's
/// rowwise kernel is slow without it); rowwise output is bf16, cast after.
/// An inner dimension that is not a multiple of 16 (cuBLASLt's float8
/// needs it; the token count of the weight gradient's GEMM) is padded with
/// zeros, which add nothing.
fn scaled_mm(a: &Operand, b: &Operand, out_kind: Kind, fast_accum: bool) -> Result<Tensor> {
    let (rows, inner, cols) = (a.data.size()[0], a.data.size()[1], b.data.size()[1]);
    if cols % 16 != 0 {
        return Err(ShimError(format!("float8 GEMMs need output widths that are multiples of 16, not {cols}")));
    }
    let padding = (16 - inner % 16) % 16;
    let (mut a_data, mut b_data) = (a.data.shallow_clone(), b.data.shallow_clone());
    if padding > 0 {
        a_data = a_data.constant_pad_nd([0, padding]);
        b_data = b_data.constant_pad_nd([0, 0, 0, padding]);
    }
    let a_data = a_data.contiguous();
    let b_data = b_data.tr().contiguous().tr();
    let (mut a_inverse, mut b_inverse) = (a.scale.reciprocal(), b.scale.reciprocal());
    let rowwise = a.scale.size() == [rows, 1] && b.scale.size() == [1, cols];
    let mut post_scale = None;
    if rowwise && !fast_accum {
        post_scale = Some(&a_inverse * &b_inverse);
        a_inverse = a_inverse.new_ones([], (Kind::Float, a_inverse.device()));
        b_inverse = a_inverse.shallow_clone();
    }
    let product_kind = if rowwise && matches!(out_kind, Kind::Half | Kind::Float) { Kind::BFloat16 } else { out_kind };
    let mut out = a_data.f_internal_scaled_mm::<Tensor>(&b_data, &a_inverse, &b_inverse, None, None, product_kind, fast_accum).map_err(|e| ShimError(format!("_scaled_mm: {e}")))?;
    if let Some(post_scale) = post_scale {
        out *= post_scale;
    }
    Ok(out.to_kind(out_kind))
}

/// x·Wᵀ as one autograd node (the shim's `Float8Linear`) whose forward and
/// backward GEMMs run in float8 as `float8` says; x and W stay in their own
/// precision, saved for backward. No bias: torchao adds it after, in the
/// output's precision.
pub fn linear(x: &Tensor, weight: &Tensor, float8: Float8) -> Result<Tensor> {
    crate::float8_linear(x, weight, float8.code())
}
