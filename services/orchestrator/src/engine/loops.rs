//! The engine's background loops: leases, timers, purge, the tasks-by-status gauges and the
//! flows directory watch. Each ends when the engine stops.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::ConfigError;
use crate::error::Error;
use crate::event::TaskStatus;

use super::Engine;
use super::clock::ms;

impl Engine {
    /// Starts the background loops and resumes every unfinished task this replica can claim.
    /// Returns their join handles; [`Engine::stop`] ends them.
    pub fn start(&self) -> Vec<tokio::task::JoinHandle<()>> {
        let mut handles = Vec::new();
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.lease_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.timer_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.purge_loop().await }));
        let e = self.clone();
        handles.push(tokio::spawn(async move { e.metrics_loop().await }));
        handles
    }

    /// Publishes the tasks-by-status gauges from the store every 2 s (the store is the truth
    /// when several replicas share it).
    async fn metrics_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        loop {
            if let Ok(counts) = self.inner.store.count_by_status().await {
                for status in TaskStatus::ALL {
                    let count = counts
                        .iter()
                        .find(|(s, _)| *s == status)
                        .map_or(0, |(_, n)| *n);
                    crate::metrics::tasks(status, usize::try_from(count).unwrap_or(0));
                }
            }
            tokio::select! {
                _ = stop.changed() => return,
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
            if *stop.borrow() {
                return;
            }
        }
    }

    /// Leases: the first pass claims every unfinished task this replica may take (all of
    /// them on an exclusive SQLite store, then the loop ends); later passes renew this
    /// replica's leases and claim unowned or expired tasks every `min(lease / 3,
    /// poll_interval)`.
    async fn lease_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let owner = self.inner.settings.node_id.clone();
        let lease = ms(self.inner.settings.lease);
        let mut first = true;
        loop {
            let now = self.inner.clock.now_ms();
            if !first && let Err(e) = self.inner.store.renew(&owner, now + lease).await {
                tracing::warn!(error = %e, "lease renewal failed");
            }
            // On an exclusive (SQLite) store the first pass takes every unfinished task: the
            // previous process is gone, whatever owner id it had.
            let force = first && self.inner.exclusive;
            // The first pass also takes back this node id's own tasks (a restart), all at once.
            let limit = if first { 1_000_000 } else { 500 };
            match self
                .inner
                .store
                .claim_batch(&owner, now, now + lease, limit, first, force)
                .await
            {
                Ok(ids) => {
                    if !ids.is_empty() {
                        tracing::info!(count = ids.len(), "resuming tasks");
                    }
                    for id in ids {
                        self.poke(&id);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "claiming tasks failed"),
            }
            first = false;
            if self.inner.exclusive {
                // One process owns an SQLite store: no leases to renew, nobody to take over
                // from, and commands poke the local engine directly.
                return;
            }
            let period = (self.inner.settings.lease / 3).min(
                self.inner
                    .settings
                    .poll_interval
                    .max(Duration::from_millis(50)),
            );
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
    }

    async fn timer_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let owner = self.inner.settings.node_id.clone();
        loop {
            let now = self.inner.clock.now_ms();
            let mut wake_at = now + ms(self.inner.settings.poll_interval);
            match self.inner.store.due_timers(&owner, now, 1000).await {
                Ok((due, next)) => {
                    if !due.is_empty() {
                        wake_at = wake_at.min(now + 10);
                    }
                    for id in due {
                        self.poke(&id);
                    }
                    if let Some(n) = next {
                        wake_at = wake_at.min(n);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reading due timers failed"),
            }
            tokio::select! {
                () = tokio::time::sleep_until(self.inner.clock.instant_at(wake_at)) => {}
                () = self.inner.timer_wake.notified() => {}
                _ = stop.changed() => return,
            }
        }
    }

    async fn purge_loop(self) {
        let mut stop = self.inner.stop.subscribe();
        let ttl = self.inner.settings.context_ttl;
        let period = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
        loop {
            let cutoff = self.inner.clock.now_ms() - ms(ttl);
            match self.inner.store.purge(cutoff).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(tasks = n, "purged ended tasks past their ttl"),
                Err(e) => tracing::warn!(error = %e, "purge failed"),
            }
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Watches `dir` and re-applies its flows when files change (debounced by 200 ms), until
    /// the engine stops. Invalid files are logged with their located errors and the previous
    /// version stays active.
    ///
    /// # Errors
    /// [`Error::Config`] ([`ConfigError::FlowsDirUnwatchable`]) when the directory cannot be
    /// watched.
    pub fn watch_flows_dir(&self, dir: PathBuf) -> Result<tokio::task::JoinHandle<()>, Error> {
        use notify::Watcher;
        let unwatchable = |e: notify::Error| ConfigError::FlowsDirUnwatchable {
            path: dir.clone(),
            detail: e.to_string(),
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if res.is_ok() {
                let _ = tx.send(());
            }
        })
        .map_err(unwatchable)?;
        watcher
            .watch(&dir, notify::RecursiveMode::NonRecursive)
            .map_err(unwatchable)?;
        let flows = self.inner.flows.clone();
        let clock = self.inner.clock;
        let mut stop = self.inner.stop_receiver();
        Ok(tokio::spawn(async move {
            let _watcher = watcher;
            loop {
                tokio::select! {
                    got = rx.recv() => if got.is_none() { return },
                    _ = stop.changed() => return,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                while rx.try_recv().is_ok() {}
                flows.apply_dir(&dir, clock.now_ms()).await;
            }
        }))
    }
}
