//! Mixed precision: the element types a framework's parameters and
//! gradients come in ([`Element`]: `f32`, [`bf16`], [`f16`](struct@f16)). The master
//! weights and both moments are always fp32 in the tier; a step widens
//! each chunk's gradients to fp32 (times the caller's unscale factor, as
//! `GradScaler` needs) while the chunk is in cache, and narrows the new
//! master weights into the caller's parameters in their own type, rounding
//! to nearest even.
#![forbid(unsafe_code)]

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
pub use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A parameter or gradient element type: `f32`, [`bf16`] or [`f16`](struct@f16).
pub trait Element: sealed::Sealed + Copy + Send + Sync + bytemuck::Pod + 'static {
    /// Its name, as torch spells the dtype ("float32", "bfloat16", "float16").
    const NAME: &'static str;
    /// Bytes per element.
    const BYTES: usize = std::mem::size_of::<Self>();
    /// Whether one value converts cheaply inside the update loop (f32,
    /// bf16: bit operations the loop vectorizes). fp16 converts a slice at
    /// a time instead, where `half` uses the CPU's F16C instructions.
    const IN_LOOP: bool = true;

    /// `src` as fp32 (borrowed where it already is, and `scale` is 1),
    /// each value times `scale`.
    fn widen(src: &[Self], scale: f32) -> Cow<'_, [f32]>;

    /// `src` (fp32) into `dst`, rounded to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// One value, rounded to nearest even.
    fn from_f32(x: f32) -> Self;

    /// One value as fp32 (exact).
    fn to_f32(self) -> f32;

    /// `s` itself where `Self` is `f32` (the master weights' own type).
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        let _ = s;
        None
    }
}

fn scaled(mut v: Vec<f32>, scale: f32) -> Vec<f32> {
    if scale != 1.0 {
        v.iter_mut().for_each(|x| *x *= scale);
    }
    v
}

impl Element for f32 {
    const NAME: &'static str = "float32";

    fn widen(src: &[f32], scale: f32) -> Cow<'_, [f32]> {
        if scale == 1.0 {
            Cow::Borrowed(src)
        } else {
            Cow::Owned(src.iter().map(|x| x * scale).collect())
        }
    }

    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn from_f32(x: f32) -> Self {
        x
    }

    fn to_f32(self) -> f32 {
        self
    }

    fn as_f32_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bfloat16";

    fn widen(src: &[bf16], scale: f32) -> Cow<'_, [f32]> {
        Cow::Owned(scaled(src.to_f32_vec(), scale))
    }

    fn narrow(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }

    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }

    fn to_f32(self) -> f32 {
        // bf16 is fp32's upper half: a shift the update loop vectorizes.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Element for f16 {
    const NAME: &'static str = "float16";
    const IN_LOOP: bool = false;

    fn widen(src: &[f16], scale: f32) -> Cow<'_, [f32]> {
        Cow::Owned(scaled(src.to_f32_vec(), scale))
    }

    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }

    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_rounds_to_nearest_even_and_widening_is_exact() {
        // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7):
        // it rounds to the even one, 1; 1 + 3·2^-9 rounds up.
        let src = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-9),
            -2.5,
            65504.0,
        ];
        let mut b = [bf16::ZERO; 4];
        bf16::narrow(&src, &mut b);
        assert_eq!(b[0].to_f32(), 1.0);
        assert_eq!(b[1].to_f32(), 1.0 + 2f32.powi(-7));
        assert_eq!(bf16::widen(&b, 1.0)[2], -2.5);
        let mut h = [f16::ZERO; 4];
        f16::narrow(&src, &mut h);
        assert_eq!(f16::widen(&h, 1.0)[3], 65504.0);
        assert_eq!(f16::widen(&h, 0.5)[2], -1.25);
        assert!(matches!(f32::widen(&src, 1.0), Cow::Borrowed(_)));
        assert_eq!(f32::widen(&src, 2.0)[2], -5.0);
    }
}
