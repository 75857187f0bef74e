//! Collectives the model calls inside its forward pass, each recorded as one autodiff op whose
//! backward step is the dual collective (Megatron's f and g operators): what tensor and
//! sequence parallelism put between a layer's local computation and the ranks' shares of it.
//!
//! | [`Flow`] | forward | backward |
//! | --- | --- | --- |
//! | `CopyTo` | identity | sum over the group |
//! | `ReduceFrom` | sum over the group | identity |
//! | `GatherRows` | every rank's rows, in rank order (all-gather) | this rank's block of the summed gradient (reduce-scatter) |
//! | `ScatterRows` | this rank's block of the sum (reduce-scatter) | every rank's rows (all-gather) |
//!
//! Rows are the first dim (a token's activations, `[tokens, d]`): blocks of rows are
//! contiguous, so no collective permutes memory. Every rank of the group makes the same calls
//! in the same order (the model's ops are the same on every rank, and burn's backward pass
//! walks the same graph in the same order), forward and backward.
//!
//! The values travel through host memory over the group's MPI communicator, one call per op,
//! whatever the device: an op here is generic over burn's backends ([`Exchanging`] for flex
//! and the CubeCL devices, and autodiff over each), not a kernel. A group of one rank records
//! nothing: every flow is then the identity.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use kiln_dist::Collective;
use std::sync::{Arc, Mutex, PoisonError};

/// What a differentiable collective does (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Identity forward, sum backward.
    CopyTo,
    /// Sum forward, identity backward.
    ReduceFrom,
    /// All-gather of rows forward, reduce-scatter backward.
    GatherRows,
    /// Reduce-scatter of rows forward, all-gather backward.
    ScatterRows,
}

/// One movement of values over a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    Identity,
    Sum,
    Gather,
    ReduceScatter,
}

impl Flow {
    /// The forward and the backward movement.
    fn moves(self) -> (Move, Move) {
        match self {
            Flow::CopyTo => (Move::Identity, Move::Sum),
            Flow::ReduceFrom => (Move::Sum, Move::Identity),
            Flow::GatherRows => (Move::Gather, Move::ReduceScatter),
            Flow::ScatterRows => (Move::ReduceScatter, Move::Gather),
        }
    }
}

/// A communicator the differentiable collectives go over: a group of its own (split from the
/// group it is made of, so that its calls never interleave with that group's), shared by the
/// ops the forward pass records until their backward steps have run.
#[derive(Clone)]
pub struct Group {
    comm: Arc<Mutex<Box<dyn Collective>>>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank, self.size)
    }
}

impl Group {
    /// A group of `of`'s ranks (every rank of `of` calls it: it splits `of`).
    pub fn split(of: &dyn Collective) -> Self {
        let comm = of.split(0, of.rank());
        Self {
            rank: comm.rank(),
            size: comm.size(),
            comm: Arc::new(Mutex::new(comm)),
        }
    }

    /// One rank: every flow is the identity.
    pub fn solo() -> Self {
        Self {
            comm: Arc::new(Mutex::new(Box::new(kiln_dist::Solo))),
            rank: 0,
            size: 1,
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs `f` on the communicator.
    pub fn with<T>(&self, f: impl FnOnce(&dyn Collective) -> T) -> T {
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        f(comm.as_ref())
    }

    /// `values` (of `shape`, rows first) moved as `m` over the group, and their new shape.
    fn moved(&self, m: Move, mut values: Vec<f32>, shape: Shape) -> (Vec<f32>, Shape) {
        let n = self.size;
        let mut dims = shape.to_vec();
        match m {
            Move::Identity => (values, shape),
            Move::Sum => {
                self.with(|c| c.all_reduce_sum_f32(&mut values));
                (values, shape)
            }
            Move::Gather => {
                let mut all = vec![0.0f32; values.len() * n];
                self.with(|c| c.all_gather_f32(&values, &mut all));
                dims[0] *= n;
                (all, Shape::from(dims))
            }
            Move::ReduceScatter => {
                assert!(
                    dims[0].is_multiple_of(n),
                    "a reduce-scatter of {} rows over {n} ranks",
                    dims[0]
                );
                let mut mine = vec![0.0f32; values.len() / n];
                self.with(|c| c.reduce_scatter_sum_f32(&values, &mut mine));
                dims[0] /= n;
                (mine, Shape::from(dims))
            }
        }
    }
}

/// The op's arguments: the flow and the group.
#[derive(Debug, Clone)]
pub struct Exchange {
    flow: Flow,
    group: Group,
}

/// `x` moved as `m` over `group`, on `x`'s backend and device (through host memory, in f32;
/// the result in `x`'s dtype).
fn move_primitive<B: Backend>(
    x: B::FloatTensorPrimitive,
    m: Move,
    group: &Group,
) -> B::FloatTensorPrimitive {
    if m == Move::Identity {
        return x;
    }
    let (device, shape, dtype) = (x.device(), x.shape(), x.dtype());
    let data = burn::tensor::try_read_sync(B::float_into_data(x))
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("a differentiable collective could not read its tensor"));
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    let (values, shape) = group.moved(m, values, shape);
    let out = B::float_from_data(TensorData::new(values, shape), &device);
    match dtype {
        DType::F32 => out,
        other => B::float_cast(out, other.into()),
    }
}

/// The forward movement of `op` on a backend without autodiff.
fn forward<B: Backend>(x: B::FloatTensorPrimitive, op: &Exchange) -> B::FloatTensorPrimitive {
    move_primitive::<B>(x, op.flow.moves().0, &op.group)
}

/// `op` recorded as one autodiff op over backend `B`.
fn autodiff<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    op: Exchange,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct ExchangeBackward;

    impl<B: Backend> Backward<B, 1> for ExchangeBackward {
        type State = Exchange;

        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let dy = grads.consume::<B>(&ops.node);
            let op = ops.state;
            // Every rank makes the backward call, whether or not its input wants the
            // gradient: the other ranks' calls must be matched.
            let dx = move_primitive::<B>(dy, op.flow.moves().1, &op.group);
            let [parent] = ops.parents;
            if let Some(node) = parent {
                grads.register::<B>(node.id, dx);
            }
        }
    }

    match ExchangeBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = forward::<B>(x.primitive().clone(), &op);
            prep.finish(op, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward::<B>(x.primitive().clone(), &op)),
    }
}

/// The differentiable collectives as one op of every backend kiln trains on (forward), and of
/// autodiff over each (forward and the dual backward step).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait Exchanging: Backend {
    /// `x` moved as `op` says.
    fn kiln_exchange(x: FloatTensor<Self>, op: Exchange) -> FloatTensor<Self>;
}

impl Exchanging for Flex {
    fn kiln_exchange(x: FloatTensor<Self>, op: Exchange) -> FloatTensor<Self> {
        forward::<Flex>(x, &op)
    }
}

impl<C: CheckpointStrategy> Exchanging for Autodiff<Flex, C> {
    fn kiln_exchange(x: FloatTensor<Self>, op: Exchange) -> FloatTensor<Self> {
        autodiff::<Flex, C>(x, op)
    }
}

#[cfg(feature = "cube")]
impl Exchanging for burn_cubecl::CubeBackend {
    fn kiln_exchange(x: FloatTensor<Self>, op: Exchange) -> FloatTensor<Self> {
        forward::<burn_cubecl::CubeBackend>(x, &op)
    }
}

#[cfg(feature = "cube")]
impl<C: CheckpointStrategy> Exchanging for Autodiff<burn_cubecl::CubeBackend, C> {
    fn kiln_exchange(x: FloatTensor<Self>, op: Exchange) -> FloatTensor<Self> {
        autodiff::<burn_cubecl::CubeBackend, C>(x, op)
    }
}

/// `x` moved over `group` as `flow` says, recorded for autodiff (see the module
/// documentation); `x` itself when the group has one rank.
pub fn exchange<const D: usize>(x: Tensor<D>, flow: Flow, group: &Group) -> Tensor<D> {
    if group.size() == 1 {
        return x;
    }
    let op = Exchange {
        flow,
        group: group.clone(),
    };
    Tensor::from_dispatch(Dispatch::kiln_exchange(x.into_dispatch(), op))
}

/// The element-wise maximum of `x` over `group`, not differentiated (a constant to the
/// backward pass: what a softmax over the group's shares subtracts for stability).
pub fn max<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    let x = x.detach();
    if group.size() == 1 {
        return x;
    }
    let (device, dims) = (x.device(), x.dims());
    let mut values = x
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    group.with(|c| c.all_reduce_max_f32(&mut values));
    Tensor::from_data(TensorData::new(values, dims), &device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;
    use kiln_dist::Threads;

    fn on_ranks<T: Send>(ranks: usize, f: impl Fn(&Group) -> T + Sync) -> Vec<T> {
        Threads::each(ranks, |c| f(&Group::split(c)))
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    /// Rank `r`'s `[rows, 2]` input: `10 r + i` at element `i`.
    fn input(r: usize, rows: usize, d: &Device) -> Tensor<2> {
        let v: Vec<f32> = (0..rows * 2).map(|i| (10 * r + i) as f32).collect();
        Tensor::from_data(TensorData::new(v, [rows, 2]), d)
    }

    /// Each flow forward and backward on three ranks, against what the collectives say: the
    /// gradient of `sum(y * w)` with `w` rank-dependent weights is the dual movement of `w`.
    #[test]
    fn each_flow_moves_forward_and_its_dual_backward() {
        let out = on_ranks(3, |g| {
            let d = Device::flex();
            let r = g.rank();
            [
                Flow::CopyTo,
                Flow::ReduceFrom,
                Flow::GatherRows,
                Flow::ScatterRows,
            ]
            .map(|flow| {
                let rows = if flow == Flow::ScatterRows { 3 } else { 1 };
                let x = input(r, rows, &d).autodiff().require_grad();
                let y = exchange(x.clone(), flow, g);
                let w = Tensor::<2>::ones(y.dims(), &d).mul_scalar((r + 1) as f64);
                let grads = (y.clone() * w.autodiff()).sum().backward();
                let dx = x.grad(&grads).map(values).unwrap_or_default();
                (values(y.inner()), dx)
            })
        });
        for (r, [copy, reduce, gather, scatter]) in out.into_iter().enumerate() {
            let mine = [(10 * r) as f32, (10 * r + 1) as f32];
            // Copy-to: y = x; dx = sum over ranks of (s + 1) = 6.
            assert_eq!(copy, (mine.to_vec(), vec![6.0, 6.0]), "rank {r}");
            // Reduce-from: y = sum of x = [30, 33]; dx = this rank's w.
            let w = (r + 1) as f32;
            assert_eq!(reduce, (vec![30.0, 33.0], vec![w, w]), "rank {r}");
            // Gather: y = every rank's row; dx = the sum over ranks of w on this block.
            assert_eq!(gather.0, vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
            assert_eq!(gather.1, vec![6.0, 6.0], "rank {r}");
            // Scatter: y = block r of the sum of the ranks' 3 rows; dx = every rank's w.
            let sum: Vec<f32> = (0..6).map(|i| (30 + 3 * i) as f32).collect();
            assert_eq!(scatter.0, sum[2 * r..2 * r + 2].to_vec(), "rank {r}");
            assert_eq!(scatter.1, vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0], "rank {r}");
        }
    }

    #[test]
    fn one_rank_records_nothing_and_the_maximum_is_taken_over_ranks() {
        let d = Device::flex();
        let x = input(1, 2, &d);
        assert_eq!(
            values(exchange(x.clone(), Flow::GatherRows, &Group::solo())),
            values(x)
        );
        let got = on_ranks(2, |g| {
            let v = [g.rank() as f32, -(g.rank() as f32)];
            values(max(Tensor::<1>::from_floats(v, &Device::flex()), g))
        });
        assert_eq!(got, vec![vec![1.0, 0.0]; 2]);
    }
}
