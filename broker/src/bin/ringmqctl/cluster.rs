//! `ringmqctl cluster …`: the cluster as one ring — its members in ring order and what each
//! holds — answered by any member from the cluster map (`GET /api/members`), and the ring
//! operations that change it (a queue's primary moved, a member drained, the primaries
//! rebalanced).

use crate::admin::{Conn, cells, client, send, table};
use anyhow::bail;
use clap::Subcommand;
use ringmq::admin_client::seg;
use serde_json::json;
use std::time::{Duration, Instant};

/// What `ringmqctl cluster` shows or does.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// The ring: members in ring order with their zone, state, and the primaries and backups
    /// each holds (the same answer from any member).
    Ring,
    /// Shows the ring's layout, or changes it with --order, --zone-aware or --placement and
    /// --backups or --backups-from-members (what is not given stays as it is). The ring is
    /// ordered at once; no copy moves until `cluster rebalance --apply` puts the backups on
    /// their primaries' new successors.
    Layout {
        /// The members' node ids in ring order, comma-separated; members not listed follow,
        /// and a listed member that joins later goes to its place.
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["zone_aware", "placement"])]
        order: Option<Vec<String>>,
        /// The zones take turns around the ring, so a queue's backups sit in other zones.
        #[arg(long, conflicts_with = "placement")]
        zone_aware: bool,
        /// The brokers place each new member (its ring_order, else the planner's gap).
        #[arg(long)]
        placement: bool,
        /// The backups (0 to 3) of every queue declared without qpid.cluster.backups.
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3), conflicts_with = "backups_from_members")]
        backups: Option<u8>,
        /// Queues declared from now on without qpid.cluster.backups take their member's
        /// default_backups again (the queues there are keep their k).
        #[arg(long)]
        backups_from_members: bool,
    },
    /// Moves a queue's primary to another member: it catches up as a backup, then takes
    /// over (consumers elsewhere get a cancel notification and redeliveries; publishes
    /// during the switch, a few milliseconds, are nacked and sent again).
    MoveQueue {
        /// The queue's vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// Node id of the member that becomes its primary.
        #[arg(long)]
        to: String,
        /// Waits until the member is the primary; exits non-zero if the move was called
        /// off or did not finish within --timeout.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits at most.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Drains a member (its node id): it takes no new roles, its primaries move to other
    /// members and its backups are replaced (catch-up, then switch), its clients are
    /// closed with 320 and go to the others. It stays a member, marked draining, until
    /// it leaves or is undrained.
    Drain {
        /// Node id of the member.
        node: String,
        /// Waits until the member holds no primary and no backup; exits non-zero if that
        /// takes longer than --timeout.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits at most.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Undrains a member: it takes roles again (what moved off stays where it is).
    Undrain {
        /// Node id of the member.
        node: String,
    },
    /// Prints the moves of queue primaries that would even them out over the active
    /// members (each within one of an even share); --apply starts them, a few at a time,
    /// each a catch-up then a switch, and then moves the backups onto each primary's ring
    /// successors (which evens them too), each a catch-up of the new backup first.
    Rebalance {
        /// Starts the plan (every member plans the same from the cluster map and carries
        /// it out; the plan survives the crash of any member).
        #[arg(long, conflicts_with = "stop")]
        apply: bool,
        /// Moves under way at once (1 to 64).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
        concurrency: u32,
        /// Waits until the rebalance under way is over; exits non-zero if a move failed
        /// or it did not end within --timeout.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits at most.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
        /// Stops the rebalance under way: moves not started yet are skipped.
        #[arg(long)]
        stop: bool,
    },
}

/// Runs `ringmqctl cluster <command>`.
pub fn run(conn: &Conn, command: &ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Ring => ring(conn),
        ClusterCommand::MoveQueue {
            vhost,
            queue,
            to,
            wait,
            timeout,
        } => move_queue(
            conn,
            vhost,
            queue,
            to,
            wait.then(|| Duration::from_secs(*timeout)),
        ),
        ClusterCommand::Drain {
            node,
            wait,
            timeout,
        } => drain(conn, node, wait.then(|| Duration::from_secs(*timeout))),
        ClusterCommand::Rebalance {
            apply,
            concurrency,
            wait,
            timeout,
            stop,
        } => rebalance(
            conn,
            RebalanceAsk {
                apply: *apply,
                concurrency: *concurrency,
                stop: *stop,
            },
            wait.then(|| Duration::from_secs(*timeout)),
        ),
        ClusterCommand::Layout {
            order,
            zone_aware,
            placement,
            backups,
            backups_from_members,
        } => {
            let order = match (order, zone_aware, placement) {
                (Some(list), _, _) => Some(json!(list)),
                (None, true, _) => Some(json!("zone-aware")),
                (None, false, true) => Some(json!("placement")),
                (None, false, false) => None,
            };
            let backups = match (backups, backups_from_members) {
                (Some(k), _) => Some(json!(k)),
                (None, true) => Some(serde_json::Value::Null),
                (None, false) => None,
            };
            layout(conn, order, backups)
        }
        ClusterCommand::Undrain { node } => {
            let path = format!("/api/members/{}/undrain", seg(node));
            send(&client(conn), "POST", &path, None)?;
            println!("member {node}: undrained");
            Ok(())
        }
    }
}

/// `cluster layout`: shows the layout, or changes the parts given (`None`: as it is).
fn layout(
    conn: &Conn,
    order: Option<serde_json::Value>,
    backups: Option<serde_json::Value>,
) -> anyhow::Result<()> {
    const PATH: &str = "/api/cluster/ring";
    let c = client(conn);
    let mut now = send(&c, "GET", PATH, None)?.body;
    if order.is_some() || backups.is_some() {
        let body = json!({
            "order": order.unwrap_or_else(|| now["order"].clone()),
            "backups": backups.unwrap_or_else(|| now["backups"].clone()),
        });
        now = send(&c, "PUT", PATH, Some(&body))?.body;
    }
    if conn.json {
        println!("{now}");
        return Ok(());
    }
    let order = match &now["order"] {
        serde_json::Value::String(s) => s.clone(),
        list => format!("explicit {list}"),
    };
    println!("order: {order}");
    match now["backups"].as_u64() {
        Some(k) => println!("backups: {k} (queues without qpid.cluster.backups)"),
        None => println!("backups: each member's default_backups"),
    }
    println!("ring now: {}", now["ring"]);
    Ok(())
}

/// What `cluster rebalance` was asked to do besides showing the plan.
struct RebalanceAsk {
    apply: bool,
    concurrency: u32,
    stop: bool,
}

/// `cluster rebalance`: shows the plan, or starts or stops it, then with `wait` follows the
/// one under way until it is over.
fn rebalance(conn: &Conn, ask: RebalanceAsk, wait: Option<Duration>) -> anyhow::Result<()> {
    const PATH: &str = "/api/cluster/rebalance";
    let c = client(conn);
    if ask.stop {
        let now = send(&c, "POST", &format!("{PATH}/stop"), None)?.body;
        println!("rebalance: {}", summary(&now));
    } else if ask.apply {
        let body = json!({"concurrency": ask.concurrency});
        let now = send(&c, "POST", PATH, Some(&body))?.body;
        if conn.json {
            println!("{now}");
        } else {
            print_moves(&now["moves"]);
            println!("rebalance started: {}", summary(&now));
        }
    } else if conn.json {
        println!("{}", send(&c, "GET", PATH, None)?.body);
    } else {
        let view = send(&c, "GET", PATH, None)?.body;
        print_moves(&view["plan"]);
        let backups = view["backup_plan"].as_array().map_or(0, Vec::len);
        println!(
            "then the backups follow the ring ({backups} backup moves if the primaries stayed)"
        );
        println!("primaries per member now: {}", view["primaries"]);
        println!("backups per member now: {}", view["backups"]);
        match view["balanced"].as_bool() {
            Some(true) => println!("balanced: nothing to move"),
            _ => println!("not applied: run again with --apply to start it"),
        }
    }
    let Some(patience) = wait else {
        return Ok(());
    };
    let deadline = Instant::now() + patience;
    loop {
        let current = send(&c, "GET", PATH, None)?.body["current"].clone();
        match current["status"].as_str() {
            None => bail!("no rebalance was ever started on this cluster"),
            Some("running") if Instant::now() >= deadline => bail!(
                "rebalance still running after {} s: {}",
                patience.as_secs(),
                summary(&current)
            ),
            Some("running") => std::thread::sleep(Duration::from_millis(200)),
            Some("done") => {
                println!("rebalance done: {}", summary(&current));
                return Ok(());
            }
            Some(status) => {
                let failed: Vec<String> = (current["moves"].as_array().into_iter().flatten())
                    .filter(|m| m["state"] == "failed")
                    .map(|m| format!("{} ({})", m["queue"], m["reason"]))
                    .collect();
                bail!(
                    "rebalance {status}: {}{}",
                    summary(&current),
                    if failed.is_empty() {
                        String::new()
                    } else {
                        format!("; failed: {}", failed.join(", "))
                    }
                )
            }
        }
    }
}

/// One line for a rebalance: how many of its moves are where.
fn summary(r: &serde_json::Value) -> String {
    format!(
        "{} moves: {} done, {} running, {} pending, {} failed, {} skipped",
        r["total"], r["done"], r["running"], r["pending"], r["failed"], r["skipped"]
    )
}

fn print_moves(moves: &serde_json::Value) {
    let cols = ["vhost", "queue", "kind", "from", "to", "state"];
    let rows: Vec<Vec<String>> = (moves.as_array().into_iter().flatten())
        .map(|m| cells(m, &cols))
        .collect();
    table(&["vhost", "queue", "kind", "from", "to", "state"], &rows);
}

/// `cluster drain`: marks the member draining, then with `wait` follows what it holds until
/// it holds nothing.
fn drain(conn: &Conn, node: &str, wait: Option<Duration>) -> anyhow::Result<()> {
    let c = client(conn);
    let path = format!("/api/members/{}", seg(node));
    send(&c, "POST", &format!("{path}/drain"), None)?;
    let Some(patience) = wait else {
        println!("member {node}: draining");
        return Ok(());
    };
    let deadline = Instant::now() + patience;
    loop {
        let m = send(&c, "GET", &path, None)?.body;
        let (primaries, backups) = (m["primaries"].as_u64(), m["backups"].as_u64());
        if primaries == Some(0) && backups == Some(0) {
            println!("member {node}: drained (it holds no queue: it can be removed without loss)");
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "member {node}: still holds {} primaries and {} backups after {} s: see the members' logs",
                m["primaries"],
                m["backups"],
                patience.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `cluster move-queue`: asks for the move, then with `wait` follows the queue until `to`
/// is its primary.
fn move_queue(
    conn: &Conn,
    vhost: &str,
    queue: &str,
    to: &str,
    wait: Option<Duration>,
) -> anyhow::Result<()> {
    let c = client(conn);
    let path = format!("/api/queues/{}/{}", seg(vhost), seg(queue));
    send(
        &c,
        "POST",
        &format!("{path}/move"),
        Some(&json!({"to": to})),
    )?;
    let Some(patience) = wait else {
        println!("queue {queue}: moving to {to}");
        return Ok(());
    };
    let deadline = Instant::now() + patience;
    loop {
        let q = send(&c, "GET", &path, None)?.body;
        if q["node"] == to {
            println!("queue {queue}: its primary is {to}");
            return Ok(());
        }
        if q["moving_to"] != to {
            bail!(
                "queue {queue}: the move to {to} was called off (primary {}, moving to {}): see the members' logs",
                q["node"],
                q["moving_to"]
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "queue {queue}: still moving to {to} after {} s (in-sync backups: {})",
                patience.as_secs(),
                q["in_sync_backup_nodes"]
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ring(conn: &Conn) -> anyhow::Result<()> {
    let members = send(&client(conn), "GET", "/api/members", None)?.body;
    if conn.json {
        println!("{members}");
        return Ok(());
    }
    let cols = [
        "ring_position",
        "id",
        "zone",
        "state",
        "primaries",
        "backups",
        "in_sync_backups",
        "amqp",
    ];
    let rows: Vec<Vec<String>> = members
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| cells(m, &cols))
        .collect();
    table(
        &[
            "position",
            "member",
            "zone",
            "state",
            "primaries",
            "backups",
            "in-sync",
            "amqp",
        ],
        &rows,
    );
    Ok(())
}
