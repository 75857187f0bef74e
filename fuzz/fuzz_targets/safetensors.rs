#![no_main]

#[path = "../harness/alloc_cap.rs"]
mod alloc_cap;
#[path = "../harness/safetensors.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
