//! The API's OpenAPI 3.1 description, `GET /openapi.json`: the document is
//! `gateway/openapi.json`, written by hand and compiled in, so the binary serves exactly
//! the file in the repository — with, for each topic that has a data contract (its
//! `schema`), that schema added ([`document_for`]): as the component
//! `TopicValue.<topic>`, in a path of the topic's own (`/v1/topics/<topic>/records`, whose
//! body's `value` is the schema or `null`), and in `BatchRecord` for the records naming the
//! topic. A client generator or schemathesis reading the document sees each topic's
//! contract.
//!
//! The tests below keep it honest: every route the routers declare (read from `app.rs`'s
//! `.route(...)` calls, and each answered by the routers) is a documented path and method
//! and nothing else is; every [`ProblemType`] is in the problem schema of its status and
//! nothing else is; the CORS facts match [`crate::cors`]'s. A route or a problem type added
//! without the document fails them. Whether answers conform to it is checked against a
//! running gateway by `scripts/api-fuzz.sh` (schemathesis).

use std::collections::BTreeSet;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde_json::{json, Value};

use crate::contracts::Contracts;
use crate::state::AppState;

/// The document, as written.
pub const DOCUMENT: &str = include_str!("../openapi.json");

/// The prefix of a topic's schema component: `TopicValue.<topic>`.
pub const TOPIC_VALUE_PREFIX: &str = "TopicValue.";

/// `GET /openapi.json`: the document with the configured topics' schemas, made once.
pub async fn document(State(state): State<AppState>) -> impl IntoResponse {
    let body = state.openapi.get_or_init(|| Bytes::from(document_for(&state.contracts))).clone();
    ([(header::CONTENT_TYPE, "application/json")], body)
}

/// The document served with `contracts`: [`DOCUMENT`] itself when no topic has one.
pub fn document_for(contracts: &Contracts) -> String {
    if contracts.is_empty() {
        return DOCUMENT.to_string();
    }
    let mut doc: Value = serde_json::from_str(DOCUMENT).expect("gateway/openapi.json is JSON");
    let generic = doc["paths"]["/v1/topics/{topic}/records"]["post"].clone();
    let mut operation_ids = BTreeSet::new();
    let mut batch_rules = Vec::new();
    for (topic, contract) in contracts.iter() {
        let name = format!("{TOPIC_VALUE_PREFIX}{topic}");
        let base = format!("#/components/schemas/{name}");
        doc["components"]["schemas"][&name] = embedded(contract.schema(), &base);
        let value = json!({
            "anyOf": [{"$ref": base}, {"type": "null"}],
            "description": format!(
                "A value of topic {topic:?}: it keeps the topic's schema ({}), or is null (a tombstone, not checked); \
                 a value that breaks it is refused with 400 value-invalid", contract.path()),
        });
        let mut operation = generic.clone();
        let mut id = format!("writeRecord_{}", topic.replace(|c: char| !c.is_ascii_alphanumeric(), "_"));
        while !operation_ids.insert(id.clone()) {
            id.push('_');
        }
        operation["operationId"] = json!(id);
        operation["summary"] = json!(format!("Write one record to {topic}"));
        if let Some(parameters) = operation["parameters"].as_array_mut() {
            parameters.retain(|p| p["$ref"] != "#/components/parameters/Topic");
        }
        operation["requestBody"]["content"]["application/json"]["schema"] = json!({
            "allOf": [{"$ref": "#/components/schemas/WriteRequest"}, {"properties": {"value": value}}],
        });
        doc["paths"][format!("/v1/topics/{topic}/records")] = json!({"post": operation});
        batch_rules.push(json!({
            "if": {"properties": {"topic": {"const": topic}}, "required": ["topic"]},
            "then": {"properties": {"value": value}},
        }));
    }
    let batch_record = doc["components"]["schemas"]["BatchRecord"].take();
    batch_rules.insert(0, batch_record);
    doc["components"]["schemas"]["BatchRecord"] = json!({"allOf": batch_rules});
    let mut text = serde_json::to_string_pretty(&doc).expect("a JSON value serializes");
    text.push('\n');
    text
}

/// A topic's schema as a component at `base`: its `$schema` and `$id` dropped (the document
/// is 3.1's dialect, and the component's place is its identity), its local references
/// (`#/$defs/x`, or through its `$id`) made references into the document at `base`.
fn embedded(schema: &Value, base: &str) -> Value {
    let mut schema = schema.clone();
    let id = match &mut schema {
        Value::Object(root) => {
            root.remove("$schema");
            root.remove("$id").and_then(|v| v.as_str().map(|s| s.trim_end_matches('#').to_string()))
        }
        _ => None,
    };
    rebase(&mut schema, base, id.as_deref());
    schema
}

/// Rewrites every local `$ref` under `schema` to point below `base`; values that are data,
/// not schemas (`const`, `enum`, `default`, `examples`), are left as they are.
fn rebase(schema: &mut Value, base: &str, id: Option<&str>) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("const" | "enum" | "default" | "examples", _) => {}
                    ("$ref", Value::String(r)) => {
                        let local = match id {
                            Some(id) if r.starts_with(id) && r[id.len()..].starts_with('#') => Some(&r[id.len()..]),
                            _ => r.starts_with('#').then_some(r.as_str()),
                        };
                        if let Some(fragment) = local {
                            *r = format!("{base}{}", &fragment[1..]);
                        }
                    }
                    (_, v) => rebase(v, base, id),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase(v, base, id)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use axum::Router;
    use serde_json::Value;
    use tower::ServiceExt as _;

    use super::*;
    use crate::problem::{ProblemType, PROBLEM_BASE};
    use crate::state::{offline_config, OFFLINE_FILE};
    use crate::{admin_app, app, AppState};

    fn state() -> AppState {
        let mut config = offline_config(OFFLINE_FILE);
        config.admin_token = Some(crate::settings::AdminToken::new("an-admin-token-of-some-length").unwrap());
        AppState::new(config).unwrap()
    }

    fn doc() -> Value {
        serde_json::from_str(DOCUMENT).expect("gateway/openapi.json is JSON")
    }

    /// `(method, path)` of every `.route("<path>", <method>(...))` in `app.rs` outside its
    /// tests: the routes of both routers, as declared.
    fn declared_routes() -> BTreeSet<(String, String)> {
        // The routers, not the routes app.rs's own tests build.
        let source = include_str!("app.rs").split("#[cfg(test)]").next().unwrap_or_default();
        let mut routes = BTreeSet::new();
        for piece in source.split(".route(\"").skip(1) {
            let (path, rest) = piece.split_once('"').expect("a route's path is a string literal");
            let rest = rest.trim_start_matches(',').trim_start();
            let method: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
            assert!(["get", "post"].contains(&method.as_str()), "route {path}: method {method:?}");
            routes.insert((method, path.to_string()));
        }
        routes
    }

    fn documented_routes() -> BTreeSet<(String, String)> {
        let doc = doc();
        let paths = doc["paths"].as_object().expect("paths");
        let mut routes = BTreeSet::new();
        for (path, item) in paths {
            for method in item.as_object().expect("a path item").keys() {
                if ["get", "post", "put", "delete", "patch", "options", "head"].contains(&method.as_str()) {
                    routes.insert((method.clone(), path.clone()));
                }
            }
        }
        routes
    }

    /// What a router answers to `method path` (parameters filled in), as (status, problem kind).
    async fn answer(router: Router, method: Method, path: &str) -> (StatusCode, String) {
        let uri =
            path.replace("{topic}", "orders").replace("{model}", "shop").replace("{key}", "k").replace("{name}", "q");
        let req = Request::builder().method(method).uri(uri).body(Body::empty()).unwrap();
        let response = router.oneshot(req).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let kind = serde_json::from_slice::<Value>(&bytes).ok().and_then(|v| v["type"].as_str().map(String::from));
        (status, kind.unwrap_or_default())
    }

    #[test]
    fn the_document_is_openapi_3_1() {
        let doc = doc();
        assert_eq!(doc["openapi"], "3.1.0");
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    }

    #[tokio::test]
    async fn every_route_is_documented_and_every_documented_route_is_served() {
        let declared = declared_routes();
        assert!(declared.len() >= 8, "the scan of app.rs found {declared:?}");
        assert_eq!(documented_routes(), declared, "gateway/openapi.json's paths against app.rs's routes");
        // Each path is routed by one of the routers: a method it does not take is 405 there,
        // never the fallback's 404 (no handler runs, so nothing reaches a service).
        for (_, path) in &declared {
            let main = answer(app(state()), Method::DELETE, path).await;
            let admin = answer(admin_app(state()), Method::DELETE, path).await;
            let no_route = format!("{PROBLEM_BASE}no-such-route");
            assert!(main.1 != no_route || admin.1 != no_route, "{path} is not routed: {main:?} {admin:?}");
        }
        // And an undocumented path is not.
        let (status, kind) = answer(app(state()), Method::GET, "/v1/undocumented").await;
        assert_eq!((status, kind), (StatusCode::NOT_FOUND, format!("{PROBLEM_BASE}no-such-route")));
    }

    #[tokio::test]
    async fn the_document_is_served() {
        let req = Request::builder().uri("/openapi.json").body(Body::empty()).unwrap();
        let response = app(state()).oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        assert_eq!(bytes, DOCUMENT.as_bytes());
    }

    /// Every problem type is in `components.schemas.Problem<status>`'s `type` enum of its
    /// status, once; every status schema's `status` is its own.
    #[test]
    fn every_problem_type_is_documented_with_its_status() {
        let doc = doc();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let mut documented: Vec<(String, u16)> = Vec::new();
        for (name, schema) in schemas {
            let Some(status) = name.strip_prefix("Problem").and_then(|s| s.parse::<u16>().ok()) else { continue };
            let own = &schema["allOf"][1]["properties"];
            assert_eq!(own["status"]["const"], status, "{name}");
            for uri in own["type"]["enum"].as_array().unwrap_or_else(|| panic!("{name}: a type enum")) {
                let uri = uri.as_str().unwrap();
                let kind = uri.strip_prefix(PROBLEM_BASE).unwrap_or_else(|| panic!("{name}: {uri}"));
                documented.push((kind.to_string(), status));
            }
        }
        let mut declared: Vec<(String, u16)> =
            ProblemType::ALL.iter().map(|t| (t.kind().to_string(), t.status().as_u16())).collect();
        documented.sort();
        declared.sort();
        assert_eq!(documented, declared, "gateway/openapi.json's problem schemas against ProblemType::ALL");
        // Each status schema is the content of the response of that name.
        for (_, status) in &declared {
            let response = &doc["components"]["responses"][format!("Problem{status}")];
            let schema = &response["content"]["application/problem+json"]["schema"]["$ref"];
            assert_eq!(schema, &format!("#/components/schemas/Problem{status}"), "response Problem{status}");
        }
    }

    /// Every operation's responses, and every `$ref`, resolve.
    #[test]
    fn every_reference_resolves() {
        fn walk(v: &Value, refs: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        refs.push(r.clone());
                    }
                    m.values().for_each(|x| walk(x, refs));
                }
                Value::Array(a) => a.iter().for_each(|x| walk(x, refs)),
                _ => {}
            }
        }
        let doc = doc();
        let mut refs = Vec::new();
        walk(&doc, &mut refs);
        assert!(!refs.is_empty());
        for r in refs {
            let pointer = r.strip_prefix('#').unwrap_or_else(|| panic!("{r}: only local references"));
            assert!(doc.pointer(pointer).is_some(), "{r} does not resolve");
        }
    }

    /// A topic with a contract gets its schema in the document: a component (its local
    /// references rebased into the document), a path of its own, and a rule of
    /// `BatchRecord`'s; every reference still resolves, and topics without a contract get
    /// nothing.
    #[test]
    fn each_topic_s_schema_is_in_the_document() {
        use parsley_settings::config::{Config, ModelConfig, TopicConfig};
        use parsley_settings::contract::Contract;
        let schema = serde_json::json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://example.com/order",
            "type": "object",
            "required": ["order"],
            "properties": {
                "order": {"$ref": "#/$defs/id"},
                "again": {"$ref": "https://example.com/order#/$defs/id"},
                "kind": {"const": {"$ref": "#/not/a/reference"}}
            },
            "$defs": {"id": {"type": "string", "minLength": 1}}
        });
        let mut orders = TopicConfig::named("shop.orders");
        orders.schema = Some("order.json".into());
        orders.contract = Some(Contract::compile("order.json", schema).unwrap());
        let mut config = Config::parse("").unwrap();
        config.models.push(ModelConfig::new("m", vec![orders, TopicConfig::named("payments")]));
        config.validate().unwrap();
        let doc: Value = serde_json::from_str(&document_for(&Contracts::of(&config))).unwrap();

        let component = &doc["components"]["schemas"]["TopicValue.shop.orders"];
        assert_eq!(component["properties"]["order"]["$ref"], "#/components/schemas/TopicValue.shop.orders/$defs/id");
        assert_eq!(component["properties"]["again"]["$ref"], "#/components/schemas/TopicValue.shop.orders/$defs/id");
        assert_eq!(component["properties"]["kind"]["const"]["$ref"], "#/not/a/reference", "data is not rebased");
        assert!(component.get("$schema").is_none() && component.get("$id").is_none());
        let operation = &doc["paths"]["/v1/topics/shop.orders/records"]["post"];
        assert_eq!(operation["operationId"], "writeRecord_shop_orders");
        let body = &operation["requestBody"]["content"]["application/json"]["schema"]["allOf"];
        assert_eq!(body[0]["$ref"], "#/components/schemas/WriteRequest");
        assert_eq!(body[1]["properties"]["value"]["anyOf"][0]["$ref"], "#/components/schemas/TopicValue.shop.orders");
        assert!(operation["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["$ref"] != "#/components/parameters/Topic"));
        assert!(doc["paths"].get("/v1/topics/payments/records").is_none());
        let batch = &doc["components"]["schemas"]["BatchRecord"]["allOf"];
        assert_eq!(batch[0]["required"], serde_json::json!(["topic", "key", "value"]));
        assert_eq!(batch[1]["if"]["properties"]["topic"]["const"], "shop.orders");
        // The generic path is still there, and every reference resolves.
        assert!(doc["paths"]["/v1/topics/{topic}/records"]["post"].is_object());
        let mut refs = Vec::new();
        collect_refs(&doc, &mut refs);
        for r in refs.iter().filter(|r| *r != "#/not/a/reference") {
            assert!(doc.pointer(&r[1..]).is_some(), "{r} does not resolve");
        }
        // Without contracts, the file as written.
        assert_eq!(document_for(&Contracts::default()), DOCUMENT);
    }

    fn collect_refs(v: &Value, refs: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    refs.push(r.clone());
                }
                m.values().for_each(|x| collect_refs(x, refs));
            }
            Value::Array(a) => a.iter().for_each(|x| collect_refs(x, refs)),
            _ => {}
        }
    }

    /// The CORS facts the document states are the middleware's.
    #[test]
    fn the_cors_facts_are_the_middleware_s() {
        let doc = doc();
        let cors = &doc["x-parsley-cors"];
        assert_eq!(cors["allow_methods"], crate::cors::ALLOWED_METHODS);
        assert_eq!(cors["expose_headers"], crate::cors::EXPOSED_HEADERS);
        assert_eq!(cors["max_age_s"], crate::cors::PREFLIGHT_MAX_AGE_S);
        let headers: Vec<&str> =
            cors["allow_headers"].as_array().unwrap().iter().map(|h| h.as_str().unwrap()).collect();
        assert_eq!(headers, crate::cors::ALLOWED_HEADERS);
    }
}
