//! The forward and backward pass of a parameter-sharded run (ZeRO-3, FSDP's full sharding):
//! no rank holds the whole model, so each stage's weights ([`Stage`]: the embedding, a block,
//! the head) are gathered when the stage runs and dropped after it.
//!
//! The forward pass runs without autodiff and keeps only each block's input. The backward
//! pass goes through the stages last first: it gathers a stage's weights again, recomputes
//! the stage under autodiff from its kept input and back-propagates the gradient that reached
//! its output (through the surrogate `sum(y * dy)`, whose gradient with respect to `y` is `dy`
//! exactly), then hands the stage's weight gradients over at once ([`StageParams::reduce`]:
//! a reduce-scatter in a sharded run) and passes the gradient at its input on. Held at any
//! time: one stage's whole weights and gradients, the blocks' inputs and one block's
//! activations, where a replicated step holds the whole model's weights, gradients and
//! activations. The price is one more forward pass of every block (as activation
//! checkpointing pays).
//!
//! Every stage computes what [`Llama::loss`] computes under autodiff, and the gradients come
//! out the same bits (tested on one rank; over ranks the mean is a reduce-scatter's). The same
//! pass over a rank's own whole weights ([`LocalStages`]) is activation checkpointing.

use crate::model::{Llama, RopeTables, Stage, Targets};
use burn::tensor::{Device, FloatDType, Gradients, Int, Tensor};

/// Where the stages' whole weights come from and where their gradients go.
pub trait StageParams {
    /// The whole parameters stage `s` owns ([`Llama::owned`]), in order.
    fn gather(&mut self, s: Stage) -> Vec<Tensor<1>>;
    /// The gradients (f32) of the parameters stage `s` owns, in order. Called once per
    /// stage and pass, last stage first.
    fn reduce(&mut self, s: Stage, grads: Vec<Tensor<1>>);
    /// The stages [`StageParams::gather`] will be asked for in this pass, in order, so that
    /// each can be fetched while the one before computes. Default: nothing fetched ahead.
    fn expect(&mut self, _order: Vec<Stage>) {}
}

/// A rank's own whole weights as stages, for activation checkpointing without sharding
/// (`training.activation_checkpointing = "blocks"`): each stage's weights are this rank's
/// own tensors, and its gradients are kept in model order ([`LocalStages::into_grads`]).
pub struct LocalStages<'a> {
    model: &'a Llama,
    params: &'a [Tensor<1>],
    grads: Vec<Option<Tensor<1>>>,
}

impl<'a> LocalStages<'a> {
    /// The stages of `model` over its whole parameters `params`.
    pub fn new(model: &'a Llama, params: &'a [Tensor<1>]) -> Self {
        Self {
            model,
            params,
            grads: vec![None; params.len()],
        }
    }

    /// The gradients of every parameter (f32), in model order; zeros where a pass did not
    /// reach one.
    pub fn into_grads(self) -> Vec<Tensor<1>> {
        (self.grads.into_iter().zip(self.params))
            .map(|(g, p)| g.unwrap_or_else(|| p.zeros_like().cast(FloatDType::F32)))
            .collect()
    }
}

impl StageParams for LocalStages<'_> {
    fn gather(&mut self, s: Stage) -> Vec<Tensor<1>> {
        self.model
            .owned(s)
            .map(|i| self.params[i].clone())
            .collect()
    }

    fn reduce(&mut self, s: Stage, grads: Vec<Tensor<1>>) {
        for (i, g) in self.model.owned(s).zip(grads) {
            self.grads[i] = Some(g);
        }
    }
}

/// The stages whose weights a pass gathers, in order: the forward pass (the embedding, the
/// blocks, what the head reads) and with `backward` the blocks again, last first, and the
/// embedding.
fn gather_order(model: &Llama, backward: bool) -> Vec<Stage> {
    let layers = model.config().n_layers;
    let mut order = vec![Stage::Embed];
    order.extend((0..layers).map(Stage::Block));
    order.extend(model.reads(Stage::Head));
    if backward {
        order.extend((0..layers).rev().map(Stage::Block));
        order.push(Stage::Embed);
    }
    order
}

/// The parameters one stage reads, placed at their indices in a list as long as the model's
/// (the model's functions index parameters by position); every other entry is empty.
struct Placed {
    all: Vec<Tensor<1>>,
    empty: Tensor<1>,
}

impl Placed {
    fn new(model: &Llama, device: &Device) -> Self {
        let empty = Tensor::empty([0], device);
        Self {
            all: vec![empty.clone(); model.specs().len()],
            empty,
        }
    }

    /// Gathers the parameters stage `s` reads; as autodiff leaves with `leaves`.
    fn load(&mut self, model: &Llama, params: &mut dyn StageParams, s: Stage, leaves: bool) {
        for read in model.reads(s) {
            for (i, t) in model.owned(read).zip(params.gather(read)) {
                self.all[i] = if leaves {
                    t.autodiff().require_grad()
                } else {
                    t
                };
            }
        }
    }

    /// Empties the entries stage `s` read and returns, per stage read, the gradients `g`
    /// holds for them (zeros where the stage did not reach a parameter).
    fn unload(&mut self, model: &Llama, s: Stage, g: &Gradients) -> Vec<(Stage, Vec<Tensor<1>>)> {
        model
            .reads(s)
            .into_iter()
            .map(|read| {
                let grads = model
                    .owned(read)
                    .map(|i| {
                        let leaf = std::mem::replace(&mut self.all[i], self.empty.clone());
                        match leaf.grad(g) {
                            Some(grad) => grad.cast(FloatDType::F32),
                            None => leaf.inner().zeros_like().cast(FloatDType::F32),
                        }
                    })
                    .collect();
                (read, grads)
            })
            .collect()
    }

    /// Empties the entries stage `s` read (the weights of a stage run without autodiff).
    fn clear(&mut self, model: &Llama, s: Stage) {
        for read in model.reads(s) {
            for i in model.owned(read) {
                self.all[i] = self.empty.clone();
            }
        }
    }
}

/// The loss of `inputs` (`[batch, seq]`) predicting `targets` times `scale`, stage by stage
/// (see the module documentation); each stage's weight gradients go to `params`.
pub fn loss_and_grads(
    model: &Llama,
    params: &mut dyn StageParams,
    inputs: Tensor<2, Int>,
    targets: Targets,
    scale: f64,
) -> f32 {
    let device = inputs.device();
    let [_, t] = inputs.dims();
    let rope = model.rope(t, &device);
    let mut p = Placed::new(model, &device);
    params.expect(gather_order(model, true));
    let mut kept = Vec::with_capacity(model.config().n_layers);
    let x = forward(
        model,
        params,
        &mut p,
        inputs.clone(),
        &rope,
        Some(&mut kept),
    );
    let x = x.autodiff().require_grad();
    p.load(model, params, Stage::Head, true);
    let targets = match targets {
        Targets::Data(t) => Targets::Data(Box::new(t.autodiff())),
        sampled => sampled,
    };
    let mut loss = model.head_loss_against(&p.all, x.clone(), targets);
    if scale != 1.0 {
        loss = loss.mul_scalar(scale);
    }
    let value = loss.clone().into_scalar::<f32>();
    let g = loss.backward();
    // With tied embeddings the head's share of the embedding's gradient waits for the
    // embedding's own, so that the stage's gradients are handed over once.
    let mut tied = None;
    for (s, grads) in p.unload(model, Stage::Head, &g) {
        match s {
            Stage::Head => params.reduce(s, grads),
            _ => tied = Some(grads),
        }
    }
    let mut dy = input_grad(&x, &g);
    for (l, x) in kept.into_iter().enumerate().rev() {
        let x = x.autodiff().require_grad();
        p.load(model, params, Stage::Block(l), true);
        let y = model.block(&p.all, l, x.clone(), &rope);
        let g = (y * dy).sum().backward();
        for (s, grads) in p.unload(model, Stage::Block(l), &g) {
            params.reduce(s, grads);
        }
        dy = input_grad(&x, &g);
    }
    p.load(model, params, Stage::Embed, true);
    let e = model.embed(&p.all, inputs.autodiff());
    let g = (e * dy).sum().backward();
    for (s, mut grads) in p.unload(model, Stage::Embed, &g) {
        if let Some(head) = tied.take() {
            grads = grads.into_iter().zip(head).map(|(a, b)| a + b).collect();
        }
        params.reduce(s, grads);
    }
    value
}

/// Next-token logits `[batch, seq, vocab]` of `inputs` `[batch, seq]`, stage by stage
/// without autodiff (eval of a parameter-sharded run).
pub fn logits(model: &Llama, params: &mut dyn StageParams, inputs: Tensor<2, Int>) -> Tensor<3> {
    let device = inputs.device();
    let rope = model.rope(inputs.dims()[1], &device);
    let mut p = Placed::new(model, &device);
    params.expect(gather_order(model, false));
    let x = forward(model, params, &mut p, inputs, &rope, None);
    p.load(model, params, Stage::Head, false);
    model.head_logits(&p.all, x)
}

/// The forward pass up to the head, without autodiff: the last block's output; every
/// block's input is pushed to `kept` when given.
fn forward(
    model: &Llama,
    params: &mut dyn StageParams,
    p: &mut Placed,
    inputs: Tensor<2, Int>,
    rope: &RopeTables,
    mut kept: Option<&mut Vec<Tensor<3>>>,
) -> Tensor<3> {
    p.load(model, params, Stage::Embed, false);
    let mut x = model.embed(&p.all, inputs);
    p.clear(model, Stage::Embed);
    for l in 0..model.config().n_layers {
        p.load(model, params, Stage::Block(l), false);
        if let Some(k) = kept.as_deref_mut() {
            k.push(x.clone());
        }
        x = model.block(&p.all, l, x, rope);
        p.clear(model, Stage::Block(l));
    }
    x
}

/// The gradient `g` holds for the stage input `x` (zeros if the stage did not use it).
fn input_grad(x: &Tensor<3>, g: &Gradients) -> Tensor<3> {
    x.grad(g).unwrap_or_else(|| x.clone().inner().zeros_like())
}
