//! The event-sourced task store, on SQLite (embedded default) or PostgreSQL (several
//! replicas), through sqlx.
//!
//! Tables: `reach_flows` (every applied flow version, YAML text), `reach_tasks` (one row per
//! task: a projection of its log for listing, plus the lease), `reach_events` (the logs),
//! `reach_timers` (durable timers, derived from timer events), `reach_ledger` (routed
//! messages), `reach_webhooks` (task webhooks: their settings, delivery progress and
//! delivery lease).
//!
//! Appends are optimistic: an append names the sequence number it expects and, for engine
//! appends, the owner it expects; a stale append is refused with [`AppendOutcome::Conflict`]
//! and changes nothing. All appends go through one writer task that commits many of them in
//! one transaction (group commit), which is what makes thousands of durable transitions per
//! second possible on one SQLite file.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tokio::sync::{mpsc, oneshot};

use crate::event::{Event, StoredEvent, TaskStatus};

/// Why a store operation failed. [`StoreError::kind`] says what a caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed.
    #[error("task store: {0}")]
    Db(#[from] sqlx::Error),
    /// A group commit failed; every append of the batch gets this copy of the error.
    #[error("task store: {message}")]
    Batch {
        /// What kind of failure the database error was.
        kind: StoreErrorKind,
        /// The database error, rendered.
        message: String,
    },
    /// The store URL is not `sqlite://...` or `postgres://...`.
    #[error("store url {0:?} is not supported: use sqlite://PATH or postgres://USER@HOST:PORT/DB")]
    BadUrl(String),
    /// Another orchestrator process uses this SQLite file.
    #[error(
        "sqlite store {0} is in use by another orchestrator process; stop it, or use PostgreSQL to run several replicas"
    )]
    Locked(String),
    /// A stored event could not be decoded (written by a newer version?).
    #[error("stored event {task_id}#{seq} cannot be decoded: {message}")]
    Corrupt {
        /// The task.
        task_id: String,
        /// The sequence number.
        seq: i64,
        /// The decoder's message.
        message: String,
    },
    /// The writer task stopped (the store is shutting down).
    #[error("task store writer stopped")]
    WriterGone,
}

/// What kind of failure a [`StoreError`] is, for the caller to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// The database cannot be reached or is busy (connection lost, pool exhausted, deadlock,
    /// disk full, shutting down): the same operation may succeed later.
    Unavailable,
    /// A write collided with another on a unique key: the data changed meanwhile.
    Conflict,
    /// Stored data cannot be read back (an undecodable event or column).
    Corrupt,
    /// Anything else: a bad store URL, a schema mismatch, a bug.
    Internal,
}

impl StoreError {
    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Db(e) => classify(e),
            StoreError::Batch { kind, .. } => *kind,
            StoreError::BadUrl(_) => StoreErrorKind::Internal,
            StoreError::Locked(_) | StoreError::WriterGone => StoreErrorKind::Unavailable,
            StoreError::Corrupt { .. } => StoreErrorKind::Corrupt,
        }
    }
}

/// The kind of a database error: SQLSTATE classes (PostgreSQL) and result codes (SQLite) of
/// lost connections, busy or exhausted resources and rolled-back transactions are
/// [`StoreErrorKind::Unavailable`]; unique violations [`StoreErrorKind::Conflict`]; decoding
/// failures [`StoreErrorKind::Corrupt`].
fn classify(e: &sqlx::Error) -> StoreErrorKind {
    use sqlx::Error as E;
    match e {
        E::Database(db) => {
            if db.is_unique_violation() {
                return StoreErrorKind::Conflict;
            }
            let code = db.code().unwrap_or_default();
            let code = code.as_ref();
            // PostgreSQL: 08 connection, 40 transaction rollback, 53 insufficient resources,
            // 57 operator intervention (shutdown), 55P03 lock not available.
            let pg_transient =
                ["08", "40", "53", "57"].iter().any(|c| code.starts_with(c)) || code == "55P03";
            // SQLite primary result codes (the low byte of extended codes): 5 BUSY,
            // 6 LOCKED, 10 IOERR, 13 FULL, 14 CANTOPEN.
            let sqlite_transient = code
                .parse::<i64>()
                .is_ok_and(|n| matches!(n & 0xff, 5 | 6 | 10 | 13 | 14));
            if pg_transient || sqlite_transient || db.message().contains("database is locked") {
                StoreErrorKind::Unavailable
            } else {
                StoreErrorKind::Internal
            }
        }
        E::Io(_)
        | E::Tls(_)
        | E::Protocol(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed
        | E::BeginFailed => StoreErrorKind::Unavailable,
        E::ColumnDecode { .. } | E::Decode(_) => StoreErrorKind::Corrupt,
        _ => StoreErrorKind::Internal,
    }
}

#[derive(Clone, Debug)]
enum Backend {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

macro_rules! with_pool {
    ($backend:expr, |$pool:ident| $body:expr) => {
        match $backend {
            Backend::Sqlite($pool) => $body,
            Backend::Postgres($pool) => $body,
        }
    };
}

/// Who may append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guard {
    /// A new task: the row must not exist yet.
    Create {
        /// The owner to record (the creating replica).
        owner: String,
        /// The lease to take (unix ms).
        lease_until_ms: i64,
    },
    /// The engine of `owner`: the task must still be leased to it.
    Owner(String),
    /// An API command (resume, cancel, retry): any owner; the lease is released so the next
    /// claim picks the task up with the new events.
    Command,
    /// Only the sequence number is checked and the lease is kept (an exclusive SQLite store,
    /// where one process owns every task).
    Seq,
}

/// The projection stored in `reach_tasks` after an append.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSummary {
    /// The task id.
    pub task_id: String,
    /// The flow.
    pub flow_id: String,
    /// The flow version.
    pub flow_version: u32,
    /// The status.
    pub status: TaskStatus,
    /// The current node.
    pub current_node: Option<String>,
    /// The last sequence number.
    pub seq: i64,
    /// When created (unix ms).
    pub created_ms: i64,
    /// When last changed (unix ms).
    pub updated_ms: i64,
    /// When ended (unix ms).
    pub ended_ms: Option<i64>,
    /// The trace id.
    pub trace_id: String,
    /// The error.
    pub error: Option<String>,
    /// The failed node.
    pub failed_node: Option<String>,
}

/// One append: events for a task, all or nothing.
#[derive(Debug, Clone)]
pub struct Append {
    /// The sequence number the log must end at.
    pub expected_seq: i64,
    /// The events, appended at `expected_seq + 1 ..`.
    pub events: Vec<Event>,
    /// When (unix ms).
    pub at_ms: i64,
    /// The task row after the events.
    pub summary: TaskSummary,
    /// Who appends.
    pub guard: Guard,
}

/// What became of an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendOutcome {
    /// Stored; the log now ends at this sequence number.
    Appended(i64),
    /// The log moved on or the lease is gone; nothing was stored.
    Conflict,
}

struct WriteReq {
    append: Append,
    reply: oneshot::Sender<Result<AppendOutcome, StoreError>>,
}

/// A handle to the store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    backend: Backend,
    writer: mpsc::Sender<WriteReq>,
    /// For an SQLite file: a connection holding an exclusive transaction on `<file>.lock`
    /// for the life of the store, so a second orchestrator on the same file is refused (the
    /// OS releases the lock when the process dies, even by SIGKILL).
    _lock: Option<std::sync::Arc<tokio::sync::Mutex<sqlx::SqliteConnection>>>,
}

/// Tuning of the SQLite backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqliteDurability {
    /// `synchronous=NORMAL` in WAL mode: a commit survives a process crash; the last
    /// commits before a power loss or OS crash may be lost (never corrupted).
    Normal,
    /// `synchronous=FULL`: every commit is fsynced (survives power loss), slower.
    Full,
}

const MAX_BATCH: usize = 512;

/// Creates the SQLite file `path` empty with mode 0600 (owner-only) unless it exists, before
/// SQLite opens it: SQLite gives its `-wal` and `-shm` files the database file's mode, so the
/// whole store stays owner-only. A failure is left for SQLite's own open to report.
fn create_owner_only(path: &std::path::Path) {
    let mut file = std::fs::OpenOptions::new();
    file.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut file, 0o600);
    let _ = file.open(path);
}

/// A failed TLS handshake with PostgreSQL (sqlx reports it as an I/O error) as an error that
/// says which setting to check; other errors unchanged.
fn explain_postgres_tls(error: sqlx::Error, server: &str) -> StoreError {
    let text = error.to_string();
    let tls = matches!(error, sqlx::Error::Tls(_))
        || text.contains("peer certificate")
        || text.contains("certificate verify");
    if !tls {
        return StoreError::Db(error);
    }
    StoreError::Batch {
        kind: StoreErrorKind::Internal,
        message: format!(
            "the TLS handshake with PostgreSQL at {server} failed ({text}): the server's certificate must chain to the CA named by sslrootcert in orchestrator.store_url and, with sslmode=verify-full, name the host of the URL"
        ),
    }
}

/// Warns when the orchestrator reaches a PostgreSQL server on another host without verifying
/// its certificate (`sslmode` other than `verify-full` or `verify-ca`): the task store then
/// travels unauthenticated, readable and changeable on the way.
fn warn_unverified_postgres(options: &PgConnectOptions) {
    let verified = matches!(
        options.get_ssl_mode(),
        PgSslMode::VerifyFull | PgSslMode::VerifyCa
    );
    let host = options.get_host();
    let local = options.get_socket().is_some()
        || host.starts_with('/')
        || host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !verified && !local {
        tracing::warn!(
            host,
            sslmode = ?options.get_ssl_mode(),
            "the orchestrator reaches PostgreSQL on another host without verifying its certificate; add ?sslmode=verify-full&sslrootcert=/path/to/ca.pem to orchestrator.store_url (docs/orchestrator.md)"
        );
    }
}

impl Store {
    /// Opens (and creates the tables of) the store at `url`: `sqlite://PATH` (the file is
    /// created), `sqlite::memory:`, or `postgres://...`.
    ///
    /// # Errors
    /// [`StoreError::BadUrl`] for other schemes; [`StoreError::Db`] when the database cannot
    /// be reached or the schema cannot be created.
    pub async fn open(url: &str, durability: SqliteDurability) -> Result<Self, StoreError> {
        Self::open_with(url, durability, Duration::from_secs(30)).await
    }

    /// [`Store::open`] with the longest wait for a pooled connection.
    ///
    /// # Errors
    /// As [`Store::open`].
    pub async fn open_with(
        url: &str,
        durability: SqliteDurability,
        acquire_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let mut lock = None;
        let backend = if url.starts_with("sqlite:") {
            if let Some(path) = url.strip_prefix("sqlite://") {
                let path = path.split('?').next().unwrap_or(path);
                if let Some(parent) = std::path::Path::new(path).parent()
                    && !parent.as_os_str().is_empty()
                {
                    // Owner-only: the store holds what tasks were given, in clear.
                    let mut dir = std::fs::DirBuilder::new();
                    dir.recursive(true);
                    #[cfg(unix)]
                    std::os::unix::fs::DirBuilderExt::mode(&mut dir, 0o700);
                    let _ = dir.create(parent);
                }
                if !path.contains(":memory:") {
                    create_owner_only(std::path::Path::new(path));
                    lock = Some(std::sync::Arc::new(tokio::sync::Mutex::new(
                        lock_file(path).await?,
                    )));
                }
            }
            let opts = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(match durability {
                    SqliteDurability::Normal => SqliteSynchronous::Normal,
                    SqliteDurability::Full => SqliteSynchronous::Full,
                })
                .busy_timeout(Duration::from_secs(10));
            let memory = url.contains(":memory:");
            if !memory {
                // Switch the file to WAL once, on one connection: several connections doing it
                // at the same time get SQLITE_BUSY without waiting.
                use sqlx::Connection;
                sqlx::SqliteConnection::connect_with(&opts)
                    .await?
                    .close()
                    .await?;
            }
            let pool = SqlitePoolOptions::new()
                .max_connections(if memory { 1 } else { 4 })
                .acquire_timeout(acquire_timeout)
                .test_before_acquire(false)
                .min_connections(if memory { 1 } else { 4 })
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(opts)
                .await?;
            Backend::Sqlite(pool)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // TLS comes from the URL (libpq's parameters): `sslmode=verify-full` with
            // `sslrootcert=CA.pem` (and `sslcert`/`sslkey` for a client certificate).
            let options = PgConnectOptions::from_str(url)?;
            warn_unverified_postgres(&options);
            let server = format!("{}:{}", options.get_host(), options.get_port());
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(acquire_timeout)
                .connect_with(options)
                .await
                .map_err(|e| explain_postgres_tls(e, &server))?;
            Backend::Postgres(pool)
        } else {
            return Err(StoreError::BadUrl(url.to_string()));
        };
        create_schema(&backend).await?;
        let (tx, rx) = mpsc::channel(4096);
        tokio::spawn(writer(backend.clone(), rx));
        Ok(Self {
            backend,
            writer: tx,
            _lock: lock,
        })
    }

    /// `sqlite` or `postgres`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Whether this store is an embedded SQLite file (one orchestrator process at a time).
    pub fn is_exclusive(&self) -> bool {
        matches!(self.backend, Backend::Sqlite(_))
    }

    /// Appends events (group-committed with concurrent appends).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; a stale append is `Ok(Conflict)`.
    pub async fn append(&self, append: Append) -> Result<AppendOutcome, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.writer
            .send(WriteReq { append, reply })
            .await
            .map_err(|_| StoreError::WriterGone)?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// The task's events after `after_seq`, in order.
    ///
    /// # Errors
    /// [`StoreError`] on database failure or an undecodable event.
    pub async fn events(
        &self,
        task_id: &str,
        after_seq: i64,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let rows: Vec<(i64, i64, String)> = with_pool!(&self.backend, |p| {
            sqlx::query_as("SELECT seq, at_ms, body FROM reach_events WHERE task_id = $1 AND seq > $2 ORDER BY seq")
                .bind(task_id)
                .bind(after_seq)
                .fetch_all(p)
                .await?
        });
        rows.into_iter()
            .map(|(seq, at_ms, body)| {
                let event = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
                    task_id: task_id.to_string(),
                    seq,
                    message: e.to_string(),
                })?;
                Ok(StoredEvent { seq, at_ms, event })
            })
            .collect()
    }

    /// The task row.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn task(&self, task_id: &str) -> Result<Option<TaskSummary>, StoreError> {
        let row: Option<SummaryRow> = with_pool!(&self.backend, |p| {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {SUMMARY_COLUMNS} FROM reach_tasks WHERE task_id = $1"
            )))
            .bind(task_id)
            .fetch_optional(p)
            .await?
        });
        Ok(row.map(summary_from_row))
    }

    /// Tasks newest first, filtered by status, flow and labels (every one of `labels`, at
    /// most a few), starting after the page token (`created_ms:task_id` of the last row of
    /// the previous page).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn list_tasks(
        &self,
        status: Option<TaskStatus>,
        flow_id: Option<&str>,
        labels: &BTreeMap<String, String>,
        limit: u32,
        after: Option<(i64, String)>,
    ) -> Result<Vec<TaskSummary>, StoreError> {
        let (after_ms, after_id) = after.unwrap_or((i64::MAX, String::new()));
        let mut label_filter = String::new();
        for i in 0..labels.len() {
            let key = 6 + 2 * i;
            label_filter.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM reach_task_labels l WHERE l.task_id = reach_tasks.task_id AND l.key = ${key} AND l.value = ${})",
                key + 1
            ));
        }
        let sql = format!(
            "SELECT {SUMMARY_COLUMNS} FROM reach_tasks \
             WHERE ($1 = '' OR status = $1) AND ($2 = '' OR flow_id = $2) \
             AND (created_ms < $3 OR (created_ms = $3 AND task_id < $4)){label_filter} \
             ORDER BY created_ms DESC, task_id DESC LIMIT $5"
        );
        let status = status.map(TaskStatus::as_str).unwrap_or("");
        let flow = flow_id.unwrap_or("");
        let rows: Vec<SummaryRow> = with_pool!(&self.backend, |p| {
            let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql.clone()))
                .bind(status)
                .bind(flow)
                .bind(after_ms)
                .bind(if after_ms == i64::MAX {
                    "\u{10FFFF}".to_string()
                } else {
                    after_id.clone()
                })
                .bind(i64::from(limit));
            for (key, value) in labels {
                query = query.bind(key.clone()).bind(value.clone());
            }
            query.fetch_all(p).await?
        });
        Ok(rows.into_iter().map(summary_from_row).collect())
    }

    /// The labels of each of `task_ids` that has any.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn labels_of(
        &self,
        task_ids: &[&str],
    ) -> Result<HashMap<String, BTreeMap<String, String>>, StoreError> {
        let mut labels: HashMap<String, BTreeMap<String, String>> = HashMap::new();
        // 500 ids per query: within SQLite's and PostgreSQL's parameter limits.
        for chunk in task_ids.chunks(500) {
            let placeholders: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let sql = format!(
                "SELECT task_id, key, value FROM reach_task_labels WHERE task_id IN ({})",
                placeholders.join(", ")
            );
            let rows: Vec<(String, String, String)> = with_pool!(&self.backend, |p| {
                let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql.clone()));
                for id in chunk {
                    query = query.bind(id.to_string());
                }
                query.fetch_all(p).await?
            });
            for (task, key, value) in rows {
                labels.entry(task).or_default().insert(key, value);
            }
        }
        Ok(labels)
    }

    /// Who started each of `task_ids` (the identity its first event records; `None` for a
    /// task started without trust). Tasks without a first event are left out. Reads one event
    /// per task, so a list can be filtered by starter without folding whole logs.
    ///
    /// # Errors
    /// [`StoreError`] on database failure; [`StoreError::Corrupt`] for a first event that
    /// does not decode.
    pub async fn starters_of(
        &self,
        task_ids: &[&str],
    ) -> Result<HashMap<String, Option<String>>, StoreError> {
        let mut starters = HashMap::new();
        for chunk in task_ids.chunks(500) {
            let placeholders: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let sql = format!(
                "SELECT task_id, body FROM reach_events WHERE seq = 1 AND task_id IN ({})",
                placeholders.join(", ")
            );
            let rows: Vec<(String, String)> = with_pool!(&self.backend, |p| {
                let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql.clone()));
                for id in chunk {
                    query = query.bind(id.to_string());
                }
                query.fetch_all(p).await?
            });
            for (task_id, body) in rows {
                // Only the two fields are read; the rest (the task's input) is skipped, not
                // built.
                #[derive(serde::Deserialize)]
                struct First {
                    kind: String,
                    #[serde(default)]
                    started_by: Option<String>,
                }
                let first: First =
                    serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
                        task_id: task_id.clone(),
                        seq: 1,
                        message: e.to_string(),
                    })?;
                let starter = (first.kind == "task_created")
                    .then_some(first.started_by)
                    .flatten();
                starters.insert(task_id, starter);
            }
        }
        Ok(starters)
    }

    /// How many tasks have not ended.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn count_unfinished(&self) -> Result<i64, StoreError> {
        let (n,): (i64,) = with_pool!(&self.backend, |p| {
            sqlx::query_as("SELECT COUNT(*) FROM reach_tasks WHERE ended_ms IS NULL")
                .fetch_one(p)
                .await?
        });
        Ok(n)
    }

    /// Counts tasks by status.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn count_by_status(&self) -> Result<Vec<(TaskStatus, i64)>, StoreError> {
        let rows: Vec<(String, i64)> = with_pool!(&self.backend, |p| {
            sqlx::query_as("SELECT status, COUNT(*) FROM reach_tasks GROUP BY status")
                .fetch_all(p)
                .await?
        });
        Ok(rows
            .into_iter()
            .filter_map(|(s, n)| TaskStatus::parse(&s).map(|s| (s, n)))
            .collect())
    }

    /// Leases task `task_id` to `owner` until `lease_until_ms` when it is unowned, already
    /// `owner`'s, expired at `now_ms`, or `force` is set. Ended tasks are never claimed.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn claim(
        &self,
        task_id: &str,
        owner: &str,
        now_ms: i64,
        lease_until_ms: i64,
        force: bool,
    ) -> Result<bool, StoreError> {
        let n = with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_tasks SET owner = $1, lease_until_ms = $2 WHERE task_id = $3 AND ended_ms IS NULL \
                 AND (owner IS NULL OR owner = $1 OR lease_until_ms < $4 OR $5 = 1)",
            )
            .bind(owner)
            .bind(lease_until_ms)
            .bind(task_id)
            .bind(now_ms)
            .bind(i64::from(force))
            .execute(p)
            .await?
            .rows_affected()
        });
        Ok(n == 1)
    }

    /// Claims up to `limit` unfinished tasks that are unowned or whose lease expired, plus
    /// those already leased to `owner` when `include_own` (a restart with the same node id),
    /// or every unfinished task when `force`; returns their ids.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn claim_batch(
        &self,
        owner: &str,
        now_ms: i64,
        lease_until_ms: i64,
        limit: u32,
        include_own: bool,
        force: bool,
    ) -> Result<Vec<String>, StoreError> {
        let cond = "ended_ms IS NULL AND (owner IS NULL OR (owner = $1 AND $6 = 1) OR lease_until_ms < $3 OR $4 = 1)";
        let ids: Vec<(String,)> = match &self.backend {
            Backend::Postgres(p) => {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "UPDATE reach_tasks SET owner = $1, lease_until_ms = $2 WHERE task_id IN \
                     (SELECT task_id FROM reach_tasks WHERE {cond} ORDER BY created_ms LIMIT $5 FOR UPDATE SKIP LOCKED) \
                     AND {cond} RETURNING task_id"
                )))
                .bind(owner)
                .bind(lease_until_ms)
                .bind(now_ms)
                .bind(i64::from(force))
                .bind(i64::from(limit))
                .bind(i64::from(include_own))
                .fetch_all(p)
                .await?
            }
            Backend::Sqlite(p) => {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "UPDATE reach_tasks SET owner = $1, lease_until_ms = $2 WHERE task_id IN \
                     (SELECT task_id FROM reach_tasks WHERE {cond} ORDER BY created_ms LIMIT $5) RETURNING task_id"
                )))
                .bind(owner)
                .bind(lease_until_ms)
                .bind(now_ms)
                .bind(i64::from(force))
                .bind(i64::from(limit))
                .bind(i64::from(include_own))
                .fetch_all(p)
                .await?
            }
        };
        Ok(ids.into_iter().map(|(id,)| id).collect())
    }

    /// Extends the lease of every unfinished task `owner` holds.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn renew(&self, owner: &str, lease_until_ms: i64) -> Result<u64, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_tasks SET lease_until_ms = $1 WHERE owner = $2 AND ended_ms IS NULL",
            )
            .bind(lease_until_ms)
            .bind(owner)
            .execute(p)
            .await?
            .rows_affected()
        }))
    }

    /// Releases every lease `owner` holds (on shutdown, so other replicas take over at once).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn release_all(&self, owner: &str) -> Result<u64, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query("UPDATE reach_tasks SET owner = NULL, lease_until_ms = 0 WHERE owner = $1")
                .bind(owner)
                .execute(p)
                .await?
                .rows_affected()
        }))
    }

    /// Tasks leased to `owner` with a pending timer due at `now_ms`, and the earliest pending
    /// timer of `owner`'s tasks that is not yet due.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn due_timers(
        &self,
        owner: &str,
        now_ms: i64,
        limit: u32,
    ) -> Result<(Vec<String>, Option<i64>), StoreError> {
        let due: Vec<(String,)> = with_pool!(&self.backend, |p| {
            sqlx::query_as(
                "SELECT DISTINCT t.task_id FROM reach_timers t JOIN reach_tasks k ON k.task_id = t.task_id \
                 WHERE t.state = 'pending' AND t.fire_at_ms <= $1 AND k.owner = $2 LIMIT $3",
            )
            .bind(now_ms)
            .bind(owner)
            .bind(i64::from(limit))
            .fetch_all(p)
            .await?
        });
        let next: Option<(i64,)> = with_pool!(&self.backend, |p| {
            sqlx::query_as(
                "SELECT t.fire_at_ms FROM reach_timers t JOIN reach_tasks k ON k.task_id = t.task_id \
                 WHERE t.state = 'pending' AND t.fire_at_ms > $1 AND k.owner = $2 ORDER BY t.fire_at_ms LIMIT 1",
            )
            .bind(now_ms)
            .bind(owner)
            .fetch_optional(p)
            .await?
        });
        Ok((
            due.into_iter().map(|(id,)| id).collect(),
            next.map(|(n,)| n),
        ))
    }

    /// Records an applied flow version; `false` when that version was already stored.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn insert_flow(
        &self,
        flow_id: &str,
        version: u32,
        yaml: &str,
        source: &str,
        applied_ms: i64,
    ) -> Result<bool, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query("INSERT INTO reach_flows (flow_id, version, yaml, source, applied_ms) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING")
                .bind(flow_id)
                .bind(i64::from(version))
                .bind(yaml)
                .bind(source)
                .bind(applied_ms)
                .execute(p)
                .await?
                .rows_affected()
        }) == 1)
    }

    /// Every stored flow version: `(flow_id, version, yaml, source, applied_ms)`.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn flows(&self) -> Result<Vec<(String, u32, String, String, i64)>, StoreError> {
        let rows: Vec<(String, i64, String, String, i64)> = with_pool!(&self.backend, |p| {
            sqlx::query_as("SELECT flow_id, version, yaml, source, applied_ms FROM reach_flows ORDER BY flow_id, version")
                .fetch_all(p)
                .await?
        });
        Ok(rows
            .into_iter()
            .map(|(id, v, y, s, a)| (id, u32::try_from(v).unwrap_or(0), y, s, a))
            .collect())
    }

    /// Appends ledger entries: `(task_id, at_ms, message_id, encoded LedgerEntry)`.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn insert_ledger(
        &self,
        rows: &[(String, i64, String, Vec<u8>)],
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        with_pool!(&self.backend, |p| {
            let mut tx = p.begin().await?;
            for (task, at, id, body) in rows {
                sqlx::query("INSERT INTO reach_ledger (task_id, at_ms, message_id, body) VALUES ($1, $2, $3, $4)")
                    .bind(task)
                    .bind(*at)
                    .bind(id)
                    .bind(body)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// The ledger entries of a task: `(at_ms, encoded LedgerEntry)` in time order.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn ledger(&self, task_id: &str) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query_as("SELECT at_ms, body FROM reach_ledger WHERE task_id = $1 ORDER BY at_ms")
                .bind(task_id)
                .fetch_all(p)
                .await?
        }))
    }

    /// Deletes tasks (with events, timers, ledger entries and webhooks) that ended before
    /// `ended_before_ms`, and ledger entries older than that without a live task; returns
    /// how many tasks were purged.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn purge(&self, ended_before_ms: i64) -> Result<u64, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            let mut tx = p.begin().await?;
            let sub =
                "SELECT task_id FROM reach_tasks WHERE ended_ms IS NOT NULL AND ended_ms < $1";
            for table in [
                "reach_events",
                "reach_timers",
                "reach_ledger",
                "reach_task_labels",
                "reach_webhooks",
            ] {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE task_id IN ({sub})"
                )))
                .bind(ended_before_ms)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query("DELETE FROM reach_ledger WHERE at_ms < $1 AND task_id NOT IN (SELECT task_id FROM reach_tasks)")
                .bind(ended_before_ms)
                .execute(&mut *tx)
                .await?;
            let n =
                sqlx::query("DELETE FROM reach_tasks WHERE ended_ms IS NOT NULL AND ended_ms < $1")
                    .bind(ended_before_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            tx.commit().await?;
            n
        }))
    }

    // === webhooks ===

    /// Stores webhook `w` of its task: a new row, or (same task and webhook id) the new
    /// settings of an existing one, which keeps its `delivered_seq`, `created_ms` and lease
    /// and is due at once. A new row is refused when the task has `max_per_task` webhooks
    /// already. Returns the stored row.
    ///
    /// # Errors
    /// [`WebhookUpsert::Full`] beyond `max_per_task`; [`StoreError`] on database failure.
    pub async fn upsert_webhook(
        &self,
        w: &WebhookRow,
        max_per_task: usize,
    ) -> Result<WebhookUpsert, StoreError> {
        let max = i64::try_from(max_per_task).unwrap_or(i64::MAX);
        with_pool!(&self.backend, |p| {
            let mut tx = p.begin().await?;
            let updated = sqlx::query(
                "UPDATE reach_webhooks SET url = $1, token = $2, auth_scheme = $3, auth_credentials = $4, format = $5, \
                 failed_attempts = 0, last_error = '', next_attempt_ms = CASE WHEN next_attempt_ms = $8 THEN $8 ELSE 0 END \
                 WHERE task_id = $6 AND webhook_id = $7",
            )
            .bind(&w.url)
            .bind(&w.token)
            .bind(&w.auth_scheme)
            .bind(&w.auth_credentials)
            .bind(&w.format)
            .bind(&w.task_id)
            .bind(&w.webhook_id)
            .bind(WEBHOOK_PARKED_MS)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if updated == 0 {
                // The count and the insert race with another replica's create; the limit is
                // a guard against unbounded growth, not an exact quota.
                let (n,): (i64,) =
                    sqlx::query_as("SELECT COUNT(*) FROM reach_webhooks WHERE task_id = $1")
                        .bind(&w.task_id)
                        .fetch_one(&mut *tx)
                        .await?;
                if n >= max {
                    return Ok(WebhookUpsert::Full);
                }
                sqlx::query(
                    "INSERT INTO reach_webhooks (webhook_id, task_id, url, token, auth_scheme, auth_credentials, format, delivered_seq, created_ms, failed_attempts, last_error, next_attempt_ms, lease_owner, lease_until_ms) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8, 0, '', 0, NULL, 0)",
                )
                .bind(&w.webhook_id)
                .bind(&w.task_id)
                .bind(&w.url)
                .bind(&w.token)
                .bind(&w.auth_scheme)
                .bind(&w.auth_credentials)
                .bind(&w.format)
                .bind(w.created_ms)
                .execute(&mut *tx)
                .await?;
            }
            let row: WebhookTuple = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {WEBHOOK_COLUMNS} FROM reach_webhooks WHERE task_id = $1 AND webhook_id = $2"
            )))
            .bind(&w.task_id)
            .bind(&w.webhook_id)
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(WebhookUpsert::Stored(Box::new(webhook_from_row(row))))
        })
    }

    /// Webhook `webhook_id` of task `task_id`, if it exists.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn webhook(
        &self,
        task_id: &str,
        webhook_id: &str,
    ) -> Result<Option<WebhookRow>, StoreError> {
        let row: Option<WebhookTuple> = with_pool!(&self.backend, |p| {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {WEBHOOK_COLUMNS} FROM reach_webhooks WHERE task_id = $1 AND webhook_id = $2"
            )))
            .bind(task_id)
            .bind(webhook_id)
            .fetch_optional(p)
            .await?
        });
        Ok(row.map(webhook_from_row))
    }

    /// Up to `limit` webhooks of task `task_id`, oldest first, starting after the page
    /// token (`created_ms` and `webhook_id` of the last row of the previous page).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn list_webhooks(
        &self,
        task_id: &str,
        limit: u32,
        after: Option<(i64, String)>,
    ) -> Result<Vec<WebhookRow>, StoreError> {
        let (after_ms, after_id) = after.unwrap_or((i64::MIN, String::new()));
        let rows: Vec<WebhookTuple> = with_pool!(&self.backend, |p| {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {WEBHOOK_COLUMNS} FROM reach_webhooks WHERE task_id = $1 \
                 AND (created_ms > $2 OR (created_ms = $2 AND webhook_id > $3)) \
                 ORDER BY created_ms, webhook_id LIMIT $4"
            )))
            .bind(task_id)
            .bind(after_ms)
            .bind(after_id.clone())
            .bind(i64::from(limit))
            .fetch_all(p)
            .await?
        });
        Ok(rows.into_iter().map(webhook_from_row).collect())
    }

    /// Deletes webhook `webhook_id` of task `task_id`; `false` when there was none.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn delete_webhook(
        &self,
        task_id: &str,
        webhook_id: &str,
    ) -> Result<bool, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query("DELETE FROM reach_webhooks WHERE task_id = $1 AND webhook_id = $2")
                .bind(task_id)
                .bind(webhook_id)
                .execute(p)
                .await?
                .rows_affected()
        }) == 1)
    }

    /// Leases to `owner` until `lease_until_ms` up to `limit` webhooks that are due at
    /// `now_ms`: their task has events after their `delivered_seq`, their next attempt is due,
    /// and their lease is free, expired or already `owner`'s. Webhooks whose events are all
    /// delivered (every webhook of an ended task, eventually) are not returned. Two replicas
    /// never hold the same webhook at once.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn claim_webhooks(
        &self,
        owner: &str,
        now_ms: i64,
        lease_until_ms: i64,
        limit: u32,
    ) -> Result<Vec<WebhookRow>, StoreError> {
        let cond = "w.next_attempt_ms <= $3 AND (w.lease_until_ms < $3 OR w.lease_owner = $1) \
                    AND w.delivered_seq < (SELECT t.seq FROM reach_tasks t WHERE t.task_id = w.task_id)";
        let lock = match self.backend {
            Backend::Postgres(_) => " FOR UPDATE SKIP LOCKED",
            Backend::Sqlite(_) => "",
        };
        let sql = format!(
            "UPDATE reach_webhooks SET lease_owner = $1, lease_until_ms = $2 WHERE (task_id, webhook_id) IN \
             (SELECT w.task_id, w.webhook_id FROM reach_webhooks w WHERE {cond} ORDER BY w.next_attempt_ms LIMIT $4{lock}) \
             AND (lease_until_ms < $3 OR lease_owner = $1) RETURNING {WEBHOOK_COLUMNS}"
        );
        let rows: Vec<WebhookTuple> = with_pool!(&self.backend, |p| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql.clone()))
                .bind(owner)
                .bind(lease_until_ms)
                .bind(now_ms)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?
        });
        Ok(rows.into_iter().map(webhook_from_row).collect())
    }

    /// Records that the webhook accepted the notifications up to `delivered_seq` (clearing
    /// its failures) and extends `owner`'s lease to `lease_until_ms`; `false` when `owner`
    /// no longer holds the webhook (it was deleted, or its lease expired and another replica
    /// took it).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn webhook_delivered(
        &self,
        task_id: &str,
        webhook_id: &str,
        owner: &str,
        delivered_seq: i64,
        lease_until_ms: i64,
    ) -> Result<bool, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET delivered_seq = $1, failed_attempts = 0, last_error = '', next_attempt_ms = 0, lease_until_ms = $2 \
                 WHERE task_id = $3 AND webhook_id = $4 AND lease_owner = $5 AND delivered_seq <= $1",
            )
            .bind(delivered_seq)
            .bind(lease_until_ms)
            .bind(task_id)
            .bind(webhook_id)
            .bind(owner)
            .execute(p)
            .await?
            .rows_affected()
        }) == 1)
    }

    /// Records a failed attempt (`error`; the next one is due at `next_attempt_ms`) and
    /// releases `owner`'s lease.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn webhook_failed(
        &self,
        task_id: &str,
        webhook_id: &str,
        owner: &str,
        error: &str,
        next_attempt_ms: i64,
    ) -> Result<(), StoreError> {
        with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET failed_attempts = failed_attempts + 1, last_error = $1, next_attempt_ms = $2, \
                 lease_owner = NULL, lease_until_ms = 0 WHERE task_id = $3 AND webhook_id = $4 AND lease_owner = $5",
            )
            .bind(error)
            .bind(next_attempt_ms)
            .bind(task_id)
            .bind(webhook_id)
            .bind(owner)
            .execute(p)
            .await?;
        });
        Ok(())
    }

    /// Parks a webhook `owner` holds, releasing the lease, when its task has ended and it
    /// was sent everything (`delivered_seq` is the task's last sequence): it is not polled
    /// again (see [`WEBHOOK_PARKED_MS`]). `false`, changing nothing, otherwise.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn park_webhook(
        &self,
        task_id: &str,
        webhook_id: &str,
        owner: &str,
    ) -> Result<bool, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET next_attempt_ms = $1, lease_owner = NULL, lease_until_ms = 0 \
                 WHERE task_id = $2 AND webhook_id = $3 AND lease_owner = $4 \
                 AND delivered_seq >= (SELECT t.seq FROM reach_tasks t WHERE t.task_id = $2 AND t.ended_ms IS NOT NULL)",
            )
            .bind(WEBHOOK_PARKED_MS)
            .bind(task_id)
            .bind(webhook_id)
            .bind(owner)
            .execute(p)
            .await?
            .rows_affected()
        }) == 1)
    }

    /// Makes parked webhooks due again: those of task `task_id` (it was retried), or with
    /// `None` those of every task that has not ended (a sweep at start, for a retry whose
    /// process stopped before it unparked them). Returns how many.
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn unpark_webhooks(&self, task_id: Option<&str>) -> Result<u64, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET next_attempt_ms = 0 WHERE next_attempt_ms = $1 \
                 AND task_id IN (SELECT t.task_id FROM reach_tasks t WHERE t.ended_ms IS NULL AND ($2 = '' OR t.task_id = $2))",
            )
            .bind(WEBHOOK_PARKED_MS)
            .bind(task_id.unwrap_or(""))
            .execute(p)
            .await?
            .rows_affected()
        }))
    }

    /// Releases every webhook lease `owner` holds (a replica stopping cleanly), or with
    /// `None` every lease (an exclusive SQLite store at start: the previous process is gone).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn release_webhooks(&self, owner: Option<&str>) -> Result<u64, StoreError> {
        Ok(with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET lease_owner = NULL, lease_until_ms = 0 \
                 WHERE lease_owner IS NOT NULL AND ($1 = '' OR lease_owner = $1)",
            )
            .bind(owner.unwrap_or(""))
            .execute(p)
            .await?
            .rows_affected()
        }))
    }

    /// Releases `owner`'s lease of a webhook (its turn is over).
    ///
    /// # Errors
    /// [`StoreError`] on database failure.
    pub async fn release_webhook(
        &self,
        task_id: &str,
        webhook_id: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        with_pool!(&self.backend, |p| {
            sqlx::query(
                "UPDATE reach_webhooks SET lease_owner = NULL, lease_until_ms = 0 WHERE task_id = $1 AND webhook_id = $2 AND lease_owner = $3",
            )
            .bind(task_id)
            .bind(webhook_id)
            .bind(owner)
            .execute(p)
            .await?;
        });
        Ok(())
    }

    /// Closes the pool.
    pub async fn close(&self) {
        with_pool!(&self.backend, |p| p.close().await);
    }
}

/// Takes the exclusive lock of an SQLite store file (see [`Store`]).
async fn lock_file(path: &str) -> Result<sqlx::SqliteConnection, StoreError> {
    use sqlx::Connection;
    let opts = SqliteConnectOptions::new()
        .filename(format!("{path}.lock"))
        .create_if_missing(true)
        .locking_mode(sqlx::sqlite::SqliteLockingMode::Exclusive)
        .busy_timeout(Duration::ZERO);
    let mut conn = sqlx::SqliteConnection::connect_with(&opts).await?;
    match sqlx::query("BEGIN EXCLUSIVE").execute(&mut conn).await {
        Ok(_) => Ok(conn),
        Err(sqlx::Error::Database(e))
            if e.message().contains("locked") || e.message().contains("busy") =>
        {
            Err(StoreError::Locked(path.to_string()))
        }
        Err(e) => Err(e.into()),
    }
}

const SUMMARY_COLUMNS: &str = "task_id, flow_id, flow_version, status, current_node, seq, created_ms, updated_ms, ended_ms, trace_id, error, failed_node";

type SummaryRow = (
    String,
    String,
    i64,
    String,
    Option<String>,
    i64,
    i64,
    i64,
    Option<i64>,
    String,
    Option<String>,
    Option<String>,
);

fn summary_from_row(r: SummaryRow) -> TaskSummary {
    TaskSummary {
        task_id: r.0,
        flow_id: r.1,
        flow_version: u32::try_from(r.2).unwrap_or(0),
        status: TaskStatus::parse(&r.3).unwrap_or(TaskStatus::Pending),
        current_node: r.4,
        seq: r.5,
        created_ms: r.6,
        updated_ms: r.7,
        ended_ms: r.8,
        trace_id: r.9,
        error: r.10,
        failed_node: r.11,
    }
}

/// One row of `reach_webhooks`: a task webhook's settings and delivery progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRow {
    /// The webhook id, unique within its task.
    pub webhook_id: String,
    /// The task.
    pub task_id: String,
    /// Where notifications are POSTed.
    pub url: String,
    /// The `X-A2A-Notification-Token` header value; empty for none.
    pub token: String,
    /// The `Authorization` scheme; empty for none.
    pub auth_scheme: String,
    /// The `Authorization` credentials; empty for none.
    pub auth_credentials: String,
    /// The renderer's format (`reach`, ...).
    pub format: String,
    /// The sequence number of the last event delivered (0 before the first).
    pub delivered_seq: i64,
    /// When created (unix ms).
    pub created_ms: i64,
    /// Failed attempts since the last success.
    pub failed_attempts: i64,
    /// The last failure; empty after a success.
    pub last_error: String,
    /// When the next attempt is due (unix ms); 0 for at once, [`WEBHOOK_PARKED_MS`] for
    /// never (parked).
    pub next_attempt_ms: i64,
    /// The replica delivering now, if any.
    pub lease_owner: Option<String>,
    /// Until when `lease_owner` holds it (unix ms).
    pub lease_until_ms: i64,
}

/// The `next_attempt_ms` of a parked webhook: its task ended and it was sent every event,
/// so it is kept (for GetTaskWebhook) but not polled; RetryTask makes it due again.
pub const WEBHOOK_PARKED_MS: i64 = i64::MAX;

/// What [`Store::upsert_webhook`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebhookUpsert {
    /// Stored (created or replaced); the row as it is now.
    Stored(Box<WebhookRow>),
    /// Not created: the task has as many webhooks as it may.
    Full,
}

const WEBHOOK_COLUMNS: &str = "webhook_id, task_id, url, token, auth_scheme, auth_credentials, format, delivered_seq, created_ms, failed_attempts, last_error, next_attempt_ms, lease_owner, lease_until_ms";

type WebhookTuple = (
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    String,
    i64,
    Option<String>,
    i64,
);

fn webhook_from_row(r: WebhookTuple) -> WebhookRow {
    WebhookRow {
        webhook_id: r.0,
        task_id: r.1,
        url: r.2,
        token: r.3,
        auth_scheme: r.4,
        auth_credentials: r.5,
        format: r.6,
        delivered_seq: r.7,
        created_ms: r.8,
        failed_attempts: r.9,
        last_error: r.10,
        next_attempt_ms: r.11,
        lease_owner: r.12,
        lease_until_ms: r.13,
    }
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS reach_flows (flow_id TEXT NOT NULL, version BIGINT NOT NULL, yaml TEXT NOT NULL, source TEXT NOT NULL, applied_ms BIGINT NOT NULL, PRIMARY KEY (flow_id, version))",
    "CREATE TABLE IF NOT EXISTS reach_tasks (task_id TEXT PRIMARY KEY, flow_id TEXT NOT NULL, flow_version BIGINT NOT NULL, status TEXT NOT NULL, current_node TEXT, seq BIGINT NOT NULL, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL, ended_ms BIGINT, owner TEXT, lease_until_ms BIGINT NOT NULL DEFAULT 0, trace_id TEXT NOT NULL, error TEXT, failed_node TEXT)",
    "CREATE INDEX IF NOT EXISTS reach_tasks_created ON reach_tasks (created_ms)",
    "CREATE INDEX IF NOT EXISTS reach_tasks_status ON reach_tasks (status, created_ms)",
    "CREATE INDEX IF NOT EXISTS reach_tasks_owner ON reach_tasks (owner, ended_ms)",
    "CREATE INDEX IF NOT EXISTS reach_tasks_ended ON reach_tasks (ended_ms)",
    "CREATE TABLE IF NOT EXISTS reach_events (task_id TEXT NOT NULL, seq BIGINT NOT NULL, at_ms BIGINT NOT NULL, kind TEXT NOT NULL, node TEXT, body TEXT NOT NULL, PRIMARY KEY (task_id, seq))",
    "CREATE TABLE IF NOT EXISTS reach_task_labels (task_id TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (task_id, key))",
    "CREATE INDEX IF NOT EXISTS reach_task_labels_value ON reach_task_labels (key, value)",
    "CREATE TABLE IF NOT EXISTS reach_timers (timer_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, fire_at_ms BIGINT NOT NULL, state TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS reach_timers_due ON reach_timers (state, fire_at_ms)",
    "CREATE INDEX IF NOT EXISTS reach_timers_task ON reach_timers (task_id)",
    "CREATE TABLE IF NOT EXISTS reach_webhooks (webhook_id TEXT NOT NULL, task_id TEXT NOT NULL, url TEXT NOT NULL, token TEXT NOT NULL, auth_scheme TEXT NOT NULL, auth_credentials TEXT NOT NULL, format TEXT NOT NULL, delivered_seq BIGINT NOT NULL DEFAULT 0, created_ms BIGINT NOT NULL, failed_attempts BIGINT NOT NULL DEFAULT 0, last_error TEXT NOT NULL DEFAULT '', next_attempt_ms BIGINT NOT NULL DEFAULT 0, lease_owner TEXT, lease_until_ms BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (task_id, webhook_id))",
    "CREATE INDEX IF NOT EXISTS reach_webhooks_due ON reach_webhooks (next_attempt_ms)",
];

async fn create_schema(backend: &Backend) -> Result<(), StoreError> {
    with_pool!(backend, |p| {
        for stmt in SCHEMA {
            sqlx::query(*stmt).execute(p).await?;
        }
    });
    let ledger = match backend {
        Backend::Sqlite(_) => {
            "CREATE TABLE IF NOT EXISTS reach_ledger (task_id TEXT NOT NULL, at_ms BIGINT NOT NULL, message_id TEXT NOT NULL, body BLOB NOT NULL)"
        }
        Backend::Postgres(_) => {
            "CREATE TABLE IF NOT EXISTS reach_ledger (task_id TEXT NOT NULL, at_ms BIGINT NOT NULL, message_id TEXT NOT NULL, body BYTEA NOT NULL)"
        }
    };
    with_pool!(backend, |p| {
        sqlx::query(ledger).execute(p).await?;
        sqlx::query(
            "CREATE INDEX IF NOT EXISTS reach_ledger_task ON reach_ledger (task_id, at_ms)",
        )
        .execute(p)
        .await?;
    });
    Ok(())
}

// === the writer: group commit ===

macro_rules! write_batch {
    ($pool:expr, $batch:expr, $bulk:expr) => {
        async {
            let pool = $pool;
            let batch: &[WriteReq] = $batch;
            let result: Result<Vec<AppendOutcome>, sqlx::Error> = async {
    let mut tx = pool.begin().await?;
    let mut out = Vec::with_capacity(batch.len());
    // (task_id, seq, at_ms, kind, node, body) of every accepted event, inserted at the end.
    let mut rows: Vec<(String, i64, i64, &'static str, Option<String>, String)> = Vec::new();
    let new_seq_of = |a: &Append| a.expected_seq + i64::try_from(a.events.len()).unwrap_or(0);
    // Bulk guard (when `$bulk`): the first engine append of each task in the batch, checked
    // and applied by one `UPDATE ... FROM (VALUES ...)` per 300 appends (10 parameters each). Later appends
    // of the same task, creations and commands take the row-by-row path below, in order.
    let mut decided: Vec<Option<bool>> = vec![None; batch.len()];
    {
        let mut seen = std::collections::HashSet::new();
        let bulk: Vec<usize> = (0..batch.len())
            .filter(|&i| {
                $bulk
                    && matches!(batch[i].append.guard, Guard::Owner(_) | Guard::Seq)
                    && seen.insert(batch[i].append.summary.task_id.as_str())
            })
            .collect();
        for chunk in bulk.chunks(300) {
            let mut qb = sqlx::QueryBuilder::new(
                "UPDATE reach_tasks SET status = v.column2, current_node = v.column3, seq = v.column4, \
                 updated_ms = v.column5, ended_ms = v.column6, error = v.column7, failed_node = v.column8 FROM (",
            );
            qb.push_values(chunk, |mut b, &i| {
                let a = &batch[i].append;
                let s = &a.summary;
                let owner = match &a.guard {
                    Guard::Owner(o) => Some(o.clone()),
                    _ => None,
                };
                b.push_bind(s.task_id.clone())
                    .push_bind(s.status.as_str().to_string())
                    .push_bind(s.current_node.clone())
                    .push_bind(new_seq_of(a))
                    .push_bind(s.updated_ms)
                    .push_bind(s.ended_ms)
                    .push_bind(s.error.clone())
                    .push_bind(s.failed_node.clone())
                    .push_bind(a.expected_seq)
                    .push_bind(owner);
            });
            qb.push(
                ") AS v WHERE reach_tasks.task_id = v.column1 AND reach_tasks.seq = v.column9 \
                 AND (v.column10 IS NULL OR reach_tasks.owner = v.column10) RETURNING task_id",
            );
            let accepted: Vec<(String,)> = qb.build_query_as().fetch_all(&mut *tx).await?;
            let accepted: std::collections::HashSet<String> =
                accepted.into_iter().map(|(t,)| t).collect();
            for &i in chunk {
                decided[i] = Some(accepted.contains(&batch[i].append.summary.task_id));
            }
        }
    }
    for (index, req) in batch.iter().enumerate() {
        let a = &req.append;
        let s = &a.summary;
        let new_seq = new_seq_of(a);
        let guarded = match (&a.guard, decided[index]) {
            (_, Some(true)) => 1,
            (_, Some(false)) => 0,
            (Guard::Create { owner, lease_until_ms }, None) => {
                sqlx::query(
                    "INSERT INTO reach_tasks (task_id, flow_id, flow_version, status, current_node, seq, created_ms, updated_ms, ended_ms, owner, lease_until_ms, trace_id, error, failed_node) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) ON CONFLICT DO NOTHING",
                )
                .bind(s.task_id.clone())
                .bind(s.flow_id.clone())
                .bind(i64::from(s.flow_version))
                .bind(s.status.as_str().to_string())
                .bind(s.current_node.clone())
                .bind(new_seq)
                .bind(s.created_ms)
                .bind(s.updated_ms)
                .bind(s.ended_ms)
                .bind(owner.clone())
                .bind(*lease_until_ms)
                .bind(s.trace_id.clone())
                .bind(s.error.clone())
                .bind(s.failed_node.clone())
                .execute(&mut *tx)
                .await?
                .rows_affected()
            }
            (guard, None) => {
                // The engine of an owner must still hold the lease; a command (resume, cancel,
                // retry) also releases it; a sequence-only guard keeps it.
                let (sql, owner) = match guard {
                    Guard::Owner(owner) => (
                        "UPDATE reach_tasks SET status = $1, current_node = $2, seq = $3, updated_ms = $4, ended_ms = $5, error = $6, failed_node = $7 WHERE task_id = $8 AND seq = $9 AND owner = $10",
                        Some(owner),
                    ),
                    Guard::Command => (
                        "UPDATE reach_tasks SET status = $1, current_node = $2, seq = $3, updated_ms = $4, ended_ms = $5, error = $6, failed_node = $7, owner = NULL, lease_until_ms = 0 WHERE task_id = $8 AND seq = $9",
                        None,
                    ),
                    _ => (
                        "UPDATE reach_tasks SET status = $1, current_node = $2, seq = $3, updated_ms = $4, ended_ms = $5, error = $6, failed_node = $7 WHERE task_id = $8 AND seq = $9",
                        None,
                    ),
                };
                let mut query = sqlx::query(sql)
                    .bind(s.status.as_str().to_string())
                    .bind(s.current_node.clone())
                    .bind(new_seq)
                    .bind(s.updated_ms)
                    .bind(s.ended_ms)
                    .bind(s.error.clone())
                    .bind(s.failed_node.clone())
                    .bind(s.task_id.clone())
                    .bind(a.expected_seq);
                if let Some(owner) = owner {
                    query = query.bind(owner.clone());
                }
                query.execute(&mut *tx).await?.rows_affected()
            }
        };
        if guarded != 1 {
            out.push(AppendOutcome::Conflict);
            continue;
        }
        for (i, event) in a.events.iter().enumerate() {
            let seq = a.expected_seq + 1 + i64::try_from(i).unwrap_or(0);
            let body = serde_json::to_string(event).unwrap_or_else(|_| "{}".into());
            rows.push((s.task_id.clone(), seq, a.at_ms, event.kind(), event.node().map(str::to_string), body));
            match event {
                Event::TimerScheduled { timer, fire_at_ms, .. } => {
                    sqlx::query("INSERT INTO reach_timers (timer_id, task_id, fire_at_ms, state) VALUES ($1, $2, $3, 'pending')")
                        .bind(timer.clone())
                        .bind(s.task_id.clone())
                        .bind(*fire_at_ms)
                        .execute(&mut *tx)
                        .await?;
                }
                Event::TimerFired { timer } | Event::TimerCancelled { timer, .. } => {
                    let state = if matches!(event, Event::TimerFired { .. }) { "fired" } else { "cancelled" };
                    sqlx::query("UPDATE reach_timers SET state = $1 WHERE timer_id = $2")
                        .bind(state.to_string())
                        .bind(timer.clone())
                        .execute(&mut *tx)
                        .await?;
                }
                Event::TaskCreated { labels, .. } => {
                    for (key, value) in labels {
                        sqlx::query("INSERT INTO reach_task_labels (task_id, key, value) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                            .bind(s.task_id.clone())
                            .bind(key.clone())
                            .bind(value.clone())
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                Event::TaskEnded { .. } => {
                    sqlx::query("UPDATE reach_timers SET state = 'cancelled' WHERE task_id = $1 AND state = 'pending'")
                        .bind(s.task_id.clone())
                        .execute(&mut *tx)
                        .await?;
                }
                _ => {}
            }
        }
        out.push(AppendOutcome::Appended(new_seq));
    }
    // One multi-row INSERT per 500 events (3 000 parameters: within SQLite's and
    // PostgreSQL's limits).
    for chunk in rows.chunks(500) {
        let mut qb = sqlx::QueryBuilder::new("INSERT INTO reach_events (task_id, seq, at_ms, kind, node, body) ");
        qb.push_values(chunk, |mut b, (task, seq, at, kind, node, body)| {
            b.push_bind(task.clone())
                .push_bind(*seq)
                .push_bind(*at)
                .push_bind((*kind).to_string())
                .push_bind(node.clone())
                .push_bind(body.clone());
        });
        qb.build().execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(out)
}
            .await;
            result
        }
    };
}

/// Whether a failed transaction may simply be run again: PostgreSQL deadlock (40P01),
/// serialization failure (40001) or lock timeout (55P03); SQLite busy or locked.
fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            matches!(
                code.as_ref(),
                "40P01" | "40001" | "55P03" | "5" | "6" | "261" | "262" | "517"
            ) || db.message().contains("database is locked")
        }
        sqlx::Error::PoolTimedOut => true,
        _ => false,
    }
}

async fn writer(backend: Backend, mut rx: mpsc::Receiver<WriteReq>) {
    // The bulk guard saves PostgreSQL a network round trip per append; SQLite runs in
    // process, where row-by-row updates by primary key measured the same.
    let bulk = matches!(backend, Backend::Postgres(_));
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        if rx.recv_many(&mut batch, MAX_BATCH).await == 0 {
            return;
        }
        // A deadlock with another replica's transaction (PostgreSQL) or a busy file
        // (SQLite) rolls the whole batch back: nothing was written, so it is retried as is.
        let mut tries = 0;
        let result = loop {
            let result = with_pool!(&backend, |p| write_batch!(p, &batch, bulk).await);
            match result {
                Err(e) if tries < 8 && is_transient(&e) => {
                    tries += 1;
                    tracing::debug!(error = %e, tries, "task store batch retried");
                    tokio::time::sleep(Duration::from_millis(5 * tries)).await;
                }
                other => break other,
            }
        };
        match result {
            Ok(outcomes) => {
                for (req, outcome) in batch.drain(..).zip(outcomes) {
                    let _ = req.reply.send(Ok(outcome));
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, size = batch.len(), "task store batch failed");
                let kind = classify(&err);
                let message = err.to_string();
                for req in batch.drain(..) {
                    let _ = req.reply.send(Err(StoreError::Batch {
                        kind,
                        message: message.clone(),
                    }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unique violation is a conflict, a lost pool is unavailable, an undecodable event is
    /// corrupt — and a failed group commit keeps its kind on the way to every append.
    #[tokio::test]
    async fn store_errors_keep_their_kind() {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (id TEXT PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO t VALUES ('a')")
            .execute(&pool)
            .await
            .unwrap();
        let dup = sqlx::query("INSERT INTO t VALUES ('a')")
            .execute(&pool)
            .await
            .unwrap_err();
        assert_eq!(StoreError::Db(dup).kind(), StoreErrorKind::Conflict);
        let bad_sql = sqlx::query("SELECT nope FROM t")
            .execute(&pool)
            .await
            .unwrap_err();
        assert_eq!(StoreError::Db(bad_sql).kind(), StoreErrorKind::Internal);
        pool.close().await;
        let closed = sqlx::query("SELECT 1").execute(&pool).await.unwrap_err();
        assert_eq!(StoreError::Db(closed).kind(), StoreErrorKind::Unavailable);
        assert_eq!(StoreError::WriterGone.kind(), StoreErrorKind::Unavailable);
        assert_eq!(
            StoreError::Corrupt {
                task_id: "t".into(),
                seq: 1,
                message: "x".into()
            }
            .kind(),
            StoreErrorKind::Corrupt
        );
    }

    /// The store's directory and files are created owner-only (0700 / 0600), WAL included.
    #[cfg(unix)]
    #[tokio::test]
    async fn the_store_is_created_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let path = data.join("tasks.db");
        let store = Store::open(
            &format!("sqlite://{}", path.display()),
            SqliteDurability::Normal,
        )
        .await
        .unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&data), 0o700);
        assert_eq!(mode(&path), 0o600);
        let wal = data.join("tasks.db-wal");
        if wal.exists() {
            assert_eq!(mode(&wal), 0o600);
        }
        store.close().await;
    }

    fn hook(task: &str, id: &str) -> WebhookRow {
        WebhookRow {
            webhook_id: id.into(),
            task_id: task.into(),
            url: "http://127.0.0.1:9/".into(),
            token: String::new(),
            auth_scheme: String::new(),
            auth_credentials: String::new(),
            format: "reach".into(),
            delivered_seq: 0,
            created_ms: 1,
            failed_attempts: 0,
            last_error: String::new(),
            next_attempt_ms: 0,
            lease_owner: None,
            lease_until_ms: 0,
        }
    }

    /// A webhook is leased to one owner at a time; a lost lease refuses progress; failures
    /// delay it; once its ended task's events are all in it is parked until a retry; replacing
    /// keeps its progress; the purge of its task deletes it.
    #[tokio::test]
    async fn webhooks_are_leased_parked_and_purged() {
        let store = Store::open("sqlite::memory:", SqliteDurability::Normal)
            .await
            .unwrap();
        let Backend::Sqlite(pool) = &store.backend else {
            unreachable!()
        };
        sqlx::query("INSERT INTO reach_tasks (task_id, flow_id, flow_version, status, seq, created_ms, updated_ms, trace_id) VALUES ('t', 'f', 1, 'PROCESSING', 3, 0, 0, 'x')")
            .execute(pool)
            .await
            .unwrap();
        let stored = |u: WebhookUpsert| match u {
            WebhookUpsert::Stored(w) => *w,
            WebhookUpsert::Full => panic!("full"),
        };
        stored(store.upsert_webhook(&hook("t", "w"), 2).await.unwrap());
        stored(store.upsert_webhook(&hook("t", "v"), 2).await.unwrap());
        assert_eq!(
            store.upsert_webhook(&hook("t", "u"), 2).await.unwrap(),
            WebhookUpsert::Full
        );
        store.delete_webhook("t", "v").await.unwrap();

        let claimed = store.claim_webhooks("a", 100, 200, 64).await.unwrap();
        assert_eq!(claimed.len(), 1);
        assert!(
            store
                .claim_webhooks("b", 150, 250, 64)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            store
                .webhook_delivered("t", "w", "a", 1, 300)
                .await
                .unwrap()
        );
        // Released leases (a replica stopping, or every lease on an SQLite store at start) are
        // free at once; another owner's lease is not released.
        assert_eq!(store.release_webhooks(Some("b")).await.unwrap(), 0);
        assert_eq!(store.release_webhooks(None).await.unwrap(), 1);
        assert_eq!(
            store.claim_webhooks("a", 150, 300, 64).await.unwrap().len(),
            1
        );
        // Expired: b takes it over, and a's progress is refused.
        assert_eq!(
            store.claim_webhooks("b", 301, 400, 64).await.unwrap().len(),
            1
        );
        assert!(
            !store
                .webhook_delivered("t", "w", "a", 2, 500)
                .await
                .unwrap()
        );
        store
            .webhook_failed("t", "w", "b", "HTTP 500", 1000)
            .await
            .unwrap();
        assert!(
            store
                .claim_webhooks("a", 999, 2000, 64)
                .await
                .unwrap()
                .is_empty()
        );
        let w = store.claim_webhooks("a", 1000, 2000, 64).await.unwrap();
        assert_eq!((w[0].failed_attempts, w[0].delivered_seq), (1, 1));
        assert!(
            store
                .webhook_delivered("t", "w", "a", 3, 2000)
                .await
                .unwrap()
        );
        // Running task: not parked, and nothing pending, so not claimed.
        assert!(!store.park_webhook("t", "w", "a").await.unwrap());
        store.release_webhook("t", "w", "a").await.unwrap();
        assert!(
            store
                .claim_webhooks("a", 1000, 2000, 64)
                .await
                .unwrap()
                .is_empty()
        );

        sqlx::query("UPDATE reach_tasks SET ended_ms = 5, status = 'SUCCEEDED'")
            .execute(pool)
            .await
            .unwrap();
        sqlx::query("UPDATE reach_webhooks SET lease_owner = 'a'")
            .execute(pool)
            .await
            .unwrap();
        assert!(store.park_webhook("t", "w", "a").await.unwrap());
        let parked = store.webhook("t", "w").await.unwrap().unwrap();
        assert_eq!(parked.next_attempt_ms, WEBHOOK_PARKED_MS);
        assert_eq!(parked.lease_owner, None);
        // Replacing keeps progress and parking; the ended task's webhook stays parked.
        let mut replaced = hook("t", "w");
        replaced.url = "https://example.com/".into();
        let now = stored(store.upsert_webhook(&replaced, 2).await.unwrap());
        assert_eq!(
            (now.delivered_seq, now.next_attempt_ms),
            (3, WEBHOOK_PARKED_MS)
        );
        assert_eq!(now.url, "https://example.com/");
        assert_eq!(store.unpark_webhooks(None).await.unwrap(), 0);
        // A retry: the task runs again with more events.
        sqlx::query("UPDATE reach_tasks SET ended_ms = NULL, status = 'PROCESSING', seq = 4")
            .execute(pool)
            .await
            .unwrap();
        assert_eq!(store.unpark_webhooks(Some("t")).await.unwrap(), 1);
        assert_eq!(
            store
                .claim_webhooks("a", 3000, 4000, 64)
                .await
                .unwrap()
                .len(),
            1
        );

        sqlx::query("UPDATE reach_tasks SET ended_ms = 5, status = 'SUCCEEDED'")
            .execute(pool)
            .await
            .unwrap();
        assert_eq!(store.purge(10).await.unwrap(), 1);
        assert_eq!(store.webhook("t", "w").await.unwrap(), None);
    }

    /// A stored event that no longer decodes is reported as corrupt, naming task and seq.
    #[tokio::test]
    async fn an_undecodable_event_is_corrupt() {
        let store = Store::open("sqlite::memory:", SqliteDurability::Normal)
            .await
            .unwrap();
        let Backend::Sqlite(pool) = &store.backend else {
            unreachable!()
        };
        sqlx::query("INSERT INTO reach_events (task_id, seq, at_ms, kind, node, body) VALUES ('t', 1, 0, 'x', NULL, '{\"kind\":\"from_the_future\"}')")
            .execute(pool)
            .await
            .unwrap();
        let err = store.events("t", 0).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Corrupt);
        assert!(
            err.to_string()
                .starts_with("stored event t#1 cannot be decoded"),
            "{err}"
        );
    }
}
