//! One rank: every collective is the identity.

use crate::Collective;

/// The collective of a job with one rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn describe(&self) -> String {
        "solo (one rank)".into()
    }
    fn all_reduce_sum_f32(&self, _buf: &mut [f32]) {}
    fn all_reduce_sum_f64(&self, _buf: &mut [f64]) {}
    fn all_reduce_max_u64(&self, _buf: &mut [u64]) {}
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        vec![value]
    }
    fn broadcast_bytes(&self, _root: usize, _buf: &mut [u8]) {}
    fn barrier(&self) {}
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
    fn split(&self, _color: usize, _key: usize) -> Box<dyn Collective> {
        Box::new(Solo)
    }
    fn concurrent(&self) -> bool {
        true
    }
}
