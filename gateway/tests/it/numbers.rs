//! Numbers keep every digit on the real stack: a document holding a number beyond `f64`
//! reads back with all its digits by key, in a collection page and through a named query,
//! and a named query summing two `1e308` values (past `f64`'s range) answers `200` with the
//! exact `numeric` sum, never `500`.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use parsley_gateway::SESSION_HEADER;
use parsley_settings::config::{Config, ParamType, QueryConfig};
use tower::ServiceExt as _;

use crate::support::*;

/// More digits than an `f64` holds (it would read back as `1.2345678901234568e+28`).
const BIG: &str = "12345678901234567890123456789";

/// One answer's status, body as sent, and token.
async fn raw(router: &Router, method: Method, uri: &str, token: Option<&str>, body: Option<&str>) -> Raw {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(SESSION_HEADER, t);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b.to_string())
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let token = response.headers().get(SESSION_HEADER).map(|v| v.to_str().unwrap().to_string());
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.unwrap();
    Raw { status, body: String::from_utf8(bytes.to_vec()).unwrap(), token }
}

struct Raw {
    status: StatusCode,
    body: String,
    token: Option<String>,
}

impl Raw {
    fn token(&self) -> String {
        self.token.clone().unwrap_or_else(|| panic!("no token in {} {}", self.status, self.body))
    }
}

/// The model's queries: a document's `n`, and the sum of the `n` of every `big-` document.
fn with_queries(n: &Names, c: &mut Config) {
    let m = &n.model;
    let q = |name: &str, sql: String, params: &[(&str, ParamType)], key: Option<&str>| QueryConfig {
        name: name.to_string(),
        sql,
        params: params.iter().map(|(p, t)| (p.to_string(), *t)).collect(),
        key: key.map(String::from),
        max_rows: 10,
        ..QueryConfig::new(name, "", Default::default())
    };
    c.models[0].queries = vec![
        q(
            "n",
            format!("SELECT doc->'n' AS n FROM projection.documents WHERE model = '{m}' AND key = :id"),
            &[("id", ParamType::Text)],
            Some("id"),
        ),
        q(
            "total",
            format!(
                "SELECT sum((doc->>'n')::numeric) AS total FROM projection.documents
                 WHERE model = '{m}' AND key LIKE 'big-%'"
            ),
            &[],
            None,
        ),
    ];
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numbers_keep_every_digit_by_key_in_pages_and_through_named_queries() {
    let mut s =
        Stack::with_config("numbers", 2, "read_wait_ms = 20000\nresponse_timeout_ms = 30000", with_queries).await;
    s.start_projector().await;
    let (m, orders) = (s.names.model.clone(), s.names.orders.clone());
    let write = |key: &str, value: &str, token: Option<String>| {
        let body = format!(r#"{{"key":"{key}","value":{value}}}"#);
        let (router, uri) = (s.router.clone(), format!("/v1/topics/{orders}/records"));
        async move { raw(&router, Method::POST, &uri, token.as_deref(), Some(&body)).await }
    };

    // Two values at f64's limit: their sum is past it, and `numeric` holds it exactly.
    let mut token: Option<String> = None;
    for key in ["big-1", "big-2"] {
        let w = write(key, r#"{"n":1e308}"#, token).await;
        assert_eq!(w.status, StatusCode::CREATED, "{}", w.body);
        token = Some(w.token());
    }
    let total = raw(&s.router, Method::GET, &format!("/v1/models/{m}/queries/total"), token.as_deref(), None).await;
    assert_eq!(total.status, StatusCode::OK, "{}", total.body);
    let exact = format!("2{}", "0".repeat(308));
    assert_eq!(total.body, format!(r#"{{"rows":[{{"total": {exact}}}],"truncated":false}}"#));
    let one = raw(&s.router, Method::GET, &format!("/v1/models/{m}/documents/big-1"), Some(&total.token()), None).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.body);
    assert!(one.body.contains(&format!("1{}", "0".repeat(308))), "{}", one.body);

    let w = write("k", &format!(r#"{{"n":{BIG}}}"#), Some(one.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.body);
    let one = raw(&s.router, Method::GET, &format!("/v1/models/{m}/documents/k"), Some(&w.token()), None).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.body);
    assert!(one.body.contains(BIG), "every digit by key: {}", one.body);
    let page = raw(&s.router, Method::GET, &format!("/v1/models/{m}/documents"), Some(&one.token()), None).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains(BIG), "every digit in a page: {}", page.body);
    let n = raw(&s.router, Method::GET, &format!("/v1/models/{m}/queries/n?id=k"), Some(&page.token()), None).await;
    assert_eq!(n.status, StatusCode::OK, "{}", n.body);
    assert!(n.body.contains(BIG), "every digit through a named query: {}", n.body);
    let parsed: serde_json::Value = serde_json::from_str(&n.body).unwrap();
    assert_eq!(parsed["truncated"], false, "{}", n.body);
}
