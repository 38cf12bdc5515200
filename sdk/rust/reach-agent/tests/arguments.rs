//! Malformed tool arguments, as models write them: each is read, repaired and validated, or
//! refused naming the JSON pointer of every bad field — none becomes `{}`. And tool schemas
//! generated from Rust types.

use reach_agent::repair::{ArgumentSchema, RepairKind};
use reach_agent::tool::{Tool, ToolContext, ToolRegistry, schema_for};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

fn booking_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["city", "nights"],
        "properties": {
            "city": {"type": "string", "minLength": 1},
            "nights": {"type": "integer", "minimum": 1},
            "breakfast": {"type": "boolean", "default": false},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "date": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email"}
        }
    })
}

fn all_of_schema() -> Value {
    json!({
        "allOf": [
            {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}},
            {"properties": {"b": {"type": "string", "default": "x"}}}
        ]
    })
}

enum Expect {
    /// Repaired (or valid as read) into this value.
    Ok(Value),
    /// Refused with exactly these pointers.
    Refused(&'static [&'static str]),
}

#[test]
fn malformed_arguments_are_repaired_or_refused_with_pointers() {
    let booking = ArgumentSchema::new(booking_schema()).unwrap();
    let all_of = ArgumentSchema::new(all_of_schema()).unwrap();
    let paris = |extra: Value| {
        let mut v = json!({"city": "Paris", "nights": 2, "breakfast": false});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let cases: Vec<(&str, &ArgumentSchema, &str, Expect)> = vec![
        (
            "strict json",
            &booking,
            r#"{"city": "Paris", "nights": 2}"#,
            Expect::Ok(paris(json!({}))),
        ),
        (
            "trailing commas",
            &booking,
            r#"{"city": "Paris", "nights": 2,}"#,
            Expect::Ok(paris(json!({}))),
        ),
        (
            "code fence",
            &booking,
            "```json\n{\"city\": \"Paris\", \"nights\": 2}\n```",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "prose around the object",
            &booking,
            "Sure! Here are the arguments: {\"city\": \"Paris\", \"nights\": 2} Let me know if {you} need more.",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "single quotes",
            &booking,
            "{'city': 'Paris', 'nights': 2}",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "unquoted keys",
            &booking,
            "{city: \"Paris\", nights: 2}",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "comments",
            &booking,
            "{ // where\n \"city\": \"Paris\", /* how long */ \"nights\": 2 }",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "python literals",
            &booking,
            "{'city': 'Paris', 'nights': 2, 'breakfast': True}",
            Expect::Ok(paris(json!({"breakfast": true}))),
        ),
        (
            "python literal inside a string is kept",
            &booking,
            "{'city': 'None Town', 'nights': 2, 'breakfast': False}",
            Expect::Ok(json!({"city": "None Town", "nights": 2, "breakfast": false})),
        ),
        (
            "yaml",
            &booking,
            "city: Paris\nnights: 2",
            Expect::Ok(paris(json!({}))),
        ),
        (
            "double-encoded json string",
            &booking,
            r#""{\"city\": \"Paris\", \"nights\": 2}""#,
            Expect::Ok(paris(json!({}))),
        ),
        (
            "empty string",
            &booking,
            "",
            Expect::Refused(&["/city", "/nights"]),
        ),
        (
            "whitespace only",
            &booking,
            "  \n\t ",
            Expect::Refused(&["/city", "/nights"]),
        ),
        (
            "a bare ? for a required field",
            &booking,
            r#"{"city": ?, "nights": 2}"#,
            Expect::Refused(&["/city"]),
        ),
        (
            "two objects",
            &booking,
            r#"{"city": "Paris", "nights": 2} {"city": "Lyon", "nights": 3}"#,
            Expect::Refused(&[""]),
        ),
        (
            "truncated json",
            &booking,
            r#"{"city": "Paris", "nights": "#,
            Expect::Refused(&[""]),
        ),
        (
            "prose without an object",
            &booking,
            "I think Paris, for two nights",
            Expect::Refused(&[""]),
        ),
        (
            "array where an object is required",
            &booking,
            r#"[{"city": "Paris", "nights": 2}]"#,
            Expect::Refused(&[""]),
        ),
        (
            "integer as a string",
            &booking,
            r#"{"city": "Paris", "nights": "3"}"#,
            Expect::Ok(paris(json!({"nights": 3}))),
        ),
        (
            "3.0 for an integer",
            &booking,
            r#"{"city": "Paris", "nights": 3.0}"#,
            Expect::Ok(paris(json!({"nights": 3}))),
        ),
        (
            "boolean as a string",
            &booking,
            r#"{"city": "Paris", "nights": 2, "breakfast": "TRUE"}"#,
            Expect::Ok(paris(json!({"breakfast": true}))),
        ),
        (
            "wrong enum case",
            &booking,
            r#"{"city": "Paris", "nights": 2, "unit": "CELSIUS"}"#,
            Expect::Ok(paris(json!({"unit": "celsius"}))),
        ),
        (
            "enum with whitespace and case",
            &booking,
            r#"{"city": "Paris", "nights": 2, "unit": " Fahrenheit "}"#,
            Expect::Ok(paris(json!({"unit": "fahrenheit"}))),
        ),
        (
            "unknown enum value",
            &booking,
            r#"{"city": "Paris", "nights": 2, "unit": "kelvin"}"#,
            Expect::Refused(&["/unit"]),
        ),
        (
            "number where a string is required",
            &booking,
            r#"{"city": 75001, "nights": 2}"#,
            Expect::Ok(json!({"city": "75001", "nights": 2, "breakfast": false})),
        ),
        (
            "unrepairable wrong type",
            &booking,
            r#"{"city": "Paris", "nights": "two"}"#,
            Expect::Refused(&["/nights"]),
        ),
        (
            "missing required field",
            &booking,
            r#"{"city": "Paris"}"#,
            Expect::Refused(&["/nights"]),
        ),
        (
            "extra field with additionalProperties false",
            &booking,
            r#"{"city": "Paris", "nights": 2, "pets": 1}"#,
            Expect::Refused(&["/pets"]),
        ),
        (
            "format date violated",
            &booking,
            r#"{"city": "Paris", "nights": 2, "date": "tomorrow"}"#,
            Expect::Refused(&["/date"]),
        ),
        (
            "format date with spaces",
            &booking,
            r#"{"city": "Paris", "nights": 2, "date": " 2026-12-24 "}"#,
            Expect::Ok(paris(json!({"date": "2026-12-24"}))),
        ),
        (
            "format email violated",
            &booking,
            r#"{"city": "Paris", "nights": 2, "email": "not-an-email"}"#,
            Expect::Refused(&["/email"]),
        ),
        (
            "minimum violated",
            &booking,
            r#"{"city": "Paris", "nights": 0}"#,
            Expect::Refused(&["/nights"]),
        ),
        (
            "several bad fields at once",
            &booking,
            r#"{"nights": "two", "pets": 1}"#,
            Expect::Refused(&["/city", "/nights", "/pets"]),
        ),
        (
            "allOf repaired and defaulted",
            &all_of,
            r#"{"a": "5"}"#,
            Expect::Ok(json!({"a": 5, "b": "x"})),
        ),
        (
            "allOf missing required",
            &all_of,
            r#"{"b": "y"}"#,
            Expect::Refused(&["/a"]),
        ),
    ];
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for (name, schema, text, expect) in cases {
        let outcome = schema.prepare(text);
        match (&outcome, &expect) {
            (Ok(prepared), Expect::Ok(value)) => {
                if &prepared.value != value {
                    failures.push(format!("{name}: got {} want {value}", prepared.value));
                }
                let strict = serde_json::from_str::<Value>(text).ok() == Some(value.clone());
                if !strict && prepared.repairs.is_empty() {
                    failures.push(format!("{name}: repaired without recording a repair"));
                }
            }
            (Err(error), Expect::Refused(pointers)) => {
                let mut got: Vec<&str> = error
                    .violations
                    .iter()
                    .map(|v| v.pointer.as_str())
                    .collect();
                got.sort_unstable();
                got.dedup();
                let mut want = pointers.to_vec();
                want.sort_unstable();
                if got != want {
                    failures.push(format!(
                        "{name}: refused at {got:?}, want {want:?}: {error}"
                    ));
                }
                if error.violations.iter().any(|v| v.expected.is_empty()) {
                    failures.push(format!("{name}: a violation says nothing"));
                }
            }
            (Ok(prepared), Expect::Refused(_)) => {
                failures.push(format!("{name}: accepted as {}", prepared.value));
            }
            (Err(error), Expect::Ok(_)) => failures.push(format!("{name}: refused: {error}")),
        }
        if let Ok(prepared) = &outcome {
            assert_ne!(prepared.value, json!({}), "{name} became {{}}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn repairs_say_what_changed_where() {
    let schema = ArgumentSchema::new(booking_schema()).unwrap();
    let prepared = schema
        .prepare("{'city': 'Paris', 'nights': '3', 'unit': 'Celsius'}")
        .unwrap();
    let kinds: Vec<(&str, RepairKind)> = prepared
        .repairs
        .iter()
        .map(|r| (r.pointer.as_str(), r.kind))
        .collect();
    assert!(kinds.contains(&("", RepairKind::LenientParse)), "{kinds:?}");
    assert!(
        kinds.contains(&("/breakfast", RepairKind::DefaultFilled)),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("/nights", RepairKind::StringToInteger)),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("/unit", RepairKind::EnumCase)),
        "{kinds:?}"
    );
    let nights = prepared
        .repairs
        .iter()
        .find(|r| r.pointer == "/nights")
        .unwrap();
    assert_eq!(
        (nights.from.clone(), nights.to.clone()),
        (json!("3"), json!(3))
    );
    // The message for the model names each field and what it must be.
    let error = schema
        .prepare(r#"{"city": "Paris", "nights": "two"}"#)
        .unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("/nights") && text.contains("integer"),
        "{text}"
    );
}

#[test]
fn empty_arguments_are_an_object_only_when_nothing_is_required() {
    let optional = ArgumentSchema::new(json!({
        "type": "object",
        "properties": {"verbose": {"type": "boolean"}}
    }))
    .unwrap();
    assert!(optional.allows_empty());
    let prepared = optional.prepare("  ").unwrap();
    assert_eq!(prepared.value, json!({}));
    assert_eq!(prepared.repairs[0].kind, RepairKind::EmptyArguments);
    let required = ArgumentSchema::new(booking_schema()).unwrap();
    assert!(!required.allows_empty());
    assert!(required.prepare("").is_err());
}

// === schemas from types ===

/// How urgent a ticket is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum Priority {
    /// Whenever.
    #[default]
    Low,
    /// Today.
    High,
}

/// A postal address.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Address {
    /// Street and number.
    street: String,
    /// The postcode, when known.
    postcode: Option<String>,
}

/// Arguments of `ticket.create`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct CreateTicket {
    /// A one-line summary of the problem.
    title: String,
    /// Where the customer lives.
    address: Address,
    /// How urgent it is.
    #[serde(default)]
    priority: Priority,
    /// Free-form labels.
    #[serde(default)]
    labels: Vec<String>,
    /// How many follow-ups to schedule.
    #[serde(default = "three")]
    follow_ups: u32,
    /// The customer's reference, if they gave one.
    reference: Option<u64>,
}

fn three() -> u32 {
    3
}

/// The created ticket.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Ticket {
    /// Its id.
    id: String,
    /// Its priority.
    priority: Priority,
    /// How many follow-ups were scheduled.
    follow_ups: u32,
}

fn ticket_tool() -> Tool {
    Tool::from_fn::<CreateTicket, Ticket, _, _>(
        "ticket.create",
        "Opens a support ticket.",
        |args: CreateTicket, _ctx: ToolContext| async move {
            Ok(Ticket {
                id: format!("T-{}", args.title.len()),
                priority: args.priority,
                follow_ups: args.follow_ups,
            })
        },
    )
    .unwrap()
    .with_usage(
        "the customer reports a problem that needs follow-up",
        "the question can be answered at once",
    )
}

#[test]
fn schemas_come_from_nested_optional_enum_and_defaulted_types() {
    let schema = schema_for::<CreateTicket>();
    let props = &schema["properties"];
    let required: Vec<&str> = schema["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        required.contains(&"title") && required.contains(&"address"),
        "{schema:#}"
    );
    for optional in ["priority", "labels", "follow_ups", "reference"] {
        assert!(
            !required.contains(&optional),
            "{optional} must be optional: {schema:#}"
        );
    }
    assert_eq!(schema["additionalProperties"], json!(false));
    assert_eq!(
        props["title"]["description"],
        json!("A one-line summary of the problem.")
    );
    // Nested struct, inlined, with its own optional field.
    let address = &props["address"];
    assert_eq!(
        address["properties"]["street"]["type"],
        json!("string"),
        "{schema:#}"
    );
    assert!(
        address["properties"]["postcode"]["type"]
            .as_array()
            .is_some_and(|t| t.contains(&json!("null"))),
        "{address:#}"
    );
    // Enum values and defaults.
    let priority = &props["priority"];
    let values = priority
        .get("enum")
        .or_else(|| priority.pointer("/oneOf"))
        .cloned()
        .unwrap_or_default();
    assert!(
        values.to_string().contains("low") && values.to_string().contains("high"),
        "{priority:#}"
    );
    assert_eq!(priority["default"], json!("low"), "{priority:#}");
    assert_eq!(props["follow_ups"]["default"], json!(3));
    assert_eq!(props["labels"]["type"], json!("array"));
    assert_eq!(props["labels"]["items"]["type"], json!("string"));

    let tool = ticket_tool();
    assert!(tool.output_schema().unwrap()["properties"]["id"].is_object());
    assert!(
        tool.description().contains("Use it when:")
            && tool.description().contains("Do not use it when:")
    );
    let tools = ToolRegistry::new().with(tool).unwrap().openai_tools();
    let function = &tools[0]["function"];
    assert_eq!(tools[0]["type"], json!("function"));
    assert_eq!(function["name"], json!("ticket__create"));
    assert!(function["parameters"].get("$schema").is_none());
    assert_eq!(function["parameters"]["type"], json!("object"));
}

#[tokio::test]
async fn a_typed_tool_gets_repaired_arguments_with_defaults() {
    let tool = ticket_tool();
    let result = tool
        .call(
            "{'title': 'no heating', 'address': {'street': '1 Main St'}, 'priority': 'HIGH', reference: None}",
            ToolContext::default(),
        )
        .await;
    assert!(result.is_ok(), "{result:?}");
    let data = result.data.clone().unwrap();
    assert_eq!(data["priority"], json!("high"));
    assert_eq!(data["follow_ups"], json!(3));
    assert!(!result.metadata.repairs.is_empty());
    // Unrepairable: the nested field's pointer is named.
    let result = tool
        .call(
            r#"{"title": "x", "address": {"street": 5, "floor": 2}}"#,
            ToolContext::default(),
        )
        .await;
    let error = result.error.unwrap();
    let pointers: Vec<&str> = error
        .violations
        .iter()
        .map(|v| v.pointer.as_str())
        .collect();
    assert_eq!(pointers, ["/address/floor"], "{error:?}");
}

#[tokio::test]
async fn output_that_is_not_json_safe_is_refused() {
    #[derive(Deserialize, JsonSchema)]
    struct NoArgs {}
    #[derive(Serialize, JsonSchema)]
    struct Ratio {
        value: f64,
    }
    let tool = Tool::from_fn::<NoArgs, Ratio, _, _>(
        "ratio",
        "A ratio.",
        |_args: NoArgs, _ctx: ToolContext| async move { Ok(Ratio { value: f64::NAN }) },
    )
    .unwrap();
    let result = tool.call("", ToolContext::default()).await;
    let error = result.error.expect("NaN refused");
    assert!(
        error.message.contains("/value") && error.message.contains("non-finite"),
        "{error:?}"
    );
}

/// A huge bad value is not echoed back whole: the model gets the pointer and a cut message.
#[test]
fn a_huge_bad_value_is_not_echoed_back_whole() {
    let schema = ArgumentSchema::new(json!({
        "type": "object",
        "required": ["n"],
        "properties": {"n": {"type": "integer"}}
    }))
    .unwrap();
    let huge = "x".repeat(30_000);
    let refused = schema
        .prepare(&json!({ "n": huge }).to_string())
        .unwrap_err();
    assert_eq!(refused.violations[0].pointer, "/n");
    let rendered = refused.to_string();
    assert!(rendered.len() < 1_000, "{} bytes", rendered.len());
}

#[test]
fn a_schema_that_refuses_what_it_means_is_refused_and_violations_name_the_schema_keyword() {
    // additionalProperties: false inside an allOf branch refuses the other branch's property.
    let trap = json!({"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false},
        {"properties": {"b": {"type": "string"}}}
    ]});
    let refused = ArgumentSchema::new(trap).unwrap_err().to_string();
    assert!(
        refused.contains("/allOf/0/additionalProperties")
            && refused.contains("unevaluatedProperties"),
        "{refused}"
    );
    let schema = ArgumentSchema::new(json!({
        "type": "object",
        "allOf": [{"required": ["city"], "properties": {"city": {"type": "string"}}}],
        "properties": {"nights": {"type": "integer", "minimum": 1}},
        "unevaluatedProperties": false
    }))
    .unwrap();
    let invalid = schema
        .prepare(r#"{"city": "Paris", "nights": 0}"#)
        .unwrap_err();
    assert_eq!(invalid.violations[0].pointer, "/nights");
    assert_eq!(
        invalid.violations[0].schema_path,
        "/properties/nights/minimum"
    );
}
