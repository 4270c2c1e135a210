//! Test hosts in network namespaces: a hub namespace with a bridge, one namespace per member
//! joined to it by a veth pair, and nftables rules on the bridge that cut a member off. Used by
//! the tests that need real network partitions between broker processes (`partition.rs`,
//! `cluster_restart/cut_off.rs`). Needs root, `ip` and `nft` (see [`crate::prereq::root_with`]);
//! everything lives in namespaces the test creates and [`Net`]'s drop deletes.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// Runs a command that must succeed (setup steps), panicking with its stderr otherwise.
fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A hub namespace with a bridge and one namespace per member on `10.<subnet>.0.0/24`;
/// deleted on drop. Each test picks its own subnet and name so that tests running at once
/// never share a namespace, an address or a rule table.
pub struct Net {
    hub: String,
    /// The member namespaces, by index (for `ip netns exec`).
    pub members: Vec<String>,
    subnet: u8,
    table: String,
}

impl Net {
    /// Creates `n` member namespaces named `<name><pid>-m<i>` on `10.<subnet>.0.0/24`.
    pub fn create(name: &str, subnet: u8, n: usize) -> Self {
        let prefix = format!("{name}{}", std::process::id());
        let net = Net {
            hub: format!("{prefix}-hub"),
            members: (0..n).map(|i| format!("{prefix}-m{i}")).collect(),
            subnet,
            table: format!("ringmq_{name}"),
        };
        run(&["ip", "netns", "add", &net.hub]);
        for ns in &net.members {
            run(&["ip", "netns", "add", ns]);
        }
        let hub = net.hub.as_str();
        let bridge_addr = format!("10.{subnet}.0.254/24");
        run(&["ip", "-n", hub, "link", "set", "lo", "up"]);
        run(&["ip", "-n", hub, "link", "add", "br0", "type", "bridge"]);
        run(&["ip", "-n", hub, "addr", "add", &bridge_addr, "dev", "br0"]);
        run(&["ip", "-n", hub, "link", "set", "br0", "up"]);
        for (i, ns) in net.members.iter().enumerate() {
            let port = format!("v{i}");
            let member_addr = format!("{}/24", net.addr(i));
            run(&[
                "ip", "-n", hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ]);
            run(&["ip", "-n", hub, "link", "set", &port, "master", "br0", "up"]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
            run(&["ip", "-n", ns, "addr", "add", &member_addr, "dev", "eth0"]);
            run(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        }
        net
    }

    /// Member `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        member_addr(self.subnet, i)
    }

    /// Drops every frame between member `i` and the others on the bridge.
    pub fn isolate(&self, i: usize) {
        let others: Vec<String> = (0..self.members.len())
            .filter(|j| *j != i)
            .map(|j| format!("\"v{j}\""))
            .collect();
        let others = others.join(", ");
        let rules = format!(
            "table bridge {} {{\n chain forward {{\n  type filter hook forward priority 0; \
             policy accept;\n  iifname \"v{i}\" oifname {{ {others} }} drop\n  iifname {{ \
             {others} }} oifname \"v{i}\" drop\n }}\n}}\n",
            self.table
        );
        self.apply_rules(&rules);
    }

    /// Drops every frame between members `a` and `b` only: each still reaches the others (a
    /// bridge — a member that sees both sides of a partition).
    pub fn cut(&self, a: usize, b: usize) {
        let rules = format!(
            "table bridge {} {{\n chain forward {{\n  type filter hook forward priority 0; \
             policy accept;\n  iifname \"v{a}\" oifname \"v{b}\" drop\n  iifname \"v{b}\" \
             oifname \"v{a}\" drop\n }}\n}}\n",
            self.table
        );
        self.apply_rules(&rules);
    }

    /// Splits the members in two: every frame between a member of `side` and a member not
    /// in it is dropped (a partition such as 2 | 3 of five).
    pub fn split(&self, side: &[usize]) {
        let name = |j: usize| format!("\"v{j}\"");
        let inside: Vec<String> = side.iter().map(|&j| name(j)).collect();
        let outside: Vec<String> = (0..self.members.len())
            .filter(|j| !side.contains(j))
            .map(name)
            .collect();
        let (inside, outside) = (inside.join(", "), outside.join(", "));
        let rules = format!(
            "table bridge {} {{\n chain forward {{\n  type filter hook forward priority 0; \
             policy accept;\n  iifname {{ {inside} }} oifname {{ {outside} }} drop\n  iifname {{ \
             {outside} }} oifname {{ {inside} }} drop\n }}\n}}\n",
            self.table
        );
        self.apply_rules(&rules);
    }

    fn apply_rules(&self, rules: &str) {
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &self.hub, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("ip netns exec nft starts");
        nft.stdin
            .take()
            .expect("piped")
            .write_all(rules.as_bytes())
            .expect("nft reads its rules");
        assert!(
            nft.wait().expect("nft runs").success(),
            "nft rules: {rules}"
        );
    }

    /// Removes the cut.
    pub fn heal(&self) {
        run(&[
            "ip",
            "netns",
            "exec",
            &self.hub,
            "nft",
            "delete",
            "table",
            "bridge",
            &self.table,
        ]);
    }

    /// Moves the calling thread into the hub namespace, so its sockets reach every member.
    pub fn enter_hub(&self) {
        let file = std::fs::File::open(format!("/var/run/netns/{}", self.hub))
            .expect("the hub namespace exists");
        // SAFETY: setns on a namespace file descriptor we opened; affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns into the hub namespace");
    }
}

/// The address of member `i` of the [`Net`] on `10.<subnet>.0.0/24`, for code that has the
/// subnet but not the `Net`.
pub fn member_addr(subnet: u8, i: usize) -> String {
    format!("10.{subnet}.0.{}", i + 1)
}

impl Net {
    /// Deletes the namespaces (a process still in one keeps it alive until it ends); also
    /// done on drop, harmlessly again.
    pub fn remove(&self) {
        for ns in self.members.iter().chain(std::iter::once(&self.hub)) {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}
