//! Low-rank products, the mechanism low-rank compression of collectives
//! rests on (`plugins/comm/powersgd` is its user; what to compress and when
//! stays there): a gradient matrix X (rows × cols, fp32) times a thin
//! factor — P = X Q, Q = Xᵀ P — and the expansion P Qᵀ with what it leaves
//! of X, and orthonormal bases of a set of thin factors. On a GPU, for
//! factors up to `kernels::LOWRANK_MAX` wide, ft's kernels
//! (core/sys/src/kernels.rs: one pass over X each, where cuBLAS tiles these
//! thin products for square ones and leaves most of the GPU idle; every
//! factor of a set orthonormalised in one launch, where ATen's QR or
//! Cholesky costs several launches a factor); else ATen's ops. Every matrix
//! is a contiguous [rows, cols] view; factors are contiguous fp32.

use anyhow::{ensure, Result};
use ft_sys::kernels::{self, LOWRANK_MAX};
use tch::{Device, Kind, Tensor};

/// Whether ft's kernels serve a matrix on `x`'s device with a factor of
/// width `r`, and `other` (what is added, or written) in fp32 or bf16.
fn kernels_serve(x: &Tensor, r: i64, other: Option<&Tensor>) -> bool {
    let kind_served = other.is_none_or(|t| matches!(t.kind(), Kind::Float | Kind::BFloat16));
    r <= LOWRANK_MAX && kind_served && kernels::available(x.device()).is_ok()
}

/// P = X Q into `p` ([rows, r]); with `add` (X's shape, fp32 or bf16), X +=
/// add first, in place (the error-fed gradient), in the same pass.
pub fn project(add: Option<&Tensor>, x: &Tensor, q: &Tensor, p: &Tensor) -> Result<()> {
    if kernels_serve(x, q.size()[1], add) {
        return Ok(kernels::lowrank_project(add, &mut x.shallow_clone(), q, &mut p.shallow_clone())?);
    }
    if let Some(add) = add {
        let _ = x.shallow_clone().f_add_(add)?;
    }
    let _ = x.f_mm_out(p, q)?;
    Ok(())
}

/// Q = Xᵀ P into `q` ([cols, r]).
pub fn project_t(x: &Tensor, p: &Tensor, q: &Tensor) -> Result<()> {
    if kernels_serve(x, p.size()[1], None) {
        return Ok(kernels::lowrank_project_t(x, p, &mut q.shallow_clone())?);
    }
    let _ = x.tr().f_mm_out(q, p)?;
    Ok(())
}

/// `out` = P Qᵀ (X's shape; fp32 or bf16) and, with `residual` = (X, n), X
/// −= P Qᵀ / n in place: what this rank's X keeps of what the sum over n
/// ranks left out.
pub fn expand(p: &Tensor, q: &Tensor, out: &Tensor, residual: Option<(&Tensor, i64)>) -> Result<()> {
    if kernels_serve(out, p.size()[1], Some(out)) {
        let (mut out, residual) = (out.shallow_clone(), residual.map(|(x, n)| (x.shallow_clone(), n)));
        return Ok(match residual {
            Some((mut x, n)) => kernels::lowrank_expand(p, q, &mut out, Some(&mut x), n as f32),
            None => kernels::lowrank_expand(p, q, &mut out, None, 1.0),
        }?);
    }
    let product = p.f_mm(&q.tr())?;
    if let Some((x, n)) = residual {
        let _ = x.shallow_clone().f_sub_(&(&product / n as f64))?;
    }
    out.shallow_clone().f_copy_(&product)?;
    Ok(())
}

/// Thin matrices side by side in one flat fp32 buffer (each `rows` ×
/// `width`, row-major, from element `at`): a set `orthonormalize` treats
/// at once. Made once for a layout and kept: on a GPU it holds the
/// kernel's table of them on the device.
pub struct Factors {
    /// (at, rows, width) each.
    parts: Vec<[i64; 3]>,
    table: Option<Tensor>,
}

impl Factors {
    pub fn new(parts: Vec<[i64; 3]>, device: Device) -> Factors {
        let served = parts.iter().all(|&[_, _, width]| width <= LOWRANK_MAX) && kernels::available(device).is_ok();
        let table = served.then(|| Tensor::from_slice(&parts.concat()).view([-1, 3]).to_device(device));
        Factors { parts, table }
    }
}

/// Each of `factors` in `all` replaced by an orthonormal basis of its
/// columns. On a GPU, every factor in one launch: CholeskyQR2 in fp64
/// (twice P ← P L⁻ᵀ with L Lᵀ = PᵀP + εI, ε 1e-15 of the trace: fp64 keeps
/// the squared condition number in range, the ridge keeps a rank-deficient
/// Gram matrix definite, and the second pass restores the directions the
/// first attenuated). Elsewhere, or for wider factors, Householder QR
/// (ATen's), a call a factor. Either way the columns span P's, and a
/// rank-deficient P's extra columns are orthonormal too.
pub fn orthonormalize(all: &Tensor, factors: &Factors) -> Result<()> {
    let end = factors.parts.iter().map(|&[at, rows, width]| at + rows * width).max().unwrap_or(0);
    ensure!(end <= all.numel() as i64, "factors reach element {end} of a buffer of {}", all.numel());
    if let Some(table) = &factors.table {
        return Ok(kernels::lowrank_orthonormalize(&mut all.shallow_clone(), table)?);
    }
    for &[at, rows, width] in &factors.parts {
        let mut p = all.narrow(0, at, rows * width).view([rows, width]);
        let (basis, _) = Tensor::f_linalg_qr(&p, "reduced")?;
        p.f_copy_(&basis)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_the_residual_are_what_the_matrices_give() {
        let opts = (Kind::Float, Device::Cpu);
        let (x, g, q) = (Tensor::randn([6, 5], opts), Tensor::randn([6, 5], opts), Tensor::randn([5, 2], opts));
        let summed = &x + &g;
        let p = Tensor::empty([6, 2], opts);
        project(Some(&g), &x, &q, &p).unwrap();
        assert!(x.allclose(&summed, 0.0, 0.0, false), "x += add in place");
        assert!(p.allclose(&summed.mm(&q), 1e-6, 1e-6, false));
        let q_back = Tensor::empty([5, 2], opts);
        project_t(&x, &p, &q_back).unwrap();
        assert!(q_back.allclose(&summed.tr().mm(&p), 1e-6, 1e-6, false));
        let out = Tensor::empty([6, 5], (Kind::BFloat16, Device::Cpu));
        expand(&p, &q_back, &out, Some((&x, 3))).unwrap();
        let product = p.mm(&q_back.tr());
        assert!(out.to_kind(Kind::Float).allclose(&product, 1e-2, 1e-2, false), "bf16 out");
        assert!(x.allclose(&(&summed - &product / 3.0), 1e-6, 1e-6, false), "residual");
    }

    #[test]
    fn orthonormal_bases_span_the_columns_even_when_some_are_dependent() {
        for width in [2, 4, 8] {
            // Two independent columns, the rest copies of them: the span has dimension 2.
            let base = Tensor::randn([50, 2], (Kind::Float, Device::Cpu));
            let p = Tensor::cat(&(0..width / 2).map(|_| base.shallow_clone()).collect::<Vec<_>>(), 1);
            // Two factors side by side, after 3 elements that stay as they are.
            let all = Tensor::cat(&[Tensor::ones([3], (Kind::Float, Device::Cpu)), p.reshape([-1]), p.reshape([-1])], 0);
            orthonormalize(&all, &Factors::new(vec![[3, 50, width], [3 + 50 * width, 50, width]], Device::Cpu)).unwrap();
            assert_eq!(Vec::<f32>::try_from(&all.narrow(0, 0, 3)).unwrap(), vec![1.0; 3]);
            for at in [3, 3 + 50 * width] {
                let q = all.narrow(0, at, 50 * width).view([50, width]);
                // Projecting the original columns onto the basis gives them back.
                let projected = q.mm(&q.tr().mm(&p));
                let error = (&projected - &p).abs().max().double_value(&[]) / p.abs().max().double_value(&[]);
                assert!(error < 1e-4, "width {width}: projection error {error:e}");
                // Columns of at most unit length, orthogonal to each other.
                let gram = q.tr().mm(&q);
                let diagonal = gram.diagonal(0, 0, 1);
                assert!(diagonal.le(1.0 + 1e-4).all().int64_value(&[]) == 1, "width {width}: columns longer than 1");
                let off = (&gram - Tensor::diag_embed(&diagonal, 0, 0, 1)).abs().max().double_value(&[]);
                assert!(off < 1e-4, "width {width}: columns not orthogonal ({off:e})");
            }
        }
        assert!(orthonormalize(&Tensor::zeros([10], (Kind::Float, Device::Cpu)), &Factors::new(vec![[0, 5, 4]], Device::Cpu)).is_err(), "outside the buffer");
    }
}
