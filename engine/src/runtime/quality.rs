//! How far a model's next-token distributions are from a reference's on the same tokens:
//! mean KL divergence `KL(P_ref ‖ P_model)` and how often both put the same token on top
//! (llama.cpp's "Mean KLD" and "Same top p").

/// Running totals over positions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Divergence {
    /// Positions compared.
    pub positions: usize,
    /// Σ KL over positions (nats).
    pub kl_sum: f64,
    /// Largest single-position KL.
    pub kl_max: f64,
    /// Positions whose argmax agrees.
    pub same_top: usize,
}

impl Divergence {
    /// Add the positions of one pair of logits matrices (`rows × vocab` each).
    pub fn add(&mut self, reference: &[f32], model: &[f32], vocab: usize) {
        assert_eq!(reference.len(), model.len(), "logits of different shapes");
        for (r, m) in reference.chunks_exact(vocab).zip(model.chunks_exact(vocab)) {
            let kl = kl_divergence(r, m);
            self.kl_sum += kl;
            self.kl_max = self.kl_max.max(kl);
            self.same_top += usize::from(argmax(r) == argmax(m));
            self.positions += 1;
        }
    }

    /// Mean KL divergence (nats).
    pub fn mean_kl(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }

    /// Fraction of positions with the same top token.
    pub fn same_top_fraction(&self) -> f64 {
        self.same_top as f64 / self.positions.max(1) as f64
    }
}

/// `log softmax` in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// `KL(softmax(p) ‖ softmax(q))` in nats.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let lp = log_softmax(p_logits);
    let lq = log_softmax(q_logits);
    lp.iter()
        .zip(&lq)
        .map(|(&a, &b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_have_zero_divergence() {
        let l = [0.3f32, -1.0, 2.0, 0.0];
        assert_eq!(kl_divergence(&l, &l), 0.0);
        // A constant shift does not change a softmax.
        let shifted: Vec<f32> = l.iter().map(|x| x + 5.0).collect();
        assert!(kl_divergence(&l, &shifted) < 1e-12);
    }

    #[test]
    fn known_two_token_case() {
        // P = (0.5, 0.5), Q = softmax(ln 3, 0) = (0.75, 0.25):
        // KL = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3).
        let kl = kl_divergence(&[0.0, 0.0], &[3f32.ln(), 0.0]);
        assert!((kl - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7, "{kl}");
    }

    #[test]
    fn totals_count_positions_and_top_agreement() {
        let mut d = Divergence::default();
        let r = [1.0f32, 0.0, 0.0, 1.0];
        let m = [1.0f32, 0.0, 2.0, 0.0];
        d.add(&r, &m, 2);
        assert_eq!(d.positions, 2);
        assert_eq!(d.same_top, 1);
        assert!(d.mean_kl() > 0.0 && d.kl_max >= d.mean_kl());
    }
}
