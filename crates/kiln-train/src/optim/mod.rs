//! The optimizers behind one seam ([`Optimizer`]: AdamW, Muon, SophiaG, SPAM, Schedule-Free
//! AdamW, Mano), replicated or
//! sharded (a range of each parameter per rank), global gradient-norm clipping and the LR
//! schedules.
//!
//! Written here rather than taken from burn because burn's optimizers (a) key their state by
//! a per-process parameter id, which does not survive reloading weights (the restored state
//! silently fails to apply and resume diverges), (b) clip gradients per tensor rather than by
//! the global norm, and (c) default eps to 1e-5 where PyTorch uses 1e-8; burn has neither
//! Muon nor SophiaG. State here is keyed by parameter name (`<param>.<slot>`, PyTorch's slot
//! names) and saved in `optimizer.safetensors` beside the weights.
//!
//! State is always f32. With bf16 master weights (`training.master_dtype`) the update is
//! computed in f32 and rounded to bf16 when stored back, as a bf16-master run on a GPU does:
//! an update smaller than half a bf16 step of the weight is lost.

mod adamw;
mod mano;
mod muon;
mod schedule_free;
mod sophia;
mod spam;

pub use adamw::AdamW;
pub use mano::Mano;
pub use muon::{Muon, newton_schulz};
pub use schedule_free::ScheduleFree;
pub use sophia::SophiaG;
pub use spam::Spam;

use crate::checkpoint::HostTensor;
use crate::checkpoint::region::Region;
use crate::config::{LrSchedulerConfig, OptimizerConfig, OptimizerKind, ScheduleKind};
use crate::model::ParamSpec;
use crate::tensor::DeviceTensor;
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use rayon::prelude::*;
use std::ops::Range;

/// Learning rate at optimizer step `step` (0-based) of `total`.
pub fn lr_at(sched: &LrSchedulerConfig, peak: f64, step: u64, total: u64) -> f64 {
    let min = peak * sched.min_lr_ratio;
    let warm = sched.warmup_steps.min(total);
    if step < warm {
        return peak * (step + 1) as f64 / warm as f64;
    }
    match sched.kind {
        ScheduleKind::Constant => peak,
        ScheduleKind::Cosine => {
            let span = total.saturating_sub(warm).max(1) as f64;
            let progress = ((step - warm) as f64 / span).min(1.0);
            min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
        ScheduleKind::Wsd => {
            let decay_steps = ((total as f64) * sched.decay_ratio).round() as u64;
            let decay_start = total.saturating_sub(decay_steps).max(warm);
            if step < decay_start {
                peak
            } else {
                let span = total.saturating_sub(decay_start).max(1) as f64;
                let progress = ((step - decay_start + 1) as f64 / span).min(1.0);
                peak + (min - peak) * progress
            }
        }
    }
}

/// Global L2 norm of all gradients (one host read-back).
pub fn global_norm(grads: &[Tensor<1>]) -> f32 {
    if grads.is_empty() {
        return 0.0;
    }
    if let Some(square_sum) = crate::kernels::fixed_order::device_square_sum(grads) {
        return square_sum.sqrt() as f32;
    }
    // One tensor per rayon task on flex: it runs each element-wise op on one thread, and the
    // per-tensor results are the same whichever thread computes them (concatenated and
    // summed in parameter order below), so the norm keeps its bits. Elsewhere one thread
    // (see `on_host_threads`).
    let square_sum = |g: &Tensor<1>| g.clone().powi_scalar(2).sum();
    let sq: Vec<Tensor<1>> = if crate::tensor::on_host_threads(&grads[0].device()) {
        grads.par_iter().map(square_sum).collect()
    } else {
        grads.iter().map(square_sum).collect()
    };
    Tensor::cat(sq, 0).sum().sqrt().into_scalar::<f32>()
}

/// Scales gradients so their global norm is at most `max_norm` (as
/// `torch.nn.utils.clip_grad_norm_`: coefficient max_norm / (norm + 1e-6), clamped to 1).
pub fn clip_by_global_norm(grads: Vec<Tensor<1>>, norm: f32, max_norm: f64) -> Vec<Tensor<1>> {
    match clip_coefficient(norm, max_norm) {
        Some(coef) => grads.into_iter().map(|g| g.mul_scalar(coef)).collect(),
        None => grads,
    }
}

/// The clipping coefficient for gradients of global norm `norm` (as
/// `torch.nn.utils.clip_grad_norm_`: max_norm / (norm + 1e-6)), or None when no clipping
/// applies (disabled, or the norm is within bounds).
pub fn clip_coefficient(norm: f32, max_norm: f64) -> Option<f64> {
    if max_norm <= 0.0 {
        return None;
    }
    let coef = (max_norm / (f64::from(norm) + 1e-6)).min(1.0);
    (coef < 1.0).then_some(coef)
}

/// PyTorch's `lerp(start, end, w)` arithmetic: `start + w (end - start)` for |w| < 0.5,
/// else `end - (end - start)(1 - w)`.
pub(crate) fn lerp(start: Tensor<1>, end: Tensor<1>, w: f64) -> Tensor<1> {
    if w.abs() < 0.5 {
        start.clone() + (end - start).mul_scalar(w)
    } else {
        end.clone() - (end - start).mul_scalar(1.0 - w)
    }
}

/// Every element of each parameter: the ranges of state held whole (a replicated run).
pub(crate) fn whole(specs: &[ParamSpec]) -> Vec<Option<Range<usize>>> {
    specs.iter().map(|s| Some(0..s.numel())).collect()
}

/// One slot of state: zeros as long as each of `ranges` (`None` where it is `None`: no state
/// for that parameter; a rank's shard of a sharded run keeps a range of each).
pub(crate) fn zeros(ranges: &[Option<Range<usize>>], device: &Device) -> Vec<Option<Tensor<1>>> {
    (ranges.iter())
        .map(|r| r.as_ref().map(|r| Tensor::zeros([r.len()], device)))
        .collect()
}

/// How Muon and Mano split the parameters ([`role`]): each hidden matrix's `[in, out]` and
/// zero momentum over its range, and the AdamW of the other parameters.
pub(crate) struct HiddenSplit {
    /// `[in, out]` of each hidden matrix, `None` for the AdamW parameters.
    pub shapes: Vec<Option<[usize; 2]>>,
    /// Zero momentum buffers of the hidden matrices (their ranges).
    pub momentum: Vec<Option<Tensor<1>>>,
    /// The AdamW of the rest.
    pub adam: AdamW,
}

impl HiddenSplit {
    /// The split of `specs`, with state as long as each of `ranges`.
    pub fn new(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        let hidden: Vec<bool> = specs.iter().map(|s| role(s) == Role::Hidden).collect();
        let only = |keep: bool| -> Vec<Option<Range<usize>>> {
            (ranges.iter().zip(&hidden))
                .map(|(r, &h)| r.clone().filter(|_| h == keep))
                .collect()
        };
        Self {
            shapes: (specs.iter().zip(&hidden))
                .map(|(s, &h)| h.then(|| [s.shape[0], s.shape[1]]))
                .collect(),
            momentum: zeros(&only(true), device),
            adam: AdamW::zeroed(cfg, specs, device, &only(false)),
        }
    }
}

/// One slot of per-parameter state (`exp_avg`, `momentum_buffer`, ...): `None` for the
/// parameters the slot does not cover.
pub(crate) type StateSlot<'a> = (&'static str, &'a Vec<Option<Tensor<1>>>);
/// A slot of state, to be restored.
pub(crate) type StateSlotMut<'a> = (&'static str, &'a mut Vec<Option<Tensor<1>>>);

/// How Muon treats a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A 2-D hidden matrix (attention and MLP projections): Muon.
    Hidden,
    /// Embeddings, norm weights, the output head: AdamW.
    Adam,
}

/// The role of a parameter under Muon, decided by name, here and nowhere else: the token
/// embedding, the output head and every norm weight go to AdamW (Muon is for hidden
/// matrices only, per Jordan et al.), every other 2-D parameter to Muon.
pub fn role(spec: &ParamSpec) -> Role {
    let name = spec.name.as_str();
    let adam = name.contains("embed_tokens")
        || name.starts_with("lm_head")
        || name.ends_with("norm.weight")
        || spec.shape.len() != 2;
    if adam { Role::Adam } else { Role::Hidden }
}

/// Whole matrices from the pieces the ranks hold, for an optimizer whose update needs each
/// matrix whole (Muon's Newton-Schulz) in a sharded run, where every rank keeps a range of
/// each parameter ([`crate::parallel::shard::ShardPlan`] does it over the ranks).
pub trait Wholes {
    /// For each `i` where `pieces[i]` is `Some` (the same `i`, with as many tensors, on every
    /// rank of the group): this rank's pieces of one or more tensors of parameter `i`'s size
    /// (Muon: its update; Mano: its update and its weights), each assembled whole (flat) from
    /// every rank's piece, `f(i, wholes)` computed once (by one rank, the matrix's owner), and
    /// this rank's piece of the result returned in its place. `None` where `pieces[i]` is
    /// `None`. A collective over the ranks that shard the state.
    fn map_whole(
        &self,
        pieces: Vec<Option<Vec<Tensor<1>>>>,
        f: &dyn Fn(usize, Vec<Tensor<1>>) -> Tensor<1>,
    ) -> Vec<Option<Tensor<1>>>;
}

/// Parameters held whole (a replicated run): [`Wholes::map_whole`] is `f` on each.
pub struct Unsharded;

impl Wholes for Unsharded {
    fn map_whole(
        &self,
        pieces: Vec<Option<Vec<Tensor<1>>>>,
        f: &dyn Fn(usize, Vec<Tensor<1>>) -> Tensor<1>,
    ) -> Vec<Option<Tensor<1>>> {
        let each = pieces.into_iter().enumerate();
        each.map(|(i, p)| p.map(|p| f(i, p))).collect()
    }
}

/// The update rule of an [`Optimizer`].
#[derive(Debug, Clone)]
pub enum Rule {
    /// AdamW for every parameter.
    AdamW(AdamW),
    /// Muon for hidden matrices, AdamW for the rest.
    Muon(Muon),
    /// SophiaG for every parameter.
    SophiaG(SophiaG),
    /// SPAM for every parameter.
    Spam(Spam),
    /// Schedule-Free AdamW for every parameter.
    ScheduleFree(ScheduleFree),
    /// Mano for hidden matrices, AdamW for the rest.
    Mano(Mano),
}

/// The optimizer of a run (`optimizer.kind`), replicated or, in a sharded run, over this
/// rank's range of each parameter. Every kind is deterministic, so data-parallel ranks,
/// which see identical all-reduced gradients, stay identical; the element-wise rules update
/// a range exactly as the same elements of a whole parameter, and Muon's orthogonalisation
/// sees each whole matrix ([`Wholes`]).
#[derive(Debug, Clone)]
pub struct Optimizer {
    /// The update rule and its state.
    pub rule: Rule,
    /// In a sharded run, the elements of each parameter whose state this rank keeps (the
    /// state then holds that range only, and the update is given that range of the
    /// parameter and gradient); `None` when the state is whole.
    ranges: Option<Vec<Option<Range<usize>>>>,
}

impl Optimizer {
    /// Zero state for these parameters. `tokens_per_step` (all ranks together) is SophiaG's
    /// batch size in its clipping threshold.
    pub fn new(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        tokens_per_step: u64,
    ) -> Self {
        Self {
            rule: Rule::zeroed(cfg, specs, device, tokens_per_step, &whole(specs)),
            ranges: None,
        }
    }

    /// Zero state for a rank's shard of a sharded run: the elements `ranges[i]` of each
    /// parameter `i` (`None`: none of it).
    pub fn sharded(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        tokens_per_step: u64,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        Self {
            rule: Rule::zeroed(cfg, specs, device, tokens_per_step, ranges),
            ranges: Some(ranges.to_vec()),
        }
    }

    /// The elements of each parameter whose state this rank keeps, in a sharded run.
    pub fn shard_ranges(&self) -> Option<&[Option<Range<usize>>]> {
        self.ranges.as_deref()
    }

    /// Which optimizer this is.
    pub fn kind(&self) -> OptimizerKind {
        match &self.rule {
            Rule::AdamW(_) => OptimizerKind::Adamw,
            Rule::Muon(_) => OptimizerKind::Muon,
            Rule::SophiaG(_) => OptimizerKind::Sophiag,
            Rule::Spam(_) => OptimizerKind::Spam,
            Rule::ScheduleFree(_) => OptimizerKind::ScheduleFreeAdamw,
            Rule::Mano(_) => OptimizerKind::Mano,
        }
    }

    /// Updates applied so far (PyTorch's `step`).
    pub fn step(&self) -> u64 {
        match &self.rule {
            Rule::AdamW(o) => o.step,
            Rule::Muon(o) => o.adam.step,
            Rule::SophiaG(o) => o.step,
            Rule::Spam(o) => o.step,
            Rule::ScheduleFree(o) => o.step,
            Rule::Mano(o) => o.adam.step,
        }
    }

    /// Sets the update count (on resume).
    pub fn set_step(&mut self, step: u64) {
        match &mut self.rule {
            Rule::AdamW(o) => o.step = step,
            Rule::Muon(o) => o.adam.step = step,
            Rule::SophiaG(o) => o.step = step,
            Rule::Spam(o) => o.step = step,
            Rule::ScheduleFree(o) => o.step = step,
            Rule::Mano(o) => o.adam.step = step,
        }
    }

    /// [`Optimizer::update`] of gradients clipped by `grad_scale` (from
    /// [`clip_coefficient`]): bit-identical to [`clip_by_global_norm`] then `update`. AdamW
    /// on f32 parameters folds the scaling into its fused pass over each parameter. In a
    /// sharded run `params` and `grads` are this rank's ranges, and `wholes` gathers the
    /// matrices a rule needs whole.
    pub fn update_clipped(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        (grad_scale, lr): (Option<f64>, f64),
        frozen: &[bool],
        wholes: &dyn Wholes,
    ) {
        let f32_params = params.iter().all(|p| p.dtype() == DType::F32);
        if let (Rule::AdamW(o), true) = (&mut self.rule, f32_params) {
            return o.update_clipped(params, grads, grad_scale, lr, frozen);
        }
        let grads = match grad_scale {
            Some(c) => grads.into_iter().map(|g| g.mul_scalar(c)).collect(),
            None => grads,
        };
        self.update_in(params, grads, lr, frozen, wholes)
    }

    /// One update of every parameter (held whole) whose `frozen` flag is false. Parameters
    /// stored in bf16 are updated in f32 and rounded back.
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
    ) {
        self.update_in(params, grads, lr, frozen, &Unsharded)
    }

    fn update_in(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
        wholes: &dyn Wholes,
    ) {
        let narrow = params
            .first()
            .map(Tensor::dtype)
            .filter(|d| *d != DType::F32);
        let Some(master) = narrow else {
            return self.rule.update_f32(params, grads, lr, frozen, wholes);
        };
        let mut wide: Vec<Tensor<1>> = params
            .iter()
            .map(|p| p.clone().cast(FloatDType::F32))
            .collect();
        self.rule.update_f32(&mut wide, grads, lr, frozen, wholes);
        for (p, w) in params.iter_mut().zip(wide) {
            *p = w.cast(master);
        }
    }

    /// Whether the update just applied is one after which SophiaG wants a fresh Hessian
    /// estimate ([`Optimizer::update_hessian`]); never for the other kinds.
    pub fn hessian_due(&self) -> bool {
        match &self.rule {
            Rule::SophiaG(o) => o.hessian_due(),
            _ => false,
        }
    }

    /// Folds a Gauss-Newton-Bartlett estimate into SophiaG's Hessian EMA: `grads` are the
    /// gradients of the mean loss against labels sampled from the model itself (in a
    /// sharded run, this rank's ranges of them).
    pub fn update_hessian(&mut self, grads: Vec<Tensor<1>>) {
        if let Rule::SophiaG(o) = &mut self.rule {
            o.update_hessian(grads);
        }
    }

    /// The weights to evaluate and publish (checkpoints, snapshots, the final weights) of the
    /// parameters `params` this optimizer trains (this rank's pieces in a sharded run), when
    /// they are not the parameters themselves: Schedule-Free's average `x` of its training
    /// point `y` and iterate `z`. In the parameters' dtype.
    pub fn published(&self, params: &[Tensor<1>]) -> Option<Vec<Tensor<1>>> {
        let Rule::ScheduleFree(o) = &self.rule else {
            return None;
        };
        let dtype = params.first().map(Tensor::dtype)?;
        let wide: Vec<Tensor<1>> = params
            .iter()
            .map(|p| p.clone().cast(FloatDType::F32))
            .collect();
        let x = o.published(&wide);
        Some(x.into_iter().map(|t| t.cast(dtype)).collect())
    }

    /// What a resume puts back in place of the published weights (see
    /// [`Optimizer::published`]): Schedule-Free's training point `y`, each in `dtype`;
    /// `None` for the other kinds and before the first update.
    pub fn training_point(&self, dtype: DType) -> Option<Vec<Option<Tensor<1>>>> {
        let Rule::ScheduleFree(o) = &self.rule else {
            return None;
        };
        let y = o.training_point()?;
        Some(y.iter().map(|t| t.clone().map(|t| t.cast(dtype))).collect())
    }

    /// The optimizer's scalars `state.json` records beside the step (Schedule-Free's
    /// `lr_max` and weight sum; none for the other kinds).
    pub fn scalars(&self) -> Vec<(String, f64)> {
        match &self.rule {
            Rule::ScheduleFree(o) => o.scalars(),
            _ => Vec::new(),
        }
    }

    /// Restores [`Optimizer::scalars`] from a checkpoint's; an error names a missing one.
    pub fn set_scalars(&mut self, saved: &[(String, f64)]) -> Result<(), String> {
        match &mut self.rule {
            Rule::ScheduleFree(o) => o.set_scalars(saved),
            _ => Ok(()),
        }
    }

    fn slots(&self) -> Vec<StateSlot<'_>> {
        match &self.rule {
            Rule::AdamW(o) => o.slots(),
            Rule::Muon(o) => o.slots(),
            Rule::SophiaG(o) => o.slots(),
            Rule::Spam(o) => o.slots(),
            Rule::ScheduleFree(o) => o.slots(),
            Rule::Mano(o) => o.slots(),
        }
    }

    fn slots_mut(&mut self) -> Vec<StateSlotMut<'_>> {
        match &mut self.rule {
            Rule::AdamW(o) => o.slots_mut(),
            Rule::Muon(o) => o.slots_mut(),
            Rule::SophiaG(o) => o.slots_mut(),
            Rule::Spam(o) => o.slots_mut(),
            Rule::ScheduleFree(o) => o.slots_mut(),
            Rule::Mano(o) => o.slots_mut(),
        }
    }

    /// The state as named tensors on the device (references, no copy); in a sharded run,
    /// this rank's pieces, named `<param>.<slot>@<first element>`.
    pub fn named_state(&self, specs: &[ParamSpec]) -> Vec<DeviceTensor> {
        let ranges = self.shard_ranges();
        let mut out = Vec::new();
        for (suffix, tensors) in self.slots() {
            for (i, (spec, t)) in specs.iter().zip(tensors).enumerate() {
                let Some(t) = t else { continue };
                let (name, shape) = match ranges.and_then(|r| r[i].as_ref()) {
                    Some(r) => (format!("{}.{suffix}@{}", spec.name, r.start), vec![r.len()]),
                    None => (format!("{}.{suffix}", spec.name), spec.shape.clone()),
                };
                out.push(DeviceTensor {
                    name,
                    shape,
                    tensor: t.clone(),
                });
            }
        }
        out
    }

    /// This rank's pieces of the state for a checkpoint written in pieces: the state of
    /// parameter `i` under the name of `region_of(i)` (`<param>.<slot>@<where>`, see
    /// [`crate::checkpoint::region`]), left out where that is `None`.
    pub fn state_pieces(
        &self,
        specs: &[ParamSpec],
        region_of: &dyn Fn(usize) -> Option<Region>,
    ) -> Vec<DeviceTensor> {
        let mut out = Vec::new();
        for (suffix, tensors) in self.slots() {
            for (i, (spec, t)) in specs.iter().zip(tensors).enumerate() {
                let (Some(t), Some(region)) = (t, region_of(i)) else {
                    continue;
                };
                out.push(DeviceTensor {
                    name: region.name(&format!("{}.{suffix}", spec.name)),
                    shape: vec![region.len()],
                    tensor: t.clone(),
                });
            }
        }
        out
    }

    /// The optimizer of `cfg` restored from a checkpoint's state tensors at optimizer step
    /// `step` (see [`Optimizer::load_host_state`]).
    pub fn restore(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        (tokens_per_step, shard): (u64, Option<&[Option<Range<usize>>]>),
        (tensors, step): (&[HostTensor], u64),
    ) -> Result<Self, String> {
        let mut o = match shard {
            Some(ranges) => Self::sharded(cfg, specs, device, tokens_per_step, ranges),
            None => Self::new(cfg, specs, device, tokens_per_step),
        };
        o.load_host_state(specs, tensors, device)?;
        o.set_step(step);
        Ok(o)
    }

    /// Restores the state from host tensors named `<param>.<slot>`, whole (or flat: a
    /// sharded checkpoint assembled when it is loaded); every slot this optimizer keeps must
    /// be there with its parameter's size (the error names the first that is not). A sharded
    /// optimizer takes its range of each, or a piece of exactly that range (a checkpoint
    /// read piecewise, [`crate::checkpoint::load_kept`]).
    pub fn load_host_state(
        &mut self,
        specs: &[ParamSpec],
        tensors: &[HostTensor],
        device: &Device,
    ) -> Result<(), String> {
        let by_name: std::collections::HashMap<&str, &HostTensor> =
            tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let ranges = self.shard_ranges().map(<[_]>::to_vec);
        for (suffix, slot) in self.slots_mut() {
            for (i, (spec, t)) in specs.iter().zip(slot.iter_mut()).enumerate() {
                if t.is_none() {
                    continue;
                }
                let name = format!("{}.{suffix}", spec.name);
                let found = by_name
                    .get(name.as_str())
                    .ok_or_else(|| format!("optimizer tensor {name} is missing"))?;
                let range = match ranges.as_ref().and_then(|r| r[i].clone()) {
                    Some(r) => r,
                    None => 0..spec.numel(),
                };
                // A sharded optimizer takes its range of the whole tensor, or the piece a
                // checkpoint read piecewise gave it (exactly that long).
                let values = found
                    .elements(&spec.shape, range.clone(), ranges.is_some())
                    .ok_or_else(|| {
                        format!(
                            "optimizer tensor {name} has shape {:?}, the model needs {:?}",
                            found.shape, spec.shape
                        )
                    })?;
                *t = Some(Tensor::from_data(
                    TensorData::new(values, [range.len()]),
                    device,
                ));
            }
        }
        Ok(())
    }
}

impl Rule {
    /// Zero state of `cfg`'s rule for the elements `ranges[i]` of each parameter `i`.
    fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        tokens_per_step: u64,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        match cfg.kind {
            OptimizerKind::Adamw => Self::AdamW(AdamW::zeroed(cfg, specs, device, ranges)),
            OptimizerKind::Muon => Self::Muon(Muon::zeroed(cfg, specs, device, ranges)),
            OptimizerKind::Sophiag => {
                Self::SophiaG(SophiaG::zeroed(cfg, specs, device, tokens_per_step, ranges))
            }
            OptimizerKind::Spam => Self::Spam(Spam::zeroed(cfg, specs, device, ranges)),
            OptimizerKind::ScheduleFreeAdamw => {
                Self::ScheduleFree(ScheduleFree::zeroed(cfg, specs, device, ranges))
            }
            OptimizerKind::Mano => Self::Mano(Mano::zeroed(cfg, specs, device, ranges)),
        }
    }

    fn update_f32(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
        wholes: &dyn Wholes,
    ) {
        match self {
            Self::AdamW(o) => o.update(params, grads, lr, frozen),
            Self::Muon(o) => o.update(params, grads, lr, frozen, wholes),
            Self::SophiaG(o) => o.update(params, grads, lr, frozen),
            Self::Spam(o) => o.update(params, grads, lr, frozen),
            Self::ScheduleFree(o) => o.update(params, grads, lr, frozen),
            Self::Mano(o) => o.update(params, grads, lr, frozen, wholes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind) -> LrSchedulerConfig {
        LrSchedulerConfig {
            kind,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            decay_ratio: 0.2,
        }
    }

    #[test]
    fn cosine_warms_up_peaks_and_ends_at_min() {
        let s = sched(ScheduleKind::Cosine);
        assert!((lr_at(&s, 1.0, 0, 100) - 0.1).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 9, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 10, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 100, 100) - 0.1).abs() < 1e-9);
        let mid = lr_at(&s, 1.0, 55, 100);
        assert!((mid - 0.55).abs() < 1e-9, "{mid}");
    }

    #[test]
    fn wsd_is_flat_then_decays_linearly() {
        let s = sched(ScheduleKind::Wsd);
        assert_eq!(lr_at(&s, 1.0, 50, 100), 1.0);
        assert_eq!(lr_at(&s, 1.0, 79, 100), 1.0);
        assert!(lr_at(&s, 1.0, 80, 100) < 1.0);
        assert!((lr_at(&s, 1.0, 99, 100) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let device = Device::flex();
        let g = vec![Tensor::<1>::from_floats([3.0, 4.0], &device)];
        let n = global_norm(&g);
        assert!((n - 5.0).abs() < 1e-6);
        let c = clip_by_global_norm(g, n, 1.0);
        assert!((global_norm(&c) - 1.0).abs() < 1e-5);
    }
}
