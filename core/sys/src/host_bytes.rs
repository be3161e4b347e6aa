//! A host tensor's elements as bytes, borrowed: what a file writer hands
//! the kernel straight from the tensor's memory (checkpoint files), where
//! tch's own writers first copy every tensor into a fresh buffer.

use crate::{Result, ShimError};
use tch::{Device, Tensor};

/// The bytes of `tensor`'s elements in memory order, borrowed for as long
/// as `tensor` is. Refuses an undefined tensor, one off the CPU, or one
/// that is not contiguous: only a contiguous CPU tensor's elements are
/// `numel × element size` consecutive bytes at its `data_ptr`.
///
/// Sound because `tensor` holds a reference to its storage for the whole
/// borrow, so the memory stays allocated; a contiguous tensor's elements
/// are exactly those bytes from `data_ptr` (which already counts the
/// storage offset), initialised by whatever made the tensor; and any byte
/// is a valid `u8`. What the borrow checker cannot see is another handle
/// to the same storage (`shallow_clone`, a view) written while the slice
/// is alive — as for every tch tensor shared between threads, the caller
/// keeps writers away (a checkpoint's snapshot is not touched until its
/// save is finished).
pub fn host_bytes(tensor: &Tensor) -> Result<&[u8]> {
    if !tensor.defined() {
        return Err(ShimError("host_bytes: the tensor is undefined".into()));
    }
    if tensor.device() != Device::Cpu || !tensor.is_contiguous() {
        return Err(ShimError(format!(
            "host_bytes needs a contiguous CPU tensor (got one on {:?}, {})",
            tensor.device(),
            if tensor.is_contiguous() { "contiguous" } else { "not contiguous" }
        )));
    }
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    if len == 0 {
        // An empty tensor's data pointer may be null, which a slice may not be.
        return Ok(&[]);
    }
    // SAFETY: see above — `len` initialised bytes at `data_ptr`, kept alive by `tensor`'s borrow.
    Ok(unsafe { std::slice::from_raw_parts(tensor.data_ptr() as *const u8, len) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn the_bytes_are_the_elements_in_memory_order() {
        let values = [1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5];
        let tensor = Tensor::from_slice(&values).reshape([2, 3]);
        let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(host_bytes(&tensor).unwrap(), expected.as_slice());
        // A contiguous view into the middle of a storage starts at its own first element.
        assert_eq!(host_bytes(&tensor.get(1)).unwrap(), &expected[12..]);
        assert_eq!(host_bytes(&Tensor::zeros([0], (Kind::Float, Device::Cpu))).unwrap(), &[] as &[u8]);
    }

    #[test]
    fn strided_and_undefined_tensors_are_refused() {
        let transposed = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]).tr();
        assert!(host_bytes(&transposed).unwrap_err().0.contains("not contiguous"));
        assert!(host_bytes(&Tensor::new()).unwrap_err().0.contains("undefined"));
    }
}
