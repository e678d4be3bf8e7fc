//! `/debug/explain` on the metrics listener: the `kube-proxy explain` answer for the running
//! proxy's current state. Off unless the binary hands [`crate::serve_metrics`] an
//! [`Explainer`] (`--debug-explain`); without one the path is a plain 404.
//!
//! `GET /debug/explain?dest=IP[:PORT][/PROTO][&from=SRC][&format=text|json]`. The query is
//! checked here (a bad one is a 400 saying what is wrong and what is expected); the answer
//! itself comes from the [`Explainer`], which runs on Tokio's blocking pool: explaining walks
//! every service port, and the admin runtime must stay free for `/healthz` and `/metrics`.

use kp_core::report::ErrorChain as _;
use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::header::{ACCEPT, CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kp_rules::explain::{Destination, Query as ExplainQuery};
use serde::Deserialize;

use crate::json_response;

/// The path served.
pub const EXPLAIN_PATH: &str = "/debug/explain";

/// What every 400 ends with, so a caller learns the expected form.
const USAGE: &str =
    "usage: /debug/explain?dest=IP[:PORT][/tcp|udp|sctp][&from=SRC_IP][&format=text|json]";

/// One answer in both renderings (the same as `kube-proxy explain` and `-o json` print).
#[derive(Clone, Debug, PartialEq)]
pub struct Explained {
    /// The readable tree.
    pub text: String,
    /// The explanation as JSON.
    pub json: serde_json::Value,
}

/// Why a query got no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExplainFailure {
    /// The query cannot be answered as asked (e.g. source and destination of different IP
    /// families): 400.
    #[error("{0}")]
    BadQuery(String),
    /// No answer now (e.g. before the first sync): 503; asking later may work.
    #[error("{0}")]
    Unavailable(String),
}

/// Answers explain queries from the proxy's current state. Called on a blocking thread, so it
/// may take as long as a walk over every service takes, but must not wait for a sync.
pub trait Explainer: Send + Sync + 'static {
    /// The answer for `query`.
    fn explain(&self, query: &ExplainQuery) -> Result<Explained, ExplainFailure>;
}

/// The query string. Every field is optional here so that a missing one gets our message.
#[derive(Debug, Deserialize)]
pub(crate) struct Params {
    dest: Option<String>,
    from: Option<String>,
    format: Option<String>,
}

/// Response format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Text,
    Json,
}

fn bad_request(message: impl std::fmt::Display) -> Response {
    (
        StatusCode::BAD_REQUEST,
        [
            (
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            ),
            (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        ],
        format!("{message}\n{USAGE}\n"),
    )
        .into_response()
}

/// Parses and checks the query: the explain query and the format, or what is wrong with it.
fn parse(
    params: Result<Query<Params>, QueryRejection>,
    headers: &HeaderMap,
) -> Result<(ExplainQuery, Format), String> {
    let Query(params) = params.map_err(|rejection| format!("bad query string: {rejection}"))?;
    let dest = params
        .dest
        .as_deref()
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .ok_or_else(|| "missing dest".to_owned())?;
    let destination: Destination = dest
        .parse()
        .map_err(|error| format!("bad dest {dest:?}: {error}"))?;
    let source = match params.from.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(from) => Some(
            from.parse::<IpAddr>()
                .map_err(|error| format!("bad from {from:?}: {error} (an IP address)"))?,
        ),
    };
    let format = match params.format.as_deref() {
        Some("json") => Format::Json,
        Some("text") => Format::Text,
        Some(other) => return Err(format!("bad format {other:?}: text or json")),
        None => {
            let wants_json = headers
                .get_all(ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/json"));
            if wants_json {
                Format::Json
            } else {
                Format::Text
            }
        }
    };
    Ok((
        ExplainQuery {
            destination,
            source,
        },
        format,
    ))
}

pub(crate) async fn handler(
    State(explainer): State<Arc<dyn Explainer>>,
    headers: HeaderMap,
    params: Result<Query<Params>, QueryRejection>,
) -> Response {
    let (query, format) = match parse(params, &headers) {
        Ok(parsed) => parsed,
        Err(message) => return bad_request(message),
    };
    let answer = tokio::task::spawn_blocking(move || explainer.explain(&query)).await;
    match answer {
        Ok(Ok(explained)) => match format {
            Format::Json => json_response(StatusCode::OK, &explained.json),
            Format::Text => (
                [
                    (
                        CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; charset=utf-8"),
                    ),
                    (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
                ],
                explained.text,
            )
                .into_response(),
        },
        Ok(Err(ExplainFailure::BadQuery(message))) => bad_request(message),
        Ok(Err(ExplainFailure::Unavailable(message))) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{message}\n")).into_response()
        }
        Err(error) => {
            tracing::error!(error = %error.chain(), "explain failed");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    //! The query string is outside input: any query, percent-encoded bytes included, is
    //! either taken or refused with a message, never a panic.

    use axum::http::Uri;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;

    /// Percent-encodes every byte outside unreserved characters.
    fn encode(text: &str) -> String {
        text.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("10.96.0.10:80/tcp".to_owned()),
            Just("[fd00::1]:53/udp".to_owned()),
            Just("10.96.0.10:65536".to_owned()),
            Just("::ffff:1.2.3.4".to_owned()),
            Just("json".to_owned()),
            Just(String::new()),
            any::<String>(),
        ]
    }

    #[test]
    fn any_query_is_parsed_or_refused_with_a_message() {
        let key = prop_oneof![
            Just("dest"),
            Just("from"),
            Just("format"),
            Just("other"),
            Just("")
        ];
        let strategy = (
            proptest::collection::vec((key, value(), any::<bool>()), 0..5),
            proptest::option::of("[ -~]{0,40}"),
        );
        let mut runner = TestRunner::new(Config {
            cases: 512,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&strategy, |(pairs, raw)| {
                let query = match raw {
                    // Raw printable text, as a client might send it unencoded.
                    Some(raw) => raw.replace([' ', '#'], "+"),
                    None => pairs
                        .iter()
                        .map(|(k, v, encoded)| {
                            if *encoded {
                                format!("{k}={}", encode(v))
                            } else {
                                format!("{k}={}", v.replace(['&', '#', ' '], ""))
                            }
                        })
                        .collect::<Vec<_>>()
                        .join("&"),
                };
                let Ok(uri) = format!("/debug/explain?{query}").parse::<Uri>() else {
                    return Ok(());
                };
                let params = Query::<Params>::try_from_uri(&uri);
                match parse(params, &HeaderMap::new()) {
                    Ok((parsed, _)) => {
                        // A taken query names a real destination port (or none).
                        prop_assert!(parsed.destination.port != Some(0));
                        prop_assert!(query.contains("dest="));
                    }
                    Err(message) => prop_assert!(!message.trim().is_empty()),
                }
                Ok(())
            })
            .unwrap_or_else(|failure| panic!("{failure}"));
    }
}
