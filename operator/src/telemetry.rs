//! Logging setup.
//!
//! Why a separate file: controller-rs keeps tracing setup apart so the library stays free of
//! global state; only the binary calls [`init`].

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber: `RUST_LOG` filter (default `info`), JSON when
/// `LOG_FORMAT=json` (for log pipelines), text otherwise.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
