//! The flow registry: every applied version of every flow, persisted in the store, plus hot
//! reload of a flows directory.
//!
//! Versions are immutable: applying a flow whose id and version exist with different text is
//! refused (bump `version`). Tasks keep the version they started with, so re-applying never
//! changes a running task. The engine watches a flows directory and calls
//! [`FlowRegistry::apply_dir`] on changes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::error::Error;
use crate::expr::ExprLimits;
use crate::flow::Flow;
use crate::store::Store;

/// A stored flow version and when it was applied.
#[derive(Debug, Clone)]
pub struct FlowEntry {
    /// The flow.
    pub flow: Arc<Flow>,
    /// When applied (unix ms).
    pub applied_ms: i64,
}

/// Every loaded flow version. Cheap to clone.
#[derive(Clone, Debug)]
pub struct FlowRegistry {
    inner: Arc<RwLock<HashMap<String, BTreeMap<u32, FlowEntry>>>>,
    store: Store,
    /// The limits every flow's expressions are compiled and evaluated with.
    limits: ExprLimits,
}

impl FlowRegistry {
    /// Loads every version stored in `store`, compiling expressions within `limits`.
    ///
    /// # Errors
    /// Store errors. A stored flow that no longer validates (within `limits`, too) is
    /// skipped with an error log.
    pub async fn load(store: Store, limits: ExprLimits) -> Result<Self, Error> {
        let reg = Self {
            inner: Arc::default(),
            store,
            limits,
        };
        for (id, version, yaml, source, applied_ms) in reg.store.flows().await? {
            match Flow::parse_with(&source, &yaml, &reg.limits) {
                Ok(flow) => reg.insert(Arc::new(flow), applied_ms),
                Err(e) => {
                    tracing::error!(flow_id = %id, version, errors = %e, "stored flow no longer validates")
                }
            }
        }
        Ok(reg)
    }

    fn insert(&self, flow: Arc<Flow>, applied_ms: i64) {
        self.inner
            .write()
            .expect("flow registry lock")
            .entry(flow.id.clone())
            .or_default()
            .insert(flow.version, FlowEntry { flow, applied_ms });
    }

    /// The limits the flows' expressions are compiled and evaluated with.
    pub fn limits(&self) -> &ExprLimits {
        &self.limits
    }

    /// Flow `id` at `version`.
    pub fn get(&self, id: &str, version: u32) -> Option<Arc<Flow>> {
        self.inner
            .read()
            .expect("flow registry lock")
            .get(id)?
            .get(&version)
            .map(|e| e.flow.clone())
    }

    /// The latest version of flow `id`.
    pub fn latest(&self, id: &str) -> Option<Arc<Flow>> {
        self.inner
            .read()
            .expect("flow registry lock")
            .get(id)?
            .values()
            .next_back()
            .map(|e| e.flow.clone())
    }

    /// Flow ids, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .read()
            .expect("flow registry lock")
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    /// The latest version of every flow, sorted by id.
    pub fn latest_all(&self) -> Vec<FlowEntry> {
        let map = self.inner.read().expect("flow registry lock");
        let mut out: Vec<FlowEntry> = map
            .values()
            .filter_map(|v| v.values().next_back().cloned())
            .collect();
        out.sort_by(|a, b| a.flow.id.cmp(&b.flow.id));
        out
    }

    /// Validates and applies YAML text; returns the flow and whether it was new.
    ///
    /// # Errors
    /// [`Error::InvalidFlow`] with located errors; [`Error::FlowVersionConflict`] when the
    /// version exists with different text (here or, stored meanwhile, by another replica);
    /// [`Error::Store`].
    pub async fn apply(
        &self,
        source: &str,
        yaml: &str,
        now_ms: i64,
    ) -> Result<(Arc<Flow>, bool), Error> {
        let flow = Flow::parse_with(source, yaml, &self.limits)?;
        if let Some(existing) = self.get(&flow.id, flow.version) {
            if existing.yaml == yaml {
                return Ok((existing, false));
            }
            return Err(Error::FlowVersionConflict {
                flow_id: flow.id,
                version: flow.version,
            });
        }
        if !self
            .store
            .insert_flow(&flow.id, flow.version, yaml, source, now_ms)
            .await?
        {
            // Another replica stored this version meanwhile: use what is stored.
            let reg = Self::load(self.store.clone(), self.limits).await?;
            if let Some(stored) = reg.get(&flow.id, flow.version) {
                if stored.yaml != yaml {
                    return Err(Error::FlowVersionConflict {
                        flow_id: flow.id,
                        version: flow.version,
                    });
                }
                self.insert(stored.clone(), now_ms);
                return Ok((stored, false));
            }
        }
        let flow = Arc::new(flow);
        self.insert(flow.clone(), now_ms);
        tracing::info!(flow_id = %flow.id, version = flow.version, source = %source, "flow applied");
        Ok((flow, true))
    }

    /// Applies every `*.yaml` / `*.yml` file of `dir`, in name order; returns each file's
    /// result ([`Error::Io`] for a file that cannot be read, else as [`FlowRegistry::apply`]).
    pub async fn apply_dir(
        &self,
        dir: &Path,
        now_ms: i64,
    ) -> Vec<(PathBuf, Result<(Arc<Flow>, bool), Error>)> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return out;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        files.sort();
        for file in files {
            let result = match std::fs::read_to_string(&file) {
                Ok(text) => self.apply(&file.display().to_string(), &text, now_ms).await,
                Err(source) => Err(Error::Io {
                    path: file.clone(),
                    source,
                }),
            };
            match &result {
                Ok((flow, true)) => {
                    tracing::info!(file = %file.display(), flow_id = %flow.id, version = flow.version, "flow loaded")
                }
                Ok(_) => {}
                Err(e) => tracing::error!(file = %file.display(), error = %e, "flow not loaded"),
            }
            out.push((file, result));
        }
        out
    }
}
