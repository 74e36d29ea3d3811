//! Linear (recurrent) attention: the gated delta rule of Gated DeltaNet (Qwen3-Next,
//! Qwen3.5/3.6; arch doc 1.7) and of Kimi Delta Attention (Kimi Linear, GLM-5-next; 1.8).
//!
//! A layer projects each token to queries, keys and values (through a short causal
//! convolution with SiLU), a write strength `β` and a decay, and keeps per value head a
//! `dk × dv` state `S`: per token `S ← S·exp(g)`, `S ← S + k ⊗ β(v − Sᵀk)`, `o = Sᵀq`. The
//! output is normalised per head, gated, and projected back. What a sequence keeps
//! ([`LayerKv::state`]) is the convolution's last `K − 1` inputs followed by the states, a
//! fixed size whatever the length. Prefill and decode run the same per-token recurrence in
//! the same order, so a prompt run at once and token by token give the same bits.
//!
//! The variants differ only in how the inputs are projected ([`Projection`]), the shape of the
//! decay ([`Decay`]: one per value head, or one per key channel), the l2 normalisation's form
//! ([`L2Norm`]) and the output gate's activation ([`GateAct`]).

use rayon::prelude::*;

use super::cache::LayerKv;
use super::layers::{rows_of, sigmoid, silu, Linear};
use crate::format::safetensors::Checkpoint;
use crate::Result;

/// A depthwise causal convolution over the token axis (kernel `K`, no bias) followed by SiLU:
/// `out[t, c] = silu(Σ_j w[c, j] · x[t − (K−1) + j, c])`, so `w[c, K−1]` weighs the current
/// token. Several checkpoint tensors of the same kernel may be concatenated channel-wise
/// (Kimi's separate q/k/v convolutions): each channel is independent.
pub struct ShortConv {
    /// `[channels, kernel]`.
    pub weight: Vec<f32>,
    pub channels: usize,
    pub kernel: usize,
}

impl ShortConv {
    /// Concatenate the `[C_i, 1, K]` convolution weights `names` (channels `channels[i]`).
    pub fn load(ckpt: &Checkpoint, names: &[(&str, usize)], kernel: usize) -> Result<ShortConv> {
        let mut weight = Vec::new();
        let mut total = 0;
        for &(name, c) in names {
            weight.extend(ckpt.weight(name, &[c, 1, kernel])?.to_f32_vec()?);
            total += c;
        }
        Ok(ShortConv {
            weight,
            channels: total,
            kernel,
        })
    }

    /// Values of the state it keeps: the last `K − 1` input rows.
    pub fn state_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }

    /// Convolve rows `x` (`[T, C]`, in place) after the previous inputs in `state`
    /// (`[K − 1, C]`, oldest first), which then holds the last `K − 1` inputs.
    pub fn forward(&self, x: &mut [f32], state: &mut [f32]) {
        self.convolve(x, state, |acc, _| silu(acc));
    }

    /// The convolution with a residual and no activation, `(x + conv(x)) / divisor` (Inkling's
    /// short convolutions: divisor 1; Inkling 2's: `√(K + 1)`), with the same state as
    /// [`ShortConv::forward`].
    pub fn forward_residual(&self, x: &mut [f32], state: &mut [f32], divisor: f32) {
        self.convolve(x, state, |acc, input| (acc + input) / divisor);
    }

    /// Convolve in place, each output `finish(Σ_j w·x, x_t)`.
    fn convolve(&self, x: &mut [f32], state: &mut [f32], finish: impl Fn(f32, f32) -> f32) {
        let (c, k) = (self.channels, self.kernel);
        let t_len = x.len() / c;
        let mut window: Vec<f32> = Vec::with_capacity(state.len() + x.len());
        window.extend_from_slice(state);
        window.extend_from_slice(x);
        for t in 0..t_len {
            let out = &mut x[t * c..(t + 1) * c];
            for (ch, o) in out.iter_mut().enumerate() {
                let w = &self.weight[ch * k..(ch + 1) * k];
                let mut acc = 0.0f32;
                for (j, wj) in w.iter().enumerate() {
                    acc += wj * window[(t + j) * c + ch];
                }
                *o = finish(acc, *o);
            }
        }
        state.copy_from_slice(&window[window.len() - state.len()..]);
    }
}

/// A causal convolution whose taps change with every token (Inkling 2's key and value
/// convolutions on full-attention layers): at token `t`, tap `lag` (0 the current token) of
/// channel `c` is `static_w[lag, c] + taps_t[head(c), lag]`, where `taps_t` is a projection of
/// the token's own input (one set of `K` taps per head of `channels / heads` channels), and
/// `out_t = (Σ_lag w · x[t − lag] + x[t]) / √(2K + 1)`, in f32. What a sequence keeps is, as
/// for [`ShortConv`], the last `K − 1` inputs.
pub struct DynamicConv {
    /// `[K, channels]`.
    pub static_w: Vec<f32>,
    /// `[heads · K, input width]`.
    pub taps: Linear,
    pub channels: usize,
    pub kernel: usize,
    pub heads: usize,
}

impl DynamicConv {
    /// `{prefix}.static_w` `[K, channels]` and `{prefix}.weight_proj` `[heads · K, input]`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        channels: usize,
        heads: usize,
        kernel: usize,
        input: usize,
    ) -> Result<DynamicConv> {
        Ok(DynamicConv {
            static_w: ckpt
                .weight(&format!("{prefix}.static_w"), &[kernel, channels])?
                .to_f32_vec()?,
            taps: Linear::from_tensor(
                ckpt.weight(&format!("{prefix}.weight_proj"), &[heads * kernel, input])?,
            ),
            channels,
            kernel,
            heads,
        })
    }

    /// Values of the state it keeps: the last `K − 1` input rows.
    pub fn state_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }

    /// Convolve rows `x` (`[T, C]`, in place) with the per-token taps `taps` (`[T, heads · K]`,
    /// [`DynamicConv::taps`] of the rows' inputs) after the previous inputs in `state`, which
    /// then holds the last `K − 1` inputs.
    pub fn forward(&self, x: &mut [f32], taps: &[f32], state: &mut [f32]) {
        let (c, k) = (self.channels, self.kernel);
        let per_head = c / self.heads;
        let divisor = ((2 * k + 1) as f64).sqrt() as f32;
        let t_len = x.len() / c;
        let mut window: Vec<f32> = Vec::with_capacity(state.len() + x.len());
        window.extend_from_slice(state);
        window.extend_from_slice(x);
        for t in 0..t_len {
            let tt = &taps[t * self.heads * k..(t + 1) * self.heads * k];
            for ch in 0..c {
                let dynamic = &tt[(ch / per_head) * k..(ch / per_head + 1) * k];
                let mut acc = 0.0f32;
                for (lag, d) in dynamic.iter().enumerate() {
                    let w = self.static_w[lag * c + ch] + d;
                    acc += window[(t + k - 1 - lag) * c + ch] * w;
                }
                x[t * c + ch] = (acc + x[t * c + ch]) / divisor;
            }
        }
        state.copy_from_slice(&window[window.len() - state.len()..]);
    }
}

/// How queries and keys are l2-normalised (in f32, eps 1e-6).
#[derive(Debug, Clone, Copy)]
pub enum L2Norm {
    /// `x · rsqrt(Σx² + ε)` (Gated DeltaNet).
    Rsqrt,
    /// `x / sqrt(Σx² + ε)` (Kimi Delta Attention).
    Div,
}

impl L2Norm {
    fn apply(self, x: &mut [f32]) {
        let s = x.iter().map(|v| v * v).sum::<f32>() + 1e-6;
        match self {
            L2Norm::Rsqrt => {
                let r = 1.0 / s.sqrt();
                x.iter_mut().for_each(|v| *v *= r);
            }
            L2Norm::Div => {
                let r = s.sqrt();
                x.iter_mut().for_each(|v| *v /= r);
            }
        }
    }
}

/// The output gate's activation in the gated RMSNorm.
#[derive(Debug, Clone, Copy)]
pub enum GateAct {
    /// SiLU (Gated DeltaNet).
    Silu,
    /// Sigmoid (Kimi Delta Attention).
    Sigmoid,
}

/// The decay `g ≤ 0` (log space) of every token, from the decay projection `a`.
pub enum Decay {
    /// One per value head: `g = −exp(A_log) · softplus(a + dt_bias)` (Gated DeltaNet).
    PerHead {
        /// `−exp(A_log)`, `[heads]`.
        neg_a: Vec<f32>,
        dt_bias: Vec<f32>,
    },
    /// One per key channel of every head (Kimi Delta Attention):
    /// `g = −exp(A_log_h) · softplus(a + dt_bias)`, or with a lower bound `ℓ`
    /// `g = ℓ · sigmoid(exp(A_log_h) · (a + dt_bias))`.
    PerChannel {
        /// `exp(A_log)`, `[heads]`.
        exp_a: Vec<f32>,
        /// `[heads · dk]`.
        dt_bias: Vec<f32>,
        lower_bound: Option<f32>,
    },
}

/// `log(1 + e^x)` as torch computes it (`x` itself above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `log(1 + e^x)` as Kimi Delta Attention writes it (`torch.log(1.0 + torch.exp(x))`, `x`
/// itself above 20), which rounds differently from [`softplus`]'s `log1p`.
fn softplus_log(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

impl Decay {
    /// Decay values per token: `heads` (per head) or `heads · dk` (per channel).
    fn width(&self, heads: usize, dk: usize) -> usize {
        match self {
            Decay::PerHead { .. } => heads,
            Decay::PerChannel { .. } => heads * dk,
        }
    }

    /// `g` from the projected rows `a` (in place), `dk` values per head for per-channel decay.
    fn apply(&self, a: &mut [f32], dk: usize) {
        match self {
            Decay::PerHead { neg_a, dt_bias } => {
                for row in a.chunks_mut(neg_a.len()) {
                    for ((g, na), b) in row.iter_mut().zip(neg_a).zip(dt_bias) {
                        *g = na * softplus(*g + b);
                    }
                }
            }
            Decay::PerChannel {
                exp_a,
                dt_bias,
                lower_bound,
            } => {
                for row in a.chunks_mut(dt_bias.len()) {
                    for (i, (g, b)) in row.iter_mut().zip(dt_bias).enumerate() {
                        let ea = exp_a[i / dk];
                        *g = match lower_bound {
                            Some(l) => l * sigmoid(ea * (*g + b)),
                            None => -ea * softplus_log(*g + b),
                        };
                    }
                }
            }
        }
    }
}

/// Where a layer's inputs come from.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum Projection {
    /// Qwen3-Next: `in_proj_qkvz` grouped per key head as
    /// `[q dk | k dk | v r·dv | z r·dv]` and `in_proj_ba` as `[b r | a r]` (`r` value heads
    /// per key head).
    Grouped { qkvz: Linear, ba: Linear },
    /// Qwen3.5/3.6: `in_proj_qkv` (`[q | k | v]`), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    /// Kimi Delta Attention: separate `q`/`k`/`v` projections, the decay through a low-rank
    /// pair `f_b(f_a(x))`, `β` from `b`, the output gate through `g_b(g_a(x))`.
    Kimi {
        q: Linear,
        k: Linear,
        v: Linear,
        f_a: Linear,
        f_b: Linear,
        b: Linear,
        g_a: Linear,
        g_b: Linear,
    },
}

/// The projected rows of one or several sequences (`[T, ·]` each).
pub struct LinearRows {
    /// `[q | k | v]` before the convolution.
    pub qkv: Vec<f32>,
    /// The output gate, `[T, heads · dv]`.
    pub z: Vec<f32>,
    /// `β` before its sigmoid, `[T, heads]`.
    pub b: Vec<f32>,
    /// The decay input, `[T, decay width]`.
    pub a: Vec<f32>,
}

/// A linear-attention layer (Gated DeltaNet or Kimi Delta Attention).
pub struct LinearAttention {
    pub projection: Projection,
    pub conv: ShortConv,
    pub decay: Decay,
    pub l2: L2Norm,
    /// Query/key heads (`k_heads`) and value heads (`heads`); each query/key head serves
    /// `heads / k_heads` consecutive value heads.
    pub k_heads: usize,
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// The gated RMSNorm's weight (`[dv]`, plain `w`), eps and gate activation.
    pub norm_weight: Vec<f32>,
    pub norm_eps: f32,
    pub gate_act: GateAct,
    pub out: Linear,
}

impl LinearAttention {
    /// Values of a sequence's state: the convolution window, then `heads` `dk × dv` states.
    pub fn state_len(&self) -> usize {
        self.conv.state_len() + self.heads * self.dk * self.dv
    }

    /// The projections of rows `x` (any number of sequences: row-wise).
    pub fn project(&self, x: &[f32]) -> LinearRows {
        let (nk, nv, dk, dv) = (self.k_heads, self.heads, self.dk, self.dv);
        match &self.projection {
            Projection::Grouped { qkvz, ba } => {
                let (mixed, mixed_ba) = (qkvz.forward(x), ba.forward(x));
                let r = nv / nk;
                let group = 2 * dk + 2 * r * dv;
                let t_len = mixed.len() / (nk * group);
                let mut rows = LinearRows {
                    qkv: Vec::with_capacity(t_len * (2 * nk * dk + nv * dv)),
                    z: Vec::with_capacity(t_len * nv * dv),
                    b: Vec::with_capacity(t_len * nv),
                    a: Vec::with_capacity(t_len * nv),
                };
                for (row, ba_row) in mixed.chunks(nk * group).zip(mixed_ba.chunks(2 * nv)) {
                    let groups: Vec<&[f32]> = row.chunks(group).collect();
                    for part in [0..dk, dk..2 * dk, 2 * dk..2 * dk + r * dv] {
                        for g in &groups {
                            rows.qkv.extend_from_slice(&g[part.clone()]);
                        }
                    }
                    for g in &groups {
                        rows.z.extend_from_slice(&g[2 * dk + r * dv..]);
                    }
                    for g in ba_row.chunks(2 * r) {
                        rows.b.extend_from_slice(&g[..r]);
                    }
                    for g in ba_row.chunks(2 * r) {
                        rows.a.extend_from_slice(&g[r..]);
                    }
                }
                rows
            }
            Projection::Split { qkv, z, b, a } => LinearRows {
                qkv: qkv.forward(x),
                z: z.forward(x),
                b: b.forward(x),
                a: a.forward(x),
            },
            Projection::Kimi {
                q,
                k,
                v,
                f_a,
                f_b,
                b,
                g_a,
                g_b,
            } => {
                let (q, k, v) = (q.forward(x), k.forward(x), v.forward(x));
                let t_len = q.len() / (nk * dk);
                let mut qkv = Vec::with_capacity(q.len() + k.len() + v.len());
                for t in 0..t_len {
                    qkv.extend_from_slice(&q[t * nk * dk..(t + 1) * nk * dk]);
                    qkv.extend_from_slice(&k[t * nk * dk..(t + 1) * nk * dk]);
                    qkv.extend_from_slice(&v[t * nv * dv..(t + 1) * nv * dv]);
                }
                LinearRows {
                    qkv,
                    z: g_b.forward(&g_a.forward(x)),
                    b: b.forward(x),
                    a: f_b.forward(&f_a.forward(x)),
                }
            }
        }
    }

    /// One sequence's attention from its rows `start..start + n` of the projected stack of
    /// `tokens` rows: convolution, decay, the recurrence from the state in `kv` (updated), the
    /// gated norm. Returns the rows before the output projection (`[n, heads · dv]`).
    pub fn attend_sequence(
        &self,
        stack: &LinearRows,
        (start, n, tokens): (usize, usize, usize),
        kv: &mut LayerKv,
    ) -> Vec<f32> {
        let (nk, nv, dk, dv) = (self.k_heads, self.heads, self.dk, self.dv);
        let seg = |v: &[f32]| rows_of(v, start, n, tokens);
        let (mut qkv, z, b, mut a) = (seg(&stack.qkv), seg(&stack.z), seg(&stack.b), seg(&stack.a));
        let conv_len = self.conv.state_len();
        let (conv_state, states) = kv.state.split_at_mut(conv_len);
        self.conv.forward(&mut qkv, conv_state);
        self.decay.apply(&mut a, dk);
        let width = 2 * nk * dk + nv * dv;
        let t_len = qkv.len() / width;
        let decay_width = self.decay.width(nv, dk);
        let r = nv / nk;
        let scale = (dk as f64).sqrt() as f32;
        let mut out = vec![0.0f32; t_len * nv * dv];
        // Heads are independent: one task per value head, tokens in order.
        let mut per_head: Vec<Vec<f32>> = vec![Vec::new(); nv];
        per_head
            .par_iter_mut()
            .zip(states.par_chunks_mut(dk * dv))
            .enumerate()
            .for_each(|(h, (o_h, s))| {
                let kh = h / r;
                o_h.resize(t_len * dv, 0.0);
                let (mut q, mut k) = (vec![0.0f32; dk], vec![0.0f32; dk]);
                let mut kv_mem = vec![0.0f32; dv];
                for t in 0..t_len {
                    let row = &qkv[t * width..(t + 1) * width];
                    q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
                    k.copy_from_slice(&row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk]);
                    let v = &row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv];
                    self.l2.apply(&mut q);
                    self.l2.apply(&mut k);
                    q.iter_mut().for_each(|x| *x /= scale);
                    let beta = sigmoid(b[t * nv + h]);
                    let g = &a[t * decay_width..(t + 1) * decay_width];
                    match self.decay {
                        Decay::PerHead { .. } => {
                            let e = g[h].exp();
                            s.iter_mut().for_each(|x| *x *= e);
                        }
                        Decay::PerChannel { .. } => {
                            for (i, srow) in s.chunks_mut(dv).enumerate() {
                                let e = g[h * dk + i].exp();
                                srow.iter_mut().for_each(|x| *x *= e);
                            }
                        }
                    }
                    kv_mem.fill(0.0);
                    for (srow, ki) in s.chunks(dv).zip(&k) {
                        for (m, sv) in kv_mem.iter_mut().zip(srow) {
                            *m += sv * ki;
                        }
                    }
                    for (m, vj) in kv_mem.iter_mut().zip(v) {
                        *m = (vj - *m) * beta; // δ
                    }
                    for (srow, ki) in s.chunks_mut(dv).zip(&k) {
                        for (sv, dj) in srow.iter_mut().zip(&kv_mem) {
                            *sv += ki * dj;
                        }
                    }
                    let o = &mut o_h[t * dv..(t + 1) * dv];
                    for (srow, qi) in s.chunks(dv).zip(&q) {
                        for (oo, sv) in o.iter_mut().zip(srow) {
                            *oo += sv * qi;
                        }
                    }
                }
            });
        for (h, o_h) in per_head.iter().enumerate() {
            for t in 0..t_len {
                out[(t * nv + h) * dv..(t * nv + h + 1) * dv]
                    .copy_from_slice(&o_h[t * dv..(t + 1) * dv]);
            }
        }
        // Gated RMSNorm per head: rms(o)·w, then · act(z).
        for (o, z) in out.chunks_mut(dv).zip(z.chunks(dv)) {
            let mean_sq = o.iter().map(|v| v * v).sum::<f32>() / dv as f32;
            let r = 1.0 / (mean_sq + self.norm_eps).sqrt();
            for ((v, w), zz) in o.iter_mut().zip(&self.norm_weight).zip(z) {
                let gate = match self.gate_act {
                    GateAct::Silu => silu(*zz),
                    GateAct::Sigmoid => sigmoid(*zz),
                };
                *v = w * (*v * r) * gate;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_conv_decoded_token_by_token_equals_all_at_once() {
        let conv = ShortConv {
            weight: (0..12).map(|i| 0.1 * i as f32 - 0.5).collect(),
            channels: 3,
            kernel: 4,
        };
        let x: Vec<f32> = (0..15).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let mut all = x.clone();
        let mut state = vec![0.0; conv.state_len()];
        conv.forward(&mut all, &mut state);
        let mut step_state = vec![0.0; conv.state_len()];
        let mut steps = Vec::new();
        for row in x.chunks(3) {
            let mut r = row.to_vec();
            conv.forward(&mut r, &mut step_state);
            steps.extend(r);
        }
        assert_eq!(all, steps);
        assert_eq!(state, step_state);
        // The first output sees only the current token: silu(w[c, K-1] · x[0, c]).
        assert_eq!(all[1], silu(conv.weight[7] * x[1]));
    }

    #[test]
    fn residual_and_dynamic_convs_decoded_token_by_token_equal_all_at_once() {
        let conv = ShortConv {
            weight: (0..12).map(|i| 0.1 * i as f32 - 0.5).collect(),
            channels: 4,
            kernel: 3,
        };
        // 2 heads of 2 channels, 3 taps each; taps per token as a projection would give them.
        let dynamic = DynamicConv {
            static_w: (0..12).map(|i| 0.05 * i as f32 - 0.2).collect(),
            taps: Linear::from_tensor(crate::tensor::Tensor::from_f32("t", &[6, 1], &[0.0; 6])),
            channels: 4,
            kernel: 3,
            heads: 2,
        };
        let x: Vec<f32> = (0..20).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let taps: Vec<f32> = (0..30).map(|i| ((i * 3) % 7) as f32 * 0.1 - 0.3).collect();
        let run = |step: usize| {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let mut sa = vec![0.0; conv.state_len()];
            let mut sb = vec![0.0; dynamic.state_len()];
            for (t0, rows) in x.chunks(4 * step).enumerate() {
                let n = rows.len() / 4;
                let mut ra = rows.to_vec();
                conv.forward_residual(&mut ra, &mut sa, 2.0);
                a.extend(ra);
                let mut rb = rows.to_vec();
                let tt = &taps[t0 * step * 6..(t0 * step + n) * 6];
                dynamic.forward(&mut rb, tt, &mut sb);
                b.extend(rb);
            }
            (a, b, sa, sb)
        };
        assert_eq!(run(5), run(1));
        let (a, b, _, _) = run(5);
        // The first token sees only itself: (w[c, K−1]·x + x) / 2, and for the dynamic
        // convolution (w_lag0·x + x) / √7 with w_lag0 = static_w[0, c] + its head's tap 0.
        assert_eq!(a[1], (conv.weight[5] * x[1] + x[1]) / 2.0);
        let w = dynamic.static_w[3] + taps[3];
        assert_eq!(b[3], (x[3] * w + x[3]) / 7f64.sqrt() as f32);
    }

    #[test]
    fn softplus_matches_its_definition_and_threshold() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(-3.0) - (1.0f32 + (-3.0f32).exp()).ln()).abs() < 1e-7);
    }
}
