//! Host memory a transfer job copies from or into: the [`HostBuffer`]
//! contract, [`HostMemory`] (writable memory the core allocates), and
//! [`Region`]s of a buffer.

use std::alloc::Layout;
use std::ptr::NonNull;

/// Memory a [`TransferQueue`](super::TransferQueue) job reads blocks from
/// (a store) or writes blocks into (a load), held by the job until it ends.
///
/// The queue runs jobs in the background, so it cannot borrow the caller's
/// memory: it holds an `Arc<dyn HostBuffer>` instead, and keeps it until
/// the job's I/O has stopped touching the memory (after which the report
/// is published). Implemented here for `Vec<u8>`, `Box<[u8]>` and
/// `Arc<[u8]>` (read-only: store jobs) and for [`HostMemory`] (writable);
/// a binding implements it for memory it holds (a Python `Py_buffer`).
///
/// # Safety
///
/// An implementation promises, for as long as the value lives:
///
/// 1. [`as_ptr`](Self::as_ptr) and [`len`](Self::len) always return the
///    same values, and the `len()` bytes at `as_ptr()` stay allocated and
///    readable (and, when [`is_writable`](Self::is_writable), writable), at
///    that address, however the object they came from is used meanwhile.
///    Dropping the value may free them.
/// 2. When `is_writable()` is true, writing through the pointer from any
///    thread is allowed: the bytes are not behind a shared Rust reference
///    (`&[u8]`) that anyone holds, so the memory is not owned as plain
///    `Vec<u8>` data that others can borrow (use [`HostMemory`], or memory
///    Rust does not own).
/// 3. While a job runs, nothing outside the queue writes the bytes of its
///    regions, nor reads those of a load job's regions. The queue checks
///    its own jobs against each other (see
///    [`SubmitError::Busy`](super::SubmitError::Busy)); the rest is the
///    duty of whoever hands the buffer over (vLLM pins the rows of a job
///    until its result is collected), and an implementation for a foreign
///    runtime documents it.
pub unsafe trait HostBuffer: Send + Sync + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *const u8;
    /// How many bytes.
    fn len(&self) -> usize;
    /// Whether load jobs may write into the buffer.
    fn is_writable(&self) -> bool;
    /// Whether the buffer has no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: the queue holds the vector inside an `Arc` and never writes it
// (read-only); its heap memory does not move while nobody can mutate it.
unsafe impl HostBuffer for Vec<u8> {
    fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn is_writable(&self) -> bool {
        false
    }
}

// SAFETY: as for `Vec<u8>`: read-only, and immovable while shared.
unsafe impl HostBuffer for Box<[u8]> {
    fn as_ptr(&self) -> *const u8 {
        <[u8]>::as_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn is_writable(&self) -> bool {
        false
    }
}

// SAFETY: as for `Vec<u8>`: read-only, and immovable while shared.
unsafe impl HostBuffer for std::sync::Arc<[u8]> {
    fn as_ptr(&self) -> *const u8 {
        <[u8]>::as_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn is_writable(&self) -> bool {
        false
    }
}

/// Writable host memory for transfer jobs: a zeroed, page-aligned
/// allocation that load jobs write into and store jobs read from.
///
/// Share it as `Arc<HostMemory>` with the queue. Its bytes are read or
/// written by your code only through `&mut self`
/// ([`as_mut_slice`](Self::as_mut_slice)), which
/// [`Arc::get_mut`](std::sync::Arc::get_mut) grants once no job holds the
/// memory any more (a job lets go before its report is published, so
/// after [`TransferQueue::drain`](super::TransferQueue::drain), or once
/// every job on it is polled), or through the `unsafe`
/// [`slice`](Self::slice) while jobs run on other regions.
///
/// ```
/// use std::sync::Arc;
/// use kvtier_core::HostMemory;
///
/// let mut rows = Arc::new(HostMemory::zeroed(4 * 4096)?);
/// Arc::get_mut(&mut rows).expect("no job holds it").as_mut_slice()[..5].copy_from_slice(b"hello");
/// # Ok::<(), kvtier_core::HostAllocError>(())
/// ```
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain bytes with no thread affinity; access is governed by the
// `HostBuffer` contract and `&mut self`.
unsafe impl Send for HostMemory {}
// SAFETY: as above; shared access hands out no reference without `unsafe`.
unsafe impl Sync for HostMemory {}

/// The alignment of [`HostMemory`]: a page, as `O_DIRECT` I/O wants.
const PAGE: usize = 4096;

impl HostMemory {
    /// `len` zero bytes, aligned to 4 KiB.
    ///
    /// # Errors
    /// When the memory cannot be allocated (or `len` is too large to lay out).
    pub fn zeroed(len: usize) -> Result<Self, HostAllocError> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len,
            });
        }
        let layout = Layout::from_size_align(len, PAGE).map_err(|_| HostAllocError { len })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        match NonNull::new(raw) {
            Some(ptr) => Ok(Self { ptr, len }),
            None => Err(HostAllocError { len }),
        }
    }

    /// The bytes, for your code alone (no job can hold `&mut self`'s memory).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `len` initialised bytes (zeroed at allocation)
        // owned by `self`, borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, read while jobs may hold the memory.
    ///
    /// # Safety
    /// No load job may be writing into the bytes read through the slice
    /// while it lives (none queued or running with a region overlapping
    /// them), and nothing may write them through another path.
    pub unsafe fn slice(&self) -> &[u8] {
        // SAFETY: the caller promises no write happens while it lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

/// [`HostMemory::zeroed`] could not allocate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot allocate {len} bytes of host memory")]
pub struct HostAllocError {
    /// The bytes asked for.
    pub len: usize,
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if let Ok(layout) = Layout::from_size_align(self.len, PAGE) {
            // SAFETY: allocated in `zeroed` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

// SAFETY: the allocation is owned by the value, never moves, lives until
// it drops, and is never behind a Rust reference except through `&mut
// self` (which no job can hold while it shares the value) or the `unsafe`
// `slice`, whose caller promises no write meanwhile.
unsafe impl HostBuffer for HostMemory {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn is_writable(&self) -> bool {
        true
    }
}

/// Bytes `offset..offset + len` of a job's buffer: where one key's block
/// is read from (store) or written into (load).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// The first byte, from the start of the buffer.
    pub offset: usize,
    /// How many bytes.
    pub len: usize,
}

impl Region {
    /// Bytes `offset..offset + len`.
    pub fn new(offset: usize, len: usize) -> Self {
        Self { offset, len }
    }

    /// Row `row` of a buffer of rows of `row_bytes` each (vLLM's chunk ids
    /// over its `(num_chunks, row_bytes)` view), or `None` if its offset
    /// overflows.
    pub fn row(row: usize, row_bytes: usize) -> Option<Self> {
        Some(Self::new(row.checked_mul(row_bytes)?, row_bytes))
    }

    /// [`Region::row`] of each row, or `None` if an offset overflows.
    pub fn rows(rows: impl IntoIterator<Item = usize>, row_bytes: usize) -> Option<Vec<Self>> {
        rows.into_iter().map(|r| Self::row(r, row_bytes)).collect()
    }

    /// One past the last byte, or `None` on overflow.
    pub fn end(&self) -> Option<usize> {
        self.offset.checked_add(self.len)
    }
}
