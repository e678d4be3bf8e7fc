//! `/statusz` and `/flagz` on the metrics server, as upstream's z-pages (KEP-4827 statusz,
//! KEP-4828 flagz; beta and on by default in 1.36 behind `ComponentStatusz` and
//! `ComponentFlagz`).
//!
//! Content negotiation follows upstream's handlers: plain text (for people, no format
//! promised) unless the `Accept` header asks for the structured object the KEPs name,
//! `application/json;as=Statusz;v=v1beta1;g=config.k8s.io` (or `as=Flagz`; `v1alpha1` still
//! answers, with upstream's deprecation `Warning` header). An `Accept` that allows neither (a
//! bare `application/json`, another kind or version) gets `406 Not Acceptable`. Upstream's
//! YAML and CBOR forms of the same objects are not served here (406).
//!
//! `statusz` reports this binary: its start, uptime, version (`binaryVersion`), the upstream
//! release it follows (`emulationVersion`) and the metrics server's paths; `goVersion` is
//! empty (no Go here). `flagz` lists every flag the command line accepts, with the value
//! given, or empty when it was not given (upstream shows pflag's default there).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use axum::http::header::{ACCEPT, CONTENT_TYPE, WARNING};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// The structured objects' API group.
pub const GROUP: &str = "config.k8s.io";

/// The header upstream puts on both pages' text.
const TEXT_WARNING: &str = "Warning: This endpoint is not meant to be machine parseable, has no \
                            formatting compatibility guarantees and is for debugging purposes only.";

/// What `/statusz` and `/flagz` report; built once at start-up.
#[derive(Clone, Debug)]
pub struct ZpageInfo {
    /// The component name (`kube-proxy`).
    pub component: String,
    /// When the process started.
    pub started: SystemTime,
    /// This binary's version.
    pub binary_version: String,
    /// The upstream release whose behaviour the binary follows (`1.36`).
    pub emulation_version: String,
    /// The metrics server's paths, for `/statusz`.
    pub paths: Vec<String>,
    /// Every flag by name (without dashes) and the value given, empty when not given.
    pub flags: BTreeMap<String, String>,
    /// Serve `/statusz` (`ComponentStatusz`).
    pub statusz: bool,
    /// Serve `/flagz` (`ComponentFlagz`).
    pub flagz: bool,
}

/// Which form a request gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The plain text for people.
    Text,
    /// The structured object in JSON, at this version (`v1beta1`, `v1alpha1`).
    Json(&'static str),
}

/// The form `accept` allows for the object `kind` (`Statusz`, `Flagz`), or `None` for 406.
/// Media ranges are tried by quality, then in order; no header (or an empty one) is text.
pub fn negotiate(accept: Option<&str>, kind: &str) -> Option<Format> {
    let Some(accept) = accept.filter(|a| !a.trim().is_empty()) else {
        return Some(Format::Text);
    };
    let mut ranges: Vec<(f32, usize, &str)> = accept
        .split(',')
        .enumerate()
        .map(|(i, range)| (quality(range), i, range))
        .filter(|(q, ..)| *q > 0.0)
        .collect();
    ranges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    ranges
        .into_iter()
        .find_map(|(_, _, range)| format_of(range, kind))
}

fn quality(range: &str) -> f32 {
    params(range)
        .find(|(k, _)| *k == "q")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(1.0)
}

fn params(range: &str) -> impl Iterator<Item = (&str, &str)> {
    range
        .split(';')
        .skip(1)
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.trim(), v.trim().trim_matches('"')))
}

/// One media range's form: text for `text/plain`, `text/*` and `*/*` without a kind; JSON
/// for `application/json` naming this kind, the group and a served version.
fn format_of(range: &str, kind: &str) -> Option<Format> {
    let media = range.split(';').next().unwrap_or_default().trim();
    let param = |name: &str| params(range).find(|(k, _)| *k == name).map(|(_, v)| v);
    match media.to_ascii_lowercase().as_str() {
        "text/plain" | "text/*" | "*/*" if param("as").is_none() => Some(Format::Text),
        "application/json" if param("as") == Some(kind) && param("g") == Some(GROUP) => {
            match param("v") {
                Some("v1beta1") => Some(Format::Json("v1beta1")),
                Some("v1alpha1") => Some(Format::Json("v1alpha1")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The answer for `kind` given the request's headers: `text` or `object(version)` in the
/// negotiated form, or 406.
pub fn respond(
    headers: &HeaderMap,
    kind: &str,
    text: impl FnOnce() -> String,
    object: impl FnOnce(&str) -> serde_json::Value,
) -> Response {
    let accept = headers.get(ACCEPT).and_then(|v| v.to_str().ok());
    match negotiate(accept, kind) {
        Some(Format::Text) => (
            [(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            text(),
        )
            .into_response(),
        Some(Format::Json(version)) => {
            let mut response = (
                [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                object(version).to_string(),
            )
                .into_response();
            if version == "v1alpha1" {
                let warning = format!(
                    "299 - \"This version of the {} endpoint is deprecated. Please use a newer \
                     version.\"",
                    kind.to_lowercase()
                );
                if let Ok(value) = HeaderValue::from_str(&warning) {
                    response.headers_mut().insert(WARNING, value);
                }
            }
            response
        }
        None => (
            StatusCode::NOT_ACCEPTABLE,
            format!(
                "only text/plain or application/json;as={kind};v=v1beta1;g={GROUP} is served\n"
            ),
        )
            .into_response(),
    }
}

impl ZpageInfo {
    fn uptime(&self, now: SystemTime) -> Duration {
        now.duration_since(self.started).unwrap_or_default()
    }

    /// `/statusz` as text.
    pub fn statusz_text(&self, now: SystemTime) -> String {
        format!(
            "\n{} statusz\n{TEXT_WARNING}\n\nStarted: {}\nUp: {}s\nBinary version: {}\n\
             Emulation version: {}\nPaths: {}\n",
            self.component,
            crate::health::rfc3339(self.started),
            self.uptime(now).as_secs(),
            self.binary_version,
            self.emulation_version,
            self.paths.join(" "),
        )
    }

    /// `/statusz` as the `Statusz` object of `version`.
    pub fn statusz_object(&self, version: &str, now: SystemTime) -> serde_json::Value {
        json!({
            "kind": "Statusz",
            "apiVersion": format!("{GROUP}/{version}"),
            "metadata": { "name": self.component },
            "startTime": crate::health::rfc3339_seconds(self.started),
            "uptimeSeconds": self.uptime(now).as_secs(),
            "goVersion": "",
            "binaryVersion": self.binary_version,
            "emulationVersion": self.emulation_version,
            "paths": self.paths,
        })
    }

    /// `/flagz` as text: one `name=value` line per flag, sorted.
    pub fn flagz_text(&self) -> String {
        let mut text = format!("\n{} flagz\n{TEXT_WARNING}\n\n", self.component);
        for (name, value) in &self.flags {
            text.push_str(&format!("{name}={value}\n"));
        }
        text
    }

    /// `/flagz` as the `Flagz` object of `version`.
    pub fn flagz_object(&self, version: &str) -> serde_json::Value {
        json!({
            "kind": "Flagz",
            "apiVersion": format!("{GROUP}/{version}"),
            "metadata": { "name": self.component },
            "flags": self.flags,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_unless_the_kep_header_asks_for_json() {
        let statusz = |accept| negotiate(accept, "Statusz");
        assert_eq!(statusz(None), Some(Format::Text));
        assert_eq!(statusz(Some("")), Some(Format::Text));
        assert_eq!(statusz(Some("*/*")), Some(Format::Text));
        assert_eq!(
            statusz(Some("text/plain; charset=utf-8")),
            Some(Format::Text)
        );
        assert_eq!(
            statusz(Some(
                "application/json;as=Statusz;v=v1beta1;g=config.k8s.io"
            )),
            Some(Format::Json("v1beta1"))
        );
        assert_eq!(
            statusz(Some(
                "application/json; g=config.k8s.io; v=v1alpha1; as=Statusz"
            )),
            Some(Format::Json("v1alpha1"))
        );
        // What upstream refuses with 406.
        for refused in [
            "application/json",
            "application/json;as=Flagz;v=v1beta1;g=config.k8s.io",
            "application/json;as=Statusz;v=v2;g=config.k8s.io",
            "application/json;as=Statusz;v=v1beta1;g=other.io",
            "application/yaml;as=Statusz;v=v1beta1;g=config.k8s.io",
            "text/html",
        ] {
            assert_eq!(statusz(Some(refused)), None, "{refused}");
        }
        // Ranges by quality, then order; q=0 excludes.
        assert_eq!(
            statusz(Some(
                "text/plain;q=0.5, application/json;as=Statusz;v=v1beta1;g=config.k8s.io"
            )),
            Some(Format::Json("v1beta1"))
        );
        assert_eq!(
            statusz(Some("application/json, text/plain;q=0.1")),
            Some(Format::Text)
        );
        assert_eq!(statusz(Some("text/plain;q=0")), None);
    }
}
