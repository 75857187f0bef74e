//! Causal grouped-query attention in CubeCL, flash-style: the `T x T` scores and
//! probabilities are never stored. Forward runs one unit per query row with an online softmax
//! and saves the row's log-sum-exp; backward recomputes each probability from it, one unit per
//! query row for `dq` (and the row's `D = dO . O`), then one unit per key row for `dk` and
//! `dv`, summing over the query rows of every head in its group. Memory beyond the inputs and
//! outputs: two floats per query row.
//!
//! Layouts (as the CPU kernel): `q` `[b, kv, groups * t, hd]` (the query heads that share a
//! K/V head stacked along the sequence, so row `r` is head `kv * groups + r / t` at position
//! `r % t`), `k` `[b, kv, t, hd]`, `v` `[b, t, kv * hd]`, output `[b, t, heads * hd]`.

use super::{dense, dims, elem, empty_like, launch_1d};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The sizes every attention kernel takes.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    kv: usize,
    groups: usize,
    t: usize,
    hd: usize,
}

impl Dims {
    fn of(q: &CubeTensor, k: &CubeTensor) -> Self {
        let (qd, kd) = (dims(q), dims(k));
        let t = kd[2].max(1);
        Dims {
            b: qd[0],
            kv: qd[1],
            groups: qd[2] / t,
            t,
            hd: qd[3],
        }
    }

    fn rows(&self) -> usize {
        self.b * self.kv * self.groups * self.t
    }

    fn keys(&self) -> usize {
        self.b * self.kv * self.t
    }
}

/// `q . k` over a head, in f32.
#[cube]
fn dot<F: Float>(a: &Tensor<F>, a_at: usize, b: &Tensor<F>, b_at: usize, hd: usize) -> f32 {
    let mut s = 0.0f32;
    for j in 0..hd {
        s += f32::cast_from(a[a_at + j]) * f32::cast_from(b[b_at + j]);
    }
    s
}

/// Where one query row's data lie: its position, the starts of its `q` row, of its K/V head's
/// keys and values (and the stride between value rows), and of its output row.
#[derive(CubeType)]
struct QueryRow {
    p: usize,
    qa: usize,
    kb: usize,
    vb: usize,
    vrow: usize,
    ob: usize,
}

/// Query row `u` of `[b, kv, groups * t]`: head `kv_index * groups + r / t`, position `r % t`.
#[cube]
fn query_row(u: usize, kv: u32, groups: u32, seq: u32, #[comptime] hd: usize) -> QueryRow {
    let (nkv, g, t) = (kv as usize, groups as usize, seq as usize);
    let r = u % (g * t);
    let bk = u / (g * t);
    let (kvi, b) = (bk % nkv, bk / nkv);
    let p = r % t;
    let head = kvi * g + r / t;
    let vrow = nkv * hd;
    QueryRow {
        p,
        qa: u * hd,
        kb: bk * t * hd,
        vb: b * t * vrow + kvi * hd,
        vrow,
        ob: (b * t + p) * nkv * g * hd + head * hd,
    }
}

#[cube(launch)]
fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    rows: u32,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[define(F)] _dtype: ElemType,
) {
    let u = ABSOLUTE_POS;
    if u >= rows as usize {
        terminate!();
    }
    let at = query_row(u, kv, groups, seq, hd);
    let (p, qa, kb, vb, vrow) = (at.p, at.qa, at.kb, at.vb, at.vrow);

    // Key 0 is always visible: it starts the running max, so no infinity is needed.
    let mut m = dot::<F>(q, qa, k, kb, hd) * scale;
    let mut l = 1.0f32;
    let mut acc = Array::<f32>::new(hd);
    for j in 0..hd {
        acc[j] = f32::cast_from(v[vb + j]);
    }
    for key in 1..p + 1 {
        let s = dot::<F>(q, qa, k, kb + key * hd, hd) * scale;
        let m_new = f32::max(m, s);
        let keep = (m - m_new).exp();
        let e = (s - m_new).exp();
        l = l * keep + e;
        for j in 0..hd {
            acc[j] = acc[j] * keep + e * f32::cast_from(v[vb + key * vrow + j]);
        }
        m = m_new;
    }
    for j in 0..hd {
        out[at.ob + j] = F::cast_from(acc[j] / l);
    }
    lse[u] = m + l.ln();
}

/// One unit per query row: `D = dO . O` (saved for the key kernel) and
/// `dq = scale * sum_k p (dO . v_k - D) k_k`.
#[cube(launch)]
fn attention_dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dq: &mut Tensor<F>,
    rows: u32,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[define(F)] _dtype: ElemType,
) {
    let u = ABSOLUTE_POS;
    if u >= rows as usize {
        terminate!();
    }
    let at = query_row(u, kv, groups, seq, hd);
    let (p, qa, kb, vb, vrow, ob) = (at.p, at.qa, at.kb, at.vb, at.vrow, at.ob);

    let d = dot::<F>(dout, ob, out, ob, hd);
    delta[u] = d;
    let row_lse = lse[u];
    let mut acc = Array::<f32>::new(hd);
    for j in 0..hd {
        acc[j] = 0.0f32;
    }
    for key in 0..p + 1 {
        let prob = (dot::<F>(q, qa, k, kb + key * hd, hd) * scale - row_lse).exp();
        let ds = prob * (dot::<F>(dout, ob, v, vb + key * vrow, hd) - d);
        for j in 0..hd {
            acc[j] += ds * f32::cast_from(k[kb + key * hd + j]);
        }
    }
    for j in 0..hd {
        dq[qa + j] = F::cast_from(acc[j] * scale);
    }
}

/// One unit per key row: `dv_k = sum_r p dO_r` and `dk_k = scale * sum_r p (dO_r . v_k - D_r)
/// q_r` over the query rows of every head in the group that see key `k`.
#[cube(launch)]
fn attention_dkv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    keys: u32,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[define(F)] _dtype: ElemType,
) {
    let w = ABSOLUTE_POS;
    if w >= keys as usize {
        terminate!();
    }
    let (nkv, g, t) = (kv as usize, groups as usize, seq as usize);
    let key = w % t;
    let bk = w / t;
    let (kvi, b) = (bk % nkv, bk / nkv);
    let ka = w * hd;
    let vrow = nkv * hd;
    let va = (b * t + key) * vrow + kvi * hd;
    let mut dk_acc = Array::<f32>::new(hd);
    let mut dv_acc = Array::<f32>::new(hd);
    for j in 0..hd {
        dk_acc[j] = 0.0f32;
        dv_acc[j] = 0.0f32;
    }
    for gi in 0..g {
        let head = kvi * g + gi;
        for p in key..t {
            let u = bk * g * t + gi * t + p;
            let qa = u * hd;
            let ob = (b * t + p) * nkv * g * hd + head * hd;
            let prob = (dot::<F>(q, qa, k, ka, hd) * scale - lse[u]).exp();
            let ds = prob * (dot::<F>(dout, ob, v, va, hd) - delta[u]);
            for j in 0..hd {
                dv_acc[j] += prob * f32::cast_from(dout[ob + j]);
                dk_acc[j] += ds * f32::cast_from(q[qa + j]);
            }
        }
    }
    for j in 0..hd {
        dk[ka + j] = F::cast_from(dk_acc[j] * scale);
        dv[va + j] = F::cast_from(dv_acc[j]);
    }
}

/// `(output, log-sum-exp per query row)`.
pub(super) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
) -> (CubeTensor, CubeTensor) {
    let (q, k, v) = (dense(q), dense(k), dense(v));
    let d = Dims::of(&q, &k);
    let out = empty_like(&q, [d.b, d.t, d.kv * d.groups * d.hd]);
    let lse = super::f32_vector(&q, d.rows());
    let (count, dim) = launch_1d(d.rows());
    attention_forward_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        d.rows() as u32,
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        elem(&q),
    );
    (out, lse)
}

/// The saved state: `q`, `k`, `v`, the output, its log-sum-exp, the scale.
type Saved = (
    CubeTensor,
    CubeTensor,
    CubeTensor,
    CubeTensor,
    CubeTensor,
    f64,
);

/// `(dq, dk, dv)` for the upstream gradient `dout`.
fn backward(dout: CubeTensor, saved: Saved) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (q, k, v, out, lse, scale) = saved;
    let dout = dense(dout);
    let d = Dims::of(&q, &k);
    let (dq, dk, dv) = (
        empty_like(&q, dims(&q)),
        empty_like(&k, dims(&k)),
        empty_like(&v, dims(&v)),
    );
    let delta = super::f32_vector(&q, d.rows());
    let (count, dim) = launch_1d(d.rows());
    attention_dq_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        d.rows() as u32,
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        elem(&q),
    );
    let (count, dim) = launch_1d(d.keys());
    attention_dkv_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        dout.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        d.keys() as u32,
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        elem(&q),
    );
    (dq, dk, dv)
}

/// Attention recorded as one autodiff op.
pub(super) fn autodiff<C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<CubeBackend, C>>,
    k: FloatTensor<Autodiff<CubeBackend, C>>,
    v: FloatTensor<Autodiff<CubeBackend, C>>,
    scale: f64,
) -> FloatTensor<Autodiff<CubeBackend, C>> {
    #[derive(Debug)]
    struct AttentionBackward;

    impl Backward<CubeBackend, 3> for AttentionBackward {
        type State = Saved;

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [nq, nk, nv] = ops.parents;
            let dout = grads.consume::<CubeBackend>(&ops.node);
            let (dq, dk, dv) = backward(dout, ops.state);
            for (node, g) in [(nq, dq), (nk, dk), (nv, dv)] {
                if let Some(node) = node {
                    grads.register::<CubeBackend>(node.id, g);
                }
            }
        }
    }

    match AttentionBackward
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (q, k, v) = (
                dense(q.primitive().clone()),
                dense(k.primitive().clone()),
                dense(v.primitive().clone()),
            );
            let (out, lse) = forward(q.clone(), k.clone(), v.clone(), scale);
            prep.finish((q, k, v, out.clone(), lse, scale), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(
            forward(
                q.primitive().clone(),
                k.primitive().clone(),
                v.primitive().clone(),
                scale,
            )
            .0,
        ),
    }
}
