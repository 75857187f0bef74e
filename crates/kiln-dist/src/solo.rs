//! One rank: every collective is the identity.

use crate::collective::Collective;
use std::cell::RefCell;
use std::collections::VecDeque;

thread_local! {
    /// What this rank sent to itself and has not received yet ([`Collective::send_f32`]
    /// to rank 0 of a one-rank job), in order.
    static SENT: RefCell<VecDeque<Vec<f32>>> = const { RefCell::new(VecDeque::new()) };
}

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
    fn all_reduce_max_f32(&self, _buf: &mut [f32]) {}
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        vec![value]
    }
    fn all_to_allv_f32(&self, send: &[f32], _: &[usize], recv: &mut [f32], _: &[usize]) {
        recv.copy_from_slice(send);
    }
    fn send_recv_f32(&self, _to: usize, send: &[f32], _from: usize, recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn send_f32(&self, _to: usize, buf: &[f32]) {
        SENT.with(|q| q.borrow_mut().push_back(buf.to_vec()));
    }
    fn recv_f32(&self, _from: usize, buf: &mut [f32]) {
        // A receive with nothing sent would wait for ever on a real engine; here it leaves
        // `buf` as it is (a contract error of the caller, as MPI's would be a hang).
        if let Some(sent) = SENT.with(|q| q.borrow_mut().pop_front()) {
            buf.copy_from_slice(&sent);
        }
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
