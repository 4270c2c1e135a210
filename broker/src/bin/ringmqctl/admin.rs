//! The admin commands of `ringmqctl`: thin calls to the broker's admin HTTP API (see
//! `docs/admin-api.md`) printed as tables for people or JSON for scripts.

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use ringmq::admin_client::{AdminClient, Answer, seg};
use serde_json::{Value, json};

/// Where the admin API is and who calls it.
#[derive(Debug, Args)]
pub struct Conn {
    /// Admin API base URL.
    #[arg(
        long,
        global = true,
        env = "RINGMQ_ADMIN_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    pub admin: String,
    /// User for HTTP basic auth.
    #[arg(
        long,
        global = true,
        env = "RINGMQ_ADMIN_USER",
        default_value = "guest"
    )]
    pub user: String,
    /// Password for HTTP basic auth.
    #[arg(
        long,
        global = true,
        env = "RINGMQ_ADMIN_PASSWORD",
        default_value = "guest",
        hide_env_values = true
    )]
    pub password: String,
    /// Print JSON (the API's answer) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// Object kinds `list` shows.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ListKind {
    /// Queues with depth and consumers.
    Queues,
    /// Exchanges.
    Exchanges,
    /// Bindings.
    Bindings,
    /// Open AMQP connections.
    Connections,
    /// Open channels.
    Channels,
    /// Users (never their passwords).
    Users,
    /// Virtual hosts.
    Vhosts,
    /// Permissions.
    Permissions,
}

/// `list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// What to list.
    pub kind: ListKind,
    /// Only this vhost (queues, exchanges, bindings).
    #[arg(long)]
    pub vhost: Option<String>,
}

/// `declare`.
#[derive(Debug, Subcommand)]
pub enum Declare {
    /// A queue.
    Queue {
        /// Name.
        name: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Survives a restart.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        durable: bool,
        /// Deleted when its last consumer goes.
        #[arg(long)]
        auto_delete: bool,
        /// Arguments as a JSON object, e.g. '{"x-max-length": 1000}'.
        #[arg(long)]
        arguments: Option<String>,
    },
    /// An exchange.
    Exchange {
        /// Name.
        name: String,
        /// direct, fanout, topic or headers.
        #[arg(long = "type")]
        kind: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Survives a restart.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        durable: bool,
        /// Deleted when its last binding goes.
        #[arg(long)]
        auto_delete: bool,
        /// Clients may not publish to it.
        #[arg(long)]
        internal: bool,
        /// Arguments as a JSON object.
        #[arg(long)]
        arguments: Option<String>,
    },
    /// A binding from an exchange to a queue or exchange.
    Binding {
        /// Source exchange.
        #[arg(long)]
        source: String,
        /// Destination queue or exchange.
        #[arg(long)]
        destination: String,
        /// queue or exchange.
        #[arg(long, default_value = "queue")]
        destination_type: DestType,
        /// Routing (binding) key.
        #[arg(long, default_value = "")]
        routing_key: String,
        /// Arguments as a JSON object.
        #[arg(long)]
        arguments: Option<String>,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
    },
    /// A virtual host (you get full permissions on it).
    Vhost {
        /// Name.
        name: String,
    },
    /// A user (or a new password or tags for one).
    User {
        /// Name.
        name: String,
        /// The user's password (kept as is when omitted for an existing user). Named so that
        /// it does not clash with the global `--password` of the caller.
        #[arg(long)]
        new_password: Option<String>,
        /// Comma-separated tags: administrator, monitoring.
        #[arg(long, default_value = "")]
        tags: String,
    },
    /// A user's permission on a vhost.
    Permission {
        /// User.
        #[arg(long = "for-user")]
        for_user: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Configure regex.
        #[arg(long, default_value = ".*")]
        configure: String,
        /// Write regex.
        #[arg(long, default_value = ".*")]
        write: String,
        /// Read regex.
        #[arg(long, default_value = ".*")]
        read: String,
    },
}

/// Where a binding leads.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DestType {
    /// A queue.
    Queue,
    /// An exchange.
    Exchange,
}

impl DestType {
    fn letter(self) -> &'static str {
        match self {
            DestType::Queue => "q",
            DestType::Exchange => "e",
        }
    }
}

/// `delete`.
#[derive(Debug, Subcommand)]
pub enum Delete {
    /// A queue.
    Queue {
        /// Name.
        name: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Only if it has no consumers.
        #[arg(long)]
        if_unused: bool,
        /// Only if it holds no ready messages.
        #[arg(long)]
        if_empty: bool,
    },
    /// An exchange.
    Exchange {
        /// Name.
        name: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Only if it has no bindings.
        #[arg(long)]
        if_unused: bool,
    },
    /// A binding, named by its routing key (no arguments) or its properties key.
    Binding {
        /// Source exchange.
        #[arg(long)]
        source: String,
        /// Destination queue or exchange.
        #[arg(long)]
        destination: String,
        /// queue or exchange.
        #[arg(long, default_value = "queue")]
        destination_type: DestType,
        /// Routing key of a binding without arguments.
        #[arg(long, default_value = "")]
        routing_key: String,
        /// Properties key (from `list bindings`), for a binding with arguments.
        #[arg(long)]
        properties_key: Option<String>,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
    },
    /// A virtual host and everything in it.
    Vhost {
        /// Name.
        name: String,
    },
    /// A user (its connections are closed).
    User {
        /// Name.
        name: String,
    },
    /// A user's permission on a vhost.
    Permission {
        /// User.
        #[arg(long = "for-user")]
        for_user: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
    },
}

/// `purge`.
#[derive(Debug, Subcommand)]
pub enum Purge {
    /// Removes a queue's ready messages.
    Queue {
        /// Name.
        name: String,
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
    },
}

/// `close`.
#[derive(Debug, Subcommand)]
pub enum Close {
    /// Closes a client connection with 320 CONNECTION_FORCED.
    Connection {
        /// Its name from `list connections` (or its id).
        name: String,
        /// Reason given to the client.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `definitions`.
#[derive(Debug, Subcommand)]
pub enum Definitions {
    /// Writes users, vhosts, permissions, queues, exchanges and bindings as JSON.
    Export {
        /// File to write; standard output when omitted or `-`.
        file: Option<std::path::PathBuf>,
    },
    /// Loads a definitions file (ringmq's or RabbitMQ's export).
    Import {
        /// File to read (`-` for standard input).
        file: std::path::PathBuf,
    },
}

pub(crate) fn client(c: &Conn) -> AdminClient {
    AdminClient::new(&c.admin, Some(&c.user), Some(&c.password))
}

/// Calls the API; an error status becomes an error with the API's reason.
pub(crate) fn send(
    c: &AdminClient,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<Answer> {
    let a = c.call(method, path, body).map_err(anyhow::Error::msg)?;
    if a.status >= 400 {
        let error = a
            .body
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("error");
        bail!("{} {error}: {}", a.status, a.reason());
    }
    Ok(a)
}

fn parse_args(text: &Option<String>) -> anyhow::Result<Value> {
    match text {
        None => Ok(json!({})),
        Some(t) => {
            let v: Value = serde_json::from_str(t).context("--arguments is not JSON")?;
            if !v.is_object() {
                bail!("--arguments must be a JSON object such as '{{\"x-max-length\": 10}}'");
            }
            Ok(v)
        }
    }
}

/// Prints the outcome of a change: `created`/`ok` for people, `{"status": N}` for scripts.
fn done(conn: &Conn, a: &Answer, what: &str) {
    if conn.json {
        println!("{}", json!({"status": a.status, "result": a.body}));
    } else {
        let verb = match a.status {
            201 => "created",
            202 => "accepted",
            _ => "ok",
        };
        println!("{what}: {verb}");
    }
}

/// `status`.
pub fn status(conn: &Conn) -> anyhow::Result<()> {
    let c = client(conn);
    let ov = send(&c, "GET", "/api/overview", None)?.body;
    if conn.json {
        println!("{ov}");
        return Ok(());
    }
    println!("node:           {}", ov["node"].as_str().unwrap_or("?"));
    println!(
        "cluster:        {}",
        ov["cluster_name"].as_str().unwrap_or("?")
    );
    println!(
        "version:        {}",
        ov["ringmq_version"].as_str().unwrap_or("?")
    );
    let mut rows = Vec::new();
    for m in ov["members"].as_array().into_iter().flatten() {
        rows.push(cells(m, &["id", "amqp", "admin", "zone", "state"]));
    }
    println!();
    table(&["member", "amqp", "admin", "zone", "state"], &rows);
    println!();
    for (section, v) in [
        ("objects", &ov["object_totals"]),
        ("queued", &ov["queue_totals"]),
        ("messages", &ov["message_totals"]),
        ("memory", &ov["memory"]),
    ] {
        if let Some(m) = v.as_object() {
            let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k}={}", show(v))).collect();
            println!("{section:<15} {}", parts.join(" "));
        }
    }
    println!("{:<15} {}", "disk free", show(&ov["disk_free_bytes"]));
    println!("{:<15} {}", "blocked", show(&ov["blocked_publishers"]));
    Ok(())
}

/// `list`.
pub fn list(conn: &Conn, args: &ListArgs) -> anyhow::Result<()> {
    let scoped = |base: &str| match &args.vhost {
        Some(v) => format!("/api/{base}/{}", seg(v)),
        None => format!("/api/{base}"),
    };
    let (path, cols): (String, &[&str]) = match args.kind {
        ListKind::Queues => (
            scoped("queues"),
            &[
                "vhost",
                "name",
                "durable",
                "messages_ready",
                "messages_unacknowledged",
                "consumers",
            ],
        ),
        ListKind::Exchanges => (
            scoped("exchanges"),
            &[
                "vhost",
                "name",
                "type",
                "durable",
                "auto_delete",
                "internal",
            ],
        ),
        ListKind::Bindings => (
            scoped("bindings"),
            &[
                "vhost",
                "source",
                "destination",
                "destination_type",
                "routing_key",
                "properties_key",
            ],
        ),
        ListKind::Connections => (
            "/api/connections".into(),
            &["name", "user", "vhost", "channels"],
        ),
        ListKind::Channels => (
            "/api/channels".into(),
            &[
                "name",
                "user",
                "vhost",
                "consumer_count",
                "messages_unacknowledged",
                "prefetch_count",
            ],
        ),
        ListKind::Users => ("/api/users".into(), &["name", "tags"]),
        ListKind::Vhosts => ("/api/vhosts".into(), &["name", "queues", "messages"]),
        ListKind::Permissions => (
            "/api/permissions".into(),
            &["user", "vhost", "configure", "write", "read"],
        ),
    };
    let body = send(&client(conn), "GET", &path, None)?.body;
    if conn.json {
        println!("{body}");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = body
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| cells(x, cols))
        .collect();
    table(cols, &rows);
    Ok(())
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Array(a) => a.iter().map(show).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

pub(crate) fn cells(v: &Value, cols: &[&str]) -> Vec<String> {
    cols.iter()
        .map(|c| {
            let s = show(&v[*c]);
            if s.is_empty() { "\"\"".into() } else { s }
        })
        .collect()
}

pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

/// `declare`.
pub fn declare(conn: &Conn, d: &Declare) -> anyhow::Result<()> {
    let c = client(conn);
    let (path, body, what) = match d {
        Declare::Queue {
            name,
            vhost,
            durable,
            auto_delete,
            arguments,
        } => (
            format!("/api/queues/{}/{}", seg(vhost), seg(name)),
            json!({"durable": durable, "auto_delete": auto_delete, "arguments": parse_args(arguments)?}),
            format!("queue {name}"),
        ),
        Declare::Exchange {
            name,
            kind,
            vhost,
            durable,
            auto_delete,
            internal,
            arguments,
        } => (
            format!("/api/exchanges/{}/{}", seg(vhost), seg(name)),
            json!({"type": kind, "durable": durable, "auto_delete": auto_delete,
                   "internal": internal, "arguments": parse_args(arguments)?}),
            format!("exchange {name}"),
        ),
        Declare::Binding {
            source,
            destination,
            destination_type,
            routing_key,
            arguments,
            vhost,
        } => {
            let path = format!(
                "/api/bindings/{}/e/{}/{}/{}",
                seg(vhost),
                seg(source),
                destination_type.letter(),
                seg(destination)
            );
            let body = json!({"routing_key": routing_key, "arguments": parse_args(arguments)?});
            let a = send(&c, "POST", &path, Some(&body))?;
            done(conn, &a, &format!("binding {source} -> {destination}"));
            return Ok(());
        }
        Declare::Vhost { name } => (
            format!("/api/vhosts/{}", seg(name)),
            json!({}),
            format!("vhost {name}"),
        ),
        Declare::User {
            name,
            new_password,
            tags,
        } => {
            let mut body = json!({"tags": tags});
            if let Some(p) = new_password {
                body["password"] = json!(p);
            }
            (
                format!("/api/users/{}", seg(name)),
                body,
                format!("user {name}"),
            )
        }
        Declare::Permission {
            for_user,
            vhost,
            configure,
            write,
            read,
        } => (
            format!("/api/permissions/{}/{}", seg(vhost), seg(for_user)),
            json!({"configure": configure, "write": write, "read": read}),
            format!("permission of {for_user} on {vhost}"),
        ),
    };
    let a = send(&c, "PUT", &path, Some(&body))?;
    done(conn, &a, &what);
    Ok(())
}

/// `delete`.
pub fn delete(conn: &Conn, d: &Delete) -> anyhow::Result<()> {
    let c = client(conn);
    let (path, what) = match d {
        Delete::Queue {
            name,
            vhost,
            if_unused,
            if_empty,
        } => (
            format!(
                "/api/queues/{}/{}?if-unused={if_unused}&if-empty={if_empty}",
                seg(vhost),
                seg(name)
            ),
            format!("queue {name}"),
        ),
        Delete::Exchange {
            name,
            vhost,
            if_unused,
        } => (
            format!(
                "/api/exchanges/{}/{}?if-unused={if_unused}",
                seg(vhost),
                seg(name)
            ),
            format!("exchange {name}"),
        ),
        Delete::Binding {
            source,
            destination,
            destination_type,
            routing_key,
            properties_key,
            vhost,
        } => {
            let key = match properties_key {
                Some(k) => k.clone(),
                None if routing_key.is_empty() => "~".into(),
                None => routing_key.clone(),
            };
            (
                format!(
                    "/api/bindings/{}/e/{}/{}/{}/{}",
                    seg(vhost),
                    seg(source),
                    destination_type.letter(),
                    seg(destination),
                    seg(&key)
                ),
                format!("binding {source} -> {destination}"),
            )
        }
        Delete::Vhost { name } => (
            format!("/api/vhosts/{}", seg(name)),
            format!("vhost {name}"),
        ),
        Delete::User { name } => (format!("/api/users/{}", seg(name)), format!("user {name}")),
        Delete::Permission { for_user, vhost } => (
            format!("/api/permissions/{}/{}", seg(vhost), seg(for_user)),
            format!("permission of {for_user} on {vhost}"),
        ),
    };
    let a = send(&c, "DELETE", &path, None)?;
    done(conn, &a, &what);
    Ok(())
}

/// `purge`.
pub fn purge(conn: &Conn, p: &Purge) -> anyhow::Result<()> {
    let Purge::Queue { name, vhost } = p;
    let path = format!("/api/queues/{}/{}/contents", seg(vhost), seg(name));
    let a = send(&client(conn), "DELETE", &path, None)?;
    done(conn, &a, &format!("queue {name} purged"));
    Ok(())
}

/// `close`.
pub fn close(conn: &Conn, cl: &Close) -> anyhow::Result<()> {
    let Close::Connection { name, reason } = cl;
    let mut path = format!("/api/connections/{}", seg(name));
    if let Some(r) = reason {
        path.push_str(&format!("?reason={}", seg(r)));
    }
    let a = send(&client(conn), "DELETE", &path, None)?;
    done(conn, &a, &format!("connection {name} closing"));
    Ok(())
}

/// `definitions`.
pub fn definitions(conn: &Conn, d: &Definitions) -> anyhow::Result<()> {
    let c = client(conn);
    match d {
        Definitions::Export { file } => {
            let body = send(&c, "GET", "/api/definitions", None)?.body;
            let text = serde_json::to_string_pretty(&body)? + "\n";
            match file {
                Some(f) if f.as_os_str() != "-" => {
                    std::fs::write(f, text)
                        .with_context(|| format!("cannot write {}", f.display()))?;
                    if !conn.json {
                        eprintln!("definitions written to {}", f.display());
                    }
                }
                _ => print!("{text}"),
            }
        }
        Definitions::Import { file } => {
            let text = if file.as_os_str() == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                s
            } else {
                std::fs::read_to_string(file)
                    .with_context(|| format!("cannot read {}", file.display()))?
            };
            let body: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            let a = send(&c, "POST", "/api/definitions", Some(&body))?;
            done(conn, &a, "definitions imported");
        }
    }
    Ok(())
}
