//! The Llama-style decoder: token embedding, N pre-norm blocks (RMSNorm, causal grouped-query
//! attention with rotate-half RoPE, optional QK-norm, SwiGLU MLP), final norm, output head.
//!
//! Parameters are plain named tensors ([`Params`]) rather than burn `Module`s: the optimizer
//! keys its state by parameter *name* (burn keys it by a per-process id that does not survive
//! a reload, which silently breaks exact resume), checkpoints are safetensors keyed by the
//! same names, and every parameter is stored flat (rank 1) and reshaped in the forward pass,
//! which costs nothing (a view) and lets the optimizer treat all of them alike.
//!
//! Matrices are stored `[in, out]` (x @ W), the layout burn's `linear` takes; the Hugging Face
//! export transposes them.
//!
//! Mixed precision (`training.dtype = "bf16"`): weights and activations enter every matmul in
//! the compute dtype and leave it as f32; norms, softmax, the loss and the residual stream
//! stay f32, as under PyTorch's autocast. Parameters may be stored in bf16
//! (`training.master_dtype`): they are widened where f32 is needed. With f32 everywhere every
//! cast is a no-op, so the f32 numerics are untouched.

pub mod hf;
pub mod session;
pub mod stagewise;

use crate::config::{ModelConfig, Precision};
use crate::kernels;
use crate::mesh::Dim;
use crate::mesh::autograd::{self, Flow, Group};
use crate::mesh::placement::Placement;
use burn::tensor::activation::log_softmax;
use burn::tensor::module::embedding;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All ones (norm weights).
    Ones,
    /// Normal(0, std).
    Normal(f64),
}

/// Name, shape and role of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Hugging Face Llama-style name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Logical shape of this rank's tensor (`[in, out]` for matrices): the whole tensor's,
    /// or under tensor parallelism this rank's box of it ([`ParamSpec::placement`]).
    pub shape: Vec<usize>,
    /// Initialisation.
    pub init: Init,
    /// Norm weight or embedding (excluded from weight decay by default).
    pub is_norm_or_embedding: bool,
    /// The whole tensor and this rank's box of it.
    pub placement: Placement,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Indices into the parameter list for one block.
#[derive(Debug, Clone)]
struct BlockParams {
    attn_norm: usize,
    wq: usize,
    wk: usize,
    wv: usize,
    wo: usize,
    q_norm: Option<usize>,
    k_norm: Option<usize>,
    mlp_norm: usize,
    w_gate: usize,
    w_up: usize,
    w_down: usize,
}

/// A stage of the forward pass: what a parameter-sharded step gathers at once
/// ([`crate::model::stagewise`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The token embedding.
    Embed,
    /// Decoder block `l`.
    Block(usize),
    /// The final norm, the output head and the loss (with tied embeddings the head reads
    /// the embedding's weights: see [`Llama::reads`]).
    Head,
}

/// The model's structure (no tensors): which parameter plays which role.
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: ModelConfig,
    vocab: usize,
    specs: Vec<ParamSpec>,
    embed: usize,
    blocks: Vec<BlockParams>,
    final_norm: usize,
    head: Option<usize>,
    /// dtype of the matmuls (`training.dtype`).
    compute: DType,
    /// The tensor-parallel ranks this model's matrices are cut over (one rank: none).
    tp: Group,
}

/// The burn dtype of a config precision.
pub fn dtype_of(p: Precision) -> DType {
    match p {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
    }
}

/// The parameter list as [`Llama::new`] lays it out, each parameter cut over `parts`
/// tensor-parallel ranks as its role says, this rank's box being block `index`; each method
/// returns the new index.
struct Specs {
    specs: Vec<ParamSpec>,
    parts: usize,
    index: usize,
}

impl Specs {
    /// A norm's weight of `len` ones (whole on every rank).
    fn norm(&mut self, name: String, len: usize) -> usize {
        self.push(name, Placement::whole(&[len]), Init::Ones, true)
    }

    /// A projection's weight, normal with standard deviation `std`, cut along `dim` (`None`:
    /// whole on every rank).
    fn weight(&mut self, name: String, shape: [usize; 2], std: f64, dim: Option<usize>) -> usize {
        self.push(name, self.place(&shape, dim), Init::Normal(std), false)
    }

    /// The placement of a tensor of `shape` cut along `dim`.
    fn place(&self, shape: &[usize], dim: Option<usize>) -> Placement {
        match dim {
            Some(dim) => Placement::cut(shape, dim, Dim::Tp, self.parts, self.index),
            None => Placement::whole(shape),
        }
    }

    /// Any parameter; `norm_or_emb`: a norm's weight or the embedding (excluded from weight
    /// decay by default).
    fn push(&mut self, name: String, placement: Placement, init: Init, norm_or_emb: bool) -> usize {
        self.specs.push(ParamSpec {
            name,
            shape: placement.local_shape(),
            init,
            is_norm_or_embedding: norm_or_emb,
            placement,
        });
        self.specs.len() - 1
    }
}

/// The tensor dims a block's matrices are cut along (stored `[in, out]`): the projections
/// into the heads and the MLP by their outputs (column-parallel), those back to the residual
/// stream by their inputs (row-parallel); K and V by their heads when the ranks divide them,
/// else whole on every rank.
const COLUMNS: Option<usize> = Some(1);
const ROWS: Option<usize> = Some(0);

impl BlockParams {
    /// Lays out decoder block `l`'s parameters, in Hugging Face's names and order.
    fn lay_out(specs: &mut Specs, cfg: &ModelConfig, l: usize) -> Self {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let (d, f, std) = (cfg.d_model, cfg.ffn_hidden, cfg.init_std);
        let hd = d / cfg.n_heads;
        let kv = cfg.n_kv_heads * hd;
        let kv_cut = cfg.n_kv_heads.is_multiple_of(specs.parts).then_some(1);
        // The projections that write the residual stream, scaled down with depth if asked.
        let out_std = if cfg.scale_residual_init {
            std / (2.0 * cfg.n_layers as f64).sqrt()
        } else {
            std
        };
        let attn_norm = specs.norm(p("input_layernorm.weight"), d);
        let wq = specs.weight(p("self_attn.q_proj.weight"), [d, d], std, COLUMNS);
        let wk = specs.weight(p("self_attn.k_proj.weight"), [d, kv], std, kv_cut);
        let wv = specs.weight(p("self_attn.v_proj.weight"), [d, kv], std, kv_cut);
        let wo = specs.weight(p("self_attn.o_proj.weight"), [d, d], out_std, ROWS);
        let (q_norm, k_norm) = match cfg.qk_norm {
            true => (
                Some(specs.norm(p("self_attn.q_norm.weight"), hd)),
                Some(specs.norm(p("self_attn.k_norm.weight"), hd)),
            ),
            false => (None, None),
        };
        Self {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            mlp_norm: specs.norm(p("post_attention_layernorm.weight"), d),
            w_gate: specs.weight(p("mlp.gate_proj.weight"), [d, f], std, COLUMNS),
            w_up: specs.weight(p("mlp.up_proj.weight"), [d, f], std, COLUMNS),
            w_down: specs.weight(p("mlp.down_proj.weight"), [f, d], out_std, ROWS),
        }
    }
}

impl Llama {
    /// Lays out the parameters of a model of this shape and vocabulary.
    pub fn new(cfg: &ModelConfig, vocab: usize) -> Self {
        Self::lay_out(cfg, vocab, Group::solo())
    }

    /// The parameters of a model of this shape and vocabulary, cut over the ranks of `tp`
    /// (tensor parallelism, Megatron's layout: see [`COLUMNS`]; the embedding and the output
    /// head by the vocabulary, the norms whole on every rank). The config's rules say which
    /// shapes `tp` may cut ([`crate::config::Config::validate`]); the vocabulary is checked
    /// here.
    pub fn tensor_parallel(cfg: &ModelConfig, vocab: usize, tp: Group) -> Result<Self, String> {
        if !vocab.is_multiple_of(tp.size()) {
            return Err(format!(
                "parallelism.tp = {} does not divide the vocabulary of {vocab} tokens (the embedding and the output head are cut by it); set model.vocab_size to a multiple of {} at least {vocab}",
                tp.size(),
                tp.size()
            ));
        }
        Ok(Self::lay_out(cfg, vocab, tp))
    }

    fn lay_out(cfg: &ModelConfig, vocab: usize, tp: Group) -> Self {
        let mut specs = Specs {
            specs: Vec::new(),
            parts: tp.size(),
            index: tp.rank(),
        };
        let (d, std) = (cfg.d_model, cfg.init_std);
        let place = specs.place(&[vocab, d], ROWS);
        let embed = specs.push(
            "model.embed_tokens.weight".into(),
            place,
            Init::Normal(std),
            true,
        );
        let blocks = (0..cfg.n_layers)
            .map(|l| BlockParams::lay_out(&mut specs, cfg, l))
            .collect();
        let final_norm = specs.norm("model.norm.weight".into(), d);
        let head = (!cfg.tie_embeddings)
            .then(|| specs.weight("lm_head.weight".into(), [d, vocab], std, COLUMNS));
        Self {
            cfg: cfg.clone(),
            vocab,
            specs: specs.specs,
            embed,
            blocks,
            final_norm,
            head,
            compute: DType::F32,
            tp,
        }
    }

    /// This model with its matmuls in `compute` precision (mixed precision).
    pub fn with_compute(mut self, compute: Precision) -> Self {
        self.compute = dtype_of(compute);
        self
    }

    /// `x @ w` in the compute dtype, returned in f32.
    fn mm<const D: usize>(&self, x: Tensor<D>, w: Tensor<2>) -> Tensor<D> {
        self.mm_to(x, w, DType::F32)
    }

    /// `x @ w` in the compute dtype, returned in `out` (one op on devices: the casts inside).
    fn mm_to<const D: usize>(&self, x: Tensor<D>, w: Tensor<2>, out: DType) -> Tensor<D> {
        kernels::linear::mixed_linear(x, w, self.compute, out)
    }

    /// The dtype attention's q, k and v take from their projections: the compute dtype where
    /// kiln's kernels take mixed precision (projections write it, RoPE and attention read it,
    /// no casts between), else f32.
    fn qkv_dtype(&self, device: &Device) -> DType {
        if self.compute != DType::F32 && kernels::coverage::fuses_mixed(device) {
            self.compute
        } else {
            DType::F32
        }
    }

    /// A batched matmul in the compute dtype, returned in f32.
    fn bmm(&self, a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
        a.cast(self.compute)
            .matmul(b.cast(self.compute))
            .cast(FloatDType::F32)
    }

    /// Parameter `i` (a norm weight) in f32.
    fn weight_f32(&self, p: &[Tensor<1>], i: usize) -> Tensor<1> {
        self.param(p, i).cast(FloatDType::F32)
    }

    /// Parameter `i` as the forward pass uses it. Under tensor parallelism a parameter every
    /// rank holds whole (a norm's weight; K and V when the ranks do not divide their heads)
    /// is used by each rank on its share only (its sequences, its heads), so it enters
    /// through copy-to: its gradient is the sum of the ranks' shares, on every rank.
    fn param(&self, p: &[Tensor<1>], i: usize) -> Tensor<1> {
        match self.specs[i].placement.is_whole() {
            true => autograd::exchange(p[i].clone(), Flow::CopyTo, &self.tp),
            false => p[i].clone(),
        }
    }

    /// The tensor-parallel ranks' sequences gathered, in rank order: sequence parallelism
    /// keeps this rank's sequences of the micro-batch in the residual stream (the norms and
    /// the residual adds computed once), and the layers that cut the matrices take every
    /// rank's. The identity on one rank.
    fn enter(&self, h: Tensor<3>) -> Tensor<3> {
        autograd::exchange(h, Flow::GatherRows, &self.tp)
    }

    /// The ranks' partial results (a row-parallel product, the embedding of a vocabulary
    /// share) summed, each rank keeping its sequences. The identity on one rank.
    fn leave(&self, y: Tensor<3>) -> Tensor<3> {
        autograd::exchange(y, Flow::ScatterRows, &self.tp)
    }

    /// The tensor-parallel ranks this model is cut over.
    pub fn tensor_ranks(&self) -> &Group {
        &self.tp
    }

    /// The parameters' names, shapes and roles, in a fixed order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Total number of parameters.
    pub fn num_params(&self) -> usize {
        (self.specs.iter())
            .map(|s| s.placement.global.iter().product::<usize>())
            .sum()
    }

    /// Training FLOPs per token (6N for the matmuls plus attention's 12*L*d*T), as in
    /// PaLM's MFU accounting; used for the MFU estimate.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let non_embedding = (self.num_params() - self.vocab * self.cfg.d_model) as f64;
        6.0 * non_embedding + 12.0 * (self.cfg.n_layers * self.cfg.d_model * seq_len) as f64
    }

    /// The stages of the forward pass, in order.
    pub fn stages(&self) -> Vec<Stage> {
        let blocks = (0..self.blocks.len()).map(Stage::Block);
        std::iter::once(Stage::Embed)
            .chain(blocks)
            .chain(std::iter::once(Stage::Head))
            .collect()
    }

    /// The parameters stage `s` owns: consecutive indices into [`Llama::specs`]; the stages
    /// own every parameter once.
    pub fn owned(&self, s: Stage) -> std::ops::Range<usize> {
        match s {
            Stage::Embed => self.embed..self.embed + 1,
            Stage::Block(l) => {
                let first = self.blocks[l].attn_norm;
                first..self.blocks[l].w_down + 1
            }
            Stage::Head => self.final_norm..self.specs.len(),
        }
    }

    /// The stages whose parameters stage `s` reads: itself, and for the head with tied
    /// embeddings the embedding too.
    pub fn reads(&self, s: Stage) -> Vec<Stage> {
        match (s, self.head) {
            (Stage::Head, None) => vec![Stage::Head, Stage::Embed],
            _ => vec![s],
        }
    }

    /// The RoPE tables of sequences of `t` tokens, which every block takes.
    pub fn rope(&self, t: usize, device: &Device) -> RopeTables {
        let hd = self.cfg.d_model / self.cfg.n_heads;
        RopeTables::new(t, hd, self.cfg.rope_theta, device, self.qkv_dtype(device))
    }

    /// Fresh parameters drawn from `seed` (same values on every backend and thread count:
    /// they are generated on the host).
    pub fn init(&self, seed: u64, device: &Device) -> Vec<Tensor<1>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        self.specs
            .iter()
            .map(|s| {
                // The whole tensor is drawn, so that every cut of the model (tensor
                // parallelism) starts from the same values as one rank; this rank keeps its box.
                let n = s.placement.global.iter().product();
                let values: Vec<f32> = match s.init {
                    Init::Ones => vec![1.0; n],
                    Init::Normal(std) => {
                        // std > 0 is guaranteed by construction; a zero std gives zeros.
                        match Normal::new(0.0f64, std) {
                            Ok(dist) => (0..n).map(|_| dist.sample(&mut rng) as f32).collect(),
                            Err(_) => vec![0.0; n],
                        }
                    }
                };
                let values = s.placement.take(&values);
                let n = values.len();
                Tensor::from_data(TensorData::new(values, [n]), device)
            })
            .collect()
    }

    /// Next-token logits `[batch, seq, vocab]` for `tokens` `[batch, seq]`.
    pub fn forward(&self, p: &[Tensor<1>], tokens: Tensor<2, Int>) -> Tensor<3> {
        self.head_logits(p, self.residual(p, tokens))
    }

    /// The last stage without the loss: next-token logits `[batch, seq, vocab]` of the
    /// residual stream `x` `[batch, seq, d_model]` (final norm, output head).
    pub fn head_logits(&self, p: &[Tensor<1>], x: Tensor<3>) -> Tensor<3> {
        let h = rms_norm(x, self.weight_f32(p, self.final_norm), self.cfg.norm_eps);
        let h = self.enter(h);
        let [b, t, d] = h.dims();
        let logits = self.mm(h.reshape([b * t, d]), self.head_matrix(p));
        // Each tensor-parallel rank has its share of the vocabulary: gathered (as rows of
        // the transpose) into the whole.
        let logits = match self.tp.size() {
            1 => logits,
            _ => autograd::exchange(logits.transpose(), Flow::GatherRows, &self.tp).transpose(),
        };
        logits.reshape([b, t, self.vocab])
    }

    /// Mean next-token cross-entropy of `inputs` predicting `targets` (both `[batch, seq]`).
    // Not inlined (nor `block`, `attention`, `rms_norm`, `RopeTables::apply`): each
    // stays a frame of its own in profiles (bench/train/profile.sh), at no measurable cost.
    #[inline(never)]
    pub fn loss(
        &self,
        p: &[Tensor<1>],
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
    ) -> Tensor<1> {
        self.head_loss(p, self.residual(p, inputs), targets)
    }

    /// The residual stream after the last block, `[batch, seq, d_model]`.
    fn residual(&self, p: &[Tensor<1>], tokens: Tensor<2, Int>) -> Tensor<3> {
        let [_, t] = tokens.dims();
        let rope = self.rope(t, &tokens.device());
        let mut x = self.embed(p, tokens);
        for l in 0..self.blocks.len() {
            x = self.block(p, l, x, &rope);
        }
        x
    }

    /// The first stage: the embeddings of `tokens` `[batch, seq]`, `[batch, seq, d_model]`
    /// in f32.
    pub fn embed(&self, p: &[Tensor<1>], tokens: Tensor<2, Int>) -> Tensor<3> {
        let w = self.mat(p, self.embed);
        if self.tp.size() == 1 {
            return embedding(w, tokens).cast(FloatDType::F32);
        }
        // A vocabulary-parallel embedding: this rank's rows of the table embed the tokens
        // in its share, zeros the others; the ranks' sums are the embeddings.
        let rows = self.specs[self.embed].placement.boxed[0].clone();
        let local = tokens.sub_scalar(rows.start as i64);
        let inside = (local.clone().greater_equal_elem(0))
            .bool_and(local.clone().lower_elem(rows.len() as i64));
        let ids = local.clamp(0, rows.len() as i64 - 1);
        let e = embedding(w, ids).cast(FloatDType::F32);
        self.leave(e * inside.float().unsqueeze_dim::<3>(2))
    }

    /// Block `l` on the residual stream `x` `[batch, seq, d_model]`.
    #[inline(never)]
    pub fn block(&self, p: &[Tensor<1>], l: usize, x: Tensor<3>, rope: &RopeTables) -> Tensor<3> {
        let (blk, eps) = (&self.blocks[l], self.cfg.norm_eps);
        let h = self.enter(rms_norm(x.clone(), self.weight_f32(p, blk.attn_norm), eps));
        let [b, t, _] = h.dims();
        let x = x + self.leave(self.attention(p, blk, h, rope, b, t));
        let h = self.enter(rms_norm(x.clone(), self.weight_f32(p, blk.mlp_norm), eps));
        let gate = self.mm(h.clone(), self.mat(p, blk.w_gate));
        let up = self.mm(h, self.mat(p, blk.w_up));
        let down = self.mm(kernels::swiglu::swiglu(gate, up), self.mat(p, blk.w_down));
        x + self.leave(down)
    }

    /// The last stage's loss of the residual stream `x` against `targets` (the data's:
    /// [`Llama::head_loss`]; sampled: [`sampled_label_loss`] of [`Llama::head_logits`]).
    pub fn head_loss_against(&self, p: &[Tensor<1>], x: Tensor<3>, targets: Targets) -> Tensor<1> {
        match targets {
            Targets::Data(t) => self.head_loss(p, x, *t),
            Targets::Sampled(seed) => sampled_label_loss(self.head_logits(p, x), seed),
        }
    }

    /// The last stage: the mean next-token cross-entropy of the residual stream `x`
    /// `[batch, seq, d_model]` predicting `targets` `[batch, seq]` (final norm, output head).
    pub fn head_loss(&self, p: &[Tensor<1>], x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let h = rms_norm(x, self.weight_f32(p, self.final_norm), self.cfg.norm_eps);
        let h = self.enter(h);
        let [b, t, d] = h.dims();
        let n = b * t;
        let h = h.reshape([n, d]);
        if self.tp.size() > 1 {
            return self.vocab_parallel_loss(p, h, targets.reshape([n]));
        }
        if self.compute == DType::F32 {
            // The fused output head + cross-entropy (the logits are never materialised
            // whole); it falls back to the composed ops where no kernel covers it.
            let w = self.head_matrix(p).cast(FloatDType::F32);
            return kernels::cross_entropy::linear_cross_entropy(h, w, targets.reshape([n]));
        }
        if kernels::coverage::fuses_mixed(&h.device()) {
            // The same kernel in the compute dtype: its matmuls in bf16, its sums and the loss
            // in f32.
            let w = self.head_matrix(p).cast(self.compute);
            return kernels::cross_entropy::linear_cross_entropy(
                h.cast(self.compute),
                w,
                targets.reshape([n]),
            );
        }
        let logits = self.mm(h, self.head_matrix(p));
        let logp = log_softmax(logits, 1);
        logp.gather(1, targets.reshape([n, 1])).mean().neg()
    }

    /// The mean cross-entropy of the logits `h @ head` (`h` `[n, d]`) against `targets` `[n]`
    /// when each tensor-parallel rank holds a share of the vocabulary (loss parallelism): the
    /// logits stay cut, and the softmax's maximum, its sum and the target's logit are reduced
    /// over the ranks, so every rank gets the whole loss and the gradient of its share.
    fn vocab_parallel_loss(
        &self,
        p: &[Tensor<1>],
        h: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> Tensor<1> {
        let [n, _] = h.dims();
        let logits = self.mm(h, self.head_matrix(p));
        let [_, share] = logits.dims();
        // Subtracted for stability only: a constant to the gradient.
        let max = autograd::max(logits.clone().max_dim(1), &self.tp);
        let z = logits - max;
        let sum = autograd::exchange(z.clone().exp().sum_dim(1), Flow::ReduceFrom, &self.tp);
        let rows = self.head_columns();
        let local = targets.sub_scalar(rows.start as i64);
        let inside =
            (local.clone().greater_equal_elem(0)).bool_and(local.clone().lower_elem(share as i64));
        let ids = local.clamp(0, share as i64 - 1).reshape([n, 1]);
        let picked = z.gather(1, ids) * inside.float().reshape([n, 1]);
        let picked = autograd::exchange(picked, Flow::ReduceFrom, &self.tp);
        (sum.log() - picked).mean()
    }

    /// The vocabulary entries of this rank's share of the output head's columns.
    fn head_columns(&self) -> std::ops::Range<usize> {
        match self.head {
            Some(i) => self.specs[i].placement.boxed[1].clone(),
            None => self.specs[self.embed].placement.boxed[0].clone(),
        }
    }

    fn mat(&self, p: &[Tensor<1>], i: usize) -> Tensor<2> {
        let s = &self.specs[i].shape;
        self.param(p, i).reshape([s[0], s[1]])
    }

    fn head_matrix(&self, p: &[Tensor<1>]) -> Tensor<2> {
        match self.head {
            Some(i) => self.mat(p, i),
            None => self.mat(p, self.embed).transpose(),
        }
    }

    /// The query heads and the K/V heads this rank computes: all of them on one rank, else
    /// its block of the query heads and the K/V heads they share (Hugging Face's grouping:
    /// query head `h` uses K/V head `h / (n_heads / n_kv_heads)`).
    pub fn local_heads(&self) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (nh, nkv) = (self.cfg.n_heads, self.cfg.n_kv_heads);
        let (parts, r) = (self.tp.size(), self.tp.rank());
        let per = nh / parts;
        let groups = nh / nkv;
        let heads = r * per..(r + 1) * per;
        let kv = heads.start / groups..heads.end.div_ceil(groups);
        (heads, kv)
    }

    /// Causal grouped-query attention. K/V are never repeated: the `groups` query heads that
    /// share a K/V head are stacked along the sequence axis (`[b, kv, groups*t, hd]`), so one
    /// batched matmul serves them all against the shared K/V.
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn attention(
        &self,
        p: &[Tensor<1>],
        blk: &BlockParams,
        h: Tensor<3>,
        rope: &RopeTables,
        b: usize,
        t: usize,
    ) -> Tensor<3> {
        let cfg = &self.cfg;
        let (heads, kv) = self.local_heads();
        let (nh, hd) = (heads.len(), cfg.d_model / cfg.n_heads);
        let nkv = kv.len();
        let groups = nh / nkv;
        let qkv = self.qkv_dtype(&h.device());
        let q = self
            .mm_to(h.clone(), self.mat(p, blk.wq), qkv)
            .reshape([b, t, nh, hd]);
        // This rank's K/V heads: its columns of K and V, or, where every rank holds them
        // whole, the ones its query heads share.
        let kv_of = |w: usize| {
            let y = self.mm_to(h.clone(), self.mat(p, w), qkv);
            match self.specs[w].placement.is_whole() && self.tp.size() > 1 {
                true => y.slice([0..b, 0..t, kv.start * hd..kv.end * hd]),
                false => y,
            }
        };
        let k = kv_of(blk.wk).reshape([b, t, nkv, hd]);
        // V stays in the projection's [b, t, kv * hd] layout: the attention kernel reads it
        // (and writes its result as [b, t, heads * hd]) through strided views, no copies.
        let v = kv_of(blk.wv);
        let (q, k) = match (blk.q_norm, blk.k_norm) {
            (Some(qn), Some(kn)) => (
                rms_norm(q, self.param(p, qn).cast(qkv), cfg.norm_eps),
                rms_norm(k, self.param(p, kn).cast(qkv), cfg.norm_eps),
            ),
            _ => (q, k),
        };
        // [b, t, heads, hd] -> [b, heads, t, hd], rotated
        let q = rope.apply(q);
        let k = rope.apply(k);
        // Query head h uses K/V head h / groups (as Hugging Face's repeat_kv), so the heads of
        // one group are adjacent and the reshape below needs no copy of K or V.
        let q = q.reshape([b, nkv, groups * t, hd]);
        let scale = 1.0 / (hd as f64).sqrt();
        let y = if self.compute == DType::F32 || qkv != DType::F32 {
            // f32, or mixed precision on devices with kiln's kernels: q, k, v in the compute
            // dtype, as the head (on GPUs its products on tensor cores; the softmax and every
            // sum in f32), never holding the T x T scores; the output projection takes `y` in
            // that dtype.
            kernels::attention::causal_attention(q, k, v, scale)
        } else {
            // Mixed precision: the two attention matmuls in the compute dtype, the softmax
            // in f32.
            let v = v.reshape([b, t, nkv, hd]).swap_dims(1, 2);
            let probs = kernels::softmax::causal_softmax(self.bmm(q, k.transpose()), scale);
            self.bmm(probs, v)
                .reshape([b, nh, t, hd])
                .swap_dims(1, 2)
                .reshape([b, t, nh * hd])
        };
        self.mm(y, self.mat(p, blk.wo))
    }
}

/// What a loss is computed against.
pub enum Targets {
    /// The data's next tokens, `[batch, seq]` (boxed: a tensor handle is large).
    Data(Box<Tensor<2, Int>>),
    /// Labels sampled from the model's own softmax with this seed (SophiaG's
    /// Gauss-Newton-Bartlett estimator): [`sampled_label_loss`].
    Sampled(u64),
}

/// Mean cross-entropy of `logits` (`[batch, seq, vocab]`) against labels sampled from their
/// own softmax (drawn on the host from a seeded ChaCha8 stream, so reproducible on every
/// backend).
pub fn sampled_label_loss(logits: Tensor<3>, seed: u64) -> Tensor<1> {
    use rand::Rng;
    let device = logits.device();
    let [b, t, v] = logits.dims();
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    let host = crate::tensor::to_vec(&logp.clone().detach().reshape([b * t * v]));
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let labels: Vec<i64> = host
        .chunks_exact(v.max(1))
        .map(|row| {
            let u: f64 = rng.r#gen();
            let mut acc = 0.0f64;
            let pick = row.iter().position(|&lp| {
                acc += f64::from(lp).exp();
                acc > u
            });
            // Rounding can leave the total just under u: take the last token then.
            pick.unwrap_or(row.len() - 1) as i64
        })
        .collect();
    let labels = Tensor::<2, Int>::from_data(TensorData::new(labels, [b * t, 1]), &device);
    logp.gather(1, labels).mean().neg()
}

/// RMSNorm over the last dimension, in f32: x / sqrt(mean(x^2) + eps) * w.
#[inline(never)]
fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    kernels::rms_norm::rms_norm(x, w, eps)
}

/// Rotate-half RoPE tables (the Llama / Hugging Face layout, not burn's interleaved one).
pub struct RopeTables {
    cos: Tensor<2>,
    sin: Tensor<2>,
}

impl RopeTables {
    /// The tables of `t` positions for heads of `hd`, computed in f32 and stored in `dtype`
    /// (that of the q and k they rotate).
    fn new(t: usize, hd: usize, theta: f64, device: &Device, dtype: DType) -> Self {
        let half = hd / 2;
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        // f32 arithmetic, as PyTorch builds its tables (inv_freq = 1 / theta^(2i/hd)).
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / hd as f32))
            .collect();
        for pos in 0..t {
            for j in 0..hd {
                let angle = pos as f32 * inv_freq[j % half];
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self {
            cos: Tensor::<2>::from_data(TensorData::new(cos, [t, hd]), device).cast(dtype),
            sin: Tensor::<2>::from_data(TensorData::new(sin, [t, hd]), device).cast(dtype),
        }
    }

    /// x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1), for `x`
    /// `[b, t, heads, hd]`; returned head-major, `[b, heads, t, hd]`.
    #[inline(never)]
    fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, t, heads, hd] = x.dims();
        let x = x.reshape([b, t, heads * hd]);
        kernels::rope::rope(x, self.cos.clone(), self.sin.clone(), heads)
    }
}
