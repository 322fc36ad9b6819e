//! The live block that `provision up` draws on a terminal.
//!
//! The whole block (a header and one line per group, at most
//! [`GROUP_LINES_MAX`] of them, then one line that sums up the rest) is the
//! message of a single progress bar, rebuilt from one snapshot at a time.
//! One bar means one ticker thread and one draw whatever the size of the
//! run, and every count of a draw comes from the same snapshot: separate
//! bars per group each needed a ticker of their own (a thread per group)
//! and could show one group's old count beside another's new one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use provisioning_runtime::StatusSnapshot;

use super::header;

/// How often the live block redraws its spinner (and with it, the block).
const SPINNER_TICK: Duration = Duration::from_millis(120);

/// The most groups the block draws a line for; the others share one line.
pub(super) const GROUP_LINES_MAX: usize = 20;

/// The width of a group's bar, in characters.
const BAR_WIDTH: usize = 24;

/// The width the group names are right-aligned to.
const GROUP_NAME_WIDTH: usize = 14;

/// The live block: one spinner bar whose message is the whole block.
pub(super) struct LiveView {
    block: ProgressBar,
}

impl LiveView {
    /// Adds the block to `bars` and starts its one ticker.
    pub(super) fn new(bars: &MultiProgress) -> Self {
        let block = bars.add(ProgressBar::new_spinner());
        block.set_style(
            ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        block.enable_steady_tick(SPINNER_TICK);
        LiveView { block }
    }

    /// Shows `snapshot`, its groups in `order` (the shape file's order).
    pub(super) fn show(&self, snapshot: &StatusSnapshot, order: &[String]) {
        self.block.set_message(render(snapshot, order));
    }

    /// Stops the ticker and wipes the block.
    pub(super) fn finish(self) {
        self.block.finish_and_clear();
    }
}

/// What one group line shows.
#[derive(Default)]
struct GroupLine {
    ready: u32,
    /// Ready nodes of an older spec that still serve (a rollout).
    ready_old: u32,
    desired: u32,
    /// Counts of the stages of the group's nodes that are not ready.
    stages: BTreeMap<String, usize>,
}

/// The block's text for `snapshot`: the header, then the groups in
/// `order` (groups it does not name, such as a removed group whose nodes
/// are still going, follow in name order), at most [`GROUP_LINES_MAX`] of
/// them, then one line for the rest.
pub(super) fn render(snapshot: &StatusSnapshot, order: &[String]) -> String {
    // Desired groups, and groups whose nodes are still being removed.
    let mut lines: HashMap<&str, GroupLine> = snapshot
        .groups
        .iter()
        .map(|g| {
            let line = GroupLine {
                ready: g.ready,
                ready_old: g.ready_old,
                desired: g.desired,
                stages: BTreeMap::new(),
            };
            (g.id.as_str(), line)
        })
        .collect();
    let mut undeclared: Vec<&str> = Vec::new();
    for node in snapshot.nodes.iter() {
        let line = lines.entry(node.group.as_str()).or_insert_with(|| {
            undeclared.push(node.group.as_str());
            GroupLine::default()
        });
        if !node.ready {
            let stage = if node.deleting {
                "removing"
            } else {
                node.stage.as_str()
            };
            *line.stages.entry(stage.to_owned()).or_default() += 1;
        }
    }
    let mut ids: Vec<&str> = order
        .iter()
        .map(String::as_str)
        .filter(|id| lines.contains_key(id))
        .collect();
    let ordered: HashSet<&str> = ids.iter().copied().collect();
    let mut rest: Vec<&str> = snapshot
        .groups
        .iter()
        .map(|g| g.id.as_str())
        .chain(undeclared)
        .filter(|id| !ordered.contains(id))
        .collect();
    rest.sort_unstable();
    rest.dedup();
    ids.extend(rest);

    let mut text = header(snapshot);
    for id in ids.iter().take(GROUP_LINES_MAX) {
        if let Some(line) = lines.get(id) {
            text.push('\n');
            group_line(&mut text, id, line);
        }
    }
    let hidden = &ids[ids.len().min(GROUP_LINES_MAX)..];
    if !hidden.is_empty() {
        let (ready, desired) = hidden
            .iter()
            .filter_map(|id| lines.get(id))
            .fold((0_u64, 0_u64), |(r, d), line| {
                (r + u64::from(line.ready), d + u64::from(line.desired))
            });
        let _ = write!(
            text,
            "\n  and {} more group{}: {ready}/{desired} ready",
            thousands(hidden.len()),
            if hidden.len() == 1 { "" } else { "s" }
        );
    }
    text
}

/// Appends `  web [=====>     ] 3/5 ready  2 new`.
fn group_line(text: &mut String, id: &str, line: &GroupLine) {
    let filled = if line.desired == 0 {
        BAR_WIDTH
    } else {
        let ready = usize::try_from(line.ready.min(line.desired)).unwrap_or(BAR_WIDTH);
        let desired = usize::try_from(line.desired).unwrap_or(BAR_WIDTH).max(1);
        ready.saturating_mul(BAR_WIDTH) / desired
    };
    let mut bar = "=".repeat(filled);
    if filled < BAR_WIDTH {
        bar.push('>');
        bar.push_str(&" ".repeat(BAR_WIDTH - filled - 1));
    }
    let _ = write!(
        text,
        "  {id:>GROUP_NAME_WIDTH$} [{bar}] {}",
        ready_words(line.ready, line.ready_old, line.desired)
    );
    let mut first = true;
    for (stage, count) in &line.stages {
        text.push_str(if first { "  " } else { ", " });
        first = false;
        let _ = write!(text, "{count} {stage}");
    }
}

/// `3/5 ready`, or `1/5 ready (+3 old)` while ready nodes of an older spec
/// still serve.
pub(super) fn ready_words(ready: u32, ready_old: u32, desired: u32) -> String {
    if ready_old == 0 {
        format!("{ready}/{desired} ready")
    } else {
        format!("{ready}/{desired} ready (+{ready_old} old)")
    }
}

/// `9980` as `9,980`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

#[cfg(test)]
mod tests {
    use provisioning_runtime::{GroupStatus, HostPhase};

    use super::*;

    fn groups(n: usize) -> StatusSnapshot {
        StatusSnapshot {
            run_id: "r".to_owned(),
            generation: 1,
            observed_generation: Some(1),
            converged: true,
            phase: HostPhase::Running,
            uptime_ms: 0,
            // The snapshot lists groups in name order.
            groups: {
                let mut groups: Vec<GroupStatus> = (0..n)
                    .map(|i| GroupStatus {
                        id: format!("g{i}"),
                        provider: "process".to_owned(),
                        desired: 0,
                        ready: 0,
                        ready_old: 0,
                        paused: None,
                    })
                    .collect();
                groups.sort_by(|a, b| a.id.cmp(&b.id));
                groups
            },
            nodes: Vec::new().into(),
            durability: None,
        }
    }

    #[test]
    fn ten_thousand_groups_draw_twenty_lines_and_one_summary_in_file_order() {
        let snapshot = groups(10_000);
        let order: Vec<String> = (0..10_000).map(|i| format!("g{i}")).collect();
        let text = render(&snapshot, &order);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + GROUP_LINES_MAX + 1, "{text}");
        let names: Vec<&str> = lines[1..=GROUP_LINES_MAX]
            .iter()
            .map(|l| l.split_whitespace().next().unwrap_or(""))
            .collect();
        let expected: Vec<String> = (0..GROUP_LINES_MAX).map(|i| format!("g{i}")).collect();
        assert_eq!(names, expected);
        assert_eq!(lines[21], "  and 9,980 more groups: 0/0 ready");
    }

    #[test]
    fn a_rollout_shows_the_old_spec_nodes_that_still_serve() {
        let mut snapshot = groups(1);
        snapshot.groups[0].desired = 5;
        snapshot.groups[0].ready = 1;
        snapshot.groups[0].ready_old = 3;
        let text = render(&snapshot, &["g0".to_owned()]);
        assert!(text.contains("1/5 ready (+3 old)"), "{text}");
        snapshot.groups[0].ready_old = 0;
        let text = render(&snapshot, &["g0".to_owned()]);
        assert!(
            text.contains("1/5 ready") && !text.contains("old"),
            "{text}"
        );
    }

    #[test]
    fn thousands_are_separated_by_commas() {
        assert_eq!(thousands(7), "7");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }
}
