//! A small blocking client for the admin HTTP API: used by `ringmqctl` and by the tests.

use serde_json::Value;
use std::time::Duration;

/// What a call answered: the status and the body (JSON when the body is JSON, else a string;
/// `Null` when empty).
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// Body.
    pub body: Value,
    /// The `Location` header, if any.
    pub location: Option<String>,
}

impl Answer {
    /// The `reason` of an API error, else the body as text.
    pub fn reason(&self) -> String {
        match self.body.get("reason").and_then(Value::as_str) {
            Some(r) => r.to_owned(),
            None => self.body.to_string(),
        }
    }
}

/// An admin API endpoint with credentials.
pub struct AdminClient {
    base: String,
    auth: Option<String>,
    agent: ureq::Agent,
}

/// URL-encodes one path segment (a vhost `/` becomes `%2F`).
pub fn seg(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

impl AdminClient {
    /// A client for `base` (`http://127.0.0.1:15672`), with basic auth when `user` is set.
    pub fn new(base: &str, user: Option<&str>, password: Option<&str>) -> Self {
        use base64::Engine;
        let auth = user.map(|u| {
            let raw = format!("{u}:{}", password.unwrap_or(""));
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            )
        });
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Self {
            base: base.trim_end_matches('/').to_owned(),
            auth,
            agent,
        }
    }

    /// Sends `method path` (path starts with `/`, segments already encoded) with an optional
    /// JSON body. `Err` only when the server could not be reached or answered garbage.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Answer, String> {
        let url = format!("{}{path}", self.base);
        let mut req = ureq::http::Request::builder().method(method).uri(&url);
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        let text = body.map(Value::to_string).unwrap_or_default();
        if body.is_some() {
            req = req.header("Content-Type", "application/json");
        }
        let req = req
            .body(text)
            .map_err(|e| format!("bad request for {url}: {e}"))?;
        let mut resp = self
            .agent
            .run(req)
            .map_err(|e| format!("cannot reach the admin API at {}: {e}", self.base))?;
        let status = resp.status().as_u16();
        let location = resp
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let raw = resp
            .body_mut()
            .with_config()
            .limit(64 * 1024 * 1024)
            .read_to_string()
            .map_err(|e| format!("reading the answer from {url}: {e}"))?;
        let body = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&raw).unwrap_or(Value::String(raw))
        };
        Ok(Answer {
            status,
            body,
            location,
        })
    }

    /// GET.
    pub fn get(&self, path: &str) -> Result<Answer, String> {
        self.call("GET", path, None)
    }
}
