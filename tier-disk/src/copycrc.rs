//! Copying a payload out of a read buffer while computing its crc32 in the
//! same pass.
//!
//! A load that checks its payload pays for the check in a second pass over
//! the bytes: the kernel's copy into the region, then crc32 over it. On a
//! CPU with AVX-512 and `VPCLMULQDQ` the load instead reads each piece into
//! a small buffer that stays in the core's L2 cache, and [`copy_crc`] moves
//! it to the region with non-temporal stores, folding every 64-byte vector
//! into the crc as it passes through the registers. The kernel's copy then
//! writes to cache instead of memory and the check costs little beyond the
//! copy (measured in `read.rs`'s `READ_PIECE` comment).
//!
//! The folding is the one `crc32fast` runs on such a CPU (16 streams in four
//! registers, folded by 2,048 bits; the constants and the final Barrett
//! reduction are taken from crc32fast 1.5, MIT or Apache-2.0, which cites
//! libdeflate and the Linux kernel for the math); only the stores are new.
//! Everything else (other CPUs, the bytes before the destination's first
//! 64-byte boundary, a tail shorter than 256 bytes, and copies whose
//! aligned body is under 4 KiB) goes through a plain copy and `crc32fast`.

/// Whether [`copy_crc`] fuses the copy and the crc on this CPU (x86-64
/// with AVX-512F and `VPCLMULQDQ`); checked once.
pub(crate) fn fused() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static FUSED: OnceLock<bool> = OnceLock::new();
        *FUSED.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
                && std::arch::is_x86_feature_detected!("pclmulqdq")
                && std::arch::is_x86_feature_detected!("sse2")
                && std::arch::is_x86_feature_detected!("ssse3")
                && std::arch::is_x86_feature_detected!("sse4.1")
                && std::arch::is_x86_feature_detected!("avx")
                && std::arch::is_x86_feature_detected!("avx2")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `src` into `dst` and returns the crc32 of `src` continued from
/// `crc` (what `crc32fast::Hasher::new_with_initial(crc)`, updated with
/// `src`, finalizes to; 0 starts a new checksum). Fused on CPUs where
/// [`fused`] holds, a copy and `crc32fast` otherwise.
///
/// # Panics
/// If the lengths differ (a bug of the caller's).
pub(crate) fn copy_crc(crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
    assert_eq!(src.len(), dst.len(), "copy_crc: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if fused() {
        // SAFETY: `fused()` checked every feature `x86::copy_crc` enables.
        return unsafe { x86::copy_crc(crc, src, dst) };
    }
    plain(crc, src, dst)
}

/// The copy and the crc in two passes.
fn plain(crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
    dst.copy_from_slice(src);
    let mut hasher = crc32fast::Hasher::new_with_initial(crc);
    hasher.update(src);
    hasher.finalize()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64 as arch;

    // See crc32fast's `specialized/pclmulqdq.rs`: fold constants for a fold
    // by `D` bits are `(reflect(x^(D+32) mod P), reflect(x^(D-32) mod P))`.
    /// Fold by 128 bits.
    const K3: i64 = 0x1751997d0;
    const K4: i64 = 0x0ccaa009e;
    /// Fold by 2,048 bits (16 streams of 128).
    const K_2048_LOW: i64 = 0x11542778a;
    const K_2048_HIGH: i64 = 0x1322d1430;
    /// Barrett reduction: `floor(x^95 / G(x))` and `G(x)`, bit-reflected.
    const BARRETT_MU: i64 = 0xb4e5b025f7011641_u64 as i64;
    const BARRETT_G: i64 = 0x1db710641;

    /// Below this many bytes after alignment, the plain copy and crc: the
    /// streams' set-up and collapse cost more than they save.
    const MIN_FUSED: usize = 4096;

    /// [`super::copy_crc`] on a CPU with the features enabled here: the
    /// bytes up to `dst`'s first 64-byte boundary and any tail of fewer
    /// than 256 bytes plainly, the rest fused.
    ///
    /// # Safety
    /// The CPU has every feature this function enables; `src` and `dst`
    /// have the same length.
    #[target_feature(enable = "pclmulqdq,sse2,sse4.1,ssse3,avx,avx2,vpclmulqdq,avx512f")]
    pub(super) unsafe fn copy_crc(mut crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        let body = (dst.len() - head) / 256 * 256;
        if body < MIN_FUSED {
            return super::plain(crc, src, dst);
        }
        let (src_head, rest) = src.split_at(head);
        let (src_body, src_tail) = rest.split_at(body);
        let (dst_head, rest) = dst.split_at_mut(head);
        let (dst_body, dst_tail) = rest.split_at_mut(body);
        crc = super::plain(crc, src_head, dst_head);
        // SAFETY: the features are the caller's promise; `dst_body` starts
        // at a 64-byte boundary and both bodies are `body` bytes, a
        // non-zero multiple of 256.
        crc = unsafe { fold(crc, src_body, dst_body) };
        super::plain(crc, src_tail, dst_tail)
    }

    /// Copies `src` to `dst` with non-temporal stores and returns the crc,
    /// continued from `crc`.
    ///
    /// # Safety
    /// The CPU has the features enabled here; `dst` starts at a 64-byte
    /// boundary; both slices are the same non-zero multiple of 256 bytes.
    #[target_feature(enable = "pclmulqdq,sse2,sse4.1,ssse3,avx,avx2,vpclmulqdq,avx512f")]
    unsafe fn fold(crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
        debug_assert!(src.len() == dst.len() && src.len() >= 256 && src.len().is_multiple_of(256));
        debug_assert_eq!(dst.as_ptr().align_offset(64), 0);
        let vectors = src.len() / 64;
        let from = src.as_ptr().cast::<arch::__m512i>();
        let to = dst.as_mut_ptr().cast::<arch::__m512i>();
        // SAFETY (both closures): `i < vectors`, so the 64 bytes at vector
        // `i` lie inside `src` (read unaligned) and inside `dst`, whose
        // vectors are 64-byte aligned as the stream store needs.
        let load = |i: usize| unsafe { arch::_mm512_loadu_si512(from.add(i).cast()) };
        let store =
            |i: usize, v: arch::__m512i| unsafe { arch::_mm512_stream_si512(to.add(i).cast(), v) };

        let mut v0 = load(0);
        let mut v1 = load(1);
        let mut v2 = load(2);
        let mut v3 = load(3);
        store(0, v0);
        store(1, v1);
        store(2, v2);
        store(3, v3);
        // The initial crc goes into the lowest-offset stream.
        v0 = arch::_mm512_xor_si512(
            v0,
            arch::_mm512_castsi128_si512(arch::_mm_cvtsi32_si128(!crc as i32)),
        );
        let k = arch::_mm512_set_epi64(
            K_2048_HIGH,
            K_2048_LOW,
            K_2048_HIGH,
            K_2048_LOW,
            K_2048_HIGH,
            K_2048_LOW,
            K_2048_HIGH,
            K_2048_LOW,
        );
        let mut i = 4;
        while i + 4 <= vectors {
            let (a, b, c, d) = (load(i), load(i + 1), load(i + 2), load(i + 3));
            store(i, a);
            store(i + 1, b);
            store(i + 2, c);
            store(i + 3, d);
            v0 = fold512(v0, a, k);
            v1 = fold512(v1, b, k);
            v2 = fold512(v2, c, k);
            v3 = fold512(v3, d, k);
            i += 4;
        }
        // The stream stores are weakly ordered: they complete before
        // anything this thread writes after (the job's report).
        arch::_mm_sfence();

        // Collapse the 16 streams in increasing byte offset, each folded
        // into the next by 128 bits, then reduce 128 bits to 32.
        let k3k4 = arch::_mm_set_epi64x(K4, K3);
        let mut x = arch::_mm512_castsi512_si128(v0);
        x = fold128(x, arch::_mm512_extracti32x4_epi32::<1>(v0), k3k4);
        x = fold128(x, arch::_mm512_extracti32x4_epi32::<2>(v0), k3k4);
        x = fold128(x, arch::_mm512_extracti32x4_epi32::<3>(v0), k3k4);
        for v in [v1, v2, v3] {
            x = fold128(x, arch::_mm512_castsi512_si128(v), k3k4);
            x = fold128(x, arch::_mm512_extracti32x4_epi32::<1>(v), k3k4);
            x = fold128(x, arch::_mm512_extracti32x4_epi32::<2>(v), k3k4);
            x = fold128(x, arch::_mm512_extracti32x4_epi32::<3>(v), k3k4);
        }
        let x = arch::_mm_xor_si128(
            arch::_mm_clmulepi64_si128::<0x10>(x, k3k4),
            arch::_mm_srli_si128::<8>(x),
        );
        let barrett = arch::_mm_set_epi64x(BARRETT_G, BARRETT_MU);
        let t = arch::_mm_clmulepi64_si128::<0x00>(x, barrett);
        let t = arch::_mm_clmulepi64_si128::<0x10>(t, barrett);
        !(arch::_mm_extract_epi32::<2>(arch::_mm_xor_si128(x, t)) as u32)
    }

    /// `a` folded forward by 128 bits (per 128-bit lane) into `b`.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold128(a: arch::__m128i, b: arch::__m128i, keys: arch::__m128i) -> arch::__m128i {
        let t1 = arch::_mm_clmulepi64_si128::<0x00>(a, keys);
        let t2 = arch::_mm_clmulepi64_si128::<0x11>(a, keys);
        arch::_mm_xor_si128(arch::_mm_xor_si128(b, t1), t2)
    }

    /// `a` folded forward by 2,048 bits (per 128-bit lane) into `b`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold512(a: arch::__m512i, b: arch::__m512i, keys: arch::__m512i) -> arch::__m512i {
        let t1 = arch::_mm512_clmulepi64_epi128::<0x00>(a, keys);
        let t2 = arch::_mm512_clmulepi64_epi128::<0x11>(a, keys);
        // b ^ t1 ^ t2 in one instruction.
        arch::_mm512_ternarylogic_epi64::<0x96>(b, t1, t2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the bytes around a destination hold, to catch a store past it.
    const GUARD: u8 = 0xA5;

    fn expected(crc: u32, data: &[u8]) -> u32 {
        let mut h = crc32fast::Hasher::new_with_initial(crc);
        h.update(data);
        h.finalize()
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    /// Both forms, at lengths around every boundary the fused form has
    /// (its minimum, 256-byte steps, 64-byte alignment) and from every
    /// alignment of the destination within a cache line.
    #[test]
    fn copies_and_checksums_like_crc32fast_at_every_boundary() {
        if !fused() {
            eprintln!("copycrc: no AVX-512 VPCLMULQDQ here; only the plain copy is checked");
        }
        let src = bytes(3 << 20, 7);
        let mut dst = vec![0u8; (3 << 20) + 512];
        let lengths = [
            0usize,
            1,
            63,
            64,
            255,
            256,
            4095,
            4096,
            4097,
            4096 + 63,
            4096 + 64,
            4096 + 255,
            4096 + 256,
            8191,
            65536 + 13,
            (512 << 10) + 1,
            2 << 20,
            (2 << 20) + 100,
        ];
        for len in lengths {
            for dst_at in [0usize, 1, 7, 32, 63, 64] {
                for src_at in [0usize, 3] {
                    for init in [0u32, 0xdead_beef] {
                        let s = &src[src_at..src_at + len];
                        let at = dst.as_ptr().align_offset(64) + dst_at;
                        // Guard bands of 256 bytes on each side (the
                        // destination starts at most 127 bytes in).
                        let before = at.saturating_sub(256)..at;
                        let after = at + len..(at + len + 256).min(dst.len());
                        dst[before.clone()].fill(GUARD);
                        dst[after.clone()].fill(GUARD);
                        let d = &mut dst[at..at + len];
                        d.fill(0);
                        assert_eq!(
                            copy_crc(init, s, d),
                            expected(init, s),
                            "len {len} dst {dst_at} src {src_at}"
                        );
                        assert!(d == s, "copy differs: len {len} dst {dst_at}");
                        assert!(
                            dst[before].iter().chain(&dst[after]).all(|&b| b == GUARD),
                            "written outside the destination: len {len} dst {dst_at}"
                        );
                        let d = &mut dst[at..at + len];
                        d.fill(0);
                        assert_eq!(plain(init, s, d), expected(init, s));
                        assert!(d == s);
                    }
                }
            }
        }
    }

    /// A crc continued piece by piece equals the crc of the whole.
    #[test]
    fn pieces_continue_one_checksum() {
        let src = bytes(3 << 20, 11);
        let mut dst = vec![0u8; src.len()];
        let mut crc = 0;
        for (s, d) in src.chunks(300_007).zip(dst.chunks_mut(300_007)) {
            crc = copy_crc(crc, s, d);
        }
        assert_eq!(crc, crc32fast::hash(&src));
        assert!(dst == src);
    }

    proptest! {
        #[test]
        fn any_length_alignment_and_start(
            len in 0usize..20_000,
            dst_at in 0usize..64,
            seed: u64,
            init: u32,
            flip in proptest::option::of(0usize..20_000),
        ) {
            let mut src = bytes(len, seed);
            if let Some(at) = flip.filter(|&at| at < len) {
                src[at] ^= 0x10;
            }
            let mut dst = vec![GUARD; len + 256];
            let base = dst.as_ptr().align_offset(64) + dst_at;
            let d = &mut dst[base..base + len];
            prop_assert_eq!(copy_crc(init, &src, d), expected(init, &src));
            prop_assert!(*d == src[..]);
            prop_assert!(dst[..base].iter().chain(&dst[base + len..]).all(|&b| b == GUARD));
        }
    }
}
