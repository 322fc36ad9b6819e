//! What `provision up` shows while it runs.
//!
//! On a terminal: a live block (`live`) of a header line and one line per
//! group (ready nodes out of desired, with the stages of the others), with
//! log lines routed past it (`log_route`). Otherwise: plain lines, one per
//! change of a node's attempt or stage, and one per change of convergence,
//! so logs and tests can follow along.

mod live;
mod log_route;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressDrawTarget};
use provisioning_runtime::{HostPhase, NodeStatus, StatusSnapshot};
use tokio::sync::watch;

use self::live::LiveView;
pub(crate) use self::log_route::LogOutput;

/// The least time between two rebuilds of the live block: snapshots of a
/// large run can come faster than anyone reads, and each rebuild walks
/// every group and node.
const LIVE_REBUILD_INTERVAL_MIN: Duration = Duration::from_millis(100);

/// Turns off the echo of typed keys (control keys included) on the
/// terminal that standard input is, and puts the settings back when
/// dropped — also when `up` unwinds from a panic.
#[derive(Debug)]
struct QuietTerminal {
    /// In a mutex only to be shared: the settings hold a cell.
    saved: Mutex<nix::sys::termios::Termios>,
}

impl QuietTerminal {
    /// `None` when standard input is no terminal or its settings cannot be
    /// changed: the block is drawn anyway.
    fn new() -> Option<Self> {
        use nix::sys::termios::{LocalFlags, SetArg, tcgetattr, tcsetattr};
        use std::io::IsTerminal;
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return None;
        }
        let saved = tcgetattr(&stdin).ok()?;
        let mut quiet = saved.clone();
        quiet
            .local_flags
            .remove(LocalFlags::ECHO | LocalFlags::ECHOCTL);
        tcsetattr(&stdin, SetArg::TCSANOW, &quiet).ok()?;
        Some(QuietTerminal {
            saved: Mutex::new(saved),
        })
    }
}

impl Drop for QuietTerminal {
    fn drop(&mut self) {
        use nix::sys::termios::{SetArg, tcsetattr};
        let saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &saved);
    }
}

/// Where `up` prints: a live block or plain lines.
#[derive(Debug)]
pub(crate) struct Console {
    live: Option<MultiProgress>,
    /// While the live block is drawn, the terminal echoes no typed keys:
    /// the block's lines fill the terminal's width, so an echoed `^C` after
    /// the last one wraps the cursor onto a new line, and the block's next
    /// clear would leave a stale copy of its header behind.
    _quiet: Option<QuietTerminal>,
    /// The group ids in the shape file's order: the live block lists groups
    /// as the file does (a snapshot has them in name order).
    group_order: Mutex<Arc<[String]>>,
}

impl Console {
    /// A console with a live block when `live`, plain lines otherwise. The
    /// block goes to standard output, the terminal that `live` was decided
    /// on.
    pub(crate) fn new(live: bool) -> Self {
        Console {
            live: live.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stdout())),
            _quiet: live.then(QuietTerminal::new).flatten(),
            group_order: Mutex::new(Arc::from([])),
        }
    }

    /// The groups of the shape in force, in the shape file's order.
    pub(crate) fn set_group_order(&self, ids: impl IntoIterator<Item = String>) {
        *self
            .group_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = ids.into_iter().collect();
    }

    /// Prints one line above the live block (or plainly). Write errors are
    /// ignored: a closed stdout must not stop the cluster.
    pub(crate) fn line(&self, text: impl AsRef<str>) {
        match &self.live {
            Some(bars) => {
                let _ = bars.println(text.as_ref());
            }
            None => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", text.as_ref());
                let _ = out.flush();
            }
        }
    }

    /// Follows snapshots until the host stops, from the first one of
    /// generation `first` on: a snapshot published before the file was
    /// applied (generation 0 of a fresh run, or the resumed generation)
    /// would show a shape that is not in force any more.
    pub(crate) async fn follow(&self, mut progress: watch::Receiver<StatusSnapshot>, first: u64) {
        let mut view = match &self.live {
            Some(bars) => {
                log_route::route_past(bars);
                View::Live(LiveView::new(bars))
            }
            None => View::Plain(PlainView::default()),
        };
        let mut paused: BTreeMap<String, String> = BTreeMap::new();
        let mut attempts: BTreeMap<String, (u64, bool)> = BTreeMap::new();
        loop {
            let snapshot = progress.borrow_and_update().clone();
            if snapshot.generation < first && snapshot.phase == HostPhase::Running {
                if progress.changed().await.is_err() {
                    break;
                }
                continue;
            }
            self.breaker_events(&mut paused, &snapshot);
            match &mut view {
                View::Live(live) => {
                    // Plain mode prints every change anyway; above the
                    // block, only what an operator must not miss.
                    for event in node_events(&mut attempts, &snapshot) {
                        self.line(event);
                    }
                    let order = self
                        .group_order
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    live.show(&snapshot, &order);
                }
                View::Plain(plain) => plain.show(self, &snapshot),
            }
            if snapshot.phase == HostPhase::Stopped {
                break;
            }
            if matches!(view, View::Live(_)) {
                tokio::time::sleep(LIVE_REBUILD_INTERVAL_MIN).await;
            }
            if progress.changed().await.is_err() {
                break;
            }
        }
        if let View::Live(live) = view {
            live.finish();
            log_route::route_straight();
        }
    }
}

impl Console {
    /// One line when a group's breaker opens or closes.
    fn breaker_events(&self, paused: &mut BTreeMap<String, String>, snapshot: &StatusSnapshot) {
        for group in &snapshot.groups {
            match (&group.paused, paused.get(&group.id)) {
                (Some(reason), None) => {
                    self.line(format!(
                        "{reason} (it retries after a cool-down; `provision resume {}` retries now)",
                        group.id
                    ));
                    paused.insert(group.id.clone(), reason.clone());
                }
                (None, Some(_)) => {
                    self.line(format!("group {} resumed", group.id));
                    paused.remove(&group.id);
                }
                _ => {}
            }
        }
    }
}

/// One line for each node that failed (or was lost) or was replaced since
/// the last snapshot; `seen` holds each node's attempt and whether it had
/// failed.
fn node_events(seen: &mut BTreeMap<String, (u64, bool)>, snapshot: &StatusSnapshot) -> Vec<String> {
    let mut events = Vec::new();
    for node in &snapshot.nodes {
        let failed = node.stage == "failed";
        let before = seen.insert(node.id.clone(), (node.attempt, failed));
        match before {
            Some((attempt, _)) if attempt != node.attempt => {
                events.push(format!(
                    "node {} replaced: attempt {attempt} → {}",
                    node.id, node.attempt
                ));
            }
            Some((_, false)) | None if failed => {
                events.push(format!(
                    "node {} attempt {} failed: {}",
                    node.id,
                    node.attempt,
                    node.last_error.as_deref().unwrap_or("no reason recorded")
                ));
            }
            _ => {}
        }
    }
    seen.retain(|id, _| snapshot.nodes.iter().any(|n| &n.id == id));
    events
}

enum View {
    Live(LiveView),
    Plain(PlainView),
}

fn header(snapshot: &StatusSnapshot) -> String {
    let run = &snapshot.run_id;
    let generation = snapshot.generation;
    match snapshot.phase {
        HostPhase::Running => format!(
            "run {run} · generation {generation} · {} · {}/{} ready",
            if snapshot.converged {
                "converged"
            } else {
                "converging"
            },
            snapshot.ready_count(),
            snapshot.desired_count()
        ),
        HostPhase::ShuttingDown => format!(
            "run {run} · tearing down · {} node(s) left",
            snapshot.nodes.len()
        ),
        HostPhase::Stopped => format!(
            "run {run} · stopped · {} node(s) left",
            snapshot.nodes.len()
        ),
    }
}

#[derive(Default)]
struct PlainView {
    seen: Option<StatusSnapshot>,
}

impl PlainView {
    fn show(&mut self, console: &Console, snapshot: &StatusSnapshot) {
        let before: BTreeMap<&str, &NodeStatus> = self
            .seen
            .iter()
            .flat_map(|s| s.nodes.iter())
            .map(|n| (n.id.as_str(), n))
            .collect();
        let previous = self.seen.as_ref();
        if previous.is_none_or(|p| p.generation != snapshot.generation) {
            console.line(format!("generation {} in force", snapshot.generation));
        }
        if previous.is_none_or(|p| p.phase != snapshot.phase)
            && snapshot.phase == HostPhase::ShuttingDown
        {
            console.line("tearing the cluster down");
        }
        for node in &snapshot.nodes {
            let old = before.get(node.id.as_str());
            let moved = old.is_none_or(|o| {
                o.attempt != node.attempt
                    || o.stage != node.stage
                    || o.ready != node.ready
                    || o.deleting != node.deleting
            });
            if moved {
                let mut text = format!("node {} attempt {}: {}", node.id, node.attempt, node.stage);
                if node.ready {
                    text.push_str(" (ready)");
                }
                if node.deleting {
                    text.push_str(" (removing)");
                }
                console.line(text);
            }
            if let Some(error) = &node.last_error {
                if old.is_none_or(|o| o.last_error.as_ref() != Some(error)) {
                    console.line(format!(
                        "node {} attempt {}: error: {error}",
                        node.id, node.attempt
                    ));
                }
            }
        }
        for id in before.keys() {
            if !snapshot.nodes.iter().any(|n| n.id == *id) {
                console.line(format!("node {id}: removed"));
            }
        }
        let was_converged =
            previous.is_some_and(|p| p.converged && p.generation == snapshot.generation);
        if snapshot.converged && !was_converged && snapshot.phase == HostPhase::Running {
            console.line(format!(
                "converged: generation {}, {}/{} nodes ready",
                snapshot.generation,
                snapshot.ready_count(),
                snapshot.desired_count()
            ));
        }
        self.seen = Some(snapshot.clone());
    }
}

/// Prints a status snapshot as a table.
pub(crate) fn status_table(snapshot: &StatusSnapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "run {}  generation {}  observed {}  converged {}  phase {}",
        snapshot.run_id,
        snapshot.generation,
        snapshot
            .observed_generation
            .map_or_else(|| "-".to_owned(), |g| g.to_string()),
        if snapshot.converged { "yes" } else { "no" },
        snapshot.phase.name(),
    );
    for group in &snapshot.groups {
        let _ = writeln!(
            out,
            "group {:<16} {}  (provider {})",
            group.id,
            live::ready_words(group.ready, group.ready_old, group.desired),
            group.provider
        );
        if let Some(reason) = &group.paused {
            let _ = writeln!(out, "  {reason}");
        }
    }
    let _ = writeln!(
        out,
        "{:<20} {:>8}  {:<18} {:<5}  {:<20} LAST ERROR",
        "NODE", "ATTEMPT", "STAGE", "READY", "PENDING"
    );
    for node in &snapshot.nodes {
        let stage = if node.deleting {
            format!("{} (rm)", node.stage)
        } else {
            node.stage.clone()
        };
        let _ = writeln!(
            out,
            "{:<20} {:>8}  {:<18} {:<5}  {:<20} {}",
            node.id,
            node.attempt,
            stage,
            if node.ready { "yes" } else { "no" },
            node.pending.as_deref().unwrap_or("-"),
            node.last_error.as_deref().unwrap_or(""),
        );
    }
    out
}

/// The table `provision peers` prints: one line per ready node, then each
/// group's ready count against its desired size.
pub(crate) fn peers_table(peers: &provisioning_agent::wire::PeersUpdate) -> String {
    let mut out = format!(
        "{:<24} {:>6} {:<30} {:>8} {:<40} {:>14}\n",
        "GROUP", "INDEX", "NODE", "ATTEMPT", "ADDRESS", "READY SINCE MS"
    );
    for peer in &peers.peers {
        out.push_str(&format!(
            "{:<24} {:>6} {:<30} {:>8} {:<40} {:>14}\n",
            peer.group, peer.index, peer.node, peer.attempt, peer.address, peer.ready_since_ms
        ));
    }
    for (group, size) in &peers.groups {
        let ready = peers.peers.iter().filter(|p| &p.group == group).count();
        out.push_str(&format!("{group}: {ready} of {size} ready\n"));
    }
    out
}

/// The ids of a snapshot's nodes, for an error that names a missing one
/// (the first few, when there are many).
pub(crate) fn node_list(snapshot: &StatusSnapshot) -> String {
    const SHOWN: usize = 8;
    if snapshot.nodes.is_empty() {
        return "none".to_owned();
    }
    let ids: Vec<&str> = snapshot
        .nodes
        .iter()
        .take(SHOWN)
        .map(|n| n.id.as_str())
        .collect();
    let more = snapshot.nodes.len().saturating_sub(SHOWN);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!("{}{more}", ids.join(", "))
}

/// One node, its facts and its last transitions (`provision status NODE`).
pub(crate) fn node_details(node: &NodeStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {}  group {}  attempt {}  stage {}{}  ready {}",
        node.id,
        node.group,
        node.attempt,
        node.stage,
        if node.deleting {
            " (being removed)"
        } else {
            ""
        },
        if node.ready { "yes" } else { "no" },
    );
    if let Some(endpoint) = &node.endpoint {
        let _ = writeln!(out, "endpoint {endpoint}");
    }
    if let Some(pending) = &node.pending {
        let _ = writeln!(out, "pending {pending}");
    }
    if node.consecutive_failures > 0 {
        let _ = writeln!(out, "failures in a row {}", node.consecutive_failures);
    }
    if let Some(error) = &node.last_error {
        let _ = writeln!(out, "last error {error}");
    }
    if node.history.is_empty() {
        let _ = writeln!(out, "no history kept");
        return out;
    }
    let _ = writeln!(
        out,
        "{:>10}  {:>8}  {:<22} {:<5}  REASON",
        "AT", "ATTEMPT", "STAGE", "READY"
    );
    for entry in &node.history {
        let stage = if entry.deleting {
            format!("{} (rm)", entry.stage)
        } else {
            entry.stage.clone()
        };
        let _ = writeln!(
            out,
            "{:>9.3}s  {:>8}  {:<22} {:<5}  {}",
            entry.at_ms as f64 / 1000.0,
            entry.attempt,
            stage,
            if entry.ready { "yes" } else { "no" },
            entry.reason.as_deref().unwrap_or(""),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use provisioning_runtime::GroupStatus;

    use super::*;

    fn node(id: &str, group: &str, ready: bool, desired: bool) -> NodeStatus {
        NodeStatus {
            id: id.to_owned(),
            group: group.to_owned(),
            attempt: 1,
            stage: if ready { "dormant" } else { "new" }.to_owned(),
            ready,
            deleting: !desired,
            desired,
            pending: None,
            endpoint: None,
            consecutive_failures: 0,
            last_error: None,
            history: Vec::new(),
        }
    }

    #[test]
    fn failures_and_replacements_each_make_one_event_line() {
        let mut snapshot = StatusSnapshot {
            run_id: "r".to_owned(),
            generation: 1,
            observed_generation: Some(1),
            converged: true,
            phase: HostPhase::Running,
            uptime_ms: 0,
            groups: Vec::new(),
            nodes: vec![node("web-0", "web", true, true)].into(),
            durability: None,
        };
        let mut seen = BTreeMap::new();
        assert!(node_events(&mut seen, &snapshot).is_empty());
        snapshot.nodes[0].stage = "failed".to_owned();
        snapshot.nodes[0].last_error = Some("the node's agent is gone".to_owned());
        assert_eq!(
            node_events(&mut seen, &snapshot),
            ["node web-0 attempt 1 failed: the node's agent is gone"]
        );
        assert!(node_events(&mut seen, &snapshot).is_empty(), "once");
        snapshot.nodes[0].attempt = 2;
        snapshot.nodes[0].stage = "new".to_owned();
        assert_eq!(
            node_events(&mut seen, &snapshot),
            ["node web-0 replaced: attempt 1 → 2"]
        );
    }

    #[test]
    fn the_header_counts_what_the_group_lines_count() {
        // web: 3 desired, all ready, plus a ready node of a removed slot
        // still on its way out; db: 2 desired, 1 ready.
        let snapshot = StatusSnapshot {
            run_id: "r".to_owned(),
            generation: 2,
            observed_generation: Some(2),
            converged: false,
            phase: HostPhase::Running,
            uptime_ms: 0,
            groups: vec![
                GroupStatus {
                    id: "web".to_owned(),
                    provider: "process".to_owned(),
                    desired: 3,
                    ready: 3,
                    ready_old: 0,
                    paused: None,
                },
                GroupStatus {
                    id: "db".to_owned(),
                    provider: "process".to_owned(),
                    desired: 2,
                    ready: 1,
                    ready_old: 0,
                    paused: None,
                },
            ],
            nodes: vec![
                node("web-0", "web", true, true),
                node("web-1", "web", true, true),
                node("web-2", "web", true, true),
                node("web-3", "web", true, false),
                node("db-0", "db", true, true),
                node("db-1", "db", false, true),
            ]
            .into(),
            durability: None,
        };
        let head = header(&snapshot);
        assert!(head.ends_with("· 4/5 ready"), "{head}");
    }
}
