//! What a test needs from the machine beyond Rust — a Python package, root and network
//! tools — checked before the test starts, so that a missing one fails the test with what
//! to install instead of letting it pass without having run. `scripts/test` (the README's
//! test command) installs all of it.

use std::process::Command;

/// The variable naming the Python interpreter the tests run; `scripts/test` points it at the
/// python3 of its venv, which has tests/clients/requirements.txt installed.
pub const PYTHON_ENV: &str = "RINGMQ_PYTHON";

/// The variable that, set to 1 (any value but empty or 0), skips the tests that need root
/// (network namespaces) with a line saying so, for a developer without root. `.ci/run`
/// unsets it.
pub const SKIP_ROOT_TESTS_ENV: &str = "RINGMQ_SKIP_ROOT_TESTS";

/// The Python interpreter to run: `$RINGMQ_PYTHON`, else `python3` from PATH.
pub fn python() -> String {
    std::env::var(PYTHON_ENV)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// [`python()`], after checking that it can import `module` (from the PyPI package
/// `package`); panics naming what is missing and how to install it.
pub fn python_with(module: &str, package: &str) -> String {
    let python = python();
    let which = if std::env::var_os(PYTHON_ENV).is_some_and(|p| !p.is_empty()) {
        format!("`{python}` (from {PYTHON_ENV})")
    } else {
        format!("`{python}` ({PYTHON_ENV} is not set)")
    };
    let out = Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "this test needs Python with {package}, but {which} does not run ({e}): run the \
                 tests with `scripts/test`, which makes a venv with it and sets {PYTHON_ENV}, or \
                 point {PYTHON_ENV} at a python3 that has it"
            )
        });
    assert!(
        out.status.success(),
        "this test needs the Python package {package}, which {which} cannot import: run the \
         tests with `scripts/test`, which installs it into a venv and sets {PYTHON_ENV}, or \
         `{python} -m pip install {package}` (see tests/clients/requirements.txt)\n{}",
        String::from_utf8_lossy(&out.stderr).trim_end()
    );
    python
}

/// Whether a test that needs root and the commands `tools` (command, Debian package) runs:
/// true as root with every tool present. Panics when not root, or when a tool is missing,
/// naming what to do — unless `RINGMQ_SKIP_ROOT_TESTS=1`, which skips the test (returns
/// false) with a line on stderr.
pub fn root_with(test: &str, tools: &[(&str, &str)]) -> bool {
    if std::env::var(SKIP_ROOT_TESTS_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
        eprintln!("{test}: skipped because {SKIP_ROOT_TESTS_ENV} is set");
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert!(
        uid == 0,
        "{test} needs root (it creates network namespaces), and runs as uid {uid}: run it as \
         root (`sudo -E scripts/test`), or set {SKIP_ROOT_TESTS_ENV}=1 to skip it"
    );
    let missing: Vec<(&str, &str)> = tools
        .iter()
        .copied()
        .filter(|(tool, _)| {
            !Command::new(tool)
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    assert!(
        missing.is_empty(),
        "{test} needs {}: `apt-get install {}` (scripts/test installs them when run as root), \
         or set {SKIP_ROOT_TESTS_ENV}=1 to skip it",
        missing
            .iter()
            .map(|(tool, _)| format!("`{tool}`"))
            .collect::<Vec<_>>()
            .join(" and "),
        missing
            .iter()
            .map(|(_, package)| *package)
            .collect::<Vec<_>>()
            .join(" ")
    );
    true
}
