//! Reach's example agents, triaging real consumer complaints (CFPB student-loan complaints,
//! public domain; see `examples/data/README.md`).
//!
//! The roles follow the original design: an *ingest* (gateway) turns each CSV row into a
//! message; a *coordinator* classifies the narrative and dispatches it by capability, or
//! marks it for human review when unsure; *executors* return a structured handling
//! suggestion.
//!
//! # Layout
//! - [`catalog`] — what the fleet declares of its capabilities at registration (descriptions
//!   and schemas of `examples/protocol-registry.yaml`, compiled in).
//! - [`complaint`] — the CSV record and its loader.
//! - [`classifier`] — the deterministic weighted-term classifier and the `Issue` → category
//!   mapping used to score it.
//! - [`extract`] — key fields from the text (company, state, dollar amounts).
//! - [`executor`] — the executor handler (`complaint.<category>` capabilities).
//! - [`model_classifier`] — the model-backed classifier: one forced tool call
//!   (`complaint.set_category`) whose arguments are read leniently and repaired.
//! - [`decision`] — model or rules: [`decision::ComplaintClassifier`] falls back to the rules
//!   when the model fails, and [`decision::Provenance`] records which one decided.
//! - [`model_config`] — the `[agents.model]` settings (endpoint, model, key variable).
//! - [`coordinator`] — the coordinator handlers (`complaint.triage`, `complaint.classify`).
//! - [`ingest`] — sends complaints through the mesh and collects the outcomes.
//! - [`fleet`] — starts the whole example fleet on ephemeral ports.
//! - [`report`] — the complaint report's data work (read a CSV, aggregate, write Markdown),
//!   inside a workspace directory a model cannot leave.
//! - [`report_agent`] — the report agent's tools (`report.read_csv`, `report.aggregate`,
//!   `report.write_report`) and its scripted analyst.
//! - [`typed`] — the triage agent's own typed gRPC API (`examples.complaints.v1.TriageService`),
//!   reached through the router by typed pass-through.

pub mod catalog;
pub mod classifier;
pub mod complaint;
pub mod coordinator;
pub mod decision;
pub mod executor;
pub mod extract;
pub mod fleet;
pub mod ingest;
pub mod model_classifier;
pub mod model_config;
pub mod report;
pub mod report_agent;
pub mod typed;

/// The message type of a complaint as submitted to the coordinator.
pub const COMPLAINT_SUBMITTED: &str = "complaint.submitted";
/// The message type of a classification.
pub const COMPLAINT_CLASSIFICATION: &str = "complaint.classification";
/// The message type of an executor's handling suggestion.
pub const COMPLAINT_SUGGESTION: &str = "complaint.suggestion";
/// The message type of the coordinator's triage result.
pub const COMPLAINT_TRIAGE: &str = "complaint.triage_result";
