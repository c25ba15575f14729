//! Positioned vectored I/O (`pwritev` / `preadv`) that completes short
//! transfers: a batch's records go to a segment in one call from the
//! caller's buffers, and a load reads a record's head with the first piece
//! of its payload in one call (into the caller's region, or into the
//! loading thread's read buffer on CPUs with the fused check: see
//! `read.rs`).

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;

/// The most buffers one call takes (Linux's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

fn offset_arg(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset out of range"))
}

/// Writes every byte of `bufs`, in order, at `offset` of `file`.
///
/// # Errors
/// The operating system's error; [`io::ErrorKind::WriteZero`] if the file
/// takes no more bytes. Bytes before the error may have been written.
pub(crate) fn write_all_at(
    file: &File,
    mut bufs: &mut [IoSlice<'_>],
    mut offset: u64,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let count = bufs.len().min(MAX_IOVECS);
        // SAFETY: `IoSlice` is ABI-compatible with `iovec` on Unix, and each
        // of the first `count` entries describes a live, readable buffer
        // borrowed for this call.
        let written = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                bufs.as_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                offset_arg(offset)?,
            )
        };
        match usize::try_from(written) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                offset += n as u64;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(())
}

/// Fills every byte of `bufs`, in order, from `offset` of `file`.
///
/// # Errors
/// The operating system's error; [`io::ErrorKind::UnexpectedEof`] if the
/// file ends first (the buffers then hold what was read).
pub(crate) fn read_exact_at(
    file: &File,
    mut bufs: &mut [IoSliceMut<'_>],
    mut offset: u64,
) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let count = bufs.len().min(MAX_IOVECS);
        // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on Unix, and
        // each of the first `count` entries describes a live buffer borrowed
        // mutably for this call, so the kernel may write all of it.
        let read = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                bufs.as_mut_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                offset_arg(offset)?,
            )
        };
        match usize::try_from(read) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                offset += n as u64;
                IoSliceMut::advance_slices(&mut bufs, n);
            }
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_buffers_round_trip_past_the_iovec_limit() {
        let file = tempfile::tempfile().unwrap();
        let pieces: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| vec![(i % 251) as u8; (i % 7) as usize])
            .collect();
        let mut slices: Vec<IoSlice<'_>> = pieces.iter().map(|p| IoSlice::new(p)).collect();
        write_all_at(&file, &mut slices, 5).unwrap();
        let mut back: Vec<Vec<u8>> = pieces.iter().map(|p| vec![0; p.len()]).collect();
        let mut slices: Vec<IoSliceMut<'_>> = back.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        read_exact_at(&file, &mut slices, 5).unwrap();
        assert_eq!(back, pieces);
        let mut past = [0u8; 4];
        let err = read_exact_at(&file, &mut [IoSliceMut::new(&mut past)], 1 << 30).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
