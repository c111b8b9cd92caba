//! A LoRA training step recorded into one [`Recorder`]: the forward over every block saving
//! what the backward needs, the final norm with the lm-head and cross-entropy chunked over
//! tokens, the backward through every block in reverse into every adapter's gradient, and
//! AdamW (global-norm clipping, LoRA+). The schedule is fixed per [`StepShape`]: the same
//! launches over the same buffers every step, per-step values (learning rate, step number) as
//! runtime parameters, so no step compiles a pipeline or allocates.
//!
//! The math is [`reference`](super::reference)'s (KERNELS.md "Forward of one block", "Through
//! a block"), which the tests compare the step with.

use hesper_exec::{GpuBuffer, Recorder};
use hesper_kernels::attention::{
    SeqGrads, SeqInputs, SeqSaved, SeqShape, ValidLengths, execute_attention_backward,
    execute_attention_forward,
};
use hesper_kernels::elementwise::{execute_add, execute_add_bias, execute_embedding};
use hesper_kernels::ffn::{
    execute_relu_sqr_mul_backward, execute_relu_sqr_mul_forward, execute_swiglu_backward,
    execute_swiglu_forward, execute_swiglu_packed_backward, execute_swiglu_packed_backward_f16,
    execute_swiglu_packed_forward, execute_swiglu_packed_forward_f16,
    execute_swiglu_packed_forward_half,
};
use hesper_kernels::linear::fusion::{Residual, low_rank_fits};
use hesper_kernels::linear::split::execute_gemm_split_fused;
use hesper_kernels::linear::{
    Fusion, Gemm, GemmFusion, GemmPath, HalfBuffers, Operand, Product, Weights, execute_gemm,
    execute_gemm_blocks, execute_gemm_fused, execute_gemm_output_blocks, gemm_blocks_path,
    gemm_output_blocks_path, gemm_path,
};
use hesper_kernels::lora::{
    LoraBackward, LoraUp, LoraUps, UpWeight, WeightBackward, execute_input_grad,
    execute_lora_backward, execute_lora_down, execute_lora_down_pair, execute_lora_forward,
    execute_lora_up, execute_lora_weight_backward, execute_lora_weight_backward_pair,
};
use hesper_kernels::loss::{
    CrossEntropyGrad, IGNORE_INDEX, execute_cross_entropy_count, execute_cross_entropy_mean,
    execute_cross_entropy_stats,
};
use hesper_kernels::norm::{execute_rms_norm_backward, execute_rms_norm_forward};
use hesper_kernels::optim::{AdamW, Clip, Step, execute_adamw, execute_global_grad_norm};
use hesper_kernels::rope::{Positions, execute_rope_qk};

use super::activations::{
    GateUp, Hidden, LayerActivations, LogitsBuffers, LoraWork, LossBuffers, StepBuffers, Workspace,
    projection_input,
};
use super::config::{ModelError, Projection};
use super::gpu::{Frozen, GpuAdapter, GpuAdapters, GpuLayer, GpuModel};

/// `[W_gate; W_up]` of a layer the step packs the gate and up of.
fn merged_gate_up(layer: &GpuLayer) -> &Frozen {
    let merged = layer.gate_up();
    merged.expect("StepBuffers::new packs the gate and up only where the model merges them")
}

/// Whether `gemm` over `weights` runs on the tensor cores at a tile that adds LoRA's
/// up-projection of `rank` (`s·h·Bᵀ`, `s·dh·A`) as more depth of its own product
/// (`linear::fusion::low_rank_fits`), for less than the up-projection's own launch costs;
/// elsewhere it keeps its launch (an element-by-element epilogue costs the GEMM more,
/// BENCHMARKS.md "Fusion"). `gemm` is the GEMM as its tile is chosen (accumulating where it
/// adds a residual).
fn lora_fuses(rec: &Recorder<'_>, gemm: &Gemm, weights: &Weights<'_>, rank: usize) -> bool {
    let half = HalfBuffers {
        weight: matches!(weights, Weights::Half { .. }),
        ..HalfBuffers::NONE
    };
    match gemm_path(rec.gpu(), gemm, weights, half) {
        GemmPath::TensorCores { tile, .. } => low_rank_fits(rank, tile.bk),
        _ => false,
    }
}

/// An adapter's weights, and where one micro-batch's weight gradients go: its `da`, `db` for
/// the first micro-batch, which writes them; `micro_da`, `micro_db` for the others, added into
/// them after ([`GpuAdapter::add_micro_grads`]).
struct AdapterGrads<'a> {
    a: &'a GpuBuffer<f32>,
    b: &'a GpuBuffer<f32>,
    da: &'a mut GpuBuffer<f32>,
    db: &'a mut GpuBuffer<f32>,
}

impl GpuAdapter {
    fn grads_for(&mut self, micro: usize) -> AdapterGrads<'_> {
        let (da, db) = match micro {
            0 => (&mut self.da, &mut self.db),
            _ => (&mut self.micro_da, &mut self.micro_db),
        };
        AdapterGrads {
            a: &self.a,
            b: &self.b,
            da,
            db,
        }
    }

    /// Adds a later micro-batch's gradients into the step's.
    fn add_micro_grads(&mut self, rec: &mut Recorder<'_>) -> Result<(), ModelError> {
        execute_add(rec, &self.micro_da, &mut self.da)?;
        Ok(execute_add(rec, &self.micro_db, &mut self.db)?)
    }
}

/// Elements `i` and `j` (`i ≠ j`) of `items`, both mutable.
fn two_mut<T>(items: &mut [T], (i, j): (usize, usize)) -> (&mut T, &mut T) {
    assert_ne!(i, j, "two different elements");
    if i < j {
        let (low, high) = items.split_at_mut(j);
        (&mut low[i], &mut high[0])
    } else {
        let (low, high) = items.split_at_mut(i);
        (&mut high[0], &mut low[j])
    }
}

/// Where the backward of a projection finds its adapter's weight gradients.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LoraGrads {
    /// Computed with the projection's input gradient, `dh = dy·B` in `LoraWork::dh`.
    Here,
    /// Computed already by [`Ctx::lora_weight_backward_pair`], `dh` of the pair's first in
    /// `LoraWork::dh`, of its second in `LoraWork::dh_pair`.
    Paired { second: bool },
}

/// What every launch of one micro-batch shares.
struct Ctx<'a> {
    model: &'a GpuModel,
    /// `T = B·S`.
    tokens: usize,
    attention: SeqShape,
    positions: Positions,
    eps: f32,
    rank: usize,
    /// LoRA's `s`.
    scale: f32,
    /// The micro-batch: the first writes the adapters' gradients, the others add to them.
    micro: usize,
    /// The backward's GEMMs (and attention, `SeqShape::grad_exponent`) scale their gradient
    /// input by `2^grad_exponent` where they round it to f16 (`Gemm::input_exponent`): the
    /// gradient of the mean loss over `N` targets is of the order of `1/N`, which f16 holds
    /// only as subnormals or zero (at `N` = 4096 the logits' gradients are ~1e-8). Scaled by
    /// `2^⌊log2 N⌋`, the gradients are those of the summed loss, of the order of 1, far from
    /// both ends of f16's range. One that passes 65504 even so rounds to ±∞ on the tensor
    /// cores: the adapters' gradients are then not finite, and the trainer skips the step.
    grad_exponent: i32,
}

impl Ctx<'_> {
    /// `y = residual + x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ` for `projection` of `layer` (no
    /// residual: `y` is overwritten), saving `x·Aᵀ` in `lora_h` where LoRA adapts it. The
    /// residual is the GEMM's epilogue (`linear::fusion`): no copy of it into `y` first; so is
    /// LoRA's up-projection on the tensor cores ([`lora_fuses`]). The bias is not fused:
    /// on the H200 the fused GEMM costs more than its own kernel (BENCHMARKS.md, "Fusion").
    /// With `h_ready`, `lora_h` holds `x·Aᵀ` already ([`Ctx::lora_down_pair`]). `x` comes in
    /// f16 only for a projection LoRA does not adapt (the down projection's [`Hidden::F16`]).
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        (layer, projection): (usize, Projection),
        x: Operand<'_>,
        y: &mut GpuBuffer<f32>,
        (lora_h, h_ready): (&mut [GpuBuffer<f32>], bool),
        residual: Option<&GpuBuffer<f32>>,
    ) -> Result<(), ModelError> {
        let weights = &self.model.layers[layer];
        // Only an unadapted projection's input comes in f16 (`Hidden::F16`).
        let x32 = || match x {
            Operand::F32(x) => x,
            Operand::F16(_) => unreachable!("an adapted projection reads its input in f32"),
        };
        let (out, input) = projection.shape(self.model.config());
        let gemm = self
            .model
            .gemm(Product::Nt, (self.tokens, out, input), false);
        let frozen = weights.projection(projection).weights();
        let adapter = adapters.index(layer, projection).map(|i| {
            let h = &mut lora_h[i % adapters.lora().targets.len()];
            (&adapters.adapters[i], h)
        });
        let chosen_as = Gemm {
            accumulate: residual.is_some(),
            ..gemm
        };
        let fuse_lora = adapter.is_some() && lora_fuses(rec, &chosen_as, &frozen, self.rank);
        let (adapter, up) = match adapter {
            Some((adapter, h)) if fuse_lora => {
                if !h_ready {
                    execute_lora_down(rec, x32(), &adapter.a, self.rank, h)?;
                }
                let up = LoraUp {
                    h,
                    weight: UpWeight::B(&adapter.b),
                    rank: self.rank,
                    scale: self.scale,
                    columns: None,
                };
                (None, Some(up))
            }
            adapter => (adapter, None),
        };
        let residual = residual.map(|residual| Residual { residual });
        let epilogues: Vec<&dyn GemmFusion> = residual
            .iter()
            .map(|r| r as &dyn GemmFusion)
            .chain(up.iter().map(|u| u as &dyn GemmFusion))
            .collect();
        let fusion = Fusion {
            prologue: None,
            epilogues: &epilogues,
        };
        execute_gemm_fused(rec, &gemm, &fusion, x, frozen, &mut *y)?;
        if let Some(bias) = weights.bias(projection) {
            execute_add_bias(rec, y, bias)?;
        }
        match adapter {
            Some((adapter, h)) if h_ready => {
                execute_lora_up(rec, h, &adapter.b, self.rank, self.scale, y)?
            }
            Some((adapter, h)) => {
                let x = x32();
                execute_lora_forward(rec, x, &adapter.a, &adapter.b, self.rank, self.scale, h, y)?
            }
            None => {}
        }
        Ok(())
    }

    /// Where LoRA adapts both the query and the value projections of `layer`: their products
    /// into `r`, `x·A_qᵀ` and `x·A_vᵀ`, into their `lora_h` in one pass over `x` (the attention's
    /// normed input), and `true`; else nothing, and `false`.
    fn lora_down_pair(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        layer: usize,
        x: &GpuBuffer<f32>,
        lora_h: &mut [GpuBuffer<f32>],
    ) -> Result<bool, ModelError> {
        let (Some(q), Some(v)) = (
            adapters.index(layer, Projection::Q),
            adapters.index(layer, Projection::V),
        ) else {
            return Ok(false);
        };
        let targets = adapters.lora().targets.len();
        let (hq, hv) = two_mut(lora_h, (q % targets, v % targets));
        let a = (&adapters.adapters[q].a, &adapters.adapters[v].a);
        execute_lora_down_pair(rec, x, a, self.rank, (hq, hv))?;
        Ok(true)
    }

    /// The weight gradients of the query and value adapters of `layer` (as
    /// [`Ctx::project_backward`] computes them, written by the first micro-batch, added to by
    /// the others) in one `execute_lora_weight_backward_pair`: `dh` of each into
    /// `work.dh` and `work.dh_pair`, for their projections' input gradients after.
    fn lora_weight_backward_pair(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &mut GpuAdapters,
        (layer, saved): (usize, &LayerActivations),
        (dq, dv): (&GpuBuffer<f32>, &GpuBuffer<f32>),
        work: &mut LoraWork,
    ) -> Result<(), ModelError> {
        let at = |p| {
            adapters
                .index(layer, p)
                .expect("the caller checked both are adapted")
        };
        let (q, v) = (at(Projection::Q), at(Projection::V));
        let targets = adapters.lora().targets.len();
        let (aq, av) = two_mut(&mut adapters.adapters, (q, v));
        let LoraWork {
            dh,
            dh_pair,
            scratch,
        } = work;
        let dh_pair = dh_pair
            .as_mut()
            .expect("StepBuffers::new gives a pair's dh where LoRA adapts Q and V");
        let (gq, gv) = (aq.grads_for(self.micro), av.grads_for(self.micro));
        let q_in = LoraBackward {
            x: projection_input(saved, Projection::Q),
            a: gq.a,
            b: gq.b,
            h: &saved.lora_h[q % targets],
            dy: dq,
        };
        let v_in = LoraBackward {
            x: projection_input(saved, Projection::V),
            a: gv.a,
            b: gv.b,
            h: &saved.lora_h[v % targets],
            dy: dv,
        };
        let pair = [
            WeightBackward {
                inputs: &q_in,
                dh,
                da: gq.da,
                db: gq.db,
            },
            WeightBackward {
                inputs: &v_in,
                dh: dh_pair,
                da: gv.da,
                db: gv.db,
            },
        ];
        execute_lora_weight_backward_pair(rec, pair, self.rank, self.scale, scratch)?;
        if self.micro > 0 {
            aq.add_micro_grads(rec)?;
            av.add_micro_grads(rec)?;
        }
        Ok(())
    }

    /// `dx (+)= dy·W + s·(dy·B)·A` for `projection` of `layer` (one GEMM on the tensor
    /// cores), and its adapter's gradients (written by the first micro-batch, added to by the
    /// others) unless `grads` says they were computed already.
    #[allow(clippy::too_many_arguments)]
    fn project_backward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &mut GpuAdapters,
        (layer, projection): (usize, Projection),
        saved: &LayerActivations,
        dy: &GpuBuffer<f32>,
        dx: &mut GpuBuffer<f32>,
        (work, grads): (&mut LoraWork, LoraGrads),
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let weights = &self.model.layers[layer];
        let (out, input) = projection.shape(self.model.config());
        let gemm = self
            .model
            .gemm(Product::Nn, (self.tokens, out, input), accumulate)
            .with_input_exponent(self.grad_exponent);
        let frozen = weights.projection(projection).weights();
        let Some(i) = adapters.index(layer, projection) else {
            return Ok(execute_gemm(rec, &gemm, dy, frozen, &mut *dx)?);
        };
        let target = i % adapters.lora().targets.len();
        let adapter = &mut adapters.adapters[i];
        let AdapterGrads {
            a,
            b,
            da: grad_a,
            db: grad_b,
        } = adapter.grads_for(self.micro);
        let inputs = LoraBackward {
            x: projection_input(saved, projection),
            a,
            b,
            h: &saved.lora_h[target],
            dy,
        };
        let (rank, scale) = (self.rank, self.scale);
        let LoraWork {
            dh,
            dh_pair,
            scratch,
        } = work;
        let dh = match (grads, dh_pair) {
            (LoraGrads::Paired { second: true }, Some(dh_pair)) => dh_pair,
            _ => dh,
        };
        let here = grads == LoraGrads::Here;
        if lora_fuses(rec, &gemm, &frozen, rank) {
            // `dx = dy·W + s·dh·A` in one GEMM, `dh = dy·B` first.
            if here {
                execute_lora_weight_backward(
                    rec, &inputs, rank, scale, dh, scratch, grad_a, grad_b,
                )?;
            }
            let up = LoraUp {
                h: dh,
                weight: UpWeight::A(a),
                rank,
                scale,
                columns: None,
            };
            let fusion = Fusion {
                prologue: None,
                epilogues: &[&up],
            };
            execute_gemm_fused(rec, &gemm, &fusion, dy, frozen, &mut *dx)?;
        } else if here {
            execute_gemm(rec, &gemm, dy, frozen, &mut *dx)?;
            execute_lora_backward(rec, &inputs, rank, scale, dh, scratch, grad_a, grad_b, dx)?;
        } else {
            execute_gemm(rec, &gemm, dy, frozen, &mut *dx)?;
            execute_input_grad(rec, dh, a, rank, scale, dx)?;
        }
        if self.micro > 0 && here {
            adapter.add_micro_grads(rec)?;
        }
        Ok(())
    }

    /// `dn = [dq | dk | dv]·[W_q; W_k; W_v] (+ s·dh_q·A_q + s·dh_v·A_v)`, the input gradient
    /// through the query, key and value projections, as one GEMM over the block-major
    /// `d_qkv` (`execute_gemm_blocks`; each of the three alone stages a narrower depth), and
    /// `true`: where the layer holds `[W_q; W_k; W_v]` in one allocation, the tensor cores
    /// take the GEMM, and LoRA adapts none of the three or (`paired`) the query and value,
    /// whose weight gradients and `dh` are computed already ([`Ctx::lora_weight_backward_pair`]):
    /// both `s·dh·A` folded into the GEMM (a step's depth after another, `LoraUps`), or a
    /// launch each after it where the tile's step cannot hold one. Elsewhere `false`, and
    /// nothing is recorded. (With a q/k norm, Qwen3's, the caller never asks: the
    /// projections' gradients are then the norms' outputs, not views of `d_qkv`.)
    fn qkv_backward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        layer: usize,
        d_qkv: &GpuBuffer<f32>,
        dn: &mut GpuBuffer<f32>,
        (lora, paired): (&LoraWork, bool),
    ) -> Result<bool, ModelError> {
        let c = self.model.config();
        let Some(qkv) = self.model.layers[layer].qkv() else {
            return Ok(false);
        };
        let adapted = |p| adapters.index(layer, p);
        let pair = match (adapted(Projection::Q), adapted(Projection::K)) {
            (None, None) if adapted(Projection::V).is_none() => None,
            (Some(q), None) if paired => {
                let v = adapted(Projection::V).expect("a pair adapts the value projection");
                let dh_v = lora.dh_pair.as_ref().expect("a pair has its second dh");
                Some([(q, &lora.dh), (v, dh_v)])
            }
            _ => return Ok(false),
        };
        let widths = [Projection::Q, Projection::K, Projection::V].map(|p| p.shape(c).0);
        let gemm = self
            .model
            .gemm(
                Product::Nn,
                (self.tokens, widths.iter().sum(), c.dim),
                false,
            )
            .with_input_exponent(self.grad_exponent);
        let weights = qkv.weights();
        let path = gemm_blocks_path(rec.gpu(), &gemm, &widths, &weights, HalfBuffers::NONE);
        let Some(GemmPath::TensorCores { tile, .. }) = path else {
            return Ok(false);
        };
        // Folded where the tile's step holds it; element by element after the product it
        // would cost more than a launch of its own (BENCHMARKS.md, "Fusion").
        let fold = low_rank_fits(self.rank, tile.bk);
        let a_of = |i: usize| &adapters.adapters[i].a;
        let ups: Vec<LoraUp> = (pair.iter().flatten())
            .filter(|_| fold)
            .map(|&(i, dh)| LoraUp {
                h: dh,
                weight: UpWeight::A(a_of(i)),
                rank: self.rank,
                scale: self.scale,
                columns: None,
            })
            .collect();
        let ups = LoraUps { ups: &ups };
        let epilogues: Vec<&dyn GemmFusion> = match fold && pair.is_some() {
            true => vec![&ups],
            false => vec![],
        };
        let fusion = Fusion {
            prologue: None,
            epilogues: &epilogues,
        };
        execute_gemm_blocks(rec, &gemm, &widths, &fusion, d_qkv, weights, &mut *dn)?;
        for (i, dh) in pair.into_iter().flatten().filter(|_| !fold) {
            execute_input_grad(rec, dh, a_of(i), self.rank, self.scale, dn)?;
        }
        Ok(true)
    }

    /// `[q | k | v] = n1·[W_q; W_k; W_v]ᵀ` (+ LoRA's up-projections, + biases) as one GEMM
    /// into the block-major `saved.qkv` (`execute_gemm_output_blocks`: one launch with three
    /// times the workgroups of the key's and value's own), and `true`: where the layer holds
    /// `[W_q; W_k; W_v]` in one allocation, `q`, `k` and `v` are views of one (no q/k norm),
    /// and the tensor cores take the GEMM at a tile whose step holds an up-projection
    /// (`low_rank_fits`): each adapted projection's `s·h·Bᵀ` is folded over its own columns
    /// (`LoraUps`; a workgroup's tile lies in one projection, so the query's and the value's
    /// share a fold's depth), `h = n1·Aᵀ` computed first (`paired`: the query's and value's
    /// already, [`Ctx::lora_down_pair`]). Elsewhere `false`, and nothing is recorded. (Without
    /// the fold, after the merged GEMM each adapted projection took a `lora_up` launch, which
    /// cost more than the merge saved: 32.9 against 32.3 ms a step on an H100, BENCHMARKS.md
    /// "One GEMM for the query, key and value".)
    fn qkv_forward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        layer: usize,
        a: &mut LayerActivations,
        paired: bool,
    ) -> Result<bool, ModelError> {
        let (c, weights) = (self.model.config(), &self.model.layers[layer]);
        let (Some(frozen), Some(qkv)) = (weights.qkv(), a.qkv.as_mut()) else {
            return Ok(false);
        };
        let projections = [Projection::Q, Projection::K, Projection::V];
        let widths = projections.map(|p| p.shape(c).0);
        let gemm = self.model.gemm(
            Product::Nt,
            (self.tokens, widths.iter().sum(), c.dim),
            false,
        );
        let frozen = frozen.weights();
        let path = gemm_output_blocks_path(rec.gpu(), &gemm, &widths, &frozen, HalfBuffers::NONE);
        let Some(GemmPath::TensorCores { tile, .. }) = path else {
            return Ok(false);
        };
        let targets = adapters.lora().targets.len();
        let adapted: Vec<(usize, usize)> = (0..3)
            .filter_map(|p| adapters.index(layer, projections[p]).map(|i| (p, i)))
            .collect();
        if !adapted.is_empty() && !low_rank_fits(self.rank, tile.bk) {
            return Ok(false);
        }
        // The pair's `h` are there already; the key's (or any without the pair) not.
        let ready = |p: usize| paired && p != 1;
        for &(_, i) in adapted.iter().filter(|&&(p, _)| !ready(p)) {
            let h = &mut a.lora_h[i % targets];
            execute_lora_down(rec, &a.n1, &adapters.adapters[i].a, self.rank, h)?;
        }
        let starts = [0, widths[0], widths[0] + widths[1]];
        let ups: Vec<LoraUp> = (adapted.iter())
            .map(|&(p, i)| LoraUp {
                h: &a.lora_h[i % targets],
                weight: UpWeight::B(&adapters.adapters[i].b),
                rank: self.rank,
                scale: self.scale,
                columns: Some(starts[p]..starts[p] + widths[p]),
            })
            .collect();
        let ups = LoraUps { ups: &ups };
        let epilogues: Vec<&dyn GemmFusion> = match adapted.is_empty() {
            true => vec![],
            false => vec![&ups],
        };
        let fusion = Fusion {
            prologue: None,
            epilogues: &epilogues,
        };
        execute_gemm_output_blocks(rec, &gemm, &widths, &fusion, &a.n1, frozen, qkv)?;
        for (p, y) in projections.into_iter().zip([&mut a.q, &mut a.k, &mut a.v]) {
            if let Some(bias) = weights.bias(p) {
                execute_add_bias(rec, y, bias)?;
            }
        }
        Ok(true)
    }

    /// Block `layer`'s forward from `saved.x`, saving its activations; its output into `out`.
    fn block_forward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        layer: usize,
        saved: &mut LayerActivations,
        lens: &ValidLengths,
        out: &mut GpuBuffer<f32>,
    ) -> Result<(), ModelError> {
        let (c, w, eps) = (self.model.config(), &self.model.layers[layer], self.eps);
        let a = saved;
        execute_rms_norm_forward(rec, &a.x, &w.attn_norm, &mut a.n1, &mut a.rstd1, eps)?;
        let at = |p| (layer, p);
        let paired = self.lora_down_pair(rec, adapters, layer, &a.n1, &mut a.lora_h)?;
        if !self.qkv_forward(rec, adapters, layer, a, paired)? {
            let q_out = a.q_pre.as_mut().unwrap_or(&mut a.q);
            self.project(
                rec,
                adapters,
                at(Projection::Q),
                Operand::F32(&a.n1),
                q_out,
                (&mut a.lora_h, paired),
                None,
            )?;
            let k_out = a.k_pre.as_mut().unwrap_or(&mut a.k);
            self.project(
                rec,
                adapters,
                at(Projection::K),
                Operand::F32(&a.n1),
                k_out,
                (&mut a.lora_h, false),
                None,
            )?;
            self.project(
                rec,
                adapters,
                at(Projection::V),
                Operand::F32(&a.n1),
                &mut a.v,
                (&mut a.lora_h, paired),
                None,
            )?;
        }
        if let (Some(q_pre), Some(k_pre), Some(rstd_q), Some(rstd_k), Some(q_norm), Some(k_norm)) = (
            &a.q_pre,
            &a.k_pre,
            &mut a.rstd_q,
            &mut a.rstd_k,
            &w.q_norm,
            &w.k_norm,
        ) {
            execute_rms_norm_forward(rec, q_pre, q_norm, &mut a.q, rstd_q, eps)?;
            execute_rms_norm_forward(rec, k_pre, k_norm, &mut a.k, rstd_k, eps)?;
        }
        let heads = (c.heads, c.kv_heads);
        let qk = (&mut a.q, &mut a.k);
        execute_rope_qk(rec, qk, &self.model.rope, heads, self.positions, false)?;
        let inputs = SeqInputs {
            q: &a.q,
            k: &a.k,
            v: &a.v,
            lens: Some(lens),
        };
        execute_attention_forward(rec, self.attention, inputs, &mut a.o, &mut a.lse)?;
        if let (Some(o_sub), Some(rstd_o), Some(gamma)) =
            (&mut a.o_sub, &mut a.rstd_o, &w.attn_sub_norm)
        {
            execute_rms_norm_forward(rec, &a.o, gamma, o_sub, rstd_o, eps)?;
        }
        let o_in = a.o_sub.as_ref().unwrap_or(&a.o);
        self.project(
            rec,
            adapters,
            at(Projection::O),
            Operand::F32(o_in),
            &mut a.x1,
            (&mut a.lora_h, false),
            Some(&a.x),
        )?;

        execute_rms_norm_forward(rec, &a.x1, &w.ffn_norm, &mut a.n2, &mut a.rstd2, eps)?;
        // Packed: both projections in one GEMM over `[W_gate; W_up]`, rows of gate then up (in
        // f16: rounded as they are stored).
        let packed = self
            .model
            .gemm(Product::Nt, (self.tokens, 2 * c.ffn_dim, c.dim), false);
        match &mut a.gate_up {
            GateUp::Packed(gate_up) => {
                let merged = merged_gate_up(w).weights();
                execute_gemm(rec, &packed, &a.n2, merged, &mut *gate_up)?;
                execute_swiglu_packed_forward(rec, gate_up, c.ffn_dim, a.h.f32_mut())?;
            }
            GateUp::PackedHalf(gate_up) => {
                let merged = merged_gate_up(w).weights();
                execute_gemm(rec, &packed, &a.n2, merged, &mut *gate_up)?;
                match &mut a.h {
                    Hidden::F16(h) => {
                        execute_swiglu_packed_forward_half(rec, gate_up, c.ffn_dim, h)?
                    }
                    Hidden::F32(h) => {
                        execute_swiglu_packed_forward_f16(rec, gate_up, c.ffn_dim, h)?
                    }
                }
            }
            GateUp::Apart { gate, up } => {
                let n2 = &a.n2;
                self.project(
                    rec,
                    adapters,
                    at(Projection::Gate),
                    Operand::F32(n2),
                    gate,
                    (&mut a.lora_h, false),
                    None,
                )?;
                self.project(
                    rec,
                    adapters,
                    at(Projection::Up),
                    Operand::F32(n2),
                    up,
                    (&mut a.lora_h, false),
                    None,
                )?;
                match (&mut a.h_sub, &mut a.rstd_h, &w.ffn_sub_norm) {
                    (Some(h_sub), Some(rstd_h), Some(gamma)) => {
                        execute_relu_sqr_mul_forward(rec, gate, up, a.h.f32_mut())?;
                        execute_rms_norm_forward(rec, a.h.f32(), gamma, h_sub, rstd_h, eps)?;
                    }
                    _ => execute_swiglu_forward(rec, gate, up, a.h.f32_mut())?,
                }
            }
        }
        let h_in = match (&a.h_sub, &a.h) {
            (Some(h_sub), _) => Operand::F32(h_sub),
            (None, Hidden::F32(h)) => Operand::F32(h),
            (None, Hidden::F16(h)) => Operand::F16(h),
        };
        self.project(
            rec,
            adapters,
            at(Projection::Down),
            h_in,
            out,
            (&mut a.lora_h, false),
            Some(&a.x1),
        )
    }

    /// Block `layer`'s backward: `work.dx` holds `∂loss/∂(its output)` and is left holding
    /// `∂loss/∂(its input)`; every adapter of the block gets its gradients.
    fn block_backward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &mut GpuAdapters,
        layer: usize,
        a: &LayerActivations,
        lens: &ValidLengths,
        work: &mut Workspace,
    ) -> Result<(), ModelError> {
        let (c, w) = (self.model.config(), &self.model.layers[layer]);
        let at = |p| (layer, p);
        let Workspace {
            dx,
            dn,
            d_h,
            d_h_sub,
            d_gate_up,
            d_o,
            d_o_attn,
            stats,
            scores,
            d_q,
            d_k,
            d_v,
            d_qkv,
            d_q_pre,
            d_k_pre,
            lora,
        } = work;

        // x2 = x1 + h·W_downᵀ: dx is ∂/∂x2, and ∂/∂x1 gets it unchanged (the residual) plus
        // the FFN's path, added below.
        let d_down_in = d_h_sub.as_mut().unwrap_or(d_h);
        self.project_backward(
            rec,
            adapters,
            at(Projection::Down),
            a,
            dx,
            d_down_in,
            (lora, LoraGrads::Here),
            false,
        )?;
        match (&a.gate_up, d_gate_up) {
            (GateUp::Packed(gate_up), GateUp::Packed(d_gate_up)) => {
                // `dn = d_gate·W_gate + d_up·W_up` as one GEMM of depth 2I.
                execute_swiglu_packed_backward(rec, gate_up, c.ffn_dim, d_h, d_gate_up)?;
                let gemm = self
                    .model
                    .gemm(Product::Nn, (self.tokens, 2 * c.ffn_dim, c.dim), false)
                    .with_input_exponent(self.grad_exponent);
                execute_gemm(rec, &gemm, d_gate_up, merged_gate_up(w).weights(), &mut *dn)?;
            }
            (GateUp::PackedHalf(gate_up), GateUp::PackedHalf(d_gate_up)) => {
                // `d_gate_up` holds `2^e·∂` rounded to f16, what the GEMM above would have
                // rounded; the weights' scale `2^−e` takes it back (both exact).
                let e = self.grad_exponent;
                execute_swiglu_packed_backward_f16(rec, gate_up, c.ffn_dim, d_h, e, d_gate_up)?;
                let gemm = self
                    .model
                    .gemm(Product::Nn, (self.tokens, 2 * c.ffn_dim, c.dim), false);
                let weights = merged_gate_up(w).scaled_weights(2f32.powi(-e));
                execute_gemm(rec, &gemm, &*d_gate_up, weights, &mut *dn)?;
            }
            (
                GateUp::Apart { gate, up },
                GateUp::Apart {
                    gate: d_gate,
                    up: d_up,
                },
            ) => {
                match (&a.h_sub, &a.rstd_h, &w.ffn_sub_norm, d_h_sub) {
                    (Some(_), Some(rstd_h), Some(gamma), Some(d_h_sub)) => {
                        execute_rms_norm_backward(
                            rec,
                            a.h.f32(),
                            gamma,
                            rstd_h,
                            d_h_sub,
                            d_h,
                            false,
                        )?;
                        execute_relu_sqr_mul_backward(rec, gate, up, d_h, d_gate, d_up)?;
                    }
                    _ => execute_swiglu_backward(rec, gate, up, d_h, d_gate, d_up)?,
                }
                let gate = at(Projection::Gate);
                let here = (&mut *lora, LoraGrads::Here);
                self.project_backward(rec, adapters, gate, a, d_gate, dn, here, false)?;
                let up = at(Projection::Up);
                let here = (&mut *lora, LoraGrads::Here);
                self.project_backward(rec, adapters, up, a, d_up, dn, here, true)?;
            }
            _ => {
                unreachable!("StepBuffers::new lays the gate and up and their gradients out alike")
            }
        }
        execute_rms_norm_backward(rec, &a.x1, &w.ffn_norm, &a.rstd2, dn, dx, true)?;

        // x1 = x + o·W_oᵀ: the same for the attention's path.
        let here = (&mut *lora, LoraGrads::Here);
        self.project_backward(rec, adapters, at(Projection::O), a, dx, d_o, here, false)?;
        let d_attn: &GpuBuffer<f32> = match (&a.rstd_o, &w.attn_sub_norm, d_o_attn.as_mut()) {
            (Some(rstd_o), Some(gamma), Some(d_o_attn)) => {
                execute_rms_norm_backward(rec, &a.o, gamma, rstd_o, d_o, d_o_attn, false)?;
                d_o_attn
            }
            _ => d_o,
        };
        let saved = SeqSaved {
            inputs: SeqInputs {
                q: &a.q,
                k: &a.k,
                v: &a.v,
                lens: Some(lens),
            },
            o: &a.o,
            lse: &a.lse,
        };
        let grads = SeqGrads {
            stats,
            scores: scores.as_mut(),
            d_q,
            d_k,
            d_v,
        };
        execute_attention_backward(rec, self.attention, saved, d_attn, grads)?;
        let heads = (c.heads, c.kv_heads);
        let qk = (&mut *d_q, &mut *d_k);
        execute_rope_qk(rec, qk, &self.model.rope, heads, self.positions, true)?;
        let (mut dq_in, mut dk_in): (&GpuBuffer<f32>, &GpuBuffer<f32>) = (d_q, d_k);
        // `[d_q | d_k | d_v]` as the query, key and value projections' gradients take it.
        let mut blocks_in = d_qkv.as_ref();
        if let (
            Some(q_pre),
            Some(k_pre),
            Some(rstd_q),
            Some(rstd_k),
            Some(q_norm),
            Some(k_norm),
            Some(d_q_pre),
            Some(d_k_pre),
        ) = (
            &a.q_pre,
            &a.k_pre,
            &a.rstd_q,
            &a.rstd_k,
            &w.q_norm,
            &w.k_norm,
            d_q_pre.as_mut(),
            d_k_pre.as_mut(),
        ) {
            execute_rms_norm_backward(rec, q_pre, q_norm, rstd_q, dq_in, d_q_pre, false)?;
            execute_rms_norm_backward(rec, k_pre, k_norm, rstd_k, dk_in, d_k_pre, false)?;
            (dq_in, dk_in) = (d_q_pre, d_k_pre);
            blocks_in = None;
        }
        // The query and value adapters' weight gradients in one pair where both are adapted.
        let paired = lora.dh_pair.is_some()
            && adapters.index(layer, Projection::Q).is_some()
            && adapters.index(layer, Projection::V).is_some();
        let (q_grads, v_grads) = match paired {
            true => {
                let dys = (dq_in, &*d_v);
                self.lora_weight_backward_pair(rec, adapters, (layer, a), dys, lora)?;
                let first = LoraGrads::Paired { second: false };
                (first, LoraGrads::Paired { second: true })
            }
            false => (LoraGrads::Here, LoraGrads::Here),
        };
        let merged = match blocks_in {
            Some(d_qkv) => self.qkv_backward(rec, adapters, layer, d_qkv, dn, (lora, paired))?,
            None => false,
        };
        if !merged {
            let q = (&mut *lora, q_grads);
            self.project_backward(rec, adapters, at(Projection::Q), a, dq_in, dn, q, false)?;
            let k = (&mut *lora, LoraGrads::Here);
            self.project_backward(rec, adapters, at(Projection::K), a, dk_in, dn, k, true)?;
            let v = (&mut *lora, v_grads);
            self.project_backward(rec, adapters, at(Projection::V), a, d_v, dn, v, true)?;
        }
        execute_rms_norm_backward(rec, &a.x, &w.attn_norm, &a.rstd1, dn, dx, true)?;
        Ok(())
    }

    /// The final norm of `x_out`, then chunk by chunk of tokens the logits, their
    /// cross-entropy (each chunk's rows divided by the step's one `N`) and, given `dn`, the
    /// gradient of the norm's output into it; the per-token losses into this micro-batch's rows of
    /// `loss.token_loss`.
    fn loss_forward_backward(
        &self,
        rec: &mut Recorder<'_>,
        x_out: &GpuBuffer<f32>,
        labels: &GpuBuffer<i32>,
        loss: &mut LossBuffers,
        chunk: usize,
        mut dn: Option<&mut GpuBuffer<f32>>,
    ) -> Result<(), ModelError> {
        let c = self.model.config();
        let (t, d, vocab) = (self.tokens, c.dim, c.vocab);
        let head = self.model.head();
        execute_rms_norm_forward(
            rec,
            x_out,
            &self.model.final_norm,
            &mut loss.n,
            &mut loss.rstd,
            self.eps,
        )?;
        let mut first = 0;
        while first < t {
            let rows = chunk.min(t - first);
            rec.copy_range(&loss.n, first * d, &loss.n_chunk, 0, rows * d)?;
            if rows < chunk {
                // The rows past the batch's end hold an earlier chunk's values: masked, they
                // add nothing.
                rec.fill(&loss.labels_chunk, IGNORE_INDEX)?;
            }
            rec.copy_range(labels, self.micro * t + first, &loss.labels_chunk, 0, rows)?;
            let gemm = self.model.gemm(Product::Nt, (chunk, vocab, d), false);
            execute_gemm(rec, &gemm, &loss.n_chunk, head, &mut loss.logits)?;
            execute_cross_entropy_stats(
                rec,
                &loss.logits,
                &loss.labels_chunk,
                vocab,
                &loss.count,
                &mut loss.logit_stats,
                &mut loss.token_loss_chunk,
            )?;
            if let Some(dn) = dn.as_deref_mut() {
                let gemm = self
                    .model
                    .gemm(Product::Nn, (chunk, vocab, d), false)
                    .with_input_exponent(self.grad_exponent);
                // `dz` computed from the logits as the GEMM reads them: never written.
                let grad = CrossEntropyGrad {
                    stats: &loss.logit_stats,
                    labels: &loss.labels_chunk,
                };
                let fusion = Fusion {
                    prologue: Some(&grad),
                    epilogues: &[],
                };
                // Split-K: 24 tiles of the output over a depth of the vocabulary leave most
                // of the GPU idle (BENCHMARKS.md, "Split-K for the lm-head's backward").
                let (logits, scratch) = (&loss.logits, &mut loss.d_n_split);
                let out = &mut loss.d_n_chunk;
                execute_gemm_split_fused(rec, &gemm, &fusion, logits, head, out, scratch)?;
                rec.copy_range(&loss.d_n_chunk, 0, dn, first * d, rows * d)?;
            }
            let at = self.micro * t + first;
            rec.copy_range(&loss.token_loss_chunk, 0, &loss.token_loss, at, rows)?;
            first += rows;
        }
        Ok(())
    }
}

/// `Ok` when `buffers` were made for `model`'s config and precision and `adapters`' LoRA
/// config.
fn check_buffers(
    model: &GpuModel,
    adapters: &GpuAdapters,
    buffers: &StepBuffers,
) -> Result<(), ModelError> {
    let (config, lora, precision) = buffers.made_for();
    let adapters_fit = adapters.config() == model.config() && adapters.lora() == lora;
    if config != model.config() || !adapters_fit || precision != model.precision() {
        return Err(ModelError::invalid(
            "StepBuffers",
            "model",
            "buffers made by StepBuffers::new for this model and these adapters",
            format!(
                "buffers of another model, precision or LoRA config ({config:?}, {precision:?}, {lora:?})"
            ),
        ));
    }
    Ok(())
}

/// The context of a step over `buffers`' shape, at micro-batch 0.
fn context<'a>(model: &'a GpuModel, adapters: &GpuAdapters, buffers: &StepBuffers) -> Ctx<'a> {
    let c = model.config();
    let shape = buffers.shape;
    let grad_exponent = buffers.targets.max(1).ilog2() as i32;
    Ctx {
        model,
        tokens: shape.tokens(),
        attention: shape
            .attention(c, model.precision())
            .with_grad_exponent(grad_exponent),
        positions: Positions {
            seq_len: shape.seq_len as u32,
            offset: 0,
        },
        eps: c.norm_eps as f32,
        rank: adapters.lora().rank,
        scale: adapters.lora().scale() as f32,
        micro: 0,
        grad_exponent,
    }
}

impl Ctx<'_> {
    /// The embedding of micro-batch `self.micro` and every block's forward: the last block's
    /// output into `buffers.x_out`.
    fn blocks_forward(
        &self,
        rec: &mut Recorder<'_>,
        adapters: &GpuAdapters,
        buffers: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        let c = self.model.config();
        let (t, micro) = (self.tokens, self.micro);
        let StepBuffers {
            shape,
            layers,
            layer_inputs,
            x_out,
            inputs,
            ..
        } = buffers;
        let lens = &inputs.lens[micro];
        rec.copy_range(&inputs.tokens, micro * t, &inputs.tokens_micro, 0, t)?;
        let x0 = match layer_inputs.first_mut() {
            Some(x0) => x0,
            None => &mut layers[0].x,
        };
        execute_embedding(rec, &self.model.embed, &inputs.tokens_micro, c.dim, x0)?;
        for layer in 0..c.layers {
            if shape.recompute {
                // The one set of activations, filled from this block's kept input.
                let (input, next) = layer_inputs[layer..].split_first_mut().expect("layer < L");
                let out = next.first_mut().unwrap_or(&mut *x_out);
                rec.copy(input, &layers[0].x)?;
                self.block_forward(rec, adapters, layer, &mut layers[0], lens, out)?;
            } else {
                let (this, next) = layers[layer..].split_first_mut().expect("layer < L");
                let out = match next.first_mut() {
                    Some(next) => &mut next.x,
                    None => &mut *x_out,
                };
                self.block_forward(rec, adapters, layer, this, lens, out)?;
            }
        }
        Ok(())
    }
}

/// Record the forward and backward of the micro-batches [`StepBuffers::load`] wrote: the loss
/// (mean cross-entropy over the targets of all micro-batches) into [`StepBuffers::loss`] and
/// its gradient with respect to every adapter into the adapters' gradients (overwritten).
pub fn record_forward_backward(
    rec: &mut Recorder<'_>,
    model: &GpuModel,
    adapters: &mut GpuAdapters,
    buffers: &mut StepBuffers,
) -> Result<(), ModelError> {
    check_buffers(model, adapters, buffers)?;
    let c = model.config();
    let mut ctx = context(model, adapters, buffers);
    let labels = &buffers.inputs.labels;
    execute_cross_entropy_count(rec, labels, c.vocab, &mut buffers.loss.count)?;
    for micro in 0..buffers.shape.micro_batches {
        ctx.micro = micro;
        ctx.blocks_forward(rec, adapters, buffers)?;
        let StepBuffers {
            shape,
            chunk,
            layers,
            layer_inputs,
            x_out,
            work,
            loss,
            inputs,
            ..
        } = &mut *buffers;
        let dn = Some(&mut work.dn);
        ctx.loss_forward_backward(rec, x_out, &inputs.labels, loss, *chunk, dn)?;
        execute_rms_norm_backward(
            rec,
            x_out,
            &model.final_norm,
            &loss.rstd,
            &work.dn,
            &mut work.dx,
            false,
        )?;
        let lens = &inputs.lens[micro];
        for layer in (0..c.layers).rev() {
            let saved = if shape.recompute {
                // The forward again, from the kept input (its output lands in `x_out`, which
                // the loss no longer needs): the same kernels on the same values, so the same
                // activations to the bit.
                rec.copy(&layer_inputs[layer], &layers[0].x)?;
                ctx.block_forward(rec, adapters, layer, &mut layers[0], lens, x_out)?;
                &layers[0]
            } else {
                &layers[layer]
            };
            ctx.block_backward(rec, adapters, layer, saved, lens, work)?;
        }
    }
    let loss = &mut buffers.loss;
    execute_cross_entropy_mean(rec, &loss.token_loss, &loss.count, &mut loss.loss)?;
    Ok(())
}

/// Record the forward alone of the micro-batches [`StepBuffers::load`] wrote: the loss into
/// [`StepBuffers::loss`] and each position's into [`StepBuffers::token_losses`], as
/// [`record_forward_backward`] computes them, without the backward (an eval step). The
/// adapters' gradients are left as they are.
pub fn record_forward_loss(
    rec: &mut Recorder<'_>,
    model: &GpuModel,
    adapters: &GpuAdapters,
    buffers: &mut StepBuffers,
) -> Result<(), ModelError> {
    check_buffers(model, adapters, buffers)?;
    let mut ctx = context(model, adapters, buffers);
    let labels = &buffers.inputs.labels;
    execute_cross_entropy_count(rec, labels, model.config().vocab, &mut buffers.loss.count)?;
    for micro in 0..buffers.shape.micro_batches {
        ctx.micro = micro;
        ctx.blocks_forward(rec, adapters, buffers)?;
        let b = &mut *buffers;
        ctx.loss_forward_backward(rec, &b.x_out, &b.inputs.labels, &mut b.loss, b.chunk, None)?;
    }
    let loss = &mut buffers.loss;
    execute_cross_entropy_mean(rec, &loss.token_loss, &loss.count, &mut loss.loss)?;
    Ok(())
}

/// Record the forward of the one micro-batch [`StepBuffers::load`] wrote and the logits of
/// the given positions (`b·S + s`, one per row of `out`) into [`LogitsBuffers::logits`]: what
/// generation reads (each sequence's last position).
pub fn record_logits(
    rec: &mut Recorder<'_>,
    model: &GpuModel,
    adapters: &GpuAdapters,
    buffers: &mut StepBuffers,
    positions: &[usize],
    out: &mut LogitsBuffers,
) -> Result<(), ModelError> {
    check_buffers(model, adapters, buffers)?;
    let c = model.config();
    let shape = buffers.shape;
    let bad = |field: &str, expected: String, given: String| {
        Err(ModelError::invalid("record_logits", field, expected, given))
    };
    if shape.micro_batches != 1 {
        let expected = "buffers of one micro-batch".to_string();
        return bad("buffers", expected, shape.micro_batches.to_string());
    }
    if out.vocab != c.vocab {
        let expected = format!("LogitsBuffers of the model's vocabulary ({})", c.vocab);
        return bad("out", expected, out.vocab.to_string());
    }
    if positions.len() != out.rows {
        let expected = format!("{} positions (the LogitsBuffers' rows)", out.rows);
        return bad("positions", expected, positions.len().to_string());
    }
    if let Some(&p) = positions.iter().find(|&&p| p >= shape.tokens()) {
        let expected = format!("positions below B·S = {}", shape.tokens());
        return bad("positions", expected, p.to_string());
    }
    let ctx = context(model, adapters, buffers);
    ctx.blocks_forward(rec, adapters, buffers)?;
    let (d, loss) = (c.dim, &mut buffers.loss);
    let eps = c.norm_eps as f32;
    execute_rms_norm_forward(
        rec,
        &buffers.x_out,
        &model.final_norm,
        &mut loss.n,
        &mut loss.rstd,
        eps,
    )?;
    for (row, &p) in positions.iter().enumerate() {
        rec.copy_range(&loss.n, p * d, &out.n, row * d, d)?;
    }
    let gemm = model.gemm(Product::Nt, (out.rows, c.vocab, d), false);
    execute_gemm(rec, &gemm, &out.n, model.head(), &mut out.logits)?;
    Ok(())
}

/// The optimizer of the adapters: AdamW over every `A` and `B`, LoRA+ and global-norm
/// clipping (PyTorch's `clip_grad_norm_`, over all adapters together).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Optimizer {
    pub adamw: AdamW,
    /// Clip the gradients' global norm to this; `None` does not clip.
    pub max_grad_norm: Option<f64>,
    /// LoRA+: `B` trains at this multiple of the learning rate (1 is plain LoRA).
    pub lora_plus_ratio: f64,
}

impl Default for Optimizer {
    /// `torch.optim.AdamW`'s defaults (weight decay 0.01: Hugging Face's `Trainer` uses 0.0),
    /// clipping at 1.0 (Hugging Face's `max_grad_norm`), no LoRA+.
    fn default() -> Self {
        Optimizer {
            adamw: AdamW::default(),
            max_grad_norm: Some(1.0),
            lora_plus_ratio: 1.0,
        }
    }
}

impl Optimizer {
    /// `Ok` when every value is one AdamW takes, at learning rate `lr` and step `step`: checked
    /// before anything of the step is recorded.
    pub fn check(&self, (lr, step): (f64, u32)) -> Result<(), ModelError> {
        let bad = |field: &str, expected: &str, given: f64| {
            Err(ModelError::invalid("Optimizer", field, expected, given))
        };
        let a = &self.adamw;
        if step == 0 {
            return bad(
                "step",
                "a step number from 1 (Adam's bias corrections)",
                0.0,
            );
        }
        for (field, beta) in [("adamw.beta1", a.beta1), ("adamw.beta2", a.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(field, "in [0, 1)", beta);
            }
        }
        let positive = [
            ("adamw.eps", a.eps),
            ("lora_plus_ratio", self.lora_plus_ratio),
            ("max_grad_norm", self.max_grad_norm.unwrap_or(1.0)),
        ];
        for (field, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return bad(field, "positive and finite", value);
            }
        }
        for (field, value) in [("adamw.weight_decay", a.weight_decay), ("lr", lr)] {
            if !(value.is_finite() && value >= 0.0) {
                return bad(field, "finite and at least 0", value);
            }
        }
        Ok(())
    }
}

/// Record one optimizer step over every adapter from the gradients
/// [`record_forward_backward`] left: the global gradient norm into
/// [`StepBuffers::grad_norm`], then AdamW at learning rate `lr` as step `step` (from 1).
///
/// A gradient that is not finite makes the norm not finite, and then the update is skipped:
/// the adapters and the optimizer state keep their values, and the norm says why. A step whose
/// micro-batches have no target has loss 0 and zero gradients (not PyTorch's 0/0 = NaN): AdamW
/// then applies only its weight decay and its moments' decay, as PyTorch does with zero
/// gradients.
pub fn record_optimizer_step(
    rec: &mut Recorder<'_>,
    optimizer: &Optimizer,
    (lr, step): (f64, u32),
    adapters: &mut GpuAdapters,
    buffers: &mut StepBuffers,
) -> Result<(), ModelError> {
    optimizer.check((lr, step))?;
    let ratio = optimizer.lora_plus_ratio;
    let arenas = &mut adapters.arenas;
    execute_global_grad_norm(
        rec,
        &[&arenas.grads.whole],
        &mut buffers.norm_partials,
        &mut buffers.grad_norm,
    )?;
    // Without clipping the norm still guards the update: a coefficient of exactly 1 for every
    // finite norm, and a skipped step for one that is not.
    let max_norm = optimizer.max_grad_norm.map_or(f32::MAX, |m| m as f32);
    let clip = Clip::GlobalNorm {
        norm: &buffers.grad_norm,
        max_norm,
    };
    let step_a = Step {
        lr: lr as f32,
        t: step,
        clip,
    };
    let step_b = Step {
        lr: (lr * ratio) as f32,
        t: step,
        clip,
    };
    // Every `A` in one launch, every `B` in another (at LoRA+'s rate), over their arenas.
    let (values, grads, m, v) = (
        &mut arenas.values,
        &arenas.grads,
        &mut arenas.m,
        &mut arenas.v,
    );
    let adamw = &optimizer.adamw;
    execute_adamw(
        rec,
        adamw,
        &step_a,
        &mut values.a,
        &grads.a,
        &mut m.a,
        &mut v.a,
    )?;
    execute_adamw(
        rec,
        adamw,
        &step_b,
        &mut values.b,
        &grads.b,
        &mut m.b,
        &mut v.b,
    )?;
    Ok(())
}
