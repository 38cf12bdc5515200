//! A flow's nodes and transitions ([`Graph::from_yaml`], from the YAML the orchestrator
//! returns for one flow) drawn as SVG ([`Graph::svg`]): nodes in layers by their longest
//! distance from `initial` (back edges, such as retries through a `catch`, left out of the
//! layering), top to bottom, each with the tasks there now and the failures there.
//!
//! Transitions are read from the YAML shape of `docs/orchestrator.md`: `next`,
//! `conditions[].next`, `default`, `catch`, `on_cancel`, `on_partial`, `on_failure`.
//! Bounds: at most [`MAX_NODES`] nodes and a YAML text of at most [`MAX_YAML_BYTES`].

use std::collections::{BTreeMap, HashMap};

use maud::{Markup, html};
use serde_json::Value;

/// The most nodes drawn.
pub const MAX_NODES: usize = 200;
/// The largest flow text read, in bytes.
pub const MAX_YAML_BYTES: usize = 512 * 1024;

const NODE_W: f64 = 168.0;
const NODE_H: f64 = 48.0;
const GAP_X: f64 = 48.0;
const GAP_Y: f64 = 64.0;
const MARGIN: f64 = 24.0;

/// A flow's graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    /// The nodes in the YAML's order: `(id, type)`.
    pub nodes: Vec<(String, String)>,
    /// The transitions: `(from, to, label)`; the label is empty for `next`.
    pub edges: Vec<(String, String, String)>,
    /// The initial node.
    pub initial: String,
}

/// Tasks per node: at the node now (unfinished tasks), and failed there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Unfinished tasks by the node they are at.
    pub at: BTreeMap<String, u64>,
    /// FAILED tasks by the node they failed at.
    pub failed: BTreeMap<String, u64>,
}

/// Why a flow cannot be drawn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// The orchestrator returned no flow text.
    #[error("the orchestrator returned no flow text (an older orchestrator?)")]
    NoText,
    /// The text is larger than [`MAX_YAML_BYTES`].
    #[error("the flow text has {0} bytes, more than the console draws ({MAX_YAML_BYTES})")]
    TooLarge(usize),
    /// The text is no flow (no `states` map).
    #[error("the flow text is not a flow: {0}")]
    NotAFlow(String),
    /// More than [`MAX_NODES`] nodes.
    #[error("the flow has {0} nodes, more than the console draws ({MAX_NODES})")]
    TooManyNodes(usize),
}

impl Graph {
    /// The graph of a flow's YAML text.
    ///
    /// # Errors
    /// [`GraphError`] for an empty, oversized or malformed text.
    pub fn from_yaml(yaml: &str) -> Result<Self, GraphError> {
        if yaml.trim().is_empty() {
            return Err(GraphError::NoText);
        }
        if yaml.len() > MAX_YAML_BYTES {
            return Err(GraphError::TooLarge(yaml.len()));
        }
        let doc: Value =
            serde_norway::from_str(yaml).map_err(|e| GraphError::NotAFlow(e.to_string()))?;
        let states = doc
            .get("states")
            .and_then(Value::as_object)
            .ok_or_else(|| GraphError::NotAFlow("it has no `states` map".into()))?;
        if states.len() > MAX_NODES {
            return Err(GraphError::TooManyNodes(states.len()));
        }
        let mut nodes = Vec::new();
        let mut edges = Vec::new();
        for (id, node) in states {
            let kind = node
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            let mut edge = |to: Option<&Value>, label: String| {
                if let Some(to) = to.and_then(Value::as_str)
                    && states.contains_key(to)
                {
                    edges.push((id.clone(), to.to_string(), label));
                }
            };
            edge(node.get("next"), String::new());
            if let Some(conditions) = node.get("conditions").and_then(Value::as_array) {
                for c in conditions {
                    let expr = c.get("if").and_then(Value::as_str).unwrap_or("");
                    edge(c.get("next"), format!("if {}", short(&readable(expr), 36)));
                }
            }
            for key in ["default", "catch", "on_cancel", "on_partial", "on_failure"] {
                edge(node.get(key), key.to_string());
            }
            nodes.push((id.clone(), kind));
        }
        let initial = doc
            .get("initial")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        Ok(Self {
            nodes,
            edges,
            initial,
        })
    }

    /// The node ids, in the graph's layer order (what the per-node table lists).
    pub fn node_ids(&self) -> Vec<&str> {
        let layers = self.layers();
        let mut ids: Vec<&str> = self.nodes.iter().map(|(id, _)| id.as_str()).collect();
        ids.sort_by_key(|id| layers.get(*id).copied().unwrap_or(usize::MAX));
        ids
    }

    /// Each node's layer: the longest path from `initial` over forward edges (nodes not
    /// reachable from it go below the rest).
    fn layers(&self) -> HashMap<&str, usize> {
        let index: HashMap<&str, usize> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (id.as_str(), i))
            .collect();
        let mut out: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        for (from, to, _) in &self.edges {
            if let (Some(&f), Some(&t)) = (index.get(from.as_str()), index.get(to.as_str())) {
                out[f].push(t);
            }
        }
        // Depth-first from the initial node: an edge to a node on the stack is a back edge.
        let mut state = vec![0u8; self.nodes.len()]; // 0 new, 1 on stack, 2 done
        let mut order = Vec::new();
        let mut forward: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        let starts: Vec<usize> = index
            .get(self.initial.as_str())
            .copied()
            .into_iter()
            .chain(0..self.nodes.len())
            .collect();
        for start in starts {
            if state[start] != 0 {
                continue;
            }
            let mut stack = vec![(start, 0usize)];
            state[start] = 1;
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                if let Some(&to) = out[node].get(*next) {
                    *next += 1;
                    match state[to] {
                        0 => {
                            forward[node].push(to);
                            state[to] = 1;
                            stack.push((to, 0));
                        }
                        2 => forward[node].push(to),
                        _ => {} // back edge
                    }
                } else {
                    state[node] = 2;
                    order.push(node);
                    stack.pop();
                }
            }
        }
        order.reverse(); // a topological order of the forward edges
        let mut layer = vec![0usize; self.nodes.len()];
        for &node in &order {
            for &to in &forward[node] {
                layer[to] = layer[to].max(layer[node] + 1);
            }
        }
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (id.as_str(), layer[i]))
            .collect()
    }

    /// The graph as an SVG element, each node labelled with its id and type, and with
    /// `counts` (tasks there now, failures there) as badges.
    pub fn svg(&self, counts: &Counts) -> Markup {
        let layers = self.layers();
        let depth = layers.values().copied().max().unwrap_or(0) + 1;
        let mut rows: Vec<Vec<&str>> = vec![Vec::new(); depth];
        for (id, _) in &self.nodes {
            rows[layers[id.as_str()]].push(id);
        }
        let widest = rows.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let width = MARGIN * 2.0 + widest as f64 * NODE_W + (widest as f64 - 1.0) * GAP_X;
        let height = MARGIN * 2.0 + depth as f64 * NODE_H + (depth as f64 - 1.0) * GAP_Y;
        let mut pos: HashMap<&str, (f64, f64)> = HashMap::new();
        for (r, row) in rows.iter().enumerate() {
            let row_w = row.len() as f64 * NODE_W + (row.len() as f64 - 1.0).max(0.0) * GAP_X;
            let x0 = (width - row_w) / 2.0;
            for (i, id) in row.iter().enumerate() {
                pos.insert(
                    id,
                    (
                        x0 + i as f64 * (NODE_W + GAP_X),
                        MARGIN + r as f64 * (NODE_H + GAP_Y),
                    ),
                );
            }
        }
        let kinds: HashMap<&str, &str> = self
            .nodes
            .iter()
            .map(|(id, k)| (id.as_str(), k.as_str()))
            .collect();
        html! {
            svg xmlns="http://www.w3.org/2000/svg" width=(fmt(width)) height=(fmt(height))
                viewBox={ "0 0 " (fmt(width)) " " (fmt(height)) } role="img"
                aria-label="flow graph" font-family="system-ui, sans-serif" {
                defs {
                    marker #arrow viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse" {
                        path d="M 0 0 L 10 5 L 0 10 z" fill="#7d8799" {}
                    }
                }
                @for (from, to, label) in &self.edges {
                    @let (fx, fy) = pos[from.as_str()];
                    @let (tx, ty) = pos[to.as_str()];
                    @let back = layers[to.as_str()] <= layers[from.as_str()];
                    @let dashed = !label.is_empty() && !label.starts_with("if ") && label != "default";
                    @let (d, lx, ly) = if back {
                        // Around the side: from the source's right edge to the target's.
                        let (x1, y1) = (fx + NODE_W, fy + NODE_H / 2.0);
                        let (x2, y2) = (tx + NODE_W, ty + NODE_H / 2.0);
                        let bend = x1.max(x2) + 40.0;
                        (format!("M {} {} C {} {}, {} {}, {} {}", fmt(x1), fmt(y1), fmt(bend), fmt(y1), fmt(bend), fmt(y2), fmt(x2 + 2.0), fmt(y2)),
                         bend - 8.0, (y1 + y2) / 2.0)
                    } else {
                        let (x1, y1) = (fx + NODE_W / 2.0, fy + NODE_H);
                        let (x2, y2) = (tx + NODE_W / 2.0, ty - 2.0);
                        let mid = (y1 + y2) / 2.0;
                        // A condition's label sits above its target, where the edges fan out.
                        let (lx, ly) = if label.starts_with("if ") { (x2, y2 - 8.0) } else { ((x1 + x2) / 2.0, mid) };
                        (format!("M {} {} C {} {}, {} {}, {} {}", fmt(x1), fmt(y1), fmt(x1), fmt(mid), fmt(x2), fmt(mid), fmt(x2), fmt(y2)),
                         lx, ly)
                    };
                    path.edge d=(d) fill="none" stroke=(if label == "catch" || label == "on_failure" { "#d08a84" } else { "#7d8799" })
                        stroke-width="1.4" stroke-dasharray=[dashed.then_some("5 4")] marker-end="url(#arrow)" {}
                    @if !label.is_empty() {
                        text x=(fmt(lx)) y=(fmt(ly)) font-size="10" fill="#5b6474" text-anchor="middle"
                            paint-order="stroke" stroke="#fff" stroke-width="3" { (label) }
                    }
                }
                @for (id, _) in &self.nodes {
                    @let (x, y) = pos[id.as_str()];
                    @let kind = kinds[id.as_str()];
                    @let at = counts.at.get(id).copied().unwrap_or(0);
                    @let failed = counts.failed.get(id).copied().unwrap_or(0);
                    g.node data-node=(id) {
                        rect x=(fmt(x)) y=(fmt(y)) width=(fmt(NODE_W)) height=(fmt(NODE_H)) rx="8"
                            fill=(fill(kind)) stroke=(if id == &self.initial { "#2456c7" } else { "#aab3c2" })
                            stroke-width=(if id == &self.initial { "2" } else { "1" }) {}
                        text x=(fmt(x + NODE_W / 2.0)) y=(fmt(y + 20.0)) font-size="13" font-weight="600"
                            fill="#1d2330" text-anchor="middle" { (short(id, 20)) }
                        text x=(fmt(x + NODE_W / 2.0)) y=(fmt(y + 36.0)) font-size="11"
                            fill="#5b6474" text-anchor="middle" { (kind) }
                        @if at > 0 {
                            g.count { title { (at) " task(s) here now" }
                                rect x=(fmt(x + NODE_W - 30.0)) y=(fmt(y - 9.0)) width="34" height="18" rx="9" fill="#a15c00" {}
                                text x=(fmt(x + NODE_W - 13.0)) y=(fmt(y + 4.0)) font-size="11" font-weight="700" fill="#fff" text-anchor="middle" { (at) }
                            }
                        }
                        @if failed > 0 {
                            g.failed { title { (failed) " task(s) failed here" }
                                rect x=(fmt(x - 4.0)) y=(fmt(y - 9.0)) width="44" height="18" rx="9" fill="#b42318" {}
                                text x=(fmt(x + 18.0)) y=(fmt(y + 4.0)) font-size="11" font-weight="700" fill="#fff" text-anchor="middle" { "✕ " (failed) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn fill(kind: &str) -> &'static str {
    match kind {
        "human" => "#fff4e0",
        "condition" => "#eef0f4",
        "succeed" => "#e8f5ee",
        "fail" => "#fdecea",
        "parallel" => "#efeafd",
        _ => "#eef3ff",
    }
}

/// A condition as a label: `nodes.classify.output.category == 'x'` as
/// `classify.category == 'x'`.
fn readable(expr: &str) -> String {
    expr.replace("nodes.", "").replace(".output.", ".")
}

fn fmt(v: f64) -> String {
    format!("{v:.1}")
}

fn short(text: &str, max: usize) -> String {
    crate::render::cut(text, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOW: &str = r#"
id: f
version: 1
initial: classify
states:
  classify: {type: task, capability: c, next: route}
  route:
    type: condition
    conditions:
      - {if: "x > 1", next: a}
    default: review
  a: {type: task, capability: a, catch: review, next: done}
  review: {type: human, on_cancel: gone, next: done}
  gone: {type: fail, error: "no"}
  done: {type: succeed}
"#;

    #[test]
    fn transitions_and_layers() {
        let g = Graph::from_yaml(FLOW).unwrap();
        assert_eq!(g.nodes.len(), 6);
        assert!(
            g.edges
                .contains(&("a".into(), "review".into(), "catch".into()))
        );
        assert!(
            g.edges
                .contains(&("route".into(), "a".into(), "if x > 1".into()))
        );
        let layers = g.layers();
        assert_eq!(layers["classify"], 0);
        assert_eq!(layers["route"], 1);
        assert_eq!(layers["a"], 2);
        assert_eq!(layers["review"], 3);
        assert_eq!(layers["done"], 4);
        assert_eq!(g.node_ids()[0], "classify");
    }

    #[test]
    fn cycles_terminate_and_counts_show() {
        let g = Graph::from_yaml(
            "initial: a\nstates:\n  a: {type: task, next: b}\n  b: {type: task, next: a}\n",
        )
        .unwrap();
        assert_eq!(g.layers()["b"], 1);
        let mut counts = Counts::default();
        counts.at.insert("a".into(), 3);
        counts.failed.insert("b".into(), 2);
        let svg = g.svg(&counts).into_string();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains(">3<"), "{svg}");
        assert!(svg.contains("✕ 2"), "{svg}");
    }

    #[test]
    fn bad_texts_are_refused() {
        assert_eq!(Graph::from_yaml(""), Err(GraphError::NoText));
        assert!(matches!(
            Graph::from_yaml("id: x"),
            Err(GraphError::NotAFlow(_))
        ));
    }
}
