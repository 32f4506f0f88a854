//! Checks of kernel results: BFS by the Graph500 rules, SSSP against a
//! serial Dijkstra, PageRank against a serial reference, CC against a
//! serial union-find labelling. Each returns a one-line reason on failure.
#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::algo::{BfsResult, PrResult, SsspResult};
use super::Csr;

/// Graph500 rules: the parents form a tree rooted at the source whose edges
/// exist in the graph and join levels differing by one; every edge from a
/// reached vertex reaches a vertex at most one level deeper; exactly the
/// vertices reachable from the source are reached.
pub fn bfs(g: &Csr, source: usize, r: &BfsResult) -> Result<(), String> {
    let n = g.vertices();
    if r.depth[source] != 0 || r.parent[source] as usize != source {
        return Err(format!("the source {source} is not the root at depth 0"));
    }
    for v in 0..n {
        let d = r.depth[v];
        if d < 0 {
            if r.parent[v] != u32::MAX {
                return Err(format!("vertex {v} is unreached but has a parent"));
            }
            continue;
        }
        if v != source {
            let p = r.parent[v] as usize;
            if p >= n || r.depth[p] != d - 1 {
                return Err(format!("vertex {v}: parent {p} is not one level up"));
            }
            if g.adjacency(p).binary_search(&(v as u32)).is_err() {
                return Err(format!("tree edge {p}->{v} is not in the graph"));
            }
        }
        for &u in g.adjacency(v) {
            let du = r.depth[u as usize];
            if du < 0 || du > d + 1 {
                return Err(format!(
                    "edge {v}->{u} joins depth {d} to {du}: more than one level"
                ));
            }
        }
    }
    // Coverage: a serial BFS reaches the same set.
    let mut seen = vec![false; n];
    let mut queue = vec![source];
    seen[source] = true;
    while let Some(u) = queue.pop() {
        for &v in g.adjacency(u) {
            if !seen[v as usize] {
                seen[v as usize] = true;
                queue.push(v as usize);
            }
        }
    }
    match (0..n).find(|&v| seen[v] != (r.depth[v] >= 0)) {
        Some(v) => Err(format!("vertex {v}: reached is {}", r.depth[v] >= 0)),
        None => Ok(()),
    }
}

/// Distances equal a serial Dijkstra's.
pub fn sssp(g: &Csr, source: usize, r: &SsspResult) -> Result<(), String> {
    sssp_against(&dijkstra(g, source), r)
}

/// Serial Dijkstra.
pub fn dijkstra(g: &Csr, source: usize) -> Vec<u64> {
    let n = g.vertices();
    let mut dist = vec![u64::MAX; n];
    dist[source] = 0;
    let mut heap = BinaryHeap::from([Reverse((0u64, source))]);
    while let Some(Reverse((d, u))) = heap.pop() {
        if d > dist[u] {
            continue;
        }
        let (a, b) = (g.offsets[u] as usize, g.offsets[u + 1] as usize);
        for i in a..b {
            let v = g.neighbors[i] as usize;
            let nd = d + g.weights[i] as u64;
            if nd < dist[v] {
                dist[v] = nd;
                heap.push(Reverse((nd, v)));
            }
        }
    }
    dist
}

/// Distances equal `reference`'s.
pub fn sssp_against(reference: &[u64], r: &SsspResult) -> Result<(), String> {
    match (0..reference.len()).find(|&v| reference[v] != r.dist[v]) {
        Some(v) => Err(format!(
            "vertex {v}: distance {} where Dijkstra finds {}",
            r.dist[v], reference[v]
        )),
        None => Ok(()),
    }
}

/// Scores within 1e-6 (absolute, per vertex) of a serial reference run to
/// the same tolerance.
pub fn pagerank(g: &Csr, tolerance: f64, max_iterations: u32, r: &PrResult) -> Result<(), String> {
    pagerank_residual(g, tolerance, &r.scores)?;
    pagerank_against(&pagerank_reference(g, tolerance, max_iterations), r)
}

/// The serial reference PageRank.
pub fn pagerank_reference(g: &Csr, tolerance: f64, max_iterations: u32) -> Vec<f64> {
    let n = g.vertices();
    let d = 0.85;
    let base = (1.0 - d) / n as f64;
    let mut scores = vec![1.0 / n as f64; n];
    for _ in 0..max_iterations {
        let contrib: Vec<f64> = (0..n)
            .map(|v| match g.degree(v) {
                0 => 0.0,
                k => scores[v] / k as f64,
            })
            .collect();
        let mut error = 0.0;
        for (v, s) in scores.iter_mut().enumerate() {
            let new = base
                + d * g
                    .incoming(v)
                    .iter()
                    .map(|&u| contrib[u as usize])
                    .sum::<f64>();
            error += (new - *s).abs();
            *s = new;
        }
        if error < tolerance {
            break;
        }
    }
    scores
}

/// GAP's check: one more iteration from `scores` changes them by less than
/// `tolerance` in L1 (a result stopped early fails it).
pub fn pagerank_residual(g: &Csr, tolerance: f64, scores: &[f32]) -> Result<(), String> {
    let n = g.vertices();
    let d = 0.85;
    let base = (1.0 - d) / n as f64;
    let contrib: Vec<f64> = (0..n)
        .map(|v| match g.degree(v) {
            0 => 0.0,
            k => f64::from(scores[v]) / k as f64,
        })
        .collect();
    let change: f64 = (0..n)
        .map(|v| {
            let new = base
                + d * g
                    .incoming(v)
                    .iter()
                    .map(|&u| contrib[u as usize])
                    .sum::<f64>();
            (new - f64::from(scores[v])).abs()
        })
        .sum();
    if change < tolerance {
        Ok(())
    } else {
        Err(format!(
            "one more iteration changes the scores by {change:e} (L1), not below {tolerance:e}"
        ))
    }
}

/// Scores within 1e-6 of `reference`, vertex by vertex.
pub fn pagerank_against(reference: &[f64], r: &PrResult) -> Result<(), String> {
    match (0..reference.len()).find(|&v| (reference[v] - f64::from(r.scores[v])).abs() > 1e-6) {
        Some(v) => Err(format!(
            "vertex {v}: score {} where the reference has {}",
            r.scores[v], reference[v]
        )),
        None => Ok(()),
    }
}

/// The same partition into (weakly) connected components as a serial
/// union-find.
pub fn cc(g: &Csr, labels: &[u32]) -> Result<(), String> {
    let n = g.vertices();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    for u in 0..n {
        for &v in g.adjacency(u) {
            let (a, b) = (find(&mut parent, u), find(&mut parent, v as usize));
            if a != b {
                parent[a.max(b)] = a.min(b);
            }
        }
    }
    // Same partition: the label of a vertex's root names its component, one
    // to one.
    let mut label_of_root = vec![u32::MAX; n];
    let mut root_of_label = std::collections::HashMap::new();
    for (v, &l) in labels.iter().enumerate().take(n) {
        let root = find(&mut parent, v);
        if label_of_root[root] == u32::MAX {
            label_of_root[root] = l;
        } else if label_of_root[root] != l {
            return Err(format!(
                "vertex {v} has label {l}, others in its component {}",
                label_of_root[root]
            ));
        }
        if *root_of_label.entry(l).or_insert(root) != root {
            return Err(format!("label {l} spans two components"));
        }
    }
    Ok(())
}
