//! The expert cache's reuse estimate ([`super::moe::Eviction::Reuse`]).
//!
//! A decoder visits its MoE layers in a cycle, one layer after the other,
//! every step. An expert's next use is therefore at its layer's next visit,
//! if the router picks it then: `distance` layers from now (1 for the next
//! layer, `L` for the layer just run), with the probability `p` that its
//! layer's router picks it, estimated as the decayed share of its layer's
//! past visits that used it; if not, a whole cycle later with the same
//! chance, and so on. Belady's MIN evicts the entry used farthest in the
//! future; here the expected next use is `distance + L (1 - p) / p` layers
//! away, and an expert's value is its inverse (0 for an expert never
//! used). LRU and LRFU do the opposite on this cycle: the experts used
//! longest ago are those of the layers about to run.
//!
//! A visit begins when the decoder moves to another layer. With a single
//! MoE layer nothing marks where one visit ends and the next begins: the
//! estimate sees one long visit, every expert ever used has `p = 1`, and
//! the ranking among them is by distance alone (use [`super::moe::Eviction::Lrfu`]
//! for a model with one MoE layer).
#![forbid(unsafe_code)]

/// Powers `decay^k` kept in a table (a victim's choice values every
/// candidate; `powf` was most of its time).
const POWERS: usize = 1024;

/// Per-expert use shares and the layer being visited.
#[derive(Debug, Clone)]
pub(crate) struct Reuse {
    /// Per-visit decay of past visits, in (0, 1].
    decay: f64,
    /// `decay^k` for `k < POWERS`, each as `powf` gives it.
    powers: Vec<f64>,
    /// Visits of each layer so far.
    visits: Vec<u64>,
    /// Per layer, `Σ decay^k` over its visits so far (as `weight` gives
    /// it), kept up to date as visits begin.
    weights: Vec<f64>,
    /// The layer being visited (that of the last fetch).
    current: Option<u32>,
    /// Per expert: its layer, its decayed count of visits that used it (as
    /// of `seen`), the layer's visit count then, and the visit that last
    /// counted it (an expert counts once per visit).
    experts: Vec<Use>,
}

#[derive(Debug, Clone, Copy)]
struct Use {
    layer: u32,
    uses: f64,
    seen: u64,
    counted: u64,
}

impl Reuse {
    /// An estimate forgetting a visit's weight by `decay` per later visit of
    /// the same layer.
    pub(crate) fn new(decay: f64) -> Self {
        Self {
            decay,
            powers: (0..POWERS).map(|k| decay.powf(k as f64)).collect(),
            visits: Vec::new(),
            weights: Vec::new(),
            current: None,
            experts: Vec::new(),
        }
    }

    /// `decay^k`.
    fn power(&self, k: u64) -> f64 {
        match self.powers.get(k as usize) {
            Some(&x) => x,
            None => self.decay.powf(k as f64),
        }
    }

    /// `Σ decay^k` over `v` visits.
    fn weight(&self, v: u64) -> f64 {
        if self.decay < 1.0 {
            (1.0 - self.power(v)) / (1.0 - self.decay)
        } else {
            v as f64
        }
    }

    /// Adds expert `i` (the next index) of `layer`.
    pub(crate) fn add(&mut self, layer: u32) {
        if self.visits.len() <= layer as usize {
            self.visits.resize(layer as usize + 1, 0);
            self.weights.resize(layer as usize + 1, 0.0);
        }
        self.experts.push(Use {
            layer,
            uses: 0.0,
            seen: 0,
            counted: 0,
        });
    }

    /// The decoder is at `layer` (a fetch, or reads started for one): a new
    /// visit of it begins unless it is the layer being visited.
    pub(crate) fn at(&mut self, layer: u32) {
        if self.current != Some(layer) && (layer as usize) < self.visits.len() {
            self.current = Some(layer);
            self.visits[layer as usize] += 1;
            self.weights[layer as usize] = self.weight(self.visits[layer as usize]);
        }
    }

    /// Expert `i` is used in the current visit of its layer.
    pub(crate) fn touch(&mut self, i: usize) {
        let e = self.experts[i];
        self.at(e.layer);
        let v = self.visits[e.layer as usize];
        if e.counted == v {
            return;
        }
        let uses = e.uses * self.power(v - e.seen) + 1.0;
        let u = &mut self.experts[i];
        u.uses = uses;
        u.seen = v;
        u.counted = v;
    }

    /// The share of its layer's visits that used expert `i`, decayed: 0 for
    /// a layer never visited.
    pub(crate) fn probability(&self, i: usize) -> f64 {
        let e = self.experts[i];
        let v = self.visits[e.layer as usize];
        if v == 0 {
            return 0.0;
        }
        let uses = e.uses * self.power(v - e.seen);
        // Σ decay^k over the v visits so far.
        (uses / self.weights[e.layer as usize]).min(1.0)
    }

    /// Layers from now to `layer`'s next visit: 1 for the next layer, the
    /// layer count for the one being visited.
    pub(crate) fn distance(&self, layer: u32) -> f64 {
        let n = self.visits.len().max(1) as i64;
        match self.current {
            None => 1.0,
            Some(c) => ((layer as i64 - c as i64 - 1).rem_euclid(n) + 1) as f64,
        }
    }

    /// Expert `i`'s value: the inverse of the layers until its expected
    /// next use.
    pub(crate) fn value(&self, i: usize) -> f64 {
        self.worth(self.probability(i), self.experts[i].layer)
    }

    /// The inverse of the expected layers until the next use of an entry
    /// of `layer` used with probability `p` at each visit of its layer:
    /// `distance + L (1 - p) / p`, geometric over the visits.
    pub(crate) fn worth(&self, p: f64, layer: u32) -> f64 {
        let cycle = self.visits.len().max(1) as f64;
        let d = self.distance(layer);
        if p <= 0.0 {
            0.0
        } else {
            p / (p * d + cycle * (1.0 - p))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layer_about_to_run_is_worth_more_than_the_one_just_run() {
        let mut r = Reuse::new(0.9);
        for l in 0..4 {
            r.add(l);
        }
        for _ in 0..3 {
            for l in 0..4 {
                r.touch(l as usize);
            }
        }
        // At layer 3: layer 0 runs next, layer 3 is the farthest away.
        assert_eq!(r.distance(0), 1.0);
        assert_eq!(r.distance(3), 4.0);
        assert!(r.value(0) > r.value(1) && r.value(1) > r.value(2) && r.value(2) > r.value(3));
        assert!((r.probability(3) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn probability_is_the_decayed_share_of_visits() {
        let mut r = Reuse::new(1.0);
        r.add(0); // expert 0
        r.add(0); // expert 1
        r.add(1); // expert 2, another layer
        for visit in 0..4 {
            r.touch(0);
            if visit % 2 == 0 {
                r.touch(1);
                r.touch(1); // twice in one visit counts once
            }
            r.touch(2);
        }
        assert!((r.probability(0) - 1.0).abs() < 1e-12);
        assert!((r.probability(1) - 0.5).abs() < 1e-12);
        // With decay, recent visits weigh more: used in the last visit only.
        let mut d = Reuse::new(0.5);
        d.add(0);
        d.add(0);
        d.add(1);
        for visit in 0..3 {
            d.touch(0);
            if visit == 2 {
                d.touch(1);
            }
            d.touch(2);
        }
        // Visits weigh 0.25, 0.5, 1: expert 1 has 1 / 1.75.
        assert!((d.probability(1) - 1.0 / 1.75).abs() < 1e-12);
    }

    #[test]
    fn the_table_of_powers_gives_what_powf_gives_past_its_end() {
        // Expert 0 used at every third visit of layer 0, over more visits
        // than the table holds; the share as the closed form computes it.
        let decay = 0.5f64.powf(1.0 / 256.0);
        let mut r = Reuse::new(decay);
        r.add(0);
        r.add(1);
        let visits = POWERS as u64 + 500;
        let mut uses = 0.0;
        for v in 1..=visits {
            r.at(0);
            if v % 3 == 0 {
                r.touch(0);
                uses = uses * decay.powf(3.0) + 1.0;
            }
            r.at(1);
        }
        let last = visits - visits % 3;
        let expected = uses * decay.powf((visits - last) as f64)
            / ((1.0 - decay.powf(visits as f64)) / (1.0 - decay));
        let got = r.probability(0);
        assert!((got - expected).abs() < 1e-12, "{got} against {expected}");
        assert!((got - 1.0 / 3.0).abs() < 0.01, "about a third: {got}");
    }
}
