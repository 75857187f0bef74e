//! A global allocator that aborts on any single allocation larger than [`CAP`].
//!
//! Without a sanitizer, libFuzzer only sees memory that is touched (its RSS limit), and a
//! `Vec::with_capacity(len_from_the_file)` of 8 GiB is not touched until it is filled. The cap
//! turns such an allocation from a length field into an immediate crash with the size, so the
//! fuzzer reports it and saves the input. Shared by the fuzz targets and the corpus tests
//! (each binary includes this file once, with `#[path]`).

use std::alloc::{GlobalAlloc, Layout, System};

/// The largest single allocation a parser of a small file may make.
pub const CAP: usize = 256 << 20;

pub struct CappedAlloc;

fn refuse(size: usize) -> ! {
    // No allocation here: format into a stack buffer and write it raw to stderr.
    let mut buf = [0u8; 96];
    let msg = b"alloc_cap: refused a single allocation of ";
    let mut n = msg.len();
    buf[..n].copy_from_slice(msg);
    let mut digits = [0u8; 20];
    let mut d = 0;
    let mut v = size;
    loop {
        digits[d] = b'0' + (v % 10) as u8;
        d += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    while d > 0 {
        d -= 1;
        buf[n] = digits[d];
        n += 1;
    }
    let tail = b" bytes (unbounded allocation from input)\n";
    let end = (n + tail.len()).min(buf.len());
    buf[n..end].copy_from_slice(&tail[..end - n]);
    // SAFETY: writing a valid buffer to fd 2.
    unsafe {
        libc_write(2, buf.as_ptr(), end);
    }
    std::process::abort()
}

unsafe extern "C" {
    #[link_name = "write"]
    fn libc_write(fd: i32, buf: *const u8, count: usize) -> isize;
}

// SAFETY: forwards to the system allocator; only refuses (aborting) oversized requests.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            refuse(layout.size());
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            refuse(layout.size());
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > CAP {
            refuse(new_size);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc;
