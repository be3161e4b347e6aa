//! Float8 linear layers as torchao 0.18's `Float8Linear` computes them
//! (`torchao/float8/`: `float8_linear.py`, `float8_utils.py`,
//! `float8_training_tensor.py`, `float8_ops.py`): in each of a linear
//! layer's three GEMMs — forward x·Wᵀ, backward's input gradient dy·W and
//! weight gradient dyᵀ·x — both operands are cast to float8, each scaled
//! from its own amax at the moment it is cast, and multiplied by ATen's
//! `_scaled_mm` (cuBLASLt); or, emulated, cast to float8 and back and
//! multiplied in fp32 (torchao's `Float8LinearConfig(emulate=True)`), which
//! runs anywhere and gives torchao's emulation's bits.

use crate::{kernels, Result, ShimError};
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
    scale_from(&amax(x, dim), kind, power_of_2)
}

/// max |x| over the whole tensor or along `dim` (kept).
fn amax(x: &Tensor, dim: Option<i64>) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    match dim {
        None => x.abs().max(),
        Some(dim) => x.abs().amax([dim], true),
    }
}

/// `scale`'s value from an amax.
pub fn scale_from(amax: &Tensor, kind: Kind, power_of_2: bool) -> Tensor {
    let _no_grad = tch::no_grad_guard();
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

/// One GEMM operand in float8: its data, the scale it was cast with
/// (x ≈ data / scale) and the scale's reciprocal (what `_scaled_mm` takes).
struct Operand {
    data: Tensor,
    scale: Tensor,
    inverse: Tensor,
}

impl Operand {
    fn shallow_clone(&self) -> Operand {
        Operand { data: self.data.shallow_clone(), scale: self.scale.shallow_clone(), inverse: self.inverse.shallow_clone() }
    }

    fn transposed(&self) -> Operand {
        let flip = |t: &Tensor| if t.dim() > 1 { t.tr() } else { t.shallow_clone() };
        Operand { data: self.data.tr(), scale: flip(&self.scale), inverse: flip(&self.inverse) }
    }
}

/// What an operand is to the layer, which picks its float8 kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Input,
    Weight,
    GradOutput,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Input => "input",
            Role::Weight => "weight",
            Role::GradOutput => "grad_output",
        }
    }
}

/// One cast's amax (max |x|, one fp32 on the tensor's device; NaN or
/// infinite when x holds such a value): what the numerics guard reads.
pub struct Amax {
    /// The layer, as `layer_id` numbered it.
    pub layer: u32,
    pub role: Role,
    pub value: Tensor,
}

/// The layers' names by id, and the amaxes recorded since the last `take_amaxes`.
struct Recorder {
    names: Vec<(String, String)>,
    ids: std::collections::HashMap<(String, String), u32>,
    recording: bool,
    amaxes: Vec<Amax>,
}

fn recorder() -> std::sync::MutexGuard<'static, Recorder> {
    static RECORDER: std::sync::OnceLock<std::sync::Mutex<Recorder>> = std::sync::OnceLock::new();
    let recorder = RECORDER.get_or_init(|| std::sync::Mutex::new(Recorder { names: vec![], ids: Default::default(), recording: false, amaxes: vec![] }));
    recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The id `linear` passes for linear layer `name` of unit `unit` (the same
/// id for the same names, for the life of the process).
pub fn layer_id(unit: &str, name: &str) -> u32 {
    let mut recorder = recorder();
    let key = (unit.to_string(), name.to_string());
    if let Some(&id) = recorder.ids.get(&key) {
        return id;
    }
    let id = recorder.names.len() as u32;
    recorder.names.push(key.clone());
    recorder.ids.insert(key, id);
    id
}

/// The (unit, layer) names of `layer_id`'s `id`.
pub fn layer_name(id: u32) -> (String, String) {
    recorder().names.get(id as usize).cloned().unwrap_or_else(|| ("?".into(), format!("layer {id}")))
}

/// From now on, every float8 linear layer's forward records its input's and
/// weight's amax, and its backward its output gradient's, until
/// `take_amaxes` takes them (each step).
pub fn record_amaxes() {
    recorder().recording = true;
}

/// The amaxes recorded since the last call, in the order the casts ran.
pub fn take_amaxes() -> Vec<Amax> {
    std::mem::take(&mut recorder().amaxes)
}

fn record(layer: u32, role: Role, amax: &Tensor) {
    let mut recorder = recorder();
    if recorder.recording {
        // Rowwise casts have an amax a row: the tensor's is their largest.
        let value = if amax.numel() == 1 { amax.reshape([]) } else { amax.max() };
        recorder.amaxes.push(Amax { layer, role, value });
    }
}

/// The amaxes a tensorwise forward found for x and W, which backward's
/// casts scale from again instead of reading x and W once more.
pub(crate) type Saved = [Option<Tensor>; 2];

impl Float8 {
    /// The float8 kind a tensor of `role` is cast to.
    pub fn kind(self, role: Role) -> Kind {
        match (self.recipe, role) {
            (Recipe::Tensorwise, Role::GradOutput) => Kind::Float8e5m2,
            _ => Kind::Float8e4m3fn,
        }
    }

    /// `x` (2-D) cast for `role`: tensorwise, or rowwise with one scale per
    /// slice along `dim`.
    fn cast(self, x: &Tensor, role: Role, dim: i64) -> Operand {
        self.cast_recording(x, role, dim, None)
    }

    /// `cast`, recording its amax as `layer`'s when given.
    fn cast_recording(self, x: &Tensor, role: Role, dim: i64, layer: Option<u32>) -> Operand {
        let kind = self.kind(role);
        let gathered = if self.recipe == Recipe::Tensorwise && role == Role::Weight { gathered(x) } else { None };
        if let Some(Gathered { amax, bytes: Some(bytes) }) = &gathered {
            // A float8 gather's bytes, which a tensorwise scale casts alike in every layout.
            if let Some(layer) = layer {
                record(layer, role, amax);
            }
            return Operand { data: bytes.data.view(x.size().as_slice()), ..bytes.shallow_clone() };
        }
        let (amax, power_of_2) = match (self.recipe, gathered) {
            (Recipe::Tensorwise, Some(gathered)) => (gathered.amax, false),
            (Recipe::Tensorwise, None) => (amax(x, None), false),
            (Recipe::Rowwise, _) => (amax(x, Some(dim)), true),
        };
        if let Some(layer) = layer {
            record(layer, role, &amax);
        }
        let scale = scale_from(&amax, kind, power_of_2);
        Operand { data: cast(x, &scale, kind), inverse: scale.reciprocal(), scale }
    }

    /// a·b in `out_kind` (torchao's `float8_mm`): emulated, or `_scaled_mm`
    /// with fast accumulation where the recipe uses it (the forward GEMM);
    /// `fused`: ft's kernels serve the work around it.
    fn gemm(self, a: &Operand, b: &Operand, out_kind: Kind, fast_accum: bool, fused: bool) -> Result<Tensor> {
        if self.emulate {
            let (a, b) = (a.data.to_kind(Kind::Float) / &a.scale, b.data.to_kind(Kind::Float) / &b.scale);
            return Ok(a.mm(&b).to_kind(out_kind));
        }
        scaled_mm(a, b, out_kind, fast_accum, fused)
    }

    /// Whether ft's kernels cast (`fused`: they load on this GPU) and the
    /// GEMMs run in float8: either recipe, not emulated.
    pub fn casts_with_kernels(self, fused: bool) -> bool {
        fused && !self.emulate
    }

    /// Rowwise with ft's kernels: `x` [R, C] (contiguous) cast with a power-of-2
    /// scale per row (`Along::Rows`: from each row's amax) or per column, as
    /// `cast` along dim -1 or 0 does — the same bits — and its amaxes. The
    /// operand is x's (a view of the transposed copy [C, R padded to 16]
    /// when `transposed`: the layout a GEMM's second operand reads), the
    /// scales shaped as `cast`'s: [R, 1] or [1, C].
    fn kernel_cast_along(self, x: &Tensor, along: kernels::Along, role: Role, transposed: bool) -> Result<(Operand, Tensor)> {
        let kind = self.kind(role);
        let max = max_value(kind) as f32;
        let amax = kernels::amax_along(x, along)?;
        let (scale, inverse) = kernels::float8_scales(&amax, max, true)?;
        let cast = kernels::cast_float8_along(x, along, &scale, &inverse, kind, max, !transposed, transposed)?;
        let data = match transposed {
            true => cast.transposed.expect("asked for").tr(),
            false => cast.data.expect("asked for"),
        };
        let shape = match along {
            kernels::Along::Rows => [-1, 1],
            kernels::Along::Cols => [1, -1],
        };
        Ok((Operand { data, scale: scale.view(shape), inverse: inverse.view(shape) }, amax))
    }

    /// Forward: x·Wᵀ, x [.., in] and W [out, in], and what backward reuses.
    /// Rowwise: a scale per token and one per output feature.
    pub(crate) fn forward(self, x: &Tensor, weight: &Tensor, fused: bool, layer: u32) -> Result<(Tensor, Saved)> {
        let features = x.size()[x.dim() - 1];
        let rows = x.reshape([-1, features]);
        let (out, saved) = match (self.casts_with_kernels(fused), self.recipe) {
            (true, Recipe::Tensorwise) => {
                let rows = rows.contiguous();
                let (x_amax, input) = INPUTS.cast(&rows, self.recipe, || {
                    let amax = activation_amax(&rows).map_or_else(|| kernels::amax(&rows), Ok)?;
                    Ok((kernel_cast(&rows, &amax, Role::Input, self, false)?, amax))
                })?;
                let gathered = gathered(weight);
                let w_amax = match &gathered {
                    Some(gathered) => gathered.amax.shallow_clone(),
                    None => kernels::amax(weight)?,
                };
                record(layer, Role::Input, &x_amax);
                record(layer, Role::Weight, &w_amax);
                let weight_t = match gathered {
                    Some(Gathered { bytes: Some(bytes), .. }) => Operand { data: bytes.data.view(weight.size().as_slice()), ..bytes },
                    _ => kernel_cast(weight, &w_amax, Role::Weight, self, false)?,
                }
                .transposed();
                (self.gemm(&input, &weight_t, x.kind(), true, true)?, [Some(x_amax), Some(w_amax)])
            }
            (true, Recipe::Rowwise) => {
                let rows = rows.contiguous();
                let (x_amax, input) = INPUTS.cast(&rows, self.recipe, || self.kernel_cast_along(&rows, kernels::Along::Rows, Role::Input, false))?;
                let (weight_rows, w_amax) = self.kernel_cast_along(&weight.contiguous(), kernels::Along::Rows, Role::Weight, false)?;
                record(layer, Role::Input, &x_amax);
                record(layer, Role::Weight, &w_amax);
                (self.gemm(&input, &weight_rows.transposed(), x.kind(), true, true)?, [None, None])
            }
            (false, _) => {
                let input = self.cast_recording(&rows, Role::Input, -1, Some(layer));
                let weight_t = self.cast_recording(weight, Role::Weight, -1, Some(layer)).transposed();
                (self.gemm(&input, &weight_t, x.kind(), true, false)?, [None, None])
            }
        };
        let mut shape = x.size();
        *shape.last_mut().expect("x has a feature dimension") = weight.size()[0];
        Ok((out.reshape(shape), saved))
    }

    /// Backward from the output's gradient `grad`: the input's gradient
    /// dy·W (rowwise: a scale per token of dy, per input feature of W) and
    /// the weight's dyᵀ·x (per output feature of dy, per input feature of
    /// x), each only when asked for.
    pub(crate) fn backward(self, x: &Tensor, weight: &Tensor, grad: &Tensor, saved: Saved, wanted: [bool; 2], fused: bool, layer: u32) -> Result<[Option<Tensor>; 2]> {
        let (features, outputs) = (x.size()[x.dim() - 1], weight.size()[0]);
        let grad = grad.reshape([-1, outputs]);
        if self.casts_with_kernels(fused) {
            let (rows, grad) = (x.reshape([-1, features]).contiguous(), grad.contiguous());
            let [input, weight] = match self.recipe {
                Recipe::Tensorwise => self.fused_backward(&rows, weight, &grad, saved, wanted, layer)?,
                Recipe::Rowwise => self.rowwise_fused_backward(&rows, weight, &grad, wanted, layer)?,
            };
            return Ok([input.map(|g| g.reshape(x.size())), weight]);
        }
        // The output gradient's amax once: its first cast's.
        let mut recording = Some(layer);
        let grad_input = match wanted[0] {
            false => None,
            true => {
                let dy = self.cast_recording(&grad, Role::GradOutput, -1, recording.take());
                let w = self.cast(weight, Role::Weight, 0);
                Some(self.gemm(&dy, &w, grad.kind(), false, false)?.reshape(x.size()))
            }
        };
        let grad_weight = match wanted[1] {
            false => None,
            true => {
                let dy_t = self.cast_recording(&grad, Role::GradOutput, 0, recording.take()).transposed();
                let rows = self.cast(&x.reshape([-1, features]), Role::Input, 0);
                Some(self.gemm(&dy_t, &rows, grad.kind(), false, false)?)
            }
        };
        Ok([grad_input, grad_weight])
    }

    /// Tensorwise backward with ft's kernels: dy cast once into both
    /// layouts its GEMMs read, W and x cast transposed (the layouts
    /// `_scaled_mm` needs for dy·W and dyᵀ·x) from forward's amaxes. The
    /// same bits as `backward`'s ATen casts: a tensorwise scale does not
    /// depend on the layout.
    fn fused_backward(self, rows: &Tensor, weight: &Tensor, grad: &Tensor, saved: Saved, wanted: [bool; 2], layer: u32) -> Result<[Option<Tensor>; 2]> {
        let [x_amax, w_amax] = saved;
        let amax = |saved: Option<Tensor>, of: &Tensor| saved.map_or_else(|| kernels::amax(of), Ok);
        let g_amax = kernels::amax(grad)?;
        record(layer, Role::GradOutput, &g_amax);
        let kind = self.kind(Role::GradOutput);
        let dy = kernels::cast_float8(grad, &g_amax, kind, max_value(kind) as f32, wanted[0], wanted[1])?;
        let grad_input = match (wanted[0], &dy.data) {
            (true, Some(data)) => {
                let w = match gathered(weight) {
                    // Gathered bytes, row-major: their transpose is the layout this GEMM reads.
                    Some(Gathered { bytes: Some(bytes), .. }) => Operand { data: kernels::transpose_float8(&bytes.data.view(weight.size().as_slice()))?, ..bytes },
                    _ => kernel_cast(weight, &amax(w_amax, weight)?, Role::Weight, self, true)?,
                }
                .transposed();
                Some(self.gemm(&Operand { data: data.shallow_clone(), scale: dy.scale.shallow_clone(), inverse: dy.inverse.shallow_clone() }, &w, grad.kind(), false, true)?)
            }
            _ => None,
        };
        let grad_weight = match (wanted[1], dy.transposed) {
            (true, Some(data)) => {
                let dy_t = Operand { data, scale: dy.scale, inverse: dy.inverse };
                let (_, x) = TRANSPOSED_INPUTS.cast(rows, self.recipe, || {
                    let amax = amax(x_amax, rows)?;
                    Ok((kernel_cast(rows, &amax, Role::Input, self, true)?, amax))
                })?;
                let x = x.transposed();
                Some(self.gemm(&dy_t, &x, grad.kind(), false, true)?)
            }
            _ => None,
        };
        Ok([grad_input, grad_weight])
    }

    /// Rowwise backward with ft's kernels: dy cast per token for dy·W, W
    /// per input feature into the layout that GEMM reads, dy per output
    /// feature and x per input feature transposed for dyᵀ·x — the casts
    /// `backward`'s ATen path makes, bit for bit, with no copy to relayout.
    fn rowwise_fused_backward(self, rows: &Tensor, weight: &Tensor, grad: &Tensor, wanted: [bool; 2], layer: u32) -> Result<[Option<Tensor>; 2]> {
        use kernels::Along;
        // The output gradient's amax once: its first cast's.
        let mut recording = Some(layer);
        let grad_input = match wanted[0] {
            false => None,
            true => {
                let (dy, g_amax) = self.kernel_cast_along(grad, Along::Rows, Role::GradOutput, false)?;
                record(recording.take().expect("first"), Role::GradOutput, &g_amax);
                let (w, _) = self.kernel_cast_along(&weight.contiguous(), Along::Cols, Role::Weight, true)?;
                Some(self.gemm(&dy, &w, grad.kind(), false, true)?)
            }
        };
        let grad_weight = match wanted[1] {
            false => None,
            true => {
                let (dy, g_amax) = self.kernel_cast_along(grad, Along::Cols, Role::GradOutput, true)?;
                if let Some(layer) = recording {
                    record(layer, Role::GradOutput, &g_amax);
                }
                let (_, x) = TRANSPOSED_INPUTS.cast(rows, self.recipe, || self.kernel_cast_along(rows, Along::Cols, Role::Input, true))?;
                Some(self.gemm(&dy.transposed(), &x, grad.kind(), false, true)?)
            }
        };
        Ok([grad_input, grad_weight])
    }

    /// The code the shim's node carries, with whether ft's kernels cast and
    /// the layer's id (`Float8::from_code` reads them back).
    pub(crate) fn code(self, fused: bool, layer: u32) -> i64 {
        (self.recipe == Recipe::Rowwise) as i64 | (self.emulate as i64) << 1 | (fused as i64) << 2 | (layer as i64) << 3
    }

    pub(crate) fn from_code(code: i64) -> (Float8, bool, u32) {
        let recipe = if code & 1 == 1 { Recipe::Rowwise } else { Recipe::Tensorwise };
        (Float8 { recipe, emulate: code & 2 == 2 }, code & 4 == 4, (code >> 3) as u32)
    }
}

/// The last input a direction cast with ft's kernels and its amax, so that
/// the layers reading one input (Llama's q, k and v projections; gate and
/// up) cast it once: forward's row-major casts (`INPUTS`) and backward's
/// transposed ones (`TRANSPOSED_INPUTS`). An entry holds its tensor, so the
/// storage cannot be reused while cached, and its version counter, which
/// an in-place write would have moved; `forget_cached_inputs` empties both.
struct InputCache(std::sync::Mutex<Option<CachedInput>>);

struct CachedInput {
    x: Tensor,
    /// The recipe it was cast for (a tensorwise and a rowwise cast of x differ).
    recipe: Recipe,
    version: i64,
    amax: Tensor,
    cast: Operand,
}

static INPUTS: InputCache = InputCache(std::sync::Mutex::new(None));
static TRANSPOSED_INPUTS: InputCache = InputCache(std::sync::Mutex::new(None));

impl InputCache {
    /// `x`'s amax and cast under `recipe`: the cached ones when x is the input cast last, else `cast`'s, then cached.
    fn cast(&self, x: &Tensor, recipe: Recipe, cast: impl FnOnce() -> Result<(Operand, Tensor)>) -> Result<(Tensor, Operand)> {
        let mut entry = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(cached) = entry.as_ref() {
            if cached.recipe == recipe && same_values(&cached.x, cached.version, x) && cached.x.size() == x.size() && cached.x.stride() == x.stride() {
                return Ok((cached.amax.shallow_clone(), cached.cast.shallow_clone()));
            }
        }
        let (operand, amax) = cast()?;
        *entry = Some(CachedInput { x: x.shallow_clone(), recipe, version: x.internal_version(), amax: amax.shallow_clone(), cast: operand.shallow_clone() });
        Ok((amax, operand))
    }

    fn forget(&self) {
        *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }
}

/// Whether `x` holds the values `held` held at `version`: the same storage
/// start, device, kind and element count, and no write since (a view
/// shares its tensor's version counter).
fn same_values(held: &Tensor, version: i64, x: &Tensor) -> bool {
    held.data_ptr() == x.data_ptr() && held.device() == x.device() && held.kind() == x.kind() && held.numel() == x.numel() && version == x.internal_version()
}

/// Drops the cached input casts (`InputCache`) and the tensors they hold:
/// after a step's backward, so they hold no memory through the optimizer step.
pub fn forget_cached_inputs() {
    INPUTS.forget();
    TRANSPOSED_INPUTS.forget();
    *activation_slot() = None;
}

/// Whether the kernels that write a float8 layer's input compute its amax
/// as they write it (SwiGLU's and RMSNorm's: `kernels::swiglu_`,
/// `kernels::rms_norm_`), so the layer's
/// tensorwise cast skips its amax pass: set by the trainer when the
/// tensorwise recipe casts with ft's kernels.
static ACTIVATION_AMAXES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn fuse_activation_amaxes(on: bool) {
    ACTIVATION_AMAXES.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub fn activation_amaxes_wanted() -> bool {
    ACTIVATION_AMAXES.load(std::sync::atomic::Ordering::Relaxed)
}

/// The last activation whose writer computed its amax, with that amax and
/// the activation's version then: one slot (the layer reading it runs
/// next), holding the tensor so its storage is not reused while noted.
type ActivationAmax = Option<(Tensor, i64, Tensor)>;

fn activation_slot() -> std::sync::MutexGuard<'static, ActivationAmax> {
    static SLOT: std::sync::Mutex<ActivationAmax> = std::sync::Mutex::new(None);
    SLOT.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Notes `amax` (max |x|, one fp32 on x's device) as x's.
pub(crate) fn note_activation_amax(x: &Tensor, amax: Tensor) {
    *activation_slot() = Some((x.shallow_clone(), x.internal_version(), amax));
}

/// x's amax if its writer noted it and x is that tensor's data unchanged
/// (the same storage start, elements, kind and version; any shape), taken
/// from the slot: the first layer reading x casts it, and the input cache
/// serves the others, so the slot lets go of x at once.
fn activation_amax(x: &Tensor) -> Option<Tensor> {
    let mut slot = activation_slot();
    let (noted, version, _) = slot.as_ref()?;
    if !(same_values(noted, *version, x) && x.is_contiguous()) {
        return None;
    }
    slot.take().map(|(_, _, amax)| amax)
}

/// Weights gathered in float8 (a sharded unit's gather,
/// `ft_core::distributed::float8_gather`): the gather cast each weight with the scale
/// of its whole tensor's amax, reduced over the shard group. On a GPU it
/// hands the layer the gathered bytes themselves, which its GEMMs read in
/// place of a cast of the weight (whose buffer the gather leaves unwritten);
/// elsewhere it writes the dequantised values, which the layer casts back
/// with that amax: with the same scale s, a value q/s rounded to bf16
/// (within 2⁻⁹ of it) casts back to q, float8's steps being 2⁻⁴ apart or
/// wider. Either way the GEMMs see exactly the gathered bytes. Keyed by
/// where the weight's data starts and its size; each entry names the unit
/// that gathered it (`owner`), which forgets its entries before it gathers
/// again, and a gather or a release of a buffer forgets those inside it,
/// so no entry outlives what it describes.
struct GatheredWeight {
    owner: u64,
    address: usize,
    numel: i64,
    gathered: Gathered,
}

/// What a float8 gather made of a weight.
struct Gathered {
    /// Its whole tensor's amax, which its scale is from.
    amax: Tensor,
    /// Its float8 bytes, row-major, with their scale (on a GPU).
    bytes: Option<Operand>,
}

/// A weight's float8 bytes as a gather made them (row-major e4m3), the
/// scale it cast with (`scale_from` the weight's amax) and its reciprocal.
pub struct GatheredBytes {
    pub data: Tensor,
    pub scale: Tensor,
    pub inverse: Tensor,
}

static GATHERED: std::sync::Mutex<Vec<GatheredWeight>> = std::sync::Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<GatheredWeight>> {
    GATHERED.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Notes that `weight` (a view into a gathered buffer) was gathered in
/// float8 with the scale of `amax`, as `bytes` (its e4m3 values, when the
/// layer is to read them instead of `weight`) or as dequantised values in
/// `weight` itself; `owner` (the unit) forgets it with `forget_gathered_by`.
pub fn note_gathered(owner: u64, weight: &Tensor, amax: &Tensor, bytes: Option<GatheredBytes>) {
    let bytes = bytes.map(|GatheredBytes { data, scale, inverse }| Operand { data, scale, inverse });
    let entry = GatheredWeight {
        owner,
        address: weight.data_ptr() as usize,
        numel: weight.numel() as i64,
        gathered: Gathered { amax: amax.shallow_clone(), bytes },
    };
    registry().push(entry);
}

/// Forgets what `owner` noted (before it gathers again).
pub fn forget_gathered_by(owner: u64) {
    registry().retain(|entry| entry.owner != owner);
}

/// Forgets any note of a weight inside `buffer`: about to be written by a
/// gather of any kind, or released.
pub fn forget_gathered_in(buffer: &Tensor) {
    let start = buffer.data_ptr() as usize;
    let end = start + buffer.numel() * buffer.kind().elt_size_in_bytes();
    registry().retain(|entry| !(start..end).contains(&entry.address));
}

/// The amax a float8 gather cast `weight` with, and its bytes when the gather kept them.
fn gathered(weight: &Tensor) -> Option<Gathered> {
    let address = weight.data_ptr() as usize;
    let entries = registry();
    let entry = entries.iter().find(|entry| entry.address == address && entry.numel == weight.numel() as i64)?;
    Some(Gathered { amax: entry.gathered.amax.shallow_clone(), bytes: entry.gathered.bytes.as_ref().map(Operand::shallow_clone) })
}

/// `x` [rows, cols] cast by ft's kernel, scaled from `amax`: row-major, or
/// with `transposed` into its transpose [cols, rows padded to 16].
fn kernel_cast(x: &Tensor, amax: &Tensor, role: Role, float8: Float8, transposed: bool) -> Result<Operand> {
    let kind = float8.kind(role);
    let cast = kernels::cast_float8(x, amax, kind, max_value(kind) as f32, !transposed, transposed)?;
    let data = if transposed { cast.transposed } else { cast.data };
    Ok(Operand { data: data.expect("asked for"), scale: cast.scale, inverse: cast.inverse })
}

/// torchao's `addmm_float8_unwrapped` over `preprocess_addmm`'s layouts: a
/// row-major, b column-major, the scales inverted. Rowwise without fast
/// accumulation runs the tensorwise kernel and scales after (CUTLASS's
/// rowwise kernel is slow without it) — with `fused`, in one pass of ft's
/// kernel (`kernels::scale_outer_`, the same bits); rowwise output is
/// bf16, cast after.
/// An inner dimension that is not a multiple of 16 (cuBLASLt's float8
/// needs it; the token count of the weight gradient's GEMM) is padded with
/// zeros, which add nothing.
fn scaled_mm(a: &Operand, b: &Operand, out_kind: Kind, fast_accum: bool, fused: bool) -> Result<Tensor> {
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
    let (mut a_inverse, mut b_inverse) = (a.inverse.shallow_clone(), b.inverse.shallow_clone());
    let rowwise = a.scale.size() == [rows, 1] && b.scale.size() == [1, cols];
    let mut scaled_after = None;
    if rowwise && !fast_accum {
        scaled_after = Some((a_inverse.contiguous(), b_inverse.contiguous()));
        a_inverse = a_inverse.new_ones([], (Kind::Float, a_inverse.device()));
        b_inverse = a_inverse.shallow_clone();
    }
    let product_kind = if rowwise && matches!(out_kind, Kind::Half | Kind::Float) { Kind::BFloat16 } else { out_kind };
    let mut out = a_data.f_internal_scaled_mm::<Tensor>(&b_data, &a_inverse, &b_inverse, None, None, product_kind, fast_accum).map_err(|e| ShimError(format!("_scaled_mm: {e}")))?;
    match scaled_after {
        Some((a, b)) if fused => kernels::scale_outer_(&mut out, &a, &b)?,
        Some((a, b)) => out *= &a * &b,
        None => {}
    }
    Ok(out.to_kind(out_kind))
}

/// x·Wᵀ as one autograd node (the shim's `Float8Linear`) whose forward and
/// backward GEMMs run in float8 as `float8` says; x and W stay in their own
/// precision, saved for backward. No bias: torchao adds it after, in the
/// output's precision. With `fused_casts` (ft's kernels load on this GPU),
/// the tensorwise recipe's casts run in ft's kernels (`kernels::amax`,
/// `kernels::cast_float8`), bit for bit the casts ATen's ops make.
/// `layer` (`layer_id`) names the layer to the numerics guard (`record_amaxes`).
pub fn linear(x: &Tensor, weight: &Tensor, float8: Float8, fused_casts: bool, layer: u32) -> Result<Tensor> {
    crate::float8_linear(x, weight, None, float8.code(fused_casts, layer))
}

/// [`linear`] plus a low-rank adapter's `scale · (x·Aᵀ)·Bᵀ` (LoRA's `a`
/// and `b`, in the compute dtype) in the same node: the adapter's product
/// accumulates into the float8 GEMM's output and its input gradient into
/// the base's, where separate nodes would add a [tokens, out] tensor
/// forward and a [tokens, in] one backward (`crate::lora_linear` does the
/// same in the compute dtype).
#[allow(clippy::too_many_arguments)]
pub fn lora_linear(x: &Tensor, weight: &Tensor, a: &Tensor, b: &Tensor, scale: f64, float8: Float8, fused_casts: bool, layer: u32) -> Result<Tensor> {
    crate::float8_linear(x, weight, Some((a, b, scale)), float8.code(fused_casts, layer))
}

#[cfg(test)]
mod tests {
    use super::{linear, Float8, Recipe};
    use tch::{Device, Kind, Tensor};

    /// The same bits (any kind), NaN and signed zeros included.
    fn assert_same_bits(fused: &Tensor, aten: &Tensor, what: &str) {
        assert_eq!((fused.size(), fused.kind()), (aten.size(), aten.kind()), "{what}");
        let bits = |t: &Tensor| t.contiguous().view_dtype(if t.kind() == Kind::Float { Kind::Int } else { Kind::Int16 });
        let differ = bits(fused).ne_tensor(&bits(aten)).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(differ, 0, "{what}: {differ} of {} elements differ between ft's casts and ATen's", fused.numel());
    }

    /// x·Wᵀ's output and the gradients of the tensors that require them.
    fn run(x: &Tensor, weight: &Tensor, grad: &Tensor, fused: bool) -> Vec<Tensor> {
        run_recipe(x, weight, grad, fused, Recipe::Tensorwise)
    }

    fn run_recipe(x: &Tensor, weight: &Tensor, grad: &Tensor, fused: bool, recipe: Recipe) -> Vec<Tensor> {
        let (x, weight) = (x.detach().set_requires_grad(x.requires_grad()), weight.detach().set_requires_grad(weight.requires_grad()));
        let out = linear(&x, &weight, Float8 { recipe, emulate: false }, fused, 0).unwrap();
        // d(Σ out·grad)/d out is `grad` exactly.
        (&out * grad).sum(out.kind()).backward();
        [x.grad(), weight.grad()].into_iter().filter(Tensor::defined).chain([out.detach()]).collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU of compute capability 8.9+ (bench/gpu/llama7b_fp8_1gpu.sh runs it)"]
    fn fused_casts_equal_atens_bit_for_bit_on_a_gpu() {
        // Before any libtorch call: its CUDA ops register as CUDA opens.
        crate::cuda::init().expect("CUDA opens on a host with a GPU");
        assert!(tch::Cuda::is_available(), "libtorch was asked about CUDA before it opened (another test ran first): run GPU tests with --test-threads 1");
        let gpu = Device::Cuda(0);
        tch::manual_seed(11);
        // 300 tokens: the weight gradient's inner dimension is padded to 304.
        for (tokens, inputs, outputs) in [(300, 64, 48), (4096, 1024, 2048)] {
            for kind in [Kind::BFloat16, Kind::Float] {
                let magnitudes = Tensor::logspace(-3.0, 3.0, tokens, 10.0, (Kind::Float, gpu)).unsqueeze(1);
                let x = (Tensor::randn([tokens, inputs], (Kind::Float, gpu)) * magnitudes).to_kind(kind);
                let _ = x.get(1).zero_();
                let weight = (Tensor::randn([outputs, inputs], (Kind::Float, gpu)) * 0.05).to_kind(kind);
                let grad = (Tensor::randn([tokens, outputs], (Kind::Float, gpu)) * 1e-4).to_kind(kind);
                for (recipe, wanted) in [Recipe::Tensorwise, Recipe::Rowwise].into_iter().flat_map(|r| [[true, true], [false, true], [true, false]].map(|w| (r, w))) {
                    let (x, weight) = (x.set_requires_grad(wanted[0]), weight.set_requires_grad(wanted[1]));
                    let (fused, aten) = (run_recipe(&x, &weight, &grad, true, recipe), run_recipe(&x, &weight, &grad, false, recipe));
                    assert_eq!(fused.len(), aten.len());
                    for (i, (fused, aten)) in fused.iter().zip(&aten).enumerate() {
                        assert_same_bits(fused, aten, &format!("{recipe:?} {tokens}×{inputs}→{outputs} {kind:?} {wanted:?} result {i}"));
                    }
                }
            }
        }
        // Layers reading one input cast it once (the calls above hit the cache); one written in place since is cast again.
        let x = Tensor::randn([300, 64], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
        let weight = (Tensor::randn([48, 64], (Kind::Float, gpu)) * 0.05).to_kind(Kind::BFloat16).set_requires_grad(true);
        let grad = Tensor::randn([300, 48], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
        let before = run(&x, &weight, &grad, true);
        let _ = x.shallow_clone().g_mul_scalar_(3.0);
        let (after, aten) = (run(&x, &weight, &grad, true), run(&x, &weight, &grad, false));
        for (i, (after, aten)) in after.iter().zip(&aten).enumerate() {
            assert_same_bits(after, aten, &format!("after an in-place write, result {i}"));
        }
        assert!(!before[1].equal(&after[1]), "the written input was cast again");
        // A tensor that does not start on 16 bytes is read two values at a time: the same bits.
        let flat = Tensor::randn([300 * 64 + 1], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
        let offset = flat.narrow(0, 1, 300 * 64).view([300, 64]);
        let aligned = offset.copy();
        let amax = crate::kernels::amax(&offset).unwrap();
        assert_same_bits(&amax, &crate::kernels::amax(&aligned).unwrap(), "amax of an offset tensor");
        let [from_offset, from_aligned] = [&offset, &aligned].map(|x| crate::kernels::cast_float8(x, &amax, Kind::Float8e4m3fn, 448.0, true, true).unwrap());
        for (what, a, b) in [("row-major", &from_offset.data, &from_aligned.data), ("transposed", &from_offset.transposed, &from_aligned.transposed)] {
            let bytes = |t: &Option<Tensor>| t.as_ref().unwrap().view_dtype(Kind::Uint8).to_kind(Kind::Int16);
            assert_same_bits(&bytes(a), &bytes(b), &format!("{what} cast of an offset tensor"));
        }
        // Float8 bytes transposed by ft's kernel (a gathered weight's layout for the input gradient): ATen's copy of
        // the transposed view, byte for byte, at sizes that are and are not whole tiles; and a cast written into a
        // slice of a larger buffer (a gather's send buffer) equals the one into a new tensor.
        let bytes = |t: &Tensor| t.view_dtype(Kind::Uint8).to_kind(Kind::Int16);
        for (rows, cols) in [(4096, 1024), (48, 64), (37, 70)] {
            let x = Tensor::randn([rows, cols], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
            let amax = crate::kernels::amax(&x).unwrap();
            let cast = crate::kernels::cast_float8(&x, &amax, Kind::Float8e4m3fn, 448.0, true, false).unwrap().data.unwrap();
            let transposed = crate::kernels::transpose_float8(&cast).unwrap();
            assert_same_bits(&bytes(&transposed), &bytes(&cast.tr().contiguous()), &format!("{rows}×{cols} transposed"));
            let buffer = Tensor::zeros([rows * cols + 64], (Kind::Uint8, gpu));
            let into = buffer.narrow(0, 16, rows * cols).view_dtype(Kind::Float8e4m3fn).view([rows, cols]);
            crate::kernels::cast_float8_into(&x, &amax, Kind::Float8e4m3fn, 448.0, &into).unwrap();
            assert_same_bits(&bytes(&into), &bytes(&cast), &format!("{rows}×{cols} cast into a buffer"));
            assert_eq!(buffer.narrow(0, 0, 16).count_nonzero(None).int64_value(&[]), 0, "nothing written before the slice");
        }
        // A rowwise GEMM's scales applied after it by ft's kernel: ATen's `y *= a * b`, bit for bit, from 16 bytes in
        // and from an offset (the scalar path).
        for (rows, cols) in [(300, 2048), (37, 70)] {
            let (a, b) = (Tensor::rand([rows, 1], (Kind::Float, gpu)) * 3.0, Tensor::rand([1, cols], (Kind::Float, gpu)) / 7.0);
            let values = Tensor::randn([rows * cols + 1], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
            for offset in [0, 1] {
                let [mut ours, mut aten] = [0, 1].map(|_| values.copy().narrow(0, offset, rows * cols).view([rows, cols]));
                crate::kernels::scale_outer_(&mut ours, &a, &b).unwrap();
                aten *= &a * &b;
                assert_same_bits(&ours, &aten, &format!("{rows}×{cols} from {offset} scaled after"));
            }
        }
        // AdamW writing the stepped parameters' bf16 copy as it steps them: the parameters and moments it leaves are
        // those of the step without the copy, bit for bit, and the copy is ATen's cast of the parameters, from 16
        // bytes in and from an offset (the scalar path).
        let hyper = crate::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
        let step = Tensor::from(3f32).to_device(gpu);
        for offset in [0, 1] {
            let n = 4096 * 3 + 5;
            let state = [1.0, 1.0, 0.1, 0.01].map(|std| (Tensor::randn([n + 1], (Kind::Float, gpu)) * std).abs_().narrow(0, offset, n));
            let [with, without] = [0, 1].map(|_| [&state[0], &state[2], &state[3]].map(Tensor::copy));
            let buffer = Tensor::zeros([n + 1], (Kind::BFloat16, gpu));
            let copy = buffer.narrow(0, offset, n);
            crate::kernels::adamw_(&with[0], &state[1], &with[1], &with[2], hyper, &step, None, None, Some(&copy)).unwrap();
            crate::kernels::adamw_(&without[0], &state[1], &without[1], &without[2], hyper, &step, None, None, None).unwrap();
            for (what, a, b) in [("parameters", &with[0], &without[0]), ("exp_avg", &with[1], &without[1]), ("exp_avg_sq", &with[2], &without[2])] {
                assert_same_bits(a, b, &format!("AdamW's {what} with the copy written, from {offset}"));
            }
            assert_same_bits(&copy, &with[0].to_kind(Kind::BFloat16), &format!("AdamW's bf16 copy, from {offset}"));
        }
        // bf16 widened to fp32 by ft's kernel (an fp32 reduction's input): ATen's cast, bit for bit, from 16 bytes in
        // and from an offset (the scalar path), NaN and infinities included.
        let values = Tensor::randn([4096 * 3 + 5], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
        let _ = values.get(7).fill_(f64::NAN);
        let _ = values.get(8).fill_(f64::INFINITY);
        for x in [values.shallow_clone(), values.narrow(0, 3, 4096 * 3)] {
            assert_same_bits(&crate::kernels::widen_bf16(&x).unwrap(), &x.to_kind(Kind::Float), "widened bf16");
        }
        // SwiGLU's kernel computing its output's amax as it writes it: the amax of what it wrote, and a float8 layer
        // reading that output (which then takes the noted amax instead of a pass of its own) gives the same bits.
        let (gate, up) = (Tensor::randn([300, 128], (Kind::Float, gpu)).to_kind(Kind::BFloat16), Tensor::randn([300, 128], (Kind::Float, gpu)).to_kind(Kind::BFloat16));
        let mut out = Tensor::empty_like(&gate);
        let amax = Tensor::zeros([], (Kind::Float, gpu));
        crate::kernels::swiglu_(&gate, &up, None, &mut out, None, Some(&amax)).unwrap();
        assert_same_bits(&amax, &crate::kernels::amax(&out).unwrap(), "SwiGLU's output amax");
        // A float8 layer over what `write` returns (300 × 128) gives the same bits with its amax noted and without, and
        // takes the noted amax out of the slot.
        let weight = (Tensor::randn([64, 128], (Kind::Float, gpu)) * 0.05).to_kind(Kind::BFloat16).set_requires_grad(true);
        let same_over = |write: &dyn Fn() -> Tensor, what: &str| {
            let through = |noted: bool| {
                super::forget_cached_inputs();
                super::fuse_activation_amaxes(noted);
                let h = write();
                assert_eq!(super::activation_slot().is_some(), noted, "{what}, noted: {noted}");
                let out = linear(&h, &weight.detach().set_requires_grad(true), Float8 { recipe: Recipe::Tensorwise, emulate: false }, true, 0).unwrap();
                assert!(super::activation_slot().is_none(), "the layer took {what}'s noted amax");
                super::fuse_activation_amaxes(false);
                out.detach()
            };
            assert_same_bits(&through(true), &through(false), &format!("a float8 layer over {what}'s output, its amax noted or not"));
        };
        same_over(&|| crate::swiglu(&gate, &up, true).unwrap(), "SwiGLU");
        // RMSNorm by ft's kernel: ATen's rms_norm within one rounding of the output's kind (the squares are summed in
        // another order), both gradients (ATen's backward from the rstd the kernel kept) within the same, and the
        // amax of what it wrote; a float8 layer over it gives the same bits with that amax noted and without.
        let within_a_rounding = |ours: &Tensor, aten: &Tensor, what: &str| {
            let unit = if ours.kind() == Kind::BFloat16 { 2f64.powi(-8) } else { 2f64.powi(-20) };
            let (ours, aten) = (ours.to_kind(Kind::Float), aten.to_kind(Kind::Float));
            let worst = (&ours - &aten).abs().max().double_value(&[]) / aten.abs().max().double_value(&[]);
            assert!(worst <= unit, "{what}: {worst:e} of the largest value apart, over {unit:e}");
        };
        for (rows, cols, kind) in [(300, 4096, Kind::BFloat16), (4, 33000, Kind::BFloat16), (37, 70, Kind::BFloat16), (300, 128, Kind::Float)] {
            let x = Tensor::randn([2, rows, cols], (Kind::Float, gpu)).to_kind(kind);
            let weight = (Tensor::randn([cols], (Kind::Float, gpu)) * 0.1 + 1.0).to_kind(kind);
            let grad = Tensor::randn([2, rows, cols], (Kind::Float, gpu)).to_kind(kind);
            let norm = |ours: bool| {
                let (x, weight) = (x.detach().set_requires_grad(true), weight.detach().set_requires_grad(true));
                super::fuse_activation_amaxes(ours);
                let out = if ours { crate::rms_norm(&x, &weight, 1e-5).unwrap() } else { x.rms_norm([cols], Some(&weight), Some(1e-5)) };
                if ours {
                    let noted = super::activation_amax(&out.view([-1, cols])).expect("RMSNorm noted its amax");
                    assert_same_bits(&noted, &crate::kernels::amax(&out).unwrap(), &format!("RMSNorm's output amax, {rows}×{cols} {kind:?}"));
                }
                super::fuse_activation_amaxes(false);
                (&out * &grad).sum(out.kind()).backward();
                [out.detach(), x.grad(), weight.grad()]
            };
            let (ours, aten) = (norm(true), norm(false));
            for ((what, ours), aten) in ["output", "input gradient", "weight gradient"].iter().zip(&ours).zip(&aten) {
                within_a_rounding(ours, aten, &format!("RMSNorm's {what}, {rows}×{cols} {kind:?}"));
            }
        }
        let x = Tensor::randn([300, 128], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
        let norm_weight = Tensor::ones([128], (Kind::BFloat16, gpu));
        same_over(&|| crate::rms_norm(&x, &norm_weight, 1e-5).unwrap(), "RMSNorm");
        // A NaN anywhere makes the amax NaN, as torch's max does (the numerics guard reads it).
        let x = Tensor::ones([1000], (Kind::BFloat16, gpu));
        let _ = x.get(777).fill_(f64::NAN);
        assert!(crate::kernels::amax(&x).unwrap().double_value(&[]).is_nan());
        let _ = x.get(777).fill_(-3.5);
        assert_eq!(crate::kernels::amax(&x).unwrap().double_value(&[]), 3.5);
    }
}
