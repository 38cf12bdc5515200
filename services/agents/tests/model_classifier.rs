//! The coordinator's classifier with a model, against a local server speaking the OpenAI
//! chat-completions wire format: repaired arguments are used and recorded; arguments that
//! cannot be repaired, a reply without the tool call, and a server failing on every attempt
//! fall back to the rules; the output says which classifier decided.

mod support;

use std::sync::Arc;
use std::time::Duration;

use reach_agent::repair::RepairKind;
use reach_agent::{ModelConfig, OpenAiProvider, ScriptedProvider, Step};
use reach_agents::classifier::{Category, classify};
use reach_agents::coordinator::ClassifyOutput;
use reach_agents::decision::{ClassifierKind, ComplaintClassifier, Decision};
use reach_agents::model_classifier::ModelClassifier;
use reach_agents::model_config::ModelSettings;
use reach_sdk::ModelSlots;
use serde_json::{Value, json};
use support::openai_server::{
    FakeOpenAi, error_body, narrative, text_completion, tool_call_completion,
};

const FUNCTION: &str = "complaint__set_category";
/// The rules call this servicing; the fake model says credit_report.
const LATE_FEE: &str = "My autopay was misapplied and they charged a late fee";

fn classifier_for(server: &FakeOpenAi) -> ComplaintClassifier {
    let mut config = ModelConfig::new(&server.url, "fake-model");
    config.max_retries = 1;
    config.initial_backoff = Duration::from_millis(1);
    config.max_backoff = Duration::from_millis(2);
    config.timeout = Duration::from_secs(10);
    let provider = OpenAiProvider::new(config).unwrap();
    ComplaintClassifier::with_model(ModelClassifier::new(Arc::new(provider)))
}

async fn decide(classifier: &ComplaintClassifier, narrative: &str) -> Decision {
    classifier
        .classify(narrative, None, &ModelSlots::default())
        .await
}

/// The server answers with a tool call carrying `arguments`, whatever the request.
async fn answering(arguments: &'static str) -> FakeOpenAi {
    FakeOpenAi::start(move |_| (200, tool_call_completion(FUNCTION, arguments))).await
}

#[tokio::test]
async fn a_wrong_case_padded_category_is_repaired_used_and_recorded() {
    let server = answering(
        r#"{"category": "CREDIT_REPORT ", "confidence": 0.85, "reason": "a tradeline dispute"}"#,
    )
    .await;
    let classifier = classifier_for(&server);
    let decision = decide(&classifier, LATE_FEE).await;
    assert_eq!(decision.classification.category, Category::CreditReport);
    assert_eq!(decision.classification.confidence, 0.85);
    let provenance = &decision.provenance;
    assert_eq!(provenance.classifier, ClassifierKind::Model);
    assert_eq!(provenance.model.as_deref(), Some("fake-model"));
    assert_eq!(provenance.reason.as_deref(), Some("a tradeline dispute"));
    assert_eq!(provenance.fallback, None);
    let repair = provenance
        .repairs
        .iter()
        .find(|r| r.pointer == "/category")
        .expect("the category was repaired");
    assert!(matches!(
        repair.kind,
        RepairKind::EnumCase | RepairKind::Trimmed
    ));
    assert_eq!(repair.to, json!("credit_report"));

    // The request offered one tool, its category an enum, and forced it.
    let body = &server.requests()[0];
    assert_eq!(body["model"], "fake-model");
    assert_eq!(
        body["tool_choice"],
        json!({"type": "function", "function": {"name": FUNCTION}})
    );
    let tools = body["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 1);
    assert_eq!(
        tools[0]["function"]["parameters"]["properties"]["category"]["enum"],
        json!(["servicing", "repayment", "credit_report", "origination"])
    );
    assert_eq!(narrative(body), LATE_FEE);

    // The coordinator's output keeps its fields and says who decided.
    let output = serde_json::to_value(ClassifyOutput::of(decision)).unwrap();
    assert_eq!(output["category"], "credit_report");
    assert_eq!(output["capability"], "complaint.credit_report");
    assert_eq!(output["confidence"], 0.85);
    assert_eq!(output["classifier"], "model");
    assert_eq!(output["model"], "fake-model");
    assert_eq!(output["repairs"][0]["pointer"], "/category");
}

#[tokio::test]
async fn sloppy_argument_text_is_read_leniently() {
    let server =
        answering("Sure! {category: 'Repayment', confidence: '0.7', reason: 'PSLF denied',}").await;
    let decision = decide(&classifier_for(&server), LATE_FEE).await;
    assert_eq!(decision.provenance.classifier, ClassifierKind::Model);
    assert_eq!(decision.classification.category, Category::Repayment);
    assert_eq!(decision.classification.confidence, 0.7);
    let kinds: Vec<RepairKind> = decision.provenance.repairs.iter().map(|r| r.kind).collect();
    assert!(kinds.contains(&RepairKind::LenientParse), "{kinds:?}");
    assert!(kinds.contains(&RepairKind::StringToNumber), "{kinds:?}");
}

#[tokio::test]
async fn a_category_outside_the_enum_falls_back_to_the_rules() {
    for arguments in [
        r#"{"category": "student_loans", "confidence": 0.9, "reason": "x"}"#,
        r#"{"category": "servicing", "confidence": 1.7, "reason": "too sure"}"#,
        r#"{"category": "servicing", "reason": "no confidence"}"#,
        "not arguments at all",
    ] {
        let server = answering(arguments).await;
        let decision = decide(&classifier_for(&server), LATE_FEE).await;
        let rules = classify(LATE_FEE);
        assert_eq!(decision.classification, rules, "{arguments}");
        let provenance = &decision.provenance;
        assert_eq!(provenance.classifier, ClassifierKind::Rules, "{arguments}");
        assert_eq!(provenance.fallback.as_deref(), Some("invalid_arguments"));
        assert_eq!(provenance.model.as_deref(), Some("fake-model"));
        let output = serde_json::to_value(ClassifyOutput::of(decision)).unwrap();
        assert_eq!(output["classifier"], "rules");
        assert_eq!(output["fallback"], "invalid_arguments");
        assert_eq!(output["category"], "servicing");
    }
}

#[tokio::test]
async fn a_reply_without_the_tool_call_falls_back_to_the_rules() {
    let server = FakeOpenAi::start(|_| (200, text_completion("It is about servicing."))).await;
    let decision = decide(&classifier_for(&server), LATE_FEE).await;
    assert_eq!(decision.provenance.classifier, ClassifierKind::Rules);
    assert_eq!(
        decision.provenance.fallback.as_deref(),
        Some("no_tool_call")
    );
}

#[tokio::test]
async fn a_server_failing_every_attempt_falls_back_after_the_retries() {
    let server = FakeOpenAi::start(|_| (500, error_body("the model is overloaded"))).await;
    let decision = decide(&classifier_for(&server), LATE_FEE).await;
    assert_eq!(decision.classification, classify(LATE_FEE));
    assert_eq!(decision.provenance.classifier, ClassifierKind::Rules);
    assert_eq!(
        decision.provenance.fallback.as_deref(),
        Some("model_unavailable")
    );
    assert_eq!(
        server.requests().len(),
        2,
        "the first attempt and one retry"
    );
}

#[tokio::test]
async fn answers_follow_the_narrative() {
    // Deterministic by keyword, as the end-to-end test's server answers.
    let server = FakeOpenAi::start(|body: &Value| {
        let category = if narrative(body).contains("PSLF") {
            "repayment"
        } else {
            "origination"
        };
        let arguments = json!({"category": category, "confidence": 0.9, "reason": "keyword"});
        (200, tool_call_completion(FUNCTION, &arguments.to_string()))
    })
    .await;
    let classifier = classifier_for(&server);
    let pslf = decide(&classifier, "My PSLF forgiveness was denied").await;
    let other = decide(&classifier, LATE_FEE).await;
    assert_eq!(pslf.classification.category, Category::Repayment);
    assert_eq!(other.classification.category, Category::Origination);
    assert!(pslf.provenance.repairs.is_empty());
}

#[tokio::test]
async fn a_scripted_provider_and_the_rules_alone_work_too() {
    let model = ScriptedProvider::new([Step::tool_call(
        "complaint.set_category",
        r#"{"category": "origination", "confidence": 0.6, "reason": "sales pressure"}"#,
    )])
    .with_model("scripted-model");
    let classifier = ComplaintClassifier::with_model(ModelClassifier::new(model.shared()));
    let decision = decide(&classifier, "the recruiter pressured me").await;
    assert_eq!(decision.classification.category, Category::Origination);
    assert_eq!(decision.provenance.model.as_deref(), Some("scripted-model"));

    let rules = decide(&ComplaintClassifier::rules(), LATE_FEE).await;
    assert_eq!(rules.classification, classify(LATE_FEE));
    assert_eq!(rules.provenance, Default::default());
}

#[tokio::test]
async fn settings_build_the_classifier_only_with_a_base_url() {
    let none = ModelSettings::default().classifier(|_| None).unwrap();
    assert_eq!(none.model(), None);
    let server = answering(r#"{"category": "servicing", "confidence": 0.9, "reason": "x"}"#).await;
    let settings = ModelSettings {
        base_url: server.url.clone(),
        model: "fake-model".into(),
        api_key_env: "FAKE_KEY".into(),
        ..ModelSettings::default()
    };
    let error = settings.classifier(|_| None).unwrap_err().to_string();
    assert!(error.contains("FAKE_KEY"), "{error}");
    let classifier = settings
        .classifier(|name| (name == "FAKE_KEY").then(|| "sk-test".into()))
        .unwrap();
    let decision = decide(&classifier, LATE_FEE).await;
    assert_eq!(decision.provenance.classifier, ClassifierKind::Model);
}

/// A model that never answers.
struct Silent;

impl reach_agent::ModelProvider for Silent {
    fn provider_name(&self) -> &str {
        "silent"
    }

    fn model(&self) -> &str {
        "silent-model"
    }

    fn chat(
        &self,
        _request: reach_agent::ChatRequest,
    ) -> futures::future::BoxFuture<'_, Result<reach_agent::ChatResponse, reach_agent::ModelError>>
    {
        Box::pin(futures::future::pending())
    }
}

#[tokio::test(start_paused = true)]
async fn a_model_that_outlives_the_deadline_leaves_the_rules_time_to_decide() {
    let classifier = ComplaintClassifier::with_model(ModelClassifier::new(Arc::new(Silent)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let decision = classifier
        .classify(LATE_FEE, Some(deadline), &ModelSlots::default())
        .await;
    assert!(
        tokio::time::Instant::now() < deadline,
        "decided before the caller's deadline"
    );
    assert_eq!(decision.classification, classify(LATE_FEE));
    assert_eq!(decision.provenance.fallback.as_deref(), Some("deadline"));
    assert_eq!(decision.provenance.model.as_deref(), Some("silent-model"));
}
