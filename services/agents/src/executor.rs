//! The executor: turns a classified complaint into a structured handling suggestion.
//! One executor service per category (`executor.<category>`), serving capability
//! `complaint.<category>`.

use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::HandlerContext;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::classifier::Category;
use crate::extract::{KeyFields, extract};

/// The complaint fields an executor reads (a data part).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ComplaintInput {
    /// The complaint id.
    pub complaint_id: String,
    /// The narrative.
    pub narrative: String,
    /// The company on record ("" when unknown).
    #[serde(default)]
    pub company: String,
    /// The state on record ("" when unknown).
    #[serde(default)]
    pub state: String,
}

/// How urgent a complaint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Routine handling.
    Normal,
    /// Harm under way (delinquency, credit damage): handle ahead of routine work.
    High,
    /// Severe or imminent harm (garnishment, default, identity theft, large sums).
    Urgent,
}

/// An executor's handling suggestion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Suggestion {
    /// The complaint id.
    pub complaint_id: String,
    /// The category handled.
    pub category: Category,
    /// The department that should own it.
    pub department: String,
    /// How urgent it is.
    pub priority: Priority,
    /// What to do next, in order.
    pub next_steps: Vec<String>,
    /// Fields extracted from the complaint.
    pub fields: KeyFields,
    /// The instance that produced the suggestion.
    pub handled_by: String,
}

const URGENT_TERMS: &[&str] = &[
    "garnish",
    "default",
    "identity theft",
    "lawsuit",
    "offset",
    "collections agency",
    "treasury offset",
];
const HIGH_TERMS: &[&str] = &[
    "delinquen",
    "credit score",
    "late fee",
    "collection",
    "denied",
    "past due",
    "derogatory",
];
/// Sums above this many US dollars raise priority to urgent.
const URGENT_AMOUNT_USD: f64 = 50_000.0;

/// Builds the suggestion for a complaint of `category`.
pub fn suggest(category: Category, input: &ComplaintInput, handled_by: &str) -> Suggestion {
    let fields = extract(&input.narrative, &input.company, &input.state);
    let text = input.narrative.to_lowercase();
    let priority = if URGENT_TERMS.iter().any(|t| text.contains(t))
        || fields
            .max_amount_usd
            .is_some_and(|a| a >= URGENT_AMOUNT_USD)
    {
        Priority::Urgent
    } else if HIGH_TERMS.iter().any(|t| text.contains(t)) {
        Priority::High
    } else {
        Priority::Normal
    };
    let company = fields
        .company
        .clone()
        .unwrap_or_else(|| "the servicer".into());
    let (department, next_steps) = match category {
        Category::Servicing => (
            "Loan Servicing Operations",
            vec![
                format!("pull the payment history and account notes from {company}"),
                "verify every payment was applied and credited on its due date".to_string(),
                "correct misapplied payments, fees or interest, and send the borrower a written account statement".to_string(),
            ],
        ),
        Category::Repayment => (
            "Repayment and Forgiveness",
            vec![
                "check eligibility for income-driven repayment, forbearance, deferment and forgiveness programs".to_string(),
                format!("request the qualifying-payment count and plan history from {company}"),
                "send the borrower the options with deadlines, and pause collection while the review is open".to_string(),
            ],
        ),
        Category::CreditReport => (
            "Credit Reporting Disputes",
            vec![
                "open an FCRA dispute: the furnisher must investigate within 30 days".to_string(),
                format!("compare {company}'s reported status, balance and dates with the servicing record"),
                "send corrections to every consumer reporting agency that received the tradeline".to_string(),
            ],
        ),
        Category::Origination => (
            "Lending and Origination",
            vec![
                "collect the application, disclosures and signed agreement".to_string(),
                "review the sales contact for misleading or high-pressure practices".to_string(),
                "assess rescission, refund or borrower-defense options".to_string(),
            ],
        ),
    };
    Suggestion {
        complaint_id: input.complaint_id.clone(),
        category,
        department: department.to_string(),
        priority,
        next_steps,
        fields,
        handled_by: handled_by.to_string(),
    }
}

/// Parses the complaint from a message's first data part: either the complaint's fields at
/// the top level (`{complaint_id, narrative, ...}`, as the coordinator sends) or under
/// `complaint` (`{complaint: {...}, classification: {...}}`, as `complaint-flow` sends).
///
/// # Errors
/// INVALID_ARGUMENT naming what is missing.
pub fn read_input(message: &ReachMessage) -> Result<ComplaintInput, Status> {
    let mut data = message
        .payload
        .as_ref()
        .and_then(Payload::first_json)
        .ok_or_else(|| {
            Status::invalid_argument(
                "the payload needs a data part with complaint_id and narrative",
            )
        })?;
    if let Some(inner) = data.get_mut("complaint").filter(|c| c.is_object()) {
        data = inner.take();
    }
    serde_json::from_value(data).map_err(|e| {
        Status::invalid_argument(format!(
            "the complaint data part is malformed: {e}; send {{\"complaint_id\": \"...\", \"narrative\": \"...\"}}"
        ))
    })
}

/// The executor handler for `category`.
pub async fn handle(
    category: Category,
    ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let input = read_input(&message)?;
    let suggestion = suggest(category, &input, &ctx.instance_id);
    let value = serde_json::to_value(&suggestion).map_err(|e| Status::internal(e.to_string()))?;
    Ok(Payload::json(crate::COMPLAINT_SUGGESTION, &value))
}
